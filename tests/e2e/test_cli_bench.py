"""`ruvllm benchmark` through typer's CliRunner, with tiny settings: json and csv reports on stdout,
and bad flag values rejected with one line before any model is loaded."""

from __future__ import annotations

import csv
import io
import json

import pytest
from typer.testing import CliRunner

from ruvllm.cli.main import _register, app

_register()
runner = CliRunner()
TINY = ["--iterations", "1", "--warmup", "0", "--prompt-length", "16", "--gen-length", "4", "--concurrency", "2"]
METRICS = ["prefill_latency_ms", "ttft_mean_ms", "ttft_p50_ms", "decode_tokens_per_s", "aggregate_tokens_per_s",
           "peak_memory_mib"]


def test_json_report() -> None:
    result = runner.invoke(app, ["benchmark", *TINY, "--format", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["prompt_length"] == 16 and report["gen_length"] == 4 and report["concurrency"] == 2
    for key in METRICS:
        assert isinstance(report[key], (int, float)) and report[key] > 0, (key, report[key])


def test_two_tier_kv_cache_report(tiny_model_dir) -> None:
    """(The report's form on the tiny model: the embedded one is measured by test_json_report.)"""
    result = runner.invoke(app, ["benchmark", str(tiny_model_dir), *TINY, "--kv-cache-dtype", "int4",
                                 "--kv-hot-tokens", "16"])
    assert result.exit_code == 0, result.output
    assert "KV int4" in " ".join(result.stdout.split())  # the title wraps


def test_csv_report(tiny_model_dir) -> None:
    result = runner.invoke(app, ["benchmark", str(tiny_model_dir), *TINY, "--format", "csv"])
    assert result.exit_code == 0, result.output
    rows = list(csv.reader(io.StringIO(result.stdout)))
    assert len(rows) == 2 and len(rows[0]) == len(rows[1])
    row = dict(zip(*rows))
    assert all(float(row[key]) > 0 for key in METRICS)


@pytest.mark.parametrize("flags, message", [
    (["--format", "xml"], "--format must be one of table, json, csv"),
    (["--concurrency", "0"], "--concurrency must be at least 1"),
    (["--gen-length", "1"], "--gen-length must be at least 2"),
    (["--kv-cache-dtype", "int2"], "--kv-cache-dtype must be one of auto, bf16, fp16, int8, int4, got 'int2'"),
    (["--kv-cache-dtype", "int8", "--device", "cuda"], "CUDA"),
])
def test_bad_values_fail_in_one_line(flags: list[str], message: str) -> None:
    result = runner.invoke(app, ["benchmark", *flags])
    assert result.exit_code != 0
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output


def test_bad_flag_through_the_real_entry_point_is_one_line() -> None:
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "ruvllm.cli.main", "benchmark", "--concurrency", "abc"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "--concurrency" in r.stderr and "Traceback" not in r.stderr
