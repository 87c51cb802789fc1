"""Elastic resume of split models (issue 29): filter-parallel models and plans stop after k
optimizer steps on 3 ranks and resume on 2, with their split re-solved for other speeds; the
final weights and optimizer state equal one uninterrupted process in float64 (to 1e-10). The
cases run on gloo (tests/elastic_cases.py through launch.spawn) and one on MPI; the checks of a
full state dict's keys, shapes and format run in-process."""

from __future__ import annotations

import json
from pathlib import Path

import elastic_cases
import pytest
import torch
from torch import nn

from hetcoll import launch
from hetcoll.torch import (
    gather_optimizer_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
)

HERE = Path(__file__).resolve().parent


def _resume(name: str, tmp_path: Path) -> tuple[list, list]:
    path = str(tmp_path / f"{name}.pt")
    first = launch.spawn(elastic_cases.run_torch_first, 3, name, path, timeout=240)
    second = launch.spawn(elastic_cases.run_torch_second, 2, name, path, timeout=240)
    return first, second


def _exact(results: list[dict]) -> None:
    r = results[0]  # rank 0 compared the full dicts, the same on every rank
    assert r["weights"] <= elastic_cases.TOL, r
    assert r["optimizer"] <= elastic_cases.TOL, r


@pytest.mark.multiproc
def test_resnet18_filter_parallel_stops_on_three_ranks_and_resumes_on_two(tmp_path):
    first, second = _resume("resnet18_filter", tmp_path)
    _exact(second)
    # The split was re-solved for the ranks that resumed: conv1's 64 filters at 1:1:2, then 3:1.
    assert first[0]["conv1"] == [16, 16, 32] and second[0]["shares"]["conv1"] == [48, 16]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["plan_pipeline_split", "plan_owners", "plan_to_filter"])
def test_plans_stop_on_three_ranks_and_resume_on_two(name, tmp_path):
    first, second = _resume(name, tmp_path)
    _exact(second)


@pytest.mark.multiproc
def test_mpi_plan_stops_on_three_ranks_and_resumes_on_two(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    worker = str(HERE / "mpi_workers" / "elastic.py")
    launch.mpiexec(3, [worker, "first", "plan_pipeline_split", path], timeout=240)
    proc = launch.mpiexec(2, [worker, "second", "plan_pipeline_split", path], timeout=240)
    _exact(json.loads(proc.stdout.strip().splitlines()[-1]))
