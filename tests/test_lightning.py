"""hetcoll.lightning.BalancedStrategy under Lightning's own launcher (spawned gloo CPU ranks):
each rank takes its share of every global batch and the weights after training equal one process
on the whole batches, in float64 to 1e-10."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

lightning = pytest.importorskip("lightning")
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.loggers.logger import Logger  # noqa: E402

from hetcoll.lightning import BalancedStrategy, Rebalancing  # noqa: E402
from hetcoll.torch import BalancedSampler, Rebalancer  # noqa: E402

# The Trainers here run in this process: no MPI initialised there by their detection.
pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("lightning_without_mpi")]

N, BATCH, LR = 29, 8, 0.1  # 29 = 3 * 8 + 5: every epoch ends on a smaller batch
#: Forked ranks start at once (spawned ones would import torch and lightning again).
START = "fork"


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(N, 5, generator=g, dtype=torch.float64),
        torch.randn(N, 2, generator=g, dtype=torch.float64),
    )


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)).double()


class Regression(LightningModule):
    """Records each rank's batch sizes in ``out/sizes{rank}.json``."""

    def __init__(self, shuffle: bool, out: Path) -> None:
        super().__init__()
        self.net = net()
        self.shuffle = shuffle
        self.out = out
        self.sizes: list[int] = []

    def on_train_end(self) -> None:
        (self.out / f"sizes{self.global_rank}.json").write_text(json.dumps(self.sizes))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.sizes.append(len(x))
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return DataLoader(data(), batch_size=BATCH, shuffle=self.shuffle)


def reference(
    epochs: int, shuffle: bool, seed: int = 0, accumulate: int | list[int] = 1
) -> list[torch.Tensor]:
    """One process, plain loop, over the global batches the strategy's ranks share;
    ``accumulate``: Lightning's gradient accumulation (each micro-batch's loss divided by it, a
    step every so many batches and at the epoch's end), or one per epoch."""
    model, (x, y) = net(), data().tensors
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    order = BalancedSampler(range(N), [BATCH], 0, shuffle=shuffle, seed=seed, verify=False)
    for epoch in range(epochs):
        order.set_epoch(epoch)
        batches = list(order.batch_sampler())
        k = accumulate[epoch] if isinstance(accumulate, list) else accumulate
        for start in range(0, len(batches), k):
            opt.zero_grad()
            for idx in batches[start : start + k]:
                (nn.functional.mse_loss(model(x[idx]), y[idx]) / k).backward()
            opt.step()
    return [p.detach() for p in model.parameters()]


def quiet_trainer(strategy: BalancedStrategy, devices: int, **kw) -> Trainer:
    """A CPU Trainer on ``devices`` ranks without logger, progress bar, model summary or (unless
    ``kw`` asks) checkpoints; ``kw``: the rest of Trainer's arguments."""
    return Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"enable_checkpointing": False, **kw},
    )


def fit(
    out: Path, strategy: BalancedStrategy, devices: int, shuffle: bool, epochs: int = 2, **kw
) -> Trainer:
    trainer = quiet_trainer(strategy, devices, max_epochs=epochs, **kw)
    trainer.fit(Regression(shuffle, out))
    return trainer


def batch_sizes(out: Path, devices: int) -> list[list[int]]:
    """Every rank's batch sizes, step by step."""
    return [json.loads((out / f"sizes{r}.json").read_text()) for r in range(devices)]


def planned(shares: list[int], epochs: int, changes: dict[int, list[int]] | None = None):
    """Per rank, the batch sizes BalancedSampler plans (``changes``: shares set before step k)."""
    samplers = [BalancedSampler(range(N), shares, r, verify=False) for r in range(len(shares))]
    sizes: list[list[int]] = [[] for _ in shares]
    step = 0
    for _ in range(epochs):
        for steps in zip(*(s.batch_sampler() for s in samplers)):
            for r, idx in enumerate(steps):
                sizes[r].append(len(idx))
            step += 1
            if changes and step in changes:
                for s in samplers:
                    s.set_shares(changes[step])
    return sizes


def assert_exact(
    trainer: Trainer, epochs: int, shuffle: bool, accumulate: int | list[int] = 1
) -> None:
    got = [p.detach() for p in trainer.lightning_module.net.parameters()]
    for a, b in zip(got, reference(epochs, shuffle, accumulate=accumulate)):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_given_shares_on_two_ranks_train_as_one_process(tmp_path):
    """Lightning's injected DistributedSampler (shuffled, seed 0) becomes the balanced one."""
    trainer = fit(tmp_path, BalancedStrategy(shares=[5, 3], start_method=START), 2, shuffle=True)
    assert_exact(trainer, 2, shuffle=True)
    # Each rank ran its share of every global batch (the last one split 5:3 -> [3, 2]).
    assert batch_sizes(tmp_path, 2) == planned([5, 3], 2) == [[5, 5, 5, 3] * 2, [3, 3, 3, 2] * 2]
    # The shares are logged (progress bar and logger) on every rank.
    assert trainer.callback_metrics["share/0"] == 5.0
    assert trainer.callback_metrics["share/1"] == 3.0


class ChangeShares(Callback):
    """Sets new shares after global step ``at`` (as a Rebalancer would), on every rank."""

    def __init__(self, at: int, shares: list[int]) -> None:
        self.at, self.shares = at, shares

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            trainer.strategy.sampler.set_shares(self.shares)


def test_speeds_on_three_ranks_in_dataset_order_with_a_share_change(tmp_path):
    strategy = BalancedStrategy(speeds=[1.0, 2.0, 1.0], start_method=START)
    change = ChangeShares(2, [3, 3, 2])
    trainer = fit(
        tmp_path, strategy, 3, shuffle=False, use_distributed_sampler=False, callbacks=[change]
    )
    assert_exact(trainer, 2, shuffle=False)
    # Set after the second step, the new shares apply from the third.
    assert batch_sizes(tmp_path, 3) == planned([2, 4, 2], 2, {2: [3, 3, 2]})
    assert [trainer.callback_metrics[f"share/{r}"] for r in range(3)] == [3.0, 3.0, 2.0]


class ChangeSharesAfterBatch(Callback):
    """Sets new shares after the epoch's batch ``at`` (inside an accumulation window)."""

    def __init__(self, at: int, shares: list[int]) -> None:
        self.at, self.shares = at, shares

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.at:
            trainer.strategy.sampler.set_shares(self.shares)


def test_gradient_accumulation_trains_as_one_process_accumulating_alike(tmp_path):
    """accumulate_grad_batches=3 on 3 ranks: each epoch's four batches (the last of 5 rows) make
    a step of three micro-batches and one of one; the shares change inside the first window
    (micro-batches at [2, 4, 2], then [3, 3, 2]) and the last batch splits [2, 2, 1]. Every step
    is one process's, its micro-batches' losses divided by 3."""
    strategy = BalancedStrategy(speeds=[1.0, 2.0, 1.0], start_method=START)
    change = ChangeSharesAfterBatch(0, [3, 3, 2])
    trainer = fit(
        tmp_path, strategy, 3, shuffle=True, callbacks=[change], accumulate_grad_batches=3
    )
    assert_exact(trainer, 2, shuffle=True, accumulate=3)
    assert batch_sizes(tmp_path, 3)[0] == [2, 3, 3, 2, 3, 3, 3, 2]


class ManualAccumulation(Regression):
    """Manual optimization accumulating two batches a step, as Lightning documents it (the
    ranks' gradients exchanged on the window's last batch only, ``toggle_model``)."""

    def __init__(self, shuffle: bool, out: Path) -> None:
        super().__init__(shuffle, out)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        self.sizes.append(len(x))
        loss = nn.functional.mse_loss(self.net(x), y) / 2
        last = (batch_idx + 1) % 2 == 0 or batch_idx + 1 == self.trainer.num_training_batches
        with opt.toggle_model(sync_grad=last):
            self.manual_backward(loss)
        if last:
            opt.step()
            opt.zero_grad()


class TwoBackwards(Regression):
    """Manual optimization, two forward and backward calls a batch (each of half its loss),
    the first backward synchronising the ranks' gradients or not
    (``toggle_model(sync_grad=...)``); the strategy's warnings about it go to
    ``out/warned{rank}.json``."""

    def __init__(self, shuffle: bool, out: Path, first_synced: bool) -> None:
        super().__init__(shuffle, out)
        self.automatic_optimization = False
        self.first_synced = first_synced
        self.warned: list[str] = []

    def training_step(self, batch, batch_idx):
        import warnings

        opt = self.optimizers()
        x, y = batch
        self.sizes.append(len(x))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with opt.toggle_model(sync_grad=self.first_synced):
                self.manual_backward(nn.functional.mse_loss(self.net(x), y) / 2)
            self.manual_backward(nn.functional.mse_loss(self.net(x), y) / 2)
        self.warned += [str(w.message) for w in caught if "rebalance_every" in str(w.message)]
        opt.step()
        opt.zero_grad()

    def on_train_end(self) -> None:
        super().on_train_end()
        (self.out / f"warned{self.global_rank}.json").write_text(json.dumps(self.warned))


@pytest.mark.parametrize("first_synced", [True, False], ids=["both-synced", "first-unsynced"])
def test_a_second_synchronising_backward_in_a_batch_is_told_once(tmp_path, first_synced):
    """Under manual optimization, rebalancing: a batch whose first of two backward calls
    synchronises waits for the other ranks inside its timed span (the shares would not move):
    told once, on every rank; with it under toggle_model(sync_grad=False), nothing."""
    trainer = quiet_trainer(
        BalancedStrategy(shares=[5, 3], rebalance_every=2, start_method=START), 2, max_epochs=1
    )
    trainer.fit(TwoBackwards(True, tmp_path, first_synced))
    for rank in range(2):
        warned = json.loads((tmp_path / f"warned{rank}.json").read_text())
        assert len(warned) == int(first_synced)
        assert all("toggle_model(sync_grad=False)" in w for w in warned)


def test_accumulation_scheduled_or_by_hand_trains_as_one_process(tmp_path):
    """Lightning's GradientAccumulationScheduler (1 batch a step in epoch 0, 2 in epoch 1) and
    manual optimization accumulating by hand, on shares 5:3 whose epochs end on a batch split
    3:2: each window's batches weighed by their own rows, as one process accumulating alike."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    scheduled = GradientAccumulationScheduler({0: 1, 1: 2})
    strategy = BalancedStrategy(shares=[5, 3], start_method=START)
    trainer = fit(tmp_path, strategy, 2, shuffle=True, callbacks=[scheduled])
    assert_exact(trainer, 2, shuffle=True, accumulate=[1, 2])
    trainer = quiet_trainer(BalancedStrategy(shares=[5, 3], start_method=START), 2, max_epochs=2)
    trainer.fit(ManualAccumulation(True, tmp_path))
    assert_exact(trainer, 2, shuffle=True, accumulate=2)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_measured_and_rebalanced_shares_stay_exact(tmp_path, accumulate):
    """measure=True probes each rank and rebalance_every re-solves the shares while training
    (with accumulation, from every micro-batch's time, new shares possibly inside a step):
    whatever shares result, the weights are those of one process."""
    strategy = BalancedStrategy(
        measure=True, rebalance_every=2, measure_budget=1.0, start_method=START
    )
    trainer = fit(tmp_path, strategy, 2, shuffle=True, epochs=3, accumulate_grad_batches=accumulate)
    assert_exact(trainer, 3, shuffle=True, accumulate=accumulate)
    shares = [trainer.callback_metrics[f"share/{r}"] for r in range(2)]
    assert sum(shares) == BATCH and min(shares) >= 1
    assert all(trainer.callback_metrics[f"speed/{r}"] > 0 for r in range(2))


#: The fake clock of the rebalancing steps below, and each rank's speed in samples/s on it,
#: changing every two batches.
CLOCK = [0.0]
SPEEDS = [[100.0, 50.0, 25.0], [25.0, 100.0, 50.0], [50.0, 25.0, 100.0]]


class TimedRegression(Regression):
    """Regression whose batches take the fake clock's time at SPEEDS."""

    def training_step(self, batch, batch_idx):
        CLOCK[0] += 0.001 + len(batch[0]) / SPEEDS[(batch_idx // 2) % 3][self.global_rank]
        return super().training_step(batch, batch_idx)


class SharesLogged(Logger):
    """Writes the ``share/r`` logged at each step into ``out/logged{rank}.json``."""

    name, version = "shares", 0

    def __init__(self, out: Path, ranks: int) -> None:
        super().__init__()
        self.out, self.ranks, self.rows = out, ranks, []

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if "share/0" in metrics:
            self.rows.append([int(metrics[f"share/{r}"]) for r in range(self.ranks)])
            rank = torch.distributed.get_rank()
            (self.out / f"logged{rank}.json").write_text(json.dumps(self.rows))


def test_logged_shares_are_those_each_step_ran_at(tmp_path, monkeypatch):
    """rebalance_every=1 decides new shares after each batch, for the next steps: the
    share/r logged at a step are the ones it ran at (they were the next step's: 7 of 8 rows
    wrong over two epochs), and training stays one process's. Only the clock is faked, so
    that the speeds change deterministically."""
    import types

    import hetcoll.torch.step_timer as step_timer

    fake = types.SimpleNamespace(perf_counter=lambda: CLOCK[0])
    monkeypatch.setattr(step_timer, "time", fake)
    trainer = Trainer(
        strategy=BalancedStrategy(rebalance_every=1, start_method=START),
        accelerator="cpu",
        devices=3,
        logger=SharesLogged(tmp_path, 3),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        max_epochs=2,
    )
    trainer.fit(TimedRegression(True, tmp_path))
    assert_exact(trainer, 2, shuffle=True)
    ran = [list(step) for step in zip(*batch_sizes(tmp_path, 3), strict=True)]
    for r in range(3):
        logged = json.loads((tmp_path / f"logged{r}.json").read_text())
        assert len(logged) == len(ran) == 8
        for shares, sizes in zip(logged, ran, strict=True):
            # A full step ran at its shares; an epoch's last (5 rows) was cut from them.
            assert shares == sizes if sum(sizes) == BATCH else sum(shares) == BATCH
    assert len({tuple(s) for s in ran if sum(s) == BATCH}) >= 3  # the shares did change


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="speeds"):
        BalancedStrategy(shares=[1, 2], speeds=[1.0, 1.0])
    with pytest.raises(ValueError, match=r"shares\[1\]"):
        BalancedStrategy(shares=[1, 0])
    with pytest.raises(ValueError, match=r"speeds\[0\]"):
        BalancedStrategy(speeds=[float("nan"), 1.0])
    with pytest.raises(ValueError, match="rebalance_every"):
        BalancedStrategy(rebalance_every=0)
    with pytest.raises(TypeError, match="measure"):
        BalancedStrategy(measure="yes")
    with pytest.raises(TypeError, match="ddp_comm_hook"):
        BalancedStrategy(ddp_comm_hook=lambda s, b: None)


def test_shares_that_do_not_make_the_global_batch_raise(tmp_path):
    # Raised on the ranks; Lightning's launcher re-raises it here.
    with pytest.raises(Exception, match="shares: sum to 7, but the train_dataloader's batch_size"):
        fit(tmp_path, BalancedStrategy(shares=[4, 3], start_method=START), 2, shuffle=False)


class BatchSamplerLoader(Regression):
    def train_dataloader(self):
        from torch.utils.data import BatchSampler, SequentialSampler

        return DataLoader(data(), batch_sampler=BatchSampler(SequentialSampler(data()), 8, False))


def test_a_loader_made_with_a_batch_sampler_is_named(tmp_path):
    """Lightning rebuilds it with batch_size=1 around its DistributedSampler: the error says
    so, rather than only that the global batch of 1 is too small."""
    trainer = quiet_trainer(BalancedStrategy(start_method=START), 2, max_epochs=1)
    with pytest.raises(Exception, match="made with batch_sampler= comes here as batch_size 1"):
        trainer.fit(BatchSamplerLoader(False, tmp_path))


class TwoLoaders(Regression):
    def train_dataloader(self):
        return {"a": DataLoader(data(), batch_size=BATCH), "b": DataLoader(data(), batch_size=4)}


class HalvedOnReload(Regression):
    def train_dataloader(self):
        return DataLoader(data(), batch_size=BATCH if self.current_epoch == 0 else BATCH // 2)


def test_several_loaders_raise_and_a_reloaded_loader_keeps_the_proportions(tmp_path):
    """Two training loaders: the second was cut by the first's shares (6.9e-2 off); a loader
    reloaded at another batch size kept shares summing to the old one (2 steps of 6 + 2 where
    the epoch had 4 of 4)."""
    trainer = quiet_trainer(BalancedStrategy(shares=[6, 2], start_method=START), 2, max_epochs=1)
    with pytest.raises(Exception, match="BalancedStrategy balances one training loader"):
        trainer.fit(TwoLoaders(False, tmp_path))
    trainer = quiet_trainer(
        BalancedStrategy(shares=[6, 2], start_method=START),
        2,
        max_epochs=2,
        reload_dataloaders_every_n_epochs=1,
    )
    trainer.fit(HalvedOnReload(False, tmp_path))
    # 29 samples: 3 steps of 8 (6 + 2) and 5 (4 + 1); then 7 steps of 4 (3 + 1) and one
    # sample, padded to one each.
    assert batch_sizes(tmp_path, 2) == [[6, 6, 6, 4] + [3] * 7 + [1], [2, 2, 2, 1] + [1] * 8]


class RecordRebalancerAtEnd(Callback):
    """Rank 0 writes its batch rebalancer's steps and decisions as training ends to
    ``out/rebalancer_end.json``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module) -> None:
        reb = trainer.strategy.rebalancer
        if trainer.global_rank == 0:
            state = {"step": reb.state_dict()["step"], "decided": [e.step for e in reb.history]}
            state["shares"] = list(reb.sampler.shares)
            (self.out / "rebalancer_end.json").write_text(json.dumps(state))


def test_a_reloaded_loader_keeps_its_rebalancer(tmp_path):
    """reload_dataloaders_every_n_epochs=1 with rebalance_every=2: the second epoch's loader
    is rebalanced by the same rebalancer, its steps counted on and its decisions kept (it
    started afresh each epoch: step 4 of 8 batches); the weights stay one process's."""
    trainer = quiet_trainer(
        BalancedStrategy(shares=[6, 2], rebalance_every=2, start_method=START),
        2,
        max_epochs=2,
        reload_dataloaders_every_n_epochs=1,
        callbacks=[RecordRebalancerAtEnd(tmp_path)],
    )
    trainer.fit(Regression(True, tmp_path))
    end = json.loads((tmp_path / "rebalancer_end.json").read_text())
    assert (end["step"], end["decided"]) == (8, [2, 4, 6, 8])
    assert_exact(trainer, 2, shuffle=True)


def test_rebalancing_rows_and_experts_together_trains_as_one_process(tmp_path):
    """Mixtral's experts placed 2 : 1 : 1 on 3 ranks with rows 4 : 2 : 1, both followed as it
    trains: ``rebalance_every=1`` re-solves the rows from each rank's own compute (its timer
    leaving the experts' exchanges, where a rank waits for the others, out) and
    ``rebalance_experts_every=1`` places the experts by their loads at the speeds the row
    rebalancer models. Both decide after every step, and the model after 2 steps is one
    process's on the same global batches (1e-6: the router's softmax in float32). Rank 0's
    attention is emulated at 0.05 of its speed (it sleeps): its rows move to the others."""
    import tensor_parallel_cases as tp

    trainer = quiet_trainer(
        BalancedStrategy(
            shares=[4, 2, 1], rebalance_every=1, rebalance_experts_every=1, start_method=START
        ),
        3,
        max_epochs=1,
        use_distributed_sampler=False,
        callbacks=[RecordRebalancerAtEnd(tmp_path)],
    )
    trainer.fit(ExpertsLM(tmp_path, 3, slow=0.05))
    end = json.loads((tmp_path / "rebalancer_end.json").read_text())
    assert (end["step"], end["decided"]) == (2, [1, 2]) and sum(end["shares"]) == 7
    assert end["shares"][0] < 4, end["shares"]
    assert [m[0] for m in json.loads((tmp_path / "moves.json").read_text())] == [1, 2]
    ref = one_process_mixtral()
    full = torch.load(tmp_path / "full.pt")
    with tp.tolerance(1e-6):
        for name, t in ref.state_dict().items():
            tp.close(full[name], t, name)


class OtherBatch(Regression):
    """The global batch 6 on every rank (``rank0``: on rank 0 only, the others keep 8)."""

    rank0 = False

    def train_dataloader(self):
        size = 6 if not self.rank0 or self.global_rank == 0 else BATCH
        return DataLoader(data(), batch_size=size, shuffle=self.shuffle)


class OtherBatchOnRankZero(OtherBatch):
    rank0 = True


def test_global_batches_that_differ_are_named(tmp_path):
    """Ranks whose loaders differ in batch_size, and a checkpoint resumed at another global
    batch (Lightning counts an epoch's batches once): each raises naming batch_size."""
    trainer = quiet_trainer(BalancedStrategy(start_method=START), 2, max_epochs=1)
    with pytest.raises(Exception, match="ranks disagree on the train_dataloader's batch_size"):
        trainer.fit(OtherBatchOnRankZero(False, tmp_path))
    ckpt = tmp_path / "step2.ckpt"
    fit(tmp_path, BalancedStrategy(start_method=START), 2, False, max_steps=2,
        callbacks=[SaveAt(2, ckpt)])  # fmt: skip
    trainer = quiet_trainer(BalancedStrategy(start_method=START), 2, max_epochs=1)
    with pytest.raises(Exception, match=r"batch_size 6 .* trained at 8: resume with the same"):
        trainer.fit(OtherBatch(False, tmp_path), ckpt_path=ckpt)


def test_example_trains_as_one_process(tmp_path):
    """examples/lightning_balanced.py, fast mode, on two forked ranks with shares split 3:1:
    the weights equal one process's plain loop over the same shuffled global batches."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "examples" / "lightning_balanced.py"
    spec = importlib.util.spec_from_file_location("lightning_balanced", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = ["--devices", "2", "--speeds", "3,1", "--fast", "--float64", "--start-method", "fork"]
    got = example.main([*args, "--batch", "64", "--save", str(tmp_path / "w.pt")])
    # One process: the same 4 global batches of 64 (epoch 0's permutation, seed 0).
    net, data_ = example.make_net().double(), example.load_data()
    x, y = data_.tensors
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    order = list(BalancedSampler(range(len(y)), [64], 0, verify=False).batch_sampler())
    for idx in order[:4]:
        opt.zero_grad()
        nn.functional.cross_entropy(net(x[idx].double()), y[idx]).backward()
        opt.step()
    saved = torch.load(tmp_path / "w.pt")
    for (name, a), b in zip(got.net.named_parameters(), net.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-10)
        torch.testing.assert_close(saved[f"net.{name}"], b.detach(), rtol=0, atol=1e-10)


class SaveAt(Callback):
    """Saves a Lightning checkpoint after global step ``k`` (what stopping there leaves)."""

    def __init__(self, k: int, path: Path) -> None:
        self.k, self.path = k, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.k:
            trainer.save_checkpoint(self.path)


def test_checkpoint_on_three_ranks_resumes_mid_epoch_on_two(tmp_path):
    """The sampler's state rides in Lightning's checkpoint: stopped after 2 steps on 3 ranks,
    resumed with ckpt_path on 2 (shares re-solved from the new speeds), the run finishes the
    epoch where it stopped and ends with one uninterrupted process's weights."""
    ckpt = tmp_path / "step2.ckpt"
    first = BalancedStrategy(speeds=[1.0, 1.0, 2.0], start_method=START)
    fit(tmp_path, first, 3, shuffle=True, max_steps=2, callbacks=[SaveAt(2, ckpt)])
    trainer = quiet_trainer(
        BalancedStrategy(speeds=[3.0, 1.0], start_method=START),
        2,
        max_epochs=2,
    )
    trainer.fit(Regression(True, tmp_path), ckpt_path=ckpt)
    assert_exact(trainer, 2, shuffle=True)
    # Epoch 0's last full batch and its 5 leftover samples, then all of epoch 1, split 6:2.
    assert batch_sizes(tmp_path, 2) == [[6, 4, 6, 6, 6, 4], [2, 1, 2, 2, 2, 1]]


class RecordRebalancer(Callback):
    """Rank 0 writes its batch rebalancer's state as the first step starts to
    ``out/rebalancer.json``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        reb = trainer.strategy.rebalancer
        if trainer.global_rank == 0 and not (self.out / "rebalancer.json").exists():
            (self.out / "rebalancer.json").write_text(json.dumps(reb.state_dict()))


def test_a_resumed_run_starts_from_the_saved_speed_models(tmp_path):
    """rebalance_every's Rebalancer rides in Lightning's checkpoint: resumed after 2 steps on
    as many ranks, the first step starts from the saved rebalancer's models and steps
    (without it, from none); the weights stay one process's."""
    ckpt = tmp_path / "step2.ckpt"
    strategy = BalancedStrategy(speeds=[1.0, 3.0], rebalance_every=1, start_method=START)
    fit(tmp_path, strategy, 2, shuffle=True, max_steps=2, callbacks=[SaveAt(2, ckpt)])
    saved = torch.load(ckpt, weights_only=False)["callbacks"]["_RebalancersState"]
    assert saved["rebalancer"]["step"] == 2 and len(saved["rebalancer"]["models"]) == 2
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    trainer = quiet_trainer(
        BalancedStrategy(speeds=[1.0, 3.0], rebalance_every=1, start_method=START),
        2,
        max_epochs=1,
        callbacks=[RecordRebalancer(resumed)],
    )
    trainer.fit(Regression(True, resumed), ckpt_path=ckpt)
    assert json.loads((resumed / "rebalancer.json").read_text()) == saved["rebalancer"]
    assert_exact(trainer, 1, shuffle=True)


class WithValidation(Regression):
    """Also records each rank's validation batch sizes in ``out/val{rank}.json``."""

    def __init__(self, shuffle: bool, out: Path) -> None:
        super().__init__(shuffle, out)
        self.val_sizes: list[int] = []

    def validation_step(self, batch, batch_idx):
        self.val_sizes.append(len(batch[0]))

    def val_dataloader(self):
        return DataLoader(data(), batch_size=10)

    def on_train_end(self) -> None:
        super().on_train_end()
        (self.out / f"val{self.global_rank}.json").write_text(json.dumps(self.val_sizes))


def test_validation_loaders_stay_lightnings(tmp_path):
    """Only the training loader is balanced: validation keeps Lightning's DistributedSampler
    (29 samples -> 15 per rank, in batches of 10 and 5; the sanity check, then the epoch's end)."""
    trainer = quiet_trainer(
        BalancedStrategy(shares=[5, 3], start_method=START),
        2,
        max_epochs=1,
    )
    trainer.fit(WithValidation(False, tmp_path))
    assert batch_sizes(tmp_path, 2) == [[5, 5, 5, 3], [3, 3, 3, 2]]
    val = [json.loads((tmp_path / f"val{r}.json").read_text()) for r in range(2)]
    assert val == [[10, 5, 10, 5]] * 2


class WithWorkers(Regression):
    """The training loader fetches ahead in two persistent worker processes (``prefetch_factor``
    2 each: the whole 4-step epoch is fetched before its first step is trained)."""

    def train_dataloader(self):
        return DataLoader(
            data(), batch_size=BATCH, shuffle=self.shuffle, num_workers=2, persistent_workers=True
        )


def test_checkpoints_with_loader_workers_resume_at_the_next_step_trained(tmp_path):
    """With worker processes fetching ahead, the checkpoint still holds the steps trained: saved
    after step 2 (mid epoch 0), after step 4 (epoch 0's last: Lightning makes the resumed
    epoch's iterator before it sets the sampler's epoch) and, by Lightning's ModelCheckpoint,
    after step 5 (mid epoch 1) on 3 ranks, resumed with ckpt_path on 2 ranks (shares re-solved)
    and on 3, all end with one uninterrupted process's weights."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpts = {
        2: tmp_path / "step2.ckpt",
        4: tmp_path / "step4.ckpt",
        5: tmp_path / "mc" / "step=5.ckpt",
    }
    every5 = ModelCheckpoint(tmp_path / "mc", "{step}", every_n_train_steps=5, save_top_k=-1)
    trainer = quiet_trainer(
        BalancedStrategy(speeds=[1.0, 1.0, 2.0], start_method=START),
        3,
        enable_checkpointing=True,
        max_steps=5,
        callbacks=[SaveAt(2, ckpts[2]), SaveAt(4, ckpts[4]), every5],
    )
    trainer.fit(WithWorkers(True, tmp_path))
    for k, devices, speeds in ((2, 2, [3.0, 1.0]), (4, 2, [3.0, 1.0]), (5, 3, [1.0, 1.0, 2.0])):
        out = tmp_path / f"resumed{k}"
        out.mkdir()
        trainer = quiet_trainer(
            BalancedStrategy(speeds=speeds, start_method=START),
            devices,
            max_epochs=2,
        )
        trainer.fit(WithWorkers(True, out), ckpt_path=ckpts[k])
        assert_exact(trainer, 2, shuffle=True)
        # The steps after k, and no other: 8 steps in two epochs of 4.
        assert [len(s) for s in batch_sizes(out, devices)] == [8 - k] * devices


# -- a padded language model: items= weighs each rank by its valid tokens -------------------------


class PaddedLM(LightningModule):
    """A language model whose loss is the mean over the batch's valid labels (-100: padding);
    the loader yields the global batches of ``lm_common`` in order. It logs its loss on every
    step (``sync_dist=True``); with ``out``, each rank writes the values logged to
    ``out/{rank}.json``."""

    def __init__(self, name: str, world: int, out: Path | None = None) -> None:
        super().__init__()
        from lm_common import MODELS

        self.net = MODELS[name]()
        self.world = world
        self.out = out
        self.logged: list[float] = []

    def training_step(self, batch, batch_idx):
        from lm_common import lm_loss

        x, y = batch
        loss = lm_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.logged.append(float(self.trainer.callback_metrics["loss"]))

    def on_train_end(self):
        if self.out is not None:
            (self.out / f"{self.global_rank}.json").write_text(json.dumps(self.logged))

    def configure_optimizers(self):
        from lm_common import optimizer

        return optimizer(self.net)

    def train_dataloader(self):
        from lm_common import SHARES, global_batches

        batches = global_batches(self.world)
        x, y = (torch.cat(t) for t in zip(*batches))
        return DataLoader(TensorDataset(x, y), batch_size=sum(SHARES[self.world]), shuffle=False)


@pytest.mark.parametrize(
    ("name", "world", "weigh"),
    [("gpt2", 2, "items"), ("encoder", 3, "items"), ("gpt2", 2, "rows")],
)
def test_items_train_a_padded_lm_as_one_process(name, world, weigh, tmp_path):
    """Uneven shares and uneven padding (in one step the last rank has no valid label):
    with items= the weights equal one process's on the same global batches (the mean over every
    valid token) to 1e-10 in float64, and so does the loss logged with ``sync_dist`` at every
    step, on every rank (it was the ranks' plain mean, NaN where a rank had no valid label);
    weighed by rows (the default) they do not."""
    from lm_common import MODELS, SHARES, global_batches, items, lm_loss, optimizer, rel_err

    count = {"items": lambda batch: items(batch[1]), "rows": None}[weigh]
    trainer = quiet_trainer(
        BalancedStrategy(shares=SHARES[world], items=count, start_method=START),
        world,
        max_epochs=1,
        use_distributed_sampler=False,
    )
    trainer.fit(PaddedLM(name, world, tmp_path))
    got = [p.detach() for p in trainer.lightning_module.net.parameters()]
    model = MODELS[name]()
    opt = optimizer(model)
    losses = []
    for x, y in global_batches(world):
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    err = rel_err(got, [p.detach() for p in model.parameters()])
    if weigh == "items":
        assert err <= 1e-10
        for r in range(world):
            logged = json.loads((tmp_path / f"{r}.json").read_text())
            assert logged == pytest.approx(losses, rel=1e-10, abs=0), (r, logged, losses)
    else:
        assert not err <= 1e-3


@pytest.mark.parametrize(("name", "world", "accumulate"), [("encoder", 3, 2), ("gpt2", 2, 3)])
def test_items_with_gradient_accumulation_train_as_one_process(name, world, accumulate, tmp_path):
    """Gradient accumulation weighs each micro-batch's ranks by their valid labels in it, as one
    process under Lightning does (each micro-batch's mean over its valid labels, divided by the
    accumulation). The micro-batch where the last rank has no valid label (a NaN loss) is the
    last of its step (encoder, 2 micro-batches a step) or inside it (GPT-2, 3). Each
    micro-batch's loss logged with ``sync_dist`` is one process's."""
    from lm_common import MODELS, SHARES, global_batches, items, lm_loss, optimizer, rel_err

    trainer = quiet_trainer(
        BalancedStrategy(
            shares=SHARES[world], items=lambda batch: items(batch[1]), start_method=START
        ),
        world,
        max_epochs=1,
        use_distributed_sampler=False,
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(PaddedLM(name, world, tmp_path))
    got = [p.detach() for p in trainer.lightning_module.net.parameters()]
    model = MODELS[name]()
    opt = optimizer(model)
    batches = global_batches(world)
    losses = []
    for start in range(0, len(batches), accumulate):
        opt.zero_grad()
        for x, y in batches[start : start + accumulate]:
            loss = lm_loss(model(x), y)
            (loss / accumulate).backward()
            losses.append(loss.item())
        opt.step()
    assert rel_err(got, [p.detach() for p in model.parameters()]) <= 1e-10
    for r in range(world):
        logged = json.loads((tmp_path / f"{r}.json").read_text())
        assert logged == pytest.approx(losses, rel=1e-10, abs=0), (r, logged, losses)


def test_items_must_be_a_function():
    with pytest.raises(TypeError, match="items: must be a function"):
        BalancedStrategy(items=5)


def test_a_bad_item_count_raises_naming_items():
    """Raised on every rank at the step's start (no rank waits in the backward); Lightning's
    launcher re-raises it here."""
    trainer = quiet_trainer(
        BalancedStrategy(shares=[3, 5], items=lambda batch: -1, start_method=START),
        2,
        max_epochs=1,
        use_distributed_sampler=False,
    )
    with pytest.raises(Exception, match="ValueError: items: rank 0 counted -1 for this step"):
        trainer.fit(PaddedLM("encoder", 2))


# -- a mixture of experts, its experts placed on the ranks: expert_parallel -----------------------

#: The experts test's gradient clipping (below the model's gradient norm: it clips each step).
CLIP = 0.05
#: Its SGD's momentum (state the checkpoint must hold).
MOMENTUM = 0.9


def one_process_mixtral(clip: float | None = None) -> nn.Module:
    """:class:`ExpertsLM`'s model trained by one process on the same 2 global batches (SGD
    with momentum; ``clip``: gradients clipped by norm, which they exceed)."""
    import tensor_parallel_cases as tp
    from expert_parallel_cases import lm_loss, tokens

    torch.manual_seed(0)
    ref = tp.mixtral().double()
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(2):
        opt.zero_grad()
        lm_loss(ref, *tokens(step)).backward()
        if clip is not None:
            assert torch.nn.utils.clip_grad_norm_(ref.parameters(), clip) > clip  # it clips
        opt.step()
    return ref


class ExpertsLM(LightningModule):
    """Hugging Face Mixtral whose experts ``configure_model`` places on the ranks
    (:func:`hetcoll.torch.expert_parallel`: 2 : 1 : 1, not by speed); at the end every rank
    gathers the whole model and rank 0 saves it in ``out/full.pt``, with the strategy's
    expert rebalancer's decisions in ``out/moves.json``."""

    def __init__(self, out: Path, world: int, slow: float | None = None) -> None:
        super().__init__()
        import tensor_parallel_cases as tp

        torch.manual_seed(0)
        self.net = tp.mixtral().double()
        self.out, self.world, self.slow = out, world, slow

    def configure_model(self) -> None:
        from hetcoll.lab.emulate import slow_down
        from hetcoll.torch import expert_parallel

        expert_parallel(self.net, shares=[2, 1, 1])
        if self.slow is not None and self.global_rank == 0:
            # Emulated: rank 0's attention at ``slow`` of its speed (it sleeps), outside
            # the experts' exchanges, which the timer leaves out as waits.
            slow_down([layer.self_attn for layer in self.net.model.layers], self.slow)

    def training_step(self, batch, batch_idx):
        from expert_parallel_cases import lm_loss

        return lm_loss(self.net, *batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    def train_dataloader(self):
        from expert_parallel_cases import ROWS, tokens

        ids, labels = (torch.cat(t) for t in zip(*(tokens(step) for step in range(2))))
        return DataLoader(TensorDataset(ids, labels), batch_size=ROWS, shuffle=False)

    def on_train_end(self) -> None:
        from hetcoll.torch import gather_state_dict

        full = gather_state_dict(self.net, dst=None)
        watch = self.trainer.strategy.expert_rebalancer
        if self.global_rank == 0:
            torch.save(full, self.out / "full.pt")
            moves = [[e.step, e.old_placement, e.new_placement, e.applied] for e in watch.history]
            (self.out / "moves.json").write_text(json.dumps(moves))


def test_experts_placed_on_the_ranks_train_as_one_process(tmp_path):
    """Mixtral's experts placed 2 : 1 : 1 in configure_model, rows 4 : 2 : 1 of each global
    batch of 7, gradients clipped by norm (``gradient_clip_val``: the whole model's norm,
    every rank's own experts included): BalancedStrategy's DDP leaves each rank's experts to
    it; its expert rebalancer,
    looking after every step, moves them by their loads at the shares' speeds (both layers to
    3 : 1 : 0 after the first, any experts on any rank); the gathered model after 2 steps
    equals one process's on the
    same batches (1e-6: the router's softmax in float32), in the ranks and, sent back whole, in
    the main process."""
    import tensor_parallel_cases as tp

    def experts_trainer(**kw: Any) -> Trainer:
        return quiet_trainer(
            BalancedStrategy(shares=[4, 2, 1], start_method=START, rebalance_experts_every=1),
            3,
            max_epochs=1,
            use_distributed_sampler=False,
            gradient_clip_val=CLIP,
            **kw,
        )

    ckpt = tmp_path / "step1.ckpt"
    trainer = experts_trainer(callbacks=[SaveAt(1, ckpt)])
    trainer.fit(ExpertsLM(tmp_path, 3))
    # Placed by the first step's loads, any experts on any rank: 3 : 1 : 0 each. Layer 1's
    # slowest rank is as fast with expert 3 moved alone (refined_placement) as by the best
    # placement's two moves: the one move is made. The second step's loads keep them.
    layer0, layer1 = "net.model.layers.0.mlp.experts", "net.model.layers.1.mlp.experts"
    even = [[0, 1], [2], [3]]
    first = {layer0: [[1, 2, 3], [0], []], layer1: [[0, 1, 3], [2], []]}
    assert json.loads((tmp_path / "moves.json").read_text()) == [
        [1, {layer0: even, layer1: even}, first, True],
        [2, first, first, False],
    ]
    ref = one_process_mixtral(clip=CLIP)
    full = torch.load(tmp_path / "full.pt")
    # The main process's module gets the whole model back too, every expert in place.
    back = trainer.lightning_module.net.state_dict()
    with tp.tolerance(1e-6):
        for name, t in ref.state_dict().items():
            tp.close(full[name], t, name)
            tp.close(back[name], t, f"main process: {name}")
    # Lightning's checkpoint after step 1 (taken after the experts moved) holds the unsplit
    # model and momentum, gathered, and the expert rebalancer's state: it loads into the main
    # process's whole module, and a run resumed from it (the experts placed 2 : 1 : 1 again,
    # then back where the checkpoint had them) decides at step 2 as the uninterrupted run
    # did and ends as it does.
    saved = torch.load(ckpt, weights_only=False)
    watched = saved["callbacks"]["_RebalancersState"]["experts"]
    assert watched["step"] == 1 and watched["placement"] == first
    assert saved["state_dict"].keys() == {f"net.{k}" for k in ref.state_dict()}
    momentum = saved["optimizer_states"][0]["state"][f"{layer0}.down_proj"]["momentum_buffer"]
    assert momentum.shape == ref.state_dict()["model.layers.0.mlp.experts.down_proj"].shape
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    experts_trainer().fit(ExpertsLM(resumed_dir, 3), ckpt_path=ckpt)
    again = torch.load(resumed_dir / "full.pt")
    assert max(float((again[k] - full[k]).abs().max()) for k in full) < 1e-10
    assert json.loads((resumed_dir / "moves.json").read_text()) == [[2, first, first, False]]


def test_rebalancing_names_bad_arguments_and_refuses_balanced_strategy():
    with pytest.raises(TypeError, match=r"^rebalancer: must be a hetcoll\.torch\.Rebalancer"):
        Rebalancing("every 10")  # type: ignore[arg-type]
    rebalancer = Rebalancer(BalancedSampler(range(8), [8], 0, verify=False), every=2)
    with pytest.raises(TypeError, match=r"^rows: must be a function of the batch, got int"):
        Rebalancing(rebalancer, rows=3)  # type: ignore[arg-type]
    # BalancedStrategy rebalances its own loader: the callback would observe every batch twice.
    callback = Rebalancing(rebalancer)
    trainer = Trainer(strategy=BalancedStrategy(), accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[callback], max_steps=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"^rebalancer: BalancedStrategy rebalances its own"):
        callback.on_train_start(trainer, LightningModule())


@pytest.mark.usefixtures("one_rank_for_a_test")
def test_rebalancing_carries_its_rebalancers_state_through_a_checkpoint():
    """Lightning restores a callback's state before training starts; the callback hands it to
    its rebalancer there (the steps counted and the speed models), and times the module. The
    rebalancer decides over torch.distributed's default group, of this process alone."""
    rebalancer = Rebalancer(BalancedSampler(range(8), [8], 0, verify=False), every=2)
    for _ in range(3):
        rebalancer.observe(8, 0.1)
    saved = Rebalancing(rebalancer).state_dict()
    fresh = Rebalancer(BalancedSampler(range(8), [8], 0, verify=False), every=2)
    resumed = Rebalancing(fresh)
    resumed.load_state_dict(saved)
    module = LightningModule()
    module.layer = nn.Linear(2, 2)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    resumed.on_train_start(trainer, module)
    assert (
        fresh.state_dict()
        == rebalancer.state_dict()
        != Rebalancer(BalancedSampler(range(8), [8], 0, verify=False), every=2).state_dict()
    )
    module.layer(torch.randn(3, 2)).sum().backward()  # a child's forward starts the step
    resumed.on_train_batch_end(trainer, module, None, [torch.zeros(3, 2)], 0)
    assert fresh.state_dict()["step"] == rebalancer.state_dict()["step"] + 1
    resumed.on_train_end(trainer, module)
