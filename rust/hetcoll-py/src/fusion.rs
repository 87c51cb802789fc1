//! Bindings of `hetcoll_core::kernels::{pack, unpack}`: numpy buffers in, no copies, GIL released.

use hetcoll_core::kernels::{self, Element};
use numpy::{BorrowError, PyArrayMethods, PyReadonlyArrayDyn, PyReadwriteArrayDyn};
use pyo3::prelude::*;

use crate::buffers::{check_disjoint, kind, typed, with_kind, Span};
use crate::errors::{detached, invalid, IntoPy};

/// `out = scale · concat(arrays)`; `arrays` are C-contiguous numpy arrays of any shape and
/// `out`'s dtype, `out` holds exactly their total element count.
#[pyfunction]
#[pyo3(signature = (arrays, out, *, scale=1.0, bfloat16=false))]
pub fn pack_into(
    py: Python<'_>,
    arrays: Vec<Bound<'_, PyAny>>,
    out: &Bound<'_, PyAny>,
    scale: f64,
    bfloat16: bool,
) -> PyResult<()> {
    with_kind!(
        kind(py, out, "out", bfloat16)?,
        pack_as(py, &arrays, out, scale)
    )
}

/// `arrays[i] = scale · flat[o_i : o_i + arrays[i].size]`, in place.
#[pyfunction]
#[pyo3(signature = (flat, arrays, *, scale=1.0, bfloat16=false))]
pub fn unpack_from(
    py: Python<'_>,
    flat: &Bound<'_, PyAny>,
    arrays: Vec<Bound<'_, PyAny>>,
    scale: f64,
    bfloat16: bool,
) -> PyResult<()> {
    with_kind!(
        kind(py, flat, "flat", bfloat16)?,
        unpack_as(py, flat, &arrays, scale)
    )
}

fn pack_as<N, T>(
    py: Python<'_>,
    arrays: &[Bound<'_, PyAny>],
    out: &Bound<'_, PyAny>,
    scale: f64,
    view: fn(&[N]) -> &[T],
    view_mut: fn(&mut [N]) -> &mut [T],
) -> PyResult<()>
where
    N: numpy::Element,
    T: Element,
{
    let want = format!("out's dtype {}", T::NAME);
    let out = typed::<N>(out, "out", &want)?;
    let mut spans = vec![Span::of(out, true, "out".into())];
    let mut typed_arrays = Vec::with_capacity(arrays.len());
    for (i, a) in arrays.iter().enumerate() {
        let name = format!("arrays[{i}]");
        let a = typed::<N>(a, &name, &want)?;
        spans.push(Span::of(a, false, name));
        typed_arrays.push(a);
    }
    check_disjoint(spans)?;
    let mut out_rw = out.try_readwrite().map_err(|e| invalid("out", e))?;
    let mut guards: Vec<PyReadonlyArrayDyn<'_, N>> = Vec::with_capacity(arrays.len());
    for (i, a) in typed_arrays.into_iter().enumerate() {
        let name = format!("arrays[{i}]");
        let ro = a
            .try_readonly()
            .map_err(|_| invalid(&name, "overlaps out"))?;
        guards.push(ro);
    }
    let sources = guards
        .iter()
        .enumerate()
        .map(|(i, g)| {
            g.as_slice()
                .map(view)
                .map_err(|e| invalid(&format!("arrays[{i}]"), e))
        })
        .collect::<PyResult<Vec<&[T]>>>()?;
    let out_slice = view_mut(out_rw.as_slice_mut().map_err(|e| invalid("out", e))?);
    let threads = kernels::default_threads().py_err()?;
    detached(py, || kernels::pack(&sources, scale, out_slice, threads))?.py_err()
}

fn unpack_as<N, T>(
    py: Python<'_>,
    flat: &Bound<'_, PyAny>,
    arrays: &[Bound<'_, PyAny>],
    scale: f64,
    view: fn(&[N]) -> &[T],
    view_mut: fn(&mut [N]) -> &mut [T],
) -> PyResult<()>
where
    N: numpy::Element,
    T: Element,
{
    let want = format!("flat's dtype {}", T::NAME);
    let flat = typed::<N>(flat, "flat", &want)?;
    let mut spans = vec![Span::of(flat, false, "flat".into())];
    let mut typed_arrays = Vec::with_capacity(arrays.len());
    for (i, a) in arrays.iter().enumerate() {
        let name = format!("arrays[{i}]");
        let a = typed::<N>(a, &name, &want)?;
        spans.push(Span::of(a, true, name));
        typed_arrays.push(a);
    }
    check_disjoint(spans)?;
    let flat_ro = flat.try_readonly().map_err(|e| invalid("flat", e))?;
    let mut guards: Vec<PyReadwriteArrayDyn<'_, N>> = Vec::with_capacity(arrays.len());
    for (i, a) in typed_arrays.into_iter().enumerate() {
        let name = format!("arrays[{i}]");
        let rw = a.try_readwrite().map_err(|e| match e {
            BorrowError::NotWriteable => invalid(&name, "is read-only; unpack writes into it"),
            _ => invalid(&name, "overlaps flat or another of arrays"),
        })?;
        guards.push(rw);
    }
    let src = view(flat_ro.as_slice().map_err(|e| invalid("flat", e))?);
    let mut dests = guards
        .iter_mut()
        .enumerate()
        .map(|(i, g)| {
            g.as_slice_mut()
                .map(view_mut)
                .map_err(|e| invalid(&format!("arrays[{i}]"), e))
        })
        .collect::<PyResult<Vec<&mut [T]>>>()?;
    let threads = kernels::default_threads().py_err()?;
    detached(py, || kernels::unpack(src, &mut dests, scale, threads))?.py_err()
}
