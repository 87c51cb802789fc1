"""The meta trace makes batch norm's outputs itself (``counting._META_OUTPUTS``) rather than
run torch's Python decomposition of it: the tensors must be those the op gives - shape,
strides, dtype, storage - in every case it takes, and the costs of models with batch norms
the same, field for field, as with the op run."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from hetcoll.model import layer_costs, networks
from hetcoll.model.costs import counting

FORWARD = torch.ops.aten.native_batch_norm.default
BACKWARD = torch.ops.aten.native_batch_norm_backward.default


def _described(t: torch.Tensor | None) -> object:
    if t is None:
        return None
    return (
        tuple(t.shape),
        t.stride(),
        t.dtype,
        t.device.type,
        t.untyped_storage().nbytes(),
        t.storage_offset(),
    )


def _outcome(func: object, args: tuple) -> object:
    try:
        return [_described(t) for t in func(*args)]  # type: ignore[operator]
    except Exception as e:  # the op's own error, whatever its kind
        return type(e)


CASES = list(
    itertools.product(
        [torch.float32, torch.float16, torch.bfloat16, torch.float64],
        [(4, 3), (4, 3, 5, 6), (2, 3, 2, 2, 2), (1, 7, 1, 1), (0, 3, 2, 2)],
        [True, False],  # affine
        [True, False],  # running statistics
        [True, False],  # weights in the input's dtype (else float32)
        [True, False],  # contiguous input (else channels last / transposed)
    )
)


@pytest.mark.parametrize(("dtype", "shape", "affine", "stats", "same", "contiguous"), CASES)
def test_batch_norm_outputs_are_the_ops(
    dtype: torch.dtype,
    shape: tuple[int, ...],
    affine: bool,
    stats: bool,
    same: bool,
    contiguous: bool,
) -> None:
    x = torch.empty(shape, dtype=dtype, device="meta")
    if not contiguous:
        x = x.transpose(0, -1)
    c = x.shape[1]
    wd = dtype if same else torch.float32
    w, b = (torch.empty(c, dtype=wd, device="meta") for _ in range(2)) if affine else (None, None)
    rm, rv = (torch.empty(c, dtype=wd, device="meta") for _ in range(2)) if stats else (None, None)
    for training in (True, False):
        args = (x, w, b, rm, rv, training, 0.1, 1e-5)
        want = _outcome(FORWARD, args)
        assert _outcome(lambda *a: counting._run(FORWARD, a, {}), args) == want
        if isinstance(want, type):
            continue
        mean, invstd = FORWARD(*args)[1:]
        for mask in (
            (True, True, True),
            (True, False, False),
            (False, True, False),
            (False, False, True),
        ):
            grad = torch.empty_like(x)
            bargs = (grad, x, w, rm, rv, mean, invstd, training, 1e-5, list(mask))
            got = _outcome(lambda *a: counting._run(BACKWARD, a, {}), bargs)
            assert got == _outcome(BACKWARD, bargs)


@pytest.mark.parametrize(
    ("model", "shape"),
    [
        (networks.build("resnet", (3, 32, 32), 10, device="meta"), (3, 32, 32)),
        (nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)), (6,)),
        (nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, affine=False)), (3, 9, 9)),
    ],
)
def test_costs_are_those_of_the_ops_run(
    model: nn.Module, shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    made = layer_costs(model, shape)
    monkeypatch.setattr(counting, "_META_OUTPUTS", {})
    run = layer_costs(model, shape)
    assert made == run
