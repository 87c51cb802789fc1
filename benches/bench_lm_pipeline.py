"""examples/train_lm.py's decoder (Hugging Face Llama, float32) as a pipeline on three gloo
ranks, under hetcoll and under torch.distributed.pipelining:

    python benches/bench_lm_pipeline.py [--launches 3] [--steps 15] [--json out.json]
    python benches/bench_lm_pipeline.py --quick --json /tmp/x.json       # a dry run (~1 min)

The model is ``make_model()`` of examples/train_lm.py (6 decoder layers, hidden 64, grouped-query
attention, rotary embeddings, eager attention, byte vocabulary), trained on its ``batches``: a
global batch of 16 rows of 64 bytes, padded rows masked, labels -100 there, in 4 micro-batches.
A step is forward, backward and an AdamW step. Two comparisons:

1. **The same pipeline** (ranks of equal speed): stages cut between decoder layers, two layers
   each (embedding + layers 0-1 / layers 2-3 / layers 4-5 + norm + head), 1F1B and GPipe, equal
   micro-batches, under :func:`hetcoll.torch.parallelize` (a plan whose ``layers`` index
   :func:`hetcoll.torch.layers.model_layers`: each stage replays the model's own forward around
   its blocks) and under ``torch.distributed.pipelining`` (``PipelineStage`` + ``Schedule1F1B`` /
   ``ScheduleGPipe``). ``throughput`` = torch's step / hetcoll's: hetcoll's throughput as a
   fraction of torch's (target: >= 0.9).
2. **The best heterogeneous plan against the best plan torch can express**, at emulated speeds
   1 : 0.5 : 0.25 (rank 0 the fastest). torch's candidates (one rank per stage, equal
   micro-batches, 1F1B): the even cut, and the cuts by speed over the three ranks and over
   the two fastest (rank 2 idle): :func:`hetcoll.partition_chain` over the chain embedding,
   decoder layer x 6, norm + head + loss, each measured forward + backward on a micro-batch
   (:func:`unit_seconds`) — the min-max cut, so the best one-rank-per-stage pipeline torch
   can run on those ranks in that order (the chain's model predicts each:
   ``predicted_units_s``). hetcoll's: the same pipelines cut by speed; asymmetric replicas
   (rank 0 runs the whole model beside a 2-stage pipeline of ranks 1 and 2, the batch split by
   the replicas' throughputs, uneven micro-batches); data-parallel replicas with the batch
   split by speed; and the planner's best plan (:func:`hetcoll.model.plan` on the emulated
   cluster: this machine's device measured once, slowed to each rank's speed by
   :func:`hetcoll.lab.emulate.emulated_device`; a plan equal to a candidate above is marked
   ``planner_chose`` rather than run twice). ``vs_best_torch`` = the best torch candidate's
   step / the best hetcoll candidate's.

**torch's side is hand-built stages**, not ``pipeline()``: ``pipeline(model, mb_args=(),
mb_kwargs={"input_ids", "attention_mask"}, split_spec={"model.layers.2":
SplitPoint.BEGINNING, ...})`` traces this model (torch 2.15, transformers 5.23), but the
first stage it builds cannot run: the rotary embedding's ``torch.no_grad`` region becomes a
``wrap_with_set_grad_enabled`` submodule that the unflattened stage calls with no arguments
("Expected positional argument for parameter unsqueeze_default"). So each rank builds its
stage as :class:`TorchStage` (from the same HF modules, copied from one model built with the
same seed as hetcoll's): the first stage embeds the tokens and computes the 4-D attention mask
(``transformers.masking_utils.create_causal_mask``) and the rotary cos/sin
(``model.rotary_emb``) as ``LlamaModel.forward`` does; every stage runs its decoder layers and
passes hidden states, mask, cos and sin on, as the graph split of ``pipeline()`` does
(the same four tensors cross each of its cuts); the last adds ``norm`` and ``lm_head``.
hetcoll's stages send only the hidden states: each recomputes the mask and the cos/sin from
the micro-batch's inputs (:mod:`hetcoll.torch.replay`).

**The loss, the same on both sides.** hetcoll weights each micro-batch by its valid tokens
(``items=valid_tokens``): the step's gradient is that of the mean over the global batch's valid
tokens. torch's schedules average per micro-batch (``scale_grads=True`` divides by the
micro-batch count, the global token mean only when every micro-batch holds as many valid
tokens); so torch's side sums each micro-batch's token losses and divides by the global
batch's valid-token count (fixed: the benchmark repeats one batch), with ``scale_grads=False``.
Both then compute the same cross entropy over the same logits per micro-batch, and the same
gradient: the first step's losses of the two sides are reported (``first_loss``) and agree
to float32 rounding.

Heterogeneity is *emulated* the same way on both sides (as in ``bench_plans.py``): each rank
slows its own blocks with :func:`hetcoll.lab.emulate.slow_down` — the embedding, each decoder
layer (attention included), the final norm and the head each sleep ``(1/speed - 1)`` times
their own forward and backward; the rotary embedding (no parameters) runs at full speed. The
benchmark checks after warm-up that every slowed block was timed. Timing as in
``bench_plans.py``: a step's time is the slowest rank's (barrier, step, max over ranks), the
configurations of a comparison taking turns step by step in an order shuffled every step
(so that no peer always runs first); the figure is the median over steps after warm-up, and
over launches the median of the launches' medians; the spread is each launch's median and the
steps' interquartile range.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hetcoll
from hetcoll import launch

# examples/train_lm.py (and its train_plan.py) as modules, in this process and in the ranks.
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

import train_lm  # noqa: E402

SPEEDS = (1.0, 0.5, 0.25)
BATCH = 16
MICROBATCHES = 4
#: Seed of the global batch (examples/train_lm.py's ``batches``).
DATA_SEED = 0
#: Decoder layers per stage of the first comparison's pipeline.
EVEN = (2, 2, 2)


def _batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return train_lm.batches(train_lm.corpus(), BATCH, 1, DATA_SEED)[0]


@functools.cache
def _built() -> Any:
    torch.manual_seed(0)
    return train_lm.make_model("llama")


def _model() -> Any:
    """The example's Llama (a ``LlamaForCausalLM``), a fresh copy of the same weights on every
    call (built once per process: a rank builds a dozen)."""
    return copy.deepcopy(_built())


def _layer_count() -> int:
    return int(_model().config.num_hidden_layers)


# -- the two sides' stages -----------------------------------------------------------------------


def block_range(layers: Sequence[int], stage: int) -> tuple[int, int]:
    """The plan's ``layers`` range (indices into :func:`hetcoll.torch.layers.model_layers`:
    ``model.embed_tokens, model.rotary_emb, model.layers.0 .. model.layers.N-1, model.norm,
    lm_head``) of pipeline stage ``stage`` when the stages hold ``layers`` decoder layers (the
    first also the embedding, the last also the norm and the head)."""
    first = 2  # model.embed_tokens, model.rotary_emb
    lo = first + sum(layers[:stage])
    hi = first + sum(layers[: stage + 1])
    return (0 if stage == 0 else lo, hi + 2 if stage == len(layers) - 1 else hi)


def pipeline_plan(pipe: dict[str, Any], schedule: str) -> dict[str, Any]:
    """A one-rank-per-stage pipeline: ``pipe["ranks"][s]`` runs stage ``s``, which holds
    ``pipe["layers"][s]`` decoder layers."""
    layers = pipe["layers"]
    stages = [
        {"ranks": [r], "layers": list(block_range(layers, s))} for s, r in enumerate(pipe["ranks"])
    ]
    return {
        "microbatches": MICROBATCHES,
        "schedule": schedule,
        "replicas": [{"samples": BATCH, "stages": stages}],
    }


class TorchStage(nn.Module):
    """Decoder layers ``lo:hi`` of a Hugging Face ``LlamaForCausalLM``, as
    ``LlamaModel.forward`` runs them, for a hand-built ``PipelineStage``. The ``first`` stage
    takes ``(input_ids, attention_mask)``, embeds the tokens and builds the 4-D mask and the
    rotary cos/sin; a stage that is not the ``last`` returns ``(hidden, mask, cos, sin)``, the
    next one takes them; the last adds the norm and the head and returns the logits."""

    def __init__(self, model: Any, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        inner = model.model
        self.config = model.config
        self.first, self.last = first, last
        self.embed_tokens = inner.embed_tokens if first else None
        self.rotary_emb = inner.rotary_emb if first else None
        self.layers = nn.ModuleList(inner.layers[lo:hi])
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, *args: torch.Tensor) -> Any:
        if self.first:
            from transformers.masking_utils import create_causal_mask

            assert self.embed_tokens is not None and self.rotary_emb is not None
            input_ids, attention_mask = args
            hidden = self.embed_tokens(input_ids)
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            mask = create_causal_mask(
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=attention_mask,
                past_key_values=None,
                position_ids=position_ids,
            )
            if not isinstance(mask, torch.Tensor):
                raise RuntimeError("create_causal_mask returned no tensor: eager attention needed")
            cos, sin = self.rotary_emb(hidden, position_ids=position_ids)
            # Sent as they are: contiguous buffers.
            mask, cos, sin = mask.contiguous(), cos.contiguous(), sin.contiguous()
        else:
            hidden, mask, cos, sin = args
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=(cos, sin))
        if self.last:
            assert self.norm is not None and self.lm_head is not None
            return self.lm_head(self.norm(hidden))
        return hidden, mask, cos, sin

    def blocks(self) -> list[nn.Module]:
        """The blocks with parameters, as the emulation slows them."""
        ends = [self.embed_tokens] if self.first else []
        tail = [self.norm, self.lm_head] if self.last else []
        return [m for m in [*ends, *self.layers, *tail] if m is not None]


def _slow(blocks: list[nn.Module], speed: float) -> Any:
    from hetcoll.lab.emulate import slow_down

    return slow_down(blocks, speed)


def _hetcoll_step(
    plan: dict[str, Any], speed: float, first_loss: dict[str, float], name: str
) -> tuple[Callable[[], None], Any]:
    from hetcoll.torch import parallelize
    from hetcoll.torch.layers import model_layers

    model = _model()
    names = [n for n, _ in model_layers(model)]
    par = parallelize(model, plan, loss_fn=train_lm.lm_loss, items=train_lm.valid_tokens)
    handle = None
    if par.stage is not None and par.place is not None:
        i, j = par.place
        lo, hi = plan["replicas"][i]["stages"][j]["layers"]
        blocks = [par.stage.get_submodule(n) for n in names[lo:hi]]
        handle = _slow([b for b in blocks if next(b.parameters(), None) is not None], speed)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-3, weight_decay=0.0)
    x, y = _batch()

    def step() -> None:
        loss = par.step(x, y)
        first_loss.setdefault(name, loss)
        opt.step()
        opt.zero_grad()

    return step, handle


def _torch_step(
    pipe: dict[str, Any],
    schedule: str,
    rank: int,
    speed: float,
    first_loss: dict[str, float],
    name: str,
) -> tuple[Callable[[], None], Any]:
    from torch.distributed import pipelining

    ranks, layers = pipe["ranks"], pipe["layers"]
    # Every rank creates the pipeline's group (a collective), in the same order.
    group: Any = dist.new_group(ranks) if len(ranks) < dist.get_world_size() else None
    if rank not in ranks:
        return (lambda: None), None
    s = ranks.index(rank)
    lo, hi = sum(layers[:s]), sum(layers[: s + 1])
    first, last = s == 0, s == len(ranks) - 1
    module = TorchStage(_model(), lo, hi, first, last)
    handle = _slow(module.blocks(), speed)
    x, y = _batch()
    tokens = int(train_lm.valid_tokens(y))

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # The micro-batch's share of the global token mean (see the module's docs).
        lg = logits[:, :-1]
        total = nn.functional.cross_entropy(
            lg.reshape(-1, lg.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        return total / tokens

    stage = pipelining.PipelineStage(module, s, len(ranks), torch.device("cpu"), group=group)
    make = getattr(pipelining, schedule)
    sched = make(stage, MICROBATCHES, loss_fn=loss_fn, scale_grads=False)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.0)

    def step() -> None:
        if first and last:
            raise RuntimeError("a one-stage pipeline: not a torch.distributed.pipelining peer")
        if first:
            sched.step(x["input_ids"], x["attention_mask"])
        elif last:
            losses: list[torch.Tensor] = []
            sched.step(target=y, losses=losses)
            first_loss.setdefault(name, float(sum(float(v.detach()) for v in losses)))
        else:
            sched.step()
        opt.step()
        opt.zero_grad()

    return step, handle


def _rank(
    rank: int, world: int, configs: dict[str, dict[str, Any]], steps: int, warmup: int
) -> dict[str, Any]:
    """Each comparison's configurations (name -> ``{"runner": "hetcoll", "plan": ...}`` or
    ``{"runner": "torch", "pipeline": ..., "schedule": ...}``, with ``"comparison"`` and the
    ranks' ``"speeds"``) taking turns step by step; the times of the slowest rank, and the
    first step's loss where this rank has it (the last stage's rank, for torch)."""
    t_build = time.perf_counter()
    torch.set_num_threads(1)
    # The first stage's embedding reads token ids, which need no gradient: its backward is not
    # timed (hetcoll.lab.emulate.SlowDown), on both sides alike.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    first_loss: dict[str, float] = {}
    runs: dict[str, Callable[[], None]] = {}
    handles: dict[str, Any] = {}
    for name, c in configs.items():
        speed = c["speeds"][rank]
        if c["runner"] == "hetcoll":
            runs[name], handles[name] = _hetcoll_step(c["plan"], speed, first_loss, name)
        else:
            runs[name], handles[name] = _torch_step(
                c["pipeline"], c["schedule"], rank, speed, first_loss, name
            )
    build_s = time.perf_counter() - t_build
    times: dict[str, list[float]] = {name: [] for name in runs}
    groups: dict[str, list[str]] = {}
    for name, c in configs.items():
        groups.setdefault(c["comparison"], []).append(name)
    for i in range(warmup + steps):
        if i == warmup:
            _check_slowed(handles, rank)
        for comparison, names in groups.items():
            # A new order every step (the same on every rank): no peer always runs first.
            order = list(names)
            random.Random(f"{comparison}/{i}").shuffle(order)
            for name in order:
                dist.barrier()
                t0 = time.perf_counter()
                runs[name]()
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if i >= warmup:
                    times[name].append(float(t))
    return {"times": times, "first_loss": first_loss, "build_s": build_s}


def _check_slowed(handles: dict[str, Any], rank: int) -> None:
    """Every block a slowed rank holds ran under its hooks (else the emulation missed it)."""
    for name, handle in handles.items():
        if handle is None or handle.speed >= 1.0:
            continue
        missed = [i for i, s in enumerate(handle.forward_seconds) if s <= 0.0]
        if missed:
            raise RuntimeError(f"{name}, rank {rank}: blocks {missed} were never timed")


# -- the plans ------------------------------------------------------------------------------------


def unit_seconds(rows: int = BATCH // MICROBATCHES, repeats: int = 5) -> list[float]:
    """The chain the stages are cut by: forward + backward seconds on a micro-batch, one thread,
    of the embedding (with the mask and the rotary cos/sin), of each decoder layer, and of the
    norm + head + loss. The decoder layers are alike: each is costed at the best time of any
    of them (the best of ``repeats`` passes), which a shared machine's noise cannot tilt."""
    torch.set_num_threads(1)
    model = _model()
    n = int(model.config.num_hidden_layers)
    x, y = _batch()
    inputs = (x["input_ids"][:rows], x["attention_mask"][:rows])
    embed = TorchStage(model, 0, 0, True, False)
    layers = [TorchStage(model, k, k + 1, False, False) for k in range(n)]
    head = TorchStage(model, n, n, False, True)
    best = {"embed": float("inf"), "layer": float("inf"), "head": float("inf")}

    def timed(key: str, stage: TorchStage, args: Any, backward: Callable[[Any], None]) -> Any:
        t0 = time.perf_counter()
        out = stage(*args)
        backward(out)
        best[key] = min(best[key], time.perf_counter() - t0)
        return out

    def grad(out: Any) -> None:
        out[0].backward(torch.ones_like(out[0]))

    def loss(out: Any) -> None:
        train_lm.lm_loss(_Logits(out), y[:rows]).backward()

    for _ in range(repeats):
        h = timed("embed", embed, inputs, grad)
        for stage in layers:
            h = timed("layer", stage, (h[0].detach().requires_grad_(), *h[1:]), grad)
        timed("head", head, (h[0].detach().requires_grad_(), *h[1:]), loss)
    return [best["embed"], *[best["layer"]] * n, best["head"]]


class _Logits:
    """What ``lm_loss`` reads of a model's output."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


def speed_pipeline(costs: Sequence[float], ranks: Sequence[int]) -> dict[str, Any]:
    """The pipeline of one stage per rank of ``ranks`` (at their :data:`SPEEDS`, in this order)
    with the smallest bottleneck, cut between decoder layers (:func:`hetcoll.partition_chain`
    over the chain of :func:`unit_seconds`): ``{"ranks": [...], "layers": [decoder layers per
    stage]}``, ranks given nothing left out."""
    counts = hetcoll.partition_chain(list(costs), [SPEEDS[r] for r in ranks])
    used = [(r, int(c)) for r, c in zip(ranks, counts) if c > 0]
    layers = [c for _, c in used]
    layers[0] -= 1  # the embedding
    layers[-1] -= 1  # norm + head
    return {"ranks": [r for r, _ in used], "layers": layers}


def pipeline_seconds(costs: Sequence[float], pipe: dict[str, Any], m: int = MICROBATCHES) -> float:
    """A pipeline's step in the chain's model: its bottleneck stage's ``m`` micro-batches, and
    the bubble: ``bottleneck * (m + S - 1)``."""
    at, bottleneck = 0, 0.0
    stages = len(pipe["ranks"])
    for s, (r, n) in enumerate(zip(pipe["ranks"], pipe["layers"])):
        units = n + (s == 0) + (s == stages - 1)
        bottleneck = max(bottleneck, sum(costs[at : at + units]) / SPEEDS[r])
        at += units
    return bottleneck * (m + stages - 1)


def heterogeneous_plans(costs: Sequence[float]) -> dict[str, dict[str, Any]]:
    """hetcoll's own candidates at :data:`SPEEDS`, beyond the pipelines torch runs too."""
    n_blocks = block_range([len(costs) - 2], 0)[1]  # the whole model
    second = speed_pipeline(costs, (1, 2))
    # Throughputs of the whole model on rank 0 and of the pipeline of ranks 1 and 2, with its
    # bubble, per micro-batch-worth of rows.
    rate = [SPEEDS[0] * MICROBATCHES / sum(costs), MICROBATCHES / pipeline_seconds(costs, second)]
    samples = hetcoll.split(BATCH, rate, minimum=MICROBATCHES)
    data = hetcoll.split(BATCH, list(SPEEDS), minimum=1)
    stages = pipeline_plan(second, "1F1B")["replicas"][0]["stages"]
    return {
        "asymmetric replicas": {
            "microbatches": MICROBATCHES,
            "schedule": "1F1B",
            "replicas": [
                {"samples": samples[0], "stages": [{"ranks": [0], "layers": [0, n_blocks]}]},
                {"samples": samples[1], "stages": stages},
            ],
        },
        "data parallel by speed": {
            "microbatches": 1,
            "schedule": "1F1B",
            "replicas": [
                {"samples": data[r], "stages": [{"ranks": [r], "layers": [0, n_blocks]}]}
                for r in range(len(SPEEDS))
            ],
        },
    }


def planner_plan() -> tuple[dict[str, Any] | None, str]:
    """The planner's best runnable plan for the emulated cluster (each rank this machine's
    device, measured now, slowed to its speed; the gloo link measured now), and its strategy."""
    import hetcoll.model as model
    from hetcoll.lab import calibrate
    from hetcoll.lab.emulate import emulated_device
    from hetcoll.lab.validate import validation_cluster

    device = calibrate.measure_device("rank", 4e9, quick=True)
    fit = calibrate.measure_gloo_link()
    link = fit.link("gloo-local")
    cluster = validation_cluster([emulated_device(device, f) for f in SPEEDS], link)
    net = _model()
    seq = train_lm.SEQ
    costs = model.layer_costs(
        net,
        {"input_ids": (seq,), "attention_mask": (seq,)},
        dtype=torch.int64,
        loss=train_lm.costed_loss,
    )
    for p in model.plan(costs, cluster, BATCH, model=net):
        if p.feasible and p.has_plan:
            return p.to_plan().to_dict(), p.strategy
    return None, "no runnable plan"


def torch_pipelines(costs: Sequence[float]) -> dict[str, dict[str, Any]]:
    """torch's candidates at :data:`SPEEDS`: the even cut, and the cuts by speed over the
    three ranks and over the two fastest (a pipeline of more than one stage each)."""
    out = {"even cut": {"ranks": [0, 1, 2], "layers": list(EVEN)}}
    for ranks in ((0, 1, 2), (0, 1)):
        pipe = speed_pipeline(costs, ranks)
        if len(pipe["ranks"]) > 1 and pipe not in out.values():
            out[f"cut by speed, ranks {','.join(map(str, pipe['ranks']))}"] = pipe
    return out


def configs(costs: Sequence[float], planner: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Every configuration the ranks run, by name, each in one comparison."""
    out: dict[str, dict[str, Any]] = {}
    even = {"ranks": [0, 1, 2], "layers": list(EVEN)}
    for schedule, torch_schedule in (("1F1B", "Schedule1F1B"), ("GPipe", "ScheduleGPipe")):
        common: dict[str, Any] = {
            "comparison": "same pipeline",
            "speeds": [1.0] * len(SPEEDS),
            "pipeline": even,
        }
        out[f"hetcoll {schedule}"] = common | {
            "runner": "hetcoll",
            "plan": pipeline_plan(even, schedule),
        }
        out[f"torch {schedule}"] = common | {"runner": "torch", "schedule": torch_schedule}
    het: dict[str, Any] = {"comparison": "heterogeneous", "speeds": list(SPEEDS)}
    for label, pipe in torch_pipelines(costs).items():
        common = het | {"pipeline": pipe, "predicted_units_s": pipeline_seconds(costs, pipe)}
        out[f"torch pipeline, {label}"] = common | {"runner": "torch", "schedule": "Schedule1F1B"}
        if label != "even cut":
            out[f"hetcoll pipeline, {label}"] = common | {
                "runner": "hetcoll",
                "plan": pipeline_plan(pipe, "1F1B"),
            }
    for name, plan in heterogeneous_plans(costs).items():
        out[f"hetcoll {name}"] = het | {"runner": "hetcoll", "plan": plan}
    if planner is not None:
        same = [n for n, c in out.items() if "plan" in c and _same_plan(c["plan"], planner)]
        if same:  # the planner chose one of the candidates above: not run twice
            for n in same:
                out[n]["planner_chose"] = True
        else:
            out["hetcoll planner's plan"] = het | {
                "runner": "hetcoll",
                "plan": planner,
                "planner_chose": True,
            }
    return out


def _same_plan(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two plans run the same way on this model (a one-stage replica's schedule does
    not matter; micro-batches do)."""
    one_stage = all(len(r["stages"]) == 1 for r in a["replicas"])

    def key(p: dict[str, Any]) -> Any:
        replicas = [
            (r["samples"], [(s["ranks"], s["layers"]) for s in r["stages"]]) for r in p["replicas"]
        ]
        return p["microbatches"], replicas, None if one_stage else p["schedule"]

    return bool(key(a) == key(b))


# -- the caller -----------------------------------------------------------------------------------


def _quartiles(xs: Sequence[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _figures(launches: list[dict[str, list[float]]], name: str) -> dict[str, Any]:
    medians = [statistics.median(t[name]) for t in launches]
    return {
        "measured_s": statistics.median(medians),
        "measured_s_per_launch": medians,
        "quartiles_s_per_launch": [list(_quartiles(t[name])) for t in launches],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=3, help="launches of the three ranks")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration")
    ap.add_argument("--quick", action="store_true", help="a dry run: 1 launch, 2 steps")
    ap.add_argument("--no-planner", action="store_true", help="leave the planner's plan out")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.launches, args.steps, args.warmup = 1, 2, 1
    for flag in ("launches", "steps", "warmup"):
        if getattr(args, flag) < (0 if flag == "warmup" else 1):
            ap.error(f"--{flag}: too small ({getattr(args, flag)})")
    t_start = time.perf_counter()
    costs = unit_seconds()
    planner, strategy = (None, "left out") if args.no_planner else planner_plan()
    runs = configs(costs, planner)
    setup_s = time.perf_counter() - t_start
    launches: list[dict[str, list[float]]] = []
    losses: list[dict[str, float]] = []
    build_s = []
    for _ in range(args.launches):
        ranks = launch.spawn(_rank, len(SPEEDS), runs, args.steps, args.warmup, timeout=1800)
        launches.append(ranks[0]["times"])
        build_s.append(max(r["build_s"] for r in ranks))
        # A torch pipeline's loss is on its last stage's rank; hetcoll's on every rank.
        losses.append({k: v for r in ranks for k, v in r["first_loss"].items()})
    rows = {name: c | _figures(launches, name) for name, c in runs.items()}

    same = []
    for schedule in ("1F1B", "GPipe"):
        h, t = rows[f"hetcoll {schedule}"], rows[f"torch {schedule}"]
        ratios = [ts / hs for ts, hs in zip(t["measured_s_per_launch"], h["measured_s_per_launch"])]
        same.append(
            {
                "schedule": schedule,
                "layers": list(EVEN),
                "plan": h["plan"],
                "hetcoll_s": h["measured_s"],
                "torch_s": t["measured_s"],
                "hetcoll_s_per_launch": h["measured_s_per_launch"],
                "torch_s_per_launch": t["measured_s_per_launch"],
                "hetcoll_quartiles_s_per_launch": h["quartiles_s_per_launch"],
                "torch_quartiles_s_per_launch": t["quartiles_s_per_launch"],
                "throughput_vs_torch": statistics.median(ratios),
                "throughput_vs_torch_per_launch": ratios,
                "first_loss": {
                    "hetcoll": losses[0].get(f"hetcoll {schedule}"),
                    "torch": losses[0].get(f"torch {schedule}"),
                },
            }
        )
    het = {n: r for n, r in rows.items() if r["comparison"] == "heterogeneous"}
    best = {
        runner: min(
            (n for n, r in het.items() if r["runner"] == runner), key=lambda n: het[n]["measured_s"]
        )
        for runner in ("hetcoll", "torch")
    }
    vs = [
        ts / hs
        for ts, hs in zip(
            het[best["torch"]]["measured_s_per_launch"],
            het[best["hetcoll"]]["measured_s_per_launch"],
        )
    ]
    candidates = []
    for name, r in het.items():
        candidates.append(
            {
                "name": name,
                "runner": r["runner"],
                "pipeline": r.get("pipeline"),
                # torch's stages written as the hetcoll.Plan of the same stages.
                "plan": r.get("plan") or pipeline_plan(r["pipeline"], "1F1B"),
                "predicted_units_s": r.get("predicted_units_s"),
                "planner_chose": r.get("planner_chose", False),
                "measured_s": r["measured_s"],
                "measured_s_per_launch": r["measured_s_per_launch"],
                "quartiles_s_per_launch": r["quartiles_s_per_launch"],
                "first_loss": losses[0].get(name),
            }
        )
    out = {
        "speeds": list(SPEEDS),
        "batch": BATCH,
        "microbatches": MICROBATCHES,
        "seq": train_lm.SEQ,
        "decoder_layers": _layer_count(),
        "unit_seconds": costs,
        "launches": args.launches,
        "steps": args.steps,
        "warmup": args.warmup,
        "quick": args.quick,
        "same_pipeline": same,
        "heterogeneous": {
            "candidates": candidates,
            "best_hetcoll": best["hetcoll"],
            "best_torch": best["torch"],
            "vs_best_torch": statistics.median(vs),
            "vs_best_torch_per_launch": vs,
            "planner_strategy": strategy,
        },
        "step_s": launches,
        "setup_s": setup_s,
        "build_s_per_launch": build_s,
        "wall_s": time.perf_counter() - t_start,
    }
    print(
        f"{len(SPEEDS)} gloo ranks; batch {BATCH} x {train_lm.SEQ} tokens in {MICROBATCHES} "
        f"micro-batches; {args.launches} launch(es) x {args.steps} steps"
    )
    print("Same pipeline (equal speeds, layers per stage " + ":".join(map(str, EVEN)) + ")")
    for s in same:
        print(
            f"  {s['schedule']:<6} hetcoll {s['hetcoll_s'] * 1e3:7.1f} ms  torch "
            f"{s['torch_s'] * 1e3:7.1f} ms  hetcoll's throughput / torch's "
            f"{s['throughput_vs_torch']:.2f}x  (first loss {s['first_loss']['hetcoll']:.6f} / "
            f"{s['first_loss']['torch']:.6f})"
        )
    print(f"Heterogeneous (emulated speeds {' : '.join(f'{f:g}' for f in SPEEDS)})")
    for c in candidates:
        launches_ms = ", ".join(f"{m * 1e3:.1f}" for m in c["measured_s_per_launch"])
        print(f"  {c['name']:<36} {c['measured_s'] * 1e3:7.1f} ms  ({launches_ms})")
    print(
        f"  best torch ({best['torch']}) / best hetcoll ({best['hetcoll']}): "
        f"{out['heterogeneous']['vs_best_torch']:.2f}x; planner: {strategy}; "
        f"{out['wall_s']:.0f} s in all (costs and planner {setup_s:.0f} s, building the "
        f"configurations {sum(build_s):.0f} s)"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
