"""``torch.compile`` of a split model (after ``filter_parallel``): the exchanges between the
ranks run as they are, the graph breaking around them, and the compiled split model trains as
the unsplit one. torchvision's ViT compiled with aot_eager failed in its first forward: the
traced gather of its head took its output for an alias of its input ("setStorage ... out of
bounds"). A Llama's LoRA head, whose base and adapter outputs the split adds still split, and
a head whose logits stay split through the loss (loss_parallel) failed in dynamo's guards on
the split output: compiled whole, those outputs are gathered (with a warning); compiled block
by block, they stay split. Real gloo jobs against the unsplit model, float64."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from hetcoll.launch import spawn

pytestmark = pytest.mark.multiproc


def _trained_alike(model, split, loss_of, compiled=None) -> tuple[list[float], float]:
    """``model`` and ``split`` (a filter_parallel copy of it) compiled (``compiled``: default
    the whole of it), each trained 2 SGD steps (``loss_of(m, step)``: step's loss): the
    losses, unsplit's then compiled's, and the largest relative difference of the gathered
    state from the unsplit model's."""
    from hetcoll.torch import gather_state_dict

    if compiled is None:
        compiled = torch.compile(split, backend="aot_eager")
    losses = []
    for m in (model, compiled):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for step in range(2):
            opt.zero_grad()
            loss = loss_of(m, step)
            loss.backward()
            opt.step()
            losses.append(float(loss))
    full = gather_state_dict(split, dst=None)
    off = max(
        float((full[k] - w).abs().max() / max(w.abs().max(), 1e-12))
        for k, w in model.state_dict().items()
    )
    return losses, off


def _compiled_vit(rank, world):
    import torchvision

    from hetcoll.torch import filter_parallel

    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(
        image_size=32,
        patch_size=16,
        num_layers=2,
        num_heads=4,
        hidden_dim=32,
        mlp_dim=48,
        num_classes=5,
    ).double()
    split = filter_parallel(copy.deepcopy(model), speeds=[1.0, 1 / 3])

    def loss_of(m, step):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 3, 32, 32, generator=g, dtype=torch.float64)
        y = torch.randint(0, 5, (4,), generator=g)
        return torch.nn.functional.cross_entropy(m(x), y)

    return _trained_alike(model, split, loss_of)


def test_a_compiled_split_vit_trains_as_the_unsplit_model():
    for losses, off in spawn(_compiled_vit, 2, timeout=300):
        assert losses[:2] == pytest.approx(losses[2:], rel=1e-12, abs=0)
        assert off <= 1e-10


def _compiled_lora_head(rank, world, loss_parallel):
    """The LoRA-head Llama split, compiled whole and block by block (each decoder layer's
    ``compile()``, torch's regional compilation), each trained beside the unsplit model; and
    split eagerly. Returns, compiled whole then block by block: what :func:`_trained_alike`
    returns, the last step's traffic (``split_traffic``), the type of its logits and the
    warnings on gathering; the eager split's traffic; the hetcoll functions compiled."""
    import tensor_parallel_cases as cases

    from hetcoll.torch import filter_parallel, split_traffic

    # Past torch.compile's recompile limit (per function, 8 by default) a function runs as it
    # is: at 2, most of what compiles once per shape here would. The outputs kept split (the
    # LoRA head's, loss_parallel's logits) must be gathered all the same, else dynamo fails
    # on a split output handed to the compiled code around them (it did, when the split
    # layers' forward was compiled and reached the limit).
    torch._dynamo.config.recompile_limit = 2
    torch.manual_seed(0)
    model = cases.llama_lora_head().double()
    runs = []
    for way in ("whole", "blocks"):
        split = filter_parallel(
            copy.deepcopy(model), speeds=[1.0, 0.5], loss_parallel=loss_parallel
        )
        compiled = None
        if way == "blocks":
            for block in split.modules():
                if type(block).__name__ == "LlamaDecoderLayer":
                    block.compile(backend="aot_eager")
            compiled = split
        logits = []  # the unsplit model's steps, then the split's

        def loss_of(m, step, logits=logits):
            out, loss = cases.loss_of(m, cases.batch(step))
            logits.append(type(out).__name__)
            return loss

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trained = _trained_alike(copy.deepcopy(model), split, loss_of, compiled)
        warned = sum("compiled whole" in str(w.message) for w in seen)
        runs.append((trained, split_traffic(split), logits[2:], warned))
    eager = filter_parallel(copy.deepcopy(model), speeds=[1.0, 0.5], loss_parallel=loss_parallel)
    cases.loss_of(eager, cases.batch(1))[1].backward()
    return runs, split_traffic(eager), _compiled_hetcoll_functions()


def _compiled_hetcoll_functions() -> set[str]:
    """The qualified names of hetcoll's functions and methods torch.compile has compiled code
    for in this process (dynamo's cache entries on their code objects)."""
    import inspect
    import sys

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    found = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("hetcoll."):
            continue
        for value in vars(module).values():
            members = vars(value).values() if inspect.isclass(value) else [value]
            for f in members:
                f = getattr(f, "__func__", f)
                code = getattr(f, "__code__", None)
                if code is not None and _debug_get_cache_entry_list(code):
                    found.add(f.__qualname__)
    return found


@pytest.mark.parametrize("loss_parallel", [False, True])
def test_a_compiled_split_lora_head_trains_as_the_unsplit_model(loss_parallel):
    """Compiled whole, the split outputs a LoRA head adds (and, with loss_parallel, the logits
    its loss reads split) are gathered instead, with a warning: their reported shape failed
    dynamo's guards. Compiled block by block, the head runs eagerly and keeps them split: a
    step sends what the eager split's sends."""
    for runs, eager, compiled in spawn(_compiled_lora_head, 2, loss_parallel, timeout=300):
        for (losses, off), _, _, _ in runs:
            assert losses[:2] == pytest.approx(losses[2:], rel=1e-12, abs=0)
            assert off <= 1e-10
        (_, whole, whole_logits, whole_warned), (_, blocks, logits, warned) = runs
        assert blocks == eager and whole["activations"] > eager["activations"], (blocks, whole)
        assert whole_warned == 1 and warned == 0  # once a model
        # The logits: the LoRA head's sum gathered once, or with loss_parallel kept split.
        assert whole_logits == ["Tensor"] * 2
        assert logits == [("SplitOutput" if loss_parallel else "Tensor")] * 2
        # hetcoll's checks and exchanges run outside the compiled graph, never traced: the
        # first forward's probes of the split attention (tracing them took a compile 18 s of
        # a 47 s job), the ranks' agreement on each forward's inputs, and the split layers'
        # forward (one local layer between exchanges, else compiled once per weight shape).
        # The hook noting a compiled forward is compiled (traced with the model's code).
        assert "AgreedForward.note_compiled" in compiled, compiled
        checks = {
            "FirstForwardCheck.check",
            "_AgreeOnInputs.before",
            "_AgreeOnInputs.after",
            "FilterParallelLayer.forward",
        }
        assert not checks & compiled, compiled


_BEFORE_THE_TRACER = """
import sys, torch
from hetcoll.collectives.autograd import disable_pending, never_traced_methods
from torch import nn

assert "torch._dynamo" not in sys.modules
seen = []

@never_traced_methods("hook")
class Hook:
    def hook(self, module, args):
        seen.append(torch.compiler.is_compiling())

lazy = Hook.__dict__["hook"]
if sys.argv[1] == "disable":
    disable_pending()
layers = [nn.Linear(3, 3) for _ in range(10)]
for layer in layers:
    layer.register_forward_pre_hook(Hook().hook)
model = torch.compile(nn.Sequential(*layers), backend="eager")
model(torch.randn(2, 3))
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
print(len(seen), any(seen), len(_debug_get_cache_entry_list(lazy.__code__)))
"""


@pytest.mark.parametrize("disable", [True, False])
def test_hooks_defined_before_torch_compile_s_tracer_are_never_traced(disable):
    """A class's never-traced methods defined before torch.compile's tracer is loaded (hetcoll
    imported first, as any script does) run as they are; filter_parallel, expert_parallel and
    parallelize put the disabled methods in place first (``disable_pending``), so torch.compile
    compiles no wrapper of them: without that, the wrapper is compiled for each module it is
    hooked on (past 8, torch warns of its recompile limit)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _BEFORE_THE_TRACER, "disable" if disable else "lazy"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    calls, traced, compiled = out.stdout.split()
    assert (calls, traced) == ("10", "False")
    assert (int(compiled) == 0) == disable, out.stdout
