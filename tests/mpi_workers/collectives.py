"""MPI worker of tests/test_collectives.py: every rank runs tests/collective_cases.py.

Run as ``mpiexec -n 4 python tests/mpi_workers/collectives.py``; rank 0 prints one JSON list:
per rank, the case counts of each group it was in (one printer, so lines cannot interleave).
A failing case raises, so mpiexec exits non-zero.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collective_cases
from mpi4py import MPI

counts = MPI.COMM_WORLD.gather(collective_cases.run_mpi(MPI.COMM_WORLD), root=0)
if MPI.COMM_WORLD.Get_rank() == 0:
    print(json.dumps(counts), flush=True)
