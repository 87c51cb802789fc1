"""Expert parallelism inside a Plan: the plan's ``experts`` place whole experts on its
replicas' ranks, :func:`parallelize` runs it as one process trains (tests/plan_experts_cases.py
on 4 gloo ranks), the performance model prices it and the planner proposes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hetcoll import Plan, launch

pytest.importorskip("transformers")

import plan_experts_cases as cases
import transformer_cases as tc

LAYER = cases.EXPERTS.format


@pytest.mark.multiproc
def test_gloo_plans_with_experts_train_as_one_process():
    """Every case against one process on the whole batch, float64, 1e-10: 3 single-rank
    replicas (experts 3 : 1 : 0, a micro-batch of prompt only, rank 3 idle); 2 replicas of 2
    stages under 1F1B, each layer placed its own way; a checkpoint (weights and Adam's state)
    taken under the first and resumed under the second; the planner's plans (replicas of one
    stage, and its pipelines of expert-parallel replicas); the second's
    experts placed again by hand and by an ExpertRebalancer as it trains; experts under
    PEFT's LoRA on their parameters. Plans that do not fit the model raise the same error on
    every rank."""
    results = launch.spawn(cases.run_torch, 4, timeout=400)
    by_speed = [r["by_speed"]["held"] for r in results]
    assert by_speed == [{LAYER(k): n for k in range(4)} for n in (3, 1, 0)] + [{}]
    assert results[3]["by_speed"]["traffic"] == dict.fromkeys(
        ("activations", "gradients", "outputs", "allreduce"), 0
    )  # the idle rank joins no exchange
    # Ranks 0 and 3 run the first stage of replicas 0 and 1, ranks 2 and 1 the second.
    assert [r["pipelines"]["held"] for r in results] == [
        {LAYER(0): 4, LAYER(1): 1},
        {LAYER(2): 2, LAYER(3): 4},
        {LAYER(2): 2, LAYER(3): 0},
        {LAYER(0): 0, LAYER(1): 3},
    ]
    assert all(r["resumed"] for r in results)
    # Under PEFT's LoRA on the experts' parameters, each replica's experts (3 : 1 : 0 of every
    # layer) hold their adapters' blocks, and train as one process.
    assert [sorted(set(r["lora"]["held"].values())) for r in results] == [[3], [1], [0], []]
    _placed_again(results)
    planned = results[0]["planned"]["plan"]
    assert "experts" in planned and all(r["planned"]["plan"] == planned for r in results)
    assert sum(r["planned"]["held"][LAYER(0)] for r in results) == 4
    # The planner's pipeline of expert-parallel replicas: 2 replicas of 2 stages.
    pipeline = results[0]["planned_pipeline"]["plan"]
    assert all(r["planned_pipeline"]["plan"] == pipeline for r in results)
    assert pipeline["experts"] == [2, 2] and [len(r["stages"]) for r in pipeline["replicas"]] == [
        2,
        2,
    ]
    assert all(sum(r["planned_pipeline"]["held"].values()) > 0 for r in results)
    errors = results[0]["errors"]
    assert all(r["errors"] == errors for r in results)
    assert len(errors) == 3
    assert errors[0].startswith("plan.experts: must be 3 ints >= 0 summing to the 4 experts")
    assert errors[1].startswith("plan.experts: must name every experts module")
    assert errors[2].startswith("model: holds no experts module")


def _placed_again(results: list[dict]) -> None:
    """PIPELINES' experts moved by hand, then by the rebalancer (plan_experts_cases.
    placed_again): every rank's plan follows; each replica's ranks hold what it says."""
    again = [r.pop("placed_again") for r in results]
    # At 1 : 0.25 each layer's coolest expert goes to the slow replica, wherever it is: in
    # layer 0 (loads 65, 58, 63, 66) it takes 58 x 4 = 232 against 252 for every expert on
    # the fast one, the best of any runs in expert order.
    moved = {
        LAYER(0): [[0, 2, 3], [1]],
        LAYER(1): [[0, 1, 3], [2]],
        LAYER(2): [[0, 1, 2], [3]],
        LAYER(3): [[0, 2, 3], [1]],
    }
    counts = {k: [3, 1] for k in moved}
    # 2 steps of 7 rows of 9 tokens, 2 experts each, every replica's summed.
    assert [a["decisions"] for a in again] == [[[2, counts, moved, True]]] * 4
    assert all(a["routed"] == dict.fromkeys(moved, 252) for a in again)
    assert again[0]["loads"][LAYER(0)] == [65, 58, 63, 66]
    assert all(a["by_hand"] == cases.BY_HAND_LISTS and a["plan"] == moved for a in again)
    # Ranks 0 and 3 run replica 0's and 1's first stage, ranks 2 and 1 their second.
    assert [a["held"] for a in again] == [
        {LAYER(0): 3, LAYER(1): 3},
        {LAYER(2): 1, LAYER(3): 1},
        {LAYER(2): 3, LAYER(3): 3},
        {LAYER(0): 1, LAYER(1): 1},
    ]


def test_plan_with_experts_round_trips_through_json(tmp_path):
    for doc in (cases.BY_SPEED, cases.PIPELINES):
        plan = Plan.from_dict(doc)
        path = tmp_path / "plan.json"
        plan.save(path)
        assert Plan.load(path) == plan
        assert json.loads(path.read_text())["experts"] == doc["experts"]
    assert Plan.from_dict(cases.BY_SPEED).experts == (3, 1, 0)
    assert Plan.from_dict(cases.PIPELINES).experts[LAYER(1)] == (1, 3)
    assert Plan.from_dict(cases.PIPELINES).experts[LAYER(2)] == ((1, 3), (0, 2))
    no_experts = {k: v for k, v in cases.BY_SPEED.items() if k != "experts"}
    assert "experts" not in Plan.from_dict(no_experts).to_dict()


def _two_ranks_stage() -> dict:
    doc = json.loads(json.dumps(cases.BY_SPEED))
    doc["replicas"][0]["stages"][0]["ranks"] = [0, 3]
    return doc


def _other_cut() -> dict:
    doc = json.loads(json.dumps(cases.PIPELINES))
    doc["replicas"][1]["stages"][0]["layers"] = [0, 3]
    doc["replicas"][1]["stages"][1]["layers"] = [3, cases.LAYERS]
    return doc


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({**cases.BY_SPEED, "experts": [3, 1]}, r"plan.experts: needs one entry per replica \(3\)"),
        (
            {**cases.BY_SPEED, "experts": [[0, 1], [1], []]},
            "plan.experts: must name each of the 3 experts once; names expert 1 twice",
        ),
        (
            {**cases.BY_SPEED, "experts": [[0, 2], [3], []]},
            "plan.experts: must name each of the 3 experts once; misses expert 1",
        ),
        ({**cases.BY_SPEED, "experts": [[0], 1, []]}, "gives counts and expert indices together"),
        ({**cases.BY_SPEED, "experts": [[0], ["a"], []]}, r"plan.experts\[1\]\[0\]: must be an"),
        ({**cases.BY_SPEED, "experts": [0, 0, 0]}, "plan.experts: places no expert"),
        ({**cases.BY_SPEED, "experts": [3, -1, 2]}, r"plan.experts\[1\]: must be an integer >= 0"),
        # Counts are listed expert by expert: a file of a few bytes once filled the memory.
        ({**cases.BY_SPEED, "experts": [10**12, 0, 0]}, r"more than 16777216 \(MAX_EXPERTS\)"),
        ({**cases.BY_SPEED, "experts": {}}, "plan.experts: must name at least one"),
        ({**cases.BY_SPEED, "experts": {" x": [1, 1, 1]}}, "must be an experts module's path"),
        ({**cases.BY_SPEED, "experts": {"x": [1, 1]}}, r"plan.experts\['x'\]: needs one entry"),
        (_two_ranks_stage(), r"stages\[0\] splits over 2 ranks"),
        (_other_cut(), "the replicas must share their stages"),
        ({**cases.BY_SPEED, "microbatches": 3}, r"plan.replicas\[1\] has 2 samples"),
    ],
)
def test_invalid_experts_name_the_field(doc, message):
    with pytest.raises(ValueError, match=message):
        Plan.from_dict(doc)


# -- the performance model and the planner ----------------------------------------------------


def _costs(make=tc.mixtral):
    from hetcoll.model import layer_costs

    model = make("grouped_mm") if make is tc.mixtral else make()
    # The forward's inputs as parallelize gives them (with the mask: costed on the meta device).
    tokens = {"input_ids": (tc.SEQ,), "attention_mask": (tc.SEQ,)}
    return layer_costs(model, tokens, dtype=torch.int64)


def _cluster(*flops: float, memory: float = 8e9, calls_s: tuple = ()):
    from hetcoll.lab.validate import validation_cluster
    from hetcoll.model import Device, Link

    devices = [Device(f"d{i}", f, f, memory) for i, f in enumerate(flops)]
    return validation_cluster(devices, Link("link", 1e-4, 1e9, 0.0, calls_s))


def test_predict_plan_prices_a_plan_with_experts():
    """One device holding every expert steps as the plan without experts does; on a fast and
    a slow device, experts and samples by speed beat even; an idle device holds nothing;
    shapes the model does not price are named."""
    from hetcoll.model.predict import predict_plan

    costs = _costs()
    one = Plan.from_dict({"replicas": cases.replicas(16)})
    alone = Plan.from_dict({"replicas": cases.replicas(16), "experts": [4]})
    c1 = _cluster(1e10)
    assert predict_plan(costs, c1, alone).step_s == pytest.approx(
        predict_plan(costs, c1, one).step_s, rel=1e-12
    )
    two = _cluster(1e11, 2.5e10, 1e11)
    by_speed = Plan.from_dict({"replicas": cases.replicas(26, 6), "experts": [3, 1]})
    even = Plan.from_dict({"replicas": cases.replicas(16, 16), "experts": [2, 2]})
    fast = predict_plan(costs, two, by_speed)
    assert fast.step_s < predict_plan(costs, two, even).step_s
    assert fast.shares == [26, 6, 0] and fast.memory_bytes[2] == 0.0
    assert fast.plan is by_speed and fast.detail["experts"][LAYER(0)] == [3, 1]
    assert fast.detail["all_to_all_s"] > 0 and fast.detail["loss_allreduce_s"] > 0


def test_predict_plan_prices_micro_batches_of_a_plan_with_experts():
    """Micro-batches run one after another, every replica in each: on one device holding
    every expert the step is the plan's without experts; two micro-batches of equal halves
    take exactly one half's forward and backward more than that half alone (one sum, one
    update, one loss), holding its activations only under 1F1B, and under GPipe (every
    forward before the first backward) the whole batch's, as in one pass; the runtime's plan
    of 2 micro-batches (3 replicas, one of them without experts) is priced."""
    from hetcoll.model.predict import expert_plan_schedule, predict_plan

    costs = _costs()
    c1 = _cluster(1e10)
    for m in (2, 3):
        alone = Plan.from_dict({"microbatches": m, "replicas": cases.replicas(16), "experts": [4]})
        one = Plan.from_dict({"microbatches": m, "replicas": cases.replicas(16)})
        assert predict_plan(costs, c1, alone).step_s == pytest.approx(
            predict_plan(costs, c1, one).step_s, rel=1e-12
        )
    two = _cluster(1e11, 2.5e10)
    halves = Plan.from_dict(
        {
            "microbatches": 2,
            "schedule": "1F1B",
            "replicas": cases.replicas(26, 6),
            "experts": [3, 1],
        }
    )
    half = Plan.from_dict({"replicas": cases.replicas(13, 3), "experts": [3, 1]})
    both, once = predict_plan(costs, two, halves), predict_plan(costs, two, half)
    passes = expert_plan_schedule(costs, two, halves).passes
    assert len(passes) == 2 and [list(p.shares) for p in passes] == [[13, 3], [13, 3]]
    end, _ = expert_plan_schedule(costs, two, half).passes[0].timeline()
    assert both.step_s - once.step_s == pytest.approx(float(end.max()), rel=1e-12)
    assert both.memory_bytes == pytest.approx(once.memory_bytes, rel=1e-12)
    whole = predict_plan(costs, two, Plan.from_dict({**halves.to_dict(), "microbatches": 1}))
    assert all(a < b for a, b in zip(both.memory_bytes, whole.memory_bytes, strict=True))
    gpipe = Plan.from_dict({**halves.to_dict(), "schedule": "GPipe"})
    held = predict_plan(costs, two, gpipe)
    assert held.step_s == pytest.approx(both.step_s, rel=1e-12)
    assert held.memory_bytes == pytest.approx(whole.memory_bytes, rel=1e-12)
    # The closed form holds the same: the other half's activations on top of one half's.
    closed = [expert_plan_schedule(costs, two, p).prediction() for p in (halves, gpipe)]
    saved = costs.saved_bytes_per_sample()
    assert [b - a for a, b in zip(*(c.memory_bytes for c in closed), strict=True)] == (
        pytest.approx([13 * saved, 3 * saved], rel=1e-12)
    )
    assert both.shares == [26, 6] and both.detail["micro_batches"] == 2
    runtime = predict_plan(costs, _cluster(1e11, 5e10, 2.5e10), Plan.from_dict(cases.BY_SPEED))
    assert runtime.feasible and runtime.shares == [3, 2, 2]


def test_predict_plan_prices_pipelines_of_expert_parallel_replicas():
    """Replicas of several stages are simulated as any plan: a stage holding experts layers
    runs each at the tokens routed to its replica's experts, between exchanges with the same
    stage of every replica. One replica holding every expert steps as the plan without
    experts; the simulation of replicas of one stage is expert_plan_schedule's step; on a
    fast and a slow pipeline the experts by speed beat the reverse; each rank holds its own
    experts; the plan refuses a stage split over several ranks."""
    from hetcoll.model.predict import expert_plan_schedule, predict_plan
    from hetcoll.model.predict.layout import plan_layout
    from hetcoll.model.predict.schedule import layout_schedule
    from hetcoll.model.predict.staged_experts import StagedExperts

    costs = _costs()
    four = _cluster(1e11, 2.5e10, 1e11, 2.5e10)
    pipeline = cases.PIPELINES["replicas"][0]
    for schedule in ("1F1B", "GPipe"):
        alone = {"microbatches": 2, "schedule": schedule, "replicas": [pipeline]}
        assert predict_plan(costs, four, Plan.from_dict({**alone, "experts": [4]})).step_s == (
            pytest.approx(predict_plan(costs, four, Plan.from_dict(alone)).step_s, rel=1e-12)
        )
    thirds = {"microbatches": 3, "schedule": "GPipe", "replicas": cases.replicas(9, 4, 3)}
    for doc in (cases.BY_SPEED, {**thirds, "experts": [2, 1, 1]}):
        plan = Plan.from_dict(doc)
        layout = plan_layout(costs, four, plan)
        staged = StagedExperts(costs, four, layout, plan.experts)
        simulated = layout_schedule(costs, four, layout, plan.schedule, 1, "plan", experts=staged)
        passes = expert_plan_schedule(costs, four, plan).prediction()
        # (expert_plan_schedule's step leaves out the loss's allreduce, which predict_plan adds.)
        loss = simulated.detail["loss_allreduce_s"]
        assert simulated.prediction().step_s - loss == pytest.approx(passes.step_s, rel=1e-12)
    # Replica 0 on the fast devices (ranks 0, 2), replica 1 on the slow ones (3, 1).
    placed = Plan.from_dict(cases.PIPELINES)
    pred = predict_plan(costs, four, placed)
    assert pred.feasible and pred.shares == [4, 3, 4, 3]
    assert pred.detail["experts"] == placed.to_dict()["experts"]
    assert pred.detail["all_to_all_s"] > 0 and pred.detail["stages"] == 2
    steps = {}
    for name, held in (("by speed", [3, 1]), ("reversed", [1, 3])):
        plan = Plan.from_dict({**cases.PIPELINES, "experts": held})
        steps[name] = predict_plan(costs, four, plan)
    assert steps["by speed"].step_s < steps["reversed"].step_s
    # Rank 0 holds 3 experts of the first stage's layers, rank 3 one; their others alike.
    held_bytes = steps["by speed"].memory_bytes
    assert held_bytes[0] > held_bytes[3] and held_bytes[2] > held_bytes[1]
    split = {
        "replicas": [
            {"samples": 4, "stages": [{"ranks": [0, 1], "layers": [0, cases.LAYERS]}]},
            {"samples": 4, "stages": [{"ranks": [2, 3], "layers": [0, cases.LAYERS]}]},
        ],
        "experts": [2, 2],
    }
    with pytest.raises(ValueError, match="give every stage one rank"):
        predict_plan(costs, four, Plan.from_dict(split))


def test_every_exchange_of_a_plan_with_experts_pays_the_links_call_cost():
    """Each experts layer opens every forward with an exchange of counts and sends its rows
    out and back, forward and backward: five all-to-alls a pass, each paying the link's fixed
    cost of an all-to-all call; then one sum of the replicated gradients and the loss's
    allreduce, each an allreduce's."""
    from hetcoll.model.predict import predict_plan

    costs = _costs()
    a2a, allreduce = 2e-4, 7e-4
    plain = _cluster(1e11, 2.5e10)
    costly = _cluster(1e11, 2.5e10, calls_s=(("all_to_all", a2a), ("allreduce", allreduce)))
    for m in (1, 2):
        plan = Plan.from_dict(
            {"microbatches": m, "replicas": cases.replicas(26, 6), "experts": [3, 1]}
        )
        added = m * 5 * len(costs.experts) * a2a + 2 * allreduce
        a, b = (predict_plan(costs, c, plan).step_s for c in (plain, costly))
        assert b - a == pytest.approx(added, rel=1e-9), m


def test_the_planner_proposes_expert_parallelism():
    """For a mixture of experts the planner costs expert parallelism (by speed, and even);
    for a dense model it does not. Where every device is too small for all the experts but
    the devices together hold them, it is feasible where data parallelism is not; where one
    pass's activations do not fit either, in micro-batches."""
    from hetcoll.model import plan
    from hetcoll.model.planner.experts import expert_parallel_plan
    from hetcoll.model.predict import predict_plan

    costs = _costs()
    found = {p.strategy: p for p in plan(costs, _cluster(4e10, 1e10), 8)}
    assert {"expert parallel, balanced", "expert parallel, even"} <= set(found)
    assert found["expert parallel, balanced"].to_plan().experts is not None
    dense = plan(_costs(tc.llama), _cluster(4e10, 1e10), 8)
    assert not [p for p in dense if p.strategy.startswith("expert")]
    # Memory for about half the experts' weights and state on each device: data parallelism
    # no longer fits, expert parallelism does (and pipelines, which hold half the layers).
    whole = found["data parallel, even"].memory_bytes[0]
    experts = found["expert parallel, even"].memory_bytes[0]
    tight = {
        p.strategy: p for p in plan(costs, _cluster(4e10, 4e10, memory=(whole + experts) / 2), 8)
    }
    assert not tight["data parallel, even"].feasible
    assert not tight["data parallel, balanced"].feasible
    assert tight["expert parallel, even"].feasible
    assert tight["expert parallel, even"].to_plan().microbatches == 1
    # Memory between two micro-batches' activations and one's: in micro-batches it fits.
    layers = [(b.module, b.experts) for b in costs.experts]
    even_plan = expert_parallel_plan(8, [1.0, 1.0], layers, len(costs.plan_layers))
    cluster = _cluster(4e10, 4e10)
    once = predict_plan(costs, cluster, even_plan).memory_bytes[0]
    twice = predict_plan(
        costs,
        cluster,
        Plan.from_dict({**even_plan.to_dict(), "microbatches": 2, "schedule": "1F1B"}),
    )
    squeezed = {
        p.strategy: p
        for p in plan(costs, _cluster(4e10, 4e10, memory=(once + twice.memory_bytes[0]) / 2), 8)
    }
    assert squeezed["expert parallel, even"].feasible
    assert squeezed["expert parallel, even"].to_plan().microbatches == 2
    assert squeezed["expert parallel, even"].step_s == pytest.approx(twice.step_s, rel=1e-12)


def test_the_planner_places_experts_on_its_replicated_pipelines():
    """The fastest replicated pipelines the planner finds are costed again with each
    replica's experts only (placed by its samples): each rank then holds fewer experts, so
    where the devices are too small for every pipeline with all its experts, the pipeline
    with its replica's experts still fits, and the planner proposes it as a plan the runtime
    runs."""
    from hetcoll.model import Cluster, Device, Link, Node, plan

    costs = _costs()

    def node(memory: float) -> Cluster:  # one node: the planner's pipelines stay in a node
        return Cluster([Node("n", Device("d", 4e10, 4e10, memory), 4, Link("l", 1e-4, 1e9))])

    found = plan(costs, node(8e9), 16)
    twins = [p for p in found if p.strategy.endswith(", experts by speed")]
    assert twins and all(p.detail["stages"] == 2 and p.detail["replicas"] == 2 for p in twins)
    by_name = {p.strategy: p for p in found}
    for twin in twins:
        base = by_name[twin.strategy.removesuffix(", experts by speed")]
        assert max(twin.memory_bytes) < max(base.memory_bytes)
        assert twin.to_plan().experts == (2, 2) and twin.to_plan().replicas == (
            base.to_plan().replicas
        )
    # Two replicas of two one-device stages: with every expert, none fits; with their own,
    # they do. (A replica of two filter-split stages, which splits every expert, fits too.)
    shape = "replicated pipeline, 2 replicas x 2 stages,"
    pipelines = [p for p in found if p.strategy.startswith(shape)]
    smallest = min(max(p.memory_bytes) for p in pipelines if p not in twins)
    fits = min(max(p.memory_bytes) for p in twins)
    tight = plan(costs, node((smallest + fits) / 2), 16)
    feasible = [p.strategy for p in tight if p.feasible and p.strategy.startswith(shape)]
    assert feasible and all(name.endswith(", experts by speed") for name in feasible)


def test_the_planner_places_experts_by_measured_loads():
    """Given each experts layer's measured loads (two hot experts side by side), the
    planner's expert parallelism by speed parts the hot experts (any experts on any device:
    expert_assignment), which no cut into runs can do, and prices every experts plan at those
    loads: it beats the plan by speed alone priced at the same loads, which the skew slows
    down; the even candidate stays DeepSpeed's runs; the replicated pipelines' twins are
    placed by the loads too."""
    from hetcoll.model import Cluster, Device, Link, Node, plan
    from hetcoll.model.planner.experts import expert_parallel_plan
    from hetcoll.model.predict import predict_plan

    costs = _costs()
    layers = [(b.module, b.experts) for b in costs.experts]
    loads = {path: [8.0, 8.0, 1.0, 1.0] for path, _ in layers}
    cluster = _cluster(4e10, 4e10)
    found = {p.strategy: p for p in plan(costs, cluster, 8, expert_loads=loads)}
    balanced = found["expert parallel, balanced"]
    # (Every layer placed alike: one placement, as the plan writes it.)
    assert balanced.to_plan().experts == ((0, 2), (1, 3))
    assert found["expert parallel, even"].to_plan().experts == (2, 2)
    by_speed = expert_parallel_plan(8, [1.0, 1.0], layers, len(costs.plan_layers))
    assert by_speed.experts == (2, 2)
    skewed = predict_plan(costs, cluster, by_speed, loads=loads).step_s
    assert balanced.step_s < skewed
    assert skewed > predict_plan(costs, cluster, by_speed).step_s
    assert balanced.step_s == pytest.approx(
        predict_plan(costs, cluster, balanced.to_plan(), loads=loads).step_s, rel=1e-12
    )
    # Without loads: the runs by speed, as before.
    plain = {p.strategy: p for p in plan(costs, cluster, 8)}
    assert plain["expert parallel, balanced"].to_plan().experts == (2, 2)
    # Two replicas of two stages on four equal devices: their experts by load, parted too.
    node = Cluster([Node("n", Device("d", 4e10, 4e10, 8e9), 4, Link("l", 1e-4, 1e9))])
    twins = [p for p in plan(costs, node, 16, expert_loads=loads) if p.strategy.endswith("by load")]
    assert twins and all(t.to_plan().experts == ((0, 2), (1, 3)) for t in twins)


@pytest.mark.parametrize(
    "loads, message",
    [
        ({"nope": [1, 1, 1, 1]}, r"'nope' is no experts layer of the model \(they are: '"),
        ({LAYER(0): [1, 1, 1]}, f"'{LAYER(0)}' needs 4 finite numbers >= 0"),
        ({LAYER(0): [1, -1, 1, 1]}, f"'{LAYER(0)}' needs 4 finite numbers >= 0"),
        ({LAYER(0): [1, float("nan"), 1, 1]}, f"'{LAYER(0)}' needs 4 finite numbers >= 0"),
        ({LAYER(0): "many"}, f"'{LAYER(0)}' needs 4 finite numbers >= 0"),
        ([1, 2, 3, 4], "must map experts module paths to token counts, got list"),
    ],
)
def test_bad_expert_loads_name_the_argument(loads, message):
    """Loads for a layer the model does not have, or counts that are not one number >= 0 per
    expert, are refused by name, by the planner and by the model alike."""
    from hetcoll.model import plan
    from hetcoll.model.predict import expert_parallel

    costs = _costs()
    cluster = _cluster(4e10, 1e10)
    with pytest.raises(ValueError, match="^expert_loads: " + message):
        plan(costs, cluster, 8, expert_loads=loads)
    with pytest.raises(ValueError, match="^loads: " + message):
        expert_parallel(costs, cluster, [4, 4], [2, 2], loads=loads)


@pytest.mark.multiproc
def test_mpi_plans_with_experts_train_as_one_process():
    """The same on 4 MPI ranks (mpi4py, no torch.distributed): the experts' exchanges on an
    MPI sub-communicator of their own, and moved on it."""
    worker = str(Path(__file__).parent / "mpi_workers" / "cases.py")
    parts = ["by_speed", "pipelines", "placed_again"]
    proc = launch.mpiexec(4, [worker, "plan_experts_cases", *parts], timeout=400)
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    _placed_again(results)
    assert [r["by_speed"]["held"].get(LAYER(0)) for r in results] == [3, 1, 0, None]
    assert [sorted(r["pipelines"]["held"].values()) for r in results] == [
        [1, 4], [2, 4], [0, 2], [0, 3]
    ]  # fmt: skip


def test_expert_loads_of_megabytes_are_named_in_a_line() -> None:
    """A million counts, or a path of a million characters, were echoed in full."""
    from hetcoll.model.predict import expert_parallel

    costs, cluster = _costs(), _cluster(4e10, 1e10)
    for loads in ({LAYER(0): list(range(10**6))}, {"x" * 10**6: [1, 1, 1, 1]}):
        with pytest.raises(ValueError, match=r"^loads: ") as caught:
            expert_parallel(costs, cluster, [4, 4], [2, 2], loads=loads)
        assert len(str(caught.value)) < 600, len(str(caught.value))
