"""A forward that exchanges between the ranks (SyncBatchNorm's batch statistics over the global
batch) under the weighted DDP hook with uneven shares: its backward sums the ranks' gradients
before the hook can weigh them, so each loss is weighed before its backward
(``state.weigh(loss)``), and the step equals one process on the global batch.

torch's own ``nn.SyncBatchNorm`` synchronises on GPUs only (DDP refuses it on the CPU);
``_GlobalBatchNorm`` computes its statistics on the CPU (sums and counts all-reduced with
``torch.distributed.nn``, whose backward all-reduces the gradients, as SyncBatchNorm's does).
The warning of a step not weighed while a SyncBatchNorm trains: tests/cuda_cases.py."""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from hetcoll.launch import spawn
from hetcoll.torch import register_weighted_hook

pytestmark = pytest.mark.multiproc
STEPS = 2


class _GlobalBatchNorm(nn.Module):
    """Batch statistics over every rank's rows (SyncBatchNorm's in training)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.eps = 1e-5
        self.weight = nn.Parameter(torch.ones(features))
        self.bias = nn.Parameter(torch.zeros(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = torch.tensor([float(x.shape[0])], dtype=x.dtype)
        sums = torch.cat([x.sum(0), (x * x).sum(0), n])
        if dist.is_initialized():
            sums = dist_fn.all_reduce(sums)
        c = x.shape[1]
        mean = sums[:c] / sums[-1]
        var = sums[c : 2 * c] / sums[-1] - mean * mean
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), _GlobalBatchNorm(6), nn.Tanh(), nn.Linear(6, 3)).double()


def _data(step: int, n: int, last: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``last``: in step 1, the global batch's last ``last`` rows hold no label (the last
    rank's, with ``last`` its share: a rank weighing 0)."""
    g = torch.Generator().manual_seed(10 + step)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    y[torch.rand(n, generator=g) < 0.3] = -100  # rows without a label (items=)
    y[0] = 0
    if step == 1 and last:
        y[n - last :] = -100
    return x, y


def _loss(out: torch.Tensor, y: torch.Tensor, items: bool) -> torch.Tensor:
    return F.cross_entropy(out, y if items else y.clamp(min=0), ignore_index=-100)


def _reference(shares: list[int], items: bool, micro: int, last: int = 0) -> list[torch.Tensor]:
    """One process: each micro-batch the ranks' rows together, their losses averaged."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    n = sum(shares)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _data(step, n * micro, last)
        for k in range(micro):
            rows = slice(k * n, (k + 1) * n)
            (_loss(model(x[rows]), y[rows], items) / micro).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ranks(rank, world, shares, mode, micro):
    ddp = DistributedDataParallel(_net())
    items = mode.startswith("items")
    last = shares[-1] if mode == "items_empty" else 0
    if items:
        state = register_weighted_hook(ddp, items=lambda y: int((y != -100).sum()))
    else:
        state = register_weighted_hook(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5, momentum=0.9)
    n, lo = sum(shares), sum(shares[:rank])
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _data(step, n * micro, last)
        for k in range(micro):
            rows = slice(k * n + lo, k * n + lo + shares[rank])
            if mode == "by_hand":
                state.local_batch = shares[rank]
            if items:
                state.count(y[rows])
            with ddp.no_sync() if k < micro - 1 else contextlib.nullcontext():
                loss = _loss(ddp(x[rows]), y[rows], items)
                if mode != "plain":
                    loss = state.weigh(loss)
                (loss / micro).backward()
        opt.step()
    return [p.detach().clone() for p in ddp.module.parameters()]


def _off(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want))


@pytest.mark.parametrize(
    ("shares", "mode", "micro"),
    [
        ([5, 3], "counted", 1),
        ([4, 3, 2], "counted", 1),
        ([5, 3], "by_hand", 1),
        ([4, 3, 2], "items", 1),
        ([5, 3], "counted", 2),
        ([5, 3], "items", 2),
        ([4, 3, 2], "items_empty", 1),
        ([5, 3], "items_empty", 2),
    ],
)
def test_a_weighed_loss_makes_a_synced_batch_norm_one_process(shares, mode, micro):
    """``items_empty``: the last rank has no valid label in step 1 (in its last micro-batch
    with 2): it weighs 0, and its gradients still carry what the others' losses gave it."""
    last = shares[-1] if mode == "items_empty" else 0
    want = _reference(shares, mode.startswith("items"), micro, last)
    for params in spawn(_ranks, len(shares), shares, mode, micro):
        assert _off(params, want) <= 1e-10


def test_unweighed_losses_are_not_one_process():
    """The hook alone weighs the gradients after the exchange's backward has mixed them."""
    shares = [5, 3]
    want = _reference(shares, False, 1)
    for params in spawn(_ranks, 2, shares, "plain", 1):
        assert _off(params, want) > 1e-3


def test_weigh_refuses_bad_arguments_naming_them():
    from hetcoll.torch import WeightedAllreduceState

    state = WeightedAllreduceState(None, local_batch=3)
    with pytest.raises(TypeError, match=r"^loss: must be a tensor, got float"):
        state.weigh(1.0)
    with pytest.raises(ValueError, match=r"^weight: must be in \[0, 1\]"):
        state.weigh(torch.ones(()), weight=1.5)
    with pytest.raises(TypeError, match=r"^weight: must be a number, got bool"):
        state.weigh(torch.ones(()), weight=True)


def _weigh_twice(rank, world, items):
    ddp = DistributedDataParallel(_net())
    if items:
        state = register_weighted_hook(ddp, items=lambda y: int((y != -100).sum()))
    else:
        state = register_weighted_hook(ddp)
    x, y = _data(0, 4 * world)
    rows = slice(4 * rank, 4 * rank + 4)
    if items:
        state.count(y[rows])
    out = ddp(x[rows])
    first = state.weigh(_loss(out, y[rows], items))
    second = state.weigh(out.square().mean())  # a second term of the same forward's loss
    (first + second).backward()


@pytest.mark.parametrize("items", [False, True])
def test_weighing_twice_for_one_forward_says_so_on_every_rank(items):
    """A second weigh() without a forward between took no count: every rank raised "counted
    nothing" (or "no count for this forward"), which did not say what was called twice."""
    from hetcoll.launch import RankFailed

    with pytest.raises(RankFailed) as failed:
        spawn(_weigh_twice, 2, items)
    text = str(failed.value)
    argument = "items" if items else "local_batch"
    for rank in range(2):
        assert f"rank {rank}: " in text
    assert text.count("state.weigh(loss) was called twice for one step") >= 2, text
    assert f"{argument}: " in text and "sum its terms first" in text


def _weigh_a_row_loss(rank, world):
    """Rank 0 weighs its loss per row (not reduced): what each rank raised."""
    ddp = DistributedDataParallel(_net())
    state = register_weighted_hook(ddp)
    x, _ = _data(0, 4 * world)
    rows = slice(4 * rank, 4 * rank + 4)
    losses = ddp(x[rows]).square().mean(1)
    try:
        state.weigh(losses if rank == 0 else losses.mean())
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "nothing"


def test_a_per_row_loss_weighed_on_one_rank_raises_on_every_rank():
    """weigh() counting samples takes one reduced loss: a per-row one on one rank raised in
    that rank's backward alone, while the others waited in DDP's allreduce; it is now told in
    weigh's exchange of the counts."""
    mine, other = spawn(_weigh_a_row_loss, 2, timeout=60)
    assert mine == "ValueError: loss: must be one number (a mean), got shape (4,); reduce it first"
    assert other.startswith("CollectiveMismatchError: rank 0 raised ValueError: loss: must be one")
