"""Plan cases that run inside every rank of a real job (gloo through launch.spawn, or MPI).

Each case trains a model under a plan for a few SGD-momentum steps and checks, on every rank,
that the losses and ``full_state_dict()`` equal one process training the whole batch, in
float64 to 1e-10 (relative). Plan shapes: a 4-stage pipeline with uneven stages and uneven
micro-batches (1F1B), asymmetric replicas (one rank holding the whole model beside a 2-stage
replica whose second stage is split over two ranks), an idle rank, explicit shares, and
torchvision's ResNet-18 (traced: its forward calls torch.flatten) as an uneven 2-stage pipeline
beside a whole-model replica, a filter-split stage feeding an owners (node-wise) stage, a
model whose two layers tie a weight (pipelined, and split), and torchvision's Swin with its
features split (its attentions' functionally read layers whole). Bad input must raise the same
error on every rank, scalers a step cannot run with too; a plan with an idle rank scales its
losses with hetcoll's GroupGradScaler (both engines) and on gloo with torch's
ShardedGradScaler too (:func:`loss_scaled`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hetcoll import CollectiveMismatchError, Plan
from hetcoll.comm import allgather_objects, wrap
from hetcoll.torch import GroupGradScaler, parallelize

TOL = 1e-10


def cnn() -> nn.Sequential:
    """11 layers; awkward channel counts. Some ReLUs work in place, as torchvision's do: a
    stage that starts with one (layer 1 in PIPELINE_4) modifies the activation it received,
    and an owners stage's readers run them on the input they assembled (layers 6 and 9)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 12, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(12, 10, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(10 * 4 * 4, 20),
        nn.ReLU(inplace=True),
        nn.Linear(20, 5),
    )


def wide_cnn() -> nn.Sequential:
    """:func:`cnn` with a 1024-wide hidden layer: 1.3 MB of float64 gradients, past
    ``ONE_COLLECTIVE_BYTES``, so a data-parallel training step checks its batch beside its
    forwards and sums its gradients after (the small one does both in its sum)."""
    layers = list(cnn())
    layers[8], layers[10] = nn.Linear(10 * 4 * 4, 1024), nn.Linear(1024, 5)
    return nn.Sequential(*layers)


def resnet18() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=5)


def densenet() -> nn.Module:
    """torchvision's DenseNet, small: 11 blocks (features.conv0 .. features.norm5,
    classifier), in-place ReLUs as blocks (features.relu0) and in its forward, between
    features.norm5 and the classifier (``F.relu(features, inplace=True)``)."""
    import torchvision

    return torchvision.models.DenseNet(
        growth_rate=4, block_config=(2, 2), num_init_features=8, bn_size=2, num_classes=5
    )


def swin() -> nn.Module:
    """torchvision's Swin Transformer (v1), small: a chain of 6 layers (features, norm,
    permute, avgpool, flatten, head), its attentions reading their qkv and proj weights
    themselves (F.linear): a split stage keeps those whole and splits the MLPs."""
    from torchvision.models import SwinTransformer

    return SwinTransformer(
        patch_size=[4, 4], embed_dim=12, depths=[2, 2], num_heads=[2, 4], window_size=[2, 2],
        num_classes=5, stochastic_depth_prob=0.0,
    )  # fmt: skip


class Tied(nn.Module):
    """A chain of calls whose two layers share one weight (``fc2.weight is fc1.weight``): cut
    by its blocks, not as a chain, whose stages copy their layers one by one and would part
    the weight (each trained by its own gradient alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc2.weight = self.fc1.weight
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Unused(nn.Module):
    """A chain holding a module its forward never calls (GoogLeNet's aux heads in eval): on
    no stage, untrained, in the full state as it was (its key raised KeyError there)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.aux = nn.Linear(8, 5)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc1(x)))


class Frozen(Unused):
    """:class:`Unused` with its first layer's weight frozen (a fine-tuning run's, a
    transformer's sinusoidal position table): held by both replicas of a plan, it was given a
    zero gradient where one process gives none, and weight decay moved it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1.weight.requires_grad_(False)


class Unhit(nn.Module):
    """Experts of which the forward calls one only (an expert given no tokens in a step): the
    other's gradient is None in one process, and the replicas' sum gave it zeros, which
    weight decay followed."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.experts = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.experts[0](self.fc1(x))))


def three_replicas(layers: int, cut: int) -> dict[str, Any]:
    """Three replicas of a ``layers``-layer chain on 4 ranks: rank 0 whole (4 samples), ranks 1
    and 2 a pipeline cut at ``cut`` (4 samples), rank 3 whole (2 samples); 2 micro-batches."""
    return {
        "microbatches": 2,
        "replicas": [
            {"samples": 4, "stages": [{"ranks": [0], "layers": [0, layers]}]},
            {
                "samples": 4,
                "stages": [
                    {"ranks": [1], "layers": [0, cut]},
                    {"ranks": [2], "layers": [cut, layers]},
                ],
            },
            {"samples": 2, "stages": [{"ranks": [3], "layers": [0, layers]}]},
        ],
    }


#: Three replicas, one a pipeline, each holding both experts.
UNHIT = three_replicas(4, 2)


class RoutedByFirstFeature(nn.Module):
    """Rows routed by their first feature to one of two experts (a mixture of experts'
    router, per row): a replica none of whose rows takes an expert gives it no gradient while
    the others give it one, so the holders combine their gradients by different roads (the
    concatenation of every gradient, and the general road's zeros where one is missing)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:  # the runtime's shape probes read no values: every expert's shape
            return self.experts[0](x) + self.experts[1](x)
        up = x[:, 0] > 0.5
        out = x.new_zeros(x.shape)
        for expert, rows in zip(self.experts, (~up, up), strict=True):
            if bool(rows.any()):
                out = out.index_put((rows,), expert(x[rows]))
        return out


def routed() -> nn.Module:
    return nn.Sequential(RoutedByFirstFeature(), nn.ReLU(), nn.Linear(8, 5))


#: Three replicas, one a pipeline; with :func:`batches`' data, every step has a replica whose
#: rows leave the second expert untouched beside replicas whose rows reach it.
ROUTED = three_replicas(3, 1)


class CastsItsLayer(nn.Module):
    """A layer whose forward converts its own weights (Switch Transformers' router casts its
    classifier to float32 at every call)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin = self.lin.to(torch.float32)
        return torch.relu(self.lin(x.float())).to(x.dtype)


def casts() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), CastsItsLayer(), nn.Linear(8, 5))


def batches(shape: tuple[int, ...], batch: int, steps: int, classes: int = 5) -> list[Any]:
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn((batch, *shape), generator=g, dtype=torch.float64),
            torch.randint(0, classes, (batch,), generator=g),
        )
        for _ in range(steps)
    ]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-30))


def reference(
    model: nn.Module,
    data: list[Any],
    lr: float,
    weight_decay: float = 0.0,
    skip: tuple[int, ...] = (),
) -> tuple[list[float], dict[str, Any]]:
    """One process, whole batch; the optimizer skips the steps numbered in ``skip`` (as a
    loss scaler skips a step whose gradients overflowed)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    losses = []
    for n, (x, y) in enumerate(data):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if n not in skip:
            opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, model.state_dict()


def equals_one_process(
    group: Any,
    make: Any,
    plan: Plan,
    shape: tuple[int, ...],
    *,
    steps: int = 3,
    eval_mode=False,
    tol: float = TOL,
    weight_decay: float = 0.0,
) -> dict[str, int]:
    torch.manual_seed(0)
    model = make().double()
    if eval_mode:
        model.eval()
    data = batches(shape, plan.batch, steps)
    want_losses, want_state = reference(model, data, 0.05, weight_decay)
    par = parallelize(model, plan, loss_fn=nn.CrossEntropyLoss(), group=group)
    if eval_mode:
        par.eval()
    opt = torch.optim.SGD(par.parameters(), lr=0.05, momentum=0.9, weight_decay=weight_decay)
    for (x, y), want in zip(data, want_losses, strict=True):
        loss = par.step(x, y)
        assert abs(loss - want) <= tol * abs(want), (loss, want)
        opt.step()
        opt.zero_grad()
    got = par.full_state_dict()
    assert list(got) == list(want_state), (list(got)[:5], list(want_state)[:5])
    for k, v in want_state.items():
        assert got[k].dtype == v.dtype, (k, got[k].dtype, v.dtype)
        if v.is_floating_point():
            assert rel(got[k], v) <= tol, (k, rel(got[k], v))
        else:
            assert torch.equal(got[k], v), k
    traffic = par.traffic()
    # An evaluation step: the trained model's loss, every gradient left as it was (none). The
    # replicas' sums ran under no_grad too, and gave every parameter zeros.
    trained = make().double().eval()
    trained.load_state_dict(want_state)
    par.eval()
    x, y = data[0]
    with torch.no_grad():
        want = float(nn.functional.cross_entropy(trained(x), y))
        loss = par.step(x, y)
    assert abs(loss - want) <= tol * abs(want), (loss, want)
    assert all(p.grad is None for p in par.parameters())
    return traffic


def evaluating_alone(group: Any) -> str:
    """A rank evaluating (no_grad) while the others train: every rank raises, naming it."""
    torch.manual_seed(0)
    par = parallelize(
        cnn().double(), Plan.from_dict(PIPELINE_4), loss_fn=nn.CrossEntropyLoss(), group=group
    )
    x, y = batches((3, 8, 8), par.plan.batch, 1)[0]
    try:
        with torch.no_grad() if wrap(group).rank == 0 else contextlib.nullcontext():
            par.step(x, y)
    except CollectiveMismatchError as e:
        return str(e).split(" (")[0]
    return "no error"


PIPELINE_4 = {
    "microbatches": 4,
    "schedule": "1F1B",
    "replicas": [
        {
            "samples": 14,  # micro-batches of 4, 4, 3, 3
            "stages": [
                {"ranks": [0], "layers": [0, 1]},
                {"ranks": [1], "layers": [1, 5]},
                {"ranks": [2], "layers": [5, 8]},
                {"ranks": [3], "layers": [8, 11]},
            ],
        }
    ],
}

ASYMMETRIC = {
    "microbatches": 3,
    "schedule": "GPipe",
    "replicas": [
        {"samples": 9, "stages": [{"ranks": [0], "layers": [0, 11]}]},
        {
            "samples": 7,
            "stages": [
                {"ranks": [1], "layers": [0, 5]},
                {"ranks": [2, 3], "speeds": [1.0, 0.4], "layers": [5, 11]},
            ],
        },
    ],
}

IDLE = {
    "microbatches": 4,
    "schedule": "1F1B",
    "replicas": [
        {"samples": 5, "stages": [{"ranks": [0], "layers": [0, 11]}]},
        {
            "samples": 6,
            "stages": [{"ranks": [3], "layers": [0, 6]}, {"ranks": [2], "layers": [6, 11]}],
        },
    ],
}

SHARES = {
    "microbatches": 2,
    "replicas": [
        {
            "samples": 6,
            "stages": [
                {"ranks": [2, 0], "shares": {"0": [5, 3], "2": [5, 3]}, "layers": [0, 3]},
                {"ranks": [1], "layers": [3, 11]},
            ],
        },
        {"samples": 3, "stages": [{"ranks": [3], "layers": [0, 11]}]},
    ],
}

#: A split stage with a grouped convolution between its pair (ResNeXt's bottleneck, small):
#: the pair's shares in whole groups (4 groups of 2 channels), named by layer index on ranks
#: 0 and 2, by speeds on ranks 1 and 3 (3 groups and 1).
GROUPED = {
    "microbatches": 2,
    "replicas": [
        {
            "samples": 5,
            "stages": [
                {"ranks": [0, 2], "shares": {"0": [2, 6], "5": [2, 6]}, "layers": [0, 6]},
                {"ranks": [1, 3], "speeds": [1.0, 0.3], "layers": [6, 8]},
            ],
        },
    ],
}


def grouped_cnn() -> nn.Sequential:
    """8 layers: a 1x1 convolution, a grouped 3x3 one of 4 groups between it and another 1x1
    (BatchNorm and ReLU between), then a second such block in layers 6-7's Sequential."""

    def block(c: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(c, 8, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=4),
            nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 6, 1),
        )  # fmt: skip

    return nn.Sequential(*block(3), block(6), nn.Sequential(nn.Flatten(), nn.Linear(6 * 16, 5)))


RESNET = {
    "microbatches": 2,
    "schedule": "1F1B",
    "replicas": [
        {
            "samples": 3,
            "stages": [{"ranks": [0], "layers": [0, 6]}, {"ranks": [1], "layers": [6, 11]}],
        },
        {"samples": 2, "stages": [{"ranks": [2], "layers": [0, 11]}]},
    ],
}

#: DenseNet's stages start with in-place ops on the activations they receive: features.relu0
#: (rank 1) and the forward's own ReLU of features.norm5's output (rank 2).
DENSENET = {
    "microbatches": 2,
    "replicas": [
        {
            "samples": 5,
            "stages": [
                {"ranks": [0], "layers": [0, 2]},
                {"ranks": [1], "layers": [2, 10]},
                {"ranks": [2], "layers": [10, 11]},
            ],
        },
        {"samples": 3, "stages": [{"ranks": [3], "layers": [0, 11]}]},
    ],
}

#: Swin's features split over two ranks (its attentions' layers whole), then the rest.
SWIN = {
    "microbatches": 2,
    "replicas": [
        {
            "samples": 5,
            "stages": [
                {"ranks": [0, 1], "speeds": [1.0, 0.5], "layers": [0, 1]},
                {"ranks": [2], "layers": [1, 6]},
            ],
        },
        {"samples": 3, "stages": [{"ranks": [3], "layers": [0, 6]}]},
    ],
}

#: The tied weight on two stages of a pipeline (its gradient summed over them) beside a
#: replica whose one stage is split over two ranks.
TIED = {
    "microbatches": 2,
    "replicas": [
        {
            "samples": 6,
            "stages": [{"ranks": [0], "layers": [0, 1]}, {"ranks": [1], "layers": [1, 3]}],
        },
        {"samples": 4, "stages": [{"ranks": [2, 3], "speeds": [1.0, 0.5], "layers": [0, 3]}]},
    ],
}

#: Two pipeline replicas of two stages (three layers: casts()'s).
CASTS = {
    "microbatches": 2,
    "replicas": [
        {
            "samples": 6,
            "stages": [{"ranks": [0], "layers": [0, 1]}, {"ranks": [1], "layers": [1, 3]}],
        },
        {
            "samples": 4,
            "stages": [{"ranks": [2], "layers": [0, 2]}, {"ranks": [3], "layers": [2, 3]}],
        },
    ],
}

#: A filter-split stage feeding an owners stage (node-wise placement, hetcoll.torch.placement):
#: both split ranks take the owners' summed input gradient.
OWNERS_AFTER_SPLIT = {
    "microbatches": 2,
    "replicas": [
        {
            "samples": 7,
            "stages": [
                {"ranks": [0, 1], "speeds": [1.0, 0.5], "layers": [0, 5]},
                {
                    "ranks": [3, 2],
                    "layers": [5, 11],
                    "owners": {"5": [0, 1, 1] * 3 + [0], "8": [1, 0] * 10, "10": [1, 1, 0, 1, 0]},
                },
            ],
        }
    ],
}


class Raises:
    """``raises(kind, text, fn)``: ``fn()`` must raise ``kind`` with ``text`` in its message;
    ``count`` says how many did."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, kind: type[BaseException], text: str, fn: Any) -> None:
        try:
            fn()
        except kind as e:
            assert text in str(e), (text, str(e))
            self.count += 1
            return
        raise AssertionError(f"no {kind.__name__} ({text})")


#: Data parallelism, uneven shares: no rank sends anything before the gradients' sum, so
#: Parallel.step checks the batch and sums the loss in one allgather after the backward.
DATA_PARALLEL = {
    "microbatches": 2,
    "replicas": [
        {"samples": s, "stages": [{"ranks": [r], "layers": [0, 11]}]}
        for r, s in enumerate((5, 3, 4, 2))
    ],
}


def data_parallel_errors(group: Any, make: Any) -> int:
    """Under DATA_PARALLEL, whose steps sum their loss and flags with their gradients (and a
    large model's training step checks its batch beside its forwards): each mistake raises on
    every rank (none hangs), and the next good step trains. Returns how many raised."""
    rank = wrap(group).rank
    torch.manual_seed(0)
    model = make().double()
    raises = Raises()

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if rank == 2 and failing:
            raise RuntimeError("rank 2's loss failed")
        return nn.functional.cross_entropy(out, y)

    failing = False
    par = parallelize(model, DATA_PARALLEL, loss_fn=loss_fn, group=group)
    (x, y), (x13, y13) = batches((3, 8, 8), 14, 1)[0], batches((3, 8, 8), 13, 1)[0]
    raises(ValueError, "the plan's replicas take 14 samples a step", lambda: par.step(x13, y13))
    raises(
        CollectiveMismatchError,
        "the number of input rows",
        lambda: par.step(*((x, y) if rank else (x13, y13))),
    )
    with torch.no_grad() if rank == 0 else contextlib.nullcontext():
        raises(CollectiveMismatchError, "ranks disagree on gradients", lambda: par.step(x, y))
    failing = True
    if rank == 2:
        raises(RuntimeError, "rank 2's loss failed", lambda: par.step(x, y))
    else:
        raises(CollectiveMismatchError, "rank 2 raised RuntimeError", lambda: par.step(x, y))
    failing = False
    # Rank 2's last backward raising at the first layer's gradient, the last it computes (the
    # large model's first bucket of sums started by then): the others raise naming it.
    backwards = [0]

    def backward_fails(_: torch.Tensor) -> None:
        backwards[0] += 1
        if rank == 2 and backwards[0] == DATA_PARALLEL["microbatches"]:
            raise RuntimeError("rank 2's backward failed")

    assert par.stage is not None
    hook = par.stage[0].weight.register_post_accumulate_grad_hook(backward_fails)
    if rank == 2:
        raises(RuntimeError, "rank 2's backward failed", lambda: par.step(x, y))
    else:
        raises(CollectiveMismatchError, "rank 2 raised RuntimeError", lambda: par.step(x, y))
    hook.remove()
    # No failed step left a gradient (each rank's own work put back).
    assert all(p.grad is None for p in par.parameters())
    init = 2.0**4 if rank == 2 else 2.0**5
    scaler = GroupGradScaler("cpu", init, group=group)
    raises(ValueError, "loss scales differ", lambda: par.step(x, y, scaler=scaler))
    # Scales that differ are found at the step's end, its gradients summed: set aside. The
    # next step trains: the one process's loss and gradients.
    for p in par.parameters():
        p.grad = None
    loss = par.step(x, y)
    out = nn.functional.cross_entropy(model(x), y)
    out.backward()
    assert abs(loss - float(out)) <= TOL * abs(float(out)), (loss, float(out))
    got = dict(par.named_parameters())
    assert all(rel(got[n].grad, p.grad) <= TOL for n, p in model.named_parameters())
    return raises.count


@contextlib.contextmanager
def counting(calls: list[str], *where: tuple[Any, str]) -> Iterator[None]:
    """Inside it, each call of ``owner.name`` (each ``(owner, name)`` of ``where``: a module's
    function or a class's method) appends ``name`` to ``calls`` and runs the real one."""
    real = {(owner, name): getattr(owner, name) for owner, name in where}

    def counted(fn: Any, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    for (owner, name), fn in real.items():
        setattr(owner, name, counted(fn, name))
    try:
        yield
    finally:
        for (owner, name), fn in real.items():
            setattr(owner, name, fn)


def data_parallel_collectives(make: Any) -> dict[str, list[str]]:
    """The torch.distributed collectives of DATA_PARALLEL's steps (allgathers, allreduces) on
    the default group, in order among the step's forwards and its first layer's gradients
    (the last each backward gives)."""
    import torch.distributed as dist

    par = parallelize(make().double(), DATA_PARALLEL, loss_fn=nn.CrossEntropyLoss())
    x, y = batches((3, 8, 8), 14, 1)[0]
    par.step(x, y)  # a first step, unrecorded
    out = {}
    for mode in ("train", "eval"):
        calls: list[str] = []
        evaluating = torch.no_grad() if mode == "eval" else contextlib.nullcontext()
        assert par.stage is not None
        hooks = [
            par.stage.register_forward_pre_hook(lambda *_, c=calls: c.append("forward")),
            par.stage[0].weight.register_post_accumulate_grad_hook(
                lambda _, c=calls: c.append("first layer's gradient")
            ),
        ]
        with counting(calls, (dist, "all_gather_into_tensor"), (dist, "all_reduce")), evaluating:
            par.step(x, y)
        for hook in hooks:
            hook.remove()
        out[mode] = calls
    return out


def data_parallel_low_precision(group: Any) -> dict[str, bool]:
    """DATA_PARALLEL's training step in bfloat16 and float16 (its gradients' sum in that dtype,
    each rank's loss and flags carried beside them as bytes): the loss is the evaluation
    step's (told through an allgather of int64 words) bit for bit, every rank's gradients are
    the same, and near the float64 one process's for the same weights (an unweighted or
    missing replica's part would be off by far more)."""
    out = {}
    x, y = batches((3, 8, 8), 14, 1)[0]
    # Each dtype's forward and backward, not the sum, set the distance: about 12% of the
    # largest entry in bfloat16 (8 significant bits), 2% in float16 (11).
    for dtype, tol in ((torch.bfloat16, 0.25), (torch.float16, 0.05)):
        torch.manual_seed(0)
        model = cnn().to(dtype)
        one = copy.deepcopy(model).double()
        nn.functional.cross_entropy(one(x), y).backward()
        par = parallelize(model, DATA_PARALLEL, loss_fn=nn.CrossEntropyLoss(), group=group)
        loss = par.step(x.to(dtype), y)
        with torch.no_grad():
            evaluated = par.step(x.to(dtype), y)
        grads = dict(par.named_parameters())
        flat = torch.cat([p.grad.double().reshape(-1) for p in grads.values()])
        every = allgather_objects(wrap(group), flat)
        same = all(torch.equal(every[0], g) for g in every)
        near = all(
            rel(grads[n].grad, p.grad) <= tol for n, p in one.named_parameters() if n in grads
        )
        out[str(dtype)] = loss == evaluated and same and near
    return out


def bad_input(group: Any) -> int:
    """Each mistake raises the same error on every rank; returns how many were checked."""
    rank = wrap(group).rank
    plan = Plan.from_dict(PIPELINE_4)
    raises = Raises()

    torch.manual_seed(0)
    model = cnn().double()
    raises(
        ValueError,
        "stages cover 11 layers but the model has 3",
        lambda: parallelize(
            nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2)),
            plan,
            loss_fn=nn.CrossEntropyLoss(),
            group=group,
        ),
    )
    # Ranks disagree on the plan.
    other = dict(PIPELINE_4, microbatches=2 if rank == 1 else 4)
    raises(
        CollectiveMismatchError,
        "the plan",
        lambda: parallelize(model, other, loss_fn=nn.CrossEntropyLoss(), group=group),
    )
    # Ranks disagree on which parameters are frozen (their sums would differ).
    frozen = cnn().double()
    frozen[0].weight.requires_grad_(rank != 2)
    raises(
        CollectiveMismatchError,
        "which are frozen",
        lambda: parallelize(frozen, plan, loss_fn=nn.CrossEntropyLoss(), group=group),
    )
    # More ranks in a stage than a layer has channels.
    thin = {"replicas": [{"samples": 4, "stages": [{"ranks": [0, 1, 2, 3], "layers": [0, 11]}]}]}
    tiny = nn.Sequential(*cnn()[:10], nn.Linear(20, 3)).double()
    raises(
        ValueError,
        "plan.replicas[0].stages[0]",
        lambda: parallelize(tiny, thin, loss_fn=nn.CrossEntropyLoss(), group=group),
    )
    # A batch whose size differs from the plan's samples.
    par = parallelize(model, plan, loss_fn=nn.CrossEntropyLoss(), group=group)
    x, y = batches((3, 8, 8), 12, 1)[0]
    raises(ValueError, "the plan's replicas take 14 samples a step", lambda: par.step(x, y))
    # Ranks that pass different batches.
    x, y = batches((3, 8, 8), 14 if rank else 13, 1)[0]
    raises(CollectiveMismatchError, "the number of input rows", lambda: par.step(x, y))
    return raises.count


def run_all(group: Any) -> dict[str, Any]:
    size = wrap(group).size
    assert size == 4, size
    out: dict[str, Any] = {}
    rank = wrap(group).rank
    t = equals_one_process(group, cnn, Plan.from_dict(PIPELINE_4), (3, 8, 8))
    # Each stage sends its output forward and its input's gradient back: 14 rows of float64
    # (conv1's 8 x 8 x 8 from rank 0; 12 x 4 x 4 after the pool from rank 1; 160 from rank 2).
    boundary = {0: 8 * 8 * 8, 1: 12 * 4 * 4, 2: 160, 3: 0}[rank] * 14 * 8
    inbound = {0: 0, 1: 8 * 8 * 8, 2: 12 * 4 * 4, 3: 160}[rank] * 14 * 8
    assert t == {"activations": boundary, "gradients": inbound, "outputs": 0, "allreduce": 0}, t
    out["pipeline_4"] = True
    out["evaluating_alone"] = evaluating_alone(group)
    t = equals_one_process(group, cnn, Plan.from_dict(ASYMMETRIC), (3, 8, 8))
    out["asymmetric"] = t["allreduce"] > 0
    t = equals_one_process(group, cnn, Plan.from_dict(IDLE), (3, 8, 8))
    out["idle"] = t if wrap(group).rank == 1 else None
    equals_one_process(group, cnn, Plan.from_dict(SHARES), (3, 8, 8))
    out["shares"] = True
    # (in evaluation mode, as the ResNet's: a micro-batch's BatchNorm statistics are not the
    # batch's)
    equals_one_process(group, grouped_cnn, Plan.from_dict(GROUPED), (3, 4, 4), eval_mode=True)
    out["grouped"] = True
    equals_one_process(
        group, resnet18, Plan.from_dict(RESNET), (3, 32, 32), steps=2, eval_mode=True
    )
    out["resnet18"] = True
    equals_one_process(
        group, densenet, Plan.from_dict(DENSENET), (3, 16, 16), steps=2, eval_mode=True
    )
    out["densenet"] = True
    equals_one_process(group, cnn, Plan.from_dict(OWNERS_AFTER_SPLIT), (3, 8, 8))
    out["owners_after_split"] = True
    equals_one_process(group, Tied, Plan.from_dict(TIED), (8,))
    out["tied"] = True
    equals_one_process(group, Unused, Plan.from_dict(TIED), (8,))  # fc1, relu | head
    out["unused"] = True
    equals_one_process(group, Frozen, Plan.from_dict(TIED), (8,), weight_decay=0.01)
    out["frozen"] = True
    equals_one_process(group, Unhit, Plan.from_dict(UNHIT), (8,), weight_decay=0.01)
    out["unhit"] = True
    steps = batches((8,), Plan.from_dict(ROUTED).batch, 3)
    reached = [
        [bool((x[a:b, 0] > 0.5).any()) for a, b in ((0, 4), (4, 8), (8, 10))] for x, _ in steps
    ]
    assert all(True in r and False in r for r in reached), reached  # a mixed step each time
    equals_one_process(group, routed, Plan.from_dict(ROUTED), (8,), weight_decay=0.01)
    out["routed"] = True
    # Its full state dict crashed (the stage's lead sent float32 bytes its peers read as the
    # float64 the layer held when the plan was made); float32 sums in the replicas' average.
    equals_one_process(group, casts, Plan.from_dict(CASTS), (8,), tol=1e-5)
    out["casts"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its attentions are left unsplit
        equals_one_process(group, swin, Plan.from_dict(SWIN), (3, 16, 16), steps=2)
    out["swin"] = True
    equals_one_process(group, cnn, Plan.from_dict(DATA_PARALLEL), (3, 8, 8))
    equals_one_process(group, wide_cnn, Plan.from_dict(DATA_PARALLEL), (3, 8, 8))
    out["data_parallel"] = True
    out["data_parallel_errors"] = [data_parallel_errors(group, m) for m in (cnn, wide_cnn)]
    out["data_parallel_low_precision"] = data_parallel_low_precision(group)
    out["errors"] = bad_input(group)
    out["scaler_mistakes"] = scaler_mistakes(group)
    # hetcoll's scaler sums the overflow flags through the plan's own communicator: MPI too.
    scaler = functools.partial(GroupGradScaler, group=group)
    out["loss_scaled"] = loss_scaled(group, scaler)
    out["loss_scaled_data_parallel"] = loss_scaled(group, scaler, DATA_PARALLEL)
    return out


def loss_scaled(group: Any, make: Any, plan_dict: dict[str, Any] = IDLE) -> list[float]:
    """Loss scaling under IDLE (a whole replica, a 2-stage pipeline, an idle rank), or
    ``plan_dict``, with the scaler ``make(device="cpu", ...)`` (a ShardedGradScaler or a
    GroupGradScaler): 4 steps equal one process training unscaled (scales are powers of two,
    exact in float64), except step 1, in which only rank 3 (IDLE's pipeline's first stage)
    finds an overflow in its gradients: every rank skips it, the idle rank too, and one
    process skips it alike. The losses the step returns are unscaled. Returns the scale after
    each step."""
    rank = wrap(group).rank
    plan = Plan.from_dict(plan_dict)
    torch.manual_seed(0)
    model = cnn().double()
    data = batches((3, 8, 8), plan.batch, 4)
    want_losses, want_state = reference(model, data, 0.05, skip=(1,))
    par = parallelize(model, plan, loss_fn=nn.CrossEntropyLoss(), group=group)
    opt = torch.optim.SGD(par.parameters(), lr=0.05, momentum=0.9)
    scaler = make(device="cpu", init_scale=2.0**10, growth_interval=2)
    scales = []
    for n, ((x, y), want) in enumerate(zip(data, want_losses, strict=True)):
        loss = par.step(x, y, scaler=scaler)
        assert abs(loss - want) <= TOL * abs(want), (n, loss, want)
        if rank == 3 and n == 1:
            next(p for p in par.parameters() if p.grad is not None).grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    got = par.full_state_dict()  # collective
    for k, v in want_state.items():
        assert rel(got[k], v) <= TOL if v.is_floating_point() else torch.equal(got[k], v), k
    return scales


def scaler_mistakes(group: Any) -> int:
    """A scaler that cannot run raises the same error on every rank; returns how many did."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    rank = wrap(group).rank
    par = parallelize(
        cnn().double(), Plan.from_dict(PIPELINE_4), loss_fn=nn.CrossEntropyLoss(), group=group
    )
    x, y = batches((3, 8, 8), par.plan.batch, 1)[0]
    mistakes: list[tuple[type[BaseException], str, Any]] = [
        (TypeError, "decides from its own rank's", torch.amp.GradScaler("cpu")),
        (TypeError, "or None, got float", 2.0),
    ]
    if wrap(group).engine == "mpi":
        mistakes.append((TypeError, "MPI communicator", ShardedGradScaler(device="cpu")))
        # Over two halves of the plan's ranks: every rank's group is another than the plan's.
        halves = group.Split(rank // 2, rank)
        mistakes.append((TypeError, "is not the plan's", GroupGradScaler("cpu", group=halves)))
    else:
        import torch.distributed as dist

        three = dist.new_group([0, 1, 2])
        mistakes.append(
            (TypeError, "process_group", ShardedGradScaler(device="cpu", process_group=three))
        )
        # Two kinds of scaler would sum their flags in different collectives.
        mixed = GroupGradScaler("cpu") if rank == 0 else ShardedGradScaler(device="cpu")
        mistakes.append((CollectiveMismatchError, "loss scaling", mixed))
    # Scales that differ: every rank raises at the step's end.
    init = 2.0**4 if rank == 2 else 2.0**5
    mistakes.append((ValueError, "loss scales differ", GroupGradScaler("cpu", init, group=group)))
    checked = 0
    for kind, text, scaler in mistakes:
        try:
            par.step(x, y, scaler=scaler)
        except kind as e:
            assert text in str(e), (text, str(e))
            checked += 1
            continue
        raise AssertionError(f"no {kind.__name__} ({text})")
    return checked


def run_torch(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    out = run_all(None)
    out["loss_scaled_sharded"] = loss_scaled(None, ShardedGradScaler)
    out["data_parallel_collectives"] = {
        "small": data_parallel_collectives(cnn),
        "large": data_parallel_collectives(wide_cnn),
    }
    return out


class ReadsABlock(nn.Module):
    """A forward that reads a module's weight itself, never calling it (as Hugging Face
    ProphetNet's decoder reads ``ngram_embeddings.weight``); with ``example``, the model
    brings example inputs (``dummy_inputs``), whose forward tells the blocks' call order."""

    def __init__(self, example: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.extra = nn.Embedding(2, 8)  # read, never called
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 20)
        if example:
            self.dummy_inputs = {"input_ids": torch.zeros(1, 3, dtype=torch.long)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h = torch.cat([h, self.extra.weight[None].expand(len(h), -1, -1)], 1)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(h)[:, : input_ids.shape[1]]


class _ScalarReads(TorchDispatchMode):
    """Counts the tensors read back to the host as numbers (``item()``, ``float()``, and
    ``tolist()``, which reads without dispatching an op)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._tolist = torch.Tensor.tolist

    def __enter__(self) -> _ScalarReads:
        real = self._tolist

        def tolist(t: torch.Tensor) -> Any:
            self.count += 1
            return real(t)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def alone(rank: int, world: int) -> dict[str, int]:
    """A rank alone (world 1): the one process's numbers, a wrong batch still refused, and
    nothing exchanged: no agreement (there is no one to agree with), no sum of the losses.
    A step of 3 micro-batches reads its loss to the host once, at its end (``reads``)."""
    import torch.distributed as dist

    from hetcoll.comm.distributed import TorchCommunicator

    sent = {"iallgatherv": 0, "all_reduce": 0}
    with counting(sent, (TorchCommunicator, "iallgatherv"), (dist, "all_reduce")):
        stage = {"ranks": [0], "layers": [0, 11]}
        whole = Plan.from_dict({"replicas": [{"samples": 6, "stages": [stage]}]})
        equals_one_process(None, cnn, whole, (3, 8, 8))
        par = parallelize(cnn().double(), whole, loss_fn=nn.CrossEntropyLoss())
        x, y = batches((3, 8, 8), 5, 1)[0]
        try:
            par.step(x, y)
        except ValueError as e:
            assert "the plan's replicas take 6 samples a step" in str(e), str(e)
        else:
            raise AssertionError("a batch of 5 rows passed a plan of 6")
        micro = Plan.from_dict({"microbatches": 3, "replicas": [{"samples": 6, "stages": [stage]}]})
        par = parallelize(cnn().double(), micro, loss_fn=nn.CrossEntropyLoss())
        x, y = batches((3, 8, 8), 6, 1)[0]
        with _ScalarReads() as reads:
            loss = par.step(x, y)
        assert isinstance(loss, float) and loss > 0, loss
        sent["reads"] = reads.count
    return sent


def reads_a_block(rank: int, world: int, example: bool) -> float:
    """Two stages of :class:`ReadsABlock` (cut before its second layer): its loss, equal to
    one process's."""
    from hetcoll.torch.layers import model_layers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ReadsABlock(example).double()
    n = len(model_layers(model))
    plan = {
        "microbatches": 2,
        "replicas": [
            {"samples": 4, "stages": [{"ranks": [0], "layers": [0, n - 2]},
                                      {"ranks": [1], "layers": [n - 2, n]}]},
        ],
    }  # fmt: skip

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, 20), y.reshape(-1))

    ids = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(1))
    want = float(loss_fn(model(ids), ids))
    got = parallelize(model, Plan.from_dict(plan), loss_fn=loss_fn).step({"input_ids": ids}, ids)
    assert abs(got - want) <= 1e-12 * want, (got, want)
    return got
