"""Elastic resume of a raw balanced loop (DDP + weighted comm hook + BalancedSampler): train k
steps on 3 ranks, checkpoint, resume on 2 ranks with shares re-solved for them at load time, and
the final weights equal one uninterrupted process on the same global batches, in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcoll
from hetcoll.launch import spawn
from hetcoll.torch import BalancedSampler, WeightedAllreduceState, weighted_allreduce_hook

from dp_common import make_data, make_model

pytestmark = pytest.mark.multiproc

# 53 = 6 * 8 + 5: each epoch ends on a smaller global batch, split over the ranks without padding.
N, BATCH, EPOCHS, SEED, LR = 53, 8, 2, 3, 0.1


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)  # momentum: optimizer state to carry


def train(rank, world, speeds, save_at, resume):
    """The balanced loop on this rank: from the start, saving a checkpoint after each step of
    ``save_at`` ({step: path}, what stopping there would leave), or from the checkpoint at
    ``resume`` to the end. Returns the final parameters, this rank's batch sizes and shares."""
    x, y = make_data(N)
    model = make_model()
    opt = make_optimizer(model.parameters())
    shares = hetcoll.split(BATCH, speeds, minimum=1)  # solved for the ranks running now
    sampler = BalancedSampler(range(N), shares, rank, seed=SEED)
    start_epoch, step = 0, 0
    if resume:
        ckpt = torch.load(resume, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sampler.load_state_dict(ckpt["sampler"])  # another number of ranks: keeps `shares`
        start_epoch, step = ckpt["sampler"]["epoch"], ckpt["step"]
    ddp = DDP(model)
    state = WeightedAllreduceState(None, local_batch=shares[rank])
    ddp.register_comm_hook(state, weighted_allreduce_hook)
    sizes = []
    for epoch in range(start_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for idx in sampler.batch_sampler():
            state.local_batch = len(idx)
            sizes.append(len(idx))
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x[idx]), y[idx]).backward()
            opt.step()
            step += 1
            if step in save_at and rank == 0:
                checkpoint = {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "sampler": sampler.state_dict(),
                    "step": step,
                }
                torch.save(checkpoint, save_at[step])
    return [p.detach().clone() for p in model.parameters()], sizes, shares


def resume_each(rank, world, speeds, paths):
    """Resume from every checkpoint in turn, in the same processes."""
    return [train(rank, world, speeds, {}, path) for path in paths]


def uninterrupted():
    x, y = make_data(N)
    model = make_model()
    opt = make_optimizer(model.parameters())
    order = BalancedSampler(range(N), [BATCH], 0, seed=SEED, verify=False)
    for epoch in range(EPOCHS):
        order.set_epoch(epoch)
        for idx in order.batch_sampler():
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return [p.detach() for p in model.parameters()]


STOPS = (4, 9)  # mid first epoch; mid second epoch


def test_stop_on_three_ranks_resume_on_two_equals_an_uninterrupted_run(tmp_path):
    paths = {k: str(tmp_path / f"step{k}.pt") for k in STOPS}
    spawn(train, 3, [1.0, 1.0, 2.0], paths, None)
    per_rank = spawn(resume_each, 2, [3.0, 1.0], [paths[k] for k in STOPS])
    reference = uninterrupted()
    for k, (rank0, rank1) in zip(STOPS, zip(*per_rank)):
        (params, sizes, shares), (params1, sizes1, _) = rank0, rank1
        assert shares == [6, 2]  # re-solved for the two ranks at load time
        # The rest of the stopped epoch and the next, cut into global batches of 8 split 6:2;
        # each epoch's last 5 samples split 4:1.
        assert len(sizes) == len(sizes1) == 2 * 7 - k
        assert sizes[-1] == 4 and sizes1[-1] == 1
        for a, b, c in zip(params, params1, reference):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # the ranks agree bitwise
            torch.testing.assert_close(a, c, rtol=0, atol=1e-10)
