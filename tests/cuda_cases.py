"""CUDA cases that run inside every rank of a real job (launched by tests/test_cuda.py).

A mixed job puts rank 0 on the GPU and the other ranks on the CPU, all in one gloo group: the
real heterogeneity hetcoll is for. Each case checks against one process on the CPU, in float64
to 1e-10 (relative) where the math is exact, else at the tolerance it states. A failing check
raises, which fails the launch.
"""

from __future__ import annotations

import copy
import warnings

import filter_cases
import plan_cases
import torch
import torch.distributed as dist
from torch import nn

import hetcoll
from hetcoll import CollectiveMismatchError, Plan
from hetcoll.collectives import allgatherv_autograd
from hetcoll.torch import GroupGradScaler, parallelize, register_weighted_hook

from dp_common import make_data, make_model, reference_step, rel_err

TOL = 1e-10


def device_of(rank: int, first: str) -> torch.device:
    """Rank 0 on ``first`` (``"cuda"``: the GPU), the others on the CPU. The cases run with
    ``first="cpu"`` too: the same code with every rank on the CPU, where no GPU is at hand."""
    return torch.device(first, 0) if rank == 0 and first == "cuda" else torch.device("cpu")


def _data(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def collectives(rank: int, world: int, first: str = "cuda") -> dict[str, int]:
    """allreduce (every algorithm, weighted) and allgatherv (and its autograd) with rank 0's
    tensors on the GPU beside CPU ranks: the device tensor is staged through host memory and
    takes the same algorithm as the CPU ranks."""
    dev = device_of(rank, first)
    weights = [(r + 1) / 7 for r in range(world)]
    checked = 0
    for n in (5, 1000, 300_001):  # inline in the agreement, small, ring-sized
        want = sum(w * _data(r, n, torch.float64) for r, w in enumerate(weights))
        for algorithm in ("auto", "native", "direct", "ring"):
            buf = _data(rank, n, torch.float64).to(dev)
            got = hetcoll.allreduce(buf, weight=weights[rank], algorithm=algorithm)
            assert got is buf and got.device == dev, (got.device, dev)
            err = rel_err(got.cpu(), want)
            assert err <= TOL, (n, algorithm, err)
            checked += 1
    # 16-bit and float32: reduced in float32 on the host, rounded once per ring hop.
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        want = sum(w * _data(r, 4096, dtype).double() for r, w in enumerate(weights))
        buf = _data(rank, 4096, dtype).to(dev)
        hetcoll.allreduce(buf, weight=weights[rank], algorithm="ring")
        assert buf.dtype == dtype
        err = rel_err(buf.cpu().double(), want)
        assert err <= tol, (dtype, err)
        checked += 1
    # Uneven pieces gathered: a copy, so bitwise.
    pieces = [
        torch.arange(3 * (r + 1), dtype=torch.float64).view(r + 1, 3) + r for r in range(world)
    ]
    out = hetcoll.allgatherv(pieces[rank].to(dev))
    assert out.device == dev
    assert torch.equal(out.cpu(), torch.cat(pieces))
    # Its autograd form: backward keeps this rank's rows of the summed gradient.
    x = pieces[rank].to(dev).requires_grad_(True)
    y = allgatherv_autograd(x)
    (y * (rank + 1)).sum().backward()
    assert x.grad is not None and x.grad.device == dev
    assert torch.equal(x.grad.cpu(), torch.full((rank + 1, 3), float(sum(range(1, world + 1)))))
    checked += 2
    # Ranks that disagree (the GPU rank's dtype) raise on every rank, whatever the device.
    dtype = torch.float32 if rank == 0 else torch.float64
    try:
        hetcoll.allreduce(torch.ones(8, dtype=dtype, device=dev))
    except CollectiveMismatchError:
        checked += 1
    else:
        raise AssertionError("a dtype mismatch between ranks did not raise")
    return {"checked": checked}


def nccl_one_rank(rank: int, world: int, path: str) -> dict[str, object]:
    """World size 1 on NCCL: allreduce and allgatherv on the device (NCCL's own, the weight in
    PREMUL_SUM), the weighted DDP hook training as one process does, and what moves host
    bytes (:func:`nccl_host_buffers`, checkpoints at ``path``)."""
    assert dist.get_backend() == "nccl"
    dev = torch.device("cuda", 0)
    buf = _data(0, 1000, torch.float64).to(dev)
    want = 0.375 * buf.cpu()
    hetcoll.allreduce(buf, weight=0.375)
    assert buf.device == dev and rel_err(buf.cpu(), want) <= TOL
    out = hetcoll.allgatherv(torch.arange(6.0, device=dev).view(2, 3))
    assert out.device == dev and torch.equal(out.cpu(), torch.arange(6.0).view(2, 3))
    return {
        "steps": ddp_steps(dev, [10], 0),
        "sync_bn_told": sync_bn_told(dev),
        **nccl_host_buffers(rank, world, path),
    }


def sync_bn_told(dev: torch.device) -> list[int]:
    """A SyncBatchNorm training under the weighted hook: steps whose losses are not weighed
    (``state.weigh``) warn once, weighed ones never (the warnings of [not weighed, weighed])."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    told = []
    for weigh in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.SyncBatchNorm(6), nn.Linear(6, 3))
        ddp = DDP(model.double().to(dev), device_ids=[dev.index])
        state = register_weighted_hook(ddp)
        x = torch.randn(8, 4, dtype=torch.float64, device=dev)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                loss = ddp(x).pow(2).mean()
                (state.weigh(loss) if weigh else loss).backward()
        told.append(sum("state.weigh(loss)" in str(w.message) for w in seen))
    return told


def ddp_steps(dev: torch.device, shares: list[int], rank: int, algorithm: str = "auto") -> int:
    """DDP with the weighted hook, this rank's model on ``dev``, one step on its share of a
    global batch of ``sum(shares)``: gradients and parameters equal one process (float64)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    n = sum(shares)
    x, y = make_data(n)
    lo = sum(shares[:rank])
    xs, ys = x[lo : lo + shares[rank]].to(dev), y[lo : lo + shares[rank]].to(dev)
    model = make_model().to(dev)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    from hetcoll.torch import WeightedAllreduceState, weighted_allreduce_hook

    if algorithm == "auto":
        register_weighted_hook(ddp)
    else:
        state = WeightedAllreduceState(None, local_batch=shares[rank], algorithm=algorithm)
        ddp.register_comm_hook(state, weighted_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    nn.functional.cross_entropy(ddp(xs), ys).backward()
    grads, params = reference_step(n)
    for p, g in zip(model.parameters(), grads, strict=True):
        assert p.grad is not None and p.grad.device == dev
        assert rel_err(p.grad.cpu(), g) <= TOL, rel_err(p.grad.cpu(), g)
    opt.step()
    for p, want in zip(model.parameters(), params, strict=True):
        assert rel_err(p.detach().cpu(), want) <= TOL
    return 1


def ddp_mixed(rank: int, world: int, first: str = "cuda") -> dict[str, int]:
    """The weighted DDP hook on gloo, the GPU rank's buckets beside CPU ranks' (both the
    direct exchange "auto" takes and the allreduce path)."""
    dev = device_of(rank, first)
    shares = [5, 2, 3][:world]
    steps = ddp_steps(dev, shares, rank, "auto") + ddp_steps(dev, shares, rank, "allreduce")
    return {"steps": steps}


def filter_mixed(rank: int, world: int, first: str = "cuda") -> dict[str, object]:
    """filter_parallel with the GPU rank's channels beside CPU ranks': outputs, gradients and
    parameters after 3 steps equal the unsplit model (float64 1e-10, float32 1e-5 with cuDNN's
    TF32 off)."""
    dev = device_of(rank, first)
    speeds = [29.0, 7.0, 1.0][:world]
    modes = filter_cases.equals_unsplit(None, speeds, torch.float64, device=dev)
    shares = {"0": [29, 7, 1], "3": [40, 20, 1], "6": [3, 1, 1], "8": [10, 2, 1], "10": [5, 1, 1]}
    # cuDNN convolves float32 in TF32 unless told not to (torch's default): a 10-bit mantissa
    # whose error (1e-4 relative on the H100) is the GPU's, not the split's. In IEEE float32 the
    # split is checked against the CPU's unsplit model at float32's tolerance.
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        filter_cases.equals_unsplit(None, shares, torch.float32, avoid_gathers=False, device=dev)
    return {"modes": sorted(set(modes.values()))}


def dcp_offloaded(rank: int, world: int, path: str, first: str = "cuda") -> dict[str, object]:
    """torch.distributed.checkpoint of a split MLP whose GPU rank's slices
    ``get_state_dict(..., cpu_offload=True)`` copies into host memory (the copies keep the
    slices' marks): the checkpoint torch's converter reads is the unsplit model, exactly; and
    its full state dict (``full_state_dict=True``): the unsplit tensors on each rank's device."""
    import math

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from hetcoll.torch import filter_parallel, gather_state_dict

    dev = device_of(rank, first)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 3))
    split = filter_parallel(mlp.double(), [3.0, 1.0, 1.0][:world]).to(dev)
    opt = torch.optim.AdamW(split.parameters(), lr=0.01)
    for _ in range(2):
        for p in split.parameters():
            p.grad = torch.sin(3 * p.detach() + 1)
        opt.step()
    model_sd, optim_sd = get_state_dict(split, opt, options=StateDictOptions(cpu_offload=True))
    on_host = all(t.device.type == "cpu" for t in model_sd.values())
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    full = gather_state_dict(split, dst=None)
    assert full is not None
    # The full state dict: the unsplit tensors on every rank, on the rank's device.
    whole, _ = get_state_dict(split, opt, options=StateDictOptions(full_state_dict=True))
    got: dict[str, object] = {
        "on_host": on_host,
        "full": max(
            (whole[k].cpu() - v).abs().max().item() if whole[k].shape == v.shape else math.inf
            for k, v in full.items()
        ),
        "on_device": all(t.device.type == torch.device(dev).type for t in whole.values()),
    }
    if rank != 0:
        return got
    dcp_to_torch_save(path, f"{path}.pt")
    converted = torch.load(f"{path}.pt")["model"]
    off = max(
        (converted[k] - v.cpu()).abs().max().item() if converted[k].shape == v.shape else math.inf
        for k, v in full.items()
    )
    return {**got, "off": off}


def nccl_host_buffers(rank: int, world: int, path: str) -> dict[str, object]:
    """NCCL at world size 1, what moves host bytes (through the GPU: NCCL moves device memory
    only): a CPU tensor's allgatherv, and the state of a split MLP on the GPU: its gathers to
    rank 0 and to every rank, its optimizer's, DCP's checkpoint and full state dict
    (:func:`dcp_offloaded`), each the unsplit model's exactly."""
    from hetcoll.torch import filter_parallel, gather_optimizer_state_dict, gather_state_dict

    assert dist.get_backend() == "nccl"
    rows = torch.arange(6.0, dtype=torch.float64).view(2, 3)
    out = hetcoll.allgatherv(rows)
    assert out.device.type == "cpu" and torch.equal(out, rows)
    got = dcp_offloaded(rank, world, path)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3)).double()
    dev = device_of(rank, "cuda")
    split = filter_parallel(copy.deepcopy(mlp), [1.0]).to(dev)
    opt = torch.optim.SGD(split.parameters(), lr=0.1, momentum=0.9)
    split(torch.ones(2, 6, dtype=torch.float64, device=dev)).sum().backward()
    opt.step()
    whole = gather_state_dict(split, dst=0)
    state = gather_optimizer_state_dict(split, opt, dst=0)
    assert whole is not None and state is not None
    own = split.state_dict()  # one rank holds every channel
    off = max((whole[k].cpu() - own[k].cpu()).abs().max().item() for k in mlp.state_dict())
    named = dict(split.named_parameters())
    momentum = max(
        (state["state"][k]["momentum_buffer"].cpu() - opt.state[p]["momentum_buffer"].cpu())
        .abs()
        .max()
        .item()
        for k, p in named.items()
    )
    return {**got, "gathered": [len(whole), len(state["state"])], "gathers_off": off + momentum}


#: A pipeline whose first stage is the GPU rank and whose second stage is split over two CPU
#: ranks, beside nothing; a whole-model replica on the GPU beside a 2-stage CPU pipeline; the
#: GPU rank's replica beside two CPU ranks' (data parallelism); the GPU rank in a split stage.
MIXED_PLANS = [
    {
        "microbatches": 3,
        "schedule": "1F1B",
        "replicas": [
            {
                "samples": 11,
                "stages": [
                    {"ranks": [0], "layers": [0, 5]},
                    {"ranks": [1, 2], "speeds": [1.0, 0.4], "layers": [5, 11]},
                ],
            }
        ],
    },
    {
        "microbatches": 2,
        "schedule": "GPipe",
        "replicas": [
            {"samples": 9, "stages": [{"ranks": [0], "layers": [0, 11]}]},
            {
                "samples": 5,
                "stages": [{"ranks": [1], "layers": [0, 6]}, {"ranks": [2], "layers": [6, 11]}],
            },
        ],
    },
    {  # data parallelism: the step's loss and flags in the gradients' sum, staged to the host
        "microbatches": 2,
        "replicas": [
            {"samples": s, "stages": [{"ranks": [r], "layers": [0, 11]}]}
            for r, s in enumerate((8, 3, 3))
        ],
    },
    {  # the GPU rank inside a split stage, after a CPU stage
        "microbatches": 2,
        "replicas": [
            {
                "samples": 7,
                "stages": [
                    {"ranks": [2], "layers": [0, 3]},
                    {"ranks": [0, 1], "speeds": [4.0, 1.0], "layers": [3, 11]},
                ],
            }
        ],
    },
]


def plans_mixed(rank: int, world: int, first: str = "cuda") -> dict[str, int]:
    """parallelize with the GPU rank's stages beside CPU ranks' (activations and gradients
    staged through host memory for gloo): losses and full_state_dict() after 3 SGD-momentum
    steps equal one process on the CPU, float64 to 1e-10."""
    dev = device_of(rank, first)
    done = 0
    for spec in MIXED_PLANS:
        plan = Plan.from_dict(spec)
        torch.manual_seed(0)
        model = plan_cases.cnn().double()
        data = plan_cases.batches((3, 8, 8), plan.batch, 3)
        want_losses, want_state = plan_cases.reference(model, data, 0.05)
        par = parallelize(copy.deepcopy(model).to(dev), plan, loss_fn=nn.CrossEntropyLoss())
        opt = torch.optim.SGD(par.parameters(), lr=0.05, momentum=0.9)
        for (x, y), want in zip(data, want_losses, strict=True):
            loss = par.step(x, y)
            assert abs(loss - want) <= TOL * abs(want), (loss, want)
            opt.step()
            opt.zero_grad()
        assert all(p.device == dev for p in par.parameters())
        got = par.full_state_dict()
        for k, v in want_state.items():
            if v.is_floating_point():
                assert plan_cases.rel(got[k].cpu(), v) <= TOL, (k, plan_cases.rel(got[k].cpu(), v))
        done += 1
    return {"plans": done}


#: Two whole-model replicas: the GPU rank's and a CPU rank's.
REPLICAS = {
    "microbatches": 2,
    "replicas": [
        {"samples": 12, "stages": [{"ranks": [0], "layers": [0, 11]}]},
        {"samples": 4, "stages": [{"ranks": [1], "layers": [0, 11]}]},
    ],
}

#: The GPU rank's first stage feeding a CPU rank's second: a boundary under autocast.
PIPELINE = {
    "microbatches": 2,
    "replicas": [
        {
            "samples": 9,
            "stages": [{"ranks": [0], "layers": [0, 5]}, {"ranks": [1], "layers": [5, 11]}],
        }
    ],
}

#: float32 sums of the same bf16 products in another order (the gradient combination).
AUTOCAST_TOL = 1e-5


def _autocast_pipeline(rank: int, dev: torch.device, model: nn.Module) -> None:
    """PIPELINE under autocast: the boundary travels in its own dtype (float32: the receiver's
    buffer) whatever autocast computed it in, and its gradient back the same way. Rank 0 holds
    both devices, so it checks against the same computation by hand in one process (stage 0
    under autocast on its device, the boundary cast to float32 and moved, stage 1 under CPU
    autocast): the loss and every gradient to 1e-5."""
    plan = Plan.from_dict(PIPELINE)
    x, y = plan_cases.batches((3, 8, 8), plan.batch, 1)[0]
    x = x.float()
    par = parallelize(copy.deepcopy(model).to(dev), plan, loss_fn=nn.CrossEntropyLoss())
    with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
        loss = par.step(x, y)
    # Every gradient at rank 0: its own stage's, then rank 1's (sent over the group).
    mine = torch.cat([p.grad.reshape(-1).cpu() for p in par.parameters()])
    if rank == 1:
        dist.send(mine, 0)
        return
    theirs = torch.empty(sum(p.numel() for p in model[5:].parameters()), dtype=mine.dtype)
    dist.recv(theirs, 1)
    got = torch.cat([mine, theirs])
    ref = copy.deepcopy(model)
    first, second = ref[:5].to(dev), ref[5:]
    off, want_loss = 0, 0.0
    for m in plan.microbatch_sizes(0):
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
            h = first(x[off : off + m].to(dev))
        assert h.dtype == torch.bfloat16, h.dtype  # autocast ran on stage 0
        h = h.to("cpu", dtype=torch.float32)
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            part = nn.functional.cross_entropy(second(h), y[off : off + m]) * (m / plan.batch)
        part.backward()
        want_loss += float(part.detach())
        off += m
    assert abs(loss - want_loss) <= AUTOCAST_TOL * abs(want_loss), (loss, want_loss)
    want = torch.cat([p.grad.reshape(-1).cpu() for p in ref.parameters()])
    assert rel_err(got, want) <= AUTOCAST_TOL, rel_err(got, want)


def autocast_plan(rank: int, world: int, first: str = "cuda") -> dict[str, object]:
    """bf16 autocast through a plan: each rank runs ``par.step`` under ``torch.autocast`` on
    its own device (CUDA on the GPU rank, CPU on the other) with a float32 model. The stages
    compute in bf16 (checked), the gradients are combined in float32, and the loss and every
    gradient equal each rank's own replica run under the same autocast on its device (its
    micro-batches, losses scaled by rows / batch) summed over the ranks, to 1e-5 (the same
    bf16 products, summed in float32 in another order)."""
    dev = device_of(rank, first)
    plan = Plan.from_dict(REPLICAS)
    torch.manual_seed(0)
    model = plan_cases.cnn().float()
    x, y = (t for t in plan_cases.batches((3, 8, 8), plan.batch, 1)[0])
    x = x.float()
    # The reference: this rank's replica by hand, summed over the ranks.
    own = copy.deepcopy(model).to(dev)
    off, loss_sum = sum(r.samples for r in plan.replicas[:rank]), 0.0
    with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
        for m in plan.microbatch_sizes(rank):
            part = nn.functional.cross_entropy(
                own(x[off : off + m].to(dev)), y[off : off + m].to(dev)
            ) * (m / plan.batch)
            part.backward()
            loss_sum += float(part.detach())
            off += m
    want = torch.cat([p.grad.reshape(-1).cpu() for p in own.parameters()])
    hetcoll.allreduce(want)
    want_loss = torch.tensor([loss_sum], dtype=torch.float64)
    hetcoll.allreduce(want_loss)

    par = parallelize(copy.deepcopy(model).to(dev), plan, loss_fn=nn.CrossEntropyLoss())
    seen: list[torch.dtype] = []
    assert par.stage is not None
    par.stage.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
        loss = par.step(x, y)
    assert seen and set(seen) == {torch.bfloat16}, seen
    assert abs(loss - float(want_loss)) <= AUTOCAST_TOL * abs(float(want_loss)), (loss, want_loss)
    got = torch.cat([p.grad.reshape(-1).cpu() for p in par.parameters()])
    assert got.dtype == torch.float32
    assert rel_err(got, want) <= AUTOCAST_TOL, rel_err(got, want)
    _autocast_pipeline(rank, dev, model)
    return {"dtypes": sorted(str(d) for d in set(seen))}


#: The plan against one process under the same float16 autocast, after 3 steps at a large
#: rate: 3.0e-4 apart on the CPU (float16 sums in other orders); a step taken where the other
#: skipped it moves the weights 0.44 apart.
FP16_TOL = 1e-2


def fp16_scaled_plan(
    rank: int, world: int, first: str = "cuda", kind: str = "group"
) -> dict[str, object]:
    """float16 autocast through a plan with a scaler (``kind``: "group", hetcoll's
    GroupGradScaler; "sharded", torch's ShardedGradScaler): the GPU rank's stage feeding
    a CPU rank's, an idle CPU rank beside. Each rank computes under autocast on its device in
    float16 (checked). In step 1 only the CPU stage finds an overflow (put there by hand):
    every rank skips it (its parameters unchanged) and halves its scale, alike. The trained
    model equals one process on the CPU under float16 autocast with a GradScaler and the same
    overflow, to FP16_TOL."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    dev = device_of(rank, first)
    plan = Plan.from_dict(PIPELINE)  # on 3 ranks: rank 2 is idle
    torch.manual_seed(0)
    model = plan_cases.cnn().float()
    data = [(x.float(), y) for x, y in plan_cases.batches((3, 8, 8), plan.batch, 3)]
    # One process on the CPU under the same autocast, with a GradScaler, the overflow put
    # into the same step.
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=100)
    for n, (x, y) in enumerate(data):
        with torch.autocast(device_type="cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(ref(x), y)
        ref_scaler.scale(loss).backward()
        if n == 1:
            next(ref.parameters()).grad.view(-1)[0] = float("inf")
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
    par = parallelize(copy.deepcopy(model).to(dev), plan, loss_fn=nn.CrossEntropyLoss())
    seen: list[torch.dtype] = []
    if par.stage is not None:
        par.stage.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    opt = torch.optim.SGD(par.parameters(), lr=0.5)
    make = {"group": GroupGradScaler, "sharded": ShardedGradScaler}[kind]
    scaler = make(device=dev.type, init_scale=2.0**12, growth_interval=100)
    scales, kept = [], []
    held = [p for p in par.parameters() if p.numel()]  # none on the idle rank
    for n, (x, y) in enumerate(data):
        before = [p.detach().clone() for p in held]
        with torch.autocast(device_type=dev.type, dtype=torch.float16):
            loss = par.step(x, y, scaler=scaler)
        assert loss == loss and abs(loss) < 1e3, loss  # unscaled
        if rank == 1 and n == 1:
            next(p for p in par.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        kept.append(all(torch.equal(a, b) for a, b in zip(before, held, strict=True)))
    got = par.full_state_dict()
    for k, v in ref.state_dict().items():
        assert plan_cases.rel(got[k].cpu().float(), v) <= FP16_TOL, (k, plan_cases.rel(got[k], v))
    return {
        "dtypes": sorted(str(d) for d in set(seen)),
        "scales": scales,
        "skipped": [n for n, same in enumerate(kept) if same] if held else None,
    }


def lm_plans_mixed(rank: int, world: int, first: str = "cuda") -> dict[str, int]:
    """Language models through plans with the GPU rank beside CPU ranks (4 ranks, gloo):
    Hugging Face GPT-2 (its head tied to the embedding across stages) and Llama (grouped-query
    attention, RoPE), token-weighted over padded labels, in the hybrid plan where the GPU rank
    holds a pipeline's last stage, and in one where it shares a split stage with a CPU rank
    too slow for any head (``empty_blocks``); Llama also on a stage of the GPU rank and two CPU
    ranks, more than its 2 key/value groups (split by query head, each rank cutting the whole
    key and value to its heads' on its own device). Losses and full_state_dict() after 2
    SGD-momentum
    steps equal one process on the CPU: float64 to 1e-10 (Llama 1e-6: its rotary embedding
    computes in float32). Mixtral (a mixture of experts, eager) on that 3-rank stage too:
    each rank learns its experts' output shape from a copy of them run on its own device; and
    with its experts placed whole on the replicas' ranks (plans with ``experts``: 3 replicas,
    then 2 pipelines of 2 stages), float64 to 1e-10. Llama again with its decoder layers
    compiled after parallelize (each one's ``compile()``)."""
    import transformer_cases as lm

    from hetcoll.torch.layers import model_layers

    dev = device_of(rank, first)
    done = 0
    for make in (lm.gpt2, lm.llama):
        n = len(model_layers(make()))
        tol = 1e-6 if make is lm.llama else TOL
        beside = lm.hybrid(n)
        beside["replicas"][1]["stages"][0] = {
            "ranks": [0, 3],
            "speeds": [1.0, 0.1],
            "empty_blocks": True,
            "layers": [0, n],
        }
        beside["replicas"][0]["stages"] = [
            {"ranks": [1], "layers": [0, 3]},
            {"ranks": [2], "layers": [3, n]},
        ]
        specs = [lm.hybrid(n), beside] + ([lm.split_three(n)] if make is lm.llama else [])
        for spec in specs:
            lm.equals_one_process(None, make, Plan.from_dict(spec), tol=tol, device=dev)
            done += 1
    # Llama's decoder layers compiled block by block after parallelize (aot_eager: no code
    # generated), the GPU rank's run compiled on its own device, beside the split stage's.
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    plan = Plan.from_dict(beside)
    lm.equals_one_process(None, lm.llama, plan, tol=1e-6, device=dev, compiled=LlamaDecoderLayer)
    n = len(model_layers(lm.mixtral()))
    lm.equals_one_process(None, lm.mixtral, Plan.from_dict(lm.split_three(n)), tol=1e-6, device=dev)
    # Its experts placed whole on the replicas' ranks (the plan's experts): the GPU rank holds
    # most, the tokens to and from it staged through host memory.
    import plan_experts_cases as experts

    for spec in (experts.BY_SPEED, experts.PIPELINES):
        lm.equals_one_process(None, lm.mixtral, Plan.from_dict(spec), device=dev)
    return {"plans": done + 4}


def sole_holder_mixed(rank: int, world: int, first: str = "cuda") -> dict[str, object]:
    """GPT-2 split over the GPU rank and a CPU rank too slow for any head (``empty_blocks``,
    speeds 1 : 0.05): each attention's partial sum is then the GPU rank's alone, and a
    broadcast from it stands in for the reduction. Every rank must take that broadcast: the
    GPU rank once took the reduction while the CPU rank broadcast, and the two waited on each
    other for ever (the first GPU run's hang). Losses and gradients over two steps equal the
    unsplit model's on the CPU; returns the worst difference and each split attention's
    heads by rank."""
    import tensor_parallel_cases as tp

    from hetcoll.torch import gather_gradients
    from hetcoll.torch.filters import FilterParallelLayer

    dev = device_of(rank, first)
    torch.manual_seed(0)
    ref = tp.gpt2().double()
    split = tp.split_copy(ref, None, [1.0, 0.05][:world], empty_blocks=True).to(dev)
    worst = 0.0
    for step in range(2):
        ids = tp.batch(step)
        _, want = tp.loss_of(ref, ids)
        _, got = tp.loss_of(split, ids.to(dev))
        ref.zero_grad()
        split.zero_grad()
        want.backward()
        got.backward()
        grads = gather_gradients(split, dst=None)
        assert grads is not None
        worst = max(worst, abs(got.item() - want.item()))
        for n, p in ref.named_parameters():
            assert p.grad is not None
            worst = max(worst, float((grads[n] - p.grad).abs().max()))
    heads = [
        list(m.shares)
        for n, m in split.named_modules()
        if isinstance(m, FilterParallelLayer) and n.endswith("attn.c_attn")
    ]
    return {"worst": worst, "heads": heads}


def experts_mixed(rank: int, world: int, first: str = "cuda") -> dict[str, object]:
    """Expert parallelism with the GPU rank beside CPU ranks (3 ranks, gloo): Mixtral and
    GPT-OSS in float64, experts placed by speed (the GPU rank, first, holds most), DDP with
    the weighted hook (the GPU rank's buckets staged through host memory), the tokens to and
    from the GPU rank's experts staged the same way; gradients and state after 2 SGD steps
    equal one process on the CPU (1e-6: the routers' softmax in float32). Then an
    ExpertRebalancer moves Mixtral's experts between the devices as training goes on (its
    decisions under ``"rebalanced"``)."""
    import expert_parallel_cases as ep
    import tensor_parallel_cases as tp

    dev = device_of(rank, first)
    with tp.tolerance(1e-6):
        placed: dict[str, object] = {
            name: ep.trains_as_one_process(None, make, ep.SPEEDS[:world], device=dev)
            for name, make in (("mixtral", tp.mixtral), ("gpt_oss", tp.gpt_oss))
        }
        placed["rebalanced"] = [
            [e[0], e[2], e[3]] for e in ep.rebalanced_while_training(None, device=dev)
        ]
    return placed


def experts_nccl(rank: int, world: int) -> dict[str, object]:
    """Expert parallelism on NCCL at world size 1 (the tokens' all-to-all on the GPU): Mixtral
    in float64 holding every expert, its gradients after one step equal one process's on the
    CPU (1e-6: the router's softmax in float32)."""
    import expert_parallel_cases as ep
    import tensor_parallel_cases as tp

    from hetcoll.torch import expert_parallel

    torch.manual_seed(0)
    ref = tp.mixtral().double()
    model = expert_parallel(copy.deepcopy(ref).cuda(), speeds=[1.0])
    ids, labels = ep.tokens(0)
    ep.lm_loss(model, ids.cuda(), labels.cuda()).backward()
    ep.lm_loss(ref, ids, labels).backward()
    grads = dict(model.named_parameters())
    with tp.tolerance(1e-6):
        for name, p in ref.named_parameters():
            tp.close(grads[name].grad.cpu(), p.grad, f"gradient of {name}")
    return {"checked": len(grads)}


def dropout_mixed(rank: int, world: int, first: str = "cuda") -> dict[str, object]:
    """BERT with dropout (0.2 on its attention probabilities and hidden states) split by heads
    over the GPU rank and CPU ranks, every rank seeded alike: the dropout on whole tensors
    draws the same masks on every rank (on the CPU: ``CpuDraws``), so the ranks' copies of the
    hidden states agree over 3 Adam steps (1e-10 relative in float64: the GPU's matmuls round
    otherwise than the CPU's) and so do their LayerNorm weights; ranks seeded apart raise
    ``CollectiveMismatchError`` on every rank. A mask drawn otherwise would be O(1) off."""
    import transformers

    from hetcoll.torch import filter_parallel

    dev = device_of(rank, first)
    cfg = transformers.BertConfig(
        vocab_size=23, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.2,
        attention_probs_dropout_prob=0.2, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    bert = filter_parallel(transformers.BertForMaskedLM(cfg).double(), [3.0, 1.0, 1.0][:world])
    bert.to(dev)
    seen: dict[str, torch.Tensor] = {}
    bert.get_submodule("bert.encoder.layer.1.output.LayerNorm").register_forward_hook(
        lambda m, i, o: seen.__setitem__("hidden", o)
    )
    ids = torch.randint(1, 23, (4, 8), generator=torch.Generator().manual_seed(0)).to(dev)
    opt = torch.optim.Adam(bert.parameters(), lr=1e-2)
    torch.manual_seed(5)

    def apart(t: torch.Tensor) -> float:
        mine = t.detach().double().cpu().contiguous()
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        return max(rel_err(e, every[0]) for e in every)

    worst = 0.0
    for _ in range(3):
        bert(input_ids=ids, labels=ids).loss.backward()
        worst = max(worst, apart(seen["hidden"]))
        opt.step()
        opt.zero_grad()
    norms = torch.cat([p.flatten() for n, p in bert.named_parameters() if "LayerNorm" in n])
    worst = max(worst, apart(norms))
    assert worst <= TOL, worst
    torch.manual_seed(rank)
    try:
        bert(input_ids=ids)
        raised = False
    except CollectiveMismatchError:
        raised = True
    return {"raised": raised}


def fsdp_nccl(rank: int, world: int) -> dict[str, bool]:
    """FSDP2 (``fully_shard``) on NCCL, one GPU: ``weigh_loss`` takes its count as a CUDA
    tensor (the valid labels; read on the host: at world size 1 nothing is exchanged) and
    weighs 1, and the sharded model's gradients are the plain model's (float64, 1e-12)."""
    from torch.distributed.fsdp import fully_shard

    from hetcoll.torch import weigh_loss

    assert dist.get_backend() == "nccl"
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double().to(dev)
    sharded = copy.deepcopy(plain)
    fully_shard(sharded)
    x = torch.randn(6, 5, dtype=torch.float64, device=dev)
    y = torch.tensor([0, 1, -100, 2, -100, 1], device=dev)
    loss = nn.functional.cross_entropy(sharded(x), y, ignore_index=-100)
    weighed = weigh_loss(loss, (y != -100).sum())
    weighed.backward()
    nn.functional.cross_entropy(plain(x), y, ignore_index=-100).backward()
    diff = max(
        float((p.grad.full_tensor() - q.grad).abs().max())
        for p, q in zip(sharded.parameters(), plain.parameters(), strict=True)
    )
    return {"weighs 1": weighed.item() == loss.item(), "plain gradients": diff < 1e-12}


def fsdp_nccl_timer(rank: int, world: int) -> dict[str, float]:
    """A StepTimer on a model sharded by FSDP2 on NCCL, one GPU: its marks are CUDA events
    (FSDP's spans among them), so a step of long kernels reads at least half of what torch's
    own events around the step give, and not more."""
    from torch.distributed.fsdp import fully_shard

    assert dist.get_backend() == "nccl"
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1)).to(dev)
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    timed, whole = timed_gpu_step(model, torch.randn(8192, 4096, device=dev))
    return {"timed": timed, "whole": whole}


def timed_gpu_step(model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """One step of ``model`` on ``x`` after a warm-up (cuBLAS handles, the allocator, FSDP's
    set-up): a StepTimer's seconds, and the seconds torch's own CUDA events give the step."""
    from hetcoll.torch import StepTimer

    timer = StepTimer(model)
    model(x).sum().backward()
    timer.pop()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    model(x).sum().backward()
    end.record()
    timed = timer.pop()
    end.synchronize()
    return timed, start.elapsed_time(end) / 1000.0
