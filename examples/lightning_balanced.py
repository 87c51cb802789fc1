"""Balanced data-parallel training with PyTorch Lightning: ``hetcoll.lightning.BalancedStrategy``.

    python examples/lightning_balanced.py --devices 2 --speeds 3,1        # shares split 3:1
    python examples/lightning_balanced.py --devices 2 --measure --rebalance-every 10

The training DataLoader's ``batch_size`` is the *global* batch. The strategy gives each rank its
share of every global batch (given as ``--shares``, split from ``--speeds``, or ``--measure``d
when training starts, and re-solved every ``--rebalance-every`` steps) and averages the
gradients weighted by samples, so every step applies the gradient of the whole global batch: the
model is the one a single process trains on the same batches (``--float64``: to rounding). The
progress bar shows every rank's share (``share/r``); with ``--measure`` the logger also gets
every rank's speed (``speed/r``, samples/s).

The data are scikit-learn's bundled 8x8 digits (hetcoll's demo data), the model a small MLP; put
your own in ``Digits`` and ``load_data``. ``--fast`` trains a few steps (the test suite runs it).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hetcoll.lightning import BalancedStrategy


def load_data(seed: int = 0) -> TensorDataset:
    """The training part of scikit-learn's digits, flattened to 64 features."""
    from hetcoll.lab.demo_ranks import load_digits

    x, y, _, _ = load_digits(seed)
    return TensorDataset(x.flatten(1), y)


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


class Digits(LightningModule):
    def __init__(self, batch: int, lr: float, float64: bool) -> None:
        super().__init__()
        self.net = make_net()
        self.batch, self.lr, self.float64 = batch, lr, float64
        if float64:
            self.net.double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        dtype = torch.float64 if self.float64 else torch.float32
        loss = nn.functional.cross_entropy(self.net(x.to(dtype)), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        # batch_size is the global batch: BalancedStrategy gives each rank its share of it.
        return DataLoader(load_data(), batch_size=self.batch, shuffle=True)


def numbers(text: str | None, kind: type) -> list[Any] | None:
    return None if text is None else [kind(v) for v in text.split(",")]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--devices", type=int, default=2, help="CPU processes (ranks)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--shares", help="per-rank batch sizes, e.g. 96,32 (sum: --batch)")
    how.add_argument("--speeds", help="relative per-rank speeds, e.g. 3,1")
    how.add_argument("--measure", action="store_true", help="time every rank at the start")
    p.add_argument("--rebalance-every", type=int, default=None, help="re-solve every N steps")
    p.add_argument("--batch", type=int, default=128, help="the global batch")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument(
        "--accumulate", type=int, default=1, help="micro-batches per optimizer step (Lightning's)"
    )
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--float64", action="store_true", help="train in float64")
    p.add_argument("--fast", action="store_true", help="a few steps only (the test suite)")
    p.add_argument(
        "--start-method",
        default="popen",
        choices=["popen", "spawn", "fork"],
        help="how Lightning starts the ranks (popen: re-runs this script, its default)",
    )
    p.add_argument("--save", help="write the trained state dict here (rank 0)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> Digits:
    """Train; the returned module holds the trained weights (in the process that called)."""
    args = parse(argv)
    strategy = BalancedStrategy(
        shares=numbers(args.shares, int),
        speeds=numbers(args.speeds, float),
        measure=args.measure,
        rebalance_every=args.rebalance_every,
        measure_budget=1.0 if args.fast else 10.0,
        start_method=args.start_method,
    )
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_epochs=1 if args.fast else args.epochs,
        max_steps=4 if args.fast else -1,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=not args.fast,
    )
    model = Digits(args.batch, args.lr, args.float64)
    trainer.fit(model)
    if args.save and trainer.is_global_zero:
        torch.save(model.state_dict(), args.save)
    return model


if __name__ == "__main__":
    main()
