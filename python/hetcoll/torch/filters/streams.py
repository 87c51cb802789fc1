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
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import torch
from torch import nn

#: Mixes the rank into the seed drawn from the common stream (the 64-bit golden ratio).
_MIX = 0x9E3779B97F4A7C15


def _cuda_device() -> int | None:
    """The CUDA device whose generator a split part's dropout would draw from, if CUDA runs."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


class RankStream:
    """This rank's random stream for its split parts (module docs). :meth:`enter` and
    :meth:`leave` alternate; an :meth:`enter` while inside (a split part within another)
    stays in the stream entered first. An object, not closures: a deep copy of the model
    keeps hooks of its own."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._saved: tuple[torch.Tensor, torch.Tensor | None, int | None] | None = None

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


def install_rank_streams(model: nn.Module, rank: int) -> None:
    """Run ``model``'s split parts in this rank's stream (:class:`RankStream`): what follows a
    split-output layer (its output the rank's channels, heads or hidden units) up to the next
    split-input layer, which sums the ranks' parts into a whole tensor; the whole forward of
    a mixture of experts split by hidden units and of torch's attention split by heads. The
    model's forward leaves the stream in any case (an exception on the way)."""
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
    if found:
        model.register_forward_hook(stream.leave, always_call=True)


_DROPOUT_NAME = re.compile(r"drop(out|_?path|_prob|_rate)|pdrop|stochastic_depth", re.IGNORECASE)


def draws_random(model: nn.Module) -> bool:
    """Whether ``model`` may draw random numbers in training: a dropout module (torch's, or any
    class named for dropout, drop path or stochastic depth) of nonzero probability, or a
    nonzero number under such a name on a module (Hugging Face's ``self.attention_dropout =
    config.attention_dropout``, read by ``F.dropout``)."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if _DROPOUT_NAME.search(type(m).__name__) and not isinstance(
            m, nn.modules.dropout._DropoutNd
        ):
            p = getattr(m, "p", getattr(m, "drop_prob", None))
            if not isinstance(p, (int, float)) or p > 0:
                return True
        for name, value in vars(m).items():
            if _DROPOUT_NAME.search(name) and isinstance(value, float) and value > 0:
                return True
    return False


def generator_fingerprint(model: nn.Module) -> int:
    """The state of the generator ``model``'s dropout draws from (the CPU's, or its CUDA
    device's), with that device's type: equal on ranks that will draw the same masks."""
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    cuda = device.type == "cuda"
    state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
    return zlib.crc32(device.type.encode() + state.numpy().tobytes())
