"""The CUDA paths (`pytest -m cuda`; skipped where no CUDA device is): hetcoll.weighted_sum and
hetcoll.allreduce / allgatherv on CUDA tensors, the weighted DDP hook on NCCL (world size 1)
and on gloo with a GPU rank beside CPU ranks, filter_parallel and parallelize with one CUDA
rank beside CPU ranks over gloo (tensors staged through host memory), language models (GPT-2,
Llama) through plans with the GPU rank beside CPU ranks, BalancedStrategy with
accelerator="gpu", and bf16 autocast through a plan. The multi-rank cases live in
tests/cuda_cases.py; float64 to 1e-10 where the math is exact, else the tolerance each states.

Where no GPU is at hand the same code runs here with every rank on the CPU: the device-generic
weighted sum against the Rust kernel, and the autocast plan cases on CPU ranks (not marked).
"""

from __future__ import annotations

import re
import warnings

import cuda_cases
import numpy as np
import pytest
import torch
from torch import nn

import hetcoll
from hetcoll import launch
from hetcoll.kernels import (
    FUSED_MAX_ARRAYS,
    fused_device_kernel,
    fused_source,
    weighted_sum_device,
)

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
cuda = [pytest.mark.cuda, needs_cuda]

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
#: Against the Rust kernel (which accumulates 16-bit types in float32 too, in the same order):
#: float64 1e-10 and float32 1e-6 relative; 16-bit types one rounding of the result apart.
KERNEL_TOL = {torch.float64: 1e-10, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _inputs(dtype: torch.dtype, k: int = 4, n: int = 10_001) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for _ in range(k)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).abs().max() / b.abs().max())


# -- weighted_sum ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=cuda), "cpu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_device_weighted_sum_equals_the_rust_kernel(device, dtype):
    """torch's ops on the tensors' device (on the CPU too, where it can be compared with the
    kernel in one process), new output and in place into one of the arrays."""
    xs, w = _inputs(dtype), [0.25, -1.5, 3.0, 0.125]
    want = hetcoll.weighted_sum(xs, w)  # the Rust kernel, CPU
    on = [x.to(device) for x in xs]
    got = weighted_sum_device(on, w) if device == "cpu" else hetcoll.weighted_sum(on, w)
    assert got.device.type == device and got.dtype == dtype
    assert _rel(got, want) <= KERNEL_TOL[dtype]
    into = on[2]
    out = hetcoll.weighted_sum(on, w, out=into) if device == "cuda" else None
    if device == "cpu":
        out = weighted_sum_device(on, w, out=into)
    assert out is into
    assert _rel(out, want) <= KERNEL_TOL[dtype]


def test_the_fused_device_kernels_source_is_what_jiterator_takes():
    """Where no GPU is at hand: each fused kernel's source parses as torch's jiterator reads it
    (its kernel named, one weight argument per array, in order), and more arrays than
    jiterator takes have no fused kernel (the add_ chain sums them)."""
    from torch.cuda.jiterator import _CodeParser

    for k in range(1, FUSED_MAX_ARRAYS + 1):
        for acc in ("float", "double"):
            parsed = _CodeParser(fused_source(k, acc))
            assert parsed.function_name == f"hetcoll_weighted_sum_{k}_{acc}"
            kernel = fused_device_kernel(k, acc)
            assert kernel is not None and list(kernel.kwargs_dict) == [f"w{i}" for i in range(k)]
    assert fused_device_kernel(FUSED_MAX_ARRAYS + 1, "float") is None
    assert fused_device_kernel(0, "float") is None


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_weighted_sum_is_one_fused_pass(dtype):
    """On CUDA, 1 to 8 arrays are summed by one fused kernel (jiterator; 1 and 8 here, each
    compiled at its first call): it compiles (no warning that it fell back to the add_ chain),
    equals the Rust kernel, and a new output is the only memory it takes (the chain's float32
    accumulator for 16-bit types is gone); into out, in place or not, and 9 arrays (the
    chain), it equals the kernel too."""
    n = 10_001
    rounded = -(-n * torch.tensor([], dtype=dtype).element_size() // 512) * 512  # allocator
    for k in (1, 8, 9):  # one array, the most one kernel takes, and the chain beyond
        xs = _inputs(dtype, k, n)
        w = [0.25 + 0.5 * i * (-1) ** i for i in range(k)]
        want = hetcoll.weighted_sum(xs, w)  # the Rust kernel, CPU
        on = [x.cuda() for x in xs]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            got = hetcoll.weighted_sum(on, w)
            torch.cuda.synchronize()
            taken = torch.cuda.max_memory_allocated() - base
            assert _rel(got, want) <= KERNEL_TOL[dtype], k
            if k <= FUSED_MAX_ARRAYS:
                assert taken == rounded, (k, taken, rounded)
            into = torch.empty_like(on[0])
            assert hetcoll.weighted_sum(on, w, out=into) is into
            assert _rel(into, want) <= KERNEL_TOL[dtype], k
            assert hetcoll.weighted_sum(on, w, out=on[-1]) is on[-1]
            assert _rel(on[-1], want) <= KERNEL_TOL[dtype], k


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=cuda), "cpu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_the_nccl_hooks_division_on_the_device_is_one_rounding(device, dtype):
    """The weighted DDP hook on NCCL divides each bucket by the ranks' count summed on the
    device (hooks._divide_), not read on the host: each element within one rounding of the
    exact quotient, 16-bit buckets included (counts they cannot hold)."""
    from hetcoll.torch.hooks import _divide_

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    for n in (3, 7, 1000, 4097, 100_003):
        got = x.clone()
        _divide_(got, torch.tensor(n, device=device))
        exact = x.double().cpu() / n
        error = (got.double().cpu() - exact).abs()
        info = torch.finfo(dtype)  # spacing eps * |q|, and eps * tiny among subnormals
        assert bool((error <= info.eps * (exact.abs() + info.tiny)).all()), n


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=cuda), "cpu"])
def test_device_weighted_sum_refuses_what_the_kernel_refuses(device):
    """The same argument errors as the Rust path: the weights' own (count, finiteness, from the
    kernel itself), dtype, shape, contiguity, overlap with out, out requiring grad."""
    run = hetcoll.weighted_sum if device == "cuda" else weighted_sum_device
    x, y = (t.to(device) for t in _inputs(torch.float64, 2, 16))
    cases = [
        (([x, y], [1.0]), ValueError, "weights: has 1 entries but arrays has 2"),
        (([x, y], [1.0, float("nan")]), ValueError, "weights[1]: must be finite"),
        (([x, y.float()], [1.0, 1.0]), TypeError, "arrays[1]: dtype torch.float32 does not"),
        (([x, y[:8]], [1.0, 1.0]), ValueError, "arrays[1]: has shape (8,)"),
        (([x.view(4, 4).t(), y.view(4, 4)], [1.0, 1.0]), ValueError, "must be C-contiguous"),
        (([x.int(), y.int()], [1.0, 1.0]), TypeError, "arrays[0]: dtype torch.int32"),
    ]
    for args, kind, message in cases:
        with pytest.raises(kind, match=re.escape(message)):
            run(*args)
        if device == "cpu":  # the Rust path says the same
            with pytest.raises(kind):
                hetcoll.weighted_sum(*args)
    z = torch.zeros(24, dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match=re.escape("arrays[0]: overlaps out in memory")):
        run([z[:16], y], [1.0, 1.0], out=z[8:])
    out = torch.zeros(16, dtype=torch.float64, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match="out: requires grad"):
        run([x, y], [1.0, 1.0], out=out)


@pytest.mark.cuda
@needs_cuda
def test_weighted_sum_refuses_a_mix_of_devices():
    """CUDA and CPU tensors in one call: a TypeError that says to put them on one device."""
    x = torch.ones(4, device="cuda")
    with pytest.raises(TypeError, match=r"arrays\[1\]: is cpu but arrays\[0\] is on cuda"):
        hetcoll.weighted_sum([x, torch.ones(4)], [1.0, 1.0])
    with pytest.raises(TypeError, match=r"arrays\[1\]: is on cuda:0; the Rust kernels"):
        hetcoll.weighted_sum([torch.ones(4), x], [1.0, 1.0])
    with pytest.raises(TypeError, match="out: is ndarray"):
        hetcoll.weighted_sum([x, x], [1.0, 1.0], out=np.zeros(4, np.float32))


@pytest.mark.cuda
@needs_cuda
def test_a_gpus_item_counts_are_read_at_once():
    """``items`` counts a step's micro-batches as tensors on the GPU: count_items_of reads
    them in one transfer (one sync of the host, not one a micro-batch), each the count
    count_items gives for it on the CPU, a bad one (negative) as bad there."""
    from hetcoll.torch.batches import count_items, count_items_of

    values = [torch.tensor(5), torch.tensor(7, dtype=torch.int32), torch.tensor([2]), 4]
    values += [torch.tensor(-3), torch.tensor(2**40)]
    on = [v.cuda() if isinstance(v, torch.Tensor) else v for v in values]
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            got = count_items_of(lambda v: v, on)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1
    want = [count_items(lambda v: v, v) for v in values]
    assert [(c.status, c.value) for c in got] == [(c.status, c.value) for c in want]
    assert got[4].failure is not None and "returned tensor(-3, device='cuda:0')" in str(
        got[4].failure
    )


# -- collectives, DDP, filter_parallel, plans: real ranks ------------------------------------


def _spawn(fn, world, *args, backend="gloo"):
    return launch.spawn(fn, world, *args, backend=backend, timeout=240)


@pytest.mark.multiproc
@pytest.mark.cuda
@needs_cuda
def test_collectives_with_a_gpu_rank_beside_cpu_ranks():
    """allreduce (auto, native, direct, ring; float64 1e-10, float32 / 16-bit at stated
    tolerances) and allgatherv (bitwise) with rank 0's tensors on the GPU, over gloo."""
    assert _spawn(cuda_cases.collectives, 3) == [{"checked": 18}] * 3


@pytest.mark.multiproc
@pytest.mark.cuda
@needs_cuda
def test_nccl_at_world_size_one(tmp_path):
    """NCCL's own allreduce (weight in PREMUL_SUM) and allgatherv, and the weighted DDP hook:
    one step equals one process in float64 to 1e-10; a SyncBatchNorm training under the hook
    warns once where the loss is not weighed (``state.weigh``). What moves host bytes goes
    through the GPU (NCCL moves device memory only): a CPU tensor's allgatherv, the gathers
    of a split model's state and its optimizer's, DCP's checkpoint and full state dict of a
    split, each exact. (One launch: the device script's time is short.)"""
    got = _spawn(cuda_cases.nccl_one_rank, 1, str(tmp_path / "ckpt"), backend="nccl")
    host = {"on_host": True, "full": 0.0, "on_device": True, "off": 0.0}
    assert got == [
        {"steps": 1, "sync_bn_told": [1, 0], **host, "gathered": [4, 4], "gathers_off": 0.0}
    ]


@pytest.mark.multiproc
@pytest.mark.cuda
@needs_cuda
def test_fsdp_with_weighed_losses_on_nccl():
    """FSDP2 on one GPU (NCCL): weigh_loss takes a CUDA count (at world size 1 nothing is
    exchanged); the gradients are the plain model's."""
    got = _spawn(cuda_cases.fsdp_nccl, 1, backend="nccl")
    assert got == [{"weighs 1": True, "plain gradients": True}]


@pytest.mark.multiproc
@pytest.mark.cuda
@needs_cuda
def test_step_timer_under_fsdp_on_nccl_reads_cuda_events():
    """FSDP2 on one GPU (NCCL): the timer's marks and FSDP's spans are CUDA events; a step of
    long kernels reads between half and all of torch's own events around it."""
    (got,) = _spawn(cuda_cases.fsdp_nccl_timer, 1, backend="nccl")
    assert 0.5 * got["whole"] <= got["timed"] <= got["whole"] * 1.01 + 1e-4, got


@pytest.mark.multiproc
@pytest.mark.cuda
@needs_cuda
def test_ddp_hook_on_gloo_with_a_gpu_rank():
    """DDP over gloo, rank 0's model on the GPU, shares 5:2:3: the weighted hook ("auto":
    the direct exchange, and "allreduce") gives the full-batch gradient to 1e-10."""
    assert _spawn(cuda_cases.ddp_mixed, 3) == [{"steps": 2}] * 3


@pytest.mark.multiproc
@pytest.mark.cuda
@needs_cuda
def test_filter_parallel_with_a_gpu_rank():
    """filter_parallel over gloo with rank 0's channels on the GPU (speeds 29:7:1, and every
    layer gathering in float32): equals the unsplit model."""
    modes = ["gather", "split-input", "split-output"]
    assert _spawn(cuda_cases.filter_mixed, 3) == [{"modes": modes}] * 3


@pytest.mark.multiproc
@pytest.mark.cuda
@needs_cuda
def test_dcp_of_a_split_offloaded_from_the_gpu(tmp_path):
    """get_state_dict's cpu_offload copies the GPU rank's slices into host memory; dcp.save of
    the copies is the unsplit model (the CPU suite's copy stands in for it:
    tests/test_dcp.py). Its full_state_dict gives the unsplit tensors, on the GPU there.

    The checkpoint agrees to float64's 1e-10, not bitwise: a parameter both ranks hold whole
    (the middle layer's bias, which the first rank adds) is stepped by each rank on its own
    device, and the GPU's sine and AdamW round differently from the CPU's in the last bit (the
    H100 run: 6.9e-18). dcp writes one rank's copy of it, gather_state_dict rank 0's."""
    got = _spawn(cuda_cases.dcp_offloaded, 2, str(tmp_path / "ckpt"))
    each = {"on_host": True, "full": 0.0, "on_device": True}
    off = got[0].pop("off")
    assert got == [each, each]
    assert off <= 1e-10


@pytest.mark.multiproc
@pytest.mark.cuda
@needs_cuda
def test_parallelize_with_a_gpu_rank():
    """Four plans with the GPU rank as a pipeline stage, a whole-model replica (beside a CPU
    pipeline, and beside CPU replicas: data parallelism, its step's fields in the gradients'
    sum) and one rank of a split stage, beside CPU ranks over gloo: equal one process,
    float64 1e-10."""
    assert _spawn(cuda_cases.plans_mixed, 3) == [{"plans": 4}] * 3


@pytest.mark.multiproc
@pytest.mark.parametrize("first", [pytest.param("cuda", marks=cuda), "cpu"])
def test_language_models_through_plans_with_a_gpu_rank(first):
    """GPT-2 and Llama, token-weighted, in two plans each with the GPU rank as a pipeline
    stage and as the fast rank of a split stage whose slow CPU rank holds no heads (Llama in a
    third, a 3-rank split stage by query head; Mixtral there too, and in two plans placing
    its experts whole on the replicas' ranks; Llama's decoder layers compiled after
    parallelize in the second): equal one process on the CPU. With ``first="cpu"`` every
    rank is a CPU rank."""
    assert _spawn(cuda_cases.lm_plans_mixed, 4, first) == [{"plans": 9}] * 4


@pytest.mark.multiproc
@pytest.mark.parametrize("first", [pytest.param("cuda", marks=cuda), "cpu"])
def test_bf16_autocast_through_a_plan(first):
    """Each rank under torch.autocast(bf16) on its own device: replicas and a pipeline
    boundary (which travels in its own dtype); equal the same autocast computation in one
    process to 1e-5. With ``first="cpu"`` every rank is a CPU rank (CPU autocast)."""
    assert _spawn(cuda_cases.autocast_plan, 2, first) == [{"dtypes": ["torch.bfloat16"]}] * 2


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("first", "scaler"),
    [
        pytest.param("cuda", "group", marks=cuda),
        pytest.param("cuda", "sharded", marks=cuda),
        ("cpu", "group"),
    ],
)
def test_fp16_loss_scaling_through_a_plan(first, scaler):
    """float16 autocast, hetcoll's GroupGradScaler (its flag read back from the GPU) or torch's
    ShardedGradScaler: a stage on the GPU rank, one on a CPU rank, an idle CPU rank. An
    overflow only the CPU stage finds makes every rank skip the step and halve its scale; the
    model trains as one process under the same autocast with a GradScaler, to 1e-2. With
    ``first="cpu"`` every rank is a CPU rank (CPU autocast)."""
    got = _spawn(cuda_cases.fp16_scaled_plan, 3, first, scaler)
    for rank, r in enumerate(got):
        computes = rank < 2  # rank 2 is idle
        assert r == {
            "dtypes": ["torch.float16"] if computes else [],
            "scales": [4096.0, 2048.0, 2048.0],
            "skipped": [1] if computes else None,
        }, (rank, r)


@pytest.mark.cuda
@needs_cuda
def test_cpu_draws_give_a_gpu_tensor_the_cpus_masks():
    """Under CpuDraws a CUDA tensor's dropout, channel dropout, ``bernoulli_`` fill,
    ``rand(device=cuda)`` and in-place dropout draw from the CPU generator: bitwise what the
    CPU computes from the same seed, the gradient too; the CUDA generator is left as it was."""
    from hetcoll.torch.filters.streams import CpuDraws

    x = torch.randn(6, 5, 4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    gx = x.cuda().requires_grad_()
    cx = x.clone().requires_grad_()
    torch.manual_seed(3)  # seeds the CUDA generator too: its state is read after
    cuda_state = torch.cuda.get_rng_state()
    with CpuDraws():
        got = [
            nn.functional.dropout(gx, 0.3),
            nn.functional.dropout2d(gx, 0.5),
            torch.empty(7, device="cuda").bernoulli_(0.4),
            torch.rand(3, device="cuda"),
            nn.Dropout(0.5, inplace=True)(gx * 1),
        ]
    torch.manual_seed(3)
    want = [
        nn.functional.dropout(cx, 0.3),
        nn.functional.dropout2d(cx, 0.5),
        torch.empty(7).bernoulli_(0.4),
        torch.rand(3),
        nn.Dropout(0.5, inplace=True)(cx * 1),
    ]
    for g, w in zip(got, want, strict=True):
        assert g.device.type == "cuda"
        assert torch.equal(g.cpu(), w)
    # Each draw's gradient on its own: their sum also depends on the order in which autograd
    # accumulates the three into the leaf, which the graph across devices (its copies to and
    # from the host) may change. The first GPU run's sums differed in the last bits.
    for i, loss in ((0, torch.sum), (1, lambda t: t.pow(2).sum()), (4, torch.sum)):
        (g,) = torch.autograd.grad(loss(got[i]), gx, retain_graph=True)
        (w,) = torch.autograd.grad(loss(want[i]), cx, retain_graph=True)
        assert g.device.type == "cuda"
        assert torch.equal(g.cpu(), w), f"gradient of draw {i}"
    assert torch.equal(torch.cuda.get_rng_state(), cuda_state)


@pytest.mark.multiproc
@pytest.mark.parametrize("first", [pytest.param("cuda", marks=cuda), "cpu"])
def test_dropout_in_a_split_with_a_gpu_rank(first):
    """BERT with dropout split by heads over the GPU rank and two CPU ranks: the masks on
    whole tensors are drawn on the CPU on every rank, so the ranks' copies of the hidden
    states and LayerNorms agree to 1e-10 over 3 steps; ranks seeded apart raise. With
    ``first="cpu"`` every rank is a CPU rank."""
    assert _spawn(cuda_cases.dropout_mixed, 3, first) == [{"raised": True}] * 3


@pytest.mark.multiproc
@pytest.mark.parametrize("first", [pytest.param("cuda", marks=cuda), "cpu"])
def test_a_gpu_rank_holding_every_head_broadcasts_as_its_cpu_peer_does(first):
    """A split stage's sole holder (the CPU rank too slow for any head) makes the partial
    sums a broadcast on every rank, the GPU rank's too: GPT-2 then trains as unsplit, float64
    to 1e-10. With ``first="cpu"`` both ranks are CPU ranks."""
    got = _spawn(cuda_cases.sole_holder_mixed, 2, first)
    for one in got:
        assert one["worst"] <= 1e-10, got
        # Each split attention's heads: all on rank 0 (the sole holder), none on rank 1.
        assert one["heads"] and all(h[1] == 0 < h[0] for h in one["heads"]), got


@pytest.mark.multiproc
@pytest.mark.parametrize("first", [pytest.param("cuda", marks=cuda), "cpu"])
def test_expert_parallel_with_a_gpu_rank(first):
    """Mixtral's and GPT-OSS's experts placed on a GPU rank and two CPU ranks by speed, DDP
    with the weighted hook over gloo: equal one process on the CPU; an ExpertRebalancer moves
    Mixtral's between the GPU and the CPU ranks (the speeds reversed), its gradients clipped
    by the whole model's norm, and training still equals it. With ``first="cpu"`` every rank
    is a CPU rank."""
    layers = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    # Each rank's experts (test_expert_parallel's BY_LOAD): moved after step 2, kept after 4.
    by_load = dict(zip(layers, [[[], [0], [1, 2, 3]], [[], [2], [0, 1, 3]]], strict=True))
    placed = {
        "mixtral": [3, 1, 0],
        "gpt_oss": [3, 1, 0],
        "rebalanced": [[2, by_load, True], [4, by_load, False]],
    }
    assert _spawn(cuda_cases.experts_mixed, 3, first) == [placed] * 3


@pytest.mark.multiproc
@pytest.mark.cuda
@needs_cuda
def test_expert_parallel_on_nccl():
    """The tokens' all-to-all on NCCL (world size 1): Mixtral equals one process on the CPU."""
    assert _spawn(cuda_cases.experts_nccl, 1, backend="nccl") == [{"checked": 21}]


# -- Lightning ------------------------------------------------------------------------------


@pytest.mark.multiproc  # Lightning's process group takes a rendezvous port
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
@pytest.mark.usefixtures("lightning_without_mpi")  # as test_lightning's Trainers
def test_balanced_strategy_on_the_gpu(tmp_path, monkeypatch, backend):
    """BalancedStrategy with accelerator="gpu" (one device, NCCL or gloo): the weights after
    two epochs equal one process on the CPU, float64 to 1e-10. Lightning runs one device in
    this process and keeps its process group until exit: the test ends it, so that the next
    backend gets a group of its own."""
    pytest.importorskip("lightning")
    import torch.distributed as dist
    from lightning.pytorch import Trainer
    from test_lightning import BATCH, Regression, reference

    from hetcoll.lightning import BalancedStrategy

    class OnDevices(Regression):
        """Records where its parameters are at the end of training, before the teardown."""

        devices: frozenset[str] = frozenset()

        def on_train_end(self) -> None:
            self.devices = frozenset(p.device.type for p in self.parameters())
            super().on_train_end()

    trainer = Trainer(
        strategy=BalancedStrategy(shares=[BATCH], process_group_backend=backend),
        accelerator="gpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    monkeypatch.setenv("MASTER_PORT", str(launch.free_port()))
    module = OnDevices(True, tmp_path)
    try:
        trainer.fit(module)
        assert dist.get_backend() == backend
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Trained on the GPU; Lightning's teardown then moves the module back to the CPU.
    assert module.devices == {"cuda"}
    got = list(trainer.lightning_module.net.parameters())
    assert trainer.strategy.hook_state is not None
    for a, b in zip(got, reference(2, shuffle=True), strict=True):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a.detach().cpu(), b, rtol=0, atol=1e-10)


@pytest.mark.cuda
@needs_cuda
def test_step_timer_times_the_gpu_work_not_its_queueing():
    """On a GPU the hooks run as the work is queued: the timer reads CUDA events, so a step
    whose kernels take long is timed at their length (at least the length torch's own events
    give the same work), not at the microseconds of queueing it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1)).cuda()
    timed, whole = cuda_cases.timed_gpu_step(model, torch.randn(8192, 4096, device="cuda"))
    assert 0.5 * whole <= timed <= whole * 1.01 + 1e-4


def test_cuda_marker_is_registered(pytestconfig):
    """`pytest -m cuda` selects these tests without an unknown-marker warning."""
    markers = pytestconfig.getini("markers")
    assert any(m.startswith("cuda:") for m in markers)


_ = nn  # the cases module builds the models
