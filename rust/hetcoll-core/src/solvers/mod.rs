//! Solvers that decide who does how much.
//!
//! - [`split`]: integer work shares over ranks of unequal speed (samples per rank, filters per
//!   rank, chunk sizes of a ring) with the smallest makespan.
//! - [`assign`]: independent items (experts) on devices, any items on any device, smallest
//!   bottleneck (branch and bound, exact within a node budget).
//! - [`chain`]: layers per device for contiguous pipeline stages, exact bottleneck.
//! - [`hypergraph`]: multilevel k-way hypergraph partitioning with heterogeneous block targets
//!   (connectivity-minus-one objective), e.g. the filters of a network over devices.

pub mod assign;
pub mod chain;
pub mod hypergraph;
pub mod split;

pub use assign::{assign_items, assign_items_near, assignment_time, refine_assignment, Assignment};
pub use chain::{partition_chain, partition_chain_within, stage_times, ChainMemory};
pub use hypergraph::{km1, partition_hypergraph, Hypergraph, PartitionOptions};
pub use split::{finish_times, split, SplitOptions};
