"""Node-wise placement (plan stages with ``owners``) run for real: tests/owners_cases.py inside
every rank of a 3-process gloo job and of a 3-process MPI job (every case equal to one process in
float64 to 1e-10; bad placements raise on every rank). Here the ranks' ``traffic()`` is summed
and compared with the km1 of the same partition of ``network_hypergraph``; the Plan's ``owners``
validation and JSON round trip run in-process."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import owners_cases
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hetcoll
from hetcoll import Plan, launch
from hetcoll.model import (
    hypergraph_plan,
    network_hypergraph,
    placement_traffic,
    predict_placement,
)

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
    assert [r["memory"] for r in results] == [True] * 3
    for n, seed in enumerate(owners_cases.RANDOM_SEEDS):
        want = _expected(owners_cases.random_plan(seed))
        assert want["activations"] > 0 and want["outputs"] > 0
        assert _summed([r["random"][n] for r in results]) == want, seed
    for case, plan in (("layers", owners_cases.LAYERS), ("pipeline", owners_cases.PIPELINE)):
        assert _summed([r[case] for r in results]) == _expected(plan), case
        # ... and the library's prediction of the same bytes.
        assert _summed([r[case] for r in results]) == placement_traffic(
            owners_cases.cnn().double(), owners_cases.SHAPE, Plan.from_dict(plan)
        )
    # The partitioner's placement runs (exactly, in the job), moving the bytes predicted.
    plan = hypergraph_plan(
        owners_cases.cnn().double(),
        owners_cases.SHAPE,
        owners_cases.HYPERGRAPH_SPEEDS,
        12,
        microbatches=2,
    )
    measured = _summed([r["hypergraph"] for r in results])
    assert measured == placement_traffic(owners_cases.cnn().double(), owners_cases.SHAPE, plan)
    assert measured == _expected(plan.to_dict())
    # Whole layers to different ranks: each layer's maps go to the one rank that reads them.
    assert [r["layers"]["activations"] for r in results] == [
        14 * BYTES * 7 * 4 * 4 * 1,  # rank 0: pooled conv maps to rank 1 ...
        14 * BYTES * 9 * 4 * 4 * 1,  # rank 1: conv maps (read flattened) to rank 2
        14 * BYTES * 11 * 2,  # rank 2: neurons to ranks 0 and 1 (layer 9's owners)
    ]
    # An owners stage before another: its lead gathers the maps and sends them on.
    middle = [r["middle"] for r in results]
    assert middle[0]["activations"] == 0 and middle[2]["outputs"] > 0
    assert middle[0]["gradients"] == 9 * BYTES * 9 * 4 * 4  # back to the owners stage's lead
    asym = [r["asymmetric"] for r in results]
    assert all(t["allreduce"] > 0 for t in asym)  # the replicas' gradients were combined
    assert asym[0]["activations"] == 0 and asym[1]["activations"] > 0


@pytest.mark.multiproc
def test_gloo_owners_placements_equal_one_process():
    _check(launch.spawn(owners_cases.run_torch, 3, timeout=300))


@pytest.mark.multiproc
def test_mpi_owners_placements_equal_one_process():
    proc = launch.mpiexec(3, [str(HERE / "mpi_workers" / "cases.py"), "owners_cases"], timeout=300)
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


def test_network_hypergraph_reads_a_float64_model():
    # It ran the model on float32 zeros, which a float64 model rejects.
    h = network_hypergraph(owners_cases.cnn().double(), owners_cases.SHAPE, bytes_per_element=8)
    assert [(name, count) for name, _, count in h.layers] == [
        ("0", 7),
        ("4", 9),
        ("7", 11),
        ("9", 5),
    ]


def test_hypergraph_plan_balances_and_checks_its_arguments():
    model = owners_cases.cnn()
    h = network_hypergraph(model, owners_cases.SHAPE)
    plan = hypergraph_plan(model, owners_cases.SHAPE, [3.0, 1.0], 8, epsilon=0.05)
    (stage,) = plan.replicas[0].stages
    assert stage.ranks == (0, 1) and stage.layers == (0, 10) and plan.batch == 8
    parts = np.concatenate([stage.owners[k] for k in (0, 4, 7, 9)])
    load = np.bincount(parts, weights=h.vertex_weights, minlength=2) / h.vertex_weights.sum()
    assert load[0] <= 1.05 * 0.75 and load[1] <= 1.05 * 0.25
    one = hypergraph_plan(model, owners_cases.SHAPE, [1.0], 8)
    assert one.replicas[0].stages[0].owners is None
    with pytest.raises(ValueError, match="speeds"):
        hypergraph_plan(model, owners_cases.SHAPE, [1.0, -1.0], 8)
    with pytest.raises(ValueError, match="batch"):
        hypergraph_plan(model, owners_cases.SHAPE, [1.0, 1.0], 0)
    with pytest.raises(ValueError, match="microbatches"):
        hypergraph_plan(model, owners_cases.SHAPE, [1.0, 1.0], 4, microbatches=0)
    with pytest.raises(ValueError, match=r"model: layer 0 \('0', ReLU\) starts the stage"):
        hypergraph_plan(
            torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(4, 8)), (4,), [1.0, 1.0], 4
        )
    with pytest.raises(ValueError, match="has 2 replicas"):
        placement_traffic(model, owners_cases.SHAPE, Plan.from_dict(owners_cases.ASYMMETRIC))


def test_predicted_step_pipelines_whole_layers_over_micro_batches():
    # Three equal Linear layers on three ranks, links free: the replayed schedule is a pipeline
    # of S = 3 stages, forward t per micro-batch and stage, backward 2t, the loss after the
    # last forward: 3 t (M + S - 1), where one micro-batch would take 3 t S with t M times larger.
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 8),
    )
    owners = {"0": [0] * 8, "2": [1] * 8, "4": [2] * 8}
    flops = 8 * 2 * 8 * 16  # neurons x 2 in_features x batch, per layer
    for m in (1, 2, 4, 8):
        plan = Plan.from_dict(
            {
                "microbatches": m,
                "replicas": [
                    {
                        "samples": 16,
                        "stages": [{"ranks": [0, 1, 2], "layers": [0, 5], "owners": owners}],
                    }
                ],
            }
        )
        p = predict_placement(net, (8,), plan, flops_per_s=[1.0] * 3, bytes_per_s=math.inf)
        assert p.step_s == 3 * (flops / m) * (m + 2)
        assert p.compute_s == [3.0 * flops] * 3
    # A slower link adds its latency and bytes on the critical path; a slower rank its compute.
    slow = predict_placement(net, (8,), plan, flops_per_s=[1.0, 0.5, 1.0], bytes_per_s=math.inf)
    assert slow.compute_s[1] == 6.0 * flops and slow.step_s > p.step_s
    linked = predict_placement(net, (8,), plan, flops_per_s=[1.0] * 3, bytes_per_s=1.0)
    assert linked.step_s > p.step_s
    with pytest.raises(ValueError, match="flops_per_s"):
        predict_placement(net, (8,), plan, flops_per_s=[1.0, 1.0], bytes_per_s=1.0)
    with pytest.raises(ValueError, match="one replica of one stage"):
        predict_placement(
            owners_cases.cnn(),
            owners_cases.SHAPE,
            Plan.from_dict(owners_cases.PIPELINE),
            flops_per_s=[1.0] * 3,
            bytes_per_s=1.0,
        )


def test_predict_plan_refuses_owners_stages_rather_than_mispredicting():
    # It read an owners stage as an equal-speed filter split and predicted that.
    from hetcoll.model import Cluster, Device, Link, Node, layer_costs, predict_plan

    nodes = [Node(f"n{i}", Device(f"d{i}", 1e11, 2e10, 1e10, 1e-6), 1) for i in range(3)]
    cluster = Cluster(nodes, Link("net", 1e-5, 1e9))
    costs = layer_costs(owners_cases.cnn(), owners_cases.SHAPE)
    plan = Plan.from_dict(owners_cases.random_plan(0))
    with pytest.raises(ValueError, match=r"stages\[0\]: places channels by owners"):
        predict_plan(costs, cluster, plan)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_km1_counts_what_the_runtime_sends_for_any_placement(data):
    # The runtime's rule (hetcoll.torch.placement's blocks: each map to every other rank owning
    # channels of the next block) against network_hypergraph's km1, for random placements on
    # 2-4 ranks; tests/owners_cases.py measures the same on real ranks for a few of them.
    from hetcoll.torch.layers import model_layers
    from hetcoll.torch.placement import owners_blocks

    p = data.draw(st.integers(2, 4))
    owners = {
        str(k): data.draw(st.lists(st.integers(0, p - 1), min_size=n, max_size=n))
        for k, n in owners_cases.WIDTHS.items()
    }
    stage = {"ranks": list(range(p)), "layers": [0, 10], "owners": owners}
    plan = Plan.from_dict({"replicas": [{"samples": 3, "stages": [stage]}]})
    model = owners_cases.cnn().double()
    layers = model_layers(model)
    blocks = owners_blocks(layers, plan.replicas[0].stages[0], "stage")
    x = torch.zeros((1, *owners_cases.SHAPE), dtype=torch.float64)
    shapes = []
    with torch.no_grad():
        for _, m in layers:
            x = m.eval()(x)
            shapes.append(x.shape)
    sent = 0
    for k, b in enumerate(blocks[:-1]):
        per_channel = math.prod(shapes[b.last_layer][2:]) * BYTES
        readers = set(blocks[k + 1].owner_ranks)
        sent += sum(len(readers - {o}) for o in b.owners) * per_channel
    traffic = placement_traffic(model, owners_cases.SHAPE, plan)
    assert traffic["activations"] == traffic["gradients"] == sent * 3
