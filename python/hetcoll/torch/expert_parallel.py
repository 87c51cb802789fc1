"""Expert parallelism over data-parallel ranks of unequal speed: each rank holds whole experts
of every mixture-of-experts layer, as many as its speed (and the experts' measured loads) call
for, and trains on its own share of the batch; every token its router sends to an expert
travels to that expert's rank and back (two all-to-alls forward, two backward), so the
experts' weights are held once across the group, not once per rank.

The model learns what one process would on the whole batch. Data-parallel averaging weighs
rank r's gradient by ``w_r = n_r / sum(n)`` (its share of the items the losses average over:
:func:`hetcoll.torch.register_weighted_hook`, :class:`hetcoll.torch.DistributedOptimizer`);
an expert's gradient sums the gradients of every rank's tokens, so the rows coming from rank r
are weighed by ``w_r`` on the expert's rank in the backward, and the input gradients going back
are divided by it again. Each forward exchanges the ranks' ``n_r`` with the token counts.

Which modules: Hugging Face's experts modules (``use_experts_implementation``: every
expert's weights stacked along dimension 0 of 3-D parameters, called as
``experts(hidden_states, top_k_index, top_k_weights)``), whatever their layout (gated or not,
transposed, biased, a norm of each expert's output). A rank's slice is the module's own class
holding fewer experts, run with the module's own forward and kernel (``eager``,
``batched_mm``, ``grouped_mm``) on the tokens it receives.
"""

from __future__ import annotations

import math
import numbers
import types
import weakref
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

import hetcoll
from hetcoll.collectives.autograd import disable_pending, exchanging
from hetcoll.comm import Communicator, agree, deadline, wrap
from hetcoll.plan import MAX_EXPERTS, expert_indices, expert_runs
from hetcoll.torch.filters.chains import inside_unknown_adapters, stacked_adapters
from hetcoll.torch.filters.checks import check_module
from hetcoll.torch.filters.experts import LocalExperts, derived_class, experts_flags
from hetcoll.torch.filters.layers import ChannelSplit
from hetcoll.torch.filters.shards import guard_save_pretrained, track_optimizers
from hetcoll.torch.replaced import record_replaced
from hetcoll.torch.step_timer import StepTimer
from hetcoll.torch.transport import CountingCommunicator, transport

#: A rank's weight in the step's gradient average: a function of nothing, called at each
#: forward of an expert-parallel layer (None: the rows of that layer's input, its tokens).
Weight = Callable[[], float]

#: One experts layer's experts per rank, in rank order: counts (rank r holds the next
#: ``counts[r]`` experts in expert order) or each rank's expert indices (any experts).
Held = Sequence[int] | Sequence[Sequence[int]]
#: Experts per rank: one placement (:data:`Held`) for every experts layer, or a dict by
#: experts module name.
Shares = Held | Mapping[str, Held]
#: Each rank's expert indices (ascending), by experts module name: what a placement returns.
Placement = dict[str, list[list[int]]]
#: Each expert's routed tokens: one list for every experts layer, or a dict by module name.
Loads = Sequence[float] | Mapping[str, Sequence[float]]

#: Codes of the dtypes the ranks' tokens may carry (exchanged to check that the ranks agree).
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

#: How the data-parallel step combines the ranks' gradients: ``"average"`` weighs rank r's by
#: its share of the batch (DDP with hetcoll's weighted hook, DistributedOptimizer);
#: ``"sum"`` adds them, each rank's loss already scaled by its share (parallelize's replicas);
#: ``"mean"`` averages them alike (DDP's own hook), each rank's loss already scaled by its
#: share times the number of ranks (Hugging Face Trainer's ``num_items_in_batch``).
COMBINE = ("average", "sum", "mean")

#: Fields of the counts every forward exchanges, per destination rank; then the rows it sends
#: to each of that rank's experts.
_WEIGHT, _FEATURES, _DTYPE, _BAD, _FIELDS = range(5)


def experts_module(m: nn.Module) -> str | None:
    """Why ``m`` cannot be placed by whole experts ("" where it can), or None where it holds
    no experts: an experts module has an int ``num_experts`` and 3-D parameters; it must carry
    Hugging Face's ``use_experts_implementation`` flags (its forward is then
    ``experts(hidden_states, top_k_index, top_k_weights)``) and hold every parameter stacked
    by expert (dimension 0 of length ``num_experts``)."""
    experts = getattr(m, "num_experts", None)
    if not isinstance(experts, int) or not any(p.dim() == 3 for p in m.parameters(False)):
        return None
    if isinstance(m, ExpertParallelExperts):
        return None
    flags = experts_flags(m)
    if isinstance(flags, str):
        return flags
    odd = [n for n, p in m.named_parameters() if p.dim() < 1 or p.shape[0] != experts]
    if odd:
        return f"it holds parameters not stacked by expert (dimension 0 of {experts}): {odd}"
    if list(m.buffers()):
        return "it holds buffers, which no rule here places by expert"
    return ""


def _check_experts(num_experts: object) -> int:
    """``num_experts``, an int in ``[1, MAX_EXPERTS]``; ``ValueError`` naming it otherwise."""
    if (
        isinstance(num_experts, bool)
        or not isinstance(num_experts, (int, np.integer))
        or not 1 <= num_experts <= MAX_EXPERTS
    ):
        raise ValueError(
            f"num_experts: must be an int >= 1 and <= {MAX_EXPERTS} (MAX_EXPERTS), "
            f"got {num_experts!r}"
        )
    return int(num_experts)


def _numbers(value: object, name: str) -> list[float]:
    """``value`` as a list of floats (a sequence of numbers); ``ValueError`` naming ``name``
    (and the entry) where it is none."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"{name}: must be a list of numbers, got {type(value).__name__}")
    out = []
    for i, x in enumerate(value):
        try:
            if isinstance(x, (bool, np.bool_, str, bytes)):
                raise TypeError
            out.append(float(x))
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{name}[{i}]: must be a number, got {x!r}") from None
    return out


def _check_capacity(capacity: object, ranks: int, of: str = "rank") -> list[int] | None:
    """``capacity`` (None, or the most experts each of ``ranks`` ranks may hold: one int >= 0
    and < 2**64 each, numpy's too) as a list, read once (a generator is not used up by a
    first pass); ``ValueError`` naming it otherwise (a dict's keys were once read as the
    list, and 2**70 passed where the loads went and failed where they did not)."""
    if capacity is None:
        return None
    if isinstance(capacity, (str, bytes, Mapping)) or not isinstance(capacity, Iterable):
        raise ValueError(f"capacity: needs one int >= 0 per {of} ({ranks}), got {capacity!r}")
    values = list(capacity)
    if len(values) != ranks or any(
        isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0 for c in values
    ):
        raise ValueError(f"capacity: needs one int >= 0 per {of} ({ranks}), got {values}")
    for i, c in enumerate(values):
        if c >= 2**64:  # the Rust layer's counts, as hetcoll.split says it
            raise ValueError(f"capacity[{i}]: must be < 2**64, got {c}")
    return [int(c) for c in values]


def _check_gap(gap: object) -> float:
    """``gap``, a finite number >= 0 (:func:`hetcoll.partition_items`'); ``ValueError`` naming
    it otherwise."""
    if isinstance(gap, bool) or not isinstance(gap, numbers.Real):
        raise ValueError(f"gap: must be a number, got {gap!r}")
    try:
        g = float(gap)
    except OverflowError:  # an int beyond floats
        g = math.inf
    if not (math.isfinite(g) and g >= 0):
        raise ValueError(f"gap: must be finite and >= 0, got {gap!r}")
    return g


def expert_shares(
    num_experts: int,
    speeds: Sequence[float],
    *,
    loads: Sequence[float] | None = None,
    capacity: Sequence[int] | None = None,
) -> list[int]:
    """Experts per rank, in rank order (rank r holds the next ``shares[r]`` experts).

    Without ``loads`` every expert counts alike: :func:`hetcoll.split` of ``num_experts`` by
    ``speeds`` (a rank may get none). With ``loads`` (each expert's work: the tokens routed to
    it, :func:`expert_loads`) the experts are cut into contiguous runs whose load over the
    rank's speed is smallest at the slowest rank (:func:`hetcoll.partition_chain`, exact).
    ``capacity``: the most experts each rank may hold (what its memory fits); a request none
    fits raises ``ValueError``, as does bad input (naming the argument: ``num_experts`` is an
    int from 1 to :data:`MAX_EXPERTS`, ``speeds`` and ``loads`` lists of numbers, the loads'
    sum a double, ``capacity`` one int >= 0 and < 2**64 per rank).

    >>> expert_shares(8, [3.0, 1.0])
    [6, 2]
    >>> expert_shares(4, [1.0, 1.0], loads=[3.0, 1.0, 1.0, 1.0])
    [1, 3]
    >>> expert_shares(4, [9.0, 1.0], capacity=[2, 4])
    [2, 2]
    """
    num_experts = _check_experts(num_experts)
    speeds = _numbers(speeds, "speeds")
    capacity = _check_capacity(capacity, len(speeds))
    if loads is None:
        return [int(n) for n in hetcoll.split(num_experts, speeds, capacity=capacity)]
    loads = _numbers(loads, "loads")
    if len(loads) != num_experts:
        raise ValueError(f"loads: needs one entry per expert ({num_experts}), got {len(loads)}")
    if any(not math.isfinite(x) or x < 0 for x in loads):
        raise ValueError(f"loads: must be finite and >= 0, got {loads}")
    if not math.isfinite(_running_sum(loads)):  # the Rust layer's check, under its own name
        raise ValueError("loads: their sum overflows a double")
    if capacity is None:
        return [int(n) for n in hetcoll.partition_chain(loads, speeds)]
    # partition_chain bounds bytes: each expert weighs one, each rank holds its capacity.
    return [
        int(n)
        for n in hetcoll.partition_chain(
            loads, speeds, memory=[1.0] * num_experts, capacity=[float(c) for c in capacity]
        )
    ]


def _running_sum(values: Sequence[float]) -> float:
    """``values`` added one after another, as the Rust layer adds them (Python's ``sum`` of
    floats compensates, and could differ from it at the edge of a double's range)."""
    total = 0.0
    for x in values:
        total += x
    return total


def expert_assignment(
    num_experts: int,
    speeds: Sequence[float],
    *,
    loads: Sequence[float] | None = None,
    capacity: Sequence[int] | None = None,
    current: Sequence[Sequence[int]] | None = None,
    gap: float = 0.0,
) -> list[list[int]]:
    """Each rank's experts (their indices, ascending), in rank order: any experts on any rank.

    Without ``loads`` every expert counts alike and the runs of :func:`expert_shares` are as
    good as any (``[[0, 1, 2, 3, 4, 5], [6, 7]]`` for 8 experts at 3:1). With ``loads`` (each
    expert's routed tokens: :func:`expert_loads`) the experts go where the slowest rank's
    tokens over its speed are fewest, whichever experts those are
    (:func:`hetcoll.partition_items`, exact within its search budget; never worse than the
    best contiguous runs, which it keeps on a tie): two hot experts side by side are parted,
    which no cut into runs can do. ``capacity``: the most experts each rank may hold; a
    request none fits raises ``ValueError``. ``current``: the placement now (each rank's
    expert indices); ranks of the same speed and capacity are interchangeable, so their
    sets are handed out to keep as many experts where they are as they can (fewer move).
    ``gap``: content with a placement within that fraction of the best (``partition_items``'
    ``gap``, finite and >= 0: a search that would spend its budget proving the last fraction
    of a percent ends at once). Bad input raises ``ValueError`` naming the argument (as
    :func:`expert_shares`; ``current`` must name each expert once, one entry per rank).

    >>> expert_assignment(4, [1.0, 1.0], loads=[5.0, 5.0, 1.0, 1.0])
    [[0, 2], [1, 3]]
    >>> expert_assignment(4, [3.0, 1.0])
    [[0, 1, 2], [3]]
    """
    num_experts = _check_experts(num_experts)
    speeds = _numbers(speeds, "speeds")
    gap = _check_gap(gap)
    now = None
    if current is not None:
        now = expert_indices(current, len(speeds), "current", experts=num_experts, of="rank")
    load = None if loads is None else _numbers(loads, "loads")
    capacity = _check_capacity(capacity, len(speeds))  # once: partition_items reads it again
    runs = expert_shares(num_experts, speeds, loads=load, capacity=capacity)
    contiguous = [list(held) for held in expert_indices(runs, len(runs), "shares")]
    if load is None:
        return contiguous
    owner, _ = hetcoll.partition_items(load, speeds, capacity=capacity, gap=gap)
    anywhere = [[e for e in range(num_experts) if owner[e] == r] for r in range(len(runs))]
    best = anywhere
    if assignment_seconds(contiguous, load, speeds) <= assignment_seconds(anywhere, load, speeds):
        best = contiguous
    if now is None:
        return best
    return _least_moved(best, now, speeds, capacity)


def _least_moved(
    placement: list[list[int]],
    current: Sequence[Sequence[int]],
    speeds: Sequence[float],
    capacity: Sequence[int] | None,
) -> list[list[int]]:
    """``placement`` with the sets of interchangeable ranks (the same speed and capacity)
    handed out again, each set to the rank of its kind that holds most of it now (the
    largest overlaps first; ties to the lower rank, then the lower set), so that fewer
    experts move and the time is the same."""
    if len(current) != len(placement):
        raise ValueError(
            f"current: needs one entry per rank ({len(placement)}), got {len(current)}"
        )
    now = [set(held) for held in current]
    out = [list(held) for held in placement]
    kinds: dict[tuple[float, int | None], list[int]] = {}
    for r, s in enumerate(speeds):
        kinds.setdefault((float(s), None if capacity is None else int(capacity[r])), []).append(r)
    for ranks in kinds.values():
        if len(ranks) < 2:
            continue
        pairs = sorted(
            ((len(now[r] & set(placement[k])), r, k) for r in ranks for k in ranks),
            key=lambda t: (-t[0], t[1], t[2]),
        )
        free_ranks, free_sets = set(ranks), set(ranks)
        for _, r, k in pairs:
            if r in free_ranks and k in free_sets:
                out[r] = list(placement[k])
                free_ranks.discard(r)
                free_sets.discard(k)
    return out


def assignment_seconds(
    placement: Sequence[Sequence[int]], loads: Sequence[float], speeds: Sequence[float]
) -> float:
    """One experts layer's time under ``placement`` (each rank's expert indices): the largest
    ``tokens / speed`` of any rank holding tokens (a rank of speed 0 holding tokens takes
    forever); ``loads``: each expert's tokens."""
    worst = 0.0
    for held, s in zip(placement, speeds, strict=True):
        work = float(sum(loads[e] for e in held))
        if work > 0:
            worst = max(worst, work / s if s > 0 else math.inf)
    return worst


#: The parameters holding a rank's own experts, by id (a weak reference each, so a freed
#: parameter whose id is reused is not mistaken for one).
_rank_local: dict[int, weakref.ReferenceType[torch.Tensor]] = {}


def is_rank_local(p: torch.Tensor) -> bool:
    """Whether ``p`` holds this rank's own experts (:func:`expert_parallel`): data-parallel
    averaging must leave its gradient alone."""
    if not isinstance(p, torch.Tensor):  # None once answered False
        raise TypeError(f"p: must be a tensor (a parameter), got {type(p).__name__}")
    ref = _rank_local.get(id(p))
    return ref is not None and ref() is p


def _mark_rank_local(p: torch.Tensor) -> None:
    key = id(p)
    _rank_local[key] = weakref.ref(p, lambda _: _rank_local.pop(key, None))


@exchanging
class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` sent in rank order (``send[q]`` rows to rank q), ``recv[q]`` rows received
    from each rank q; backward sends the rows' gradients back the same way
    (:func:`_exchange`)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        comm: Communicator,
        send: list[int],
        recv: list[int],
        timeout: float | None,
    ) -> torch.Tensor:
        ctx.comm, ctx.send, ctx.recv, ctx.timeout = comm, send, recv, timeout
        return _exchange(x, comm, send, recv, timeout, "activations")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        g = _exchange(grad, ctx.comm, ctx.recv, ctx.send, ctx.timeout, "gradients")
        return g, None, None, None, None


def _exchange(
    x: torch.Tensor,
    comm: Communicator,
    send: list[int],
    recv: list[int],
    timeout: float | None,
    kind: str,
) -> torch.Tensor:
    """``x``'s rows all-to-all (``send[q]`` rows to rank q, ``recv[q]`` from it), on ``x``'s
    device: NCCL's own all-to-all on its device tensors; gloo's and MPI's on host memory,
    device tensors staged there and back. A wait for the other ranks, not compute: a
    :class:`~hetcoll.torch.StepTimer` leaves it out of the step (a fast rank waits here for
    a slow one's experts)."""
    CountingCommunicator.count_as(comm, kind)
    with StepTimer.waiting():
        return _all_to_all(x, comm, send, recv, timeout)


def _all_to_all(
    x: torch.Tensor, comm: Communicator, send: list[int], recv: list[int], timeout: float | None
) -> torch.Tensor:
    if comm.engine == "nccl":
        import torch.distributed as dist

        inp = x.detach().contiguous()
        out = inp.new_empty((sum(recv), *inp.shape[1:]))
        dist.all_to_all_single(out, inp, recv, send, group=comm.native)
        return out
    host = x.detach().to("cpu", memory_format=torch.contiguous_format).contiguous()
    row = math.prod(host.shape[1:]) * host.element_size()
    out = host.new_empty((sum(recv), *host.shape[1:]))
    comm.ialltoallv(
        _bytes(host), [n * row for n in send], _bytes(out), [n * row for n in recv]
    ).wait(deadline(timeout))
    return out.to(x.device)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies each row's gradient by ``scale`` (one per row)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (scale,) = ctx.saved_tensors
        return grad * scale.to(grad.dtype).view(-1, *([1] * (grad.dim() - 1))), None


class ExpertFactor(ChannelSplit):
    """A factor of PEFT's LoRA on a parameter of experts placed by whole experts
    (``ParamWrapper``'s ``lora_A`` or ``lora_B`` layer), holding this rank's experts' blocks
    of its weight. PEFT keeps expert e's adapter in A's rows ``e r .. e r + r - 1`` and in
    B's columns ``j E + e`` (``j < r``, E experts, adapter rank r); a rank holds its own
    experts' blocks laid out the same way for its ``E'`` experts, so PEFT computes each of
    its experts' ``B A`` from them, and the state dicts gather them into the unsplit layout
    (:attr:`~hetcoll.torch.filters.layers.ChannelSplit.order`). Made by
    :func:`_place_adapters`, in place."""

    weight: nn.Parameter
    #: The weight's dimension holding the experts' blocks: 0 (A's rows) or 1 (B's columns).
    dim: int
    #: Entries per expert (the adapter's rank) and every rank's experts together.
    per_expert: int
    all_experts: int

    def split_spec(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        return {"weight": (self.dim, (1,))}

    def place(self, comm: Communicator, placement: Sequence[Sequence[int]]) -> None:
        """Hold ``placement``'s blocks (each rank's expert indices): each rank's experts'
        entries, in the order it holds them."""
        e, r = self.all_experts, self.per_expert

        def entries(held: Sequence[int]) -> list[int]:
            if self.dim == 0:
                return [x * r + i for x in held for i in range(r)]
            return [j * e + x for j in range(r) for x in held]

        self._set_split(comm, [len(held) * r for held in placement])
        self.order = tuple(i for held in placement for i in entries(held))

    def stacked(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, shaped as this rank's weight, stacked by expert along dimension 0 (a view
        for A; B's columns gathered per expert)."""
        experts = self.shares[self.rank] // self.per_expert
        if self.dim == 0:
            return t.view(experts, self.per_expert, *t.shape[1:])
        return t.view(t.shape[0], self.per_expert, experts).permute(2, 0, 1)

    def unstacked(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows stacked by expert (:meth:`stacked`) laid out as the weight holds them."""
        if self.dim == 0:
            return rows.reshape(-1, *rows.shape[2:])
        return rows.permute(1, 2, 0).reshape(rows.shape[1], -1).contiguous()

    def extra_repr(self) -> str:
        held = self.shares[self.rank] // self.per_expert
        return f"{super().extra_repr()}, experts {held} of {self.all_experts}, rank={self.rank}"  # type: ignore[misc]


def _place_adapters(
    wrapper: Any, experts: int, placement: Sequence[Sequence[int]], comm: Communicator
) -> None:
    """PEFT's LoRA ``wrapper`` on a parameter of an experts module whose ``experts`` are
    placed by ``placement``: each factor holds this rank's experts' blocks
    (:class:`ExpertFactor`), and the wrapper counts this rank's experts."""
    for dim, held in ((0, wrapper.lora_A), (1, wrapper.lora_B)):
        for a, layer in held.items():
            r = int(wrapper.r[a])
            layer.__class__ = derived_class(ExpertFactor, type(layer), "ExpertParallel")
            factor: Any = layer
            factor.dim, factor.per_expert, factor.all_experts = dim, r, experts
            factor.place(comm, placement)
            w = layer.weight
            with torch.no_grad():
                index = factor.held_index().to(w.device)
                local = nn.Parameter(w.index_select(dim, index), requires_grad=w.requires_grad)
            layer.weight = local
            _mark_rank_local(local)
    wrapper.num_experts = len(placement[comm.rank])
    wrapper.get_delta_weight = types.MethodType(_delta_weight, wrapper)


def _delta_weight(wrapper: Any, adapter_name: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """PEFT's per-expert ``scaling * B A`` of a ``ParamWrapper`` on stacked experts
    (``get_delta_weight``, its 3-D branch), the adapter's rank given rather than inferred: a
    rank holding one expert or none has it too (PEFT takes one expert for a 2-D parameter,
    and cannot infer the rank of none)."""
    a = wrapper.lora_A[adapter_name].weight
    b = wrapper.lora_B[adapter_name].weight
    experts, r = int(wrapper.num_experts), int(wrapper.r[adapter_name])
    a = a.reshape(experts, r, a.shape[-1])
    b = b.reshape(b.shape[0], r, experts)
    spec = "o r e, e r i -> e o i" if wrapper._did_swap_in_out_features else "o r e, e r i -> e i o"
    delta = torch.einsum(spec, b, a) * wrapper.scaling[adapter_name]
    param = wrapper.get_param()
    return delta.to(param.device, param.dtype)


class ExpertParallelExperts(ChannelSplit):
    """An experts module holding this rank's whole experts (``shares[rank]`` of them, from
    ``offset``): its own class and forward on its slices, between an all-to-all of the routed
    tokens to the experts' ranks and one of the experts' outputs back. Made by
    :meth:`convert`, which gives the module a class deriving from this and its own.

    ``weight`` (:data:`Weight`) gives this rank's weight in the gradient average at each
    forward; None counts the rows of the layer's input (exact where each rank's loss is a mean
    over its samples or tokens and every sample has as many tokens)."""

    timeout: float | None
    weight: Weight | None
    #: How the data-parallel step combines the ranks' gradients (:data:`COMBINE`).
    combine: str
    #: The rank's own computation on the tokens it received, between the exchanges.
    local: LocalExperts
    #: This rank's experts (the module's own count, which its forward reads).
    num_experts: int
    #: Every rank's experts together.
    all_experts: int
    #: Each rank's experts (their indices, ascending), in rank order.
    placement: tuple[tuple[int, ...], ...]
    #: Each expert's place in rank order (rank 0's experts, then rank 1's, ...).
    _position: torch.Tensor
    #: The tokens this rank's router sent to each expert (all of them, by global index) since
    #: :func:`expert_loads` last took them: what a placement by load reads.
    routed: torch.Tensor
    #: Its own parameters' names; PEFT's LoRA wrappers around it (outermost first).
    _names: tuple[str, ...]
    _wrappers: tuple[Any, ...]

    def _own(self) -> dict[str, nn.Parameter]:
        """The module's own parameters (its experts' slices)."""
        return dict(self._parameters)  # type: ignore[attr-defined]

    def split_spec(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        return {n: (0, (1,)) for n in self._own()}

    def _set_placement(self, comm: Communicator, placement: Sequence[Sequence[int]]) -> None:
        """Hold ``placement`` (each rank's expert indices, ascending): the split's shares,
        and where the rank order puts each expert (:attr:`ChannelSplit.order` where the
        experts are not runs in expert order)."""
        self.placement = tuple(tuple(int(e) for e in held) for held in placement)
        counts = [len(held) for held in self.placement]
        self._set_split(comm, counts)
        flat = [e for held in self.placement for e in held]
        self.order = None if expert_runs(self.placement) is not None else tuple(flat)
        position = torch.empty(len(flat), dtype=torch.long)
        position[torch.tensor(flat, dtype=torch.long)] = torch.arange(len(flat))
        self._position = position

    @staticmethod
    def convert(
        module: nn.Module,
        shares: Held,
        comm: Communicator,
        *,
        weight: Weight | None = None,
        combine: str = "average",
        timeout: float | None = None,
        wrappers: Sequence[nn.Module] = (),
    ) -> nn.Module:
        """``module`` (an experts module :func:`experts_module` accepts) made to hold this
        rank's experts of ``shares`` (:data:`Held`: counts, or each rank's expert indices),
        in place; returned. ``weight`` and ``combine`` as :func:`expert_parallel` takes
        them. ``wrappers``: PEFT's LoRA on its parameters around it
        (:func:`~hetcoll.torch.filters.chains.stacked_adapters`), whose factors' blocks of
        the rank's experts it holds (:class:`ExpertFactor`)."""
        why = experts_module(module)
        if why is None or why:
            raise ValueError(f"module: cannot place its experts on ranks ({why or 'no experts'})")
        experts = int(module.num_experts)  # type: ignore[arg-type]
        placement = _check_shares(shares, experts, comm.size)
        if weight is not None and not callable(weight):
            raise TypeError(f"weight: must be a function of nothing or None, got {weight!r}")
        if combine not in COMBINE:
            raise ValueError(f"combine: must be one of {COMBINE}, got {combine!r}")
        mine = torch.tensor(placement[comm.rank], dtype=torch.long)
        with torch.no_grad():
            for n, p in list(module.named_parameters(recurse=False)):
                local = nn.Parameter(
                    p.index_select(0, mine.to(p.device)), requires_grad=p.requires_grad
                )
                setattr(module, n, local)
                _mark_rank_local(local)
        names = tuple(n for n, _ in module.named_parameters(recurse=False))
        for wrapper in wrappers:
            _place_adapters(wrapper, experts, placement, comm)
        module.local = LocalExperts()
        module.__class__ = derived_class(ExpertParallelExperts, type(module), "ExpertParallel")
        ep: Any = module
        ep.num_experts, ep.all_experts = len(placement[comm.rank]), experts
        ep._set_placement(comm, placement)
        ep.timeout, ep.weight, ep.combine = timeout, weight, combine
        ep.routed = torch.zeros(experts, dtype=torch.int64)
        ep._names, ep._wrappers = names, tuple(wrappers)
        return module

    def factors(self) -> list[ExpertFactor]:
        """The factors of PEFT's LoRA around it, each holding this rank's experts' blocks."""
        return [
            f
            for w in self._wrappers
            for held in (w.lora_A, w.lora_B)
            for f in held.values()
            if isinstance(f, ExpertFactor)
        ]

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        x, index, weights = _routed(args, kwargs)
        comm, p = self.comm, self.comm.size
        tokens, top_k = index.shape
        flat = index.reshape(-1).to(torch.long)
        rows = torch.arange(tokens, device=x.device).repeat_interleave(top_k)
        experts = self.all_experts
        bad = bool(flat.numel()) and not (int(flat.min()) >= 0 and int(flat.max()) < experts)
        clamped = flat.clamp(0, experts - 1)  # in range: bad indices raise after the exchange
        # Rows sorted by their expert's place in rank order: by rank, then by the rank's own
        # expert index.
        if self._position.device != x.device:  # moved once, not at every forward
            self._position = self._position.to(x.device)
        order = torch.argsort(self._position[clamped], stable=True)
        per_expert = torch.bincount(clamped, minlength=experts).cpu()
        if not bad and not _recomputing():
            self.routed += per_expert

        # One exchange of counts: each rank's rows for each of its experts (so the rows need
        # no expert index), this rank's weight, and what the ranks must agree on (features,
        # dtype, indices in range); then every rank checks alike.
        held = self.shares
        mine = np.zeros((p, _FIELDS + max(held)), dtype=np.float64)
        counts = per_expert.numpy()
        for q in range(p):
            mine[q, _FIELDS : _FIELDS + held[q]] = counts[list(self.placement[q])]
        mine[:, _WEIGHT] = _weight_of(self.weight, tokens)
        mine[:, _FEATURES] = x.shape[-1]
        mine[:, _DTYPE] = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1
        mine[:, _BAD] = bad
        everyone = [1] * p
        got = (
            _exchange(
                torch.from_numpy(mine).to(x.device),
                comm,
                everyone,
                everyone,
                self.timeout,
                "activations",
            )
            .cpu()
            .numpy()
        )
        _check_counts(got, type(self).__name__)
        send = mine[:, _FIELDS:].sum(axis=1).astype(np.int64).tolist()
        from_each = got[:, _FIELDS : _FIELDS + held[self.rank]].astype(np.int64)
        recv = from_each.sum(axis=1).tolist()
        # Each rank's rows come sorted by expert: their experts, counted from this rank's first.
        ids = torch.repeat_interleave(
            torch.arange(held[self.rank]).repeat(p), torch.from_numpy(from_each.reshape(-1))
        ).to(x.device)
        received = _AllToAll.apply(x[rows[order]], comm, send, recv, self.timeout)
        if self.combine in ("average", "mean"):
            # The rows from rank s weigh share[s] in the experts' gradients (its share of the
            # batch; 1/p where each loss already holds it, times p); their input gradients go
            # back unweighted (rank s's own data-parallel weight applies there).
            total = float(got[:, _WEIGHT].sum())
            if self.combine == "mean":
                weights_of = np.full(p, 1.0 / p)
            elif total > 0:
                weights_of = got[:, _WEIGHT] / total
            else:
                weights_of = np.zeros(p)
            share = torch.tensor(weights_of, dtype=torch.float64)
            scale = share.repeat_interleave(torch.tensor(recv)).to(x.device)
            unscale = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
            received = _ScaleGradient.apply(received, unscale)
            out = _ScaleGradient.apply(self._experts(received, ids), scale)
        else:  # each rank's loss already weighs its rows: their gradients add up as they come
            out = self._experts(received, ids)
        back = _AllToAll.apply(out, comm, recv, send, self.timeout)
        gates = weights.reshape(-1)[order].unsqueeze(-1)
        combined = torch.zeros_like(x)
        return combined.index_add(0, rows[order], (back * gates).to(x.dtype))

    def _experts(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the rows it received (``ids``: each row's expert, counted
        from this rank's first), each row weighted 1."""
        if not len(x):
            # No rows: the experts' gradients are zeros, as one process has them, and the
            # backward still reaches the exchange that brought the rows (every rank joins it).
            # Read as the forward reads them: through PEFT's LoRA on them, where it adapts them.
            params = [getattr(self, n) for n in self._names]
            touch = sum((q.sum() * 0 for q in params), x.new_zeros(()))
            return x * 0 + touch.to(x.dtype)
        ones = x.new_ones((len(x), 1))
        out = self.local(super().forward, x, ids.unsqueeze(-1), ones)  # type: ignore[misc]
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__}: its forward returned a {type(out).__name__}, where an "
                "experts module returns one tensor"
            )
        return out

    def extra_repr(self) -> str:
        inner = super().extra_repr()  # type: ignore[misc]
        mine = list(self.placement[self.rank])
        runs = expert_runs(self.placement)
        held = f"{self.offset}..{self.offset + len(mine)}" if runs is not None else str(mine)
        return (
            f"{inner + ', ' if inner else ''}experts={held} of {self.all_experts}, "
            f"shares={self.shares}, rank={self.rank}"
        )


def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass: gradient checkpointing recomputing
    it (``torch.utils.checkpoint``, reentrant or not), whose tokens the first forward counted.
    torch's own checkpoint asks the autograd engine the same way."""
    return bool(torch._C._current_graph_task_id() != -1)


def _weight_of(weight: Weight | None, tokens: int) -> float:
    """This rank's weight in the step (``tokens`` without a ``weight`` function); -1 where
    ``weight()`` gives no finite number >= 0 or raises: the exchange goes on, and every rank
    then raises (:func:`_check_counts`), none waiting for this one."""
    if weight is None:
        return float(tokens)
    try:
        n = float(weight())  # type: ignore[arg-type]
    except Exception:  # whatever the user's function raises: reported on every rank
        return -1.0
    return n if math.isfinite(n) and n >= 0 else -1.0


def _routed(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """``(hidden_states, top_k_index, top_k_weights)`` from an experts module's call."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    if len(args) > 3 or set(kwargs) - set(names):
        raise TypeError(f"an experts module is called as experts({', '.join(names)})")
    values = dict(zip(names, args, strict=False)) | kwargs
    missing = [n for n in names if n not in values]
    if missing:
        raise TypeError(
            f"an experts module is called as experts({', '.join(names)}); {missing} missing"
        )
    x, index, weights = (values[n] for n in names)
    if not (isinstance(x, torch.Tensor) and x.dim() == 2):
        raise ValueError("hidden_states: must be a 2-D tensor (tokens, features)")
    if not (isinstance(index, torch.Tensor) and index.dim() == 2 and len(index) == len(x)):
        raise ValueError("top_k_index: must be a 2-D tensor with a row per token")
    if not (isinstance(weights, torch.Tensor) and weights.shape == index.shape):
        raise ValueError("top_k_weights: must have top_k_index's shape")
    return x, index, weights


def _check_counts(got: np.ndarray, where: str) -> None:
    """Raise, on every rank alike (each has every rank's fields), where the ranks' tokens do
    not fit together."""
    if (got[:, _BAD] != 0).any():
        ranks = np.flatnonzero(got[:, _BAD]).tolist()
        raise ValueError(f"top_k_index: ranks {ranks} route tokens to experts that do not exist")
    if (got[:, _WEIGHT] < 0).any():
        ranks = np.flatnonzero(got[:, _WEIGHT] < 0).tolist()
        raise ValueError(f"weight: on ranks {ranks}, weight() raised or gave no finite number >= 0")
    for field, name in ((_FEATURES, "features"), (_DTYPE, "dtype")):
        if len(set(got[:, field].tolist())) > 1 or got[0, field] < 0:
            raise ValueError(
                f"hidden_states: the ranks' {name} differ or are not supported "
                f"({got[:, field].tolist()}; dtypes {[str(d) for d in _DTYPES]}) in {where}"
            )


def _check_shares(
    shares: object,
    experts: int,
    ranks: int,
    where: str = "shares",
    module: str = "",
    of: str = "rank",
) -> list[list[int]]:
    """A layer's placement (:data:`Held`) of ``experts`` on ``ranks`` ranks, as each rank's
    expert indices; ``ValueError`` naming ``where`` (and the layer, ``module``) where it is
    none."""
    if isinstance(shares, np.ndarray):
        shares = shares.tolist()
    elif isinstance(shares, Sequence) and not isinstance(shares, (str, bytes)):
        shares = [v.item() if isinstance(v, np.generic) else v for v in shares]
    try:
        placed = expert_indices(shares, ranks, where, experts=experts, of=of)
    except ValueError as e:
        raise ValueError(f"{e} (experts of {module!r})" if module else str(e)) from None
    return [list(held) for held in placed]


def expert_parallel(
    model: nn.Module,
    group: Any = None,
    *,
    speeds: Sequence[float] | None = None,
    shares: Shares | None = None,
    loads: Loads | None = None,
    capacity: Sequence[int] | None = None,
    weight: Weight | None = None,
    combine: str = "average",
    timeout: float | None = None,
) -> nn.Module:
    """Place the experts of every mixture-of-experts layer of ``model`` on the ranks of
    ``group``, whole experts per rank, in place; return ``model``.

    Exactly one of ``speeds=`` (one number per rank: :func:`expert_shares`, with ``loads``
    if given: each expert's routed tokens, one list for every layer or a dict by experts
    module name, and ``capacity``, the most experts a rank holds of each layer) or
    ``shares=`` (experts per rank, in rank order: one list for every layer, or a dict by
    experts module name, as :func:`place_experts` returns them).

    Everything else stays replicated and trains data-parallel over the same ranks, each on
    its own share of the batch, with hetcoll's weighted averaging:
    ``DistributedDataParallel`` with :func:`~hetcoll.torch.register_weighted_hook` (this
    function names the experts among the parameters a DDP around ``model`` leaves alone:
    :func:`leave_to_ranks`, which a DDP around a module holding ``model`` needs called on
    that module), or
    :class:`~hetcoll.torch.DistributedOptimizer` (which skips them: :func:`is_rank_local`).
    ``weight`` must count what that averaging weighs: None counts the tokens the experts
    layer sees (right where each rank's loss is a mean over its samples or its tokens, every
    sample as long); a language model padded with ``-100`` labels weighs its valid tokens,
    ``weight=lambda: state.local_batch`` with ``state.count(y)`` called before the forward.
    ``combine="sum"`` instead where the ranks' gradients are summed, each rank's loss
    already scaled by its share of the batch (as :func:`hetcoll.torch.parallelize` runs a
    plan's replicas, whose ``experts`` place them this way): the experts' gradients then add
    every rank's rows as they come, and ``weight`` is not read. ``combine="mean"`` where DDP
    averages the ranks alike (its own hook), each rank's loss already scaled by its share
    times the number of ranks (Hugging Face Trainer's ``num_items_in_batch`` with
    ``average_tokens_across_devices``; :class:`hetcoll.accelerate.BalancedTrainer` sets it).

    The tokens travel on the group's engine: NCCL's all-to-all on the GPUs, or gloo's and
    MPI's through host memory (a CUDA rank's tokens staged there). The exchanges run on a
    group of their own, made here (collective: every rank calls this with the same arguments). A
    module holding experts in a layout this rule does not know raises ``ValueError`` naming
    it; a forward whose ranks disagree (features, dtype, experts out of range, a bad
    ``weight()``) raises the same ``ValueError`` on every rank.

    >>> model = expert_parallel(model, speeds=[1.0, 0.25])  # doctest: +SKIP
    >>> ddp = DistributedDataParallel(model)  # doctest: +SKIP
    >>> register_weighted_hook(ddp)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    disable_pending()  # what a compiled model runs of the split, never traced
    if (speeds is None) == (shares is None):
        raise TypeError("speeds: give exactly one of speeds= or shares=")
    whole = wrap(group)
    placed: Placement = {}
    failure: Exception | None = None
    try:
        placed = experts_placement(
            find_experts(model),
            whole.size,
            speeds=speeds,
            shares=shares,
            loads=loads,
            capacity=capacity,
        )
        if combine not in COMBINE:
            raise ValueError(f"combine: must be one of {COMBINE}, got {combine!r}")
        deadline(timeout)  # checked here, not at the first forward
    except (TypeError, ValueError) as e:  # raised here after the others learn of it, none waiting
        failure = e
    agree_placement(whole, placed, failure)
    # The experts' exchanges run on a group of their own where every rank can make one (the
    # default group's): data parallelism's gradient reductions (DDP's hook) run during the
    # same backward, on the user's group. On a torch sub-group they share it (no group can be
    # made there without moving torch's count of groups on its ranks alone); each rank's
    # backward then issues both in one order, that of its autograd graph, the same on every
    # rank.
    comm = wrap(transport(group).subgroup(range(whole.size)))
    unplaced = list(model.parameters())
    for name, held in placed.items():
        module = model.get_submodule(name)
        ExpertParallelExperts.convert(
            module,
            held,
            comm,
            weight=weight,
            combine=combine,
            timeout=timeout,
            wrappers=experts_wrappers(model, name),
        )
    leave_to_ranks(model)
    record_replaced(unplaced, model.parameters(), "expert_parallel")
    track_optimizers()
    guard_save_pretrained(model)
    return model


def leave_to_ranks(model: nn.Module) -> None:
    """Name ``model``'s rank-local parameters (:func:`rank_local_parameters`, relative to
    ``model``) among those a ``DistributedDataParallel`` wrapping ``model`` leaves alone
    (DDP's own ``_ddp_params_and_buffers_to_ignore``, kept with any already there)."""
    check_module(model)
    own = rank_local_parameters(model)
    if own:
        ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, sorted(ignored | set(own))
        )


def experts_modules(model: nn.Module) -> dict[str, str]:
    """``model``'s experts modules by path, each with why it cannot be placed by whole experts
    ("" where it can): :func:`experts_module`'s reason, or the PEFT wrapper around it whose
    adapters hold every expert (LoRA on the experts' parameters, PEFT's ``ParamWrapper``)."""
    named = dict(model.named_modules())
    wrapped = inside_unknown_adapters(named)
    out = {}
    for name, m in named.items():
        why = experts_module(m)
        if why is not None and name in wrapped and stacked_adapters(named, name) is None:
            why = (
                f"they are inside {wrapped[name]}, which no rule here places by expert (PEFT's "
                "plain LoRA on their parameters, enabled, is placed with them): split them by "
                "hidden units instead (filter_parallel, or a plan's stage over several ranks), "
                "or leave the experts out of the adapters' targets"
            )
        if why is not None:
            out[name] = why
    return out


def experts_wrappers(model: nn.Module, name: str) -> list[nn.Module]:
    """PEFT's LoRA wrappers on the parameters of ``model``'s experts module ``name``
    (:func:`~hetcoll.torch.filters.chains.stacked_adapters`), placed with its experts."""
    named = dict(model.named_modules())
    return [named[w] for w in stacked_adapters(named, name) or ()]


def placed_parameters(model: nn.Module, name: str) -> list[str]:
    """The names (``model``'s) of the parameters placed with the experts of its experts
    module ``name``: its own, then its LoRA wrappers' factors (:func:`experts_wrappers`)."""
    named = dict(model.named_modules())
    own = [f"{name}.{n}" for n, _ in named[name].named_parameters(recurse=False)]
    factors = [
        f"{w}.{kind}.{a}.weight"
        for w in stacked_adapters(named, name) or ()
        for kind in ("lora_A", "lora_B")
        for a in named[w].get_submodule(kind)._modules
    ]
    return own + factors


def find_experts(model: nn.Module) -> list[tuple[str, int]]:
    """``model``'s experts modules (:func:`experts_modules`), by path, with their experts;
    ``ValueError`` naming ``model`` where it holds none, or experts no rule here places."""
    found = []
    for name, why in experts_modules(model).items():
        if why:
            raise ValueError(f"model: cannot place the experts of {name!r}: {why}")
        found.append((name, int(model.get_submodule(name).num_experts)))  # type: ignore[arg-type]
    if not found:
        raise ValueError("model: holds no experts module (Hugging Face's experts layout)")
    return found


def agree_placement(comm: Communicator, placed: Placement, failure: Exception | None) -> None:
    """One agreement before any other collective: every layer's placement the same on every
    rank, or every rank raises (:class:`hetcoll.CollectiveMismatchError` naming the layer, or
    a rank whose own arguments failed: it raises ``failure``, the others name it)."""
    fields = {f"experts of {n}": zlib.crc32(repr(held).encode()) for n, held in placed.items()}
    agree(comm, {"experts layers": len(placed), **fields}, failure=failure)


def experts_placement(
    experts: Sequence[tuple[str, int]],
    ranks: int,
    *,
    speeds: Sequence[float] | None = None,
    shares: Shares | None = None,
    loads: Loads | None = None,
    capacity: Sequence[int] | None = None,
    where: str = "shares",
    of: str = "rank",
    current: Placement | None = None,
    gap: float = 0.0,
) -> Placement:
    """Each experts layer (its path and experts: :func:`find_experts`) placed on ``ranks``
    ranks, as each rank's expert indices: by ``speeds`` (:func:`expert_assignment`, with
    ``loads`` and ``capacity``), or as ``shares`` give them (:data:`Shares`: one placement
    for every layer, or a dict by path naming every layer; ``where``: the argument they came
    as, ``of``: what one entry is for, a rank or a plan's replica, for the errors;
    ``current``: each layer's placement now, which placing by speed disturbs least, and
    ``gap``: :func:`expert_assignment`'s). ``ValueError`` naming the argument where they do
    not make a placement."""
    if speeds is not None:
        speeds = _numbers(speeds, "speeds")  # True or 0 once raised "has no len()"
        if len(speeds) != ranks:
            raise ValueError(f"speeds: needs one per {of} ({ranks}), got {len(speeds)}")
    # Read once, not once per layer (a generator gave the second layer nothing).
    if loads is not None and not isinstance(loads, Mapping):
        loads = _numbers(loads, "loads")
    capacity = _check_capacity(capacity, ranks, of)
    for arg, given in (("loads", loads), (where, shares)):
        if isinstance(given, Mapping):
            missing = [n for n, _ in experts if n not in given]
            unknown = [n for n in given if n not in dict(experts)]
            if missing or unknown:
                raise ValueError(
                    f"{arg}: must name every experts module ({[n for n, _ in experts]}), "
                    + (f"misses {missing}" if missing else f"names {unknown}, which are not")
                )
    placed = {}
    for name, count in experts:
        load = loads.get(name) if isinstance(loads, Mapping) else loads
        if speeds is not None:
            now = None if current is None else current.get(name)
            placed[name] = expert_assignment(
                count, speeds, loads=load, capacity=capacity, current=now, gap=gap
            )
        else:
            held = shares.get(name) if isinstance(shares, Mapping) else shares
            w = f"{where}[{name!r}]" if isinstance(shares, Mapping) else where
            placed[name] = _check_shares(held or (), count, ranks, w, name, of)
    return placed


def expert_loads(model: nn.Module, *, timeout: float | None = None) -> dict[str, list[int]]:
    """Each experts layer's routed tokens per expert, every rank's summed, since the previous
    call (or the placement), by experts module name: ``expert_parallel(..., loads=...)``'s
    (or :func:`expert_shares`') argument for a placement by load. Collective over the
    experts' group (every rank calls it); the counts start again from zero."""
    check_module(model)
    layers = _placed_layers(model)
    comm = layers[0][1].comm
    mine = np.concatenate([m.routed.numpy() for _, m in layers]).astype(np.int64)
    total = comm.allgather_int64(mine, deadline(timeout)).sum(axis=0)
    out: dict[str, list[int]] = {}
    start = 0
    for name, m in layers:
        out[name] = [int(n) for n in total[start : start + m.all_experts]]
        start += m.all_experts
        m.routed.zero_()
    return out


def place_experts(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    speeds: Sequence[float] | None = None,
    shares: Shares | None = None,
    loads: Loads | None = None,
    capacity: Sequence[int] | None = None,
) -> Placement:
    """Place ``model``'s experts (:func:`expert_parallel`'s) on the ranks again, in place:
    when the ranks' speeds or the experts' loads (:func:`expert_loads`) have moved. Exactly
    one of ``speeds=`` (with ``loads`` and ``capacity`` as :func:`expert_parallel` takes
    them) or ``shares=``. Collective (every rank, the same arguments). Returns each rank's
    experts (their indices), by experts module name.

    Only the experts that change rank move, each straight from its old rank to its new one
    (one all-to-all per layer that changes, on the experts' own group): a rank holds at most
    its old and its new experts meanwhile, never the whole layer. Their gradients move with
    them where they have any, and, with ``optimizer`` (built over ``model.parameters()``),
    their optimizer state: every state tensor stacked by expert as the parameter is (momentum,
    Adam's moments; scalars such as Adam's step stay). The same parameter objects hold the
    new experts, so the optimizer and a ``DistributedDataParallel`` around the model carry on.
    A state laid out differently on different ranks raises on every rank before anything
    moves.

    >>> place_experts(model, opt, speeds=new_speeds, loads=expert_loads(model))  # doctest: +SKIP
    """
    check_module(model)
    layers = _placed_layers(model)
    comm = layers[0][1].comm
    placed = agreed_placement(
        comm,
        [(name, m.all_experts) for name, m in layers],
        comm.size,
        speeds=speeds,
        shares=shares,
        loads=loads,
        capacity=capacity,
        optimizer=optimizer,
    )
    move_experts([(name, m, placed[name]) for name, m in layers], optimizer)
    return placed


def agreed_placement(
    comm: Communicator,
    experts: Sequence[tuple[str, int]],
    ranks: int,
    *,
    speeds: Sequence[float] | None,
    shares: Shares | None,
    loads: Loads | None,
    capacity: Sequence[int] | None,
    of: str = "rank",
    optimizer: object = None,
) -> Placement:
    """:func:`experts_placement` of exactly one of ``speeds=`` or ``shares=`` (``TypeError``
    otherwise), agreed over ``comm`` before anything moves (:func:`agree_placement`: a
    rank's bad argument, or placements that differ, raise on every rank). ``optimizer``, the
    one whose state moves with the experts, is checked with them: a torch optimizer or
    None."""
    if (speeds is None) == (shares is None):
        raise TypeError("speeds: give exactly one of speeds= or shares=")
    placed: Placement = {}
    failure: Exception | None = None
    try:
        # A str was once taken, to break only once experts moved (its .state read then).
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer: must be a torch.optim.Optimizer or None, got "
                f"{type(optimizer).__name__}"
            )
        placed = experts_placement(
            experts,
            ranks,
            speeds=speeds,
            shares=shares,
            loads=loads,
            capacity=capacity,
            of=of,
        )
    except (TypeError, ValueError) as e:  # raised after the others learn of it, none waiting
        failure = e
    agree_placement(comm, placed, failure)
    return placed


def move_experts(
    moves: Sequence[tuple[str, ExpertParallelExperts, Sequence[Sequence[int]]]],
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Each experts layer of ``moves`` (its name, the layer, its new placement: each rank of
    its group's expert indices, every layer on one group) holding it, in place, only the experts
    that change rank moving (with their gradients and, with ``optimizer``, their state:
    :func:`place_experts`). Collective over the layers' group, every rank with the same
    placements (agreed by the caller); the state's layout is agreed here, before anything
    moves."""
    moving = [
        (name, m, new)
        for name, m, new in moves
        if tuple(tuple(held) for held in new) != m.placement
    ]
    if not moving:
        return
    carried = {name: _carried(m, optimizer) for name, m, _ in moving}
    agree(
        moving[0][1].comm,
        {
            f"the gradients and optimizer state of {name}'s experts": zlib.crc32(
                repr([(c.what, c.tensor.dtype, tuple(c.tensor.shape[1:])) for c in held]).encode()
            )
            for name, held in carried.items()
        },
        deadline(moving[0][1].timeout),
    )
    for name, m, new in moving:
        _move_experts(m, new, carried[name])


def _placed_layers(model: nn.Module) -> list[tuple[str, ExpertParallelExperts]]:
    """``model``'s experts layers placed by :func:`expert_parallel`, by module name;
    ``ValueError`` naming ``model`` where it holds none."""
    layers = [
        (name, m) for name, m in model.named_modules() if isinstance(m, ExpertParallelExperts)
    ]
    if not layers:
        raise ValueError("model: holds no experts placed by expert_parallel")
    return layers


@dataclass(frozen=True)
class _Carried:
    """A tensor that moves with a rank's experts (stacked by expert along dimension 0, as
    the experts' parameters are): what it is, for the ranks' agreement, and where its new
    rows go."""

    what: str
    tensor: torch.Tensor
    install: Callable[[torch.Tensor], None]


def _carried(m: ExpertParallelExperts, optimizer: torch.optim.Optimizer | None) -> list[_Carried]:
    """The tensors that move with ``m``'s experts: its parameters and its LoRA factors' blocks
    (:meth:`ExpertFactor.stacked` by expert to move, laid out again once moved), their
    gradients, and every optimizer state tensor stacked by expert as its parameter is (more
    than zero dimensions, the first of the parameter's length; a factor's shaped as it)."""
    held: list[tuple[str, torch.Tensor, ExpertFactor | None]] = [
        (n, p, None) for n, p in m._own().items()
    ]
    held += [(f"factor {k}", f.weight, f) for k, f in enumerate(m.factors())]
    out: list[_Carried] = []
    for n, p, f in held:

        def carry(what: str, t: torch.Tensor, install: Any, f: ExpertFactor | None = f) -> None:
            if f is None:
                out.append(_Carried(what, t, install))
            else:
                out.append(_Carried(what, f.stacked(t), lambda rows: install(f.unstacked(rows))))

        carry(n, p.data, partial(setattr, p, "data"))
        if p.grad is not None:
            carry(f"{n}.grad", p.grad, partial(setattr, p, "grad"))
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key in sorted(state, key=str):
            t = state[key]
            if not isinstance(t, torch.Tensor):
                continue
            if t.shape == p.shape if f is not None else t.dim() >= 1 and t.shape[0] == p.shape[0]:
                carry(f"{n}.state[{key!r}]", t, partial(state.__setitem__, key))
    return out


def _move_experts(
    m: ExpertParallelExperts, new: Sequence[Sequence[int]], carried: list[_Carried]
) -> None:
    """``m``'s experts moved to the placement ``new`` (each rank's expert indices, ascending):
    each rank sends every rank those of its experts that rank holds next (one all-to-all per
    dtype), then holds its new experts in the same parameter objects (and gradients,
    optimizer state)."""
    comm, rank, old = m.comm, m.rank, m.placement
    mine = {e: i for i, e in enumerate(old[rank])}  # each old expert's row here
    wanted = [set(held) for held in new]
    # To each rank q: the experts of mine q holds next, ascending (rows out in rank order);
    # from each rank q: the experts of q's that this rank holds next, ascending.
    going = [[e for e in old[rank] if e in wanted[q]] for q in range(comm.size)]
    coming = [[e for e in old[q] if e in wanted[rank]] for q in range(comm.size)]
    send = [len(going[q]) if q != rank else 0 for q in range(comm.size)]
    recv = [len(coming[q]) if q != rank else 0 for q in range(comm.size)]
    out_rows = torch.tensor(
        [mine[e] for q in range(comm.size) if q != rank for e in going[q]], dtype=torch.long
    )
    kept_rows = torch.tensor([mine[e] for e in going[rank]], dtype=torch.long)
    # The new rows come as those received (in rank order), then those kept: each one's
    # expert, put in ascending order.
    arrived = [e for q in range(comm.size) if q != rank for e in coming[q]] + going[rank]
    into = torch.argsort(torch.tensor(arrived, dtype=torch.long))
    # One exchange per dtype, the same on every rank (agreed); a pack travels on its first
    # tensor's device (a parameter's) and each part returns to its own (optimizer state may
    # live elsewhere).
    packs: dict[torch.dtype, list[_Carried]] = {}
    for c in carried:
        packs.setdefault(c.tensor.dtype, []).append(c)
    with torch.no_grad():
        for members in packs.values():
            on = members[0].tensor.device
            widths = [math.prod(c.tensor.shape[1:]) for c in members]
            flat = [c.tensor.reshape(len(old[rank]), w) for c, w in zip(members, widths)]
            leaving = torch.cat([f[out_rows.to(f.device)].to(on) for f in flat], dim=1)
            got = _exchange(leaving, comm, send, recv, m.timeout, "placement")
            for c, f, part in zip(members, flat, got.split(widths, dim=1)):
                rows = torch.cat([part.to(f.device), f[kept_rows.to(f.device)]])
                rows = rows[into.to(f.device)]
                c.install(rows.reshape(len(new[rank]), *c.tensor.shape[1:]))
    m._set_placement(comm, new)
    m.num_experts = len(new[rank])
    for factor in m.factors():
        factor.place(comm, new)
    for wrapper in m._wrappers:
        wrapper.num_experts = len(new[rank])


def rank_local_parameters(model: nn.Module) -> list[str]:
    """The names of ``model``'s parameters each rank holds its own part of (its experts): the
    data-parallel average must leave them alone."""
    check_module(model)
    out = []
    for name, m in model.named_modules():
        if isinstance(m, ExpertParallelExperts):
            out += [f"{name}.{n}" if name else n for n in m._own()]
        elif isinstance(m, ExpertFactor):  # its LoRA factors' blocks of the rank's experts
            out.append(f"{name}.weight" if name else "weight")
    return out
