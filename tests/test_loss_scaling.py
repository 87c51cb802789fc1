"""The check that a plan's ranks scale their losses by one factor (hetcoll.torch.loss_scaling),
against a brute-force oracle: the fields each rank adds to the step's sum, summed, say "one
scale" exactly when every rank's float32 scale is the same. The runtime's use of it, and
the scalers a step refuses, run in tests/plan_cases.py on 4 gloo and MPI ranks; here,
hetcoll's GroupGradScaler on a group of one rank against torch's GradScaler."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetcoll.torch import GroupGradScaler
from hetcoll.torch.loss_scaling import SCALE_FIELDS, scale_fields, scales_agree

#: Scales a GradScaler holds: powers of two from its defaults, and any positive float32.
_SCALES = st.one_of(
    st.integers(-30, 40).map(lambda e: 2.0**e),
    st.floats(2.0**-100, 2.0**100, width=32, allow_subnormal=False),
)


def _summed(scales: list[float]) -> list[float]:
    total = torch.zeros(SCALE_FIELDS, dtype=torch.float64)
    for s in scales:
        total += scale_fields(torch.tensor([s], dtype=torch.float32))
    return total.tolist()


@settings(max_examples=300, deadline=None)
@given(st.lists(_SCALES, min_size=1, max_size=9))
def test_the_summed_fields_agree_exactly_when_every_scale_is_the_same(scales):
    bits = {torch.tensor(s, dtype=torch.float32).view(torch.int32).item() for s in scales}
    assert scales_agree(_summed(scales), len(scales)) == (len(bits) == 1)


@settings(max_examples=200, deadline=None)
@given(_SCALES, st.one_of(st.none(), st.integers(0, 22)), st.integers(1, 2000))
def test_one_rank_apart_among_many_is_seen(common, flip, ranks):
    """Up to 2000 ranks at one scale and one more at it too, or at it with one bit of its
    mantissa flipped (the low 16 bits included)."""
    bits = torch.tensor([common], dtype=torch.float32).view(torch.int32)
    odd = bits if flip is None else bits ^ (1 << flip)
    total = [
        a * ranks + b
        for a, b in zip(_summed([common]), _summed([float(odd.view(torch.float32))]), strict=True)
    ]
    assert scales_agree(total, ranks + 1) == (flip is None)


def test_neighbouring_scales_differ():
    s = torch.tensor(1024.0, dtype=torch.float32)
    near = torch.nextafter(s, torch.tensor(2048.0))
    assert not scales_agree(_summed([float(s), float(near)]), 2)
    assert scales_agree(_summed([float(s)] * 5), 5)


def test_the_fields_are_the_scale_s_bit_halves_and_their_squares():
    out = scale_fields(torch.tensor([2.0**16 + 1], dtype=torch.float32))
    assert out.dtype == torch.float64 and out.shape == (SCALE_FIELDS,)
    hi, lo = 0x4780, 0x0080  # 65537.0 in float32: 0x47800080
    assert out.tolist() == [hi, hi * hi, lo, lo * lo]


def _train(scaler: torch.amp.GradScaler, overflow_at: int) -> tuple[list[float], torch.Tensor]:
    """Four float64 steps of a linear model under ``scaler``, one gradient made inf at step
    ``overflow_at``; the scale after each step and the final weight."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    scales = []
    for step in range(4):
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if step == overflow_at:
            model.weight.grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, model.weight.detach().clone()


def test_a_group_scaler_on_one_rank_is_a_grad_scaler(one_rank_for_a_test):
    """On a group of one rank, the sum of the flags is this rank's own: the same skips, scales
    and weights as torch's GradScaler, bit for bit."""
    settings_ = {"device": "cpu", "init_scale": 2.0**8, "growth_interval": 2}
    want = _train(torch.amp.GradScaler(**settings_), overflow_at=1)
    got = _train(GroupGradScaler(**settings_), overflow_at=1)
    assert got[0] == want[0] == [256.0, 128.0, 128.0, 256.0]
    assert torch.equal(got[1], want[1])


def test_a_group_scaler_steps_a_rank_that_holds_no_gradient(one_rank_for_a_test):
    """A rank whose parameters got no gradient (a plan's idle rank) still takes part in the
    sum, and its step is no error: torch's GradScaler asserts that it recorded a flag."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GroupGradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 4.0 and torch.equal(p, torch.zeros(3))


def test_a_group_scaler_names_its_bad_arguments(one_rank_for_a_test):
    with pytest.raises(TypeError, match="group"):
        GroupGradScaler("cpu", group=3)
    with pytest.raises(ValueError, match="timeout"):
        GroupGradScaler("cpu", timeout=0)
    with pytest.raises(ValueError, match="timeout"):
        GroupGradScaler("cpu", timeout=float("nan"))


def test_a_disabled_group_scaler_needs_no_group():
    """``enabled=False`` (float32 runs of a float16 script) is a no-op, as torch's: one
    process with no group may construct it, and it scales nothing."""
    scaler = GroupGradScaler("cpu", enabled=False)
    assert scaler.comm is None and not scaler.is_enabled()
    assert scaler.scale(torch.tensor(3.0)).item() == 3.0


def test_a_group_scaler_over_the_default_group_pickles_as_ddp_does(one_rank_for_a_test):
    """Over the default group (``group=None``) it pickles mid-training, its scale and growth
    carried, and unpickles over the loading process's default group; over a group given
    explicitly it raises naming state_dict, as a communicator cannot be pickled."""
    import pickle

    import torch.distributed as dist

    scaler = GroupGradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    _train(scaler, overflow_at=1)
    again = pickle.loads(pickle.dumps(scaler))
    assert again.get_scale() == scaler.get_scale() == 256.0
    assert again.state_dict() == scaler.state_dict()
    assert again.comm is not None and again.comm.size == 1
    assert _train(again, overflow_at=-1)[0] == _train(scaler, overflow_at=-1)[0]
    explicit = GroupGradScaler("cpu", group=dist.group.WORLD)
    with pytest.raises(TypeError, match=r"state_dict\(\)"):
        pickle.dumps(explicit)


def test_an_unpickled_group_scaler_where_there_is_no_group_says_so(group_of_one):
    """Unpickled where there is no default group, an enabled scaler raises naming the group
    (a disabled one needs none)."""
    import pickle

    disabled = pickle.loads(pickle.dumps(GroupGradScaler("cpu", enabled=False)))
    assert disabled.comm is None and not disabled.is_enabled()
    with group_of_one():
        raw = pickle.dumps(GroupGradScaler("cpu"))
    with pytest.raises(ValueError, match="group"):
        pickle.loads(raw)
