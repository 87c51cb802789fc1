"""hetcoll.partition_hypergraph vs Mt-KaHyPar (default preset), same instances, same run.

Instances, in families: column-net hypergraphs of scipy.sparse random matrices (rows are
vertices, each column is a net over the rows with a nonzero in it) and of a 2D 5-point stencil
(banded); geometric kNN hypergraphs in 2-D and 3-D (points uniform in the unit square/cube, one
net per point: itself and its ``KNN`` nearest neighbours); power-law nets (Chung-Lu: net sizes
and vertex degrees Pareto-distributed); and the weighted seed-002 hypergraphs
(``hetcoll.model.network_hypergraph``) of CNNs: two small ones, VGG-11's convolutional stack and
a plain (no-shortcut) ResNet-18 chain, both at reduced width and 32x32 inputs
(``network_hypergraph`` reads chains of layers only, so ResNet's shortcuts are left out); k = 2,
4, 8; uniform targets and heterogeneous ones (speeds 4:2:1:1 repeated). Mt-KaHyPar gets the
same limits as individual maximum block weights ``floor((1 + eps) * targets[b] * W)`` (it takes
integer weights, so weights are rounded to integers for both), one thread, the default preset.

The CNN network family (issue 42, instances named ``net ...``): the hypergraphs of a CIFAR CNN
(5 convolutions, 2 linear layers), VGG-11 and the ResNet-18 chain at half and full width, and
MobileNetV3-small's chain of convolutions (224x224 inputs), at device speeds 1:0.5, 1:0.5:0.25,
0.5:0.3:0.2, 4:2:1:1, (1:0.5:0.25) x 2 and (4:2:1:1) x 2, three of them also with memory
capacities (each vertex's parameters' training state; every device holds at most
``MEMORY_SLACK`` times an even share, or the largest layer's). Each cell reports km1, the bytes
per step it means at batch ``BATCH`` (forward maps and backward gradients, from the nets' true
bytes) and the time, beside Mt-KaHyPar's; Mt-KaHyPar takes no memory constraint, so with
capacities it partitions without them and the table says whether its partition fits.

    python benches/compare_partitioners.py [--quick] [--family PREFIX] [--repeat N] [--json F]

Needs ``mtkahypar`` (the ``bench`` dependency group, which ``make bench`` installs; hetcoll does
not depend on it). Lab code, like everything in benches/: it imports the library, the library
never imports it.
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

import hetcoll

EPS = 0.03
#: Neighbours per point in the geometric kNN hypergraphs.
KNN = 8


def column_net(matrix: sp.spmatrix) -> list[np.ndarray]:
    csc = sp.csc_matrix(matrix)
    nets = [csc.indices[csc.indptr[j] : csc.indptr[j + 1]] for j in range(csc.shape[1])]
    return [np.asarray(n, dtype=np.int64) for n in nets if len(n) >= 2]


def random_matrix(n: int, nnz_per_row: int, seed: int) -> sp.spmatrix:
    rng = np.random.default_rng(seed)
    return sp.random(n, n, density=nnz_per_row / n, format="csr", random_state=rng) + sp.eye(n)


def stencil(side: int) -> sp.spmatrix:
    one = sp.diags([1.0, 1.0, 1.0], [-1, 0, 1], shape=(side, side))
    return sp.kron(one, sp.eye(side)) + sp.kron(sp.eye(side), one)


def knn_nets(n: int, dim: int, seed: int) -> list[np.ndarray]:
    """One net per point of ``n`` uniform points in ``[0, 1]^dim``: itself and its KNN nearest."""
    from scipy.spatial import cKDTree

    points = np.random.default_rng(seed).random((n, dim))
    _, near = cKDTree(points).query(points, k=KNN + 1)
    # The point itself is among its nearest (distance 0); duplicates cannot occur.
    return [np.asarray(row, dtype=np.int64) for row in near]


def power_law_nets(n: int, m: int, seed: int) -> list[np.ndarray]:
    """Chung-Lu style: net sizes Pareto(1.5)-distributed (2 to n/10 pins), each pin drawn with
    probability proportional to a Pareto(1.5) vertex weight, so vertex degrees are heavy-tailed.
    """
    rng = np.random.default_rng(seed)
    affinity = rng.pareto(1.5, n) + 1.0
    p = affinity / affinity.sum()
    sizes = np.minimum(np.floor(2 * (rng.pareto(1.5, m) + 1.0)).astype(np.int64), n // 10)
    # All pins in one draw (inverse transform on the cumulative affinities), then cut into nets.
    pins = np.minimum(np.searchsorted(np.cumsum(p), rng.random(int(sizes.sum()))), n - 1)
    nets = []
    for chunk in np.split(pins, np.cumsum(sizes)[:-1]):
        net = np.unique(chunk)
        if len(net) >= 2:
            nets.append(net.astype(np.int64))
    return nets


Instance = tuple[str, int, list[np.ndarray], np.ndarray, np.ndarray]


def vgg11_features(width: float) -> Any:
    """VGG-11's convolutional stack (configuration A) at ``width`` times its channels, with a
    small classifier for 32x32 inputs."""
    import torch

    layers: list[torch.nn.Module] = []
    channels = 3
    for c in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):
        if c == "M":
            layers.append(torch.nn.MaxPool2d(2))
            continue
        out = max(1, int(int(c) * width))
        layers += [torch.nn.Conv2d(channels, out, 3, padding=1), torch.nn.ReLU()]
        channels = out
    return torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.Linear(channels, 10))


def plain_resnet18(width: float) -> Any:
    """ResNet-18's layers as a chain (stem, 4 stages of 2 basic blocks, 3x3 convolutions, stride
    2 between stages) at ``width`` times its channels, shortcuts left out."""
    import torch

    w = [max(1, int(c * width)) for c in (64, 128, 256, 512)]
    layers: list[torch.nn.Module] = [
        torch.nn.Conv2d(3, w[0], 3, padding=1),
        torch.nn.BatchNorm2d(w[0]),
        torch.nn.ReLU(),
    ]
    channels = w[0]
    for stage, out in enumerate(w):
        for conv in range(4):
            stride = 2 if stage > 0 and conv == 0 else 1
            layers += [
                torch.nn.Conv2d(channels, out, 3, stride=stride, padding=1),
                torch.nn.BatchNorm2d(out),
                torch.nn.ReLU(),
            ]
            channels = out
    return torch.nn.Sequential(
        *layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(channels, 10)
    )


def real_cnn_instances(quick: bool) -> list[Instance]:
    """VGG-11 and plain ResNet-18 hypergraphs at a quarter (quick) or half of their width."""
    try:
        import torch

        from hetcoll.model import network_hypergraph
    except ImportError:
        return []
    torch.manual_seed(0)
    width = 0.25 if quick else 0.5
    out = []
    for name, model in [("vgg11", vgg11_features(width)), ("resnet18", plain_resnet18(width))]:
        h = network_hypergraph(model, (3, 32, 32))
        out.append(
            (f"cnn {name} x{width}", h.num_vertices, h.nets, h.vertex_weights, h.net_weights)
        )
    return out


def cnn_instances() -> list[Instance]:
    try:
        import torch

        from hetcoll.model import network_hypergraph
    except ImportError:
        return []
    torch.manual_seed(0)
    small = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(64, 128, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(128 * 8 * 8, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    # The seed-000 network: 8 conv layers of 60..480 3x3 filters, pooling every second layer.
    layers: list[torch.nn.Module] = []
    channels = 3
    for i, width in enumerate([60, 60, 120, 120, 240, 240, 480, 480]):
        layers += [torch.nn.Conv2d(channels, width, 3, padding=1), torch.nn.ReLU()]
        if i % 2:
            layers.append(torch.nn.MaxPool2d(2))
        channels = width
    seed000 = torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.Linear(480 * 2 * 2, 10))
    out = []
    for name, model, shape in [
        ("cnn-cifar small", small, (3, 32, 32)),
        ("cnn seed-000 8 conv", seed000, (3, 32, 32)),
    ]:
        h = network_hypergraph(model, shape)
        out.append((name, h.num_vertices, h.nets, h.vertex_weights, h.net_weights))
    return out


def cifar_cnn() -> Any:
    """A CIFAR-style CNN: 5 convolutions (32, 32, 64, 64, 128 filters, pooling after the 2nd, 4th
    and 5th) and 2 linear layers (256 neurons, 10 classes)."""
    import torch

    c = torch.nn
    return c.Sequential(
        c.Conv2d(3, 32, 3, padding=1), c.ReLU(), c.Conv2d(32, 32, 3, padding=1), c.ReLU(),
        c.MaxPool2d(2),
        c.Conv2d(32, 64, 3, padding=1), c.ReLU(), c.Conv2d(64, 64, 3, padding=1), c.ReLU(),
        c.MaxPool2d(2),
        c.Conv2d(64, 128, 3, padding=1), c.ReLU(), c.MaxPool2d(2),
        c.Flatten(), c.Linear(128 * 4 * 4, 256), c.ReLU(), c.Linear(256, 10),
    )  # fmt: skip


def mobilenet_v3_small_convs() -> Any:
    """torchvision's MobileNetV3-small, its convolutions as a chain in execution order (stem,
    each inverted residual's expansion, depthwise and projection convolutions, the last 1x1):
    ``network_hypergraph`` reads chains only, so the squeeze-excitation branches and the
    shortcuts are left out, and so is the classifier."""
    import torch
    import torchvision  # type: ignore[import-untyped]
    from torchvision.ops.misc import SqueezeExcitation  # type: ignore[import-untyped]

    convs: list[torch.nn.Module] = []

    def walk(module: torch.nn.Module) -> None:
        for child in module.children():
            if isinstance(child, SqueezeExcitation):
                continue
            if isinstance(child, torch.nn.Conv2d):
                convs.extend([child, torch.nn.Hardswish()])
            else:
                walk(child)

    walk(torchvision.models.mobilenet_v3_small().features)
    return torch.nn.Sequential(*convs)


#: The CNN network family (issue 42): name, model builder, one sample's shape.
NETWORKS: tuple[tuple[str, Any, tuple[int, int, int]], ...] = (
    ("cifar cnn 5 conv 2 fc", cifar_cnn, (3, 32, 32)),
    ("vgg11 x0.5", lambda: vgg11_features(0.5), (3, 32, 32)),
    ("vgg11 x1", lambda: vgg11_features(1.0), (3, 32, 32)),
    ("resnet18 chain x0.5", lambda: plain_resnet18(0.5), (3, 32, 32)),
    ("resnet18 chain x1", lambda: plain_resnet18(1.0), (3, 32, 32)),
    ("mobilenetv3-small convs", mobilenet_v3_small_convs, (3, 224, 224)),
)

#: Device speeds of the CNN network family's cells (targets proportional to speed).
NETWORK_SPEEDS: tuple[tuple[float, ...], ...] = (
    (1.0, 0.5),
    (1.0, 0.5, 0.25),
    (0.5, 0.3, 0.2),
    (4.0, 2.0, 1.0, 1.0),
    (1.0, 0.5, 0.25) * 2,
    (4.0, 2.0, 1.0, 1.0) * 2,
)

#: Speeds of the cells that are also run with memory capacities.
NETWORK_MEMORY_SPEEDS = ((1.0, 0.5, 0.25), (4.0, 2.0, 1.0, 1.0), (4.0, 2.0, 1.0, 1.0) * 2)

#: Bytes of a parameter's training state: fp32 weight, gradient and Adam's two moments.
STATE_BYTES = 16
#: Memory capacities: every device (equal memories, unequal speeds) holds at most this many
#: times an even share of the parameters' training state, or of the largest layer's if that is
#: more (a layer holding most of the parameters, as a CNN's first linear layer does, would
#: otherwise have to be cut apart however much that costs). At 1.1 the slow devices of a
#: pipeline cannot hold VGG-11's or ResNet-18's parameter-heavy last layers at all, and km1 is
#: 4-9x Mt-KaHyPar's unconstrained partition's: a comparison of different problems.
MEMORY_SLACK = 2.0
#: Batch of the bytes per step reported for the network family.
BATCH = 64


def network_instances(
    networks: tuple[tuple[str, Any, tuple[int, int, int]], ...] = NETWORKS,
) -> list[dict[str, Any]]:
    """The CNN network family's hypergraphs: integer weights for both partitioners (as for the
    other CNN instances), the nets' bytes per sample, and each vertex's memory (its parameters'
    training state, ``STATE_BYTES`` per parameter)."""
    import torch

    from hetcoll.model import network_hypergraph

    out = []
    for name, build, shape in networks:
        torch.manual_seed(0)
        model = build()
        h = network_hypergraph(model, shape)
        memory = np.zeros(h.num_vertices)
        largest = 0.0
        for layer, first, count in h.layers:
            params = sum(p.numel() for p in model.get_submodule(layer).parameters())
            memory[first : first + count] = STATE_BYTES * params / count
            largest = max(largest, float(STATE_BYTES * params))
        vw = np.maximum(1, np.round(h.vertex_weights / max(1.0, h.vertex_weights.max() / 1e4)))
        nw = np.maximum(1, np.round(h.net_weights / max(1.0, h.net_weights.max() / 1e4)))
        out.append(
            dict(
                name=f"net {name}", n=h.num_vertices, nets=h.nets, vw=vw, nw=nw,
                net_bytes=h.net_weights, memory=memory, largest_layer_memory=largest,
            )
        )  # fmt: skip
    return out


def speeds_label(speeds: tuple[float, ...]) -> str:
    return ":".join(f"{s:g}" for s in speeds)


def targets_for(k: int, hetero: bool) -> list[float]:
    speeds = [(4.0, 2.0, 1.0, 1.0)[b % 4] if hetero else 1.0 for b in range(k)]
    return [s / sum(speeds) for s in speeds]


def km1_of(nets, parts, net_weights) -> float:
    return hetcoll.km1(nets, parts, net_weights)


def balanced(parts, vw, targets) -> bool:
    w = np.bincount(parts, weights=vw, minlength=len(targets))
    total = float(np.sum(vw))
    return all(w[b] <= (1 + EPS) * targets[b] * total for b in range(len(targets)))


def run_mtkahypar(mtkahypar, mtk, n, nets, vw, nw, targets):
    """Mt-KaHyPar's partition (the module ``mtkahypar``, initialised as ``mtk``) and seconds."""
    ctx = mtk.context_from_preset(mtkahypar.PresetType.DEFAULT)
    ctx.set_partitioning_parameters(len(targets), EPS, mtkahypar.Objective.KM1)
    total = int(np.sum(vw))
    ctx.set_individual_target_block_weights([math.floor((1 + EPS) * t * total) for t in targets])
    mtkahypar.set_seed(0)
    ctx.logging = False
    hg = mtk.create_hypergraph(
        ctx, n, len(nets), [list(map(int, e)) for e in nets], list(map(int, vw)), list(map(int, nw))
    )
    start = time.perf_counter()
    phg = hg.partition(ctx)
    seconds = time.perf_counter() - start
    parts = np.array([phg.block_id(v) for v in range(n)], dtype=np.int64)
    return parts, seconds


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


#: Families: a name and the prefix of its instances' names.
FAMILIES: tuple[tuple[str, str], ...] = (
    ("random matrices", "random"),
    ("stencil", "stencil"),
    ("kNN 2-D", "knn 2-D"),
    ("kNN 3-D", "knn 3-D"),
    ("power-law", "power-law"),
    ("CNN hypergraphs", "cnn"),
    ("CNN networks (issue 42)", "net "),
)

#: Summary rows: a name and which runs it covers (a run's record).
GROUPS: tuple[tuple[str, Any], ...] = (
    ("all", lambda r: True),
    ("all but the CNN network family", lambda r: not r["instance"].startswith("net ")),
    (
        "beyond banded (kNN, power-law, CNN)",
        lambda r: r["instance"].startswith(("knn", "power", "cnn", "net ")),
    ),
    ("uniform targets", lambda r: not r["hetero"]),
    ("heterogeneous targets", lambda r: r["hetero"]),
    *(
        (family, lambda r, prefix=prefix: r["instance"].startswith(prefix))
        for family, prefix in FAMILIES
    ),
    (
        "CNN networks without memory capacities",
        lambda r: r["instance"].startswith("net ") and not r.get("memory"),
    ),
    (
        "CNN networks with memory capacities",
        lambda r: r["instance"].startswith("net ") and bool(r.get("memory")),
    ),
)


def instances(quick: bool, family: str | None) -> list[Instance]:
    """The benchmark's instances (``quick``: the small sizes), of one family's prefix if given."""
    out: list[Instance] = []

    def want(prefix: str) -> bool:
        return family is None or prefix.startswith(family)

    if want("random"):
        for n, d in [(10_000, 5)] if quick else [(10_000, 5), (30_000, 5), (100_000, 4)]:
            nets = column_net(random_matrix(n, d, seed=n))
            out.append((f"random {n} x {n}, {d}/row", n, nets, np.ones(n), np.ones(len(nets))))
    if want("stencil"):
        side = 100 if quick else 200
        nets = column_net(stencil(side))
        n = side * side
        out.append((f"stencil {side}x{side}", n, nets, np.ones(n), np.ones(len(nets))))
    for dim in (2, 3):
        if want(f"knn {dim}-D"):
            for n in [3_000] if quick else [3_000, 10_000]:
                nets = knn_nets(n, dim, seed=n + dim)
                out.append((f"knn {dim}-D {n} pts", n, nets, np.ones(n), np.ones(len(nets))))
    if want("power-law"):
        for n in [5_000] if quick else [5_000, 20_000]:
            nets = power_law_nets(n, n, seed=n)
            out.append((f"power-law {n}", n, nets, np.ones(n), np.ones(len(nets))))
    if want("cnn"):
        for name, n, nets, vw, nw in cnn_instances() + real_cnn_instances(quick):
            # Integer weights for both partitioners (Mt-KaHyPar takes integers only).
            vw = np.maximum(1, np.round(vw / max(1.0, vw.max() / 1e4)))
            nw = np.maximum(1, np.round(nw / max(1.0, nw.max() / 1e4)))
            out.append((name, n, nets, vw, nw))
    return out


def results_file(runs: list[dict[str, Any]], quick: bool, repeat: int) -> dict[str, Any]:
    """The runs as a results file for benches/report.py: every run, then the summary groups."""
    from report import RATIO, SCHEMA, host_info, now

    summary = []
    for group, covers in GROUPS:
        chosen = [r for r in runs if covers(r)]
        if chosen:
            km1 = [r["km1_ratio"] for r in chosen]
            summary.append(
                [
                    group,
                    len(chosen),
                    geomean(km1),
                    max(km1),
                    geomean([r["time_ratio"] for r in chosen]),
                    sum(r["balanced_hetcoll"] and r["balanced_mtkahypar"] for r in chosen),
                ]
            )
    every = [r["km1_ratio"] for r in runs]
    gt = geomean([r["time_ratio"] for r in runs])
    try:
        version = metadata.version("mtkahypar")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "schema": SCHEMA,
        "benchmark": "partitioners",
        "title": "Hypergraph partitioner vs Mt-KaHyPar: quality and time",
        "command": "python benches/compare_partitioners.py " + shlex.join(sys.argv[1:]),
        "when": now(),
        "host": host_info() | {"mtkahypar": version},
        "description": (
            "`hetcoll.partition_hypergraph` against Mt-KaHyPar's default preset (one thread "
            "each), same instances, same run: column-net hypergraphs of random sparse "
            "matrices and a 2D 5-point stencil (banded); geometric kNN hypergraphs in 2-D and "
            f"3-D (uniform points, one net per point and its {KNN} nearest); power-law nets "
            "(Chung-Lu, Pareto net sizes and vertex degrees); the weighted hypergraphs of CNNs "
            "(two small ones, VGG-11's convolutional stack and a plain ResNet-18 chain at reduced "
            "width); k = 2, 4, 8; uniform targets and speeds 4:2:1:1 repeated; and the CNN "
            "network family (a CIFAR CNN, VGG-11 and a ResNet-18 chain at half and full width, "
            "MobileNetV3-small's convolutions; speeds 1:0.5 to (4:2:1:1) x 2, with and without "
            "memory capacities, bytes per step at batch 64). Mt-KaHyPar gets "
            "the same per-block limits, floor((1 + eps) * target * W), eps = 0.03, and both get "
            "integer weights."
        ),
        "notes": [
            "km1 ratio: hetcoll's km1 over Mt-KaHyPar's (< 1: hetcoll cuts less); time ratio: "
            "hetcoll's time over Mt-KaHyPar's (< 1: hetcoll is faster). "
            + (
                f"Each cell: the medians of {repeat} runs (km1 and seconds, each partitioner's "
                "own), the partitioner that goes first alternating; balanced in every run."
                if repeat > 1
                else "One run per cell."
            ),
            *(
                ["`--quick`: the small instance of each family (CNNs at a quarter width)."]
                if quick
                else []
            ),
        ],
        "headlines": [
            {
                "figure": "partition_hypergraph km1 / Mt-KaHyPar's, geometric mean",
                "value": f"{geomean(every):.3f} (worst {max(every):.3f}, {len(runs)} runs)",
            },
            {
                "figure": "partition_hypergraph time / Mt-KaHyPar's, geometric mean",
                "value": f"{gt:.2f}x",
            },
        ],
        "sections": [
            {
                "title": "Summary",
                "peer": f"Mt-KaHyPar {version}, default preset, 1 thread",
                "columns": [
                    {"name": "group"},
                    {"name": "runs"},
                    {"name": "km1 ratio, geometric mean", "format": "{:.3f}"},
                    {"name": "worst km1 ratio", "format": "{:.3f}"},
                    {"name": "time ratio, geometric mean", "format": RATIO},
                    {"name": "runs balanced (both)"},
                ],
                "rows": summary,
            },
            {
                "title": "Every run",
                "peer": f"Mt-KaHyPar {version}, default preset, 1 thread",
                "columns": [
                    {"name": "instance"},
                    {"name": "k"},
                    {"name": "targets"},
                    {"name": "km1 hetcoll", "format": "{:,.0f}"},
                    {"name": "km1 Mt-KaHyPar", "format": "{:,.0f}"},
                    {"name": "km1 ratio", "format": "{:.3f}"},
                    {"name": "hetcoll (s)", "format": "{:.3f}"},
                    {"name": "Mt-KaHyPar (s)", "format": "{:.3f}"},
                    {"name": "time ratio", "format": RATIO},
                    {"name": "balanced hetcoll"},
                    {"name": "balanced Mt-KaHyPar"},
                ],
                "rows": [
                    [
                        r["instance"],
                        r["k"],
                        "4:2:1:1" if r["hetero"] else "uniform",
                        r["km1_hetcoll"],
                        r["km1_mtkahypar"],
                        r["km1_ratio"],
                        r["seconds_hetcoll"],
                        r["seconds_mtkahypar"],
                        r["time_ratio"],
                        r["balanced_hetcoll"],
                        r["balanced_mtkahypar"],
                    ]
                    for r in runs
                    if not r["instance"].startswith("net ")
                ],
            },
            *([network_section(runs, version)] if any("speeds" in r for r in runs) else []),
        ],
    }


def network_section(runs: list[dict[str, Any]], version: str) -> dict[str, Any]:
    """The CNN network family's cells: km1, bytes per step and time beside Mt-KaHyPar's."""
    from report import RATIO

    return {
        "title": f"CNN networks: km1, bytes per step (batch {BATCH}) and time",
        "peer": f"Mt-KaHyPar {version}, default preset, 1 thread",
        "columns": [
            {"name": "network"},
            {"name": "k"},
            {"name": "speeds"},
            {"name": "memory capacities"},
            {"name": "km1 hetcoll", "format": "{:,.0f}"},
            {"name": "km1 Mt-KaHyPar", "format": "{:,.0f}"},
            {"name": "km1 ratio", "format": "{:.3f}"},
            {"name": "MB/step hetcoll", "format": "{:,.2f}"},
            {"name": "MB/step Mt-KaHyPar", "format": "{:,.2f}"},
            {"name": "hetcoll (s)", "format": "{:.3f}"},
            {"name": "Mt-KaHyPar (s)", "format": "{:.3f}"},
            {"name": "time ratio", "format": RATIO},
            {"name": "balanced (both)"},
            {"name": "Mt-KaHyPar fits memory"},
        ],
        "rows": [
            [
                r["instance"].removeprefix("net "),
                r["k"],
                r["speeds"],
                "yes" if r["memory"] else "no",
                r["km1_hetcoll"],
                r["km1_mtkahypar"],
                r["km1_ratio"],
                r["bytes_hetcoll"] / 1e6,
                r["bytes_mtkahypar"] / 1e6,
                r["seconds_hetcoll"],
                r["seconds_mtkahypar"],
                r["time_ratio"],
                r["balanced_hetcoll"] and r["balanced_mtkahypar"],
                ("yes" if r["fits_mtkahypar"] else "no") if r["memory"] else "",
            ]
            for r in runs
            if "speeds" in r
        ],
    }


def measure(
    mtkahypar: Any,
    mtk: Any,
    n: int,
    nets: list[np.ndarray],
    vw: np.ndarray,
    nw: np.ndarray,
    targets: list[float],
    repeat: int,
    *,
    memory: np.ndarray | None = None,
    capacity: list[float] | None = None,
    net_bytes: np.ndarray | None = None,
) -> dict[str, Any]:
    """One cell: ``repeat`` runs of each partitioner, the one that goes first alternating (a
    change of load reaches both alike); km1, bytes and seconds are medians over the runs
    (Mt-KaHyPar's km1 varies between runs with one seed, hetcoll's does not). With ``memory``
    and ``capacity``, hetcoll also keeps every block's memory within its capacity; Mt-KaHyPar
    takes no second constraint, so it partitions without, and ``fits_mtkahypar`` says whether its
    partition happens to fit. ``net_bytes``: the nets' bytes per sample, for bytes per step at
    ``BATCH`` samples (forward maps and backward gradients)."""
    mine, yours = [], []
    ok_ours = ok_theirs = fits_theirs = True
    extra = {} if memory is None else dict(vertex_memory=memory, capacity=capacity)

    def per_step(parts: np.ndarray) -> float:
        return 2.0 * BATCH * km1_of(nets, parts, net_bytes) if net_bytes is not None else 0.0

    for rep in range(repeat):
        for go in ("ours", "theirs") if rep % 2 == 0 else ("theirs", "ours"):
            if go == "ours":
                start = time.perf_counter()
                ours = hetcoll.partition_hypergraph(
                    n, nets, targets, vertex_weights=vw, net_weights=nw, epsilon=EPS, seed=0,
                    **extra,
                )  # fmt: skip
                seconds = time.perf_counter() - start
                mine.append((km1_of(nets, ours, nw), seconds, per_step(ours)))
                ok_ours = ok_ours and balanced(ours, vw, targets)
                if memory is not None:
                    held = np.bincount(ours, weights=memory, minlength=len(targets))
                    ok_ours = ok_ours and bool(np.all(held <= np.asarray(capacity)))
            else:
                theirs, t = run_mtkahypar(mtkahypar, mtk, n, nets, vw, nw, targets)
                yours.append((km1_of(nets, theirs, nw), t, per_step(theirs)))
                ok_theirs = ok_theirs and balanced(theirs, vw, targets)
                if memory is not None:
                    held = np.bincount(theirs, weights=memory, minlength=len(targets))
                    fits_theirs = fits_theirs and bool(np.all(held <= np.asarray(capacity)))
    a, t_ours, bytes_ours = (statistics.median(x) for x in zip(*mine))
    b, t_theirs, bytes_theirs = (statistics.median(x) for x in zip(*yours))
    ratio = a / b if b > 0 else (1.0 if a == 0 else math.inf)
    cell = dict(
        km1_hetcoll=a,
        km1_mtkahypar=b,
        km1_ratio=ratio,
        seconds_hetcoll=t_ours,
        seconds_mtkahypar=t_theirs,
        time_ratio=t_ours / t_theirs,
        balanced_hetcoll=bool(ok_ours),
        balanced_mtkahypar=bool(ok_theirs),
    )
    if net_bytes is not None:
        cell |= dict(bytes_hetcoll=bytes_ours, bytes_mtkahypar=bytes_theirs)
    if memory is not None:
        cell |= dict(fits_mtkahypar=bool(fits_theirs))
    return cell


def print_cell(name: str, k: int, label: str, cell: dict[str, Any]) -> None:
    ok = f"{cell['balanced_hetcoll']!s:>5}/{cell['balanced_mtkahypar']!s:<5}"
    print(
        f"{name:<28} {k:>2} {label:<7} {cell['km1_hetcoll']:>12.0f}"
        f" {cell['km1_mtkahypar']:>14.0f} {cell['km1_ratio']:>6.3f}"
        f" {cell['seconds_hetcoll']:>9.3f}s {cell['seconds_mtkahypar']:>10.3f}s {ok:>9}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small instances only")
    ap.add_argument("--family", help="only the instances whose name starts with this")
    ap.add_argument("--json", type=Path, help="also write a results file for benches/report.py")
    ap.add_argument(
        "--repeat", type=int, default=3, help="runs of each cell, medians reported (default 3)"
    )
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat: must be at least 1, got {args.repeat}")
    import mtkahypar

    mtk = mtkahypar.initialize(1, False)
    print(
        f"{'instance':<28} {'k':>2} {'targets':<7} {'km1 hetcoll':>12} {'km1 MtKaHyPar':>14}"
        f" {'ratio':>6} {'t hetcoll':>10} {'t MtKaHyPar':>11} {'balanced':>9}"
    )
    runs: list[dict[str, Any]] = []
    for name, n, nets, vw, nw in instances(args.quick, args.family):
        pins = sum(len(e) for e in nets)
        print(f"# {name}: {n} vertices, {len(nets)} nets, {pins} pins", flush=True)
        for k in (2, 4, 8):
            for hetero in (False, True):
                targets = targets_for(k, hetero)
                cell = measure(mtkahypar, mtk, n, nets, vw, nw, targets, args.repeat)
                runs.append(dict(instance=name, k=k, hetero=hetero, **cell))
                print_cell(name, k, "hetero" if hetero else "uniform", cell)
    if args.family is None or "net ".startswith(args.family) or args.family.startswith("net"):
        for inst in network_instances():
            name, n, nets = inst["name"], inst["n"], inst["nets"]
            if args.family is not None and not name.startswith(args.family):
                continue
            pins = sum(len(e) for e in nets)
            print(f"# {name}: {n} vertices, {len(nets)} nets, {pins} pins", flush=True)
            for speeds in NETWORK_SPEEDS:
                for with_memory in (False, True) if speeds in NETWORK_MEMORY_SPEEDS else (False,):
                    targets = [x / sum(speeds) for x in speeds]
                    k = len(targets)
                    memory = inst["memory"] if with_memory else None
                    share = max(float(inst["memory"].sum()) / k, inst["largest_layer_memory"])
                    capacity = [MEMORY_SLACK * share] * k
                    cell = measure(
                        mtkahypar, mtk, n, nets, inst["vw"], inst["nw"], targets, args.repeat,
                        memory=memory, capacity=capacity if with_memory else None,
                        net_bytes=inst["net_bytes"],
                    )  # fmt: skip
                    runs.append(
                        dict(
                            instance=name, k=k, hetero=len(set(speeds)) > 1,
                            speeds=speeds_label(speeds), memory=with_memory, **cell,
                        )
                    )  # fmt: skip
                    label = speeds_label(speeds) + (" mem" if with_memory else "")
                    print_cell(name, k, label, cell)
    if not runs:
        ap.error(f"--family: no instance's name starts with {args.family!r}")
    gm = geomean([r["km1_ratio"] for r in runs])
    gt = geomean([r["time_ratio"] for r in runs])
    print(f"geometric mean km1 ratio hetcoll / Mt-KaHyPar: {gm:.3f}")
    print(f"geometric mean time ratio hetcoll / Mt-KaHyPar: {gt:.2f}")
    if args.json is not None:
        from report import write_result

        write_result(args.json, results_file(runs, args.quick, args.repeat))
        print(f"results: {args.json}")


if __name__ == "__main__":
    main()
