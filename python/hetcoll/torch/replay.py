"""A pipeline stage of any model: the model's own forward, replayed around the stage's blocks.

A transformer is not a chain of one-tensor calls: its forward builds masks and position ids from
its keyword inputs, computes rotary embeddings once for every layer, calls its decoder layers
from a Python loop over a ``ModuleList`` and returns a ``ModelOutput``. Rather than rewrite that
code as a graph, each stage runs the model's forward itself, with every block
(:func:`hetcoll.torch.layers.model_layers`) routed by its role for the stage:

- ``"mine"``: the stage's own blocks run for real (their outputs that later stages read are sent
  to them);
- ``"received"``: a block of an earlier stage whose output this stage reads — the tensors it
  sent stand in for the call, so gradients flow back to it;
- ``"recompute"``: a block without parameters that reads only the inputs (or other such
  blocks) runs again here rather than crossing the cut;
- ``"dummy"``: any other block returns zeros of its output's shape; nothing this stage computes
  reads them (checked once, below);
- ``"stop"``: the first block after the stage ends the forward of a stage that is not the last;
- ``"glue"``: a block without parameters that the forward calls more than once (one activation
  module used at several places) runs every time, on every stage, as the code between blocks.

The code between blocks (masks, position ids, a residual at the top level) runs on every stage
from the micro-batch's own inputs, which every rank holds. What crosses a cut is therefore
exactly the blocks' outputs that a later stage reads, whatever their structure (tuples,
``ModelOutput``, hidden states beside cos/sin), as torch.export's graph split would carry them.

Which outputs cross, and the shapes of the zeros, come from a probe (:func:`probe`), run once
per input shape: the forward with the inputs as they are and every block run on the meta device
(shapes only, no memory, no compute), while a ``TorchFunctionMode`` follows which blocks' outputs
each value of the code between blocks is computed from. The same probe is run by every rank, so
a cut that cannot work (a block reading a later stage's output, a block called twice) raises the
same error everywhere, before anything is sent.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from hetcoll.torch.meta_ops import meta_ops
from hetcoll.torch.stage_inputs import StageInput

__all__ = [
    "BlockCalledAgain",
    "Flow",
    "Leaf",
    "StageRoles",
    "StandIn",
    "StopForward",
    "call_model",
    "install_output_recorders",
    "meta_copy",
    "output_recorders",
    "probe",
    "probe_first_that_runs",
    "replay",
    "routed",
    "stage_roles",
    "tensor_attributes_kept",
    "tensors_replaced",
    "wants_values",
    "zeros_outside_blocks",
]


#: The module whose forward hooks only record a module's output (Hugging Face's capture of
#: hidden states and attentions, put on the modules of the classes it records).
_RECORDERS = "transformers.utils.output_capturing"


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device (shapes and
    dtypes only), made without copying any data; ties between parameters are kept. Tensors a
    module holds as plain attributes (what a forward stored there: RAFT's ``corr_pyramid``,
    which deepcopy cannot copy where autograd made them) are copied alike, without a graph.
    Hooks that record outputs (:func:`output_recorders`) are left out of the copy."""
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in memo:
            empty = torch.empty_like(t, device="meta")
            memo[id(t)] = (
                nn.Parameter(empty, requires_grad=t.requires_grad)
                if isinstance(t, nn.Parameter)
                else empty
            )
    for _, value in _tensor_attributes(model):
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor) and id(t) not in memo:
                memo[id(t)] = torch.empty_like(t.detach(), device="meta")
    out = copy.deepcopy(model, memo)
    # A copy that only tells shapes records nothing (the model's own modules do, once).
    for m in out.modules():
        for key, hook in list(m._forward_hooks.items()):
            if _records(hook):
                del m._forward_hooks[key]
    return out


def _records(hook: Any) -> bool:
    """Whether a forward hook only records its module's output (:data:`_RECORDERS`)."""
    return getattr(hook, "__module__", "") == _RECORDERS


def _holds_tensors(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor | fx.Proxy) for t in pytree.tree_leaves(value))


def _attributes(model: nn.Module) -> dict[tuple[nn.Module, str], Any]:
    """The plain attributes of ``model``'s modules (not parameters, buffers or submodules),
    by (module, name), with their values."""
    return {(m, k): v for m in model.modules() for k, v in vars(m).items() if k[0] != "_"}


def _tensor_attributes(model: nn.Module) -> list[tuple[tuple[nn.Module, str], Any]]:
    """Those of :func:`_attributes` that hold tensors."""
    return [(at, v) for at, v in _attributes(model).items() if _holds_tensors(v)]


@contextmanager
def tensor_attributes_kept(model: nn.Module) -> Iterator[None]:
    """Inside, ``model``'s forward may store tensors (or a trace's proxies) in its modules'
    plain attributes (RAFT's ``corr_block.corr_pyramid``) and update its buffers (a running
    mean, a call counter: in place, or a new tensor); after, those attributes and buffers are
    as they were (set back, or removed where they were not there): a probe, a trace or a
    count of the forward, on meta tensors or zeros, leaves the user's model as it was. (A
    torch.fx trace runs a forward's in-place updates of buffers for real: it reads buffers as
    the tensors they are.)"""
    before = _attributes(model)
    buffers = {
        (m, k): (b, b.detach().clone() if not b.is_meta else None)
        for m in model.modules()
        for k, b in m._buffers.items()
        if b is not None
    }
    try:
        yield
    finally:
        for (m, k), v in _tensor_attributes(model):
            if (m, k) not in before:
                delattr(m, k)
            elif before[m, k] is not v:
                setattr(m, k, before[m, k])
        with torch.no_grad():
            for (m, k), (b, values) in buffers.items():
                if m._buffers.get(k) is not b:
                    m._buffers[k] = b
                if values is not None and not torch.equal(b, values):
                    b.copy_(values)


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a dict of keyword inputs, else ``model(inputs)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    return model(inputs)


class StopForward(Exception):
    """Ends the forward of a stage that is not the last, once its blocks have run."""


def output_recorders(m: nn.Module) -> list[Callable[..., Any]]:
    """The forward hooks of ``m`` that only record its output, for the code between blocks to
    read (Hugging Face's: Llava picks a vision layer's hidden state out of what they record)."""
    return [h for h in m._forward_hooks.values() if _records(h)]


def install_output_recorders(model: nn.Module) -> None:
    """Have ``model``'s Hugging Face parts put their output recorders on the modules they
    record now (they would at their first forward, on a stage's copy, where a block it does
    not hold is a :class:`StandIn` of no recorded class): a stand-in then runs its block's
    (:func:`output_recorders`). Nothing for a model of no Hugging Face part."""
    import sys

    capture = sys.modules.get(_RECORDERS)
    utils = sys.modules.get("transformers.modeling_utils")
    install = getattr(capture, "maybe_install_capturing_hooks", None)
    pretrained = getattr(utils, "PreTrainedModel", None)
    if install is None or pretrained is None:
        return
    for m in model.modules():
        if isinstance(m, pretrained):
            install(m)


#: The tensors of blocks held elsewhere that code between blocks read off their stand-ins
#: (on the meta device), latest last: what a probe that fails on them names.
_TENSORS_READ: list[str] = []


class StandIn(nn.Module):
    """Holds a block's place in a stage's copy of the model when the stage does not hold its
    weights; :func:`routed` decides what its calls return. Attributes the code between blocks
    reads off a block (``layers[0].self_attn.batch_first``) come from the block's copy on the
    meta device, which is not a submodule: the stage neither holds nor trains its weights.
    ``recorders``: its block's hooks that record its output (:func:`output_recorders`), which
    it runs alike."""

    def __init__(self, name: str, meta: nn.Module, recorders: Sequence[Callable[..., Any]] = ()):
        super().__init__()
        self.block = name
        object.__setattr__(self, "meta", meta)
        for hook in recorders:
            self.register_forward_hook(hook)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            value = getattr(object.__getattribute__(self, "meta"), name)
            if isinstance(value, torch.Tensor):  # its weights, which this stage does not hold
                _TENSORS_READ.append(f"{self.block}.{name}")
            return value

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"block {self.block!r} is held by another stage; it runs only inside a plan's step"
        )

    def extra_repr(self) -> str:
        return f"{self.block!r}, held by another stage"


@dataclass(frozen=True)
class Leaf:
    """One tensor of a block's output: its shape and dtype, and whether it carries a gradient."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass
class Flow:
    """What one probe saw (:func:`probe`): the order blocks were called in, each block's output
    structure (``spec``; a :class:`Leaf` per tensor, the value itself for anything else) and
    the blocks each block's arguments — and the model's output — were computed from."""

    order: list[int] = field(default_factory=list)
    specs: dict[int, tuple[pytree.TreeSpec, list[Any]]] = field(default_factory=dict)
    reads: dict[int, frozenset[int]] = field(default_factory=dict)
    output_reads: frozenset[int] = frozenset()
    #: Blocks without parameters called more than once: run as code between blocks.
    glue: frozenset[int] = frozenset()
    #: Blocks without parameters whose output the values of their inputs do not change (a
    #: rotary embedding reads the hidden states for their dtype and device alone): any stage
    #: computes them from stand-ins of their inputs (:func:`_reads_no_values`).
    value_free: set[int] = field(default_factory=set)
    #: Blocks whose parameters the code between blocks reads itself, outside their calls
    #: (DETR's query embeddings' weight): only a stage holding them could run that code.
    read_outside: frozenset[int] = frozenset()
    #: The roles of each (replica, stage) for this probe, kept by whoever computes them.
    roles: dict[tuple[int, int], StageRoles] = field(default_factory=dict)

    def zeros(
        self,
        k: int,
        device: torch.device,
        cache: dict[Any, torch.Tensor] | None = None,
        *,
        grad: bool = False,
    ) -> Any:
        """Block ``k``'s output structure with zeros for its tensors. With a ``cache``, tensors
        of one shape and dtype are one tensor, kept there across calls (a stage's stand-ins for
        blocks it skips, never written to); without, each is fresh. ``grad``: each requires a
        gradient where the block's output does (the probe's, for the code between blocks to
        pass on)."""
        spec, leaves = self.specs[k]
        out = []
        for leaf in leaves:
            if not isinstance(leaf, Leaf):
                out.append(leaf)
                continue
            key = (leaf.shape, leaf.dtype)
            t = cache.get(key) if cache is not None else None
            if t is None:
                t = torch.zeros(leaf.shape, dtype=leaf.dtype, device=device)
                if grad:  # not a leaf: code between blocks may work on it in place
                    t = StageInput(t, leaf.requires_grad).tensor
                if cache is not None:
                    cache[key] = t
            out.append(t)
        return pytree.tree_unflatten(out, spec)

    def tensors(self, k: int) -> list[Leaf]:
        return [leaf for leaf in self.specs[k][1] if isinstance(leaf, Leaf)]

    def rebuild(self, k: int, tensors: Sequence[torch.Tensor]) -> Any:
        """Block ``k``'s output structure around the given tensors (in leaf order)."""
        spec, leaves = self.specs[k]
        it = iter(tensors)
        return pytree.tree_unflatten(
            [next(it) if isinstance(leaf, Leaf) else leaf for leaf in leaves], spec
        )


class _Sources(TorchFunctionMode):
    """Follows, for every tensor the code between blocks computes, the blocks whose outputs it
    was computed from (the union over each op's tensor arguments)."""

    def __init__(
        self, owned: Mapping[int, int] | None = None, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.of: dict[int, frozenset[int]] = {}
        self.keep: list[torch.Tensor] = []  # no id is reused while the probe runs
        self.paused = 0
        #: The blocks' parameters (by id: their block), and the blocks whose parameters the
        #: code between blocks reads itself (DETR's query embeddings' weight): every stage
        #: runs that code, and only one holds the block. A stand-in's parameters (on the meta
        #: device) read so are zeros on the probe's ``device``, so that the probe goes on.
        self.owned = dict(owned or {})
        self.read_outside: set[int] = set()
        self.device = device

    def mark(self, value: Any, sources: frozenset[int]) -> None:
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor):
                self.of[id(t)] = self.of.get(id(t), frozenset()) | sources
                self.keep.append(t)

    def sources(self, value: Any) -> frozenset[int]:
        found: frozenset[int] = frozenset()
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor):
                found |= self.of.get(id(t), frozenset())
        return found

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        hit = set[int]()
        if not self.paused and self.owned:
            args, kwargs = pytree.tree_map(lambda t: self._read(t, hit), (args, kwargs))
        if not self.paused and func in _TO_PYTHON:
            found = self.sources((args, kwargs))
            if found:
                raise _DecidesOnData(found)
        out = func(*args, **kwargs)
        if hit and any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(out)):
            self.read_outside |= hit  # its values computed on, not its dtype or shape read
        if not self.paused:
            found = self.sources((args, kwargs))
            if found:
                self.mark(out, found)
        return out

    def _read(self, t: Any, hit: set[int]) -> Any:
        k = self.owned.get(id(t)) if isinstance(t, torch.Tensor) else None
        if k is None:
            return t
        hit.add(k)
        if t.is_meta and self.device is not None and self.device.type != "meta":
            return torch.zeros(t.shape, dtype=t.dtype, device=self.device)
        return t


#: Reading a tensor's values into Python: a branch or a size decided by data.
_TO_PYTHON = {
    torch.Tensor.__bool__,
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}


class _DecidesOnData(Exception):
    def __init__(self, blocks: frozenset[int]):
        super().__init__()
        self.blocks = blocks


def compiled_call(module: nn.Module) -> Callable[..., Any] | None:
    """torch.compile's call of ``module`` where it was compiled in place (``module.compile()``,
    torch's regional compilation, which keeps it in a private attribute), else None."""
    return getattr(module, "_compiled_call_impl", None)


@contextmanager
def routed(model: nn.Module, blocks: Sequence[str], route: Callable[..., Any]) -> Iterator[None]:
    """Within the block, every call of block ``k`` of ``model`` (by module path) becomes
    ``route(k, module, forward, *args, **kwargs)``, ``forward`` being the block's own. A block
    compiled in place (``block.compile()``, torch's regional compilation) is routed around its
    compiled call instead (``forward`` then runs its hooks and forward, compiled): routing
    inside it would have torch.compile trace the route."""
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for k, name in enumerate(blocks):
            m = model.get_submodule(name)
            compiled = compiled_call(m)
            own = m.forward if compiled is None else compiled

            def call(*args: Any, _k: int = k, _m: nn.Module = m, _f: Any = own, **kw: Any) -> Any:
                return route(_k, _m, _f, *args, **kw)

            if compiled is None:
                m.forward = call  # type: ignore[method-assign]
            else:
                m._compiled_call_impl = call
            patched.append((m, compiled))
        yield
    finally:
        for m, compiled in patched:
            if compiled is None:
                del m.forward
            else:
                m._compiled_call_impl = compiled


@contextmanager
def zeros_outside_blocks(
    model: nn.Module, blocks: Sequence[nn.Module], device: torch.device
) -> Iterator[None]:
    """For a :func:`probe` on ``device`` of a ``model`` built on the meta device: what the code
    between blocks may read for real (every buffer: a rotary embedding's ``inv_freq``, run
    between blocks where the forward calls it at several places; and the parameters no block
    holds: BART's ``final_logits_bias``) as zeros on ``device`` meanwhile, the model's own
    tensors back after. The blocks themselves run as meta copies. Nothing changes on the meta
    device, or for a model whose tensors have storage."""
    if device.type == "meta":
        yield
        return
    held = {id(p) for b in blocks for p in b.parameters()}
    zeros: dict[int, torch.Tensor] = {}  # one stand-in for a tensor registered twice

    def zeros_of(t: torch.Tensor, parameter: bool) -> torch.Tensor | None:
        if not t.is_meta or (parameter and id(t) in held):
            return None
        if id(t) not in zeros:
            z = torch.zeros(t.shape, dtype=t.dtype, device=device)
            zeros[id(t)] = nn.Parameter(z, t.requires_grad) if parameter else z
        return zeros[id(t)]

    with tensors_replaced(model, zeros_of):
        yield


@contextmanager
def tensors_replaced(
    model: nn.Module, stand_in: Callable[[torch.Tensor, bool], torch.Tensor | None]
) -> Iterator[None]:
    """Every parameter and buffer of ``model``'s modules for which ``stand_in(tensor,
    is_parameter)`` gives a tensor held as that tensor while the context lasts (each module
    holding a tensor registered twice gets what ``stand_in`` gives for it), the model's own
    back after. A stand-in the forward moved to the module's other store is taken out of it
    (torch's parametrize, which PEFT's LoRA on parameters applies for each forward, registers
    a parametrized tensor back as a buffer unless it is an ``nn.Parameter``): the module holds
    its own tensor, where it held it, and nothing more."""
    swapped: list[tuple[nn.Module, dict[str, Any], str, torch.Tensor, torch.Tensor]] = []
    for module in model.modules():
        stores: tuple[dict[str, Any], dict[str, Any]] = (module._parameters, module._buffers)
        for store in stores:
            for name, t in store.items():
                new = None if t is None else stand_in(t, store is module._parameters)
                if new is not None:
                    swapped.append((module, store, name, t, new))
    for _, store, name, _, new in swapped:
        store[name] = new
    try:
        yield
    finally:
        for module, store, name, t, new in swapped:
            for other in (module._parameters, module._buffers):
                if other is not store and other.get(name) is new:
                    del other[name]
            store[name] = t


def probe(
    model: nn.Module, blocks: Sequence[str], meta_blocks: Sequence[nn.Module], inputs: Any
) -> Flow:
    """Run ``model``'s forward on ``inputs`` with each block ``k`` (a module path of
    ``blocks``) computed by ``meta_blocks[k]`` on the meta device and answered with zeros of
    its output's shape on the inputs' device; return what the run saw (:class:`Flow`). The code
    between blocks runs for real (so a forward that looks at its inputs' values works) and
    ``model``'s own blocks are not run. A block without parameters that the forward calls
    more than once (one dropout or activation module used at several places) is code between
    blocks too: every stage runs each of its calls (``Flow.glue``)."""
    glue: set[int] = set()
    # Modules compiled in place (block.compile()) run as they are here: a probe reads shapes
    # off tensors of its own, which torch.compile would trace.
    compiled = any(compiled_call(m) is not None for m in model.modules())
    with torch.compiler.set_stance("force_eager") if compiled else nullcontext():
        while True:
            try:
                return _probe(model, blocks, meta_blocks, inputs, frozenset(glue))
            except _CalledAgain as e:
                glue.add(e.block)


class BlockCalledAgain(ValueError):
    """A block with parameters that the forward calls more than once (ALBERT's one layer
    group, run once per layer): no stage can hold it alone. ``block``: its path."""

    def __init__(self, block: str):
        super().__init__(
            f"model: block {block!r} is called more than once per forward; a plan needs each "
            "block called once (give the repeated work its own module)"
        )
        self.block = block


class _CalledAgain(Exception):
    def __init__(self, block: int):
        super().__init__()
        self.block = block


def probe_first_that_runs(
    model: nn.Module, blocks: Sequence[tuple[str, nn.Module]], attempts: Sequence[Any]
) -> Flow:
    """:func:`probe` of ``model`` cut into ``blocks`` (path, module), on each of ``attempts``
    (the forward's inputs, a tensor or a dict of keyword inputs) in turn until one runs, on
    the device of its tensors: the meta device first (no memory), then the CPU for a forward
    that wants values there (Hugging Face's sdpa masks read ``padding_mask.all()``), where a
    model built on the meta device reads its tensors outside the blocks as zeros
    (:func:`zeros_outside_blocks`). The blocks' meta copies are made once for all attempts.
    ``ValueError`` saying why each failed where none runs."""
    names = [n for n, _ in blocks]
    modules = [m for _, m in blocks]
    meta_blocks = [meta_copy(m) for m in modules]
    errors = []
    for inputs in attempts:
        leaves = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
        device = leaves[0].device if leaves else torch.device("cpu")
        try:
            with zeros_outside_blocks(model, modules, device), tensor_attributes_kept(model):
                return probe(model, names, meta_blocks, inputs)
        except BlockCalledAgain:
            raise  # how the model is cut, not how it was run
        except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError) as e:
            errors.append(f"{device.type}: {type(e).__name__}: {e}")
    raise ValueError("; ".join(errors))


def _probe(
    model: nn.Module,
    blocks: Sequence[str],
    meta_blocks: Sequence[nn.Module],
    inputs: Any,
    glue: frozenset[int],
) -> Flow:
    flow = Flow(glue=glue)
    device = next(
        (t.device for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)),
        torch.device("cpu"),
    )
    owned = {}
    for k, name in enumerate(blocks):
        m = model.get_submodule(name)
        held = object.__getattribute__(m, "meta") if isinstance(m, StandIn) else m
        if k not in glue:  # run as code between blocks on every stage, its tensors too
            owned.update({id(p): k for p in held.parameters()})
    sources = _Sources(owned, device)

    def route(k: int, module: nn.Module, forward: Any, *args: Any, **kwargs: Any) -> Any:
        name = blocks[k]
        if k in glue:
            return forward(*args, **kwargs)
        if k in flow.specs:
            if next(module.parameters(), None) is None and not isinstance(module, StandIn):
                raise _CalledAgain(k)
            raise BlockCalledAgain(name)
        flow.order.append(k)
        flow.reads[k] = sources.sources((args, kwargs))
        sources.paused += 1
        try:
            out_meta = _output_of(meta_blocks[k], args, kwargs, device)
        except Exception as e:
            compiled = (
                "; the model is compiled (torch.compile): give the model before compiling it "
                "(model._orig_mod), and compile the result"
                if name.startswith("_orig_mod.")
                else ""
            )
            raise ValueError(
                f"model: block {name!r} does not run on the meta device ({type(e).__name__}: "
                f"{e}); a plan learns its output's shape there{compiled}"
            ) from None
        finally:
            sources.paused -= 1
        leaves, spec = pytree.tree_flatten(out_meta)
        flow.specs[k] = (
            spec,
            [
                Leaf(tuple(t.shape), t.dtype, bool(t.requires_grad))
                if isinstance(t, torch.Tensor)
                else t
                for t in leaves
            ],
        )
        free = not isinstance(module, StandIn) and next(module.parameters(), None) is None
        if (
            free
            and flow.reads[k]
            and device.type != "meta"
            and _reads_no_values(forward, args, kwargs)
        ):
            flow.value_free.add(k)
        # Fresh zeros for each block (told apart by the sources), carrying a gradient where the
        # block's output does, so that the code between blocks passes that on.
        out = flow.zeros(k, device, grad=True)
        sources.mark(out, frozenset({k}))
        return out

    _TENSORS_READ.clear()
    try:
        with routed(model, blocks, route), torch.enable_grad(), sources:
            output = call_model(model, inputs)
    except RuntimeError as e:
        read = sorted(set(_TENSORS_READ))
        if not read or "meta" not in str(e):
            raise
        raise ValueError(
            f"model: its forward reads {', '.join(map(repr, read))} itself, outside the "
            "block's call, on a stage that does not hold that block (its weights are on "
            "another stage): give the model example inputs (dummy_inputs, a dict of tensors "
            "whose forward tells the blocks' call order), which make a module the forward "
            "never calls but reads no block, its weights held by every stage"
        ) from e
    except _DecidesOnData as e:
        which = ", ".join(repr(blocks[k]) for k in sorted(e.blocks))
        raise ValueError(
            f"model: its forward reads the values of block {which}'s output into Python (a "
            "branch or a size decided by data) between blocks, so its stages cannot replay it "
            "without that block; move the decision inside a block, or compute it from the "
            "inputs"
        ) from None
    flow.output_reads = sources.sources(output)
    flow.read_outside = frozenset(sources.read_outside)
    return flow


def _reads_no_values(forward: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a block without parameters gives the same output for its floating-point
    inputs' values as for other values of theirs (zeros, then a random draw): it reads their
    shapes, dtypes and devices alone (a rotary embedding). Without gradients; a forward that
    fails on them, or draws at random itself (dropout), does not."""

    def other(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return torch.rand_like(t.detach()) + 1.0
        return t

    other_args, other_kwargs = pytree.tree_map(other, (args, kwargs))
    try:
        with torch.no_grad():
            first = pytree.tree_leaves(forward(*args, **kwargs))
            again = pytree.tree_leaves(forward(*other_args, **other_kwargs))
    except Exception:  # whatever a block's forward raises on other values
        return False
    if len(first) != len(again):
        return False
    for a, b in zip(first, again, strict=True):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return False
        if isinstance(a, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
                return False
        elif a != b:
            return False
    return True


def _on_meta(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    return StageInput(t.detach().to("meta"), t.requires_grad).tensor


#: What torch's errors say where a run on the meta device wants values: a tensor read into
#: Python, an output whose shape depends on values (``nonzero``, as in a mixture of experts'
#: routing), a tensor made on the CPU meeting meta ones, or torch.autocast on the meta device
#: ("unsupported scalarType": PEFT's LoRA on parameters folds its factors under autocast).
_WANTS_VALUES = (
    "meta tensor",
    "data-independent",
    "on the expected device",
    "same device",
    "unsupported scalarType",
)


def wants_values(e: BaseException) -> bool:
    """Whether ``e``, raised by a run on the meta device, is for want of values: the run
    must then be a real one."""
    return any(m in str(e) for m in _WANTS_VALUES)


def _output_of(
    meta_block: nn.Module, args: tuple, kwargs: dict[str, Any], device: torch.device
) -> Any:
    """What ``meta_block`` returns for ``args`` and ``kwargs``: on the meta device, or, where
    its forward decides something on values there (a mixture of experts picking the experts
    its tokens reach: a loop over ``nonzero``), from a real run of a copy of it holding
    zeros on ``device`` (one block's memory, once per input shape; the same on every rank).
    Only the output's structure, shapes, dtypes and ``requires_grad`` are read off it."""
    meta_args, meta_kwargs = pytree.tree_map(_on_meta, (args, kwargs))
    try:
        with meta_ops():
            return meta_block(*meta_args, **meta_kwargs)
    except Exception as e:
        if not wants_values(e):
            raise
    real = copy.deepcopy(meta_block).to_empty(device=device)
    with torch.no_grad():
        for t in (*real.parameters(), *real.buffers()):
            t.zero_()
    own_args, own_kwargs = pytree.tree_map(_copied, (args, kwargs))
    return pytree.tree_map(_on_meta, real(*own_args, **own_kwargs))


def _copied(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    return StageInput(t.detach().clone(), t.requires_grad).tensor


@dataclass(frozen=True)
class StageRoles:
    """Each block's role for one stage (module docs) and what crosses its cuts: ``receives``,
    the earlier blocks whose outputs it reads (in call order), and ``sends``, its blocks whose
    outputs later stages read, with the stages reading each."""

    roles: dict[int, str]
    receives: list[int]
    sends: dict[int, list[int]]


def stage_roles(
    flow: Flow,
    names: Sequence[str],
    stage_of: Sequence[int],
    stage: int,
    parameter_free: Sequence[bool],
    where: Callable[[int], str],
) -> StageRoles:
    """The roles of every block for ``stage`` of a pipeline whose block ``k`` belongs to stage
    ``stage_of[k]``. Raises ``ValueError`` (naming the block) for a cut that cannot run: a
    block that reads the output of a later stage's block, a block whose parameters the code
    between blocks reads (which every stage runs) on a plan of several stages."""
    if flow.read_outside and max(stage_of) > 0:
        which = ", ".join(repr(names[k]) for k in sorted(flow.read_outside))
        raise ValueError(
            f"{where(stage_of[min(flow.read_outside)])}: the model's forward reads the "
            f"parameters of block {which} itself, outside the block's call, in code between "
            "blocks that every stage runs, and only this stage holds them: give the model "
            "example inputs (dummy_inputs, a dict of tensors whose forward tells the blocks' "
            "call order), which make a module the forward never calls no block, its weights "
            "held by every stage"
        )
    recompute: set[int] = set()
    for k in flow.order:  # a block that reads only the inputs and such blocks
        if parameter_free[k] and flow.reads[k] <= recompute:
            recompute.add(k)
    # A block of a later stage that a stage reads is one it computes itself where its output
    # does not change with its inputs' values (a rotary embedding registered after the layers
    # that read it); a block in order is sent as any other.
    early: dict[int, set[int]] = {}

    def reads_of(s: int) -> list[tuple[str, frozenset[int]]]:
        out = [(f"block {names[k]!r}", flow.reads[k]) for k in flow.order if stage_of[k] == s]
        if s == max(stage_of):
            out.append(("the model's output", flow.output_reads))
        return out

    last = max(stage_of)
    needed: dict[int, set[int]] = {}
    for s in range(last + 1):
        needed[s] = set()
        for what, reads in reads_of(s):
            for j in sorted(reads):
                if stage_of[j] == s or j in recompute:
                    continue
                if stage_of[j] > s and parameter_free[j] and j in flow.value_free:
                    early.setdefault(s, set()).add(j)
                    continue
                if stage_of[j] > s:
                    raise ValueError(
                        f"{where(s)}: {what} reads the output of block {names[j]!r}, which a "
                        f"later stage ({where(stage_of[j])}) holds; cut the model in the order "
                        "its forward calls the blocks"
                    )
                needed[s].add(j)
    roles: dict[int, str] = {}
    for k in range(len(names)):
        if k in flow.glue:
            roles[k] = "glue"
        elif stage_of[k] == stage:
            roles[k] = "mine"
        elif k in recompute or k in early.get(stage, ()):
            roles[k] = "recompute"
        elif k in needed[stage]:
            roles[k] = "received"
        elif stage_of[k] > stage and stage != last:
            roles[k] = "stop"
        else:
            roles[k] = "dummy"
    order = {k: i for i, k in enumerate(flow.order)}
    receives = sorted(needed[stage], key=order.__getitem__)
    crossing = {k for s in needed for k in needed[s] if stage_of[k] == stage}
    sends = {
        k: [s for s in range(stage + 1, last + 1) if k in needed[s]]
        for k in sorted(crossing, key=order.__getitem__)
    }
    return StageRoles(roles, receives, sends)


def replay(
    model: nn.Module,
    blocks: Sequence[str],
    inputs: Any,
    flow: Flow,
    roles: StageRoles,
    received: Mapping[int, Any],
    device: torch.device,
) -> tuple[Any, dict[int, Any]]:
    """One stage's forward of one micro-batch: ``model``'s forward on ``inputs`` with each
    block routed by its role (module docs), ``received`` standing in for the blocks the stage
    receives. Returns the model's output (None for a stage that is not the last) and the
    outputs of the stage's blocks that later stages read (``roles.sends``)."""
    captured: dict[int, Any] = {}
    dummies: dict[Any, torch.Tensor] = {}
    mine = sum(1 for k in flow.order if roles.roles[k] == "mine")
    done = 0

    def route(k: int, module: nn.Module, forward: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal done
        role = roles.roles[k]
        if role == "glue":
            return forward(*args, **kwargs)
        if role == "mine" or role == "recompute":
            out = forward(*args, **kwargs)
            if role == "mine":
                done += 1
                if k in roles.sends:
                    captured[k] = out
            return out
        if role == "received":
            return received[k]
        if role == "stop" and done == mine:
            raise StopForward
        return flow.zeros(k, device, dummies)

    with routed(model, blocks, route):
        try:
            output = call_model(model, inputs)
        except StopForward:
            output = None
    return output, captured
