//! Solvers that decide who does how much.
//!
//! - [`split`]: integer work shares over ranks of unequal speed (samples per rank, filters per
//!   rank, chunk sizes of a ring) with the smallest makespan.

pub mod split;

pub use split::{finish_times, split, SplitOptions};
