//! Bindings of `hetcoll_core::solvers`.

use hetcoll_core::solvers::{self, SplitOptions};
use pyo3::prelude::*;

use crate::convert::{count, counts, floats};
use crate::errors::{detached, IntoPy};

/// Integer shares with sum `total` that minimise `max_i (latency_i + shares_i / speeds_i)`.
#[pyfunction]
#[pyo3(
    signature = (total, speeds, *, latency=None, capacity=None, multiple_of=None, minimum=None),
    text_signature = "(total, speeds, *, latency=None, capacity=None, multiple_of=1, minimum=0)"
)]
pub fn split(
    py: Python<'_>,
    total: &Bound<'_, PyAny>,
    speeds: &Bound<'_, PyAny>,
    latency: Option<&Bound<'_, PyAny>>,
    capacity: Option<&Bound<'_, PyAny>>,
    multiple_of: Option<&Bound<'_, PyAny>>,
    minimum: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<u64>> {
    let total = count(total, "total")?;
    let speeds = floats(speeds, "speeds")?;
    let latency = latency.map(|x| floats(x, "latency")).transpose()?;
    let capacity = capacity.map(|x| counts(x, "capacity")).transpose()?;
    let multiple_of = multiple_of.map_or(Ok(1), |x| count(x, "multiple_of"))?;
    let minimum = minimum.map_or(Ok(0), |x| count(x, "minimum"))?;
    let options = SplitOptions {
        latency: latency.as_deref(),
        capacity: capacity.as_deref(),
        multiple_of,
        minimum,
    };
    detached(py, || solvers::split(total, &speeds, &options))?.py_err()
}

/// Seconds each rank finishes at with these shares: `latency_i + shares_i / speeds_i`.
#[pyfunction]
#[pyo3(signature = (shares, speeds, *, latency=None))]
pub fn finish_times(
    shares: &Bound<'_, PyAny>,
    speeds: &Bound<'_, PyAny>,
    latency: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<f64>> {
    let shares = counts(shares, "shares")?;
    let speeds = floats(speeds, "speeds")?;
    let latency = latency.map(|x| floats(x, "latency")).transpose()?;
    solvers::finish_times(&shares, &speeds, latency.as_deref()).py_err()
}
