"""Node-wise placement (plan stages with ``owners``) run for real: tests/owners_cases.py inside
every rank of a 3-process gloo job and of a 3-process MPI job (every case equal to one process in
float64 to 1e-10; bad placements raise on every rank). Here the ranks' ``traffic()`` is summed
and compared with the km1 of the same partition of ``network_hypergraph``; the Plan's ``owners``
validation and JSON round trip run in-process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import owners_cases
import pytest

import hetcoll
from hetcoll import Plan, launch
from hetcoll.model import network_hypergraph

HERE = Path(__file__).resolve().parent
BYTES = 8  # float64


def _parts(stages: list[dict[str, Any]]) -> np.ndarray:
    """The partition of network_hypergraph's vertices the plan's single replica makes: an
    owners stage's channel -> its owner's rank, a one-rank stage's channels -> that rank."""
    h = network_hypergraph(owners_cases.cnn(), owners_cases.SHAPE, bytes_per_element=BYTES)
    parts = np.full(h.num_vertices, -1, dtype=np.int64)
    for name, first, count in h.layers:
        layer = int(name)
        for s in stages:
            if s["layers"][0] <= layer < s["layers"][1]:
                if "owners" in s:
                    parts[first : first + count] = [s["ranks"][i] for i in s["owners"][name]]
                else:
                    parts[first : first + count] = s["ranks"][0]
    assert (parts >= 0).all()
    return parts


def _expected(plan: dict[str, Any]) -> dict[str, int]:
    """Bytes summed over ranks: km1 times the batch forward and backward; the last layer's
    neurons not owned by the lead travel to it and their gradients back ("outputs")."""
    (replica,) = plan["replicas"]
    stages, batch = replica["stages"], replica["samples"]
    h = network_hypergraph(owners_cases.cnn(), owners_cases.SHAPE, bytes_per_element=BYTES)
    km1 = hetcoll.km1(h.nets, _parts(stages), h.net_weights)
    last = stages[-1]
    away = sum(1 for i in last["owners"]["9"] if i != 0) if "owners" in last else 0
    return {
        "activations": round(km1 * batch),
        "gradients": round(km1 * batch),
        "outputs": 2 * away * BYTES * batch,
        "allreduce": 0,
    }


def _summed(per_rank: list[dict[str, int]]) -> dict[str, int]:
    return {k: sum(t[k] for t in per_rank) for k in per_rank[0]}


def _check(results: list[dict[str, Any]]) -> None:
    assert [r["errors"] for r in results] == [5, 5, 5]
    for n, seed in enumerate(owners_cases.RANDOM_SEEDS):
        want = _expected(owners_cases.random_plan(seed))
        assert want["activations"] > 0 and want["outputs"] > 0
        assert _summed([r["random"][n] for r in results]) == want, seed
    for case, plan in (("layers", owners_cases.LAYERS), ("pipeline", owners_cases.PIPELINE)):
        assert _summed([r[case] for r in results]) == _expected(plan), case
    # Whole layers to different ranks: each layer's maps go to the one rank that reads them.
    assert [r["layers"]["activations"] for r in results] == [
        14 * BYTES * 7 * 4 * 4 * 1,  # rank 0: pooled conv maps to rank 1 ...
        14 * BYTES * 9 * 4 * 4 * 1,  # rank 1: conv maps (read flattened) to rank 2
        14 * BYTES * 11 * 2,  # rank 2: neurons to ranks 0 and 1 (layer 9's owners)
    ]
    asym = [r["asymmetric"] for r in results]
    assert all(t["allreduce"] > 0 for t in asym)  # the replicas' gradients were combined
    assert asym[0]["activations"] == 0 and asym[1]["activations"] > 0


@pytest.mark.multiproc
def test_gloo_owners_placements_equal_one_process():
    _check(launch.spawn(owners_cases.run_torch, 3, timeout=300))


@pytest.mark.multiproc
def test_mpi_owners_placements_equal_one_process():
    proc = launch.mpiexec(3, [str(HERE / "mpi_workers" / "owners.py")], timeout=300)
    _check(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_owners_round_trip_through_json(tmp_path):
    plan = Plan.from_dict(owners_cases.random_plan(0))
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    stage = plan.replicas[0].stages[0]
    assert stage.owners is not None and stage.owners[4] == tuple(owners_cases.random_owners(0)["4"])
    assert json.loads(path.read_text())["replicas"][0]["stages"][0]["owners"]["9"] == list(
        stage.owners[9]
    )


def _one_stage(**stage: Any) -> dict[str, Any]:
    return {"replicas": [{"samples": 4, "stages": [{"ranks": [0, 1], "layers": [0, 3], **stage}]}]}


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (_one_stage(owners={"0": [0, 1]}, speeds=[1, 1]), "give one of speeds, shares or owners"),
        (_one_stage(owners={}), r"stages\[0\].owners: must be a non-empty dict"),
        (_one_stage(owners=[0, 1]), r"stages\[0\].owners: must be a non-empty dict"),
        (_one_stage(owners={"x": [0]}), r"owners\['x'\]: the key must be a layer index"),
        (
            _one_stage(owners={"3": [0]}),
            r"owners\['3'\]: the key must be a layer index in \[0, 3\)",
        ),
        (_one_stage(owners={"1": []}), r"owners\['1'\]: needs one owner per channel, got none"),
        (
            _one_stage(owners={"1": [0, 2]}),
            r"owners\['1'\]\[1\]: must be an index into the stage's",
        ),
        (_one_stage(owners={"1": [0, True]}), r"owners\['1'\]\[1\]: must be an index"),
        (_one_stage(owners={"1": "01"}), r"owners\['1'\]: must be a list"),
        (
            {
                "replicas": [
                    {
                        "samples": 4,
                        "stages": [{"ranks": [0], "layers": [0, 3], "owners": {"0": [0]}}],
                    }
                ]
            },
            "a stage with one rank computes every channel itself and takes no owners",
        ),
    ],
)
def test_invalid_owners_name_the_field(plan, message):
    with pytest.raises(ValueError, match=message):
        Plan.from_dict(plan)
