"""MPI worker of the plan tests: every rank runs ``run_all(MPI.COMM_WORLD)`` of the cases module
named on the command line (tests/plan_cases.py for tests/test_plan.py, tests/owners_cases.py
for tests/test_placement.py), with no torch.distributed at all. Rank 0 prints every rank's
results as one JSON line."""

import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from mpi4py import MPI

torch.set_num_threads(1)
try:
    result = importlib.import_module(sys.argv[1]).run_all(MPI.COMM_WORLD)
except BaseException:
    import traceback

    traceback.print_exc()
    sys.stdout.flush()
    MPI.COMM_WORLD.Abort(1)  # the other ranks may be waiting in a collective
results = MPI.COMM_WORLD.gather(result, root=0)
if MPI.COMM_WORLD.Get_rank() == 0:
    print(json.dumps(results), flush=True)
