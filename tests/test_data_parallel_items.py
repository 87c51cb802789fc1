"""Token-weighted data parallelism on real gloo processes: a padded language model (Hugging Face
GPT-2, and a decoder around torch.nn.TransformerEncoder) trained with the weighted DDP hook and
``items=`` on ranks with uneven shares and uneven padding learns exactly what one process learns
on the same global batches (the mean over every valid token), where weighing ranks by rows does
not; bad counts raise ValueError naming ``items`` on every rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hetcoll.launch import RankFailed, spawn
from hetcoll.torch import (
    WeightedAllreduceState,
    item_weights,
    register_weighted_hook,
    weighted_allreduce_hook,
)
from hetcoll.torch.batches import (
    COUNTED,
    NEGATIVE,
    NOT_A_NUMBER,
    NOT_INTEGER,
    RAISED,
    count_items,
    count_items_of,
)

from lm_common import (
    MODELS,
    global_batches,
    items,
    lm_loss,
    optimizer,
    rank_rows,
    reference,
    rel_err,
)

pytestmark = pytest.mark.multiproc


def _train(rank, world, name, algorithm, weigh):
    """``weigh``: "items" (register_weighted_hook(ddp, items=...)), "state" (a state built by
    hand with items=) or "rows" (today's default: each rank weighs its rows)."""
    ddp = DDP(MODELS[name](), bucket_cap_mb=0.01)  # several buckets per step
    if weigh == "items":
        state = register_weighted_hook(ddp, items=items, algorithm=algorithm)
    elif weigh == "state":
        state = WeightedAllreduceState(None, items=items, algorithm=algorithm)
        ddp.register_comm_hook(state, weighted_allreduce_hook)
    else:
        state = register_weighted_hook(ddp, algorithm=algorithm)
    opt = optimizer(ddp)
    seen = []
    for x, y in global_batches(world):
        xs, ys = x[rank_rows(world, rank)], y[rank_rows(world, rank)]
        if weigh != "rows":
            state.count(ys)
        opt.zero_grad()
        lm_loss(ddp(xs), ys).backward()
        opt.step()
        seen.append((state.local_batch, state.global_items))
    return [p.detach().clone() for p in ddp.parameters()], seen


def _train_all(rank, world, runs):
    """Every run of ``runs`` ((name, algorithm, weigh) each), one after another."""
    return [_train(rank, world, *run) for run in runs]


#: The language-model runs on each number of ranks, (name, algorithm, weigh): one gloo job per
#: number of ranks runs them all (each rank's imports of torch and transformers take seconds).
RUNS = {
    3: [("gpt2", "direct", "items"), ("encoder", "allreduce", "items"), ("gpt2", "auto", "rows")],
    2: [("gpt2", "allreduce", "state"), ("encoder", "auto", "state")],
}
_jobs: dict[int, list | RankFailed] = {}


def _trained(world, name, algorithm, weigh):
    """Each rank's result of one run of :data:`RUNS`, from the job of ``world`` ranks, run by
    the first test that reads it (a failed job fails each test that reads it)."""
    if world not in _jobs:
        try:
            _jobs[world] = spawn(_train_all, world, RUNS[world], timeout=300)
        except RankFailed as e:
            _jobs[world] = e
    job = _jobs[world]
    if isinstance(job, RankFailed):
        raise RankFailed(f"the {world}-rank gloo job of {RUNS[world]} failed") from job
    k = RUNS[world].index((name, algorithm, weigh))
    return [per_rank[k] for per_rank in job]


@pytest.mark.parametrize(
    ("name", "world", "algorithm", "weigh"),
    [
        ("gpt2", 3, "direct", "items"),
        ("gpt2", 2, "allreduce", "state"),
        ("encoder", 3, "allreduce", "items"),
        ("encoder", 2, "auto", "state"),
    ],
)
def test_items_weighted_hook_equals_one_process_on_a_padded_lm(name, world, algorithm, weigh):
    batches = global_batches(world)
    # The data really is uneven: ranks hold different numbers of valid labels per row, and in
    # step 1 the last rank has none (its loss is a mean over nothing).
    per_rank = [[items(y[rank_rows(world, r)]) for r in range(world)] for _, y in batches]
    assert per_rank[1][-1] == 0 and all(len(set(counts)) == world for counts in per_rank[::2])
    want = reference(name, world)
    for rank, (params, seen) in enumerate(_trained(world, name, algorithm, weigh)):
        assert rel_err(params, want) <= 1e-10, rank
        assert seen == [(c[rank], sum(c)) for c in per_rank]


def test_rows_weighting_is_measurably_wrong_on_a_padded_lm():
    """The same run weighted by rows (the default): not the one process's model. What the items
    test above checks could fail."""
    world = 3
    results = _trained(world, "gpt2", "auto", "rows")
    params = results[0][0]
    assert all(rel_err(p, params) == 0 for p, _ in results)  # the ranks agree with each other
    assert not rel_err(params, reference("gpt2", world)) <= 1e-3


# -- the rule ------------------------------------------------------------------------------------


def test_item_weights_is_the_items_share_and_zero_items_weigh_zero():
    counts = np.array([[COUNTED, 6], [COUNTED, 0], [COUNTED, 2]])
    assert item_weights(counts).tolist() == [0.75, 0.0, 0.25]
    assert count_items(items, torch.tensor([[1, -100], [2, 3]])) == (COUNTED, 3, None)
    assert count_items(lambda y: torch.tensor(4), None).value == 4  # an integer tensor counts


@pytest.mark.parametrize(
    ("returned", "status", "message"),
    [
        (-3, NEGATIVE, "items: rank 1 counted -3 for this step; items(y) must be an integer >= 0"),
        (2.5, NOT_INTEGER, "items: rank 1 counted 2.5 for this step"),
        (torch.tensor(2.0), NOT_INTEGER, "items: rank 1 counted 2.0 for this step"),
        (True, NOT_A_NUMBER, "items: rank 1 counted something that is not a number"),
        ("7", NOT_A_NUMBER, "items: rank 1 counted something that is not a number"),
    ],
)
def test_bad_counts_raise_the_same_error_for_every_rank(returned, status, message):
    bad = count_items(lambda y: returned, None)
    assert bad.status == status and bad.failure is not None
    counts = np.array([[COUNTED, 4], bad.exchanged, [COUNTED, 1]])
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        item_weights(counts)  # another rank: no failure of its own
    with pytest.raises(ValueError, match="items: rank 1") as raised:
        item_weights(counts, failure=bad.failure)  # the failing rank: its own error chained
    assert raised.value.__cause__ is bad.failure


class Loud:
    """A count that records each repr of it (a GPU tensor's repr reads the device)."""

    reprs = 0

    def __init__(self, n: int) -> None:
        self.n = n

    def __index__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        Loud.reprs += 1
        return f"Loud({self.n})"


def test_a_good_count_is_never_shown_and_a_bad_one_is():
    """The message echoing a count is made only for a bad one: made for every count, it cost a
    repr a micro-batch (a GPU's count: 12 reads of the device for 5 counts, the H100 run)."""
    Loud.reprs = 0
    assert count_items(lambda y: Loud(5), None) == (COUNTED, 5, None)
    assert count_items_of(lambda y: y, [Loud(1), Loud(2), 3]) == [
        (COUNTED, n, None) for n in (1, 2, 3)
    ]
    assert Loud.reprs == 0
    bad = count_items(lambda y: Loud(-2), None)
    assert bad.status == NEGATIVE and "items(y) returned Loud(-2)" in str(bad.failure)
    assert Loud.reprs == 1


def test_zero_items_on_every_rank_and_a_raising_items_name_items():
    with pytest.raises(ValueError, match="items: every rank counted 0 items for this step"):
        item_weights(np.array([[COUNTED, 0], [COUNTED, 0]]))
    boom = count_items(lambda y: 1 // 0, None)
    assert boom.status == RAISED and isinstance(boom.failure, ZeroDivisionError)
    with pytest.raises(ValueError, match="items: items\\(y\\) raised an exception on rank 0"):
        item_weights(np.array([boom.exchanged, [COUNTED, 3]]))


# -- bad input on real ranks: ValueError naming items on every rank, no hang -----------------------


BAD = {
    "non_integer": ("items: rank 1 counted 2.5 for this step", ValueError),
    "negative": ("items: rank 0 counted -1 for this step", ValueError),
    "all_zero": ("items: every rank counted 0 items for this step", ValueError),
    "raises": ("items: items(y) raised an exception on rank 1", ValueError),
    "not_counted": ("items: no count for this step; call state.count(y)", RuntimeError),
    # One rank skips its count: it raises in its backward, the other in count(), at once (its
    # hook's check and the other's count were two exchanges of different sizes: gloo killed
    # the process).
    "one_forgets": ("items: no count for this step; call state.count(y)", RuntimeError),
}


def _bad(rank, world):
    out = {}
    ids = torch.randint(0, 5, (2, 4))
    for case in BAD:
        model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5)).double()
        ddp = DDP(model)

        def count(y, case=case):
            if case == "non_integer" and rank == 1:
                return 2.5
            if case == "negative" and rank == 0:
                return -1
            if case == "raises" and rank == 1:
                raise KeyError("labels")
            return 0 if case == "all_zero" else items(y)

        state = register_weighted_hook(ddp, items=count)
        try:
            if case != "not_counted" and (case != "one_forgets" or rank == 0):
                state.count(ids)
            lm_loss(ddp(ids), ids).backward()
            out[case] = "no error"
        except Exception as e:
            out[case] = (type(e).__name__, str(e))
        # The ranks still work together afterwards: a good step goes through.
        state = WeightedAllreduceState(None, items=items)
        ddp = DDP(model)
        ddp.register_comm_hook(state, weighted_allreduce_hook)
        state.count(ids)
        lm_loss(ddp(ids), ids).backward()
    return out


def test_bad_items_raise_on_every_rank():
    for rank, per_rank in enumerate(spawn(_bad, 2, timeout=120)):
        for case, (message, kind) in BAD.items():
            if case == "one_forgets" and rank == 0:  # the rank that counted
                kind, message = RuntimeError, "rank 1 raised RuntimeError: " + message
                assert per_rank[case][0] == "CollectiveMismatchError", per_rank[case]
            else:
                assert per_rank[case][0] == kind.__name__, (case, per_rank[case])
            assert message in per_rank[case][1], (case, per_rank[case])


def _micro_batches(rank, world):
    """Two micro-batches per step under ``no_sync``, each counted: the step weighs their sum."""
    ddp = DDP(MODELS["encoder"]())
    state = register_weighted_hook(ddp, items=items)
    opt = optimizer(ddp)
    for x, y in global_batches(world):
        rows = rank_rows(world, rank)
        mine = list(range(rows.start, rows.stop))
        opt.zero_grad()
        n = items(y[rows])
        for k, half in enumerate([mine[0::2], mine[1::2]]):
            state.count(y[half])
            with ddp.no_sync() if k == 0 else torch.enable_grad():
                loss = nn.functional.cross_entropy(
                    ddp(x[half]).flatten(0, 1),
                    y[half].flatten(),
                    ignore_index=-100,
                    reduction="sum",
                )
                (loss / max(n, 1)).backward()
        opt.step()
    return [p.detach().clone() for p in ddp.parameters()]


def test_counting_each_micro_batch_weighs_the_step_s_items():
    # Each count() replaced the last: the step weighed the last micro-batch's items alone.
    want = reference("encoder", 2)
    for params in spawn(_micro_batches, 2, timeout=120):
        assert rel_err(params, want) <= 1e-10


def test_bad_arguments_name_items():
    with pytest.raises(TypeError, match="items: must be a function"):
        WeightedAllreduceState(None, items=3)
    with pytest.raises(TypeError, match=r"items: give items= .* not both"):
        WeightedAllreduceState(None, 4, items=items)
    state = WeightedAllreduceState(None, 4)
    with pytest.raises(TypeError, match="items: count\\(y\\) needs a state built with items="):
        state.count(torch.zeros(2))
    state = WeightedAllreduceState(None, items=items)
    with pytest.raises(TypeError, match="local_batch: this state counts items"):
        state.local_batch = 3


def _no_samples(rank, world):
    out = {}
    for algorithm in ("direct", "allreduce"):
        ddp = DDP(nn.Linear(3, 2).double())
        state = WeightedAllreduceState(None, 0, algorithm=algorithm)
        ddp.register_comm_hook(state, weighted_allreduce_hook)
        try:
            ddp(torch.zeros(2, 3, dtype=torch.float64)).sum().backward()
            out[algorithm] = "no error"
        except RuntimeError as e:  # DDP reports a hook's error as a RuntimeError around it
            out[algorithm] = str(e)
    return out


def test_rows_weighting_goes_through_the_same_rule():
    """Samples counted by hetcoll (local_batch, the forward's counter) are weighed by the same
    rule: zero samples on every rank is the rule's error, by either exchange."""
    for per_rank in spawn(_no_samples, 2, timeout=60):
        for algorithm, message in per_rank.items():
            assert "local_batch: every rank counted 0 samples for this step" in message, algorithm


def _padding_first(rank, world, order):
    """Two micro-batches under no_sync, one of them nothing but padding on every rank, in
    ``order``; the step's gradient."""
    from hetcoll.torch import register_weighted_hook

    torch.manual_seed(0)
    model = nn.Linear(3, 2, dtype=torch.float64)
    ddp = DDP(model)
    state = register_weighted_hook(ddp, items=lambda t: int(t[1].sum()))
    x, y, valid = _padded(rank)
    mine = int(valid.sum())
    for k, rows in enumerate([slice(0, 2), slice(2, 4)][::order]):
        ctx = ddp.no_sync() if k == 0 else torch.enable_grad()
        with ctx:
            state.count((y[rows], valid[rows]))
            err = ((ddp(x[rows]) - y[rows]) ** 2).sum(1)
            (err * valid[rows]).sum().div(mine).backward()
    return model.weight.grad.clone()


def _padded(rank):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    y = torch.randn(4, 2, generator=g, dtype=torch.float64)
    valid = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 0]][rank], dtype=torch.bool)
    return x, y, valid


@pytest.mark.parametrize("order", [1, -1], ids=["padding first", "padding last"])
def test_a_micro_batch_of_padding_under_no_sync_counts_nothing(order):
    """A step's first micro-batch all padding on every rank: the step weighs its later ones'
    items (before, its count raised "every rank counted 0 items" although the step had 3)."""
    torch.manual_seed(0)
    ref = nn.Linear(3, 2, dtype=torch.float64)
    x, y, v = (torch.cat(t) for t in zip(*(_padded(r) for r in range(2))))
    (((ref(x) - y) ** 2).sum(1) * v).sum().div(v.sum()).backward()
    for got in spawn(_padding_first, 2, order):
        assert rel_err(got, ref.weight.grad) <= 1e-12


def _items_under_join(rank, world):
    from hetcoll.torch import register_weighted_hook

    torch.manual_seed(0)
    ddp = DDP(nn.Linear(3, 2))
    state = register_weighted_hook(ddp, items=len)
    try:
        with ddp.join():
            for _ in range(2 + rank):  # rank 1 has one more step
                y = torch.zeros(2)
                state.count(y)
                ddp(torch.ones(2, 3)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_items_under_join_raise_at_once_on_every_rank():
    """count(y) under ddp.join() raises on every rank at its first call: a rank out of inputs
    takes no part in the counts' exchange (before, the others waited in it until the
    process group's timeout)."""
    for got in spawn(_items_under_join, 2, timeout=60):
        assert got.startswith("items: count(y) cannot run under ddp.join()"), got
