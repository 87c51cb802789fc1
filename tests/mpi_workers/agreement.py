"""MPI worker of tests/test_agreement.py: every rank runs tests/agreement_cases.py.

Run as ``mpiexec -n 2 python tests/mpi_workers/agreement.py EXAMPLES``; rank 0 prints one JSON
list, every rank's outcomes. A failing hypothesis case raises on rank 0 (mpiexec exits
non-zero, with the falsifying example on stderr).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import agreement_cases
from mpi4py import MPI

comm = MPI.COMM_WORLD
mine = agreement_cases.run_mpi(comm, int(sys.argv[1]))
every = comm.gather(mine, root=0)
if comm.Get_rank() == 0:
    print(json.dumps(every), flush=True)
