"""torch.distributed.checkpoint saves a split model as the unsplit one and loads it into any
other split (tests/dcp_cases.py): a split's ``state_dict()`` and its optimizer's mark each
slice with where it sits in the unsplit tensor (DCP's ``CheckpointableTensor`` fields), and a
slice saved by another rank is refused by ``load_state_dict``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import dcp_cases
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from hetcoll import launch
from hetcoll.torch.filters.layers import ChannelSplit


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(dcp_cases.CASES))
def test_saved_on_two_ranks_loads_on_three_other_speeds(name, tmp_path):
    path = str(tmp_path / "ckpt")
    launch.spawn(dcp_cases.first_job, 2, name, path, timeout=240)
    # The checkpoint is the unsplit model's: torch's own converter gives its state dict.
    dcp_to_torch_save(path, str(tmp_path / "unsplit.pt"))
    converted = torch.load(tmp_path / "unsplit.pt")
    saved = torch.load(tmp_path / "ckpt" / "full.pt")
    assert converted["model"].keys() == saved["model"].keys()
    for k, v in saved["model"].items():
        assert torch.equal(converted["model"][k], v), k
    r = launch.spawn(dcp_cases.second_job, 3, name, path, timeout=240)[0]
    assert r["keys"] == 0, r
    assert r["model"] == 0, r  # copied entries: exact
    assert r["optim"] == 0, r
    assert r["forward"] <= dcp_cases.TOL, r


@pytest.mark.multiproc
def test_an_optimizer_whose_state_exists_before_any_step_loads_on_other_speeds(tmp_path):
    """Adagrad makes its state (its sums) with the optimizer: DCP's get_state_dict does not
    step such a fresh one, so it was never hooked and its state went unmarked, and dcp.load
    refused the unsplit state's size ("Size mismatch between saved [10, 6] and current
    [6, 6]"). Saved on 2 ranks at 3:1 after 2 steps, loaded on 3 at 2:1:1, exactly."""
    path = str(tmp_path / "ckpt")
    launch.spawn(dcp_cases.first_job, 2, "mlp", path, False, None, "adagrad", timeout=240)
    r = launch.spawn(dcp_cases.second_job, 3, "mlp", path, "adagrad", timeout=240)[0]
    assert (r["keys"], r["model"], r["optim"]) == (0, 0, 0), r
    assert r["forward"] <= dcp_cases.TOL, r


def _converted_differs(path: Path) -> float:
    """How far the unsplit state dict torch's converter reads from checkpoint ``path`` is
    from the gathered one saved beside it (the model's, largest entry difference; infinite
    where a tensor's shape differs: a rank's slice written as the whole tensor)."""
    dcp_to_torch_save(str(path), str(path.parent / "unsplit.pt"))
    converted = torch.load(path.parent / "unsplit.pt")["model"]
    saved = torch.load(path / "full.pt")["model"]
    assert converted.keys() == saved.keys()
    return max(
        (converted[k] - v).abs().max().item() if converted[k].shape == v.shape else math.inf
        for k, v in saved.items()
    )


@pytest.mark.multiproc
def test_state_dicts_copied_to_the_host_keep_their_marks(tmp_path):
    """``get_state_dict(..., options=StateDictOptions(cpu_offload=True))`` copies a GPU rank's
    tensors into host memory, dropping the marks of its slices, and DCP wrote one rank's slice
    under each name (silently, where the slices have the same shape). Here the copy a GPU
    makes is made of CPU tensors (tests/dcp_cases.py: offloaded_to_host); the model and
    optimizer state must load on 3 ranks of other speeds exactly, and without hetcoll's
    wrapper of the copy the checkpoint must be wrong."""
    path = tmp_path / "marked" / "ckpt"
    launch.spawn(dcp_cases.first_job, 2, "mlp", str(path), False, True, timeout=240)
    assert _converted_differs(path) == 0.0
    r = launch.spawn(dcp_cases.second_job, 3, "mlp", str(path), timeout=240)[0]
    assert (r["keys"], r["model"], r["optim"]) == (0, 0, 0), r
    assert r["forward"] <= dcp_cases.TOL, r
    blind = tmp_path / "blind" / "ckpt"
    try:
        launch.spawn(dcp_cases.first_job, 2, "mlp", str(blind), False, False, timeout=240)
    except Exception as e:  # the wrong save may fail as well as write
        print(f"unmarked copies: the save failed: {e}")
    else:
        assert _converted_differs(blind) > 0


@pytest.mark.multiproc
@pytest.mark.parametrize("case", list(dcp_cases.PLANS))
def test_plans_and_splits_load_each_others_checkpoints(case, tmp_path):
    # A plan's checkpoint is the unsplit model's, as a split's is: it loads into any other
    # plan (other stages, kinds, idle ranks) and into a filter-parallel split, and a split's
    # loads into a plan; the CNN cut as a chain of layers, GPT-2 between blocks (its head tied
    # to the embedding on another stage).
    _, _, saving, _, loading = dcp_cases.PLANS[case]
    path = str(tmp_path / "ckpt")
    said = launch.spawn(dcp_cases.plan_first_job, saving, case, path, timeout=240)
    assert said == [[]] * saving  # ReplicaSavePlanner is a planner as torch's API wants
    dcp_to_torch_save(path, str(tmp_path / "unsplit.pt"))
    converted = torch.load(tmp_path / "unsplit.pt")["model"]
    saved = torch.load(tmp_path / "ckpt" / "full.pt")["model"]
    assert converted.keys() == saved.keys()  # the unsplit model's names
    assert all(torch.equal(converted[k], v) for k, v in saved.items())
    r = launch.spawn(dcp_cases.plan_second_job, loading, case, path, timeout=240)[0]
    assert r["model"] == 0 and r["optim"] == 0, r


@pytest.mark.multiproc
def test_the_unsplit_state_loads_into_a_split_through_set_state_dict():
    # StateDictOptions(full_state_dict=True): each rank takes its slice, optimizer state too
    r = launch.spawn(dcp_cases.full_into_split, 3, timeout=240)[0]
    assert r["model"] == 0 and r["optim"] == 0, r


@pytest.mark.multiproc
@pytest.mark.parametrize("world", sorted(dcp_cases.FULL))
def test_full_state_dicts_hold_the_unsplit_tensors(world):
    """get_state_dict(..., full_state_dict=True) of splits (channels with BatchNorm's
    statistics, grouped-query, packed and multi-query attention, experts placed out of
    order) and plans (a pipeline with a split stage, an idle rank, owners stages, replicas
    of two shapes, experts placed 3:1:0): each rank's tensors
    are the unsplit model's under the names it holds, the optimizer's state too, exactly;
    with cpu_offload torch keeps them on rank 0 alone, as for any model."""
    runs = launch.spawn(dcp_cases.full_state_dicts, world, timeout=300)
    for rank, r in enumerate(runs):
        for case, got in r.items():
            full, offloaded = got["full"], got["offloaded"]
            assert full["keys"] == got["own"], (rank, case)
            assert (full["model"], full["optim"], full["on_host"]) == (0, 0, True), (rank, case)
            assert full["empty"] == dcp_cases.PLACEHOLDERS.get((case, rank), []), (rank, case)
            kept = full if rank == 0 else {**full, "keys": [], "empty": []}
            assert offloaded == kept, (rank, case)


@pytest.mark.multiproc
def test_full_state_dicts_without_hetcoll_hold_the_ranks_slices():
    # The same check fails where DCP's copies are torch's own: its full state dicts gathered
    # only its sharded types, and gave each rank its slices.
    runs = launch.spawn(dcp_cases.full_state_dicts, 2, True, timeout=300)
    for case in runs[0]:
        assert all(r[case]["full"]["model"] == math.inf for r in runs), case


@pytest.mark.multiproc
def test_full_state_dicts_on_mpi():
    # No torch.distributed: the slices are gathered over MPI's COMM_WORLD, and torch keeps
    # the offloaded full state dict on every rank.
    worker = str(Path(__file__).resolve().parent / "mpi_workers" / "cases.py")
    proc = launch.mpiexec(3, [worker, "dcp_cases"], timeout=240)
    exact = {"keys": True, "model": 0.0, "optim": 0.0}
    assert (
        json.loads(proc.stdout.strip().splitlines()[-1])
        == [{"full": exact, "offloaded": exact}] * 3
    )


@pytest.mark.multiproc
def test_saved_right_after_a_resume_from_the_gathered_state(tmp_path):
    # The optimizer was loaded (load_full_optimizer_state_dict) and never stepped.
    path = str(tmp_path / "ckpt")
    launch.spawn(dcp_cases.first_job, 2, "mlp", path, True, timeout=240)
    r = launch.spawn(dcp_cases.second_job, 3, "mlp", path, timeout=240)[0]
    assert r["model"] == 0 and r["optim"] == 0 and r["keys"] == 0, r
    assert r["forward"] <= dcp_cases.TOL, r


@pytest.mark.multiproc
def test_a_ranks_own_state_loads_back_as_it_was():
    for rank, r in enumerate(launch.spawn(dcp_cases.own_state_round_trips, 2, timeout=240)):
        assert r["preconditioner"] == (8, 8), r  # optimizer state of the unsplit shape, kept
        assert r["momentum"] == r["weight"] == ((2, 8) if rank == 0 else (6, 8)), r
        assert r["marked"] == [], r


@pytest.mark.multiproc
def test_a_slice_saved_by_another_rank_is_refused(tmp_path):
    errors = launch.spawn(dcp_cases.slice_of_another_rank, 2, str(tmp_path), timeout=240)
    for rank, (model, optim, first_step, marked) in enumerate(errors):
        assert marked == [], marked  # state_dict(keep_vars=True): the parameters, unmarked
        assert first_step.startswith("optimizer: state[0]['momentum_buffer']"), first_step
        assert model.startswith("state_dict: '0.weight' is a slice"), model
        assert f"({5 * (1 - rank)}, {5 * (2 - rank)})" in model, model  # the saved entries
        assert f"({5 * rank}, {5 * (rank + 1)})" in model, model  # this rank's
        assert optim.startswith("optimizer state_dict: state[0]['momentum_buffer']"), optim


@pytest.mark.multiproc
def test_an_older_torchs_dcp_is_taught_the_marks(tmp_path):
    # On torch < 2.14 hetcoll wraps DCP's shard functions (filters/dcp_fields.py). Here this
    # torch's DCP is made blind to the marks, as an older one is, in a process of its own:
    # the wrappers must give the unsplit tensor, and without them the test's check fails.
    (r,) = launch.spawn(dcp_cases.older_dcp, 1, str(tmp_path / "taught"), True, timeout=120)
    assert r == {"wrapped": True, "saved": 0.0, "bias": 0.0, "loaded": 0.0, "loaded_bias": 0.0}
    (blind,) = launch.spawn(dcp_cases.older_dcp, 1, str(tmp_path / "blind"), False, timeout=120)
    assert blind["blind"]["saved"] > 0, blind  # the rows as the tensor held them


class _Split(ChannelSplit):
    """A split module's bookkeeping alone: tensor ``w`` split along dim 0 in ``blocks`` (with
    ``whole`` entries every rank holds after each block), or held in ``order``."""

    def __init__(self, shares, rank, blocks, whole, order=None):
        self.shares, self.rank, self.offset = shares, rank, sum(shares[:rank])
        self.blocks, self.whole, self.order = tuple(blocks), tuple(whole), order

    def split_spec(self):
        return {"w": (0, self.blocks)}

    def whole_spec(self):
        return {"w": self.whole} if any(self.whole) else {}


@st.composite
def _layouts(draw):
    ranks = draw(st.integers(1, 4))
    shares = draw(st.lists(st.integers(0, 4), min_size=ranks, max_size=ranks))
    if sum(shares) == 0:
        shares[0] = 1
    if draw(st.booleans()):  # whole experts held out of order: one block, none whole
        drawn = draw(st.permutations(range(sum(shares))))
        at = [sum(shares[:r]) for r in range(ranks + 1)]  # each rank's experts ascending
        order = [e for r in range(ranks) for e in sorted(drawn[at[r] : at[r + 1]])]
        return shares, (1,), (), tuple(order)
    blocks = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))
    if sum(blocks) == 0:
        blocks[0] = 1
    whole = draw(st.lists(st.integers(0, 2), min_size=len(blocks), max_size=len(blocks)))
    return shares, tuple(blocks), tuple(whole), None


@settings(max_examples=300, deadline=None)
@given(_layouts(), st.integers(1, 3))
def test_marks_tile_the_unsplit_tensor(layout, width):
    """Every rank's marked runs hold the entries its slice (cut by ``load_state_dict`` from the
    unsplit tensor) holds there, and all ranks' runs cover the unsplit tensor, each entry once
    but those every rank holds, which are the same run on every rank (DCP writes it once)."""
    shares, blocks, whole, order = layout
    total = sum(shares) * sum(blocks) + sum(whole)
    full = torch.arange(total * width, dtype=torch.float64).reshape(total, width)
    seen: dict[tuple[int, int], int] = {}
    for rank in range(len(shares)):
        m = _Split(shares, rank, blocks, whole, order)
        state = {"w": full}
        m._slice_full(state, "")
        local = state["w"].clone()
        if not m.mark_shards("w", local):
            assert local.shape[0] == 0 or len(shares) == 1, layout
            continue
        assert local.global_shape == (total, width)
        for g, lo, size in zip(local.global_offsets, local.local_offsets, local.local_sizes):
            n = size[0]
            assert torch.equal(local[lo[0] : lo[0] + n], full[g[0] : g[0] + n]), layout
            seen[(g[0], n)] = seen.get((g[0], n), 0) + 1
    covered = sorted(a for (g, n) in seen for a in range(g, g + n))
    assert covered == list(range(total)), (layout, seen)
    for (g, n), times in seen.items():  # a run several ranks mark is one every rank holds
        assert times == 1 or (times == len(shares) and sum(whole) > 0), (layout, g, n, times)


@pytest.mark.multiproc
def test_a_plans_own_state_dict_is_keyed_as_the_unsplit_model_and_loads_back():
    # An idle rank, an owners stage and a pipeline with a split stage; and the keys earlier
    # versions wrote (stage.<layer>, stage.parts.<layer>, idle, the loss's) still load.
    for r in launch.spawn(dcp_cases.own_state_dicts_of_plans, 3, timeout=240):
        for plan, checks in r.items():
            assert all(checks.values()), (plan, checks)


@pytest.mark.multiproc
def test_the_unsplit_state_loads_into_plans_through_set_state_dict():
    # full_state_dict=True into a plan with an idle rank (none of the first parameter) and a
    # pipeline with a split stage: each rank takes its part, AdamW's state too
    r = launch.spawn(dcp_cases.full_into_plans, 3, timeout=240)[0]
    for plan, diffs in r.items():
        assert diffs["model"] == 0 and diffs["optim"] == 0, (plan, diffs)


@pytest.mark.multiproc
def test_a_pipeline_loaded_without_flattened_optimizer_state_is_refused(tmp_path):
    said = launch.spawn(dcp_cases.unflattened_pipeline, 3, str(tmp_path / "ckpt"), timeout=240)
    refused = [m for m in said if m != "loaded"]
    assert refused, said
    assert all("flatten_optimizer_state_dict=True" in m for m in refused), said


@pytest.mark.multiproc
def test_save_pretrained_of_a_split_model_refuses_its_slices(tmp_path):
    # It wrote this rank's slices under the unsplit names, silently; the gathered state dict
    # saves the unsplit model.
    for r in launch.spawn(dcp_cases.save_pretrained_of_a_split, 2, str(tmp_path), timeout=240):
        assert all(m.startswith("save_pretrained: the model is split") for m in r["said"]), r
        assert all("gather_state_dict(model, dst=0)" in m for m in r["said"]), r
        assert r["keys"] and r["diff"] == 0, r
