"""MPI worker of tests/test_collectives.py: every rank runs tests/collective_cases.py.

Run as ``mpiexec -n P python tests/mpi_workers/collectives.py``; rank 0 prints one JSON line
with the case counts. A failing case raises, so mpiexec exits non-zero.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collective_cases
from mpi4py import MPI

counts = collective_cases.run_all(MPI.COMM_WORLD)
if MPI.COMM_WORLD.Get_rank() == 0:
    print(json.dumps(counts), flush=True)
