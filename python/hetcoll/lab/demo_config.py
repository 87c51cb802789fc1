"""``hetcoll demo``: the main job (its options and command line; importable without torch, so
other ``hetcoll`` commands stay fast). Trains a small CNN on scikit-learn's bundled digits on local
ranks of unequal (emulated) speed, twice:

- **unbalanced**: equal batches and plain averaging, as DDP / DistributedSampler do today;
- **balanced**: each rank's speed measured, the global batch split with :func:`hetcoll.split`,
  :class:`~hetcoll.torch.BalancedSampler` and exact sample-weighted averaging (the DDP comm hook
  on gloo, the MPI :class:`~hetcoll.torch.DistributedOptimizer` with ``--backend mpi``).

Both runs see the same global batches in the same order, so they learn the same model; only the
time differs. Speeds are *emulated* (a slow rank sleeps in proportion to its real compute, see
:mod:`hetcoll.lab.emulate`). Prints a table, writes a PNG plot and, with ``--json``, a
machine-readable result.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

# The demo's training set: 80% of scikit-learn's 1,797 digits (hetcoll.lab.demo_ranks.load_digits).
DIGITS_TRAIN_SAMPLES = int(0.8 * 1797)


@dataclass
class DemoConfig:
    """Everything a demo run depends on (defaults finish in about two minutes on 2 cores)."""

    speeds: tuple[float, ...] = (1.0, 0.25)
    epochs: int = 10
    global_batch: int = 128
    lr: float = 0.05
    backend: str = "gloo"
    seed: int = 0
    rebalance: bool = True
    progress: bool = True
    runs: tuple[str, ...] = ("unbalanced", "balanced")
    strategy: str = "data"  # "filter": hetcoll.lab.filter_demo; "plan": hetcoll.lab.plan_demo

    @property
    def world_size(self) -> int:
        return len(self.speeds)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DemoConfig:
        """The config ``dataclasses.asdict`` made (after a JSON round trip: lists back to
        tuples), as the mpiexec workers receive it."""
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        return cls(**fields)

    def validate(self) -> None:
        if not self.speeds or any(not 0 < s <= 1 for s in self.speeds):
            raise ValueError(f"speeds: each must be in (0, 1], got {list(self.speeds)}")
        if self.global_batch < self.world_size:
            raise ValueError(
                f"global_batch: must be at least the number of ranks ({self.world_size})"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr: must be a finite number > 0, got {self.lr}")
        if self.global_batch > DIGITS_TRAIN_SAMPLES:
            raise ValueError(
                f"global_batch: at most the {DIGITS_TRAIN_SAMPLES:,} training samples, "
                f"got {self.global_batch}"
            )
        if self.epochs < 1:
            raise ValueError(f"epochs: must be >= 1, got {self.epochs}")
        if self.backend not in ("gloo", "mpi"):
            raise ValueError(f"backend: must be 'gloo' or 'mpi', got {self.backend!r}")
        if self.strategy not in ("data", "filter", "plan"):
            raise ValueError(f"strategy: must be 'data', 'filter' or 'plan', got {self.strategy!r}")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``demo`` subcommand's options; the caller sets what runs it."""
    p = sub.add_parser(
        "demo",
        help="train a CNN on ranks of unequal (emulated) speed, unbalanced vs balanced",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = DemoConfig()
    p.add_argument(
        "--speeds",
        default=",".join(map(str, d.speeds)),
        help="emulated speed of each rank as a fraction of real speed (default 1,0.25)",
    )
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch", type=int, default=d.global_batch, help="global batch per step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--backend", choices=["gloo", "mpi"], default=d.backend)
    p.add_argument(
        "--strategy",
        choices=["data", "filter", "plan"],
        default=d.strategy,
        help="data: balanced batches (default); filter: layers split by speed (filter "
        "parallel); plan: the planner's best plan, run beside even data parallelism",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--no-rebalance",
        dest="rebalance",
        action="store_false",
        help="keep the first split (default: re-solve it every 10 steps from each rank's "
        "measured compute time)",
    )
    p.add_argument("--out", default="demo-out", help="directory for demo.png (and demo.json)")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.add_argument("--no-progress", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """The run the parsed options of ``hetcoll demo`` ask for."""
    try:
        speeds = tuple(float(s) for s in args.speeds.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"speeds: expected comma-separated numbers, got {args.speeds!r}") from None
    return DemoConfig(
        speeds=speeds,
        epochs=args.epochs,
        global_batch=args.batch,
        lr=args.lr,
        backend=args.backend,
        strategy=args.strategy,
        seed=args.seed,
        rebalance=args.rebalance,
        progress=not args.no_progress,
    )
