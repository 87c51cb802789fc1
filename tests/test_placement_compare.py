"""Seed 002's comparison (hetcoll.lab.placement_compare and benches/bench_placement.py): the five
plans and their predicted figures in-process, the benchmark's pieces, and what the benchmark
relies on in the runtime: a filter-split stage pairs its layers and counts its traffic every
step (a 2-rank gloo job)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hetcoll
from hetcoll import Plan, launch
from hetcoll.lab.placement_compare import (
    STRATEGIES,
    balance,
    comparison_plans,
    comparison_table,
    layer_flops,
    placement_compare,
)
from hetcoll.model import hypergraph_plan, network_hypergraph, placement_traffic

BENCHES = Path(__file__).resolve().parents[1] / "benches"
sys.path.insert(0, str(BENCHES))

import bench_placement  # noqa: E402

SHAPE = (1, 8, 8)
KINDS = ("activations", "gradients", "outputs", "allreduce")
SPEEDS = [1.0, 0.5, 0.25]
EPS = 0.2  # the small CNN's filters are too coarse for 3% balance over 3 blocks


def small_cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 12, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(12, 12, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(12 * 4 * 4, 18),
        nn.ReLU(),
        nn.Linear(18, 10),
    )


def test_plans_cover_every_strategy_on_every_rank() -> None:
    plans = comparison_plans(small_cnn(), SHAPE, SPEEDS, 32, microbatches=4, epsilon=EPS)
    assert list(plans) == list(STRATEGIES)
    for name, plan in plans.items():
        assert plan.batch == 32, name
        assert plan.num_layers == 9, name
    assert plans["hypergraph placement"] == hypergraph_plan(
        small_cnn(), SHAPE, SPEEDS, 32, microbatches=4, epsilon=EPS
    )
    (split,) = plans["speed-proportional filter split"].replicas[0].stages
    assert split.ranks == (0, 1, 2) and split.speeds == tuple(SPEEDS)
    (even,) = plans["even filter split"].replicas[0].stages
    assert even.speeds == (1.0, 1.0, 1.0)
    dp = plans["data parallel"]
    assert [r.samples for r in dp.replicas] == hetcoll.split(32, SPEEDS, minimum=1)
    assert all(r.stages[0].layers == (0, 9) for r in dp.replicas)
    pipe = plans["pipeline"]
    assert pipe.microbatches == 4
    stages = pipe.replicas[0].stages
    assert [s.layers[0] for s in stages[1:]] == [s.layers[1] for s in stages[:-1]]
    counts = hetcoll.partition_chain(layer_flops(small_cnn(), SHAPE), SPEEDS)
    assert [s.layers[1] - s.layers[0] for s in stages] == [n for n in counts if n]


def test_layer_flops_are_the_hypergraphs_per_top_level_layer() -> None:
    flops = layer_flops(small_cnn(), SHAPE)
    h = network_hypergraph(small_cnn(), SHAPE)
    assert sum(flops) == pytest.approx(float(h.vertex_weights.sum()))
    assert flops[0] == 2 * 1 * 9 * 64 * 12  # 12 filters, 1 input channel, 8x8 outputs
    assert [i for i, f in enumerate(flops) if f] == [0, 2, 6, 8]


def test_predicted_traffic_and_balance() -> None:
    model = small_cnn()
    rows = placement_compare(model, SHAPE, SPEEDS, 32, epsilon=EPS)
    by = {r.strategy: r for r in rows}
    assert [r.strategy for r in rows] == list(STRATEGIES)
    for name in ("hypergraph placement", "pipeline"):
        assert by[name].traffic == placement_traffic(model, SHAPE, by[name].plan)
    params = sum(p.numel() for p in model.parameters()) * 4
    assert by["data parallel"].traffic == {
        "activations": 0,
        "gradients": 0,
        "outputs": 0,
        "allreduce": 3 * round(2 * 2 / 3 * params),
    }
    assert by["even filter split"].traffic is None
    assert by["even filter split"].bytes_per_step is None
    # Every rank's FLOPs add up to the model's times the batch, whatever the split.
    total = 32 * sum(layer_flops(model, SHAPE))
    for r in rows:
        assert sum(r.flops) == pytest.approx(total), r.strategy
    # An even split (channels divide by 3) on ranks of speeds 1 : 0.5 : 0.25: compute times
    # 1 : 2 : 4 where sharing by speed would take 3 / 1.75 each.
    assert by["even filter split"].balance == pytest.approx(4 / (3 / 1.75))
    assert by["speed-proportional filter split"].balance < 1.2
    assert by["data parallel"].balance < 1.2
    text = comparison_table(rows)
    assert all(name in text for name in STRATEGIES)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model": "net"}, "model: must be a torch.nn.Module"),
        ({"input_shape": (1, 0, 8)}, "input_shape: expected the shape of one sample"),
        ({"speeds": [1.0]}, "speeds: needs two or more"),
        ({"speeds": [1.0, -1.0]}, "speeds: needs two or more"),
        ({"speeds": "fast"}, "speeds: must be a sequence"),
        ({"batch": 2}, "batch: must be an integer >= the number of speeds"),
        ({"microbatches": 0}, "microbatches: must be an integer >= 1"),
    ],
)
def test_bad_input_names_the_argument(change: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {
        "model": small_cnn(),
        "input_shape": SHAPE,
        "speeds": SPEEDS,
        "batch": 32,
        "microbatches": 4,
        "epsilon": EPS,
    }
    args.update(change)
    with pytest.raises((TypeError, ValueError), match=message):
        placement_compare(**args)


# -- the benchmark's pieces -----------------------------------------------------------------------


def test_compute_timer_includes_the_emulations_sleeps() -> None:
    """Lower bounds only (a sleep lasts at least as long as asked): a timer put on after the
    slow-down times its layer's forward and backward with the sleeps inside."""
    from hetcoll.lab.emulate import SlowDown

    class Fixed(SlowDown):
        def forward_delay(self, i: int, seconds: float, backward: bool) -> float:
            return 0.02

        def backward_delay(self, i: int, seconds: float) -> float:
            return 0.03

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    slow = Fixed([model[0], model[2]], 0.5)
    # SlowDown takes what one sleep overshot off the next, so only the sum is bounded below.
    both = bench_placement.ComputeTimer([model[0], model[2]])
    first = bench_placement.ComputeTimer([model[0]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first layer's backward hook fires at its output
        y = model(x)
        forward = first.seconds
        y.sum().backward()
    assert both.seconds >= 2 * 0.02 + 0.03  # two forwards, the second layer's backward
    assert forward >= 0.02  # the first sleep of all: nothing taken off
    assert first.seconds == forward  # no input needs a gradient: its backward is not timed
    earlier = both.seconds
    both.reset()
    with torch.no_grad():
        model(x)
    # What the first block overslept is taken off these sleeps: only the sum is bounded below
    # (0.0395 s here once, for 0.04 asked).
    assert earlier + both.seconds >= 2 * 0.02 + 0.03 + 2 * 0.02
    for t in (first, both):
        t.remove()
        t.reset()
    slow.remove()
    model(x).sum().backward()
    assert first.seconds == both.seconds == 0.0
    with pytest.raises(TypeError, match=r"layers: must be torch\.nn\.Modules"):
        bench_placement.ComputeTimer(["conv"])  # type: ignore[list-item]


def test_balance_is_the_slowest_over_the_speed_shared_ideal() -> None:
    assert balance([2.0, 2.0, 2.0], [1.0, 0.5, 0.25]) == pytest.approx(1.0)
    assert balance([1.0, 2.0, 4.0], [1.0, 0.5, 0.25]) == pytest.approx(4 / (3 / 1.75))
    assert balance([3.0, 0.0], [1.0, 1.0]) == pytest.approx(2.0)  # all on one of two equals
    for args, message in [
        (([0.0, 0.0], [1.0, 1.0]), "compute_s: needs some compute"),
        (([1.0, -1.0], [1.0, 1.0]), "compute_s: must be finite"),
        (([1.0, 1.0], [1.0, 0.0]), "speeds: must be finite numbers > 0"),
        (([1.0], [1.0, 1.0]), "compute_s, speeds: need one entry per rank"),
    ]:
        with pytest.raises(ValueError, match=message):
            balance(*args)


def test_batches_are_seeded_epochs_of_the_training_set() -> None:
    b = bench_placement.batches(5, 100)
    assert [len(x) for x in b] == [bench_placement.BATCH] * 5
    first = torch.cat(b)[:100]
    assert sorted(first.tolist()) == list(range(100))  # one epoch: a permutation
    assert all(torch.equal(x, y) for x, y in zip(b, bench_placement.batches(5, 100)))


def test_the_benchmark_model_runs_every_plan() -> None:
    """The plans the benchmark measures are ones the runtime accepts (as parallelize checks
    them, before any transfer): owners blocks and filter shares."""
    from hetcoll.torch.filters import filter_shares
    from hetcoll.torch.layers import model_layers
    from hetcoll.torch.placement import owners_blocks

    model = bench_placement.vgg_digits()
    plans = comparison_plans(model, bench_placement.SHAPE, bench_placement.SPEEDS, 64)
    stage = plans["hypergraph placement"].replicas[0].stages[0]
    assert len(owners_blocks(model_layers(model), stage, "stage")) == 6
    shares = filter_shares(model, size=3, speeds=list(bench_placement.SPEEDS))
    assert len(shares) == 6  # every Conv2d and Linear split


# -- the runtime: a filter-split stage pairs its layers and counts its traffic -------------------


def _split_stage(rank: int, world: int) -> dict[str, Any]:
    from hetcoll.torch import parallelize
    from hetcoll.torch.filters import FilterParallelLayer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 48), nn.ReLU(), nn.Linear(48, 64)).double()
    plan = {
        "microbatches": 1,
        "schedule": "GPipe",
        "replicas": [
            {"samples": 20, "stages": [{"ranks": [0, 1], "layers": [0, 3], "speeds": [2.0, 1.0]}]}
        ],
    }
    par = parallelize(model, plan, loss_fn=nn.MSELoss())
    assert par.stage is not None
    modes = [m.mode for m in par.stage.modules() if isinstance(m, FilterParallelLayer)]
    x = torch.randn(20, 8, dtype=torch.float64)
    y = torch.randn(20, 64, dtype=torch.float64)
    traffic = []
    for _ in range(2):
        par.step(x, y)
        traffic.append(par.traffic())
    return {"modes": modes, "traffic": traffic}


@pytest.mark.multiproc
def test_split_stage_pairs_its_layers_and_counts_every_step() -> None:
    results = launch.spawn(_split_stage, 2, timeout=120)
    for r in results:
        assert r["modes"] == ["split-output", "split-input"]
        first, second = r["traffic"]
        assert first == second
        # The split-input layer's partial sums ([20, 64] float64) allreduced forward: a ring
        # sends 2 (p-1)/p of them.
        assert first["activations"] >= 20 * 64 * 8
        assert first["allreduce"] == first["outputs"] == 0


def test_plan_of_the_benchmark_round_trips() -> None:
    model = bench_placement.vgg_digits()
    for plan in comparison_plans(model, bench_placement.SHAPE, bench_placement.SPEEDS, 64).values():
        assert Plan.from_dict(plan.to_dict()) == plan


def test_docstring_examples() -> None:
    import doctest

    import hetcoll.lab.placement_compare as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def _cluster(n: int) -> Any:
    from hetcoll.model.hardware import Cluster, Device, Link, Node

    nodes = [
        Node(f"d{r}", Device(f"d{r}", 1e10 * s, 1e10, 4e9, conv_flops_per_s=2e10 * s), 1)
        for r, s in enumerate(SPEEDS[:n])
    ]
    return Cluster(nodes, Link("net", 1e-5, 1e9))


def test_a_cluster_gives_each_plan_its_predicted_step() -> None:
    from hetcoll.model import layer_costs, predict_placement, predict_plan

    model = small_cnn()
    cluster = _cluster(3)
    rows = placement_compare(model, SHAPE, SPEEDS, 32, epsilon=EPS, cluster=cluster)
    by = {r.strategy: r for r in rows}
    hyper = by["hypergraph placement"]
    want = predict_placement(
        model,
        SHAPE,
        hyper.plan,
        flops_per_s=[2e10 * s for s in SPEEDS],
        bytes_per_s=1e9,
        latency_s=1e-5,
    ).step_s
    assert hyper.step_s == want
    costs = layer_costs(model, SHAPE)
    for name in STRATEGIES[1:]:
        assert by[name].step_s == predict_plan(costs, cluster, by[name].plan).step_s, name
        assert by[name].note == ""
    assert "step ms" in comparison_table(rows)
    assert all(r.step_s is None for r in placement_compare(model, SHAPE, SPEEDS, 32, epsilon=EPS))
    with pytest.raises(ValueError, match="cluster: has 2 devices; give one per speed"):
        placement_compare(model, SHAPE, SPEEDS, 32, epsilon=EPS, cluster=_cluster(2))
    with pytest.raises(TypeError, match=r"cluster: must be a hetcoll\.model\.Cluster"):
        placement_compare(model, SHAPE, SPEEDS, 32, epsilon=EPS, cluster="cluster.toml")


def _every_plan(rank: int, world: int, plans: dict[str, dict[str, Any]]) -> dict[str, Any]:
    from hetcoll.torch import parallelize

    torch.manual_seed(1)
    x = torch.randn(32, *SHAPE, dtype=torch.float64)
    y = torch.randint(0, 10, (32,))
    out = {}
    for name, plan in plans.items():
        torch.manual_seed(0)
        par = parallelize(small_cnn().double(), plan, loss_fn=nn.CrossEntropyLoss())
        opt = torch.optim.SGD(par.parameters(), lr=0.1)
        losses = []
        for _ in range(2):
            losses.append(par.step(x, y))
            opt.step()
            opt.zero_grad()
        out[name] = {"losses": losses, "traffic": par.traffic()}
    return out


@pytest.mark.multiproc
def test_every_plan_equals_one_process_and_moves_the_predicted_bytes() -> None:
    """The five plans on 3 gloo ranks in float64: two SGD steps equal to one process's, and the
    bytes the runtime counts equal to placement_compare's prediction where it has one."""
    model = small_cnn().double()
    rows = placement_compare(model, SHAPE, SPEEDS, 32, epsilon=EPS)
    plans = {r.strategy: r.plan.to_dict() for r in rows}
    results = launch.spawn(_every_plan, 3, plans, timeout=300)
    torch.manual_seed(1)
    x = torch.randn(32, *SHAPE, dtype=torch.float64)
    y = torch.randint(0, 10, (32,))
    torch.manual_seed(0)
    net = small_cnn().double()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    want = []
    for _ in range(2):
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(float(loss.detach()))
    for r in rows:
        for rank in range(3):
            got = results[rank][r.strategy]["losses"]
            assert got == pytest.approx(want, rel=1e-10, abs=0), (r.strategy, rank)
        summed = {k: sum(res[r.strategy]["traffic"][k] for res in results) for k in KINDS}
        if r.traffic is not None:
            assert summed == r.traffic, r.strategy
        else:
            assert summed["activations"] > 0, r.strategy  # the splits' gathers / reductions
