//! numpy buffers as the kernels see them: the storage kind of a buffer, a typed C-contiguous
//! view of each array, and one dispatch from kind to the generic binding that runs the kernel.
//! bfloat16 arrives as `uint16` bit patterns (numpy has no bfloat16; the Python layer passes
//! torch bfloat16 tensors this way).

use numpy::{dtype, PyArrayDescrMethods, PyArrayDyn, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::errors::invalid;

/// The storage type shared by every buffer of one call.
pub enum Kind {
    F32,
    F64,
    F16,
    Bf16,
}

/// The kind of `buffer` (the output or the fusion buffer, named `argument` in errors).
pub fn kind(
    py: Python<'_>,
    buffer: &Bound<'_, PyAny>,
    argument: &str,
    bfloat16: bool,
) -> PyResult<Kind> {
    let arr = buffer
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
    } else if d.is_equiv_to(&dtype::<half::f16>(py)) {
        Ok(Kind::F16)
    } else {
        Err(PyTypeError::new_err(format!(
            "{argument}: dtype {d} is not supported (float32, float64, float16, bfloat16)"
        )))
    }
}

/// `a` as a typed, C-contiguous, aligned numpy array of element `N` (`want` describes the dtype expected,
/// for the error message).
pub fn typed<'a, 'py, N: numpy::Element>(
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
    if !t.is_aligned() {
        // Rust slices need aligned elements; a view at an odd byte offset (numpy.frombuffer with
        // an offset, a field of a packed record) would be undefined behaviour, so it is refused.
        return Err(invalid(
            name,
            format!(
                "is not aligned to {} bytes (a view at an odd byte offset?); pass a copy",
                std::mem::align_of::<N>()
            ),
        ));
    }
    Ok(t)
}

/// `run::<N, T>(args..., view, view_mut)` for the storage kind: `N` is the numpy element, `T`
/// the kernel's element, `view`/`view_mut` reinterpret slices of one as the other.
macro_rules! with_kind {
    ($kind:expr, $run:ident($($arg:expr),* $(,)?)) => {
        match $kind {
            $crate::buffers::Kind::F32 => $run::<f32, f32>($($arg),*, |s| s, |s| s),
            $crate::buffers::Kind::F64 => $run::<f64, f64>($($arg),*, |s| s, |s| s),
            $crate::buffers::Kind::F16 => {
                $run::<half::f16, half::f16>($($arg),*, |s| s, |s| s)
            }
            $crate::buffers::Kind::Bf16 => $run::<u16, half::bf16>(
                $($arg),*,
                |s| half::slice::HalfBitsSliceExt::reinterpret_cast(s),
                |s| half::slice::HalfBitsSliceExt::reinterpret_cast_mut(s),
            ),
        }
    };
}
pub(crate) use with_kind;
