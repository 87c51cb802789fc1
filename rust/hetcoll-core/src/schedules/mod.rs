//! Communication schedules: who sends which element range to whom, step by step.
//!
//! - [`ring`]: ring allreduce (reduce-scatter + allgather) over chunks of unequal sizes.

pub mod ring;
