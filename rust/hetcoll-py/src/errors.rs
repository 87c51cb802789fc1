//! The one place where core errors become Python exceptions, and where long work leaves the GIL.

use hetcoll_core::CoreError;
use pyo3::exceptions::PyValueError;
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
pub fn detached<T, F>(py: Python<'_>, work: F) -> PyResult<T>
where
    F: FnOnce() -> T + Send,
    T: Send,
{
    let out = py.detach(work);
    py.check_signals()?;
    Ok(out)
}
