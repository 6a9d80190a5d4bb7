"""The engine's CLI flags, generated from the config dataclasses' `setting(...)` fields.

Every engine setting is declared once, in ruvllm/config.py, with its default, help and choices;
serve, chat and benchmark take the flags `engine_flags` generates from those fields, and
`LLM(**kwargs)` takes the same fields as keywords (engine/llm.py::build_engine_config). A command
decorated with `with_engine_flags` receives the parsed values as one `EngineFlags`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import typer

from ruvllm.config import CacheConfig, EngineConfig, LoraConfig, QuantConfig, SchedulerConfig, SpeculativeConfig

_SECTIONS = (EngineConfig, CacheConfig, SchedulerConfig, QuantConfig, LoraConfig, SpeculativeConfig)


@dataclass(frozen=True)
class EngineSetting:
    config: type
    name: str  # the dataclass field (and the LLM keyword, but for QuantConfig.method: `quantization`)
    param: str  # the Python parameter name of the CLI option
    default: Any
    meta: dict[str, Any]

    @property
    def keyword(self) -> str:
        return "quantization" if (self.config, self.name) == (QuantConfig, "method") else self.name

    def option(self, default: Any = dataclasses.MISSING) -> inspect.Parameter:
        m = self.meta
        flag = m["flag"] or "--" + self.name.replace("_", "-")
        names = [flag, *m["aliases"]]
        help_text = m["help"]
        value = self.default if default is dataclasses.MISSING else default
        if m["cli_type"] is not None and value is not None:
            raise TypeError(f"{self.name}: a setting given in other units needs a None default")
        ftype = m["cli_type"] or _field_type(self.config, self.name)
        opt = typer.Option(value, *names, help=help_text, min=m["min"], max=m["max"], show_default=value is not None)
        annotation = Optional[ftype] if value is None else ftype
        return inspect.Parameter(self.param, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=annotation)


def _field_type(cls: type, name: str) -> type:
    """The field's type without its `| None` (the CLI option's None default says that)."""
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def engine_settings() -> list[EngineSetting]:
    out = []
    for cls in _SECTIONS:
        for f in dataclasses.fields(cls):
            if "setting" in f.metadata:
                param = f"engine_{f.name}"
                out.append(EngineSetting(cls, f.name, param, f.default, f.metadata["setting"]))
    return out


@dataclass(frozen=True)
class EngineFlags:
    """The engine flags as one command parsed them."""

    values: dict[str, Any]  # LLM keyword -> value (only flags given a value)

    def get(self, keyword: str) -> Any:
        return self.values.get(keyword)

    def to_config(self, model: str | None, **overrides: Any) -> EngineConfig:
        from ruvllm.engine.llm import build_engine_config

        return build_engine_config(model, **{**self.values, **overrides})


def with_engine_flags(exclude: tuple[str, ...] = (), defaults: dict[str, Any] | None = None) -> Callable:
    """Decorate a typer command that takes `engine: EngineFlags`: its signature gains one option per
    engine setting (but those in `exclude`), and the parsed values reach it as `engine`.
    `defaults` replaces a setting's default for this command (benchmark turns prefix caching off)."""
    defaults = defaults or {}

    def wrap(fn: Callable) -> Callable:
        settings = [s for s in engine_settings() if s.keyword not in exclude]
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.name != "engine"]
        params += [s.option(defaults.get(s.keyword, dataclasses.MISSING)) for s in settings]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            values = {}
            for s in settings:
                value = kwargs.pop(s.param)
                if value is None:
                    continue
                choices = s.meta["choices"]
                if choices and value not in choices:  # before any model is looked for
                    flag = (s.meta["flag"] or "--" + s.name.replace("_", "-")).split("/")[0]
                    raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
                if s.meta["to_value"] is not None:
                    value = s.meta["to_value"](value)
                values[s.keyword] = value
            return fn(*args, engine=EngineFlags(values), **kwargs)

        wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        return wrapper

    return wrap
