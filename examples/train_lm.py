"""Train a small language model under a plan, on text that needs no download: the Python
standard library's own source, read as bytes.

    python examples/train_lm.py                                         # one process
    torchrun --standalone --nproc-per-node 3 examples/train_lm.py --emulate 1,0.5,0.25
    mpiexec -n 3 python examples/train_lm.py --mpi --emulate 1,0.5,0.25
    hetcoll plan --model examples.train_lm:make_model --dtype int64 \\
        --input input_ids=64,attention_mask=64 --loss cross-entropy \\
        --cluster my_cluster.toml --batch 16 --out plan.json              # the planner's plan
    torchrun --standalone --nproc-per-node 3 examples/train_lm.py --plan plan.json

The model is Hugging Face's Llama (grouped-query attention, rotary embeddings) built from a
config, Mixtral (``--arch mixtral``: Llama's layout, each MLP a mixture of 8 experts, whose
plans may place whole experts on the replicas' ranks: the plan's ``experts``) or GPT-2
(``--arch gpt2``), byte-level (vocabulary 256). A plan (``hetcoll.Plan``,
JSON) says which ranks run which of its blocks (``hetcoll.torch.layers.model_layers``:
``model.embed_tokens, model.rotary_emb, model.layers.0 ..``) on how many samples of every global
batch; without ``--plan`` the ranks form one pipeline, its stages cut between decoder layers.
Every rank reads the same global batches — keyword inputs ``{"input_ids", "attention_mask"}``,
rows of different lengths padded at the end, labels -100 there — and ``par.step`` returns the
batch's mean loss over its valid tokens (``items``): the model learns what one process learns on
the same batches (to rounding in float64; Llama's rotary embedding computes in float32, so its
runs agree to about 1e-7 where rows are split).

``--emulate 1,0.5,0.25`` runs rank r at that fraction of its real speed (its blocks sleep in
proportion to their compute: emulated heterogeneity, for trying plans on one machine).
``--rebalance-experts N``, for a plan with ``experts``: every N steps an
``hetcoll.torch.ExpertRebalancer`` places them again by the tokens their routers sent them,
at the replicas' speeds as the plan's samples give them; the report then holds the plan as
last placed and every decision. ``--save-expert-loads loads.json`` writes the experts' measured
loads (tokens per expert, by experts module) for the planner to place them by:

    hetcoll plan --model examples.train_lm:make_mixtral ... --expert-loads loads.json --out p.json
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Its neighbour train_plan, run as a script or imported as examples.train_lm (`hetcoll plan
# --model examples.train_lm:make_model` from the repository's root).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_plan import Job

import hetcoll
from hetcoll import Plan
from hetcoll.plan import experts_field
from hetcoll.torch import parallelize
from hetcoll.torch.layers import model_layers

VOCAB = 256  # bytes
SEQ = 64
#: Attention as plain ops, the same numbers on any split of the rows (SDPA's fused kernels differ
#: by ~1e-8 between a batch and its parts).
EAGER: dict[str, Any] = {"attn_implementation": "eager"}
#: Standard-library modules whose source is the corpus (they ship with every CPython).
CORPUS = ("textwrap.py", "string.py", "argparse.py", "difflib.py", "functools.py", "typing.py")


def make_model(
    arch: str = "llama",
    *,
    hidden: int = 64,
    layers: int = 6,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 176,
    positions: int = SEQ,
    vocab: int = VOCAB,
    experts: int = 8,
    experts_implementation: str = "grouped_mm",
) -> nn.Module:
    """A small byte-level decoder built from a config (no download): ``layers`` decoder layers
    of width ``hidden`` with ``heads`` attention heads, for sequences of up to ``positions``
    tokens. Llama's attention shares its keys and values among ``kv_heads`` groups and its MLP is
    ``intermediate`` wide; Mixtral's is Llama's with each MLP a mixture of ``experts`` experts
    of that width, 2 per token, run by ``experts_implementation`` (Hugging Face's default,
    ``grouped_mm``, has no float64: ``batched_mm`` has); GPT-2's MLP is
    4 ``hidden`` wide (``kv_heads``, ``intermediate`` and ``experts`` are Llama's and
    Mixtral's only); ``vocab`` token ids (a benchmark's larger vocabulary; the example's text
    is bytes). The defaults are this example's model."""
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(
            GPT2Config(
                vocab_size=vocab,
                n_embd=hidden,
                n_layer=layers,
                n_head=heads,
                n_positions=positions,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                use_cache=False,
                bos_token_id=0,
                eos_token_id=0,
                **EAGER,
            )
        )
    if arch not in ("llama", "mixtral"):
        raise ValueError(f"arch: 'llama', 'mixtral' or 'gpt2', got {arch!r}")
    import transformers

    # Mixtral is Llama's layout with each MLP a mixture of experts.
    llama: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": positions,
        "use_cache": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        **EAGER,
    }
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama))
    mixture: dict[str, Any] = {
        "num_local_experts": experts,
        "num_experts_per_tok": 2,
        "experts_implementation": experts_implementation,
    }
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**llama, **mixture))


def make_mixtral() -> nn.Module:
    """The example's mixture of experts (``--arch mixtral``), for ``hetcoll plan --model
    train_lm:make_mixtral``: the planner proposes its experts placed on the ranks."""
    return make_model("mixtral")


def corpus() -> torch.Tensor:
    """The corpus as byte ids."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join((stdlib / name).read_bytes() for name in CORPUS)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(
    text: torch.Tensor, batch: int, steps: int, seed: int
) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """``steps`` global batches of ``batch`` rows: text at random places, each row of a random
    length (half to all of SEQ), padded with 0 at the end (masked, labels -100)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(text) - SEQ, (batch,), generator=g)
        ids = torch.stack([text[s : s + SEQ] for s in starts.tolist()])
        lengths = torch.randint(SEQ // 2, SEQ + 1, (batch,), generator=g)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        out.append(
            ({"input_ids": ids * mask, "attention_mask": mask}, ids.masked_fill(mask == 0, -100))
        )
    return out


def lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Next-byte cross entropy, the mean over the valid (not -100) labels."""
    logits = output.logits[:, :-1]
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def costed_loss(output: Any) -> torch.Tensor:
    """lm_loss as the performance model costs it (``layer_costs(model, ..., loss=costed_loss)``):
    on labels of zeros, one per token (the costs run on shapes, not on a batch)."""
    logits = output.logits
    return lm_loss(output, torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device))


def valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    """What lm_loss averages over: a batch's weight in the global mean. The count stays a
    tensor where the labels are (parallelize reads a GPU's counts of a step at once)."""
    return (labels[:, 1:] != -100).sum()


def default_plan(model: nn.Module, world: int, batch: int, microbatches: int) -> Plan:
    """One pipeline over every rank, its stages cut between blocks by their parameter counts
    (:func:`hetcoll.partition_chain`): what to run without a planner's plan."""
    layers = model_layers(model)
    costs = [float(sum(p.numel() for p in m.parameters())) + 1.0 for _, m in layers]
    counts = hetcoll.partition_chain(costs, [1.0] * world) if world > 1 else [len(layers)]
    stages, at = [], 0
    for rank, n in enumerate(counts):
        stages.append({"ranks": [rank], "layers": [at, at + n]})
        at += n
    return Plan.from_dict(
        {
            "microbatches": microbatches,
            "schedule": "1F1B",
            "replicas": [
                {"samples": batch, "stages": [s for s in stages if s["layers"][0] < s["layers"][1]]}
            ],
        }
    )


def train(args: argparse.Namespace) -> dict[str, Any]:
    job = Job(args.mpi)
    if args.emulate is not None and len(args.emulate) != job.world:
        raise SystemExit(f"--emulate: needs one value per rank ({job.world})")
    torch.set_num_threads(hetcoll.num_threads())  # the node's cores shared among its ranks
    dtype = torch.float64 if args.float64 else torch.float32
    torch.manual_seed(args.seed)
    # Mixtral's default experts kernel (grouped_mm) has no float64; batched_mm computes the same.
    kernel = "batched_mm" if args.float64 else "grouped_mm"
    net = make_model(args.arch, experts_implementation=kernel).to(job.device, dtype)
    plan = (
        Plan.load(args.plan)
        if args.plan
        else default_plan(net, job.world, args.batch, args.microbatches)
    )
    for flag, given in (
        ("--rebalance-experts", args.rebalance_experts is not None),
        ("--save-expert-loads", bool(args.save_expert_loads)),
    ):
        if given and plan.experts is None:
            raise SystemExit(
                f'{flag}: the plan places no experts (it has no "experts"): its experts are '
                "replicated, and only placed experts count their tokens; plan for a cluster "
                "where they do not fit every device, or write the plan's experts yourself"
            )
    # Collective: every rank passes the same plan (rank 0's weights are used).
    par = parallelize(net, plan, loss_fn=lm_loss, items=valid_tokens, group=job.group)
    if args.emulate and par.stage is not None:
        from hetcoll.lab.emulate import slow_down

        slow_down(par.stage, args.emulate[job.rank])
    opt = torch.optim.AdamW(par.parameters(), lr=args.lr, weight_decay=0.0)
    watch = None
    if args.rebalance_experts is not None:
        from hetcoll.torch import ExpertRebalancer

        speeds = [float(r.samples) for r in plan.replicas]  # what the planner split them by
        watch = ExpertRebalancer(par, opt, speeds=speeds, every=args.rebalance_experts)
    data = batches(corpus(), plan.batch, args.steps, args.seed)
    bar = progress(job, args.steps, args.quiet)
    losses, t0 = [], time.perf_counter()
    for x, y in data:
        x = {k: v.to(job.device) for k, v in x.items()}
        losses.append(par.step(x, y.to(job.device)))
        opt.step()
        opt.zero_grad()
        if watch is not None:
            watch.step()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    state = par.full_state_dict()  # collective
    if args.save_expert_loads:
        # Each experts layer's routed tokens per expert, for `hetcoll plan --expert-loads`:
        # the whole run's (collective), or the rebalancer's running estimate where it ran.
        loads = par.expert_loads() if watch is None or watch.loads is None else watch.loads
        if job.rank == 0:
            with open(args.save_expert_loads, "w", encoding="utf-8") as f:
                json.dump(loads, f, indent=1)
    if job.rank == 0 and not args.quiet:
        tokens = sum(int(valid_tokens(y)) for _, y in data)
        print(
            f"{len(data)} steps in {seconds:.2f} s ({tokens / seconds:.0f} tokens/s), "
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}",
            flush=True,
        )
    if job.rank == 0 and args.save:
        torch.save(state, args.save)
    report = {
        "rank": job.rank,
        "backend": job.backend,
        "world": job.world,
        "place": par.place,
        "plan": par.plan.to_dict(),  # as last placed
        "losses": losses,
        "seconds": seconds,
        "traffic": par.traffic(),
        "experts_moves": [
            # As the plan writes them: counts where runs in expert order, else each replica's.
            {"step": e.step, "experts": experts_field(e.new_placement), "moved": e.applied}
            for e in watch.history
        ]
        if watch is not None
        else [],
    }
    del par, opt  # before the group goes (Job.close)
    job.close()
    return report


def progress(job: Job, steps: int, quiet: bool) -> Any:
    if job.rank != 0 or quiet:
        return None
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(total=steps, desc="train", file=sys.stderr, leave=False)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--plan", help="a plan file (hetcoll plan ... --out); default: one pipeline")
    p.add_argument("--arch", default="llama", choices=("llama", "mixtral", "gpt2"))
    p.add_argument("--mpi", action="store_true", help="run on MPI (under mpiexec)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="global batch without --plan")
    p.add_argument("--microbatches", type=int, default=4, help="without --plan")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--float64", action="store_true", help="train in double precision")
    p.add_argument(
        "--emulate",
        type=lambda s: [float(v) for v in s.split(",")],
        help="run rank r at S_r times its real speed (0 < S_r <= 1): emulated heterogeneity",
    )
    p.add_argument(
        "--rebalance-experts",
        type=int,
        metavar="N",
        help="with a plan placing experts: place them again by their loads every N steps",
    )
    p.add_argument("--save", help="write the trained state dict here (rank 0)")
    p.add_argument(
        "--save-expert-loads",
        metavar="LOADS.json",
        help="with a plan placing experts: write each experts layer's routed tokens per expert "
        "here (rank 0), for hetcoll plan --expert-loads",
    )
    p.add_argument("--json", help="write each rank's report here ({rank} is replaced)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary line")
    args = p.parse_args(argv)
    if args.rebalance_experts is not None and args.rebalance_experts < 1:
        p.error(f"--rebalance-experts: must be >= 1, got {args.rebalance_experts}")
    if args.plan:
        try:
            Plan.load(args.plan)
        except (OSError, ValueError) as e:
            p.error(f"--plan: {e}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    report = train(args)
    if args.json:
        with open(args.json.format(rank=report["rank"]), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
