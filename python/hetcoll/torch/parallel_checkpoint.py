"""Checkpoints of a :class:`~hetcoll.torch.parallel.Parallel`: the unsplit model's state and
optimizer state, gathered from the ranks that hold its pieces under any plan, and loaded back
into any other plan's ranks (:mod:`hetcoll.torch.state_dicts` holds the rules every
checkpointing path shares), and the data position: :meth:`PlanCheckpoints.sampler` orders the
plan's global batches with a :class:`~hetcoll.torch.BalancedSampler` whose state resumes the
epoch at the next step untrained, under any other plan. :class:`PlanCheckpoints` is the part of
``Parallel`` that does it; ``Parallel`` runs the steps.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from hetcoll.comm import agree, allgather_objects
from hetcoll.plan import Plan
from hetcoll.torch.filters import gather_state_dict, split_tensors
from hetcoll.torch.filters.shards import Marks, flag_copy
from hetcoll.torch.placement import Block, OwnersStage
from hetcoll.torch.sampler import BalancedSampler
from hetcoll.torch.state_dicts import (
    Part,
    check_full_optimizer_state_dict,
    check_full_state_dict,
    check_optimizer,
    local_optimizer_state_dict,
    named_optimizer_state,
    state_kind,
)
from hetcoll.torch.transport import Transport, as_bytes, from_bytes

#: Every dtype of this torch, in one order on every rank: a tensor's dtype as a number.
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


class PlanCheckpoints:
    """The checkpoint methods of :class:`~hetcoll.torch.parallel.Parallel` (which sets the
    attributes below when :func:`~hetcoll.torch.parallel.parallelize` builds it)."""

    plan: Plan
    rank: int
    place: tuple[int, int] | None
    stage: nn.Module | None
    _tr: Transport
    _device: torch.device
    _state_layout: list[tuple[str, int, tuple[int, ...], torch.dtype]]
    _param_names: list[str]
    _blocks: dict[tuple[int, int], list[Block]]
    _alias: dict[str, str]
    _home: dict[str, int]
    _experts_names: frozenset[str]
    #: A chain's state outside its layers (modules its forward never calls): on no stage.
    _unheld: dict[str, torch.Tensor]
    #: A rank holding no parameter: its placeholder, and the model's parameter it holds none
    #: of, with those marks (:meth:`hold_nothing`).
    idle: nn.Parameter
    _nothing_of: tuple[str, Marks] | None = None

    def sampler(
        self, dataset: Any, *, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ) -> BalancedSampler:
        """The order of ``dataset`` in the plan's global batches: every rank gets the same
        ``plan.batch`` indices a step (:meth:`BalancedSampler.whole_batches`, checked across
        the plan's group), for ``DataLoader(dataset, batch_sampler=s.batch_sampler(), ...)``
        feeding :meth:`~hetcoll.torch.parallel.Parallel.step`. Its ``state_dict()`` is the
        data position of a checkpoint: the steps the loader handed to training, whatever its
        workers fetched ahead. A job resumed under another plan (other ranks, shares re-solved)
        builds its own with the same ``shuffle`` and ``seed`` and loads the state into it
        (``load_state_dict``, collective: the ranks check the position): the rest of the epoch is
        cut into the new plan's batches, and the epoch sees every sample once. ``drop_last``
        (default on): a step takes ``plan.batch`` rows, so an epoch's smaller remainder is
        dropped; with it off the last step is smaller and ``step`` refuses it, unless the
        dataset's length is a multiple of the batch. Collective over the group (the batch is
        checked).

        >>> s = par.sampler(dataset)  # doctest: +SKIP
        >>> loader = DataLoader(dataset, batch_sampler=s.batch_sampler())  # doctest: +SKIP
        >>> ckpt = {"model": par.full_state_dict(), "data": s.state_dict()}  # doctest: +SKIP
        """
        return BalancedSampler.whole_batches(
            dataset,
            self.plan.batch,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            group=self._tr.comm,
        )

    def _wire_device(self) -> torch.device:
        # NCCL moves CUDA tensors only; gloo and MPI move host memory.
        return self._device if self._tr.engine == "nccl" else torch.device("cpu")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsplit model's state dict, with its original names, on every rank (CPU
        tensors). Taken from replica 0 (BatchNorm running statistics included: see the module
        docs). Collective over the group."""
        plan, out = self.plan, {}
        replica0 = plan.replicas[0]
        local: dict[str, torch.Tensor] | None = None
        if self.place is not None and self.place[0] == 0 and self.stage is not None:
            ranks = replica0.stages[self.place[1]].ranks
            if isinstance(self.stage, OwnersStage):
                pass  # summed below
            elif len(ranks) > 1:  # gathered to the lead (sub-group ranks are in increasing order)
                local = gather_state_dict(self.stage, dst=sorted(ranks).index(ranks[0]))
            else:
                local = self.stage.state_dict()
        experts = self._experts_names
        for j, stage in enumerate(replica0.stages):
            keys = [
                e
                for e in self._state_layout
                if stage.layers[0] <= e[1] < stage.layers[1]
                and e[0] not in experts
                and e[0] not in self._unheld
            ]
            if not keys:
                continue
            if (0, j) in self._blocks:
                out.update(self._owners_state(keys, self.place == (0, j)))
                continue
            lead = stage.ranks[0]
            # The dtypes as the lead holds them now: a forward may convert its own weights
            # (Switch Transformers' router casts its classifier to float32 at each call).
            held = local if self.rank == lead else None
            codes = torch.tensor(
                [_DTYPES.index(held[k].dtype) if held is not None else 0 for k, *_ in keys],
                dtype=torch.int64,
                device=self._wire_device(),
            )
            self._tr.broadcast(codes, lead)
            dtypes = [_DTYPES[c] for c in codes.tolist()]
            sizes = [
                math.prod(shape) * dtype.itemsize
                for (_, _, shape, _), dtype in zip(keys, dtypes, strict=True)
            ]
            buf = torch.empty(sum(sizes), dtype=torch.uint8, device=self._wire_device())
            if self.rank == lead:
                assert local is not None
                buf.copy_(torch.cat([as_bytes(local[k]) for k, *_ in keys]))
            self._tr.broadcast(buf, lead)
            at = 0
            host = buf.cpu()
            for (key, _, shape, _), dtype, n in zip(keys, dtypes, sizes, strict=True):
                out[key] = from_bytes(host[at : at + n], dtype, shape, copy=True)
                at += n
        if experts:  # every replica holds its own experts: each rank adds its slices
            parts = self._parts()
            out.update(
                self._summed(
                    [
                        (k, shape, dtype)
                        for k, _, shape, dtype in self._state_layout
                        if k in experts
                    ],
                    {n: tp for n, tp in parts.items() if n in experts},
                )
            )
        out.update({k: t.clone() for k, t in self._unheld.items()})
        return {k: out[k] for k, *_ in self._state_layout}

    def _owners_state(
        self, keys: list[tuple[str, int, tuple[int, ...], torch.dtype]], mine: bool
    ) -> dict[str, torch.Tensor]:
        """An owners stage's full tensors on every rank (``mine``: this rank is in it), summed
        from the ranks' channels (:meth:`_summed`)."""
        parts = self._parts() if mine else {}
        pieces = {n: tp for n, tp in parts.items() if self._counts(n, tp[1])}
        return self._summed([(k, shape, dtype) for k, _, shape, dtype in keys], pieces)

    def _summed(
        self,
        members: list[tuple[Any, tuple[int, ...], torch.dtype]],
        pieces: Mapping[Any, tuple[torch.Tensor, Part]],
    ) -> dict[Any, torch.Tensor]:
        """Full tensors of ``members`` (key, full shape, dtype) on every rank (CPU): each rank
        writes its ``pieces`` (key -> its tensor and where it sits; only pieces that count)
        into a zeroed full-size buffer, one per dtype, and the group sums them. Exact: each
        entry is one rank's value plus zeros. Collective over the group."""
        out = {}
        for dtype in dict.fromkeys(d for *_, d in members):
            same = [m for m in members if m[2] == dtype]
            sizes = [math.prod(shape) for _, shape, _ in same]
            buf = torch.zeros(sum(sizes), dtype=dtype, device=self._wire_device())
            at = 0
            for (key, shape, _), n in zip(same, sizes, strict=True):
                if key in pieces:
                    t, part = pieces[key]
                    part.put(buf[at : at + n].view(shape), t)
                at += n
            self._tr.allreduce(buf, None)
            host, at = buf.cpu(), 0
            for (key, shape, _), n in zip(same, sizes, strict=True):
                out[key] = host[at : at + n].view(shape).clone()
                at += n
        return out

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The unsplit model's optimizer state, on every rank (CPU tensors): ``optimizer``'s
        state (built over :meth:`parameters`) with every parameter's state whole, keyed by the
        original model's parameter names as torch.distributed.checkpoint's full optimizer state
        dict and FSDP's ``full_optim_state_dict`` are (:mod:`hetcoll.torch.state_dicts`): state
        shaped as its parameter (SGD's momentum, Adam's moments) is gathered from the ranks
        holding slices of it, as :meth:`full_state_dict` gathers the weights, from replica 0.
        Collective over the group; every rank passes an optimizer of the same type and param
        groups (an idle rank's holds its placeholder), or every rank raises.
        :meth:`load_full_optimizer_state_dict` loads it into any plan's ranks.

        >>> full = par.full_optimizer_state_dict(opt)  # doctest: +SKIP
        """
        parts = self._parts()
        names = self._names_of_params(parts)
        failure: BaseException | None = None
        state: dict[str, dict[str, Any]] = {}
        groups: list[tuple[dict[str, Any], list[str]]] = []
        try:
            state, groups = named_optimizer_state(optimizer, names)
        except (TypeError, ValueError) as e:
            failure = e
        fields = {"the number of the optimizer's param groups": len(groups)}
        for g, (hyper, _) in enumerate(groups):
            fields[f"the hyperparameters of param group {g}"] = zlib.crc32(
                repr(sorted(hyper.items())).encode()
            )
        agree(self._tr.comm, fields, failure=failure)

        # What this rank's state adds to the full one: its parts of replica 0's parameters (as
        # full_state_dict reads them), tensors by (name, field, dtype), the rest by value.
        held: list[str] = []
        entries: list[tuple[str, str, str, Any]] = []
        if self.place is not None:
            for n, (t, part) in parts.items():
                if id(t) not in names or not self._counts(n, part):
                    continue
                if self.place[0] != 0 and n not in self._experts_names:
                    continue  # replica 0's, but for the experts every replica holds its own
                held.append(n)
                for f, v in state.get(n, {}).items():
                    if state_kind(v, t.shape) == "sliced":
                        entries.append((n, f, "sliced", str(v.dtype)))
                    else:
                        kept = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                        entries.append((n, f, "value", kept))
        mine = {"held": held, "entries": entries, "groups": [names for _, names in groups]}
        every = allgather_objects(self._tr.comm, mine)

        order = {n: i for i, n in enumerate(self._param_names)}
        holders: dict[str, list[int]] = {}
        found: dict[tuple[str, str], tuple[str, Any, list[int]]] = {}
        for q, d in enumerate(every):
            for n in d["held"]:
                holders.setdefault(n, []).append(q)
            for n, f, kind, v in d["entries"]:
                if (n, f) not in found:
                    found[n, f] = (kind, v, [])
                elif kind == "sliced" and found[n, f][:2] != (kind, v):
                    raise ValueError(
                        f"optimizer: ranks keep parameter {n!r}'s {f!r} in different dtypes "
                        f"({found[n, f][1]} and {v})"
                    )
                found[n, f][2].append(q)
        for (n, f), (kind, _, ranks) in found.items():
            if kind == "sliced" and ranks != holders[n]:
                raise ValueError(
                    f"optimizer: parameter {n!r} is held by ranks {holders[n]} but only ranks "
                    f"{ranks} have its {f!r} state (did every rank step the same optimizer?)"
                )
        shapes = {k: shape for k, _, shape, _ in self._state_layout}
        keys = sorted(found, key=lambda nf: order[nf[0]])
        members = [
            (k, shapes[k[0]], getattr(torch, found[k][1].removeprefix("torch.")))
            for k in keys
            if found[k][0] == "sliced"
        ]
        pieces = {
            (n, f): (state[n][f], parts[n][1]) for n, f, kind, _ in entries if kind == "sliced"
        }
        full = self._summed(members, pieces)
        out: dict[str, dict[str, Any]] = {}
        for n, f in keys:  # each parameter's fields in its first holder's order
            kind, v, _ = found[n, f]
            out.setdefault(n, {})[f] = full[n, f] if kind == "sliced" else v
        param_groups = []
        for g, (hyper, _) in enumerate(groups):
            listed = {n for d in every for n in d["groups"][g]}
            param_groups.append({**hyper, "params": sorted(listed, key=order.__getitem__)})
        return {"state": out, "param_groups": param_groups}

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load the unsplit model's ``state_dict`` (:meth:`full_state_dict`'s, a filter-parallel
        model's gathered one, or a plain model's) into this rank's part of the model: its
        stage's layers, its channel slice of a split stage, its own channels of an owners
        stage, whatever plan wrote the checkpoint. Local (no communication); keys and shapes
        are checked first, against the unsplit model, the same on every rank.

        >>> par = parallelize(make_model(), new_plan, loss_fn=loss)  # doctest: +SKIP
        >>> par.load_full_state_dict(ckpt["model"])  # doctest: +SKIP
        """
        check_full_state_dict(
            state_dict,
            {k: shape for k, _, shape, _ in self._state_layout},
            dtypes={k: dtype for k, _, _, dtype in self._state_layout},
        )
        with torch.no_grad():
            for n, (t, part) in self._parts().items():
                t.copy_(part.take(state_dict[n]).to(t.device, t.dtype))
            for n, t in self._unheld.items():
                t.copy_(state_dict[n].to(t.dtype))

    def load_full_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
    ) -> None:
        """Load a full optimizer state dict (:meth:`full_optimizer_state_dict`'s, or
        :func:`hetcoll.torch.gather_optimizer_state_dict`'s) into ``optimizer``, built over
        :meth:`parameters` with the param groups it was saved with: each rank takes its part of
        every parameter it holds, whatever plan wrote it, and the saved hyperparameters. Local
        (no communication); names and shapes are checked first, against the unsplit model.

        >>> opt = torch.optim.SGD(par.parameters(), lr=0.1, momentum=0.9)  # doctest: +SKIP
        >>> par.load_full_optimizer_state_dict(opt, ckpt["optimizer"])  # doctest: +SKIP
        """
        check_optimizer(optimizer)
        shapes = {k: shape for k, _, shape, _ in self._state_layout}
        check_full_optimizer_state_dict(state_dict, {n: shapes[n] for n in self._param_names})
        parts = self._parts()
        held: dict[int, tuple[str, Part] | None] = {
            i: None if n is None else (n, parts[n][1])
            for i, n in self._names_of_params(parts).items()
        }
        optimizer.load_state_dict(local_optimizer_state_dict(optimizer, state_dict, held))

    def _parts(self) -> dict[str, tuple[torch.Tensor, Part]]:
        """This rank's parameters and buffers by the model's state-dict names, each with where
        it sits in the full tensor (a filter-split stage's channel slice, an owners stage's
        channels, or whole)."""
        shapes = {k: shape for k, _, shape, _ in self._state_layout}
        if self.stage is None:
            return {}
        if isinstance(self.stage, OwnersStage):
            return {
                n: (t, Part(shapes[n], index=index))
                for n, (t, index) in self.stage.local_state().items()
            }
        out = {n: (t, Part(shapes[n])) for n, t in self.stage.state_dict(keep_vars=True).items()}
        for n, (t, part) in split_tensors(self.stage).items():
            out[n] = (t, part)
        # A parameter tied to another (a head to its embedding) by the name the model gives it
        # once; a stage holding both holds one tensor.
        for alias, name in self._alias.items():
            if alias in out:
                tp = out.pop(alias)
                out.setdefault(name, tp)
        return out

    def _contributes(self, name: str, part: Part) -> bool:
        """Whether this rank's gradient of a tensor counts in a sum over its holders: every
        slice does; a whole tensor held by several ranks of a stage counts once (at the
        stage's lead, or at an owners stage's holder of the layer's whole tensors). Stages
        that each use a tensor (a blocks model's parameters between blocks, a tied head) each
        add their own gradient."""
        if not part.whole:
            return True
        if isinstance(self.stage, OwnersStage):
            layer = next(layer for k, layer, *_ in self._state_layout if k == name)
            return self.stage.whole_tensor_holder(layer) == self.rank
        assert self.place is not None
        return self.rank == self.plan.replicas[self.place[0]].stages[self.place[1]].ranks[0]

    def _counts(self, name: str, part: Part) -> bool:
        """Whether this rank's copy of a tensor is the one a full checkpoint takes for its
        replica: that of the stage holding the tensor's layer (a tensor several stages hold is
        taken once), as :meth:`_contributes` picks within the stage."""
        if self.place is not None and name in self._home:
            lo, hi = self.plan.replicas[self.place[0]].stages[self.place[1]].layers
            if not lo <= self._home[name] < hi:
                return False
        return self._contributes(name, part)

    def _names_of_params(
        self, parts: dict[str, tuple[torch.Tensor, Part]]
    ) -> dict[int, str | None]:
        """``id(parameter) -> name`` for this rank's parameters; None for the placeholder an
        idle rank (or an owners rank holding no channel with weights) holds."""
        names: dict[int, str | None] = {
            id(t): n for n, (t, _) in parts.items() if isinstance(t, nn.Parameter)
        }
        idle = getattr(self, "idle", None)
        if idle is not None:
            names[id(idle)] = None
        return names

    def hold_nothing(self) -> None:
        """Make this rank one that holds no parameter of the model (idle, a stage of
        parameter-free layers, an owners stage owning no channel with weights): it gets a
        placeholder parameter, ``idle``, so the same training code runs on every rank, and in
        DCP's names (its state dict, its optimizer's) it holds none of the model's first
        parameter, an empty slice so marked (:class:`~hetcoll.torch.filters.shards.Marks`).
        DCP wants a state dict on every rank, and reads and writes nothing of such a slice, so
        checkpoints of plans with and without idle ranks load into each other."""
        shapes = {k: (shape, dtype) for k, _, shape, dtype in self._state_layout}
        first = next((n for n in self._param_names if shapes[n][0]), None)
        if first is None:  # no parameter of one dimension or more: a placeholder of none
            self.idle = nn.Parameter(torch.empty(0, device=self._device))
            return
        shape, dtype = shapes[first]
        self.idle = nn.Parameter(torch.empty((0, *shape[1:]), dtype=dtype, device=self._device))
        self._nothing_of = (first, Marks(0, (), shape[0]))  # parallelize registers the marks

    def _holds_nothing(self, name: str, t: Any) -> bool:
        """Whether entry ``name``, ``t``, is an idle rank's placeholder: empty, under the name
        of the parameter it holds none of (:meth:`hold_nothing`)."""
        return (
            self._nothing_of is not None
            and name == self._nothing_of[0]
            and isinstance(t, torch.Tensor)
            and t.numel() == 0
        )

    def param_marks(self) -> list[tuple[torch.Tensor, Marks]]:
        """An idle rank's placeholder with its marks (none of the model's first parameter:
        :meth:`hold_nothing`), for the optimizer hooks of
        :mod:`hetcoll.torch.filters.shards`."""
        return [] if self._nothing_of is None else [(self.idle, self._nothing_of[1])]

    def _model_name(self, name: str, canonical: bool) -> str:
        """A parameter's or buffer's name in this module (``stage.``...) as the unsplit model
        names it; ``canonical``: a tied alias by the model's first name for the tensor."""
        if name == "idle" and self._nothing_of is not None:
            return self._nothing_of[0]
        name = name.removeprefix("stage.")
        return self._alias.get(name, name) if canonical else name

    def _tied_elsewhere(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's tied parameters by the model's first name for them, where its stage
        holds them under another name only (a head tied to an embedding held by another
        stage)."""
        if self.stage is None:
            return []
        held = dict(self.stage.named_parameters(remove_duplicate=False))
        return [
            (name, held[alias])
            for alias, name in self._alias.items()
            if alias in held and name not in held
        ]

    def param_copies(self) -> list[torch.Tensor]:
        """This rank's parameters held as copies of what another rank writes to a DCP
        checkpoint: on a rank of a replica after the first, all but its experts (each replica
        holds its own), for the optimizer hooks of :mod:`hetcoll.torch.filters.shards`."""
        if not self._is_copy():
            return []
        return [
            t
            for n, (t, _) in self._parts().items()
            if isinstance(t, nn.Parameter) and n not in self._experts_names
        ]

    def _is_copy(self) -> bool:
        """Whether this rank's state copies replica 0's (:class:`~hetcoll.torch.ReplicaSavePlanner`
        writes the first replica's)."""
        return self.place is not None and self.place[0] > 0

    def _fqn_modifiers(self) -> dict[str, str]:
        """torch.distributed.checkpoint's contract for a module whose state-dict keys leave out
        a submodule's name (``torch.distributed.checkpoint.state_dict``): each first name of a
        key reaches its tensor through ``stage``, so DCP names the parameters, and the
        optimizer's state, as :func:`keyed_as_the_model` names the state dict."""
        out = dict.fromkeys(self._stage_names(), "stage")
        if self._nothing_of is not None:
            out.setdefault(self._nothing_of[0].split(".", 1)[0], "_path_to_nothing")
        return out

    @property
    def _path_to_nothing(self) -> Any:
        """Attributes spelling the name of the tensor an idle rank holds none of, down to its
        placeholder: DCP resolves each name it is given by attributes from the model."""
        assert self._nothing_of is not None
        path: Any = self.idle
        atoms = self._nothing_of[0].split(".")
        for atom in reversed(atoms[1:]):
            path = SimpleNamespace(**{atom: path})
        return SimpleNamespace(**{atoms[0]: path})

    def _stage_names(self) -> set[str]:
        """The first names of this rank's stage's state-dict keys: its layers' (the model's
        child names) and its own tensors'."""
        if self.stage is None:
            return set()
        own = (n for n, _ in self.stage.named_parameters(recurse=False))
        buffers = (n for n, _ in self.stage.named_buffers(recurse=False))
        return {n for n, _ in self.stage.named_children()} | set(own) | set(buffers)


def keyed_as_the_model(module: nn.Module, state_dict: Any, prefix: str, metadata: Any) -> None:
    """A :class:`~hetcoll.torch.parallel.Parallel`'s state-dict post-hook: this rank's
    entries under the unsplit model's names (``stage.`` dropped), as a plain model, a
    filter-parallel model and every other plan's ranks name them, so that
    torch.distributed.checkpoint writes one unsplit model whatever the plan, and loads it into
    any other. An idle rank's placeholder is the empty slice of the model's first parameter
    it stands for (:meth:`PlanCheckpoints.hold_nothing`). A rank of a replica after the first
    flags its tensors, but its experts, as copies (:mod:`hetcoll.torch.dcp_planner`)."""
    assert isinstance(module, PlanCheckpoints)
    idle = state_dict.pop(prefix + "idle", None)
    head = prefix + "stage."
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if key.startswith(head):
            state_dict[prefix + key[len(head) :]] = state_dict.pop(key)
        else:  # its own modules' (a loss function's class weights): not the model's
            del state_dict[key]
    if idle is not None and module._nothing_of is not None:
        name, marks = module._nothing_of
        if not isinstance(idle, nn.Parameter):  # keep_vars hands out the parameter unmarked
            marks.mark(idle)
        state_dict[prefix + name] = idle
    if module._is_copy():
        for key, t in state_dict.items():
            if (
                key.startswith(prefix)
                and isinstance(t, torch.Tensor)
                and not isinstance(t, nn.Parameter)  # keep_vars hands out the parameters
                and key[len(prefix) :] not in module._experts_names
            ):
                flag_copy(t)


def keyed_as_the_stage(module: nn.Module, state_dict: Any, prefix: str, *args: Any) -> None:
    """The load pre-hook undoing :func:`keyed_as_the_model`: the model's names back under
    ``stage.`` (keys already under it, as state dicts saved before were, are kept), and an idle
    rank's placeholder put back."""
    assert isinstance(module, PlanCheckpoints) and isinstance(module, nn.Module)
    names = module._stage_names()
    own = {n for n, _ in module.named_children()} - {"stage"}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix) :]
        first = rest.split(".", 1)[0]
        if first == "idle" or module._holds_nothing(rest, state_dict[key]):
            del state_dict[key]  # an idle rank's placeholders: this rank's is put back below
        elif first in names:
            state_dict[prefix + "stage." + rest] = state_dict.pop(key)
        elif first == "stage":  # as earlier versions keyed it (an owners stage's under parts.)
            if isinstance(module.stage, OwnersStage) and rest.startswith("stage.parts."):
                state_dict[prefix + "stage." + rest[len("stage.parts.") :]] = state_dict.pop(key)
        elif first not in own:  # not this rank's: reported as the stage's unexpected key
            state_dict[prefix + "stage." + rest] = state_dict.pop(key)
    # Its own modules' state (a loss function's class weights) is not the model's: left out of
    # its state dict, and kept as it is where a state dict (an earlier version's) lacks it.
    for child in own:
        for name, t in getattr(module, child).state_dict(keep_vars=True).items():
            state_dict.setdefault(f"{prefix}{child}.{name}", t.detach())
    idle = getattr(module, "idle", None)
    if isinstance(idle, nn.Parameter):
        state_dict[prefix + "idle"] = idle.detach()


def named_as_the_model_in_errors(module: nn.Module, incompatible: Any) -> None:
    """The load post-hook naming the missing and unexpected keys :func:`keyed_as_the_stage`
    put under ``stage.`` as the model names them (those of a root module's load)."""
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [k.removeprefix("stage.") for k in keys]
