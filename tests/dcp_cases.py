"""torch.distributed.checkpoint of split models, run inside every rank of real gloo jobs
(tests/test_dcp.py): a first job splits a model one way, steps AdamW twice and saves
``get_state_dict(model, optimizer)`` with ``dcp.save``, as a user of DCP would; a second job,
on another number of ranks split for other speeds, builds the model afresh (other initial
weights), and loads the checkpoint with ``dcp.load`` and ``set_state_dict``. Its gathered
model and optimizer state must equal the first job's exactly, and its forward the unsplit
model's with that state (float64, 1e-10).

The gradients the optimizer steps are set elementwise from each parameter's values (the same
function of the unsplit parameter's entries whatever the split), so the state is the unsplit
model's without a forward: every layout a split holds (channel runs, packed query/key/value
blocks, the multi-query key and value every rank holds whole, experts placed out of order)
is checked on its own.
"""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from transformer_cases import SEQ, VOCAB, falcon, gpt2, llama, mixtral, mixtral_lora

from hetcoll.torch import (
    ReplicaSavePlanner,
    expert_parallel,
    filter_parallel,
    gather_optimizer_state_dict,
    gather_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
)

TOL = 1e-10


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 3))


def resnet18() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=5)


def resnext() -> nn.Module:
    """torchvision's ResNeXt, small: its grouped 3x3 convolutions split by whole groups."""
    from torchvision.models.resnet import Bottleneck, ResNet

    return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=5, groups=4, width_per_group=4)


def dora(model: nn.Module) -> nn.Module:
    """``model`` with PEFT's DoRA on its attentions' projections and its MLPs' down
    projections."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=4, target_modules=targets, use_dora=True))


def trainable(model: nn.Module) -> nn.Module:
    """``model`` with every parameter trainable (the jobs step every parameter: a frozen one's
    optimizer state would go unsaved)."""
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ))


#: name: (the model, its input, how it splits: ("filter", speeds) or ("experts", shares)
#: for each of the two jobs (2 ranks, then 3)).
CASES: dict[str, tuple[Any, Any, tuple[str, Any], tuple[str, Any]]] = {
    "mlp": (mlp, lambda: torch.randn(4, 6, dtype=torch.float64), ("filter", [1.0, 3.0]),
            ("filter", [2.0, 1.0, 1.0])),
    "resnet18": (resnet18, lambda: torch.randn(2, 3, 32, 32, dtype=torch.float64),
                 ("filter", [1.0, 2.0]), ("filter", [1.0, 1.0, 3.0])),
    # Its groups split 3 : 1, then 1 : 1 : 2 (layer1's 4 groups of 4: [12, 4], [4, 4, 8]).
    "resnext": (resnext, lambda: torch.randn(2, 3, 32, 32, dtype=torch.float64),
                ("filter", [3.0, 1.0]), ("filter", [1.0, 1.0, 2.0])),
    "llama": (llama, tokens, ("filter", [1.0, 1.0]), ("filter", [1.0, 0.5, 0.5])),
    "gpt2": (gpt2, tokens, ("filter", [3.0, 1.0]), ("filter", [1.0, 2.0, 1.0])),
    "falcon": (falcon, tokens, ("filter", [1.0, 1.0]), ("filter", [2.0, 1.0, 1.0])),
    "mixtral": (mixtral, tokens, ("experts", [[0, 3], [1, 2]]), ("experts", [[2], [0, 3], [1]])),
    # PEFT: DoRA's magnitudes (a column's sliced, a row's whole); LoRA on the experts'
    # parameters (ParamWrapper), a factor of each sliced with the experts' hidden units.
    "dora": (lambda: trainable(dora(llama())), tokens, ("filter", [1.0, 1.0]),
             ("filter", [1.0, 0.5, 0.5])),
    "mixtral_lora": (lambda: trainable(mixtral_lora()), tokens, ("filter", [1.0, 3.0]),
                     ("filter", [1.0, 1.0, 2.0])),
    # ... and placed by whole experts, each factor's blocks with their experts.
    "mixtral_lora_experts": (lambda: trainable(mixtral_lora()), tokens,
                             ("experts", [[0, 3], [1, 2]]), ("experts", [[2], [0, 3], [1]])),
}  # fmt: skip


def build(name: str, split: tuple[str, Any], group: Any, seed: int) -> nn.Module:
    make = CASES[name][0]
    torch.manual_seed(seed)
    model = make().double()
    kind, how = split
    if kind == "filter":
        return filter_parallel(model, group, speeds=how)
    return expert_parallel(model, group, shares=how)


def output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def differences(
    full: dict[str, torch.Tensor], optim: dict[str, Any], saved: dict[str, Any]
) -> dict[str, float]:
    """The largest differences of a gathered model and optimizer state from the saved ones."""
    return {
        "model": max((full[k] - v).abs().max().item() for k, v in saved["model"].items()),
        "optim": max(
            (optim["state"][n][f] - v).abs().max().item()
            for n, fields in saved["optim"]["state"].items()
            for f, v in fields.items()
            if isinstance(v, torch.Tensor)
        ),
    }


def offloaded_to_host(marked: bool) -> None:
    """In this process: ``get_state_dict``'s ``cpu_offload`` copies every tensor, as it copies
    a GPU's into host memory (a CPU tensor's ``.to("cpu")`` is the tensor itself, so here it
    would copy nothing); ``marked`` False: without hetcoll's wrapper carrying the marks of
    the slices onto the copies (``hetcoll.torch.filters.dcp_copies``)."""
    from torch.distributed.checkpoint import state_dict as dcp_state_dict
    from torch.utils._pytree import tree_map

    from hetcoll.torch.filters import dcp_copies

    def to_host(state: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)

    dcp_state_dict._offload_state_dict_to_cpu = to_host
    if not marked:
        dcp_copies._copies_marked = True  # as if installed: nothing is wrapped


#: The optimizers the jobs step, by name: AdamW's state starts at its first step, Adagrad's
#: when it is made (its sums, shaped as the parameters).
OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.01),
}


def first_job(
    rank: int,
    world: int,
    name: str,
    path: str,
    resumed: bool = False,
    offloaded: Any = None,
    optimizer: str = "adamw",
) -> None:
    """Step, then save through DCP; ``resumed``: step, then resume on the other split of the
    same ranks from the gathered state (``load_full_*``), and save that through DCP before
    any step (its optimizer never stepped); ``offloaded`` (True or False, for
    :func:`offloaded_to_host`): the state dicts DCP saves copied to the host, as
    ``cpu_offload=True`` copies a GPU's."""
    torch.set_num_threads(1)
    if offloaded is not None:
        offloaded_to_host(marked=offloaded)
    model = build(name, CASES[name][2], None, seed=0)
    opt = OPTIMIZERS[optimizer](model.parameters())
    for _ in range(2):
        for p in model.parameters():  # elementwise in the unsplit entries: any split alike
            p.grad = torch.sin(3 * p.detach() + 1)
        opt.step()
    if resumed:
        full, optim = (
            gather_state_dict(model, dst=None),
            gather_optimizer_state_dict(model, opt, dst=None),
        )
        kind, how = CASES[name][2]
        model = build(name, (kind, how[::-1]), None, seed=1)
        opt = OPTIMIZERS[optimizer](model.parameters())
        assert full is not None and optim is not None
        load_full_state_dict(model, full)
        load_full_optimizer_state_dict(model, opt, optim)
    options = StateDictOptions(cpu_offload=offloaded is not None)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    full = gather_state_dict(model, dst=0)
    optim = gather_optimizer_state_dict(model, opt, dst=0)
    if rank == 0:
        torch.save({"model": full, "optim": optim}, Path(path) / "full.pt")
    dist.barrier()


def second_job(
    rank: int, world: int, name: str, path: str, optimizer: str = "adamw"
) -> dict[str, float] | None:
    torch.set_num_threads(1)
    model = build(name, CASES[name][3], None, seed=1)  # other initial weights
    opt = OPTIMIZERS[optimizer](model.parameters())
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = gather_state_dict(model, dst=0)
    optim = gather_optimizer_state_dict(model, opt, dst=0)
    torch.manual_seed(2)
    x = CASES[name][1]()
    got = output(model, x)
    if rank != 0:
        return None
    saved = torch.load(Path(path) / "full.pt")
    assert full is not None and optim is not None
    torch.manual_seed(3)
    unsplit = CASES[name][0]().double()
    unsplit.load_state_dict(saved["model"])
    want = output(unsplit, x)
    return {
        **differences(full, optim, saved),
        "keys": float(set(full) != set(saved["model"])),
        "forward": ((got - want).abs().max() / want.abs().max()).item(),
    }


def slice_of_another_rank(rank: int, world: int, path: str) -> tuple[str, str, str, list[str]]:
    """An even split (2 ranks, one speed): each rank saves its own ``state_dict()`` and its
    optimizer's with ``torch.save``; each rank then loads its own, which must load, and the
    other rank's, of the same shapes, which must raise naming the entry. Also the names of
    the parameters ``state_dict(keep_vars=True)`` hands out marked (none must be), and the
    error of a fresh optimizer's first step after loading the other rank's state."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = filter_parallel(mlp().double(), speeds=[1.0, 1.0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.sin(3 * p.detach() + 1)
    opt.step()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"{path}/rank{rank}.pt")
    dist.barrier()
    errors: list[str] = []
    own = torch.load(f"{path}/rank{rank}.pt", weights_only=False)
    model.load_state_dict(own["model"])
    opt.load_state_dict(own["optim"])
    other = torch.load(f"{path}/rank{1 - rank}.pt", weights_only=False)
    try:
        model.load_state_dict(other["model"])
    except ValueError as e:
        errors.append(str(e))
    try:
        opt.load_state_dict(other["optim"])
    except ValueError as e:
        errors.append(str(e))
    # A fresh optimizer (no hooks yet) takes the other rank's state without a word; its first
    # step refuses it, before training with it.
    fresh = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fresh.load_state_dict(other["optim"])
    try:
        fresh.step()
    except ValueError as e:
        errors.append(str(e))
    marked = [k for k, t in model.state_dict(keep_vars=True).items() if hasattr(t, "global_shape")]
    return errors[0], errors[1], errors[2], marked


#: An owners stage on ranks 1 and 2 placing the channels otherwise than OWNERS_3.
OWNERS_OTHER = {
    "microbatches": 2,
    "replicas": [
        {
            "samples": 8,
            "stages": [
                {"ranks": [0], "layers": [0, 5]},
                {
                    "ranks": [1, 2],
                    "layers": [5, 11],
                    "owners": {"5": [1, 0] * 5, "8": [0] * 12 + [1] * 8, "10": [0, 1, 0, 1, 1]},
                },
            ],
        }
    ],
}

#: GPT-2 (9 layers: wte, wpe, drop, 4 blocks, ln_f, the head tied to wte) on 3 ranks: the
#: embeddings on rank 0, the rest split over ranks 1 and 2.
GPT2_PIPELINE_SPLIT = {
    "microbatches": 2,
    "replicas": [
        {
            "samples": 6,
            "stages": [
                {"ranks": [0], "layers": [0, 3]},
                {"ranks": [1, 2], "speeds": [1.0, 0.5], "layers": [3, 9]},
            ],
        }
    ],
}

#: GPT-2 as three pipeline stages (the tied head on another stage than the embedding).
GPT2_PIPELINE_3 = {
    "microbatches": 3,
    "schedule": "1F1B",
    "replicas": [
        {
            "samples": 6,
            "stages": [
                {"ranks": [2], "layers": [0, 4]},
                {"ranks": [0], "layers": [4, 6]},
                {"ranks": [1], "layers": [6, 9]},
            ],
        }
    ],
}

#: GPT-2 as three pipeline stages, the second holding dropout alone (no parameter).
GPT2_FREE_STAGE = {
    "microbatches": 2,
    "replicas": [
        {
            "samples": 6,
            "stages": [
                {"ranks": [0], "layers": [0, 2]},
                {"ranks": [1], "layers": [2, 3]},
                {"ranks": [2], "layers": [3, 9]},
            ],
        }
    ],
}

#: name: (the model, the layout that saves and its ranks, the layout that loads and its ranks).
#: A layout is a plan (its name, in this module or elastic_cases, plan_cases or
#: plan_experts_cases; ranks in no stage idle) or ("filter", speeds): filter_parallel. Every
#: checkpoint is the unsplit model's, so any layout loads any other's.
PLANS: dict[str, tuple[str, Any, int, Any, int]] = {
    "pipeline_split_to_split": ("cnn", "PIPELINE_SPLIT_3", 3, "SPLIT_2", 2),
    "owners_to_other_owners": ("cnn", "OWNERS_3", 3, "OWNERS_OTHER", 3),
    "owners_to_pipeline_split": ("cnn", "OWNERS_3", 3, "PIPELINE_SPLIT_3", 3),
    "pipeline_split_to_filter_parallel": ("cnn", "PIPELINE_SPLIT_3", 3, ("filter", [1.0, 2.0]), 2),
    "filter_parallel_to_owners": ("cnn", ("filter", [1.0, 1.0, 2.0]), 3, "OWNERS_OTHER", 3),
    "idle_rank_to_another_idle_rank": ("cnn", "IDLE_3", 3, "SPLIT_2", 3),
    "no_idle_rank_to_an_idle_rank": ("cnn", "PIPELINE_SPLIT_3", 3, "IDLE_3", 3),
    "replicas_of_two_shapes_to_pipeline": ("cnn", "ASYMMETRIC", 4, "PIPELINE_2", 2),
    "gpt2_split_stage_to_pipeline": ("gpt2", "GPT2_PIPELINE_SPLIT", 3, "GPT2_PIPELINE_3", 3),
    "gpt2_pipeline_to_filter_parallel": ("gpt2", "GPT2_PIPELINE_3", 3, ("filter", [2.0, 1.0]), 2),
    "gpt2_filter_parallel_to_pipeline": ("gpt2", ("filter", [1.0, 3.0]), 2, "GPT2_PIPELINE_3", 3),
    "mixtral_experts_to_pipelines": ("mixtral", "BY_SPEED", 4, "PIPELINES", 4),
    "gpt2_parameter_free_stage_to_split": ("gpt2", "GPT2_FREE_STAGE", 3, ("filter", [1.0, 2.0]), 2),
}


def _plan(name: str) -> dict[str, Any]:
    import elastic_cases
    import plan_cases
    import plan_experts_cases

    for where in (globals(), vars(elastic_cases), vars(plan_cases), vars(plan_experts_cases)):
        if name in where:
            return where[name]
    raise KeyError(name)


def _layout(model: str, layout: Any, seed: int) -> nn.Module:
    """``model`` (float64, weights from ``seed``) laid out on this job's ranks."""
    from plan_cases import cnn
    from transformer_cases import lm_loss, valid_tokens

    from hetcoll import Plan
    from hetcoll.torch import parallelize

    torch.manual_seed(seed)
    net = {"cnn": cnn, "gpt2": gpt2, "mixtral": mixtral}[model]().double()
    if isinstance(layout, tuple):
        return filter_parallel(net, speeds=layout[1])
    if model == "cnn":  # a loss holding state of its own (class weights): not the model's
        loss = nn.CrossEntropyLoss(weight=torch.linspace(0.5, 1.5, 5, dtype=torch.float64))
        return parallelize(net, Plan.from_dict(_plan(layout)), loss_fn=loss)
    return parallelize(net, Plan.from_dict(_plan(layout)), loss_fn=lm_loss, items=valid_tokens)


def _train(model: str, net: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Two steps: a plan's (``Parallel.step``), or a split model's forward and backward."""
    from plan_cases import batches
    from transformer_cases import batches as token_batches
    from transformer_cases import lm_loss

    rows = net.plan.batch if hasattr(net, "plan") else 8 if model == "cnn" else 6
    data = batches((3, 8, 8), rows, 2) if model == "cnn" else token_batches(rows, 2)
    for x, y in data:
        if hasattr(net, "step"):
            net.step(x, y)
        elif model == "cnn":
            nn.functional.cross_entropy(net(x.double()), y).backward()
        else:
            lm_loss(net(**x), y).backward()
        opt.step()
        opt.zero_grad()


def _gathered(net: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The unsplit model's state and its optimizer's, on every rank."""
    if hasattr(net, "full_state_dict"):
        return net.full_state_dict(), net.full_optimizer_state_dict(opt)
    full, optim = gather_state_dict(net, dst=None), gather_optimizer_state_dict(net, opt, dst=None)
    assert full is not None and optim is not None
    return full, optim


#: Ranks of a plan hold different parameters (a pipeline's stages): torch's DCP then wants the
#: optimizer's state dict flattened, param groups by parameter name (its MPMD option).
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def plan_first_job(rank: int, world: int, case: str, path: str) -> list[str]:
    """A plan or a split trains 2 steps (AdamW: its step count is state shaped as no
    parameter) and saves through DCP: ``get_state_dict`` of the model and its optimizer, as
    for any model. Returns the warnings the save gave."""
    torch.set_num_threads(1)
    model, layout = PLANS[case][0], PLANS[case][1]
    net = _layout(model, layout, seed=0)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    _train(model, net, opt)
    model_sd, optim_sd = get_state_dict(net, opt, options=FLAT)
    # Replicas of different shapes cut tensors differently: the first one's are written.
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        dcp.save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=path,
            planner=ReplicaSavePlanner(),
        )
    full, optim = _gathered(net, opt)
    if rank == 0:
        torch.save({"model": full, "optim": optim}, Path(path) / "full.pt")
    dist.barrier()
    return [str(w.message) for w in said if "planner" in str(w.message).lower()]


def plan_second_job(rank: int, world: int, case: str, path: str) -> dict[str, float] | None:
    """Another layout loads it (other initial weights): its gathered state must equal the
    first job's, and its forward the unsplit model's with that state."""
    torch.set_num_threads(1)
    model, layout = PLANS[case][0], PLANS[case][3]
    net = _layout(model, layout, seed=1)
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    model_sd, optim_sd = get_state_dict(net, opt, options=FLAT)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT
    )
    full, optim = _gathered(net, opt)
    if rank != 0:
        return None
    return differences(full, optim, torch.load(Path(path) / "full.pt"))


def full_into_split(rank: int, world: int) -> dict[str, float] | None:
    """DCP's ``set_state_dict`` with ``full_state_dict=True``: the unsplit model's state and
    its optimizer's (every rank the same), loaded into a split; its gathered state must equal
    them (each rank took its slice)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = mlp().double()
    popt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    for p in plain.parameters():
        p.grad = torch.sin(3 * p.detach() + 1)
    popt.step()
    model_sd, optim_sd = get_state_dict(plain, popt)
    torch.manual_seed(1)
    model = filter_parallel(mlp().double(), speeds=[1.0, 3.0, 2.0][:world])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    set_state_dict(
        model,
        opt,
        model_state_dict=model_sd,
        optim_state_dict=optim_sd,
        options=StateDictOptions(full_state_dict=True),
    )
    full = gather_state_dict(model, dst=0)
    optim = gather_optimizer_state_dict(model, opt, dst=0)
    if rank != 0:
        return None
    assert full is not None and optim is not None
    want = plain.state_dict()
    names = [n for n, _ in plain.named_parameters()]
    wanted = {names[i]: fields for i, fields in popt.state_dict()["state"].items()}
    return {
        "model": max((full[k] - v).abs().max().item() for k, v in want.items()),
        "optim": max(
            (optim["state"][n][f] - v).abs().max().item()
            for n, fields in wanted.items()
            for f, v in fields.items()
        ),
    }


def own_state_round_trips(rank: int, world: int) -> dict[str, Any]:
    """A split model's and optimizer's own state loaded back on the same rank: optimizer state
    of any shape is kept as it is (a preconditioner shaped as the unsplit weight is not taken
    for the unsplit state), and what loads keeps no marks (``assign=True`` keeps the loaded
    tensors themselves; an optimizer keeps the tensors it loads)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = filter_parallel(
        nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).double(), speeds=[1, 3]
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.sin(3 * p.detach() + 1)
    opt.step()
    weight = model[0].weight
    opt.state[weight]["preconditioner"] = torch.ones(8, 8, dtype=torch.float64)  # unsplit shape
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    out = {
        "preconditioner": tuple(opt.state[weight]["preconditioner"].shape),
        "momentum": tuple(opt.state[weight]["momentum_buffer"].shape),
        "weight": tuple(weight.shape),
        "marked": [
            f"{i}.{f}"
            for i, fields in enumerate(opt.state.values())
            for f, v in fields.items()
            if hasattr(v, "global_shape")
        ],
    }
    model.load_state_dict(model.state_dict(), assign=True)  # the model's tensors are replaced
    out["marked"] += [
        k for k, t in model.state_dict(keep_vars=True).items() if hasattr(t, "global_shape")
    ]
    return out


def own_state_dicts_of_plans(rank: int, world: int) -> dict[str, Any]:
    """Each rank's own state dict of a plan, under the unsplit model's names (its parameters'
    and buffers' names too, which ``get_parameter`` takes; its loss function's buffers are
    its own), loads back on the rank (strict) into the right
    tensors, as does one keyed as earlier versions keyed it (``stage.``, an owners stage's
    ``stage.parts.``, an idle rank's ``idle``, the loss function's class weights); a key of
    no layer is reported under the model's names. ``named_modules()`` names this rank's layers
    as the model does too: a forward hook registered by a layer's name there runs in a
    training step, on the rank holding the layer."""
    from plan_cases import cnn

    torch.set_num_threads(1)
    unsplit = set(cnn().state_dict())
    layers = {n for n, _ in cnn().named_modules() if n}
    out: dict[str, Any] = {}
    for name in ("IDLE_3", "OWNERS_3", "PIPELINE_SPLIT_3"):
        par = _layout("cnn", name, seed=0)
        modules = dict(par.named_modules())
        held = layers & set(modules)
        ran: set[str] = set()
        for n in held:
            modules[n].register_forward_hook(lambda m, args, out, n=n, ran=ran: ran.add(n))
        _train("cnn", par, torch.optim.SGD(par.parameters(), lr=0.0))
        parts_of = {n.rsplit(".", 1)[0] for n, _ in par.named_parameters()}
        sd = par.state_dict()
        names = {n for n, _ in par.named_parameters()} | {n for n, _ in par.named_buffers()}
        changed = {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}
        par.load_state_dict(changed)
        now = par.state_dict()
        stage = par.stage.state_dict() if par.stage is not None else {}
        parts = "stage.parts." if type(par.stage).__name__ == "OwnersStage" else "stage."
        earlier = (
            {f"{parts}{k}": v for k, v in stage.items()} if stage else {"idle": torch.empty(0)}
        )
        earlier["_loss_fn.weight"] = par._loss_fn.weight.clone()
        par.load_state_dict(earlier)
        wrong = par.load_state_dict({**now, "no_layer.weight": torch.zeros(1)}, strict=False)
        out[name] = {
            "names": set(sd) <= unsplit and names <= unsplit | {"_loss_fn.weight"},
            "get_parameter": all(par.get_parameter(n) is p for n, p in par.named_parameters()),
            "loaded": now.keys() == sd.keys() and all(torch.equal(now[k], changed[k]) for k in sd),
            "earlier": all(torch.equal(v, now[k]) for k, v in par.state_dict().items()),
            "reported": wrong.unexpected_keys == ["no_layer.weight"],
            "modules": set(modules) - held
            <= {"", "stage", "_loss_fn"} | {f"{n}.local" for n in held},
            "hooks by name": ran == held and (par.stage is None or parts_of <= held),
            "get_submodule": all(par.get_submodule(n) is m for n, m in modules.items()),
        }
    return out


def full_into_plans(rank: int, world: int) -> dict[str, dict[str, float]] | None:
    """DCP's ``set_state_dict`` with ``full_state_dict=True`` (and ``strict=False``: a stage
    holds some of the model) into plans, an idle rank's among them: each rank takes its part
    of the unsplit model's state and its AdamW's."""
    from plan_cases import cnn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = cnn().double()
    popt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    for _ in range(2):
        for p in plain.parameters():
            p.grad = torch.sin(3 * p.detach() + 1)
        popt.step()
    model_sd, optim_sd = get_state_dict(plain, popt)
    names = [n for n, _ in plain.named_parameters()]
    wanted = {names[i]: fields for i, fields in popt.state_dict()["state"].items()}
    out = {}
    for plan in ("IDLE_3", "PIPELINE_SPLIT_3"):
        par = _layout("cnn", plan, seed=1)
        opt = torch.optim.AdamW(par.parameters(), lr=0.01)
        set_state_dict(
            par,
            opt,
            model_state_dict=model_sd,
            optim_state_dict=optim_sd,
            options=StateDictOptions(full_state_dict=True, strict=False),
        )
        full, optim = par.full_state_dict(), par.full_optimizer_state_dict(opt)
        out[plan] = {
            "model": max((full[k] - v).abs().max().item() for k, v in plain.state_dict().items()),
            "optim": max(
                (optim["state"][n][f] - v).abs().max().item()
                for n, fields in wanted.items()
                for f, v in fields.items()
            ),
        }
    return out if rank == 0 else None


def unflattened_pipeline(rank: int, world: int, path: str) -> str:
    """A pipeline saved and loaded through DCP without ``flatten_optimizer_state_dict``: its
    ranks' param groups come back without hyperparameters on all but one rank, which is
    refused at the load (it failed at the first step, on those ranks alone). The message on
    each rank, or "loaded"."""
    torch.set_num_threads(1)
    par = _layout("cnn", "PIPELINE_SPLIT_3", seed=0)
    opt = torch.optim.AdamW(par.parameters(), lr=0.01)
    _train("cnn", par, opt)
    model_sd, optim_sd = get_state_dict(par, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    try:
        set_state_dict(par, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except ValueError as e:
        return str(e)
    return "loaded"


def save_pretrained_of_a_split(rank: int, world: int, path: str) -> dict[str, Any]:
    """Hugging Face's ``save_pretrained`` of a split GPT-2 refuses the model's own state dict
    (this rank's slices, which safetensors would write as the unsplit tensors) and one passed
    holding them; the gathered state dict saves the unsplit model, which ``from_pretrained``
    reads."""
    from transformers import GPT2LMHeadModel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = filter_parallel(gpt2().double(), speeds=[1.0, 2.0])
    said = []
    for kwargs in ({}, {"state_dict": model.state_dict()}):
        try:
            model.save_pretrained(path, **kwargs)
            said.append("saved")
        except ValueError as e:
            said.append(str(e))
    full = gather_state_dict(model, dst=None)
    assert full is not None
    if rank == 0:
        model.save_pretrained(path, state_dict=dict(full))  # it empties the dict it writes
    dist.barrier()
    loaded = GPT2LMHeadModel.from_pretrained(path, dtype=torch.float64).state_dict()
    return {
        "said": said,
        "keys": loaded.keys() == full.keys(),
        "diff": max((loaded[k] - v).abs().max().item() for k, v in full.items()),
    }


def older_dcp(rank: int, world: int, path: str, taught: bool) -> dict[str, Any]:
    """DCP as a torch older than 2.14 would run it, with hetcoll's wrappers of its shard
    functions (hetcoll.torch.filters.dcp_fields) installed as there, whatever this torch: a
    tensor holding the unsplit one's rows out of order (two runs) saves as the unsplit tensor,
    and loads into a slice of three rows held out of order. Without them (``taught`` False)
    the checkpoint holds the rows as the tensor held them: the test fails there."""
    from torch.distributed.checkpoint import default_planner, planner_helpers
    from torch.distributed.checkpoint import utils as dcp_utils

    from hetcoll.torch.filters import dcp_fields

    # This process only (a job of its own): a torch >= 2.14's DCP made blind to the fields,
    # as an older one is, and hetcoll's wrappers installed as there.
    for module in (planner_helpers, default_planner, dcp_utils):
        if hasattr(module, "_is_checkpointable_tensor"):
            module._is_checkpointable_tensor = lambda obj: False
    dcp_fields.needed = lambda: True
    if not taught:
        return {"blind": _round_trip(path)}
    dcp_fields.install()
    return {
        "wrapped": hasattr(planner_helpers._create_chunk_list, "__wrapped__"),
        **_round_trip(path),
    }


def _round_trip(path: str) -> dict[str, Any]:
    from hetcoll.torch.filters.shards import Marks

    full = torch.arange(24, dtype=torch.float64).reshape(6, 4)
    held = full[[4, 5, 0, 1, 2, 3]].clone()
    Marks.of_index(0, [4, 5, 0, 1, 2, 3], 6).mark(held)
    bias = torch.arange(3, dtype=torch.float64)
    dcp.save({"w": held, "b": bias}, checkpoint_id=f"{path}/ckpt", no_dist=True)
    dcp_to_torch_save(f"{path}/ckpt", f"{path}/unsplit.pt")
    unsplit = torch.load(f"{path}/unsplit.pt")
    part = torch.zeros(3, 4, dtype=torch.float64)
    Marks.of_index(0, [1, 5, 3], 6).mark(part)
    into = {"w": part, "b": torch.zeros(3, dtype=torch.float64)}
    try:
        dcp.load(into, checkpoint_id=f"{path}/ckpt", no_dist=True)
    except CheckpointException as e:  # a blind DCP's size check: not the saved tensor's size
        return {"saved": (unsplit["w"] - full).abs().max().item(), "loaded": repr(e)}
    return {
        "saved": (unsplit["w"] - full).abs().max().item(),
        "bias": (unsplit["b"] - bias).abs().max().item(),
        "loaded": (part - full[[1, 5, 3]]).abs().max().item(),
        "loaded_bias": (into["b"] - bias).abs().max().item(),
    }


#: The layouts whose full state dicts (``StateDictOptions(full_state_dict=True)``) are checked,
#: by the number of ranks: a model of :data:`CASES` split ("filter", speeds) or its experts
#: placed ("experts", shares), or a model of :func:`_layout` and its plan.
FULL: dict[int, list[tuple[str, Any]]] = {
    2: [
        ("mlp", ("filter", [1.0, 3.0])),
        ("resnet18", ("filter", [1.0, 2.0])),
        ("llama", ("filter", [1.0, 1.0])),
        ("gpt2", ("filter", [3.0, 1.0])),
        ("falcon", ("filter", [1.0, 1.0])),
        ("mixtral", ("experts", [[0, 3], [1, 2]])),
    ],
    3: [
        ("cnn", "PIPELINE_SPLIT_3"),
        ("cnn", "IDLE_3"),
        ("cnn", "OWNERS_3"),
        ("gpt2", "GPT2_PIPELINE_SPLIT"),
    ],
    4: [("cnn", "ASYMMETRIC"), ("mixtral", "BY_SPEED")],
}


#: The ranks of :data:`FULL`'s layouts that hold no parameter, and the name of the empty
#: slice each holds (the model's first parameter, whole on another rank: no rank's part).
PLACEHOLDERS = {
    ("cnn IDLE_3", 1): ["0.weight"],
    ("mixtral BY_SPEED", 3): ["model.embed_tokens.weight"],
}


def _off(a: Any, b: Any) -> float:
    """The largest difference of tensors ``a`` and ``b``; infinite where their shapes differ."""
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return math.inf
    return (a - b).abs().max().item() if a.numel() else 0.0


def full_state_dicts(rank: int, world: int, blind: bool = False) -> dict[str, dict[str, Any]]:
    """Each layout of :data:`FULL` trains 2 steps (AdamW), then DCP's ``get_state_dict`` with
    ``full_state_dict=True`` (flattened optimizer state: a plan's ranks hold different
    parameters), without and with ``cpu_offload``: each rank's tensors must be the unsplit
    model's (hetcoll's gathers), under the names the rank holds. ``blind``: without hetcoll's
    wrapper of DCP's copies, as torch alone makes them."""
    from hetcoll.torch.filters import dcp_copies

    torch.set_num_threads(1)
    if blind:
        dcp_copies._copies_marked = True  # as if installed: nothing is wrapped
    out = {}
    for model, layout in FULL[world]:
        if isinstance(layout, tuple):
            net = build(model, layout, None, seed=0)
            opt = torch.optim.AdamW(net.parameters(), lr=0.01)
            for _ in range(2):
                for p in net.parameters():
                    p.grad = torch.sin(3 * p.detach() + 1)
                opt.step()
        else:
            net = _layout(model, layout, seed=0)
            opt = torch.optim.AdamW(net.parameters(), lr=0.01)
            _train(model, net, opt)
        full, optim = _gathered(net, opt)
        own = net.state_dict()
        got: dict[str, Any] = {"own": sorted(own)}
        for offload in (False, True):
            options = StateDictOptions(
                full_state_dict=True, cpu_offload=offload, flatten_optimizer_state_dict=True
            )
            model_sd, optim_sd = get_state_dict(net, opt, options=options)
            # A rank holding no parameter holds an empty slice of the model's first.
            empty = [k for k, v in model_sd.items() if v.numel() == 0 and full[k].numel()]
            state = {
                tuple(k.removeprefix("state.").rsplit(".", 1)): v
                for k, v in optim_sd.items()
                if k.startswith("state.")
            }
            got["offloaded" if offload else "full"] = {
                "keys": sorted(model_sd),
                "empty": empty,
                "model": max(
                    (_off(v, full[k]) for k, v in model_sd.items() if k not in empty),
                    default=0.0,
                ),
                "optim": max(
                    (
                        _off(v, optim["state"][name][field])
                        for (name, field), v in state.items()
                        if name not in empty
                    ),
                    default=0.0,
                ),
                "on_host": all(v.device.type == "cpu" for v in model_sd.values()),
            }
        out[f"{model} {layout}"] = got
    return out


def run_all(comm: Any) -> dict[str, Any]:
    """On MPI, with no torch.distributed (tests/mpi_workers/cases.py): a split MLP's full
    state dict through DCP's ``get_state_dict``, gathered over ``MPI.COMM_WORLD`` (the default
    group there), without and with ``cpu_offload`` (every rank keeps it: torch keeps rank 0's
    alone only where torch.distributed runs)."""
    torch.manual_seed(0)
    model = filter_parallel(mlp().double(), comm, speeds=[1.0, 3.0, 2.0][: comm.Get_size()])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.sin(3 * p.detach() + 1)
    opt.step()
    full = gather_state_dict(model, dst=None)
    optim = gather_optimizer_state_dict(model, opt, dst=None)
    assert full is not None and optim is not None
    out = {}
    for offload in (False, True):
        options = StateDictOptions(full_state_dict=True, cpu_offload=offload)
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        out["offloaded" if offload else "full"] = {
            "keys": sorted(model_sd) == sorted(full),
            "model": max(_off(v, full[k]) for k, v in model_sd.items()),
            "optim": max(
                _off(v, optim["state"][name][field])
                for name, fields in optim_sd["state"].items()
                for field, v in fields.items()
            ),
        }
    return out
