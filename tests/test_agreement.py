"""Disagreeing ranks and one rank's bad argument end in clear errors on every rank, at once
(issue 26): real 2-rank jobs on gloo (torch.multiprocessing) and MPI (mpiexec).

The cases live in tests/agreement_cases.py and run inside the ranks: the findings of issue
26 one by one, then hypothesis-drawn disagreements (length, dtype, algorithm, speeds, a NaN
weight or an integer dtype on one rank) drawn on rank 0 and run by the same two processes, so
a few dozen examples take seconds. A rank left waiting would end in CollectiveTimeout (every
call has a timeout), which no expectation accepts; pytest-timeout bounds the whole job.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import agreement_cases
import numpy as np
import pytest

from hetcoll import launch
from hetcoll.comm import deadline

HERE = Path(__file__).resolve().parent
EXAMPLES = 30

MISMATCH = "CollectiveMismatchError: "
#: Per finding: what rank 0 and rank 1 must raise (a prefix of "Type: message"), or "ok".
EXPECTED = {
    "default_check": (MISMATCH + "ranks disagree on length",) * 2,
    "unchecked": ("ok", "ok"),
    "nan_weight": (
        MISMATCH + "rank 1 raised ValueError: weight: must be finite",
        "ValueError: weight: must be finite",
    ),
    "wrong_dtype": (
        MISMATCH + "rank 1 raised TypeError: buf: dtype int32",
        "TypeError: buf: dtype int32",
    ),
    "timeout_inf": ("ok", "ok"),
    "gather_local": (
        MISMATCH + "rank 1 raised TypeError: local: must be a numpy array or a torch tensor",
        "TypeError: local: must be a numpy array or a torch tensor",
    ),
    "gather_out": (
        MISMATCH + "rank 1 raised TypeError: out:",
        "TypeError: out:",
    ),
    "gather_out_rows": (
        MISMATCH + "out: rank 1's has 3 rows along axis 0, the pieces hold 4",
        "ValueError: out: has 3 rows along axis 0, the pieces hold 4",
    ),
    "gather_algorithm": (
        MISMATCH + "rank 1 raised ValueError: algorithm: must be one of",
        "ValueError: algorithm: must be one of",
    ),
    "gather_segment": (
        MISMATCH + "rank 1 raised ValueError: segment_bytes: must be an integer in [1, 2**62)",
        "ValueError: segment_bytes: must be an integer in [1, 2**62) or None",
    ),
    "gather_meta": (
        MISMATCH + "rank 1 raised ValueError: local: a meta tensor holds no values",
        "ValueError: local: a meta tensor holds no values",
    ),
    "gather_sparse": (
        MISMATCH + "rank 1 raised ValueError: local: must be a dense (strided) tensor",
        "ValueError: local: must be a dense (strided) tensor",
    ),
    "gather_objects": (
        MISMATCH + "rank 1 raised ValueError: local: an array of Python objects",
        "ValueError: local: an array of Python objects",
    ),
    "allreduce_check": (
        MISMATCH + "rank 1 raised TypeError: check: must be True or False",
        "TypeError: check: must be True or False",
    ),
    "allreduce_meta": (
        MISMATCH + "rank 1 raised ValueError: buf: a meta tensor holds no values",
        "ValueError: buf: a meta tensor holds no values",
    ),
    "filter_parallel_speeds": (
        MISMATCH + "rank 1 raised ValueError: speeds: has 3 speeds but the group has 2 ranks",
        "ValueError: speeds: has 3 speeds but the group has 2 ranks",
    ),
    "parallelize_plan": (MISMATCH + "rank 1 raised ValueError: plan", "ValueError: plan"),
    "allreduce_requires_grad": (
        MISMATCH + "rank 1 raised ValueError: buf: requires grad",
        "ValueError: buf: requires grad",
    ),
    "clip_parameters": (
        MISMATCH + "rank 1 raised TypeError: parameters: must be a tensor or tensors",
        "TypeError: parameters: must be a tensor or tensors",
    ),
    "broadcast_root": ("ValueError: root: must be a rank of group, in [0, 2), got 7",) * 2,
    "broadcast_root_local": (
        MISMATCH + "rank 1 raised ValueError: root: must be a rank of group",
        "ValueError: root: must be a rank of group, in [0, 2), got '1'",
    ),
    "broadcast_agree": ("ok", "ok"),
    "gather_after": ("ok", "ok"),
    "optimizer_order": (MISMATCH + "ranks disagree on the parameter shapes",) * 2,
    "optimizer_dtype": (MISMATCH + "ranks disagree on the parameter dtypes",) * 2,
    "optimizer_local": (
        MISMATCH + "rank 1 raised TypeError: optimizer: parameter 0 is torch.float16",
        "TypeError: optimizer: parameter 0 is torch.float16",
    ),
    "optimizer_agree": ("ok", "ok"),
    "optimizer_local_batch": ("ValueError: local_batch: rank 1 counted -3 for this step",) * 2,
    "optimizer_after": ("ok", "ok"),
    "set_shares": (MISMATCH + "ranks disagree on shares[0]",) * 2,
    "set_shares_kept": ("ok", "ok"),
    "set_shares_local": (
        MISMATCH + "rank 1 raised ValueError: shares[1]: must be a positive integer",
        "ValueError: shares[1]: must be a positive integer",
    ),
    "construct_local": (
        MISMATCH + "rank 1 raised ValueError: rank: must be an integer in [0, 2)",
        "ValueError: rank: must be an integer in [0, 2)",
    ),
    "set_shares_agree": ("ok", "ok"),
    "after": ("ok", "ok"),
}
EXPECTED_MPI = {
    **EXPECTED,
    "shared_speeds_check_True": (MISMATCH + "ranks disagree on speeds",) * 2,
    "shared_speeds_check_False": (MISMATCH + "ranks disagree on speeds",) * 2,
    "auto_straddle": (MISMATCH + "ranks disagree on length (rank 0: 4096, rank 1: 1024)",) * 2,
}


def _check(per_rank: list[dict], expected: dict[str, tuple[str, str]]) -> None:
    got = [r["findings"] for r in per_rank]
    assert sorted(got[0]) == sorted(got[1]) == sorted(expected)
    for name, want in expected.items():
        for r in range(2):
            assert got[r][name].startswith(want[r]), (name, r, got[r][name])
    assert [r["fuzzed"] for r in per_rank] == [EXAMPLES, EXAMPLES]


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_gloo_ranks_that_disagree_all_raise():
    per_rank = launch.spawn(agreement_cases.run_torch, 2, EXAMPLES, timeout=180)
    _check(per_rank, EXPECTED)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_mpi_ranks_that_disagree_all_raise():
    worker = str(HERE / "mpi_workers" / "agreement.py")
    proc = launch.mpiexec(2, [worker, str(EXAMPLES)], timeout=180)
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("[")]
    _check(json.loads(line), EXPECTED_MPI)


def test_expected_outcomes_of_drawn_cases():
    """The oracle of the hypothesis cases: agreeing ranks get the weighted sum; a differing
    field fails everywhere; a rank's own bad argument is its own error, the others' mismatch."""
    base = {"length": 3, "dtype": "float32", "algorithm": "ring", "speeds": None}
    agreeing = [dict(base, weight=0.5), dict(base, weight=2.0)]
    assert agreement_cases.expected(agreeing) == 0.5 * 1 + 2.0 * 2
    assert agreement_cases.expected([agreeing[0], dict(agreeing[1], length=4)]) == (
        "CollectiveMismatchError",
        "CollectiveMismatchError",
    )
    assert agreement_cases.expected([agreeing[0], dict(agreeing[1], weight=np.nan)]) == (
        "CollectiveMismatchError",
        "ValueError",
    )


def test_timeout_inf_is_no_limit_and_bad_timeouts_name_the_argument():
    assert deadline(float("inf")) is None
    assert deadline(None) is None
    assert deadline(5.0) > time.monotonic()
    for bad in (0, -1.0, float("nan"), "5", True):
        with pytest.raises(ValueError, match="timeout"):
            deadline(bad)


def test_agreement_helpers_name_what_is_no_communicator():
    """None where a Communicator belongs once raised AttributeError ('.size', '.native',
    '.Get_rank'); rows of the wrong shape an IndexError."""
    from hetcoll import comm

    for call, text in (
        (lambda: comm.agree(None, {}), r"^comm: must be a hetcoll.comm.Communicator"),
        (lambda: comm.start_agreement(3, {}), r"^comm: must be a hetcoll.comm.Communicator"),
        (lambda: comm.same_processes(None, None), r"^a: must be a hetcoll.comm.Communicator"),
        (lambda: comm.MpiCommunicator(None), r"^comm: must be an mpi4py communicator"),
    ):
        with pytest.raises(TypeError, match=text):
            call()
    with pytest.raises(ValueError, match=r"^rows: must be one row per rank of 2 values"):
        comm.same_rows(["a", "b"], [[1], [1]])
    comm.same_rows(["a"], [[1], [1]])  # the same on every rank: no error


def test_fingerprint_is_what_agree_compares() -> None:
    """The fields' digest that agree's first round carries (and a data-parallel step's sum
    carries in each rank's slot): 63 bits, the same for the same names and values in the same
    order, another for another value, name or order; a bad value is refused by name."""
    from hetcoll.comm import fingerprint

    fields = {"rows": 14, "mode": 1, "scale": -3}
    got = fingerprint(fields)
    assert 0 <= got < 2**63 and got == fingerprint(dict(fields))
    others = [
        {"rows": 13, "mode": 1, "scale": -3},
        {"rowz": 14, "mode": 1, "scale": -3},
        {"mode": 1, "rows": 14, "scale": -3},
        {"rows": 14, "mode": 1},
    ]
    assert len({got, *(fingerprint(f) for f in others)}) == 1 + len(others)
    with pytest.raises(TypeError, match=r"fields\['mode'\]: must be an integer"):
        fingerprint({"rows": 14, "mode": "train"})
