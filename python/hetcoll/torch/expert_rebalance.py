"""ExpertRebalancer: place the experts again while their loads drift.

A router's preferences move as a mixture of experts trains: an expert that received a tenth
of the tokens at the start may receive a third later, and the rank holding it then holds up
every other rank at each experts layer's exchange. Every ``every`` steps the rebalancer
takes the tokens each expert received since the last look (:func:`expert_loads`, one small
all-gather), smooths them into a running estimate, and asks what each layer's slowest rank
would spend on its experts' tokens under the current placement and under a better one for
those loads. Two candidates: the current placement improved by a few moves and swaps of
experts off its slowest rank (:func:`refined_placement`), and the best placement of any
experts on any rank (:func:`expert_assignment` at the ranks' speeds), which may move most of
them. Of the two, within ``threshold`` (what a move must gain to be made) of the faster, the
one moving fewer experts is taken, and the experts move only where it beats the current
placement by more than ``threshold`` (:func:`place_experts`: only those that change rank,
with their gradients and optimizer state). Every rank decides on the same gathered counts,
so every rank decides alike.

The predicted time of a placement is, summed over the experts layers (each is a barrier: its
exchange waits for every rank's experts), the most tokens any rank's experts receive over
that rank's speed: the quantity :func:`expert_assignment` minimises.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from hetcoll import refine_items
from hetcoll.comm import Communicator, agree
from hetcoll.plan import expert_indices
from hetcoll.torch.expert_parallel import (
    ExpertParallelExperts,
    Held,
    Placement,
    _check_capacity,
    _running_sum,
    assignment_seconds,
    expert_loads,
    experts_placement,
    place_experts,
)
from hetcoll.torch.parallel_experts import PlanExperts
from hetcoll.torch.speed import every_argument

#: The ranks' speeds (any unit, one per rank), or a function of nothing giving them at each
#: decision (None while they are not known yet: :attr:`hetcoll.torch.Rebalancer.speeds`).
Speeds = Sequence[float] | Callable[[], Sequence[float] | None]


@dataclass(frozen=True)
class ExpertRebalanceEvent:
    """One decision: the step, the ranks' speeds, each layer's experts per rank before and
    after (by experts module name: counts in ``old_shares`` and ``new_shares``, each rank's
    expert indices in ``old_placement`` and ``new_placement``), the predicted experts' time
    per step before and after (in tokens over speed: seconds where the speeds are tokens per
    second), and whether the experts moved; ``moved``: the experts the new placement puts on
    another rank (over every layer, whether or not applied), ``seconds``: this rank's wall
    time moving them (0 when not applied), what the ``threshold`` is to outweigh."""

    step: int
    speeds: tuple[float, ...]
    old_shares: dict[str, list[int]]
    new_shares: dict[str, list[int]]
    predicted_old: float
    predicted_new: float
    applied: bool
    old_placement: Placement
    new_placement: Placement
    moved: int = 0
    seconds: float = 0.0


def _floats(values: object) -> list[float]:
    """``values`` as floats: ``TypeError``/``ValueError``/``OverflowError`` where it is no
    list of numbers (a str, a dict, whose keys a loop reads, or a bool among them)."""
    if isinstance(values, (str, bytes, Mapping)):
        raise TypeError(values)
    out = []
    for x in values:  # type: ignore[attr-defined]
        if isinstance(x, (bool, np.bool_)):  # True once counted as 1
            raise TypeError(x)
        out.append(float(x))
    return out


def _load_list(loads: object, argument: str) -> list[float]:
    """``loads`` as floats, each finite and >= 0 (tokens routed to each expert), their sum a
    double; ``ValueError`` naming ``argument`` otherwise (NaN once priced a placement at 2 s,
    a negative load at 0, and 4 loads of 1e308 at infinity)."""
    try:
        values = _floats(loads)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{argument}: must be numbers, one per expert, got {loads!r}") from None
    if not all(np.isfinite(values)) or (values and min(values) < 0):
        raise ValueError(f"{argument}: must be finite numbers >= 0, one per expert, got {values}")
    if not math.isfinite(_running_sum(values)):
        raise ValueError(f"{argument}: their sum overflows a double")
    return values


def _speed_list(speeds: object, size: int | None = None, *, positive: bool = False) -> list[float]:
    """``speeds`` as floats, each finite and >= 0 (> 0 where ``positive``: a placement by load
    needs every rank's), one per rank (``size`` of them where given); ``ValueError`` naming
    ``speeds`` otherwise."""
    try:
        values = _floats(speeds)  # "11" once read as two ranks' speeds, [True] as one of 1
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"speeds: must be numbers, one per rank, got {speeds!r}") from None
    per_rank = "per rank" if size is None else f"per rank ({size})"
    bound = "> 0" if positive else ">= 0"
    if (
        not values
        or (size is not None and len(values) != size)
        or not all(np.isfinite(values))
        or min(values) < 0
        or (positive and min(values) == 0)
    ):
        raise ValueError(f"speeds: needs one finite number {bound} {per_rank}, got {values}")
    return values


def _real(value: object) -> float | None:
    """``value`` as a float where it is a real number within a double's range (numpy's too;
    a bool is none: True once counted as 1), else None."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # an int past floats (10**400 once raised OverflowError)
        return None


def placement_time(
    shares: Mapping[str, Held],
    loads: Mapping[str, Sequence[float]],
    speeds: Sequence[float],
) -> float:
    """The experts' time of a placement: over the layers in ``shares`` (experts per rank, by
    experts module name: counts, or each rank's expert indices), the largest ``tokens /
    speed`` of any rank, summed; ``loads``: each expert's tokens, by the same names. The
    objective :func:`expert_assignment` minimises per layer (a rank of speed 0 holding tokens
    takes forever)."""
    for value, argument in ((shares, "shares"), (loads, "loads")):
        if not isinstance(value, Mapping):
            raise TypeError(
                f"{argument}: must be a dict by experts module name, got {type(value).__name__}"
            )
    speeds = _speed_list(speeds)
    total = 0.0
    for name, held in shares.items():
        if name not in loads:
            raise ValueError(f"loads: has no entry for {name!r}, which shares names")
        load = _load_list(loads[name], f"loads[{name!r}]")
        placed = expert_indices(held, len(speeds), f"shares[{name!r}]", of="speed")
        experts = sum(map(len, placed))
        if len(load) != experts:
            raise ValueError(
                f"loads: {name!r} needs one entry per expert ({experts}), got {len(load)}"
            )
        total += assignment_seconds(placed, load, speeds)
    return total


def refined_placement(
    current: Sequence[Sequence[int]],
    loads: Sequence[float],
    speeds: Sequence[float],
    *,
    capacity: Sequence[int] | None = None,
) -> list[list[int]]:
    """``current`` (each rank's expert indices) improved a step at a time: an expert moved off
    the slowest rank, or swapped there for a lighter one, wherever that lowers the larger of
    the two ranks' ``tokens / speed`` below the slowest rank's (the step that lowers it most;
    ties to the lower expert and rank), until no step does (at most twice as many steps as
    experts): :func:`hetcoll.refine_items` (Rust). Few experts move, and the slowest rank's
    time never rises. ``capacity``: the most experts each rank may hold."""
    speeds = _speed_list(speeds)
    placed = expert_indices(current, len(speeds), "current", of="speed")
    experts = sum(map(len, placed))
    loads = _load_list(loads, "loads")
    if len(loads) != experts:
        raise ValueError(f"loads: needs one entry per expert ({experts}), got {len(loads)}")
    # Checked here: the Rust layer read a dict's keys as the list.
    capacity = _check_capacity(capacity, len(speeds))
    owner = [0] * experts
    for rank, held in enumerate(placed):
        for e in held:
            owner[e] = rank
    refined = refine_items(loads, speeds, owner, capacity=capacity)
    return [[e for e, r in enumerate(refined) if r == rank] for rank in range(len(speeds))]


def _moved(old: Sequence[Sequence[int]], new: Sequence[Sequence[int]]) -> int:
    """Experts that change rank between two placements."""
    return sum(len(set(a) - set(b)) for a, b in zip(old, new, strict=True))


class ExpertRebalancer:
    """Watch the experts' loads of a model placed by :func:`expert_parallel` (or of a
    :class:`~hetcoll.torch.Parallel` whose plan places experts) and place its experts again
    when that pays.

    Call :meth:`step` on every rank after every optimizer step; every ``every`` steps it
    decides (collectively, on the experts' group; a ``Parallel``'s whole group) and returns
    True when the experts moved. ``speeds``: the ranks' speeds, each > 0, one per rank (a
    ``Parallel``: one per replica, in its plan's order), or a function of nothing that gives
    them (or None while unknown) at each decision, e.g. ``lambda: rebalancer.speeds`` of the
    :class:`~hetcoll.torch.Rebalancer` that splits the batch. ``optimizer`` (built over
    ``model.parameters()``): its state moves with the experts. ``threshold``: the least
    relative gain in the predicted experts' time that moves them (moving costs one exchange
    of the moving experts' weights and state); of the best placement and the current one
    refined by a few moves (:func:`refined_placement`), the one moving fewer experts is
    taken unless the other is faster by more than it; the best is sought within a tenth of
    it (:func:`expert_assignment`'s ``gap``).
    ``smoothing`` (0, 1]: the weight of the latest window's loads in the running estimate
    (1: the latest window alone). ``capacity``: the most experts each rank may hold of a
    layer (:func:`expert_assignment`).

    A checkpoint that holds :meth:`state_dict` resumes the decisions exactly
    (:meth:`load_state_dict`): the steps counted, the running loads and the placement.

    >>> watch = ExpertRebalancer(model, opt, speeds=[1.0, 0.25], every=100)  # doctest: +SKIP
    >>> opt.step(); watch.step()  # on every rank  # doctest: +SKIP
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        speeds: Speeds,
        every: int = 100,
        threshold: float = 0.05,
        smoothing: float = 0.5,
        capacity: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
        # The three things a decision does, for a plan's replicas or a model's ranks.
        self._comm: Communicator
        self._loads_now: Callable[[], dict[str, list[int]]]
        self._placed_now: Callable[[], Placement]
        self._place: Callable[..., Placement]
        if isinstance(model, PlanExperts):
            if not model.plan.experts:
                raise ValueError("model: its plan places no experts (its experts field)")
            self.size = len(model.plan.replicas)
            self._loads_now = model.expert_loads
            self._placed_now = lambda: model.experts_placement
            self._place = model.place_experts
            self._comm = model.experts_comm
        else:
            layers = {
                name: m for name, m in model.named_modules() if isinstance(m, ExpertParallelExperts)
            }
            if not layers:
                raise ValueError("model: holds no experts placed by expert_parallel")
            self.size = next(iter(layers.values())).comm.size
            self._loads_now = partial(expert_loads, model)
            self._placed_now = lambda: {
                name: [list(held) for held in m.placement] for name, m in layers.items()
            }
            self._place = partial(place_experts, model)
            self._comm = next(iter(layers.values())).comm
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer: must be a torch.optim.Optimizer or None, got "
                f"{type(optimizer).__name__}"
            )
        every = every_argument(every, "every", optional=False)
        # A bool is no number here (True once meant 1); infinity reached step() as its gap.
        thresh, smooth = _real(threshold), _real(smoothing)
        if thresh is None or not 0.0 <= thresh < math.inf:
            raise ValueError(f"threshold: must be a finite number >= 0, got {threshold!r}")
        if smooth is None or not 0.0 < smooth <= 1.0:
            raise ValueError(f"smoothing: must be in (0, 1], got {smoothing!r}")
        if not callable(speeds):
            # Every decision places by load, which needs each speed > 0: checked here, not
            # at the first decision.
            speeds = _speed_list(speeds, self.size, positive=True)
        held = _check_capacity(capacity, self.size)
        if held is not None:
            for name, placed in self._placed_now().items():
                experts = sum(map(len, placed))
                if sum(held) < experts:
                    raise ValueError(
                        f"capacity: holds {sum(held)} experts in all, fewer than the "
                        f"{experts} of {name!r}"
                    )
        self.model, self.optimizer = model, optimizer
        self._speeds = speeds
        self.every, self.threshold, self.smoothing = every, thresh, smooth
        self.capacity = held
        #: Each layer's estimated tokens per expert per window (by experts module name).
        self.loads: dict[str, list[float]] | None = None
        self.history: list[ExpertRebalanceEvent] = []
        self._step = 0

    def step(self) -> bool:
        """Count one step; every ``every`` steps take the loads and decide (collective: every
        rank of the experts' group calls it as often). True when the experts moved."""
        self._step += 1
        if self._step % self.every:
            return False
        window = self._loads_now()
        a = self.smoothing
        self.loads = {
            name: [float(x) for x in counts]
            if self.loads is None
            else [a * x + (1 - a) * y for x, y in zip(counts, self.loads[name])]
            for name, counts in window.items()
        }
        given = self._speeds() if callable(self._speeds) else self._speeds
        if given is None:
            return False  # the speeds are not known yet: the loads are kept
        speeds = _speed_list(given, self.size, positive=True)
        old = self._placed_now()
        new = experts_placement(
            [(name, sum(map(len, held))) for name, held in old.items()],
            self.size,
            speeds=speeds,
            loads=self.loads,
            capacity=self.capacity,
            current=old,
            # Placements closer than the threshold do not decide anything: a tenth of it is
            # close enough for the best one (the search proving the last fraction of a
            # percent took ~6 ms a layer at 64 experts).
            gap=self.threshold / 10,
        )
        # Per layer, two candidates: the best placement, and the current one refined by a
        # few moves. Of those within the threshold of the faster, the one moving fewer
        # experts (then the faster). The chosen ones' times and moves make the decision's.
        after, moved = 0.0, 0
        for name, held in old.items():
            load = self.loads[name]
            near = refined_placement(held, load, speeds, capacity=self.capacity)
            options = [
                (assignment_seconds(c, load, speeds), _moved(held, c), k, c)
                for k, c in enumerate((new[name], near))
            ]
            fastest = min(t for t, *_ in options)
            layer_time, moves, _, new[name] = min(
                (o for o in options if o[0] * (1 - self.threshold) <= fastest),
                key=lambda o: (o[1], o[0], o[2]),
            )
            after += layer_time
            moved += moves
        before = placement_time(old, self.loads, speeds)
        applied = new != old and after < before * (1 - self.threshold)
        seconds = 0.0
        if applied:
            start = time.perf_counter()
            self._place(self.optimizer, shares=new)
            seconds = time.perf_counter() - start
        counts = {name: [len(h) for h in held] for name, held in old.items()}
        new_counts = {name: [len(h) for h in held] for name, held in new.items()}
        self.history.append(
            ExpertRebalanceEvent(
                self._step,
                tuple(speeds),
                counts,
                new_counts,
                before,
                after,
                applied,
                old,
                new,
                moved,
                seconds,
            )
        )
        return applied

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to decide as this one would: the steps counted, the running
        loads (None before the first decision) and the placement, each rank's expert indices by
        experts module name. Plain ints, floats, lists and dicts, for any checkpoint format;
        the same on every rank. :attr:`history` is not part of it."""
        return {
            "step": self._step,
            "loads": None if self.loads is None else {k: list(v) for k, v in self.loads.items()},
            "placement": {
                name: [list(held) for held in ranks] for name, ranks in self._placed_now().items()
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`): the steps counted and the running
        loads come back, and the experts move to the saved placement, with their optimizer
        state (load the model's and the optimizer's state first: any placement takes them).
        On another number of ranks the placement stays as it is (the loads, per expert, still
        come back). Collective (every rank, the same state): a state that does not fit the
        model's experts raises ``ValueError`` naming its field, and ranks whose states differ
        raise :class:`hetcoll.CollectiveMismatchError`, on every rank before anything moves."""
        try:
            step, loads, placement = self._checked_state(state)
        except (TypeError, ValueError) as e:
            agree(self._comm, {}, failure=e)  # the other ranks raise at once
            raise
        fields = {"the restored step": step}
        for name, values in (loads or {}).items():
            bits = np.asarray(values, np.float64).view(np.int64)  # exact, as ints
            fields.update(
                {f"the restored loads[{name!r}][{i}]": int(v) for i, v in enumerate(bits)}
            )
        agree(self._comm, fields)
        self._step, self.loads = step, loads
        if placement is not None and placement != self._placed_now():
            self._place(self.optimizer, shares=placement)

    def _checked_state(
        self, state: object
    ) -> tuple[int, dict[str, list[float]] | None, Placement | None]:
        """The step, loads and placement of ``state`` (the placement None on another number
        of ranks), checked against the model's experts layers."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state: must be a dict from state_dict(), got {type(state).__name__}")
        missing = [k for k in ("step", "loads", "placement") if k not in state]
        if missing:
            raise ValueError(f"state: missing {missing} (not an ExpertRebalancer state_dict)")
        step = state["step"]
        # Below 2**63: the ranks agree on it as a 64-bit int (2**70 was refused there, under
        # that agreement's own name for it).
        if (
            isinstance(step, bool)
            or not isinstance(step, (int, np.integer))
            or not 0 <= step < 2**63
        ):
            raise ValueError(f"state['step']: must be an integer >= 0 and < 2**63, got {step!r}")
        step = int(step)
        layers = {name: sum(map(len, held)) for name, held in self._placed_now().items()}
        saved = state["placement"]
        if not isinstance(saved, Mapping) or set(saved) != set(layers):
            raise ValueError(
                f"state['placement']: must place the model's experts layers {sorted(layers)}, "
                f"got {sorted(saved) if isinstance(saved, Mapping) else saved!r}"
            )
        placement: Placement | None = {}
        for name, held in saved.items():
            ranks = len(held) if isinstance(held, Sequence) else self.size
            where = f"state['placement'][{name!r}]"
            placed = expert_indices(held, ranks, where, experts=layers[name], of="rank")
            if placement is not None:
                placement[name] = [list(h) for h in placed]
            if ranks != self.size:
                placement = None  # saved on another number of ranks: the loads alone carry over
        loads = state["loads"]
        if loads is not None:
            if not isinstance(loads, Mapping) or set(loads) != set(layers):
                raise ValueError(
                    f"state['loads']: must be None or hold the model's experts layers "
                    f"{sorted(layers)}"
                )
            checked: dict[str, list[float]] = {}
            for name, values in loads.items():
                try:  # not a bool, nor a dict's keys
                    checked[name] = _floats(values)
                except (TypeError, ValueError, OverflowError):
                    raise ValueError(f"state['loads'][{name!r}]: must be numbers") from None
                if len(checked[name]) != layers[name] or not all(
                    np.isfinite(x) and x >= 0 for x in checked[name]
                ):
                    raise ValueError(
                        f"state['loads'][{name!r}]: needs one finite number >= 0 per expert "
                        f"({layers[name]})"
                    )
                if not math.isfinite(_running_sum(checked[name])):  # step() would place by it
                    raise ValueError(f"state['loads'][{name!r}]: their sum overflows a double")
            loads = checked
        return step, loads, placement
