"""Training an X-LoRA classifier with peft (`ruvllm xlora train`): the base model (dequantized to
float32, as transformers' model) and the adapters frozen, only the classifier learns, on the CPU.

The loss is the causal-LM loss on the texts (as peft and the X-LoRA paper train), plus, for texts
labelled with the adapter that suits them, a routing term: the cross-entropy of the mean scaling
(over the text's tokens and the adapted modules) against that adapter, weighted by
`routing_weight` (0: the LM loss alone). Labelled texts held out of training measure routing: the
share whose mean scaling's argmax is their adapter.

The checkpoint is peft's `save_pretrained`, with the whole classifier written to the top-level
safetensors (peft's own save loses its first linear) and without peft's per-adapter subfolders
(copies of base tensors that peft's loader does not read): `adapter_config.json` names the
adapters' folders, as peft writes it.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ruvllm.errors import AdapterError


@dataclass(frozen=True)
class XLoraTrainConfig:
    depth: int = 2
    size: int = 256
    layerwise_scalings: bool = False
    softmax_temperature: float = 1.0
    top_k: int | None = None
    epochs: int = 3
    batch_size: int = 8
    lr: float = 1e-3
    max_tokens: int = 128  # per text: longer ones are cut
    routing_weight: float = 1.0
    eval_fraction: float = 0.2  # of the labelled texts, held out to measure routing
    seed: int = 0


@dataclass(frozen=True)
class Example:
    text: str
    label: int | None = None  # index of the adapter that suits the text


@dataclass
class TrainResult:
    steps: int = 0
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    routing_accuracy: float | None = None  # on the held-out labelled texts
    held_out: int = 0
    per_label: dict[int, tuple[int, int]] = field(default_factory=dict)  # label -> (right, total)


def read_examples(path: Path, adapter_names: list[str]) -> list[Example]:
    """JSON lines: {"text": ...} with an optional "adapter" (an index into --adapters, or the name
    of one of their folders). Errors name the line."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    examples = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"].strip():
            raise ValueError(f"{path}:{n}: each line must be an object with a non-empty \"text\"")
        label = row.get("adapter")
        if label is not None:
            if isinstance(label, str) and label in adapter_names:
                label = adapter_names.index(label)
            if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(adapter_names):
                raise ValueError(f"{path}:{n}: \"adapter\" must be one of {', '.join(adapter_names)} or an index "
                                 f"below {len(adapter_names)}, got {label!r}")
        examples.append(Example(row["text"], label))
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


def transformers_model(src: Any) -> torch.nn.Module:
    """transformers' model of a source ruvllm loads (GGUF and packed weights dequantized), float32."""
    from transformers import AutoModelForCausalLM

    from ruvllm.loader import iter_weights, load_model_config
    from ruvllm.loader.hf_writer import hf_config

    cfg = load_model_config(src)
    model = AutoModelForCausalLM.from_config(hf_config(cfg, torch.float32), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dict(iter_weights(src, torch.float32)), strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise ValueError(f"{src.path}: transformers' model does not take these weights "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.config.use_cache = False  # peft's X-LoRA runs both passes over the whole sequence
    return model


def train_xlora(model: torch.nn.Module, tokenizer: Any, adapters: list[Path], examples: list[Example], out: Path,
                config: XLoraTrainConfig, on_step: Callable[[int, int, float], None] | None = None,
                replace: bool = False) -> TrainResult:
    """Train the classifier over `adapters` (PEFT LoRA folders) on `examples`; write the checkpoint to `out`."""
    from peft import XLoraConfig, get_peft_model

    rng = random.Random(config.seed)
    labelled = [e for e in examples if e.label is not None]
    rng.shuffle(labelled)
    held = labelled[:int(len(labelled) * config.eval_fraction)]
    held_ids = {id(e) for e in held}
    train = [e for e in examples if id(e) not in held_ids]
    if not train:
        raise ValueError("no examples left to train on (lower --eval-fraction)")
    torch.manual_seed(config.seed)
    xcfg = XLoraConfig(task_type="CAUSAL_LM", hidden_size=model.config.hidden_size,
                       adapters={str(i): str(p.absolute()) for i, p in enumerate(adapters)},
                       xlora_depth=config.depth, xlora_size=config.size, layerwise_scalings=config.layerwise_scalings,
                       softmax_temperature=config.softmax_temperature, top_k_lora=config.top_k,
                       enable_softmax_topk=config.top_k is not None, enable_softmax=config.top_k is None)
    try:
        xlora = get_peft_model(model, xcfg)
    except (ValueError, KeyError, OSError) as e:
        raise AdapterError(f"peft cannot build the X-LoRA model over these adapters: {e}") from None
    classifier = xlora.base_model.internal_xlora_classifier
    params = [p for p in classifier.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr)
    batches = -(-len(train) // config.batch_size)
    total = config.epochs * batches
    result = TrainResult()
    for epoch in range(config.epochs):
        order = list(train)
        rng.shuffle(order)
        xlora.train()
        for b in range(batches):
            batch = order[b * config.batch_size:(b + 1) * config.batch_size]
            ids, mask = _encode(tokenizer, [e.text for e in batch], config.max_tokens)
            labels = ids.masked_fill(mask == 0, -100)
            loss = xlora(input_ids=ids, attention_mask=mask, labels=labels).loss
            routed = [(i, e.label) for i, e in enumerate(batch) if e.label is not None]
            if routed and config.routing_weight > 0:
                mean = _mean_scalings(xlora, mask)
                rows = torch.tensor([i for i, _ in routed])
                target = torch.tensor([lab for _, lab in routed])
                loss = loss + config.routing_weight * torch.nn.functional.nll_loss(
                    mean[rows].clamp_min(1e-9).log(), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            result.steps += 1
            value = float(loss.detach())
            if result.steps == 1:
                result.first_loss = value
            result.last_loss = value
            if on_step is not None:
                on_step(result.steps, total, value)
    xlora.eval()
    if held:
        _measure_routing(xlora, tokenizer, held, config, result)
    _write_checkpoint(xlora, out, len(adapters), replace)
    return result


def _encode(tokenizer: Any, texts: list[str], max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [tokenizer.encode(t)[:max_tokens] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return ids, mask


def _mean_scalings(xlora: torch.nn.Module, mask: torch.Tensor) -> torch.Tensor:
    """Each text's scalings of the last forward, averaged over its tokens and the modules: [B, adapters]."""
    scalings = xlora.base_model.internal_xlora_scalings  # [B, T, modules, adapters]
    per_token = scalings.mean(dim=2)
    m = mask.unsqueeze(-1).to(per_token.dtype)
    return (per_token * m).sum(dim=1) / m.sum(dim=1)


@torch.no_grad()
def _measure_routing(xlora: torch.nn.Module, tokenizer: Any, held: list[Example], config: XLoraTrainConfig,
                     result: TrainResult) -> None:
    right = 0
    for b in range(0, len(held), config.batch_size):
        batch = held[b:b + config.batch_size]
        ids, mask = _encode(tokenizer, [e.text for e in batch], config.max_tokens)
        xlora(input_ids=ids, attention_mask=mask)
        picks = _mean_scalings(xlora, mask).argmax(dim=-1).tolist()
        for e, pick in zip(batch, picks):
            ok, n = result.per_label.get(e.label, (0, 0))
            result.per_label[e.label] = (ok + (pick == e.label), n + 1)
            right += pick == e.label
    result.held_out = len(held)
    result.routing_accuracy = right / len(held)


def _write_checkpoint(xlora: torch.nn.Module, out: Path, n_adapters: int, replace: bool) -> None:
    """Written beside `out` and renamed onto it once whole: a failed write leaves `out` as it was."""
    from safetensors.torch import save_file

    from ruvllm.loader.hf_writer import folder_in_place

    with folder_in_place(out, replace=replace) as tmp:
        xlora.save_pretrained(tmp)
        classifier = xlora.base_model.internal_xlora_classifier
        tensors = {f"base_model.internal_xlora_classifier.layers.{k}": v.detach().contiguous()
                   for k, v in classifier.layers.state_dict().items()}
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        for i in range(n_adapters):
            shutil.rmtree(tmp / str(i), ignore_errors=True)
