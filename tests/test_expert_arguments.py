"""Bad arguments to the expert-parallel API (expert_parallel, place_experts, expert_shares,
expert_assignment, refined_placement, placement_time, ExpertRebalancer) raise ValueError or
TypeError naming the argument, where they are given; the good calls answer as before. On a
world-size-1 gloo group (made from an in-memory store: no port), and on 2 ranks where one
rank's argument is bad."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tensor_parallel_cases as tp
import torch
from torch import nn

from hetcoll import CollectiveMismatchError
from hetcoll.torch import (
    ExpertRebalancer,
    expert_assignment,
    expert_parallel,
    expert_shares,
    place_experts,
    placement_time,
    refined_placement,
)

#: Both experts layers of tensor_parallel_cases.mixtral (4 experts each).
LAYERS = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
#: Everything on the one rank.
ALONE = {name: [[0, 1, 2, 3]] for name in LAYERS}


@pytest.fixture(scope="module")
def placed(one_rank: None) -> nn.Module:
    """Mixtral (2 experts layers of 4) placed on the one rank."""
    return expert_parallel(tp.mixtral(), speeds=[1.0])


def test_capacity_as_a_dict_is_refused(placed):
    """A dict's keys were read as the capacities: ExpertRebalancer(capacity={0: 'x'}) held
    [0], refined_placement(capacity={1: 3, 3: 1}) answered as for [1, 3]."""
    with pytest.raises(ValueError, match=r"^capacity: needs one int >= 0 per rank \(1\)"):
        ExpertRebalancer(placed, speeds=[1.0], capacity={0: "x"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^capacity: needs one int >= 0 per rank \(2\)"):
        refined_placement(
            [[0], [1, 2, 3]],
            [1, 1, 1, 1],
            [1.0, 1.0],
            capacity={1: 3, 3: 1},  # type: ignore[arg-type]
        )
    with pytest.raises(ValueError, match=r"^capacity: needs one int >= 0 per rank \(1\)"):
        place_experts(placed, speeds=[1.0], capacity={4: 1})  # type: ignore[arg-type]
    # The lists still place as before.
    assert ExpertRebalancer(placed, speeds=[1.0], capacity=[4]).capacity == [4]
    assert refined_placement([[0], [1, 2, 3]], [1, 1, 1, 1], [1.0, 1.0], capacity=[1, 3]) == [
        [0],
        [1, 2, 3],
    ]
    assert refined_placement([[0], [1, 2, 3]], [1, 1, 1, 1], [1.0, 1.0], capacity=[3, 3]) == [
        [0, 1],
        [2, 3],
    ]


def test_a_bool_is_no_number(placed):
    """speeds=[True], threshold=True and smoothing=True were taken as 1, and so was True
    among placement_time's speeds or refined_placement's loads."""
    for kwargs, text in (
        ({"speeds": [True]}, r"^speeds: must be numbers, one per rank, got \[True\]"),
        ({"speeds": [np.bool_(True)]}, r"^speeds: must be numbers"),
        ({"threshold": True}, r"^threshold: must be a finite number >= 0, got True"),
        ({"smoothing": True}, r"^smoothing: must be in \(0, 1\], got True"),
    ):
        with pytest.raises(ValueError, match=text):
            ExpertRebalancer(placed, **{"speeds": [1.0], **kwargs})
    with pytest.raises(ValueError, match=r"^speeds: must be numbers, one per rank, got \[True"):
        placement_time({"a": [2, 2]}, {"a": [1, 1, 1, 1]}, [True, 1.0])
    with pytest.raises(ValueError, match=r"^loads\['a'\]: must be numbers"):
        placement_time({"a": [2, 2]}, {"a": [True, 1, 1, 1]}, [1.0, 1.0])
    with pytest.raises(ValueError, match=r"^loads: must be numbers, one per expert"):
        refined_placement([[0], [1, 2, 3]], [True, 1, 1, 1], [1.0, 1.0])
    # Numbers, numpy's included, are taken as before.
    watch = ExpertRebalancer(
        placed, speeds=[np.float64(2.0)], threshold=np.float32(0.25), smoothing=np.float64(0.5)
    )
    assert (watch.threshold, watch.smoothing) == (0.25, 0.5)
    assert placement_time({"a": [2, 2]}, {"a": [1, 1, 1, 1]}, [1, np.float64(1.0)]) == 2.0


def test_place_experts_names_an_optimizer_that_is_none(placed):
    """A str as the optimizer was accepted, to break only once experts moved (its state
    read then)."""
    with pytest.raises(TypeError, match=r"^optimizer: must be a torch.optim.Optimizer or None"):
        place_experts(placed, "not an optimizer", speeds=[1.0])  # type: ignore[arg-type]
    opt = torch.optim.SGD(placed.parameters(), lr=0.1, momentum=0.9)
    assert place_experts(placed, opt, speeds=[1.0]) == ALONE
    assert place_experts(placed, None, shares=[4]) == ALONE


def test_speeds_and_capacity_that_are_no_lists(one_rank, placed):
    """speeds=True, speeds=0 and capacity=0 raised TypeError: object of type 'bool' (or
    'int') has no len()."""
    with pytest.raises(ValueError, match=r"^speeds: must be a list of numbers, got bool"):
        expert_parallel(tp.mixtral(), speeds=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^speeds: must be a list of numbers, got int"):
        place_experts(placed, speeds=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^capacity: needs one int >= 0 per rank \(1\), got 0"):
        ExpertRebalancer(placed, speeds=[1.0], capacity=0)  # type: ignore[arg-type]


def test_the_rebalancer_refuses_at_construction_what_its_step_would(placed):
    """speeds=[0.0] (a placement by load needs each speed > 0), capacity=[2**70] (past the
    Rust layer's counts), a capacity too small for a layer and threshold=inf (step()'s gap)
    were accepted, to raise at the first decision only; 10**400 raised OverflowError."""
    for kwargs, text in (
        ({"speeds": [0.0]}, r"^speeds: needs one finite number > 0 per rank \(1\), got \[0\.0\]"),
        ({"capacity": [2**70]}, r"^capacity\[0\]: must be < 2\*\*64, got 1180591620717411303424"),
        ({"capacity": [3]}, r"^capacity: holds 3 experts in all, fewer than the 4 of 'model"),
        ({"threshold": float("inf")}, r"^threshold: must be a finite number >= 0, got inf"),
        ({"threshold": 10**400}, r"^threshold: must be a finite number >= 0"),
    ):
        with pytest.raises(ValueError, match=text):
            ExpertRebalancer(placed, **{"speeds": [1.0], "every": 1, **kwargs})
    # A function's speeds are checked at each decision, by the same rule.
    watch = ExpertRebalancer(placed, speeds=lambda: [0.0], every=1)
    with pytest.raises(ValueError, match=r"^speeds: needs one finite number > 0 per rank"):
        watch.step()
    # Good arguments decide as before: one rank, nothing to move.
    watch = ExpertRebalancer(placed, speeds=[1.0], every=1, capacity=[4], threshold=0)
    assert watch.step() is False
    assert watch.state_dict() == {
        "step": 1,
        "loads": {n: [0.0] * 4 for n in LAYERS},
        "placement": ALONE,
    }


def test_load_state_dict_names_its_own_fields(placed):
    """A step of 2**70 raised "fields['the restored step']: must fit in 64 bits" (the
    agreement's name); a numpy step was refused; True among the loads counted as 1, a dict's
    keys as the loads, and loads summing past a double were taken."""
    watch = ExpertRebalancer(placed, speeds=[1.0])
    fresh = {"step": 2, "loads": None, "placement": ALONE}
    layer, other = LAYERS
    named = rf"^state\['loads'\]\[{layer!r}\]"
    for state, text in (
        ({"step": 2**70}, r"^state\['step'\]: must be an integer >= 0 and < 2\*\*63, got 118"),
        ({"step": True}, r"^state\['step'\]: must be an integer >= 0"),
        ({"loads": {layer: [True, 1, 1, 1], other: [1] * 4}}, f"{named}: must be numbers"),
        ({"loads": {layer: {1: 2, 3: 4, 5: 6, 7: 8}, other: [1] * 4}}, f"{named}: must be numbers"),
        ({"loads": {layer: [1e308] * 4, other: [1] * 4}}, f"{named}: their sum overflows a double"),
    ):
        with pytest.raises(ValueError, match=text):
            watch.load_state_dict({**fresh, **state})
    watch.load_state_dict({**fresh, "step": np.int64(3)})
    assert watch.state_dict() == {**fresh, "step": 3}
    assert type(watch.state_dict()["step"]) is int
    loads = {n: [1.0, 2.0, 3.0, 4.0] for n in LAYERS}
    watch.load_state_dict({**fresh, "loads": loads})
    assert watch.state_dict() == {**fresh, "loads": loads}


def test_loads_summing_past_a_double_are_named_loads():
    """expert_shares(4, [1.0, 1.0], loads=[1e308] * 4) raised "costs: their sum overflows a
    double" (the Rust layer's name); refined_placement answered, placement_time gave inf."""
    big = [1e308] * 4
    with pytest.raises(ValueError, match=r"^loads: their sum overflows a double"):
        expert_shares(4, [1.0, 1.0], loads=big)
    with pytest.raises(ValueError, match=r"^loads: their sum overflows a double"):
        expert_assignment(4, [1.0, 1.0], loads=big)
    with pytest.raises(ValueError, match=r"^loads: their sum overflows a double"):
        refined_placement([[0], [1, 2, 3]], big, [1.0, 1.0])
    with pytest.raises(ValueError, match=r"^loads\['x'\]: their sum overflows a double"):
        placement_time({"x": [2, 2]}, {"x": big}, [1.0, 1.0])
    # Loads a double holds still place.
    assert expert_shares(4, [1.0, 1.0], loads=[4e307] * 4) == [2, 2]


def test_arguments_are_read_once(placed):
    """capacity=(c for c in [4, 4]) was read by expert_shares and then, used up, by
    partition_items ("capacity: ... got 0"); loads as a generator gave the second experts
    layer none. Each is taken as a list once, as speeds are."""
    loads = [1, 2, 3, 4]
    assert expert_assignment(4, [1.0, 1.0], loads=loads, capacity=(c for c in [4, 4])) == [
        [0, 3],
        [1, 2],
    ]
    assert expert_assignment(4, [1.0, 1.0], loads=loads, capacity=[4, 4]) == [[0, 3], [1, 2]]
    assert expert_assignment(4, [1.0, 1.0], loads=loads, capacity=(c for c in [1, 3])) == [
        [3],
        [0, 1, 2],
    ]
    assert refined_placement([[0], [1, 2, 3]], [1] * 4, [1.0, 1.0], capacity=iter([3, 3])) == [
        [0, 1],
        [2, 3],
    ]
    assert ExpertRebalancer(placed, speeds=[1.0], capacity=iter([4])).capacity == [4]
    got = place_experts(placed, speeds=(s for s in [1.0]), loads=(x for x in [1, 1, 1, 1]))
    assert got == ALONE


def test_capacity_past_64_bits_is_refused_with_or_without_loads(placed):
    """capacity=[2**70, 1] was refused without loads ("capacity[0]: must be < 2**64") and
    accepted with them ([3, 1]). The same check, and message, on both paths now."""
    text = r"^capacity\[0\]: must be < 2\*\*64, got 1180591620717411303424"
    for loads in (None, [1, 1, 1, 1]):
        with pytest.raises(ValueError, match=text):
            expert_shares(4, [1.0, 1.0], loads=loads, capacity=[2**70, 1])
        with pytest.raises(ValueError, match=text):
            expert_assignment(4, [1.0, 1.0], loads=loads, capacity=[2**70, 1])
    with pytest.raises(ValueError, match=text):
        refined_placement([[0], [1, 2, 3]], [1] * 4, [1.0, 1.0], capacity=[2**70, 3])
    with pytest.raises(ValueError, match=text):
        place_experts(placed, speeds=[1.0], capacity=[2**70])
    # The largest count the Rust layer takes is still a capacity, on both paths.
    most = 2**64 - 1
    assert expert_shares(4, [1.0, 1.0], capacity=[most, 1]) == [3, 1]
    assert expert_shares(4, [1.0, 1.0], loads=[1, 1, 1, 1], capacity=[most, 1]) == [3, 1]


def test_good_calls_answer_as_before():
    """The documented answers, and numpy numbers where ints and floats go."""
    assert expert_shares(8, [3.0, 1.0]) == [6, 2]
    assert expert_shares(4, [1.0, 1.0], loads=[3.0, 1.0, 1.0, 1.0]) == [1, 3]
    assert expert_shares(4, [9.0, 1.0], capacity=[2, 4]) == [2, 2]
    assert expert_shares(4, [9.0, 1.0], loads=[1.0] * 4, capacity=[2, 4]) == [2, 2]
    assert expert_shares(np.int64(4), [np.float64(9.0), 1], capacity=np.array([2, 4])) == [2, 2]
    assert expert_shares(
        4, np.array([9.0, 1.0]), loads=np.ones(4), capacity=[np.int64(2), np.int32(4)]
    ) == [2, 2]
    assert expert_assignment(4, [1.0, 1.0], loads=[5.0, 5.0, 1.0, 1.0]) == [[0, 2], [1, 3]]
    assert expert_assignment(4, [3.0, 1.0]) == [[0, 1, 2], [3]]
    held = expert_assignment(6, [9.0, 1.0], loads=[1.0] * 6, capacity=np.array([2, 4]))
    assert [len(h) for h in held] == [2, 4]
    loads = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0, 1.0]
    now = [[0, 1, 2, 3, 4, 5], [6, 7]]
    assert refined_placement(now, loads, [1.0, 1.0]) == [[0, 1, 2, 3, 4, 5, 7], [6]]
    assert refined_placement(now, np.array(loads), [1, np.float64(1.0)], capacity=[8, 2]) == [
        [0, 1, 2, 3, 4, 5, 7],
        [6],
    ]
    assert placement_time({"x": [[0, 2], [1, 3]]}, {"x": [5, 5, 1, 1]}, [1.0, 1.0]) == 6.0


def _one_rank_s_bad_argument(rank: int, world: int) -> list[str]:
    """On 2 ranks: rank 1 alone gives expert_parallel a dict as capacity and place_experts a
    str as optimizer; each rank reports what it raised."""
    seen: list[str] = []
    capacity: Any = {0: 4, 1: 4} if rank == 1 else [4, 4]
    try:
        expert_parallel(tp.mixtral(), speeds=[1.0, 1.0], capacity=capacity)
    except (CollectiveMismatchError, TypeError, ValueError) as e:
        seen.append(f"{type(e).__name__}: {e}")
    placed = expert_parallel(tp.mixtral(), speeds=[1.0, 1.0])
    opt: Any = torch.optim.SGD(placed.parameters(), lr=0.1)
    try:
        place_experts(placed, "adam" if rank == 1 else opt, speeds=[1.0, 3.0])
    except (CollectiveMismatchError, TypeError, ValueError) as e:
        seen.append(f"{type(e).__name__}: {e}")
    seen.append(str(place_experts(placed, opt, speeds=[1.0, 3.0])))
    return seen


@pytest.mark.multiproc
def test_one_rank_s_bad_argument_raises_on_every_rank():
    """The checks run inside the collectives' agreement: the rank with the bad argument
    raises its own error, the other the mismatch naming it, none waiting; the placement
    then goes on."""
    from hetcoll.launch import spawn

    first, second = spawn(_one_rank_s_bad_argument, 2, timeout=240)
    assert second[0].startswith("ValueError: capacity: needs one int >= 0 per rank (2)")
    assert second[1].startswith("TypeError: optimizer: must be a torch.optim.Optimizer or None")
    for mine in first[:2]:
        assert mine.startswith("CollectiveMismatchError: rank 1 raised"), mine
    assert "ValueError: capacity" in first[0] and "TypeError: optimizer" in first[1]
    assert first[2] == second[2]
