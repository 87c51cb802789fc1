"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on uneven shares, inside every rank of real
gloo jobs (tests/test_fsdp.py). FSDP averages the ranks' gradients by their number; each
rank's loss, weighed by :func:`hetcoll.torch.weigh_loss`, makes that the gradient of the
whole global batch's mean, which one process computes: the parameters after training must
equal its (float64). Models: an MLP (the ragged last batch, a rank with no row), Hugging
Face's GPT-2 from a config (sharded by its blocks, a ModuleList; the loss over valid tokens)
and torchvision's VisionTransformer (sharded by its encoder layers)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.utils.data import DataLoader

from hetcoll.errors import CollectiveMismatchError
from hetcoll.torch import BalancedSampler, StepTimer, weigh_loss

from lm_common import hf_gpt2

ROWS, BATCH = 29, 8  # 29 = 3 * 8 + 5: each epoch ends on a smaller batch
VOCAB, SEQ = 40, 10


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)
    ).double()


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return hf_gpt2(vocab=VOCAB, hidden=16, layers=3, heads=4, positions=16).double()


def vit() -> nn.Module:
    from torchvision.models import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(
        image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
        num_classes=5,
    ).double()  # fmt: skip


def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, 5, generator=g, dtype=torch.float64)
    return x, torch.randn(ROWS, 2, generator=g, dtype=torch.float64)


def token_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows and their labels, each row padded (-100) after a length of its own."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g)
    lengths = torch.randint(2, SEQ + 1, (ROWS,), generator=g)
    labels = ids.masked_fill(torch.arange(SEQ) >= lengths[:, None], -100)
    return ids, labels


def image_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS, 3, 16, 16, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 5, (ROWS,), generator=g)


def token_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean over the valid next-token targets (the labels shifted by one), in float64."""
    logits = model(input_ids=ids).logits
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def token_count(labels: torch.Tensor) -> torch.Tensor:
    return (labels[:, 1:] != -100).sum()


#: Per model: the model, its data, its loss, what the loss averages over, its blocks to shard.
CASES: dict[str, Any] = {
    "mlp": (
        mlp,
        regression_data,
        lambda m, x, y: nn.functional.mse_loss(m(x), y),
        lambda x, y: len(x),
        lambda m: [m[0], m[2], m[4]],
    ),
    "gpt2": (gpt2, token_data, token_loss, lambda x, y: token_count(y), lambda m: m.transformer.h),
    "vit": (
        vit,
        image_data,
        lambda m, x, y: nn.functional.cross_entropy(m(x), y),
        lambda x, y: len(x),
        lambda m: m.encoder.layers,
    ),
}


def train(
    case: str,
    shares: list[int],
    rank: int,
    epochs: int,
    weighed: bool = True,
    accumulate: int = 1,
) -> list[torch.Tensor]:
    """Train ``case`` with SGD (momentum) for ``epochs`` over a BalancedSampler's ``shares``;
    this rank's view of the parameters after (every rank's full tensors; one process:
    ``shares`` of one rank). ``weighed``: each loss through weigh_loss, else FSDP's plain
    mean. ``accumulate``: micro-batches per optimizer step (the mean of their means; FSDP
    reduces the gradients at the last only, ``set_requires_gradient_sync``)."""
    make, load, loss_fn, count, blocks = CASES[case]
    model = make()
    sharded = dist.is_initialized()
    if sharded:
        for block in blocks(model):
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = load()
    sampler = BalancedSampler(range(ROWS), shares, rank, shuffle=True, seed=0, verify=False)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        batches = list(sampler.batch_sampler())
        for start in range(0, len(batches), accumulate):
            micro = batches[start : start + accumulate]
            for i, idx in enumerate(micro):
                if sharded:
                    model.set_requires_gradient_sync(i == len(micro) - 1)
                loss = loss_fn(model, x[idx], y[idx])
                if weighed and sharded:
                    loss = weigh_loss(loss, count(x[idx], y[idx]))
                (loss / len(micro)).backward()
            opt.step()
            opt.zero_grad()
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return [p.detach().clone() for p in full]


def trained(
    rank: int, world: int, case: str, shares: list[int], epochs: int, accumulate: int = 1
) -> dict[str, Any]:
    """This rank's parameters trained with and without weighing."""
    return {
        "weighed": train(case, shares, rank, epochs, accumulate=accumulate),
        "plain": train(case, shares, rank, epochs, weighed=False, accumulate=accumulate),
    }


def bad_inputs(rank: int, world: int) -> dict[str, str]:
    """Each bad call on one rank: what every rank raised."""
    loss = torch.tensor(1.0, dtype=torch.float64)
    raised: dict[str, str] = {}
    calls = {
        "count -1 on rank 1": lambda: weigh_loss(loss, -1 if rank == 1 else 3),
        "count 2.5 on rank 0": lambda: weigh_loss(loss, 2.5 if rank == 0 else 3),
        "a bool tensor on rank 0": lambda: weigh_loss(loss, torch.tensor(True) if rank == 0 else 3),
        "complex loss on rank 1": lambda: weigh_loss(
            loss.to(torch.complex128) if rank == 1 else loss, 3
        ),
        "zero everywhere": lambda: weigh_loss(loss, 0),
        "loss not a tensor on rank 0": lambda: weigh_loss(1.0 if rank == 0 else loss, 3),
        "per-row loss on rank 0": lambda: weigh_loss(loss.expand(3) if rank == 0 else loss, 3),
        "integer loss on rank 1": lambda: weigh_loss(torch.tensor(2) if rank == 1 else loss, 3),
    }
    for name, call in calls.items():
        try:
            call()
        except (TypeError, ValueError, CollectiveMismatchError) as e:
            raised[name] = f"{type(e).__name__}: {e}"
        else:
            raised[name] = "nothing"
    # Every rank is still in step after those: a good call weighs right (a one-element numpy
    # array is a count).
    raised["good"] = str(float(weigh_loss(loss, np.array([1 + rank]))))
    fsdp1 = FullyShardedDataParallel(mlp(), device_id=torch.device("cpu"))
    try:
        StepTimer(fsdp1)
    except ValueError as e:
        raised["timer fsdp1"] = str(e)
    # Tensor parallelism (a column-wise split of each linear layer over the ranks): its
    # collectives inside the layers are not FSDP's, which the timer leaves out.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tp = parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": ColwiseParallel()})
    try:
        StepTimer(tp)
    except ValueError as e:
        raised["timer tensor parallel"] = str(e)
    # A torch whose FSDP lacks a method the timer wraps: refused, nothing left wrapped.
    model = mlp()
    fully_shard(model)
    group = model._get_fsdp_state()._fsdp_param_group
    group.post_backward = None
    try:
        StepTimer(model)
    except ValueError as e:
        raised["timer without post_backward"] = str(e)
    raised["left wrapped"] = str(sorted(n for n in ("pre_forward", "unshard") if n in vars(group)))
    # A timer made before sharding: its hooks are on the parameters fully_shard replaced.
    model = mlp()
    timer = StepTimer(model)
    fully_shard(model)
    model(torch.zeros(2, 5, dtype=torch.float64)).sum().backward()
    try:
        timer.pop()
    except RuntimeError as e:
        raised["timer before sharding"] = str(e)
    return raised


def lightning_main(out: str, shares: list[int], epochs: int, slow_s: float = 0.0) -> None:
    """Under ``torchrun``: Lightning's ``ModelParallelStrategy`` (FSDP2 applied in
    ``configure_model`` over its data-parallel mesh) trains GPT-2 on a ``BalancedSampler``'s
    ``shares`` (``use_distributed_sampler=False``: the loader is the user's), each step's loss
    weighed in ``training_step``; each rank writes its full parameters to ``out/rank{r}.pt``.
    ``slow_s``: rank 1 sleeps that long in each block's forward, and a ``Rebalancing`` callback
    moves the shares every 2 batches. Each rank's final shares and the number of decisions
    that moved them go to ``out/rank{r}.json``."""
    import gc
    import json
    import os
    import time

    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy

    from hetcoll.lightning import Rebalancing
    from hetcoll.torch import Rebalancer

    rank = int(os.environ["RANK"])
    _, load, loss_fn, count, blocks = CASES["gpt2"]

    class LM(pl.LightningModule):
        def configure_model(self) -> None:
            self.model = gpt2()  # float64: Lightning's precision plugin leaves it so
            mesh = self.device_mesh["data_parallel"]
            for block in blocks(self.model):
                if slow_s and rank == 1:
                    block.mlp.register_forward_hook(lambda *_: time.sleep(slow_s))
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            ids, labels = batch
            return weigh_loss(loss_fn(self.model, ids, labels), count(ids, labels))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    ids, labels = load()
    sampler = BalancedSampler(range(ROWS), shares, rank, shuffle=True, seed=0, verify=False)
    rows = [(ids[i], labels[i]) for i in range(ROWS)]
    # Lightning sets the epoch of the batch sampler's sampler, this BalancedSampler.
    loader = DataLoader(rows, batch_sampler=sampler.batch_sampler())
    rebalancer = Rebalancer(sampler, every=2) if slow_s else None
    trainer = pl.Trainer(
        callbacks=[Rebalancing(rebalancer)] if rebalancer is not None else [],
        strategy=ModelParallelStrategy(data_parallel_size=len(shares), tensor_parallel_size=1),
        accelerator="cpu", devices=len(shares), max_epochs=epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    lm = LM()
    trainer.fit(lm, loader)
    full = [p.full_tensor().detach().clone() for p in lm.model.parameters()]
    torch.save(full, f"{out}/rank{rank}.pt")
    moved = sum(e.applied for e in rebalancer.history) if rebalancer is not None else 0
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"shares": list(sampler.shares), "moved": moved}, f)
    # An orderly end: FSDP's mesh holds process groups, which, freed at exit after a peer left,
    # aborted a rank once in gloo's teardown ("terminate called without an active
    # exception"); they go first, then the ranks leave the group together.
    del trainer, lm, full
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def timed_steps(rank: int, world: int, slow_s: float) -> dict[str, Any]:
    """GPT-2 sharded by its blocks, rank 1 sleeping ``slow_s`` in each block's forward: each
    rank's StepTimer seconds and wall seconds for a step, for a step of two micro-batches
    (gradients reduced at the second only), for a step followed by an evaluation before the
    timer is read, with a second timer made and removed, and with only the blocks sharded (the
    embeddings whole); whether removing the timer, or dropping it, restored FSDP's methods."""
    import gc
    import time

    _, load, loss_fn, count, blocks = CASES["gpt2"]
    ids, labels = load()
    ids, labels = ids[:4], labels[:4]

    def sharded(root: bool) -> nn.Module:
        model = gpt2()
        for block in blocks(model):
            if rank == 1:
                block.mlp.register_forward_hook(lambda *_: time.sleep(slow_s))
            fully_shard(block)
        if root:
            fully_shard(model)
        return model

    def step(model: nn.Module, micro: int = 1) -> None:
        for i in range(micro):
            for block in blocks(model):
                block.set_requires_gradient_sync(i == micro - 1)
            # weigh_loss's exchange waits for the slow rank inside the step: left out too.
            weigh_loss(loss_fn(model, ids, labels), count(ids, labels)).backward()

    def timed(model: nn.Module, timer: StepTimer, micro: int = 1, evaluate: bool = False):
        dist.barrier()
        started = time.perf_counter()
        step(model, micro)
        wall = time.perf_counter() - started
        if evaluate:  # FSDP's spans after the step's end are not in it
            with torch.no_grad():
                model(input_ids=ids)
        return timer.pop(), wall

    def wrapped(model: nn.Module) -> bool:
        groups = [g for b in blocks(model) for g in [b._get_fsdp_state()._fsdp_param_group]]
        return any(name in vars(g) for g in groups for name in ("pre_forward", "post_backward"))

    model = sharded(root=True)
    timer = StepTimer(model)  # after fully_shard: on the sharded parameters
    step(model)  # FSDP's lazy set-up
    timer.pop()
    out: dict[str, Any] = {
        "step": timed(model, timer),
        "two micro-batches": timed(model, timer, micro=2),
        "evaluated before pop": timed(model, timer, evaluate=True),
    }
    with torch.no_grad():
        model(input_ids=ids)  # an evaluation: no step
    try:
        timer.pop()
    except RuntimeError as e:
        out["evaluation"] = str(e)
    second = StepTimer(model)
    second.remove()  # the first timer's spans stay
    out["beside a removed timer"] = timed(model, timer)
    timer.remove()
    out["restored"] = not wrapped(model)
    dropped = StepTimer(model)
    del dropped
    gc.collect()
    out["restored when dropped"] = not wrapped(model)
    step(model)  # FSDP's own methods still train
    blocks_only = sharded(root=False)
    timer = StepTimer(blocks_only)
    step(blocks_only)
    timer.pop()
    out["blocks only"] = timed(blocks_only, timer)
    return out


if __name__ == "__main__":
    import sys

    lightning_main(
        sys.argv[1],
        [int(s) for s in sys.argv[2].split(",")],
        int(sys.argv[3]),
        float(sys.argv[4]) if len(sys.argv) > 4 else 0.0,
    )
