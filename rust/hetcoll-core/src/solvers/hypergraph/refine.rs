//! Refinement of a k-way partition: rebalancing and FM, both with km1 gains.
//!
//! The gain of moving `v` from block `a` to block `b` is
//! `Σ_{e ∋ v, Φ(e,a) = 1} w(e) − Σ_{e ∋ v, Φ(e,b) = 0} w(e)` (`Φ(e,x)`: pins of `e` in block `x`):
//! nets that leave `a` entirely stop paying for it, nets that did not touch `b` start paying.

use std::collections::BinaryHeap;

use super::{Hypergraph, Rng};

/// A partition with its block weights, pin counts and a gain cache, kept consistent under moves.
///
/// The cache makes a vertex's best move `O(k)`: `conn[v·k + b]` is the weight of `v`'s nets that
/// touch block `b`, `benefit[v]` the weight of its nets of which it is the last pin in its block,
/// so the gain of moving `v` to `b` is `benefit[v] + conn[v·k + b] − incident[v]`. A move updates
/// the cache only along nets whose pin counts cross 0, 1 or 2 (the delta-gain rules of FM).
pub(super) struct State<'h> {
    pub hg: &'h Hypergraph,
    pub k: usize,
    pub parts: Vec<u32>,
    pub block_weights: Vec<f64>,
    /// `Φ(e, b)` at `e · k + b`.
    pin_counts: Vec<u32>,
    pub caps: Vec<f64>,
    /// Memory held by each block and the most it may hold; both empty when memory is not limited.
    block_memory: Vec<f64>,
    memory_caps: Vec<f64>,
    conn: Vec<f64>,
    benefit: Vec<f64>,
    incident: Vec<f64>,
}

/// A move and its gain.
#[derive(Clone, Copy, Debug)]
pub(super) struct Move {
    pub gain: f64,
    pub to: u32,
}

impl<'h> State<'h> {
    pub fn new(hg: &'h Hypergraph, parts: Vec<u32>, caps: &[f64]) -> Self {
        let k = caps.len();
        let n = hg.num_vertices();
        let mut block_weights = vec![0.0; k];
        for (v, &b) in parts.iter().enumerate() {
            block_weights[b as usize] += hg.vertex_weights[v];
        }
        let mut pin_counts = vec![0u32; hg.num_nets() * k];
        let mut conn = vec![0.0; n * k];
        let mut benefit = vec![0.0; n];
        let mut incident = vec![0.0; n];
        let mut present: Vec<usize> = Vec::with_capacity(k);
        for e in 0..hg.num_nets() {
            let w = hg.net_weights[e];
            let row = &mut pin_counts[e * k..e * k + k];
            present.clear();
            for &v in hg.pins(e) {
                let b = parts[v as usize] as usize;
                if row[b] == 0 {
                    present.push(b);
                }
                row[b] += 1;
            }
            for &v in hg.pins(e) {
                let v = v as usize;
                incident[v] += w;
                if row[parts[v] as usize] == 1 {
                    benefit[v] += w;
                }
                for &b in &present {
                    conn[v * k + b] += w;
                }
            }
        }
        State {
            hg,
            k,
            parts,
            block_weights,
            pin_counts,
            caps: caps.to_vec(),
            block_memory: Vec::new(),
            memory_caps: Vec::new(),
            conn,
            benefit,
            incident,
        }
    }

    /// Limit each block's memory to `memory_caps[b]` from now on (moves that would exceed it are
    /// not offered unless full blocks are allowed; `is_balanced` and rebalancing include it).
    pub fn limit_memory(&mut self, memory_caps: &[f64]) {
        let mut used = vec![0.0; self.k];
        for (v, &b) in self.parts.iter().enumerate() {
            used[b as usize] += self.hg.memory(v);
        }
        self.block_memory = used;
        self.memory_caps = memory_caps.to_vec();
    }

    /// Whether block `b` holds more than it may (weight or memory).
    fn overloaded(&self, b: usize) -> bool {
        self.block_weights[b] > self.caps[b]
            || (!self.memory_caps.is_empty() && self.block_memory[b] > self.memory_caps[b])
    }

    /// What moving `v` out relieves its block of: its weight if the block is too heavy, else its
    /// memory (the block holds too much memory).
    fn relief(&self, v: usize) -> f64 {
        let a = self.parts[v] as usize;
        if self.block_weights[a] > self.caps[a] {
            self.hg.vertex_weights[v]
        } else {
            self.hg.memory(v)
        }
    }

    /// Room left in block `b`: weight, and memory (infinite when not limited).
    pub fn room(&self, b: usize) -> (f64, f64) {
        let memory = if self.memory_caps.is_empty() {
            f64::INFINITY
        } else {
            self.memory_caps[b] - self.block_memory[b]
        };
        (self.caps[b] - self.block_weights[b], memory)
    }

    /// Whether `v` (not in `b`) fits in block `b`: weight and memory.
    #[inline]
    fn fits(&self, v: usize, b: usize) -> bool {
        self.block_weights[b] + self.hg.vertex_weights[v] <= self.caps[b]
            && (self.memory_caps.is_empty()
                || self.block_memory[b] + self.hg.memory(v) <= self.memory_caps[b])
    }

    #[inline]
    pub fn phi(&self, e: usize, b: usize) -> u32 {
        self.pin_counts[e * self.k + b]
    }

    pub fn km1(&self) -> f64 {
        (0..self.hg.num_nets())
            .map(|e| {
                let lambda = (0..self.k).filter(|&b| self.phi(e, b) > 0).count();
                self.hg.net_weights[e] * (lambda as f64 - 1.0)
            })
            .sum()
    }

    pub fn is_balanced(&self) -> bool {
        (0..self.k).all(|b| !self.overloaded(b))
    }

    /// Whether some net of `v` touches another block (only such vertices can gain by moving).
    fn is_boundary(&self, v: usize) -> bool {
        let a = self.parts[v] as usize;
        self.conn[v * self.k..(v + 1) * self.k]
            .iter()
            .enumerate()
            .any(|(b, &c)| b != a && c > 0.0)
    }

    /// The best move of `v`; to a block with room for it unless `allow_full`.
    pub fn best_move(&self, v: usize, allow_full: bool) -> Option<Move> {
        let k = self.k;
        let a = self.parts[v] as usize;
        let base = self.benefit[v] - self.incident[v];
        let conn = &self.conn[v * k..v * k + k];
        let mut best: Option<Move> = None;
        for (b, &c) in conn.iter().enumerate() {
            if b == a || (!allow_full && !self.fits(v, b)) {
                continue;
            }
            let gain = base + c;
            let better = match best {
                None => true,
                // Equal gains: prefer the block with more room left.
                Some(m) => {
                    gain > m.gain || (gain == m.gain && self.slack(b) > self.slack(m.to as usize))
                }
            };
            if better {
                best = Some(Move { gain, to: b as u32 });
            }
        }
        best
    }

    fn slack(&self, b: usize) -> f64 {
        self.caps[b] - self.block_weights[b]
    }

    /// Move `v` to `to`; calls `touched(e)` for each net whose pins' gains changed.
    pub fn apply(&mut self, v: usize, to: usize, mut touched: impl FnMut(usize)) {
        let hg = self.hg;
        let k = self.k;
        let from = self.parts[v] as usize;
        let wv = hg.vertex_weights[v];
        self.block_weights[from] -= wv;
        self.block_weights[to] += wv;
        if !self.memory_caps.is_empty() {
            let mv = hg.memory(v);
            self.block_memory[from] -= mv;
            self.block_memory[to] += mv;
        }
        self.parts[v] = to as u32;
        let mut own_benefit = 0.0;
        for &e in hg.nets(v) {
            let e = e as usize;
            let w = hg.net_weights[e];
            self.pin_counts[e * k + from] -= 1;
            self.pin_counts[e * k + to] += 1;
            let after_from = self.pin_counts[e * k + from];
            let after_to = self.pin_counts[e * k + to];
            if after_to == 1 {
                own_benefit += w;
            }
            let critical = after_from <= 1 || after_to <= 2;
            if !critical {
                continue;
            }
            for &u in hg.pins(e) {
                let u = u as usize;
                if after_from == 0 {
                    self.conn[u * k + from] -= w;
                }
                if after_to == 1 {
                    self.conn[u * k + to] += w;
                }
                if u == v {
                    continue;
                }
                let pu = self.parts[u] as usize;
                if after_from == 1 && pu == from {
                    // u is now the last pin of e in `from`.
                    self.benefit[u] += w;
                }
                if after_to == 2 && pu == to {
                    // u is no longer alone in `to`.
                    self.benefit[u] -= w;
                }
            }
            touched(e);
        }
        self.benefit[v] = own_benefit;
    }
}

/// Heap entry: highest gain first, then a random tie-break, then the vertex — packed into one
/// integer whose order is exactly that (`f64::total_cmp` on the gain, then `tie`, then `v`), so
/// that a heap operation compares one `u128` instead of three fields (the heaps' pops were the
/// largest single cost of refinement).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Entry(u128);

impl Entry {
    fn new(gain: f64, tie: u32, v: u32) -> Self {
        Entry((u128::from(ordered_bits(gain)) << 64) | (u128::from(tie) << 32) | u128::from(v))
    }

    fn gain(self) -> f64 {
        let key = (self.0 >> 64) as u64;
        // Inverse of `ordered_bits`.
        let bits = if key >> 63 == 1 {
            key ^ (1 << 63)
        } else {
            !key
        };
        f64::from_bits(bits)
    }

    fn v(self) -> u32 {
        self.0 as u32
    }

    /// The same vertex and tie-break at another gain.
    fn with_gain(self, gain: f64) -> Self {
        Entry((u128::from(ordered_bits(gain)) << 64) | (self.0 & u128::from(u64::MAX)))
    }
}

/// The bits of `x` as an unsigned integer ordered as `f64::total_cmp` orders floats: positive
/// floats get the top bit set, negative ones are inverted (larger magnitude, smaller key).
fn ordered_bits(x: f64) -> u64 {
    let bits = x.to_bits();
    if bits >> 63 == 1 {
        !bits
    } else {
        bits | (1 << 63)
    }
}

/// The move of the popped `top` (a vertex whose entry is current), or None with the vertex
/// re-queued at its lower gain, or parked at the full block it wants (its `queued` cleared) until
/// a move makes room there: the one rule both kinds of FM search pop vertices by.
fn pick_move(
    state: &State<'_>,
    top: Entry,
    heap: &mut BinaryHeap<Entry>,
    parked: &mut [BinaryHeap<Entry>],
    queued: &mut [f64],
) -> Option<Move> {
    let v = top.v() as usize;
    let Some(unconstrained) = state.best_move(v, true) else {
        queued[v] = f64::NEG_INFINITY;
        return None;
    };
    if unconstrained.gain < top.gain() {
        heap.push(top.with_gain(unconstrained.gain));
        queued[v] = unconstrained.gain;
        return None;
    }
    match state.best_move(v, false) {
        Some(m) if m.gain >= unconstrained.gain => Some(m),
        _ => {
            parked[unconstrained.to as usize].push(top.with_gain(unconstrained.gain));
            queued[v] = f64::NEG_INFINITY;
            None
        }
    }
}

/// Move `v` to block `to`; `woken` gets the pins of its nets (those of at most `LARGE_NET` pins),
/// whose gains the move changed.
fn apply_move(state: &mut State<'_>, v: usize, to: u32, woken: &mut Vec<u32>) {
    woken.clear();
    let hg = state.hg;
    state.apply(v, to as usize, |e| {
        if hg.net_size(e) <= LARGE_NET {
            woken.extend_from_slice(hg.pins(e));
        }
    });
}

/// Room was made in `from`: the best candidates parked there that fit now (by weight and
/// memory) leave the park, each handed to `admit`, which puts it back in line if it may still
/// move.
fn release_parked(
    state: &State<'_>,
    from: usize,
    parked: &mut BinaryHeap<Entry>,
    mut admit: impl FnMut(Entry),
) {
    let hg = state.hg;
    let (room, memory_room) = state.room(from);
    let (mut released, mut released_memory) = (0.0, 0.0);
    while let Some(p) = parked.peek() {
        let w = hg.vertex_weights[p.v() as usize];
        let m = hg.memory(p.v() as usize);
        if released + w > room || released_memory + m > memory_room {
            break;
        }
        released += w;
        released_memory += m;
        admit(parked.pop().expect("peeked"));
    }
}

/// Nets larger than this are not used to wake up neighbours after a move (their pins are
/// re-evaluated when popped instead): keeps a move's cost bounded on hypergraphs with huge nets.
const LARGE_NET: usize = 1000;

/// Rebalance if needed, then global FM passes and rounds of localized FM until a round stops
/// improving, then (with `flow_slack`, `ε · target(b) · W` per block) flow-based refinement and
/// FM again if flows found a better cut. (Label propagation before FM
/// was tried and removed: it fills blocks with mediocre moves that FM then cannot undo; without it
/// km1 was lower and refinement faster on the benchmark instances.)
pub(super) fn refine(
    hg: &Hypergraph,
    parts: &mut Vec<u32>,
    caps: &[f64],
    mem: Option<&[f64]>,
    flow_slack: Option<&[f64]>,
    rng: &mut Rng,
) {
    let mut state = State::new(hg, std::mem::take(parts), caps);
    if let Some(mem) = mem {
        state.limit_memory(mem);
    }
    if !state.is_balanced() {
        rebalance(&mut state, rng);
    }
    // A couple of global passes take the easy gains cheaply; localized searches go deeper.
    fm(&mut state, rng, GLOBAL_PASSES);
    localized_fm(&mut state, rng, LOCAL_ROUNDS);
    // Flows only on a balanced partition (they keep balance, they do not restore it); FM again
    // if they moved something, to polish around the new cut.
    if let Some(slack) = flow_slack {
        if state.is_balanced() && super::flow::flow_refine(&mut state, slack) {
            fm(&mut state, rng, 2);
        }
    }
    *parts = state.parts;
}

/// Move vertices out of overweight blocks, least km1 loss per unit of weight first, until every
/// block fits or nothing can move. Returns whether the partition is balanced.
pub(super) fn rebalance(state: &mut State<'_>, rng: &mut Rng) -> bool {
    let n = state.hg.num_vertices();
    for _round in 0..4 {
        if state.is_balanced() {
            return true;
        }
        let over: Vec<bool> = (0..state.k).map(|b| state.overloaded(b)).collect();
        let mut heap = BinaryHeap::new();
        for v in 0..n {
            let relieves = state.hg.vertex_weights[v] > 0.0 || state.hg.memory(v) > 0.0;
            if over[state.parts[v] as usize] && relieves {
                if let Some(m) = state.best_move(v, false) {
                    let gain = score(m.gain, state.relief(v));
                    heap.push(Entry::new(gain, rng.next_u64() as u32, v as u32));
                }
            }
        }
        while let Some(top) = heap.pop() {
            let v = top.v() as usize;
            let from = state.parts[v] as usize;
            if !state.overloaded(from) {
                continue;
            }
            let Some(m) = state.best_move(v, false) else {
                continue;
            };
            let s = score(m.gain, state.relief(v));
            if s < top.gain() {
                heap.push(top.with_gain(s));
                continue;
            }
            state.apply(v, m.to as usize, |_| {});
            if state.is_balanced() {
                return true;
            }
        }
    }
    state.is_balanced()
}

/// Gain per unit of weight moved: losing little per weight unit rebalances with least damage.
fn score(gain: f64, weight: f64) -> f64 {
    if gain >= 0.0 {
        gain * weight
    } else {
        gain / weight
    }
}

/// One FM search's moves in order (vertex, block it left), their running gain and the best
/// prefix so far: both searches record their moves here and roll back to the best prefix.
#[derive(Default)]
struct MoveLog {
    moves: Vec<(u32, u32)>,
    current: f64,
    best: f64,
    best_len: usize,
}

impl MoveLog {
    /// Empty, for the next search (keeping the allocation).
    fn clear(&mut self) {
        self.moves.clear();
        (self.current, self.best, self.best_len) = (0.0, 0.0, 0);
    }

    /// Records vertex `v`'s move out of block `from`, gaining `gain`; false once more than
    /// `patience` moves have passed without a new best prefix (the search stops).
    fn record(&mut self, v: usize, from: u32, gain: f64, patience: usize) -> bool {
        self.moves.push((v as u32, from));
        self.current += gain;
        if self.current > self.best + 1e-12 * self.best.abs().max(1.0) {
            self.best = self.current;
            self.best_len = self.moves.len();
        } else if self.moves.len() - self.best_len > patience {
            return false;
        }
        true
    }

    /// Undoes the moves after the best prefix, last first; the kept moves.
    fn roll_back(&self, state: &mut State<'_>) -> &[(u32, u32)] {
        for &(v, from) in self.moves[self.best_len..].iter().rev() {
            state.apply(v as usize, from as usize, |_| {});
        }
        &self.moves[..self.best_len]
    }
}

/// k-way Fiduccia–Mattheyses passes with km1 gains: each pass moves boundary vertices best gain
/// first (negative gains too, every vertex at most once), then rolls back to the best prefix.
pub(super) fn fm(state: &mut State<'_>, rng: &mut Rng, max_passes: usize) {
    let n = state.hg.num_vertices();
    let mut locked = vec![0u32; n]; // pass number in which the vertex moved
    let mut stamp = vec![0u64; n];
    let mut stamp_now = 0u64;
    // Gain of each vertex's newest heap entry: a neighbour's move pushes a new entry only when the
    // gain went up; entries that went down are caught (and re-queued) when popped.
    let mut queued = vec![f64::NEG_INFINITY; n];
    for pass in 1..=max_passes as u32 {
        let mut heap = BinaryHeap::new();
        // Vertices whose best target block is full, by that block: they get another chance as
        // soon as a move makes room there (when one block is full, moves into it must wait for
        // moves out of it, and a heap that dropped them would never try them again).
        let mut parked: Vec<BinaryHeap<Entry>> = vec![BinaryHeap::new(); state.k];
        for (v, q) in queued.iter_mut().enumerate() {
            *q = f64::NEG_INFINITY;
            if state.is_boundary(v) {
                if let Some(m) = state.best_move(v, true) {
                    heap.push(Entry::new(m.gain, rng.next_u64() as u32, v as u32));
                    *q = m.gain;
                }
            }
        }
        let mut log = MoveLog::default();
        // Give up a pass after this many moves without a new best (adaptive stopping is overkill
        // for the sizes hetcoll sees).
        let patience = 100 + (n / 100).min(250);
        let mut woken: Vec<u32> = Vec::new();
        while let Some(top) = heap.pop() {
            let v = top.v() as usize;
            if locked[v] == pass || top.gain() < queued[v] {
                continue;
            }
            let Some(m) = pick_move(state, top, &mut heap, &mut parked, &mut queued) else {
                continue;
            };
            let from = state.parts[v];
            stamp_now += 1;
            apply_move(state, v, m.to, &mut woken);
            release_parked(state, from as usize, &mut parked[from as usize], |p| {
                if locked[p.v() as usize] != pass {
                    heap.push(p);
                    queued[p.v() as usize] = p.gain();
                }
            });
            locked[v] = pass;
            if !log.record(v, from, m.gain, patience) {
                break;
            }
            for &u in &woken {
                let u = u as usize;
                // Each vertex once per move, however many of the moved vertex's nets it shares.
                if locked[u] == pass || stamp[u] == stamp_now {
                    continue;
                }
                stamp[u] = stamp_now;
                if let Some(mu) = state.best_move(u, true) {
                    if mu.gain > queued[u] {
                        heap.push(Entry::new(mu.gain, rng.next_u64() as u32, u as u32));
                        queued[u] = mu.gain;
                    }
                }
            }
        }
        if log.roll_back(state).is_empty() {
            break;
        }
    }
}

/// Global FM passes per refinement, before the localized searches.
const GLOBAL_PASSES: usize = 2;
/// Rounds of localized searches per refinement at most (Mt-KaHyPar's multitry rounds).
const LOCAL_ROUNDS: usize = 10;
/// Seed vertices of one localized search (Mt-KaHyPar's default).
const SEEDS: usize = 25;
/// A localized search stops after this many moves without a new best.
const LOCAL_PATIENCE: usize = 32;

/// Localized k-way FM (KaHyPar's and Mt-KaHyPar's multitry FM): rounds of many small searches,
/// each started from a few boundary vertices and growing only to the neighbours of the vertices it
/// moved, rolled back to its best prefix and kept if that gains. A global pass moves the best
/// vertex anywhere and so interleaves unrelated moves whose losses add up; a local search follows
/// one region, so it can carry a group of vertices across the cut together (power-law nets: the
/// global passes stop 25% above Mt-KaHyPar's km1 where these searches keep going). Vertices moved
/// by a kept search stay put for the rest of the round; those of a rolled-back one are released.
pub(super) fn localized_fm(state: &mut State<'_>, rng: &mut Rng, max_rounds: usize) {
    let n = state.hg.num_vertices();
    let k = state.k;
    let mut locked = vec![0u32; n]; // round in which a kept search moved the vertex
    let mut claimed = vec![0u64; n]; // search that last moved the vertex
    let mut queued = vec![f64::NEG_INFINITY; n];
    let mut queued_in = vec![0u64; n]; // search for which `queued` holds
    let mut stamp = vec![0u64; n];
    let mut stamp_now = 0u64;
    let mut search = 0u64;
    let mut heap: BinaryHeap<Entry> = BinaryHeap::new();
    let mut parked: Vec<BinaryHeap<Entry>> = vec![BinaryHeap::new(); k];
    let mut log = MoveLog::default();
    let mut woken: Vec<u32> = Vec::new();
    for round in 1..=max_rounds as u32 {
        let mut seeds: Vec<u32> = (0..n as u32)
            .filter(|&v| state.is_boundary(v as usize))
            .collect();
        rng.shuffle(&mut seeds);
        let mut cursor = 0;
        let mut round_gain = 0.0;
        let start_km1 = state.km1();
        while cursor < seeds.len() {
            search += 1;
            heap.clear();
            for p in &mut parked {
                p.clear();
            }
            log.clear();
            let mut taken = 0;
            while cursor < seeds.len() && taken < SEEDS {
                let v = seeds[cursor] as usize;
                cursor += 1;
                if locked[v] == round || !state.is_boundary(v) {
                    continue;
                }
                if let Some(m) = state.best_move(v, true) {
                    heap.push(Entry::new(m.gain, rng.next_u64() as u32, v as u32));
                    queued[v] = m.gain;
                    queued_in[v] = search;
                    taken += 1;
                }
            }
            if taken == 0 {
                continue;
            }
            while let Some(top) = heap.pop() {
                let v = top.v() as usize;
                if locked[v] == round
                    || claimed[v] == search
                    || queued_in[v] != search
                    || top.gain() < queued[v]
                {
                    continue;
                }
                let Some(m) = pick_move(state, top, &mut heap, &mut parked, &mut queued) else {
                    continue;
                };
                let from = state.parts[v];
                stamp_now += 1;
                apply_move(state, v, m.to, &mut woken);
                release_parked(state, from as usize, &mut parked[from as usize], |p| {
                    if claimed[p.v() as usize] != search && locked[p.v() as usize] != round {
                        heap.push(p);
                        queued[p.v() as usize] = p.gain();
                        queued_in[p.v() as usize] = search;
                    }
                });
                claimed[v] = search;
                if !log.record(v, from, m.gain, LOCAL_PATIENCE) {
                    break;
                }
                for &u in &woken {
                    let u = u as usize;
                    if locked[u] == round || claimed[u] == search || stamp[u] == stamp_now {
                        continue;
                    }
                    stamp[u] = stamp_now;
                    if let Some(mu) = state.best_move(u, true) {
                        if queued_in[u] != search || mu.gain > queued[u] {
                            heap.push(Entry::new(mu.gain, rng.next_u64() as u32, u as u32));
                            queued[u] = mu.gain;
                            queued_in[u] = search;
                        }
                    }
                }
            }
            for &(v, _) in log.roll_back(state) {
                locked[v as usize] = round;
            }
            round_gain += log.best;
        }
        // Stop once a round gains less than 0.1% (Mt-KaHyPar's relative improvement threshold).
        if round_gain <= 1e-3 * start_km1 {
            break;
        }
    }
}

#[cfg(test)]
mod entry_tests {
    use proptest::prelude::*;

    use super::Entry;

    /// Any float, NaNs, infinities, zeros of both signs and subnormals included.
    fn any_gain() -> impl Strategy<Value = f64> {
        prop_oneof![
            any::<u64>().prop_map(f64::from_bits),
            prop::sample::select(vec![0.0, -0.0, f64::INFINITY, f64::NEG_INFINITY, 1.0, -1.0]),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// The packed key orders entries exactly as gain (`total_cmp`), tie, vertex would, and
        /// gives back the gain and the vertex bit for bit.
        #[test]
        fn packed_order_is_gain_tie_vertex(
            a in (any_gain(), any::<u32>(), any::<u32>()),
            b in (any_gain(), any::<u32>(), any::<u32>()),
            other in any_gain(),
        ) {
            let (ea, eb) = (Entry::new(a.0, a.1, a.2), Entry::new(b.0, b.1, b.2));
            let expected = a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2));
            prop_assert_eq!(ea.cmp(&eb), expected);
            prop_assert_eq!(ea.gain().to_bits(), a.0.to_bits());
            prop_assert_eq!(ea.v(), a.2);
            let moved = ea.with_gain(other);
            prop_assert_eq!(moved, Entry::new(other, a.1, a.2));
        }
    }
}
