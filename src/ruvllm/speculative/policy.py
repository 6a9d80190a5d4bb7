"""How many proposals a sequence should have scored this step.

Scoring k proposals costs the target k more rows in its pass (and a draft model k passes of its
own); it pays only when enough of them are accepted. Each sequence keeps a decayed count of its
proposals' outcomes, which estimates alpha, the chance that the next proposal is accepted given
the ones before it were. With alpha and the measured costs the expected yield of k proposals is
E(k) = 1 + alpha + ... + alpha^k tokens for a step costing c(k) = 1 + (row_cost + draft_cost) k
plain steps; the policy picks the k (0 to what is on offer) with the most tokens per unit of cost,
so a sequence whose proposals keep failing stops paying for them, and one that copies its prompt
uses all K. A sequence's first offer, and every PROBE_EVERY-th offer it declines in a row, is
tried with one proposal anyway, so the estimate keeps learning (a text can turn repetitive).
Proposals are exact whatever k is (verify.py), so this only changes speed."""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_EVERY = 16


@dataclass
class _Outcomes:
    accepted: float
    tried: float
    declined: int = 0  # offers declined since the last proposal


@dataclass
class SpeculationPolicy:
    row_cost: float  # one more row in the target's pass, in plain decode steps
    draft_cost: float = 0.0  # one draft pass, in plain decode steps (0 for prompt lookup)
    prior: tuple[float, float] = (1.0, 2.0)  # (accepted, tried): alpha starts at 0.5
    decay: float = 0.8  # per verification: about the last five count
    _seen: dict[str, _Outcomes] = field(default_factory=dict)

    def length(self, request_id: str, offered: int) -> int:
        """The number of proposals (0..offered) with the best expected tokens per unit of cost."""
        if not offered:
            return 0
        o = self._seen.get(request_id)
        if o is None:  # the first offer: try one
            self._seen[request_id] = _Outcomes(*self.prior)
            return 1
        alpha = min(o.accepted / o.tried, 0.999)
        step = self.row_cost + self.draft_cost
        best, best_k = 1.0, 0
        gain, term = 1.0, 1.0
        for k in range(1, offered + 1):
            term *= alpha
            gain += term
            rate = gain / (1.0 + step * k)
            if rate > best:
                best, best_k = rate, k
        if best_k:
            o.declined = 0
            return best_k
        o.declined += 1
        if o.declined >= PROBE_EVERY:
            o.declined = 0
            return 1
        return 0

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verification kept `accepted` of `proposed`: positions up to the first rejection were tried."""
        if not proposed:
            return
        o = self._seen.get(request_id)
        if o is None:
            o = self._seen[request_id] = _Outcomes(*self.prior)
        o.accepted = o.accepted * self.decay + accepted
        o.tried = o.tried * self.decay + min(accepted + 1, proposed)

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)


def step_seconds(runner, rows: int, repeats: int = 5) -> float:  # noqa: ANN001  (a ModelRunner)
    """The fastest of `repeats` forward passes (and LM head) over `rows` tokens of one sequence in the
    runner's scratch block (which padding rows already write: nothing of a sequence's is touched)."""
    import time

    import torch

    from ruvllm.outputs import ScheduledSeq, SchedulerOutput

    rows = min(rows, runner.block_size)
    so = SchedulerOutput(seqs=[ScheduledSeq("cost", [0] * rows, 0, [runner.scratch_block], True)])
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms up
        start = time.perf_counter()
        runner.logits_at(so.seqs, list(range(rows)))  # every row's logits, as verification needs
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        best = min(best, time.perf_counter() - start)
    return best
