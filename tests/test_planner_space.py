"""The planner's larger space (issue 28 part 3): every family is in it on a small cluster,
every candidate is the plan it names (its figure is predict_plan's on that plan), a few of
them run for real on gloo equal to one process, node-wise plans are ranked beside the others
with seed 002's comparison, and hetcoll plan shows why the best wins, plots and writes JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import plan_cases
import pytest

from hetcoll import Plan, launch
from hetcoll.cli import main
from hetcoll.model import (
    Cluster,
    Device,
    Link,
    Node,
    layer_costs,
    load_cluster,
    plan,
    predict_plan,
)
from hetcoll.model.planner import SearchReport, explain

SHAPE = (3, 8, 8)
BATCH = 16


def _cluster() -> Cluster:
    """A node of four devices and one of two, the first kind twice as fast as the other."""
    fast = Device("fast", 2e9, 4e9, 1e10, 1e-6)
    slow = Device("slow", 1e9, 2e9, 1e10, 1e-6)
    return Cluster(
        [Node("a", fast, 4, Link("nv", 1e-6, 1e10)), Node("b", slow, 2, Link("nv", 1e-6, 1e10))],
        Link("net", 1e-5, 1e9),
    )


@pytest.fixture(scope="module")
def ranked():  # type: ignore[no-untyped-def]
    # Every candidate costed (prune=False): the space itself.
    model = plan_cases.cnn()
    costs = layer_costs(model, SHAPE)
    report = SearchReport()
    return costs, plan(costs, _cluster(), BATCH, model=model, report=report, prune=False), report


def test_the_bounds_prune_and_keep_the_best(ranked) -> None:  # type: ignore[no-untyped-def]
    costs, every, unpruned = ranked
    report = SearchReport()
    pruned = plan(costs, _cluster(), BATCH, model=plan_cases.cnn(), report=report)
    assert not unpruned.pruned and report.pruned, report.pruned
    assert len(pruned) < len(every)
    assert pruned[0].strategy == every[0].strategy and pruned[0].step_s == every[0].step_s
    # What the bounds dropped was slower than the best, and no candidate is new.
    kept = {p.strategy for p in pruned}
    assert kept <= {p.strategy for p in every}
    assert all(p.step_s >= pruned[0].step_s for p in every if p.strategy not in kept)


def test_the_space_holds_every_family(ranked) -> None:  # type: ignore[no-untyped-def]
    _, out, _ = ranked
    names = [p.strategy for p in out]
    for family in (
        "data parallel, balanced",
        "data parallel, even",
        "filter parallel",
        "pipeline",
        "replicated pipeline",
        "asymmetric",
        "node-wise, hypergraph placement",
        "node-wise, even filter split",
    ):
        assert any(n.startswith(family) for n in names), (family, names)
    for schedule in ("GPipe", "1F1B"):
        assert any(n.startswith("pipeline") and schedule in n for n in names)
        assert any(n.startswith("replicated pipeline") and schedule in n for n in names)
    # Stages of several devices (filter-split), and a subset of the devices.
    assert any(n.startswith("replicated pipeline") and "of 2 devices" in n for n in names), names
    assert any("of 6 devices" in n for n in names), names


def test_every_candidate_is_its_plan(ranked) -> None:  # type: ignore[no-untyped-def]
    costs, out, _ = ranked
    cluster = _cluster()
    for p in out:
        if not p.feasible and not p.has_plan:
            continue
        plan_ = p.to_plan()
        assert Plan.from_dict(json.loads(json.dumps(plan_.to_dict()))) == plan_
        if p.strategy.startswith(("replicated pipeline", "pipeline", "asymmetric")):
            want = predict_plan(costs, cluster, plan_).step_s
            if p.detail.get("devices") and len(p.detail["devices"]) < cluster.num_devices:
                continue  # predicted on just its ranks (the subset's own cluster)
            assert p.step_s == pytest.approx(want, rel=1e-12), p.strategy


def test_replicas_alike_are_simulated_once_and_the_step_is_the_same(ranked) -> None:  # type: ignore[no-untyped-def]
    costs, _, _ = ranked
    cluster = _cluster()
    # Two alike replicas (one per node, each a 2-stage pipeline inside its node would differ
    # in kind): two one-stage replicas on the fast node are alike; a third on the slow node.
    doc = {
        "microbatches": 2,
        "replicas": [
            {"samples": 6, "stages": [{"ranks": [0], "layers": [0, 11]}]},
            {"samples": 6, "stages": [{"ranks": [1], "layers": [0, 11]}]},
            {
                "samples": 4,
                "stages": [{"ranks": [2], "layers": [0, 5]}, {"ranks": [3], "layers": [5, 11]}],
            },
        ],
    }
    got = predict_plan(costs, cluster, Plan.from_dict(doc))
    assert got.detail["simulated_replicas"] == 2
    # The same plan with the alike replicas made unlike by one sample: each simulated.
    doc["replicas"][0]["samples"], doc["replicas"][2]["samples"] = 7, 3
    other = predict_plan(costs, cluster, Plan.from_dict(doc))
    assert other.detail["simulated_replicas"] == 3
    assert got.step_s != other.step_s


def test_node_wise_plans_are_ranked_with_seed_002_s_comparison(ranked) -> None:  # type: ignore[no-untyped-def]
    _, out, report = ranked
    owners = [p for p in out if p.strategy.startswith("node-wise")]
    assert owners and all(p.feasible and math.isfinite(p.step_s) for p in owners)
    assert all(p.to_plan().replicas[0].stages[0].owners for p in owners)
    table = report.placement_comparison
    assert table is not None and table["devices"] == list(range(6))
    rows = {r["strategy"]: r for r in table["rows"]}
    assert {"hypergraph placement", "even filter split", "pipeline stages", "data parallel"} <= set(
        rows
    )
    for r in rows.values():
        assert r["bytes_per_step"] > 0 and r["load_balance"] >= 0.999 and r["step_s"] > 0
    # Seed 002's finding: the partition moves fewer bytes than splitting every layer evenly.
    assert (
        rows["hypergraph placement"]["bytes_per_step"] < rows["even filter split"]["bytes_per_step"]
    )
    # The speed-proportional split balances unequal devices better than the even one.
    assert (
        rows["speed-proportional filter split"]["load_balance"]
        < rows["even filter split"]["load_balance"]
    )


def test_the_best_plan_s_bottleneck_is_named(ranked) -> None:  # type: ignore[no-untyped-def]
    _, out, _ = ranked
    cluster = _cluster()
    short = out[0].to_json(with_plan=False, per_device=False)
    assert "shares" not in short and "plan" not in short
    assert short["devices_used"] == sum(1 for x in out[0].shares if x)
    assert short["max_memory_bytes"] == max(out[0].memory_bytes)
    for p in out[:10]:
        why = explain(p, cluster)
        assert why["term"] in ("compute", "communication", "bubble", "optimizer")
        assert 0 < why["share"] <= 1 and why["text"]
        assert why["seconds"] == pytest.approx(
            max(
                p.breakdown.get("compute", 0)
                + p.breakdown.get("memory", 0)
                + p.breakdown.get("overhead", 0),
                p.breakdown.get("communication", 0),
                p.breakdown.get("bubble", 0),
                p.breakdown.get("optimizer", 0),
            )
        )


def _runs(rank: int, world: int, docs: list[dict]) -> list[bool]:  # type: ignore[type-arg]
    import torch

    torch.set_num_threads(1)
    for doc in docs:
        plan_cases.equals_one_process(None, plan_cases.cnn, Plan.from_dict(doc), SHAPE, steps=2)
    return [True] * len(docs)


@pytest.mark.multiproc
def test_candidates_of_the_new_families_run_equal_to_one_process(ranked) -> None:  # type: ignore[no-untyped-def]
    _, out, _ = ranked
    picked = {}
    for p in out:
        for family in ("replicated pipeline", "node-wise, hypergraph", "pipeline"):
            if p.strategy.startswith(family) and family not in picked and p.feasible:
                if family == "replicated pipeline" and "of 2 devices" not in p.strategy:
                    continue
                picked[family] = p.to_plan().to_dict()
    assert len(picked) == 3, list(picked)
    world = 1 + max(
        r
        for doc in picked.values()
        for x in doc["replicas"]
        for st in x["stages"]
        for r in st["ranks"]
    )
    done = launch.spawn(_runs, world, list(picked.values()), timeout=600)
    assert done == [[True] * 3] * world


def test_cli_plan_plots_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = (
        Path(__file__).resolve().parent.parent / "examples" / "clusters" / "a100_v100_cpu.toml"
    )
    png = tmp_path / "plans.png"
    args = [
        "plan",
        "--model",
        "cnn",
        "--input",
        "3x32x32",
        "--cluster",
        str(cluster),
        "--batch",
        "512",
    ]
    assert main([*args, "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "bottleneck:" in text and "seed 002's comparison" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*args, "--json", "--top", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["best_bottleneck"]["term"] in ("compute", "communication", "bubble", "optimizer")
    assert doc["search"]["placement_comparison"]["rows"]
    assert set(doc["search"]) >= {"costed", "pruned", "skipped"}
    assert all("bottleneck" in p for p in doc["plans"])
    assert "plan" in doc["plans"][0] and "plan" not in doc["plans"][-1]
    assert any(p["strategy"].startswith("node-wise") for p in doc["plans"])


def test_bad_input_is_named(ranked, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from hetcoll.model.planner import plot_plans
    from hetcoll.model.predict import chain_stages, predict_stages
    from hetcoll.plan import microbatch_sizes

    costs, out, _ = ranked
    cluster = _cluster()
    with pytest.raises(TypeError, match="report"):
        plan(costs, cluster, BATCH, report="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model"):
        plan(costs, cluster, BATCH, model=object())
    with pytest.raises(TypeError, match="pred"):
        explain("best", cluster)  # type: ignore[arg-type]
    small = Cluster([Node("a", Device("d", 1e9, 1e9, 1e9), 1)])
    with pytest.raises(ValueError, match="cluster"):
        explain(next(p for p in out if (p.detail.get("critical_device") or 0) >= 1), small)
    with pytest.raises(ValueError, match="top"):
        plot_plans(out, str(tmp_path / "x.png"), top=0)
    with pytest.raises(ValueError, match="ranked"):
        plot_plans([], str(tmp_path / "x.png"))
    with pytest.raises(ValueError, match="stage_speeds"):
        chain_stages(costs, [], 4)
    with pytest.raises(ValueError, match="micro"):
        chain_stages(costs, [1e9, 1e9], 0)
    spec = [(BATCH, (((0,), (0, 11), None),))]
    with pytest.raises(ValueError, match="schedule"):
        predict_stages(costs, cluster, spec, 2, "zigzag")
    with pytest.raises(ValueError, match="microbatches"):
        predict_stages(costs, cluster, spec, 0, "GPipe")
    with pytest.raises(ValueError, match=r"replicas\[0\]"):
        predict_stages(costs, cluster, [(0, spec[0][1])], 2, "GPipe")
    with pytest.raises(ValueError, match="samples"):
        microbatch_sizes(0, 2)
    # A split stage the runtime refuses is named (the cnn's last layer has 5 outputs).
    with pytest.raises(ValueError, match=r"replicas\[0\]\.stages\[0\]"):
        predict_stages(
            costs, cluster, [(BATCH, (((0, 1, 2, 3, 4, 5), (0, 11), None),))], 1, "GPipe"
        )


def test_alike_replicas_simulated_once_give_the_full_simulation_s_step(ranked) -> None:  # type: ignore[no-untyped-def]
    # The same plan simulated with every replica taking part (one class each) and with alike
    # replicas simulated once: the same step, memory and breakdown, to the last bit.

    from hetcoll.model.predict import plan_schedule, predict_plan

    costs, _, _ = ranked
    fast = Device("fast", 2e9, 4e9, 1e10, 1e-6)
    slow = Device("slow", 1e9, 2e9, 1e10, 1e-6)
    cluster = Cluster(
        [Node(f"a{i}", fast, 4, Link("nv", 1e-6, 1e10)) for i in range(3)]
        + [Node(f"b{i}", slow, 2, Link("pcie", 2e-6, 5e9)) for i in range(2)],
        Link("net", 1e-5, 1e9),
    )
    replicas = []
    for node in range(3):  # two 2-stage replicas per fast node, the second stage split in two
        for half in range(2):
            d = 4 * node + 2 * half
            replicas.append(
                {
                    "samples": 10,
                    "stages": [
                        {"ranks": [d], "layers": [0, 5]},
                        {"ranks": [d + 1], "layers": [5, 11]},
                    ],
                }
            )
    replicas.append({"samples": 6, "stages": [{"ranks": [12, 13], "layers": [0, 11]}]})
    replicas.append({"samples": 6, "stages": [{"ranks": [14, 15], "layers": [0, 11]}]})
    for schedule in ("GPipe", "1F1B"):
        plan_ = Plan.from_dict({"microbatches": 3, "schedule": schedule, "replicas": replicas})
        # predict_plan groups alike replicas; plan_schedule lays every one out (for the lab).
        once = predict_plan(costs, cluster, plan_)
        laid = plan_schedule(costs, cluster, plan_)
        each = laid.prediction()
        assert len(laid.programs) == len(laid.program_devices) == 16
        assert once.detail["simulated_replicas"] == 2 and each.detail["simulated_replicas"] == 8
        assert once.step_s == each.step_s
        assert once.memory_bytes == each.memory_bytes and once.shares == each.shares
        assert once.breakdown == each.breakdown


def test_a_split_the_slow_devices_cannot_take_leaves_the_rest_of_the_search() -> None:
    # OLMo-2 at hidden 32 (4 heads of 8, 2 key/value groups): the asymmetric family's replica
    # of the 8 slow devices cannot split its 32 channels eight ways in whole groups. That
    # split's ValueError used to end the whole search ("hetcoll plan: error: minimum:
    # infeasible"); it is now one option fewer, and the search finds the others.
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.Olmo2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=64,
    )
    with torch.device("meta"):
        model = transformers.Olmo2ForCausalLM(config)
    costs = layer_costs(
        model,
        {"input_ids": (16,), "attention_mask": (16,)},
        dtype=torch.int64,
        loss="cross-entropy",
    )
    cluster = load_cluster(
        Path(__file__).resolve().parent.parent / "examples" / "clusters" / "a100_v100_cpu.toml"
    )
    report = SearchReport()
    found = plan(costs, cluster, 8, model=model, report=report)
    assert found[0].feasible and found[0].to_plan() is not None
