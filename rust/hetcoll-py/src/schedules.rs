//! Bindings of `hetcoll_core::schedules`.

use hetcoll_core::schedules::ring::{self, Phase};
use pyo3::prelude::*;

use crate::convert::{count, counts as count_list};
use crate::errors::{invalid, IntoPy};

/// One ring step: (reduce?, segments sent, segments received), element ranges `[lo, hi)`.
type PyStep = (bool, Vec<(usize, usize)>, Vec<(usize, usize)>);

/// The `2 (p - 1)` steps of the ring allreduce for `rank` over chunks of `counts[c]` elements,
/// each chunk cut into segments of at most `segment` elements.
#[pyfunction]
#[pyo3(signature = (counts, rank, segment))]
pub fn ring_schedule(
    counts: &Bound<'_, PyAny>,
    rank: &Bound<'_, PyAny>,
    segment: &Bound<'_, PyAny>,
) -> PyResult<Vec<PyStep>> {
    let c = count_list(counts, "counts")?;
    let rank = usize::try_from(count(rank, "rank")?).map_err(|_| invalid("rank", "too large"))?;
    let segment =
        usize::try_from(count(segment, "segment")?).map_err(|_| invalid("segment", "too large"))?;
    let steps = ring::ring_allreduce(&c, rank, segment).py_err()?;
    Ok(steps
        .into_iter()
        .map(|s| (s.phase == Phase::ReduceScatter, s.send, s.recv))
        .collect())
}
