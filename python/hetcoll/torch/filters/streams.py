"""Random draws on a rank's slice of a split tensor, apart from those on whole tensors.

Every rank of a split model computes its replicated parts (norms, residuals, the dropout on a
whole hidden state) alike, which needs every rank's random generator in the same state there.
A split part draws on the rank's own slice: dropout on its heads' attention probabilities,
on its hidden units, on its channels between a pair. Those draws differ in number per rank,
so without care they leave the generators out of step, and the next dropout on a whole tensor
draws other masks on each rank: the ranks' copies of the model drift apart, silently.

:class:`RankStream` runs a split part on a stream of its own: on entering, one number is drawn
from the common stream (the same draw on every rank, so the common stream stays in step) and
seeds the rank's stream together with the rank (masks independent between ranks and between
calls); on leaving, the common stream is restored. Hooks enter it around an attention or MLP
split by heads or hidden units, and between a split-output layer and the split-input layer
after it (:func:`install_rank_streams`).

A split whose ranks run on different kinds of device (a CUDA rank beside CPU ranks) has
generators that draw different masks from one state. There every random function of the split
model's forward (dropout, and the random tensor functions drop path uses) runs on the CPU,
from the CPU generator, on every rank (:class:`CpuDraws`): a CUDA rank moves the tensors to
the CPU and the result back, so it draws and computes exactly what the CPU ranks do.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from hetcoll.collectives.autograd import never_traced_methods

#: Mixes the rank into the seed drawn from the common stream (the 64-bit golden ratio).
_MIX = 0x9E3779B97F4A7C15


def _cuda_device() -> int | None:
    """The CUDA device whose generator a split part's dropout would draw from, if CUDA runs."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


# Under torch.compile its hooks run as they are, never traced: they swap the generators' states
# and note which tensors they were given, nothing a graph holds.
@never_traced_methods(
    "enter", "leave", "enter_alone", "leave_alone", "given", "done", "drop_whole", "dropped"
)
class RankStream:
    """This rank's random stream for its split parts (module docs). :meth:`enter` and
    :meth:`leave` alternate; an :meth:`enter` while inside (a split part within another)
    stays in the stream entered first. An object, not closures: a deep copy of the model
    keeps hooks of its own."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._saved: tuple[torch.Tensor, torch.Tensor | None, int | None] | None = None
        #: The tensors (by id) that modules holding split layers were given: whole tensors.
        self.whole: set[int] = set()
        self._paused = 0  # dropout calls on whole tensors inside a split part, running
        self._alone = False  # inside for one dropout on a slice alone (enter_alone)

    @property
    def inside(self) -> bool:
        """Whether a split part runs in the stream now."""
        return self._saved is not None

    def enter(self, module: nn.Module, *_: Any) -> None:
        if self._saved is not None or not module.training:  # no dropout in evaluation
            return
        seed = int(torch.randint(0, 1 << 62, (1,)))  # from the common stream, on every rank
        device = _cuda_device()
        cuda = torch.cuda.get_rng_state(device) if device is not None else None
        self._saved = (torch.get_rng_state(), cuda, device)
        mine = (seed ^ ((self.rank + 1) * _MIX)) & ((1 << 63) - 1)
        torch.default_generator.manual_seed(mine)
        if device is not None:
            torch.cuda.default_generators[device].manual_seed(mine)

    def leave(self, *_: Any) -> None:
        if self._saved is None:
            return
        cpu, cuda, device = self._saved
        self._saved = None
        torch.set_rng_state(cpu)
        if cuda is not None and device is not None:
            torch.cuda.set_rng_state(cuda, device)

    # A dropout module on a rank's slice outside any split part (a LoRA row's, on the slice
    # its split-input layers read, after its base layer left the stream): run in the stream,
    # entered and left around it alone, so the common stream's draws stay the same in number
    # on every rank.

    def enter_alone(self, module: nn.Module, *_: Any) -> None:
        if not self.inside:
            self.enter(module)
            self._alone = self.inside

    def leave_alone(self, *_: Any) -> None:
        if self._alone:
            self._alone = False
            self.leave()

    # A dropout module inside a split part given a whole tensor the part was given (DeBERTa's
    # relative-position table, inside its attention): its mask must be every rank's, so it
    # draws from the common stream, and the rank's stream is entered anew after it.

    def given(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """Before a module holding split layers: its inputs are whole tensors."""
        self.whole.update(id(t) for t in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t))

    def done(self, *_: Any) -> None:
        self.whole.clear()

    def drop_whole(self, module: nn.Module, args: Any) -> None:
        """Before a dropout module: a whole tensor's draws leave the rank's stream."""
        if self.inside and args and id(args[0]) in self.whole:
            self.leave()
            self._paused += 1

    def dropped(self, module: nn.Module, *_: Any) -> None:
        if self._paused:
            self._paused -= 1
            self.enter(module)


def install_rank_streams(model: nn.Module, rank: int) -> RankStream | None:
    """Run ``model``'s split parts in this rank's stream (:class:`RankStream`): what follows a
    split-output layer (its output the rank's channels, heads or hidden units) up to the next
    split-input layer, which sums the ranks' parts into a whole tensor; the whole forward of
    a mixture of experts split by hidden units and of torch's attention split by heads. The
    model's forward leaves the stream in any case (an exception on the way). Returns the
    stream, or None where the model has no split part."""
    from hetcoll.torch.filters.experts import FilterParallelExperts
    from hetcoll.torch.filters.layers import FilterParallelLayer, FilterParallelMultiheadAttention

    stream = RankStream(rank)
    found = False
    for m in model.modules():
        if isinstance(m, FilterParallelExperts | FilterParallelMultiheadAttention):
            m.register_forward_pre_hook(stream.enter)
            m.register_forward_hook(stream.leave, always_call=True)
        elif isinstance(m, FilterParallelLayer) and m.mode == "split-output":
            m.register_forward_hook(stream.enter)
        elif isinstance(m, FilterParallelLayer) and m.mode == "split-input":
            m.register_forward_pre_hook(stream.leave)
        else:
            continue
        found = True
    if not found:
        return None
    model.register_forward_hook(stream.leave, always_call=True)
    for parent in model.modules():
        if isinstance(parent, FilterParallelLayer) or not any(
            isinstance(c, FilterParallelLayer) and c.mode == "split-output"
            for c in parent.children()
        ):
            continue
        parent.register_forward_pre_hook(stream.given, with_kwargs=True)
        parent.register_forward_hook(stream.done, always_call=True)
        for m in parent.modules():
            if isinstance(m, nn.modules.dropout._DropoutNd):
                m.register_forward_pre_hook(stream.drop_whole)
                m.register_forward_hook(stream.dropped, always_call=True)
    return stream


#: Names of what draws random numbers in training: dropout, drop path, stochastic depth, and a
#: mixture of experts' jitter.
_RANDOM_NAME = re.compile(
    r"drop(out|_?path|_prob|_rate)|pdrop|stochastic_depth|jitter", re.IGNORECASE
)


def draws_random(model: nn.Module) -> bool:
    """Whether ``model`` may draw random numbers in training: a dropout module (torch's, or any
    class named for dropout, drop path or stochastic depth) of nonzero probability, or a
    nonzero number under such a name on a module (Hugging Face's ``self.attention_dropout =
    config.attention_dropout``, read by ``F.dropout``), or named for jitter (a mixture of
    experts' noise on its input in training: Mixtral's and PhiMoE's ``jitter_noise``)."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if _RANDOM_NAME.search(type(m).__name__) and not isinstance(
            m, nn.modules.dropout._DropoutNd
        ):
            p = getattr(m, "p", getattr(m, "drop_prob", None))
            if not isinstance(p, (int, float)) or p > 0:
                return True
        for name, value in vars(m).items():
            if _RANDOM_NAME.search(name) and isinstance(value, float) and value > 0:
                return True
    return False


#: The kinds of device a rank's generators are told apart by (:func:`generator_states`).
DEVICE_KINDS = ("cpu", "cuda")


def _device(model: nn.Module) -> torch.device:
    return next((t.device for t in model.parameters()), torch.device("cpu"))


def device_kind(model: nn.Module) -> int:
    """The kind of device ``model``'s parameters are on, as an index of :data:`DEVICE_KINDS`
    (another kind counts as a kind of its own)."""
    kind = _device(model).type
    return DEVICE_KINDS.index(kind) if kind in DEVICE_KINDS else len(DEVICE_KINDS)


def generator_states(model: nn.Module) -> list[int]:
    """This rank's ``[kind, cpu, device]``: the kind of device ``model`` is on
    (:func:`device_kind`), the CPU generator's state and that device's generator's state
    (fingerprints). Ranks of one kind draw the same masks when their device's states are
    equal; ranks of several kinds, from the CPU (:class:`CpuDraws`), when their CPU states
    are."""
    kind = device_kind(model)
    cpu = zlib.crc32(torch.get_rng_state().numpy().tobytes())
    device = cpu
    if kind == DEVICE_KINDS.index("cuda"):
        device = zlib.crc32(torch.cuda.get_rng_state(_device(model)).numpy().tobytes())
    return [kind, cpu, device]


def unequal_generators(states: Any) -> tuple[bool, str | None]:
    """From every rank's :func:`generator_states` (rows in rank order): whether the ranks run
    on several kinds of device, and the generator whose states differ among the ranks (a
    description for the error every rank raises), or None."""
    kinds = {int(row[0]) for row in states}
    mixed = len(kinds) > 1
    column = [int(row[1 if mixed else 2]) for row in states]
    if all(v == column[0] for v in column):
        return mixed, None
    which = "the CPU random generator's" if mixed else "the random generator's"
    return mixed, which


#: torch's functional dropouts: ``(input, p, training, inplace)``.
_DROPOUTS = (
    F.dropout,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
    F.alpha_dropout,
    F.feature_alpha_dropout,
)
#: Random functions of torch that :class:`CpuDraws` runs on the CPU.
_RANDOM = {
    *_DROPOUTS, torch.dropout, torch.feature_dropout, torch.alpha_dropout,
    torch.feature_alpha_dropout, torch.bernoulli, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal,
    torch.poisson, torch.multinomial, torch.Tensor.bernoulli, torch.Tensor.multinomial,
}  # fmt: skip
#: Their in-place forms, which fill a tensor.
_FILLS = {
    torch.Tensor.bernoulli_, torch.Tensor.uniform_, torch.Tensor.normal_,
    torch.Tensor.exponential_, torch.Tensor.random_, torch.Tensor.geometric_,
    torch.Tensor.cauchy_, torch.Tensor.log_normal_,
}  # fmt: skip


def _off_cpu(args: Any, kwargs: dict[str, Any]) -> torch.device | None:
    """The device, not the CPU, that a random function's tensors or ``device=`` are on."""
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return torch.device(device)
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            return t.device
    return None


def _to(device: Any) -> Any:
    return lambda t: t.to(device) if isinstance(t, torch.Tensor) else t


class CpuDraws(TorchFunctionMode):
    """Inside: torch's random functions (dropout, ``rand``, ``bernoulli_``, ...) on tensors
    off the CPU run on the CPU, from the CPU generator, their results moved back (gradients
    flow through the moves). Outside ``stream`` only: a split part's draws are the rank's
    own. A call given its own ``generator=`` is left alone."""

    def __init__(self, stream: RankStream | None = None) -> None:
        super().__init__()
        self.stream = stream

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        routed = func in _RANDOM or func in _FILLS
        if (
            not routed
            or kwargs.get("generator") is not None
            or (self.stream is not None and self.stream.inside)
        ):
            return func(*args, **kwargs)
        device = _off_cpu(args, kwargs)
        if device is None:
            return func(*args, **kwargs)
        if func in _FILLS:  # tensor.bernoulli_(p): fill a CPU copy, then the tensor
            target, rest = args[0], pytree.tree_map(_to("cpu"), (args[1:], kwargs))
            filled = torch.empty(target.shape, dtype=target.dtype)
            func(filled, *rest[0], **rest[1])
            with torch.no_grad():
                target.copy_(filled)
            return target
        cpu_args, cpu_kwargs = pytree.tree_map(_to("cpu"), (args, kwargs))
        if "device" in cpu_kwargs:
            cpu_kwargs["device"] = "cpu"
        inplace = bool(cpu_kwargs.pop("inplace", False))
        if func in _DROPOUTS and len(cpu_args) >= 4:
            inplace = bool(cpu_args[3])
            cpu_args = (*cpu_args[:3], False, *cpu_args[4:])
        out = pytree.tree_map(_to(device), func(*cpu_args, **cpu_kwargs))
        if inplace:
            return args[0].copy_(out)
        return out
