"""Expert parallelism: whole experts placed on data-parallel ranks by speed (and load), tokens
sent to their experts' ranks and back, training as one process on the whole batch."""

from __future__ import annotations

import itertools
import json
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hetcoll import launch
from hetcoll.torch.expert_parallel import (
    expert_assignment,
    expert_parallel,
    expert_shares,
    experts_module,
    placed_parameters,
)
from hetcoll.torch.expert_rebalance import placement_time, refined_placement

pytest.importorskip("transformers")

import expert_parallel_cases as cases
import tensor_parallel_cases as tp

MPI_WORKER = os.path.join(os.path.dirname(__file__), "mpi_workers", "expert_parallel.py")

#: Mixtral's 4 experts at speeds 1 : 0.5 : 0.25 (the last rank too slow for one).
PLACED = [3, 1, 0]
LAYER0, LAYER1 = "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"
#: PLACED as each rank's experts.
RUNS = [[0, 1, 2], [3], []]
#: Placed again by the loads of 2 steps when the speeds reverse (0.25 : 0.5 : 1): layer 0's
#: best placement is runs; layer 1's is not (expert 2, its hottest, alone on the middle rank:
#: 137 tokens a unit of speed at the slowest, where the best runs [0, 1, 3] take 156).
BY_LOAD = {LAYER0: [[], [0], [1, 2, 3]], LAYER1: [[], [2], [0, 1, 3]]}
#: An ExpertRebalancer's decisions when the speeds reverse, looking every 2 steps (gradients
#: clipped): the experts move by the loads of steps 0-1; the running estimate keeps them.
REBALANCED = [
    [2, {LAYER0: RUNS, LAYER1: RUNS}, BY_LOAD, True],
    [4, BY_LOAD, BY_LOAD, False],
]


@pytest.mark.multiproc
def test_gloo_experts_placed_by_speed_train_as_one_process():
    """DDP with the weighted hook over 3 gloo ranks, rows 4 : 2 : 1 of each step's batch,
    experts 3 : 1 : 0 (and 2 : 1 : 1 given as shares): every model's gathered gradients and
    state equal one process's on the whole batch, and resume on another placement; measured
    loads place the experts again between a backward and its optimizer step, their gradients
    and Adam moments moved with them, only the experts that change rank sent; gradient
    checkpointing recomputes the exchanges and counts no token twice
    (expert_parallel_cases)."""
    results = launch.spawn(cases.run_torch, 3, timeout=300)
    # What each rank raised: a forward's disagreements on every rank alike; placements that
    # differ, or a rank's own bad argument, agreed on before any other exchange.
    for rank, errors in enumerate(r.pop("errors") for r in results):
        assert errors == [
            "weight", "hidden_states", "top_k_index",  # a forward's, on every rank
            "model" if rank == 1 else "CollectiveMismatchError",  # rank 1's model has none
            "CollectiveMismatchError",  # the ranks' speeds differ
            "model",  # experts in a layout of no known role, on every rank
            "adapters",  # under PEFT's LoRA on their parameters, disabled, on every rank
            "router",  # DDP over a router's weight trained under PEFT's LoRA, on every rank
            "CollectiveMismatchError",  # placed again at speeds that differ
        ], (rank, errors)  # fmt: skip
    assert all(r == results[0] for r in results)
    # One layer against the unsplit one to 1e-12 over 30 random set-ups (random_layers),
    # among them ranks without tokens and ranks without experts.
    random = results[0].pop("random")
    assert len(random) == 30
    assert any(0 in case[2:5] for case in random) and any(0 in case[5:] for case in random)
    models = ["mixtral", "batched_mm", "gpt_oss", "qwen2_moe", "deepseek_v3", "olmoe"]
    # Placed again when the speeds reverse, by each layer's routed tokens (2 steps of 7
    # rows of 7 tokens, 2 experts each: 196), counted as one process routes them.
    again = {
        "by_speed": PLACED,
        "loads": {LAYER0: [63, 46, 44, 43], LAYER1: [40, 45, 59, 52]},
        "by_load": BY_LOAD,
    }
    assert results[0] == {
        **{m: PLACED for m in models}, "padded": PLACED, "grouped_mm": PLACED,
        "checkpointed": PLACED, "compiled": PLACED,
        "every_rank": [2, 1, 1],
        "again": again,
        "rebalanced": REBALANCED,
        # Under PEFT's LoRA on their parameters, placed with their adapters' blocks; placed
        # again at the speeds reversed.
        "lora": {
            "mixtral": PLACED, "gpt_oss": PLACED, "every_rank": [2, 1, 1],
            "moved": [[0, 1, 3], [0, 1, 3]],
        },
    }  # fmt: skip


@pytest.mark.multiproc
def test_mpi_experts_placed_by_speed_train_as_one_process():
    """The same under mpiexec: DistributedOptimizer averages all but each rank's own experts
    (samples, then valid tokens), the experts' tokens travel by MPI's all-to-all, and an
    ExpertRebalancer moves them when the speeds reverse."""
    out = launch.mpiexec(3, [MPI_WORKER], timeout=240).stdout
    results = json.loads(next(line for line in out.splitlines() if line.startswith("[")))
    expected = {"mixtral": PLACED, "gpt_oss": PLACED, "padded": PLACED, "rebalanced": REBALANCED}
    assert results == [expected] * 3


def test_expert_shares_follow_speeds_and_loads():
    assert expert_shares(8, [3.0, 1.0]) == [6, 2]
    assert expert_shares(4, [1.0, 0.5, 0.25]) == PLACED
    # A hot first expert: the fast rank takes it alone.
    assert expert_shares(4, [1.0, 1.0], loads=[3.0, 1.0, 1.0, 1.0]) == [1, 3]
    # Memory for 2 experts on the first rank bounds it below its speed's share.
    assert expert_shares(4, [9.0, 1.0], loads=[1.0] * 4) == [4, 0]
    assert expert_shares(4, [9.0, 1.0], loads=[1.0] * 4, capacity=[2, 4]) == [2, 2]
    assert expert_shares(4, [9.0, 1.0], capacity=[3, 4]) == [3, 1]


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"num_experts": 0, "speeds": [1.0]}, ValueError, "num_experts: must be an int >= 1"),
        ({"num_experts": 4, "speeds": [1.0], "loads": [1.0]}, ValueError, "loads: needs one"),
        (
            {"num_experts": 2, "speeds": [1.0], "loads": [1.0, -1.0]},
            ValueError,
            "loads: must be finite",
        ),
        (
            {"num_experts": 2, "speeds": [1.0, 1.0], "loads": [1.0, 1.0], "capacity": [1]},
            ValueError,
            "capacity: needs one int >= 0 per rank",
        ),
        ({"num_experts": 4, "speeds": [1.0, 1.0], "capacity": [1, 1]}, ValueError, "capacity"),
        (
            {"num_experts": 4, "speeds": [1.0, 1.0], "loads": [1.0] * 4, "capacity": [1, 1]},
            ValueError,
            "capacity: infeasible",
        ),
        ({"num_experts": 2, "speeds": [1.0, -1.0]}, ValueError, "speeds"),
    ],
)
def test_expert_shares_name_bad_input(kwargs, error, text):
    with pytest.raises(error, match=text):
        expert_shares(**kwargs)


@settings(max_examples=60, deadline=None)
@given(
    loads=st.lists(st.integers(0, 20), min_size=1, max_size=7),
    speeds=st.lists(st.integers(1, 6), min_size=1, max_size=3),
)
def test_expert_shares_by_load_are_the_best_contiguous_placement(loads, speeds):
    """Against brute force over every contiguous placement: the slowest rank's load over its
    speed is the smallest there is (and what placement_time reads, summed over layers)."""
    shares = expert_shares(len(loads), [float(s) for s in speeds], loads=[float(x) for x in loads])
    assert sum(shares) == len(loads) and min(shares) >= 0

    def slowest(cut: list[int]) -> float:
        bounds = [0, *itertools.accumulate(cut)]
        return max(
            sum(loads[a:b]) / s for a, b, s in zip(bounds[:-1], bounds[1:], speeds, strict=True)
        )

    best = min(
        slowest(list(c))
        for c in itertools.product(range(len(loads) + 1), repeat=len(speeds))
        if sum(c) == len(loads)
    )
    assert slowest(shares) == pytest.approx(best, rel=1e-12)
    # The rebalancer's predicted time of a placement is that same slowest rank's.
    one = {"experts": shares}
    assert placement_time(one, {"experts": loads}, speeds) == pytest.approx(best, rel=1e-12)
    assert placement_time({**one, "again": shares}, {"experts": loads, "again": loads}, speeds) == (
        pytest.approx(2 * best, rel=1e-12)
    )


@settings(max_examples=60, deadline=None)
@given(
    loads=st.lists(st.integers(0, 20), min_size=1, max_size=6),
    speeds=st.lists(st.integers(1, 6), min_size=1, max_size=3),
)
def test_expert_assignment_is_the_best_placement_of_any_experts(loads, speeds):
    """Against brute force over every placement of any experts on any rank: the slowest
    rank's tokens over its speed are the fewest there are, never more than the best runs
    (which it keeps on a tie), and what placement_time reads; every expert placed once."""
    speeds_f = [float(v) for v in speeds]
    held = expert_assignment(len(loads), speeds_f, loads=[float(x) for x in loads])
    assert sorted(e for h in held for e in h) == list(range(len(loads)))
    assert all(h == sorted(h) for h in held)

    def slowest(owner: tuple[int, ...]) -> float:
        work = [
            sum(x for x, o in zip(loads, owner, strict=True) if o == r) for r in range(len(speeds))
        ]
        return max(w / s for w, s in zip(work, speeds, strict=True))

    best = min(slowest(o) for o in itertools.product(range(len(speeds)), repeat=len(loads)))
    got = placement_time({"experts": held}, {"experts": loads}, speeds_f)
    assert got == pytest.approx(best, rel=1e-9)
    runs = expert_shares(len(loads), speeds_f, loads=[float(x) for x in loads])
    by_runs = placement_time({"experts": runs}, {"experts": loads}, speeds_f)
    assert got <= by_runs
    if got == by_runs:
        cuts = [0, *itertools.accumulate(runs)]
        assert held == [list(range(a, b)) for a, b in itertools.pairwise(cuts)]


def test_expert_assignment_parts_hot_experts():
    """Two hot experts side by side: runs cannot part them, any experts can; without loads
    the runs of expert_shares; capacity bounds each rank; bad input names the argument."""
    assert expert_assignment(4, [1.0, 1.0], loads=[5.0, 5.0, 1.0, 1.0]) == [[0, 2], [1, 3]]
    assert placement_time({"x": [[0, 2], [1, 3]]}, {"x": [5, 5, 1, 1]}, [1.0, 1.0]) == 6.0
    assert placement_time({"x": [1, 3]}, {"x": [5, 5, 1, 1]}, [1.0, 1.0]) == 7.0
    assert expert_assignment(8, [3.0, 1.0]) == [[0, 1, 2, 3, 4, 5], [6, 7]]
    held = expert_assignment(6, [9.0, 1.0], loads=[1.0] * 6, capacity=[2, 4])
    assert [len(h) for h in held] == [2, 4]
    # Ranks of one speed are interchangeable: given the placement now, their sets go where
    # most of each already is (the same time, fewer experts moving).
    loads, speeds = [5.0, 5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 0.5]
    now = [[7, 6], [5, 4], [3, 2], [1], [0]]
    fresh = expert_assignment(8, speeds, loads=loads)
    kept = expert_assignment(8, speeds, loads=loads, current=now)
    assert placement_time({"x": kept}, {"x": loads}, speeds) == 5.0
    assert placement_time({"x": fresh}, {"x": loads}, speeds) == 5.0
    assert sorted(map(sorted, kept[:4])) == sorted(map(sorted, fresh[:4])) and kept[4] == fresh[4]

    def moved(held: list[list[int]]) -> int:
        return sum(len(set(h) - set(n)) for h, n in zip(held, now, strict=True))

    assert moved(kept) < moved(fresh)
    for kwargs, text in (
        ({"loads": [1.0]}, "loads: needs one entry per expert"),
        ({"loads": [1.0] * 4, "capacity": [1, 1]}, "capacity: infeasible"),
        ({"loads": [1.0, -1.0, 1.0, 1.0]}, "loads: must be finite"),
    ):
        with pytest.raises(ValueError, match=text):
            expert_assignment(4, [1.0, 1.0], **kwargs)
    with pytest.raises(ValueError, match=r"shares\['x'\]: must name each of the 4 experts once"):
        placement_time({"x": [[0, 1], [1, 3]]}, {"x": [1, 1, 1, 1]}, [1.0, 1.0])


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        # current: one entry per rank, each expert exactly once, in range (checked even
        # without loads, where it was ignored).
        ({"current": [[99], [-1]]}, r"current\[1\]\[0\]: must be an integer >= 0"),
        ({"loads": [5, 5, 1, 1], "current": [[0, 9], [1, -3]]}, r"current\[1\]\[1\]"),
        ({"loads": [5, 5, 1, 1], "current": [[0, 9], [1, 2, 3]]}, "current: .*names expert 9"),
        (
            {"loads": [5, 5, 1, 1], "current": [[0, 1, 2, 3], [0, 1, 2, 3]]},
            "current: must name each of the 4 experts once; names expert 0 twice",
        ),
        ({"loads": [5, 5, 1, 1], "current": [[0, 1], [2]]}, "current: .*misses expert 3"),
        ({"current": [[0, 1, 2, 3]]}, r"current: needs one entry per rank \(2\), got 1"),
        ({"loads": [5, 5, 1, 1], "current": [None, None]}, r"current\[0\]: must be a list"),
        # gap: finite and >= 0 (checked even without loads).
        ({"gap": float("nan")}, "gap: must be finite and >= 0"),
        ({"loads": [5, 5, 1, 1], "gap": -1.0}, "gap: must be finite and >= 0"),
        ({"loads": [5, 5, 1, 1], "gap": "x"}, "gap: must be a number"),
        ({"gap": 10**400}, "gap: must be finite and >= 0"),
        ({"speeds": None}, "speeds: must be a list of numbers, got NoneType"),
        ({"speeds": "ab"}, "speeds: must be a list of numbers, got str"),
        ({"speeds": [1.0, "a"]}, r"speeds\[1\]: must be a number, got 'a'"),
        ({"speeds": [1.0, 10**400]}, r"speeds\[1\]: must be a number"),
        ({"speeds": [1.0, None]}, r"speeds\[1\]: must be a number, got None"),
        ({"loads": None, "speeds": [1.0, 1.0], "capacity": 3}, "capacity: needs one int"),
        ({"loads": "abcd"}, "loads: must be a list of numbers, got str"),
        ({"loads": [5, 5, None, 1]}, r"loads\[2\]: must be a number, got None"),
        ({"num_experts": 2**63}, r"num_experts: must be an int >= 1 and <= 16777216"),
        ({"num_experts": 2**24 + 1}, "num_experts: .*MAX_EXPERTS"),
        ({"num_experts": 4.0}, "num_experts: must be an int"),
    ],
)
def test_expert_assignment_and_shares_name_bad_input(kwargs, text):
    """Every argument is checked, whether or not it matters to the answer: a bad current
    placement, gap, speeds or loads, or an absurd count of experts (which filled the memory
    listing them), raise ValueError naming the argument; expert_shares checks its own alike."""
    args = {"num_experts": 4, "speeds": [1.0, 1.0], **kwargs}
    with pytest.raises(ValueError, match=text):
        expert_assignment(**args)
    if "current" not in kwargs and "gap" not in kwargs:
        with pytest.raises(ValueError, match=text):
            expert_shares(**args)
    # The largest count allowed is placed.
    assert expert_shares(2**24, [1.0, 3.0]) == [2**22, 3 * 2**22]


@settings(max_examples=60, deadline=None)
@given(
    loads=st.lists(st.integers(0, 20), min_size=1, max_size=9),
    speeds=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    limited=st.booleans(),
)
def test_refined_placement_only_improves_and_moves_few(loads, speeds, seed, limited):
    """From any placement: every expert still placed once, within capacity, the slowest
    rank's time never higher, and no step left that lowers it (a move off the slowest rank
    or a swap there for a lighter expert)."""
    rng = np.random.default_rng(seed)
    owner = rng.integers(0, len(speeds), len(loads))
    now = [[e for e in range(len(loads)) if owner[e] == r] for r in range(len(speeds))]
    capacity = [max(len(h), 1) + int(rng.integers(0, 2)) for h in now] if limited else None
    s = [float(v) for v in speeds]
    got = refined_placement(now, loads, s, capacity=capacity)
    assert sorted(e for h in got for e in h) == list(range(len(loads)))
    if capacity is not None:
        assert all(len(h) <= c for h, c in zip(got, capacity, strict=True))
    before = placement_time({"x": now}, {"x": loads}, s)
    after = placement_time({"x": got}, {"x": loads}, s)
    assert after <= before
    work = [sum(loads[e] for e in h) for h in got]
    r = max(range(len(s)), key=lambda q: (work[q] / s[q], -q))
    for e in got[r]:
        for q in range(len(s)):
            if q == r:
                continue
            if capacity is None or len(got[q]) < capacity[q]:
                assert max((work[r] - loads[e]) / s[r], (work[q] + loads[e]) / s[q]) >= after
            for f in got[q]:
                if loads[f] < loads[e]:
                    here = (work[r] - loads[e] + loads[f]) / s[r]
                    assert max(here, (work[q] - loads[f] + loads[e]) / s[q]) >= after


def test_refined_placement_reaches_the_best_time_in_one_move():
    """A hot expert beside a cool one on one rank: one move (the cool one away) reaches the
    best time there is, which the rebalancer then takes over any placement moving more."""
    loads = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0, 1.0]
    now = [[0, 1, 2, 3, 4, 5], [6, 7]]
    speeds = [1.0, 1.0]
    near = refined_placement(now, loads, speeds)
    assert near == [[0, 1, 2, 3, 4, 5, 7], [6]]
    assert placement_time({"x": near}, {"x": loads}, speeds) == 9.0
    best = expert_assignment(8, speeds, loads=loads, current=now)
    assert placement_time({"x": best}, {"x": loads}, speeds) == 9.0


@pytest.mark.parametrize(
    ("args", "error", "text"),
    [
        ((None, {}, [1.0]), TypeError, "^shares: must be a dict"),
        (({"e": [1, 1]}, None, [1.0, 1.0]), TypeError, "^loads: must be a dict"),
        (({"e": [1, 1]}, {"e": [1.0, 1.0]}, None), ValueError, "^speeds: must be numbers"),
        (({"e": [1, 1]}, {"e": [1.0, 1.0]}, [1.0, -1.0]), ValueError, "^speeds: needs one finite"),
        (
            ({"e": [1, 1]}, {"f": [1.0, 1.0]}, [1.0, 1.0]),
            ValueError,
            "^loads: has no entry for 'e'",
        ),
        (({"e": [1, 1]}, {"e": [1.0, "x"]}, [1.0, 1.0]), ValueError, r"^loads\['e'\]: must be num"),
        (({"e": [1, 1]}, {"e": [1.0]}, [1.0, 1.0]), ValueError, "^loads: 'e' needs one entry"),
        # NaN loads once priced the placement at 2 s, negative ones at 0; a str of speeds read
        # each character as a rank's speed.
        (({"e": [1, 1]}, {"e": [math.nan, 1]}, [1, 1.0]), ValueError, r"^loads\['e'\]: must be f"),
        (({"e": [1, 1]}, {"e": [-1.0, 1.0]}, [1.0, 1.0]), ValueError, r"^loads\['e'\]: must be f"),
        (({"e": [1, 1]}, {"e": [1.0, 1.0]}, "11"), ValueError, "^speeds: must be numbers"),
    ],
)  # fmt: skip
def test_placement_time_names_bad_input(args, error, text):
    with pytest.raises(error, match=text):
        placement_time(*args)


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (([[0], [1]], [1.0, 2.0], "11"), "^speeds: must be numbers, one per rank"),
        (([[0], [1]], None, [1.0, 1.0]), "^loads: must be numbers, one per expert, got None"),
        (([[0], [1]], [math.nan, 1.0], [1.0, 1.0]), "^loads: must be finite numbers >= 0"),
        (([[0], [1]], [1.0], [1.0, 1.0]), r"^loads: needs one entry per expert \(2\)"),
    ],
)
def test_refined_placement_names_bad_input(args, text):
    with pytest.raises(ValueError, match=text):
        refined_placement(*args)


def test_experts_modules_are_found_in_hugging_face_models():
    """Every experts module of the Hugging Face families the tests train is placed by whole
    experts; a module holding experts in another layout is named with the reason."""
    both = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for make, want in (
        (tp.mixtral, both), (tp.gpt_oss, both), (tp.qwen2_moe, both), (tp.olmoe, both),
        (tp.deepseek_v3, both[1:]),  # its first block is dense
    ):  # fmt: skip
        found = [n for n, m in make().named_modules() if experts_module(m) == ""]
        assert found == want, found
    assert experts_module(nn.Linear(2, 2)) is None

    class Stacked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 2
            self.w = nn.Parameter(torch.zeros(2, 3, 4))

    assert "use_experts_implementation" in (experts_module(Stacked()) or "")


def test_clip_grad_norm_names_bad_input_before_any_collective():
    """Against torch's on real ranks, placed experts included: expert_parallel_cases
    (``clip=``), test_accelerate and test_lightning."""
    from hetcoll.torch import clip_grad_norm_

    weight = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="max_norm: must be a number >= 0"):
        clip_grad_norm_([weight], -1.0)
    with pytest.raises(TypeError, match="parameters: must be tensors"):
        clip_grad_norm_(["weight"], 1.0)  # type: ignore[list-item]


def _clip_disagreeing(rank, world):
    from hetcoll.torch import clip_grad_norm_

    weight = nn.Parameter(torch.ones(3))
    weight.grad = torch.full((3,), 2.0)
    out = []
    for max_norm in ([1.0, -1.0], [1.0, 2.0], [1.0, 1.0]):
        try:
            out.append(float(clip_grad_norm_([weight], max_norm[rank])))
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


@pytest.mark.multiproc
def test_clip_grad_norm_raises_on_every_rank_when_one_rank_s_argument_is_bad():
    # One rank's bad max_norm raised there alone, and the others waited in the sum of squares
    # until the process group's timeout; ranks clipping to different norms clipped silently
    # differently. Both raise on every rank now; the same norm on each still clips.
    from hetcoll.launch import spawn

    first, second = spawn(_clip_disagreeing, 2, timeout=120)
    assert second[0] == "ValueError: max_norm: must be a number >= 0, got -1.0"
    assert first[0].startswith("CollectiveMismatchError: rank 1 raised ValueError: max_norm")
    for mine in (first[1], second[1]):
        assert mine.startswith("CollectiveMismatchError: ranks disagree on max_norm"), mine
    assert first[2] == second[2] == pytest.approx(12.0**0.5)  # replicated: counted once


def test_expert_parallel_names_bad_arguments_before_any_collective():
    """Argument errors every rank sees alike raise before any exchange (the rest are agreed
    on, on real ranks: expert_parallel_cases.disagreements)."""
    with pytest.raises(TypeError, match=r"model: must be a torch\.nn\.Module"):
        expert_parallel("model", speeds=[1.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="speeds: give exactly one of speeds= or shares="):
        expert_parallel(tp.mixtral())


# -- the performance model ------------------------------------------------------------------


def _costs(make=tp.mixtral):
    from hetcoll.model import layer_costs

    model = make("grouped_mm") if make is tp.mixtral else make()
    # With the attention mask, as the models run: costed on the meta device (no CPU run).
    return layer_costs(model, {"input_ids": (7,), "attention_mask": (7,)}, dtype=torch.int64)


def _cluster(*flops: float, latency: float = 1e-4, bandwidth: float = 1e9):
    from hetcoll.lab.validate import validation_cluster
    from hetcoll.model import Device, Link

    devices = [Device(f"d{i}", f, f, 8e9) for i, f in enumerate(flops)]
    return validation_cluster(devices, Link("link", latency, bandwidth))


def test_the_model_places_the_experts_the_runtime_places():
    """The experts layers the costs record are those expert_parallel converts, with their
    experts, top_k and tokens (Mixtral's 2 of 4 per token; DeepSeek-V3's first block dense)."""
    for make in (tp.mixtral, tp.gpt_oss, tp.deepseek_v3):
        costs = _costs(make)
        placed = [n for n, m in make().named_modules() if experts_module(m) == ""]
        assert [b.module for b in costs.experts] == placed
        assert {(b.experts, b.top_k, b.tokens_per_sample) for b in costs.experts} == {(4, 2, 7.0)}


def test_experts_under_lora_on_their_parameters_are_costed_and_placed():
    """PEFT's LoRA on the experts' parameters (``ParamWrapper``, which ``"all-linear"`` puts on
    Mixtral's experts and router), whose factors hold a block per expert: expert parallelism
    places them with their experts (expert_parallel_cases.lora_experts), so the costs place
    the experts modules inside the wrappers; with the adapters disabled, a wrapper no rule
    places, none. Costing runs the model, whose LoRA parametrizes its weights for each
    forward: the model is left as it was (no stand-in of the costing's left beside its
    weights) and trains as before."""
    from hetcoll.model import layer_costs

    torch.manual_seed(0)
    model = tp._with_lora(tp.mixtral(), "all-linear")
    before = {n: t for n, t in model.named_buffers()}
    ids = torch.randint(0, tp.VOCAB, (2, 7))
    want = model(input_ids=ids).logits
    inputs = {"input_ids": (7,), "attention_mask": (7,)}
    costs = layer_costs(model, inputs, dtype=torch.int64)
    inner = [f"base_model.model.model.layers.{i}.mlp.experts.base_layer.base_layer" for i in (0, 1)]
    assert costs.layers and [b.module for b in costs.experts] == inner
    assert {(b.experts, b.top_k, b.tokens_per_sample) for b in costs.experts} == {(4, 2, 7.0)}
    # Every parameter counted once (registering PEFT's parametrization at each forward passes
    # the wrapped weight twice to one op: it was counted twice). The layers the experts
    # hold (the module's and its wrappers', which read its weights) hold exactly what the
    # runtime places with them: its weights and its adapters' factors.
    assert costs.params == sum(p.numel() for p in model.parameters())
    params = dict(model.named_parameters())
    for block in costs.experts:
        outer = block.module.rsplit(".base_layer", 2)[0]
        assert block.wrappers == (outer, f"{outer}.base_layer")
        held = sum(x.params for x in costs.layers if block.holds(x.name))
        assert held == sum(params[n].numel() for n in placed_parameters(model, block.module))
    model.base_model.disable_adapter_layers()
    assert not layer_costs(model, inputs, dtype=torch.int64).experts
    model.base_model.enable_adapter_layers()
    assert {n: t for n, t in model.named_buffers()} == before
    assert torch.equal(model(input_ids=ids).logits, want)


def test_one_device_of_expert_parallelism_is_data_parallelism():
    """Holding every expert, one device exchanges nothing: the step is data parallelism's."""
    from hetcoll.model.predict import data_parallel
    from hetcoll.model.predict import expert_parallel as predict

    costs, one = _costs(), _cluster(1e10)
    assert predict(costs, one, [16], [4]).step_s == pytest.approx(
        data_parallel(costs, one, [16]).step_s, rel=1e-12
    )


def test_the_model_prefers_experts_and_rows_by_speed_and_prices_the_exchanges():
    """On a fast and a slow device, experts and rows by speed step faster than evenly; the
    all-to-alls grow with the link's latency; loads move the slow device's work."""
    from hetcoll.model.predict import expert_parallel as predict

    costs, two = _costs(), _cluster(1e11, 2.5e10)
    by_speed = predict(costs, two, [26, 6], [3, 1])
    even = predict(costs, two, [16, 16], [2, 2])
    assert by_speed.step_s < even.step_s
    assert by_speed.detail["experts"] == {b.module: [3, 1] for b in costs.experts}
    slower = predict(costs, _cluster(1e11, 2.5e10, latency=1e-3), [26, 6], [3, 1])
    assert slower.detail["all_to_all_s"] > by_speed.detail["all_to_all_s"]
    # Its one expert cold, the slow device computes less, and the step shortens.
    cold = {b.module: [1.0, 1.0, 1.0, 0.0] for b in costs.experts}
    assert predict(costs, two, [26, 6], [3, 1], loads=cold).step_s < by_speed.step_s


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        (
            {"shares": [16, 16], "experts": [4]},
            r"experts: needs one entry per device \(2\), got 1 \(experts of 'model.layers.0",
        ),
        (
            {"shares": [16, 16], "experts": [[0, 1], [1, 2]]},
            "experts: must name each of the 4 experts once; names expert 1 twice",
        ),
        ({"shares": [16, 16], "experts": {"x": [2, 2]}}, "experts: names no placement"),
        ({"shares": [16], "experts": [2, 2]}, "shares: expected 2 values"),
        (
            {"shares": [16, 16], "experts": [2, 2], "loads": {"model.layers.0.mlp.experts": [1]}},
            "loads: 'model.layers.0.mlp.experts' needs 4",
        ),
    ],
)
def test_the_model_names_bad_placements(kwargs, text):
    from hetcoll.model.predict import expert_parallel as predict

    with pytest.raises(ValueError, match=text):
        predict(_costs(), _cluster(1e10, 1e10), **kwargs)
    with pytest.raises(ValueError, match="costs: the model holds no experts layer"):
        predict(_costs(tp.qwen2), _cluster(1e10, 1e10), [16, 16], [2, 2])


@pytest.mark.parametrize(
    ("name", "argument", "extra"),
    [
        ("broadcast_parameters", "module", ()),
        ("gather_state_dict", "model", ()),
        ("gather_gradients", "model", ()),
        ("load_full_optimizer_state_dict", "model", (None, {})),
        ("place_experts", "model", ()),
        ("rank_local_parameters", "model", ()),
        ("leave_to_ranks", "model", ()),
        ("expert_loads", "model", ()),
    ],
)
def test_model_helpers_given_no_module_name_it(name, argument, extra):
    """None or another object where the model belongs once raised AttributeError from inside
    (``.named_modules()`` of None)."""
    import hetcoll.torch

    for bad in (None, "model", [nn.Linear(2, 2)]):
        with pytest.raises(TypeError, match=rf"^{argument}: must be a torch.nn.Module, got"):
            getattr(hetcoll.torch, name)(bad, *extra)
