"""Whether a model source can be loaded, decided from its headers before anything is allocated.

check_model reads GGUF metadata and tensor infos (gguf_header.py) or config.json and safetensors
headers (safetensors_header.py), never tensor data, and checks that
- every config number is in a sane range (limits.py, applied by both config readers);
- the layer count is the number of layers the tensors hold;
- every tensor the model needs is present with the shape the config implies, and none is left over
  (GPTQ/AWQ: every quantized linear has all its packed parts);
- every tensor's data lies inside its file, and the shards an index lists exist and hold their tensors;
- the tokenizer is there (HF: its files exist and parse; GGUF: a token list no longer than the vocabulary);
- every config value the loader reads has its type (an integer is never "576" or 64.0, a flag never
  "false": transformers refuses those when it builds the tokenizer, so these checks refuse them first).
The loader (load_model_config) and `ruvllm info` both call it, so they agree on what loads.
Every failure is a ModelLoadError of one line: "<file>: <field or tensor>: <what is wrong>".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from gguf.constants import GGUFValueType

from ruvllm.config import ModelConfig
from ruvllm.errors import CorruptModelError, ModelLoadError
from ruvllm.loader import gguf_file, hf_folder
from ruvllm.loader.gguf_header import GGUFArray, read_header
from ruvllm.loader.safetensors_header import read_safetensors_header
from ruvllm.quant.checkpoint_scheme import CheckpointQuant, checkpoint_quant

if TYPE_CHECKING:
    from ruvllm.loader import ModelSource

# Files a Hugging Face tokenizer can be built from: the fast tokenizer's own file, or a slow
# tokenizer's vocabulary (SentencePiece model, or BPE vocab.json + merges.txt) that transformers converts.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_JSON_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_LAYER = re.compile(r"layers\.(\d+)\.")
_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class _Stored:
    """A tensor as a file holds it."""

    name: str  # as the file spells it (GGUF: blk.0.attn_q.weight)
    shape: tuple[int, ...]  # torch order
    file: Path


@dataclass(frozen=True)
class _Dim:
    size: int
    label: str  # the config field(s) it comes from


def check_model(src: ModelSource, *, tokenizer: bool = True) -> ModelConfig:
    """The model's checked config, or the first problem as a one-line ModelLoadError.

    tokenizer=False leaves the tokenizer out: weights-only folders (tests, `ruvllm quantize`'s
    inputs) are readable without one, and load_tokenizer checks it when it is needed.
    """
    if src.format == "gguf":
        cfg = _check_gguf(src.path)
    else:
        cfg = _check_hf(src.path)
    if tokenizer:
        check_tokenizer(src)
    return cfg


def check_tokenizer(src: ModelSource) -> None:
    if src.format == "gguf":
        header = read_header(src.path)
        model, tokens = header.get("tokenizer.ggml.model"), header.get("tokenizer.ggml.tokens")
        if not isinstance(model, str):
            raise ModelLoadError(f"{src.path}: tokenizer.ggml.model: missing (the file carries no tokenizer)")
        if not (isinstance(tokens, GGUFArray) and tokens.item_type == GGUFValueType.STRING and tokens.count):
            raise ModelLoadError(f"{src.path}: tokenizer.ggml.tokens: missing or empty (the file carries no tokenizer)")
        vocab, key = gguf_file.vocab_source(header)
        if vocab is not None and tokens.count > vocab:
            raise CorruptModelError(f"{src.path}: tokenizer.ggml.tokens: {tokens.count} tokens, more than the "
                                    f"{vocab} embeddings of {key}")
        return
    folder = src.path
    if (folder / hf_folder.CONFIG_FILE).is_file():  # transformers reads it too, and refuses a wrong type
        hf_folder.load_config(folder)  # there, naming the tokenizer (LLM loads the tokenizer first)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{folder / TOKENIZER_FILES[0]}: missing, and no {' or '.join(TOKENIZER_FILES[1:])} "
                             "either: the folder has no tokenizer")
    for name in _JSON_TOKENIZER_FILES:
        file = folder / name
        if not file.is_file():
            continue
        try:
            # The whole file's syntax, its top level an object, without building its values: Gemma 3's
            # 33 MB tokenizer.json took 1.2-1.5 s of CPU through json.loads, 0.09 s so (session 31).
            msgspec.json.decode(file.read_bytes(), type=dict[str, msgspec.Raw])
        except OSError as e:
            raise ModelLoadError(f"{file}: cannot read ({e.strerror or e})") from None
        except msgspec.ValidationError as e:  # (a DecodeError too: first)
            raise CorruptModelError(f"{file}: expected a JSON object ({e})") from None
        except msgspec.DecodeError as e:
            raise CorruptModelError(f"{file}: not valid JSON ({e}); the file is truncated or corrupt") from None


# ------------------------------------------------------------------ the two formats


def _check_gguf(path: Path) -> ModelConfig:
    header = read_header(path)  # bounded walk: counts, lengths, tensor data inside the file
    cfg = gguf_file.config_from_header(header)  # numbers in range
    gguf_file.check_tensor_kinds(header, cfg.architecture)  # readable types, known names
    names = gguf_file.field_names(header)
    stored: dict[str, _Stored] = {}
    for t in header.tensors:
        hf = gguf_file.hf_name(t.name, cfg.architecture)
        if hf is not None:  # (rope_freqs.weight: folded into the config)
            stored[hf.removeprefix("model.")] = _Stored(t.name, t.shape, path)
    if not stored:
        raise CorruptModelError(f"{path}: GGUF.tensor_count: the file holds no weights")

    def shown(key: str) -> str:
        return gguf_file.gguf_name(key if key == "lm_head.weight" else f"model.{key}", cfg.architecture) or key

    _check_tensors(cfg, stored, names, config_file=path, missing_in=path, shown=shown, scheme=None)
    return cfg


def _check_hf(folder: Path) -> ModelConfig:
    cfg = hf_folder.load_config(folder)  # numbers in range
    config_file = folder / hf_folder.CONFIG_FILE
    raw = hf_folder.read_config_json(folder)
    scheme = checkpoint_quant(raw, str(config_file))
    index = folder / hf_folder.INDEX_FILE
    listed: list[tuple[str, Path, tuple[int, ...]]] = []  # (name, file, shape) the loader will read
    if index.is_file():
        weight_map = hf_folder.read_index(folder)
        if not weight_map:
            raise CorruptModelError(f"{index}: weight_map: empty (the model has no tensors)")
        by_file: dict[Path, list[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, []).append(name)
        for file, wanted in by_file.items():
            if not file.is_file():
                raise CorruptModelError(f"{file}: listed in {hf_folder.INDEX_FILE} but missing")
            header = read_safetensors_header(file)
            for name in wanted:
                if name not in header:
                    raise CorruptModelError(f"{file}: {name}: listed in {hf_folder.INDEX_FILE} but not in this file")
                listed.append((name, file, header[name].shape))
        missing_in = index
    else:
        single = folder / hf_folder.SINGLE_WEIGHTS_FILE
        listed = [(name, single, entry.shape) for name, entry in read_safetensors_header(single).items()]
        if not listed:
            raise CorruptModelError(f"{single}: holds no tensors")
        missing_in = single
    stored: dict[str, _Stored] = {}
    for name, file, shape in listed:
        # The loader's own skips (hf_weights._generate, LlamaForCausalLM.load_weights).
        if name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        key = name.removeprefix("model.")
        if key in stored:
            raise CorruptModelError(f"{file}: {name}: the same tensor as {stored[key].name} in {stored[key].file}")
        stored[key] = _Stored(name, shape, file)

    def shown(key: str) -> str:
        return key if key == "lm_head.weight" else f"model.{key}"

    _check_tensors(cfg, stored, hf_folder.field_names(raw), config_file=config_file, missing_in=missing_in,
                   shown=shown, scheme=scheme)
    return cfg


# ------------------------------------------------------------------ tensors against the config


def expected_shapes(cfg: ModelConfig, names: Mapping[str, str]) -> dict[str, tuple[_Dim, ...]]:
    """Every tensor the model loads (Hugging Face names without "model."), with its shape and where
    each size comes from: what LlamaForCausalLM.load_weights will accept."""
    vocab, hidden = _Dim(cfg.vocab_size, names["vocab_size"]), _Dim(cfg.hidden_size, names["hidden_size"])
    inter = _Dim(cfg.intermediate_size, names["intermediate_size"])
    q = _Dim(cfg.q_size, f"{names['num_heads']} x {names['head_dim']}")
    kv = _Dim(cfg.kv_size, f"{names['num_kv_heads']} x {names['head_dim']}")
    head = _Dim(cfg.head_dim, names["head_dim"])
    shapes: dict[str, tuple[_Dim, ...]] = {"embed_tokens.weight": (vocab, hidden)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "self_attn.q_proj.weight": (q, hidden),
                   p + "self_attn.k_proj.weight": (kv, hidden), p + "self_attn.v_proj.weight": (kv, hidden)}
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (head,), p + "self_attn.k_norm.weight": (head,)}
        shapes |= {p + "self_attn.o_proj.weight": (hidden, q), p + "post_attention_layernorm.weight": (hidden,),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter)}
        if cfg.architecture == "gemma3":  # norms before and after the MLP too
            shapes |= {p + "pre_feedforward_layernorm.weight": (hidden,),
                       p + "post_feedforward_layernorm.weight": (hidden,)}
    shapes["norm.weight"] = (hidden,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _check_tensors(cfg: ModelConfig, stored: dict[str, _Stored], names: Mapping[str, str], *, config_file: Path,
                   missing_in: Path, shown: Callable[[str], str], scheme: CheckpointQuant | None) -> None:
    _check_layer_count(cfg, stored, names, config_file)
    used: set[str] = set()
    linears = {f"layers.{i}.{m}" for i in range(cfg.num_layers) for m in _LINEARS} | {"lm_head"}
    for key, dims in expected_shapes(cfg, names).items():
        prefix, _, leaf = key.rpartition(".")
        if scheme is not None and leaf == "weight" and prefix in linears and key not in stored:
            _check_packed(prefix, shown(key).removesuffix(".weight"), dims, stored, scheme, missing_in, used)
            continue
        if key not in stored:
            raise CorruptModelError(f"{missing_in}: {shown(key)}: missing")
        _check_shape(stored[key], dims)
        used.add(key)
    for key, t in stored.items():
        if key in used:
            continue
        prefix, _, leaf = key.rpartition(".")
        if scheme is not None and leaf == "bias" and prefix in linears:
            continue  # GPTQ exporters write all-zero biases; the loader drops those and refuses others
        raise CorruptModelError(f"{t.file}: {t.name}: unexpected tensor for a {cfg.architecture} model "
                                f"with this config")


def _check_layer_count(cfg: ModelConfig, stored: Mapping[str, _Stored], names: Mapping[str, str],
                       config_file: Path) -> None:
    held = sorted({int(m.group(1)) for key in stored if (m := _LAYER.match(key))})
    if held == list(range(cfg.num_layers)):
        return
    field = names["num_layers"]
    if not held:
        raise CorruptModelError(f"{config_file}: {field}: {cfg.num_layers}, but the weights hold no layers")
    raise CorruptModelError(f"{config_file}: {field}: {cfg.num_layers}, but the weights hold {len(held)} "
                            f"layers ({_spans(held)})")


def _spans(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    text = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans[:4])
    return text + (", ..." if len(spans) > 4 else "")


def _check_shape(t: _Stored, dims: Iterable[_Dim]) -> None:
    dims = tuple(dims)
    if t.shape != tuple(d.size for d in dims):
        expected = ", ".join(f"{d.size} ({d.label})" for d in dims)
        raise CorruptModelError(f"{t.file}: {t.name}: shape {list(t.shape)}, expected [{expected}]")


def _check_packed(prefix: str, layer: str, dims: tuple[_Dim, ...], stored: Mapping[str, _Stored],
                  scheme: CheckpointQuant, missing_in: Path, used: set[str]) -> None:
    """A GPTQ/AWQ linear: all of its packed parts present, and qweight's shape exact (it fixes the
    weight's shape: GPTQ packs eight inputs to an int32 [K/8, N], AWQ eight outputs [K, N/8]).
    qzeros, scales and g_idx are checked for presence only: their shapes depend on the group size
    and are checked against qweight when the layer is unpacked (quant/checkpoints.py)."""
    parts = {part: stored.get(f"{prefix}.{part}") for part in scheme.parts}
    lacking = [part for part, t in parts.items() if t is None]
    if len(lacking) == len(parts):
        raise CorruptModelError(f"{missing_in}: {layer}: missing (neither .weight nor {scheme.method} "
                                f"{', '.join(scheme.parts)})")
    if lacking:
        raise CorruptModelError(f"{missing_in}: {layer}: lacks {', '.join(lacking)} of its {scheme.method} tensors")
    n, k = dims
    qweight = parts["qweight"]
    assert qweight is not None
    want = ((k.size // 8, n.size) if scheme.method == "gptq" else (k.size, n.size // 8))
    if qweight.shape != want:
        labels = (f"{k.label} / 8", n.label) if scheme.method == "gptq" else (k.label, f"{n.label} / 8")
        raise CorruptModelError(f"{qweight.file}: {qweight.name}: shape {list(qweight.shape)}, expected "
                                f"[{want[0]} ({labels[0]}), {want[1]} ({labels[1]})]")
    used.update(f"{prefix}.{part}" for part in scheme.parts)


__all__ = ["TOKENIZER_FILES", "check_model", "check_tokenizer", "expected_shapes"]
