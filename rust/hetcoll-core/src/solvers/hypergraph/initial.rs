//! Initial partitioning of the coarsest hypergraph: recursive bisection, the best of several tries
//! per bisection, and a weight-only packing used as the last resort for balance.

use std::collections::BinaryHeap;

use super::coarsen::{coarsen, VERTICES_PER_BLOCK};
use super::refine::{fm, rebalance, State};
use super::{uncoarsen, Hypergraph, Rng};

/// Tries per bisection: greedy growing from random seeds alternating with random assignments.
const TRIES: usize = 8;

/// Blocks `0..budget.targets.len()` of the vertices of `hg` by recursive bisection. Each
/// bisection gets an adaptive imbalance `ε'` such that the imbalances compound to at most the
/// final `ε` over the `⌈log2 k⌉` levels (KaHyPar's rule, with unequal targets).
pub(super) fn initial_partition(hg: &Hypergraph, budget: &Budget<'_>, rng: &mut Rng) -> Vec<u32> {
    let n = hg.num_vertices();
    let mut parts = vec![0u32; n];
    let ids: Vec<u32> = (0..n as u32).collect();
    recurse(
        hg.clone(),
        &ids,
        0,
        budget.targets.len(),
        budget,
        &mut parts,
        rng,
    );
    parts
}

/// What recursive bisection splits by.
pub(super) struct Budget<'a> {
    /// Each block's share of `total`.
    pub targets: &'a [f64],
    pub epsilon: f64,
    /// The weight the targets are shares of (exceeds the hypergraph's when vertices were set
    /// aside).
    pub total: f64,
    /// The final k-way capacities: a side never gets more room than its blocks have together
    /// (the adaptive formula can round a hair above a single block's capacity).
    pub caps: &'a [f64],
    /// Whether bisections of hypergraphs with large nets are multilevel too (see
    /// [`multilevel_bisect`]).
    pub multilevel_large_nets: bool,
}

fn recurse(
    sub: Hypergraph,
    ids: &[u32],
    lo: usize,
    hi: usize,
    budget: &Budget<'_>,
    parts: &mut [u32],
    rng: &mut Rng,
) {
    if hi - lo == 1 {
        for &v in ids {
            parts[v as usize] = lo as u32;
        }
        return;
    }
    let mid = lo + (hi - lo) / 2;
    let t_sub: f64 = budget.targets[lo..hi].iter().sum();
    let t_left: f64 = budget.targets[lo..mid].iter().sum();
    let w_sub = sub.total_weight();
    let caps = if w_sub > 0.0 {
        let depth = (usize::BITS - (hi - lo - 1).leading_zeros()) as f64; // ⌈log2(hi − lo)⌉
        let base = (1.0 + budget.epsilon) * t_sub * budget.total / w_sub;
        let eps = (base.powf(1.0 / depth) - 1.0).max(0.0);
        [
            (1.0 + eps) * (t_left / t_sub) * w_sub,
            (1.0 + eps) * ((t_sub - t_left) / t_sub) * w_sub,
        ]
    } else {
        [f64::INFINITY, f64::INFINITY]
    };
    let caps = [
        caps[0].min(budget.caps[lo..mid].iter().sum()),
        caps[1].min(budget.caps[mid..hi].iter().sum()),
    ];
    let side = multilevel_bisect(&sub, &caps, budget.multilevel_large_nets, rng);
    for s in 0..2u32 {
        let (child, child_ids) = extract(&sub, ids, &side, s);
        let (a, b) = if s == 0 { (lo, mid) } else { (mid, hi) };
        recurse(child, &child_ids, a, b, budget, parts, rng);
    }
}

/// A 2-way split of `hg` under `caps`: multilevel (Mt-KaHyPar's bisections) when `hg` has many
/// vertices and small nets, else the best of the flat tries of [`bisect`].
///
/// The coarsest level has `160·k` vertices, so at k = 8 the first bisection splits 1280 of them,
/// and on a mesh-like hypergraph (kNN points, a stencil) flat tries with FM at that size land far
/// apart: 4-way cuts of one 2-D kNN coarsest level ranged over 170-230 between runs. Coarsening
/// the side to `2·160` vertices, bisecting there and refining on the way back up narrows that
/// and costs less than the flat tries on the full side. On hypergraphs with large nets (a CNN's
/// feature maps, power-law nets) clustering found nothing the flat tries' BFS sweeps and growing
/// miss on large inputs, and rating over large nets is costly: those stay flat unless
/// `large_nets` (small inputs, where fewer multilevel runs replace more flat ones).
fn multilevel_bisect(
    hg: &Hypergraph,
    caps: &[f64; 2],
    large_nets: bool,
    rng: &mut Rng,
) -> Vec<u32> {
    let n = hg.num_vertices();
    // Pin-weighted mean net size, `Σ|e|² / Σ|e|`: the size of the net a pin is in, on average.
    let squares: usize = (0..hg.num_nets()).map(|e| hg.net_size(e).pow(2)).sum();
    let net_size = squares as f64 / hg.pins.len().max(1) as f64;
    if n <= 4 * VERTICES_PER_BLOCK || (net_size > SMALL_NETS && !large_nets) {
        return bisect(hg, caps, rng);
    }
    // One group: the communities were the input's; here every cluster may form.
    let groups = vec![0u32; n];
    let hierarchy = coarsen(hg, 2, caps, None, &groups, rng);
    let coarsest = hierarchy.last().map_or(hg, |level| &level.coarse);
    let parts = bisect(coarsest, caps, rng);
    uncoarsen(hg, &hierarchy, parts, caps, None, None, rng)
}

/// Bisections of hypergraphs whose pin-weighted mean net size is at most this are multilevel
/// (kNN: 3-4, stencil: 3, random matrices: 4-6; power-law and CNN coarsest levels: 50-300).
const SMALL_NETS: f64 = 16.0;

/// The best 2-way split of `hg` under `caps` over several tries: balanced before unbalanced, then
/// smallest km1.
fn bisect(hg: &Hypergraph, caps: &[f64; 2], rng: &mut Rng) -> Vec<u32> {
    let n = hg.num_vertices();
    let mut best: Option<(bool, f64, Vec<u32>)> = None;
    let total = hg.total_weight();
    let ideal_right = total * caps[1] / (caps[0] + caps[1]);
    let tries = if n < super::SMALL { 2 * TRIES } else { TRIES };
    for attempt in 0..tries + 2 {
        let start = if attempt >= tries {
            bfs_sweep(hg, ideal_right, caps, attempt > tries, rng)
        } else if attempt % 3 == 2 {
            random_split(hg, ideal_right, rng)
        } else {
            grow(hg, ideal_right, caps, rng)
        };
        let mut state = State::new(hg, start, caps);
        let ok = state.is_balanced() || rebalance(&mut state, rng);
        fm(&mut state, rng, 4);
        let cut = state.km1();
        let better = match &best {
            None => true,
            Some((b_ok, b_cut, _)) => (ok && !b_ok) || (ok == *b_ok && cut < *b_cut),
        };
        if better {
            best = Some((ok, cut, state.parts));
        }
        if n < 2 {
            break;
        }
    }
    best.map(|(_, _, p)| p).unwrap_or_else(|| vec![0; n])
}

/// Greedy hypergraph growing: block 1 grows from a random seed, always taking the vertex whose
/// move from block 0 gains most, until it reaches its ideal weight.
fn grow(hg: &Hypergraph, ideal_right: f64, caps: &[f64; 2], rng: &mut Rng) -> Vec<u32> {
    let n = hg.num_vertices();
    let mut state = State::new(hg, vec![0; n], caps);
    let mut heap: BinaryHeap<(Key, u32)> = BinaryHeap::new();
    let mut weight = 0.0;
    let mut order: Vec<u32> = (0..n as u32).collect();
    rng.shuffle(&mut order);
    let mut next_seed = 0usize;
    let mut woken: Vec<u32> = Vec::new();
    let mut stamp = vec![0u64; n];
    let mut stamp_now = 0u64;
    while weight < ideal_right {
        let v = loop {
            match heap.pop() {
                Some((Key(g), v)) => {
                    if state.parts[v as usize] == 1 {
                        continue;
                    }
                    let m = state
                        .best_move(v as usize, true)
                        .map_or(f64::MIN, |m| m.gain);
                    if m < g {
                        heap.push((Key(m), v));
                        continue;
                    }
                    break Some(v);
                }
                None => {
                    // Disconnected from block 1 so far: start from a fresh random seed.
                    while next_seed < n && state.parts[order[next_seed] as usize] == 1 {
                        next_seed += 1;
                    }
                    break order.get(next_seed).copied();
                }
            }
        };
        let Some(v) = v else { break };
        let w = hg.vertex_weights[v as usize];
        if weight + w > caps[1] {
            // Too heavy for block 1: it stays in block 0.
            if heap.is_empty() && next_seed < n && order[next_seed] == v {
                next_seed += 1;
            }
            continue;
        }
        woken.clear();
        state.apply(v as usize, 1, |e| woken.extend_from_slice(hg.pins(e)));
        weight += w;
        stamp_now += 1;
        for &u in &woken {
            if state.parts[u as usize] == 0 && stamp[u as usize] != stamp_now {
                stamp[u as usize] = stamp_now;
                if let Some(m) = state.best_move(u as usize, true) {
                    heap.push((Key(m.gain), u));
                }
            }
        }
    }
    state.parts
}

/// Breadth-first sweep: vertices in BFS order from a pseudo-peripheral vertex (the last one a BFS
/// from a random vertex reaches) join block 1 one by one; of all these prefixes, the one with the
/// smallest cut among those leaving both blocks within their limits is taken. On layered
/// hypergraphs (a CNN's chain of layers) BFS order is layer order, so the sweep sees every cut
/// between two layers and picks the cheapest balanced one — which greedy growing, following the
/// best gain from a random seed, and FM, moving one vertex at a time, rarely reach.
fn bfs_sweep(
    hg: &Hypergraph,
    ideal_right: f64,
    caps: &[f64; 2],
    relaxed: bool,
    rng: &mut Rng,
) -> Vec<u32> {
    let n = hg.num_vertices();
    let mut parts = vec![0u32; n];
    if n == 0 {
        return parts;
    }
    let start = rng.below(n);
    let far = bfs_order(hg, start).last().copied().unwrap_or(start as u32) as usize;
    let order = bfs_order(hg, far);
    let total = hg.total_weight();
    // Relaxed: prefixes up to the blocks' total slack beyond either limit count too, for the
    // rebalancing in `bisect` to repair by moving the cheapest vertices (a cut between two layers
    // that is slightly too unbalanced, plus a few light vertices moved over, can beat every
    // balanced prefix).
    let margin = if relaxed {
        (caps[0] + caps[1] - total).max(0.0)
    } else {
        0.0
    };
    let (lowest, highest) = (total - caps[0] - margin, caps[1] + margin);
    // Pins of each net in block 1 so far; the cut of the current prefix.
    let mut in_right = vec![0usize; hg.num_nets()];
    let (mut weight, mut cut) = (0.0, 0.0);
    let mut best: Option<(f64, f64, usize)> = None; // (cut, distance from ideal, prefix length)
    for (i, &v) in order.iter().enumerate() {
        let v = v as usize;
        let w = hg.vertex_weights[v];
        if weight + w > highest {
            break;
        }
        weight += w;
        for &e in hg.nets(v) {
            let e = e as usize;
            let size = hg.net_size(e);
            let was_cut = in_right[e] > 0 && in_right[e] < size;
            in_right[e] += 1;
            let is_cut = in_right[e] < size;
            match (was_cut, is_cut) {
                (false, true) => cut += hg.net_weights[e],
                (true, false) => cut -= hg.net_weights[e],
                _ => {}
            }
        }
        if weight >= lowest {
            let key = (cut, (weight - ideal_right).abs(), i + 1);
            if best.is_none_or(|b| key.0 < b.0 || (key.0 == b.0 && key.1 < b.1)) {
                best = Some(key);
            }
        }
    }
    let take = best.map_or_else(
        || {
            // No prefix fits both limits (heavy vertices): up to the ideal weight, as growing does.
            let mut w = 0.0;
            order
                .iter()
                .take_while(|&&v| {
                    w += hg.vertex_weights[v as usize];
                    w <= ideal_right
                })
                .count()
        },
        |b| b.2,
    );
    for &v in &order[..take] {
        parts[v as usize] = 1;
    }
    parts
}

/// Every vertex in breadth-first order from `start`, then the other components' from their
/// lowest vertex.
pub(super) fn bfs_order(hg: &Hypergraph, start: usize) -> Vec<u32> {
    let n = hg.num_vertices();
    let mut seen = vec![false; n];
    let mut seen_net = vec![false; hg.num_nets()];
    let mut order: Vec<u32> = Vec::with_capacity(n);
    let mut next_root = 0;
    let mut root = start;
    loop {
        seen[root] = true;
        order.push(root as u32);
        let mut i = order.len() - 1;
        while i < order.len() {
            let v = order[i] as usize;
            i += 1;
            for &e in hg.nets(v) {
                if seen_net[e as usize] {
                    continue;
                }
                seen_net[e as usize] = true;
                for &u in hg.pins(e as usize) {
                    if !seen[u as usize] {
                        seen[u as usize] = true;
                        order.push(u);
                    }
                }
            }
        }
        while next_root < n && seen[next_root] {
            next_root += 1;
        }
        if next_root == n {
            return order;
        }
        root = next_root;
    }
}

/// Random vertices go to block 1 until it reaches its ideal weight.
fn random_split(hg: &Hypergraph, ideal_right: f64, rng: &mut Rng) -> Vec<u32> {
    let n = hg.num_vertices();
    let mut order: Vec<u32> = (0..n as u32).collect();
    rng.shuffle(&mut order);
    let mut parts = vec![0u32; n];
    let mut weight = 0.0;
    for &v in &order {
        if weight >= ideal_right {
            break;
        }
        parts[v as usize] = 1;
        weight += hg.vertex_weights[v as usize];
    }
    parts
}

/// `f64` ordered by `total_cmp`, for heaps.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Key(f64);
impl Eq for Key {}
impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Key {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// The sub-hypergraph induced by the vertices on `side`, with nets cut down to their pins there
/// (cut-net splitting: what km1 still charges inside the side), and the input id (`ids`) of each
/// of its vertices.
fn extract(hg: &Hypergraph, ids: &[u32], parts: &[u32], side: u32) -> (Hypergraph, Vec<u32>) {
    let (sub, here) = hg.induced_by(|v| parts[v] == side);
    (sub, here.iter().map(|&v| ids[v as usize]).collect())
}

/// Packing that ignores the cut, heaviest vertex first (and, with `mem`, only into blocks with
/// memory left for it), tried several ways: into the block with the most
/// room left (worst fit), with the least room that still fits (best fit), the first that fits
/// with blocks by decreasing capacity (first fit), then first fit over shuffled block orders and
/// shuffled ties. `None` if every way leaves some vertex without a block (bin packing is NP-hard:
/// this can miss a packing that exists).
pub(super) fn pack(hg: &Hypergraph, caps: &[f64], mem: Option<&[f64]>) -> Option<Vec<u32>> {
    let k = caps.len();
    let mut by_capacity: Vec<usize> = (0..k).collect();
    by_capacity.sort_by(|&a, &b| caps[b].total_cmp(&caps[a]).then(a.cmp(&b)));
    // Vertices by decreasing weight; with memory limits also by decreasing memory, and by the sum
    // of both as shares of their capacities (two-dimensional packing has no single right order).
    let total_memory: f64 = mem.map_or(0.0, |m| m.iter().sum());
    let total_caps: f64 = caps.iter().sum();
    let keys: Vec<Box<dyn Fn(usize) -> f64>> = if mem.is_some() {
        vec![
            Box::new(|v| hg.vertex_weights[v]),
            Box::new(|v| hg.memory(v)),
            Box::new(move |v| {
                hg.vertex_weights[v] / total_caps
                    + hg.memory(v) / total_memory.max(f64::MIN_POSITIVE)
            }),
        ]
    } else {
        vec![Box::new(|v| hg.vertex_weights[v])]
    };
    for key in &keys {
        if let Some(parts) = pack_in_order(hg, caps, mem, &by_capacity, key) {
            return Some(parts);
        }
    }
    None
}

/// [`pack`] with vertices in decreasing `key` (ties shuffled in the restarts).
fn pack_in_order(
    hg: &Hypergraph,
    caps: &[f64],
    mem: Option<&[f64]>,
    by_capacity: &[usize],
    key: &dyn Fn(usize) -> f64,
) -> Option<Vec<u32>> {
    let n = hg.num_vertices();
    let k = caps.len();
    let mut order: Vec<u32> = (0..n as u32).collect();
    order.sort_by(|&a, &b| key(b as usize).total_cmp(&key(a as usize)).then(a.cmp(&b)));
    let mut rng = Rng::new(0x9ac4);
    for attempt in 0..3 + PACKING_RESTARTS {
        let mut blocks = by_capacity.to_vec();
        if attempt >= 3 {
            rng.shuffle(&mut blocks);
            shuffle_ties(&mut order, key, &mut rng);
        }
        let mut room = caps.to_vec();
        let mut memory_room = mem.map_or_else(|| vec![f64::INFINITY; k], <[f64]>::to_vec);
        let mut parts = vec![0u32; n];
        let mut ok = true;
        for &v in &order {
            let w = hg.vertex_weights[v as usize];
            let m = hg.memory(v as usize);
            let fits = blocks
                .iter()
                .copied()
                .filter(|&b| w <= room[b] && m <= memory_room[b]);
            let chosen = match attempt {
                0 => fits.max_by(|&x, &y| room[x].total_cmp(&room[y]).then(y.cmp(&x))),
                1 => fits.min_by(|&x, &y| room[x].total_cmp(&room[y]).then(x.cmp(&y))),
                _ => fits.into_iter().next(),
            };
            let Some(b) = chosen else {
                ok = false;
                break;
            };
            parts[v as usize] = b as u32;
            room[b] -= w;
            memory_room[b] -= m;
        }
        if ok {
            return Some(parts);
        }
    }
    None
}

/// Randomised first-fit restarts of [`pack`] after its three fixed rules.
const PACKING_RESTARTS: usize = 64;

/// Shuffle runs of equal `key` in `order` (sorted by decreasing key), keeping the sort.
fn shuffle_ties(order: &mut [u32], key: &dyn Fn(usize) -> f64, rng: &mut Rng) {
    let mut start = 0;
    while start < order.len() {
        let w = key(order[start] as usize);
        let mut end = start + 1;
        while end < order.len() && key(order[end] as usize) == w {
            end += 1;
        }
        rng.shuffle(&mut order[start..end]);
        start = end;
    }
}
