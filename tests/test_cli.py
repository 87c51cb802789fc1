"""The ``hetcoll`` command against bad input, as a user meets it in a real process: every bad
flag ends in one line on stderr, ``hetcoll CMD: error: ...`` naming the flag, and exit status 2,
never a traceback; ``--model module:attr`` calls only what it may; cluster files are bounded;
``hetcoll plan`` names devices, says how to run its plan and when to leave devices out."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from hetcoll.model import layer_costs, load_cluster, networks, plan, sweep
from hetcoll.model.hardware import MAX_DEVICES, MAX_FILE_BYTES

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = str(ROOT / "examples" / "clusters" / "a100_v100_cpu.toml")
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT)]),
    "OMP_NUM_THREADS": "1",
}


def hetcoll(*args: str, cwd: Path | str = ROOT) -> subprocess.CompletedProcess[str]:
    """``hetcoll ARGS`` in a new process, as its console script runs it: ``-P`` keeps the
    working directory off ``sys.path`` (``python -m`` would put it there)."""
    return subprocess.run(
        [sys.executable, "-P", "-m", "hetcoll.cli", *args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_usage_error(run: subprocess.CompletedProcess[str], command: str, *words: str) -> None:
    """Exit status 2, one line on stderr naming the command and ``words``, no traceback."""
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"hetcoll {command}: error: "), lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])


PLAN = ("plan", "--model", "cnn", "--input", "3x32x32", "--cluster", CLUSTER)

# Refused while the command line is parsed: no torch import, a fraction of a second each.
PARSE_ERRORS = [
    (("split", "0", "--speeds", "1,2"), "split", ("total", ">= 1")),
    (("split", str(2**64 - 1), "--speeds", "1,2"), "split", ("total", "at most")),
    (("split", "10", "--speeds", "1,2", "--multiple-of", "0"), "split", ("--multiple-of",)),
    (("split", "10", "--speeds", "1,x"), "split", ("--speeds", "numbers")),
    # Finish times past float's range: JSON has no Infinity (it printed one).
    (("split", "10", "--speeds", "5e-324,5e-324", "--json"), "split", ("speeds", "largest float")),
    ((*PLAN, "--batch", str(10**20)), "plan", ("--batch", "at most")),
    ((*PLAN, "--batch", "0"), "plan", ("--batch", ">= 1")),
    ((*PLAN, "--batch", "8", "--classes", "-1"), "plan", ("--classes", ">= 1")),
    ((*PLAN, "--batch", "8", "--top", "-1"), "plan", ("--top",)),
    (
        (*PLAN, "--batch", "8", "--plot", "/nonexistent/dir/s.png"),
        "plan",
        ("--plot", "/nonexistent"),
    ),
    ((*PLAN, "--batch", "8", "--out", "/nonexistent/p.json"), "plan", ("--out", "/nonexistent")),
    ((*PLAN, "--batch", "8", "--out", "/"), "plan", ("--out", "directory")),
    (("plan", "--input", "3x32x32"), "plan", ("required",)),
    (
        ("model", "costs", "--model", "cnn", "--input", "3x8x8", "--classes", "0"),
        "model costs",
        ("--classes",),
    ),
    (("model", "validate", "--steps", "0"), "model validate", ("--steps",)),
    (("model", "calibrate", "-o", "/nonexistent/c.toml"), "model calibrate", ("--output",)),
]


@pytest.mark.parametrize(("argv", "command", "words"), PARSE_ERRORS, ids=lambda x: str(x)[:40])
def test_bad_flags_are_one_line_and_status_2(
    argv: tuple[str, ...], command: str, words: tuple[str, ...]
) -> None:
    assert_usage_error(hetcoll(*argv), command, *words)


def test_split_prints_a_ratio_past_floats_range_in_words() -> None:
    # The even split's 5e299 s over this split's 1e-10 s: the ratio itself overflows.
    run = hetcoll("split", "10", "--speeds", "1e11,1e-299")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1].endswith("(more than 1.8e308x longer)"), run.stdout


def test_flags_are_refused_and_split_runs_without_importing_torch() -> None:
    """A mistyped flag is answered in a tenth of a second, not after torch's import (a second
    and more): every parse error above, ``hetcoll split`` and ``--help``, in one process."""
    argvs = [list(argv) for argv, _, _ in PARSE_ERRORS]
    argvs += [["split", "10", "--speeds", "1,2"], ["--help"], ["plan", "--help"]]
    code = (
        "import contextlib, io, sys\n"
        "from hetcoll.cli import main\n"
        f"for argv in {argvs!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()), "
        "contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit:\n"
        "            pass\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    run = subprocess.run(
        [sys.executable, "-P", "-c", code], env=ENV, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout[:500]


# Refused by the library once the command runs (torch imported: a few seconds each).
RUN_ERRORS = [
    (("demo", "--lr", "-1"), "demo", ("lr", "> 0")),
    (("demo", "--batch", str(10**12)), "demo", ("global_batch", "training samples")),
    (("demo", "--out", "/proc/no/such/dir"), "demo", ("out", "/proc/no/such/dir")),
    ((*PLAN[:3], "--input", f"3x{2**40}x{2**40}", *PLAN[5:], "--batch", "8"), "plan", ("input",)),
    (
        ("model", "costs", "--model", "cnn", "--input", "x=3x8x8,x=3x8x8"),
        "model costs",
        ("--input", "keyword inputs", "each name once"),
    ),
    (
        ("plan", "--model", "os:system", *PLAN[3:], "--batch", "8"),
        "plan",
        ("os:system", "nn.Module"),
    ),
    (
        ("plan", "--model", "cnn", "--input", "3x32x32", "--cluster", "/dev/zero", "--batch", "8"),
        "plan",
        ("/dev/zero", "regular file"),
    ),
    # Read only if a regular file, and only so far: /dev/zero read whole would never end.
    ((*PLAN, "--batch", "8", "--expert-loads", "/dev/zero"), "plan", ("/dev/zero", "regular file")),
    ((*PLAN[:2], "hf:/dev/zero", *PLAN[3:], "--batch", "8"), "plan", ("hf:/dev/zero", "regular")),
    ((*PLAN[:2], "hf:/no/such", *PLAN[3:], "--batch", "8"), "plan", ("hf:/no/such", "config.json")),
]


@pytest.mark.parametrize(("argv", "command", "words"), RUN_ERRORS, ids=lambda x: str(x)[:40])
def test_bad_values_the_library_refuses_are_one_line_and_status_2(
    argv: tuple[str, ...], command: str, words: tuple[str, ...]
) -> None:
    assert_usage_error(hetcoll(*argv), command, *words)


def test_a_model_too_large_for_memory_is_planned_on_the_meta_device() -> None:
    # 3x100000x100000 images give the CNN's first dense layer 1.6e13 weights (64 TB): built for
    # real, the allocation failed with a traceback; on the meta device it is costed, and no
    # device can hold it.
    run = hetcoll(*PLAN[:3], "--input", "3x100000x100000", *PLAN[5:], "--batch", "8", "--json")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    out = json.loads(run.stdout)
    assert not out["plans"][0]["feasible"] and "GB" in out["plans"][0]["reason"]


def test_json_into_a_closed_pipe_ends_quietly() -> None:
    # The reader goes away after a few bytes (`hetcoll plan --json | head -c 10`); the plans of
    # a 1,024-device cluster are far more than a pipe's buffer.
    big = str(ROOT / "examples" / "clusters" / "a100_v100_1024.toml")
    cmd = [sys.executable, "-P", "-m", "hetcoll.cli", "plan", "--model", "cnn", "--input"]
    proc = subprocess.Popen(
        [*cmd, "3x32x32", "--cluster", big, "--batch", "4096", "--json"],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(10).startswith(b"{")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert err == "", err


# ------------------------------------------------------------------------- module:attr


@pytest.mark.parametrize(
    ("attr", "why"),
    [
        ("os:system", "builtin_function_or_method"),
        ("subprocess:Popen", "not an nn.Module"),
        ("tests.cli_models:NotAModel", "not an nn.Module"),
        ("tests.cli_models:untyped", "not annotated to return an nn.Module"),
        ("tests.cli_models:needs_width", "needs arguments"),
        ("tests.cli_models:CALLS", "list"),
    ],
)
def test_module_attr_calls_only_module_classes_and_annotated_builders(attr: str, why: str) -> None:
    from tests import cli_models

    with pytest.raises(ValueError, match=f"model: {attr!r}.*{why}"):
        networks.build(attr, (2, 4, 4))
    assert cli_models.CALLS == []  # nothing refused was called


@pytest.mark.parametrize(
    "attr",
    [
        "tests.cli_models:make_net",
        "tests.cli_models:make_sequential",
        "tests.cli_models:INSTANCE",
        "tests.cli_models:Recurrent",
        "torchvision.models:resnet18",
    ],
)
def test_module_attr_loads_module_classes_and_annotated_builders_on_meta(attr: str) -> None:
    model = networks.build(attr, (2, 4, 4), device="meta")
    assert isinstance(model, nn.Module)
    if attr != "tests.cli_models:INSTANCE":  # an instance was built when its module loaded
        assert all(p.is_meta for p in model.parameters())


# ------------------------------------------------------------------------- hf:CONFIG


def _llama_config(
    directory: Path,
    *,
    vocab: int = 64,
    hidden: int = 32,
    intermediate: int = 88,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    positions: int = 16,
) -> Path:
    """A Llama's config.json (written as the Hub holds one) in ``directory``; small unless
    the sizes say otherwise (the tests' Llama builder, on the meta device: no weights)."""
    from lm_common import hf_llama

    with torch.device("meta"):
        model = hf_llama(
            vocab=vocab,
            hidden=hidden,
            intermediate=intermediate,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            positions=positions,
        )
    model.config.save_pretrained(directory)
    return directory / "config.json"


def test_hugging_face_models_are_built_from_their_config(tmp_path: Path) -> None:
    """``hf:PATH`` (a config.json or its directory) builds transformers' class for its
    model_type, with the language-model head where there is one, on the meta device; no
    weights, no download."""
    from transformers import AutoModelForCausalLM, LlamaConfig, ViTConfig

    config = _llama_config(tmp_path / "llama")
    for spec in (f"hf:{config}", f"hf:{config.parent}"):
        model = networks.build(spec, (16,), device="meta")
        assert type(model).__name__ == "LlamaForCausalLM"
        assert all(p.is_meta for p in model.parameters())
    same = AutoModelForCausalLM.from_config(LlamaConfig.from_json_file(config))
    assert [(n, p.shape) for n, p in model.named_parameters()] == [
        (n, p.shape) for n, p in same.named_parameters()
    ]
    # A model type without a language-modelling head: its bare model.
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        tmp_path / "vit"
    )
    assert type(networks.build(f"hf:{tmp_path / 'vit'}", (3, 224, 224))).__name__ == "ViTModel"
    # The class its architectures names, as the Hub's configs name it.
    bert = tmp_path / "bert.json"
    bert.write_text(
        '{"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 32, '
        '"num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}'
    )
    assert type(networks.build(f"hf:{bert}", (16,), device="meta")).__name__ == "BertForMaskedLM"


def test_an_encoder_given_its_attention_mask_is_costed_on_the_meta_device(tmp_path: Path) -> None:
    """BERT reads its bidirectional mask's values (to skip a mask of no padding) in either
    attention implementation: counted without it, on the meta device, with a note (it was a
    real run of 1,009 samples on the CPU: minutes at BERT-base's size), the same costs as
    without the mask."""
    from hetcoll.model import layer_costs

    bert = tmp_path / "bert.json"
    bert.write_text(
        '{"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64, '
        '"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}'
    )
    model = networks.build(f"hf:{bert}", (16,), device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to the CPU
        masked = layer_costs(
            model, {"input_ids": (16,), "attention_mask": (16,)}, dtype=torch.int64
        )
        plain = layer_costs(model, {"input_ids": (16,)}, dtype=torch.int64)
    assert any("without the attention_mask" in n for n in masked.notes)
    assert [x.forward_flops(8) for x in masked.layers] == [x.forward_flops(8) for x in plain.layers]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"hidden_size": 32}', "model_type"),
        ("[1, 2]", "model_type"),
        ('{"model_type": "no-such-model"}', "no-such-model"),
        ("{not json", "not a JSON config"),
        ("[" * 100_000, "not a JSON config"),
        ('{"model_type": "llama", "num_attention_heads": "many"}', "num_attention_heads"),
        ('{"model_type": "llama", "architectures": ["MyRemoteLlama"]}', "MyRemoteLlama"),
        ('{"model_type": "llama", "architectures": ["AutoConfig"]}', "no model class"),
    ],
)
def test_hugging_face_configs_that_are_not_are_refused_by_name(
    tmp_path: Path, text: str, why: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"model: hf:{re.escape(str(path))}.*{re.escape(why)}"):
        networks.build(f"hf:{path}", (16,), device="meta")


#: A user's encoder LM of 2 heads whose blocks run in another order than registered: no plan
#: cuts it into blocks, so a rank of a split stage cannot hold no heads.
LATE_BLOCKS = """
import torch
from torch import nn


class Late(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(32, 64)
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(32, 2, 64, batch_first=True)])
        self.embed = nn.Embedding(64, 32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers[0](self.embed(input_ids)))
"""


def test_a_filter_split_the_devices_cannot_take_is_a_plan_ranked_infeasible(tmp_path: Path) -> None:
    """A model of 2 heads that no plan cuts into blocks, on 18 devices: its filter split over
    all 18 would give devices no head, which only a blocks stage can; the planner ranks that
    candidate infeasible, saying why, and plans the rest (it raised, ending the search). T5
    (encoder and decoder, cut into blocks) of 2 heads splits over all 18, the devices too slow
    for a head holding none (``empty_blocks``)."""
    (tmp_path / "late.py").write_text(LATE_BLOCKS)
    argv = ("plan", "--model", "late:Late", "--input", "16", "--dtype", "int64")
    run = hetcoll(
        *argv, "--cluster", CLUSTER, "--batch", "32", "--json", "--top", "100", cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    plans = json.loads(run.stdout)["plans"]
    assert plans[0]["feasible"]
    (refused,) = [p for p in plans if p["strategy"] == "filter parallel, balanced"]
    assert not refused["feasible"] and "2 units" in refused["reason"]
    assert "too few for 18 devices" in refused["reason"]
    # On 2 devices the heads split: a feasible filter split of a subset.
    assert any(p["strategy"].startswith("filter parallel") and p["feasible"] for p in plans)
    t5 = tmp_path / "t5.json"
    t5.write_text(
        '{"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 32, '
        '"d_kv": 16, "d_ff": 64, "num_layers": 1, "num_heads": 2, "vocab_size": 64}'
    )
    inputs = "input_ids=16,attention_mask=16,decoder_input_ids=8"
    argv = ("plan", "--model", f"hf:{t5}", "--input", inputs, "--dtype", "int64")
    run = hetcoll(*argv, "--cluster", CLUSTER, "--batch", "32", "--json", "--top", "100")
    assert run.returncode == 0, run.stderr
    (every,) = [
        p for p in json.loads(run.stdout)["plans"] if p["strategy"] == "filter parallel, balanced"
    ]
    assert every["feasible"], every["reason"]


def test_plan_takes_a_hugging_face_config_and_says_how_to_build_it(tmp_path: Path) -> None:
    config = _llama_config(tmp_path)
    argv = ("plan", "--model", f"hf:{config}", "--input", "input_ids=16,attention_mask=16")
    run = hetcoll(*argv, "--dtype", "int64", "--cluster", CLUSTER, "--batch", "8")
    assert run.returncode == 0, run.stderr
    assert f"hf:{config} (" in run.stdout and "best:" in run.stdout
    assert f"hetcoll.model.networks.hugging_face({str(config)!r})" in run.stdout


#: Two devices that cannot hold a 1.1B-parameter model's training state alone, on a slow link:
#: a pipeline.
TWO_SMALL = """
[devices.small-gpu]
flops_per_s = 10e12
mem_bytes_per_s = 500e9
memory_bytes = 12e9

[links.slow]
latency_s = 1e-5
bytes_per_s = 1e9

[[nodes]]
name = "box"
device = "small-gpu"
count = 1
repeat = 2

[network]
link = "slow"
"""


def test_a_pipeline_of_a_transformer_counts_its_layers_as_its_plan_does(tmp_path: Path) -> None:
    """TinyLlama's shape (1.1B parameters, 22 blocks) on two 12 GB devices: a pipeline. Each
    device's layers are the plan's top-level layers (embedding, rotary table, blocks, norm,
    head: 26), as the plan line cuts them, not the ~150 costed layers it was priced by."""
    _llama_config(
        tmp_path,
        vocab=32000,
        hidden=2048,
        intermediate=5632,
        layers=22,
        heads=32,
        kv_heads=4,
        positions=2048,
    )
    (tmp_path / "two.toml").write_text(TWO_SMALL)
    argv = ("plan", "--model", f"hf:{tmp_path}", "--input", "input_ids=64,attention_mask=64")
    run = hetcoll(
        *argv, "--dtype", "int64", "--batch", "16", "--cluster", str(tmp_path / "two.toml")
    )
    assert run.returncode == 0, run.stderr
    assert "best: pipeline" in run.stdout, run.stdout
    cuts = re.search(r"rank 0 layers 0-(\d+) \| rank 1 layers \1-26\]", run.stdout)
    assert cuts is not None, run.stdout
    first = int(cuts.group(1))
    held = re.search(r"ranks 0-1: (?:layers (\d+),(\d+)|(\d+) layers each)", run.stdout)
    assert held is not None, run.stdout
    counts = [int(held.group(3))] * 2 if held.group(3) else [int(held.group(1)), int(held.group(2))]
    assert counts == [first, 26 - first]


def test_module_attr_finds_the_working_directory_like_python_m(tmp_path: Path) -> None:
    (tmp_path / "my_models.py").write_text(
        "from torch import nn\n\n\nclass Net(nn.Sequential):\n"
        "    def __init__(self) -> None:\n"
        "        super().__init__(nn.Flatten(), nn.Linear(12, 3))\n"
    )
    run = hetcoll(
        "model", "costs", "--model", "my_models:Net", "--input", "3x4", "--json", cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    assert [row["params"] for row in json.loads(run.stdout)["layers"]] == [0, 39]


def test_keyword_inputs_reach_the_forward_by_name(tmp_path: Path) -> None:
    """``--input NAME=SHAPE,...`` calls the forward with keyword inputs (as a Hugging Face
    model takes ``input_ids`` and ``attention_mask``)."""
    (tmp_path / "kw_models.py").write_text(
        "import torch\nfrom torch import nn\n\n\nclass Pair(nn.Module):\n"
        "    def __init__(self) -> None:\n"
        "        super().__init__()\n"
        "        self.a = nn.Linear(4, 3)\n"
        "        self.b = nn.Linear(2, 3)\n\n"
        "    def forward(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:\n"
        "        return self.a(left) + self.b(right)\n"
    )
    argv = ("model", "costs", "--model", "kw_models:Pair", "--input", "right=2, left=4")
    run = hetcoll(*argv, "--json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    costs = json.loads(run.stdout)
    assert sorted(row["params"] for row in costs["layers"] if row["params"]) == [9, 15]
    assert {x["name"]: x["shape"] for x in costs["inputs"]} == {"right": [2], "left": [4]}
    # NAME=SHAPE:DTYPE: each input of its own dtype (Whisper's float features beside int64
    # decoder ids; one --dtype for all failed there).
    (tmp_path / "mixed_models.py").write_text(
        "import torch\nfrom torch import nn\n\n\nclass Mixed(nn.Module):\n"
        "    def __init__(self) -> None:\n"
        "        super().__init__()\n"
        "        self.embed = nn.Embedding(10, 4)\n"
        "        self.a = nn.Linear(4, 4)\n\n"
        "    def forward(self, features: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:\n"
        "        return self.a(features) + self.embed(ids)\n"
    )
    argv = ("model", "costs", "--model", "mixed_models:Mixed")
    run = hetcoll(*argv, "--input", "features=3x4:float32,ids=3:int64", "--json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    inputs = {x["name"]: (x["shape"], x["dtype"]) for x in json.loads(run.stdout)["inputs"]}
    assert inputs == {"features": ([3, 4], "float32"), "ids": ([3], "int64")}
    run = hetcoll(*argv, "--input", "features=3x4:float99,ids=3", cwd=tmp_path)
    assert run.returncode != 0 and "--input: features: dtype" in run.stderr, run.stderr


# ------------------------------------------------------------------------- cluster files


def _cluster_text(count: int = 1, repeat: int = 1, nodes: int = 1, block: int = 1) -> str:
    text = (
        "[devices.c]\nflops_per_s = 1e11\nmem_bytes_per_s = 2e10\nmemory_bytes = 8e9\n"
        f"conv_channel_block = {block}\n"
        "[links.l]\nlatency_s = 1e-6\nbytes_per_s = 1e9\n[network]\nlink = 'l'\n"
    )
    node = f"[[nodes]]\nname = 'n'\ndevice = 'c'\ncount = {count}\nlink = 'l'\nrepeat = {repeat}\n"
    return text + node * nodes


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (_cluster_text(count=10**9), "nodes[0].count: must be at most"),
        (_cluster_text(repeat=10**9), "nodes[0].repeat: must be at most"),
        (
            _cluster_text(count=8, repeat=MAX_DEVICES // 8 + 1),
            "nodes[0].repeat: the cluster reaches",
        ),
        (_cluster_text(count=MAX_DEVICES // 2, nodes=3), "nodes[2].count: the cluster reaches"),
        (_cluster_text(count=64, repeat=MAX_DEVICES // 64, nodes=2), "nodes[1].repeat: the"),
        (_cluster_text(block=10**9), "devices.c.conv_channel_block: must be an integer in"),
        ("a = " + "[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("# " + "x" * MAX_FILE_BYTES, f"longer than {MAX_FILE_BYTES:,} bytes"),
        ("name = '\udcff'", "not UTF-8"),
    ],
    ids=[
        "count",
        "repeat",
        "count-x-repeat",
        "total",
        "total-repeat",
        "block",
        "nested",
        "size",
        "utf8",
    ],
)
def test_cluster_files_are_bounded(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "c.toml"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ValueError, match=re.escape(f"{path}: ") + ".*" + re.escape(field)):
        load_cluster(path)


def test_cluster_at_the_device_bound_loads(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(_cluster_text(count=8, repeat=MAX_DEVICES // 8 // 2, nodes=2))
    assert load_cluster(path).num_devices == MAX_DEVICES


@pytest.mark.parametrize("special", ["/dev/zero", "/dev/null", "fifo", "dir"])
def test_cluster_special_files_are_refused_without_reading(tmp_path: Path, special: str) -> None:
    if special == "fifo":
        special = str(tmp_path / "fifo")
        os.mkfifo(special)  # no writer: a blocking open would wait for ever
    elif special == "dir":
        special = str(tmp_path)
    with pytest.raises(ValueError, match=r"not a regular file|Is a directory"):
        load_cluster(special)


# ------------------------------------------------------------------------- hetcoll plan


def test_plan_names_devices_leaves_slow_ones_out_and_says_how_to_run(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    run = hetcoll(*PLAN, "--batch", "256", "--out", str(out))
    assert run.returncode == 0, run.stderr
    text = run.stdout
    # Each node by name, with its device and ranks; the best plan (8 A100s) leaves the rest out
    # and says how much faster that is than the best plan on all 18.
    assert "dgx-a100 (8 x a100-sxm4-40gb), ranks 0-7: 32 samples each" in text
    assert "dgx1-v100 (8 x v100-sxm2-32gb), ranks 8-15: left out" in text
    assert "leaves out 8 x v100-sxm2-32gb (ranks 8-15), 2 x epyc-7763-x2 (ranks 16-17): " in text
    assert "faster than the best plan on all 18" in text
    # How to run the written plan: as many processes as its last rank needs.
    assert f"torchrun --standalone --nproc-per-node 8 examples/train_plan.py --plan {out}" in text
    assert f"mpiexec -n 8 python examples/train_plan.py --plan {out} --mpi" in text
    assert max(json.loads(out.read_text())["replicas"][-1]["stages"][-1]["ranks"]) == 7
    nodes = json.loads(hetcoll(*PLAN, "--batch", "256", "--json").stdout)["nodes"]
    assert nodes[0] == {"node": "dgx-a100", "device": "a100-sxm4-40gb", "ranks": [0, 7]}


def test_plan_writes_the_best_plan_the_runtime_can_run(tmp_path: Path) -> None:
    # A model whose blocks are listed out of call order cannot be cut, so its pipelines have
    # no plan; whole-model replicas need no cut. Before, --out failed (exit 2) even for them.
    out = tmp_path / "plan.json"
    run = hetcoll(
        "plan", "--model", "tests.cli_models:out_of_order", "--input", "8", "--cluster",
        CLUSTER, "--batch", "64", "--out", str(out),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    stages = [st for r in doc["replicas"] for st in r["stages"]]
    assert stages and all(st["layers"] == [0, 3] and len(st["ranks"]) == 1 for st in stages)
    assert f"wrote {out}" in run.stdout
    # Why no plan cuts it is said (it was in the costs' plan_layers_note alone).
    assert (
        "not searched: plans cutting the model (pipelines, split stages): the model's blocks "
        "do not run in the order listed" in run.stdout
    ), run.stdout


def test_plan_offers_filter_parallelism_only_where_it_splits_something() -> None:
    cluster = load_cluster(CLUSTER)
    lstm = layer_costs(networks.build("tests.cli_models:Recurrent", (6, 8), device="meta"), (6, 8))
    assert not dict(lstm.filter_modes)
    strategies = [p.strategy for p in plan(lstm, cluster, 64)]
    assert strategies and not any("filter" in s for s in strategies), strategies
    cnn = layer_costs(networks.build("cnn", (3, 32, 32), device="meta"), (3, 32, 32))
    assert any(p.strategy.startswith("filter parallel") for p in plan(cnn, cluster, 64))


@pytest.mark.parametrize(
    ("model", "shape"), [("cnn", (3, 32, 32)), ("vgg", (3, 32, 32)), ("mlp", (784,))]
)
def test_plan_is_never_slower_than_the_best_of_the_nodes_sweep(
    model: str, shape: tuple[int, ...]
) -> None:
    # The user's trial: `--sweep nodes` found a faster plan on fewer devices than `plan` did.
    cluster = load_cluster(CLUSTER)
    costs = layer_costs(networks.build(model, shape, device="meta"), shape)
    for batch in (4, 16, 64, 256):
        best = plan(costs, cluster, batch)[0]
        swept = [p for pt in sweep(costs, cluster, batch, "nodes") for p in pt.best.values()]
        assert best.feasible and best.step_s <= min(p.step_s for p in swept) * (1 + 1e-12)


def test_a_model_whose_forward_raises_its_own_error_is_one_line() -> None:
    # Before: a 36-line traceback ending in the model's AssertionError (torchvision's
    # Faster R-CNN asserting targets in training), exit status 1.
    run = hetcoll(
        "plan", "--model", "tests.cli_models:WantsTargets", "--input", "3x8x8", "--batch", "8",
        "--cluster", CLUSTER,
    )  # fmt: skip
    assert_usage_error(run, "plan", "input_shape", "targets should not be none")
