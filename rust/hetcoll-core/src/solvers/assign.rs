//! Independent items on devices of unequal speed, any items on any device: the assignment whose
//! slowest device finishes first.
//!
//! Item `i` carries load `w_i` (the tokens routed to an expert of a mixture-of-experts layer, or
//! any work unit), device `d` runs `s_d` load units per second and holds at most `cap_d` items.
//! Device `d` finishes its items after `(Σ_{i on d} w_i) / s_d` seconds; the solver minimises the
//! largest of these (scheduling on uniformly related machines, `Q||C_max`, with a cardinality
//! limit per machine). Unlike [`super::chain`], a device's items need not be contiguous: with
//! skewed loads that is worth a fifth of the bottleneck and more (two hot experts side by side
//! cannot be separated by a contiguous cut).
//!
//! # Algorithm
//!
//! The problem is NP-hard, so the solver is a depth-first branch and bound over the items in
//! decreasing load, each tried on the devices in the order they would finish it:
//!
//! - the first bound is the greedy schedule (each item, heaviest first, on the device where it
//!   finishes soonest: LPT for uniform machines), so the answer is never worse than greedy;
//! - a branch is cut when the device it uses would reach the best bottleneck found, or when the
//!   load still to place exceeds what every device could still take below that bottleneck
//!   (`Σ_d max(0, B · s_d − L_d)`, the fluid bound), or when no device has room left;
//! - devices of the same speed, room and load are interchangeable: only the first is tried;
//! - the search ends as soon as the best equals the lower bound `max(Σ w / Σ s, max w / max s)`.
//!
//! It is exact when it ends within `max_nodes` nodes ([`Assignment::exact`]); past that budget it
//! returns the best assignment found. Everything is deterministic: the same inputs give the same
//! assignment on every rank that solves them.
//!
//! # Items without load, devices without speed
//!
//! Items of zero load cost no time anywhere; they are placed after the others, each on the device
//! with room whose items per speed stay lowest (memory spreads as speed does). A device of speed 0
//! holds only such items.

use crate::error::{CoreError, Result};

/// The solver's answer: each item's device, and whether the search proved it optimal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// `owner[i]`: the device holding item `i`.
    pub owner: Vec<usize>,
    /// Whether the branch and bound finished within its node budget (the bottleneck is then the
    /// smallest possible, as computed in IEEE double).
    pub exact: bool,
}

/// The greedy bound's and the search's relative slack: a bottleneck within it of the lower bound
/// ends the search (rounding in the lower bound's sums must not keep an optimum unproved).
const PROVED: f64 = 1e-12;

/// Each item's device (see the module documentation): `loads` one per item, `speeds` one per
/// device, `capacity` the most items each device holds (none: unlimited), `max_nodes` the search's
/// budget. Requests no assignment satisfies are refused with [`CoreError::Infeasible`].
///
/// ```
/// use hetcoll_core::solvers::assign_items;
/// // Two hot items go to different devices, whatever their order.
/// let a = assign_items(&[9.0, 9.0, 1.0, 1.0], &[1.0, 1.0], None, 10_000).unwrap();
/// assert_ne!(a.owner[0], a.owner[1]);
/// assert!(a.exact);
/// ```
pub fn assign_items(
    loads: &[f64],
    speeds: &[f64],
    capacity: Option<&[u64]>,
    max_nodes: u64,
) -> Result<Assignment> {
    assign_items_near(loads, speeds, capacity, max_nodes, 0.0)
}

/// [`assign_items`], content with an assignment within `gap` of the best: it searches only for
/// bottlenecks below the best found over `1 + gap`, and stops at the lower bound times
/// `1 + gap`, so [`Assignment::exact`] then says the answer is at most `1 + gap` times the
/// optimum. Where callers weigh placements by a threshold of a few percent (an
/// `ExpertRebalancer`), a gap of a fraction of it ends most searches at once instead of spending
/// the node budget on proofs that change nothing. `gap = 0` is [`assign_items`].
///
/// ```
/// use hetcoll_core::solvers::{assign_items_near, assignment_time};
/// let loads: Vec<f64> = (1..=64).map(|i| (i * 37 % 23 + 1) as f64).collect();
/// let speeds = [1.0, 0.8, 0.6, 0.5, 0.5, 0.3, 0.2, 0.1];
/// let near = assign_items_near(&loads, &speeds, None, 200_000, 0.01).unwrap();
/// let lower = loads.iter().sum::<f64>() / speeds.iter().sum::<f64>();
/// assert!(near.exact);
/// assert!(assignment_time(&loads, &speeds, &near.owner).unwrap() <= 1.01 * lower * 1.0001);
/// ```
pub fn assign_items_near(
    loads: &[f64],
    speeds: &[f64],
    capacity: Option<&[u64]>,
    max_nodes: u64,
    gap: f64,
) -> Result<Assignment> {
    if !(gap.is_finite() && gap >= 0.0) {
        return Err(CoreError::invalid(
            "gap",
            format!("must be finite and >= 0, got {gap}"),
        ));
    }
    check_items(loads, speeds, capacity)?;
    let (n, p) = (loads.len(), speeds.len());
    let room: Vec<u64> = match capacity {
        None => vec![n as u64; p],
        Some(c) => c.iter().map(|&x| x.min(n as u64)).collect(),
    };
    let total_room: u64 = room.iter().sum();
    if total_room < n as u64 {
        return Err(CoreError::infeasible(
            "capacity",
            format!("the devices hold {total_room} items in all, {n} need a place"),
        ));
    }
    let mut heavy: Vec<usize> = (0..n).filter(|&i| loads[i] > 0.0).collect();
    // Heaviest first; equal loads in item order.
    heavy.sort_by(|&a, &b| loads[b].total_cmp(&loads[a]).then(a.cmp(&b)));
    let working_room: u64 = (0..p).filter(|&d| speeds[d] > 0.0).map(|d| room[d]).sum();
    if (heavy.len() as u64) > working_room {
        return Err(CoreError::infeasible(
            if working_room < total_room {
                "speeds"
            } else {
                "capacity"
            },
            format!(
                "{} items carry load but the devices of speed > 0 hold {working_room}",
                heavy.len()
            ),
        ));
    }

    let mut owner = vec![usize::MAX; n];
    let mut exact = true;
    if !heavy.is_empty() {
        let search = Search::new(loads, speeds, &room, &heavy, gap);
        let (best, proved) = search.run(max_nodes);
        exact = proved;
        for (k, &i) in heavy.iter().enumerate() {
            owner[i] = best[k];
        }
    }
    // Items without load: on the device with room whose items per speed stay lowest.
    let mut held = vec![0u64; p];
    for &d in owner.iter().filter(|&&d| d != usize::MAX) {
        held[d] += 1;
    }
    for slot in owner.iter_mut().filter(|o| **o == usize::MAX) {
        let d = (0..p)
            .filter(|&d| held[d] < room[d])
            .min_by(|&a, &b| {
                let key = |d: usize| {
                    if speeds[d] > 0.0 {
                        (held[d] + 1) as f64 / speeds[d]
                    } else {
                        f64::INFINITY
                    }
                };
                key(a).total_cmp(&key(b)).then(a.cmp(&b))
            })
            .expect("the total room was checked to hold every item");
        *slot = d;
        held[d] += 1;
    }
    Ok(Assignment { owner, exact })
}

/// The items' loads and the devices' speeds (each finite and >= 0, at least one of each) and
/// the devices' capacity, one count per device, as both solvers take them.
fn check_items(loads: &[f64], speeds: &[f64], capacity: Option<&[u64]>) -> Result<()> {
    if loads.is_empty() {
        return Err(CoreError::invalid("loads", "must hold at least one item"));
    }
    non_negative(loads, "loads")?;
    if speeds.is_empty() {
        return Err(CoreError::invalid("speeds", "must not be empty"));
    }
    non_negative(speeds, "speeds")?;
    match capacity {
        Some(c) if c.len() != speeds.len() => Err(CoreError::invalid(
            "capacity",
            format!(
                "must hold one count per device ({}), got {}",
                speeds.len(),
                c.len()
            ),
        )),
        _ => Ok(()),
    }
}

/// `owner`: one device in `[0, p)` for each of `n` items.
fn check_owner(owner: &[usize], n: usize, p: usize) -> Result<()> {
    if owner.len() != n {
        return Err(CoreError::invalid(
            "owner",
            format!("must hold one device per item ({n}), got {}", owner.len()),
        ));
    }
    match owner.iter().position(|&d| d >= p) {
        Some(i) => Err(CoreError::invalid(
            format!("owner[{i}]"),
            format!("must be a device in [0, {p}), got {}", owner[i]),
        )),
        None => Ok(()),
    }
}

/// Every entry of `values` (the argument `name`) finite and >= 0.
fn non_negative(values: &[f64], name: &str) -> Result<()> {
    match values.iter().position(|x| !x.is_finite() || *x < 0.0) {
        Some(i) => Err(CoreError::invalid(
            format!("{name}[{i}]"),
            format!("must be finite and >= 0, got {}", values[i]),
        )),
        None => Ok(()),
    }
}

/// The bottleneck of an assignment: the largest `load / speed` over the devices (a device of speed
/// 0 holding load takes forever). `owner[i]` is item `i`'s device.
pub fn assignment_time(loads: &[f64], speeds: &[f64], owner: &[usize]) -> Result<f64> {
    check_owner(owner, loads.len(), speeds.len())?;
    let mut load = vec![0.0f64; speeds.len()];
    for (i, &d) in owner.iter().enumerate() {
        load[d] += loads[i];
    }
    Ok(time_of(&load, speeds))
}

/// `owner` (each item's device) improved a step at a time, few items moving: each step moves one
/// item off the slowest device, or swaps it there for a lighter item of another device, taking
/// the step that leaves the larger of the two devices' `load / speed` lowest, and only one that
/// leaves it below the slowest device's; it stops when no step does, or after `2·n + 2` steps.
/// The slowest device's time never rises, so the result is never slower than `owner`; a device
/// only receives an item with room for it under `capacity` (the most items each device holds;
/// none: unlimited), and swaps keep every device's count. Ties go to the lower item, then the
/// lower device, a move before a swap, then the lower item swapped back: deterministic, as every
/// rank that refines the same placement must agree.
///
/// This is the local counterpart of [`assign_items`]: where that one may hand out a new
/// assignment that moves most items for a small gain, this one keeps the current one but for the
/// few steps that lower its bottleneck (an `ExpertRebalancer` weighs both).
///
/// ```
/// use hetcoll_core::solvers::{assignment_time, refine_assignment};
/// // Two hot items on device 0: one of them moves, a cold one comes back.
/// let loads = [9.0, 9.0, 1.0, 1.0];
/// let better = refine_assignment(&loads, &[1.0, 1.0], &[0, 0, 1, 1], None).unwrap();
/// assert_eq!(assignment_time(&loads, &[1.0, 1.0], &better).unwrap(), 10.0);
/// ```
pub fn refine_assignment(
    loads: &[f64],
    speeds: &[f64],
    owner: &[usize],
    capacity: Option<&[u64]>,
) -> Result<Vec<usize>> {
    check_items(loads, speeds, capacity)?;
    check_owner(owner, loads.len(), speeds.len())?;
    let (n, p) = (loads.len(), speeds.len());
    let room: Vec<u64> = capacity.map_or_else(|| vec![u64::MAX; p], <[u64]>::to_vec);
    // Each device's items, ascending (the order ties are broken in).
    let mut held: Vec<Vec<usize>> = vec![Vec::new(); p];
    let mut work = vec![0.0f64; p];
    for (i, &d) in owner.iter().enumerate() {
        held[d].push(i);
        work[d] += loads[i];
    }
    for _ in 0..2 * n + 2 {
        let (r, worst) = (0..p)
            .map(|d| (d, finish(work[d], speeds[d])))
            .fold((0, f64::NEG_INFINITY), |b, x| if x.1 > b.1 { x } else { b });
        if worst <= 0.0 {
            break;
        }
        // (the pair's time, the item leaving r, its device, the item coming back).
        let mut best: Option<(f64, usize, usize, Option<usize>)> = None;
        let mut consider = |pair: f64, e: usize, q: usize, f: Option<usize>| {
            if pair < worst && best.is_none_or(|b| pair < b.0) {
                best = Some((pair, e, q, f));
            }
        };
        for &e in &held[r] {
            let left = finish(work[r] - loads[e], speeds[r]);
            for q in (0..p).filter(|&q| q != r) {
                if (held[q].len() as u64) < room[q] {
                    let pair = left.max(finish(work[q] + loads[e], speeds[q]));
                    consider(pair, e, q, None);
                }
                for &f in held[q].iter().filter(|&&f| loads[f] < loads[e]) {
                    let here = finish(work[r] - loads[e] + loads[f], speeds[r]);
                    let there = finish(work[q] - loads[f] + loads[e], speeds[q]);
                    consider(here.max(there), e, q, Some(f));
                }
            }
        }
        let Some((_, e, q, f)) = best else { break };
        move_item(&mut held, &mut work, loads, e, r, q);
        if let Some(f) = f {
            move_item(&mut held, &mut work, loads, f, q, r);
        }
    }
    let mut out = vec![0usize; n];
    for (d, items) in held.iter().enumerate() {
        for &i in items {
            out[i] = d;
        }
    }
    Ok(out)
}

/// Item `i` from device `from` to device `to`, its list kept ascending.
fn move_item(
    held: &mut [Vec<usize>],
    work: &mut [f64],
    loads: &[f64],
    i: usize,
    from: usize,
    to: usize,
) {
    held[from].retain(|&x| x != i);
    let at = held[to].partition_point(|&x| x < i);
    held[to].insert(at, i);
    work[from] -= loads[i];
    work[to] += loads[i];
}

fn time_of(load: &[f64], speeds: &[f64]) -> f64 {
    load.iter()
        .zip(speeds)
        .map(|(&l, &s)| finish(l, s))
        .fold(0.0, f64::max)
}

/// Seconds a device of speed `s` takes over load `l`.
fn finish(l: f64, s: f64) -> f64 {
    if l <= 0.0 {
        0.0
    } else if s > 0.0 {
        l / s
    } else {
        f64::INFINITY
    }
}

/// The branch and bound over the items that carry load, heaviest first.
struct Search<'a> {
    /// Load of the `k`-th heaviest item.
    w: Vec<f64>,
    /// `rest[k]`: the load of items `k..`.
    rest: Vec<f64>,
    speeds: &'a [f64],
    room: &'a [u64],
    /// No assignment finishes sooner.
    lower: f64,
    /// `1 +` the relative gap the answer may leave to the optimum: the search looks only for
    /// bottlenecks below the best over it.
    slack: f64,
}

/// The search's mutable state.
struct State {
    load: Vec<f64>,
    left: Vec<u64>,
    at: Vec<usize>,
    best: Vec<usize>,
    best_time: f64,
    nodes: u64,
    budget: u64,
    stopped: bool,
}

impl<'a> Search<'a> {
    fn new(loads: &[f64], speeds: &'a [f64], room: &'a [u64], heavy: &[usize], gap: f64) -> Self {
        let w: Vec<f64> = heavy.iter().map(|&i| loads[i]).collect();
        let mut rest = vec![0.0; w.len() + 1];
        for k in (0..w.len()).rev() {
            rest[k] = rest[k + 1] + w[k];
        }
        let fastest = speeds.iter().copied().fold(0.0, f64::max);
        let total_speed: f64 = speeds.iter().sum();
        let lower = (rest[0] / total_speed).max(w[0] / fastest);
        Search {
            w,
            rest,
            speeds,
            room,
            lower,
            slack: 1.0 + gap,
        }
    }

    /// The best assignment of the heavy items (device of the `k`-th heaviest) and whether the
    /// search proved it optimal.
    fn run(&self, max_nodes: u64) -> (Vec<usize>, bool) {
        let p = self.speeds.len();
        let greedy = self.greedy();
        let mut load = vec![0.0; p];
        for (k, &d) in greedy.iter().enumerate() {
            load[d] += self.w[k];
        }
        let mut st = State {
            load: vec![0.0; p],
            left: self.room.to_vec(),
            at: vec![0; self.w.len()],
            best_time: time_of(&load, self.speeds),
            best: greedy,
            nodes: 0,
            budget: max_nodes,
            stopped: false,
        };
        if !self.proved(st.best_time) {
            self.branch(0, &mut st);
        }
        let proved = !st.stopped || self.proved(st.best_time);
        (st.best, proved)
    }

    fn proved(&self, t: f64) -> bool {
        t <= self.lower * self.slack.max(1.0 + PROVED)
    }

    /// Each item, heaviest first, on the device with room where it finishes soonest.
    fn greedy(&self) -> Vec<usize> {
        let p = self.speeds.len();
        let mut load = vec![0.0; p];
        let mut left = self.room.to_vec();
        self.w
            .iter()
            .map(|&w| {
                let d = (0..p)
                    .filter(|&d| left[d] > 0 && self.speeds[d] > 0.0)
                    .min_by(|&a, &b| {
                        finish(load[a] + w, self.speeds[a])
                            .total_cmp(&finish(load[b] + w, self.speeds[b]))
                            .then(a.cmp(&b))
                    })
                    .expect("the room of the devices of speed > 0 was checked");
                load[d] += w;
                left[d] -= 1;
                d
            })
            .collect()
    }

    fn branch(&self, k: usize, st: &mut State) {
        if k == self.w.len() {
            let t = time_of(&st.load, self.speeds);
            if t < st.best_time {
                st.best_time = t;
                st.best.copy_from_slice(&st.at);
            }
            return;
        }
        if st.stopped || self.proved(st.best_time) {
            return;
        }
        st.nodes += 1;
        if st.nodes > st.budget {
            st.stopped = true;
            return;
        }
        // Only assignments below the best over the slack are searched for. The fluid bound: can
        // the devices still take the rest below that?
        let bound = st.best_time / self.slack;
        let free: f64 = (0..self.speeds.len())
            .filter(|&d| st.left[d] > 0)
            .map(|d| (bound * self.speeds[d] - st.load[d]).max(0.0))
            .sum();
        if self.rest[k] > free * (1.0 + PROVED) {
            return;
        }
        let w = self.w[k];
        let mut tried: Vec<usize> = (0..self.speeds.len())
            .filter(|&d| st.left[d] > 0 && self.speeds[d] > 0.0)
            .filter(|&d| finish(st.load[d] + w, self.speeds[d]) < bound)
            .collect();
        tried.sort_by(|&a, &b| {
            finish(st.load[a] + w, self.speeds[a])
                .total_cmp(&finish(st.load[b] + w, self.speeds[b]))
                .then(a.cmp(&b))
        });
        for (j, &d) in tried.iter().enumerate() {
            // Interchangeable with a device tried already: the same subtree.
            let twin = tried[..j].iter().any(|&e| {
                self.speeds[e] == self.speeds[d]
                    && st.left[e] == st.left[d]
                    && st.load[e] == st.load[d]
            });
            if twin || finish(st.load[d] + w, self.speeds[d]) >= st.best_time / self.slack {
                continue;
            }
            st.load[d] += w;
            st.left[d] -= 1;
            st.at[k] = d;
            let before = st.load[d] - w;
            self.branch(k + 1, st);
            st.load[d] = before;
            st.left[d] += 1;
            if st.stopped {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The best bottleneck over every assignment that fits.
    fn brute_force(loads: &[f64], speeds: &[f64], room: Option<&[u64]>) -> Option<f64> {
        let (n, p) = (loads.len(), speeds.len());
        let mut best: Option<f64> = None;
        let mut owner = vec![0usize; n];
        loop {
            let fits = room.is_none_or(|c| {
                (0..p).all(|d| owner.iter().filter(|&&o| o == d).count() as u64 <= c[d])
            });
            if fits {
                let t = assignment_time(loads, speeds, &owner).unwrap();
                if t.is_finite() && best.is_none_or(|b| t < b) {
                    best = Some(t);
                }
            }
            let mut i = 0;
            while i < n {
                owner[i] += 1;
                if owner[i] < p {
                    break;
                }
                owner[i] = 0;
                i += 1;
            }
            if i == n {
                return best;
            }
        }
    }

    #[test]
    fn separates_hot_items() {
        let a = assign_items(&[1.0, 9.0, 9.0, 1.0], &[1.0, 1.0], None, 1000).unwrap();
        assert_ne!(a.owner[1], a.owner[2]);
        assert_eq!(
            assignment_time(&[1.0, 9.0, 9.0, 1.0], &[1.0, 1.0], &a.owner).unwrap(),
            10.0
        );
        assert!(a.exact);
    }

    #[test]
    fn beats_greedy() {
        // LPT puts 3,3 then 2,2,2 as 3+2+2 / 3+2 = 7; the optimum is 3+3 / 2+2+2 = 6.
        let loads = [3.0, 3.0, 2.0, 2.0, 2.0];
        let a = assign_items(&loads, &[1.0, 1.0], None, 10_000).unwrap();
        assert_eq!(assignment_time(&loads, &[1.0, 1.0], &a.owner).unwrap(), 6.0);
        assert!(a.exact);
    }

    #[test]
    fn zero_loads_spread_by_speed_and_zero_speeds_hold_no_load() {
        let a = assign_items(&[0.0; 6], &[2.0, 1.0, 0.0], None, 100).unwrap();
        let count = |d| a.owner.iter().filter(|&&o| o == d).count();
        assert_eq!((count(0), count(1), count(2)), (4, 2, 0));
        let b = assign_items(&[1.0, 0.0, 0.0], &[1.0, 0.0], Some(&[1, 2]), 100).unwrap();
        assert_eq!(b.owner, vec![0, 1, 1]);
    }

    #[test]
    fn budget_spent_returns_greedy_or_better() {
        let loads: Vec<f64> = (0..40).map(|i| ((i * 37) % 17 + 1) as f64).collect();
        let speeds = [1.0, 0.7, 0.45, 0.3];
        let a = assign_items(&loads, &speeds, None, 1).unwrap();
        let mut h: Vec<usize> = (0..40).collect();
        h.sort_by(|&x, &y| loads[y].total_cmp(&loads[x]).then(x.cmp(&y)));
        let g = Search::new(&loads, &speeds, &[40; 4], &h, 0.0).greedy();
        let mut load = [0.0; 4];
        let mut sorted: Vec<f64> = loads.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        for (k, &d) in g.iter().enumerate() {
            load[d] += sorted[k];
        }
        assert!(assignment_time(&loads, &speeds, &a.owner).unwrap() <= time_of(&load, &speeds));
    }

    #[test]
    fn bad_input_names_the_argument() {
        let err = |r: Result<Assignment>| r.unwrap_err().argument().to_string();
        assert_eq!(err(assign_items(&[], &[1.0], None, 10)), "loads");
        assert_eq!(err(assign_items(&[f64::NAN], &[1.0], None, 10)), "loads[0]");
        assert_eq!(err(assign_items(&[1.0], &[], None, 10)), "speeds");
        assert_eq!(err(assign_items(&[1.0], &[-1.0], None, 10)), "speeds[0]");
        assert_eq!(err(assign_items(&[1.0], &[1.0], Some(&[]), 10)), "capacity");
        for gap in [-0.1, f64::NAN, f64::INFINITY] {
            assert_eq!(err(assign_items_near(&[1.0], &[1.0], None, 10, gap)), "gap");
        }
        assert_eq!(
            err(assign_items(&[1.0, 1.0], &[1.0, 1.0], Some(&[1, 0]), 10)),
            "capacity"
        );
        assert_eq!(
            err(assign_items(&[1.0, 1.0], &[1.0, 0.0], Some(&[1, 2]), 10)),
            "speeds"
        );
        assert_eq!(
            err(assignment_time(&[1.0], &[1.0], &[1]).map(|_| Assignment {
                owner: vec![],
                exact: true
            })),
            "owner[0]"
        );
    }

    /// Whether some move or swap off the slowest device lowers the pair's larger time below it
    /// (what `refine_assignment` stops without), by brute force over every step.
    fn improving_step_left(loads: &[f64], speeds: &[f64], owner: &[usize], room: &[u64]) -> bool {
        let p = speeds.len();
        let work = |o: &[usize], d: usize| -> f64 {
            o.iter()
                .zip(loads)
                .filter(|(&x, _)| x == d)
                .map(|(_, &w)| w)
                .sum()
        };
        let times: Vec<f64> = (0..p).map(|d| finish(work(owner, d), speeds[d])).collect();
        let worst = times.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let r = times.iter().position(|&t| t == worst).unwrap();
        let count = |d: usize| owner.iter().filter(|&&o| o == d).count() as u64;
        for e in (0..owner.len()).filter(|&e| owner[e] == r) {
            for q in (0..p).filter(|&q| q != r) {
                let mut moved = owner.to_vec();
                moved[e] = q;
                let pair =
                    |o: &[usize]| finish(work(o, r), speeds[r]).max(finish(work(o, q), speeds[q]));
                if count(q) < room[q] && pair(&moved) < worst * (1.0 - 1e-9) {
                    return true;
                }
                for f in (0..owner.len()).filter(|&f| owner[f] == q && loads[f] < loads[e]) {
                    let mut swapped = moved.clone();
                    swapped[f] = r;
                    if pair(&swapped) < worst * (1.0 - 1e-9) {
                        return true;
                    }
                }
            }
        }
        false
    }

    #[test]
    fn refine_moves_few_items_and_keeps_what_cannot_improve() {
        // Device 0 holds both hot items: one swaps with a cold one, the rest stay.
        let loads = [9.0, 9.0, 1.0, 1.0, 1.0, 1.0];
        let start = [0, 0, 0, 1, 1, 1];
        let better = refine_assignment(&loads, &[1.0, 1.0], &start, None).unwrap();
        let moved = start.iter().zip(&better).filter(|(a, b)| a != b).count();
        assert_eq!(assignment_time(&loads, &[1.0, 1.0], &better).unwrap(), 11.0);
        assert!(moved <= 3, "{better:?}");
        // Already balanced: nothing moves. Full devices take swaps only.
        let even = [0, 1, 0, 1, 0, 1];
        assert_eq!(
            refine_assignment(&loads, &[1.0, 1.0], &even, None).unwrap(),
            even
        );
        let capped = refine_assignment(&loads, &[1.0, 1.0], &start, Some(&[3, 3])).unwrap();
        assert_eq!(capped.iter().filter(|&&d| d == 0).count(), 3);
        assert!(assignment_time(&loads, &[1.0, 1.0], &capped).unwrap() < 19.0);
        // A device of speed 0 holding one loaded item hands it on; holding two, it keeps them
        // (either step alone leaves it infinitely slow: `assign_items` places them anew).
        let off = refine_assignment(&[0.0, 2.0], &[1.0, 0.0], &[1, 1], None).unwrap();
        assert_eq!(off, vec![1, 0]);
        let stuck = refine_assignment(&[1.0, 2.0], &[1.0, 0.0], &[1, 1], None).unwrap();
        assert_eq!(stuck, vec![1, 1]);
    }

    #[test]
    fn refine_names_bad_input() {
        let err = |r: Result<Vec<usize>>| r.unwrap_err().argument().to_string();
        assert_eq!(err(refine_assignment(&[], &[1.0], &[], None)), "loads");
        assert_eq!(
            err(refine_assignment(&[-1.0], &[1.0], &[0], None)),
            "loads[0]"
        );
        assert_eq!(err(refine_assignment(&[1.0], &[], &[0], None)), "speeds");
        assert_eq!(
            err(refine_assignment(&[1.0], &[f64::INFINITY], &[0], None)),
            "speeds[0]"
        );
        assert_eq!(err(refine_assignment(&[1.0], &[1.0], &[], None)), "owner");
        assert_eq!(
            err(refine_assignment(&[1.0], &[1.0], &[1], None)),
            "owner[0]"
        );
        assert_eq!(
            err(refine_assignment(&[1.0], &[1.0], &[0], Some(&[]))),
            "capacity"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// Never slower than the start, never over a device's room (unless it started over),
        /// and no improving step left.
        #[test]
        fn refine_never_slower_within_room_and_locally_optimal(
            loads in prop::collection::vec(
                prop_oneof![Just(0.0), 0.0f64..10.0, (1u32..5).prop_map(f64::from)],
                1..10,
            ),
            speeds in prop::collection::vec(prop_oneof![Just(1.0f64), Just(0.0), 0.1f64..4.0], 1..4),
            seed in any::<u64>(),
            cap in prop::collection::vec(0u64..6, 1..4),
            limited in any::<bool>(),
        ) {
            let p = speeds.len();
            let start: Vec<usize> = (0..loads.len())
                .map(|i| ((seed >> (i % 32)) as usize + i * 7) % p)
                .collect();
            let room: Vec<u64> = (0..p).map(|d| cap[d % cap.len()]).collect();
            let limit = limited.then_some(room.as_slice());
            let got = refine_assignment(&loads, &speeds, &start, limit).unwrap();
            let before = assignment_time(&loads, &speeds, &start).unwrap();
            let after = assignment_time(&loads, &speeds, &got).unwrap();
            prop_assert!(after <= before, "{after} > {before}");
            let count = |o: &[usize], d: usize| o.iter().filter(|&&x| x == d).count() as u64;
            let unlimited = vec![u64::MAX; p];
            let bound = if limited { &room } else { &unlimited };
            for (d, &cap) in bound.iter().enumerate() {
                prop_assert!(count(&got, d) <= cap.max(count(&start, d)));
            }
            prop_assert!(!improving_step_left(&loads, &speeds, &got, bound), "{got:?}");
            prop_assert_eq!(refine_assignment(&loads, &speeds, &start, limit).unwrap(), got);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Within a gap, the answer is proved at most `1 + gap` times the brute-force optimum.
        #[test]
        fn near_within_its_gap_of_brute_force(
            loads in prop::collection::vec(prop_oneof![Just(0.0), 0.0f64..10.0], 1..8),
            speeds in prop::collection::vec(prop_oneof![Just(1.0f64), 0.1f64..4.0], 1..4),
            gap in prop_oneof![Just(0.0), 0.0f64..0.3],
        ) {
            let a = assign_items_near(&loads, &speeds, None, 1_000_000, gap).unwrap();
            let best = brute_force(&loads, &speeds, None).unwrap();
            prop_assert!(a.exact);
            let t = assignment_time(&loads, &speeds, &a.owner).unwrap();
            prop_assert!(t <= best * (1.0 + gap) * (1.0 + 1e-9), "{t} vs {best}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        #[test]
        fn optimal_against_brute_force(
            loads in prop::collection::vec(
                prop_oneof![Just(0.0), 0.0f64..10.0, (1u32..5).prop_map(f64::from)],
                1..8,
            ),
            speeds in prop::collection::vec(prop_oneof![Just(1.0f64), 0.1f64..4.0], 1..4),
            cap in prop::collection::vec(0u64..5, 1..4),
            limited in any::<bool>(),
        ) {
            let p = speeds.len();
            let room: Vec<u64> = (0..p).map(|d| cap[d % cap.len()]).collect();
            let room = limited.then_some(room.as_slice());
            let got = assign_items(&loads, &speeds, room, 1_000_000);
            match brute_force(&loads, &speeds, room) {
                None => prop_assert!(got.is_err()),
                Some(best) => {
                    let a = got.unwrap();
                    prop_assert!(a.exact);
                    let t = assignment_time(&loads, &speeds, &a.owner).unwrap();
                    prop_assert!(t <= best * (1.0 + 1e-9), "{t} vs {best}");
                    if let Some(c) = room {
                        for (d, &cap) in c.iter().enumerate() {
                            prop_assert!(a.owner.iter().filter(|&&o| o == d).count() as u64 <= cap);
                        }
                    }
                }
            }
        }
    }
}
