"""Loader tests: default GGUF vs transformers' own GGUF loader, HF folder round trips, bad inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from ruvllm.config import ModelConfig
from ruvllm.errors import (
    CorruptModelError,
    ModelNotFoundError,
    NotAModelError,
    UnsupportedArchitectureError,
    UnsupportedQuantizationError,
)
from ruvllm.loader import (
    ModelSource,
    default_model_path,
    gguf_file,
    iter_weights,
    load_model_config,
    load_tokenizer,
    resolve_model,
)


@pytest.fixture(scope="module")
def default_src() -> ModelSource:
    return resolve_model(None)


@pytest.fixture(scope="module")
def default_weights(default_src: ModelSource) -> dict[str, torch.Tensor]:
    return dict(iter_weights(default_src, torch.float32))


@pytest.fixture(scope="module")
def reference_state_dict(default_src: ModelSource, tmp_path_factory: pytest.TempPathFactory
                         ) -> dict[str, torch.Tensor]:
    """transformers' own GGUF loader: loaded once for the module, from a copy of the file without the
    tokenizer's arrays (every tensor byte for byte; its reader parses them string by string, twice:
    tests/gguf_copy.py), which took most of its 18 s of CPU; gguf's name table built once
    (tests/hf_gguf.py)."""
    from tests.hf_gguf import hf_model_from_gguf

    model = hf_model_from_gguf(default_src.path, tmp_path_factory.mktemp("model-only"), dtype=torch.float32,
                               local_files_only=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- default model


def test_default_model_path_finds_file() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()
    assert resolve_model(None) == ModelSource(path, "gguf")


def test_default_model_config(default_src: ModelSource) -> None:
    cfg = load_model_config(default_src)
    assert cfg.architecture == "llama"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.intermediate_size) == (49152, 64, 1536)
    assert cfg.tie_word_embeddings
    assert not cfg.attention_bias and not cfg.qk_norm
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == 8192
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_default_gguf_weights_equal_transformers(
    default_weights: dict[str, torch.Tensor], reference_state_dict: dict[str, torch.Tensor]
) -> None:
    # transformers exposes the tied lm_head in its state_dict; we do not yield it.
    ref = {k: v for k, v in reference_state_dict.items() if k != "lm_head.weight"}
    assert set(default_weights) == set(ref)
    for name, expected in ref.items():
        got = default_weights[name]
        assert got.dtype == torch.float32 and got.shape == expected.shape, name
        assert torch.equal(got, expected), name


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                                   gguf.GGMLQuantizationType.Q8_0])
def test_block_types_decode_as_ggufs_own_decoder_does(qtype) -> None:
    """Our torch decoder of the 32-weight block types (the default model's Q4_1 and Q8_0 are also
    checked whole above, against transformers' read): gguf's numpy values, bit for bit."""
    from ruvllm.quant.gguf_blocks import gguf_dense

    weights = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32) * 0.05
    weights[0, :32] += 3.0  # a block whose minimum is far from zero (Q4_1's m)
    raw = gguf.quants.quantize(weights, qtype)
    assert torch.equal(gguf_dense(raw, qtype, (8, 256)), torch.from_numpy(gguf.quants.dequantize(raw, qtype)))


def test_default_gguf_weights_cast_to_dtype(default_src: ModelSource) -> None:
    name, tensor = next(iter(iter_weights(default_src, torch.bfloat16)))
    assert name == "model.embed_tokens.weight"
    assert tensor.dtype == torch.bfloat16 and tensor.shape == (49152, 576)


def test_default_tokenizer(default_src: ModelSource) -> None:
    tok = load_tokenizer(default_src)
    assert len(tok) == 49152
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text
    assert tok.decode(tok("Hello world").input_ids) == "Hello world"


def test_dir_with_one_gguf_resolves(tmp_path: Path, default_src: ModelSource) -> None:
    (tmp_path / "m.gguf").symlink_to(default_src.path)
    assert resolve_model(tmp_path) == ModelSource(tmp_path / "m.gguf", "gguf")


# ---------------------------------------------------------------- HF folders

_SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    eos_token_id=[3, 4],
    bos_token_id=1,
)


def _tiny(kind: str, tie: bool):
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**_SMALL, tie_word_embeddings=tie, rope_theta=50000.0))
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**_SMALL, tie_word_embeddings=tie))
    return Qwen3ForCausalLM(Qwen3Config(**_SMALL, tie_word_embeddings=tie, head_dim=32))


@pytest.mark.parametrize(
    "kind,tie,shard",
    [("llama", False, False), ("llama", True, True), ("qwen2", True, False), ("qwen3", False, True)],
)
def test_hf_folder_round_trip(tmp_path: Path, kind: str, tie: bool, shard: bool) -> None:
    model = _tiny(kind, tie)
    model.save_pretrained(tmp_path, max_shard_size="20KB" if shard else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == shard

    src = resolve_model(str(tmp_path))
    assert src == ModelSource(tmp_path, "hf")
    cfg = load_model_config(src)
    assert cfg == ModelConfig(
        architecture=kind,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32 if kind == "qwen3" else 16,
        rms_norm_eps=1e-5,
        rope_theta=50000.0 if kind == "llama" else 10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        attention_bias=kind == "qwen2",
        qk_norm=kind == "qwen3",
        rope_scaling=None,
        bos_token_id=1,
        eos_token_ids=(3, 4),
    )

    expected = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    got = dict(iter_weights(src, torch.float32))
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert all(t.dtype == torch.float16 for _, t in iter_weights(src, torch.float16))


def test_hf_rope_scaling_normalised(tmp_path: Path) -> None:
    _tiny("llama", False).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)  # old (transformers 4) style config
    cfg.update(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0}, model_type="mistral")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    mc = load_model_config(resolve_model(tmp_path))
    assert mc.architecture == "mistral"
    assert mc.rope_theta == 500000.0
    assert mc.rope_scaling == {"rope_type": "linear", "factor": 2.0}


# ---------------------------------------------------------------- bad inputs


def _write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]]) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(256)
    for name, (data, raw) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelNotFoundError, match=str(missing)):
        resolve_model(missing)


def test_empty_dir(tmp_path: Path) -> None:
    with pytest.raises(NotAModelError, match=str(tmp_path)):
        resolve_model(tmp_path)


def test_text_file(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("hello, not a model\n")
    with pytest.raises(NotAModelError, match=str(f)):
        resolve_model(f)


def test_truncated_gguf(tmp_path: Path, default_src: ModelSource) -> None:
    f = tmp_path / "cut.gguf"
    with open(default_src.path, "rb") as fin:
        f.write_bytes(fin.read(1 << 20))
    src = resolve_model(f)  # magic is fine; the damage shows when parsing
    with pytest.raises(CorruptModelError, match=f"{f}: truncated"):
        load_model_config(src)


def test_gguf_cut_in_tensor_data(tmp_path: Path) -> None:
    f = tmp_path / "cut.gguf"
    _write_gguf(f, "llama", {"token_embd.weight": (np.ones((256, 8), np.float32), None)})
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(CorruptModelError, match=f"{f}: truncated"):
        iter_weights(resolve_model(f), torch.float32)


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    f = tmp_path / "mamba.gguf"
    _write_gguf(f, "mamba", {"token_embd.weight": (np.zeros((256, 8), np.float32), None)})
    with pytest.raises(UnsupportedArchitectureError, match=f"{f}.*'mamba'"):
        load_model_config(resolve_model(f))


def test_gguf_unsupported_quantization(tmp_path: Path) -> None:
    f = tmp_path / "tq.gguf"
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.TQ1_0]
    tensors = {
        "token_embd.weight": (np.zeros((256, 8), np.float32), None),
        "blk.0.attn_q.weight": (np.zeros((8, type_size), np.uint8), gguf.GGMLQuantizationType.TQ1_0),
    }
    _write_gguf(f, "llama", tensors)
    src = resolve_model(f)
    assert gguf_file.load_config(f).num_layers == 1  # metadata alone is fine
    with pytest.raises(UnsupportedQuantizationError, match=f"{f}: tensor blk.0.attn_q.weight .*TQ1_0"):
        load_model_config(src)  # the whole-model check refuses it before anything is read
    with pytest.raises(UnsupportedQuantizationError, match=f"{f}: tensor blk.0.attn_q.weight .*TQ1_0"):
        iter_weights(src, torch.float32)


def test_gguf_llama3_rope_factors(tmp_path: Path) -> None:
    """A Llama 3.x GGUF stores rope scaling as rope_freqs.weight; we rebuild HF's rope_scaling."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf_cfg = LlamaConfig(
        hidden_size=512,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(scaling),  # a copy: LlamaConfig mutates it
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    base = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128)
    f = tmp_path / "l3.gguf"
    w = gguf.GGUFWriter(str(f), "llama")
    for key, value in dict(block_count=1, context_length=131072, embedding_length=512, feed_forward_length=16,
                           head_count=4, layer_norm_rms_eps=1e-5, vocab_size=256, rope_freq_base=500000.0).items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("rope_freqs.weight", (base / scaled).float().numpy())
    w.add_tensor("token_embd.weight", np.zeros((256, 512), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    src = resolve_model(f)
    assert gguf_file.load_config(f).rope_scaling == scaling  # (a one-tensor file: metadata only)
    assert [name for name, _ in iter_weights(src, torch.float32)] == ["model.embed_tokens.weight"]


def test_hf_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedArchitectureError, match=f"{tmp_path}/config.json.*bert"):
        load_model_config(resolve_model(tmp_path))


def test_hf_config_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(NotAModelError, match=str(tmp_path)):
        resolve_model(tmp_path)


def test_hf_missing_shard(tmp_path: Path) -> None:
    _tiny("llama", False).save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shutil.move(shard, tmp_path / "elsewhere")
    with pytest.raises(CorruptModelError, match=str(shard)):
        iter_weights(resolve_model(tmp_path), torch.float32)


def test_gguf_tokenizer_is_the_one_autotokenizer_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       default_src: ModelSource) -> None:
    """The loader picks the tokenizer class from the file's architecture, skipping AutoTokenizer's
    reading of the whole config (tokenizer.py says why): the result must be what AutoTokenizer builds."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("RUVLLM_CACHE_DIR", str(tmp_path))  # converted here, not read from a cache
    ours = load_tokenizer(default_src)
    path = default_src.path
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    assert type(ours) is type(reference)
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert ours.chat_template == reference.chat_template
    assert ours.special_tokens_map == reference.special_tokens_map
    assert ours.init_kwargs == reference.init_kwargs


def test_the_tokenizer_cache_drops_folders_whose_file_is_gone_or_changed(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         default_src: ModelSource) -> None:
    """Each folder records the file it was converted from; writing a new one removes those no load
    can read again (the key is the file's identity), and keeps the rest."""
    from ruvllm.loader.tokenizer import _SOURCE

    monkeypatch.setenv("RUVLLM_CACHE_DIR", str(tmp_path / "cache"))
    folders = tmp_path / "cache" / "tokenizers"
    kept, changed = tmp_path / "kept.gguf", tmp_path / "changed.gguf"
    kept.write_bytes(b"x")
    changed.write_bytes(b"x")

    def entry(name: str, source: Path | None, size: int = 1) -> Path:
        folder = folders / name
        folder.mkdir(parents=True)
        if source is not None:
            st = source.stat() if source.exists() else None
            (folder / _SOURCE).write_text(json.dumps({"path": str(source.resolve()), "size": size,
                                                      "mtime_ns": st.st_mtime_ns if st else 0}))
        return folder

    entries = {"kept": entry("kept", kept), "changed": entry("changed", changed, size=2),
               "gone": entry("gone", tmp_path / "deleted.gguf"), "unrecorded": entry("unrecorded", None),
               "partial": entry(".partial-x", None)}
    load_tokenizer(default_src)  # converted: a folder written, the cache pruned first
    assert {n for n, f in entries.items() if f.exists()} == {"kept", "partial"}
    (written,) = [f for f in folders.iterdir() if f.name not in ("kept", ".partial-x")]
    recorded = json.loads((written / _SOURCE).read_text())
    assert recorded["path"] == str(default_src.path.resolve()) and recorded["size"] == default_src.path.stat().st_size


def test_gguf_tokenizer_is_cached_as_a_hf_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 default_src: ModelSource) -> None:
    monkeypatch.setenv("RUVLLM_CACHE_DIR", str(tmp_path))
    first = load_tokenizer(default_src)  # converted from GGUF metadata, then written to the cache
    folders = list((tmp_path / "tokenizers").iterdir())
    assert len(folders) == 1 and (folders[0] / "tokenizer.json").is_file()
    second = load_tokenizer(default_src)  # read back from the cache
    text = "café 日本語 <|im_start|>user\nHi<|im_end|>"
    assert second.encode(text) == first.encode(text)
    assert second.chat_template == first.chat_template and second.eos_token_id == first.eos_token_id
    # the added tokens also in tokenizer_config.json, so a load need not parse tokenizer.json for
    # them (tokenizer.py _record_added_tokens): the same tokens come back
    config = json.loads((folders[0] / "tokenizer_config.json").read_text())
    assert len(config["added_tokens_decoder"]) == len(first.added_tokens_decoder) > 0
    assert second.added_tokens_decoder == first.added_tokens_decoder
    assert second.backend_tokenizer.to_str() == first.backend_tokenizer.to_str()
    # read back through the class its tokenizer_config.json names, without AutoTokenizer (tokenizer.py
    # says why): what AutoTokenizer reads from the same folder
    from transformers import AutoTokenizer

    from ruvllm.loader.tokenizer import _cached_class

    reference = AutoTokenizer.from_pretrained(str(folders[0]), local_files_only=True)
    assert _cached_class(folders[0]) is type(second) is type(reference)
    assert second.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert second.chat_template == reference.chat_template
    assert second.special_tokens_map == reference.special_tokens_map and second.init_kwargs == reference.init_kwargs
    other = tmp_path / "other"  # a class of its own, or no readable config: AutoTokenizer's to pick
    other.mkdir()
    assert _cached_class(other) is AutoTokenizer
    (other / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GemmaTokenizer"}))
    assert _cached_class(other) is AutoTokenizer
    (folders[0] / "tokenizer.json").write_text("{broken")
    assert load_tokenizer(default_src).encode(text) == first.encode(text)  # a corrupt cache is rebuilt
    json.loads((folders[0] / "tokenizer.json").read_text())  # the rebuilt cache is valid again
    assert load_tokenizer(default_src).encode(text) == first.encode(text)


@pytest.mark.parametrize(("model_type", "named", "direct"), [
    ("llama", "TokenizersBackend", True), ("mistral", "TokenizersBackend", True),
    ("llama", "PreTrainedTokenizerFast", True),  # Llama 3's folders
    ("qwen2", "TokenizersBackend", False), ("gemma3", "TokenizersBackend", False),
    ("llama", "GPT2Tokenizer", False)])
def test_a_folder_tokenizer_is_the_one_autotokenizer_builds(tmp_path: Path, default_src: ModelSource,
                                                            model_type: str, named: str, direct: bool) -> None:
    """A Hugging Face folder is read through transformers' generic backend directly where its model
    type registers no tokenizer class and it names that backend (tokenizer.py says why), and through
    AutoTokenizer otherwise (qwen2, whose named class AutoTokenizer overrides; gemma3, which has its
    own; a named class of another kind): either way what AutoTokenizer builds from the folder."""
    from transformers import AutoTokenizer

    from ruvllm.loader.tokenizer import _folder_class, load_hf_tokenizer

    load_tokenizer(default_src).save_pretrained(str(tmp_path))  # the default model's: a chat template, added tokens
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": named}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    ours = load_hf_tokenizer(tmp_path)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert (_folder_class(tmp_path) is not AutoTokenizer) == direct
    assert type(ours) is type(reference)
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert ours.chat_template == reference.chat_template
    assert ours.special_tokens_map == reference.special_tokens_map and ours.init_kwargs == reference.init_kwargs


def test_a_generic_folder_tokenizer_loads_without_torch(tiny_model_dir: Path) -> None:
    """`ruvllm serve` and `chat` fronts never import torch; AutoTokenizer would (its config classes do)."""
    import subprocess
    import sys

    code = ("import sys; from ruvllm.loader import load_tokenizer, resolve_model; "
            f"load_tokenizer(resolve_model({str(tiny_model_dir)!r})); assert 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
