"""StepTimer: a rank's own compute per step, from its model's first forward to its last
gradient, without the waits for other ranks that DDP's backward ends with."""

from __future__ import annotations

import time
import types

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hetcoll.torch.step_timer as step_timer
from hetcoll.launch import spawn
from hetcoll.torch import StepTimer


class Ticking(nn.Module):
    """A model whose forward advances a fake clock by ``per_row`` seconds per row, and whose
    backward, by ``backward`` seconds more (its first layer's gradient, the last computed)."""

    def __init__(self, clock: list[float], per_row: float, backward: float) -> None:
        super().__init__()
        self.first = nn.Linear(3, 4)
        self.second = nn.Linear(4, 1)
        self.clock, self.per_row = clock, per_row

        def tick(grad: torch.Tensor) -> torch.Tensor:
            clock[0] += backward
            return grad

        self.first.weight.register_hook(tick)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock[0] += self.per_row * len(x)
        return self.second(torch.relu(self.first(x)))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(step_timer, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    return now


def test_a_step_is_timed_from_its_first_forward_to_its_last_gradient(clock):
    model = Ticking(clock, per_row=0.5, backward=2.0)
    timer = StepTimer(model)
    x = torch.randn(4, 3)
    clock[0] += 7.0  # before the step: not counted
    model(x).sum().backward()
    clock[0] += 30.0  # after the last gradient (DDP's wait for the others): not counted
    assert timer.pop() == pytest.approx(4 * 0.5 + 2.0)
    # Two micro-batches, one step: from the first forward to the second's last gradient.
    model(x[:2]).sum().backward()
    clock[0] += 5.0
    model(x).sum().backward()
    assert timer.pop() == pytest.approx(1.0 + 2.0 + 5.0 + 2.0 + 2.0)


def test_forwards_without_gradients_start_no_step_and_a_forward_alone_ends_now(clock):
    model = Ticking(clock, per_row=1.0, backward=0.0)
    timer = StepTimer(model)
    with torch.no_grad():
        model(torch.randn(3, 3))  # an evaluation: no step
    with pytest.raises(RuntimeError, match="no forward since the last pop"):
        timer.pop()
    model(torch.randn(2, 3))  # a forward, no backward: timed to now
    clock[0] += 1.5
    assert timer.pop() == pytest.approx(3.5)


def test_remove_takes_the_hooks_off_and_bad_models_are_named(clock):
    model = Ticking(clock, per_row=1.0, backward=0.0)
    timer = StepTimer(model)
    timer.remove()
    model(torch.randn(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="no forward"):
        timer.pop()
    with pytest.raises(TypeError, match=r"model: must be a torch\.nn\.Module"):
        StepTimer("model")  # type: ignore[arg-type]
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="model: has no parameter"):
        StepTimer(frozen)
    # DeepSpeed ZeRO-3 marks its partitioned parameters with a ds_id: their gathers wait for
    # the other ranks inside every layer, where the timer cannot leave them out.
    zero3 = nn.Linear(2, 2)
    zero3.weight.ds_id = 0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="model: its parameters are sharded by DeepSpeed ZeRO-3"):
        StepTimer(zero3)
    # One device's work is timed (CUDA events of two devices cannot be compared).
    spread = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match=r"model: its parameters are on 2 devices \(cpu, meta\)"):
        StepTimer(spread)


def _ddp_times(rank: int, world: int, slow_s: float) -> tuple[float, float]:
    """One DDP step of a small model on each rank, rank 1 sleeping ``slow_s`` in its forward:
    (the timer's seconds, the step's wall seconds)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    if rank == 1:
        model[1].register_forward_hook(lambda *_: time.sleep(slow_s))
    ddp = DistributedDataParallel(model)
    timer = StepTimer(ddp)  # timed through its module
    x = torch.randn(4, 8)
    ddp(x).sum().backward()  # warm-up: DDP's first step builds its buckets
    timer.pop()
    torch.distributed.barrier()
    started = time.perf_counter()
    ddp(x).sum().backward()
    wall = time.perf_counter() - started
    return timer.pop(), wall


@pytest.mark.multiproc
def test_under_ddp_the_fast_rank_is_timed_without_its_wait_for_the_slow_one():
    """The real clock, on 2 gloo ranks: rank 0's backward ends only once rank 1, sleeping a
    second in its forward, has sent its gradients; its step is timed without that second."""
    (fast, fast_wall), (slow, _) = spawn(_ddp_times, 2, 1.0, timeout=120)
    assert fast_wall > 0.9  # DDP made it wait
    assert fast < 0.5  # the timer did not count the wait
    assert slow > 0.9  # the slow rank's own time is its own


def _experts_times(rank: int, world: int, slow_s: float) -> tuple[float, float]:
    """One step of Hugging Face Mixtral (2 layers) whose experts are placed 2 : 2 on the ranks,
    each rank its half of the rows, rank 1 sleeping ``slow_s`` in each of its experts
    layers' local computation: (the timer's seconds, the step's wall seconds)."""
    import tensor_parallel_cases as tp
    from expert_parallel_cases import lm_loss, tokens

    from hetcoll.torch import ExpertParallelExperts, expert_parallel

    torch.manual_seed(0)
    model = tp.mixtral()
    expert_parallel(model, shares=[2, 2])
    if rank == 1:
        for m in model.modules():
            if isinstance(m, ExpertParallelExperts):
                m.local.register_forward_hook(lambda *_: time.sleep(slow_s))
    timer = StepTimer(model)
    ids, labels = (t[rank::world] for t in tokens(0))
    lm_loss(model, ids, labels).backward()  # warm-up
    timer.pop()
    torch.distributed.barrier()
    started = time.perf_counter()
    lm_loss(model, ids, labels).backward()
    wall = time.perf_counter() - started
    return timer.pop(), wall


@pytest.mark.multiproc
def test_with_experts_placed_the_fast_rank_is_timed_without_its_waits_in_their_exchanges():
    """The real clock, on 2 gloo ranks: every experts layer sends rank 1 tokens and waits for
    them back, so rank 0's step lasts as long as rank 1's, whose experts sleep 0.3 s in each
    of 2 layers; its timer leaves the exchanges (all-to-alls, waits included) out."""
    (fast, fast_wall), (slow, _) = spawn(_experts_times, 2, 0.3, timeout=180)
    assert fast_wall > 0.55  # the exchanges made it wait for rank 1's experts
    assert fast < 0.25  # the timer did not count those waits
    assert slow > 0.55  # the slow rank's own time is its own


def test_waits_marked_inside_a_step_are_left_out_and_reset_drops_a_step(clock):
    model = Ticking(clock, per_row=1.0, backward=2.0)
    timer = StepTimer(model)
    out = model(torch.randn(2, 3))  # 2 s
    with StepTimer.waiting():  # a collective of the user's: 10 s waiting for the others
        clock[0] += 10.0
    out.sum().backward()  # 2 s
    with StepTimer.waiting():  # after the step's last gradient: not in it either way
        clock[0] += 7.0
    assert timer.pop() == pytest.approx(4.0)
    model(torch.randn(3, 3))  # a step an exception cut short
    timer.reset()
    with pytest.raises(RuntimeError, match="no forward since the last pop"):
        timer.pop()
    timer.remove()
    with StepTimer.waiting():  # a removed timer marks nothing (and raises nothing)
        clock[0] += 1.0
