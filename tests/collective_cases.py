"""The multi-rank cases of tests/test_collectives.py, run inside every rank of a real job.

One function per engine entry (:func:`run_all`) runs many cases per launch, because process
start-up (torch import) is the cost. Each rank checks its own results against a float64
reference it can compute itself (every rank's input is a deterministic function of its rank),
and the ranks compare digests of their results to prove they are bitwise identical. A failing
check raises, which fails the rank and so the launch.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

import hetcoll
from hetcoll import collectives, fusion
from hetcoll.collectives import _common, _tuning
from hetcoll.comm import Communicator

DTYPES = ["float32", "float64", "float16", "bfloat16"]
# relative tolerance against sum_r |w_r x_r| (16-bit types are rounded at every ring hop)
RTOL = {"float32": 2e-6, "float64": 1e-14, "float16": 4e-3, "bfloat16": 3e-2}


def _input(kind: str, n: int, rank: int, seed: int, as_tensor: bool) -> tuple[Any, np.ndarray]:
    """This rank's buffer and its exact value in float64."""
    rng = np.random.default_rng(seed * 1000 + rank)
    x = rng.standard_normal(n)
    if kind == "bfloat16":
        t = torch.from_numpy(x).to(torch.bfloat16)
        return t, t.double().numpy()
    if as_tensor:
        t = torch.from_numpy(x).to(getattr(torch, kind))
        return t, t.double().numpy()
    a = x.astype(kind)
    return a, a.astype(np.float64)


def _as_f64(buf: Any) -> np.ndarray:
    if isinstance(buf, torch.Tensor):
        return buf.double().numpy()
    return np.asarray(buf, dtype=np.float64)


def _digest(buf: Any) -> str:
    if isinstance(buf, torch.Tensor):
        data = buf.contiguous().view(torch.uint8).numpy().tobytes() if buf.numel() else b""
    else:
        data = np.ascontiguousarray(buf).tobytes()
    return hashlib.sha256(data).hexdigest()


def _same_everywhere(comm: Communicator, digest: str, what: str) -> None:
    raw = np.frombuffer(bytes.fromhex(digest), dtype=np.int64)
    rows = comm.allgather_int64(raw, time.monotonic() + 60)
    if not (rows == rows[0]).all():
        raise AssertionError(f"{what}: results differ between ranks")


def _weight(rank: int, case: int) -> float:
    return [1.0, 0.5 + 0.25 * rank, -1.5 + rank, 1.0 / (rank + 3)][case % 4]


def _algorithms(comm: Communicator) -> tuple[str, ...]:
    """The allreduce algorithms this engine has ("shared" needs MPI and one node)."""
    return ("ring", "native", "direct", "auto") + (("shared",) if comm.engine == "mpi" else ())


@contextmanager
def _native_halves(always: bool) -> Iterator[None]:
    """Within: "native" goes in two halves at once at any size when ``always`` (on both
    engines), else in one call at any size."""
    saved = _tuning.NATIVE_HALVES_FROM_BYTES, _tuning.NATIVE_HALVES_TWO_RANKS_FROM_BYTES
    halves = dict.fromkeys(("mpi", "gloo"), 0 if always else math.inf)
    _tuning.NATIVE_HALVES_FROM_BYTES = _tuning.NATIVE_HALVES_TWO_RANKS_FROM_BYTES = halves
    try:
        yield
    finally:
        _tuning.NATIVE_HALVES_FROM_BYTES, _tuning.NATIVE_HALVES_TWO_RANKS_FROM_BYTES = saved


def check_allreduce(comm: Communicator, native: Any) -> int:
    p, r = comm.size, comm.rank
    lengths = [0, 1, p - 1, 13, 1009, 65_537, 300_007]
    done = 0
    for kind in DTYPES:
        for algorithm in _algorithms(comm):
            for i, n in enumerate(lengths):
                slow_sum = algorithm not in ("ring", "shared")
                if kind in ("float16", "bfloat16") and n > 65_537 and slow_sum:
                    continue  # the 16-bit MPI sum is a Python-level user op: keep the run short
                as_tensor = (i % 2 == 1) or kind == "bfloat16"
                seed = 7 * i + len(kind)
                w = _weight(r, i)
                buf, _ = _input(kind, n, r, seed, as_tensor)
                speeds = [1.0 + (q % 3) for q in range(p)] if i % 3 == 2 else None
                segment = 4096 if i % 2 else _tuning.SEGMENT_BYTES
                with _native_halves(i % 2 == 1):
                    out = hetcoll.allreduce(
                        buf,
                        native,
                        weight=w,
                        algorithm=algorithm,
                        speeds=speeds,
                        check=(i % 2 == 0),
                        timeout=None if i % 3 == 1 else 60,  # the engines' blocking calls
                        segment_bytes=segment,
                    )
                assert out is buf
                ref = np.zeros(n)
                scale = np.zeros(n)
                for q in range(p):
                    _, x = _input(kind, n, q, seed, as_tensor)
                    ref += _weight(q, i) * x
                    scale += abs(_weight(q, i) * x)
                got = _as_f64(buf)
                err = np.abs(got - ref)
                bound = RTOL[kind] * (scale + 1e-300) * (p + 1)
                if (err > bound).any():
                    k = int(np.argmax(err - bound))
                    raise AssertionError(
                        f"allreduce {kind} {algorithm} n={n} rank {r}: element {k} is {got[k]}, "
                        f"reference {ref[k]}"
                    )
                _same_everywhere(comm, _digest(buf), f"allreduce {kind} {algorithm} n={n}")
                done += 1
    return done


def check_random_sweep(comm: Communicator, native: Any) -> int:
    """Property sweep: random lengths, dtypes, algorithms, weights, chunk speeds and segment
    sizes (the same draws on every rank), each against the float64 reference."""
    p, r = comm.size, comm.rank
    rng = np.random.default_rng(2024 + p)
    cases = 12
    for case in range(cases):
        kind = DTYPES[rng.integers(len(DTYPES))]
        n = int(rng.integers(0, 5000))
        algorithm = ("ring", "native", "direct", "auto")[rng.integers(4)]
        if comm.engine == "mpi" and case % 3 == 0:
            algorithm = "shared"
        weights = rng.uniform(-2, 2, p)
        speeds = rng.uniform(0.1, 5, p).tolist() if rng.integers(2) else None
        segment_bytes = int(rng.integers(1, 4096))
        seed = 10_000 + case
        buf, _ = _input(kind, n, r, seed, True)
        hetcoll.allreduce(
            buf,
            native,
            weight=float(weights[r]),
            algorithm=algorithm,
            speeds=speeds,
            segment_bytes=segment_bytes,
            check=True,
            timeout=60,
        )
        ref, scale = np.zeros(n), np.zeros(n)
        for q in range(p):
            _, x = _input(kind, n, q, seed, True)
            ref += weights[q] * x
            scale += abs(weights[q] * x)
        err = np.abs(_as_f64(buf) - ref)
        if (err > RTOL[kind] * scale * (p + 1)).any():
            raise AssertionError(
                f"sweep case {case}: {kind} {algorithm} n={n} speeds={speeds} "
                f"segment_bytes={segment_bytes}: off the reference on rank {r}"
            )
        _same_everywhere(comm, _digest(buf), f"sweep case {case}")
    return cases


def check_auto_choice(comm: Communicator, native: Any) -> int:
    """What "auto" allreduce picks on either side of each crossover that applies to this engine
    and rank count (the same on every rank: it reads only what ranks agree on)."""
    p, engine = comm.size, comm.engine
    windows = comm.node_windows(_tuning.SHARED_SEGMENT_BYTES) is not None
    expect: list[tuple[float, bool, str]] = []  # (bytes, chunk speeds given, algorithm)
    if windows:
        shared = _tuning.SHARED_FROM_BYTES[engine]
        expect += [
            (shared, False, "shared"),
            (shared, True, "shared"),
            (shared - 4, False, "native"),
        ]
    elif p == 2:
        ring = _tuning.RING_TWO_RANKS_FROM_BYTES[engine]
        direct = _tuning.DIRECT_TWO_RANKS_FROM_BYTES.get(engine, ring)
        expect += [(ring, False, "ring"), (ring - 4, True, "ring"), (direct - 4, False, "native")]
        if direct < ring:
            expect += [(direct, False, "direct"), (ring - 4, False, "direct")]
    else:
        ring = _tuning.RING_CROSSOVER_BYTES[engine]
        direct = _tuning.DIRECT_BYTES[engine] // (p - 1) // 4 * 4
        expect += [(ring, False, "ring"), (ring - 4, False, "native"), (4, True, "ring")]
        if direct:
            expect += [(direct, False, "direct"), (direct + 4, False, "native")]
    for nbytes, speeds, want in expect:
        got = collectives.choose_algorithm(comm, int(nbytes), speeds)
        assert got == want, (engine, p, nbytes, speeds, got, want)
    return 1


def check_aliasing_and_shapes(comm: Communicator, native: Any) -> int:
    p, r = comm.size, comm.rank
    for algorithm in _algorithms(comm):
        # A view into a larger buffer: only the view changes.
        big = np.full(40, 100.0 + r)
        view = big[5:35].reshape(5, 6)
        view[...] = np.arange(30.0).reshape(5, 6) * (r + 1)
        hetcoll.allreduce(view, native, weight=2.0, algorithm=algorithm, segment_bytes=64)
        want = np.arange(30.0).reshape(5, 6) * 2.0 * sum(q + 1 for q in range(p))
        np.testing.assert_array_equal(view, want)
        np.testing.assert_array_equal(big[:5], 100.0 + r)
        np.testing.assert_array_equal(big[35:], 100.0 + r)
    # Fusion buffer path of the data-parallel optimizer: pack scaled, allreduce, unpack.
    grads = [np.full((3, 2), r + 1.0, np.float32), np.full(5, -(r + 1.0), np.float32)]
    flat = fusion.pack(grads, scale=float(r + 1))
    hetcoll.allreduce(flat, native, algorithm="ring")
    fusion.unpack(flat, grads, scale=0.5)
    total = 0.5 * sum((q + 1.0) ** 2 for q in range(p))
    np.testing.assert_array_equal(grads[0], total)
    np.testing.assert_array_equal(grads[1], -total)
    return 3


@contextmanager
def _speculative_rounds(batched: bool) -> Iterator[None]:
    """allgatherv's speculative round on gloo as one all-to-all (what small gathers get) or,
    when not ``batched``, point to point (what large ones get), whatever the gather's size."""
    saved = _tuning.BATCHED_GATHER_BYTES
    _tuning.BATCHED_GATHER_BYTES = saved if batched else -1
    try:
        yield
    finally:
        _tuning.BATCHED_GATHER_BYTES = saved


def check_mismatch(comm: Communicator, native: Any) -> int:
    r = comm.rank
    cases = [
        dict(buf=np.ones(10 + (r == comm.size - 1)), algorithm="ring"),
        dict(buf=np.ones(10, np.float32 if r == 0 else np.float64), algorithm="native"),
        dict(buf=np.ones(10), algorithm="ring" if r == 0 else "native"),
    ]
    for kw, names in zip(cases, ([], ["float32 = 1", "float64 = 2"], ["'ring' = "]), strict=True):
        try:
            hetcoll.allreduce(kw["buf"], native, algorithm=kw["algorithm"], check=True, timeout=30)
        except hetcoll.CollectiveMismatchError as e:
            # The codes ranks passed are named (they were bare numbers).
            assert all(n in str(e) for n in names), e
            continue
        raise AssertionError(f"rank {r}: no CollectiveMismatchError for {kw}")
    shared = 0
    if comm.engine == "mpi":
        # "shared" compares lengths, dtypes and speeds in its headers, even unchecked.
        speeds = [1.0 + r] + [1.0] * (comm.size - 1)
        for buf, sp in (
            (np.ones(10 + (r == 1)), None),
            (np.ones(10, np.float32 if r else np.float64), None),
            (np.ones(10), speeds),
        ):
            try:
                hetcoll.allreduce(
                    buf, native, algorithm="shared", speeds=sp, check=False, timeout=30
                )
            except hetcoll.CollectiveMismatchError as e:
                assert "ranks disagree on" in str(e), e
            else:
                raise AssertionError(f"rank {r}: shared allreduce accepted {buf.dtype}[{buf.size}]")
            shared += 1
    try:
        hetcoll.allgatherv(np.ones((2, 3 + (r == 0))), native, timeout=30)
    except hetcoll.CollectiveMismatchError:
        pass
    else:
        raise AssertionError(f"rank {r}: allgatherv accepted pieces of different widths")
    # After gathers that set a prediction (96 bytes a piece on gloo's speculative round), ranks
    # disagree on the dtype and the others' pieces outgrow the prediction: every rank still
    # finishes the round (no one sends more than predicted) and raises; both ways of sending.
    for batched in (True, False):
        with _speculative_rounds(batched):
            for _ in range(2):
                hetcoll.allgatherv(np.ones((4, 3)), native, timeout=30)
            odd = np.ones((4, 3), np.float32) if r == 0 else np.ones((8, 3))
            try:
                hetcoll.allgatherv(odd, native, timeout=30)
            except hetcoll.CollectiveMismatchError as e:
                assert "dtype" in str(e), e
            else:
                raise AssertionError(f"rank {r}: allgatherv accepted pieces of different dtypes")
            np.testing.assert_array_equal(  # the group still works
                hetcoll.allgatherv(np.full((1, 3), r), native, timeout=30),
                np.repeat(np.arange(comm.size), 3).reshape(-1, 3),
            )
    odd_ones = _odd_arguments(comm, native)
    try:
        hetcoll.allgatherv(np.ones(5), native, algorithm="ring" if r == 0 else "auto", timeout=30)
    except hetcoll.CollectiveMismatchError as e:
        assert "algorithm: ranks disagree" in str(e), e
        return len(cases) + 3 + shared + odd_ones
    raise AssertionError(f"rank {r}: allgatherv ran with ranks choosing different algorithms")


def _odd_arguments(comm: Communicator, native: Any) -> int:
    """Arguments of rank 0 that its own checks once let through or that failed outside them:
    each raises on every rank (rank 0 naming its argument), and the group stays in step."""
    p, r = comm.size, comm.rank
    lazy = torch.arange(3.0).to(torch.complex64) * (1j + r)
    cases = [
        # bfloat16 travels as int16 patterns: the pieces were read as the other type.
        (
            lambda: hetcoll.allgatherv(
                torch.ones(2, dtype=torch.bfloat16 if r == 0 else torch.int16), native, timeout=30
            ),
            hetcoll.CollectiveMismatchError,
            "dtype",
        ),
        # np.ascontiguousarray made a 0-d piece 1-d: gathered as one row, no error.
        (
            lambda: hetcoll.allgatherv(np.array(1.0) if r == 0 else np.ones(1), native, timeout=30),
            ValueError,
            "^local: must have at least one dimension",
        ),
        # A lazily negated tensor (x.conj().imag): numpy's RuntimeError left rank 0 alone.
        (
            lambda: hetcoll.allreduce(
                lazy.conj().imag if r == 0 else torch.ones(3), native, timeout=30
            ),
            ValueError,
            "^buf: has its negative bit set",
        ),
    ]
    for call, error, pattern in cases:
        try:
            call()
        except hetcoll.CollectiveMismatchError as e:
            assert r != 0 or error is hetcoll.CollectiveMismatchError, e
            assert r == 0 or "rank 0 raised" in str(e) or re.search(pattern, str(e)), e
        except error as e:
            assert r == 0 and re.search(pattern, str(e)), e
        else:
            raise AssertionError(f"rank {r}: no error for {pattern}")
        np.testing.assert_array_equal(  # the group still works
            hetcoll.allgatherv(np.full(1, r), native, timeout=30), np.arange(p)
        )
    # A lazily conjugated piece (x.conj()) gathers its values (a RuntimeError on that rank).
    got = hetcoll.allgatherv(lazy.conj(), native, timeout=30)
    want = torch.cat([torch.arange(3.0).to(torch.complex64) * (q - 1j) for q in range(p)])
    assert torch.equal(got, want), (got, want)
    return len(cases) + 1


def check_shared(comm: Communicator, native: Any) -> int:
    """ "shared" through small windows, so buffers go in many pieces, each in one round or in
    two: every dtype, lengths around the piece and chunk boundaries, chunks sized by speeds,
    against the float64 reference and bitwise the same everywhere. On engines without shared
    memory, asking for it raises on every rank."""
    if comm.engine != "mpi":
        for call in (hetcoll.allreduce, hetcoll.allgatherv):
            try:
                call(np.ones(4), native, algorithm="shared")
            except ValueError as e:
                assert "algorithm" in str(e), e
            else:
                raise AssertionError(f"rank {comm.rank}: {comm.engine} ran {call.__name__} shared")
        return 2
    p, r = comm.size, comm.rank
    saved = (
        _tuning.SHARED_SEGMENT_BYTES,
        _tuning.SHARED_ONE_ROUND_BYTES,
        _tuning.SHARED_GATHER_BELOW_BYTES,
    )
    done = 0
    try:
        _tuning.SHARED_SEGMENT_BYTES = 4096
        for one_round in (0, 1 << 20):
            _tuning.SHARED_ONE_ROUND_BYTES = one_round
            for i, kind in enumerate(DTYPES):
                itemsize = 8 if kind == "float64" else 4 if kind == "float32" else 2
                per = 4096 // itemsize
                for n in (1, p + 1, per - 1, per, 3 * per + 7):
                    seed = 500 + n + i
                    w = _weight(r, n + i)
                    speeds = [1.0 + 2 * q for q in range(p)] if n % 2 else None
                    buf, _ = _input(kind, n, r, seed, as_tensor=(n % 2 == 0))
                    hetcoll.allreduce(
                        buf, native, weight=w, algorithm="shared", speeds=speeds, timeout=60
                    )
                    ref, scale = np.zeros(n), np.zeros(n)
                    for q in range(p):
                        _, x = _input(kind, n, q, seed, as_tensor=(n % 2 == 0))
                        ref += _weight(q, n + i) * x
                        scale += abs(_weight(q, n + i) * x)
                    if (np.abs(_as_f64(buf) - ref) > RTOL[kind] * (scale + 1e-300) * p).any():
                        raise AssertionError(
                            f"shared {kind} n={n} one_round<={one_round}: off the reference "
                            f"on rank {r}"
                        )
                    _same_everywhere(comm, _digest(buf), f"shared {kind} n={n}")
                    done += 1
        # allgatherv: pieces of 0 to several windows' worth of rows, in rounds of 4 KiB each.
        for rows_of in (lambda q: 0, lambda q: q, lambda q: 1000 * q + 7, lambda q: 1500 - q):
            pieces = [
                np.arange(rows_of(q) * 3, dtype=np.float32).reshape(-1, 3) + q for q in range(p)
            ]
            out = hetcoll.allgatherv(pieces[r], native, algorithm="shared", timeout=60)
            np.testing.assert_array_equal(out, np.concatenate(pieces))
            done += 1
        # "auto" from SHARED_GATHER_BELOW_BYTES: the windows carry the headers, the engine the
        # pieces (here the ring: messages); below it, no message at all.
        counted, tags = _counted(comm, native)
        pieces = [np.arange((700 * q + 5) * 3, dtype=np.float32).reshape(-1, 3) for q in range(p)]
        total = sum(x.nbytes for x in pieces)
        for below, messages in ((total, True), (total + 1, False)):
            tags.clear()
            _tuning.SHARED_GATHER_BELOW_BYTES = {"mpi": below}
            out = hetcoll.allgatherv(pieces[r], counted, timeout=60)
            np.testing.assert_array_equal(out, np.concatenate(pieces))
            assert bool(tags) == messages, (below, total, tags)
            done += 1
    finally:
        _tuning.SHARED_SEGMENT_BYTES, _tuning.SHARED_ONE_ROUND_BYTES = saved[:2]
        _tuning.SHARED_GATHER_BELOW_BYTES = saved[2]
    return done


def check_allgatherv(comm: Communicator, native: Any) -> int:
    p, r = comm.size, comm.rank
    done = 0
    # Uneven pieces, a rank with none, none at all, and equal pieces (the engine's allgather).
    row_sets = [lambda q: q + 1, lambda q: 0 if q == 1 else 2 * q + 1, lambda q: 0, lambda q: 2]
    for k, rows_of in enumerate(row_sets):
        for i, dtype in enumerate(("float32", "float64", "int64", "float16")):
            pieces = [
                np.arange(rows_of(q) * 3, dtype=dtype).reshape(rows_of(q), 3) + 100 * q
                for q in range(p)
            ]
            algorithm = ("native", "ring", "direct", "auto")[(k + i) % 4]
            if comm.engine == "mpi" and i == 3:
                algorithm = "shared"
            out = hetcoll.allgatherv(
                pieces[r], native, algorithm=algorithm, timeout=60, segment_bytes=16
            )
            np.testing.assert_array_equal(out, np.concatenate(pieces))
            assert out.dtype == np.dtype(dtype)
            done += 1
        t = torch.arange(rows_of(r) * 2, dtype=torch.float32).to(torch.bfloat16).view(-1, 2) + r
        out_t = hetcoll.allgatherv(
            t, native, algorithm=("ring", "native", "direct")[k % 3], timeout=60
        )
        want = torch.cat(
            [
                torch.arange(rows_of(q) * 2, dtype=torch.float32).to(torch.bfloat16).view(-1, 2) + q
                for q in range(p)
            ]
        )
        assert out_t.dtype == torch.bfloat16 and torch.equal(out_t, want)
        ints = torch.arange(rows_of(r), dtype=torch.int64) * 10 + r
        got = hetcoll.allgatherv(ints, native, timeout=60)
        want_ints = torch.cat(
            [torch.arange(rows_of(q), dtype=torch.int64) * 10 + q for q in range(p)]
        )
        assert got.dtype == torch.int64 and torch.equal(got, want_ints)
        done += 1
    # large, uneven 1-D
    n_of = [100_003 * (q + 1) for q in range(p)]
    mine = np.full(n_of[r], float(r), np.float32)
    want = np.concatenate([np.full(n, q, np.float32) for q, n in enumerate(n_of)])
    for algorithm in _algorithms(comm):
        out = hetcoll.allgatherv(mine, native, algorithm=algorithm)
        np.testing.assert_array_equal(out, want)
    return done


def check_speculative_round(comm: Communicator, native: Any, batched: bool) -> int:
    """``"auto"`` around allgatherv's speculative first round on gloo: one round when every
    piece is at most as long as the group's recent gathers predict, a second one (the rest of
    longer pieces) when not; a repeating pattern of shapes is recognised. ``batched``: the
    round as one all-to-all, else point to point. On MPI: through the node's shared memory
    when ``batched``, else as across nodes (the length exchange and MPI_Allgatherv)."""
    with _speculative_rounds(batched):
        return _speculative_steps(comm, native, batched)


def _counted(comm: Communicator, native: Any) -> tuple[Communicator, list[int]]:
    """A wrapper of its own around ``native``, and the list its messages land in: a send or
    receive as its tag, an all-to-all as -2, another collective (a length exchange or an
    allgatherv) as -1."""
    counted = type(comm)(native)
    tags: list[int] = []

    def counting(name: str) -> Any:
        method = getattr(counted, name)

        def count(*a: Any, **kw: Any) -> Any:
            tags.append(a[2] if name in ("isend", "irecv") else -2 if name == "ialltoallv" else -1)
            return method(*a, **kw)

        return count

    for name in ("allgather_fixed", "iallgatherv", "ialltoallv", "isend", "irecv"):
        setattr(counted, name, counting(name))
    return counted, tags


def _speculative_steps(comm: Communicator, native: Any, batched: bool) -> int:
    p, r = comm.size, comm.rank
    counted, tags = _counted(comm, native)
    speculative = comm.engine in _tuning.SPECULATIVE_GATHER_ENGINES
    # MPI: through the node's shared memory; the second pass as if the ranks were on several
    # nodes (no shared memory), where a length exchange and MPI_Allgatherv do it.
    shared = comm.engine == "mpi" and batched
    if comm.engine == "mpi" and not batched:
        counted.node_windows = lambda capacity, deadline=None: None  # type: ignore[method-assign]
    rest, head = _common._TAG_GATHER_REST, _common._TAG_GATHER_HEAD
    # (the last rank's piece length, rows of 3 float64, one round on gloo?)
    steps = [
        (5, False),  # the group's first gather: nothing predicted
        (5, True),  # as predicted
        (9, False),  # longer than predicted: its rest follows
        (2, True),  # shorter: what came is all there is
        (0, True),  # an empty piece
        (7, False),
        (300, False),
        (7, True),  # shorter than the 300 predicted
        (300, False),  # 7 predicted: 7, 300, 7 is no pattern yet
        (7, True),  # 7, 300, 7, 300 repeats with period 2: predicted exactly from here on
        (300, True),
        (7, True),
    ]
    kept = []  # every result, checked again at the end: none may share another's memory
    for big, one_round in steps:
        n_of = [big if q == p - 1 else q + 1 for q in range(p)]
        mine = np.arange(n_of[r] * 3, dtype=np.float64).reshape(-1, 3) + 1000 * r
        want = np.concatenate(
            [
                np.arange(n * 3, dtype=np.float64).reshape(-1, 3) + 1000 * q
                for q, n in enumerate(n_of)
            ]
        )
        tags.clear()
        got = hetcoll.allgatherv(mine, counted, timeout=60)
        np.testing.assert_array_equal(got, want)
        kept.append((got, want))
        if speculative:
            # A second round shows on every rank: the longer piece's rank sends its rest,
            # the others receive it.
            assert (rest not in tags) == one_round, (big, tags)
            assert -1 not in tags, tags  # no length exchange of its own
            first = [t for t in tags if t != rest]
            if batched:  # one all-to-all
                assert first == [-2], tags
            else:  # headers, and pieces predicted non-empty, point to point
                assert first and -2 not in first and head in first, tags
        elif shared:  # MPI on one node: every round through shared memory, no message
            assert tags == [], tags
        else:  # MPI across nodes: a length exchange, then MPI_Allgatherv
            assert tags[0] == -1 and len(tags) > 1, tags
    for got, want in kept:
        np.testing.assert_array_equal(got, want)
    if speculative:
        history = counted.gather_history
        assert history is not None and history[-1] == tuple(n * 24 for n in n_of)
    return len(steps)


def check_allgatherv_out(comm: Communicator, native: Any) -> int:
    """``out=``: filled and returned for every algorithm, and when the prediction holds or
    not; a wrong row count raises on every rank in the first round (its rank a ValueError,
    the others the mismatch); local checks raise before it (here on every rank, as every rank
    passes the same bad argument)."""
    p, r = comm.size, comm.rank
    done = 0
    # The prediction held (the repeated shape) and not, with both ways of sending the round.
    shapes = (
        lambda q: q + 1,
        lambda q: p - q,  # the same total: the predicted and the real layout overlap in out
        lambda q: 2 * q + 3,
        lambda q: 2 * q + 3,
        lambda q: q,
    )
    for batched, rows_of in itertools.product((True, False), shapes):
        want = np.concatenate(
            [np.arange(rows_of(q) * 2, dtype=np.float64).reshape(-1, 2) + 10 * q for q in range(p)]
        )
        mine = want[sum(rows_of(q) for q in range(r)) :][: rows_of(r)].copy()
        for algorithm in ("auto", "native", "ring", "direct"):
            out = np.full_like(want, -1.0)
            with _speculative_rounds(batched):
                got = hetcoll.allgatherv(mine, native, out=out, algorithm=algorithm, timeout=60)
            assert got is out
            np.testing.assert_array_equal(out, want)
        done += 1
    t = torch.arange((r + 1) * 3, dtype=torch.float32).to(torch.bfloat16).view(-1, 3) + r
    want_t = torch.cat(
        [
            torch.arange((q + 1) * 3, dtype=torch.float32).to(torch.bfloat16).view(-1, 3) + q
            for q in range(p)
        ]
    )
    out_t = torch.empty_like(want_t)
    assert hetcoll.allgatherv(t, native, out=out_t, timeout=60) is out_t
    assert torch.equal(out_t, want_t)
    done += 1
    # Rank 0's out is one row short: seen in the first round, where every rank learns every
    # rank's rows, so every rank raises (the others were served before, and went on alone).
    mine = np.full((r + 1, 2), float(r))
    rows = p * (p + 1) // 2
    out = np.empty((rows - 1 if r == 0 else rows, 2))
    has = f"has {rows - 1} rows along axis 0, the pieces hold {rows}"
    try:
        hetcoll.allgatherv(mine, native, out=out, timeout=60)
        raise AssertionError("no error for a short out")
    except hetcoll.CollectiveMismatchError as e:
        assert r != 0 and str(e) == f"out: rank 0's {has}", e
    except ValueError as e:
        assert r == 0 and str(e) == f"out: {has}", e
    done += 1
    for bad, error in (
        (np.empty((rows, 2), np.float32), TypeError),  # dtype
        (np.empty((rows, 3)), ValueError),  # trailing shape
        (np.empty((2, rows)).T, ValueError),  # layout
        (torch.empty(rows, 2, dtype=torch.float64), TypeError),  # kind
    ):
        try:
            hetcoll.allgatherv(mine, native, out=bad, timeout=60)
        except error as e:
            assert str(e).startswith("out:"), e
        else:
            raise AssertionError(f"no {error.__name__} for out={bad!r}")
        done += 1
    try:
        hetcoll.allgatherv(mine, native, out=mine, timeout=60)
    except ValueError as e:
        assert str(e).startswith("out:"), e
        done += 1
    return done


def check_alltoallv(comm: Communicator, native: Any) -> int:
    """The Communicator's all-to-all of bytes: rank r sends rank q ``r + 2q`` bytes (none to
    itself when r = q = 0), all equal to ``16 r + q``, and receives in rank order."""
    p, r = comm.size, comm.rank
    send_counts = [r + 2 * q for q in range(p)]
    recv_counts = [q + 2 * r for q in range(p)]
    send = np.concatenate([np.full(n, 16 * r + q, np.uint8) for q, n in enumerate(send_counts)])
    recv = np.full(sum(recv_counts), 255, np.uint8)
    comm.ialltoallv(send, send_counts, recv, recv_counts).wait(time.monotonic() + 60)
    want = np.concatenate([np.full(n, 16 * q + r, np.uint8) for q, n in enumerate(recv_counts)])
    np.testing.assert_array_equal(recv, want)
    return 1


def check_autograd(comm: Communicator, native: Any) -> int:
    p, r = comm.size, comm.rank
    rows = [q % 3 + 1 for q in range(p)]
    total = sum(rows)
    x = torch.randn(rows[r], 4, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
    x.requires_grad_(True)
    y = collectives.allgatherv_autograd(x, native, timeout=60)
    assert tuple(y.shape) == (total, 4)
    coeff = [
        torch.arange(total * 4, dtype=torch.float64).view(total, 4) * (q + 1) for q in range(p)
    ]
    (y * coeff[r]).sum().backward()
    start = sum(rows[:r])
    want = sum(c[start : start + rows[r]] for c in coeff)
    assert x.grad is not None and torch.equal(x.grad, want), (x.grad, want)
    # forward values: every rank's piece
    for q in range(p):
        xq = torch.randn(
            rows[q], 4, dtype=torch.float64, generator=torch.Generator().manual_seed(q)
        )
        assert torch.equal(y[sum(rows[:q]) : sum(rows[: q + 1])].detach(), xq)
    return 1


def run_all(comm_obj: Any) -> dict[str, int]:
    """Every case on this rank; returns how many of each ran."""
    comm = hetcoll.comm.wrap(comm_obj)
    return {
        "allreduce": check_allreduce(comm, comm_obj),
        "auto": check_auto_choice(comm, comm_obj),
        "sweep": check_random_sweep(comm, comm_obj),
        "aliasing": check_aliasing_and_shapes(comm, comm_obj),
        "mismatch": check_mismatch(comm, comm_obj),
        "shared": check_shared(comm, comm_obj),
        "allgatherv": check_allgatherv(comm, comm_obj),
        "speculative": check_speculative_round(comm, comm_obj, batched=True)
        + check_speculative_round(comm, comm_obj, batched=False),
        "allgatherv_out": check_allgatherv_out(comm, comm_obj),
        "alltoallv": check_alltoallv(comm, comm_obj),
        "autograd": check_autograd(comm, comm_obj),
    }


# Groups of 4, 3 and 2 of the 4 launched processes, so one launch covers every size: ranks in
# a group are numbered from 0 in the order listed, unlike their numbers in the world.
GROUPS = {4: [0, 1, 2, 3], 3: [1, 2, 3], 2: [0, 3]}


def run_mpi(world: Any) -> dict[int, dict[str, int]]:
    """Entry point of tests/mpi_workers/collectives.py: every case on every group size."""
    results = {}
    for p, members in GROUPS.items():
        me = world.Get_rank()
        color = 0 if me in members else 1
        sub = world.Split(color, members.index(me) if me in members else me)
        if color == 0:
            results[p] = run_all(sub)
        sub.Free()
        # Ranks outside the group wait here; MPI_Barrier would spin and starve the group's
        # ranks of the 2 cores, so poll a non-blocking barrier with sleeps instead.
        done = world.Ibarrier()
        while not done.Test():
            time.sleep(0.005)
    return results


def run_torch(rank: int, world_size: int) -> dict[int, dict[str, int]]:
    """Entry point for :func:`hetcoll.launch.spawn` (gloo): every case on every group size,
    the whole world as the default group (None), the others as ProcessGroups."""
    import torch.distributed as dist

    results = {}
    for p, members in GROUPS.items():
        group = None if p == world_size else dist.new_group(members)
        if rank in members:
            results[p] = run_all(group)
        dist.barrier()
    return results
