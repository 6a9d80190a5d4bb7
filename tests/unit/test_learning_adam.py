"""The instant step's Adam as one call (learning/instant.py adam_step, issue 37 item 1, session 20):
torch's fused kernel called directly, and our C++ over every tensor at once (micro_lora_adam_),
against `Optimizer.step()`: the same bits, step after step; the other settings left to `step()`."""

from __future__ import annotations

import pytest
import torch

from ruvllm.cpu_build import kernels
from ruvllm.learning.instant import adam_step


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((2, 576), (960, 2), (2, 1536), (7,))]


def _run(stepper, params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, steps: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    for i in range(steps):
        opt.zero_grad()
        for j, p in enumerate(params):
            if i == 2 and j == 1:
                continue  # a parameter without a gradient this step: left alone, its step count too
            p.grad = torch.randn(p.shape, generator=g) * 10.0 ** -(j + i % 3)
        stepper(opt)
    return [p.detach().clone() for p in params] + [t for p in params for t in opt.state[p].values()]


@pytest.mark.parametrize("ours", ["torch's kernel", "our C++"])
def test_the_one_call_is_optimizer_step_to_the_bit(ours: str) -> None:
    ext = kernels() if ours == "our C++" else None
    if ours == "our C++" and ext is None:
        pytest.skip("our C++ kernels do not build here")
    for kwargs in ({"lr": 1e-2}, {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.01}):
        a, b = _params(1), _params(1)
        mine = _run(lambda opt: adam_step(opt, ext), a, torch.optim.Adam(a, fused=True, **kwargs))
        theirs = _run(lambda opt: opt.step(), b, torch.optim.Adam(b, fused=True, **kwargs))
        assert len(mine) == len(theirs) == 4 * len(a)
        for x, y in zip(mine, theirs):
            assert torch.equal(x, y)
        assert not torch.equal(mine[0], _params(1)[0])  # it moved


def test_our_adam_refuses_tensors_out_of_its_layout() -> None:
    ext = kernels()
    if ext is None:
        pytest.skip("our C++ kernels do not build here")
    p, g = torch.zeros(4), torch.zeros(5)
    with pytest.raises(RuntimeError, match="size"):
        ext.micro_lora_adam_([p], [g], [torch.zeros(4)], [torch.zeros(4)], [torch.zeros(())], 1e-2, 0.9, 0.999,
                             1e-8, 0.0)


def test_other_optimizers_and_settings_take_optimizer_step() -> None:
    """What the one call does not cover runs `step()` itself: the same result as calling it."""
    for make in (lambda p: torch.optim.Adam(p, lr=1e-2),  # not fused: the per-tensor loop
                 lambda p: torch.optim.Adam(p, lr=1e-2, fused=True, amsgrad=True),
                 lambda p: torch.optim.Adam(p, lr=1e-2, fused=True, maximize=True),
                 lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
                 lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9)):
        a, b = _params(2), _params(2)
        ours = _run(adam_step, a, make(a))
        theirs = _run(lambda opt: opt.step(), b, make(b))
        for x, y in zip(ours, theirs):
            assert torch.equal(x, y)
