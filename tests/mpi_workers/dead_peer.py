"""MPI worker of tests/test_collectives.py: the last rank dies, the others must time out.

Usage: ``mpiexec -disable-auto-cleanup -n P python tests/mpi_workers/dead_peer.py TIMEOUT_S``.
Each surviving rank tries the ring, the native, the direct and the shared allreduce, prints
``rank R ALGORITHM: CollectiveTimeout after S s`` for each and exits with code 0.
"""

import os
import sys
import time

import numpy as np
from mpi4py import MPI

import hetcoll

timeout = float(sys.argv[1])
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
buf = hetcoll.allreduce(np.ones(1000), comm)  # everybody alive: works
if rank == size - 1:
    os._exit(3)  # dies without a word, like a killed process
time.sleep(0.5)
for algorithm in ("ring", "native", "direct", "shared"):
    start = time.monotonic()
    try:
        hetcoll.allreduce(buf, comm, algorithm=algorithm, timeout=timeout)
        print(f"rank {rank} {algorithm}: completed", flush=True)
    except hetcoll.CollectiveTimeout:
        seconds = time.monotonic() - start
        print(f"rank {rank} {algorithm}: CollectiveTimeout after {seconds:.2f} s", flush=True)
# MPI_Finalize would wait for the dead peer: a rank that saw CollectiveTimeout leaves without it.
os._exit(0)
