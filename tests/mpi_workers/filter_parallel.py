"""MPI worker of tests/test_filter_parallel.py: every rank runs tests/filter_cases.py over
MPI.COMM_WORLD (no torch.distributed at all).

Run as ``mpiexec -n P python tests/mpi_workers/filter_parallel.py``; rank 0 prints one JSON
line with the case counts and every rank's loss scales. A failing case raises, so mpiexec
exits non-zero.
"""

import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import filter_cases
import torch
from mpi4py import MPI

from hetcoll.torch import GroupGradScaler

torch.set_num_threads(1)
try:
    counts = filter_cases.run_all(MPI.COMM_WORLD)
    # Loss scaling over MPI: hetcoll's GroupGradScaler; every rank's scales.
    make = functools.partial(GroupGradScaler, group=MPI.COMM_WORLD)
    scales = filter_cases.scaled_split(MPI.COMM_WORLD, make)
    counts["scaled"] = MPI.COMM_WORLD.allgather(scales)
except BaseException:
    import traceback

    traceback.print_exc()
    sys.stdout.flush()
    MPI.COMM_WORLD.Abort(1)  # the other ranks may be waiting in a collective
if MPI.COMM_WORLD.Get_rank() == 0:
    print(json.dumps(counts), flush=True)
