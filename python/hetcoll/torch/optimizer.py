"""Sample-weighted data parallelism over MPI (mpi4py), for jobs launched with ``mpiexec`` and no
torch.distributed: wrap the optimizer, nothing else in the training loop changes (Horovod's
``DistributedOptimizer`` pattern, with the weighting Horovod never had).

``step()`` packs every gradient into fusion buffers of at most ``fusion_bytes`` (the Rust kernel
scales each by ``n_r / N`` while it copies), sums them in place with :func:`hetcoll.allreduce`
(``MPI_Allreduce``, or hetcoll's ring for large buffers), unpacks, and only then runs the
wrapped optimizer, so every rank applies the exact full-batch gradient
``sum_r n_r g_r / N``. ``N`` and an agreement check (every rank must hold the same number of
gradient elements, or all ranks raise) travel in one small ``MPI_Allgather`` per step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hetcoll import fusion
from hetcoll.collectives import allreduce
from hetcoll.torch.hooks import local_batch_value

_SUPPORTED = (torch.float32, torch.float64)


class DistributedOptimizer:
    """Wrap ``optimizer`` so that :meth:`step` first averages gradients across ``comm``'s ranks,
    weighted by each rank's ``local_batch``.

    >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
    ...                            local_batch=shares[rank])  # doctest: +SKIP
    >>> loss_fn(model(x), y).backward(); opt.local_batch = len(x); opt.step()  # doctest: +SKIP
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        comm: Any = None,
        *,
        local_batch: int,
        fusion_bytes: int = 64 << 20,
    ) -> None:
        from mpi4py import MPI

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer: must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if fusion_bytes < 1:
            raise ValueError(f"fusion_bytes: must be >= 1, got {fusion_bytes}")
        self.optimizer = optimizer
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.local_batch = local_batch
        self.fusion_bytes = int(fusion_bytes)

    @property
    def local_batch(self) -> int:
        return self._local_batch

    @local_batch.setter
    def local_batch(self, n: int) -> None:
        self._local_batch = local_batch_value(n)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def synchronize(self) -> None:
        """Replace every gradient by the sample-weighted mean over all ranks (collective)."""
        params = self._params()
        for i, p in enumerate(params):
            if p.device.type != "cpu" or p.dtype not in _SUPPORTED:
                raise TypeError(
                    f"optimizer: parameter {i} is {p.dtype} on {p.device}; the MPI path handles "
                    "float32/float64 CPU parameters"
                )
        grads: list[torch.Tensor] = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        numel = sum(g.numel() for g in grads)
        mine = np.array([self.local_batch, numel], dtype=np.float64)
        every = np.empty((self.comm.Get_size(), 2), dtype=np.float64)
        self.comm.Allgather(mine, every)
        if np.any(every[:, 1] != numel):
            raise ValueError(
                "optimizer: ranks disagree on the gradients to average (elements per rank: "
                f"{every[:, 1].astype(int).tolist()})"
            )
        total = float(every[:, 0].sum())
        if total <= 0:
            raise ValueError("local_batch: every rank reported 0 samples for this step")
        scale = self.local_batch / total
        for bucket in self._buckets(grads):
            flat = fusion.pack(bucket, scale=scale)
            allreduce(flat, self.comm)  # the engine's allreduce or hetcoll's ring, by size
            fusion.unpack(flat, bucket)

    def _buckets(self, grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Consecutive gradients of one dtype, at most ``fusion_bytes`` per bucket (a larger
        single gradient gets a bucket of its own)."""
        buckets: list[list[torch.Tensor]] = []
        size = 0
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if not buckets or buckets[-1][0].dtype != g.dtype or size + nbytes > self.fusion_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(g)
            size += nbytes
        return buckets

    def step(self, closure: Any = None) -> Any:
        """Average gradients across ranks, then step the wrapped optimizer."""
        self.synchronize()
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


def broadcast_parameters(module: torch.nn.Module, comm: Any = None, root: int = 0) -> None:
    """Copy ``root``'s parameters and buffers to every rank (call before training)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    for t in [*module.parameters(), *module.buffers()]:
        with torch.no_grad():
            view = t.detach().numpy() if t.is_contiguous() else None
            if view is None:
                raise ValueError("module: parameters must be contiguous to broadcast")
            comm.Bcast(view, root=root)
