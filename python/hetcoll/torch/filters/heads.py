"""The record of a transformer block split by heads or hidden units (:class:`TensorSplit`), and
how a rank's module holds its share: its head-counting attributes set to its own counts, its
config's counts in a view of its own (:class:`ConfigView`). Made by
:func:`~.tensor_split.plan_tensor_splits`; read by the split (:mod:`.convert`), its runtime
guards (:mod:`.head_guards`) and probes (:mod:`.head_probes`), and the performance model."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class TensorSplit:
    """An attention split by whole heads (by key/value group under grouped-query attention,
    each query head following its group) or an MLP split by hidden units, paired as Megatron-LM
    pairs them (kind ``"experts"``: a mixture of experts split by each expert's hidden units,
    ``width`` of them per unit, the experts module itself its ``row``, with no ``columns``:
    :mod:`.experts`): ``columns`` — the layers reading the block's input, split along their outputs
    ("split-output", one shared copy of the input) — feed ``row``, split along its input
    ("split-input", one sum-reduction of the block's output).

    ``units``: the key/value groups (attention) or hidden units (MLP) the ranks divide;
    ``width``: the row layer's input features per unit; ``columns``: ``(layer, blocks)``, the
    output features per unit of each block the layer's output packs (one block; three for
    query, key and value packed in one layer: ``(rep * head_dim, head_dim, head_dim)``);
    ``attrs``: the module's attributes that count heads (or their features), by their value per
    unit: a rank's module runs with its own counts; ``config``: the same for the head counts
    of its ``config``, which the rank's module sees in a view of its own (:class:`ConfigView`:
    the config itself is shared by every layer); ``empty_fails``: why its forward cannot run
    on a rank holding none of its units ("" where it can, or no probe could tell:
    :func:`~.head_probes.runs_without_heads`). ``shared``: the module's other parameters
    (a query/key norm over the head dimension, as Qwen3's and Gemma 3's), every rank holding
    them whole and applying them to its own heads: each rank's gradient is its heads' part,
    summed over the ranks in the backward. ``head_dim``: an attention's head size.
    ``tables``: its per-head tables, children making a part per query head (T5's relative
    position bias, an embedding; Swin v2's MLP; Swin's table of a column per head): every rank
    holds them whole (their parameters are in ``shared``) and reads its own heads' part of
    their output, along the dimension ``table_dims`` gives (default the last).
    ``head_params``: its parameters of a number or a row per query head
    (GPT-OSS's attention sinks; Cohere's ``q_norm.weight``, heads x head size), held whole on
    every rank (in ``shared``) and read at the rank's heads
    (:class:`~.head_guards.HeadParameters`); ``key_params``: those of a row per key/value head
    (Cohere's ``k_norm.weight``), read at the key/value heads the rank's module computes.
    ``heads_with``: the attention whose heads
    this one must hold alike, where one of its class holds a per-head table and hands what it
    computes to the others (T5's position bias, one per stack); "" for none. ``whole``: its
    projections every rank holds and runs whole, reading the block's input: multi-query
    attention's key and value (one head, which every query head reads), kept whole on every rank
    as Megatron-LM keeps them; its unit is then a query head. They read the columns' shared copy
    of the input (its gradient summed once) and their parameters are in ``shared``.
    ``whole_features``: for a column packing that key and value with the query heads
    (Falcon-7B's ``query_key_value``), the output features after each block's split ones
    that every rank holds (``(0, head_dim, head_dim)``), their gradients summed alike.
    ``kv_groups``: for grouped-query attention split by query head (``whole``: its key and value
    projections, every key/value head), the key/value heads; each rank cuts their outputs to
    its own query heads' heads, one per query head (:class:`~.head_guards.KeyValueOfHeads`),
    so its module reads them with ``fixed``'s counts (``num_key_value_groups`` 1). 0 for
    none. ``fixed``: attributes set to the same value on every rank. ``by_head``: for
    grouped-query attention split by key/value group, the same attention split by query head
    instead, its key and value whole on every rank: the split where its groups are too few
    for the ranks (Megatron-LM's convention), or where shares name whole query heads.
    ``upstream``: the modules every rank runs whole ahead of the columns, on the block's input
    itself (a latent attention's latent projections and their norms: DeepSeek's
    ``kv_a_proj_with_mqa``, ``q_a_proj``); ``fed_by``: for each column reading one of them,
    the upstream layer whose output is copied to the ranks (:class:`~.layers.UpstreamCopy`:
    its gradient, each rank's its heads' part, summed) and which the column reads as is.
    ``norms``: RMS norms over a column's whole output (OLMo 2's ``q_norm``), by name, with the
    column each follows: split as its output is (:class:`~.layers.FilterParallelRMSNorm`).
    ``adapted``: its layers that are PEFT's LoRA wrappers of a linear layer
    (:func:`~.chains.lora_base`), each split with its adapters: a column's base layer and
    ``lora_B`` split along their outputs, its ``lora_A`` whole on every rank reading the
    columns' copy of the input (its parameters in ``shared``: each rank's gradient its units'
    part, summed); the row's base layer and ``lora_A`` split along their inputs (``lora_A``'s
    output summed over the ranks too, a number per token and adapter rank), its ``lora_B`` whole
    on every rank, reading that sum (its gradient the same on every rank).
    """

    kind: str
    module: str
    units: int
    width: int
    columns: list[tuple[str, tuple[int, ...]]]
    row: str
    attrs: dict[str, int] = field(default_factory=dict)
    config: dict[str, int] = field(default_factory=dict)
    shared: list[str] = field(default_factory=list)
    head_dim: int = 0
    empty_fails: str = ""
    tables: list[str] = field(default_factory=list)
    table_dims: dict[str, int] = field(default_factory=dict)
    head_params: list[str] = field(default_factory=list)
    key_params: list[str] = field(default_factory=list)
    heads_with: str = ""
    whole: list[str] = field(default_factory=list)
    whole_features: dict[str, tuple[int, ...]] = field(default_factory=dict)
    kv_groups: int = 0
    fixed: dict[str, int] = field(default_factory=dict)
    by_head: TensorSplit | None = None
    upstream: list[str] = field(default_factory=list)
    fed_by: dict[str, str] = field(default_factory=dict)
    norms: dict[str, str] = field(default_factory=dict)
    adapted: list[str] = field(default_factory=list)
    #: PEFT's LoRA on an experts module's parameters around it (``ParamWrapper``, outermost
    #: first: :func:`~.chains.experts_adapters`), each with its factor holding the split
    #: dimension (``"lora_A"`` or ``"lora_B"``), sliced with it; the other factor is whole on
    #: every rank, among ``shared`` (its gradient each rank's units' part, summed).
    param_adapters: dict[str, str] = field(default_factory=dict)
    #: Whether the probe forward at the split could not see whether an attention cuts its
    #: heads into parts (an input it lacks stopped it): its first forward looks again
    #: (:class:`~.head_probes.FirstForwardCheck`).
    cut_unseen: bool = False
    #: Whether the probe forwards at the split could not tell whether an attention runs on a
    #: rank holding some of its heads (both failed alike, on an input they lack): its first
    #: forward looks again too.
    parts_unseen: bool = False

    def by_query_head(self) -> bool:
        """Whether its units are query heads beside a key/value head every rank holds whole
        (multi-query attention), not key/value groups."""
        return bool(self.whole or self.whole_features)

    def heads(self) -> int:
        """An attention's query heads (unsplit); 0 for an MLP."""
        return self.units * self.width // self.head_dim if self.head_dim else 0

    def layers(self) -> list[str]:
        return [c for c, _ in self.columns] + [self.row]

    def held_whole(self, names: Iterable[str]) -> list[str]:
        """Its layers every rank holds and runs whole, by name: :attr:`whole` and
        :attr:`upstream`, and those of ``names`` inside its :attr:`tables` (the layers of an
        MLP making a table per head: Swin v2's)."""
        inside = [n for n in names if any(n.startswith(f"{t}.") for t in self.tables)]
        return [*self.whole, *self.upstream, *inside]

    def base(self, layer: str) -> str:
        """The module that computes ``layer``'s projection: its ``base_layer`` where it is one of
        the :attr:`adapted` LoRA wrappers, else ``layer`` itself."""
        return f"{layer}.base_layer" if layer in self.adapted else layer

    def inner(self, names: Iterable[str]) -> list[str]:
        """Those of ``names`` inside its :attr:`adapted` layers (a LoRA wrapper's base layer,
        adapters and dropout: split with their wrapper) or inside the layers it holds whole
        (a LoRA wrapper's, whole with it): no layers of their own."""
        outer = [*self.adapted, *self.whole, *self.upstream]
        return [n for n in names if any(n.startswith(f"{a}.") for a in outer)]

    def features_per_unit(self) -> list[int]:
        """The channels each of :meth:`layers` splits per unit a rank holds: a column's output
        features (every packed block's), the row's input features."""
        return [sum(blocks) for _, blocks in self.columns] + [self.width]

    def packed(self) -> int:
        """How many blocks its most packed column holds (3: query, key and value in one)."""
        return max(len(blocks) for _, blocks in self.columns)

    def hold(self, module: nn.Module, units: int) -> None:
        """Make ``module`` (its :attr:`module`) count the heads of ``units`` units, where it
        counts them: its attributes, and its config's counts in a view of its own
        (:class:`ConfigView`)."""
        for attr, per in self.attrs.items():
            setattr(module, attr, per * units)
        for attr, value in self.fixed.items():
            setattr(module, attr, value)
        if self.config:
            view: Any = ConfigView(
                module.config, {a: per * units for a, per in self.config.items()}
            )
            module.config = view


class ConfigView:
    """A split attention's view of the config it shares with every other layer: its own head
    counts (``own``: the rank's, where the unsplit module's forward reads them from the
    config, as Phi-3's ``self.config.num_attention_heads``), everything else read from and
    written to the shared config, so a later change to it (the attention implementation) still
    reaches the module."""

    __slots__ = ("_base", "_own")

    def __init__(self, base: Any, own: dict[str, int]) -> None:
        if isinstance(base, ConfigView):  # a view of a view: one level, the counts updated
            own, base = {**base._own, **own}, base._base
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_own", dict(own))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        own = object.__getattribute__(self, "_own")
        return own[name] if name in own else getattr(object.__getattribute__(self, "_base"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ConfigView.__slots__:  # unpickling
            object.__setattr__(self, name, value)
        elif name in self._own:
            self._own[name] = value
        else:
            setattr(self._base, name, value)

    def __deepcopy__(self, memo: dict[int, Any]) -> ConfigView:
        import copy

        return ConfigView(copy.deepcopy(self._base, memo), self._own)

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in self._own.items())
        return f"ConfigView({counts}) of {type(self._base).__name__}"
