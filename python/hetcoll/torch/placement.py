"""Node-wise placement (seed 002): a plan stage whose channels are placed one by one.

A :class:`~hetcoll.plan.Stage` with ``owners`` names, for every output channel (filter) of each
Conv2d and every output neuron of each Linear in its layer range, the rank that computes it. The
stage's layers are read as *blocks*: a Conv2d / Linear followed by the layers up to the next one.
Within a block,

- the leading channel-wise layers (activations, BatchNorm, pooling, dropout: each output channel
  depends on the same input channel only) run at the channel's *owner*, on its own channels, so
  what it sends is what :func:`hetcoll.model.network_hypergraph` counts as the channel's net
  (the map *where read*, after pooling);
- the layers after those (a Flatten before a Linear, anything else without parameters or
  buffers) run at every *reader*, on the full tensor it assembles.

A rank keeps only the weights of its own channels (Conv2d / Linear rows, BatchNorm entries):
memory follows ownership.

Each micro-batch flows through the blocks as follows. The stage's input is on every rank that
owns channels of the first block (the data is everywhere; a previous stage sends it to those
ranks only). For block ``k``, every rank owning channels of it assembles its full input from the
owners of block ``k - 1`` (its own channels locally, the others received), computes its own
channels and sends them to each other rank owning channels of block ``k + 1``: every feature map
goes once to each rank that reads it and to no other. The last block's channels are gathered at
the stage's first rank (its *lead*), which computes the loss (last stage) or sends the output on.

Backward is exact: each reader computes the gradient of its assembled input and sends every owner
of the previous block the slice of that owner's channels; each owner sums the slices it gets (its
own included) in increasing rank order and backpropagates through its own channels. Every layer's
input is kept as a detached leaf, so each block's backward is a call of its own.

Order: non-blocking sends (all waited for at the end of the step) and *layer-major* work: every
rank runs the forwards of all micro-batches of its first block, then of its next block, ..., and
the backwards in reverse. Each rank's order is a subsequence of one global order in which every
receive follows its send, so there is no deadlock, and a placement that gives whole layers to
different ranks pipelines them across micro-batches (GPipe-like). A replica holding an owners
stage therefore runs GPipe in every stage, whatever the plan's ``schedule`` says (1F1B would let a
neighbouring stage wait for a backward that the owners stage starts only after all forwards).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hetcoll.plan import Stage
from hetcoll.torch.filters import ELEMENTWISE_MODULES, SPATIAL_MODULES
from hetcoll.torch.filters.shards import Marks, register_marking
from hetcoll.torch.stage_inputs import StageInput

__all__ = ["CHANNELWISE", "Block", "OwnersStage", "StepIO", "check_block_shapes", "owners_blocks"]

#: Layers each of whose output channels depends on the same input channel only (elementwise
#: maps, dropout, BatchNorm, 2-D pooling): in an owners stage they run at the channel's owner.
CHANNELWISE = (*ELEMENTWISE_MODULES, nn.BatchNorm1d, nn.BatchNorm2d, *SPATIAL_MODULES)
#: ... of which these act on 2-D feature maps only (after a Conv2d, not a Linear).
_CONV_ONLY = (nn.BatchNorm2d, *SPATIAL_MODULES)
_TAG_FORWARD = 7200  # + 2 * block
_TAG_BACKWARD = 7201  # + 2 * block


@dataclass(frozen=True)
class Block:
    """A Conv2d / Linear (model layer ``layer``) and the layers after it in its stage:
    ``owner_tail`` run at each channel's owner, ``reader_tail`` at each reader. ``owners``
    holds each output channel's group rank."""

    layer: int
    name: str
    linear: bool
    owners: tuple[int, ...]
    owner_tail: tuple[int, ...]
    reader_tail: tuple[int, ...]

    def channels_of(self, rank: int) -> torch.Tensor:
        """The output channels ``rank`` owns, in increasing order (int64)."""
        return torch.tensor([c for c, o in enumerate(self.owners) if o == rank], dtype=torch.long)

    @property
    def owner_ranks(self) -> list[int]:
        """The ranks owning at least one channel, in increasing order."""
        return sorted(set(self.owners))

    @property
    def last_layer(self) -> int:
        """The model layer whose output the owners send."""
        return self.owner_tail[-1] if self.owner_tail else self.layer


def _state_free(m: nn.Module) -> bool:
    return next(m.parameters(), None) is None and next(m.buffers(), None) is None


def owners_blocks(layers: list[tuple[str, nn.Module]], stage: Stage, where: str) -> list[Block]:
    """The blocks of an owners stage over the model's ``layers`` (checked against the model:
    the same verdict on every rank, so a placement that cannot run fails everywhere before any
    transfer). Raises ``ValueError`` naming ``where`` and the layer."""
    assert stage.owners is not None
    lo, hi = stage.layers
    blocks: list[Block] = []
    layer = lo
    while layer < hi:
        name, m = layers[layer]
        what = f"{where}: layer {layer} ({name!r}, {type(m).__name__})"
        if type(m) not in (nn.Conv2d, nn.Linear):
            if layer == lo:
                raise ValueError(
                    f"{what} starts the stage; an owners stage starts with a Conv2d or Linear "
                    "(give the layers before it to the previous stage)"
                )
            raise AssertionError("unreachable: tails are consumed below")
        if layer not in stage.owners:
            raise ValueError(f"{where}.owners: has no entry for layer {layer} ({name!r})")
        out = m.out_channels if isinstance(m, nn.Conv2d) else m.out_features
        if len(stage.owners[layer]) != out:
            raise ValueError(
                f"{where}.owners[{str(layer)!r}]: needs one owner per output channel of {name!r} "
                f"({out}), got {len(stage.owners[layer])}"
            )
        if isinstance(m, nn.Conv2d) and m.groups != 1:
            raise ValueError(f"{what}: grouped convolutions cannot be placed by owners")
        conv = isinstance(m, nn.Conv2d)
        owner_tail: list[int] = []
        reader_tail: list[int] = []
        nxt = layer + 1
        while nxt < hi and type(layers[nxt][1]) not in (nn.Conv2d, nn.Linear):
            tname, t = layers[nxt]
            twhat = f"{where}: layer {nxt} ({tname!r}, {type(t).__name__})"
            if nxt in stage.owners:
                raise ValueError(
                    f"{where}.owners[{str(nxt)!r}]: {tname!r} is a {type(t).__name__}; owners "
                    "name Conv2d or Linear layers of the stage"
                )
            channelwise = isinstance(t, CHANNELWISE) and (conv or not isinstance(t, _CONV_ONLY))
            if isinstance(t, (nn.BatchNorm1d, nn.BatchNorm2d)) and t.num_features != out:
                channelwise = False
            if channelwise and not reader_tail:
                owner_tail.append(nxt)
            elif _state_free(t):
                reader_tail.append(nxt)
            else:
                raise ValueError(
                    f"{twhat} holds parameters or buffers and does not act on each channel of "
                    f"{name!r} on its own; an owners stage runs chains of Conv2d / Linear layers "
                    "with channel-wise layers between them (a module with its own forward, such "
                    "as a residual block, belongs in a stage of its own)"
                )
            nxt += 1
        owners = tuple(stage.ranks[i] for i in stage.owners[layer])
        blocks.append(Block(layer, name, not conv, owners, tuple(owner_tail), tuple(reader_tail)))
        layer = nxt
    extra = sorted(set(stage.owners) - {b.layer for b in blocks})
    if extra:
        name, m = layers[extra[0]]
        raise ValueError(
            f"{where}.owners[{str(extra[0])!r}]: {name!r} is a {type(m).__name__}; owners name "
            "Conv2d or Linear layers of the stage"
        )
    return blocks


def check_block_shapes(
    blocks: list[Block],
    input_dim: int,
    shapes: list[tuple[torch.Size, torch.dtype]],
    where: str,
) -> None:
    """Every Linear of an owners stage must read ``[rows, features]`` and every Conv2d
    ``[rows, channels, height, width]``, so output channels are dimension 1. ``shapes`` are the
    shapes after every model layer, ``input_dim`` the model input's dimensions: the same on every
    rank, so this fails everywhere alike."""
    for b in blocks:
        layer_in = input_dim if b.layer == 0 else len(shapes[b.layer - 1][0])
        if layer_in != (2 if b.linear else 4):
            raise ValueError(
                f"{where}: layer {b.layer} ({b.name!r}) reads a {layer_in}-D tensor; an owners "
                "stage places Linear layers reading [rows, features] and Conv2d layers reading "
                "[rows, channels, height, width]"
            )


def _rows(m: nn.Module, index: torch.Tensor) -> nn.Module:
    """A copy of ``m`` (Conv2d, Linear or BatchNorm) keeping output channels ``index``."""
    new = copy.deepcopy(m)
    for pname, p in list(m.named_parameters(recurse=False)):
        setattr(new, pname, nn.Parameter(p.detach()[index].clone(), requires_grad=p.requires_grad))
    for bname, b in list(m.named_buffers(recurse=False)):
        if b is not None and b.dim() >= 1:
            setattr(new, bname, b.detach()[index].clone())
    n = len(index)
    if isinstance(new, nn.Conv2d):
        new.out_channels = n
    elif isinstance(new, nn.Linear):
        new.out_features = n
    elif isinstance(new, (nn.BatchNorm1d, nn.BatchNorm2d)):
        new.num_features = n
    return new


@dataclass
class StepIO:
    """How an owners stage meets the rest of a step (given by the plan runtime).

    ``boundary(m)``: shape and dtype after every model layer for micro-batch ``m``.
    ``stage_input(m)``: the stage's input (on readers of the first block). ``input_grad(m, g)``:
    hands back its gradient (None when the stage's input needs none). ``finish(m, out)``: at
    the lead, the gathered output -> the tensor to backpropagate from (the scaled loss, or the
    output after sending it on). ``output_grad(m, out)``: at the lead, the gradient for
    ``finish``'s result (None: it is a loss). ``send``: start a send and count it by kind.
    """

    micro_batches: int
    input_dim: int  # dimensions of the stage's input (rows included)
    boundary: Callable[[int], list[tuple[torch.Size, torch.dtype]]]
    stage_input: Callable[[int], torch.Tensor]
    input_grad: Callable[[int, torch.Tensor], None] | None
    finish: Callable[[int, torch.Tensor], torch.Tensor]
    output_grad: Callable[[int, torch.Tensor], torch.Tensor | None]
    send: Callable[[torch.Tensor, int, int, str], None]
    recv: Callable[[torch.Tensor, int, int], None]
    device: torch.device
    wire: torch.device


class OwnersStage(nn.Module):
    """This rank's channels of an owners stage: for each block it owns channels of, the
    Conv2d / Linear rows and channel-wise layers of those channels (registered under the
    model's child names, so parameter names are the model's), plus the stateless reader-side
    layers of every block. Built by :func:`hetcoll.torch.parallelize`."""

    def __init__(
        self,
        layers: list[tuple[str, nn.Module]],
        blocks: list[Block],
        rank: int,
        lead: int,
    ) -> None:
        super().__init__()
        # Its layers are its children under the model's names (so its state-dict keys are the
        # model's); its own attributes are private, out of the way of any layer's name.
        self._blocks = blocks
        self._rank = rank
        self._lead = lead
        self._index = [b.channels_of(rank) for b in blocks]
        self._names = {i: n for i, (n, _) in enumerate(layers)}
        for b, index in zip(blocks, self._index, strict=True):
            if len(index):
                self.add_module(b.name, _rows(layers[b.layer][1], index))
                for t in b.owner_tail:
                    m = layers[t][1]
                    kept = _rows(m, index) if not _state_free(m) else copy.deepcopy(m)
                    self.add_module(self._names[t], kept)
            for t in b.reader_tail:
                self.add_module(self._names[t], copy.deepcopy(layers[t][1]))
        # Its state dicts mark each tensor's channels where they sit in the unsplit tensor
        # (torch.distributed.checkpoint's shards: :mod:`hetcoll.torch.filters.shards`).
        self._block_marks = [
            Marks.of_index(0, index.tolist(), len(b.owners))
            for b, index in zip(blocks, self._index, strict=True)
        ]
        register_marking(self)

    def _owned(self) -> dict[str, tuple[torch.Tensor, Marks]]:
        """This rank's tensors of owned channels by their names in this module, with where
        their channels sit in the unsplit tensors."""
        out: dict[str, tuple[torch.Tensor, Marks]] = {}
        for k, (b, index) in enumerate(zip(self._blocks, self._index, strict=True)):
            if not len(index):
                continue
            marks = self._block_marks[k]
            for layer in (b.layer, *b.owner_tail):
                name = self._names[layer]
                for key, t in self._layer(name).state_dict(keep_vars=True).items():
                    if t.dim() >= 1:
                        out[f"{name}.{key}"] = (t, marks)
        return out

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module.state_dict``, each tensor of owned channels marked (not the tensors
        themselves, which ``keep_vars=True`` hands out)."""
        out = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", "")
        for key, (t, marks) in self._owned().items():
            saved = out.get(prefix + key)
            if isinstance(saved, torch.Tensor) and saved is not t:
                marks.mark(saved)
        return out

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        """Refuse a marked tensor of owned channels cut for another rank or placement."""
        for key, (_, marks) in self._owned().items():
            t = state_dict.get(prefix + key)
            if isinstance(t, torch.Tensor):
                state_dict[prefix + key] = marks.loaded("state_dict", repr(prefix + key), t)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def param_marks(self) -> list[tuple[torch.Tensor, Marks]]:
        """Each tensor of owned channels, with its marks (:mod:`hetcoll.torch.filters.shards`)."""
        return list(self._owned().values())

    def forward(self, *args: Any) -> Any:
        raise TypeError("an owners stage runs inside Parallel.step")

    def local_state(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """This rank's parameters and buffers by the model's state-dict names, each with the
        output channels it holds (None: a whole tensor, such as BatchNorm's step counter)."""
        out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for b, index in zip(self._blocks, self._index, strict=True):
            if not len(index):
                continue
            for layer in (b.layer, *b.owner_tail):
                name = self._names[layer]
                for key, t in self._layer(name).state_dict(keep_vars=True).items():
                    out[f"{name}.{key}"] = (t, index if t.dim() >= 1 else None)
        return out

    def whole_tensor_holder(self, layer: int) -> int:
        """The rank whose copy of a layer's whole (unsliced) tensors counts: the owner of the
        block's channel 0."""
        for b in self._blocks:
            if layer == b.layer or layer in b.owner_tail:
                return b.owners[0]
        raise KeyError(layer)

    def _layer(self, name: str) -> nn.Module:
        """The layer this stage keeps under the model's child name ``name``."""
        m = self._modules[name]
        assert m is not None
        return m

    def _through(self, layers: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
        for t in layers:
            x = self._layer(self._names[t])(x)
        return x

    def _readers(self, k: int) -> list[int]:
        return self._blocks[k + 1].owner_ranks if k + 1 < len(self._blocks) else [self._lead]

    def run(self, io: StepIO) -> None:
        """This rank's forwards and backwards of every micro-batch (layer-major, see the
        module docs); the sends are started, not waited for."""
        blocks, rank, M = self._blocks, self._rank, io.micro_batches
        K = len(blocks)
        own = [rank in b.owner_ranks for b in blocks]
        saved: dict[tuple[int, int], tuple[StageInput, torch.Tensor]] = {}
        outputs: dict[tuple[int, int], torch.Tensor] = {}  # own channels, detached
        grads: dict[tuple[int, int], torch.Tensor] = {}  # own slices of readers' gradients

        def assemble(k: int, m: int) -> torch.Tensor:
            """Block k's full output for micro-batch m, from its owners."""
            b = blocks[k]
            shape, dtype = io.boundary(m)[b.last_layer]
            full = torch.empty(shape, dtype=dtype, device=io.device)
            for o in b.owner_ranks:
                index = b.channels_of(o)
                if o == rank:
                    part = outputs.pop((k, m))
                else:
                    buf = torch.empty(
                        (shape[0], len(index), *shape[2:]), dtype=dtype, device=io.wire
                    )
                    io.recv(buf, o, _TAG_FORWARD + 2 * k)
                    part = buf.to(io.device)
                full.index_copy_(1, index.to(io.device), part)
            return full

        def scatter(k: int, m: int, g: torch.Tensor, kind: str) -> None:
            """Send each owner of block k its channels of ``g`` (a reader's gradient)."""
            b = blocks[k]
            for o in b.owner_ranks:
                part = g.index_select(1, b.channels_of(o).to(g.device))
                if o == rank:
                    grads[k, m] = part
                else:
                    io.send(part, o, _TAG_BACKWARD + 2 * k, kind)

        # Forwards, layer-major.
        for k in range(K):
            if not own[k]:
                continue
            b = blocks[k]
            for m in range(M):
                if k == 0:
                    x_in = StageInput(io.stage_input(m).detach(), io.input_grad is not None)
                    z = x_in.tensor
                else:
                    x_in = StageInput(assemble(k - 1, m))
                    z = self._through(blocks[k - 1].reader_tail, x_in.tensor)
                y = self._through(b.owner_tail, self._layer(b.name)(z))
                saved[k, m] = (x_in, y)
                for r in self._readers(k):
                    if r == rank:
                        outputs[k, m] = y.detach()
                    else:
                        kind = "outputs" if k == K - 1 else "activations"
                        io.send(y.detach(), r, _TAG_FORWARD + 2 * k, kind)
        # The lead gathers the output, computes the loss or sends it on, and sends back the
        # output's gradient.
        if rank == self._lead:
            ends = []
            for m in range(M):
                x_out = StageInput(assemble(K - 1, m))
                ends.append(
                    (x_out, io.finish(m, self._through(blocks[-1].reader_tail, x_out.tensor)))
                )
            for m, (x_out, end) in enumerate(ends):
                g = io.output_grad(m, end)
                if end.requires_grad:
                    torch.autograd.backward(end, g)
                scatter(K - 1, m, x_out.grad(), "outputs")
        # Backwards, layer-major in reverse.
        for k in reversed(range(K)):
            if not own[k]:
                continue
            for m in range(M):
                x_in, y = saved.pop((k, m))
                dy = torch.zeros_like(y)
                for r in self._readers(k):
                    if r == rank:
                        dy += grads.pop((k, m))
                    else:
                        buf = torch.empty(y.shape, dtype=y.dtype, device=io.wire)
                        io.recv(buf, r, _TAG_BACKWARD + 2 * k)
                        dy += buf.to(io.device)
                if y.requires_grad:
                    torch.autograd.backward(y, dy)
                if k == 0 and io.input_grad is None:
                    continue  # the data: no gradient wanted
                g = x_in.grad()
                if k > 0:
                    scatter(k - 1, m, g, "gradients")
                else:
                    assert io.input_grad is not None
                    io.input_grad(m, g)
