//! Exact makespan split: integer shares `b_i` over ranks of unequal speed.
//!
//! Given a total `B`, speeds `s_i` (units per second), start-up latencies `a_i` (seconds),
//! capacities `c_i`, a granularity `q` (`multiple_of`) and a floor `m` (`minimum`), find integers
//! `b_i` with
//!
//! ```text
//! Σ b_i = B,   m ≤ b_i ≤ c_i,   b_i mod q = 0
//! ```
//!
//! minimising the makespan `max_i f_i(b_i)` where `f_i(b) = a_i + b / s_i` is the time rank `i`
//! finishes. Every rank's latency counts, also when its share is zero.
//!
//! # Algorithm and why it is exact
//!
//! Work in units of `q`: rank `i` holds `u_i ∈ [lo_i, hi_i]` units, `lo_i = ⌈m/q⌉`,
//! `hi_i = ⌊c_i/q⌋`, and `R = B/q − Σ lo_i` units remain to be handed out above the floors. Giving
//! rank `i` its `k`-th extra unit costs the *increment* `v_i(k) = f_i((lo_i + k)·q)`, a
//! nondecreasing sequence in `k`. A solution picks a prefix of each rank's sequence, `R` increments
//! in all, and its makespan is `max(max_i f_i(lo_i·q), largest picked increment)`.
//!
//! *Lower bound.* Any `R` increments contain one at least as large as the `R`-th smallest increment
//! overall, `v*`. *Attained.* Taking the `R` smallest increments overall is a union of prefixes
//! (each sequence is sorted), so it is feasible and its largest increment is `v*`. Hence the greedy
//! that hands out one unit at a time to the rank whose finish time after taking it is smallest is
//! optimal (the classical argument for separable convex resource allocation).
//!
//! Handing units out one by one costs `O(R log p)`. Instead, bisection on the level `t` finds a
//! level whose count `C(t) = #{increments ≤ t}` is at most `R` and close to it; every rank takes all
//! its increments `≤ t` at once (`O(p)` per probe: an estimate `⌊(t − a_i)·s_i/q⌋` corrected by
//! evaluating `f_i` itself, so rounding never miscounts), and a heap hands out the few units left.
//! All increments `≤ t` belong to the `R` smallest whenever `C(t) ≤ R`, so the result is exactly
//! the one-unit-at-a-time greedy's. Cost: `O(p log(B/p))` probes' worth of work plus
//! `O(p log p)` for the heap.
//!
//! # Tie-breaking
//!
//! Among optimal splits the solver returns the greedy's: each unit goes to the rank whose finish
//! time after taking it is smallest; on equal finish times, to the lowest rank index. The result
//! is a deterministic function of the inputs.
//!
//! Finish times are computed as `a_i + (b as f64) / s_i` in IEEE double precision everywhere (here,
//! in [`finish_times`], and in the tests' oracles), so comparisons are exact for totals below 2^53.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use crate::error::{CoreError, Result};

/// Optional constraints of [`split`]; `SplitOptions::default()` has none.
#[derive(Debug, Clone, Copy)]
pub struct SplitOptions<'a> {
    /// Start-up time of each rank in seconds (default 0).
    pub latency: Option<&'a [f64]>,
    /// Largest share each rank can hold (default unbounded).
    pub capacity: Option<&'a [u64]>,
    /// Every share is a multiple of this (default 1).
    pub multiple_of: u64,
    /// Smallest share of any rank (default 0).
    pub minimum: u64,
}

impl Default for SplitOptions<'_> {
    fn default() -> Self {
        SplitOptions {
            latency: None,
            capacity: None,
            multiple_of: 1,
            minimum: 0,
        }
    }
}

/// Finish time of a rank holding `share` units: `latency + share / speed`, in seconds.
#[inline]
fn finish(latency: f64, speed: f64, share: u64) -> f64 {
    latency + (share as f64) / speed
}

/// Predicted finish time in seconds of each rank holding `shares`: `latency_i + shares_i / speeds_i`.
///
/// ```
/// let t = hetcoll_core::solvers::finish_times(&[30, 10], &[3.0, 1.0], None).unwrap();
/// assert_eq!(t, vec![10.0, 10.0]);
/// ```
pub fn finish_times(shares: &[u64], speeds: &[f64], latency: Option<&[f64]>) -> Result<Vec<f64>> {
    validate_speeds(speeds)?;
    if shares.len() != speeds.len() {
        return Err(length_mismatch("shares", shares.len(), speeds.len()));
    }
    if let Some(lat) = latency {
        validate_latency(lat, speeds.len())?;
    }
    Ok(shares
        .iter()
        .zip(speeds)
        .enumerate()
        .map(|(i, (&b, &s))| finish(latency.map_or(0.0, |l| l[i]), s, b))
        .collect())
}

/// Integer shares with `Σ b_i = total` and the smallest makespan `max_i (latency_i + b_i / speeds_i)`
/// under the constraints of `options`. See the module documentation for the algorithm, the proof
/// of exactness and the tie-breaking rule.
///
/// ```
/// use hetcoll_core::solvers::{split, SplitOptions};
/// let shares = split(100, &[3.0, 1.0], &SplitOptions::default()).unwrap();
/// assert_eq!(shares, vec![75, 25]);
/// ```
pub fn split(total: u64, speeds: &[f64], options: &SplitOptions<'_>) -> Result<Vec<u64>> {
    let p = speeds.len();
    validate_speeds(speeds)?;
    let zeros;
    let latency = match options.latency {
        Some(lat) => {
            validate_latency(lat, p)?;
            lat
        }
        None => {
            zeros = vec![0.0; p];
            &zeros
        }
    };
    if let Some(cap) = options.capacity {
        if cap.len() != p {
            return Err(length_mismatch("capacity", cap.len(), p));
        }
    }
    let q = options.multiple_of;
    if q == 0 {
        return Err(CoreError::invalid(
            "multiple_of",
            "must be at least 1, got 0",
        ));
    }
    if total % q != 0 {
        return Err(CoreError::infeasible(
            "multiple_of",
            format!("total={total} is not a multiple of multiple_of={q}"),
        ));
    }
    let units = total / q;
    let lo_units = options.minimum.div_ceil(q);
    let lo = vec![lo_units; p];
    let mut hi = vec![units; p];
    if let Some(cap) = options.capacity {
        for (i, &c) in cap.iter().enumerate() {
            hi[i] = (c / q).min(units);
            if hi[i] < lo[i] {
                return Err(CoreError::infeasible(
                    format!("capacity[{i}]"),
                    format!(
                        "capacity {c} is below minimum={} (in multiples of {q}: {} < {})",
                        options.minimum, hi[i], lo[i]
                    ),
                ));
            }
        }
    }
    let floor_units: u128 = lo.iter().map(|&x| x as u128).sum();
    if floor_units > units as u128 {
        return Err(CoreError::infeasible(
            "minimum",
            format!(
                "{p} ranks x minimum={} (rounded up to a multiple of {q}) exceeds total={total}",
                options.minimum
            ),
        ));
    }
    let room_units: u128 = hi.iter().map(|&x| x as u128).sum();
    if room_units < units as u128 {
        return Err(CoreError::infeasible(
            "capacity",
            format!(
                "capacities hold at most {} in multiples of {q}, less than total={total}",
                room_units * q as u128
            ),
        ));
    }

    let remaining = units - floor_units as u64;
    let solver = Increments {
        speeds,
        latency,
        lo: &lo,
        hi: &hi,
        q,
    };
    if remaining as u128 == room_units - floor_units {
        // Every rank is filled to its capacity: no choice left.
        return Ok(hi.iter().map(|&u| u * q).collect());
    }
    let extra = solver.allocate(remaining);
    Ok(lo.iter().zip(&extra).map(|(&l, &k)| (l + k) * q).collect())
}

/// The increments of every rank above its floor, and the greedy over them.
struct Increments<'a> {
    speeds: &'a [f64],
    latency: &'a [f64],
    lo: &'a [u64],
    hi: &'a [u64],
    q: u64,
}

impl Increments<'_> {
    /// Finish time of rank `i` after taking its `k`-th extra unit.
    #[inline]
    fn value(&self, i: usize, k: u64) -> f64 {
        finish(self.latency[i], self.speeds[i], (self.lo[i] + k) * self.q)
    }

    /// Number of rank `i`'s increments `≤ t`: a floating-point estimate, then corrected against
    /// [`Self::value`] so that the count agrees exactly with the finish-time comparisons. The
    /// increments are nondecreasing in `k` (IEEE rounding is monotone), so the correction is an
    /// exponential search from the estimate: `O(log error)` evaluations even when the estimate is
    /// far off (finish times dominated by a huge latency, or shares beyond 2^53 that round).
    #[inline]
    fn count(&self, i: usize, t: f64) -> u64 {
        let room = self.hi[i] - self.lo[i];
        let estimate =
            ((t - self.latency[i]) * self.speeds[i] / self.q as f64).floor() - self.lo[i] as f64;
        let k = if estimate.is_nan() || estimate <= 0.0 {
            0
        } else if estimate >= room as f64 {
            room
        } else {
            (estimate as u64).min(room)
        };
        // `fits(k)`: the k-th increment is `≤ t` (k = 0 always fits).
        let fits = |k: u64| k == 0 || self.value(i, k) <= t;
        // Bracket the answer in `[good, bad)` with `fits(good)` and `!fits(bad)` (bad = room + 1
        // stands for "beyond the room"), doubling the step away from the estimate.
        let (mut good, mut bad) = if fits(k) {
            let (mut good, mut step) = (k, 1u64);
            loop {
                let next = good.saturating_add(step).min(room);
                if next == good {
                    return good; // every increment up to the room fits
                }
                if fits(next) {
                    good = next;
                    step = step.saturating_mul(2);
                } else {
                    break (good, next);
                }
            }
        } else {
            let (mut bad, mut step) = (k, 1u64);
            loop {
                let next = bad.saturating_sub(step);
                if fits(next) {
                    break (next, bad);
                }
                bad = next;
                step = step.saturating_mul(2);
            }
        };
        while bad - good > 1 {
            let mid = good + (bad - good) / 2;
            if fits(mid) {
                good = mid;
            } else {
                bad = mid;
            }
        }
        good
    }

    /// The largest level `t ≤ hi_t` (to bisection precision) at which the relaxed count
    /// `Σ_i clamp((t − a_i)·s_i/q − lo_i, 0, hi_i − lo_i)` is at most `target`. Multiplications
    /// only: cheap enough to probe 64 times.
    fn continuous_level(&self, target: f64, hi_t: f64) -> f64 {
        let rate: Vec<f64> = self.speeds.iter().map(|&s| s / self.q as f64).collect();
        let relaxed = |t: f64| -> f64 {
            (0..rate.len())
                .map(|i| {
                    let room = (self.hi[i] - self.lo[i]) as f64;
                    ((t - self.latency[i]) * rate[i] - self.lo[i] as f64).clamp(0.0, room)
                })
                .sum()
        };
        let (mut lo, mut hi) = (0.0_f64, hi_t);
        for _ in 0..64 {
            let mid = lo + (hi - lo) / 2.0;
            if mid <= lo || mid >= hi {
                break;
            }
            if relaxed(mid) <= target {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// `Σ_i count(i, t)`, in `u128`: each count can reach 2^64 − 1.
    fn total_count(&self, t: f64) -> u128 {
        (0..self.speeds.len())
            .map(|i| u128::from(self.count(i, t)))
            .sum()
    }

    /// Extra units per rank (above the floors) for `remaining` units, exactly the unit-at-a-time
    /// greedy's. Requires `remaining` < the total room, so the largest increment exceeds the level.
    fn allocate(&self, remaining: u64) -> Vec<u64> {
        let p = self.speeds.len();
        if remaining == 0 {
            return vec![0; p];
        }
        let mut hi_t = (0..p)
            .filter(|&i| self.hi[i] > self.lo[i])
            .map(|i| self.value(i, self.hi[i] - self.lo[i]))
            .fold(0.0_f64, f64::max)
            .min(f64::MAX); // a share whose finish time overflows stays above every finite level
                            // Start from the level of the continuous relaxation: there the exact count is within p of
                            // `remaining`, so usually no exact probe beyond this one is needed.
        let guess = self.continuous_level(remaining as f64, hi_t);
        let guess_count = self.total_count(guess);
        let remaining_wide = u128::from(remaining);
        // Invariant: count(lo_t) <= remaining < count(hi_t). Finish times are >= 0 (latencies
        // are), so no increment is <= -1.
        let (mut lo_t, mut lo_count) = if guess_count <= remaining_wide {
            (guess, guess_count)
        } else {
            hi_t = guess;
            (-1.0, 0)
        };
        let slack = p as u128;
        while remaining_wide - lo_count > slack {
            let mid = lo_t + (hi_t - lo_t) / 2.0;
            if mid <= lo_t || mid >= hi_t {
                break; // adjacent floats: the rest are ties, the heap settles them
            }
            let c = self.total_count(mid);
            if c <= remaining_wide {
                lo_t = mid;
                lo_count = c;
            } else {
                hi_t = mid;
            }
        }
        let mut taken: Vec<u64> = (0..p).map(|i| self.count(i, lo_t)).collect();
        // count(lo_t) <= remaining, so the sum fits in u64.
        let mut left = remaining - taken.iter().sum::<u64>();
        let mut heap: BinaryHeap<Reverse<(Level, usize)>> = (0..p)
            .filter(|&i| taken[i] < self.hi[i] - self.lo[i])
            .map(|i| Reverse((Level(self.value(i, taken[i] + 1)), i)))
            .collect();
        // The greedy hands out one unit at a time; the popped rank keeps winning while its next
        // increment beats the heap's top (ties to the lower rank), so it takes that whole run at
        // once. Each pop either exhausts `left`, fills the rank, or hands the lead to another
        // rank, so runs of equal finish times (a huge latency, shares that round) cost one pop.
        while left > 0 {
            let Some(Reverse((_, i))) = heap.pop() else {
                unreachable!("room exceeds the remaining units, so the heap cannot run dry");
            };
            let room = self.hi[i] - self.lo[i];
            let reach = match heap.peek() {
                None => room,
                Some(&Reverse((Level(top), j))) => {
                    if i < j {
                        self.count(i, top)
                    } else {
                        self.count(i, prev_float(top))
                    }
                }
            };
            // The popped increment itself always counts (it beat the top).
            let run = reach.max(taken[i] + 1).min(room).min(taken[i] + left) - taken[i];
            taken[i] += run;
            left -= run;
            if taken[i] < room {
                heap.push(Reverse((Level(self.value(i, taken[i] + 1)), i)));
            }
        }
        taken
    }
}

/// The largest float below `x` (for a finite or infinite `x > 0`, as finish times are).
fn prev_float(x: f64) -> f64 {
    if x.is_nan() || x == f64::NEG_INFINITY {
        return x;
    }
    if x == 0.0 {
        return -f64::from_bits(1);
    }
    let bits = x.to_bits();
    if x > 0.0 {
        f64::from_bits(bits - 1)
    } else {
        f64::from_bits(bits + 1)
    }
}

/// A finite finish time with a total order, for the heap.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Level(f64);

impl Eq for Level {}

impl PartialOrd for Level {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Level {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

fn length_mismatch(argument: &str, got: usize, expected: usize) -> CoreError {
    CoreError::invalid(
        argument,
        format!("has {got} entries but speeds has {expected}"),
    )
}

fn validate_speeds(speeds: &[f64]) -> Result<()> {
    if speeds.is_empty() {
        return Err(CoreError::invalid("speeds", "must not be empty"));
    }
    for (i, &s) in speeds.iter().enumerate() {
        if !(s.is_finite() && s > 0.0) {
            return Err(CoreError::invalid(
                format!("speeds[{i}]"),
                format!("must be a finite number > 0, got {s}"),
            ));
        }
    }
    Ok(())
}

fn validate_latency(latency: &[f64], p: usize) -> Result<()> {
    if latency.len() != p {
        return Err(length_mismatch("latency", latency.len(), p));
    }
    for (i, &a) in latency.iter().enumerate() {
        if !(a.is_finite() && a >= 0.0) {
            return Err(CoreError::invalid(
                format!("latency[{i}]"),
                format!("must be a finite number >= 0, got {a}"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn makespan(shares: &[u64], speeds: &[f64], latency: Option<&[f64]>) -> f64 {
        finish_times(shares, speeds, latency)
            .unwrap()
            .into_iter()
            .fold(f64::NEG_INFINITY, f64::max)
    }

    /// Unit-at-a-time greedy, the reference the fast solver must reproduce exactly.
    fn greedy(total: u64, speeds: &[f64], o: &SplitOptions<'_>) -> Vec<u64> {
        let p = speeds.len();
        let q = o.multiple_of;
        let lat = o.latency.map(|l| l.to_vec()).unwrap_or(vec![0.0; p]);
        let lo = o.minimum.div_ceil(q);
        let mut u = vec![lo; p];
        let hi: Vec<u64> = (0..p)
            .map(|i| o.capacity.map_or(total / q, |c| c[i] / q))
            .collect();
        for _ in 0..(total / q - lo * p as u64) {
            let best = (0..p)
                .filter(|&i| u[i] < hi[i])
                .min_by(|&a, &b| {
                    finish(lat[a], speeds[a], (u[a] + 1) * q)
                        .total_cmp(&finish(lat[b], speeds[b], (u[b] + 1) * q))
                        .then(a.cmp(&b))
                })
                .unwrap();
            u[best] += 1;
        }
        u.iter().map(|&x| x * q).collect()
    }

    #[test]
    fn proportional_when_divisible() {
        let s = split(60, &[70.0, 25.0, 5.0], &SplitOptions::default()).unwrap();
        assert_eq!(s.iter().sum::<u64>(), 60);
        assert_eq!(s, greedy(60, &[70.0, 25.0, 5.0], &SplitOptions::default()));
    }

    #[test]
    fn beats_largest_remainder() {
        // Largest-remainder rounding of 7 * [1, 1, 1.1] / 3.1 gives [2, 2, 3]: makespan 3/1.1 =
        // 2.73; the optimum gives the slow ranks 2 and 3 ... check against the greedy instead.
        let speeds = [1.0, 1.0, 1.1];
        let s = split(7, &speeds, &SplitOptions::default()).unwrap();
        let g = greedy(7, &speeds, &SplitOptions::default());
        assert_eq!(s, g);
        assert!(makespan(&s, &speeds, None) <= makespan(&[2, 2, 3], &speeds, None));
    }

    #[test]
    fn latency_capacity_multiple_minimum() {
        let speeds = [4.0, 2.0, 1.0, 0.5];
        let lat = [0.5, 0.0, 1.0, 0.25];
        let cap = [40, 16, 64, 8];
        let o = SplitOptions {
            latency: Some(&lat),
            capacity: Some(&cap),
            multiple_of: 4,
            minimum: 3,
        };
        let s = split(64, &speeds, &o).unwrap();
        assert_eq!(s, greedy(64, &speeds, &o));
        assert!(s.iter().all(|&b| b % 4 == 0 && b >= 4));
        assert_eq!(s.iter().sum::<u64>(), 64);
    }

    #[test]
    fn all_filled_to_capacity() {
        let s = split(
            10,
            &[1.0, 2.0],
            &SplitOptions {
                capacity: Some(&[4, 6]),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(s, vec![4, 6]);
    }

    #[test]
    fn errors_name_the_argument() {
        let d = SplitOptions::default();
        assert_eq!(split(1, &[], &d).unwrap_err().argument(), "speeds");
        assert_eq!(
            split(1, &[1.0, f64::NAN], &d).unwrap_err().argument(),
            "speeds[1]"
        );
        assert_eq!(split(1, &[0.0], &d).unwrap_err().argument(), "speeds[0]");
        let e = split(
            5,
            &[1.0],
            &SplitOptions {
                multiple_of: 2,
                ..d
            },
        );
        assert_eq!(e.unwrap_err().argument(), "multiple_of");
        let e = split(3, &[1.0, 1.0], &SplitOptions { minimum: 2, ..d });
        assert_eq!(e.unwrap_err().argument(), "minimum");
        let e = split(
            9,
            &[1.0, 1.0],
            &SplitOptions {
                capacity: Some(&[4, 4]),
                ..d
            },
        );
        assert_eq!(e.unwrap_err().argument(), "capacity");
        let e = split(
            9,
            &[1.0, 1.0],
            &SplitOptions {
                latency: Some(&[0.0, -1.0]),
                ..d
            },
        );
        assert_eq!(e.unwrap_err().argument(), "latency[1]");
    }
}
