"""What a model is costed on: its inputs as :class:`ModelInput` (a name, the shape of one sample,
a dtype), read from what :func:`hetcoll.model.layer_costs` is given, and example batches of them.

``layer_costs(model, inputs, dtype=...)`` takes:

- a shape of one sample (``(3, 32, 32)``, ``"3x32x32"``, ``(512,)``): the forward's one
  positional input, of ``dtype`` (default ``torch.float32``; an integer dtype such as
  ``torch.int64`` for token ids);
- an example tensor: a batch (its first dimension is the batch), which gives the shape and dtype;
- a dict of keyword inputs, the forward called as ``model(**inputs)``: each value a shape of one
  sample (of ``dtype``), a ``(shape, dtype)`` pair, or an example batch (a tensor), e.g.
  ``{"input_ids": (512,), "attention_mask": (512,)}`` with ``dtype=torch.int64``, or
  ``{"input_ids": ((512,), torch.int64), "inputs_embeds": ...}``.

Costs are counted on the meta device (shapes only), so no value is ever read for them; where the
plan's cuts need a real run of the code between blocks (:func:`hetcoll.torch.replay.probe`), the
example batch is zeros: valid token ids (id 0 is in every vocabulary) and valid positions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hetcoll.model.costs.records import ModelInput, parse_shape


def dtype_of(name: str) -> torch.dtype:
    """A dtype by its torch name (``"int64"``, ``"bfloat16"``, ...), ``ValueError`` naming
    ``dtype`` otherwise."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: expected a torch dtype's name (int64, float32...), got {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sample_shape(value: Any, where: str = "input_shape") -> tuple[int, ...]:
    """The shape of one sample: integer sizes >= 1, no batch dimension, given as a sequence
    or as ``"3x32x32"``; ``ValueError`` naming ``where`` otherwise (every reader of a sample's
    shape checks it here: a size of 0, True or 32.5 once built a model of nothing)."""
    try:
        shape = parse_shape(value) if isinstance(value, str) else value
    except ValueError:
        shape = None  # named below, as ``where``
    if (
        not isinstance(shape, Sequence)
        or not shape
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape)
    ):
        raise ValueError(
            f"{where}: expected the shape of one sample (positive integer sizes, no batch "
            f"dimension), got {value!r}"
        )
    return tuple(shape)


def _one(value: Any, dtype: torch.dtype, name: str, where: str) -> ModelInput:
    if isinstance(value, torch.Tensor):
        if value.dim() < 1 or value.shape[0] < 1:
            raise ValueError(
                f"{where}: an example tensor is a batch (its first dimension the samples), got "
                f"shape {tuple(value.shape)}"
            )
        shape = tuple(value.shape[1:])
        return ModelInput(name, shape, dtype_name(value.dtype))
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[1], torch.dtype)
        and not isinstance(value[0], int)
    ):
        return ModelInput(name, sample_shape(value[0], where), dtype_name(value[1]))
    return ModelInput(name, sample_shape(value, where), dtype_name(dtype))


def model_inputs(inputs: Any, dtype: torch.dtype | None = None) -> tuple[ModelInput, ...]:
    """``inputs`` (module docs) as :class:`ModelInput` records; ``ValueError`` naming
    ``input_shape`` (the argument of :func:`hetcoll.model.layer_costs`) for anything else."""
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, got {type(dtype).__name__}")
    dtype = torch.float32 if dtype is None else dtype
    if isinstance(inputs, Mapping):
        if not inputs:
            raise ValueError("input_shape: an empty dict names no input")
        out = []
        for key, value in inputs.items():
            if not isinstance(key, str) or not key.isidentifier():
                raise ValueError(
                    f"input_shape: keys name the forward's keyword arguments, got {key!r}"
                )
            out.append(_one(value, dtype, key, f"input_shape[{key!r}]"))
        return tuple(out)
    return (_one(inputs, dtype, "", "input_shape"),)


def example_batch(
    inputs: Sequence[ModelInput], batch: int, device: torch.device | str
) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """Positional and keyword arguments of the forward for ``batch`` samples of ``inputs``:
    zeros (on the meta device: shapes only)."""
    made = {
        x.name: torch.zeros((batch, *x.shape), dtype=dtype_of(x.dtype), device=device)
        for x in inputs
    }
    if "" in made:
        return (made[""],), {}
    return (), made


def activation_dtype(model: torch.nn.Module, inputs: Sequence[ModelInput]) -> torch.dtype:
    """The dtype of the activations: a floating input's, else (token ids) the model's first
    floating parameter's (float32 for a model without)."""
    for x in inputs:
        d = dtype_of(x.dtype)
        if d.is_floating_point:
            return d
    for p in model.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.float32
