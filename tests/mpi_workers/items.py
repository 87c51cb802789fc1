"""MPI worker for tests/test_data_parallel_mpi.py: padded language models trained with
DistributedOptimizer(items=...) under mpiexec against one process on the same global batches;
prints one JSON line (rank 0) with every rank's results."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from mpi4py import MPI
from torch import nn

from hetcoll.torch import DistributedOptimizer

from lm_common import (
    MODELS,
    global_batches,
    items,
    lm_loss,
    optimizer,
    rank_rows,
    reference,
    rel_err,
)

torch.set_num_threads(1)
comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
result = {"rank": rank}


def train(name, weigh):
    """``weigh``: "items" (opt.count(y) each step) or "rows" (model=: each rank's rows)."""
    model = MODELS[name]()
    if weigh == "items":
        opt = DistributedOptimizer(optimizer(model), items=items, fusion_bytes=4096)
    else:
        opt = DistributedOptimizer(optimizer(model), model=model, fusion_bytes=4096)
    seen = []
    for x, y in global_batches(world):
        xs, ys = x[rank_rows(world, rank)], y[rank_rows(world, rank)]
        opt.zero_grad()
        if weigh == "items":
            opt.count(ys)
        lm_loss(model(xs), ys).backward()
        opt.step()
        seen.append([opt.local_batch, opt.global_batch])
    return [p.detach().clone() for p in model.parameters()], seen


for name in MODELS:
    params, seen = train(name, "items")
    want = reference(name, world)
    result[name] = {"items": rel_err(params, want), "seen": seen}
    if name == "gpt2":
        rows, _ = train(name, "rows")
        result[name]["rows"] = rel_err(rows, want)

# Bad counts: the same error on every rank, from step(), and the ranks go on together.
bad = {}
ids = torch.randint(0, 5, (2, 4))
for case in ("non_integer", "all_zero", "not_counted", "raises"):
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5)).double()

    def count(y, case=case):
        if case == "non_integer" and rank == world - 1:
            return 1.5
        if case == "raises" and rank == 0:
            raise KeyError("labels")
        return 0 if case == "all_zero" else items(y)

    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), items=count)
    if case != "not_counted" or rank == 0:  # the other ranks forgot the count
        opt.count(ids)
    lm_loss(model(ids), ids).backward()
    try:
        opt.step()
        bad[case] = "no error"
    except Exception as e:
        bad[case] = [type(e).__name__, str(e)]
    good = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), items=items)
    good.count(ids)
    good.step()  # the ranks still work together afterwards
result["bad"] = bad

results = comm.gather(result, root=0)
if rank == 0:
    print(json.dumps(results), flush=True)
