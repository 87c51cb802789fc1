"""Plans run for real: tests/plan_cases.py inside every rank of a 4-process gloo job and of a
4-process MPI job (every plan shape equal to one process in float64; bad input raises on every
rank); the Plan's own validation and JSON round trip in-process."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import plan_cases
import pytest
import torch
import torchvision
from torch import nn

from hetcoll import Plan, launch
from hetcoll.plan import Replica, Stage
from hetcoll.torch.layers import model_cut, model_layers
from hetcoll.torch.parallel import schedule_order
from hetcoll.torch.replay import probe_first_that_runs

HERE = Path(__file__).resolve().parent
EXPECTED = {
    "pipeline_4": True,
    # Rank 0 evaluating while the others train.
    "evaluating_alone": "ranks disagree on gradients",
    "asymmetric": True,
    "shares": True,
    "grouped": True,
    "resnet18": True,
    "densenet": True,
    "owners_after_split": True,
    "tied": True,
    "unused": True,
    "frozen": True,
    "unhit": True,
    "routed": True,
    "casts": True,
    "swin": True,
    "data_parallel": True,
    # Wrong rows; rows that differ; a rank evaluating alone; a rank's loss raising; a rank's
    # backward raising; scales that differ.
    "data_parallel_errors": [6, 6],  # the small model's, the large one's
    # A training step's loss and flags beside its bfloat16 / float16 gradients, bit for bit.
    "data_parallel_low_precision": {"torch.bfloat16": True, "torch.float16": True},
    "errors": 6,
}
#: A scaler that cannot run, on every rank: a GradScaler, a float, scales that differ between
#: ranks; on MPI a ShardedGradScaler (no torch.distributed) and GroupGradScalers over halves
#: of the ranks; on gloo a ShardedGradScaler over 3 of the 4 ranks, and a GroupGradScaler on
#: one rank beside ShardedGradScalers.
SCALER_MISTAKES = {"mpi": 5, "gloo": 5}
#: loss_scaled's scale after each of its 4 steps, on every rank (GroupGradScaler on both
#: engines, ShardedGradScaler on gloo): 2**10, grown every 2 steps without an overflow,
#: halved by step 1's (found by rank 3 alone).
SCALES = [1024.0, 512.0, 512.0, 1024.0]


def _check(results: list[dict], engine: str) -> None:
    for rank, r in enumerate(results):
        idle = r.pop("idle")
        assert r.pop("scaler_mistakes") == SCALER_MISTAKES[engine], (rank, r)
        assert r.pop("loss_scaled") == SCALES, (rank, r)
        assert r.pop("loss_scaled_data_parallel") == SCALES, (rank, r)
        if engine == "gloo":  # a ShardedGradScaler needs torch.distributed
            assert r.pop("loss_scaled_sharded") == SCALES, (rank, r)
            # A data-parallel step of a small model (0.2 MB of gradients) is one collective:
            # its batch's check, loss and flags in its gradients' sum (zeros, evaluating). A
            # large model's (1.3 MB) training step checks its batch beside its forwards, and
            # sums in two buckets: the last layers' during the last backward (before the first
            # layer's gradient), the rest with its fields after; evaluating, the check with its
            # loss after the forwards.
            grad = "first layer's gradient"
            assert r.pop("data_parallel_collectives") == {
                "small": {
                    "train": ["forward", "forward", grad, grad, "all_reduce"],
                    "eval": ["forward", "forward", "all_reduce"],
                },
                "large": {
                    "train": [
                        *("all_gather_into_tensor", "forward", "forward", grad),
                        *("all_reduce", grad, "all_reduce"),
                    ],
                    "eval": ["forward", "forward", "all_gather_into_tensor"],
                },
            }
        assert r == EXPECTED, (rank, r)
        if rank == 1:  # the idle rank sent nothing
            assert idle == dict.fromkeys(("activations", "gradients", "outputs", "allreduce"), 0)


@pytest.mark.multiproc
def test_a_rank_alone_trains_as_one_process_and_agrees_with_no_one() -> None:
    """A plan on one rank computes the one process's numbers and refuses a wrong batch, and
    its steps exchange nothing: no batch agreement (Parallel.step's check has no one to agree
    with), no sum of the step's loss over the group (a sum over one rank is its own). A step
    reads its loss back once, at its end, however many micro-batches it runs: a CUDA rank's
    host then queues its backward while the forward runs."""
    (sent,) = launch.spawn(plan_cases.alone, 1, timeout=120)
    assert sent == {"iallgatherv": 0, "all_reduce": 0, "reads": 1}


@pytest.mark.multiproc
def test_gloo_plans_equal_one_process():
    _check(launch.spawn(plan_cases.run_torch, 4, timeout=300), "gloo")


@pytest.mark.multiproc
def test_mpi_plans_equal_one_process():
    proc = launch.mpiexec(4, [str(HERE / "mpi_workers" / "cases.py"), "plan_cases"], timeout=300)
    _check(json.loads(proc.stdout.strip().splitlines()[-1]), "mpi")


def test_plan_round_trips_through_json(tmp_path):
    plan = Plan.from_dict(plan_cases.ASYMMETRIC)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert Plan.from_dict(json.loads(path.read_text())).to_dict() == plan.to_dict()
    assert plan.batch == 16 and plan.ranks == (0, 1, 2, 3) and plan.num_layers == 11
    assert plan.place(3) == (1, 1) and plan.place(7) is None
    assert Plan.from_dict(plan_cases.PIPELINE_4).microbatch_sizes(0) == [4, 4, 3, 3]
    assert Plan.from_dict(dict(plan_cases.IDLE, microbatches=9)).microbatch_sizes(0) == [1] * 5


def test_plan_files_are_paths_and_bad_files_name_the_path(tmp_path):
    """An int is no path (open() took it for a file descriptor, wrote there and closed the
    caller's descriptor); a file that is not UTF-8 JSON Python reads raises naming it."""
    plan = Plan.from_dict(plan_cases.PIPELINE_4)
    r, w = os.pipe()
    try:
        for bad in (w, None, str(tmp_path / "p.json").encode()):
            with pytest.raises(TypeError, match=r"path: must be a str or os\.PathLike"):
                plan.save(bad)
        with pytest.raises(TypeError, match=r"path: must be a str or os\.PathLike, got int"):
            Plan.load(r)
        os.fstat(r), os.fstat(w)  # both still open
    finally:
        os.close(r)
        os.close(w)
    path = tmp_path / "p.json"
    plan.save(str(path))
    assert Plan.load(str(path)) == plan
    for content, text in (
        (b'{"replicas": "\xff\xfe"}', "is not UTF-8 text"),
        (b'{"microbatches": ' + b"9" * 5000 + b"}", "is not JSON a plan can hold"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"a": ', "is not JSON"),
    ):
        path.write_bytes(content)
        with pytest.raises(ValueError, match=re.escape(f"path: '{path}' ") + ".*" + text):
            Plan.load(path)


def test_plan_methods_and_constructor_name_bad_arguments():
    plan = Plan.from_dict(plan_cases.PIPELINE_4)
    assert len(plan.replicas) == 1 and plan.microbatch_sizes(0) == [4, 4, 3, 3]
    for bad in (-1, 1, 5):
        with pytest.raises(ValueError, match=r"replica: must be an integer in \[0, 1\), got"):
            plan.microbatch_sizes(bad)
    for bad in (True, "a", 0.0, None):
        with pytest.raises(ValueError, match="replica: must be an integer >= 0"):
            plan.microbatch_sizes(bad)
    # A rank beyond the plan's is idle (None), as documented; a negative or non-int one is
    # no rank.
    assert plan.place(0) == (0, 0) and plan.place(99) is None
    for bad in (-1, "a", True, None, 1.0):
        with pytest.raises(ValueError, match="rank: must be an integer >= 0"):
            plan.place(bad)
    assert Plan(list(plan.replicas), plan.microbatches, plan.schedule) == plan
    d = plan_cases.PIPELINE_4
    for replicas, text in (
        (None, "replicas: must be a list of Replica, got NoneType"),
        (d, r"replicas: must be a list of Replica, got dict \(.*Plan.from_dict"),
        (d["replicas"], r"replicas\[0\]: must be a Replica, got dict \(.*Plan.from_dict"),
        (
            [Replica(8, list(d["replicas"][0]["stages"]))],
            r"replicas\[0\].stages\[0\]: must be a Stage, got dict",
        ),
        ([Replica(8, None)], r"replicas\[0\].stages: must be a list of Stage"),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError, match=text):
            Plan(replicas=replicas)


def test_stages_built_in_code_name_their_bad_fields():
    """A Stage or Replica made in code is checked as its dict form is (its fields of another
    type raised AttributeError and TypeError inside to_dict, or were dropped silently)."""
    whole = Stage((0, 1), (0, 3))
    bad: Any = [1, 2]  # what the type hints refuse
    for stage, text in (
        (Stage((0, 1), (0, 3), shares=bad), r"stages\[0\].shares: must be a non-empty dict"),
        (Stage((0, 1), (0, 3), owners=5), r"stages\[0\].owners: must be a non-empty dict"),  # type: ignore[arg-type]
        (Stage((0,), bad[0]), r"stages\[0\].layers: must be a list, got int"),
        (Stage("ab", (0, 3)), r"stages\[0\].ranks: must be a list, got str"),  # type: ignore[arg-type]
        (Stage((0, 1), (0, 3), speeds=(1.0, 2**2000)), r"stages\[0\].speeds\[1\]: must be"),  # type: ignore[arg-type]
        (
            Stage((0, 1), (0, 3), shares={0: (1, 2)}, named_shares={"a": (1, 1)}),
            r"^replicas\[0\].stages\[0\]: give shares \(by layer index\) or named_shares",
        ),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=text):
            Plan((Replica(4, (stage,)),))
    with pytest.raises(ValueError, match=r"plan.replicas\[0\].samples: must be an integer >= 1"):
        Plan((Replica(-3, (whole,)),))
    with pytest.raises(ValueError, match=r"^plan.experts: must be a list, got int"):
        Plan((Replica(4, (Stage((0,), (0, 3)),)),), experts=5)  # type: ignore[arg-type]
    split = Plan((Replica(4, (Stage((0, 1), (0, 3), shares={0: (1, 2)}),)),))
    assert split.to_dict()["replicas"][0]["stages"][0]["shares"] == {"0": [1, 2]}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 2}, "plan.version"),
        ({"schedule": "zigzag"}, "plan.schedule"),
        ({"microbatches": 0}, "plan.microbatches"),
        ({"replicas": []}, "plan.replicas"),
        (
            {"replicas": [{"samples": 0, "stages": [{"ranks": [0], "layers": [0, 1]}]}]},
            r"plan.replicas\[0\].samples",
        ),
        (
            {"replicas": [{"samples": 2, "stages": [{"ranks": [0], "layers": [1, 3]}]}]},
            r"stages\[0\].layers: must start at layer 0",
        ),
        (
            {
                "replicas": [
                    {
                        "samples": 2,
                        "stages": [
                            {"ranks": [0], "layers": [0, 2]},
                            {"ranks": [1], "layers": [3, 4]},
                        ],
                    }
                ]
            },
            r"stages\[1\].layers: must start where stage 0 ends",
        ),
        (
            {
                "replicas": [
                    {"samples": 2, "stages": [{"ranks": [0], "layers": [0, 2]}]},
                    {"samples": 2, "stages": [{"ranks": [0], "layers": [0, 2]}]},
                ]
            },
            "rank 0 is already in",
        ),
        (
            {
                "replicas": [
                    {"samples": 2, "stages": [{"ranks": [0], "layers": [0, 2]}]},
                    {"samples": 2, "stages": [{"ranks": [1], "layers": [0, 3]}]},
                ]
            },
            r"plan.replicas\[1\].stages: cover 3 layers",
        ),
        (
            {
                "replicas": [
                    {"samples": 2, "stages": [{"ranks": [0, 1], "layers": [0, 2], "speeds": [1.0]}]}
                ]
            },
            "one speed per rank",
        ),
        (
            {
                "replicas": [
                    {
                        "samples": 2,
                        "stages": [{"ranks": [0, 1], "layers": [0, 2], "speeds": [1.0, -1]}],
                    }
                ]
            },
            r"speeds\[1\]",
        ),
        (
            {
                "replicas": [
                    {
                        "samples": 2,
                        "stages": [
                            {
                                "ranks": [0, 1],
                                "layers": [0, 2],
                                "shares": {"0": [1, 1], "x": [1, 1]},
                            }
                        ],
                    }
                ]
            },
            "names layers by index and by module path",
        ),
        (
            {
                "replicas": [
                    {
                        "samples": 2,
                        "stages": [{"ranks": [0, 1], "layers": [0, 2], "shares": {" x": [1, 1]}}],
                    }
                ]
            },
            "the key must be a layer index or a module path",
        ),
        (
            {
                "replicas": [
                    {
                        "samples": 2,
                        "stages": [{"ranks": [0, 1], "layers": [0, 2], "shares": {"9": [1, 1]}}],
                    }
                ]
            },
            "layer index in",
        ),
        (
            {
                "replicas": [
                    {
                        "samples": 2,
                        "stages": [{"ranks": [0], "layers": [0, 2], "owners": {"0": [0]}}],
                    }
                ]
            },
            "takes no owners",
        ),
        (
            {"replicas": [{"samples": 2, "stages": [{"ranks": [-1], "layers": [0, 2]}]}]},
            r"ranks\[0\]",
        ),
        (
            {
                "replicas": [
                    {
                        "samples": 2,
                        "stages": [
                            {
                                "ranks": [0, 1],
                                "layers": [0, 2],
                                "shares": {"0": [1, 2], " 0": [2, 1]},
                            }
                        ],
                    }
                ]
            },
            r"shares\[' 0'\]: names layer 0 twice",
        ),
    ],
)
def test_invalid_plans_name_the_field(change, message):
    d = dict(plan_cases.PIPELINE_4)
    d.update(change)
    with pytest.raises(ValueError, match=message):
        Plan.from_dict(d)


def test_schedules_run_every_micro_batch_once_in_dependency_order():
    for schedule in ("GPipe", "1F1B"):
        for stages in range(1, 5):
            for m in range(1, 7):
                for s in range(stages):
                    order = schedule_order(schedule, s, stages, m)
                    assert sorted(order) == sorted(
                        [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
                    )
                    for k in range(m):
                        assert order.index(("F", k)) < order.index(("B", k))
                    if schedule == "1F1B":  # at most (stages - s) micro-batches in flight
                        live = peak = 0
                        for op, _ in order:
                            live += 1 if op == "F" else -1
                            peak = max(peak, live)
                        assert peak <= max(1, stages - s)


class Twice(nn.Module):
    """One module called twice in a chain of calls."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.relu(self.layer(x)))


def test_a_weight_normed_module_is_one_block():
    # Its parametrizations (a ModuleDict of ParametrizationLists) were taken for repeated
    # blocks: WavLM's positional convolution became the blocks
    # 'encoder.pos_conv_embed.conv.parametrizations.weight.0', its padding and activation.
    from torch.nn.utils.parametrizations import weight_norm

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Sequential(weight_norm(nn.Conv1d(4, 4, 3, padding=1)), nn.GELU())
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.pos(x.transpose(1, 2)).transpose(1, 2)
            for layer in self.layers:
                x = layer(x)
            return x

    assert [n for n, _ in model_layers(Net())] == ["pos", "layers.0", "layers.1"]


def test_a_vision_model_s_blocks_are_in_call_order():
    # Hugging Face's example inputs are token ids, which a vision model does not take: its
    # blocks stayed in registration order, YOLOS's encoder.interpolation (called before the
    # layers, registered after) among them, and a plan could not cut between its layers.
    # An image of its configured size tells the order.
    import transformers

    config = transformers.YolosConfig(
        hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        image_size=[32, 32], patch_size=8, num_detection_tokens=3,
    )  # fmt: skip
    names = [n for n, _ in model_layers(transformers.YolosModel(config))]
    assert names[:4] == [
        "embeddings",
        "encoder.interpolation",
        "encoder.layer.0",
        "encoder.layer.1",
    ]


def test_model_layers_of_real_models():
    names = [n for n, _ in model_layers(torchvision.models.resnet18())]
    assert names == [
        "conv1",
        "bn1",
        "relu",
        "maxpool",
        "layer1",
        "layer2",
        "layer3",
        "layer4",
        "avgpool",
        "flatten",
        "fc",
    ]
    model = torchvision.models.resnet18(num_classes=3).eval()
    x = torch.randn(2, 3, 32, 32)
    y = x
    for _, layer in model_layers(model):
        y = layer(y)
    assert torch.equal(y, model(x))
    assert [n for n, _ in model_layers(torchvision.models.mobilenet_v2())] == [
        "features",
        "adaptive_avg_pool2d",
        "flatten",
        "classifier",
    ]
    # Not chains: their blocks, repeated ones expanded (ViT's encoder layers, a top-level
    # residual's two halves).
    vit = [n for n, _ in model_layers(torchvision.models.vit_b_16())]
    assert vit[:3] == ["conv_proj", "encoder.dropout", "encoder.layers.encoder_layer_0"]
    assert vit[-3:] == ["encoder.layers.encoder_layer_11", "encoder.ln", "heads"]

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x)) + x

    assert model_cut(Residual()).kind == "blocks"
    # A chain of calls sharing a module or a weight is cut by its blocks (a chain's stages
    # copy their layers one by one, which would part them), where a block called twice
    # raises when the plan runs it; an nn.Sequential holding one module twice lists it twice.
    tied = plan_cases.Tied()
    assert model_cut(tied).kind == "blocks"
    assert [n for n, _ in model_layers(tied)] == ["fc1", "fc2", "head"]
    same = nn.Linear(4, 4)
    for twice in (nn.Sequential(same, nn.ReLU(), same), Twice(same)):
        cut = model_cut(twice)
        assert cut.kind == "blocks"
        with pytest.raises(ValueError, match="is called more than once per forward"):
            probe_first_that_runs(twice, cut.layers, [torch.zeros(2, 4)])
    assert [n for n, _ in model_layers(Residual())] == ["a", "b"]
    with pytest.raises(TypeError, match=r"model: must be a torch\.nn\.Module"):
        model_layers("resnet")


@pytest.mark.multiproc
def test_a_forward_reading_a_block_it_does_not_call_says_what_to_do():
    # Before: "RuntimeError: Tensor on device meta is not on the expected device cpu!" on
    # the stage not holding the module whose weight the forward reads (ProphetNet's decoder),
    # then an error on that rank alone (the other waited for its peer: DETR's query
    # embeddings). Every rank raises, at its first step's probe.
    with pytest.raises(launch.RankFailed) as failed:
        launch.spawn(plan_cases.reads_a_block, 2, False, timeout=120)
    for rank in (0, 1):
        assert (
            f"rank {rank}: ValueError: plan.replicas[0].stages[0]: the model's forward reads "
            "the parameters of block 'extra' itself" in str(failed.value)
        ), str(failed.value)
    assert "dummy_inputs" in str(failed.value)
    # With example inputs that module is no block: every stage holds its weight.
    losses = launch.spawn(plan_cases.reads_a_block, 2, True, timeout=120)
    assert losses[0] == losses[1]


def test_launchers_name_bad_arguments_before_starting_anything():
    def nothing(rank: int, world: int) -> None:
        return None

    odd: Any = None  # what the type hints refuse
    for timeout in (float("nan"), float("inf"), -1, 0, True, odd, "5"):
        with pytest.raises(ValueError, match=r"^timeout: must be a finite number of seconds > 0"):
            launch.spawn(nothing, 1, timeout=timeout)
        with pytest.raises(ValueError, match=r"^timeout: must be a finite number of seconds > 0"):
            launch.mpiexec(1, ["x.py"], timeout=timeout)
    with pytest.raises(ValueError, match=r"^world_size: must be an integer >= 1, got True"):
        launch.spawn(nothing, True)
    with pytest.raises(ValueError, match=r"^nprocs: must be an integer >= 1, got True"):
        launch.mpiexec(True, ["x.py"])
    with pytest.raises(TypeError, match=r"^argv: must be a list of str .*got 'x.py'"):
        launch.mpiexec(2, "x.py")  # once split into "x", ".", "p", "y"
    with pytest.raises(TypeError, match=r"^argv\[1\]: must be a str or a path, got int"):
        launch.mpiexec(2, ["x.py", 3])
    with pytest.raises(TypeError, match=r"^env: must be a dict of str to str"):
        launch.mpiexec(2, ["x.py"], env={"A": 1})


def test_experts_field_names_a_placement_that_is_none():
    from hetcoll.plan import experts_field

    assert experts_field({"a": [3, 1], "b": [[0, 1, 2], [3]]}) == [3, 1]
    with pytest.raises(TypeError, match=r"^placed: must be a dict from experts module path"):
        experts_field(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^placed\['a'\]\[0\]: must be an integer >= 0, got -1"):
        experts_field({"a": [-1, 3]})
    with pytest.raises(ValueError, match=r"^placed\['a'\]: must be a list, got int"):
        experts_field({"a": 5})  # type: ignore[dict-item]
