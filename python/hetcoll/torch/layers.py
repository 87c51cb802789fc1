"""A model as a list of layers: what a Plan's ``layers`` ranges count.

Two kinds of models, told apart by :func:`model_cut`:

- **Chains.** An ``nn.Sequential`` is the chain of its children. A model holding no
  ``nn.ModuleList`` is traced (``torch.fx``, its top-level children kept whole) and, when its graph
  is a chain — each top-level call reads the previous one's output and constants only — its
  layers are those calls. torchvision's ResNet, for instance, becomes ``conv1, bn1, relu,
  maxpool, layer1 .. layer4, avgpool, flatten, fc`` — the ``torch.flatten`` its forward calls is
  a layer of its own. A stage boundary carries one tensor.
- **Blocks**, every other model (a transformer: keyword inputs, masks and rotary embeddings
  beside the hidden states, decoder layers in a ``ModuleList``): its blocks, each named by its
  module path, with repeated blocks expanded so that a plan can cut between them. The root is
  opened, and so is every module on the way to a *repeated container* — a ``ModuleList`` or
  ``ModuleDict``, or an ``nn.Sequential`` of two or more children of one class (torchvision
  ViT's encoder layers) — whose items become blocks; every other child is a block, whole.
  Hugging Face's ``LlamaForCausalLM`` gives ``model.embed_tokens, model.rotary_emb,
  model.layers.0 .. model.layers.N-1, model.norm, lm_head``. The code between blocks (masks,
  position ids, a residual at the top level) is not a layer: a plan's stage runs it again for
  itself (:mod:`hetcoll.torch.replay`), and stage boundaries carry the blocks' outputs that
  cross the cut, whatever their structure.

  Blocks are listed in call order when the model brings example inputs of its own (Hugging
  Face's ``dummy_inputs``: a run on the meta device, no memory, no compute; for a vision model,
  whose ``dummy_inputs`` are token ids it does not take, an image of its configured size), or
  a module inside it does whose inputs its forward takes by name (a user's module around a
  Hugging Face model: MBart's ``layernorm_embedding``, registered after its layers, runs before
  them), else in the order the model registers them, which is the call order of nearly every
  model. That run also
  finds a block the forward calls more than once (ALBERT's one layer group, run once per
  layer): the module around it is then one block, not opened (ALBERT's encoder).

Either way the modules are the model's own, so their parameter names (and the state dict's keys)
stay the original ones.
"""

from __future__ import annotations

import inspect
import itertools
import operator
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import fx, nn
from torch.nn.utils.parametrize import ParametrizationList

from hetcoll.torch.replay import BlockCalledAgain, probe_first_that_runs, tensor_attributes_kept

__all__ = ["Call", "ModelCut", "model_cut", "model_layers"]


class _Input:
    """Stands for the previous layer's output in a :class:`Call`'s arguments."""

    def __repr__(self) -> str:
        return "<input>"

    def __deepcopy__(self, memo: dict[int, Any]) -> _Input:
        return self  # one marker: copies of a Call (made for every stage) keep finding it

    def __reduce__(self) -> str:
        return "_INPUT"


_INPUT = _Input()


class Call(nn.Module):
    """A function or method call of a traced forward as a layer: ``target(input, *args)`` with
    the previous layer's output in the place the graph had it."""

    def __init__(
        self, target: Callable[..., Any] | str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ):
        super().__init__()
        self.target = target
        self.args = args
        self.kwargs = kwargs

    def forward(self, x: torch.Tensor) -> Any:
        args = [x if a is _INPUT else a for a in self.args]
        kwargs = {k: x if v is _INPUT else v for k, v in self.kwargs.items()}
        if isinstance(self.target, str):
            obj, *rest = args
            return getattr(obj, self.target)(*rest, **kwargs)
        return self.target(*args, **kwargs)

    def extra_repr(self) -> str:
        name = self.target if isinstance(self.target, str) else getattr(self.target, "__name__", "")
        return f"{name}{self.args}" if not self.kwargs else f"{name}{self.args} {self.kwargs}"


class _TopLevel(fx.Tracer):
    """Keeps every direct child of the traced module whole (one call node each). Buffers
    are traced too (not read as constants), so that a forward that reads or updates its own
    buffers (a step counter, a decay kept as a buffer) is no chain: a chain's stages would
    hold a copy taken at tracing, and drop the updates."""

    proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return "." not in qualname


def _is_plain_sequential(m: nn.Module) -> bool:
    return isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward


@dataclass(frozen=True)
class ModelCut:
    """How a plan cuts a model (:func:`model_cut`): ``kind`` ``"chain"`` (a stage boundary
    carries one tensor) or ``"blocks"`` (stages replay the model's forward around their
    blocks: :mod:`hetcoll.torch.replay`), and the ``layers`` a Plan's ranges index."""

    kind: Literal["chain", "blocks"]
    layers: list[tuple[str, nn.Module]]


def model_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers of ``model`` in the order they run, as ``(name, module)``: a Plan's
    ``layers`` ranges index this list (see the module docs for chains and blocks). Names are
    the model's own module paths (calls traced out of a chain's forward get their graph
    node's name). The modules are the model's own, not copies.

    >>> [n for n, _ in model_layers(nn.Sequential(nn.Linear(4, 3), nn.ReLU()))]
    ['0', '1']
    """
    return model_cut(model).layers


def model_cut(model: nn.Module) -> ModelCut:
    """:func:`model_layers`' list and whether it is a chain or blocks (module docs)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: must be a torch.nn.Module, got {type(model).__name__}")
    if _is_plain_sequential(model):
        # Its calls, one per entry: named_children() would list a module held twice once.
        chain = [(n, m) for n, m in model._modules.items() if m is not None]
        if not chain:
            raise ValueError("model: an empty nn.Sequential has no layers")
        if _shared_between(chain) is None:
            return ModelCut("chain", chain)
    elif not any(isinstance(m, nn.ModuleList | nn.ModuleDict) for m in model.modules()):
        try:
            return ModelCut("chain", _chain(model))
        except ValueError:
            pass  # not a chain: its blocks
    # A block the forward calls more than once (ALBERT's layer group, run once per layer)
    # cannot be a stage's alone: the module around it that the forward calls once is a
    # block instead, whole (ALBERT's encoder).
    whole: set[int] = set()
    while True:
        blocks = _blocks(model, whole)
        if not blocks:
            raise ValueError(f"model: {type(model).__name__} has no child modules to cut between")
        try:
            return ModelCut("blocks", _in_call_order(model, blocks))
        except BlockCalledAgain as e:
            around = _opened_around(model, e.block)
            if around is None or id(around) in whole:
                raise
            whole.add(id(around))


def _repeated(m: nn.Module) -> bool:
    """A container of repeated blocks: a ModuleList or ModuleDict, or a plain Sequential of
    two or more children of one class."""
    children = list(m.children())
    if isinstance(m, ParametrizationList) or (
        children and all(isinstance(c, ParametrizationList) for c in children)
    ):  # a module's parametrizations (weight norm): part of that module, no blocks
        return False
    if isinstance(m, nn.ModuleList | nn.ModuleDict):
        return True
    if _is_plain_sequential(m):
        kinds = {type(c) for c in m.children()}
        return len(list(m.children())) >= 2 and len(kinds) == 1
    return False


def _opened_around(model: nn.Module, block: str) -> nn.Module | None:
    """The innermost module around ``block`` that :func:`_blocks` opens, neither the root
    nor a repeated container; None where there is none."""
    parts = block.split(".")
    for k in range(len(parts) - 1, 0, -1):
        m = model.get_submodule(".".join(parts[:k]))
        if not _repeated(m):
            return m
    return None


def _blocks(model: nn.Module, whole: AbstractSet[int] = frozenset()) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model`` (module docs); a module in ``whole`` (by id) is one block,
    not opened."""
    holds = {
        id(m)
        for m in model.modules()
        if id(m) not in whole and any(_repeated(d) for d in m.modules())
    }
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()  # a module registered under two paths is one block, by its first

    def add(path: str, m: nn.Module) -> None:
        if id(m) not in seen:
            seen.add(id(m))
            out.append((path, m))

    def items(container: nn.Module, path: str) -> None:
        # A repeated container's items, a container among them opened in turn (Funnel's
        # blocks: a ModuleList of ModuleLists its encoder iterates, never calls).
        for k, item in container.named_children():
            if isinstance(item, nn.ModuleList | nn.ModuleDict):
                items(item, f"{path}.{k}")
            else:
                add(f"{path}.{k}", item)

    def open_(m: nn.Module, prefix: str) -> None:
        for name, child in m.named_children():
            path = prefix + name
            if _repeated(child):
                items(child, path)
            elif id(child) in holds:
                open_(child, path + ".")
            else:
                add(path, child)

    open_(model, "")
    return out


def _in_call_order(
    model: nn.Module, blocks: list[tuple[str, nn.Module]]
) -> list[tuple[str, nn.Module]]:
    """``blocks`` in the order a forward of the model's own example inputs calls them (those
    it does not call last, less those of them holding tensors), or as they are when the model
    brings none."""
    example = _example_inputs(model)
    if example is None:
        return blocks
    names = [n for n, _ in blocks]
    examples = [dict(example)]
    if any(v.is_meta for v in example.values()):
        # A model built on the meta device makes its example there, where a forward that
        # reads a value (Hugging Face's sdpa masks: padding_mask.all()) fails: then ones of
        # its shapes on the CPU (valid token ids, a mask attending everywhere).
        examples.append({k: torch.ones(v.shape, dtype=v.dtype) for k, v in example.items()})
    try:
        with torch.no_grad():
            flow = probe_first_that_runs(model, blocks, examples)
    except BlockCalledAgain:
        raise  # cut otherwise (model_cut)
    except Exception:  # its example does not run: keep the registration order
        return blocks
    called = {names[k]: i for i, k in enumerate(flow.order)}
    glue = {names[k] for k in flow.glue}  # called at several places (Gemma 3's rotary)
    at = {n: i for i, (n, _) in enumerate(blocks)}

    # A module the forward never calls but whose tensors it reads (DeBERTa's rel_embeddings,
    # its weight read by the encoder's own code) is no block: its parameters lie outside
    # every block, on every stage, as the code between blocks that reads them does. One whose
    # tensors a called block holds (T5's shared embedding, tied to its stacks') stays, last.
    def tensors(m: nn.Module) -> set[int]:
        return {id(t) for t in itertools.chain(m.parameters(), m.buffers())}

    in_called = set().union(*(tensors(m) for n, m in blocks if n in called))
    kept = [b for b in blocks if b[0] in called or b[0] in glue or not tensors(b[1]) - in_called]
    return sorted(kept, key=lambda b: (called.get(b[0], len(blocks) + at[b[0]]), at[b[0]]))


def _example_inputs(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The model's own example inputs (Hugging Face's ``dummy_inputs``), or where it has none,
    those of the outermost module inside that has (a user's module around a Hugging Face
    model) that its forward takes by name: those of them its signature names (all, where it
    takes ``**kwargs``). None where there are none; a forward they do not run keeps the
    registration order (:func:`_in_call_order`)."""

    def own(m: nn.Module) -> dict[str, torch.Tensor] | None:
        example = getattr(m, "dummy_inputs", None)
        if not isinstance(example, Mapping) or not example:
            return None
        if not all(isinstance(v, torch.Tensor) for v in example.values()):
            return None
        return _images_of(m) or dict(example)

    found = own(model)
    if found is not None:
        return found
    inner = next((e for m in model.modules() if m is not model and (e := own(m))), None)
    if inner is None:
        return None
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return inner
    named = {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    taken = {k: v for k, v in inner.items() if k in named}
    return taken or None


def _images_of(m: nn.Module) -> dict[str, torch.Tensor] | None:
    """An image of ``m``'s configured size, for a Hugging Face vision model (its main input
    ``pixel_values``), whose own ``dummy_inputs`` are token ids it does not take: one image
    of ``config.image_size`` and ``config.num_channels``, zeros in the model's dtype, on its
    device (the meta device too). None for any other model."""
    config = getattr(m, "config", None)
    size = getattr(config, "image_size", None)
    if getattr(m, "main_input_name", None) != "pixel_values" or size is None:
        return None
    if isinstance(size, int):
        size = (size, size)
    if not (
        isinstance(size, list | tuple) and len(size) == 2 and all(isinstance(x, int) for x in size)
    ):
        return None
    channels = getattr(config, "num_channels", 3)
    weight = next((p for p in m.parameters() if p.is_floating_point()), None)
    if weight is None or not isinstance(channels, int):
        return None
    shape = (1, channels, *size)
    return {"pixel_values": torch.zeros(shape, dtype=weight.dtype, device=weight.device)}


def _chain(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """A model's top-level calls, if its traced graph is a chain of one-tensor calls."""
    try:
        with tensor_attributes_kept(model):  # a forward storing what it computed
            graph = _TopLevel().trace(model)
    except Exception as e:  # any tracing failure gets the same advice
        raise ValueError(
            f"model: {type(model).__name__} could not be traced into a chain of layers "
            f"({type(e).__name__}: {e}); give an nn.Sequential of its parts instead"
        ) from None
    children = dict(model.named_children())
    layers: list[tuple[str, nn.Module]] = []
    prev: fx.Node | None = None
    for node in graph.nodes:
        if node.op == "placeholder":
            if prev is not None:
                raise ValueError(
                    f"model: {type(model).__name__}.forward takes more than one input; a plan "
                    "runs models of one tensor input"
                )
            prev = node
            continue
        if node.op == "output":
            if node.args[0] is not prev:
                raise ValueError(
                    f"model: {type(model).__name__}'s output is not its last call's result"
                )
            break
        where = f"model: {type(model).__name__}'s call {node.name!r} ({node.op} {node.target})"
        if node.op == "get_attr":
            raise ValueError(
                f"{where} reads a parameter or buffer outside a child module, so the model is "
                "not a chain of layers; give an nn.Sequential of its parts instead"
            )
        if node.op == "call_function" and node.target is operator.getitem:
            raise ValueError(f"{where} indexes a result: stage boundaries must carry one tensor")
        used = [n for n in node.all_input_nodes]
        if used != [prev]:
            names = ", ".join(n.name for n in used) or "nothing"
            raise ValueError(
                f"{where} reads {names}, not just the previous call's output, so the model is "
                "not a chain of layers (a residual or branch at the top level); give an "
                "nn.Sequential of its parts instead"
            )
        if node.op == "call_module":
            if node.args != (prev,) or node.kwargs:
                raise ValueError(f"{where} passes more than the previous output to a child")
            layers.append((str(node.target), children[str(node.target)]))
        else:
            args = tuple(_INPUT if a is prev else a for a in node.args)
            kwargs = {k: _INPUT if v is prev else v for k, v in node.kwargs.items()}
            if any(isinstance(a, fx.Node) for a in (*args, *kwargs.values())):
                raise ValueError(f"{where} nests the previous output inside an argument")
            target: Callable[..., Any] | str = node.target  # type: ignore[assignment]
            layers.append((node.name, Call(target, args, kwargs)))
        prev = node
    if not layers:
        raise ValueError(f"model: {type(model).__name__} has no layers")
    shared = _shared_between(layers)
    if shared is not None:
        raise ValueError(f"model: {type(model).__name__} {shared}, so it is no chain of layers")
    return layers


def _shared_between(layers: list[tuple[str, nn.Module]]) -> str | None:
    """What two of a chain's ``layers`` share, or None: the same module called twice, or a
    parameter or buffer held by two (tied weights). A chain's stages copy their layers one by
    one, which would part them, so such a model is cut by its blocks (whose runtime keeps a
    tied weight one and sums its gradients, and refuses a block called twice)."""
    owner: dict[int, str] = {}
    for name, m in layers:
        if id(m) in owner:
            return f"calls {owner[id(m)]!r} again as {name!r}"
        owner[id(m)] = name
    held: dict[int, str] = {}
    for name, m in layers:
        for t in (*m.parameters(), *m.buffers()):
            if held.setdefault(id(t), name) != name:
                return f"ties a tensor of {held[id(t)]!r} to {name!r}"
    return None
