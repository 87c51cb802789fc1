"""The full state dict of a model held over ranks, for a checkpoint: DCP's
``get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
cpu_offload=True))`` of a filter-parallel split (hetcoll assembles its slices on rank 0),
against the same call on the same model sharded by FSDP2 (``fully_shard``: torch gathers its
DTensors), the peer, and against hetcoll's own gathers (``gather_state_dict`` and
``gather_optimizer_state_dict`` to rank 0).

Two gloo CPU ranks, one thread each, on one host. The model is a GPT-2 built from a config
(4 blocks of width 512, 8 heads, a byte vocabulary: 12.8M parameters, the embedding tied to the
head), split 1 : 1 by ``filter_parallel`` (its attention by heads, its MLPs by hidden units;
embeddings and norms whole on both ranks) and sharded by FSDP2 by its blocks, then its root
(each parameter's rows evenly). Both are stepped once by AdamW, so the state dict holds the
model's weights and the optimizer's two moments: ~150 MB in float32. Each way is timed by rank
0's clock from a barrier to its result, over 5 calls after one warm-up, in each of 5 launches
(the three ways take turns in a launch, their order rotated from launch to launch).

    make bench-full-state      # writes benches/results/full_state.json

Lab code, like everything in benches/: it imports the library, the library never imports it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from hetcoll import launch

LAUNCHES = 5
CALLS = 5
#: The three ways, as each launch runs them (rotated by the launch's index).
WAYS = ("fsdp2", "split", "gather")
NAMES = {
    "fsdp2": "FSDP2, get_state_dict(full_state_dict, cpu_offload)",
    "split": "filter_parallel, get_state_dict(full_state_dict, cpu_offload)",
    "gather": "filter_parallel, gather_state_dict + gather_optimizer_state_dict (dst=0)",
}
GROUP = (
    "full state dict (model and AdamW state, ~150 MB) of GPT-2 (4 blocks of width 512) on 2 "
    "gloo ranks, to rank 0's host memory"
)


def _model() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_embd=512,
        n_layer=4,
        n_head=8,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def _stepped(model: Any) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return opt


def _way(name: str) -> tuple[list[float], int]:
    """Rank 0's seconds for each of :data:`CALLS` calls of way ``name`` (after a warm-up),
    and the bytes of the state rank 0 got."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import fully_shard

    from hetcoll.torch import filter_parallel, gather_optimizer_state_dict, gather_state_dict

    model = _model()
    if name == "fsdp2":
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    else:
        model = filter_parallel(model, speeds=[1.0, 1.0])
    opt = _stepped(model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def call() -> Any:
        if name == "gather":
            return gather_state_dict(model, dst=0), gather_optimizer_state_dict(model, opt, dst=0)
        return get_state_dict(model, opt, options=options)

    seconds, got = [], None
    for i in range(CALLS + 1):
        dist.barrier()
        start = time.perf_counter()
        got = call()
        if i:
            seconds.append(time.perf_counter() - start)
    return seconds, _bytes(got)


def _bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_bytes(v) for v in state)
    return 0


def job(rank: int, world: int, launch_index: int) -> dict[str, Any] | None:
    """One launch: every way, in the order this launch takes them."""
    import warnings

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="filter_parallel: left replicated")
    k = launch_index % len(WAYS)
    out = {}
    for name in WAYS[k:] + WAYS[:k]:
        out[name] = _way(name)
    return out if rank == 0 else None


def test_full_state_dict(figure: Any) -> None:
    launches = [launch.spawn(job, 2, i, timeout=900)[0] for i in range(LAUNCHES)]
    medians = {w: [statistics.median(run[w][0]) for run in launches] for w in WAYS}
    for w in WAYS:
        runs = ", ".join(f"{1e3 * m:.0f}" for m in medians[w])
        size = launches[0][w][1] / 1e6
        figure(
            GROUP,
            f"{NAMES[w]}: time (ms)",
            f"{1e3 * statistics.median(medians[w]):.0f} (launches: {runs}); rank 0 got "
            f"{size:.0f} MB",
        )
    for w in ("split", "gather"):
        ratios = [f / s for f, s in zip(medians["fsdp2"], medians[w], strict=True)]
        figure(
            GROUP,
            f"{NAMES[w]} vs FSDP2's (FSDP2's time / its time)",
            f"{statistics.median(ratios):.2f}x (launches: {', '.join(f'{r:.2f}' for r in ratios)})",
            headline=w == "split",
        )
