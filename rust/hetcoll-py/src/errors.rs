//! The one place where core errors become Python exceptions, and where long work leaves the GIL.

use hetcoll_core::CoreError;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

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
    out.map_err(panicked)
}

/// As [`detached`], for work long enough that Ctrl-C should not wait for it (the hypergraph
/// partitioner on a large instance): it runs on a thread of its own while this one, without
/// the GIL, wakes every 50 ms to let a pending signal surface as `KeyboardInterrupt` at once.
/// The interrupted work then finishes alone and its result is dropped (it owns its data).
pub fn interruptible<T, F>(py: Python<'_>, work: F) -> PyResult<T>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let (tx, mut rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("hetcoll-solver".into())
        .spawn(move || {
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
            let _ = tx.send(out); // the caller may have gone (interrupted): nothing to do then
        })
        .map_err(|e| PyRuntimeError::new_err(format!("could not start a solver thread: {e}")))?;
    loop {
        let (got, back) = py.detach(move || (rx.recv_timeout(Duration::from_millis(50)), rx));
        rx = back;
        match got {
            Ok(out) => return out.map_err(panicked),
            Err(RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(RecvTimeoutError::Disconnected) => return Err(PyRuntimeError::new_err(
                "internal error in hetcoll's Rust core: the solver thread ended without a result",
            )),
        }
    }
}

/// A panic's payload as the `RuntimeError` that reports it.
fn panicked(panic: Box<dyn std::any::Any + Send>) -> PyErr {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    PyRuntimeError::new_err(format!(
        "internal error in hetcoll's Rust core (please report it with the arguments): {what}"
    ))
}
