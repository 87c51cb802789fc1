"""Built-in networks for the planner and the validation runs (no torchvision needed).

``cnn``: a small CIFAR-style CNN in the style of seed 003 / PyDTNN's examples (3x3 convs, batch
norm, ReLU, max pooling, two dense layers). ``vgg``: a VGG-11-like stack for 32x32 inputs.
``resnet``: a ResNet-18-like network of basic blocks for 32x32 inputs. ``mlp``: three dense
layers. Each takes the sample shape (channels first) and the number of classes.

Users name their own model as ``module:attr`` (see :func:`build` for what ``attr`` may be), or a
Hugging Face model by its config as ``hf:PATH`` (:func:`hugging_face`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import typing
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from hetcoll.model.costs.inputs import sample_shape
from hetcoll.model.files import read_small_file
from hetcoll.torch.replay import wants_values


def cnn(input_shape: Sequence[int] = (3, 32, 32), classes: int = 10) -> nn.Module:
    """Seed-003-style CNN: conv(32)x2, pool, conv(64)x2, pool, dense(512), dense(classes)."""
    c, h, w = _image(input_shape)
    return nn.Sequential(
        nn.Conv2d(c, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * (h // 4) * (w // 4), 512),
        nn.ReLU(),
        nn.Linear(512, classes),
    )


_VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


def vgg(input_shape: Sequence[int] = (3, 32, 32), classes: int = 10) -> nn.Module:
    """VGG-11-like: 8 conv layers (64..512 filters, 3x3) with batch norm, 5 max pools, 3 dense."""
    c, h, w = _image(input_shape)
    layers: list[nn.Module] = []
    for v in _VGG11:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
            h, w = h // 2, w // 2
        else:
            layers += [nn.Conv2d(c, int(v), 3, padding=1), nn.BatchNorm2d(int(v)), nn.ReLU()]
            c = int(v)
    if h < 1 or w < 1:
        raise ValueError(f"input_shape: vgg needs images of at least 32x32, got {input_shape!r}")
    layers += [
        nn.Flatten(),
        nn.Linear(c * h * w, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, classes),
    ]
    return nn.Sequential(*layers)


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )
        self.relu2 = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        y = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        return self.relu2(y + self.shortcut(x))


def resnet(input_shape: Sequence[int] = (3, 32, 32), classes: int = 10) -> nn.Module:
    """ResNet-18-like for small images: a 3x3 stem, 4 stages of 2 basic blocks (64..512)."""
    c, _, _ = _image(input_shape)
    blocks: list[nn.Module] = [
        nn.Conv2d(c, 64, 3, padding=1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
    ]
    c_in = 64
    for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        blocks += [_BasicBlock(c_in, c_out, stride), _BasicBlock(c_out, c_out, 1)]
        c_in = c_out
    blocks += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*blocks)


def mlp(input_shape: Sequence[int] = (784,), classes: int = 10) -> nn.Module:
    """Three dense layers (1024, 1024, classes) on the flattened sample."""
    n = math.prod(sample_shape(input_shape))
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(n, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, classes),
    )


BUILTIN: dict[str, Callable[..., nn.Module]] = {
    "cnn": cnn,
    "vgg": vgg,
    "resnet": resnet,
    "mlp": mlp,
}


def _image(shape: Sequence[int]) -> tuple[int, int, int]:
    dims = sample_shape(shape)
    if len(dims) != 3:
        raise ValueError(f"input_shape: expected channels x height x width, got {shape!r}")
    c, h, w = dims
    return c, h, w


def build(
    name: str,
    input_shape: Sequence[int],
    classes: int = 10,
    *,
    device: torch.device | str | None = None,
) -> nn.Module:
    """A built-in network by name (``cnn``, ``vgg``, ``resnet``, ``mlp``), a Hugging Face model
    as ``hf:PATH`` (its ``config.json``, or a directory holding one: :func:`hugging_face`) or a
    user model as ``module:attr``, constructed on ``device`` (``"meta"``: shapes only, no
    memory; ``None``: torch's default device).

    ``module`` is imported (its top-level code runs, as with ``python -m``); ``attr`` must be
    one of, and nothing else is called:

    - an ``nn.Module`` subclass whose constructor takes no required arguments;
    - a function (``def``) annotated to return an ``nn.Module`` subclass and callable with no
      arguments, such as torchvision's builders (``torchvision.models:resnet18``);
    - an ``nn.Module`` instance (used as it is: it was built when ``module`` was imported).

    ``input_shape`` and ``classes`` shape the built-ins only.

    >>> type(build("cnn", (3, 32, 32))).__name__
    'Sequential'
    >>> build("os:system", (1,))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: model: 'os:system' is a builtin_function_or_method; expected an nn.Module ...
    """
    if name in BUILTIN:
        if isinstance(classes, bool) or not isinstance(classes, int) or classes < 1:
            raise ValueError(f"classes: must be an integer >= 1, got {classes!r}")
        try:
            with _on(device):
                return BUILTIN[name](input_shape, classes)
        except (RuntimeError, TypeError, OverflowError) as e:
            # Sizes torch refuses: a layer's element count overflows int64 (TypeError, from
            # unpacking the size) or real memory runs out (RuntimeError).
            raise ValueError(
                f"input_shape: {name} cannot be built for {tuple(input_shape)}: "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from None
    if name.startswith("hf:"):
        return hugging_face(name.removeprefix("hf:"), device=device)
    if ":" not in name:
        raise ValueError(
            f"model: unknown built-in {name!r} (built-ins: {sorted(BUILTIN)}; or module:attr, "
            "or hf:CONFIG)"
        )
    mod_name, attr = name.split(":", 1)
    if not mod_name or not attr:  # ":" once said only "Empty module name"
        raise ValueError(f"model: {name!r} must be MODULE:ATTR (both named)")
    try:
        obj = getattr(importlib.import_module(mod_name), attr)
    except SystemExit as e:  # a script's top-level sys.exit() must not end the caller
        raise ValueError(
            f"model: cannot load {name!r}: its import called sys.exit({e.code!r})"
        ) from None
    except Exception as e:  # its top-level code may raise anything (a SyntaxError too)
        raise ValueError(f"model: cannot load {name!r}: {type(e).__name__}: {e}") from None
    if isinstance(obj, nn.Module):
        return obj
    make = _constructor(obj, name)
    try:
        try:
            with _on(device):
                made = make()
        except Exception as e:
            if device is None or torch.device(device).type != "meta" or not wants_values(e):
                raise
            # A constructor that computes with tensors (torchvision's RegNet reads its widths
            # off them) cannot run with every tensor on the meta device: only its parameters
            # and buffers go there.
            with _parameters_on(torch.device(device)):
                made = make()
    except SystemExit as e:
        raise ValueError(
            f"model: {name!r} failed to build: it called sys.exit({e.code!r})"
        ) from None
    except Exception as e:  # the user's constructor failed: named, the cause chained
        raise ValueError(f"model: {name!r} failed to build: {type(e).__name__}: {e}") from e
    if not isinstance(made, nn.Module):
        raise ValueError(f"model: {name!r} returned a {type(made).__name__}, not an nn.Module")
    return made


#: The longest Hugging Face config read (a model's config.json is a few kilobytes).
MAX_CONFIG_BYTES = 2**20


def hugging_face(path: str | Path, *, device: torch.device | str | None = None) -> nn.Module:
    """A Hugging Face model built from its config: ``path`` is a ``config.json`` or a directory
    holding one, as a model's page on the Hub has it (no weights are read, nothing is
    downloaded, no code of the model's own runs): the ``transformers`` class its
    ``architectures`` names (``BertForMaskedLM``), else the class for its ``model_type``
    with its language-modelling head where the type has one (``AutoModelForCausalLM``), else
    its bare model (``AutoModel``); constructed on ``device``
    (``"meta"``: a model of any size, costed without its memory). ``ValueError`` names
    ``path`` where it is not such a config.

    >>> hugging_face("/dev/null")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: model: hf:/dev/null: not a regular file (...)
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    where = f"hf:{path}"
    try:
        data = read_small_file(p, "a Hugging Face model's config.json", MAX_CONFIG_BYTES)
    except ValueError as e:
        raise ValueError(f"model: hf:{e}") from None
    try:
        values = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"model: {where}: not a JSON config ({e})") from None
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise ValueError(
            f"model: {where}: a Hugging Face config is a JSON object naming its model_type "
            '("llama", "gpt2", ...)'
        )
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        raise ValueError(f"model: {where} needs transformers (pip install transformers)") from None
    _check_depths(values, where)  # before transformers builds per-layer lists of them
    values = dict(values)
    model_type = values.pop("model_type")
    named = values.get("architectures")
    make: Callable[[typing.Any], object]
    if isinstance(named, list) and named and isinstance(named[0], str):
        architecture = getattr(transformers, named[0], None)
        if not (
            isinstance(architecture, type)
            and issubclass(architecture, transformers.PreTrainedModel)
        ):
            raise ValueError(
                f"model: {where}: architectures names {named[0]!r}, which is no model class "
                "of transformers (a model's own code is not run)"
            )
        make = architecture
    elif model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:  # with its language-modelling head
        make = transformers.AutoModelForCausalLM.from_config
    else:
        make = transformers.AutoModel.from_config
    try:
        config = transformers.AutoConfig.for_model(model_type, **values)
    except Exception as e:  # a field transformers refuses (its own exception types vary)
        raise ValueError(f"model: {where}: {_why(e)}") from None
    _check_sizes(config, where)
    try:
        with _on(device):
            return typing.cast(nn.Module, make(config))
    except Exception as e:
        raise ValueError(f"model: {where}: {_why(e)}") from None


#: The most layers a Hugging Face config may build (a billion once ran for ever on the meta
#: device), and the most experts over all its layers: the largest published models have a
#: few hundred layers and a few ten thousand experts in all.
MAX_CONFIG_LAYERS = 10_000
MAX_CONFIG_EXPERTS = 2**17
_DEPTH_FIELDS = (
    "num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers",
    "encoder_layers", "decoder_layers",
)  # fmt: skip
# Counts a model is built of: each at least one where the config sets it.
_SIZE_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size", "max_position_embeddings",
    "num_local_experts", "n_routed_experts", "num_experts_per_tok",
)  # fmt: skip
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


def _why(e: BaseException) -> str:
    """transformers' reason, on one line: its validation errors give the field on their
    first line and the reason on the next; its unknown model type lists every type it knows
    after ". Should contain" (hundreds). A lookup's error is only the key it missed
    (``'bogus'``, an unknown ``rope_scaling`` type's), so its type comes first."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()] or [type(e).__name__]
    why = " ".join(lines[:2]).split(". Should contain", 1)[0]
    return f"{type(e).__name__}: {why}" if isinstance(e, LookupError) else why


def _check_depths(values: object, where: str) -> None:
    """Layer counts of the config (and of its nested configs: a vision tower's, a text
    model's) at most :data:`MAX_CONFIG_LAYERS`, read before transformers builds anything."""
    if not isinstance(values, dict):
        return
    for key, value in values.items():
        if key in _DEPTH_FIELDS and isinstance(value, int) and value > MAX_CONFIG_LAYERS:
            raise ValueError(
                f"model: {where}: {key}: at most {MAX_CONFIG_LAYERS:,} layers, got {value:,}"
            )
        _check_depths(value, where)


def _check_sizes(config: typing.Any, where: str) -> None:
    """The counts a model is built of, as transformers reads them (its aliases resolved):
    each >= 1 (a vocabulary of 0 and 0 experts once built, failing later under
    ``input_shape``), the experts a token picks at most the experts, and the experts of all
    layers at most :data:`MAX_CONFIG_EXPERTS`."""
    for name in _SIZE_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"model: {where}: {name}: must be >= 1, got {value}")
    experts = next(
        (v for f in _EXPERT_FIELDS if isinstance(v := getattr(config, f, None), int)), None
    )
    chosen = getattr(config, "num_experts_per_tok", None)
    if experts is not None and isinstance(chosen, int) and chosen > experts:
        raise ValueError(
            f"model: {where}: num_experts_per_tok: {chosen} is more than the {experts} experts"
        )
    layers = getattr(config, "num_hidden_layers", None)
    if experts is not None and isinstance(layers, int) and experts * layers > MAX_CONFIG_EXPERTS:
        raise ValueError(
            f"model: {where}: {experts:,} experts in each of {layers:,} layers, more than "
            f"{MAX_CONFIG_EXPERTS:,} in all"
        )


def _on(device: torch.device | str | None) -> typing.ContextManager[object]:
    """Construct tensors on ``device`` (``None``: wherever torch would)."""
    return contextlib.nullcontext() if device is None else torch.device(device)


@contextlib.contextmanager
def _parameters_on(device: torch.device) -> typing.Iterator[None]:
    """Modules constructed meanwhile hold their parameters and buffers on ``device``, each
    moved there as it is registered; other tensors are made where torch makes them. Each
    parameter exists on torch's default device only until its registration (its
    initialisation, after, runs on ``device``)."""
    register_parameter = nn.Module.register_parameter
    register_buffer = nn.Module.register_buffer

    def parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register_parameter(module, name, param)
        if param is not None:
            moved = param.detach().to(device)
            module._parameters[name] = type(param)(moved, requires_grad=param.requires_grad)

    def buffer(
        module: nn.Module, name: str, tensor: Tensor | None, persistent: bool = True
    ) -> None:
        register_buffer(module, name, tensor, persistent)
        if tensor is not None:
            module._buffers[name] = tensor.to(device)

    nn.Module.register_parameter = parameter  # type: ignore[method-assign,assignment]
    nn.Module.register_buffer = buffer  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]


def _constructor(obj: object, name: str) -> Callable[[], object]:
    """``obj`` if it may be called to make a model (an ``nn.Module`` subclass, or a function
    annotated to return one, either callable without arguments), else a ``ValueError`` saying
    why; ``name`` is how the user named it. Nothing is called here.
    """
    expected = (
        "expected an nn.Module subclass, an nn.Module, or a function annotated to return an "
        "nn.Module (-> nn.Module)"
    )
    if inspect.isclass(obj):
        if not issubclass(obj, nn.Module):
            raise ValueError(
                f"model: {name!r} is the class {obj.__name__}, not an nn.Module; {expected}"
            )
    elif inspect.isfunction(obj):
        try:
            hints = typing.get_type_hints(obj)
        except Exception as e:  # an annotation that does not resolve: no known return type
            raise ValueError(f"model: {name!r}: cannot read its return annotation ({e})") from None
        ret = hints.get("return")
        if not (inspect.isclass(ret) and issubclass(ret, nn.Module)):
            raise ValueError(
                f"model: {name!r} is a function not annotated to return an nn.Module "
                f"(its return annotation: {getattr(ret, '__name__', ret)}); {expected}"
            )
    else:
        raise ValueError(f"model: {name!r} is a {type(obj).__name__}; {expected}")
    try:
        inspect.signature(obj).bind()
    except TypeError as e:
        raise ValueError(
            f"model: {name!r} needs arguments ({e}); wrap it in a function taking none"
        ) from None
    except ValueError:
        pass  # no signature to read (a C-implemented constructor): try it
    return typing.cast(Callable[[], object], obj)
