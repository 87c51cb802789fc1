//! The one error type of the core. Every failure names the argument it is about, so the bindings
//! can turn it into a Python exception whose message a user can act on.

use std::fmt;

/// What went wrong, and with which argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoreError {
    /// A malformed argument: wrong length, NaN, out of range, ...
    InvalidArgument {
        /// The argument's name as the public API spells it (`speeds`, `capacity[3]`, ...).
        argument: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Arguments that are each well formed but admit no solution together.
    Infeasible {
        /// The argument most responsible (`capacity`, `multiple_of`, `minimum`, ...).
        argument: String,
        /// Why no solution exists.
        reason: String,
    },
}

impl CoreError {
    /// A malformed argument.
    pub fn invalid(argument: impl Into<String>, reason: impl Into<String>) -> Self {
        CoreError::InvalidArgument {
            argument: argument.into(),
            reason: reason.into(),
        }
    }

    /// Well-formed arguments without a solution.
    pub fn infeasible(argument: impl Into<String>, reason: impl Into<String>) -> Self {
        CoreError::Infeasible {
            argument: argument.into(),
            reason: reason.into(),
        }
    }

    /// The name of the argument the error is about.
    pub fn argument(&self) -> &str {
        match self {
            CoreError::InvalidArgument { argument, .. } | CoreError::Infeasible { argument, .. } => {
                argument
            }
        }
    }
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::InvalidArgument { argument, reason } => write!(f, "{argument}: {reason}"),
            CoreError::Infeasible { argument, reason } => {
                write!(f, "{argument}: infeasible: {reason}")
            }
        }
    }
}

impl std::error::Error for CoreError {}

/// Result alias used across the core.
pub type Result<T> = std::result::Result<T, CoreError>;
