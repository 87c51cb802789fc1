"""The planner hands the runtime what it plans: ``predict_plan`` (the step of any Plan) against
the existing predictors on the plans they cover and against a brute-force schedule; the
top-level layers a plan counts; ``Prediction.to_plan()`` round trips; device subsets and
asymmetric replicas win where they should; ``hetcoll plan --out``."""

from __future__ import annotations

import functools
import itertools
import json
import math
import random
from collections import OrderedDict
from pathlib import Path

import plan_cases
import pytest
from torch import nn

from hetcoll import Plan
from hetcoll.cli import main
from hetcoll.model import (
    Cluster,
    Device,
    Link,
    Node,
    Prediction,
    layer_costs,
    load_cluster,
    networks,
    plan,
    predict_plan,
    terms,
)
from hetcoll.model import predict_data_parallel as data_parallel
from hetcoll.model import predict_filter_parallel as filter_parallel
from hetcoll.model import predict_pipeline as pipeline
from hetcoll.torch.filters import filter_modes
from hetcoll.torch.layers import model_layers
from hetcoll.torch.parallel import schedule_order

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "clusters"


def _cluster(
    devs: list[tuple[float, float]], bw: float = 1e9, lat: float = 1e-5, mem: float = 1e10
) -> Cluster:
    nodes = [Node(f"n{i}", Device(f"d{i}", f, m, mem, 1e-6), 1) for i, (f, m) in enumerate(devs)]
    return Cluster(nodes, Link("net", lat, bw) if len(nodes) > 1 else None)


@pytest.fixture(scope="module")
def cnn_costs():  # type: ignore[no-untyped-def]
    return layer_costs(networks.cnn(), (3, 32, 32))


# ---------------------------------------------------------------- the model's top-level layers


def test_costs_know_the_top_level_layers_a_plan_counts() -> None:
    import torchvision

    model = torchvision.models.resnet18(num_classes=5)
    costs = layer_costs(model, (3, 32, 32))
    names = [n for n, _ in model_layers(model)]
    assert costs.plan_layers == tuple(names) and len(names) == 11
    assert costs.plan_layer_kinds[9] == "Call"  # torch.flatten, traced out of the forward
    # Every costed layer sits in its top-level layer, in order; the fc is layer 10.
    assert costs.plan_layer_of[-1] == 10 and costs.layers[-1].name == "fc"
    assert list(costs.plan_layer_of) == sorted(costs.plan_layer_of)
    assert costs.plan_range(4, 5) == (
        4,
        4 + sum(1 for x in costs.layers if x.name[:7] == "layer1."),
    )
    assert costs.plan_range(9, 10)[0] == costs.plan_range(9, 10)[1]  # flatten: nothing costed
    # Output bytes per sample of each top-level layer (float32): 64 x 16 x 16 after conv1, ...
    assert costs.plan_out_bytes[0] == 64 * 16 * 16 * 4
    assert costs.plan_out_bytes[8] == costs.plan_out_bytes[9] == 512 * 4
    assert costs.plan_out_bytes[10] == 5 * 4
    bare = layer_costs(nn.Linear(4, 3), (4,))
    assert bare.plan_layers == () and "no child modules" in bare.plan_layers_note
    with pytest.raises(ValueError, match="top-level layers are unknown"):
        bare.check_plan_layers()


def test_a_model_whose_blocks_work_in_place_has_plan_layers() -> None:
    # DenseNet's forward runs F.relu(features, inplace=True) between features.norm5 and the
    # classifier, and features.relu0 is an in-place block: the probe's stand-ins for blocks'
    # outputs used to be leaves requiring a gradient, which torch refuses to modify in place,
    # and the model had no plan layers.
    model = plan_cases.densenet()
    costs = layer_costs(model, (3, 16, 16))
    assert costs.plan_layers_note == ""
    assert costs.plan_layers == tuple(n for n, _ in model_layers(model))
    assert costs.plan_layers[2] == "features.relu0" and len(costs.plan_layers) == 11


def _runtime_stage_modes(model: nn.Module, lo: int, hi: int) -> dict[str, str]:
    layers = model_layers(model)
    return filter_modes(nn.Sequential(OrderedDict(layers[lo:hi])))


@pytest.mark.parametrize(
    "make, shape",
    [
        (plan_cases.cnn, (3, 8, 8)),
        (networks.cnn, (3, 32, 32)),
        (lambda: networks.mlp((8,)), (8,)),
        # Pairs that a cut can break and re-form differently: a chain of Linear layers.
        (
            lambda: nn.Sequential(
                nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
            ),
            (8,),
        ),
    ],
)
def test_stage_modes_are_the_runtime_s_for_every_range(make, shape) -> None:  # type: ignore[no-untyped-def]
    model = make()
    costs = layer_costs(model, shape)
    n = len(costs.plan_layers)
    for lo, hi in itertools.combinations(range(n + 1), 2):
        assert costs.stage_filter_modes(lo, hi) == _runtime_stage_modes(model, lo, hi), (lo, hi)


def test_stage_modes_of_a_traced_resnet() -> None:
    import torchvision

    model = torchvision.models.resnet18(num_classes=5)
    costs = layer_costs(model, (3, 32, 32))
    for lo, hi in [(0, 11), (0, 4), (3, 6), (8, 11), (10, 11)]:
        assert costs.stage_filter_modes(lo, hi) == _runtime_stage_modes(model, lo, hi)


# ---------------------------------------------------------------- the schedule, brute force


def _brute_force_pipeline(
    f: list[list[float]],
    b: list[list[float]],
    latency: float,
    transfer: list[list[float]],
    schedule: str,
) -> float:
    """Finish of a one-rank-per-stage pipeline as a longest path, by recursion over the ops:
    an op starts when the stage finished its previous op and its input arrived; a stage's
    sends go out one after another on its link (``transfer[s][k]``: stage s's message of
    micro-batch k, the same size forward and backward)."""
    n_st, m = len(f), len(f[0])
    orders = [schedule_order(schedule, s, n_st, m) for s in range(n_st)]
    where = {(s, op, k): i for s in range(n_st) for i, (op, k) in enumerate(orders[s])}

    @functools.cache
    def done(s: int, i: int) -> float:
        op, k = orders[s][i]
        start = done(s, i - 1) if i else 0.0
        if op == "F" and s > 0:
            start = max(start, arrival(s - 1, where[s - 1, "F", k], transfer[s - 1][k]))
        if op == "B" and s < n_st - 1:
            start = max(start, arrival(s + 1, where[s + 1, "B", k], transfer[s][k]))
        return start + (f if op == "F" else b)[s][k]

    def sends(s: int) -> list[int]:
        return [
            i
            for i, (op, _) in enumerate(orders[s])
            if (op == "F" and s < n_st - 1) or (op == "B" and s > 0)
        ]

    @functools.cache
    def link_free(s: int, i: int) -> float:
        """When stage s's link is free after the send of its op i."""
        before = [j for j in sends(s) if j < i]
        start = max(done(s, i), link_free(s, before[-1]) if before else 0.0)
        op, k = orders[s][i]
        size = transfer[s][k] if op == "F" else transfer[s - 1][k]
        return start + size

    def arrival(s: int, i: int, size: float) -> float:
        return link_free(s, i) + latency

    ends = []
    for s in range(n_st):
        last = done(s, len(orders[s]) - 1)
        out = [link_free(s, i) + latency for i in sends(s)]
        ends.append(max([last, *out]))
    return max(ends)


def _programs(
    f: list[list[float]],
    b: list[list[float]],
    latency: float,
    transfer: list[list[float]],
    schedule: str,
) -> list[list[tuple]]:
    n_st, m = len(f), len(f[0])
    progs: list[list[tuple]] = []
    for s in range(n_st):
        prog: list[tuple] = []
        for op, k in schedule_order(schedule, s, n_st, m):
            if op == "F":
                if s > 0:
                    prog.append(("recv", ("F", s, k)))
                prog.append(("compute", f[s][k]))
                if s < n_st - 1:
                    prog.append(("send", ((("F", s + 1, k), latency, transfer[s][k]),)))
            else:
                if s < n_st - 1:
                    prog.append(("recv", ("B", s, k)))
                prog.append(("compute", b[s][k]))
                if s > 0:
                    prog.append(("send", ((("B", s - 1, k), latency, transfer[s - 1][k]),)))
        prog.append(("wait_sends",))
        progs.append(prog)
    return progs


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_schedule_simulation_equals_a_brute_force_longest_path(schedule: str) -> None:
    rng = random.Random(3)
    for _ in range(60):
        n_st, m = rng.randint(1, 5), rng.randint(1, 6)
        f = [[rng.uniform(0.1, 2.0) for _ in range(m)] for _ in range(n_st)]
        b = [[rng.uniform(0.1, 4.0) for _ in range(m)] for _ in range(n_st)]
        transfer = [
            [rng.choice([0.0, rng.uniform(0.0, 1.5)]) for _ in range(m)] for _ in range(n_st)
        ]
        latency = rng.choice([0.0, 0.3])
        finish, _ = terms.schedule_finish_seconds(_programs(f, b, latency, transfer, schedule), {})
        want = _brute_force_pipeline(f, b, latency, transfer, schedule)
        assert max(finish) == pytest.approx(want, rel=1e-12)


def test_equal_stages_on_free_links_take_the_closed_form() -> None:
    # GPipe and 1F1B alike: (m + S - 1) x (f + b) for equal stages and micro-batches.
    for schedule, n_st, m in itertools.product(("GPipe", "1F1B"), (1, 2, 4), (1, 3, 8)):
        f = [[1.0] * m for _ in range(n_st)]
        b = [[2.0] * m for _ in range(n_st)]
        zero = [[0.0] * m for _ in range(n_st)]
        finish, _ = terms.schedule_finish_seconds(_programs(f, b, 0.0, zero, schedule), {})
        assert max(finish) == pytest.approx(float(terms.pipeline_seconds(3.0, n_st, m)))


def test_schedule_simulation_by_hand_and_its_errors() -> None:
    # Two stages, two micro-batches, GPipe, hop of 0.5 s: stage 0 forwards end at 1, 2; stage
    # 1 runs F0 1.5-2.5, F1 2.5-3.5, B0 3.5-5.5, B1 5.5-7.5 and waits until its last gradient
    # has arrived (8); stage 0 gets B0's gradient at 6, B1's at 8: B0 6-8, B1 8-10.
    f, b = [[1.0, 1.0], [1.0, 1.0]], [[2.0, 2.0], [2.0, 2.0]]
    finish, _ = terms.schedule_finish_seconds(_programs(f, b, 0.5, [[0, 0], [0, 0]], "GPipe"), {})
    assert finish == pytest.approx([10.0, 8.0])
    with pytest.raises(ValueError, match="deadlock"):
        terms.schedule_finish_seconds([[("recv", "never")]], {})
    with pytest.raises(ValueError, match="deadlock"):
        terms.schedule_finish_seconds([[("collective", 0)]], {0: (2, 1.0)})


def _linear_chain_costs():  # type: ignore[no-untyped-def]
    model = nn.Sequential(
        nn.Linear(8, 16, bias=False),
        nn.Linear(16, 16, bias=False),
        nn.Linear(16, 12, bias=False),
        nn.Linear(12, 4, bias=False),
    )
    return model, layer_costs(model, (8,))


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_pipeline_prediction_is_the_schedule_of_its_stage_times(schedule: str) -> None:
    # Linear layers on devices with free memory and no launch overhead: a layer takes exactly
    # 2 in out b / rate forward, as much again for the weight gradient and (not the first
    # layer) for the input gradient. Uneven stages (rates), uneven micro-batches (10 in 4).
    model, costs = _linear_chain_costs()
    rates = [1e9, 4e8, 7e8, 2e8]
    lat, bw = 2e-6, 5e8
    nodes = [Node(f"n{i}", Device(f"d{i}", r, 1e30, 1e10), 1) for i, r in enumerate(rates)]
    cluster = Cluster(nodes, Link("net", lat, bw))
    pred = pipeline(costs, cluster, 10, 4, layers_per_device=[1, 1, 1, 1], schedule=schedule)
    sizes = Plan.from_dict(
        {
            "microbatches": 4,
            "replicas": [{"samples": 10, "stages": [{"ranks": [0], "layers": [0, 4]}]}],
        }
    ).microbatch_sizes(0)
    assert sizes == [3, 3, 2, 2]
    dims = [(m.in_features, m.out_features) for m in model]
    f = [[2 * i * o * n / rates[s] for n in sizes] for s, (i, o) in enumerate(dims)]
    b = [
        [(2 if s else 1) * 2 * i * o * n / rates[s] for n in sizes] for s, (i, o) in enumerate(dims)
    ]
    transfer = [[o * 4 * n / bw for n in sizes] for _, o in dims]
    want = _brute_force_pipeline(f, b, lat, transfer, schedule)
    extra = pred.detail["loss_allreduce_s"] + pred.breakdown["optimizer"]
    assert pred.step_s - extra == pytest.approx(want, rel=1e-9)
    # The same step through its plan.
    assert predict_plan(costs, cluster, pred.to_plan()).step_s == pytest.approx(pred.step_s)


# ---------------------------------------------------------------- against the other predictors


def test_data_parallel_plan_is_the_data_parallel_step_without_ddp_s_overlap(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    # The runtime sums every gradient in one allreduce after the backward: DDP's prediction
    # with one bucket, no overlap and no buffer broadcast, plus (with an idle rank, outside the
    # sum) the loss's one-float allreduce.
    cluster = _cluster([(1e11, 2e10), (5e10, 1e10), (2e10, 5e9), (2e10, 5e9)])

    def like(shares: list[int]) -> Prediction:
        return data_parallel(
            cnn_costs,
            cluster,
            shares,
            overlap=False,
            broadcast_buffers=False,
            first_bucket_bytes=math.inf,
            bucket_bytes=math.inf,
        )

    shares = [40, 20, 4, 0]  # the last device sits out: idle in the plan
    dp = data_parallel(cnn_costs, cluster, shares)
    got = predict_plan(cnn_costs, cluster, dp.to_plan())
    assert got.step_s == pytest.approx(
        like(shares).step_s + got.detail["loss_allreduce_s"], rel=1e-12
    )
    assert got.detail["loss_allreduce_s"] > 0  # the idle rank's step: the loss's sum alone
    assert got.memory_bytes == pytest.approx(dp.memory_bytes)
    assert got.shares == shares and got.detail["idle_devices"] == [3]
    assert sum(got.breakdown.values()) == pytest.approx(got.step_s)
    # Every device a replica: one gradient sum over all of them, which carries the step's loss
    # and check (Parallel.step), so no collective of their own.
    busy = [40, 20, 4, 2]
    got = predict_plan(cnn_costs, cluster, data_parallel(cnn_costs, cluster, busy).to_plan())
    assert got.detail["loss_allreduce_s"] == 0.0
    assert got.step_s == pytest.approx(like(busy).step_s, rel=1e-12)


def test_filter_parallel_plan_is_the_filter_parallel_step(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    same = _cluster([(1e11, 2e10)] * 3)
    fp = filter_parallel(cnn_costs, same, 64, [1.0, 1.0, 1.0])
    got = predict_plan(cnn_costs, same, fp.to_plan())
    assert got.step_s == pytest.approx(fp.step_s + got.detail["loss_allreduce_s"], rel=1e-12)
    # Unequal devices: the loss's allreduce makes the ranks wait for each other before the
    # optimizer, which the lock-step prediction lets each rank start on its own.
    mixed = _cluster([(1e11, 2e10), (5e10, 1e10), (2e10, 5e9)])
    fp = filter_parallel(cnn_costs, mixed, 64, [1.0, 0.5, 0.2])
    got = predict_plan(cnn_costs, mixed, fp.to_plan())
    low = fp.step_s + got.detail["loss_allreduce_s"]
    assert low - 1e-15 <= got.step_s <= low + got.breakdown["optimizer"]
    assert fp.to_plan().replicas[0].stages[0].speeds == (1.0, 0.5, 0.2)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_pipeline_plan_is_the_pipeline_step(cnn_costs, schedule) -> None:  # type: ignore[no-untyped-def]
    cluster = _cluster([(1e11, 2e10), (5e10, 1e10), (5e10, 1e10)])
    pp = pipeline(cnn_costs, cluster, 30, 4, schedule=schedule)
    the_plan = pp.to_plan()
    assert the_plan.schedule == schedule and the_plan.microbatches == 4
    assert [s.ranks for s in the_plan.replicas[0].stages] == [
        (d,) for d in range(3) if pp.shares[d]
    ]
    got = predict_plan(cnn_costs, cluster, the_plan)
    assert got.step_s == pytest.approx(pp.step_s, rel=1e-12)
    assert got.memory_bytes == pytest.approx(pp.memory_bytes)


def test_one_stage_plan_on_one_device_is_data_parallel_on_it(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    one = _cluster([(1e11, 2e10)])
    dp = data_parallel(cnn_costs, one, [32])
    got = predict_plan(cnn_costs, one, dp.to_plan())
    assert got.step_s == pytest.approx(dp.step_s + got.detail["loss_allreduce_s"], rel=1e-12)
    pp = pipeline(cnn_costs, one, 32, 1)
    assert pp.step_s == pytest.approx(got.step_s, rel=1e-12)


def test_1f1b_keeps_fewer_activations_than_gpipe(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    cluster = _cluster([(1e11, 2e10)] * 4)
    stages = [5, 4, 5, 4]
    gpipe = pipeline(cnn_costs, cluster, 64, 8, layers_per_device=stages)
    ofob = pipeline(cnn_costs, cluster, 64, 8, layers_per_device=stages, schedule="1F1B")
    # GPipe keeps all 8 micro-batches' activations; 1F1B keeps 4 on the first stage, 1 on the
    # last.
    assert all(a < b for a, b in zip(ofob.memory_bytes, gpipe.memory_bytes))


def test_asymmetric_plan_with_a_filter_split_stage(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    # plan_cases' shapes on this model: a whole-model replica beside a two-stage replica whose
    # second stage is split over two ranks.
    n = len(cnn_costs.plan_layers)
    doc = {
        "microbatches": 3,
        "schedule": "GPipe",
        "replicas": [
            {"samples": 40, "stages": [{"ranks": [0], "layers": [0, n]}]},
            {
                "samples": 24,
                "stages": [
                    {"ranks": [1], "layers": [0, 7]},
                    {"ranks": [2, 3], "speeds": [1.0, 0.4], "layers": [7, n]},
                ],
            },
        ],
    }
    cluster = _cluster([(1e11, 2e10), (5e10, 1e10), (5e10, 1e10), (2e10, 5e9)])
    got = predict_plan(cnn_costs, cluster, Plan.from_dict(doc))
    assert got.feasible and got.shares == [40, 24, 24, 24]
    assert got.detail["gradient_allreduce_s"] > 0 and got.detail["replicas"] == 2
    # Faster links never make it slower; a faster device never does either.
    faster = predict_plan(cnn_costs, cluster.scaled(link_bw=10.0), Plan.from_dict(doc))
    assert faster.step_s <= got.step_s
    # Explicit shares of the split stage's first conv (plan layer 7) and their pair.
    doc["replicas"][1]["stages"][1] = {"ranks": [2, 3], "shares": {"7": [40, 24]}, "layers": [7, n]}
    predict_plan(cnn_costs, cluster, Plan.from_dict(doc))
    # A pair both named: the split-input layer's shares are of its partner's channels, as the
    # runtime reads them (layer 2's are conv 0's 8, not its own 12: they were refused).
    shares = predict_plan(
        layer_costs(plan_cases.cnn(), (3, 8, 8)), cluster, Plan.from_dict(plan_cases.SHARES)
    )
    assert shares.feasible


def test_bad_plans_are_named(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    cluster = _cluster([(1e11, 2e10)] * 4)
    n = len(cnn_costs.plan_layers)
    with pytest.raises(ValueError, match=f"stages cover 11 layers but the model has {n}"):
        predict_plan(cnn_costs, cluster, Plan.from_dict(plan_cases.PIPELINE_4))
    one = {"replicas": [{"samples": 8, "stages": [{"ranks": [4], "layers": [0, n]}]}]}
    with pytest.raises(ValueError, match="names rank 4 but the cluster has 4 devices"):
        predict_plan(cnn_costs, cluster, Plan.from_dict(one))
    # (a split-input layer takes its partner's channels: only the others need one per rank)
    thin = nn.Sequential(nn.Linear(8, 3), nn.ReLU(), nn.Linear(3, 8))
    split = {"replicas": [{"samples": 8, "stages": [{"ranks": [0, 1, 2, 3], "layers": [0, 3]}]}]}
    with pytest.raises(ValueError, match=r"plan.replicas\[0\].stages\[0\]: layer '0' has 3"):
        predict_plan(layer_costs(thin, (8,)), cluster, Plan.from_dict(split))
    relu = {"replicas": [{"samples": 8, "stages": [{"ranks": [0, 1], "layers": [1, 2]}]}]}
    relu["replicas"][0]["stages"].insert(0, {"ranks": [2], "layers": [0, 1]})
    relu["replicas"][0]["stages"].append({"ranks": [3], "layers": [2, 3]})
    with pytest.raises(ValueError, match="no Conv2d or Linear to split"):
        predict_plan(layer_costs(thin, (8,)), cluster, Plan.from_dict(relu))
    shares = {
        "replicas": [
            {"samples": 8, "stages": [{"ranks": [0, 1], "layers": [0, 3], "shares": {"1": [4, 4]}}]}
        ]
    }
    with pytest.raises(ValueError, match="layer 1 is not a Conv2d or Linear"):
        predict_plan(layer_costs(thin, (8,)), cluster, Plan.from_dict(shares))
    with pytest.raises(ValueError, match="top-level layers are unknown"):
        predict_plan(layer_costs(nn.Linear(4, 3), (4,)), cluster, Plan.from_dict(one))


# ---------------------------------------------------------------- the planner's plans


def test_every_candidate_carries_a_plan_that_round_trips(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    cluster = load_cluster(EXAMPLES / "a100_v100_cpu.toml")
    ranked = plan(cnn_costs, cluster, 512, prune=False)  # every candidate, none bounded out
    kinds = {p.strategy.split(",")[0] for p in ranked}
    assert {"data parallel", "filter parallel", "pipeline", "asymmetric"} <= kinds
    assert "replicated pipeline" in kinds
    for p in ranked:
        if not p.feasible and p.reason.startswith("the runtime cannot run it"):
            continue
        the_plan = p.to_plan()
        assert Plan.from_dict(json.loads(json.dumps(the_plan.to_dict()))) == the_plan
        assert the_plan.batch == 512 and the_plan.num_layers == len(cnn_costs.plan_layers)
        assert p.to_json()["plan"] == the_plan.to_dict()
        if p.strategy.startswith(("pipeline", "asymmetric", "replicated pipeline")):
            # These are predicted as the plan runs: the same figure from the plan (a plan on
            # a subset of the first devices runs on just those ranks).
            devices = p.detail.get("devices")
            world = cluster.first_devices(max(devices) + 1) if devices else cluster
            again = predict_plan(cnn_costs, world, the_plan)
            assert again.step_s == pytest.approx(p.step_s, rel=1e-12)


def test_pipelines_cut_only_between_top_level_layers() -> None:
    costs = layer_costs(networks.resnet(), (3, 32, 32))
    assert len(costs.layers) > len(costs.plan_layers)
    cluster = _cluster([(1e11, 2e10), (5e10, 1e10), (5e10, 1e10), (2e10, 5e9)])
    for p in plan(costs, cluster, 64):
        if p.strategy.startswith("pipeline"):
            cuts = list(itertools.accumulate(p.shares))[:-1]
            assert all(
                c == 0 or costs.plan_layer_of[c - 1] != costs.plan_layer_of[c]
                for c in cuts
                if c < len(costs.layers)
            )
            p.to_plan()
    inside = [5, len(costs.layers) - 5, 0, 0]  # layer 5 is inside the first basic block
    assert costs.plan_layer_of[4] == costs.plan_layer_of[5]
    pred = pipeline(costs, cluster, 64, 2, layers_per_device=inside)
    with pytest.raises(ValueError, match="ends inside top-level layer"):
        pred.to_plan()


def test_filter_splits_the_runtime_cannot_run_are_marked() -> None:
    # 5 classes on 8 devices: the last Linear (unpaired: it gathers) cannot give every rank a
    # channel.
    costs = layer_costs(networks.mlp((8,), classes=5), (8,))
    cluster = _cluster([(1e11, 2e10)] * 8)
    by = {p.strategy: p for p in plan(costs, cluster, 64)}
    fp = by["filter parallel, balanced"]
    assert (
        not fp.feasible and "the runtime cannot run it" in fp.reason and "5 channels" in fp.reason
    )
    with pytest.raises(ValueError, match="no plan the runtime can run"):
        fp.to_plan()


def test_the_planner_leaves_out_a_device_that_only_slows_the_step(cnn_costs) -> None:  # type: ignore[no-untyped-def]
    # Two fast devices on a fast link; a slow one behind a slow network: every allreduce that
    # includes it crosses the network.
    fast = Device("fast", 1e11, 2e10, 1e10, 1e-6)
    slow = Device("slow", 1e10, 5e9, 1e10, 1e-6)
    cluster = Cluster(
        [Node("a", fast, 2, Link("nv", 1e-6, 1e11)), Node("b", slow, 1)], Link("eth", 5e-5, 1e8)
    )
    ranked = plan(cnn_costs, cluster, 128)
    best = ranked[0]
    assert best.strategy == "data parallel, balanced, 2 of 3 devices", [
        (p.strategy, p.step_s) for p in ranked[:4]
    ]
    everyone = next(p for p in ranked if p.strategy == "data parallel, balanced")
    assert best.step_s < 0.9 * everyone.step_s
    assert best.shares == [64, 64, 0] and best.memory_bytes[2] == 0.0
    the_plan = best.to_plan()
    assert the_plan.ranks == (0, 1) and the_plan.place(2) is None  # device 2 idle
    # Its plan, predicted as the runtime runs it, also beats everyone's.
    assert (
        predict_plan(cnn_costs, cluster, the_plan).step_s
        < predict_plan(cnn_costs, cluster, everyone.to_plan()).step_s
    )


def _mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(256, 10))


def test_the_planner_puts_slow_small_devices_in_a_pipeline_beside_a_replica() -> None:
    # Two slow devices too small for the whole model: data parallelism can only use the fast
    # one; a pipeline of the two slow ones, as a second replica, adds their speed.
    costs = layer_costs(_mlp(), (256,))
    fast = Device("fast", 2e10, 2e10, 1e9, 1e-6)
    slow = Device("slow", 5e9, 5e9, 3e6, 1e-6)
    cluster = Cluster(
        [Node("a", fast, 1), Node("b", slow, 2, Link("l", 1e-5, 1e9))], Link("net", 1e-5, 1e10)
    )
    ranked = plan(costs, cluster, 256)
    best = ranked[0]
    assert best.strategy.startswith("asymmetric, 1 whole-model replica + pipeline of 2"), [
        (p.strategy, p.step_s) for p in ranked[:4]
    ]
    dp = next(p for p in ranked if p.strategy == "data parallel, balanced")
    assert dp.shares == [256, 0, 0]  # the slow devices cannot hold the model
    assert best.step_s < 0.85 * dp.step_s
    the_plan = best.to_plan()
    whole, piped = the_plan.replicas
    assert whole.stages[0].ranks == (0,) and [s.ranks for s in piped.stages] == [(1,), (2,)]
    assert whole.samples > piped.samples > 0 and the_plan.batch == 256
    assert predict_plan(costs, cluster, the_plan).step_s == pytest.approx(best.step_s)


def test_cli_plan_writes_the_best_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    cluster = str(EXAMPLES / "a100_v100_cpu.toml")
    argv = ["plan", "--model", "cnn", "--input", "3x32x32", "--batch", "256", "--cluster", cluster]
    assert main([*argv, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out}" in text and "plan:" in text
    written = Plan.load(out)
    assert written.batch == 256
    assert main([*argv, "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]
    assert best["plan"] == written.to_dict()
    with pytest.raises(SystemExit):
        main([*argv, "--sweep", "batch", "--out", str(out)])
    tiny = tmp_path / "tiny.toml"
    tiny.write_text(
        "[devices.d]\nflops_per_s = 1e11\nmem_bytes_per_s = 1e10\nmemory_bytes = 1e6\n"
        '[[nodes]]\nname = "n"\ndevice = "d"\ncount = 1\n'
    )
    with pytest.raises(SystemExit) as e:
        main([*argv[:-1], str(tiny), "--out", str(tmp_path / "none.json")])
    assert e.value.code == 2 and not (tmp_path / "none.json").exists()
    assert "--out: no feasible plan" in capsys.readouterr().err


def test_the_runtime_s_resnet18_plan_is_predicted() -> None:
    # plan_cases.RESNET, which the runtime trains exactly: torchvision's traced ResNet-18 as an
    # uneven 2-stage pipeline beside a whole-model replica.
    import torchvision

    costs = layer_costs(torchvision.models.resnet18(num_classes=5), (3, 32, 32))
    cluster = _cluster([(1e11, 2e10), (5e10, 1e10), (5e10, 1e10)])
    got = predict_plan(costs, cluster, Plan.from_dict(plan_cases.RESNET))
    assert got.feasible and got.shares == [3, 3, 2] and got.detail["replicas"] == 2
    assert got.detail["gradient_allreduce_s"] > 0


def test_plan_is_exported_and_predicts_a_saved_plan(tmp_path: Path, cnn_costs) -> None:  # type: ignore[no-untyped-def]
    import hetcoll.model

    assert hetcoll.model.predict_plan is predict_plan
    cluster = _cluster([(1e11, 2e10)] * 2)
    best = plan(cnn_costs, cluster, 64)[0]
    best.to_plan().save(tmp_path / "p.json")
    again = predict_plan(cnn_costs, cluster, Plan.load(tmp_path / "p.json"))
    assert again.feasible and again.batch == 64
