//! numpy buffers as the kernels see them: the storage kind of a buffer, a typed C-contiguous
//! view of each array, and one dispatch from kind to the generic binding that runs the kernel.
//! bfloat16 arrives as `uint16` bit patterns (numpy has no bfloat16; the Python layer passes
//! torch bfloat16 tensors this way).

use numpy::{
    dtype, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods,
};
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

/// A buffer's byte range, whether the kernel writes it, and its argument name.
pub struct Span {
    start: usize,
    end: usize,
    written: bool,
    name: String,
}

impl Span {
    /// The bytes `a` occupies (C-contiguous, checked by [`typed`]); empty for no elements.
    pub fn of<N: numpy::Element>(
        a: &Bound<'_, PyArrayDyn<N>>,
        written: bool,
        name: String,
    ) -> Self {
        let start = a.data() as usize;
        Span {
            start,
            end: start + a.len() * std::mem::size_of::<N>(),
            written,
            name,
        }
    }
}

/// Refuse buffers that overlap where the kernel writes, as torch refuses them: every written
/// span must be disjoint from every other span (spans only read may overlap each other).
/// Compared by address, so torch views, `numpy.frombuffer` arrays and slices of one allocation
/// are caught whatever object owns the memory (numpy's own borrow tracking only sees arrays of
/// one base object). A sweep over the spans sorted by address: `O(n log n)` for the hundreds
/// of gradients of a fusion buffer. The error names a buffer only read first.
pub fn check_disjoint(mut spans: Vec<Span>) -> PyResult<()> {
    spans.retain(|s| s.end > s.start);
    spans.sort_by_key(|s| s.start);
    let mut last_written: Option<&Span> = None;
    let mut last_read: Option<&Span> = None;
    for s in &spans {
        if let Some(w) = last_written.filter(|w| s.start < w.end) {
            return Err(invalid(&s.name, format!("overlaps {} in memory", w.name)));
        }
        if s.written {
            if let Some(r) = last_read.filter(|r| s.start < r.end) {
                return Err(invalid(&r.name, format!("overlaps {} in memory", s.name)));
            }
            if last_written.is_none_or(|w| s.end > w.end) {
                last_written = Some(s);
            }
        } else if last_read.is_none_or(|r| s.end > r.end) {
            last_read = Some(s);
        }
    }
    Ok(())
}
