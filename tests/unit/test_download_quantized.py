"""`ruvllm download MODEL --quantization METHOD` and the MODEL:TAG variants it stores.

Downloads never reach huggingface.co: they go to the LOCAL STAND-IN for the Hugging Face Hub API
from test_cli_models.py (an http.server in a thread answering what snapshot_download asks), here
serving a GGUF-only repository of several small placeholder .gguf files (picking is by file name;
the loader only checks their magic) and a tiny random safetensors Llama.
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from ruvllm.cli import quantize_cmd
from ruvllm.loader import hub, load_model_config, model_cache, load_tokenizer, resolve_model
from tests.unit.test_cli_models import COMMIT, _handler, _HubStandIn, _point_hf_at, assert_one_line_error, invoke

GGUF_REPO = "ruvllm-test/tiny-GGUF"
ST_REPO = "ruvllm-test/tiny-st"
GGUF_FILES = ("tiny.Q4_0.gguf", "tiny.Q4_K_M.gguf", "tiny.Q4_K_S.gguf", "tiny.Q8_0.gguf", "tiny-Q6_K_L.gguf",
              "mmproj-tiny-F16.gguf")


pytestmark = pytest.mark.usefixtures("wide_terminal")


@pytest.fixture(scope="module")
def gguf_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gguf-repo")
    for name in GGUF_FILES:
        (folder / name).write_bytes(b"GGUF" + name.encode())  # each file tells which it is
    (folder / "README.md").write_text("placeholder GGUF files\n")
    return folder


@pytest.fixture(scope="module")
def st_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama whose projections tile into int4 groups of 32 and 64 (not 128), with the
    default model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("st-repo")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2)).save_pretrained(folder)
    load_tokenizer(resolve_model(None)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def standin(gguf_repo: Path, st_repo: Path) -> Iterator[_HubStandIn]:
    server_state = _HubStandIn(url="", repos={GGUF_REPO: gguf_repo, ST_REPO: st_repo})
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(server_state))
    server_state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    with pytest.MonkeyPatch.context() as mp:
        _point_hf_at(mp, server_state.url)
        yield server_state
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def int4_cache(standin: _HubStandIn, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding ST_REPO:int4, downloaded with the default group size."""
    cache = tmp_path_factory.mktemp("cache")
    result = invoke("download", ST_REPO, "-q", "int4", "--cache-dir", str(cache))
    assert result.exit_code == 0, result.output
    # 128, quantize's default, does not divide the 64 inputs: the largest size that does is taken.
    assert "group size 64, as 128 does not divide the model's layers" in result.stdout, result.output
    assert f"ruvllm serve {ST_REPO}:int4" in result.stdout
    return cache


# ------------------------------------------------------------------ GGUF-only repositories


def _gguf_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.gguf"))


def test_gguf_quantization_picks_the_file(standin: _HubStandIn, tmp_path: Path) -> None:
    for method, want in (("q8", "tiny.Q8_0.gguf"), ("q4k", "tiny.Q4_K_M.gguf"), ("Q4_0", "tiny.Q4_0.gguf")):
        result = invoke("download", GGUF_REPO, "-q", method, "--cache-dir", str(tmp_path))
        assert result.exit_code == 0, result.output
        folder = tmp_path / "models" / f"ruvllm-test--tiny-GGUF--{method.lower()}"
        assert _gguf_in(folder) == [want], result.output
        assert f"GGUF file {want}" in result.stdout
        assert model_cache.resolve_cli_model(f"{GGUF_REPO}:{method}", tmp_path) == str(folder)
        assert resolve_model(folder).path.name == want
    assert not (tmp_path / "models" / "ruvllm-test--tiny-GGUF").exists()  # variants only

    # Present under its tagged name: no network.
    gets = len(standin.requests)
    again = invoke("download", f"{GGUF_REPO}:q8", "--cache-dir", str(tmp_path))
    assert again.exit_code == 0 and "already downloaded" in again.output, again.output
    assert len(standin.requests) == gets

    listed = invoke("list", "--downloaded", "--cache-dir", str(tmp_path))
    assert {f"{GGUF_REPO}:q8", f"{GGUF_REPO}:q4k", f"{GGUF_REPO}:q4_0"} <= set(listed.output.split()), listed.output
    assert [m.variant for m in model_cache.list_models(tmp_path)] == ["q4_0", "q4k", "q8"]


def test_gguf_no_match_and_conflicts_are_one_line(standin: _HubStandIn, tmp_path: Path) -> None:
    cache = ["--cache-dir", str(tmp_path)]
    assert_one_line_error(invoke("download", GGUF_REPO, "-q", "bf16", *cache),
                          "no .gguf file is BF16", "the repository has: " + ", ".join(sorted(GGUF_FILES)))
    assert_one_line_error(invoke("download", GGUF_REPO, "-q", "q8", "--gguf", "tiny.Q8_0.gguf", *cache),
                          "--gguf and --quantization")
    assert_one_line_error(invoke("download", GGUF_REPO, "-q", "int4", "--group-size", "64", *cache),
                          "GGUF repository", "--group-size")
    assert_one_line_error(invoke("download", f"{GGUF_REPO}:q8", "-q", "q4k", *cache), ":q8", "q4k")
    assert_one_line_error(invoke("download", GGUF_REPO, "-q", "int3", *cache), "unknown quantization 'int3'")
    assert model_cache.list_models(tmp_path) == []


def test_pick_gguf_by_file_type() -> None:
    """How -q names map to files, as Hub GGUF repositories spell them (no network)."""
    files = ["README.md", "m-q4_0.gguf", "m-Q4_0_4_4.gguf", "m-q4_k_s.gguf", "m-fp16.gguf", "m-BF16.gguf",
             "mmproj-m-f16.gguf", "m-Q6_K_L.gguf", "sub/m.Q8_0.gguf"]
    picks = {m: hub.pick_gguf("m", files, m) for m in ("q8", "int8", "q4k", "int4", "f16", "bf16", "q4_0")}
    assert picks == {"q8": "sub/m.Q8_0.gguf", "int8": "sub/m.Q8_0.gguf", "q4k": "m-q4_k_s.gguf",
                     "int4": "m-q4_0.gguf", "f16": "m-fp16.gguf", "bf16": "m-BF16.gguf", "q4_0": "m-q4_0.gguf"}
    assert hub.pick_gguf("m", ["a-Q4_1.gguf", "a-Q4_K_M.gguf", "a-Q4_0.gguf"], "int4") == "a-Q4_K_M.gguf"
    assert hub.pick_gguf("m", ["a-Q4_1.gguf", "a-Q4_0.gguf"], "int4") == "a-Q4_0.gguf"
    with pytest.raises(hub.HubError, match=r"no \.gguf file is Q6_K .*m-Q6_K_L\.gguf"):
        hub.pick_gguf("m", files, "q6_k")  # Q6_K_L is another type
    with pytest.raises(hub.HubError, match="2 .gguf files are Q8_0"):
        hub.pick_gguf("m", ["a-Q8_0-00001-of-00002.gguf", "a-Q8_0-00002-of-00002.gguf"], "q8")


# ------------------------------------------------------------------ safetensors repositories


def test_int4_variant_loads_by_tagged_name_and_generates(standin: _HubStandIn, int4_cache: Path) -> None:
    from ruvllm import LLM, SamplingParams
    from ruvllm.quantize.awq_writer import quantization_config
    from ruvllm.quant.linear import QuantLinear

    name = f"{ST_REPO}:int4"
    folder = int4_cache / "models" / "ruvllm-test--tiny-st--int4"
    assert model_cache.resolve_cli_model(name, int4_cache) == str(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"] == quantization_config(64)
    assert (int4_cache / "models" / "ruvllm-test--tiny-st" / "config.json").is_file()  # the plain download stays

    llm = LLM(model_cache.resolve_cli_model(name, int4_cache), dtype="bfloat16", num_blocks=16)  # int4 stays packed
    assert isinstance(llm.model.layers[0].qkv_proj, QuantLinear)
    out = llm.generate(["It is a truth universally"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4

    gets = len(standin.requests)
    again = invoke("download", name, "--cache-dir", str(int4_cache))
    assert again.exit_code == 0 and f"{name} is already downloaded in {folder}" in again.output, again.output
    assert len(standin.requests) == gets

    info = invoke("info", name, "--cache-dir", str(int4_cache))
    assert info.exit_code == 0, info.output
    for line in ("variant:        int4 (int4 round-to-nearest, AWQ checkpoint, group size 64",
                 "quantization:   awq", f"revision:       main ({COMMIT[:12]})"):
        assert line in info.output, info.output


def test_variants_are_listed(int4_cache: Path) -> None:
    listed = invoke("list", "--downloaded", "--cache-dir", str(int4_cache))
    assert listed.exit_code == 0, listed.output
    rows = [line.split() for line in listed.output.splitlines()[1:]]
    assert ["-", ST_REPO] in [r[:2] for r in rows] and ["-", f"{ST_REPO}:int4"] in [r[:2] for r in rows]
    everything = invoke("list", "--cache-dir", str(int4_cache))
    assert f"{ST_REPO}:int4" in everything.output.split(), everything.output
    assert [(m.repo_id, m.variant) for m in model_cache.list_models(int4_cache)][:2] == [(ST_REPO, None), (ST_REPO, "int4")]


def test_bf16_variant_reuses_the_download(standin: _HubStandIn, int4_cache: Path) -> None:
    from ruvllm.loader import iter_weights

    gets = len(standin.requests)
    result = invoke("download", ST_REPO, "-q", "bf16", "--cache-dir", str(int4_cache))
    assert result.exit_code == 0, result.output
    assert len(standin.requests) == gets  # written from the plain download: no network
    src = resolve_model(model_cache.resolve_cli_model(f"{ST_REPO}:bf16", int4_cache))
    assert json.loads((src.path / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_model_config(src) == load_model_config(resolve_model(int4_cache / "models" / "ruvllm-test--tiny-st"))
    assert {t.dtype for _, t in iter_weights(src, torch.float32)} == {torch.float32}  # read back as asked
    assert "dense bfloat16 copy" in result.stdout


def test_int4_group_size_option(int4_cache: Path) -> None:
    cache = ["--cache-dir", str(int4_cache)]
    assert_one_line_error(invoke("download", ST_REPO, "-q", "int4", "--group-size", "128", *cache),
                          "group size 128 does not divide the input size 64", "group sizes that fit this model: 32, 64")
    # Another group size than the variant's: written again.
    result = invoke("download", ST_REPO, "-q", "int4", "--group-size", "32", *cache)
    assert result.exit_code == 0 and "group size 32" in result.stdout, result.output
    assert model_cache.is_downloaded(f"{ST_REPO}:int4", int4_cache, group_size=32)
    assert not model_cache.is_downloaded(f"{ST_REPO}:int4", int4_cache, group_size=64)


@pytest.mark.parametrize("method", ["int8", "w8a8", "q8", "q4k", "none", "auto"])
def test_load_time_methods_are_one_line(standin: _HubStandIn, tmp_path: Path, method: str) -> None:
    result = invoke("download", ST_REPO, "-q", method, "--cache-dir", str(tmp_path))
    assert_one_line_error(result, "applied when the model is loaded", f"`ruvllm serve {ST_REPO} -q {method}`")
    assert model_cache.list_models(tmp_path) == []  # refused before anything was fetched


def test_default_group_size_is_quantize_default() -> None:
    from ruvllm.cli.variants import int4_group_size
    from ruvllm.config import ModelConfig

    option = inspect.signature(quantize_cmd.quantize_cmd).parameters["group_size"].default
    assert option.default in (None, quantize_cmd.DEFAULT_GROUP_SIZE)  # None: the command applies the constant
    cfg = ModelConfig("llama", vocab_size=32, hidden_size=576, intermediate_size=1536, num_layers=1, num_heads=9,
                      num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                      tie_word_embeddings=True, eos_token_ids=(0,))
    assert int4_group_size(cfg, None) == 64  # SmolLM2-135M's shapes
    assert int4_group_size(cfg, 32) == 32
    with pytest.raises(ValueError, match="group sizes that fit this model: 32, 64"):
        int4_group_size(cfg, 128)
    wide = ModelConfig("llama", vocab_size=32, hidden_size=1024, intermediate_size=4096, num_layers=1, num_heads=16,
                       num_kv_heads=4, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                       tie_word_embeddings=True, eos_token_ids=(0,))
    assert int4_group_size(wide, None) == quantize_cmd.DEFAULT_GROUP_SIZE == 128
