//! The one place where core errors become Python exceptions, and where long work leaves the GIL.

use hetcoll_core::CoreError;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// Every core error is a `ValueError` whose message starts with the argument's name.
pub fn to_py(err: CoreError) -> PyErr {
    PyValueError::new_err(err.to_string())
}

/// `Result<T, CoreError>` → `PyResult<T>`.
pub trait IntoPy<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for Result<T, CoreError> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

/// A `ValueError` for `argument`: `"{argument}: {reason}"`.
pub fn invalid(argument: &str, reason: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("{argument}: {reason}"))
}

/// Run `work` without the GIL, then let a pending Ctrl-C surface as `KeyboardInterrupt`.
///
/// A panic in the core (a bug: every input is validated first) becomes a `RuntimeError` saying
/// so, not a `PanicException` (which derives from `BaseException` and escapes `except
/// Exception`). The core's loops are bounded (see its hostile-input property tests), so the
/// signal check after the work is prompt.
pub fn detached<T, F>(py: Python<'_>, work: F) -> PyResult<T>
where
    F: FnOnce() -> T + Send,
    T: Send,
{
    let out = py.detach(|| std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)));
    py.check_signals()?;
    out.map_err(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        PyRuntimeError::new_err(format!(
            "internal error in hetcoll's Rust core (please report it with the arguments): {what}"
        ))
    })
}
