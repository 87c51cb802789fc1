//! Bindings of the partitioners: `hetcoll_core::solvers::{chain, hypergraph}`.

use hetcoll_core::solvers::{self, Hypergraph, PartitionOptions};
use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyString};

use crate::convert::{count, floats};
use crate::errors::{detached, interruptible, invalid, IntoPy};

/// Layers per device of contiguous pipeline stages with the smallest bottleneck stage time (whose
/// layers fit each device's `capacity` when `memory` is given).
#[pyfunction]
#[pyo3(signature = (costs, speeds, *, boundary_bytes=None, bandwidth=None, memory=None, capacity=None))]
#[allow(clippy::too_many_arguments)]
pub fn partition_chain(
    py: Python<'_>,
    costs: &Bound<'_, PyAny>,
    speeds: &Bound<'_, PyAny>,
    boundary_bytes: Option<&Bound<'_, PyAny>>,
    bandwidth: Option<&Bound<'_, PyAny>>,
    memory: Option<&Bound<'_, PyAny>>,
    capacity: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<u64>> {
    let costs = floats(costs, "costs")?;
    let speeds = floats(speeds, "speeds")?;
    let boundary_bytes = boundary_bytes
        .map(|x| floats(x, "boundary_bytes"))
        .transpose()?;
    let bandwidth = bandwidth.map(|x| number(x, "bandwidth")).transpose()?;
    let limits = memory_limits(memory, capacity, "memory")?;
    detached(py, || {
        let limits = limits
            .as_ref()
            .map(|(memory, capacity)| solvers::ChainMemory { memory, capacity });
        solvers::partition_chain_within(
            &costs,
            &speeds,
            boundary_bytes.as_deref(),
            bandwidth,
            limits,
        )
    })?
    .py_err()
}

/// Per-item memory (argument `memory_name`) and per-device `capacity`: both or neither.
fn memory_limits(
    memory: Option<&Bound<'_, PyAny>>,
    capacity: Option<&Bound<'_, PyAny>>,
    memory_name: &str,
) -> PyResult<Option<(Vec<f64>, Vec<f64>)>> {
    match (memory, capacity) {
        (None, None) => Ok(None),
        (Some(_), None) => Err(invalid(
            "capacity",
            format!("is required (one entry per device) when {memory_name} is given"),
        )),
        (None, Some(_)) => Err(invalid(memory_name, "is required when capacity is given")),
        (Some(m), Some(c)) => Ok(Some((floats(m, memory_name)?, floats(c, "capacity")?))),
    }
}

/// Seconds of each pipeline stage for given layers per device (the model `partition_chain` uses).
#[pyfunction]
#[pyo3(signature = (costs, speeds, layers, *, boundary_bytes=None, bandwidth=None))]
pub fn chain_stage_times(
    costs: &Bound<'_, PyAny>,
    speeds: &Bound<'_, PyAny>,
    layers: &Bound<'_, PyAny>,
    boundary_bytes: Option<&Bound<'_, PyAny>>,
    bandwidth: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<f64>> {
    let costs = floats(costs, "costs")?;
    let speeds = floats(speeds, "speeds")?;
    let layers = crate::convert::counts(layers, "layers")?;
    let boundary_bytes = boundary_bytes
        .map(|x| floats(x, "boundary_bytes"))
        .transpose()?;
    let bandwidth = bandwidth.map(|x| number(x, "bandwidth")).transpose()?;
    solvers::stage_times(
        &costs,
        &speeds,
        &layers,
        boundary_bytes.as_deref(),
        bandwidth,
    )
    .py_err()
}

/// Block of each vertex of a multilevel k-way partition with heterogeneous targets (km1 objective).
#[pyfunction]
#[pyo3(
    signature = (num_vertices, nets, targets, *, vertex_weights=None, net_weights=None, epsilon=None, seed=None, vertex_memory=None, capacity=None),
    text_signature = "(num_vertices, nets, targets, *, vertex_weights=None, net_weights=None, epsilon=0.03, seed=0, vertex_memory=None, capacity=None)"
)]
#[allow(clippy::too_many_arguments)]
pub fn partition_hypergraph<'py>(
    py: Python<'py>,
    num_vertices: &Bound<'py, PyAny>,
    nets: &Bound<'py, PyAny>,
    targets: &Bound<'py, PyAny>,
    vertex_weights: Option<&Bound<'py, PyAny>>,
    net_weights: Option<&Bound<'py, PyAny>>,
    epsilon: Option<&Bound<'py, PyAny>>,
    seed: Option<&Bound<'py, PyAny>>,
    vertex_memory: Option<&Bound<'py, PyAny>>,
    capacity: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let num_vertices = count(num_vertices, "num_vertices")?;
    let num_vertices = usize::try_from(num_vertices)
        .ok()
        .filter(|&n| n < u32::MAX as usize)
        .ok_or_else(|| invalid("num_vertices", "must be < 2**32"))?;
    let (offsets, pins) = compressed_nets(nets, u64::from(u32::MAX))?;
    let targets = floats(targets, "targets")?;
    let vertex_weights = vertex_weights
        .map(|x| floats(x, "vertex_weights"))
        .transpose()?;
    let net_weights = net_weights.map(|x| floats(x, "net_weights")).transpose()?;
    let epsilon = epsilon.map_or(Ok(0.03), |x| number(x, "epsilon"))?;
    let seed = seed.map_or(Ok(0), |x| count(x, "seed"))?;
    let limits = memory_limits(vertex_memory, capacity, "vertex_memory")?;
    let parts = interruptible(py, move || -> hetcoll_core::Result<Vec<u32>> {
        let mut hg = Hypergraph::new(num_vertices, offsets, pins, vertex_weights, net_weights)?;
        let mut options = PartitionOptions::new(targets);
        options.epsilon = epsilon;
        options.seed = seed;
        if let Some((memory, capacity)) = limits {
            hg = hg.with_vertex_memory(memory)?;
            options.capacity = Some(capacity);
        }
        solvers::partition_hypergraph(&hg, &options)
    })?
    .py_err()?;
    let parts: Vec<i64> = parts.into_iter().map(i64::from).collect();
    Ok(PyArray1::from_vec(py, parts))
}

/// `Σ_e w(e) · (λ(e) − 1)`: connectivity minus one of `parts` over `nets`.
#[pyfunction]
#[pyo3(signature = (nets, parts, net_weights=None))]
pub fn km1(
    py: Python<'_>,
    nets: &Bound<'_, PyAny>,
    parts: &Bound<'_, PyAny>,
    net_weights: Option<&Bound<'_, PyAny>>,
) -> PyResult<f64> {
    let parts = block_ids(parts)?;
    let (offsets, pins) = compressed_nets(nets, u64::from(u32::MAX))?;
    let net_weights = net_weights.map(|x| floats(x, "net_weights")).transpose()?;
    detached(py, || {
        solvers::km1(&offsets, &pins, &parts, net_weights.as_deref())
    })?
    .py_err()
}

/// A float argument (Python `float`, `int`, numpy scalar), not `bool` or `str`.
fn number(obj: &Bound<'_, PyAny>, argument: &str) -> PyResult<f64> {
    if obj.is_instance_of::<PyBool>() || obj.is_instance_of::<PyString>() {
        return Err(invalid(argument, "must be a number"));
    }
    obj.extract::<f64>()
        .map_err(|_| invalid(argument, "must be a number"))
}

/// Block ids, one per vertex: a numpy integer array (fast path) or any sequence of integers.
fn block_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    // Fast path for aligned arrays only: a misaligned view is read element by element below.
    if let Some(arr) = obj.cast::<PyArray1<i64>>().ok().filter(|a| a.is_aligned()) {
        let ro = arr.try_readonly().map_err(|e| invalid("parts", e))?;
        let slice = ro
            .as_slice()
            .map_err(|_| invalid("parts", "must be contiguous"))?;
        return slice
            .iter()
            .enumerate()
            .map(|(i, &b)| {
                u32::try_from(b).map_err(|_| invalid(&format!("parts[{i}]"), "must be in 0..2**32"))
            })
            .collect();
    }
    let list = crate::convert::counts(obj, "parts")?;
    list.into_iter()
        .enumerate()
        .map(|(i, b)| {
            u32::try_from(b).map_err(|_| invalid(&format!("parts[{i}]"), "must be < 2**32"))
        })
        .collect()
}

/// Nets (a sequence of sequences of vertex ids; numpy integer arrays take a fast path) in
/// compressed form. Range, emptiness and duplicates are checked by the core.
fn compressed_nets(nets: &Bound<'_, PyAny>, limit: u64) -> PyResult<(Vec<usize>, Vec<u32>)> {
    if nets.is_instance_of::<PyString>() {
        return Err(invalid(
            "nets",
            "must be a sequence of sequences of vertex ids",
        ));
    }
    let iter = nets
        .try_iter()
        .map_err(|_| invalid("nets", "must be a sequence of sequences of vertex ids"))?;
    let mut offsets = vec![0usize];
    let mut pins: Vec<u32> = Vec::new();
    for (e, net) in iter.enumerate() {
        let net = net?;
        let name = || format!("nets[{e}]");
        let mut push = |v: i64| -> PyResult<()> {
            if v < 0 || v as u64 >= limit {
                return Err(invalid(&name(), format!("vertex id {v} out of range")));
            }
            pins.push(v as u32);
            Ok(())
        };
        // Fast path for aligned arrays only (Rust reads them as slices).
        if let Some(arr) = net.cast::<PyArray1<i64>>().ok().filter(|a| a.is_aligned()) {
            let ro = arr.try_readonly().map_err(|e| invalid(&name(), e))?;
            for &v in ro.as_array().iter() {
                push(v)?;
            }
            offsets.push(pins.len());
            continue;
        }
        if net.is_instance_of::<PyString>() {
            return Err(invalid(&name(), "must be a sequence of vertex ids"));
        }
        let items = net
            .try_iter()
            .map_err(|_| invalid(&name(), "must be a sequence of vertex ids"))?;
        for item in items {
            let item = item?;
            if item.is_instance_of::<PyBool>() || item.is_instance_of::<PyFloat>() {
                return Err(invalid(&name(), "vertex ids must be integers"));
            }
            let v: i64 = item
                .extract()
                .map_err(|_| invalid(&name(), "vertex ids must be integers"))?;
            push(v)?;
        }
        offsets.push(pins.len());
    }
    Ok((offsets, pins))
}

/// Each item's device, any items on any device, smallest bottleneck `max_d load_d / speeds[d]`
/// (`hetcoll_core::solvers::assign_items_near`: branch and bound, exact within `max_nodes`, or
/// within `gap` of the optimum).
#[pyfunction]
#[pyo3(
    signature = (loads, speeds, *, capacity=None, max_nodes=None, gap=None),
    text_signature = "(loads, speeds, *, capacity=None, max_nodes=None, gap=0.0)"
)]
pub fn partition_items(
    py: Python<'_>,
    loads: &Bound<'_, PyAny>,
    speeds: &Bound<'_, PyAny>,
    capacity: Option<&Bound<'_, PyAny>>,
    max_nodes: Option<&Bound<'_, PyAny>>,
    gap: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Vec<usize>, bool)> {
    let loads = floats(loads, "loads")?;
    let speeds = floats(speeds, "speeds")?;
    let capacity = capacity
        .map(|c| crate::convert::counts(c, "capacity"))
        .transpose()?;
    let max_nodes = match max_nodes {
        Some(x) => count(x, "max_nodes")?,
        None => 200_000,
    };
    if max_nodes == 0 {
        return Err(invalid("max_nodes", "must be >= 1, got 0"));
    }
    let gap = gap.map_or(Ok(0.0), |x| number(x, "gap"))?;
    // A large budget on many items may search long: Ctrl-C ends the wait at once.
    let a = interruptible(py, move || {
        solvers::assign_items_near(&loads, &speeds, capacity.as_deref(), max_nodes, gap)
    })?
    .py_err()?;
    Ok((a.owner, a.exact))
}

/// `owner` (each item's device) improved by single moves and swaps off the slowest device, few
/// items moving (`hetcoll_core::solvers::refine_assignment`).
#[pyfunction]
#[pyo3(signature = (loads, speeds, owner, *, capacity=None))]
pub fn refine_items(
    py: Python<'_>,
    loads: &Bound<'_, PyAny>,
    speeds: &Bound<'_, PyAny>,
    owner: &Bound<'_, PyAny>,
    capacity: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<usize>> {
    let loads = floats(loads, "loads")?;
    let speeds = floats(speeds, "speeds")?;
    let owner: Vec<usize> = crate::convert::counts(owner, "owner")?
        .into_iter()
        .map(|d| usize::try_from(d).unwrap_or(usize::MAX))
        .collect();
    let capacity = capacity
        .map(|c| crate::convert::counts(c, "capacity"))
        .transpose()?;
    detached(py, move || {
        solvers::refine_assignment(&loads, &speeds, &owner, capacity.as_deref())
    })?
    .py_err()
}
