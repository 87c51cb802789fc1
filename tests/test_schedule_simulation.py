"""``terms.schedule_finish_seconds`` runs each device until it waits and again once what it
waits for is there; it used to pass over every device, round after round, until none moved.
Every time in a step is a function of its dependencies alone, so both must give the same
floats, bit for bit, and stop at the same deadlock: checked on random programs of sends,
receives, collectives and compute against that round-robin simulation, kept here."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from hetcoll.model import terms


def _round_robin(
    programs: list[list[tuple[Any, ...]]], collectives: dict[object, tuple[int, float]]
) -> tuple[list[float], list[float]]:
    """The simulation as it was: every device in turn, until a round moves none."""
    n = len(programs)
    now, pc = [0.0] * n, [0] * n
    link_free, sent_until, in_collectives = [0.0] * n, [0.0] * n, [0.0] * n
    pending: list[object] = [None] * n
    arrival: dict[object, float] = {}
    joined: dict[object, tuple[int, float]] = {}
    ends: dict[object, float] = {}
    left = sum(len(p) for p in programs)
    while left:
        moved = 0
        for d in range(n):
            prog, i, t = programs[d], pc[d], now[d]
            while i < len(prog):
                op = prog[i]
                kind = op[0]
                if kind == "compute":
                    t += op[1]
                elif kind == "send":
                    link_free[d] = terms.post_sends(t, op[1], link_free[d], arrival)
                    sent_until[d] = max([sent_until[d], *(arrival[m] for m, _, _ in op[1])])
                elif kind == "recv":
                    at = arrival.get(op[1])
                    if at is None:
                        break
                    t = max(t, at)
                elif kind == "collective":
                    key = op[1]
                    end = ends.get(key)
                    if end is None:
                        need, seconds = collectives[key]
                        if pending[d] != key:
                            pending[d] = key
                            count, latest = joined.get(key, (0, 0.0))
                            joined[key] = (count + 1, max(latest, t))
                        count, latest = joined[key]
                        if count < need:
                            break
                        end = ends[key] = latest + seconds
                    pending[d] = None
                    in_collectives[d] += collectives[key][1]
                    t = end
                elif kind == "wait_sends":
                    t = max(t, sent_until[d])
                else:
                    raise ValueError(f"programs: unknown operation {kind!r}")
                i += 1
            moved += i - pc[d]
            pc[d], now[d] = i, t
        if not moved:
            stuck = [
                f"device {d}: {programs[d][pc[d]]!r}" for d in range(n) if pc[d] < len(programs[d])
            ]
            raise ValueError("programs: deadlock; waiting: " + "; ".join(stuck[:4]))
        left -= moved
    return now, in_collectives


seconds = st.one_of(st.just(0.0), st.floats(1e-6, 5.0, allow_nan=False, allow_infinity=False))


@st.composite
def steps(draw: Any) -> tuple[list[list[tuple[Any, ...]]], dict[object, tuple[int, float]]]:
    """Programs of 1-6 devices: compute pieces, messages (each sent once, by one device, in a
    send of one to three, and received by another), collectives (reached once by each of their
    participants), ``wait_sends``, at random places in each program: some deadlock."""
    n = draw(st.integers(1, 6))
    programs: list[list[tuple[Any, ...]]] = [[] for _ in range(n)]

    def put(d: int, op: tuple[Any, ...]) -> None:
        programs[d].insert(draw(st.integers(0, len(programs[d]))), op)

    collectives: dict[object, tuple[int, float]] = {}
    for e in range(draw(st.integers(0, 30))):
        what = draw(st.sampled_from(["compute", "send", "collective", "wait_sends"]))
        d = draw(st.integers(0, n - 1))
        if what == "compute":
            put(d, ("compute", draw(seconds)))
        elif what == "wait_sends":
            put(d, ("wait_sends",))
        elif what == "send" and n > 1:
            sends = []
            for k in range(draw(st.integers(1, 3))):
                to = draw(st.integers(0, n - 2))
                to += to >= d
                message = ("m", e, k)
                sends.append((message, draw(seconds), draw(seconds)))
                put(to, ("recv", message))
            put(d, ("send", tuple(sends)))
        elif what == "collective":
            members = draw(st.sets(st.integers(0, n - 1), min_size=1))
            collectives[("c", e)] = (len(members), draw(seconds))
            for x in members:
                put(x, ("collective", ("c", e)))
    return programs, collectives


@settings(max_examples=400, deadline=None)
@given(steps())
def test_the_waiting_simulation_matches_the_round_robin_one(
    step: tuple[list[list[tuple[Any, ...]]], dict[object, tuple[int, float]]],
) -> None:
    programs, collectives = step
    try:
        want: Any = _round_robin(programs, collectives)
    except ValueError as e:
        want = str(e)
    try:
        got: Any = terms.schedule_finish_seconds(programs, collectives)
    except ValueError as e:
        got = str(e)
    assert got == want  # floats compared exactly
