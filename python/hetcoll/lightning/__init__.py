"""PyTorch Lightning integration: :class:`BalancedStrategy`, DDP with each rank taking its share
of every global batch and exact sample-weighted gradient averaging (needs ``lightning``)."""

from hetcoll.lightning.strategy import BalancedStrategy

__all__ = ["BalancedStrategy"]
