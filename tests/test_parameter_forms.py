"""The dtypes, layouts and parameter forms users bring, on real gloo jobs against one process:

- tensors that are not C-contiguous (a view with gaps, a transposed weight, channels_last):
  gloo's broadcast wrote nothing into a strided view, so ``broadcast_parameters`` left it
  different on every rank without a word;
- layers whose forward is more than their kind's: torch's hook-based ``spectral_norm`` and
  ``weight_norm``, a user's forward hook, ``torch.nn.utils.parametrizations``. Split, they
  dropped their hooks (3.5 off after a step) or, named in ``layers=``, their
  parametrization; now they stay whole, or the split raises naming them;
- a model still on the meta device, whose split layers no ``reset_parameters`` would
  initialise;
- tensors of several dtypes packed into one byte buffer (a float64 head on a float32 body,
  a bool mask buffer, an odd number of bfloat16 values before a float32 layer): gathering a
  split model's state and a plan's first broadcast failed with "storage_offset() must be
  divisible by 8";
- a forward that updates its own buffers (a step counter): a plan cut it as a chain of
  layers, traced with the buffers read as constants, and the updates were dropped.

The MPI optimizer's and MPI broadcast's side: tests/mpi_workers/data_parallel.py.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hetcoll.launch import spawn

pytestmark = pytest.mark.multiproc


def _strided(rank, world):
    from hetcoll.torch import broadcast_parameters

    torch.manual_seed(rank)  # every rank starts different
    m = nn.Module()
    m.gaps = nn.Parameter(torch.randn(4, 10, dtype=torch.float64)[:, :3])
    m.transposed = nn.Parameter(torch.randn(3, 4, dtype=torch.float64).t())
    m.conv = nn.Conv2d(3, 4, 3).double().to(memory_format=torch.channels_last)
    layouts = [t.is_contiguous() for t in (m.gaps, m.transposed, m.conv.weight)]
    broadcast_parameters(m)
    return layouts, {n: t.detach().clone() for n, t in m.state_dict().items()}


def test_broadcast_reaches_parameters_in_any_layout():
    results = spawn(_strided, 2)
    assert results[0][0] == [False, False, False]  # none C-contiguous
    for name, want in results[0][1].items():
        assert torch.equal(results[1][1][name], want), name


def _hooked_models() -> dict[str, nn.Module]:
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
        ).double()

    models = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of the hook-based norms
        models["spectral_norm"] = net()
        torch.nn.utils.spectral_norm(models["spectral_norm"][2])
        models["weight_norm"] = net()
        torch.nn.utils.weight_norm(models["weight_norm"][2])
    models["forward_hook"] = net()
    models["forward_hook"][2].register_forward_hook(lambda m, args, out: 2 * out)
    return models


def _hooked(rank, world):
    from hetcoll.torch import filter_parallel, gather_state_dict

    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = {}
    refs = _hooked_models()  # built twice: the hook-based weight_norm cannot be deep-copied
    for kind, model in _hooked_models().items():
        ref = refs[kind]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            split = filter_parallel(model, speeds=[5.0, 3.0])
        for m in (ref, split):
            opt = torch.optim.SGD(m.parameters(), lr=0.5)
            for _ in range(2):
                opt.zero_grad()
                m(x).pow(2).sum().backward()
                opt.step()
        full = gather_state_dict(split, dst=None)
        want = ref.state_dict()
        out[kind] = {
            "keys": sorted(full) == sorted(want),
            "off": max(float((full[k] - v).abs().max()) for k, v in want.items()),
            "output": float((split(x) - ref(x)).detach().abs().max()),
            "warned": [str(w.message) for w in caught if "left replicated" in str(w.message)],
        }
    return out


def test_layers_with_hooks_stay_whole_and_train_as_the_unsplit_model():
    for got in spawn(_hooked, 2):
        for kind, r in got.items():
            assert r["keys"], kind  # weight_orig / weight_g ... kept
            assert r["off"] <= 1e-12 and r["output"] <= 1e-12, (kind, r)
        assert "'2' (Linear, a weight made by a hook)" in got["spectral_norm"]["warned"][0]
        assert "'2' (Linear, a weight made by a hook)" in got["weight_norm"]["warned"][0]
        assert "'2' (Linear, forward hooks)" in got["forward_hook"]["warned"][0]


def test_naming_a_layer_that_cannot_be_split_raises():
    from torch.nn.utils.parametrizations import orthogonal

    from hetcoll.torch.filters import filter_shares

    for model in _hooked_models().values():
        with pytest.raises(ValueError, match=r"^layers: '2' cannot be split: it has "):
            filter_shares(model, size=2, speeds=[1.0, 1.0], layers=["0", "2"])
    model = nn.Sequential(nn.Linear(4, 4), orthogonal(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match=r"'1' cannot be split: it has parametrizations, and"):
        filter_shares(model, size=2, speeds=[1.0, 1.0], layers=["1"])

    class Scaled(nn.Linear):  # an adapter-like layer: more than x @ W.T + b
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(4, 4), Scaled(4, 4))
    with pytest.raises(ValueError, match=r"'1' cannot be split: it has a forward of its own"):
        filter_shares(model, size=2, speeds=[1.0, 1.0], layers=["1"])


def test_a_model_on_the_meta_device_is_refused():
    from hetcoll.torch import filter_parallel

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(ValueError, match=r"^model: '0\.weight' is on the meta device; materi"):
        filter_parallel(model, speeds=[1.0, 1.0])


class _MixedDtypes(nn.Module):
    """A float32 body, a float64 head: the split layers' gathered bytes mix 4- and 8-byte
    values."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 7)
        self.head = nn.Linear(7, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)).double())


def _mixed(rank, world):
    from hetcoll.torch import (
        filter_parallel,
        gather_gradients,
        gather_optimizer_state_dict,
        gather_state_dict,
    )

    model = _MixedDtypes()
    ref = copy.deepcopy(model)
    split = filter_parallel(model, speeds=[5.0, 3.0])
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, split)]
    for m in (ref, split):
        m(x).sum().backward()
    grads = gather_gradients(split, dst=None)
    for opt in opts:
        opt.step()
    full = gather_state_dict(split, dst=None)
    moments = gather_optimizer_state_dict(split, opts[1], dst=None)
    want = ref.state_dict()
    return {
        "dtypes": {k: str(v.dtype) for k, v in full.items()}
        == {k: str(v.dtype) for k, v in want.items()},
        "weights": max(float((full[k] - v).abs().max()) for k, v in want.items()),
        "grads": max(float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters()),
        "moments": len(moments["state"]),
    }


def test_a_split_of_mixed_dtypes_gathers_its_state():
    for got in spawn(_mixed, 2):
        assert got["dtypes"] and got["moments"] == 4, got
        assert got["weights"] <= 1e-6 and got["grads"] <= 1e-6, got  # float32 sums' order


class _Masked(nn.Module):
    """A float64 chain with a bool buffer of 3 bytes registered ahead of its weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.a = nn.Linear(4, 6).double()
        self.b = nn.Linear(6, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class _Counting(nn.Module):
    """Counts its training steps and halves a decay in buffers, updated in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 12).double()
        self.b = nn.Linear(12, 10).double()
        self.out = nn.Linear(10, 3).double()
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("decay", torch.ones((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1
            self.decay.mul_(0.5)
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _planned(rank, world, make):
    from hetcoll.torch import parallelize
    from hetcoll.torch.layers import model_cut

    model = make()
    ref = copy.deepcopy(model)
    n = len(model_cut(model).layers)
    stages = [{"ranks": [0], "layers": [0, 1]}, {"ranks": [1], "layers": [1, n]}]
    plan = {"microbatches": 1, "replicas": [{"samples": 6, "stages": stages}]}
    par = parallelize(model, plan, loss_fn=F.cross_entropy)
    g = torch.Generator().manual_seed(1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (par, ref)]
    for _ in range(2):
        x = torch.randn(6, ref.a.in_features, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (6,), generator=g)
        par.step(x, y)
        F.cross_entropy(ref(x), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    full = par.full_state_dict()
    want = ref.state_dict()
    return {
        "keys": sorted(full) == sorted(want),
        "off": max(float((full[k].double() - v.double()).abs().max()) for k, v in want.items()),
    }


@pytest.mark.parametrize("make", [_Masked, _Counting])
def test_a_plan_keeps_buffers_of_any_dtype_and_their_updates(make):
    for got in spawn(_planned, 2, make):
        assert got["keys"] and got["off"] <= 1e-12, got


class _HalfBody(nn.Module):
    """bfloat16 layers of an odd number of entries (40 and 10 bytes), then float32 ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 3, bias=False).to(torch.bfloat16)
        self.b = nn.Linear(3, 5).to(torch.bfloat16)
        self.head = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x.bfloat16())).float())


def _half(rank, world):
    from hetcoll.torch import parallelize

    model = nn.Sequential(_HalfBody(), nn.ReLU(), nn.Linear(2, 2))
    want = copy.deepcopy(model).state_dict()
    stages = [{"ranks": [0], "layers": [0, 1]}, {"ranks": [1], "layers": [1, 3]}]
    plan = {"microbatches": 2, "replicas": [{"samples": 4, "stages": stages}]}
    full = parallelize(model, plan, loss_fn=F.cross_entropy).full_state_dict()
    return all(torch.equal(full[k], v) and full[k].dtype == v.dtype for k, v in want.items())


def test_a_plan_broadcasts_bfloat16_before_float32():
    assert spawn(_half, 2) == [True, True]
