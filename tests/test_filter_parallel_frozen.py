"""Frozen parameters in a split model, as fine-tuning freezes them: they stay frozen, keep no
gradient and train as in the unsplit model, on real gloo jobs against one process in float64.

- torchvision's ResNet-18 with every BatchNorm frozen: the BatchNorms between split conv pairs
  came back trainable from the split (and trained: 1.3e-2 off after a step).
- Llama with its first block frozen on 3 ranks, split by query head, its key and value
  projections held whole with their gradients summed: the split raised "cannot register a
  hook on a tensor that doesn't require gradient". Frozen after the split, nothing of theirs is
  exchanged; unfrozen after a split that found them frozen, the backward raises (their
  gradient would be each rank's part alone).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hetcoll.launch import RankFailed, spawn

pytestmark = pytest.mark.multiproc


def _off(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max(
        float((got[k].double() - w.double()).abs().max() / max(w.double().abs().max(), 1e-12))
        for k, w in want.items()
        if w.is_floating_point()
    )


def _train(model: nn.Module, batches, loss_of, adam: bool = True) -> None:
    # SGD for ResNet: Adam's first steps magnify 1e-12 absolute differences of its near-zero
    # gradients (BatchNorm over a few values a channel) into 1e-6.
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(trained, lr=1e-2) if adam else torch.optim.SGD(trained, lr=0.1)
    for x, y in batches:
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()


def _resnet(rank, world):
    import torchvision

    from hetcoll.torch import filter_parallel, gather_state_dict

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=5).double()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.requires_grad_(False)
            m.bias.requires_grad_(False)
    split = filter_parallel(copy.deepcopy(model), speeds=[1.0, 1 / 3])
    frozen = {n for n, p in split.named_parameters() if not p.requires_grad}
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(4, 3, 32, 32, generator=g, dtype=torch.float64), torch.randint(0, 5, (4,)))
        for _ in range(2)
    ]

    def loss_of(m, x, y):
        return nn.functional.cross_entropy(m(x), y)

    _train(model, batches, loss_of, adam=False)
    _train(split, batches, loss_of, adam=False)
    return {
        "frozen": sorted(frozen),
        "want_frozen": sorted(n for n, p in model.named_parameters() if not p.requires_grad),
        "off": _off(gather_state_dict(split, dst=None), model.state_dict()),
    }


def test_frozen_batch_norms_stay_frozen_in_a_split_resnet():
    for got in spawn(_resnet, 2, timeout=240):
        assert got["frozen"] == got["want_frozen"] and len(got["frozen"]) == 40
        assert got["off"] <= 1e-9


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        attn_implementation="eager",
        use_cache=False,
    )
    return LlamaForCausalLM(config).double()


def _lm_loss(m, x, y):
    return m(input_ids=x, labels=y).loss


def _lm_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(ids, ids) for ids in (torch.randint(0, 64, (3, 7), generator=g) for _ in range(2))]


def _llama_frozen(rank, world, when):
    from hetcoll.torch import filter_parallel, gather_state_dict

    pytest.importorskip("transformers")
    model = _llama()
    block = [p for p in model.model.layers[0].parameters()]
    if when == "before":
        for p in block:
            p.requires_grad_(False)
    split = filter_parallel(copy.deepcopy(model), speeds=[1.0, 0.5, 0.25])
    split_block = [p for p in split.model.layers[0].parameters()]
    if when in ("after", "unfrozen"):
        for p in block + split_block:
            p.requires_grad_(when == "unfrozen")
    if when == "unfrozen":  # frozen before the split, unfrozen after it
        for p in block:
            p.requires_grad_(True)
    batches = _lm_batches()
    _train(model, batches, _lm_loss)
    _train(split, batches, _lm_loss)
    return {
        "grads": [p.grad is None for p in split_block],
        "off": _off(gather_state_dict(split, dst=None), model.state_dict()),
    }


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_frozen_block_held_whole_in_a_head_split(when):
    pytest.importorskip("transformers")
    for got in spawn(_llama_frozen, 3, when, timeout=240):
        assert all(got["grads"])  # frozen: no gradient, nothing summed into one
        assert got["off"] <= 1e-10


def _llama_unfrozen(rank, world):
    from hetcoll.torch import filter_parallel

    model = _llama()
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)
    split = filter_parallel(model, speeds=[1.0, 0.5, 0.25])
    for p in split.model.layers[0].parameters():
        p.requires_grad_(True)
    x, y = _lm_batches()[0]
    _lm_loss(split, x, y).backward()


def test_unfreezing_what_the_split_found_frozen_raises_on_every_rank():
    pytest.importorskip("transformers")
    with pytest.raises(RankFailed) as failed:
        spawn(_llama_unfrozen, 3, timeout=240)
    text = str(failed.value)
    for rank in range(3):
        assert f"rank {rank}: RuntimeError: model: a parameter of shape" in text
    assert "Unfreeze it before splitting the model" in text


def _llama_frozen_on_one_rank(rank, world):
    from hetcoll.torch import filter_parallel

    split = filter_parallel(_llama(), speeds=[1.0, 0.5, 0.25])
    if rank == 1:  # the key and value projections (held whole) frozen here only
        for p in split.model.layers[0].parameters():
            p.requires_grad_(False)
    x, y = _lm_batches()[0]
    _lm_loss(split, x, y).backward()


def test_ranks_that_freeze_differently_raise_on_every_rank():
    """Frozen on one rank only, the whole parameters' gradient sums waited for ever (the
    ranks summed different parameters): now every rank raises, naming what differs."""
    pytest.importorskip("transformers")
    with pytest.raises(RankFailed) as failed:
        spawn(_llama_frozen_on_one_rank, 3, timeout=240)
    text = str(failed.value)
    for rank in range(3):
        assert (
            f"rank {rank}: CollectiveMismatchError: ranks disagree on the parameters held " in text
        )
    assert "frozen (requires_grad False)" in text
