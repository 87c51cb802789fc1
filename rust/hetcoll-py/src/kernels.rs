//! Bindings of `hetcoll_core::kernels`: numpy buffers in, no copies, GIL released.

use hetcoll_core::kernels::{self, Element, Source};
use numpy::{PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::buffers::{check_disjoint, kind, typed, with_kind, Span};
use crate::convert::floats;
use crate::errors::{detached, invalid, IntoPy};

/// `out[k] = Σ_i weights[i] · arrays[i][k]` into `out` (which may be one of `arrays`).
///
/// `bfloat16=True` reads `uint16` buffers as the bit patterns of bfloat16 values (numpy has no
/// bfloat16; the Python layer passes torch bfloat16 tensors this way).
#[pyfunction]
#[pyo3(signature = (arrays, weights, out, *, bfloat16=false))]
pub fn weighted_sum_into(
    py: Python<'_>,
    arrays: Vec<Bound<'_, PyAny>>,
    weights: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    bfloat16: bool,
) -> PyResult<()> {
    let weights = floats(weights, "weights")?;
    with_kind!(
        kind(py, out, "out", bfloat16)?,
        run(py, &arrays, &weights, out)
    )
}

/// Borrow every buffer as a slice of the numpy element type `N`, view it as the kernel's `T`,
/// and run the kernel without the GIL.
fn run<N, T>(
    py: Python<'_>,
    arrays: &[Bound<'_, PyAny>],
    weights: &[f64],
    out: &Bound<'_, PyAny>,
    view: fn(&[N]) -> &[T],
    view_mut: fn(&mut [N]) -> &mut [T],
) -> PyResult<()>
where
    N: numpy::Element,
    T: Element,
{
    let want = format!("out's dtype {}", T::NAME);
    let out = typed::<N>(out, "out", &want)?;
    let out_ptr = out.data() as usize;
    let shape = out.shape().to_vec();
    let mut typed_arrays = Vec::with_capacity(arrays.len());
    let mut spans = vec![Span::of(out, true, "out".into())];
    for (i, a) in arrays.iter().enumerate() {
        let name = format!("arrays[{i}]");
        let a = typed::<N>(a, &name, &want)?;
        if a.shape() != shape.as_slice() {
            return Err(invalid(
                &name,
                format!("has shape {:?} but out has shape {:?}", a.shape(), shape),
            ));
        }
        // `out` itself may be one of `arrays` (in-place accumulation); any other overlap with
        // it would read values the kernel has already overwritten.
        if a.data() as usize != out_ptr {
            spans.push(Span::of(a, false, name));
        }
        typed_arrays.push(a);
    }
    check_disjoint(spans)?;
    let mut out_rw = out.try_readwrite().map_err(|e| invalid("out", e))?;

    let mut guards: Vec<Option<PyReadonlyArrayDyn<'_, N>>> = Vec::with_capacity(arrays.len());
    for (i, a) in typed_arrays.into_iter().enumerate() {
        let name = format!("arrays[{i}]");
        if a.data() as usize == out_ptr {
            guards.push(None); // the very buffer of `out`: read in place
        } else {
            let ro = a
                .try_readonly()
                .map_err(|_| invalid(&name, "overlaps out without being out"))?;
            guards.push(Some(ro));
        }
    }
    let sources = guards
        .iter()
        .enumerate()
        .map(|(i, g)| match g {
            Some(ro) => ro
                .as_slice()
                .map(|s| Source::Slice(view(s)))
                .map_err(|e| invalid(&format!("arrays[{i}]"), e)),
            None => Ok(Source::Out),
        })
        .collect::<PyResult<Vec<Source<'_, T>>>>()?;
    let out_slice = view_mut(out_rw.as_slice_mut().map_err(|e| invalid("out", e))?);
    let threads = kernels::default_threads().py_err()?;
    detached(py, || {
        kernels::weighted_sum(&sources, weights, out_slice, threads)
    })?
    .py_err()
}

/// Threads the kernels use (`HETCOLL_NUM_THREADS`, else the node's cores divided among the
/// job's ranks on it).
#[pyfunction]
pub fn num_threads() -> PyResult<usize> {
    kernels::default_threads().py_err()
}
