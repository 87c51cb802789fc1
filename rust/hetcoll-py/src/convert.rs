//! Python values → Rust values, with errors that name the argument.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyString};

use crate::errors::invalid;

/// A non-negative integer: Python `int` or anything with `__index__` (numpy integers), not
/// `bool`, not `float` (even `10.0`: a share count is never fractional).
pub fn count(obj: &Bound<'_, PyAny>, argument: &str) -> PyResult<u64> {
    if obj.is_instance_of::<PyBool>() || obj.is_instance_of::<PyFloat>() {
        return Err(invalid(
            argument,
            format!("must be an integer, got {}", describe(obj)),
        ));
    }
    let index = obj.call_method0("__index__").map_err(|_| {
        invalid(
            argument,
            format!("must be an integer, got {}", describe(obj)),
        )
    })?;
    let value: i128 = index
        .extract()
        .map_err(|_| invalid(argument, "is out of range"))?;
    if value < 0 {
        return Err(invalid(argument, format!("must be >= 0, got {value}")));
    }
    u64::try_from(value).map_err(|_| invalid(argument, format!("must be < 2**64, got {value}")))
}

/// A sequence of numbers (list, tuple, numpy array, ...), as `f64`. Bools are refused: Python
/// counts them as ints, but `True` for a weight or a speed is a mistake.
pub fn floats(obj: &Bound<'_, PyAny>, argument: &str) -> PyResult<Vec<f64>> {
    if has_bool_dtype(obj) {
        return Err(invalid(argument, "must be numbers, got an array of bools"));
    }
    items(obj, argument)?
        .iter()
        .enumerate()
        .map(|(i, x)| {
            if let Ok(f) = x.cast::<PyFloat>() {
                return Ok(f.value()); // float, numpy.float64: no further checks
            }
            let bad = || {
                invalid(
                    &format!("{argument}[{i}]"),
                    format!("must be a number, got {}", describe(x)),
                )
            };
            if x.is_instance_of::<PyString>() || is_bool(x) {
                return Err(bad());
            }
            x.extract::<f64>().map_err(|_| bad())
        })
        .collect()
}

/// Python's `bool` or numpy's (`numpy.bool` / `numpy.bool_`), which converts to a float.
fn is_bool(x: &Bound<'_, PyAny>) -> bool {
    x.is_instance_of::<PyBool>()
        || x.get_type()
            .fully_qualified_name()
            .is_ok_and(|n| n.to_string().starts_with("numpy.bool"))
}

/// An array or tensor of bools (numpy's `bool`, torch's `torch.bool`), told by its `dtype`.
fn has_bool_dtype(obj: &Bound<'_, PyAny>) -> bool {
    obj.getattr("dtype")
        .and_then(|d| d.str().map(|s| s.to_string()))
        .is_ok_and(|d| d == "bool" || d == "torch.bool")
}

/// A sequence of non-negative integers.
pub fn counts(obj: &Bound<'_, PyAny>, argument: &str) -> PyResult<Vec<u64>> {
    items(obj, argument)?
        .iter()
        .enumerate()
        .map(|(i, x)| count(x, &format!("{argument}[{i}]")))
        .collect()
}

fn items<'py>(obj: &Bound<'py, PyAny>, argument: &str) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if obj.is_instance_of::<PyString>() {
        return Err(invalid(
            argument,
            "must be a sequence of numbers, got a str",
        ));
    }
    let iter = obj.try_iter().map_err(|_| {
        invalid(
            argument,
            format!("must be a sequence of numbers, got {}", describe(obj)),
        )
    })?;
    iter.collect()
}

fn describe(obj: &Bound<'_, PyAny>) -> String {
    let repr = obj
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "?".into());
    let name = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    format!("{repr} ({name})")
}
