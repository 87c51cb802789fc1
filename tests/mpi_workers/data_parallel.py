"""MPI worker for tests/test_data_parallel_mpi.py: run under mpiexec; prints one JSON line per
rank with the largest relative errors against the single-process references."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

import hetcoll
from hetcoll.torch import (
    BalancedSampler,
    DistributedOptimizer,
    Rebalancer,
    SpeedFit,
    broadcast_parameters,
    gather_speeds,
)

from dp_common import (
    CHANGE_AT,
    EPOCH_SEED,
    GAN_SHARES,
    N_EPOCH,
    epoch_plan,
    gan_data,
    gan_nets,
    gan_reference,
    gan_step,
    make_data,
    make_model,
    reference_epoch,
    reference_step,
    rel_err,
)

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
result = {"rank": rank}

# One step with shares [3, 5, 8][:world].
shares = [3, 5, 8][:world]
x, y = make_data(sum(shares))
start = sum(shares[:rank])
model = make_model()
broadcast_parameters(model)
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), local_batch=shares[rank])
nn.functional.cross_entropy(
    model(x[start : start + shares[rank]]), y[start : start + shares[rank]]
).backward()
opt.synchronize()
grads = [p.grad.clone() for p in model.parameters()]
opt.optimizer.step()
ref_grads, ref_params = reference_step(sum(shares))
result["step_grad"] = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
result["step_param"] = max(rel_err(p.detach(), r) for p, r in zip(model.parameters(), ref_params))

# A whole epoch: ragged last step, shares changed mid-run; each step's samples counted off the
# model's forwards (model=), evaluation forwards not counted (without gradients, or in eval
# mode with no backward).
before, after = [3, 5, 8][:world], [6, 1, 2][:world]
steps = epoch_plan(before, after, world)
x, y = make_data(N_EPOCH)
model = make_model()
sampler = BalancedSampler(range(N_EPOCH), before, rank, seed=EPOCH_SEED, verify=False)
opt = DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    model=model,
    fusion_bytes=512,  # several buckets even for this small model
)
for step, idx in enumerate(sampler.batch_sampler()):
    if step + 1 == CHANGE_AT:
        sampler.set_shares(after)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
    opt.step()
    with torch.no_grad():
        model(x[:5])
    # In eval mode with gradients on, no backward: not counted either (it was, 3 samples).
    model.eval()
    model(x[:3])
    model.train()
ref = reference_epoch(steps)
result["epoch_param"] = max(rel_err(p.detach(), r) for p, r in zip(model.parameters(), ref))

# Ranks that disagree on the gradients raise on every rank instead of hanging.
extra = [nn.Parameter(torch.zeros(3, dtype=torch.float64))] if rank == 0 else []
bad = DistributedOptimizer(
    torch.optim.SGD([*make_model().parameters(), *extra], lr=0.1), local_batch=1
)
try:
    bad.synchronize()
    result["disagree"] = "no error"
except ValueError as e:
    result["disagree"] = str(e)

# synchronize() twice for one step raised "counted nothing", not saying what was called twice.
twice_model = make_model()
twice = DistributedOptimizer(torch.optim.SGD(twice_model.parameters(), lr=0.1), model=twice_model)
nn.functional.cross_entropy(twice_model(x[:2]), y[:2]).backward()
twice.synchronize()
try:
    twice.synchronize()
    result["twice"] = "no error"
except RuntimeError as e:
    result["twice"] = str(e)


# torch's learning-rate schedulers take the optimizer (it is a torch.optim.Optimizer whose
# groups are the wrapped one's): StepLR refused it.
model = make_model()
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), local_batch=1)
schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
for _ in range(2):
    model(x[:1]).sum().backward()
    opt.step()
    schedule.step()
result["scheduled_lr"] = [opt.optimizer.param_groups[0]["lr"], schedule.get_last_lr()[0]]

# broadcast_parameters on models that differ raises on every rank (MPI's "Message truncated"
# on one rank, nothing on the other, before); bfloat16 broadcasts (numpy has no such type).
try:
    broadcast_parameters(nn.Linear(4, 3 if rank == 0 else 2))
    result["bcast_mismatch"] = "no error"
except hetcoll.CollectiveMismatchError as e:
    result["bcast_mismatch"] = str(e)
half = nn.Linear(3, 2).to(torch.bfloat16)
with torch.no_grad():
    half.weight.fill_(rank + 1)
broadcast_parameters(half)
result["bcast_bf16"] = float(half.weight.float().sum())


# Tensors in other layouts than C-contiguous: channels_last weights and a transposed one. The
# optimizer's pack refused their gradients ("arrays[0]: must be C-contiguous"), or, where one
# rank alone was channels_last, that rank raised while the other waited; broadcast refused them.
def layouts_net(last):
    torch.manual_seed(3)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    net = net.double()
    if last:
        net = net.to(memory_format=torch.channels_last)
    net[3].weight = nn.Parameter(net[3].weight.detach().t().contiguous().t())  # transposed
    return net


images = torch.randn(sum(shares), 3, 6, 6, dtype=torch.float64, generator=torch.Generator())
labels = torch.arange(sum(shares)) % 3
ref_net = layouts_net(False)
ref_opt = torch.optim.SGD(ref_net.parameters(), lr=0.1)
nn.functional.cross_entropy(ref_net(images), labels).backward()
ref_opt.step()
for name, last in (("every_rank", True), ("rank_0", rank == 0)):
    net = layouts_net(last)
    layout_opt = DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), model=net)
    mine = slice(start, start + shares[rank])
    nn.functional.cross_entropy(net(images[mine]), labels[mine]).backward()
    layout_opt.step()
    result[f"layouts_{name}"] = max(
        rel_err(p.detach(), r.detach()) for p, r in zip(net.parameters(), ref_net.parameters())
    )
torch.manual_seed(rank)  # every rank different, then rank 0's everywhere
strided = layouts_net(True)
with torch.no_grad():
    for p in strided.parameters():
        p.normal_()
broadcast_parameters(strided)
sums = np.array([float(p.double().sum()) for p in strided.parameters()])
result["bcast_layouts"] = bool((comm.allgather(sums)[0] == sums).all())

# A rank left out of a sub-communicator (MPI.COMM_NULL) is told so ("Invalid communicator").
left_out = comm.Split(MPI.UNDEFINED if rank == 0 else 1, rank)
if rank == 0:
    try:
        hetcoll.allreduce(np.ones(2), group=left_out)
        result["left_out"] = "no error"
    except ValueError as e:
        result["left_out"] = str(e)
else:
    left_out.Free()

# A sparse gradient is named, on every rank (numpy could not read it).
emb = nn.Embedding(5, 2, sparse=True).double()
sparse_opt = DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), local_batch=1)
emb(torch.tensor([rank])).sum().backward()
try:
    sparse_opt.step()
    result["sparse"] = "no error"
except (TypeError, hetcoll.CollectiveMismatchError) as e:
    result["sparse"] = f"{type(e).__name__}: {e}"


# A layer no rank uses in a step keeps no gradient and does not move, as in one process; it
# was given zeros, which momentum and weight decay then moved. A layer rank 0 alone uses in the
# second step is averaged with the others' zeros, as one process weighs those rows.
def three_heads():
    torch.manual_seed(3)
    return nn.ModuleDict({h: nn.Linear(4, 2) for h in "abc"}).double()


def heads_loss(m, x, n, n0, second):
    loss = m["a"](x).pow(2).sum() / n
    if second and n0:
        loss = loss + m["c"](x[:n0]).pow(2).sum() / n
    return loss


heads, ref = three_heads(), three_heads()
sgd = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}
opt = DistributedOptimizer(torch.optim.SGD(heads.parameters(), **sgd), local_batch=shares[rank])
ref_opt = torch.optim.SGD(ref.parameters(), **sgd)
for k in range(3):
    g = torch.Generator().manual_seed(k)
    x_all = torch.randn(sum(shares), 4, generator=g, dtype=torch.float64)
    opt.zero_grad()
    mine = x_all[start : start + shares[rank]]
    heads_loss(heads, mine, shares[rank], shares[rank] if rank == 0 else 0, k == 1).backward()
    opt.step()
    ref_opt.zero_grad()
    heads_loss(ref, x_all, sum(shares), shares[0], k == 1).backward()
    ref_opt.step()
result["heads"] = max(
    rel_err(p.detach(), r.detach()) for p, r in zip(heads.parameters(), ref.parameters())
)
result["unused_grad"] = [heads["b"].weight.grad is None, heads["b"].bias.grad is None]


# step(closure): the closure computes the gradients, so the average follows each of its calls,
# and its loss is the global batch's: LBFGS (several calls a step, a line search on the loss)
# then runs as one process's on every rank. The closure's gradients were used unaveraged
# (ranks 0.33 apart), or a closure without a forward before it raised "counted nothing".
def closure_run(make_opt, steps, data, lo, hi):
    xs, ys = data
    model = make_model()
    opt = make_opt(model)
    calls = 0

    def closure():
        nonlocal calls
        calls += 1
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xs[lo:hi]), ys[lo:hi])
        loss.backward()
        return loss

    losses = [float(opt.step(closure)) for _ in range(steps)]
    return [p.detach().clone() for p in model.parameters()], losses, calls


data = make_data(sum(shares))
lbfgs = {"lr": 0.5, "max_iter": 6, "line_search_fn": "strong_wolfe"}
for name, make in (
    ("lbfgs", lambda m: torch.optim.LBFGS(m.parameters(), **lbfgs)),
    ("sgd", lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)),
):
    want, want_losses, want_calls = closure_run(make, 3, data, 0, sum(shares))
    got, got_losses, got_calls = closure_run(
        lambda m, make=make: DistributedOptimizer(make(m), model=m),
        3,
        data,
        start,
        start + shares[rank],
    )
    result[f"closure_{name}"] = {
        "param": max(rel_err(p, r) for p, r in zip(got, want)),
        "loss": max(abs(a - b) / abs(b) for a, b in zip(got_losses, want_losses)),
        "calls": [got_calls, want_calls],
    }


# torch.amp.GradScaler: an inf on one rank alone (its loss blown up in step 1) made that rank
# skip its step while the others waited in theirs. Now every rank skips that step alike, and
# the other steps are one process's, in each recipe: "synchronize" averages first (every rank
# then finds the inf and lowers its scale alike), "plain" is scaler.step(opt) alone and
# "unscale" unscales before the step (GradScaler hands the step each rank's scale and inf
# check: the rank that overflowed lowers its scale alone).
def scaled_run(lo, hi, blow_up_rows, recipe):
    xs, ys = data
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if hi - lo < sum(shares):
        opt = DistributedOptimizer(opt, model=model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    skipped = []
    for step in range(4):
        opt.zero_grad()
        per_row = nn.functional.cross_entropy(model(xs[lo:hi]), ys[lo:hi], reduction="none")
        if step == 1:
            per_row = per_row * (blow_up_rows[lo:hi].double() * 1e308 + 1)
        scaler.scale(per_row.mean()).backward()
        if isinstance(opt, DistributedOptimizer) and recipe == "synchronize":
            opt.synchronize()
        if recipe != "plain":
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        skipped.append(getattr(opt, "skipped", None))
    return [p.detach().clone() for p in model.parameters()], scaler.get_scale(), skipped


blow_up = torch.zeros(sum(shares), dtype=torch.bool)
blow_up[sum(shares) - 1] = True  # the last rank's last row
for recipe in ("synchronize", "plain", "unscale"):
    want, want_scale, _ = scaled_run(0, sum(shares), blow_up, recipe)
    got, got_scale, skipped = scaled_run(start, start + shares[rank], blow_up, recipe)
    result[f"grad_scaler_{recipe}"] = {
        "param": max(rel_err(p, r) for p, r in zip(got, want)),
        "scales": [got_scale, want_scale],
        "skipped": skipped,
    }

# The Rebalancer over the MPI communicator: compute times at true speeds that change at step
# 20 (the first two ranks swap roles); the shares follow.
speeds_before = [100.0, 25.0, 50.0][:world]
speeds_after = [40.0, 80.0, 50.0][:world]
sampler = BalancedSampler(range(10_000), [16] * world, rank, verify=False)
reb = Rebalancer(sampler, every=4, smoothing=0.5, threshold=0.02, group=comm)
seen = []
for step in range(80):
    speeds = speeds_before if step < 20 else speeds_after
    b = sampler.shares[rank]
    reb.observe(b, b / speeds[rank])
    seen.append(list(sampler.shares))


def step_s(shares, speeds):
    return max(b / s for b, s in zip(shares, speeds))


# Several shares can tie for the optimum: compare step times.
result["rebalance"] = {
    "settled_before": step_s(seen[19], speeds_before),
    "settled_after": step_s(seen[-1], speeds_after),
    "stable": seen[-1] == seen[-20],
    "changes": sum(e.applied for e in reb.history),
    "want_before": step_s(hetcoll.split(16 * world, speeds_before, minimum=1), speeds_before),
    "want_after": step_s(hetcoll.split(16 * world, speeds_after, minimum=1), speeds_after),
}

if world == 2:
    # A GAN: the discriminator's forward in the generator's step, its gradients zeroed before
    # its own step, was counted into that step (1.2e-3 off where the shares change).
    gen, disc = gan_nets()
    opt_g, opt_d = (
        DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), model=m)
        for m in (gen, disc)
    )
    for step, shares in enumerate(GAN_SHARES):
        z, real = gan_data(step)
        mine = slice(sum(shares[:rank]), sum(shares[: rank + 1]))
        gan_step(gen, disc, opt_g, opt_d, z[mine], real[mine], freeze=False)
    trained = [p.detach() for m in (gen, disc) for p in m.parameters()]
    result["gan"] = max(
        rel_err(p, r) for p, r in zip(trained, gan_reference(freeze=False), strict=True)
    )

# One way to pass the communicator: None is MPI.COMM_WORLD here (mpiexec, no torch.distributed),
# the same as passing it; the sampler checks its shares across the ranks under MPI too.
groups = {}
for name, group in (("default", None), ("explicit", comm)):
    r = {}
    fits = gather_speeds(SpeedFit(0.0, 100.0 * (rank + 1)), group)
    r["fits"] = [f.samples_per_s for f in fits]
    r["allreduce"] = hetcoll.allreduce(np.ones(2), group).tolist()
    try:
        BalancedSampler(range(10), [1] * (world + (rank == 0)), rank, group=group)
        r["sampler_count"] = "no error"
    except hetcoll.CollectiveMismatchError as e:
        r["sampler_count"] = str(e)
    try:
        BalancedSampler(
            range(10), list(range(1, world + 1))[:: 1 if rank else -1], rank, group=group
        )
        r["sampler_values"] = "no error"
    except hetcoll.CollectiveMismatchError as e:
        r["sampler_values"] = str(e)
    try:
        BalancedSampler(range(10), [1] * (world + 1), rank, group=group)
        r["sampler_world"] = "no error"
    except ValueError as e:
        r["sampler_world"] = str(e)
    sampler = BalancedSampler(range(1000), [8] * world, rank, group=group)
    reb = Rebalancer(sampler, every=2, group=group)
    for _ in range(6):
        b = sampler.shares[rank]
        reb.observe(b, b / (100.0 if rank == 0 else 25.0))
    r["rebalanced"] = list(sampler.shares)
    groups[name] = r
result["groups"] = groups

# One line from rank 0: lines printed by several ranks can interleave on mpiexec's stdout.
results = comm.gather(result, root=0)
if rank == 0:
    print(json.dumps(results), flush=True)
