"""The collectives' tuning table: every crossover size between algorithms and every segment size.

The algorithms read these at call time, as attributes of this module (``_tuning.NAME``, never
a copy taken at import), so rebinding one here takes effect on the next call::

    from hetcoll.collectives import _tuning
    _tuning.SEGMENT_BYTES = 4 << 20

``hetcoll.collectives.NAME`` reads the same value, and assigning to it rebinds it here. The
per-engine tables map :attr:`hetcoll.comm.Communicator.engine` to bytes; an engine missing from
one never takes that branch. What each value is, and the measurements it comes from, are in
docs/collectives.md, "Tuning table" (one heading per constant, linked below).
"""

from __future__ import annotations

# allreduce "ring"
#: Ring segment size in bytes. docs/collectives.md#segment_bytes
SEGMENT_BYTES = 1 << 20
#: The ring's segment on two ranks of these engines. docs/collectives.md#two_rank_segment_bytes
TWO_RANK_SEGMENT_BYTES: dict[str, int] = {"mpi": 16 << 20}

# allreduce "auto" (choose_algorithm)
#: "auto" takes the ring from this size (p > 2). docs/collectives.md#ring_crossover_bytes
RING_CROSSOVER_BYTES: dict[str, float] = {"mpi": 4 << 20, "gloo": 64 << 20}
#: "auto" takes the ring from this size (p = 2). docs/collectives.md#ring_two_ranks_from_bytes
RING_TWO_RANKS_FROM_BYTES: dict[str, float] = {"mpi": 1 << 20, "gloo": 16 << 20}
#: "auto" takes "direct" while (p - 1) * bytes <= this (p > 2). docs/collectives.md#direct_bytes
DIRECT_BYTES: dict[str, float] = {"mpi": 0, "gloo": 3 << 20}
#: "auto" takes "direct" from this size (p = 2). docs/collectives.md#direct_two_ranks_from_bytes
DIRECT_TWO_RANKS_FROM_BYTES: dict[str, float] = {"gloo": 4 << 20}
#: "auto" takes "shared" from this size on one node. docs/collectives.md#shared_from_bytes
SHARED_FROM_BYTES: dict[str, float] = {"mpi": 16 << 10}

# allreduce's agreement check (check=True)
#: The agreement's allgather carries this many bytes in all, over the ranks (at least a word a
#: rank); "auto" reduces a buffer that fits in it there, in that one exchange.
#: docs/collectives.md#check_inline_bytes
CHECK_INLINE_BYTES = 4 << 10

# allreduce "native"
#: "native" goes in two halves from this size. docs/collectives.md#native_halves_from_bytes
NATIVE_HALVES_FROM_BYTES: dict[str, float] = {"gloo": 16 << 20}
#: The same on two ranks. docs/collectives.md#native_halves_two_ranks_from_bytes
NATIVE_HALVES_TWO_RANKS_FROM_BYTES: dict[str, float] = {"gloo": 8 << 20}

# "shared" (MPI, one node)
#: Bytes per rank per node window: the piece size. docs/collectives.md#shared_segment_bytes
SHARED_SEGMENT_BYTES = 1 << 20
#: One round per piece while p * piece bytes <= this. docs/collectives.md#shared_one_round_bytes
SHARED_ONE_ROUND_BYTES = 1 << 20
#: allgatherv "auto": windows below this total. docs/collectives.md#shared_gather_below_bytes
SHARED_GATHER_BELOW_BYTES: dict[str, float] = {"mpi": 64 << 20}

# allgatherv
#: allgatherv "auto": the ring from this total. docs/collectives.md#gather_ring_crossover_bytes
GATHER_RING_CROSSOVER_BYTES: dict[str, float] = {"mpi": 1 << 20}
#: Engines whose first round is speculative. docs/collectives.md#speculative_gather_engines
SPECULATIVE_GATHER_ENGINES = ("gloo",)
#: Longest repeating pattern of gathers predicted. docs/collectives.md#gather_periods
GATHER_PERIODS = 16
#: A speculative round up to this is one all-to-all. docs/collectives.md#batched_gather_bytes
BATCHED_GATHER_BYTES = 4 << 20
