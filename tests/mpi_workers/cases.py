"""MPI worker of the multi-rank cases: ``cases.py MODULE [ARG ...]``: every rank runs
``MODULE.run_all(MPI.COMM_WORLD, *ARGS)`` (tests/plan_cases.py for tests/test_plan.py,
tests/owners_cases.py for tests/test_placement.py, tests/elastic_cases.py for
tests/test_elastic_split.py, tests/dcp_cases.py for tests/test_dcp.py), with no
torch.distributed at all. Rank 0 prints every rank's
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
    result = importlib.import_module(sys.argv[1]).run_all(MPI.COMM_WORLD, *sys.argv[2:])
except BaseException:
    import traceback

    traceback.print_exc()
    sys.stdout.flush()
    MPI.COMM_WORLD.Abort(1)  # the other ranks may be waiting in a collective
results = MPI.COMM_WORLD.gather(result, root=0)
if MPI.COMM_WORLD.Get_rank() == 0:
    print(json.dumps(results), flush=True)
