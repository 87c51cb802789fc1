"""Filter parallelism of CNNs built on grouped convolutions, torchvision's ResNeXt-50 (32x4d)
and RegNet-X-400MF, on two gloo ranks of this host at their own speed (no emulation), equal
shares: the split that pairs each bottleneck's 1x1 convolutions across its grouped 3x3 one
(each rank runs whole groups of it) against the split with every layer gathering and the
grouped convolutions whole on every rank (``avoid_gathers=False``: what these models got
before grouped convolutions paired), and against one process training the unsplit model
(rank 0 alone, rank 1 waiting). One thread per rank; a step is forward, backward and SGD,
the slowest rank's; interleaved round by round.

    make bench-grouped-convs      # writes benches/results/grouped_convs.json

Lab code, like everything in benches/: it imports the library, the library never imports it.
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any

import pytest

from hetcoll import launch

#: Interleaved rounds (the first two warm up), each timing ``STEPS`` steps of every entry.
ROUNDS = 7
STEPS = 2
BATCH, SIZE = 8, 64
GROUP = (
    f"ResNeXt and RegNet split over 2 gloo ranks, equal shares, batch {BATCH} of "
    f"{SIZE}x{SIZE} (medians of {ROUNDS - 2} interleaved rounds)"
)
MODELS = {"ResNeXt-50 32x4d": "resnext50_32x4d", "RegNet-X-400MF": "regnet_x_400mf"}


def _steps(rank: int, world: int, name: str) -> dict[str, Any]:
    """Rank 0's median seconds per step of each entry, and each split's modes by count."""
    import torch
    import torch.distributed as dist
    import torchvision  # type: ignore[import-untyped]
    from torch.nn import functional as F

    from hetcoll.torch.filters import FilterParallelGroupedConv2d, filter_parallel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    build = getattr(torchvision.models, name)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, SIZE, SIZE, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    models: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the layers each split leaves whole, named
        models["paired"] = filter_parallel(build(num_classes=10), [1.0] * world)
        models["gathering"] = filter_parallel(
            build(num_classes=10), [1.0] * world, avoid_gathers=False
        )
    models["one process"] = build(num_classes=10)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}

    def step(key: str) -> None:
        opts[key].zero_grad()
        F.cross_entropy(models[key](x), y).backward()
        opts[key].step()

    times: dict[str, list[float]] = {k: [] for k in models}
    order = list(models)
    for r in range(ROUNDS):
        for key in order if r % 2 else order[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            if key != "one process" or rank == 0:
                for _ in range(STEPS):
                    step(key)
            dist.barrier()
            if r >= 2:
                times[key].append((time.perf_counter() - t0) / STEPS)
    grouped = sum(isinstance(m, FilterParallelGroupedConv2d) for m in models["paired"].modules())
    modes: dict[str, int] = {}
    for m in models["paired"].modules():
        mode = getattr(m, "mode", None)
        if isinstance(mode, str):
            modes[mode] = modes.get(mode, 0) + 1
    return {
        "median": {k: statistics.median(t) for k, t in times.items()},
        "ratios": [p / g for p, g in zip(times["paired"], times["gathering"], strict=True)],
        "grouped": grouped,
        "modes": modes,
    }


@pytest.mark.parametrize("model", list(MODELS))
def test_grouped_convolutions_split_by_whole_groups(figure, model):
    got = launch.spawn(_steps, 2, MODELS[model], threads_per_rank=1, timeout=1200)[0]
    med = got["median"]
    paired, gathering, alone = med["paired"], med["gathering"], med["one process"]
    ratios = sorted(got["ratios"])
    modes = ", ".join(f"{n} {mode}" for mode, n in sorted(got["modes"].items()))
    figure(
        GROUP,
        f"{model}: step time, every layer gathering / paired across the grouped convolutions",
        f"{gathering / paired:.2f}x ({paired * 1e3:.0f} ms against {gathering * 1e3:.0f} ms; "
        f"rounds' gathering / paired {1 / ratios[-1]:.2f}-{1 / ratios[0]:.2f}; "
        f"{got['grouped']} grouped convolutions split, {modes})",
        headline=model.startswith("ResNeXt"),
    )
    figure(
        GROUP,
        f"{model}: step time, one process / paired split",
        f"{alone / paired:.2f}x ({alone * 1e3:.0f} ms against {paired * 1e3:.0f} ms; every "
        f"layer gathering: {alone / gathering:.2f}x)",
    )
