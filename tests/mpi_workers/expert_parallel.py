"""MPI worker for tests/test_expert_parallel.py: experts placed on the ranks by speed, the rest
averaged by DistributedOptimizer, against one process on the whole batch, and placed again by
an ExpertRebalancer; prints one JSON line (rank 0) with every rank's experts per rank and the
rebalancer's decisions."""

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from expert_parallel_cases import SPEEDS, rebalanced_while_training, trains_as_one_process
from mpi4py import MPI
from tensor_parallel_cases import gpt_oss, mixtral, tolerance

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*bos_token_id|.*eos_token_id")
comm = MPI.COMM_WORLD
speeds = SPEEDS[: comm.Get_size()]
with tolerance(1e-6):  # the routers' float32 softmax (expert_parallel_cases)
    result = {
        "mixtral": trains_as_one_process(comm, mixtral, speeds),
        "gpt_oss": trains_as_one_process(comm, gpt_oss, speeds),
        "padded": trains_as_one_process(comm, mixtral, speeds, pad=True),
        "rebalanced": rebalanced_while_training(comm),
    }
results = comm.gather(result)
if comm.Get_rank() == 0:
    print(json.dumps(results), flush=True)
