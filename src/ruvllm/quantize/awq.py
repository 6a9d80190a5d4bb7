"""AWQ scales: searched on calibration text, folded into the float model (then quantized by awq_writer).

AWQ (Lin et al. 2023, "Activation-aware Weight Quantization") rests on one observation: a weight's
rounding error reaches the output multiplied by the activation of its input channel, and a few
channels carry activations far larger than the rest. Multiplying input channel c of a linear layer
by s_c > 1 and its input by 1/s_c leaves the float output unchanged, but gives those weights a
larger share of their group's int4 grid, so their error relative to their size shrinks (the other
weights of the group lose a little resolution in exchange). The division by s_c costs nothing at
run time: it is folded into whatever produces the input.

For each decoder layer, with the float weights, in float32:
1. Run the layer over the calibration tokens. For each group of linears sharing an input, record
   the mean |x| of each input channel (over all tokens) and a strided subset of the input rows
   (at most `search_tokens`, for the loss below).
2. Search: for alpha = 0, 1/grid, ..., 1 take s = mean|x| ** alpha, normalised so that
   max(s) * min(s) = 1, and measure the mean squared error of the group's output with the weights
   quantized at those scales, X (Q(W diag(s)) diag(s)^-1)^T, against X W^T on the recorded rows.
   Q is the round-to-nearest int4 the checkpoint stores (rtn.int4_checkpoint_grid). The lowest
   error wins. alpha = 0 is s = 1, i.e. plain RTN, so the result is never worse than RTN on these
   rows.
3. Fold: W's input columns are multiplied by s and the producer of the input divided by s:
     o_proj         <- v rows of qkv_proj (and v bias). With grouped-query attention one v channel
                       feeds the same channel of several query heads, so those o_proj inputs share
                       one scale (their mean activations are averaged).
     q/k/v          <- input_layernorm weight
     down_proj      <- up rows of gate_up_proj
     gate/up        <- the MLP's input norm weight (Llama's post_attention_layernorm, Gemma 3's
                       pre_feedforward_layernorm: the layer's MLP_NORM)
   o_proj and down_proj go first: their folds change v and up rows, and q/k/v and gate/up are then
   searched on exactly the weights that will be quantized.

4. Clip (optional, on by default): after its fold, each weight group's range [min, max] (widened
   to hold 0, as the int4 grid always does) may shrink to r * [min, max], r in 1, 0.95, ..., 0.5,
   chosen per output row and group of inputs to minimise the squared error of that group's share
   of the output on the recorded (scaled) inputs: a few outliers then no longer stretch the grid
   of the whole group. The float weights are clamped in place, so the writer's RTN reproduces the
   grid. q and k rows are never clipped (their error is magnified by the attention softmax). A
   group's clipping is kept only where it lowers its output error below the scaled-only one.

The layer inputs are always the float model's (a layer's outputs are computed before its scales
are folded; folding does not change them; clipping does, slightly, but later layers still see the
float model's activations). Candidates that would push a folded norm, v or up value beyond fp16
range (the checkpoint stores those in fp16) are skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ruvllm.config import ModelConfig
from ruvllm.quant.rtn import check_int4_group, int4_checkpoint_grid

DEFAULT_GRID = 20  # alpha steps: 0, 0.05, ..., 1
CLIP_RATIOS = tuple(1.0 - i / 20 for i in range(11))  # each group's range shrunk by up to half
DEFAULT_SEARCH_TOKENS = 512  # input rows per group on which the search measures the output error
_FP16_LIMIT = 6.0e4  # folded values must stay below fp16's max (65504)
_TOKENS_PER_CHUNK = 4096  # calibration tokens run through a layer at once


@dataclass(frozen=True)
class Search:
    """One group's scale search: the scales for the linears' input columns, the chosen alpha, and
    the output MSE on the recorded inputs with those scales and with none (alpha = 0: RTN)."""

    scales: torch.Tensor
    alpha: float
    loss: float
    rtn_loss: float


@dataclass(frozen=True)
class GroupResult:
    """One group of one layer: the alpha chosen, whether clipping was kept, and the output MSE on the
    recorded inputs of the weights as written (loss) and of plain round-to-nearest (rtn_loss)."""

    layer: int
    group: str  # "o_proj", "qkv_proj", "down_proj", "gate_up_proj"
    alpha: float
    loss: float
    rtn_loss: float
    clipped: bool = False


def calibration_ids(token_ids: list[int], samples: int, seq_len: int) -> torch.Tensor:
    """[S, L] blocks of consecutive tokens spread evenly over the text: `samples` blocks of `seq_len`
    where the text is long enough, else as many whole blocks as it holds, else one block of all of it."""
    if samples < 1 or seq_len < 2:
        raise ValueError("calibration needs at least 1 sample of at least 2 tokens")
    if len(token_ids) < 2:
        raise ValueError("the calibration text holds fewer than 2 tokens")
    ids = torch.tensor(token_ids, dtype=torch.long)
    whole = len(ids) // seq_len
    if whole == 0:
        return ids[None, :]
    n = min(samples, whole)
    starts = (torch.arange(n) * whole // n) * seq_len
    return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] after int4 round-to-nearest as the checkpoint stores it, back in float."""
    codes, scale, zero = int4_checkpoint_grid(w, group_size)
    return codes.sub_(zero[..., None]).mul_(scale[..., None]).reshape(w.shape)


def output_mse(x: torch.Tensor, w: torch.Tensor, w_quant: torch.Tensor) -> float:
    """Mean squared difference of x @ w.T and x @ w_quant.T."""
    return (x @ (w_quant - w).t()).pow(2).mean().item()


def search_scale(weight: torch.Tensor, inputs: torch.Tensor, act_mean: torch.Tensor, group_size: int,
                 grid: int = DEFAULT_GRID, tie: tuple[int, int, int] | None = None,
                 producer_absmax: torch.Tensor | None = None) -> Search:
    """The scales, one per input column of weight [N, K], that minimise the quantized output error
    on inputs [T, K] (step 2 of the module docstring).

    tie: (kv_heads, heads per kv head, head_dim) when the K inputs are query-head channels whose
    scales must be shared per kv channel; the search then runs over kv_heads * head_dim scales.
    producer_absmax: per (tied) channel, the largest |value| the fold divides by the scale; a
    candidate pushing it past fp16 range is skipped.
    """
    w = weight.float()
    k = w.shape[1]
    check_int4_group(k, group_size)
    base = act_mean.float()
    if tie is not None:
        kv, rep, dim = tie
        base = base.view(kv, rep, dim).mean(dim=1).reshape(-1)

    def expand(s: torch.Tensor) -> torch.Tensor:
        return s if tie is None else s.view(tie[0], 1, tie[2]).expand(tie).reshape(-1)

    x = inputs.float()
    best: Search | None = None
    rtn_loss = float("nan")
    for i in range(grid + 1):
        alpha = i / grid if grid else 0.0
        s = base.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        if i == 0:
            s = torch.ones_like(base)  # exactly RTN, whatever the rounding of the normalisation
        elif producer_absmax is not None and (producer_absmax / s).max() > _FP16_LIMIT:
            continue
        full = expand(s)
        loss = output_mse(x, w, fake_quantize(w * full, group_size) / full)
        if i == 0:
            rtn_loss = loss
        if best is None or loss < best.loss:
            best = Search(full, alpha, loss, rtn_loss)
    assert best is not None and best.scales.shape[0] == k
    return Search(best.scales, best.alpha, best.loss, rtn_loss)


def clip_weight(weight: torch.Tensor, inputs: torch.Tensor, group_size: int,
                ratios: tuple[float, ...] = CLIP_RATIOS) -> torch.Tensor:
    """weight [N, K] with each (row, group of inputs) clamped to r * [min(w, 0), max(w, 0)], the r of
    `ratios` minimising that group's output error sum_t (x_t . (Q(w) - w))^2 on inputs [T, K]
    (step 4 of the module docstring). A new tensor; ratio 1 leaves a group as it is."""
    w = weight.float()
    n, k = w.shape
    groups = k // group_size
    wg = w.view(n, groups, group_size)
    lo = wg.amin(dim=2, keepdim=True).clamp(max=0.0)
    hi = wg.amax(dim=2, keepdim=True).clamp(min=0.0)
    xg = inputs.float().view(-1, groups, group_size)  # [T, G, g]
    # sum_t (x_t . d)^2 = d^T (X^T X) d: one [g, g] Gram matrix per group, instead of T rows per candidate.
    gram = torch.einsum("tgi,tgj->gij", xg, xg)
    best_err = best_ratio = None
    for r in ratios:
        clipped = torch.minimum(torch.maximum(wg, lo * r), hi * r).reshape(n, k)
        dw = (fake_quantize(clipped, group_size) - w).view(n, groups, group_size)  # [N, G, g]
        err = (torch.einsum("ngi,gij->ngj", dw, gram) * dw).sum(dim=-1)  # [N, G]
        ratio = torch.full_like(err, r)
        if best_err is None:
            best_err, best_ratio = err, ratio
        else:
            better = err < best_err
            best_err, best_ratio = torch.where(better, err, best_err), torch.where(better, ratio, best_ratio)
    r = best_ratio.unsqueeze(-1)  # [N, G, 1]
    return torch.minimum(torch.maximum(wg, lo * r), hi * r).reshape(n, k)


class InputRecorder:
    """Forward pre-hook on a linear: per input channel the mean |x| over all rows (AWQ) and the
    largest |x| (SmoothQuant), and every `stride`-th row (for measuring output errors)."""

    def __init__(self, stride: int) -> None:
        self.stride = stride
        self.abs_sum: torch.Tensor | None = None
        self.abs_max: torch.Tensor | None = None
        self.count = 0
        self.rows: list[torch.Tensor] = []

    def __call__(self, _module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        magnitude = x.abs()
        total = magnitude.sum(dim=0, dtype=torch.float64)
        peak = magnitude.amax(dim=0)
        self.abs_sum = total if self.abs_sum is None else self.abs_sum + total
        self.abs_max = peak if self.abs_max is None else torch.maximum(self.abs_max, peak)
        start = (-self.count) % self.stride  # global row index a multiple of stride
        self.rows.append(x[start::self.stride].clone())
        self.count += x.shape[0]

    @property
    def mean(self) -> torch.Tensor:
        assert self.abs_sum is not None
        return (self.abs_sum / self.count).float()

    @property
    def absmax(self) -> torch.Tensor:
        assert self.abs_max is not None
        return self.abs_max

    @property
    def inputs(self) -> torch.Tensor:
        if len(self.rows) > 1:
            self.rows = [torch.cat(self.rows)]
        return self.rows[0]


def _layer_forward(model: torch.nn.Module, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One decoder layer over [S, L, H] (each sample its own causal sequence): the model's own layer
    definition, with causal attention over the samples in place of the paged-cache backend."""
    s_count, length, hidden = x.shape
    per = max(1, _TOKENS_PER_CHUNK // length)
    out = torch.empty_like(x)
    for first in range(0, s_count, per):
        n = min(per, s_count - first)
        y, residual = model.run_layers(x[first:first + n].reshape(n * length, hidden), torch.arange(length).repeat(n),
                                       model.dense_run(model.ops, sequences=n), layer.index, layer.index + 1)
        out[first:first + n] = (residual + y).view(n, length, hidden)
    return out


@torch.no_grad()
def forward_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[S, L] token ids -> [S, L, V] logits, through the same layer code the calibration runs."""
    x = model.embed(ids).float()
    for layer in model.layers:
        x = _layer_forward(model, layer, x)
    return model.compute_logits(model.norm(x))


# The four groups of linears sharing an input, in folding order: o_proj and down_proj first, as
# their folds rescale v and up rows, which q/k/v and gate/up then see as they will be quantized.
FOLD_ORDER = ("o_proj", "qkv_proj", "down_proj", "gate_up_proj")


def o_proj_tie(cfg: ModelConfig) -> tuple[int, int, int]:
    """(kv heads, query heads per kv head, head_dim): o_proj's inputs that one v channel feeds."""
    return cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim


def _v_rows(cfg: ModelConfig) -> slice:
    return slice(cfg.q_size + cfg.kv_size, cfg.q_size + 2 * cfg.kv_size)


def _up_rows(cfg: ModelConfig) -> slice:
    return slice(cfg.intermediate_size, 2 * cfg.intermediate_size)


def producer_absmax(layer: torch.nn.Module, group: str) -> torch.Tensor:
    """Per channel that fold_scales divides (per kv channel for o_proj), the largest |value| there."""
    cfg = layer.cfg
    if group == "o_proj":
        return layer.qkv_proj.weight.data[_v_rows(cfg)].abs().amax(dim=1)
    if group == "qkv_proj":
        return layer.input_layernorm.weight.data.abs()
    if group == "down_proj":
        return layer.gate_up_proj.weight.data[_up_rows(cfg)].abs().amax(dim=1)
    return getattr(layer, layer.MLP_NORM).weight.data.abs()


@torch.no_grad()
def fold_scales(layer: torch.nn.Module, group: str, scales: torch.Tensor) -> None:
    """Multiply the input columns of `group`'s weight by scales [K] and divide whatever produces that
    input by them, in place, so the float layer computes what it did. The producers are exact
    linear stand-ins: RMSNorm weights for q/k/v and gate/up; for o_proj the v rows (attention
    output is a convex mix of v rows, so scaling v scales it; scales must be tied per kv channel,
    see o_proj_tie); for down_proj the up rows (silu(gate) * up is linear in up)."""
    cfg = layer.cfg
    linear = getattr(layer, group)
    linear.weight.data.mul_(scales)
    if group == "o_proj":
        tie = o_proj_tie(cfg)
        s_v = scales.view(tie)[:, 0, :].reshape(-1)
        rows = _v_rows(cfg)
        layer.qkv_proj.weight.data[rows] /= s_v[:, None]
        if layer.qkv_proj.bias is not None:
            layer.qkv_proj.bias.data[rows] /= s_v
    elif group == "qkv_proj":
        layer.input_layernorm.weight.data /= scales
    elif group == "down_proj":
        layer.gate_up_proj.weight.data[_up_rows(cfg)] /= scales[:, None]
    else:
        getattr(layer, layer.MLP_NORM).weight.data /= scales


@torch.no_grad()
def calibrate(model: torch.nn.Module, ids: torch.Tensor, search_tokens: int = DEFAULT_SEARCH_TOKENS
              ) -> Iterator[tuple[int, torch.nn.Module, dict[str, InputRecorder]]]:
    """Run the float model (ruvllm's float32 LlamaForCausalLM) over calibration ids [S, L] layer by
    layer, yielding (index, layer, what each group's input was). The layer's output, the next
    layer's input, is computed before the layer is yielded: the caller may fold scales into it and
    later layers still see the float model's activations."""
    stride = max(1, -(-ids.numel() // search_tokens))
    x = model.embed(ids).float()
    for index, layer in enumerate(model.layers):
        rec = {name: InputRecorder(stride) for name in FOLD_ORDER}
        hooks = [getattr(layer, name).register_forward_pre_hook(rec[name]) for name in FOLD_ORDER]
        try:
            x = _layer_forward(model, layer, x)
        finally:
            for h in hooks:
                h.remove()
        yield index, layer, rec


@torch.no_grad()
def awq_fold(model: torch.nn.Module, ids: torch.Tensor, group_size: int, grid: int = DEFAULT_GRID,
             search_tokens: int = DEFAULT_SEARCH_TOKENS, clip: bool = True,
             on_layer: Callable[[int], None] | None = None) -> list[GroupResult]:
    """Search and fold AWQ scales into `model` (ruvllm's float32 LlamaForCausalLM, dense weights), in
    place, layer by layer over calibration ids [S, L], then (clip) clamp the weights' groups.
    Without clip the float model computes what it did before. Returns each group's result."""
    tie = o_proj_tie(model.cfg)
    v_rows = _v_rows(model.cfg)
    results: list[GroupResult] = []
    for index, layer, rec in calibrate(model, ids, search_tokens):

        def done(group: str, found: Search, weight: torch.Tensor, inputs: torch.Tensor,
                 clip_rows: slice | None = None) -> None:
            """Record the group's result, clipping its weight (after the fold) where that helps."""
            loss, kept = found.loss, False
            if clip:
                x_in = inputs / found.scales  # the input the folded weight sees
                unclipped = output_mse(x_in, weight, fake_quantize(weight, group_size))
                trial = weight.clone()
                rows = clip_rows if clip_rows is not None else slice(None)
                trial[rows] = clip_weight(weight[rows], x_in, group_size)
                clipped_loss = output_mse(x_in, weight, fake_quantize(trial, group_size))
                if clipped_loss < min(unclipped, found.loss):
                    weight.copy_(trial)
                    loss, kept = clipped_loss, True
            results.append(GroupResult(index, group, found.alpha, loss, found.rtn_loss, kept))

        for group in FOLD_ORDER:
            weight = getattr(layer, group).weight.data
            found = search_scale(weight, rec[group].inputs, rec[group].mean, group_size, grid,
                                 tie=tie if group == "o_proj" else None,
                                 producer_absmax=producer_absmax(layer, group))
            fold_scales(layer, group, found.scales)
            # q and k rows are never clipped: attention's softmax magnifies their error.
            done(group, found, weight, rec[group].inputs, clip_rows=v_rows if group == "qkv_proj" else None)
        if on_layer is not None:
            on_layer(index)
    return results
