"""Each step's local batch, read off the forward pass.

Sample-weighted averaging needs every rank's number of samples in the step. Setting it by hand
(``state.local_batch = len(x)``) is easy to forget, and forgetting it gives wrong gradients
without a word whenever shares are uneven or change. :class:`BatchCounter` instead counts the
samples of every forward that records a graph (grad enabled; in ``eval()`` mode, once a backward
reaches its output) since the last gradient exchange — the samples whose gradients that
exchange carries, gradient accumulation included. The DDP hook
(:func:`hetcoll.torch.register_weighted_hook`) and the MPI optimizer
(``DistributedOptimizer(..., model=model)``) use it.

Rows are the right weight only when each rank's loss is a mean over its rows. A language model's
loss is a mean over its valid tokens (labels padded with -100), so there the weight of a rank is
its number of valid tokens: ``items(y)``, a function of the step's targets that counts what
``loss_fn`` averages over (e.g. ``lambda y: int((y != -100).sum())``; ``y[:, 1:]`` for a loss
that shifts its labels, as a causal LM's does), replaces the rows
wherever hetcoll weights ranks (the DDP hook, :class:`~hetcoll.torch.DistributedOptimizer`,
Lightning's ``BalancedStrategy``). :func:`count_items` counts this rank's items without raising
(a bad count must reach the other ranks, or they would wait for this one forever;
:func:`count_items_of` counts several micro-batches', reading a GPU's counts at once), and
:func:`item_weights` is the one rule that turns every rank's count into its weight, raising the
same error on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from hetcoll.errors import shown
from hetcoll.torch.filters.checks import check_flag

#: ``items(y)``: how many items (valid tokens, rows...) ``loss_fn`` averages over for the
#: targets ``y`` of one step: an int, or an integer tensor of one element.
Items = Callable[[Any], "int | torch.Tensor"]


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward's arguments, in order, through tuples, lists, mappings (dicts,
    Hugging Face's ``BatchEncoding``) and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from _tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, field.name))


def _sample_list(value: Any, others: list[Any]) -> bool:
    """Whether ``value`` is a list of samples: a list or tuple of tensors (or dicts of them)
    beside another argument of as many entries (torchvision's detection models: a list of
    images and a list of their targets; a loader's batch of sequences and a tensor of their
    labels), or whose tensors differ in shape (images of several sizes)."""
    if not isinstance(value, (list, tuple)) or not value or isinstance(value, PackedSequence):
        return False
    if not all(isinstance(x, (torch.Tensor, Mapping)) for x in value):
        return False
    partnered = any(
        o is not value
        and (
            (isinstance(o, (list, tuple)) and len(o) == len(value))
            or (isinstance(o, torch.Tensor) and o.dim() > 0 and o.size(0) == len(value))
        )
        for o in others
    )
    shapes = {tuple(x.shape) for x in value if isinstance(x, torch.Tensor)}
    if not partnered and len(shapes) == 1 and len(value) > 1:
        first = next(x for x in value if isinstance(x, torch.Tensor))
        if first.dim() > 0 and first.size(0) != len(value):
            warnings.warn(
                f"hetcoll: a list of {len(value)} tensors of one shape {tuple(first.shape)} is "
                f"read as inputs, its samples counted along their dimension 0 "
                f"({first.size(0)}); if the list holds the samples (sequences of one length), "
                "weigh by items= (counting the step's targets) or set the local batch",
                stacklevel=4,
            )
    return partnered or len(shapes) > 1


def batch_size(args: tuple, kwargs: dict, batch_dim: int = 0) -> int | None:
    """The samples a forward's arguments hold (``args`` positional, ``kwargs`` keyword; None
    where none tells): the first argument that holds tensors decides, in order. A list of
    samples (:func:`_sample_list`: torchvision's detection models take a list of images and a
    list of their targets) holds as many as it has entries, a ``PackedSequence`` its
    sequences; any other, dimension ``batch_dim`` of its first tensor (through tuples, lists,
    mappings and dataclasses) that has it, the convention of PyTorch's DataLoader and DDP.

    >>> batch_size((torch.zeros(5, 3),), {})
    5
    >>> batch_size(([torch.zeros(3, 8, 8)] * 2, [{"boxes": torch.zeros(1, 4)}] * 2), {})
    2
    """
    values = [*args, *kwargs.values()]
    for v in values:
        if isinstance(v, PackedSequence):
            return int(v.batch_sizes[0]) if v.batch_sizes.numel() else 0
        if _sample_list(v, values):
            return len(v)
        for t in _tensors(v):
            if t.dim() > batch_dim:
                return int(t.size(batch_dim))  # size(): nested tensors have no shape
    return None


def loader_batch_size(batch: Any) -> int | None:
    """The samples of a DataLoader's batch, its entries read as a forward's arguments
    (:func:`batch_size`): a tuple or list of them, a dict of them, or one tensor.

    >>> loader_batch_size((torch.zeros(4, 3), torch.zeros(4)))
    4
    """
    if isinstance(batch, (list, tuple)):
        return batch_size(tuple(batch), {})
    if isinstance(batch, dict):
        return batch_size((), batch)
    return batch_size((batch,), {})


def loader_rows(batch: Any, argument: str) -> int:
    """:func:`loader_batch_size`, where a batch must be counted (a rebalancer's samples, the
    hook's local batch): ``TypeError`` naming ``argument`` where it holds nothing to count."""
    n = loader_batch_size(batch)
    if n is None:
        raise TypeError(
            f"{argument}: cannot count this batch's samples: it holds no tensor with a batch "
            "dimension"
        )
    return n


class BatchCounter:
    """Counts the samples of ``module``'s forwards since the last :meth:`take`.

    A forward's batch size is :func:`batch_size` of its arguments: dimension ``batch_dim`` of
    the first tensor among them (positional first, then keyword; through tuples, lists and
    dicts), the convention of PyTorch's DataLoader and DDP, or the length of a list of samples
    (torchvision's detection models: a list of images beside a list of their targets).
    Forwards run with gradients disabled (evaluation), or of a module none of whose parameters
    requires a gradient (a discriminator frozen for the generator's step), are not counted: no
    gradient of theirs is exchanged. A forward in ``eval()`` mode with gradients enabled counts
    once a backward reaches its output: a model trained in eval mode counts its samples, a
    validation forward run without ``torch.no_grad()`` does not (its samples would weigh the
    next step). With ``reached=True`` each training forward also notes when a backward has
    reached its output, for :meth:`discard_reached`.
    """

    def __init__(self, module: nn.Module, *, batch_dim: int = 0, reached: bool = False) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
            raise ValueError(f"batch_dim: must be an integer >= 0, got {batch_dim!r}")
        check_flag(reached, "reached")
        self.batch_dim = batch_dim
        self._count = 0
        self._forwards = 0
        self._track = reached
        self._pending: _Forward | None = None  # the running forward's record, until it returns
        self._records: list[_Forward] = []  # the forwards since the last take that hooks watch
        self._handles = (
            module.register_forward_pre_hook(self._see, with_kwargs=True),
            module.register_forward_hook(self._seen, with_kwargs=True),
        )
        # Until a forward is counted: torch's sequence-first layers (batch_first=False)
        # watched, in case dimension 0 of the input is their sequence (a count of steps).
        self._counted: int | None = None
        self._orders = [
            m.register_forward_pre_hook(functools.partial(self._check_order, name))
            for name, m in module.named_modules()
            if batch_dim == 0 and sequence_first(m)
        ]

    def _see(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or not any(p.requires_grad for p in module.parameters()):
            return
        n = batch_size(args, kwargs, self.batch_dim)
        if n is None:
            raise TypeError(
                f"module: cannot count this forward's samples: no tensor argument has "
                f"dimension {self.batch_dim} (batch_dim); set the local batch yourself instead"
            )
        if module.training:
            self._add(n)
            if self._track:
                self._pending = _Forward(self, n, counted=True)
        else:  # counted once a backward reaches the output (:meth:`_seen`)
            self._pending = _Forward(self, n, counted=False)
        self._counted = n

    def _check_order(self, name: str, module: nn.Module, args: tuple) -> None:
        x = next(_tensors(args), None)
        n = self._counted
        if n is not None and x is not None and x.dim() >= 2 and x.shape[0] == n != x.shape[1]:
            warnings.warn(
                f"BatchCounter: {repr(name) if name else 'the model'} "
                f"({type(module).__name__}, batch_first=False) reads "
                f"dimension 0 of its input as the sequence, and this forward's samples were "
                f"counted along dimension 0 ({n}): pass batch_dim=1 (register_weighted_hook, "
                "DistributedOptimizer) for sequence-first inputs, or set the local batch",
                stacklevel=2,
            )
            self._stop_checking()

    def _stop_checking(self) -> None:
        for handle in self._orders:
            handle.remove()
        self._orders = []

    def _seen(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._counted is not None and self._orders:  # one counted forward was looked at
            self._stop_checking()
        forward, self._pending = self._pending, None
        if forward is None:
            return
        outputs = [t for t in _tensors(output) if t.requires_grad]
        if not outputs:
            return  # nothing a backward could reach
        self._records.append(forward)
        for t in outputs:
            t.register_hook(forward.reached)

    def _add(self, n: int, forwards: int = 1) -> None:
        self._count += n
        self._forwards += forwards

    def claim_unreached(self) -> None:
        """Count the eval-mode forwards no backward has reached yet, as if one had: for a
        caller weighing a loss before its backward (:meth:`WeightedAllreduceState.weigh`)."""
        for forward in list(self._records):
            if not forward.counted:
                forward.reached()

    def discard_reached(self) -> None:
        """Drop the counted forwards a backward has reached (``reached=True``): their
        gradients were zeroed (``zero_grad``) before any exchange took the count (a model's
        forward in another model's step, as a GAN's discriminator's in the generator's). Those
        whose backward is still to come (``zero_grad`` between a forward and its backward)
        stay counted."""
        for forward in [f for f in self._records if f.done and f.counted]:
            self._add(-forward.n, -1)
            forward.counter = None
            self._records.remove(forward)

    @property
    def pending(self) -> int:
        """Samples counted since the last :meth:`take`."""
        return self._count

    @property
    def forwards(self) -> int:
        """Forwards counted since the last :meth:`take` (a forward may hold no sample)."""
        return self._forwards

    def take(self) -> int:
        """The samples counted since the last call, and start counting again. Raises
        ``RuntimeError`` when no training forward ran in between (the exchange would weigh this
        rank's gradient by a stale count)."""
        if self._forwards == 0:
            raise RuntimeError(
                "local_batch: the module ran no forward with gradients enabled since the last "
                "gradient exchange, so this step's samples are unknown; run the forward through "
                "the module the counter watches (the DDP model, or the model given to "
                "DistributedOptimizer), or set local_batch yourself"
            )
        n = self._count
        self.discard()
        return n

    def discard(self) -> None:
        """Start counting again, the samples counted so far dropped (a step whose count was
        set by hand)."""
        self._count = 0
        self._forwards = 0
        for forward in self._records:  # a backward reaching them later counts nothing
            forward.counter = None
        self._records.clear()

    def remove(self) -> None:
        """Stop counting (removes the forward hooks)."""
        for handle in self._handles:
            handle.remove()
        self._stop_checking()


def sequence_first(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch's layers reading its input sequence-first by its own
    setting (``batch_first=False``, their default): RNNs and transformers."""
    if isinstance(module, (nn.RNNBase, nn.Transformer)):
        return not module.batch_first
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return not module.self_attn.batch_first
    return False


class _Forward:
    """One forward of ``n`` samples whose output hooks watch for a backward, marked ``done``
    when the first one reaches it: one in eval mode is counted then."""

    def __init__(self, counter: BatchCounter, n: int, *, counted: bool) -> None:
        self.counter: BatchCounter | None = counter
        self.n = n
        self.counted = counted
        self.done = False

    def reached(self, grad: torch.Tensor | None = None) -> None:
        if self.done or self.counter is None:  # once; or after its count was taken
            return
        self.done = True
        if not self.counted:  # an eval-mode forward: counted now
            self.counted = True
            self.counter._add(self.n)


def local_batch_value(n: object) -> int:
    """A rank's sample count for one step, checked as every count is (:func:`checked_count`):
    an integer >= 0."""
    mine = checked_count(n, "")
    if mine.status != COUNTED:
        raise ValueError(f"local_batch: must be an integer >= 0, got {n!r}")
    return mine.value


def items_argument(items: object) -> Items | None:
    """``items`` checked: None (weigh by rows) or a callable ``items(y) -> int``."""
    if items is not None and not callable(items):
        raise TypeError(
            "items: must be a function items(y) -> int counting what loss_fn averages over "
            f"(e.g. lambda y: int((y != -100).sum())), or None for rows; got {type(items).__name__}"
        )
    return items


# -- the weight rule -------------------------------------------------------------------------------

#: A rank's count as exchanged, ``(status, value)`` (two int64, so it rides in
#: :func:`hetcoll.comm.agree`'s per-rank values): ``COUNTED`` with the count, or why there is
#: none. ``NOT_INTEGER`` carries the float64 bits of the value (every rank can print it);
#: ``TWICE`` (a step weighed twice) the index in :data:`TWICE_CALLS` of the call repeated.
COUNTED, NEGATIVE, NOT_INTEGER, NOT_A_NUMBER, RAISED, TOO_LARGE, NOT_COUNTED, TWICE = range(8)
#: The calls that weigh a step once, as ``TWICE`` names them.
TWICE_CALLS = ("state.weigh(loss)", "opt.synchronize()")
#: Counts travel as float64 weights too: beyond 2**53 they would no longer be exact.
MAX_ITEMS = 1 << 53


class LocalCount(NamedTuple):
    """This rank's count for one step, as :func:`item_weights` reads it: ``status`` and
    ``value`` (see :data:`COUNTED`), and ``failure``, this rank's own error when the status is
    not ``COUNTED`` (raised from the error every rank raises, so its details are not lost)."""

    status: int
    value: int
    failure: BaseException | None = None

    @property
    def exchanged(self) -> list[int]:
        """The two integers every rank sends."""
        return [self.status, self.value]


def counted(n: int) -> LocalCount:
    """A count known to be valid (rows counted by hetcoll, a checked ``local_batch``)."""
    return LocalCount(COUNTED, int(n))


def not_counted(argument: str, why: str) -> LocalCount:
    """No count for this step on this rank (nothing was counted since the last exchange)."""
    return LocalCount(NOT_COUNTED, 0, RuntimeError(f"{argument}: {why}"))


def called_twice(argument: str, call: str) -> LocalCount:
    """``call`` (one of :data:`TWICE_CALLS`) made a second time for one step on this rank: the
    step's count was taken already."""
    return LocalCount(TWICE, TWICE_CALLS.index(call), RuntimeError(f"{argument}: {_twice(call)}"))


def _twice(call: str) -> str:
    """What a ``TWICE`` count says: ``call`` repeated, and what to do instead."""
    once = (
        "weigh the forward's whole loss once (sum its terms first)"
        if call == TWICE_CALLS[0]
        else "the step() after it averages no more"
    )
    return f"{call} was called twice for one step (its count was taken already); {once}"


def count_items(items: Items, y: Any) -> LocalCount:
    """``items(y)`` for this rank's targets, checked but never raised: a bad count is carried to
    the exchange, where every rank raises (:func:`item_weights`). An integer >= 0 (an ``int``,
    a numpy integer or an integer tensor of one element); bool is refused."""
    return count_items_of(items, [y])[0]


def count_items_of(items: Items, ys: Sequence[Any]) -> list[LocalCount]:
    """:func:`count_items` of each of ``ys`` (the targets of a step's micro-batches), with the
    counts ``items`` returns as integer tensors on a device (a GPU's) read from it together,
    in one transfer a device: each read makes the host wait for the device, and read one by
    one they would wait once a micro-batch."""
    values: list[Any] = []
    failures: dict[int, Exception] = {}
    for k, y in enumerate(ys):
        try:
            values.append(items(y))
        except Exception as e:
            values.append(None)
            failures[k] = e
    read = list(values)
    on_device: dict[torch.device, list[int]] = {}  # each device's counts, by micro-batch
    for k, v in enumerate(values):
        if (
            isinstance(v, torch.Tensor)
            and v.device.type != "cpu"
            and v.numel() == 1
            and not (v.is_floating_point() or v.is_complex() or v.dtype == torch.bool)
        ):
            on_device.setdefault(v.device, []).append(k)
    for ks in on_device.values():
        # Integers of any width as int64, exactly; the checks below then see Python ints. One
        # count (a data-parallel rank's step) is read as it is: stacking it would copy it.
        both = (
            [int(values[ks[0]])]
            if len(ks) == 1
            else torch.stack([values[k].reshape(()).to(torch.int64) for k in ks]).tolist()
        )
        for k, n in zip(ks, both):
            read[k] = n
    read_from = {k for ks in on_device.values() for k in ks}
    return [
        LocalCount(RAISED, 0, failures[k])
        if k in failures
        else checked_count(n, functools.partial(_returned, v, n, k in read_from))
        for k, (v, n) in enumerate(zip(values, read))
    ]


def _returned(value: Any, n: int, read: bool) -> str:
    """The error of a bad count ``items(y)`` returned: ``value``, or where it is a device's
    tensor ``read`` as ``n``, its repr made from that number (torch's repr would read the device
    again)."""
    if read:
        dtype = "" if value.dtype == torch.int64 else f", dtype={value.dtype}"
        number = "[" * value.dim() + str(n) + "]" * value.dim()
        said = f"tensor({number}, device='{value.device}'{dtype})"
    else:
        said = shown(value)
    return f"items: items(y) returned {said}; it must return an integer >= 0"


def checked_count(value: Any, what: str | Callable[[], str]) -> LocalCount:
    """``value`` as this rank's count, checked but never raised (:func:`count_items`); ``what``:
    this rank's own error message where it is no integer >= 0 below 2**53, or a function making
    it (called only then: a message echoing a value costs its repr on every good count). A bool
    (Python's, numpy's or a bool tensor) is no count; a numpy array of one integer is one."""

    def said() -> str:
        return what() if callable(what) else what

    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(())[()]  # its one number, a numpy scalar
    if isinstance(value, (bool, np.bool_)) or (
        isinstance(value, torch.Tensor) and value.dtype == torch.bool
    ):
        return LocalCount(NOT_A_NUMBER, 0, TypeError(said()))
    if hasattr(value, "__index__"):
        try:
            n = int(value.__index__())
        except (TypeError, RuntimeError):  # a tensor of several elements, a float tensor
            n = None
        if n is not None:
            if n < 0:
                return LocalCount(NEGATIVE, max(n, -(1 << 63)), ValueError(said()))
            if n >= MAX_ITEMS:
                return LocalCount(TOO_LARGE, 0, ValueError(f"{said()} below 2**53"))
            return LocalCount(COUNTED, n)
    f = None
    if isinstance(value, (numbers.Real, np.generic, torch.Tensor)) and not isinstance(value, bool):
        with contextlib.suppress(TypeError, ValueError, RuntimeError):  # several elements
            f = float(value)
    if f is None:  # a str, a bool, a list...
        return LocalCount(NOT_A_NUMBER, 0, TypeError(said()))
    bits = int(np.array(f, np.float64).view(np.int64))
    return LocalCount(NOT_INTEGER, bits, ValueError(said()))


def added_count(earlier: LocalCount | None, count: LocalCount) -> LocalCount:
    """A step's count after another micro-batch's ``count``: the sum (counts of micro-batches
    whose gradients accumulate into one step, under DDP's ``no_sync``), or the first problem."""
    if earlier is None or earlier.status != COUNTED:
        return count if earlier is None else earlier
    if count.status != COUNTED:
        return count
    if earlier.value + count.value >= MAX_ITEMS:
        return LocalCount(TOO_LARGE, 0, ValueError("items: the step's items must be below 2**53"))
    return counted(earlier.value + count.value)


def added_counts(
    earlier: np.ndarray | None, counts: np.ndarray, failure: BaseException | None
) -> np.ndarray:
    """Every rank's step count after another exchange of micro-batch ``counts`` (``(ranks, 2)``
    as :func:`item_weights` reads them): each checked as there (raising the same errors on every
    rank) but for a total of 0, which one micro-batch may have; then summed per rank."""
    counts = _checked(counts, "items", failure)
    if earlier is None:
        return counts.copy()
    out = earlier.copy()
    out[:, 1] += counts[:, 1]
    return out


def _checked(counts: Any, argument: str, failure: BaseException | None) -> np.ndarray:
    """``counts`` as ``(ranks, 2)`` int64, raising (the same on every rank) for the first rank
    whose count has a problem."""
    try:
        counts = np.asarray(counts, np.int64).reshape(-1, 2)
    except (TypeError, ValueError):
        raise TypeError(
            f"counts: must be the (ranks, 2) integers of every rank's LocalCount, got {counts!r}"
        ) from None
    total = 0
    for rank, (status, value) in enumerate(counts.tolist()):
        # A count given as counted is checked as LocalCount checks one: a caller's own array
        # may hold a negative count, or counts whose int64 sum wraps around.
        if status == COUNTED and value < 0:
            status = NEGATIVE
        elif status == COUNTED and value >= MAX_ITEMS:
            status = TOO_LARGE
        if status != COUNTED:
            raise _problem(argument, rank, status, value) from failure
        total += value
    if total >= MAX_ITEMS:
        raise ValueError(
            f"{argument}: the ranks counted {total} items for this step together, 2**53 or more"
        )
    return counts


def _problem(argument: str, rank: int, status: int, value: int) -> BaseException:
    """The error every rank raises for ``rank``'s bad count (the same text on every rank)."""
    counted_by = "items(y)" if argument == "items" else argument
    if status == NOT_COUNTED:
        fix = (
            "count each step's targets (state.count(y) / opt.count(y)) on every rank"
            if argument == "items"
            else "run the step's forward (with gradients) through the model the counter watches"
        )
        return RuntimeError(f"{argument}: rank {rank} counted nothing for this step; {fix}")
    if status == TWICE:
        call = TWICE_CALLS[value] if 0 <= value < len(TWICE_CALLS) else "a weighing call"
        return RuntimeError(f"{argument}: on rank {rank}, {_twice(call)}")
    if status == RAISED:
        return ValueError(f"{argument}: {counted_by} raised an exception on rank {rank}")
    if status == NEGATIVE:
        got = str(value)
    elif status == NOT_INTEGER:
        got = repr(float(np.array(value, np.int64).view(np.float64)))
    elif status == TOO_LARGE:
        got = "2**53 or more"
    else:
        got = "something that is not a number"
    return ValueError(
        f"{argument}: rank {rank} counted {got} for this step; {counted_by} must be an integer "
        ">= 0 (what the loss averages over)"
    )


def counted_rows(counts: Any) -> np.ndarray:
    """Every rank's valid count (rows counted by hetcoll, exchanged as numbers) as
    :func:`item_weights` reads them."""
    n = np.asarray(counts, np.float64).reshape(-1)
    return np.stack([np.full(n.shape, COUNTED, np.int64), n.astype(np.int64)], axis=1)


def item_total(
    counts: np.ndarray, argument: str = "items", failure: BaseException | None = None
) -> int:
    """``N = sum_r n_r``, the denominator of :func:`item_weights` (which see), checked alike:
    for a sum formed after the ranks' scaled gradients were reduced."""
    counts = _checked(counts, argument, failure)
    total = int(counts[:, 1].sum())
    if total <= 0:
        unit = {"items": "items", "local_batch": "samples"}.get(argument, "")
        raise ValueError(
            f"{argument}: every rank counted 0{' ' + unit if unit else ''} for this step; the "
            "global batch has nothing to average over"
        )
    return total


def item_weights(
    counts: np.ndarray, argument: str = "items", failure: BaseException | None = None
) -> np.ndarray:
    """Every rank's weight for one step from every rank's count, the one rule of hetcoll's
    weighted averaging: ``w_r = n_r / N`` with ``N = sum_r n_r``, so that ``sum_r w_r g_r`` is the
    gradient of the mean over all ``N`` items of the global batch when each rank's loss is the
    mean over its own ``n_r``. A rank with ``n_r = 0`` is legal and weighs 0: it contributes
    nothing (send zeros, not ``0 * g_r``: its loss, a mean over nothing, may be NaN).

    ``counts``: the ``(ranks, 2)`` integers of every rank's :class:`LocalCount`, in rank order,
    the same on every rank, so every rank raises the same error: ``ValueError`` naming
    ``argument`` for a bad count (the first such rank) or a global total of 0, ``RuntimeError``
    for a rank that counted nothing. ``failure``: this rank's own error, chained.
    """
    total = item_total(counts, argument, failure)
    return np.asarray(counts, np.int64).reshape(-1, 2)[:, 1].astype(np.float64) / float(total)
