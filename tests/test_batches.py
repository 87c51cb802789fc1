"""BatchCounter: each step's local batch read off the forward pass (single process)."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hetcoll
from hetcoll.torch import BatchCounter, DistributedOptimizer


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, batch: dict, scale: float = 1.0) -> torch.Tensor:
        return self.lin(batch["x"]) * scale


def test_counts_training_forwards_since_the_last_take():
    model = nn.Linear(4, 2)
    counter = BatchCounter(model)
    model(torch.zeros(3, 4))
    model(torch.zeros(5, 4))  # gradient accumulation: both count
    with torch.no_grad():
        model(torch.zeros(100, 4))  # evaluation: not counted
    assert counter.pending == 8
    assert counter.take() == 8
    assert counter.pending == 0
    model(torch.zeros(2, 4))
    assert counter.take() == 2


def test_an_eval_mode_forward_counts_once_a_backward_reaches_it():
    model = nn.Sequential(nn.Linear(4, 2), nn.Dropout(0.5))
    counter = BatchCounter(model)
    model.eval()
    model(torch.ones(7, 4)).sum()  # a validation forward without no_grad: no backward
    assert counter.pending == 0 and counter.forwards == 0
    out = model(torch.ones(3, 4))  # a model trained in eval mode: counted at its backward
    assert counter.pending == 0
    (out.sum() + out.mean()).backward()  # two gradients reach the output: counted once
    assert counter.take() == 3
    model.train()
    model(torch.ones(2, 4))
    model.eval()
    stale = model(torch.ones(5, 4))
    assert counter.take() == 2  # the eval-mode forward no backward reached is dropped
    stale.sum().backward()  # reaching it after the step counts nothing
    assert counter.pending == 0
    model(torch.ones(4, 4))
    counter.claim_unreached()  # a loss weighed before its backward (state.weigh)
    assert counter.take() == 4


class _TokensLSTM(nn.Module):
    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.rnn = nn.LSTM(4, 3, batch_first=batch_first)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rnn(self.emb(ids))[0]


def test_sequence_first_layers_counted_along_their_sequence_are_named():
    ids = torch.zeros(7, 2, dtype=torch.long)  # 7 steps of 2 sequences
    for model, batch_dim, warned in [
        (_TokensLSTM(batch_first=False), 0, "'rnn' (LSTM, batch_first=False)"),
        (nn.TransformerEncoderLayer(4, 2), 0, "the model (TransformerEncoderLayer"),
        (_TokensLSTM(batch_first=False), 1, None),
        (_TokensLSTM(batch_first=True), 0, None),
    ]:
        counter = BatchCounter(model, batch_dim=batch_dim)
        x = ids if isinstance(model, _TokensLSTM) else torch.zeros(7, 2, 4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x)
            model(x)  # looked at once
        said = [str(w.message) for w in caught if "BatchCounter" in str(w.message)]
        if warned is None:
            assert not said, said
        else:
            assert len(said) == 1 and warned in said[0] and "batch_dim=1" in said[0], said
        assert counter.take() == 2 * (7 if batch_dim == 0 else 2)


def test_frozen_modules_are_not_counted_and_zeroed_forwards_are_dropped():
    model = nn.Linear(4, 2)
    counter = BatchCounter(model, reached=True)
    model.requires_grad_(False)  # a GAN's discriminator in the generator's step
    model(torch.ones(6, 4))
    assert counter.forwards == 0
    model.requires_grad_(True)
    model(torch.ones(3, 4)).sum().backward()  # its gradients then zeroed: dropped
    early = model(torch.ones(2, 4))  # zero_grad between a forward and its backward: kept
    counter.discard_reached()
    early.sum().backward()
    assert counter.take() == 2
    model.eval()  # trained in eval mode: counted at the backward, dropped alike
    model(torch.ones(5, 4)).sum().backward()
    assert counter.pending == 5
    counter.discard_reached()
    assert counter.pending == 0 and counter.forwards == 0


def test_the_forms_loaders_hand_out():
    from collections import UserDict
    from dataclasses import dataclass

    from torch.nn.utils.rnn import pack_sequence

    from hetcoll.torch.batches import batch_size, loader_batch_size

    seqs = [torch.ones(n, 2) for n in (7, 5, 2)]
    for sort in (True, False):  # its sequences, not its tokens nor its fields
        assert batch_size((pack_sequence(seqs, enforce_sorted=sort),), {}) == 3
    assert batch_size((UserDict(x=torch.ones(4, 3)),), {}) == 4  # as a BatchEncoding

    @dataclass
    class Batch:
        mask: object
        x: torch.Tensor

    assert batch_size((Batch(None, torch.ones(6, 2)),), {}) == 6
    same = [torch.ones(7, 2) for _ in range(3)]  # three sequences of one length
    assert loader_batch_size((same, torch.zeros(3))) == 3  # beside their labels
    with pytest.warns(UserWarning, match=r"a list of 3 tensors of one shape \(7, 2\)"):
        assert batch_size((same,), {}) == 7  # alone: read as inputs, and said so


def test_first_tensor_found_through_dicts_and_keywords_and_batch_dim():
    model = TwoInputs()
    counter = BatchCounter(model)
    model({"x": torch.zeros(6, 4)}, scale=2.0)
    assert counter.take() == 6
    seq = nn.Linear(4, 2)
    counter = BatchCounter(seq, batch_dim=1)
    seq(torch.zeros(3, 7, 4))  # sequence-first input: the batch is dimension 1
    assert counter.take() == 7


def test_no_forward_since_the_last_step_is_an_error_not_a_stale_count():
    model = nn.Linear(4, 2)
    counter = BatchCounter(model)
    with pytest.raises(RuntimeError, match="local_batch: the module ran no forward"):
        counter.take()
    model(torch.zeros(3, 4))
    counter.take()
    with pytest.raises(RuntimeError, match="no forward with gradients"):
        counter.take()


def test_forward_without_a_batched_tensor_names_the_problem():
    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(()))

        def forward(self, x: float) -> torch.Tensor:
            return self.w + x

    model = Scalar()
    BatchCounter(model)
    with pytest.raises(TypeError, match="no tensor argument has dimension 0"):
        model(1.0)


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="module"):
        BatchCounter("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_dim"):
        BatchCounter(nn.Linear(2, 2), batch_dim=-1)


def test_item_weights_name_counts_of_another_form():
    from hetcoll.torch import item_weights
    from hetcoll.torch.batches import COUNTED

    assert item_weights([[COUNTED, 3], [COUNTED, 1]]).tolist() == [0.75, 0.25]
    for counts in (None, "ab", [[1, 2, 3]]):
        with pytest.raises(TypeError, match=r"^counts: must be the \(ranks, 2\) integers"):
            item_weights(counts)  # type: ignore[arg-type]


def test_item_weights_refuse_counts_no_local_count_makes():
    """A caller's own array of counts is checked as a LocalCount checks one: a negative
    count once weighed its rank negatively, and counts whose int64 sum wraps around weighed
    them by 9e17."""
    from hetcoll.torch import item_total, item_weights
    from hetcoll.torch.batches import COUNTED

    for counts, message in (
        ([[COUNTED, -1], [COUNTED, 3]], r"^items: rank 0 counted -1 for this step"),
        ([[COUNTED, 1], [COUNTED, -3]], r"^items: rank 1 counted -3 for this step"),
        ([[COUNTED, 2**62]] * 4 + [[COUNTED, 5]], r"^items: rank 0 counted 2\*\*53 or more"),
        ([[COUNTED, 2**52]] * 3, r"^items: the ranks counted \d+ items for this step together"),
    ):
        for weigh in (item_weights, item_total):
            with pytest.raises(ValueError, match=message):
                weigh(counts)
    assert item_weights([[COUNTED, 0], [COUNTED, 2**52]]).tolist() == [0.0, 1.0]


def test_remove_stops_counting():
    model = nn.Linear(4, 2)
    counter = BatchCounter(model)
    counter.remove()
    model(torch.zeros(3, 4))
    assert counter.pending == 0


def test_optimizer_needs_exactly_one_of_local_batch_and_model():
    model = nn.Linear(4, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="local_batch: required unless model="):
        DistributedOptimizer(sgd, None)
    with pytest.raises(TypeError, match="not both"):
        DistributedOptimizer(sgd, None, local_batch=3, model=model)


def test_register_weighted_hook_wants_ddp():
    with pytest.raises(TypeError, match="ddp: must be a torch"):
        hetcoll.torch.register_weighted_hook(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_a_list_of_samples_counts_its_entries():
    from hetcoll.torch.batches import batch_size, loader_batch_size

    image = torch.zeros(3, 8, 8)
    targets = [{"boxes": torch.zeros(1, 4)}] * 2
    # torchvision's detection models: a list of images beside a list of their targets.
    assert batch_size(([image, image], targets), {}) == 2
    assert batch_size((), {"images": [image] * 3, "targets": targets + targets[:1]}) == 3
    # Images of several sizes are samples, even alone.
    assert batch_size(([image, torch.zeros(3, 6, 6)],), {}) == 2
    # A list of batched tensors alone, or a tensor first, is read by its first tensor's rows.
    with pytest.warns(UserWarning, match="is read as inputs"):  # (ambiguous: said so)
        assert batch_size(([torch.zeros(5, 2), torch.zeros(5, 2)],), {}) == 5
    assert batch_size((torch.zeros(7, 2), [image, image], targets), {}) == 7
    assert batch_size((torch.zeros(()),), {}) is None
    # A DataLoader's batch: its entries are the arguments (Lightning's strategy reads it so).
    assert loader_batch_size(([image] * 4, targets * 2)) == 4
    assert loader_batch_size({"x": torch.zeros(6, 2), "y": torch.zeros(6)}) == 6


def _count_values():
    """What an ``items`` function may return, good and bad: ints, numpy integers, tensors of
    every kind on the CPU, None (standing for a raise)."""
    import numpy as np
    from hypothesis import strategies as st

    ints = st.integers(-(2**60), 2**60)
    return st.one_of(
        ints,
        ints.map(np.int64),
        st.integers(-(2**31), 2**31 - 1).map(lambda n: torch.tensor(n, dtype=torch.int32)),
        ints.map(lambda n: torch.tensor([n])),
        st.one_of(st.floats(-10, 10), st.just(float("nan"))).map(torch.tensor),
        st.booleans().map(torch.tensor),
        st.just(torch.tensor([1, 2])),
        st.booleans(),
        st.just("3"),
        st.none(),
    )


def test_counting_several_micro_batches_is_counting_each():
    """count_items_of (a step's micro-batches, a GPU's counts read at once) gives each count
    count_items gives it alone: the same status, value and error, whatever ``items`` returns
    or raises (on the CPU; tests/test_cuda.py reads a GPU's)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from hetcoll.torch.batches import count_items, count_items_of

    def items(v):
        if v is None:
            raise KeyError("labels")
        return v

    @settings(max_examples=60, deadline=None)
    @given(st.lists(_count_values(), max_size=6))
    def check(values):
        got = count_items_of(items, values)
        want = [count_items(items, v) for v in values]
        assert [(c.status, c.value) for c in got] == [(c.status, c.value) for c in want]
        assert [repr(c.failure) for c in got] == [repr(c.failure) for c in want]

    check()


# -- the counts that ride in a bucket's allreduce (the weighted hook on gloo) -------------------


@settings(max_examples=300, deadline=None)
@given(
    counts=st.lists(st.integers(0, 2**53 - 1), min_size=1, max_size=64),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    order=st.randoms(use_true_random=False),
)
def test_counts_in_a_bucket_sum_exactly_in_any_order(counts, dtype, order):
    """Each rank's count (below 2**53) as pieces of count_bits bits: their sum over the ranks,
    in the bucket's own type and in any order of the reduction (a ring's chunks are summed in
    different orders), gives back the exact total."""
    from hetcoll.torch.hooks import count_bits, count_pieces, joined_count

    bits = count_bits(dtype, len(counts))
    pieces = [torch.tensor(count_pieces(n, bits), dtype=dtype) for n in counts]
    order.shuffle(pieces)
    total = torch.zeros_like(pieces[0])
    for p in pieces:
        total += p
    assert joined_count(total.tolist(), bits) == sum(counts)


def test_count_bits_leave_the_sum_within_the_significand_or_refuse():
    from hetcoll.torch.hooks import count_bits

    assert count_bits(torch.float32, 2) == 23 and count_bits(torch.float64, 2) == 52
    assert count_bits(torch.float32, 10_240) == 10  # 10,240 x 2**10 <= 2**24
    assert count_bits(torch.float32, 1 << 17) == 0  # too few bits left: gathered apart
    assert count_bits(torch.bfloat16, 2) == count_bits(torch.float16, 2) == 0
