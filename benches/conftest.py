"""Benchmark plumbing: every benchmark records its median under a group, and the session ends
with one table per group giving each entry's ratio against the group's named peer, all measured
in the same run. `make bench` runs them; README tables are copied from this output."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@dataclass
class Entry:
    median_s: float
    bytes_moved: float | None
    note: str


_RESULTS: dict[str, dict[str, Entry]] = defaultdict(dict)
_PEERS: dict[str, str] = {}


@pytest.fixture
def record():
    """record(benchmark, group, name, *, peer=False, bytes_moved=None, note="") after a run."""

    def _record(benchmark, group, name, *, peer=False, bytes_moved=None, note=""):
        median = benchmark.stats.stats.median
        _RESULTS[group][name] = Entry(median, bytes_moved, note)
        if peer:
            _PEERS[group] = name

    return _record


def pytest_terminal_summary(terminalreporter):
    if not _RESULTS:
        return
    tr = terminalreporter
    for group, entries in _RESULTS.items():
        peer = _PEERS.get(group)
        tr.write_sep("-", f"{group} (ratios: peer time / entry time; >1 means faster than peer)")
        tr.write_line(f"{'entry':<44} {'median':>11} {'GB/s':>8} {'vs ' + (peer or '-'):>24}")
        for name, e in entries.items():
            gbs = f"{e.bytes_moved / e.median_s / 1e9:8.2f}" if e.bytes_moved else f"{'':>8}"
            ratio = (
                f"{entries[peer].median_s / e.median_s:23.2f}x" if peer in entries else f"{'':>24}"
            )
            tr.write_line(f"{name:<44} {e.median_s * 1e3:9.3f}ms {gbs} {ratio} {e.note}")
