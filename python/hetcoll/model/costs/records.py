"""What a model's costs are made of: :class:`Kernel` (one kernel of a layer, linear in the batch
and the filter fraction), :class:`LayerCost` (one layer's kernels, parameters and bytes) and
:class:`ModelCosts` (every layer of a model, and the model's top-level layers a plan counts);
:class:`SplitBlock` (an attention or MLP that filter parallelism splits by heads or units)."""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import hetcoll
from hetcoll.model.hardware import check_precision

#: The name of the costed layer a step's loss is (not a module path: no module is called so;
#: :mod:`hetcoll.model.costs.losses`).
LOSS_LAYER = "(loss)"
#: The losses named by a string (``layer_costs``' and the command line's ``loss``).
LOSSES = ("cross-entropy",)

# Traced batch: 2, not 1, because batch norm in training mode refuses one sample.
_TRACE_BATCH = 2
# Batch of the op-counting run (meta tensors: the size costs nothing). A prime no layer's size
# is likely to be a multiple of: a tensor whose element count it divides grows with the batch
# (activations, their gradients), any other is read or written once a step (weights, their
# gradients, position embeddings), so one run tells per-sample bytes from fixed ones.
_COUNT_BATCH = 1009


@dataclass(frozen=True)
class Kernel:
    """One kernel of a layer, affine in the batch ``b`` and linear in the filter fraction
    ``phi``.

    flops(b, phi) = (flops_per_sample * b + flops_fixed [b > 0])
                    * (phi if scales_with_filters else 1)
    bytes(b, phi) = (bytes_per_sample + phi * filter_bytes_per_sample) * b
                    + bytes_fixed + phi * filter_bytes_fixed

    ``flops_fixed``: work the layer does once a step whatever the batch (a relative-position
    table's projection, Swin v2's position-bias MLP)."""

    name: str
    flops_per_sample: float
    bytes_per_sample: float = 0.0
    bytes_fixed: float = 0.0
    filter_bytes_per_sample: float = 0.0
    filter_bytes_fixed: float = 0.0
    scales_with_filters: bool = False
    # Element-wise layer kernels (normalisation, softmax, counted ops) run at the device's
    # element-wise bandwidth, pooling kernels (``pool``) at its pooling bandwidth; GEMMs, data
    # movement (im2col) and plain activations at its memory bandwidth.
    elementwise: bool = False
    pool: bool = False
    # A convolution's GEMM: its arithmetic runs at the device's convolution FLOP rate, on
    # channels padded to the device's channel block: ``channels`` = (output, input) channels
    # of one group.
    conv: bool = False
    channels: tuple[int, int] = (0, 0)
    #: The kernel launches this kernel stands for, each paying the device's fixed cost per
    #: kernel: one for a formula's kernel; a traced layer's summed ops count each of theirs.
    launches: int = 1
    flops_fixed: float = 0.0

    def flops(self, batch: float, filter_fraction: float = 1.0) -> float:
        f = self.flops_per_sample * batch + self.flops_fixed * (batch > 0)
        return f * filter_fraction if self.scales_with_filters else f

    def moved_bytes(self, batch: float, filter_fraction: float = 1.0) -> float:
        return (
            (self.bytes_per_sample + filter_fraction * self.filter_bytes_per_sample) * batch
            + self.bytes_fixed
            + filter_fraction * self.filter_bytes_fixed
        )


@dataclass(frozen=True)
class ModelInput:
    """One input of the model's forward: ``name`` (the keyword, or ``""`` for the one
    positional input), the ``shape`` of one sample (no batch dimension) and its ``dtype`` by
    torch's name (``"float32"``, ``"int64"`` for token ids)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class LayerCost:
    """Costs of one leaf module. Bytes are for ``itemsize``-byte elements (float32: 4).

    ``filters``: output channels a filter-parallel split can divide (0: the layer is
    replicated). ``saved_bytes_per_sample``: activation memory kept for the backward pass.
    """

    name: str
    kind: str
    params: int
    param_bytes: float
    in_bytes_per_sample: float
    out_bytes_per_sample: float
    saved_bytes_per_sample: float
    filters: int
    forward: tuple[Kernel, ...]
    backward: tuple[Kernel, ...]
    #: Groups of a convolution (1 for every other layer): the runtime splits groups=1 only.
    groups: int = 1
    #: True for the ops a module's own ``forward`` runs between its children's calls (``kind``
    #: is then ``Type.forward``); False for a leaf module's call.
    own_ops: bool = False
    #: Element-wise FLOPs per sample, (forward, backward): one per element of each arithmetic
    #: op that is not matmul-class (norms, softmax, masks, RoPE, activations, adds), counted
    #: apart from ``forward_flops`` (the matmul-class FLOPs FlopCounterMode counts); the
    #: predictors cost this work by the bytes it moves, not by these.
    elementwise_flops_per_sample: tuple[float, float] = (0.0, 0.0)
    #: The tensors its ops allocate, (forward, backward), each as (bytes per sample, fixed
    #: bytes, how many): a CPU maps those above :data:`~hetcoll.model.hardware.FRESH_PAGES_BYTES`
    #: afresh at every step (``Device.first_touch_bytes_per_s``).
    allocations: tuple[tuple[tuple[float, float, int], ...], ...] = ((), ())
    #: Bytes of its parameters that need no gradient (a frozen backbone's): held, neither
    #: given a gradient, allreduced nor updated.
    frozen_bytes: float = 0.0

    @property
    def gradient_bytes(self) -> float:
        """Bytes of this layer's weight gradients (what data parallelism allreduces and the
        optimizer updates): its parameters' but the frozen ones'."""
        return self.param_bytes - self.frozen_bytes

    def forward_flops(self, batch: float) -> float:
        return sum(k.flops(batch) for k in self.forward)

    def backward_flops(self, batch: float) -> float:
        return sum(k.flops(batch) for k in self.backward)


@dataclass(frozen=True)
class ExpertsBlock:
    """A mixture-of-experts layer as expert parallelism places it
    (:func:`hetcoll.torch.expert_parallel`: whole experts per rank, each token's ``top_k``
    rows sent to their experts' ranks and back): the experts module's path (its costed
    layers carry that name), its ``experts``, ``top_k`` experts per token, the tokens of one
    sample (``tokens_per_sample``) and each token's ``features``. ``wrappers``: the paths of
    PEFT's LoRA wrappers on its parameters (``ParamWrapper``), placed with it: their layers
    read the experts' weights (PEFT's parametrization) and hold the adapters' blocks."""

    module: str
    experts: int
    top_k: int
    tokens_per_sample: float
    features: int
    wrappers: tuple[str, ...] = ()

    def holds(self, layer: str) -> bool:
        """Whether costed layer ``layer`` is the experts' (the module's, or a wrapper's)."""
        return layer == self.module or layer in self.wrappers

    def routed_bytes_per_sample(self, itemsize: int) -> float:
        """Bytes of one sample's routed rows (one way), at ``itemsize`` bytes an element."""
        return self.tokens_per_sample * self.top_k * self.features * itemsize


@dataclass(frozen=True)
class SplitBlock:
    """An attention split by heads, an MLP split by hidden units or a mixture of experts split
    by each expert's hidden units, as filter parallelism splits it
    (:class:`hetcoll.torch.filters.TensorSplit`): the module's path, its ``kind``
    (``"attention"``, ``"mha"`` for torch's ``nn.MultiheadAttention``, ``"mlp"``,
    ``"experts"``: the experts module is its one layer, its weights held per unit), the
    ``units`` its ranks divide (key/value groups, heads or hidden units), ``width`` (the
    output projection's input features per unit), its split ``layers`` (the projections
    reading the block's input, then the one mapping back) and each layer's channels per unit
    (``per_unit``: a projection's output features, the last layer's input features). Every
    costed layer inside the module runs on a rank's share of the units (but the ``whole``
    ones: multi-query attention's key and value projections, run whole on every rank, their
    parameters among ``shared``; and a layer's ``whole_features``, one per layer: the
    features of it every rank computes, as Falcon-7B's key and value rows packed with its
    query heads); its output is summed
    over the ranks once forward, its input's gradient once backward. ``shared``: the elements
    of each parameter every rank holds whole and applies to its own heads (a per-head norm's
    weight, as Qwen3's ``q_norm``), whose gradient is summed over the ranks once per backward
    too. ``empty``: whether a rank may hold none of its units (False for an attention whose
    forward cannot run without heads, as Falcon-40B's: every rank holds at least one).
    ``heads_with``: the attention whose units this one holds alike (one of its class hands it
    inputs per head, as T5's first attention its position bias); "" for none. ``by_head``:
    for grouped-query attention split by key/value group, the same attention split by query
    head, its key and value whole on every device (:attr:`hetcoll.torch.filters.TensorSplit.
    by_head`), which the runtime splits instead where the groups are too few for the devices
    (:meth:`resolved`)."""

    module: str
    kind: str
    units: int
    width: int
    layers: tuple[str, ...]
    per_unit: tuple[int, ...]
    shared: tuple[int, ...] = ()
    empty: bool = True
    heads_with: str = ""
    whole: tuple[str, ...] = ()
    whole_features: tuple[int, ...] = ()
    by_head: SplitBlock | None = None
    #: The block's other sums over the devices, ``(bytes per sample, forward)``: a split
    #: norm's sum of squares (one number per token, each way), an experts module's routing
    #: weights' gradient (``top_k`` per token), a latent attention's second latent's gradient.
    sums: tuple[tuple[float, bool], ...] = ()
    #: Each layer's costed layer where it is no leaf of its own (PEFT's LoRA wrapper: its base
    #: layer, split as it is; its adapters, small, are priced among ``whole``); () where every
    #: layer is costed under its own name.
    costed: tuple[str, ...] = ()
    #: Its sums over the devices whatever the batch, ``(bytes per forward, forward)``: a DoRA
    #: row's sums of squares of its weight's rows (a number per output feature).
    fixed_sums: tuple[tuple[float, bool], ...] = ()
    #: The adapters split with their layer: PEFT's ``lora_B`` of a column (its rows),
    #: ``lora_A`` of a row (its columns). Each runs on a device's share of the units, which
    #: holds their share of its parameters; the block's other adapters are among
    #: :attr:`whole`.
    split_adapters: tuple[str, ...] = ()
    #: The costed layers of each DoRA layer's work whatever the batch: ``B A`` (PEFT's
    #: adapters called on an identity matrix), ``W + s B A`` and its norm. A device computes
    #: them on its share of the layer (a column's rows, a row's slice of each).
    dora_work: tuple[str, ...] = ()

    def layer_at(self, costed: str) -> int | None:
        """The index among :attr:`layers` of the layer that costed layer ``costed`` prices
        (the layer itself, or its base layer), or None."""
        for names in (self.costed, self.layers):
            if costed in names:
                return names.index(costed)
        return None

    def resolved(
        self,
        speeds: Sequence[float],
        *,
        empty: bool = False,
        shares: Mapping[str, Sequence[int]] | None = None,
    ) -> SplitBlock:
        """The split the runtime makes of it at ``speeds`` (or by layer ``shares``): itself,
        or :attr:`by_head` where per-layer ``shares`` name its query and output projections
        alone, or where its groups are too few for the devices (the runtime's rule, as
        :func:`hetcoll.torch.filter_parallel` splits)."""
        alt = self.by_head
        if alt is None:
            return self
        if shares is not None and self.units_of(shares) is not None:
            named = set(shares)
            return self if all(n in named for n in self.layers) else alt
        try:
            if self.units < len(speeds) and not (empty and self.empty):
                return alt
            self.shares([float(s) for s in speeds], empty=empty)
        except ValueError:
            return alt
        return self

    def shares(self, speeds: Sequence[float], *, empty: bool = False) -> list[int]:
        """The units per rank at ``speeds``, as the runtime splits them (:func:`hetcoll.split`
        over the features in whole units, at least one each unless ``empty`` and the block
        lets a rank hold none).

        >>> SplitBlock("mlp", "mlp", 176, 1, ("up", "down"), (1, 1)).shares([1.0, 0.25])
        [141, 35]
        """
        features = hetcoll.split(
            self.units * self.width,
            [float(s) for s in speeds],
            multiple_of=self.width,
            minimum=0 if empty and self.empty else self.width,
        )
        return [f // self.width for f in features]

    def layer_shares(self, units: Sequence[int]) -> dict[str, list[int]]:
        """Each split layer's channels per rank when the ranks hold ``units``, by name (what
        :func:`hetcoll.torch.filters.filter_shares` reports for them).

        >>> SplitBlock("mlp", "mlp", 176, 1, ("up", "down"), (1, 1)).layer_shares([141, 35])
        {'up': [141, 35], 'down': [141, 35]}
        """
        return {n: [u * f for u in units] for n, f in zip(self.layers, self.per_unit, strict=True)}

    def units_of(self, shares: Mapping[str, Sequence[int]]) -> list[int] | None:
        """The units per rank that ``shares`` (by layer name) give the block, read off the
        first of its layers they name (the last layer first); None where they name none."""
        last = len(self.layers) - 1
        for k in (last, *range(last)):
            if self.layers[k] in shares:
                return [int(v) // self.per_unit[k] for v in shares[self.layers[k]]]
        return None

    def contains(self, layer: str) -> bool:
        """Whether costed layer ``layer`` runs inside the module (its own ops included), or is
        one of its layers (an output projection held beside the attention, as BERT's)."""
        return (
            layer in self.layers
            or layer == self.module
            or layer.startswith(self.module + ".")
            or not self.module
        )


@dataclass(frozen=True)
class ModelCosts:
    """Every leaf layer of a model in execution order, for samples of ``input_shape`` (the shape
    of the first of ``inputs``, all of which ``inputs`` describes: names and dtypes too)."""

    layers: tuple[LayerCost, ...]
    input_shape: tuple[int, ...]
    #: Bytes of one element of the activations (the model's float dtype).
    itemsize: int
    notes: tuple[str, ...] = field(default=())
    #: Bytes of the module's buffers (BatchNorm running statistics), which DDP broadcasts from
    #: rank 0 before every forward.
    buffer_bytes: float = 0.0
    #: The mode :func:`hetcoll.torch.filter_parallel` would give each layer it splits (name,
    #: mode), read off the model by the runtime's own pairing rule; layers absent stay replicated.
    filter_modes: tuple[tuple[str, str], ...] = ()
    #: The channels a split-output layer's shares must be multiples of (name, channels), where
    #: a grouped convolution between it and its split-input partner runs on whole groups
    #: (:attr:`hetcoll.torch.filters.SplitLayout.units`); absent: 1.
    filter_units: tuple[tuple[str, int], ...] = ()
    #: The model's layers as a :class:`hetcoll.Plan` counts them
    #: (:func:`hetcoll.torch.layers.model_layers`: an ``nn.Sequential``'s children, or the
    #: top-level calls of a traced forward), by name; empty when the model is not such a chain
    #: (``plan_layers_note`` says why).
    plan_layers: tuple[str, ...] = ()
    #: For each of ``layers``, the index in ``plan_layers`` of the top-level layer it runs in
    #: (non-decreasing: the top-level layers run in order).
    plan_layer_of: tuple[int, ...] = ()
    #: Bytes per sample of each plan layer's output: what a pipeline stage ending there sends.
    plan_out_bytes: tuple[float, ...] = ()
    #: Module type of each plan layer (``Call`` for a function traced out of a forward).
    plan_layer_kinds: tuple[str, ...] = ()
    #: For each first plan layer ``lo``: the modes the runtime's pairing rule gives a filter-split
    #: stage running from ``lo`` to the last layer, as (layer name, mode, the name of a
    #: split-output layer's split-input partner or ""). The rule pairs left to right, so a
    #: stage ending earlier has the same modes but gathers where the partner lies beyond its
    #: end (:meth:`stage_filter_modes`).
    stage_modes: tuple[tuple[tuple[str, str, str], ...], ...] = ()
    plan_layers_note: str = ""
    #: How many layers :func:`hetcoll.torch.layers.model_layers` lists for the model, known
    #: even where ``plan_layers`` are not (its blocks listed out of call order, say): a plan of
    #: whole-model replicas, which cuts nothing, needs only this.
    whole_model_layers: int = 0
    #: The training precision these costs are for (:data:`hetcoll.model.hardware.PRECISIONS`):
    #: the predictors run matmul-class kernels at the devices' peak for it.
    precision: str = "fp32"
    #: Bytes of one element the kernels read and write and the stages send (activations, and
    #: the 16-bit weight copies autocast makes): 2 under bf16 / fp16, else ``itemsize``.
    #: Parameters, gradients, optimizer state and the gradient allreduce stay ``itemsize``.
    activation_itemsize: int = 0
    #: The forward's inputs the costs are for (one positional input, or keyword inputs).
    inputs: tuple[ModelInput, ...] = ()
    #: How a plan cuts the model (:func:`hetcoll.torch.layers.model_cut`): ``"chain"`` (a stage
    #: boundary carries one tensor; a stage may be split over ranks by filters) or ``"blocks"``
    #: (stages of whole blocks, each on one rank, replaying the forward between them;
    #: ``plan_out_bytes`` are then what crosses each cut).
    plan_cut: str = "chain"
    #: The attentions and MLPs filter parallelism splits by heads and hidden units, in the
    #: model's order; their layers are in ``filter_modes`` too.
    split_blocks: tuple[SplitBlock, ...] = ()
    #: The mixture-of-experts layers expert parallelism places by whole experts, in the
    #: model's order.
    experts: tuple[ExpertsBlock, ...] = ()
    #: The loss the costs end with (``layer_costs``' ``loss``: ``"cross-entropy"`` or the
    #: function's name), costed as the last of ``layers``; ``""``: none.
    loss: str = ""
    #: Heads tied to their token embedding, (head, embedding) by module path
    #: (:func:`hetcoll.torch.filters.vocabulary_ties`): replicated, except under
    #: ``loss_parallel``, where both split by vocabulary.
    vocabulary_ties: tuple[tuple[str, str], ...] = ()

    @property
    def loss_layer(self) -> int | None:
        """The index in ``layers`` of the loss (the last layer, named
        :data:`LOSS_LAYER`), or None without one (a pipeline
        stage's slice of the layers before the last stage's too)."""
        if self.layers and self.layers[-1].name == LOSS_LAYER:
            return len(self.layers) - 1
        return None

    def at_precision(self, precision: str) -> ModelCosts:
        """These costs for training at ``precision`` (``"fp32"``, ``"tf32"``, ``"bf16"``,
        ``"fp16"``; autocast semantics, docs/model.md "Precision"): every byte a kernel moves
        and every activation a stage sends scaled to the precision's element size; parameter
        and gradient bytes unchanged.

        >>> from torch import nn
        >>> from hetcoll.model.costs import layer_costs
        >>> c = layer_costs(nn.Linear(4, 3), (4,))
        >>> c.at_precision("bf16").layers[0].out_bytes_per_sample, c.layers[0].out_bytes_per_sample
        (6.0, 12.0)
        """
        from dataclasses import replace

        check_precision(precision)
        act = 2 if precision in ("bf16", "fp16") else self.itemsize
        f = act / (self.activation_itemsize or self.itemsize)

        def kernel(k: Kernel) -> Kernel:
            return replace(
                k,
                bytes_per_sample=k.bytes_per_sample * f,
                bytes_fixed=k.bytes_fixed * f,
                filter_bytes_per_sample=k.filter_bytes_per_sample * f,
                filter_bytes_fixed=k.filter_bytes_fixed * f,
            )

        layers = tuple(
            x
            if i == self.loss_layer
            else replace(
                x,
                in_bytes_per_sample=x.in_bytes_per_sample * f,
                out_bytes_per_sample=x.out_bytes_per_sample * f,
                saved_bytes_per_sample=x.saved_bytes_per_sample * f,
                forward=tuple(kernel(k) for k in x.forward),
                backward=tuple(kernel(k) for k in x.backward),
                allocations=tuple(
                    tuple((ps * f, fixed * f, n) for ps, fixed, n in made) for made in x.allocations
                ),
            )
            for i, x in enumerate(self.layers)
        )
        return replace(
            self,
            layers=layers,
            plan_out_bytes=tuple(b * f for b in self.plan_out_bytes),
            precision=precision,
            # 0: the same as ``itemsize``, as costs are built.
            activation_itemsize=0 if act == self.itemsize else act,
        )

    def plan_range(self, first: int, end: int) -> tuple[int, int]:
        """The half-open range of ``layers`` that plan layers ``[first, end)`` hold.

        >>> from torch import nn
        >>> from hetcoll.model.costs import layer_costs
        >>> c = layer_costs(nn.Sequential(nn.Linear(4, 3), nn.Flatten(), nn.Linear(3, 2)), (4,))
        >>> c.plan_range(0, 2), c.plan_range(2, 3)
        ((0, 2), (2, 3))
        """
        self.check_plan_layers()
        if not 0 <= first < end <= len(self.plan_layers):
            raise ValueError(
                f"layers: [{first}, {end}) is not a range of the model's "
                f"{len(self.plan_layers)} layers"
            )
        return _bisect(self.plan_layer_of, first), _bisect(self.plan_layer_of, end)

    def whole_model_plan_layers(self) -> int:
        """How many layers a whole-model stage spans in a Plan (:attr:`whole_model_layers`);
        ``ValueError`` (saying why) where the model cannot be cut at all."""
        if self.plan_layers:
            return len(self.plan_layers)
        if self.whole_model_layers:
            return self.whole_model_layers
        self.check_plan_layers()
        raise AssertionError("unreachable")  # check_plan_layers raised

    def check_plan_layers(self) -> None:
        """Raise ``ValueError`` (saying why) when the model's layers cannot be cut as a Plan
        cuts them."""
        if not self.plan_layers:
            raise ValueError(
                "costs: the model's top-level layers are unknown"
                + (f" ({self.plan_layers_note})" if self.plan_layers_note else "")
                + "; plans need a model hetcoll.torch.layers.model_layers can cut"
            )

    def stage_filter_modes(self, first: int, end: int) -> dict[str, str]:
        """The mode of every layer a filter-split stage over plan layers ``[first, end)``
        splits (name -> "gather" / "split-output" / "split-input"), as
        :func:`hetcoll.torch.parallelize` builds the stage (the runtime's pairing rule on an
        ``nn.Sequential`` of those layers).

        >>> from torch import nn
        >>> from hetcoll.model.costs import layer_costs
        >>> c = layer_costs(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), (4,))
        >>> c.stage_filter_modes(0, 3), c.stage_filter_modes(0, 2)
        ({'0': 'split-output', '2': 'split-input'}, {'0': 'gather'})
        """
        self.check_plan_layers()
        lo, hi = self.plan_range(first, end)
        names = {x.name for x in self.layers[lo:hi]}
        if self.plan_cut == "blocks":
            # The whole model's split, restricted to the stage: the runtime splits a copy of
            # the model that holds the stage's blocks alone (the attentions and MLPs inside
            # them whole, their layers all named, costed or not).
            for block in self.split_blocks:
                if any(block.contains(n) for n in names):
                    names.update(block.layers)
            return {n: m for n, m in self.filter_modes if n in names}
        return {
            name: "gather" if mode == "split-output" and partner not in names else mode
            for name, mode, partner in self.stage_modes[first]
            if name in names
        }

    def stage_filter_pairs(self, first: int, end: int) -> dict[str, str]:
        """The split-output -> split-input pairs of :meth:`stage_filter_modes`, by name."""
        lo, hi = self.plan_range(first, end)
        if self.plan_cut == "blocks":
            return {}
        names = {x.name for x in self.layers[lo:hi]}
        return {
            name: partner
            for name, mode, partner in self.stage_modes[first]
            if mode == "split-output" and name in names and partner in names
        }

    @property
    def params(self) -> int:
        return sum(x.params for x in self.layers)

    @property
    def param_bytes(self) -> float:
        return sum(x.param_bytes for x in self.layers)

    @property
    def gradient_bytes(self) -> float:
        """Bytes of the weight gradients (:attr:`LayerCost.gradient_bytes`): what a replica
        allreduces and its optimizer updates."""
        return sum(x.gradient_bytes for x in self.layers)

    def forward_flops(self, batch: float) -> float:
        key = (True, type(batch), batch)
        if key not in self._flops:
            _check_samples(batch)
            self._flops[key] = sum(x.forward_flops(batch) for x in self.layers)
        return self._flops[key]

    def backward_flops(self, batch: float) -> float:
        key = (False, type(batch), batch)
        if key not in self._flops:
            _check_samples(batch)
            self._flops[key] = sum(x.backward_flops(batch) for x in self.layers)
        return self._flops[key]

    @functools.cached_property
    def _flops(self) -> dict[tuple[bool, type, float], float]:
        # The sums above by direction and batch, worked out once: the planner asks for them
        # for every candidate it bounds (not a field: equality and hashing ignore it).
        return {}

    def elementwise_flops(self, batch: float) -> tuple[float, float]:
        """Element-wise FLOPs (forward, backward) of ``batch`` samples
        (:attr:`LayerCost.elementwise_flops_per_sample`), apart from :meth:`forward_flops`."""
        f = sum(x.elementwise_flops_per_sample[0] for x in self.layers)
        b = sum(x.elementwise_flops_per_sample[1] for x in self.layers)
        return f * batch, b * batch

    def saved_bytes_per_sample(self) -> float:
        return sum(x.saved_bytes_per_sample for x in self.layers)

    def table(self) -> str:
        """A per-layer text table (GFLOP per sample, forward / backward; params; bytes)."""
        rows = [
            f"{'layer':<24} {'kind':<12} {'params':>10} {'fwd MFLOP':>10} {'bwd MFLOP':>10} "
            f"{'act KiB':>9} {'grad KiB':>9}"
        ]
        for x in self.layers:
            rows.append(
                f"{x.name[:24]:<24} {x.kind[:12]:<12} {x.params:>10} "
                f"{x.forward_flops(1) / 1e6:>10.3f} {x.backward_flops(1) / 1e6:>10.3f} "
                f"{x.out_bytes_per_sample / 1024:>9.1f} {x.gradient_bytes / 1024:>9.1f}"
            )
        rows.append(
            f"{'total':<24} {'':<12} {self.params:>10} {self.forward_flops(1) / 1e6:>10.3f} "
            f"{self.backward_flops(1) / 1e6:>10.3f}"
        )
        return "\n".join(rows)


def _bisect(sorted_ints: Sequence[int], value: int) -> int:
    """The first index whose value is >= ``value``."""
    return bisect.bisect_left(sorted_ints, value)


def split_input_partners(modes: Mapping[str, str]) -> dict[str, str]:
    """Each split-output layer's partner under the runtime's pairing rule, by name: the next
    layer in ``modes``' order (layer name -> mode), where it is split-input (it reads the
    split channels, so the pair sums once instead of gathering).

    >>> split_input_partners({"wi": "split-output", "wo": "split-input", "head": "gather"})
    {'wi': 'wo'}
    """
    return {
        name: after
        for name, after in itertools.pairwise(modes)
        if modes[name] == "split-output" and modes[after] == "split-input"
    }


def parse_shape(text: str) -> tuple[int, ...]:
    """``"3x32x32"`` -> ``(3, 32, 32)`` (one sample, no batch dimension).

    >>> parse_shape("3x32x32")
    (3, 32, 32)
    """
    if not isinstance(text, str):
        raise TypeError(f"input: must be a str of sizes like 3x32x32, got {type(text).__name__}")
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"input: expected sizes like 3x32x32, got {text!r}") from None
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"input: every size must be >= 1, got {text!r}")
    return shape


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _check_samples(batch: object) -> None:
    """``batch`` of :meth:`ModelCosts.forward_flops` and kin: a number of samples >= 0
    (fractions are a share's mean; -1 once counted negative FLOPs)."""
    try:
        ok = not isinstance(batch, bool) and isinstance(batch, numbers.Real)
        ok = ok and 0 <= float(batch) < math.inf  # type: ignore[arg-type]
    except OverflowError:  # an int past float's range
        ok = False
    if not ok:
        raise ValueError(f"batch: must be a number of samples >= 0, got {batch!r}")
