"""One engine on the embedded default model, shared by the end-to-end and server tests (loading it takes ~10 s).

Every test that uses it ends by checking that it holds no request and every KV block is free."""

from __future__ import annotations

# No collection while the test modules import, as in ruvllm's own processes (gc_settings.py):
# pytest_collection_finish freezes what they made and turns the collector back on. Measured over
# `-k "test_invariants or test_openai_client or test_sampling_e2e"` (all modules collected, one
# process): 4.95 s of the collector's time, 1.60 s this way.
from ruvllm.gc_settings import defer_collection, startup_done  # noqa: I001  # first: before torch's import

defer_collection()

# Triton's CPU interpreter is chosen when kernels are decorated (triton.jit, at import of
# ruvllm.layers.triton_kernels), so without a GPU it must be switched on before anything imports them.
import os  # noqa: E402

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Servers the tests start (in this process or as `ruvllm serve`) keep their witness log and learned
# adapters in a folder of the test run's, never in the user's data folder.
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if "RUVLLM_DATA_DIR" not in os.environ:  # set once, by the first process (test workers inherit it)
    os.environ["RUVLLM_DATA_DIR"] = tempfile.mkdtemp(prefix="ruvllm-test-data-")
    atexit.register(shutil.rmtree, os.environ["RUVLLM_DATA_DIR"], True)

from pathlib import Path

import pytest

from ruvllm import LLM


@pytest.fixture(scope="session")
def _shared_llm() -> LLM:
    """The fp32 reference: every weight dense (the GGUF dequantized exactly), fp32 compute."""
    return LLM(dtype="float32", quantization="none", num_blocks=512, max_num_batched_tokens=512, max_num_seqs=64)


@pytest.fixture(scope="session")
def _default_llm() -> LLM:
    """The engine as a user gets it: default dtype and quantization (on the CPU: GGUF weights kept
    packed, the LM head in 8 bits, our kernels; bf16 compute on CPUs with native bf16, else fp32)."""
    return LLM(num_blocks=512, max_num_batched_tokens=512, max_num_seqs=64)


@pytest.fixture(scope="session")
def _tiny_llm() -> LLM:
    """A tiny random Llama (2 layers, built in memory in a second): the engine's invariants do not
    depend on the model, and on it they run in a fraction of the real model's time."""
    from tests.engine_fixtures import tiny_llm

    return tiny_llm("cpu", num_blocks=512)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model of _tiny_llm (same weights) as a Hugging Face folder with its word tokenizer."""
    from tests.engine_fixtures import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


def _checked(engine_llm: LLM):
    engine_llm.reset_prefix_cache()
    yield engine_llm
    stats = engine_llm.stats()
    assert stats.idle
    assert stats.free_blocks == stats.total_blocks, "KV blocks leaked"


@pytest.fixture
def llm(_shared_llm: LLM):
    yield from _checked(_shared_llm)


@pytest.fixture
def default_llm(_default_llm: LLM):
    yield from _checked(_default_llm)


@pytest.fixture(params=["float32", "default"])
def precision_llm(request: pytest.FixtureRequest):
    """Each invariant holds at the fp32 reference precision (on the tiny model: the engine's code
    paths are the same, in a fraction of the time; the real model in fp32 is checked through the
    core process, tests/e2e/test_process_engine.py) and at the default one (the real model as a user
    gets it: packed int4 weights and an 8-bit LM head)."""
    yield from _checked(request.getfixturevalue("_tiny_llm" if request.param == "float32" else "_default_llm"))


BOOK = Path(__file__).resolve().parents[2] / "shared" / "data" / "pride-and-prejudice.txt"


def novel_prompts(n: int, words: int = 40) -> list[str]:
    """Realistic, distinct prompts cut from the novel in ../shared (or a stand-in when it is absent)."""
    if BOOK.exists():
        text = BOOK.read_text(encoding="utf-8").split()[2000:]
    else:
        text = ("It is a truth universally acknowledged that a single man in possession of a good fortune "
                "must be in want of a wife ").split() * 200
    return [" ".join(text[i * 97:i * 97 + words]) for i in range(n)]


@pytest.fixture
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """CLI tests that read rich's tables: rich wraps at 80 columns otherwise."""
    monkeypatch.setenv("COLUMNS", "1000")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        startup_done()  # xdist's controller: its workers collect, it never does


def pytest_collection_finish(session: pytest.Session) -> None:
    startup_done()
