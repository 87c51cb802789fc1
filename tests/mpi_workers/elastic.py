"""MPI worker of tests/test_elastic_split.py: ``elastic.py first|second <case,...> <directory>``
runs one job of each named case of tests/elastic_cases.py on MPI.COMM_WORLD (no
torch.distributed at all; checkpoints ``<directory>/<case>.pt``); rank 0 prints every rank's
results as one JSON line."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from mpi4py import MPI

torch.set_num_threads(1)
job, names, directory = sys.argv[1:4]
try:
    import elastic_cases

    run = elastic_cases.first_job if job == "first" else elastic_cases.second_job
    result = {n: run(MPI.COMM_WORLD, n, f"{directory}/{n}.pt") for n in names.split(",")}
except BaseException:
    import traceback

    traceback.print_exc()
    sys.stdout.flush()
    MPI.COMM_WORLD.Abort(1)  # the other ranks may be waiting in a collective
results = MPI.COMM_WORLD.gather(result, root=0)
if MPI.COMM_WORLD.Get_rank() == 0:
    print(json.dumps(results), flush=True)
