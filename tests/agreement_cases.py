"""Ranks that disagree, or whose own arguments are bad, on real MPI and gloo jobs: the cases
of tests/test_agreement.py, run inside every rank (tests/mpi_workers/agreement.py under
mpiexec, :func:`run_torch` under :func:`hetcoll.launch.spawn`).

Each finding returns this rank's outcome ("ok" or the exception's type name and message);
the test compares the ranks' outcomes. :func:`fuzz` draws disagreements with hypothesis on
rank 0 and sends each drawn case to the others, so one group of processes runs them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hetcoll
from hetcoll.comm import wrap
from hetcoll.torch import (
    BalancedSampler,
    DistributedOptimizer,
    broadcast_parameters,
    clip_grad_norm_,
    filter_parallel,
    parallelize,
)

TIMEOUT = 30.0  # seconds: a rank left waiting would raise CollectiveTimeout, which fails a case


def outcome(f: Callable[[], object]) -> str:
    """ "ok", or the type name and message of what ``f`` raised."""
    try:
        f()
    except Exception as e:  # the outcome is the test's to judge
        return f"{type(e).__name__}: {e}"
    return "ok"


# -- the findings of issue 26 --------------------------------------------------------------------


def findings(native: Any, engine: str) -> dict[str, str]:
    """Each finding's outcome on this rank (2 ranks)."""
    r = wrap(native).rank
    out: dict[str, str] = {}
    # Disagreeing lengths with no check argument: checked by default.
    out["default_check"] = outcome(lambda: hetcoll.allreduce(np.ones(8 + r), native))
    # check=False is the opt-out: disagreeing algorithms ("native" vs "direct": a plain
    # allreduce against point-to-point messages) are then not caught, so only agreeing calls.
    buf = np.full(8, r + 1.0)
    hetcoll.allreduce(buf, native, check=False, timeout=TIMEOUT)
    out["unchecked"] = "ok" if (buf == 3.0).all() else f"wrong: {buf}"
    # A rank whose own argument is bad tells the others before raising.
    nan = float("nan") if r == 1 else 1.0
    out["nan_weight"] = outcome(lambda: hetcoll.allreduce(np.ones(8), native, weight=nan))
    wrong = np.ones(8, np.int32) if r == 1 else np.ones(8)
    out["wrong_dtype"] = outcome(lambda: hetcoll.allreduce(wrong, native, timeout=TIMEOUT))
    # timeout=inf is no limit, not a timeout.
    buf = np.full(8, r + 1.0)
    out["timeout_inf"] = outcome(lambda: hetcoll.allreduce(buf, native, timeout=math.inf))
    if out["timeout_inf"] == "ok" and not (buf == 3.0).all():
        out["timeout_inf"] = f"wrong: {buf}"
    if engine == "mpi":
        # The shared-memory path compared lengths and dtypes but not the speeds that size the
        # chunks: ranks reduced overlapping chunks, wrong results and no error.
        speeds = [1.0, 3.0] if r == 0 else [3.0, 1.0]
        for check in (True, False):
            out[f"shared_speeds_check_{check}"] = outcome(
                lambda check=check: hetcoll.allreduce(
                    np.ones(300_000),  # 2.4 MB: two rounds (chunked), where speeds matter
                    native,
                    algorithm="shared",
                    speeds=speeds,
                    check=check,
                    timeout=TIMEOUT,
                )
            )
        # "auto" on ranks on either side of the shared-memory crossover (16 KiB on MPI): one
        # rank created node windows while the other ran MPI_Allreduce.
        n = 4096 if r == 0 else 1024
        out["auto_straddle"] = outcome(
            lambda: hetcoll.allreduce(np.ones(n), native, timeout=TIMEOUT)
        )
    # allgatherv: a rank whose piece or output is bad joins the first round all the same.
    for _ in range(2):  # a history, so that gloo's round is speculative (it predicts bytes)
        hetcoll.allgatherv(np.ones((2, 3)), native, timeout=TIMEOUT)
    piece: Any = [1.0] if r == 1 else np.ones((2, 3))
    out["gather_local"] = outcome(lambda: hetcoll.allgatherv(piece, native, timeout=TIMEOUT))
    into = np.empty((4, 3), np.float32 if r == 1 else np.float64)
    out["gather_out"] = outcome(
        lambda: hetcoll.allgatherv(np.ones((2, 3)), native, out=into, timeout=TIMEOUT)
    )
    # out= with a row too few on one rank: known wrong only once the lengths are in, in the
    # first round, where every rank sees every rank's rows (the others returned normally).
    into = np.empty((3 if r == 1 else 4, 3))
    out["gather_out_rows"] = outcome(
        lambda: hetcoll.allgatherv(np.ones((2, 3)), native, out=into, timeout=TIMEOUT)
    )
    # A rank's bad algorithm, segment size or unsendable piece: told to the others.
    one = np.ones((2, 3))
    bad: dict[str, Any] = {
        "gather_algorithm": {"algorithm": "bogus"},
        "gather_segment": {"segment_bytes": 0},
    }
    for name, kwargs in bad.items():
        given = {"timeout": TIMEOUT, **(kwargs if r == 1 else {})}
        out[name] = outcome(lambda given=given: hetcoll.allgatherv(one, native, **given))
    unsendable: dict[str, Any] = {
        "gather_meta": torch.ones(2, 3, device="meta"),
        "gather_sparse": torch.ones(2, 3).to_sparse(),
        "gather_objects": np.array([[None] * 3] * 2, dtype=object),
    }
    for name, piece in unsendable.items():
        mine = piece if r == 1 else torch.ones(2, 3)
        out[name] = outcome(lambda mine=mine: hetcoll.allgatherv(mine, native, timeout=TIMEOUT))
    check: Any = "yes" if r == 1 else True
    out["allreduce_check"] = outcome(
        lambda: hetcoll.allreduce(np.ones(8), native, check=check, timeout=TIMEOUT)
    )
    buf = torch.ones(8, device="meta") if r == 1 else torch.ones(8)
    out["allreduce_meta"] = outcome(lambda: hetcoll.allreduce(buf, native, timeout=TIMEOUT))
    leaf = torch.ones(8, requires_grad=r == 1)  # written in place: autograd cannot follow
    out["allreduce_requires_grad"] = outcome(
        lambda: hetcoll.allreduce(leaf, native, timeout=TIMEOUT)
    )
    params: Any = None if r == 1 else [torch.nn.Parameter(torch.ones(3))]
    out["clip_parameters"] = outcome(
        lambda: clip_grad_norm_(params, 1.0, group=native, timeout=TIMEOUT)
    )
    # broadcast_parameters' root: no rank of the group (gloo's own error before), on one rank
    # or on all; a good root copies its parameters.
    lin = torch.nn.Linear(3, 2).double()
    with torch.no_grad():
        lin.weight.fill_(r + 1.0)
    out["broadcast_root"] = outcome(lambda: broadcast_parameters(lin, native, root=7))
    root: Any = "1" if r == 1 else 1
    out["broadcast_root_local"] = outcome(lambda: broadcast_parameters(lin, native, root=root))
    broadcast_parameters(lin, native, root=1)
    out["broadcast_agree"] = "ok" if (lin.weight == 2.0).all() else f"wrong: {lin.weight}"
    # A split's or a plan's bad argument on one rank: told to the others in their agreement.
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    speeds = [1.0, 1.0, 1.0] if r == 1 else [1.0, 1.0]
    out["filter_parallel_speeds"] = outcome(
        lambda: filter_parallel(net, speeds=speeds, group=native, timeout=TIMEOUT)
    )
    pipeline = {
        "microbatches": 1,
        "replicas": [{"samples": 4, "stages": [{"ranks": [0], "layers": [0, 2]},
                                                {"ranks": [1], "layers": [2, 3]}]}],
    }  # fmt: skip
    plan: Any = {"replicas": []} if r == 1 else pipeline
    loss = torch.nn.MSELoss()
    out["parallelize_plan"] = outcome(lambda: parallelize(net, plan, loss_fn=loss, group=native))
    joined = hetcoll.allgatherv(np.full((1, 3), r), native, timeout=TIMEOUT)
    out["gather_after"] = "ok" if (joined == [[0] * 3, [1] * 3]).all() else f"wrong: {joined}"
    out.update(_optimizer_findings(native, r))
    out.update(_sampler_findings(native, r))
    # The group still works after every failure above.
    buf = np.full(4, r + 1.0)
    hetcoll.allreduce(buf, native, timeout=TIMEOUT)
    out["after"] = "ok" if (buf == 3.0).all() else f"wrong: {buf}"
    return out


def _optimizer(native: Any, params: list[torch.nn.Parameter]) -> DistributedOptimizer:
    for p in params:
        p.grad = torch.ones_like(p)
    return DistributedOptimizer(torch.optim.SGD(params, lr=0.1), native, local_batch=1)


def _optimizer_findings(native: Any, r: int) -> dict[str, str]:
    """Parameters ordered or typed differently: the old check compared element counts only."""
    out = {}
    a, b = torch.zeros(2, 3), torch.zeros(3, 2)
    order = [a, b] if r == 0 else [b, a]
    opt = _optimizer(native, [torch.nn.Parameter(t) for t in order])
    out["optimizer_order"] = outcome(opt.synchronize)
    dtype = torch.float32 if r == 0 else torch.float64
    opt = _optimizer(native, [torch.nn.Parameter(torch.zeros(6, dtype=dtype))])
    out["optimizer_dtype"] = outcome(opt.synchronize)
    dtype = torch.float16 if r == 1 else torch.float32  # unsupported on rank 1 only
    opt = _optimizer(native, [torch.nn.Parameter(torch.zeros(6, dtype=dtype))])
    out["optimizer_local"] = outcome(opt.synchronize)
    # Agreeing ranks: the sample-weighted mean, exactly (float64).
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = _optimizer(native, [p])
    assert p.grad is not None
    p.grad.fill_(r + 1.0)
    opt.local_batch = 1 + 2 * r  # ranks 1 and 3 samples: (1 * 1 + 3 * 2) / 4
    opt.synchronize()
    out["optimizer_agree"] = "ok" if (p.grad == 1.75).all() else f"wrong: {p.grad}"
    # A bad local_batch on one rank (set by hand): every rank raises from its step.
    opt.local_batch = -3 if r == 1 else 2
    out["optimizer_local_batch"] = outcome(opt.synchronize)
    opt.local_batch = 1
    p.grad = torch.ones_like(p)
    out["optimizer_after"] = outcome(opt.synchronize)
    return out


def _sampler_findings(native: Any, r: int) -> dict[str, str]:
    out = {}
    sampler = BalancedSampler(range(100), [3, 5], r, group=native)
    out["set_shares"] = outcome(lambda: sampler.set_shares([4, 4] if r == 0 else [5, 3]))
    out["set_shares_kept"] = "ok" if sampler.shares == [3, 5] else f"wrong: {sampler.shares}"
    out["set_shares_local"] = outcome(lambda: sampler.set_shares([4, 0] if r == 1 else [4, 4]))
    out["construct_local"] = outcome(
        lambda: BalancedSampler(range(10), [2, 2], 5 if r == 1 else r, group=native)
    )
    sampler.set_shares([6, 2])
    out["set_shares_agree"] = "ok" if sampler.shares == [6, 2] else f"wrong: {sampler.shares}"
    return out


# -- hypothesis: disagreements drawn on rank 0 -----------------------------------------------------

WEIGHTS = (0.5, 1.0, 2.0)  # dyadic: every sum below is exact in every dtype
DTYPES = ("float32", "float64", "float16")


@st.composite
def cases(draw: Any, algorithms: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per rank (2), allreduce's arguments: agreeing, or one field that differs on one rank,
    or one rank's own bad argument (a NaN weight, an integer dtype)."""
    base = {
        "length": draw(st.integers(0, 300)),
        "dtype": draw(st.sampled_from(DTYPES)),
        "algorithm": draw(st.sampled_from(algorithms)),
        "speeds": draw(
            st.none() | st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=2, max_size=2)
        ),
    }
    per_rank = [dict(base, weight=draw(st.sampled_from(WEIGHTS))) for _ in range(2)]
    change = draw(st.sampled_from(["none", "length", "dtype", "algorithm", "speeds", "local"]))
    q = draw(st.integers(0, 1))
    if change == "length":
        per_rank[q]["length"] = base["length"] + draw(st.integers(1, 50))
    elif change == "dtype":
        per_rank[q]["dtype"] = draw(st.sampled_from([d for d in DTYPES if d != base["dtype"]]))
    elif change == "algorithm":
        others = [a for a in algorithms if a != base["algorithm"]]
        per_rank[q]["algorithm"] = draw(st.sampled_from(others))
    elif change == "speeds":
        speeds = [[1.0, 2.0], [2.0, 1.0], None]
        per_rank[q]["speeds"] = draw(st.sampled_from([s for s in speeds if s != base["speeds"]]))
    elif change == "local":
        bad = draw(st.sampled_from([{"weight": math.nan}, {"dtype": "int32"}]))
        per_rank[q].update(bad)
    return per_rank


def run_case(native: Any, per_rank: list[dict[str, Any]], r: int) -> str:
    """This rank's allreduce of its case; "ok" only if the result is right."""
    case = per_rank[r]
    buf = np.full(case["length"], r + 1.0).astype(case["dtype"])
    got = outcome(
        lambda: hetcoll.allreduce(
            buf,
            native,
            weight=case["weight"],
            algorithm=case["algorithm"],
            speeds=case["speeds"],
            timeout=TIMEOUT,
        )
    )
    want = expected(per_rank)
    if got == "ok" and not (isinstance(want, float) and (buf == want).all()):
        return f"wrong: {buf[:4]}... for {want}"
    return got


def expected(per_rank: list[dict[str, Any]]) -> tuple[str, ...] | float:
    """What every rank must see: the exception type names in rank order, or the result."""
    bad = [q for q, c in enumerate(per_rank) if math.isnan(c["weight"]) or c["dtype"] == "int32"]
    if bad:
        (q,) = bad
        own = "ValueError" if math.isnan(per_rank[q]["weight"]) else "TypeError"
        return tuple(own if r == q else "CollectiveMismatchError" for r in range(2))
    fields = [{k: v for k, v in c.items() if k != "weight"} for c in per_rank]
    if fields[0] != fields[1]:
        return ("CollectiveMismatchError",) * 2
    return sum(c["weight"] * (r + 1) for r, c in enumerate(per_rank))


def fuzz(
    native: Any,
    share: Callable[[Any], Any],
    gather: Callable[[str], list[str]],
    algorithms: tuple[str, ...],
    examples: int,
) -> int:
    """Rank 0 draws ``examples`` cases with hypothesis and ``share``s each with rank 1 (None
    ends); every rank runs it and rank 0 checks everyone's outcome (``gather``). Returns the
    number of cases run."""
    r = wrap(native).rank
    ran = 0
    if r != 0:
        while (per_rank := share(None)) is not None:
            gather(run_case(native, per_rank, r))
            ran += 1
        return ran

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(cases(algorithms))
    def check(per_rank: list[dict[str, Any]]) -> None:
        nonlocal ran
        share(per_rank)
        got = gather(run_case(native, per_rank, 0))
        ran += 1
        want = expected(per_rank)
        if isinstance(want, tuple):
            names = tuple(g.split(":")[0] for g in got)
            assert names == want, (per_rank, got)
            failing = [q for q, name in enumerate(want) if name != "CollectiveMismatchError"]
            for q, g in enumerate(got):  # the others name the failing rank and its error
                if failing and q not in failing:
                    assert f"rank {failing[0]} raised {want[failing[0]]}" in g, (per_rank, got)
        else:
            assert got == ["ok", "ok"], (per_rank, got)

    try:
        check()
    finally:
        share(None)
    return ran


# -- the engines ---------------------------------------------------------------------------------


def run_torch(rank: int, world: int, examples: int) -> dict[str, Any]:
    """A :func:`hetcoll.launch.spawn` worker (gloo)."""
    import torch.distributed as dist

    def share(x: Any) -> Any:
        box = [x]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(x: str) -> list[str]:
        every: list[Any] = [None] * world
        dist.all_gather_object(every, x)
        return every

    algorithms = ("auto", "ring", "native", "direct")
    return {
        "findings": findings(None, "gloo"),
        "fuzzed": fuzz(None, share, gather, algorithms, examples),
    }


def run_mpi(comm: Any, examples: int) -> dict[str, Any]:
    """Every rank of an MPI job (tests/mpi_workers/agreement.py)."""
    algorithms = ("auto", "ring", "native", "direct", "shared")
    return {
        "findings": findings(comm, "mpi"),
        "fuzzed": fuzz(comm, lambda x: comm.bcast(x, root=0), comm.allgather, algorithms, examples),
    }
