//! Bindings of `hetcoll_core::kernels::{pack, unpack}`: numpy buffers in, no copies, GIL released.

use half::slice::HalfBitsSliceExt;
use half::{bf16, f16};
use hetcoll_core::kernels::{self, Element};
use numpy::{
    dtype, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn,
    PyReadwriteArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::errors::{detached, invalid, IntoPy};

/// The storage type of `flat` (the fusion buffer); every array must share it.
enum Kind {
    F32,
    F64,
    F16,
    Bf16,
}

fn kind(py: Python<'_>, flat: &Bound<'_, PyAny>, argument: &str, bfloat16: bool) -> PyResult<Kind> {
    let arr = flat
        .cast::<PyUntypedArray>()
        .map_err(|_| PyTypeError::new_err(format!("{argument}: must be a numpy array")))?;
    let d = arr.dtype();
    if bfloat16 {
        if d.is_equiv_to(&dtype::<u16>(py)) {
            return Ok(Kind::Bf16);
        }
        return Err(PyTypeError::new_err(format!(
            "{argument}: bfloat16=True needs uint16 buffers holding bfloat16 bits"
        )));
    }
    if d.is_equiv_to(&dtype::<f32>(py)) {
        Ok(Kind::F32)
    } else if d.is_equiv_to(&dtype::<f64>(py)) {
        Ok(Kind::F64)
    } else if d.is_equiv_to(&dtype::<f16>(py)) {
        Ok(Kind::F16)
    } else {
        Err(PyTypeError::new_err(format!(
            "{argument}: dtype {d} is not supported (float32, float64, float16, bfloat16)"
        )))
    }
}

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
    match kind(py, out, "out", bfloat16)? {
        Kind::F32 => pack_as::<f32, f32>(py, &arrays, out, scale, |s| s, |s| s),
        Kind::F64 => pack_as::<f64, f64>(py, &arrays, out, scale, |s| s, |s| s),
        Kind::F16 => pack_as::<f16, f16>(py, &arrays, out, scale, |s| s, |s| s),
        Kind::Bf16 => pack_as::<u16, bf16>(
            py,
            &arrays,
            out,
            scale,
            |s| s.reinterpret_cast(),
            |s| s.reinterpret_cast_mut(),
        ),
    }
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
    match kind(py, flat, "flat", bfloat16)? {
        Kind::F32 => unpack_as::<f32, f32>(py, flat, &arrays, scale, |s| s, |s| s),
        Kind::F64 => unpack_as::<f64, f64>(py, flat, &arrays, scale, |s| s, |s| s),
        Kind::F16 => unpack_as::<f16, f16>(py, flat, &arrays, scale, |s| s, |s| s),
        Kind::Bf16 => unpack_as::<u16, bf16>(
            py,
            flat,
            &arrays,
            scale,
            |s| s.reinterpret_cast(),
            |s| s.reinterpret_cast_mut(),
        ),
    }
}

/// `arrays[i]` as a typed, C-contiguous numpy array of element `N`.
fn typed<'a, 'py, N: numpy::Element>(
    a: &'a Bound<'py, PyAny>,
    name: &str,
    want: &str,
) -> PyResult<&'a Bound<'py, PyArrayDyn<N>>> {
    let u = a.cast::<PyUntypedArray>().map_err(|_| {
        PyTypeError::new_err(format!("{name}: must be a numpy array or a CPU tensor"))
    })?;
    let t = a.cast::<PyArrayDyn<N>>().map_err(|_| {
        PyTypeError::new_err(format!("{name}: dtype {} does not match {want}", u.dtype()))
    })?;
    if !t.is_c_contiguous() {
        return Err(invalid(name, "must be C-contiguous"));
    }
    Ok(t)
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
    let mut out_rw = typed::<N>(out, "out", &want)?
        .try_readwrite()
        .map_err(|e| invalid("out", e))?;
    let mut guards: Vec<PyReadonlyArrayDyn<'_, N>> = Vec::with_capacity(arrays.len());
    for (i, a) in arrays.iter().enumerate() {
        let name = format!("arrays[{i}]");
        let ro = typed::<N>(a, &name, &want)?
            .try_readonly()
            .map_err(|_| invalid(&name, "overlaps out"))?;
        guards.push(ro);
    }
    let sources: Vec<&[T]> = guards
        .iter()
        .map(|g| view(g.as_slice().expect("checked C-contiguous")))
        .collect();
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
    let flat_ro = typed::<N>(flat, "flat", &want)?
        .try_readonly()
        .map_err(|e| invalid("flat", e))?;
    let mut guards: Vec<PyReadwriteArrayDyn<'_, N>> = Vec::with_capacity(arrays.len());
    for (i, a) in arrays.iter().enumerate() {
        let name = format!("arrays[{i}]");
        let rw = typed::<N>(a, &name, &want)?
            .try_readwrite()
            .map_err(|_| invalid(&name, "overlaps flat or another of arrays"))?;
        guards.push(rw);
    }
    let src = view(flat_ro.as_slice().expect("checked C-contiguous"));
    let mut dests: Vec<&mut [T]> = guards
        .iter_mut()
        .map(|g| view_mut(g.as_slice_mut().expect("checked C-contiguous")))
        .collect();
    let threads = kernels::default_threads().py_err()?;
    detached(py, || kernels::unpack(src, &mut dests, scale, threads))?.py_err()
}
