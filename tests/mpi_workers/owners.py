"""MPI worker of tests/test_placement.py: every rank runs tests/owners_cases.py over
MPI.COMM_WORLD (no torch.distributed at all). Rank 0 prints every rank's results as one JSON
line."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import owners_cases
import torch
from mpi4py import MPI

torch.set_num_threads(1)
try:
    result = owners_cases.run_all(MPI.COMM_WORLD)
except BaseException:
    import traceback

    traceback.print_exc()
    sys.stdout.flush()
    MPI.COMM_WORLD.Abort(1)  # the other ranks may be waiting in a collective
results = MPI.COMM_WORLD.gather(result, root=0)
if MPI.COMM_WORLD.Get_rank() == 0:
    print(json.dumps(results), flush=True)
