"""PyTorch Lightning integration: :class:`BalancedStrategy`, DDP with each rank taking its share
of every global batch and exact sample-weighted gradient averaging, and :class:`Rebalancing`,
a callback keeping the shares of a ``BalancedSampler`` loader at the measured speeds under
other strategies (FSDP2's ``ModelParallelStrategy``) (needs ``lightning``)."""

from hetcoll.lightning.rebalancing import Rebalancing
from hetcoll.lightning.strategy import BalancedStrategy

__all__ = ["BalancedStrategy", "Rebalancing"]
