//! Memory-bound kernels that combine uneven work.
//!
//! - [`weighted_sum`]: `out[k] = Σ_i w_i · a_i[k]` in one fused pass, multi-threaded.
//! - [`pack`]: scaled pack of many buffers into one flat fusion buffer, and scaled unpack.

pub mod element;
pub mod pack;
pub mod weighted_sum;

pub use element::Element;
pub use pack::{pack, unpack};
pub use weighted_sum::{default_threads, threads_per_rank, weighted_sum, Source, LOCAL_RANKS_VARS};
