//! # hetcoll-core
//!
//! The algorithms of hetcoll, free of Python: they can be unit-tested, property-tested and
//! benchmarked with cargo alone, and used from other Rust code.
//!
//! - [`solvers`] decide who does how much: [`solvers::split`] turns speeds and limits into integer
//!   shares with the smallest possible makespan.
//! - [`kernels`] combine uneven work: [`kernels::weighted_sum`] fuses `out = Σ w_i · a_i` into one
//!   pass over memory, multi-threaded, bitwise identical for any thread count.
//! - [`schedules`] say who sends what to whom: [`schedules::ring`] is the ring allreduce over
//!   chunks of unequal sizes.
//!
//! Every fallible function returns [`Result`], whose error names the offending argument.

pub mod error;
pub mod kernels;
pub mod schedules;
pub mod solvers;

pub use error::{CoreError, Result};
