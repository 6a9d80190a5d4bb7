"""Which quantized checkpoint a Hugging Face config.json describes (its `quantization_config`): read
by the model checks without torch; quant/checkpoints.py reads the tensors it names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ruvllm.errors import UnsupportedQuantizationError


@dataclass(frozen=True)
class CheckpointQuant:
    method: str  # "gptq" or "awq"
    group_size: int  # -1: one group over all inputs
    zero_offset: int  # added to stored zero points (GPTQ v1 stores z - 1)

    @property
    def parts(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales", "g_idx") if self.method == "gptq" else ("qweight", "qzeros", "scales")


def checkpoint_quant(config: dict[str, Any], source: str) -> CheckpointQuant | None:
    """The scheme named by config.json's quantization_config, or None for a plain checkpoint."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise UnsupportedQuantizationError(f"{source}: quantization method {method!r} is not supported "
                                           "(supported checkpoints: gptq, awq)")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise UnsupportedQuantizationError(f"{source}: {method} with {bits}-bit weights is not supported (4 only)")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise UnsupportedQuantizationError(f"{source}: AWQ version {qc.get('version')!r} is not supported (gemm only)")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    offset = 1 if method == "gptq" and str(qc.get("checkpoint_format", "gptq")).lower() == "gptq" else 0
    return CheckpointQuant(method, group, offset)
