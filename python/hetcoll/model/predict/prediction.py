"""What every predictor returns: :class:`Prediction` (step time, breakdown, memory, feasibility and
the runnable plan), and torch DDP's bucket sizes."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hetcoll.plan import Plan

# torch DDP's defaults: the first bucket is capped at 1 MiB (so communication starts early), the
# others at bucket_cap_mb = 25 MiB.
DDP_FIRST_BUCKET_BYTES = 1024 * 1024


DDP_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass
class Prediction:
    """Predicted step of one strategy at given shares.

    ``shares``: integers per device in ``share_unit`` (samples, filters of the widest split
    layer, or layers). ``breakdown``: seconds on the critical path by cause, summing to
    ``step_s``. ``memory_bytes``: what each device holds; ``feasible`` is False when any device
    holds more than its memory, or the plan cannot run at all (``reason`` says which).
    """

    strategy: str
    shares: list[int]
    share_unit: str
    step_s: float
    breakdown: dict[str, float]
    memory_bytes: list[float]
    feasible: bool
    reason: str = ""
    batch: int = 0
    detail: dict[str, Any] = field(default_factory=dict)
    #: The :class:`hetcoll.Plan` this prediction is for (what :func:`hetcoll.torch.parallelize`
    #: runs), or None with ``plan_note`` saying why the runtime cannot run it. (Not compared:
    #: two predictions are equal when their figures are.)
    plan: Plan | None = field(default=None, compare=False)
    plan_note: str = field(default="", compare=False)
    #: Builds ``plan`` when it is first read, for a candidate whose plan was costed from its
    #: layout (a plan of 10,240 replicas takes longer to build and check than to cost).
    plan_factory: Callable[[], Plan] | None = field(default=None, compare=False, repr=False)

    @property
    def samples_per_s(self) -> float:
        return self.batch / self.step_s if self.step_s > 0 and math.isfinite(self.step_s) else 0.0

    @property
    def has_plan(self) -> bool:
        """Whether the runtime can run this prediction's plan (built or not yet built)."""
        return self.plan_factory is not None or self.__dict__.get("_plan") is not None

    def to_plan(self) -> Plan:
        """The plan to hand to :func:`hetcoll.torch.parallelize` (device i = rank i);
        ``ValueError`` when there is none (``plan_note`` says why).

        >>> best = hetcoll.model.plan(costs, cluster, 256)[0]  # doctest: +SKIP
        >>> best.to_plan().save("plan.json")  # doctest: +SKIP
        """
        if self.plan is None:
            raise ValueError(
                f"{self.strategy}: no plan the runtime can run"
                + (f": {self.plan_note}" if self.plan_note else "")
            )
        return self.plan

    def to_json(self, *, with_plan: bool = True, per_device: bool = True) -> dict[str, Any]:
        """The prediction as JSON; ``with_plan=False`` leaves the plan out, ``per_device=False``
        gives the largest memory (``max_memory_bytes``) and the devices used instead of the
        figures of every device (megabytes for many candidates on 10,240 devices)."""
        plan = self.plan if with_plan else None
        devices: dict[str, Any] = (
            {"shares": self.shares, "memory_bytes": self.memory_bytes}
            if per_device
            else {
                "devices_used": sum(1 for x in self.shares if x),
                "max_memory_bytes": max(self.memory_bytes, default=0.0),
            }
        )
        return {
            "strategy": self.strategy,
            **devices,
            "share_unit": self.share_unit,
            "step_s": self.step_s,
            "samples_per_s": self.samples_per_s,
            "breakdown_s": self.breakdown,
            "feasible": self.feasible,
            "reason": self.reason,
            "batch": self.batch,
            **({"detail": self.detail} if self.detail else {}),
            **({"plan": plan.to_dict()} if plan is not None else {}),
        }


def on_devices(pred: Prediction, keep: Sequence[int], num_devices: int) -> Prediction:
    """``pred``, made on the sub-cluster of devices ``keep``, in the whole cluster's numbering
    of ``num_devices``: the others idle (no share, no memory), ``detail["critical_device"]``
    renumbered. Without a plan (the caller places one, or its factory)."""
    shares = [0] * num_devices
    memory = [0.0] * num_devices
    for j, d in enumerate(keep):
        shares[d] = pred.shares[j]
        memory[d] = pred.memory_bytes[j]
    detail = dict(pred.detail)
    if "critical_device" in detail:
        detail["critical_device"] = keep[detail["critical_device"]]
    # plan=None: reading pred.plan here would build a large candidate's plan for nothing.
    return replace(
        pred, shares=shares, memory_bytes=memory, detail=detail, plan=None, plan_factory=None
    )


def _get_plan(self: Prediction) -> Plan | None:
    built: Plan | None = self.__dict__.get("_plan")
    if built is None and self.plan_factory is not None:
        built = self.__dict__["_plan"] = self.plan_factory()
    return built


def _set_plan(self: Prediction, value: Plan | None) -> None:
    self.__dict__["_plan"] = value


# ``plan`` reads as a field and is built on first read when only its factory was given.
setattr(Prediction, "plan", property(_get_plan, _set_plan))  # noqa: B010
