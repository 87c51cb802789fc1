"""MPI worker of tests/test_collectives.py: every rank runs tests/collective_cases.py.

Run as ``mpiexec -n 4 python tests/mpi_workers/collectives.py``; every rank prints one JSON
line with the case counts of each group it was in. A failing case raises, so mpiexec exits non-zero.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collective_cases
from mpi4py import MPI

counts = collective_cases.run_mpi(MPI.COMM_WORLD)
print(json.dumps({"rank": MPI.COMM_WORLD.Get_rank(), "counts": counts}), flush=True)
