//! `hetcoll._core`: the PyO3 face of `hetcoll-core`. This crate only converts arguments, releases
//! the GIL around work and maps errors (all in `errors`); the algorithms live in the core crate.

use pyo3::prelude::*;

mod buffers;
mod convert;
mod errors;
mod fusion;
mod kernels;
mod partition;
mod schedules;
mod solvers;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(solvers::split, m)?)?;
    m.add_function(wrap_pyfunction!(solvers::finish_times, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::weighted_sum_into, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(fusion::pack_into, m)?)?;
    m.add_function(wrap_pyfunction!(fusion::unpack_from, m)?)?;
    m.add_function(wrap_pyfunction!(schedules::ring_schedule, m)?)?;
    m.add_function(wrap_pyfunction!(partition::partition_chain, m)?)?;
    m.add_function(wrap_pyfunction!(partition::chain_stage_times, m)?)?;
    m.add_function(wrap_pyfunction!(partition::partition_items, m)?)?;
    m.add_function(wrap_pyfunction!(partition::refine_items, m)?)?;
    m.add_function(wrap_pyfunction!(partition::partition_hypergraph, m)?)?;
    m.add_function(wrap_pyfunction!(partition::km1, m)?)?;
    Ok(())
}
