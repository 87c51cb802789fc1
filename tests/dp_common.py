"""Model, data and single-process references shared by the data-parallel tests (gloo and MPI)."""

from __future__ import annotations

import torch
from torch import nn

from hetcoll.torch import BalancedSampler


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    ).double()


def make_data(n: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (n,), generator=g
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(b.norm(), 1e-300))


def reference_step(n: int):
    """Gradients and parameters after one SGD step of one process on the whole batch."""
    x, y = make_data(n)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


N_EPOCH, CHANGE_AT, EPOCH_SEED = 53, 2, 3


def epoch_plan(shares_before, shares_after, world):
    """Every rank's index batches, step by step, as BalancedSampler plans them, with the shares
    changed after step CHANGE_AT - 1."""
    samplers = [
        BalancedSampler(range(N_EPOCH), shares_before, r, seed=EPOCH_SEED, verify=False)
        for r in range(world)
    ]
    iters = [iter(s.batch_sampler()) for s in samplers]
    steps = []
    while True:
        if len(steps) == CHANGE_AT:
            for s in samplers:
                s.set_shares(shares_after)
        batch = [next(it, None) for it in iters]
        if batch[0] is None:
            assert all(b is None for b in batch)
            return steps
        steps.append(batch)


def reference_epoch(steps):
    """Parameters after one process trains on the concatenated global batches of ``steps``."""
    x, y = make_data(N_EPOCH)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in steps:
        idx = [i for b in step for i in b]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]
