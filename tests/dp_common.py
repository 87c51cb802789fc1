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


def gan_nets() -> tuple[nn.Module, nn.Module]:
    """A generator (3 -> 5) and a discriminator (5 -> 1), float64."""
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 5)).double()
    d = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    return g, d


#: Each step's rows per rank (2 ranks): the shares change every step, as a Rebalancer's would.
GAN_SHARES = ([8, 2], [3, 7], [6, 4])


def gan_step(g, d, opt_g, opt_d, z, real, freeze: bool) -> None:
    """One GAN step: the discriminator on real and (detached) fake samples, then the generator
    through the discriminator, which is frozen for it (``freeze``, as pix2pix does) or has its
    gradients zeroed before its own next step."""
    bce = nn.functional.binary_cross_entropy_with_logits
    fake = g(z)
    d_real, d_fake = d(real), d(fake.detach())
    opt_d.zero_grad()
    (bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))).backward()
    opt_d.step()
    opt_g.zero_grad()
    d.requires_grad_(not freeze)
    d_gen = d(fake)
    bce(d_gen, torch.ones_like(d_gen)).backward()
    opt_g.step()
    d.requires_grad_(True)


def gan_data(step: int):
    g = torch.Generator().manual_seed(10 + step)
    n = sum(GAN_SHARES[step])
    return (
        torch.randn(n, 3, generator=g, dtype=torch.float64),
        torch.randn(n, 5, generator=g, dtype=torch.float64),
    )


def gan_reference(freeze: bool) -> list[torch.Tensor]:
    """Both nets' parameters after one process trained on the whole batches."""
    g, d = gan_nets()
    opt_g, opt_d = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (g, d))
    for step in range(len(GAN_SHARES)):
        gan_step(g, d, opt_g, opt_d, *gan_data(step), freeze)
    return [p.detach().clone() for m in (g, d) for p in m.parameters()]
