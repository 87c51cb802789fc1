//! Exact contiguous pipeline stages over devices of unequal speed in a fixed order
//! (chains-on-chains partitioning).
//!
//! Layers `0..n` with compute costs `c_l` (FLOP, or any unit of work) are cut into `p` contiguous
//! stages, stage `d` running on device `d` of speed `s_d` (work units per second). Optionally the
//! activation leaving layer `l` weighs `b_l` bytes and crosses a link of `bandwidth` bytes per
//! second when a stage ends after layer `l`. The time of a stage holding layers `[i, j)` is
//!
//! ```text
//! T_d(i, j) = (c_i + … + c_{j-1}) / s_d  +  b_{j-1} / bandwidth   (the transfer only if j < n)
//! T_d(i, i) = 0                                                  (an empty stage)
//! ```
//!
//! — each stage pays for sending its output to the next stage; the last stage sends nothing. The
//! solver minimises the bottleneck `max_d T_d`, which bounds the pipeline's throughput.
//!
//! # Empty stages are allowed
//!
//! A device may get 0 layers: with more devices than layers, or a device too slow to help, the best
//! pipeline skips it (its activations pass straight from the previous stage to the next). This also
//! makes the problem always feasible for any `p ≥ 1`.
//!
//! # Algorithm and why it is exact
//!
//! Probe + bisection (Pinar & Aykanat, "Fast optimal load balancing algorithms for 1D partitioning",
//! JPDC 2004; heterogeneous processors in a fixed order: Pinar, Tabak & Aykanat 2008). The probe for
//! a bottleneck `B` walks the devices in order and gives each the longest run of the remaining layers
//! whose stage time stays `≤ B`; `B` is feasible iff the walk reaches layer `n`. Greedy is optimal
//! because of a domination argument: from a later start position every suffix is at least as easy
//! to cover (the stage that contained the later start just shrinks, stages before it become empty,
//! and a stage's time only falls when its first layer moves right), so reaching as far as possible
//! with each device never hurts. Feasibility is monotone in `B`, so bisection over the ordered
//! bit patterns of non-negative `f64` (at most 64 probes) finds the smallest representable feasible
//! `B`. The optimum is one of the stage times `T_d(i, j)`, which the probe evaluates with the very
//! same floating-point formula ([`stage_times`] uses it too), so that smallest feasible `B` *is* the
//! optimum as computed in IEEE double — there is no tolerance.
//!
//! Boundary transfers make `T_d(i, j)` non-monotone in `j`, so "the longest run" is found by a
//! binary search on the compute part followed by a downward scan for a cut whose transfer fits;
//! the scan skips blocks of 64 cuts whose cheapest transfer cannot fit. Cost: `O(p log n)` per probe
//! without transfers, and at most 64 probes.
//!
//! # Memory
//!
//! [`partition_chain_within`] also takes each layer's memory `m_l` (bytes: parameters, optimizer
//! state, activations) and each device's capacity `C_d`: a stage's layers must fit, `m_i + … +
//! m_{j-1} ≤ C_d`. The probe then gives each device the longest run that meets the bound *and*
//! fits. Memory only grows with `j` and shrinks as `i` moves right, so the domination argument
//! still holds and the result is still exact, now among the placements that fit. Requests no
//! placement fits are refused with the shortfall (total need against total capacity, a layer
//! larger than every device, or how much of the chain cannot be placed in order).
//!
//! # Tie-breaking
//!
//! Among optimal partitions the solver returns the probe's at the optimal bottleneck: each device in
//! order takes as many layers as the bottleneck allows (later devices may be left empty when the
//! optimum does not need them).

use crate::error::{CoreError, Result};

/// Inputs of the chain partitioner after validation: prefix sums of the costs and the transfer time
/// in seconds of each possible cut.
struct Chain<'a> {
    /// `prefix[j] = c_0 + … + c_{j-1}`, `n + 1` entries.
    prefix: Vec<f64>,
    /// `transfer[j]` = seconds to send the activation leaving layer `j - 1` (0 for `j ∈ {0, n}`).
    transfer: Vec<f64>,
    /// For each block of `BLOCK` cuts starting at `BLOCK · b`: its smallest transfer.
    block_min: Vec<f64>,
    speeds: &'a [f64],
    /// `memory_prefix[j] = m_0 + … + m_{j-1}` and each device's capacity, when memory is limited.
    memory: Option<(Vec<f64>, &'a [f64])>,
}

/// Each layer's memory and each device's capacity (same unit, e.g. bytes) for
/// [`partition_chain_within`].
#[derive(Debug, Clone, Copy)]
pub struct ChainMemory<'a> {
    /// Memory of each layer (`len(costs)` entries, finite, ≥ 0).
    pub memory: &'a [f64],
    /// The most memory each device may hold (`len(speeds)` entries, finite, ≥ 0).
    pub capacity: &'a [f64],
}

const BLOCK: usize = 64;

impl<'a> Chain<'a> {
    fn new(
        costs: &[f64],
        speeds: &'a [f64],
        boundary_bytes: Option<&[f64]>,
        bandwidth: Option<f64>,
    ) -> Result<Self> {
        let n = costs.len();
        if n == 0 {
            return Err(CoreError::invalid("costs", "must hold at least one layer"));
        }
        for (i, &c) in costs.iter().enumerate() {
            if !c.is_finite() || c < 0.0 {
                return Err(CoreError::invalid(
                    format!("costs[{i}]"),
                    format!("must be finite and >= 0, got {c}"),
                ));
            }
        }
        if speeds.is_empty() {
            return Err(CoreError::invalid("speeds", "must not be empty"));
        }
        for (i, &s) in speeds.iter().enumerate() {
            if !s.is_finite() || s <= 0.0 {
                return Err(CoreError::invalid(
                    format!("speeds[{i}]"),
                    format!("must be finite and > 0, got {s}"),
                ));
            }
        }
        let mut prefix = Vec::with_capacity(n + 1);
        let mut acc = 0.0f64;
        prefix.push(acc);
        for &c in costs {
            acc += c;
            prefix.push(acc);
        }
        if !acc.is_finite() {
            return Err(CoreError::invalid("costs", "their sum overflows a double"));
        }
        let mut transfer = vec![0.0f64; n + 1];
        match (boundary_bytes, bandwidth) {
            (None, None) => {}
            (Some(_), None) => {
                return Err(CoreError::invalid(
                    "bandwidth",
                    "is required (bytes per second) when boundary_bytes is given",
                ))
            }
            (None, Some(_)) => {
                return Err(CoreError::invalid(
                    "boundary_bytes",
                    "is required when bandwidth is given",
                ))
            }
            (Some(bytes), Some(bw)) => {
                if !bw.is_finite() || bw <= 0.0 {
                    return Err(CoreError::invalid(
                        "bandwidth",
                        format!("must be finite and > 0 bytes per second, got {bw}"),
                    ));
                }
                if bytes.len() != n - 1 {
                    return Err(CoreError::invalid(
                        "boundary_bytes",
                        format!(
                            "must hold one entry per cut between layers (len(costs) - 1 = {}), got {}",
                            n - 1,
                            bytes.len()
                        ),
                    ));
                }
                for (l, &b) in bytes.iter().enumerate() {
                    if !b.is_finite() || b < 0.0 {
                        return Err(CoreError::invalid(
                            format!("boundary_bytes[{l}]"),
                            format!("must be finite and >= 0, got {b}"),
                        ));
                    }
                    transfer[l + 1] = b / bw;
                }
            }
        }
        let block_min = transfer
            .chunks(BLOCK)
            .map(|c| c.iter().copied().fold(f64::INFINITY, f64::min))
            .collect();
        Ok(Chain {
            prefix,
            transfer,
            block_min,
            speeds,
            memory: None,
        })
    }

    /// Validate `memory` against the chain and keep it; refuse (with the shortfall) requests that
    /// no placement in order fits.
    fn with_memory(mut self, memory: ChainMemory<'a>) -> Result<Self> {
        let n = self.layers();
        let p = self.speeds.len();
        let (m, cap) = (memory.memory, memory.capacity);
        if m.len() != n {
            return Err(CoreError::invalid(
                "memory",
                format!("must hold one entry per layer ({n}), got {}", m.len()),
            ));
        }
        if cap.len() != p {
            return Err(CoreError::invalid(
                "capacity",
                format!("must hold one entry per device ({p}), got {}", cap.len()),
            ));
        }
        for (argument, values) in [("memory", m), ("capacity", cap)] {
            if let Some((i, x)) = values
                .iter()
                .enumerate()
                .find(|(_, x)| !x.is_finite() || **x < 0.0)
            {
                return Err(CoreError::invalid(
                    format!("{argument}[{i}]"),
                    format!("must be finite and >= 0, got {x}"),
                ));
            }
        }
        let mut prefix = Vec::with_capacity(n + 1);
        let mut acc = 0.0f64;
        prefix.push(acc);
        for &x in m {
            acc += x;
            prefix.push(acc);
        }
        if !acc.is_finite() {
            return Err(CoreError::invalid("memory", "its sum overflows a double"));
        }
        let held: f64 = cap.iter().sum();
        if acc > held {
            return Err(CoreError::infeasible(
                "capacity",
                format!(
                    "the layers need {acc} in all, the devices hold {held} together \
                     ({} short)",
                    acc - held
                ),
            ));
        }
        let largest = cap.iter().copied().fold(0.0, f64::max);
        if let Some((l, &x)) = m.iter().enumerate().find(|(_, &x)| x > largest) {
            return Err(CoreError::infeasible(
                "capacity",
                format!(
                    "layer {l} needs {x}, more than any device holds (the largest, {largest}; \
                     {} short)",
                    x - largest
                ),
            ));
        }
        self.memory = Some((prefix, cap));
        if self.probe(f64::INFINITY).is_none() {
            // Fill the devices in order as far as memory allows: what is left cannot be placed.
            let mut at = 0;
            for d in 0..p {
                at = self.memory_reach(d, at);
            }
            let left = acc - self.memory.as_ref().map_or(0.0, |(pre, _)| pre[at]);
            return Err(CoreError::infeasible(
                "capacity",
                format!(
                    "contiguous stages in device order hold at most layers 0..{at}; layers \
                     {at}..{n} need {left} more than fits (the devices hold {held} together, \
                     but not in whole layers in order)"
                ),
            ));
        }
        Ok(self)
    }

    /// The largest `j ≥ i` whose layers `[i, j)` fit in device `d`'s memory (`n` without limits).
    fn memory_reach(&self, d: usize, i: usize) -> usize {
        let n = self.layers();
        let Some((prefix, cap)) = &self.memory else {
            return n;
        };
        // Memory used is nondecreasing in j.
        let (mut lo, mut hi) = (i, n);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if prefix[mid] - prefix[i] <= cap[d] {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }

    fn layers(&self) -> usize {
        self.prefix.len() - 1
    }

    /// `T_d(i, j)` in seconds; the one formula every comparison uses.
    #[inline]
    fn stage_time(&self, d: usize, i: usize, j: usize) -> f64 {
        if j == i {
            0.0
        } else {
            (self.prefix[j] - self.prefix[i]) / self.speeds[d] + self.transfer[j]
        }
    }

    #[inline]
    fn compute_time(&self, d: usize, i: usize, j: usize) -> f64 {
        (self.prefix[j] - self.prefix[i]) / self.speeds[d]
    }

    /// The largest `j ≥ i` with `T_d(i, j) ≤ bound` whose layers fit device `d` (`j = i`, the empty
    /// stage, always qualifies).
    fn reach(&self, d: usize, i: usize, bound: f64) -> usize {
        // Largest j whose compute part alone fits (and whose memory fits): compute_time is
        // nondecreasing in j.
        let (mut lo, mut hi) = (i, self.memory_reach(d, i));
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.compute_time(d, i, mid) <= bound {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        let mut j = lo;
        // Transfers are not monotone in j: scan down for a cut whose transfer fits as well.
        while j > i {
            if self.stage_time(d, i, j) <= bound {
                return j;
            }
            let block = j / BLOCK;
            let start = (block * BLOCK).max(i + 1);
            // Within the block the compute part is smallest at `start`, so if even the cheapest
            // transfer of the block does not fit there, no cut of the block fits.
            if j - start > 2 && self.compute_time(d, i, start) + self.block_min[block] > bound {
                j = start - 1;
            } else {
                j -= 1;
            }
        }
        i
    }

    /// Layers per device of the greedy walk at `bound`, or `None` if it does not reach the end.
    fn probe(&self, bound: f64) -> Option<Vec<u64>> {
        let n = self.layers();
        let mut at = 0usize;
        let mut layers = Vec::with_capacity(self.speeds.len());
        for d in 0..self.speeds.len() {
            let next = if at == n { n } else { self.reach(d, at, bound) };
            layers.push((next - at) as u64);
            at = next;
        }
        (at == n).then_some(layers)
    }
}

/// Layers per device (in device order) of contiguous pipeline stages with the smallest possible
/// bottleneck stage time. See the module documentation for the cost model and the algorithm.
///
/// `costs[l]`: work of layer `l` (≥ 0, at least one layer); `speeds[d]`: work per second of device
/// `d` (> 0); `boundary_bytes[l]`: bytes of the activation between layers `l` and `l + 1`
/// (`len(costs) - 1` entries), with `bandwidth` in bytes per second — both or neither.
///
/// ```
/// use hetcoll_core::solvers::partition_chain;
/// // A device three times as fast takes three times the layers.
/// assert_eq!(partition_chain(&[1.0; 8], &[3.0, 1.0], None, None).unwrap(), vec![6, 2]);
/// ```
pub fn partition_chain(
    costs: &[f64],
    speeds: &[f64],
    boundary_bytes: Option<&[f64]>,
    bandwidth: Option<f64>,
) -> Result<Vec<u64>> {
    partition_chain_within(costs, speeds, boundary_bytes, bandwidth, None)
}

/// [`partition_chain`] with each layer's memory and each device's capacity: the stages with the
/// smallest bottleneck among those whose layers fit their device. Requests no placement fits are
/// refused with [`CoreError::Infeasible`] saying by how much.
///
/// ```
/// use hetcoll_core::solvers::{partition_chain_within, ChainMemory};
/// // The fast device would take 6 layers but holds only 4.
/// let memory = ChainMemory { memory: &[1.0; 8], capacity: &[4.0, 8.0] };
/// let layers = partition_chain_within(&[1.0; 8], &[3.0, 1.0], None, None, Some(memory));
/// assert_eq!(layers.unwrap(), vec![4, 4]);
/// ```
pub fn partition_chain_within(
    costs: &[f64],
    speeds: &[f64],
    boundary_bytes: Option<&[f64]>,
    bandwidth: Option<f64>,
    memory: Option<ChainMemory<'_>>,
) -> Result<Vec<u64>> {
    let mut chain = Chain::new(costs, speeds, boundary_bytes, bandwidth)?;
    if let Some(memory) = memory {
        chain = chain.with_memory(memory)?;
    }
    if let Some(layers) = chain.probe(0.0) {
        return Ok(layers);
    }
    // The smallest stage time of one device holding everything bounds the optimum when memory
    // allows it; otherwise every stage time is finite, so infinity does (probe(∞) succeeds, as
    // `with_memory` checked).
    let n = chain.layers();
    let upper = (0..speeds.len())
        .filter(|&d| chain.memory_reach(d, 0) == n)
        .map(|d| chain.stage_time(d, 0, n))
        .fold(f64::INFINITY, f64::min);
    // Non-negative doubles order like their bit patterns: bisect on the bits, probe(lo) fails,
    // probe(hi) succeeds.
    let (mut lo, mut hi) = (0u64, upper.to_bits());
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if chain.probe(f64::from_bits(mid)).is_some() {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(chain
        .probe(f64::from_bits(hi))
        .expect("the bisection keeps probe(hi) feasible"))
}

/// Seconds of each stage for `layers` per device (same cost model and formula as
/// [`partition_chain`]); the bottleneck is their maximum.
pub fn stage_times(
    costs: &[f64],
    speeds: &[f64],
    layers: &[u64],
    boundary_bytes: Option<&[f64]>,
    bandwidth: Option<f64>,
) -> Result<Vec<f64>> {
    let chain = Chain::new(costs, speeds, boundary_bytes, bandwidth)?;
    if layers.len() != speeds.len() {
        return Err(CoreError::invalid(
            "layers",
            format!(
                "must hold one count per device ({}), got {}",
                speeds.len(),
                layers.len()
            ),
        ));
    }
    let total: u128 = layers.iter().map(|&l| l as u128).sum();
    if total != costs.len() as u128 {
        return Err(CoreError::invalid(
            "layers",
            format!("must sum to len(costs) = {}, got {total}", costs.len()),
        ));
    }
    let mut at = 0usize;
    Ok(layers
        .iter()
        .enumerate()
        .map(|(d, &l)| {
            let next = at + l as usize;
            let t = chain.stage_time(d, at, next);
            at = next;
            t
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bottleneck(
        costs: &[f64],
        speeds: &[f64],
        layers: &[u64],
        bytes: Option<&[f64]>,
        bw: Option<f64>,
    ) -> f64 {
        stage_times(costs, speeds, layers, bytes, bw)
            .unwrap()
            .into_iter()
            .fold(0.0, f64::max)
    }

    /// Every way to give `n` layers to `p` devices in order (empty stages allowed).
    fn compositions(n: u64, p: usize) -> Vec<Vec<u64>> {
        if p == 1 {
            return vec![vec![n]];
        }
        let mut out = Vec::new();
        for first in 0..=n {
            for mut rest in compositions(n - first, p - 1) {
                rest.insert(0, first);
                out.push(rest);
            }
        }
        out
    }

    fn brute_force(costs: &[f64], speeds: &[f64], bytes: Option<&[f64]>, bw: Option<f64>) -> f64 {
        compositions(costs.len() as u64, speeds.len())
            .iter()
            .map(|l| bottleneck(costs, speeds, l, bytes, bw))
            .fold(f64::INFINITY, f64::min)
    }

    #[test]
    fn proportional_to_speed() {
        assert_eq!(
            partition_chain(&[1.0; 8], &[3.0, 1.0], None, None).unwrap(),
            vec![6, 2]
        );
        assert_eq!(
            partition_chain(&[1.0; 3], &[1.0; 5], None, None).unwrap(),
            vec![1, 1, 1, 0, 0]
        );
    }

    #[test]
    fn expensive_boundary_is_avoided() {
        // Cutting after layer 0 costs 100 s of transfer; after layer 1 nothing.
        let layers = partition_chain(
            &[1.0, 1.0, 1.0, 1.0],
            &[1.0, 1.0],
            Some(&[100.0, 0.0, 100.0]),
            Some(1.0),
        )
        .unwrap();
        assert_eq!(layers, vec![2, 2]);
    }

    #[test]
    fn bad_input_names_the_argument() {
        let e = |r: Result<Vec<u64>>| r.unwrap_err().argument().to_string();
        assert_eq!(e(partition_chain(&[], &[1.0], None, None)), "costs");
        assert_eq!(
            e(partition_chain(&[1.0, -1.0], &[1.0], None, None)),
            "costs[1]"
        );
        assert_eq!(e(partition_chain(&[1.0], &[], None, None)), "speeds");
        assert_eq!(
            e(partition_chain(&[1.0], &[f64::NAN], None, None)),
            "speeds[0]"
        );
        assert_eq!(
            e(partition_chain(&[1.0, 1.0], &[1.0], Some(&[1.0]), None)),
            "bandwidth"
        );
        assert_eq!(
            e(partition_chain(
                &[1.0, 1.0],
                &[1.0],
                Some(&[1.0, 2.0]),
                Some(1.0)
            )),
            "boundary_bytes"
        );
        assert_eq!(
            e(partition_chain(
                &[1.0, 1.0],
                &[1.0],
                Some(&[1.0]),
                Some(0.0)
            )),
            "bandwidth"
        );
    }

    /// The smallest bottleneck over placements that fit, or `None` when none does.
    fn brute_force_within(
        costs: &[f64],
        speeds: &[f64],
        memory: &[f64],
        cap: &[f64],
    ) -> Option<f64> {
        compositions(costs.len() as u64, speeds.len())
            .iter()
            .filter(|l| {
                let mut at = 0usize;
                l.iter().zip(cap).all(|(&c, &limit)| {
                    let used: f64 = memory[at..at + c as usize].iter().sum();
                    at += c as usize;
                    used <= limit
                })
            })
            .map(|l| bottleneck(costs, speeds, l, None, None))
            .reduce(f64::min)
    }

    #[test]
    fn memory_limits_the_fast_device() {
        let memory = ChainMemory {
            memory: &[1.0; 8],
            capacity: &[4.0, 8.0],
        };
        let layers = partition_chain_within(&[1.0; 8], &[3.0, 1.0], None, None, Some(memory));
        assert_eq!(layers.unwrap(), vec![4, 4]);
    }

    #[test]
    fn infeasible_memory_says_by_how_much() {
        let err = |m: &[f64], c: &[f64]| {
            let memory = ChainMemory {
                memory: m,
                capacity: c,
            };
            partition_chain_within(&[1.0; 3], &[1.0, 1.0], None, None, Some(memory))
                .unwrap_err()
                .to_string()
        };
        let total = err(&[2.0, 2.0, 2.0], &[3.0, 2.5]);
        assert!(
            total.contains("need 6 in all") && total.contains("(0.5 short)"),
            "{total}"
        );
        let single = err(&[1.0, 5.0, 1.0], &[4.0, 4.0]);
        assert!(
            single.contains("layer 1 needs 5") && single.contains("1 short"),
            "{single}"
        );
        // 6 fits in 3 + 3 in total, but not as whole layers in order.
        let order = err(&[2.0, 2.0, 2.0], &[3.0, 3.0]);
        assert!(
            order.contains("layers 0..2") && order.contains("need 2 more"),
            "{order}"
        );
        let e = |m: &[f64], c: &[f64]| {
            let memory = ChainMemory {
                memory: m,
                capacity: c,
            };
            partition_chain_within(&[1.0; 2], &[1.0], None, None, Some(memory))
                .unwrap_err()
                .argument()
                .to_string()
        };
        assert_eq!(e(&[1.0], &[1.0]), "memory");
        assert_eq!(e(&[1.0, 1.0], &[1.0, 1.0]), "capacity");
        assert_eq!(e(&[1.0, f64::NAN], &[1.0]), "memory[1]");
        assert_eq!(e(&[1.0, 1.0], &[-1.0]), "capacity[0]");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        #[test]
        fn within_memory_against_brute_force(
            costs in prop::collection::vec(0u32..20, 1..7),
            speeds in prop::collection::vec(1u32..6, 1..4),
            memory in prop::collection::vec(0u32..10, 6),
            cap in prop::collection::vec(0u32..25, 3),
        ) {
            let costs: Vec<f64> = costs.into_iter().map(f64::from).collect();
            let speeds: Vec<f64> = speeds.into_iter().map(f64::from).collect();
            let memory: Vec<f64> = memory[..costs.len()].iter().map(|&m| f64::from(m)).collect();
            let cap: Vec<f64> = cap[..speeds.len()].iter().map(|&c| f64::from(c)).collect();
            let limits = ChainMemory { memory: &memory, capacity: &cap };
            let got = partition_chain_within(&costs, &speeds, None, None, Some(limits));
            match brute_force_within(&costs, &speeds, &memory, &cap) {
                None => prop_assert!(got.is_err()),
                Some(best) => {
                    let layers = got.unwrap();
                    let mut at = 0usize;
                    for (&c, &limit) in layers.iter().zip(&cap) {
                        let used: f64 = memory[at..at + c as usize].iter().sum();
                        prop_assert!(used <= limit);
                        at += c as usize;
                    }
                    prop_assert_eq!(at, costs.len());
                    prop_assert_eq!(bottleneck(&costs, &speeds, &layers, None, None), best);
                }
            }
        }

        #[test]
        fn optimal_against_brute_force(
            costs in prop::collection::vec(0u32..20, 1..8),
            speeds in prop::collection::vec(1u32..6, 1..5),
            bytes in prop::collection::vec(0u32..30, 7),
            with_transfer in any::<bool>(),
        ) {
            let costs: Vec<f64> = costs.into_iter().map(f64::from).collect();
            let speeds: Vec<f64> = speeds.into_iter().map(f64::from).collect();
            let bytes: Vec<f64> = bytes[..costs.len() - 1].iter().map(|&b| f64::from(b)).collect();
            let (b, bw) = if with_transfer { (Some(&bytes[..]), Some(4.0)) } else { (None, None) };
            let layers = partition_chain(&costs, &speeds, b, bw).unwrap();
            prop_assert_eq!(layers.iter().sum::<u64>(), costs.len() as u64);
            let got = bottleneck(&costs, &speeds, &layers, b, bw);
            prop_assert_eq!(got, brute_force(&costs, &speeds, b, bw));
        }

        #[test]
        fn optimal_with_fractional_inputs(
            costs in prop::collection::vec(0.0f64..10.0, 1..7),
            speeds in prop::collection::vec(0.1f64..5.0, 1..4),
            bytes in prop::collection::vec(0.0f64..10.0, 6),
        ) {
            let bytes = &bytes[..costs.len() - 1];
            let layers = partition_chain(&costs, &speeds, Some(bytes), Some(3.0)).unwrap();
            let got = bottleneck(&costs, &speeds, &layers, Some(bytes), Some(3.0));
            prop_assert_eq!(got, brute_force(&costs, &speeds, Some(bytes), Some(3.0)));
        }
    }
}
