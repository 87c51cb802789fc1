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
)

#: Summary rows: a name and which runs it covers (instance name, hetero).
GROUPS: tuple[tuple[str, Any], ...] = (
    ("all", lambda name, hetero: True),
    (
        "beyond banded (kNN, power-law, CNN)",
        lambda name, hetero: name.startswith(("knn", "power", "cnn")),
    ),
    ("uniform targets", lambda name, hetero: not hetero),
    ("heterogeneous targets", lambda name, hetero: hetero),
    *(
        (family, lambda name, hetero, prefix=prefix: name.startswith(prefix))
        for family, prefix in FAMILIES
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
        chosen = [r for r in runs if covers(r["instance"], r["hetero"])]
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
            "width); k = 2, 4, 8; uniform targets and speeds 4:2:1:1 repeated. Mt-KaHyPar gets "
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
                ],
            },
        ],
    }


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
                # Each run times both partitioners, the one that goes first alternating (a
                # change of load reaches both alike); km1 and seconds are medians over the runs
                # (Mt-KaHyPar's km1 varies between runs with one seed, hetcoll's does not).
                mine, yours = [], []
                ok_ours = ok_theirs = True
                for rep in range(args.repeat):
                    for go in ("ours", "theirs") if rep % 2 == 0 else ("theirs", "ours"):
                        if go == "ours":
                            start = time.perf_counter()
                            ours = hetcoll.partition_hypergraph(
                                n, nets, targets, vertex_weights=vw, net_weights=nw,
                                epsilon=EPS, seed=0,
                            )  # fmt: skip
                            mine.append((km1_of(nets, ours, nw), time.perf_counter() - start))
                            ok_ours = ok_ours and balanced(ours, vw, targets)
                        else:
                            theirs, t = run_mtkahypar(mtkahypar, mtk, n, nets, vw, nw, targets)
                            yours.append((km1_of(nets, theirs, nw), t))
                            ok_theirs = ok_theirs and balanced(theirs, vw, targets)
                a, t_ours = (statistics.median(x) for x in zip(*mine))
                b, t_theirs = (statistics.median(x) for x in zip(*yours))
                ratio = a / b if b > 0 else (1.0 if a == 0 else math.inf)
                runs.append(
                    dict(
                        instance=name,
                        k=k,
                        hetero=hetero,
                        km1_hetcoll=a,
                        km1_mtkahypar=b,
                        km1_ratio=ratio,
                        seconds_hetcoll=t_ours,
                        seconds_mtkahypar=t_theirs,
                        time_ratio=t_ours / t_theirs,
                        balanced_hetcoll=bool(ok_ours),
                        balanced_mtkahypar=bool(ok_theirs),
                    )
                )
                ok = f"{ok_ours!s:>5}/{ok_theirs!s:<5}"
                print(
                    f"{name:<28} {k:>2} {'hetero' if hetero else 'uniform':<7} {a:>12.0f}"
                    f" {b:>14.0f} {ratio:>6.3f} {t_ours:>9.3f}s {t_theirs:>10.3f}s {ok:>9}",
                    flush=True,
                )
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
