"""benchmarks/random_gguf.py (issue 34): the random-weight GGUFs of real shapes that the realistic
speed benchmark runs on. A tiny shape is written here (a second or two); the real shapes are checked
through their tensor plan, whose parameter counts must be the real models' own."""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import quants

from benchmarks.random_gguf import SHAPES, random_gguf, tensor_plan
from ruvllm.loader.default_model import default_model_path
from ruvllm.loader.gguf_header import GGUFArray, read_header

VOCAB = 49152  # the default model's tokenizer


@pytest.fixture(scope="module")
def files() -> dict[str, Path]:
    """Written to (and reused from) the script's cache, as the benchmark uses it: a file kept keeps
    its tokenizer cached too (loader/tokenizer.py, keyed by the file's path and mtime), which saves
    the ~5 s that transformers takes to build it from the GGUF metadata on every later run."""
    return {body: random_gguf("tiny", body, progress=False) for body in ("q4_0", "q4_k")}


@pytest.mark.parametrize("key, params", [
    # Hugging Face's parameter counts of the real models (tied tables counted once).
    ("smollm2-1.7b", 1_711_376_384),
    ("llama-3.2-1b", 1_235_814_400),
    ("llama-3.1-8b", 8_030_261_248),
])
def test_real_shapes_have_the_real_models_parameter_counts(key: str, params: int) -> None:
    shape = SHAPES[key]
    assert sum(math.prod(t.shape) for t in tensor_plan(shape, QType.Q4_0, shape.original_vocab)) == params


def test_untied_shape_has_an_output_table() -> None:
    plan = {t.name: t for t in tensor_plan(SHAPES["llama-3.1-8b"], QType.Q4_K, VOCAB)}
    assert plan["output.weight"].shape == (VOCAB, 4096) and plan["output.weight"].qtype == QType.Q8_0
    assert plan["blk.31.attn_k.weight"].shape == (8 * 128, 4096)
    assert plan["blk.0.ffn_down.weight"].shape == (4096, 14336) and plan["blk.0.ffn_down.weight"].qtype == QType.Q4_K
    assert "output.weight" not in {t.name for t in tensor_plan(SHAPES["smollm2-1.7b"], QType.Q4_0, VOCAB)}


@pytest.mark.parametrize("body, qtype", [("q4_0", QType.Q4_0), ("q4_k", QType.Q4_K)])
def test_file_holds_the_asked_tensors(files: dict[str, Path], body: str, qtype: QType) -> None:
    header = read_header(files[body])
    got = {t.name: (t.shape, t.tensor_type) for t in header.tensors}
    h, kv, ffn = 256, 2 * 64, 512
    expected = {"token_embd.weight": ((VOCAB, h), QType.Q8_0), "output_norm.weight": ((h,), QType.F32)}
    for i in range(2):
        b = f"blk.{i}."
        expected |= {b + "attn_norm.weight": ((h,), QType.F32), b + "ffn_norm.weight": ((h,), QType.F32),
                     b + "attn_q.weight": ((h, h), qtype), b + "attn_k.weight": ((kv, h), qtype),
                     b + "attn_v.weight": ((kv, h), qtype), b + "attn_output.weight": ((h, h), qtype),
                     b + "ffn_gate.weight": ((ffn, h), qtype), b + "ffn_up.weight": ((ffn, h), qtype),
                     b + "ffn_down.weight": ((h, ffn), qtype)}
    assert got == expected
    f = header.fields
    assert (f["general.architecture"], f["llama.embedding_length"], f["llama.block_count"],
            f["llama.attention.head_count"], f["llama.attention.head_count_kv"],
            f["llama.feed_forward_length"]) == ("llama", 256, 2, 4, 2, 512)
    # The default model's tokenizer, entry for entry (the arrays by item type and length here).
    default = read_header(default_model_path()).fields
    tokenizer = {k: v for k, v in default.items() if k.startswith("tokenizer.")}
    assert {k: v for k, v in f.items() if k.startswith("tokenizer.")} == tokenizer
    assert tokenizer["tokenizer.ggml.tokens"] == GGUFArray(tokenizer["tokenizer.ggml.tokens"].item_type, VOCAB)

    # The data decodes (gguf's own dequantizers) to what was asked: N(0, 0.02) weights, unit norms.
    raw = np.memmap(files[body], dtype=np.uint8, mode="r")
    info = {t.name: t for t in header.tensors}

    def values(name: str) -> np.ndarray:
        t = info[name]
        return quants.dequantize(raw[t.offset:t.offset + t.n_bytes], t.tensor_type).reshape(t.shape)

    assert np.array_equal(values("blk.1.ffn_norm.weight"), np.ones(h, dtype=np.float32))
    for name in ("token_embd.weight", "blk.1.ffn_down.weight", "blk.0.attn_k.weight"):
        w = values(name)
        assert abs(float(w.std()) - 0.02) < 0.002 and abs(float(w.mean())) < 0.002, name


def test_file_is_reused_and_seeded(files: dict[str, Path], tmp_path: Path) -> None:
    path = files["q4_0"]
    stamp = path.stat().st_mtime_ns
    assert random_gguf("tiny", "q4_0", directory=path.parent, progress=False) == path
    assert path.stat().st_mtime_ns == stamp  # not written again
    assert not [p for p in path.parent.iterdir() if ".partial" in p.name]
    other = random_gguf("tiny", "q4_0", seed=1, directory=tmp_path, progress=False)
    a, b = read_header(path), read_header(other)
    t = next(t for t in a.tensors if t.name == "blk.0.attn_q.weight")
    u = next(t for t in b.tensors if t.name == "blk.0.attn_q.weight")
    assert path.read_bytes()[t.offset:t.offset + t.n_bytes] != other.read_bytes()[u.offset:u.offset + u.n_bytes]


@pytest.mark.parametrize("body", ["q4_0", "q4_k"])
def test_ruvllm_loads_and_generates(files: dict[str, Path], body: str) -> None:
    from ruvllm import LLM, SamplingParams

    llm = LLM(model=str(files[body]), num_threads=1, num_blocks=16, max_num_batched_tokens=64)
    assert llm.model.cfg.vocab_size == VOCAB and llm.model.cfg.num_layers == 2
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                            logprobs=1))[0].outputs[0]
    assert len(out.token_ids) == 6 and all(0 <= t < VOCAB for t in out.token_ids)
    # Random weights at the init scale keep activations finite through the layers.
    assert all(math.isfinite(lp[t].logprob) for lp, t in zip(out.logprobs, out.token_ids))


def _llama_bench() -> str | None:
    from benchmarks.vs_llama_realistic import find_llama_binary
    return find_llama_binary("llama-bench")


@pytest.mark.skipif(_llama_bench() is None, reason="llama.cpp's llama-bench is not built on this machine "
                                                   "(../shared/tools/build-llama-cpp.sh)")
def test_llama_cpp_runs_the_file(files: dict[str, Path]) -> None:
    """llama.cpp itself (no Python) loads the file and generates from it."""
    for path in files.values():
        run = subprocess.run([_llama_bench(), "-m", str(path), "-p", "0", "-n", "4", "-r", "1", "-t", "1",
                              "-o", "json"], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert run.returncode == 0, run.stderr[-2000:]
        assert '"avg_ts"' in run.stdout
