"""The CLI flags, generated from the config dataclasses' `setting(...)` fields.

Every setting is declared once, in its config dataclass (ruvllm/config.py for the engine's,
server/config.py for the server's and Ray Serve's, learning/config.py, engine/data_parallel.py and
engine/router.py), with its default, help, bounds and choices. A command decorated with
`with_flags(group, *configs)` takes one flag per setting and receives the parsed values as one
`Flags` named `group`, each checked by its Setting.check (the dataclass's own check) before any
model is looked for. `LLM(**kwargs)` takes the engine's settings as keywords
(engine/llm.py::build_engine_config), and Ray's `serve run` as `name=value` strings (`from_strings`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import typer

from ruvllm.config import (CacheConfig, Declared, EngineConfig, LoraConfig, QuantConfig, SchedulerConfig,
                           SpeculativeConfig, declared)

ENGINE_CONFIGS = (EngineConfig, CacheConfig, SchedulerConfig, QuantConfig, LoraConfig, SpeculativeConfig)


def keyword(d: Declared) -> str:
    """The LLM keyword and Flags key: the field's name, but for QuantConfig.method `quantization`."""
    return "quantization" if (d.owner, d.name) == (QuantConfig, "method") else d.name


def flag_names(d: Declared) -> list[str]:
    return [(d.setting.flag or "--" + d.name.replace("_", "-")), *d.setting.aliases]


def flags_of(*configs: type) -> list[Declared]:
    return [d for cls in configs for d in declared(cls) if d.setting.cli]


def engine_settings() -> list[Declared]:
    return flags_of(*ENGINE_CONFIGS)


def _option(d: Declared, param: str, default: Any) -> inspect.Parameter:
    value = d.default if default is dataclasses.MISSING else default
    kind = float if d.setting.unit else d.kind
    if kind is tuple:  # a repeatable flag
        kind, value = list[str], list(value)
    opt = typer.Option(value, *flag_names(d), help=d.setting.help, metavar=d.setting.metavar,
                       envvar=d.setting.envvar, show_default=value not in (None, []))
    annotation = Optional[kind] if value is None else kind
    return inspect.Parameter(param, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=annotation)


def parse(d: Declared, value: Any, label: str | None = None) -> Any:
    """A flag's value as the field takes it, checked as the dataclass checks the field (a flag in
    other units, --kv-cache-gib, in its own)."""
    if d.kind is tuple:
        return tuple(value)
    unit = d.setting.unit or 1
    d.setting.check(label or flag_names(d)[0].split("/")[0], value, float if unit != 1 else d.kind, True, unit)
    return value if unit == 1 else int(value * unit)


@dataclass(frozen=True)
class Flags:
    """One group's flags as a command parsed them."""

    values: dict[str, Any]  # keyword -> value (only flags given a value)

    def get(self, keyword: str) -> Any:
        return self.values.get(keyword)

    def to_config(self, model: str | None, **overrides: Any) -> EngineConfig:
        from ruvllm.engine.llm import build_engine_config

        return build_engine_config(model, **{**self.values, **overrides})

    def make(self, cls: type, **overrides: Any) -> Any:
        """A `cls` of the values that are its fields, and `overrides`."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in self.values.items() if k in names}, **overrides})


def with_flags(group: str, *configs: type, exclude: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
               defaults: dict[str, Any] | None = None) -> Callable:
    """Decorate a typer command that takes `<group>: Flags`: its signature gains one option per
    setting of `configs` (but those in `exclude`, or only those in `only`), and the parsed values
    reach it as `<group>`. `defaults` replaces a setting's default for this command."""
    defaults = defaults or {}
    flags = [d for d in flags_of(*configs) if keyword(d) not in exclude and (only is None or keyword(d) in only)]

    def wrap(fn: Callable) -> Callable:
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.name != group]
        params += [_option(d, f"{group}_{d.name}", defaults.get(keyword(d), dataclasses.MISSING)) for d in flags]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            given = [(d, kwargs.pop(f"{group}_{d.name}")) for d in flags]
            return fn(*args, **{group: Flags({keyword(d): parse(d, v) for d, v in given if v is not None})}, **kwargs)

        wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        return wrapper

    return wrap


def with_engine_flags(exclude: tuple[str, ...] = (), defaults: dict[str, Any] | None = None) -> Callable:
    """with_flags for the engine's settings: the command takes `engine: Flags`."""
    return with_flags("engine", *ENGINE_CONFIGS, exclude=exclude, defaults=defaults)


def from_strings(args: Mapping[str, str], **groups: tuple[type, ...]) -> dict[str, Flags]:
    """Each group's Flags of `name=value` strings (Ray's `serve run` arguments): a name is a setting's
    field or its flag without dashes (threads=2); a value is converted to the field's type (a tuple's
    items separated by commas) and checked as a flag is."""
    by_name = {n.split("/")[0].lstrip("-").replace("-", "_"): (group, d) for group, configs in groups.items()
               for d in flags_of(*configs) for n in (*flag_names(d), d.name)}
    convert = {int: int, float: float, bool: lambda t: {"true": True, "false": False}[t.lower()],
               tuple: lambda t: t.split(",")}
    values: dict[str, dict[str, Any]] = {group: {} for group in groups}
    for name, text in args.items():
        if name not in by_name:
            raise ValueError(f"unknown setting {name!r}; choose from {', '.join(sorted(by_name))}")
        group, d = by_name[name]
        try:
            value = convert.get(float if d.setting.unit else d.kind, str)(text)
        except (ValueError, KeyError):
            value = text  # refused by the check, by name
        values[group][keyword(d)] = parse(d, value, label=name)
    return {group: Flags(v) for group, v in values.items()}
