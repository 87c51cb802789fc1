"""Expert parallelism on real ranks: whole experts placed by speed, each rank training on its
own share of the batch under DistributedDataParallel with hetcoll's weighted hook, against one
process training on the whole batch. Run on every rank of a gloo group (test_expert_parallel)."""

from __future__ import annotations

import copy
import itertools
import json
import warnings
from typing import Any

import pytest
import torch
from tensor_parallel_cases import (
    SEQ,
    VOCAB,
    _trained_whole,
    _with_lora,
    close,
    deepseek_v3,
    gpt_oss,
    gpt_oss_lora,
    mixtral,
    olmoe,
    qwen2_moe,
    tolerance,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hetcoll
from hetcoll import CollectiveMismatchError
from hetcoll.comm import wrap
from hetcoll.torch import (
    DistributedOptimizer,
    clip_grad_norm_,
    gather_gradients,
    gather_optimizer_state_dict,
    gather_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    register_weighted_hook,
)
from hetcoll.torch.expert_parallel import (
    ExpertParallelExperts,
    Placement,
    expert_loads,
    expert_parallel,
    expert_shares,
    experts_module,
    place_experts,
    rank_local_parameters,
)
from hetcoll.torch.expert_rebalance import ExpertRebalancer
from hetcoll.torch.transport import CountingCommunicator

SPEEDS = [1.0, 0.5, 0.25, 0.75]
ROWS = 7  # the global batch: split 4 : 2 : 1 at SPEEDS


def tokens(step: int, pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of ``ROWS`` sequences and its next-token labels; with ``pad``, the later
    rows' tails padded (-100 labels), unevenly, so the ranks' valid tokens are not their rows'
    share."""
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids[:, 1:].clone()
    if pad:
        for r in range(ROWS):
            labels[r, SEQ - 1 - (r * 3) % (SEQ - 1) :] = -100
    return ids, labels


def valid(labels: torch.Tensor) -> int:
    """What the loss averages over: the valid (not padded) labels."""
    return int((labels != -100).sum())


def lm_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    return nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100
    )


def trains_as_one_process(
    group: Any,
    make: Any,
    speeds: list[float],
    optimizer: str = "sgd",
    pad: bool = False,
    steps: int = 2,
    shares: list[int] | list[list[int]] | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | None = None,
    watch: Any = None,
    clip: float | None = None,
    compiled: type[nn.Module] | None = None,
) -> list[int]:
    """``make()``'s experts placed on the ranks by ``speeds``, each rank training on its
    share of each step's rows (DDP with the weighted hook; with ``pad``, weighing valid
    tokens), gives the gradients and the state of one process training on all the rows.
    ``shares`` places the experts instead of ``speeds``; ``device``: this rank's (the
    reference runs on the CPU); ``watch(model, optimizer)``: a function called after every
    optimizer step; ``clip``: each step's gradients clipped to that norm
    (:func:`hetcoll.torch.clip_grad_norm_`, the reference by torch's, the same norm);
    ``compiled``: the modules of that class compiled in place after the placement (their
    ``compile()``). Returns the experts per rank."""
    comm = wrap(group)
    torch.manual_seed(0)
    ref = make().to(dtype)
    placed: dict[str, Any] = {"speeds": speeds} if shares is None else {"shares": shares}
    step_labels: list[torch.Tensor] = []
    if pad:  # each rank weighs its valid tokens: this step's, read at the forward
        placed["weight"] = lambda: valid(step_labels[-1])
    dev = device or torch.device("cpu")
    model = expert_parallel(copy.deepcopy(ref).to(dev), group, **placed)
    for m in model.modules() if compiled is not None else ():
        if isinstance(m, compiled):
            m.compile(backend="aot_eager")
    make_opt = {
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
        "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    }[optimizer]
    ref_opt = make_opt(ref.parameters())
    if comm.engine == "mpi":
        items = {"items": valid} if pad else {"model": model}
        opt: Any = DistributedOptimizer(make_opt(model.parameters()), group, **items)
        run: nn.Module = model
    else:
        run = DistributedDataParallel(model, process_group=group)
        state = register_weighted_hook(run, items=valid if pad else None)
        opt = make_opt(model.parameters())
    after_step = watch(model, opt.optimizer if comm.engine == "mpi" else opt) if watch else None
    rows = hetcoll.split(ROWS, speeds)
    start = sum(rows[: comm.rank])
    mine = slice(start, start + rows[comm.rank])
    for step in range(steps):
        ids, labels = tokens(step, pad)
        step_labels.append(labels[mine])
        if pad:
            (opt if comm.engine == "mpi" else state).count(labels[mine])
        lm_loss(run, ids[mine].to(dev), labels[mine].to(dev)).backward()
        lm_loss(ref, ids, labels).backward()
        if comm.engine == "mpi":
            opt.synchronize()
        grads = gather_gradients(model, dst=None)
        assert grads is not None
        for n, p in ref.named_parameters():
            close(grads[n].cpu(), p.grad, f"step {step} gradient of {n}")
        if clip is not None:  # every rank's own experts in the norm, each counted once
            norm = clip_grad_norm_(model.parameters(), clip, group=group)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            assert want > clip  # it clips
            close(norm, want.to(norm.dtype), f"step {step} gradient norm")
        # The MPI optimizer's step would synchronise again; its inner optimizer steps.
        (opt.optimizer if comm.engine == "mpi" else opt).step()
        ref_opt.step()
        model.zero_grad()
        ref.zero_grad()
        if after_step is not None:
            after_step()
    full = gather_state_dict(model, dst=None)
    assert full is not None
    for n, t in ref.state_dict().items():
        close(full[n].cpu(), t, f"state {n}")
    # Resumed on the reversed counts, the experts taken from the last (not runs in expert
    # order), every expert lands where that placement puts it.
    counts = placed_shares(model)[::-1]
    backwards = list(range(sum(counts)))[::-1]
    cuts = [0, *itertools.accumulate(counts)]
    resumed = [sorted(backwards[a:b]) for a, b in itertools.pairwise(cuts)]
    again = expert_parallel(make().to(dev, dtype), group, shares=resumed)
    load_full_state_dict(again, full)
    back = gather_state_dict(again, dst=None)
    assert back is not None and all(torch.equal(back[n], t) for n, t in full.items())
    held = {m.shares[comm.rank] for m in model.modules() if isinstance(m, ExpertParallelExperts)}
    assert len(held) == 1 or watch is not None  # by speed alone, every layer alike
    assert set(rank_local_parameters(model)) == set(model._ddp_params_and_buffers_to_ignore)
    return placed_shares(model)


def rebalanced_while_training(group: Any, device: torch.device | None = None) -> list[list[Any]]:
    """Mixtral placed by speed, its ranks' speeds then reversed: an
    :class:`ExpertRebalancer` looking every 2 steps moves the experts (with their Adam
    momentum) by the loads it counted, any experts to any rank, and training goes on as one
    process's, its gradients clipped by the whole model's norm (``device``: this rank's, the
    experts moving between devices through host memory). Returns its decisions (step, each
    rank's experts before and after, moved)."""
    speeds = SPEEDS[: wrap(group).size]
    made: list[ExpertRebalancer] = []

    def watch(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
        made.append(ExpertRebalancer(model, opt, speeds=speeds[::-1], every=2, threshold=0.0))
        return made[0].step

    trains_as_one_process(
        group, mixtral, speeds, optimizer="momentum", steps=4, watch=watch, device=device, clip=0.05
    )
    # Bad arguments raise on construction, naming the argument (nothing is exchanged).
    model = made[0].model
    bad: list[tuple[Any, dict[str, Any], str]] = [
        ("model", {}, "model: must be a torch.nn.Module"),
        (nn.Linear(2, 2), {}, "model: holds no experts"),
        (model, {"optimizer": "adam"}, "optimizer: must be"),
        (model, {"speeds": [1.0]}, "speeds: needs one"),
        (model, {"speeds": ["fast"] * len(speeds)}, "speeds: must be numbers"),
        (model, {"every": 0}, "every: must be"),
        (model, {"threshold": -0.1}, "threshold: must be"),
        (model, {"smoothing": 0.0}, "smoothing: must be"),
        (model, {"capacity": [1]}, "capacity: needs one"),
    ]
    for m, kwargs, text in bad:
        with pytest.raises((TypeError, ValueError), match=text):
            ExpertRebalancer(m, **{"speeds": speeds, **kwargs})
    resumed_from_state(group, made[0], device)
    for e in made[0].history:  # the counts are the placements'
        for shares, placement in ((e.old_shares, e.old_placement), (e.new_shares, e.new_placement)):
            assert shares == {n: [len(h) for h in held] for n, held in placement.items()}
        # The experts put on another rank, and the time moving them took where they moved.
        assert e.moved == sum(
            len(set(a) - set(b))
            for n, old in e.old_placement.items()
            for a, b in zip(old, e.new_placement[n], strict=True)
        )
        assert (e.seconds > 0) == e.applied and (e.moved > 0 or not e.applied)
    return [[e.step, e.old_placement, e.new_placement, e.applied] for e in made[0].history]


def resumed_from_state(group: Any, watch: ExpertRebalancer, device: torch.device | None) -> None:
    """A run resumed from ``watch``'s state: Mixtral placed by speed again (where the run
    started), the trained weights and momentum loaded unsplit, then the rebalancer's state:
    the experts go where the rebalancer had put them, with their momentum, and its steps and
    loads come back, so it decides on as the saved one would. Bad states raise naming the
    field, on every rank; the ranks' differing states raise on every rank; a state saved on
    more ranks keeps the placement and takes the loads."""
    comm = wrap(group)
    dev = device or torch.device("cpu")
    saved = watch.state_dict()
    assert saved["step"] == 4 and saved["loads"] is not None
    weights = gather_state_dict(watch.model, dst=None)
    assert watch.optimizer is not None and weights is not None
    moments = gather_optimizer_state_dict(watch.model, watch.optimizer, dst=None)
    start = expert_parallel(mixtral().to(dev, torch.float64), group, speeds=SPEEDS[: comm.size])
    opt = torch.optim.SGD(start.parameters(), lr=0.1, momentum=0.9)
    load_full_state_dict(start, weights)
    load_full_optimizer_state_dict(start, opt, moments)
    again = ExpertRebalancer(start, opt, speeds=SPEEDS[: comm.size], every=2)
    assert again.state_dict()["placement"] != saved["placement"]  # it starts elsewhere
    again.load_state_dict(json.loads(json.dumps(saved)))  # as a JSON checkpoint holds it
    assert again.state_dict() == saved and again.loads == watch.loads
    for name, t in (gather_state_dict(start, dst=None) or {}).items():
        assert torch.equal(t, weights[name]), name
    state = gather_optimizer_state_dict(start, opt, dst=None)["state"]
    for name, entry in moments["state"].items():
        assert torch.equal(state[name]["momentum_buffer"], entry["momentum_buffer"]), name
    layer = next(iter(saved["placement"]))
    bad: list[tuple[dict[str, Any], str]] = [
        ({**saved, "step": -1}, r"state\['step'\]: must be an integer >= 0"),
        ({"step": 1}, r"state: missing \['loads', 'placement'\]"),
        ({**saved, "placement": {}}, r"state\['placement'\]: must place the model's"),
        (
            {**saved, "loads": {**saved["loads"], layer: [1.0]}},
            rf"state\['loads'\]\[{layer!r}\]: needs one finite number",
        ),
        (
            {**saved, "placement": {**saved["placement"], layer: [[0, 0]] * comm.size}},
            rf"state\['placement'\]\[{layer!r}\]",
        ),
    ]
    for state_, text in bad:  # on every rank alike: each raises its own error
        with pytest.raises(ValueError, match=text):
            again.load_state_dict(state_)
    with pytest.raises(TypeError, match="state: must be a dict"):
        again.load_state_dict([])  # type: ignore[arg-type]
    # One rank's bad state: it raises its own error, the others the mismatch, before anything
    # moves; states that differ by rank raise the mismatch on every rank.
    with pytest.raises((ValueError, CollectiveMismatchError)) as raised:
        again.load_state_dict({**saved, "step": -1} if comm.rank == 1 else saved)
    assert raised.type is (ValueError if comm.rank == 1 else CollectiveMismatchError)
    with pytest.raises(CollectiveMismatchError, match="the restored step"):
        again.load_state_dict({**saved, "step": comm.rank})
    assert again.state_dict() == saved  # nothing changed
    # Saved on one more rank: the loads come back, the experts stay where they are.
    wider = {name: [[], *held] for name, held in saved["placement"].items()}
    again.load_state_dict({"step": 8, "loads": saved["loads"], "placement": wider})
    assert again.state_dict() == {**saved, "step": 8}


def placed_shares(model: nn.Module) -> list[int]:
    """The experts per rank of ``model``'s first experts layer."""
    return next(m.shares for m in model.modules() if isinstance(m, ExpertParallelExperts))


def checkpointed(reentrant: bool = False) -> nn.Module:
    """Mixtral under Hugging Face's gradient checkpointing: each block's forward, its experts'
    exchanges included, runs again in the backward (``torch.utils.checkpoint``)."""
    model = mixtral()
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    model.train()
    return model


def experts_placed(group: Any) -> dict[str, Any]:
    """Each model's experts per rank, having trained as one process: Mixtral by its eager loop
    and batched_mm, GPT-OSS's biased, transposed experts, Qwen2-MoE beside its shared expert,
    DeepSeek-V3 beside its latent attention, OLMoE; a rank too slow for an expert holding none;
    a batch whose valid tokens are not its rows' share; Mixtral under gradient checkpointing
    (every rank's recomputed forward exchanging again in the backward), and with its
    decoder layers compiled; grouped_mm in float32."""
    p = wrap(group).size
    out: dict[str, Any] = {}
    # Hugging Face's routers take their softmax, and its norms their mean square, in float32
    # whatever the model's dtype: rows batched otherwise (each rank's share against the whole
    # batch) round differently there, 2e-7 in the first step's gradients, which Adam's
    # normalised steps would magnify to 5e-6. SGD keeps it 3e-7; a wrong weighting is 0.1.
    models = {
        "mixtral": mixtral,
        "batched_mm": lambda: mixtral("batched_mm"),
        "gpt_oss": gpt_oss,
        "qwen2_moe": qwen2_moe,
        "deepseek_v3": deepseek_v3,
        "olmoe": olmoe,
    }
    with tolerance(1e-6):
        for name, make in models.items():
            out[name] = trains_as_one_process(group, make, SPEEDS[:p])
        # At these speeds the last rank holds no expert (its tokens all travel); given
        # shares (any experts), every rank holds some.
        held = [[0, 3], [2], [1], []][:p] if p > 2 else [[1, 2, 3], [0]]
        out["every_rank"] = trains_as_one_process(group, mixtral, SPEEDS[:p], shares=held)
        out["padded"] = trains_as_one_process(group, mixtral, SPEEDS[:p], pad=True)
        out["checkpointed"] = trains_as_one_process(group, checkpointed, SPEEDS[:p])
        # Its decoder layers compiled in place (torch's regional compilation), the experts'
        # exchanges between the ranks running as they are between the compiled graphs.
        from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

        out["compiled"] = trains_as_one_process(
            group, mixtral, SPEEDS[:p], compiled=MixtralDecoderLayer
        )
    with tolerance(1e-5):  # Hugging Face's default kernel, which has no float64
        grouped = lambda: mixtral("grouped_mm")  # noqa: E731
        out["grouped_mm"] = trains_as_one_process(group, grouped, SPEEDS[:p], dtype=torch.float32)
    return out


def placed_again_by_load(group: Any) -> dict[str, Any]:
    """Mixtral trained 2 steps with its experts placed by speed, AdamW, counts the tokens
    routed to each expert as one process does (:func:`expert_loads`); placed again by those
    loads between its third step's backward and its optimizer step, it trains that step and
    a fourth as one process still, its rows where they were (:func:`place_experts`, in place:
    the same parameters, optimizer and DDP; the experts' gradients and Adam moments move with
    them). Only the experts that change rank travel: this rank sends exactly their bytes.
    Its blocks are checkpointed (reentrant, Hugging Face's default): the forwards recomputed
    in the backward are not counted again. Returns the loads and both placements."""
    comm = wrap(group)
    speeds = SPEEDS[: comm.size]
    torch.manual_seed(0)
    ref = mixtral().double()
    counted: dict[str, torch.Tensor] = {}

    def count(name: str) -> Any:
        def hook(_: nn.Module, args: tuple[Any, ...]) -> None:
            n = torch.bincount(args[1].reshape(-1), minlength=4)
            counted[name] = counted.get(name, torch.zeros_like(n)) + n

        return hook

    copied = copy.deepcopy(ref)  # before the hooks
    copied.gradient_checkpointing_enable({"use_reentrant": True})
    copied.train()
    model = expert_parallel(copied, group, speeds=speeds)
    for name, m in ref.named_modules():
        if experts_module(m) == "":
            m.register_forward_pre_hook(count(name))
    # eps large: tiny gradients (float64 rounding) are not scaled up to whole steps.
    adam = lambda ps: torch.optim.AdamW(ps, lr=0.05, eps=1.0)  # noqa: E731
    ref_opt = adam(ref.parameters())
    rows = hetcoll.split(ROWS, speeds)
    start = sum(rows[: comm.rank])
    mine = slice(start, start + rows[comm.rank])

    def step(n: int, before_step: Any = None) -> None:
        ids, labels = tokens(n)
        lm_loss(run, ids[mine], labels[mine]).backward()
        lm_loss(ref, ids, labels).backward()
        if before_step is not None:
            before_step()
        grads = gather_gradients(model, dst=None)
        assert grads is not None
        for name, p in ref.named_parameters():
            close(grads[name], p.grad, f"step {n} gradient of {name}")
        opt.step()
        ref_opt.step()
        model.zero_grad()
        ref.zero_grad()

    opt = adam(model.parameters())
    run = DistributedDataParallel(model, process_group=group)
    register_weighted_hook(run)
    for n in range(2):
        step(n)
    by_speed = placed_shares(model)
    loads = expert_loads(model)
    assert loads == {name: c.tolist() for name, c in counted.items()}, (loads, counted)
    assert expert_loads(model) == {name: [0] * 4 for name in loads}  # taken: counted anew
    # The ranks' speeds changed (the slowest is now the fastest): each layer placed anew by
    # them and its own loads, in place, its gradients and moments moved with its experts.
    layers = {n: m for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)}
    sent: dict[str, int] = {}
    counting = CountingCommunicator(next(iter(layers.values())).comm, sent)
    for m in layers.values():
        m.comm = counting
    placed: dict[str, list[list[int]]] = {}
    step(2, lambda: placed.update(place_experts(model, opt, speeds=speeds[::-1], loads=loads)))
    step(3)
    # What leaves this rank: its old experts (a run from the first, by speed) that another
    # rank now holds, each as its parameters, their gradients and Adam's two moments (float64).
    first = sum(by_speed[: comm.rank])
    expected = 0
    for name, new in placed.items():
        leaving = set(range(first, first + by_speed[comm.rank])) - set(new[comm.rank])
        row = sum(p[0].numel() * p.element_size() for p in ref.get_submodule(name).parameters())
        expected += len(leaving) * row * 4
    assert sent["placement"] == expected, (sent, expected)
    return {"by_speed": by_speed, "by_load": placed, "loads": loads}


def random_layers(group: Any, cases: int = 30) -> list[tuple[int, ...]]:
    """One experts layer against the unsplit layer on every rank's tokens together, in
    float64 to 1e-12, over ``cases`` random set-ups alike on every rank: 1-6 experts placed
    at random (runs in expert order in even cases, any experts in odd ones; a rank may hold
    none), 1-3 per token, 0-4 tokens a rank (a rank may have none),
    routing at random, gates and output gradients at random. Rank r's loss is its share of
    ``sum(out * g)`` over its share of the weight (its tokens over all), so the experts'
    gradients are the unsplit layer's, and rank r's input and gate gradients its rows' times
    the weight's inverse. Returns each case's (experts, top_k, tokens per rank...)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    comm = wrap(group)
    p, rank = comm.size, comm.rank
    seen: list[tuple[int, ...]] = []
    for case in range(cases):
        g = torch.Generator().manual_seed(1000 + case)
        experts = int(torch.randint(1, 7, (), generator=g))
        top_k = int(torch.randint(1, min(experts, 3) + 1, (), generator=g))
        cuts = torch.sort(torch.randint(0, experts + 1, (p - 1,), generator=g)).values.tolist()
        shares = [b - a for a, b in zip([0, *cuts], [*cuts, experts], strict=True)]
        order = torch.randperm(experts, generator=g).tolist() if case % 2 else range(experts)
        held = [sorted(order[a:b]) for a, b in zip([0, *cuts], [*cuts, experts], strict=True)]
        rows = torch.randint(0, 5, (p,), generator=g).tolist()
        rows[case % p] = max(rows[case % p], 1)  # some rank has tokens
        total = sum(rows)
        config = MixtralConfig(
            hidden_size=8, intermediate_size=8, num_local_experts=experts,
            num_experts_per_tok=top_k, experts_implementation="eager",
        )  # fmt: skip
        ref = MixtralExperts(config).double()
        with torch.no_grad():
            for q in ref.parameters():
                q.copy_(torch.randn(q.shape, generator=g, dtype=torch.float64) / 3)
        x = torch.randn(total, 8, generator=g, dtype=torch.float64)
        index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(total)])
        gates = torch.rand(total, top_k, generator=g, dtype=torch.float64)
        out_grad = torch.randn(total, 8, generator=g, dtype=torch.float64)
        layer = expert_parallel(
            nn.ModuleDict({"experts": copy.deepcopy(ref)}), group, shares=held
        ).experts  # fmt: skip
        mine = slice(sum(rows[:rank]), sum(rows[: rank + 1]))
        xs, gs = x[mine].clone().requires_grad_(), gates[mine].clone().requires_grad_()
        weight = rows[rank] / total
        out = layer(xs, index[mine], gs)
        if rows[rank]:
            ((out * out_grad[mine]).sum() / weight).backward()
        else:
            (out.sum() * 0).backward()  # no tokens: the rank still joins the exchanges
        xr, gr = x.clone().requires_grad_(), gates.clone().requires_grad_()
        (ref(xr, index, gr) * out_grad).sum().backward()
        for name, q in layer.named_parameters(recurse=False):
            want = ref.get_parameter(name).grad[held[rank]]
            assert q.grad is not None, (case, name)
            torch.testing.assert_close(q.grad, want, rtol=1e-12, atol=1e-12)
        if rows[rank]:
            assert xs.grad is not None and gs.grad is not None
            torch.testing.assert_close(xs.grad * weight, xr.grad[mine], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(gs.grad * weight, gr.grad[mine], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(out, ref(x, index, gates)[mine], rtol=1e-12, atol=1e-12)
        seen.append((experts, top_k, *rows, *shares))
    return seen


def disagreements(group: Any) -> list[str]:
    """An experts layer whose ranks call it with what cannot fit together raises the same
    ``ValueError`` on every rank, none waiting for another: a rank's tokens in float32 beside
    the others' float64, a rank routing to an expert that does not exist, a rank whose
    ``weight`` function raises. Placing experts raises on every rank too, before any other
    exchange: a rank whose model holds no experts (it raises its own error, the others
    :class:`hetcoll.CollectiveMismatchError`), ranks whose speeds differ (placing or placing
    again), experts in a layout of no known role, experts under PEFT's LoRA on their
    parameters. Returns what each call raised (the
    message's first word, or the error's class)."""
    rank = wrap(group).rank
    torch.manual_seed(0)
    layer = mixtral().double().model.layers[0].mlp.experts
    layer = expert_parallel(
        nn.ModuleDict({"experts": layer}), group, speeds=SPEEDS[: wrap(group).size],
        weight=lambda: 1 / 0 if rank == 1 else 1.0,
    ).experts  # fmt: skip
    seen: list[str] = []

    def call(x: torch.Tensor, index: torch.Tensor) -> None:
        try:
            layer(x, index, torch.ones(index.shape, dtype=x.dtype))
        except ValueError as e:
            seen.append(str(e).split(":")[0])

    x = torch.randn(5, 16, dtype=torch.float64)
    index = torch.zeros(5, 2, dtype=torch.long)
    call(x, index)  # rank 1's weight() raises
    layer.weight = None
    call(x if rank else x.float(), index)
    call(x, index + 9 * (rank == 0))

    class Stacked(nn.Module):  # experts stacked in no layout Hugging Face's flags describe
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 2
            self.w = nn.Parameter(torch.zeros(2, 3, 4))

    p = wrap(group).size
    for model, speeds in (
        (nn.Linear(2, 2) if rank == 1 else mixtral(), SPEEDS[:p]),
        (mixtral(), [1.0] * p if rank == 0 else SPEEDS[:p]),
        (nn.ModuleDict({"x": Stacked()}), SPEEDS[:p]),
    ):
        try:
            expert_parallel(model, group, speeds=speeds)
        except CollectiveMismatchError:
            seen.append("CollectiveMismatchError")
        except ValueError as e:
            seen.append(str(e).split(":")[0])
    # PEFT's LoRA on the experts' parameters, its adapters disabled: a wrapper no rule places.
    disabled = _with_lora(mixtral(), ["q_proj"], target_parameters=EXPERTS_PARAMETERS)
    disabled.base_model.disable_adapter_layers()
    try:
        expert_parallel(disabled, group, speeds=SPEEDS[:p])
    except ValueError as e:
        seen.append("adapters" if "no rule here places by expert" in str(e) else str(e))
    # Under "all-linear" the router's weight trains under LoRA too (ParamWrapper), a new
    # gradient accumulator each forward, which DDP's hook never sees: refused by name.
    routed = expert_parallel(
        _trained_whole(_with_lora(mixtral(), "all-linear")), group, speeds=SPEEDS[:p]
    )
    try:
        register_weighted_hook(DistributedDataParallel(routed, process_group=group))
    except (ValueError, CollectiveMismatchError) as e:
        seen.append("router" if "mlp.gate.base_layer.weight' trains under" in str(e) else str(e))
    placed = expert_parallel(mixtral(), group, speeds=SPEEDS[:p])
    try:  # placed again at speeds that differ between the ranks: nothing moves
        place_experts(placed, speeds=[1.0] * p if rank == 0 else SPEEDS[:p])
    except CollectiveMismatchError:
        seen.append("CollectiveMismatchError")
    assert placed_shares(placed) == expert_shares(4, SPEEDS[:p])
    return seen


#: The experts' parameters of :func:`mixtral` (and :func:`gpt_oss`).
EXPERTS_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


def mixtral_lora() -> nn.Module:
    """:func:`mixtral` with PEFT's LoRA on its query projections and on its experts'
    parameters (``ParamWrapper``, each adapter a block per expert), every weight trainable."""
    return _trained_whole(_with_lora(mixtral(), ["q_proj"], target_parameters=EXPERTS_PARAMETERS))


def lora_experts(group: Any) -> dict[str, Any]:
    """Experts under PEFT's LoRA on their parameters placed with their adapters' blocks, each
    training as one process (gradients, state, resumed on another placement): Mixtral's and
    GPT-OSS's (transposed, biased), by speed (a rank holding one expert and one none: PEFT's
    own delta takes one expert for a 2-D parameter, and cannot infer the adapter's rank of
    none); any experts given as shares; placed again after the first step (the factors'
    blocks moving with their experts, with their momentum). Returns the experts per rank of
    each."""
    p = wrap(group).size
    out: dict[str, Any] = {}
    with tolerance(1e-6):  # the routers' float32 softmax (momentum SGD, not Adam)
        out["mixtral"] = trains_as_one_process(group, mixtral_lora, SPEEDS[:p], "momentum")
        out["gpt_oss"] = trains_as_one_process(group, gpt_oss_lora, SPEEDS[:p])
        held = [[0, 3], [2], [1], []][:p] if p > 2 else [[1, 2, 3], [0]]
        out["every_rank"] = trains_as_one_process(
            group, mixtral_lora, SPEEDS[:p], "momentum", shares=held
        )
        moves: list[Placement] = []

        def watch(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
            def after_step() -> None:
                if not moves:  # the slowest rank's experts now the fastest's
                    moves.append(place_experts(model, opt, speeds=SPEEDS[:p][::-1]))

            return after_step

        trains_as_one_process(group, mixtral_lora, SPEEDS[:p], "momentum", steps=3, watch=watch)
        out["moved"] = [sorted(len(h) for h in held) for held in moves[0].values()]
    return out


def run_torch(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*bos_token_id|.*eos_token_id")
    with tolerance(1e-6):  # the routers' float32 softmax
        again = placed_again_by_load(None)
        rebalanced = rebalanced_while_training(None)
    return {
        **experts_placed(None),
        "lora": lora_experts(None),
        "errors": disagreements(None),
        "again": again,
        "rebalanced": rebalanced,
        "random": random_layers(None),
    }
