"""PEFT's DoRA split with its layer: the magnitude vector and weight norm of a LoRA wrapper whose
base layer is split: as a column (along its outputs) or a row (along its inputs) of an
attention or MLP split by heads or hidden units, or alone, gathering its output (a language
model's head).

DoRA adds ``(m / n - 1) * (W x) + (m / n) * s * B A x`` to the base layer's output, where
``m`` is a learnt magnitude per output feature and ``n`` the norm of each output's row of
``W + s B A`` (detached, as PEFT computes it). A column holds whole rows: it holds its outputs'
magnitudes and computes their norms alone. A row holds a slice of every row: each rank's sum of
squares over its slice is summed over the ranks (a number per output feature) before the square
root, and its magnitudes are whole on every rank. A gathering layer holds whole rows too, but
its output is whole on every rank: each rank's norms are gathered, and its magnitudes are whole.
Either way the split computes the unsplit layer's numbers, with the base output handed in or
with the adapters' dropout active (the base output recomputed on the dropped input); a column's
and a row's also when PEFT merges the adapters into the base weight."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetcoll.comm import Communicator
from hetcoll.torch.filters.autograd import GatherChannels, ReduceSum, needs_check, sole_holder
from hetcoll.torch.filters.layers import ChannelSplit, FilterParallelLayer, split_runs, take_runs
from hetcoll.torch.filters.split_output import SplitOutput


def is_dora_layer(m: nn.Module) -> bool:
    """Whether ``m`` is PEFT's DoRA layer of a linear layer (``lora.dora.DoraLinearLayer``
    itself: its weight norm and forward are the ones :class:`FilterParallelDoRA` computes)."""
    cls = type(m)
    return cls.__name__ == "DoraLinearLayer" and cls.__module__ == "peft.tuners.lora.dora"


class FilterParallelDoRA(ChannelSplit, nn.Module):
    """PEFT's ``DoraLinearLayer`` of a LoRA wrapper whose base layer is split (``base``): the
    magnitude (``weight``) this rank's outputs' in a column, whole in a row or a gathering
    layer, and the weight norm over each output's whole row. Called as PEFT calls its DoRA
    layer (:meth:`forward`, :meth:`get_weight_norm`). Only :meth:`from_module` builds one."""

    weight: nn.Parameter
    fan_in_fan_out: bool
    timeout: float | None = None
    #: The split base layer's mode: "split-output" (a column), "split-input" (a row) or
    #: "gather".
    mode: str = "split-output"
    blocks: tuple[int, ...] = (1,)
    whole: tuple[int, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("FilterParallelDoRA: build one with FilterParallelDoRA.from_module")

    @classmethod
    def from_module(
        cls, dora: nn.Module, base: FilterParallelLayer, comm: Communicator
    ) -> FilterParallelDoRA:
        """``dora`` (PEFT's DoRA layer of the wrapper whose base layer is now ``base``, split)
        holding this rank's magnitudes: those of ``base``'s outputs in a column, all in a row."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._set_split(comm, base.shares)
        self.mode, self.timeout = base.mode, base.timeout
        self.blocks, self.whole = base.blocks, base.whole
        self.fan_in_fan_out = bool(getattr(dora, "fan_in_fan_out", False))
        magnitude = dora.weight
        assert isinstance(magnitude, nn.Parameter)  # PEFT's layer holds it so
        trained = magnitude.requires_grad
        with torch.no_grad():
            if self.mode == "split-output":
                runs = split_runs(base.shares, comm.rank, base.blocks, base.whole)
                magnitude = take_runs(magnitude, 0, runs)
            self.weight = nn.Parameter(magnitude.clone(), trained)
        return self

    def split_spec(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        return {"weight": (0, self.blocks)} if self.mode == "split-output" else {}

    def whole_spec(self) -> dict[str, tuple[int, ...]]:
        return {"weight": self.whole} if self.mode == "split-output" and self.whole else {}

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """``partial`` summed over the ranks (its gradient each rank's alike: a row's output)."""
        return ReduceSum.apply(  # type: ignore[no-any-return]
            partial, self.comm, self.timeout, needs_check(self.agreed), sole_holder(self.shares)
        )

    def get_weight_norm(
        self,
        weight: torch.Tensor,
        lora_weight: torch.Tensor,
        scaling: float,
        adapter_name: str | None = None,
    ) -> torch.Tensor:
        """The norm of each output's row of ``weight + scaling * lora_weight`` (``weight``
        stored as the base layer stores it, this rank's slice): a row's sums of squares summed
        over the ranks first."""
        if self.fan_in_fan_out:
            weight = weight.T
        weight = weight + scaling * lora_weight
        if self.mode == "split-input":
            squares = weight.pow(2).sum(dim=1)
            return self._sum(squares).sqrt().to(weight.dtype)
        norm = torch.linalg.norm(weight, dim=1).to(weight.dtype)
        return self._gathered(norm, 0) if self.mode == "gather" else norm

    def _gathered(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """``t``, this rank's outputs along ``dim``, gathered: every output's."""
        return GatherChannels.apply(  # type: ignore[no-any-return]
            t, self.comm, self.shares, self.offset, dim, self.timeout
        )

    def get_lora_weight(
        self, lora_A: nn.Module, lora_B: nn.Module, adapter_name: str | None = None
    ) -> torch.Tensor:
        """``B A``, as the base layer holds its weight: this rank's rows (a column, a
        gathering layer) or its slice of every row (a row). From the adapters' weights (PEFT
        runs the adapters on an identity matrix instead: a row's split ``lora_A`` would sum
        that over the ranks); a gathering layer's adapters, split alone, gathered first."""
        a, b = lora_A.weight, lora_B.weight
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        if self.mode != "gather":
            return b @ a
        if isinstance(lora_A, FilterParallelLayer) and lora_A.mode == "gather":
            a = GatherChannels.apply(a, lora_A.comm, lora_A.shares, lora_A.offset, 0, self.timeout)
        mine = self.shares[self.rank]
        if isinstance(lora_B, FilterParallelLayer) and lora_B.mode == "gather":
            if lora_B.shares == self.shares:
                return b @ a  # this rank's rows already
            b = GatherChannels.apply(b, lora_B.comm, lora_B.shares, lora_B.offset, 0, self.timeout)
        return b.narrow(0, self.offset, mine) @ a

    def forward(
        self,
        x: torch.Tensor,
        *,
        lora_A: nn.Module,
        lora_B: nn.Module,
        scaling: float,
        base_layer: nn.Module,
        base_result: torch.Tensor | None = None,
        adapter_name: str = "default",
    ) -> torch.Tensor:
        """What DoRA adds to the base layer's output ``base_result`` (None: the adapters'
        dropout changed ``x``, and the base output is recomputed on it), as PEFT's layer."""
        assert isinstance(base_layer, FilterParallelLayer)
        weight = base_layer.weight.to(x.dtype)
        with torch.no_grad():
            lora_weight = self.get_lora_weight(lora_A, lora_B).to(x.dtype)
            norm = self.get_weight_norm(weight, lora_weight, scaling)
        scale = (self.weight / norm).view(1, -1)
        lora_result = lora_B(lora_A(x))
        if isinstance(lora_result, SplitOutput):
            lora_result = lora_result.whole()
        if base_result is not None:
            if isinstance(base_result, SplitOutput):  # a head's, split by vocabulary
                base_result = base_result.whole()
            bias: torch.Tensor | None = base_layer.bias
            if bias is not None and self.mode == "gather":
                bias = self._gathered(bias, 0)  # its gradient each rank's slice of it
            if bias is not None:
                base_result = base_result - bias
        else:
            base_result = self._base_output(x, base_layer, weight)
        return (scale - 1) * base_result + scale * lora_result * scaling  # type: ignore[no-any-return]

    def _base_output(
        self, x: torch.Tensor, base: FilterParallelLayer, weight: torch.Tensor
    ) -> torch.Tensor:
        """``W x`` without the bias, on a dropped input: a column's on the input's copy to
        the ranks (its gradient summed, as the base layer's), a row's summed over the ranks, a
        gathering layer's as a column's, gathered."""
        w = weight if base.weight_out_dim == 0 else weight.T
        if self.mode == "split-input":
            return self._sum(F.linear(x, w))
        out = F.linear(base.copied_input(x), w)
        return self._gathered(out, -1) if self.mode == "gather" else out

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, shares={self.shares}, rank={self.rank}"
