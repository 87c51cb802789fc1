"""MPI worker of tests/test_collectives.py: the last rank dies, the others must time out.

Usage: ``mpiexec -n P python tests/mpi_workers/dead_peer.py ALGORITHM TIMEOUT_S``. Each
surviving rank prints ``rank R: CollectiveTimeout after S s`` and exits with code 0.
"""

import os
import sys
import time

import hetcoll
import numpy as np
from mpi4py import MPI

algorithm, timeout = sys.argv[1], float(sys.argv[2])
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
buf = hetcoll.allreduce(np.ones(1000), comm)  # everybody alive: works
if rank == size - 1:
    os._exit(3)  # dies without a word, like a killed process
time.sleep(0.5)
start = time.monotonic()
try:
    hetcoll.allreduce(buf, comm, algorithm=algorithm, timeout=timeout)
    print(f"rank {rank}: completed", flush=True)
except hetcoll.CollectiveTimeout:
    print(f"rank {rank}: CollectiveTimeout after {time.monotonic() - start:.2f} s", flush=True)
# MPI_Finalize would wait for the dead peer: a rank that saw CollectiveTimeout leaves without it.
os._exit(0)
