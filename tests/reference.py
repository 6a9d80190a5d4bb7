"""Test helpers: a transformers reference model on the same weights, and direct runs of our model."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.initialization import no_init_weights

from ruvllm.config import ModelConfig
from ruvllm.core.adapters import AdapterRun
from ruvllm.core.kv_cache_manager import KVCacheManager
from ruvllm.kv_groups import kv_layout
from ruvllm.loader import ModelSource, iter_weights, load_model_config
from ruvllm.models.registry import build_model
from ruvllm.outputs import ScheduledSeq, SchedulerOutput
from ruvllm.request import Request, scaling_key
from ruvllm.sampling_params import SamplingParams
from ruvllm.worker.model_runner import ModelRunner

_HF = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (LlamaConfig, LlamaForCausalLM),
       "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def hf_reference(src: ModelSource) -> torch.nn.Module:
    """transformers' own modelling code loaded with the tensors our loader reads (fp32).

    (That our loader reads the same tensors as transformers' GGUF loader is tested in test_loader.)"""
    cfg = load_model_config(src)
    if cfg.architecture == "gemma3" and src.format == "hf":  # transformers reads the folder itself
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(src.path), dtype=torch.float32).eval()
    config_cls, model_cls = _HF[cfg.architecture]
    kwargs = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                  rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
                  tie_word_embeddings=cfg.tie_word_embeddings)
    if cfg.rope_scaling:
        kwargs["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.architecture == "llama":
        kwargs["attention_bias"] = cfg.attention_bias
    # Every weight is loaded below, so transformers' random init (~5 s of ~9 for the 135M default
    # model) is skipped; a weight the files lack would stay uninitialized, hence the strict check.
    with no_init_weights():
        model = model_cls(config_cls(**kwargs)).float().eval()
    missing, unexpected = model.load_state_dict(dict(iter_weights(src, torch.float32)), strict=False)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    assert not unexpected and set(missing) <= tied, (missing, unexpected)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


class DirectRunner:
    """Our model, KV manager and runner driven step by step without the scheduler, to read logits."""

    def __init__(self, src: ModelSource, block_size: int = 16, num_blocks: int = 64) -> None:
        self.cfg: ModelConfig = load_model_config(src)
        model = build_model(self.cfg, iter_weights(src, torch.float32), str(src.path),
                            self.cfg.max_position_embeddings, torch.float32)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False,
                                 windows=kv_layout(self.cfg).windows)
        self.runner = ModelRunner(model, self.cfg, block_size, num_blocks, torch.float32)

    def prefill_then_decode(self, prompt: list[int], continuation: list[int], chunk: int | None = None) -> torch.Tensor:
        """Logits after the prompt and after each teacher-forced continuation token: [1 + len(cont), V]."""
        out = teacher_forced_logits(self.kv, self.runner, prompt, continuation, chunk)
        assert self.kv.num_free_blocks == self.kv.pool.num_blocks
        return out


def teacher_forced_logits(kv: KVCacheManager, runner: ModelRunner, prompt: list[int], continuation: list[int],
                          chunk: int | None = None, adapter: str | None = None) -> torch.Tensor:
    """Logits after the prompt (prefilled in chunks of `chunk`, or at once) and after each
    teacher-forced continuation token, through a runner and KV manager without the scheduler:
    [1 + len(continuation), V]. `adapter`: a LoRA adapter or X-LoRA model loaded in the runner's worker."""
    served = runner.lora.get(adapter) if adapter is not None else None
    run = AdapterRun(adapter, 0, served.num_slots, served.scaling_pass) if served is not None else None
    req = Request("r", list(prompt), SamplingParams(), adapter=run)
    out = []
    pending = list(prompt)
    for tok in [None] + continuation:
        if tok is not None:
            req.output_token_ids.append(tok)
            pending = [tok]
        while pending:
            n = len(pending) if chunk is None else min(chunk, len(pending))
            assert kv.allocate_slots(req, n)
            tables = kv.block_tables("r")
            seq = ScheduledSeq("r", pending[:n], req.num_computed_tokens, tables[0],
                               sample=n == len(pending), adapter=adapter,
                               scaling_block_table=kv.block_table(scaling_key("r")) if req.scaling_pass else None,
                               group_block_tables=tables[1:])
            logits, _ = runner.compute_logits(SchedulerOutput([seq]))
            req.num_computed_tokens += n
            pending = pending[n:]
        out.append(logits[0])
    kv.free(req)
    return torch.stack(out)
