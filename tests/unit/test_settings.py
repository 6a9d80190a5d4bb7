"""Every setting is declared once (`setting(...)` field metadata) and checked once (its dataclass's
Checked.__post_init__, by the same Setting.check as its CLI flag): these tests are generated from
that metadata, so a new setting is tested as soon as it is declared. For each setting, a value
out of its bounds, not among its choices, or of the wrong type is a ValueError naming the field,
made directly, through LLM(...)'s keywords and through Ray's `serve run` arguments; and through
every CLI command that has its flag, one line naming the flag and a non-zero exit, before any
model is looked for."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import click.testing
import pytest
import typer

from ruvllm.cli.engine_options import ENGINE_CONFIGS, flag_names, flags_of, from_strings, keyword
from ruvllm.cli.main import _register, app
from ruvllm.config import Declared, declared
from ruvllm.engine.data_parallel import DataParallelConfig
from ruvllm.engine.llm import LLM
from ruvllm.engine.router import RouterConfig
from ruvllm.learning.config import InstantConfig, LearningConfig
from ruvllm.server.config import RayServeConfig, ServerConfig

CONFIGS = (*ENGINE_CONFIGS, ServerConfig, LearningConfig, InstantConfig, DataParallelConfig, RouterConfig,
           RayServeConfig)
SETTINGS = [d for cls in CONFIGS for d in declared(cls)]
# Ray's `serve run` arguments, grouped as ray_serve/app.py::build_app groups them.
RAY_GROUPS = {"engine": ENGINE_CONFIGS, "server": (ServerConfig,), "ray": (RayServeConfig, RouterConfig)}
# The commands whose default for a setting is their own, on purpose (the command says why).
COMMAND_DEFAULTS = {("benchmark", "enable_prefix_caching"): False, ("serve", "served_model_name"): None,
                    ("ray-serve", "served_model_name"): None}

_register()
# The click command typer builds from the app, built once: typer's CliRunner rebuilds it on every
# invoke, which was most of this file's time (179 invokes, 34 s).
CLI = typer.main.get_command(app)
runner = click.testing.CliRunner()


def _id(d: Declared) -> str:
    return f"{d.owner.__name__}.{d.name}"


def out_of_range(d: Declared, unit: float = 1) -> list[Any]:
    """Values this setting refuses for its bounds or choices (in `unit`s of the field's)."""
    s = d.setting
    if s.choices is not None:
        return [max(s.choices) + 1 if d.kind is int else "no-such-choice"]
    kind = float if unit != 1 else d.kind
    step = 1 if kind is int else 1e-3
    bad = []
    if s.minimum is not None:
        low = s.minimum / unit
        bad.append(low - step if kind is int or low == 0 else low / 2 if low > 0 else low - step)
    if s.maximum is not None:
        bad.append(s.maximum / unit + step)
    return bad


def wrong_type(d: Declared) -> Any:
    return {int: 1.5, float: "fast", bool: "yes", str: 5, tuple: ["a"]}[d.kind]


def _make(d: Declared, value: Any) -> Any:
    return d.owner(**{d.name: value})


def test_every_user_facing_config_declares_its_fields() -> None:
    """Every field of a config dataclass is a setting, but for the configs nested in others and
    EngineConfig.model (LLM's first argument)."""
    nested = {"quantization", "cache", "scheduler", "lora", "speculation", "instant", "learning", "routing", "engine",
              "server", "model"}
    for cls in CONFIGS:
        plain = [f.name for f in dataclasses.fields(cls) if "setting" not in f.metadata]
        assert set(plain) <= nested, (cls.__name__, plain)


@pytest.mark.parametrize("d", SETTINGS, ids=_id)
def test_the_dataclass_refuses_bad_values_by_name(d: Declared) -> None:
    assert _make(d, d.default) is not None  # the default is a value the setting takes
    if d.optional:
        _make(d, None)
    for bad in [*out_of_range(d), wrong_type(d)]:
        with pytest.raises(ValueError, match=rf"\b{d.name} must be .*got {re.escape(repr(bad))}$"):
            _make(d, bad)


ENGINE_SETTINGS = [d for cls in ENGINE_CONFIGS for d in declared(cls)]


@pytest.mark.parametrize("d", ENGINE_SETTINGS, ids=_id)
def test_llm_keywords_refuse_bad_values_by_name(d: Declared) -> None:
    """LLM(...) sorts its keywords into the configs, which refuse a bad value before anything loads."""
    for bad in [*out_of_range(d), wrong_type(d)]:
        with pytest.raises(ValueError, match=rf"\b{d.name} must be"):
            LLM(**{keyword(d): bad})


RAY_FLAGS = [d for configs in RAY_GROUPS.values() for d in flags_of(*configs)]


@pytest.mark.parametrize("d", RAY_FLAGS, ids=_id)
def test_ray_serve_run_arguments_refuse_bad_values_by_name(d: Declared) -> None:
    """`serve run ruvllm.ray_serve.app:build_app name=value`: converted to the field's type and checked."""
    for bad in out_of_range(d, d.setting.unit or 1):
        with pytest.raises(ValueError, match=rf"^{d.name} must be"):
            from_strings({d.name: str(bad)}, **RAY_GROUPS)
    if d.kind in (int, float, bool):
        with pytest.raises(ValueError, match=rf"^{d.name} must be .*got 'many'"):
            from_strings({d.name: "many"}, **RAY_GROUPS)
    with pytest.raises(ValueError, match="unknown setting 'no_such_setting'"):
        from_strings({"no_such_setting": "1"}, **RAY_GROUPS)


def test_ray_serve_run_arguments_build_the_configs() -> None:
    flags = from_strings({"replicas": "3", "threads": "2", "routing": "round_robin", "served_model_name": "m",
                          "kv_cache_gib": "0.5", "prefix_caching": "false", "lora_dirs": "/a,/b"}, **RAY_GROUPS)
    cfg = flags["ray"].make(RayServeConfig, engine=flags["engine"].to_config("m"),
                            server=flags["server"].make(ServerConfig), routing=flags["ray"].make(RouterConfig))
    assert (cfg.replicas, cfg.routing.policy, cfg.server.served_model_name, cfg.server.lora_dirs) == \
        (3, "round_robin", "m", ("/a", "/b"))
    assert (cfg.engine.num_threads, cfg.engine.cache.kv_cache_memory_bytes) == (2, 2**29)
    assert cfg.engine.cache.enable_prefix_caching is False
    with pytest.raises(ValueError, match="autoscaling needs both min_replicas and max_replicas"):
        RayServeConfig(min_replicas=1)
    with pytest.raises(ValueError, match=r"min_replicas \(3\) must not exceed max_replicas \(2\)"):
        RayServeConfig(min_replicas=3, max_replicas=2)


def _flag(d: Declared) -> str:
    return flag_names(d)[0].split("/")[0]


def _commands() -> dict[str, Any]:
    return CLI.commands  # type: ignore[attr-defined]


def _options(command: Any) -> dict[str, Any]:
    return {p.opts[0]: p for p in command.params if p.param_type_name == "option"}


# The commands whose flags are generated from the settings (info's -q and --group-size are its own:
# no estimate without them; its QuantConfig checks them).
COMMANDS = ("serve", "ray-serve", "chat", "benchmark")
CLI_CASES = [(name, d) for d in flags_of(*CONFIGS) for name in COMMANDS if _flag(d) in _options(_commands()[name])]


def test_every_flag_is_on_a_command() -> None:
    assert {_id(d) for d in flags_of(*CONFIGS)} == {_id(d) for _, d in CLI_CASES}


@pytest.mark.parametrize(("command", "d"), CLI_CASES, ids=lambda c: c if isinstance(c, str) else _id(c))
def test_the_cli_refuses_bad_values_in_one_line_naming_the_flag(wide_terminal, command: str, d: Declared) -> None:
    flag = _flag(d)
    option = _options(_commands()[command])[flag]
    # one default for each setting, wherever its flag is (but where a command says otherwise)
    default = COMMAND_DEFAULTS.get((command, d.name), d.default)
    assert option.default == (list(default) if d.kind is tuple else default), (command, flag)
    for bad in out_of_range(d, d.setting.unit or 1):
        text = str(bad) if not isinstance(bad, float) or math.isfinite(bad) else "0"
        result = runner.invoke(CLI, [command, flag, text], prog_name="ruvllm")
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {flag} must be"), result.output


def test_learning_flags_default_as_the_config() -> None:
    """--learn-nice defaulted to 10 while LearningConfig.nice was 0: one default now (10, measured in
    docs/learning.md), for `serve --learn` and LLM.enable_learning alike."""
    assert LearningConfig().nice == 10
    assert _options(_commands()["serve"])["--learn-nice"].default == 10
