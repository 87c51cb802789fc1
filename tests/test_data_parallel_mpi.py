"""The MPI DistributedOptimizer under mpiexec: exact full-batch updates with uneven batches."""

import json
import os

import pytest

from hetcoll.launch import mpiexec

pytestmark = pytest.mark.multiproc
WORKER = os.path.join(os.path.dirname(__file__), "mpi_workers", "data_parallel.py")


@pytest.mark.parametrize("world", [2, 3])
def test_mpi_optimizer_matches_single_process(world):
    out = mpiexec(world, [WORKER], timeout=240).stdout
    results = json.loads(next(line for line in out.splitlines() if line.startswith("[")))
    assert sorted(r["rank"] for r in results) == list(range(world))
    for r in results:
        assert r["step_grad"] <= 1e-10
        assert r["step_param"] <= 1e-10
        assert r["epoch_param"] <= 1e-10
        assert "ranks disagree" in r["disagree"]
        reb = r["rebalance"]  # the same decisions on every rank, and the right ones
        assert reb["settled_before"] == reb["want_before"]
        assert reb["settled_after"] == reb["want_after"] and reb["stable"]
        assert 2 <= reb["changes"] <= 8
        for got in r["groups"].values():  # group=None is COMM_WORLD under mpiexec
            assert got["fits"] == [100.0 * (q + 1) for q in range(world)]
            assert got["allreduce"] == [float(world)] * 2
            assert "ranks disagree on the number of shares" in got["sampler_count"]
            assert "ranks disagree on shares[0]" in got["sampler_values"]
            assert (
                f"has {world + 1} entries but the group has {world} ranks" in got["sampler_world"]
            )
            assert got["rebalanced"] == results[0]["groups"]["default"]["rebalanced"]
            assert got["rebalanced"] != [8] * world
