"""Transformers through plans: tests/transformer_cases.py inside every rank of a 4-process gloo
job (Hugging Face GPT-2, Llama, Mixtral, DeepSeek, Falcon, Mamba and Jamba, a user's
TransformerEncoder LM, each equal to one process averaging over valid tokens, and torchvision's
ViT; bad input raises on every rank) and of a 4-process MPI job (the cases making every kind
of exchange between ranks: ``transformer_cases.BACKEND``), and the blocks ``model_layers``
lists for them, in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformer_cases
from torch import nn

from hetcoll import launch
from hetcoll.torch.layers import model_cut, model_layers

HERE = Path(__file__).resolve().parent
MODELS = ("gpt2", "llama", "encoder")
EXPECTED = {
    **{f"{m}_{p}": True for m in MODELS for p in ("pipeline", "hybrid", "planned_split")},
    "gpt2_by_shares": True,
    "llama_by_shares": True,
    "gpt2_empty_blocks": True,
    "llama_empty_blocks": True,
    "llama_mqa_empty_blocks": True,
    "llama_gqa_three_ranks": True,
    "t5_pipeline": True,
    "t5_hybrid": True,
    "t5_empty_blocks": True,
    "t5_planned_split": True,
    "mixtral_pipeline": True,
    "mixtral_three_ranks": True,
    "mixtral_by_shares": True,
    "mixtral_planned_split": True,
    "mixtral_grouped_mm": True,
    "deepseek_pipeline": True,
    "deepseek_three_ranks": True,
    "falcon_hybrid": True,
    "mamba_pipeline": True,
    "jamba_hybrid": True,
    "deberta_pipeline": True,
    "albert_hybrid": True,
    "llava_after_projector": True,
    "llava_inside_language_model": True,
    "funnel_pipeline": True,
    "mbart_pipeline": True,
    "falcon_resumes": True,
    "gpt2_loss_parallel": True,
    "llama_loss_parallel": True,
    "vit_hybrid": True,
    "shared_activation": True,
    "rows_wrong": True,
    "resumes": True,
    "autocast": True,
    "checkpointed": True,
    "thawed": {"beside a block": True, "raised": True},
    # Compiled block by block after parallelize: graphs on every rank (each holds a block);
    # compiled before, named in a warning.
    "compiled_blocks": {
        "graphs": True,
        "warned": ["parallelize: 'model.layers.0' compiled in place (module.comp"],
    },
    "scaled": True,
    "lora": {"summed adapters alone": True, "thawed": True, "named where held": True},
    "errors": 13,
}


#: Each 4-rank job's limit: past it, launch says where each rank was.
JOB_S = 400
#: The jobs took 214 s (gloo) and 86 s (MPI) beside another test in CI: their own limit (and
#: launch's start-up slack) comes before pytest's.
job_timeout = pytest.mark.timeout(JOB_S + 80)


@pytest.mark.multiproc
@job_timeout
def test_gloo_transformer_plans_equal_one_process():
    for rank, r in enumerate(launch.spawn(transformer_cases.run_torch, 4, timeout=JOB_S)):
        assert r == EXPECTED, (rank, r)


@pytest.mark.multiproc
@job_timeout
def test_mpi_transformer_plans_equal_one_process():
    proc = launch.mpiexec(
        4,
        [str(HERE / "mpi_workers" / "cases.py"), "transformer_cases", "backend"],
        timeout=JOB_S,
    )
    expected = {name: EXPECTED[name] for name in transformer_cases.BACKEND}
    for rank, r in enumerate(json.loads(proc.stdout.strip().splitlines()[-1])):
        assert r == expected, (rank, r)


def test_blocks_of_hugging_face_and_torch_transformers():
    llama = [n for n, _ in model_layers(transformer_cases.llama())]
    assert llama == [
        "model.embed_tokens",
        "model.rotary_emb",  # called before the layers: the call order, not registration's
        *[f"model.layers.{k}" for k in range(4)],
        "model.norm",
        "lm_head",
    ]
    gpt2 = [n for n, _ in model_layers(transformer_cases.gpt2())]
    assert gpt2 == [
        "transformer.wte",
        "transformer.wpe",
        "transformer.drop",
        *[f"transformer.h.{k}" for k in range(4)],
        "transformer.ln_f",
        "lm_head",
    ]
    cut = model_cut(transformer_cases.EncoderLM())
    assert cut.kind == "blocks"
    assert [n for n, _ in cut.layers] == [
        "embed",
        *[f"encoder.layers.{k}" for k in range(4)],
        "head",
    ]
    # DeBERTa's relative position table, which its encoder reads itself, is no block.
    deberta = [n for n, _ in model_layers(transformer_cases.deberta())]
    assert deberta == [
        "deberta.embeddings",
        *[f"deberta.encoder.layer.{k}" for k in range(4)],
        "cls",
    ]
    # ALBERT's one layer group, called once per layer, cannot be a block: the encoder
    # around it is one.
    albert = [n for n, _ in model_layers(transformer_cases.albert())]
    assert albert == ["albert.embeddings", "albert.encoder", "predictions"]
    # Funnel's blocks, a ModuleList of ModuleLists its encoder iterates: their layers.
    funnel = [n for n, _ in model_layers(transformer_cases.funnel())]
    assert [n for n in funnel if ".blocks." in n] == [
        f"funnel.encoder.blocks.{b}.{k}" for b in range(2) for k in range(2)
    ]
    # A model of repeated blocks but nothing else stays whole where a Sequential is a chain.
    assert model_cut(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))).kind == "chain"


def test_empty_blocks_in_a_plan_round_trips_and_is_checked():
    from hetcoll.plan import Plan

    plan = Plan.from_dict(transformer_cases.hybrid(9, empty_blocks=True))
    assert plan.replicas[1].stages[0].empty_blocks
    assert Plan.from_dict(plan.to_dict()) == plan
    assert "empty_blocks" not in json.dumps(transformer_cases.hybrid(9))
    one = {"ranks": [0], "layers": [0, 3], "empty_blocks": True}
    bad = [
        ({"ranks": [0, 1], "layers": [0, 3], "empty_blocks": 1}, "must be true or false"),
        (one, "only a stage split over several ranks"),
    ]
    for stage, message in bad:
        with pytest.raises(ValueError, match=r"stages\[0\]\.empty_blocks: " + message):
            Plan.from_dict({"replicas": [{"samples": 4, "stages": [stage]}]})
    # loss_parallel: a split last stage only; it round-trips.
    split_loss = Plan.from_dict(transformer_cases.hybrid_loss_split(9))
    assert split_loss.replicas[1].stages[0].loss_parallel
    assert Plan.from_dict(split_loss.to_dict()) == split_loss
    first = {"ranks": [0, 1], "layers": [0, 3], "speeds": [1, 1], "loss_parallel": True}
    wrong = [
        ([{**first, "loss_parallel": 1}], r"stages\[0\]\.loss_parallel: must be true or false"),
        ([{"ranks": [0], "layers": [0, 3], "loss_parallel": True}], "only a stage split over"),
        ([first, {"ranks": [2], "layers": [3, 5]}], "only the last stage of a replica"),
    ]
    for stages, message in wrong:
        with pytest.raises(ValueError, match=message):
            Plan.from_dict({"replicas": [{"samples": 4, "stages": stages}]})
    # Shares by module path (a transformer's split stage): round trip, a rank holding none
    # only with empty_blocks, and one kind of key.
    by_path = transformer_cases.hybrid_by_shares(transformer_cases.gpt2, 9)
    plan = Plan.from_dict(by_path)
    split = plan.replicas[1].stages[0]
    assert split.named_shares and split.shares is None and split.speeds is None
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    stage = by_path["replicas"][1]["stages"][0]
    stage["empty_blocks"] = False
    with pytest.raises(ValueError, match=r"shares\['transformer\.h\.0\.attn\.c_attn'\]\[1\]"):
        Plan.from_dict(by_path)
    stage["empty_blocks"] = True
    stage["shares"]["3"] = [1, 1]
    with pytest.raises(ValueError, match="names layers by index and by module path"):
        Plan.from_dict(by_path)
