"""Which layers filter parallelism splits and in which mode: the runs (chains) of modules known
to feed each other in order (plain nn.Sequential children, and what torch.fx finds in a traced
forward), the chain pairing rule over them (:func:`chain_filter_modes`, :func:`plan_modes`)
and the choice of layers (:func:`choose_layers`: tied weights stay replicated). It reads module
types and sizes only, so a model on the meta device works."""

from __future__ import annotations

import inspect
import math
import re
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from hetcoll.torch.filters.dora import is_dora_layer
from hetcoll.torch.filters.experts import ExpertsLayout, experts_layout
from hetcoll.torch.filters.layers import is_conv1d
from hetcoll.torch.replay import tensor_attributes_kept

#: Modules that act on each channel (or element) on its own, so a channel-split tensor can pass
#: through them unchanged: nothing needs gathering before them (the filter-parallel pairing rule
#: and the owners stages of hetcoll.torch.placement both read this list) ...
ELEMENTWISE_MODULES = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Tanh,
    nn.Sigmoid,
    nn.Hardtanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Softplus,
    nn.Identity,
    nn.Dropout,
)
#: ... and those that do so on 2-D feature maps (after a convolution).
SPATIAL_MODULES = (
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
    nn.Dropout2d,
)


@dataclass(frozen=True)
class Excitation:
    """A squeeze-and-excitation in a run (torchvision's ``SqueezeExcitation``, EfficientNet's
    and MobileNetV3's): ``x * gate(expand(act(reduce(mean(x)))))``, with ``reduce`` and
    ``expand`` 1x1 convolutions (by name) over ``channels`` channels and the mean global.
    On a channel-split ``x`` it needs no gather: ``reduce`` sums its split input (split-input),
    ``expand`` computes the rank's own channels' gates (split-output, by the shares of the
    layer whose output ``x`` is), each rank scales its own channels."""

    reduce: str
    expand: str
    channels: int


Chain = list[tuple[str, "nn.Module | Excitation"]]


@dataclass
class Traced:
    """What a module's traced forward shows: its runs (:func:`_traced_chains`) and the
    splittable layers whose parameters it reads itself instead of calling the layer (a
    functional ``F.linear(x, self.qkv.weight)``, torchvision Swin's attention): a split of
    such a layer would hand that code its slice."""

    chains: list[Chain]
    reads: list[str]
    #: the run, when the whole forward is one from its input to its output (an inverted
    #: residual block without its residual): a run around the module goes on through it
    through: Chain | None = None


def _chains(
    module: nn.Module,
    prefix: str = "",
    untraced: list[str] | None = None,
    traced_cache: dict[tuple[int, str], Traced | str] | None = None,
    reads: list[str] | None = None,
) -> Iterator[Chain]:
    """Runs of modules known to feed each other in order, and nothing else: the children of
    plain nn.Sequential containers (nested ones flattened), and inside a module with its own
    forward the runs torch.fx finds in its traced graph (:func:`_traced_chains`). A module whose
    forward cannot be traced breaks a run — its dataflow is unknown — and its insides are
    searched for runs of their own; its name goes to ``untraced``. ``traced_cache``: traces
    already made of these modules, by (module id, prefix), to read and add to (one caller
    asking about the same unchanged modules several times)."""
    if _is_plain_sequential(module):
        chain: Chain = []
        inner: list[tuple[str, nn.Module]] = []
        _flatten(module, prefix, chain, inner)
        opened = {name for name, _ in inner}
        spliced: Chain = []
        for name, m in chain:
            if name in opened and isinstance(m, nn.Module):
                t = _traced(m, name, traced_cache)
                if isinstance(t, Traced) and t.through is not None:
                    spliced.extend(t.through)
                    opened.discard(name)
                    if reads is not None:
                        reads.extend(t.reads)
                        reads.extend(_method_reads(m, name))
                    continue
            spliced.append((name, m))
        yield spliced
        for name, m in inner:
            if name in opened:
                yield from _chains(m, name, untraced, traced_cache, reads)
        return
    if next(module.children(), None) is None:
        return
    traced = _traced(module, prefix, traced_cache)
    if isinstance(traced, Traced):
        if reads is not None:
            reads.extend(traced.reads)
            reads.extend(_method_reads(module, prefix))
        yield from traced.chains
        return
    if untraced is not None:
        untraced.append(f"{prefix or type(module).__name__} ({traced})")
    if reads is not None:
        reads.extend(_source_reads(module, prefix))
    for name, child in module.named_children():
        full = f"{prefix}.{name}" if prefix else name
        yield from _chains(child, full, untraced, traced_cache, reads)


def _traced(
    module: nn.Module, prefix: str, cache: dict[tuple[int, str], Traced | str] | None
) -> Traced | str:
    """:func:`_traced_chains`, read from and added to ``cache`` when one is given."""
    if cache is None:
        return _traced_chains(module, prefix)
    key = (id(module), prefix)
    if key not in cache:
        cache[key] = _traced_chains(module, prefix)
    return cache[key]


# Functions and tensor methods a traced forward may call on a channel-split tensor, as the
# module that does the same (one instance each: the pairing rule reads only their types); the
# tensor split's MLP rule (.tensor_split) reads the elementwise ones too.
_RELU, _POOL, _FLATTEN = nn.ReLU(), nn.MaxPool2d(1), nn.Flatten()
ELEMENTWISE_FUNCTIONS = {
    F.relu, F.relu6, F.leaky_relu, F.elu, F.selu, F.celu, F.gelu, F.silu, F.mish, F.hardtanh,
    F.hardswish, F.hardsigmoid, F.softplus, F.dropout, torch.relu, torch.tanh, torch.sigmoid,
}  # fmt: skip
_SPATIAL_FUNCTIONS = {
    F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d, F.dropout2d,
    torch.max_pool2d,
}  # fmt: skip
ELEMENTWISE_METHODS = {"relu", "relu_", "tanh", "sigmoid"}


def _as_module(node: Any, named: dict[str, nn.Module]) -> nn.Module | None:
    """The module a traced node stands for in the pairing rule, or None when it is none of the
    channel-wise operations the rule knows (that breaks a run)."""
    if node.op == "call_module":
        return named[node.target]
    args = list(node.args[1:]) + list(node.kwargs.values())
    if node.op == "call_function":
        if node.target in ELEMENTWISE_FUNCTIONS:
            return _RELU
        if node.target in _SPATIAL_FUNCTIONS:
            return _POOL
        if node.target is torch.flatten and args in ([1], [1, -1]):
            return _FLATTEN
    if node.op == "call_method":
        if node.target in ELEMENTWISE_METHODS:
            return _RELU
        if node.target == "flatten" and args in ([1], [1, -1]):
            return _FLATTEN
    return None


def _has_state(m: nn.Module) -> bool:
    return any(True for _ in m.parameters()) or any(True for _ in m.buffers())


#: ``self.<child>.weight`` (or ``.bias``) in a module's code used whole as a tensor: an operand
#: of ``@``, or an argument (Mamba's ``self.dt_proj.weight @ time_step``, a fused kernel given
#: ``self.out_proj.weight``); not read for its metadata (``self.q_proj.weight.dtype``), type
#: (``isinstance``, dropped first) or rows (BLOOM's ``self.dense.weight[:, ...]``, a path of
#: its pretraining's tensor parallelism).
_SOURCE_READ = re.compile(
    r"self\.(\w+)\.(?:weight|bias)\s*(?=[@,)])|@\s*self\.(\w+)\.(?:weight|bias)\b(?!\s*[.\[])"
    # a method of the weight's values (Gemma 3n's ``self.correction_coefs.weight.clamp(...)``),
    # not of its metadata
    r"|self\.(\w+)\.(?:weight|bias)\.(?!(?:shape|dtype|device|size|dim|ndim|numel|nelement"
    r"|element_size|stride|requires_grad|data|grad|is_\w+)\b)\w+"
)
_TYPE_TEST = re.compile(r"isinstance\(\s*self\.\w+\.(?:weight|bias)\s*,")


def _source_reads(module: nn.Module, prefix: str) -> list[str]:
    """The children of ``module`` (a module whose forward torch.fx cannot trace) whose
    parameters its class's code reads itself (Hugging Face Mamba's ``self.dt_proj.weight @
    time_step``), by name, as a trace would show them: read off the source of its class's
    methods (any of them: the forward may call another, a fused kernel's path among them).
    None where the source cannot be read (an empty list), and none for torch's own modules,
    whose weights their fast paths read (``nn.MultiheadAttention``'s ``out_proj``,
    ``nn.TransformerEncoderLayer``'s MLP), which rules of their own split."""
    return _present(_names_read(type(module), methods=False), module, prefix)


def _method_reads(module: nn.Module, prefix: str) -> list[str]:
    """:func:`_source_reads` of the methods of ``module``'s class other than ``forward`` and
    ``__init__``, for a module whose forward torch.fx traced: its parent may call them
    instead (Gemma 3n's AltUp: ``altup.correct(...)``, which reads
    ``self.correction_coefs.weight`` in training), and no trace saw them."""
    return _present(_names_read(type(module), methods=True), module, prefix)


#: What :func:`_names_read` found, by class: a split meets each class of a model once per
#: block, in every probe of its plan (a third of a Hugging Face model's split time, before).
_READ: dict[bool, weakref.WeakKeyDictionary[type, frozenset[str]]] = {
    False: weakref.WeakKeyDictionary(),
    True: weakref.WeakKeyDictionary(),
}


def _code_of(cls: type, methods: bool) -> list[Any]:
    """What :func:`_names_read` reads the source of: the functions of ``cls``'s own body
    (methods, static and class methods, properties' accessors), each unwrapped from its
    decorators, or with ``methods`` those but ``forward`` and ``__init__``. A function's
    source is found from its first line, where the whole class's is found by parsing its
    file (Python before 3.13: tens of milliseconds for a Hugging Face modeling file, each
    class). Without ``methods``, ``[cls]`` where one is no code of the class's own (a
    decorator without ``functools.wraps``): the class's text still holds it."""
    found: list[Any] = []
    for name, value in vars(cls).items():
        if methods and name in ("forward", "__init__"):
            continue
        if isinstance(value, property):
            parts = [value.fget, value.fset, value.fdel]
        else:
            parts = [getattr(value, "__func__", value)]  # a static or class method's function
        for f in parts:
            if not inspect.isfunction(f):
                continue
            f = inspect.unwrap(f)
            own = getattr(f, "__qualname__", "").startswith(cls.__qualname__ + ".")
            if not own and not methods:
                return [cls]
            found.append(f)
    return found


def _names_read(cls: type, methods: bool) -> frozenset[str]:
    """The attribute names whose weights the code of class ``cls`` uses whole
    (:data:`_SOURCE_READ`): in the whole class, or (``methods``) in its methods other than
    ``forward`` and ``__init__``; none for torch's own classes or unreadable source."""
    cache = _READ[methods]
    if cls in cache:
        return cache[cls]
    sources = []
    if cls.__module__.split(".")[0] != "torch":
        for f in _code_of(cls, methods):
            try:
                sources.append(inspect.getsource(f))
            except (OSError, TypeError):
                continue
    found = frozenset(
        a or b or c
        for source in sources
        for a, b, c in _SOURCE_READ.findall(_TYPE_TEST.sub("", source))
    )
    cache[cls] = found
    return found


def _present(found: frozenset[str], module: nn.Module, prefix: str) -> list[str]:
    """The names of ``found`` that are children of ``module``, under ``prefix``."""
    children = dict(module.named_children())
    return [f"{prefix}.{n}" if prefix else n for n in sorted(found) if n in children]


def has_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class defines a forward (containers such as nn.ModuleList and
    nn.ModuleDict do not: their parents call their children). Tracing one would only raise,
    after torch.fx's patching of every module class, milliseconds each time."""
    return type(module).forward is not nn.Module.forward


def _traced_chains(module: nn.Module, prefix: str) -> Traced | str:
    """The runs of :func:`_chains` in ``module``'s forward, read off its torch.fx graph: a run
    continues from one operation to the next while the next is the only user of the first's
    output and reads nothing else, so a channel-split tensor between them is seen by no one
    else. A module with parameters or buffers called from more than one place breaks runs (it
    would need two modes); a stateless one (a ReLU used twice) does not.
    Returns why when the forward cannot be traced (data-dependent control flow, say)."""
    from torch import fx

    if not has_forward(module):
        return "it has no forward of its own"
    try:
        with tensor_attributes_kept(module):  # a forward storing what it computed
            graph = fx.Tracer().trace(module)
    except Exception as e:  # fx raises many kinds on untraceable code; the reason is reported
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    named = dict(module.named_modules())
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1

    def element(node: Any) -> tuple[str, nn.Module] | None:
        if node.op == "call_module" and calls[node.target] > 1 and _has_state(named[node.target]):
            return None
        m = _as_module(node, named)
        if m is None:
            return None
        name = node.target if node.op == "call_module" else f"<{node.name}>"
        return (f"{prefix}.{name}" if prefix else name), m

    chains: list[Chain] = []
    reads = sorted(
        {
            f"{prefix}.{owner}" if prefix else owner
            for node in graph.nodes
            if node.op == "get_attr"
            and (owner := str(node.target).rpartition(".")[0]) in named
            and splittable(named[owner])
            and _traced_in(node) != owner  # not its own forward, traced through (a Conv1D)
            and not _metadata_only(node)
        }
    )
    seen: set[Any] = set()
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    computed = [n for n in graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    result = next(n for n in graph.nodes if n.op == "output").args
    through = None
    for node in graph.nodes:
        chain: Chain = []
        first, before = node, len(seen)
        last = node
        while node not in seen and (el := element(node)) is not None:
            seen.add(node)
            chain.append(el)
            last = node
            users = list(node.users)
            # x -> mean -> reduce -> act -> expand -> gate -> x * gate: the run goes on
            # after the product, the excitation one element of it
            found = _excitation(node, named, calls) if len(users) == 2 else None
            if found is not None:
                se, branch, node = found
                seen.update(branch)
                seen.add(node)
                last = node
                where = f"{prefix}.{se.reduce}" if prefix else se.reduce
                chain.append((f"<{where}>", _prefixed(se, prefix)))
                users = list(node.users)
            if len(users) != 1 or users[0].all_input_nodes != [node]:
                break
            node = users[0]
        if chain:
            chains.append(chain)
            if (
                len(inputs) == 1
                and list(inputs[0].users) == [first]
                and first.all_input_nodes == inputs
                and result == (last,)
                and len(seen) - before == len(computed)
            ):
                through = chain
    return Traced(chains, reads, through)


def _one_operation(module: nn.Module) -> nn.Module | None:
    """The module of the pairing rule that a stateless module of a class of its own stands
    for, when its traced forward is one known channel-wise operation on its input (a Plan's
    layer calling ``torch.flatten(x, 1)``, :class:`hetcoll.torch.layers.Call`; a user's
    ``Flatten``), else None."""
    from torch import fx

    if type(module).__module__.split(".")[0] == "torch" or _has_state(module):
        return None
    if next(module.children(), None) is not None:
        return None
    try:
        graph = fx.Tracer().trace(module)
    except Exception:  # fx raises many kinds on untraceable code: not one then
        return None
    nodes = list(graph.nodes)
    computed = [n for n in nodes if n.op in ("call_function", "call_method")]
    inputs = [n for n in nodes if n.op == "placeholder"]
    if (
        len(computed) != 1
        or len(inputs) != 1
        or computed[0].all_input_nodes != inputs
        or nodes[-1].args != (computed[0],)
    ):
        return None
    return _as_module(computed[0], {})


def _prefixed(se: Excitation, prefix: str) -> Excitation:
    if not prefix:
        return se
    return Excitation(f"{prefix}.{se.reduce}", f"{prefix}.{se.expand}", se.channels)


def _global_mean(node: Any, named: dict[str, nn.Module]) -> bool:
    """Whether ``node`` averages a 4-D tensor over its whole map, keeping its dimensions
    (``nn.AdaptiveAvgPool2d(1)``, ``F.adaptive_avg_pool2d(x, 1)``, ``x.mean((2, 3),
    keepdim=True)``)."""
    if node.op == "call_module":
        m = named[node.target]
        return isinstance(m, nn.AdaptiveAvgPool2d) and m.output_size in (1, (1, 1))
    args = list(node.args[1:])
    if node.op == "call_function" and node.target is F.adaptive_avg_pool2d:
        size = args[0] if args else node.kwargs.get("output_size")
        return size in (1, (1, 1), [1, 1])
    if node.op == "call_method" and node.target == "mean":
        dims = args[0] if args else node.kwargs.get("dim")
        keep = args[1] if len(args) > 1 else node.kwargs.get("keepdim", False)
        return keep is True and dims in ((2, 3), [2, 3], (-2, -1), [-2, -1])
    return False


def _is_product(node: Any) -> bool:
    import operator

    return (
        (
            (node.op == "call_function" and node.target in (operator.mul, torch.mul))
            or (node.op == "call_method" and node.target == "mul")
        )
        and len(node.args) == 2
        and not node.kwargs
    )


def _excitation(
    x: Any, named: dict[str, nn.Module], calls: dict[str, int]
) -> tuple[Excitation, list[Any], Any] | None:
    """The squeeze-and-excitation reading traced node ``x`` (:class:`Excitation`): its
    branch's nodes and the product node, or None. The branch must be a global mean, a 1x1
    convolution (``groups=1``, no padding) from ``x``'s channels, element-wise operations, a
    1x1 convolution back to them and element-wise operations, each node's output read by the
    next alone; the product multiplies ``x`` by the branch's end."""
    users = list(x.users)
    for start, product in (users, users[::-1]):
        if not _is_product(product) or x not in product.args or not _global_mean(start, named):
            continue
        branch, convs, node = [start], [], start
        while True:
            after = list(node.users)
            if after == [product]:
                node = product
                break
            if len(after) != 1 or after[0].all_input_nodes != [node]:
                break
            node = after[0]
            if node.op == "call_module" and type(named[node.target]) is nn.Conv2d:
                if calls[node.target] > 1:
                    break
                convs.append(node.target)
            elif not isinstance(_as_module(node, named), ELEMENTWISE_MODULES):
                break
            branch.append(node)
        end = branch[-1]
        if node is not product or set(product.args) != {x, end} or x is end or len(convs) != 2:
            continue
        reduce, expand = (named[c] for c in convs)
        assert isinstance(reduce, nn.Conv2d) and isinstance(expand, nn.Conv2d)
        if (
            all(
                c.kernel_size == (1, 1) and c.groups == 1 and c.padding in ((0, 0), "valid")
                for c in (reduce, expand)
            )
            and reduce.out_channels == expand.in_channels
            and reduce.in_channels == expand.out_channels
            and branch[1].target == convs[0]  # the mean feeds the first convolution
            and isinstance(_as_module(end, named), ELEMENTWISE_MODULES)  # the gate
        ):
            return Excitation(convs[0], convs[1], reduce.in_channels), branch, product
    return None


def _excitation_module(module: nn.Module, prefix: str) -> Excitation | None:
    """``module`` as an :class:`Excitation` (named under ``prefix``) when its forward, traced,
    is one and nothing else: its input, the branch, the product returned."""
    from torch import fx

    convs = [m for m in module.modules() if type(m) is nn.Conv2d]
    if len(convs) != 2 or any(
        True for m in module.modules() if m not in convs for _ in m.parameters(recurse=False)
    ):
        return None
    try:
        with tensor_attributes_kept(module):
            graph = fx.Tracer().trace(module)
    except Exception:  # fx raises many kinds on untraceable code: not one then
        return None
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1 or len(inputs[0].users) != 2:
        return None
    named = dict(module.named_modules())
    calls: dict[str, int] = {}
    for n in nodes:
        if n.op == "call_module":
            calls[n.target] = calls.get(n.target, 0) + 1
    found = _excitation(inputs[0], named, calls)
    if found is None or nodes[-1].op != "output" or nodes[-1].args != (found[2],):
        return None
    return _prefixed(found[0], prefix)


def _metadata_only(node: Any) -> bool:
    """Whether a ``get_attr`` node's tensor is used for nothing but its metadata (T5's
    ``self.wo.weight.dtype``), or not at all: no read of its values."""
    import builtins

    return all(
        u.op == "call_function"
        and u.target is builtins.getattr
        and u.args[1] in ("dtype", "shape", "device", "is_cuda")
        for u in node.users
    )


def experts_adapters(named: dict[str, nn.Module], name: str) -> dict[str, str] | None:
    """The PEFT wrappers around experts module ``name`` of ``named`` (outermost first), each
    with its factor that the split slices, where each is LoRA on one of the parameters the
    experts' split by hidden units slices (:func:`lora_on_experts`): they split with it. None
    where another wrapper is around it."""
    experts = named[name]
    layout = experts_layout(experts)
    if not isinstance(layout, ExpertsLayout):
        return None
    parts = name.split(".")
    chain = {}
    for k in range(1, len(parts)):
        outer = ".".join(parts[:k])
        m = named.get(outer)
        if m is None or not _peft_wrapper(m):
            continue
        factor = lora_on_experts(m, experts, layout)
        if factor is None:
            return None
        chain[outer] = factor
    return chain


def lora_on_experts(m: nn.Module, experts: nn.Module, layout: ExpertsLayout) -> str | None:
    """Where ``m`` is PEFT's LoRA on a 3-D parameter of ``experts`` (``ParamWrapper``: the
    parameter made ``W + scaling * B A`` per expert during each forward) that the experts'
    split by hidden units (``layout``) slices, plain (no variant), enabled and not merged, no
    hooks of the user's: which factor holds the parameter's split dimension, ``"lora_B"``
    (its output features: B's rows) or ``"lora_A"`` (its input features: A's columns, in one
    block). Else None."""
    name = lora_on_stacked(m, experts)
    spec = None if name is None else layout.params.get(name)
    if spec is None:
        return None
    # PEFT's delta per expert is (out, in) where the parameter is stored (experts, out, in)
    # (Hugging Face's layout, unless the module says is_transposed), else (experts, in, out).
    dim, blocks = spec
    transposed = bool(getattr(experts, "is_transposed", False))
    if (dim == 1) != transposed:
        return "lora_B"
    return "lora_A" if tuple(blocks) == (1,) else None


def lora_on_stacked(m: nn.Module, experts: nn.Module) -> str | None:
    """The name of the parameter of ``experts`` that ``m`` adapts, where ``m`` is PEFT's plain
    LoRA on a 3-D parameter stacked by expert (``ParamWrapper``: the parameter made
    ``W + scaling * B A`` per expert during each forward, A's rows and B's columns a block of
    the adapter rank per expert), enabled and not merged, no bias on its factors, no hooks of
    the user's; else None."""
    cls = type(m)
    if cls.__name__ != "ParamWrapper" or cls.__module__ != "peft.tuners.lora.layer":
        return None
    get_base = getattr(m, "get_base_layer", None)
    if not callable(get_base) or get_base() is not experts or forward_changed(m) is not None:
        return None
    name = str(getattr(m, "parameter_name", ""))
    param = getattr(experts, name, None)
    if not isinstance(param, torch.Tensor) or param.dim() != 3:
        return None
    if getattr(m, "num_experts", None) != param.shape[0]:
        return None
    if any(v is not None for v in (getattr(m, "lora_variant", None) or {}).values()):
        return None
    adapters = _enabled_adapters(m)
    if adapters is None or any(x.bias is not None for x in adapters):
        return None
    return name


def stacked_adapters(named: dict[str, nn.Module], name: str) -> list[str] | None:
    """The PEFT wrappers around experts module ``name`` of ``named`` (outermost first), where
    each is LoRA on one of its parameters stacked by expert (:func:`lora_on_stacked`): their
    factors hold a block per expert, which expert parallelism places with the experts. None
    where another wrapper is around it."""
    experts = named[name]
    parts = name.split(".")
    chain = []
    for k in range(1, len(parts)):
        outer = ".".join(parts[:k])
        m = named.get(outer)
        if m is None or not _peft_wrapper(m):
            continue
        if lora_on_stacked(m, experts) is None:
            return None
        chain.append(outer)
    return chain


def _peft_wrapper(m: nn.Module) -> bool:
    """Whether ``m`` is a PEFT tuner's wrapper of a layer (a ``base_layer`` beside its
    adapters)."""
    return type(m).__module__.startswith("peft.tuners.") and isinstance(
        getattr(m, "base_layer", None), nn.Module
    )


def inside_unknown_adapters(named: dict[str, nn.Module]) -> dict[str, str]:
    """The modules of ``named`` inside a PEFT wrapper :func:`unknown_adapter` keeps whole, by
    name, with the wrapper and why."""
    wrappers = {n: why for n, m in named.items() if (why := unknown_adapter(m)) is not None}
    out: dict[str, str] = {}
    if not wrappers:
        return out
    for n in named:
        parts = n.split(".")
        # Its ancestors, outermost first: a wrapper inside a wrapper is named by the outer one.
        outer = next(
            (a for k in range(1, len(parts)) if (a := ".".join(parts[:k])) in wrappers), None
        )
        if outer is not None:
            out[n] = f"{outer!r}: {wrappers[outer]}"
    return out


def _traced_in(node: Any) -> str | None:
    """The path of the module whose forward ``node`` was traced in (the innermost), if any."""
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else None


def splittable(m: nn.Module) -> bool:
    """Whether filter parallelism can split layer ``m``: a linear layer (``nn.Linear``,
    Hugging Face's ``Conv1D``) or an ``nn.Conv2d`` with ``groups=1``, computing its kind's
    forward on its own weights alone (:func:`forward_changed`)."""
    return linear_features(m) is not None or (
        type(m) is nn.Conv2d and m.groups == 1 and forward_changed(m) is None
    )


def forward_changed(m: nn.Module) -> str | None:
    """Why layer ``m`` computes more than its kind's forward on its own parameters, which a
    split layer (the kind's forward on its slices) would not, as what it has:
    ``"parametrizations"`` (``torch.nn.utils.parametrize``: weight or spectral norm,
    orthogonal), ``"a weight made by a hook"`` (the hook-based
    ``torch.nn.utils.spectral_norm`` and ``weight_norm``: its ``weight`` is no parameter of
    its own but computed before each forward) or ``"forward hooks"`` (the user's, which may
    change its inputs or output); else None. Hugging Face's output recorders, hooks that
    only record an output, do not count."""
    if hasattr(m, "parametrizations"):
        return "parametrizations"
    for hooks in (m._forward_pre_hooks, m._forward_hooks):
        for hook in hooks.values():
            if isinstance(hook, (SpectralNorm, WeightNorm)):
                return "a weight made by a hook"
            code = getattr(hook, "__module__", None) or ""
            if not code.startswith("transformers.utils.output_capturing"):
                return "forward hooks"
    return None


def _is_plain_sequential(m: nn.Module) -> bool:
    return isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward


def _flatten(
    seq: nn.Module,
    prefix: str,
    chain: Chain,
    inner: list[tuple[str, nn.Module]],
) -> None:
    for name, child in seq.named_children():
        full = f"{prefix}.{name}" if prefix else name
        if _is_plain_sequential(child):
            _flatten(child, full, chain, inner)
        elif (se := _excitation_module(child, full)) is not None:
            chain.append((f"<{full}>", se))  # its layers split with the run, or as a pair
        elif (op := _one_operation(child)) is not None:
            chain.append((full, op))  # a plan's ``torch.flatten(x, 1)`` layer, say
        else:
            chain.append((full, child))
            if next(child.children(), None) is not None:
                inner.append((full, child))


def linear_features(m: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` features of a linear layer filter parallelism can split (``nn.Linear``,
    a subclass whose forward computes what ``nn.Linear``'s does: :func:`computes_linear`;
    Hugging Face's ``Conv1D``), else None."""
    if isinstance(m, nn.Linear) and computes_linear(m):
        return m.in_features, m.out_features
    if is_conv1d(m):
        return int(m.nx), int(m.nf)  # type: ignore[arg-type]
    return None


def lora_base(m: nn.Module) -> nn.Module | None:
    """The base layer of ``m`` where ``m`` is PEFT's LoRA wrapper of a linear layer
    (``peft.tuners.lora.layer.Linear``: ``base_layer(x) + lora_B(lora_A(dropout(x))) *
    scaling`` per adapter) that an attention or MLP split by heads or hidden units splits with
    its adapters: a base layer filter parallelism splits (:func:`linear_features`), every
    adapter plain LoRA or DoRA (``nn.Linear`` A and B; no other variant), none merged into the
    base, adapters enabled, no hooks of the user's; else None. PEFT is not imported: a model
    holding such a wrapper imported it."""
    cls = type(m)
    if cls.__name__ != "Linear" or cls.__module__ != "peft.tuners.lora.layer":
        return None
    base = getattr(m, "base_layer", None)
    if not isinstance(base, nn.Module) or linear_features(base) is None:
        return None
    if _enabled_adapters(m) is None:
        return None
    variants = getattr(m, "lora_variant", None) or {}
    dora = getattr(m, "use_dora", None) or {}
    names = [a for a, _ in m.get_submodule("lora_A").named_children()]
    if not all(_plain_or_dora(m, a, variants.get(a), dora.get(a)) for a in names):
        return None
    return base if forward_changed(m) is None else None


#: An adapter's B layer inside PEFT's LoRA wrapper: ``<wrapper>.lora_B.<adapter>``.
_LORA_B = re.compile(r"^(?P<wrapper>.+)\.lora_B\.[^.]+$")


def summed_before_gathering(modes: Mapping[str, str], names: Collection[str]) -> dict[str, str]:
    """The gathering layers whose outputs are added to another's before a single gather, by
    name -> the other's: each ``lora_B`` of PEFT's LoRA wrapper whose base layer
    (``<wrapper>.base_layer``) gathers too (a head split alone, outside attentions and MLPs).
    Split alike, the wrapper adds their pieces and gathers the sum once
    (:class:`~.split_output.SplitOutput`), not each output. A DoRA wrapper (a
    ``<wrapper>.lora_magnitude_vector.<adapter>`` among ``names``, the model's module names)
    scales the base output and the adapters' apart: each is gathered. The runtime's rule and
    the performance model's (which also need the two split alike)."""
    out = {}
    dora = {
        n.rsplit(".lora_magnitude_vector.", 1)[0] for n in names if ".lora_magnitude_vector." in n
    }
    for name, mode in modes.items():
        found = _LORA_B.match(name)
        if mode != "gather" or found is None or found["wrapper"] in dora:
            continue
        base = f"{found['wrapper']}.base_layer"
        if modes.get(base) == "gather":
            out[name] = base
    return out


def _enabled_adapters(m: nn.Module) -> list[nn.Module] | None:
    """The A and B adapters of PEFT's LoRA wrapper ``m`` where each is a plain ``nn.Linear``
    without hooks of the user's, every adapter has both, and they are enabled and not merged
    into the base layer; else None."""
    lora_a, lora_b = getattr(m, "lora_A", None), getattr(m, "lora_B", None)
    if not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
        return None
    if set(lora_a) != set(lora_b) or not len(lora_a):
        return None
    adapters = [*lora_a.values(), *lora_b.values()]
    if any(type(x) is not nn.Linear or forward_changed(x) is not None for x in adapters):
        return None
    if getattr(m, "merged", True) or getattr(m, "disable_adapters", True):
        return None
    return adapters


def _plain_or_dora(m: nn.Module, adapter: str, variant: object, dora: object) -> bool:
    """Whether adapter ``adapter`` of LoRA wrapper ``m`` is plain LoRA or PEFT's own DoRA
    (its variant and its layer PEFT's, no bias on ``lora_B``: the split's
    :class:`~.dora.FilterParallelDoRA` computes its weight norm)."""
    if variant is None and not dora:
        return True
    if not dora or type(variant).__name__ != "DoraLinearVariant":
        return False
    if type(variant).__module__ != "peft.tuners.lora.variants":
        return False
    layers = getattr(m, "lora_magnitude_vector", None)
    layer = layers[adapter] if isinstance(layers, nn.ModuleDict) and adapter in layers else None
    return (
        layer is not None
        and is_dora_layer(layer)
        and forward_changed(layer) is None
        and m.get_submodule(f"lora_B.{adapter}").bias is None
    )


def unknown_adapter(m: nn.Module) -> str | None:
    """Why the layers inside ``m`` stay whole, where ``m`` is a PEFT tuner's wrapper of a layer
    (a ``base_layer`` beside its adapters) that :func:`lora_base` does not split with its
    block: a variant other than DoRA, adapters merged into the base or disabled (a split layer
    would unmerge and re-enable against a slice). Else None."""
    if not _peft_wrapper(m):
        return None
    if lora_base(m) is not None:
        return None
    if getattr(m, "merged", False):
        return "its adapters merged into the base layer"
    if getattr(m, "disable_adapters", False):
        return "its adapters disabled"
    return f"{type(m).__name__}, a PEFT wrapper the split does not know"


def projection_features(m: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` features of a projection an attention or MLP split by heads or hidden
    units splits: a linear layer (:func:`linear_features`), or PEFT's LoRA wrapper of one
    (:func:`lora_base`), split with its adapters."""
    features = linear_features(m)
    if features is None and (base := lora_base(m)) is not None:
        return linear_features(base)
    return features


# (class, has a bias) -> whether such a layer's traced forward is nn.Linear's computation.
_LINEAR_FORWARDS: dict[tuple[type, bool], bool] = {}


def computes_linear(m: nn.Linear) -> bool:
    """Whether an ``nn.Linear`` (or subclass) computes ``x @ weight.T + bias`` and holds
    nothing else, so that a split layer computing ``F.linear`` on its slices can stand in for
    it: ``nn.Linear`` itself, a subclass keeping its forward (torch's
    ``NonDynamicallyQuantizableLinear``), or one whose forward traces (``torch.fx``) to
    ``F.linear(x, weight, bias)`` or to ``x @ weight.T`` plus ``bias`` (Falcon's
    ``FalconLinear``), with no parameters but those, no buffers and no submodules. A
    quantised or adapter layer computes something else and stays replicated."""
    if forward_changed(m) is not None:
        return False
    cls = type(m)
    if cls is nn.Linear:
        return True
    own = {n for n, _ in m.named_parameters(recurse=False)}
    if not own <= {"weight", "bias"} or next(m.buffers(), None) is not None:
        return False
    if next(m.children(), None) is not None:
        return False
    if cls.forward is nn.Linear.forward:
        return True
    key = (cls, m.bias is not None)
    if key not in _LINEAR_FORWARDS:
        _LINEAR_FORWARDS[key] = _traces_to_linear(m)
    return _LINEAR_FORWARDS[key]


def _traces_to_linear(m: nn.Linear) -> bool:
    import operator

    from torch import fx

    try:
        with tensor_attributes_kept(m):  # a forward updating its buffers
            graph = fx.symbolic_trace(m).graph
    except Exception:  # fx raises many kinds on untraceable code: not recognised then
        return False
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    outputs = [n for n in nodes if n.op == "output"]
    if len(inputs) != 1 or len(outputs) != 1:
        return False
    x, (result,) = inputs[0], outputs[0].args
    attrs = {n.target: n for n in nodes if n.op == "get_attr"}
    weight, bias = attrs.get("weight"), attrs.get("bias")
    if weight is None or set(attrs) - {"weight", "bias"} or (bias is None) == (m.bias is not None):
        return False
    computed = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")]
    if [n.target for n in computed] == [F.linear]:
        (call,) = computed
        args = list(call.args) + [call.kwargs.get("bias")] * (len(call.args) < 3)
        return call is result and args[:2] == [x, weight] and args[2] is bias
    # x @ weight.T (+ bias)
    if len(computed) != (3 if bias is not None else 2):
        return False
    t, mm = computed[0], computed[1]
    transposed = (t.op == "call_function" and t.target is getattr and t.args == (weight, "T")) or (
        t.op == "call_method" and t.target == "t" and t.args == (weight,)
    )
    matmul = mm.op == "call_function" and mm.target in (operator.matmul, torch.matmul)
    if not (transposed and matmul and mm.args == (x, t)):
        return False
    if bias is None:
        return mm is result
    add = computed[2]
    return (
        add is result
        and add.op == "call_function"
        and add.target in (operator.add, torch.add)
        and set(add.args) == {mm, bias}
        and len(add.args) == 2
    )


def layer_channels(m: nn.Module) -> int:
    """The channels a split of layer ``m`` divides: a Conv2d's output channels, a Linear's
    (or Hugging Face Conv1D's) output features."""
    if isinstance(m, nn.Conv2d):
        return m.out_channels
    features = linear_features(m)
    return m.out_features if features is None else features[1]  # type: ignore[return-value]


def layer_in_channels(m: nn.Module) -> int:
    """The channels layer ``m`` reads: a Conv2d's input channels, a linear layer's input
    features (-1 for any other module)."""
    if isinstance(m, nn.Conv2d):
        return m.in_channels
    features = linear_features(m)
    return features[0] if features is not None else -1


def chain_filter_modes(chain: Sequence[tuple[str, nn.Module]]) -> list[dict[str, str]]:
    """The chain-pair modes of ``nn.Sequential(OrderedDict(chain[lo:]))`` for every ``lo``: the
    modes of a filter-split stage running from each layer of a chain of named layers to its
    end, as a plan's split stage splits it (by shares per layer, so by chain pairs alone), each
    module's forward traced once for all of them (the chain is read, not changed).

    >>> chain = [("a", nn.Linear(8, 6)), ("b", nn.ReLU()), ("c", nn.Linear(6, 2))]
    >>> chain_filter_modes(chain)
    [{'a': 'split-output', 'c': 'split-input'}, {'c': 'gather'}, {'c': 'gather'}]
    """
    traced: dict[tuple[int, str], Traced | str] = {}
    out = []
    for lo in range(len(chain)):
        model = nn.Sequential(OrderedDict(chain[lo:]))
        chosen = choose_layers(model, None, dict(model.named_modules()), warn=False)
        out.append(plan_modes(model, chosen, True, traced_cache=traced)[0])
    return out


def plan_modes(
    model: nn.Module,
    chosen: list[str],
    avoid_gathers: bool,
    untraced: list[str] | None = None,
    traced_cache: dict[tuple[int, str], Traced | str] | None = None,
    reads: list[str] | None = None,
    ranks: int = 1,
) -> tuple[dict[str, str], dict[str, tuple[str, int]], dict[str, str]]:
    """Modes of the chosen layers; for each split-input layer the layer whose shares it takes
    and its in_features_per_channel (and for the expanding layer of a squeeze-and-excitation
    on a split run, split-output, the layer whose shares it takes and 1: :class:`Excitation`);
    for each per-channel layer to split (a BatchNorm, a depthwise or grouped convolution), the
    layer it follows. A grouped convolution of fewer groups than ``ranks`` needs the full
    tensor (each rank holds whole groups). The
    modules whose forwards could not be traced go to ``untraced`` (:func:`_chains`, as does
    ``traced_cache``), and the layers a traced forward reads the parameters of to ``reads``."""
    modes = {name: "gather" for name in chosen}
    feeds: dict[str, tuple[str, int]] = {}
    bns: dict[str, str] = {}
    if not avoid_gathers:
        if reads is not None:  # the traces, for what they read
            for _ in _chains(model, untraced=untraced, traced_cache=traced_cache, reads=reads):
                pass
        return modes, feeds, bns

    def alone(ses: list[Excitation]) -> None:
        # excitations not on a split run: their two layers pair with each other
        for se in ses:
            if se.reduce in modes and se.expand in modes:
                modes[se.reduce], modes[se.expand] = "split-output", "split-input"
                feeds[se.expand] = (se.reduce, 1)

    for chain in _chains(model, untraced=untraced, traced_cache=traced_cache, reads=reads):
        prev: tuple[str, nn.Module] | None = None
        flattened = False
        pending: list[str] = []
        excitations: list[Excitation] = []
        for name, m in chain:
            if isinstance(m, Excitation):
                if (
                    prev is not None
                    and isinstance(prev[1], nn.Conv2d)
                    and not flattened
                    and m.channels == prev[1].out_channels
                    and m.reduce in modes
                    and m.expand in modes
                ):
                    excitations.append(m)
                    continue
                alone([*excitations, m])
                prev, pending, excitations = None, [], []
                continue
            if name in modes:
                unit = _pairs(prev, m, flattened) if prev is not None else None
                if prev is not None and unit is not None:
                    modes[prev[0]], modes[name] = "split-output", "split-input"
                    feeds[name] = (prev[0], unit)
                    bns.update({b: prev[0] for b in pending})
                    for se in excitations:  # on the split channels, by the pair's shares
                        modes[se.reduce], modes[se.expand] = "split-input", "split-output"
                        feeds[se.reduce] = feeds[se.expand] = (prev[0], 1)
                    prev = None
                else:
                    alone(excitations)
                    prev = (name, m)
                flattened, pending, excitations = False, [], []
                continue
            if prev is None:
                continue
            conv = isinstance(prev[1], nn.Conv2d)
            if isinstance(m, ELEMENTWISE_MODULES) or (
                conv and not flattened and isinstance(m, SPATIAL_MODULES)
            ):
                continue
            bn_type = nn.BatchNorm2d if conv else nn.BatchNorm1d
            channels = layer_channels(prev[1])
            if type(m) is bn_type and not flattened and m.num_features == channels:
                pending.append(name)
                continue
            width = channels_per_group(m, channels) if conv and not flattened else None
            if width is not None and groups_for_every_rank(channels, width, ranks):
                # Per channel too, or per group of channels (MobileNet's depthwise convolution
                # between its 1x1 convolutions, ResNeXt's and RegNet's grouped one).
                pending.append(name)
                continue
            flat = isinstance(m, nn.Flatten) and m.start_dim == 1 and m.end_dim == -1
            if conv and not flattened and flat:
                flattened = True
                continue
            alone(excitations)
            prev, pending, excitations = None, [], []  # anything else needs the full tensor
        alone(excitations)
    return modes, feeds, bns


def channels_per_group(m: nn.Module, channels: int) -> int | None:
    """The channels of each group of ``m`` if it is a depthwise or grouped convolution of
    ``channels`` channels in and out (``groups`` > 1; its padding, of any mode, is per
    channel), each group's output channels its own input channels' alone: it runs on
    a slice of whole groups as it runs on all (1 for a depthwise convolution); else None."""
    if not (type(m) is nn.Conv2d and m.in_channels == m.out_channels == channels and m.groups > 1):
        return None
    return channels // m.groups


def groups_for_every_rank(channels: int, width: int, ranks: int) -> bool:
    """Whether a grouped convolution of ``channels`` in groups of ``width`` channels has a
    whole group for each of ``ranks`` ranks: else it needs the full tensor, and the pair
    around it gathers (the runtime's rule, which the performance model follows)."""
    return channels // width >= ranks


def channel_units(bns: Mapping[str, str], named: Mapping[str, nn.Module]) -> dict[str, int]:
    """The channels a pair's shares must be multiples of, by the pair's split-output layer,
    where more than 1: the channels of each group of a grouped convolution between them
    (``bns``: :func:`plan_modes`' per-channel layers, each with the layer it follows), the
    least common multiple of several."""
    units: dict[str, int] = {}
    for name, src in bns.items():
        m = named[name]
        if isinstance(m, nn.Conv2d) and m.groups > 1:
            units[src] = math.lcm(units.get(src, 1), m.in_channels // m.groups)
    return {src: u for src, u in units.items() if u > 1}


def _pairs(prev: tuple[str, nn.Module], m: nn.Module, flattened: bool) -> int | None:
    """in_features_per_channel if ``m`` can read ``prev``'s channel-split output, else None."""
    p = prev[1]
    if not isinstance(p, (nn.Conv2d, nn.Linear)) or not isinstance(m, (nn.Conv2d, nn.Linear)):
        return None  # a Conv1D pairs only inside a tensor split
    if isinstance(p, nn.Conv2d):
        if isinstance(m, nn.Conv2d) and not flattened and m.in_channels == p.out_channels:
            return 1
        if isinstance(m, nn.Linear) and flattened and m.in_features % p.out_channels == 0:
            return m.in_features // p.out_channels
        return None
    if isinstance(m, nn.Linear) and m.in_features == p.out_features:  # type: ignore[union-attr]
        return 1
    return None


# Layers with parameters that filter parallelism does not split: named in a warning, so a
# model that stays (partly) replicated says so.
_REPLICATED_KINDS = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.RNNBase,
    nn.Bilinear,
    nn.Linear,  # a subclass computing more than x @ W.T + b: parametrized, quantised, adapted
)


def _why_kept(m: nn.Module) -> str:
    if isinstance(m, nn.Conv2d) and not isinstance(m, nn.ConvTranspose2d) and m.groups != 1:
        return f", groups={m.groups}"
    changed = forward_changed(m)
    return "" if changed is None else f", {changed}"


def _holders(model: nn.Module) -> dict[int, list[tuple[str, str]]]:
    """Every parameter of ``model`` (by ``id``) with the modules holding it and its name in
    each, a module registered under two names counted twice."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((n, pname))
    return owners


def _tied(model: nn.Module) -> dict[str, str]:
    """Modules whose own parameters another module also holds (tied weights, or one module
    registered under two names), by name, each with what it shares: ``"weight shared with
    'emb'"``. Splitting such a module would give it a slice of its own and untie the rest."""
    tied: dict[str, str] = {}
    for holders in _holders(model).values():
        if len(holders) < 2:
            continue
        for n, pname in holders:
            others = ", ".join(repr(o) for o, _ in holders if o != n) or f"{n!r} itself"
            tied.setdefault(n, f"{pname} shared with {others}")
    return tied


def vocabulary_ties(model: nn.Module) -> dict[str, str]:
    """The linear layers whose weight is an ``nn.Embedding``'s and no other module's (a
    language model's head tied to its token embedding), each with that embedding's name: both
    can be split by vocabulary alike, the head by its output features, the embedding by its
    rows, so that they stay tied. An embedding with ``max_norm`` (it renormalises its rows in
    place), ``scale_grad_by_freq`` or sparse gradients is not split, nor one (or a head) inside
    a PEFT wrapper the split does not know (LoRA on the embedding reads the whole one)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    owners = {k: [n for n, _ in v] for k, v in _holders(model).items()}
    wrapped = inside_unknown_adapters(modules)
    ties: dict[str, str] = {}
    for n, m in modules.items():
        if type(m) is not nn.Linear or n in wrapped:
            continue
        holders = owners.get(id(m.weight), [])
        if len(holders) != 2 or len(set(holders)) != 2 or len(owners.get(id(m.bias), [])) > 1:
            continue
        other = next(h for h in holders if h != n)
        emb = modules[other]
        if (
            type(emb) is nn.Embedding
            and other not in wrapped
            and emb.weight is m.weight
            and emb.max_norm is None
            and not emb.scale_grad_by_freq
            and not emb.sparse
        ):
            ties[n] = other
    return ties


def choose_layers(
    model: nn.Module,
    layers: Sequence[str] | None,
    named: dict[str, nn.Module],
    *,
    warn: bool = True,
    vocabulary: bool = False,
    per_channel: Collection[str] = (),
    argument: str = "layers",
) -> list[str]:
    """The names of the layers to split, in the model's order: ``layers`` checked against
    ``named`` (``model.named_modules()``), or by default every Linear and groups=1 Conv2d whose
    parameters no other module holds; with ``vocabulary``, also a head tied to its token
    embedding (:func:`vocabulary_ties`: both split by vocabulary); with ``warn``, a
    ``UserWarning`` names the layers with parameters that stay replicated (but the
    ``per_channel`` ones, split with the layer they follow: depthwise convolutions). Errors name
    ``argument``, where the names came from (``layers``, or the keys of a dict of shares)."""
    tied = _tied(model)
    ties = vocabulary_ties(model) if vocabulary else {}
    for head, emb in ties.items():
        tied.pop(head, None)
        tied.pop(emb, None)
    embeddings = set(ties.values())
    wrapped = inside_unknown_adapters(named)
    if layers is None:
        chosen, kept = [], []
        for n, m in named.items():
            if n in embeddings:
                continue  # split with its head
            if n in wrapped:
                if any(True for _ in m.parameters(recurse=False)):
                    kept.append(f"{n!r} ({wrapped[n]})")
                continue
            if n in tied and (isinstance(m, (nn.Linear, nn.Conv2d)) or is_conv1d(m)):
                kept.append(f"{n!r} ({type(m).__name__}, {tied[n]}: a split would untie them)")
            elif splittable(m):
                chosen.append(n)
            elif (
                isinstance(m, _REPLICATED_KINDS)
                and any(True for _ in m.parameters())
                and n not in per_channel
            ):
                kept.append(f"{n!r} ({type(m).__name__}{_why_kept(m)})")
        if kept and warn:
            warnings.warn(
                "filter_parallel: left replicated (every rank computes them whole): "
                + ", ".join(kept),
                UserWarning,
                stacklevel=4,
            )
        experts = any(experts_layout(m) is not None for m in named.values())
        if not chosen and not experts and warn:
            warnings.warn(
                f"filter_parallel: {type(model).__name__} has no Conv2d (groups=1) or Linear "
                "layer or experts it can split; it runs unchanged on every rank",
                UserWarning,
                stacklevel=4,
            )
        return chosen
    if isinstance(layers, str) or not isinstance(layers, Sequence):
        raise TypeError(
            f"{argument}: must be a sequence of module names, got {type(layers).__name__}"
        )
    for name in layers:
        if name not in named:
            raise ValueError(f"{argument}: the model has no module named {name!r}")
        if lora_base(named[name]) is not None:
            continue  # a projection of a block split by heads or units (else _shares raises)
        if name in wrapped:
            raise ValueError(
                f"{argument}: {name!r} cannot be split: it is inside PEFT's wrapper of "
                f"{wrapped[name]} (leave it out of {argument}: it then stays replicated)"
            )
        if not isinstance(named[name], (nn.Conv2d, nn.Linear)) and not is_conv1d(named[name]):
            raise ValueError(
                f"{argument}: {name!r} is a {type(named[name]).__name__}; only Conv2d, Linear and "
                "Hugging Face Conv1D layers can be split (and PEFT's LoRA wrappers of linear "
                "layers, as projections of an attention or MLP split by heads or hidden units)"
            )
        layer = named[name]
        changed = forward_changed(layer)
        if changed is None and isinstance(layer, nn.Linear) and not computes_linear(layer):
            changed = f"a forward of its own ({type(layer).__name__})"
        if changed is not None:
            kind = "Conv2d" if isinstance(layer, nn.Conv2d) else "Linear"
            raise ValueError(
                f"{argument}: {name!r} cannot be split: it has {changed}, and a split layer "
                f"computes a plain {kind} on its slice of the weights (leave it out of "
                f"{argument}: it then stays replicated)"
            )
        if name in tied:
            raise ValueError(
                f"{argument}: {name!r} cannot be split: {tied[name]}, and a split layer holds only "
                "its slice, which would untie them (leave it out of layers: it then stays "
                "replicated)"
            )
    if len(set(layers)) != len(layers):
        raise ValueError(f"{argument}: names a module more than once")
    order = list(named)
    return sorted(layers, key=order.index)
