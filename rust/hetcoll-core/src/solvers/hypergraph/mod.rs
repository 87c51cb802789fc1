//! Multilevel k-way hypergraph partitioning with heterogeneous block targets.
//!
//! A hypergraph has weighted vertices (work: the FLOPs of a filter) and weighted nets (pin sets:
//! a feature map and everyone who reads it, weighted by its bytes). A partition into `k` blocks is
//! *balanced* when every block `b` weighs at most `(1 + ε) · targets[b] · W` (`W` the total vertex
//! weight, `targets` summing to 1 — unequal targets for devices of unequal speed). The objective is
//! the connectivity minus one, `km1 = Σ_e w(e) · (λ(e) − 1)` with `λ(e)` the number of blocks net `e`
//! touches: the volume a producer sends to the other blocks that read its output.
//!
//! The scheme is the multilevel one of hMETIS, PaToH and KaHyPar, close to Mt-KaHyPar's default
//! preset, single-threaded and deterministic for a seed:
//!
//! 0. Vertices in no net of two or more pins are set aside and, at the end, put into the blocks
//!    with the most room left (they cost nothing anywhere; left in, they take room the connected
//!    vertices could use). `community`: Louvain modularity clustering of the star expansion.
//! 1. `coarsen`: heavy-edge clustering inside communities (rating `Σ w(e)/(s(e)−1)` over shared
//!    nets, `s(e)` the number of clusters net `e` spans so far; bounded cluster weight, at most a
//!    2.5× shrink per level; a vertex whose best partner is too heavy stays alone rather than join
//!    one rated far lower, or pairs with another vertex that wanted the same partner; vertices
//!    without nets are packed together) contracted level by level until about `160·k` vertices
//!    remain; single-pin nets dropped and parallel nets merged.
//! 2. `initial`: recursive bisection of the coarsest hypergraph with adaptive imbalance per level;
//!    a side of many vertices and small nets is bisected multilevel (coarsened to `2·160`
//!    vertices, split there, refined on the way back), as Mt-KaHyPar does; each (coarsest)
//!    bisection takes the best of a portfolio of tries (greedy hypergraph growing from random
//!    seeds, random assignments, BFS sweeps: the cheapest balanced prefix of a BFS order), each
//!    polished by FM; several such runs compete on the k-way result.
//! 3. `refine`: on the way back, the coarse partition is projected, then k-way FM with km1 gains
//!    (gain cache, vertices whose best block is full parked until it has room): two global passes,
//!    then rounds of localized searches (Mt-KaHyPar's multitry FM: many small searches from a few
//!    boundary vertices each, each kept up to its best prefix); a rebalancing pass restores
//!    balance whenever a level starts out of balance. On the input level, `flow`: max-flow
//!    min-cut refinement between pairs of blocks on a region around their cut (KaHyPar-MF), then
//!    FM again.
//! 4. `sweep` (inputs of at most 50,000 vertices): the cheapest ordered split of the input order
//!    and of a BFS order into `k` runs, over every distinct order of the blocks (a pipeline, for
//!    a network's chain of layers), refined like the input level, replaces the multilevel
//!    result if it cuts less.
//!
//! Balance is a hard constraint: the result always meets it, or the call fails with an error
//! (`vertex_weights` when one vertex outweighs the largest block, `targets` when no packing was
//! found — bin packing is NP-hard, so "not found" is what can honestly be said for weighted
//! vertices).

mod coarsen;
mod community;
mod flow;
mod initial;
mod refine;
mod sweep;

use crate::error::{CoreError, Result};

/// A hypergraph in compressed form: nets → pins and vertices → nets.
#[derive(Debug, Clone)]
pub struct Hypergraph {
    vertex_weights: Vec<f64>,
    /// Memory of each vertex (bytes a device needs to hold it); empty when not given.
    vertex_memory: Vec<f64>,
    net_offsets: Vec<usize>,
    pins: Vec<u32>,
    net_weights: Vec<f64>,
    incidence_offsets: Vec<usize>,
    incidence: Vec<u32>,
}

impl Hypergraph {
    /// The hypergraph induced by the vertices that `keep` (weights, and nets cut down to their
    /// pins among them; nets left with fewer than two pins go; no memory), and the id here of
    /// each of its vertices.
    pub(super) fn induced_by(&self, keep: impl Fn(usize) -> bool) -> (Hypergraph, Vec<u32>) {
        let mut local = vec![u32::MAX; self.num_vertices()];
        let mut ids = Vec::new();
        for (v, slot) in local.iter_mut().enumerate() {
            if keep(v) {
                *slot = ids.len() as u32;
                ids.push(v as u32);
            }
        }
        let mut offsets = vec![0usize];
        let mut pins = Vec::new();
        let mut net_weights = Vec::new();
        for e in 0..self.num_nets() {
            let start = pins.len();
            pins.extend(
                self.pins(e)
                    .iter()
                    .filter(|&&v| local[v as usize] != u32::MAX)
                    .map(|&v| local[v as usize]),
            );
            if pins.len() - start < 2 {
                pins.truncate(start);
            } else {
                offsets.push(pins.len());
                net_weights.push(self.net_weights[e]);
            }
        }
        let weights = ids
            .iter()
            .map(|&v| self.vertex_weights[v as usize])
            .collect();
        (
            Hypergraph::from_parts(weights, offsets, pins, net_weights),
            ids,
        )
    }

    /// Validate and build. `net_offsets` has one more entry than there are nets; net `e` has pins
    /// `pins[net_offsets[e]..net_offsets[e + 1]]`. Weights default to 1.
    pub fn new(
        num_vertices: usize,
        net_offsets: Vec<usize>,
        pins: Vec<u32>,
        vertex_weights: Option<Vec<f64>>,
        net_weights: Option<Vec<f64>>,
    ) -> Result<Self> {
        if num_vertices > u32::MAX as usize {
            return Err(CoreError::invalid(
                "num_vertices",
                format!("must be < 2**32, got {num_vertices}"),
            ));
        }
        if net_offsets.first() != Some(&0) || net_offsets.last() != Some(&pins.len()) {
            return Err(CoreError::invalid("nets", "malformed offsets"));
        }
        check_memory(num_vertices, pins.len(), available_memory())?;
        let m = net_offsets.len() - 1;
        let mut seen = vec![u32::MAX; num_vertices];
        for e in 0..m {
            let (a, b) = (net_offsets[e], net_offsets[e + 1]);
            if b <= a {
                return Err(CoreError::invalid(
                    format!("nets[{e}]"),
                    if b == a {
                        "must not be empty"
                    } else {
                        "malformed offsets"
                    },
                ));
            }
            for &v in &pins[a..b] {
                if v as usize >= num_vertices {
                    return Err(CoreError::invalid(
                        format!("nets[{e}]"),
                        format!("vertex id {v} out of range 0..{num_vertices} (num_vertices is {num_vertices})"),
                    ));
                }
                if seen[v as usize] == e as u32 {
                    return Err(CoreError::invalid(
                        format!("nets[{e}]"),
                        format!("duplicate pin {v}"),
                    ));
                }
                seen[v as usize] = e as u32;
            }
        }
        let vertex_weights = weights(vertex_weights, num_vertices, "vertex_weights")?;
        let net_weights = weights(net_weights, m, "net_weights")?;
        let total: f64 = vertex_weights.iter().sum();
        if !total.is_finite() {
            return Err(CoreError::invalid(
                "vertex_weights",
                "their sum overflows a double",
            ));
        }
        Ok(Self::from_parts(
            vertex_weights,
            net_offsets,
            pins,
            net_weights,
        ))
    }

    /// Build from already valid parts (used by contraction and sub-hypergraph extraction).
    fn from_parts(
        vertex_weights: Vec<f64>,
        net_offsets: Vec<usize>,
        pins: Vec<u32>,
        net_weights: Vec<f64>,
    ) -> Self {
        let n = vertex_weights.len();
        let mut degree = vec![0usize; n + 1];
        for &v in &pins {
            degree[v as usize + 1] += 1;
        }
        for i in 0..n {
            degree[i + 1] += degree[i];
        }
        let incidence_offsets = degree.clone();
        let mut fill = degree;
        let mut incidence = vec![0u32; pins.len()];
        for e in 0..net_offsets.len() - 1 {
            for &v in &pins[net_offsets[e]..net_offsets[e + 1]] {
                incidence[fill[v as usize]] = e as u32;
                fill[v as usize] += 1;
            }
        }
        Hypergraph {
            vertex_weights,
            vertex_memory: Vec::new(),
            net_offsets,
            pins,
            net_weights,
            incidence_offsets,
            incidence,
        }
    }

    /// The same hypergraph with each vertex's memory (finite, ≥ 0; one entry per vertex), which
    /// [`PartitionOptions::capacity`] limits per block.
    pub fn with_vertex_memory(mut self, memory: Vec<f64>) -> Result<Self> {
        let memory = weights(Some(memory), self.num_vertices(), "vertex_memory")?;
        if !memory.iter().sum::<f64>().is_finite() {
            return Err(CoreError::invalid(
                "vertex_memory",
                "its sum overflows a double",
            ));
        }
        self.vertex_memory = memory;
        Ok(self)
    }

    /// Memory of vertex `v` (0 when no memory was given).
    #[inline]
    fn memory(&self, v: usize) -> f64 {
        self.vertex_memory.get(v).copied().unwrap_or(0.0)
    }

    /// Number of vertices.
    pub fn num_vertices(&self) -> usize {
        self.vertex_weights.len()
    }

    /// Number of nets.
    pub fn num_nets(&self) -> usize {
        self.net_offsets.len() - 1
    }

    #[inline]
    fn pins(&self, e: usize) -> &[u32] {
        &self.pins[self.net_offsets[e]..self.net_offsets[e + 1]]
    }

    #[inline]
    fn nets(&self, v: usize) -> &[u32] {
        &self.incidence[self.incidence_offsets[v]..self.incidence_offsets[v + 1]]
    }

    #[inline]
    fn net_size(&self, e: usize) -> usize {
        self.net_offsets[e + 1] - self.net_offsets[e]
    }

    fn total_weight(&self) -> f64 {
        self.vertex_weights.iter().sum()
    }

    /// `Σ_e w(e) · (λ(e) − 1)` of `parts` (one block id per vertex).
    pub fn km1(&self, parts: &[u32]) -> f64 {
        let mut blocks: Vec<u32> = Vec::new();
        let mut total = 0.0;
        for e in 0..self.num_nets() {
            blocks.clear();
            blocks.extend(self.pins(e).iter().map(|&v| parts[v as usize]));
            blocks.sort_unstable();
            blocks.dedup();
            total += self.net_weights[e] * (blocks.len() as f64 - 1.0);
        }
        total
    }
}

fn weights(w: Option<Vec<f64>>, len: usize, argument: &str) -> Result<Vec<f64>> {
    let Some(w) = w else {
        return Ok(vec![1.0; len]);
    };
    if w.len() != len {
        return Err(CoreError::invalid(
            argument,
            format!("must hold {len} entries, got {}", w.len()),
        ));
    }
    for (i, &x) in w.iter().enumerate() {
        if !x.is_finite() || x < 0.0 {
            return Err(CoreError::invalid(
                format!("{argument}[{i}]"),
                format!("must be finite and >= 0, got {x}"),
            ));
        }
    }
    Ok(w)
}

/// Tuning of [`partition_hypergraph`]; `PartitionOptions::new(targets)` gives the defaults.
#[derive(Debug, Clone)]
pub struct PartitionOptions {
    /// Share of the total vertex weight block `b` aims at; positive, summing to 1.
    pub targets: Vec<f64>,
    /// Allowed imbalance: block `b` may weigh up to `(1 + epsilon) · targets[b] · W`.
    pub epsilon: f64,
    /// Seed of every random choice; the result is a deterministic function of the inputs and it.
    pub seed: u64,
    /// The most vertex memory (see [`Hypergraph::with_vertex_memory`]) block `b` may hold, one
    /// entry per block; `None`: memory is not limited.
    pub capacity: Option<Vec<f64>>,
}

impl PartitionOptions {
    /// Defaults: `epsilon = 0.03`, `seed = 0`.
    pub fn new(targets: Vec<f64>) -> Self {
        PartitionOptions {
            targets,
            epsilon: 0.03,
            seed: 0,
            capacity: None,
        }
    }
}

/// Bytes the partitioner holds at its peak per vertex and per pin (its levels of coarsening,
/// their gains and moves), rounded up from about 120 of each measured on isolated vertices and
/// on random nets of 5 pins.
const BYTES_PER_VERTEX: u128 = 160;
const BYTES_PER_PIN: u128 = 160;

/// Refuse a hypergraph whose partition would need more memory than the machine has left
/// (`available`, bytes; None where unknown): a clear error where the allocation would abort the
/// process or have the system kill it.
fn check_memory(num_vertices: usize, pins: usize, available: Option<u64>) -> Result<()> {
    let need = BYTES_PER_VERTEX * num_vertices as u128 + BYTES_PER_PIN * pins as u128;
    match available {
        Some(have) if need > have as u128 => Err(CoreError::infeasible(
            "num_vertices",
            format!(
                "{num_vertices} vertices and {pins} pins need about {:.1} GiB to partition, \
                 {:.1} GiB of memory is available",
                need as f64 / (1u64 << 30) as f64,
                have as f64 / (1u64 << 30) as f64
            ),
        )),
        _ => Ok(()),
    }
}

/// Bytes of memory the system can still give a process (Linux: `MemAvailable` in
/// `/proc/meminfo`); None where that is not known.
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Block of each vertex of `hg` (see the module documentation for the objective, the balance
/// constraint and the algorithm).
///
/// ```
/// use hetcoll_core::solvers::{partition_hypergraph, Hypergraph, PartitionOptions};
/// // Two triangles joined by one net: cut between them.
/// let nets: Vec<Vec<u32>> = vec![vec![0, 1], vec![1, 2], vec![0, 2], vec![3, 4], vec![4, 5],
///                                vec![3, 5], vec![2, 3]];
/// let offsets: Vec<usize> = std::iter::once(0)
///     .chain(nets.iter().scan(0, |s, n| { *s += n.len(); Some(*s) })).collect();
/// let hg = Hypergraph::new(6, offsets, nets.concat(), None, None).unwrap();
/// let parts = partition_hypergraph(&hg, &PartitionOptions::new(vec![0.5, 0.5])).unwrap();
/// assert_eq!(hg.km1(&parts), 1.0);
/// ```
pub fn partition_hypergraph(hg: &Hypergraph, options: &PartitionOptions) -> Result<Vec<u32>> {
    let caps = capacities(hg, options)?;
    let k = caps.len();
    let mem = memory_capacities(hg, options)?;
    let mem = mem.as_deref();
    let n = hg.num_vertices();
    if k == 1 {
        return Ok(vec![0; n]);
    }
    let mut rng = Rng::new(options.seed);
    // What the balance constraint lets each block exceed its ideal weight by (flow regions).
    let slack: Vec<f64> = caps
        .iter()
        .map(|c| c * options.epsilon / (1.0 + options.epsilon))
        .collect();
    let setting = Setting {
        targets: &options.targets,
        epsilon: options.epsilon,
        total: hg.total_weight(),
        caps: &caps,
        mem,
        slack: &slack,
    };
    // Vertices in no net of two or more pins cost nothing wherever they go: partition the rest
    // under the same block limits, then fill them into the room left (Mt-KaHyPar's degree-zero
    // removal). Left in, they sit wherever the initial partition put them (FM has no reason to
    // move them) and take room the connected vertices could use; on power-law nets, 5% of the
    // vertices, the small blocks of a 4:2:1:1 split should hold them.
    let isolated: Vec<bool> = (0..n)
        .map(|v| hg.nets(v).iter().all(|&e| hg.net_size(e as usize) < 2))
        .collect();
    let connected = isolated.iter().filter(|&&i| !i).count();
    let mut parts = if connected < n && connected >= 2 * k {
        let (sub, ids) = induced(hg, &isolated);
        let sub_parts = multilevel(&sub, &setting, &mut rng);
        let mut parts = vec![0u32; n];
        for (i, &v) in ids.iter().enumerate() {
            parts[v as usize] = sub_parts[i];
        }
        place_isolated(hg, &mut parts, &isolated, &caps, mem);
        if !balanced(hg, &parts, &caps, mem) {
            refine::refine(hg, &mut parts, &caps, mem, None, &mut rng);
        }
        parts
    } else {
        multilevel(hg, &setting, &mut rng)
    };
    if !balanced(hg, &parts, &caps, mem) {
        // Refinement could not restore balance from the projected partition: pack from scratch,
        // ignoring the cut, and polish.
        parts = initial::pack(hg, &caps, mem).ok_or_else(|| {
            if mem.is_some() {
                CoreError::infeasible(
                    "capacity",
                    "no partition found that is balanced and fits every block's capacity for \
                     these vertex weights and memory, targets, epsilon and capacities",
                )
            } else {
                CoreError::infeasible(
                    "targets",
                    "no balanced partition found for these vertex weights, targets and epsilon",
                )
            }
        })?;
        refine::refine(hg, &mut parts, &caps, mem, Some(&slack), &mut rng);
    }
    debug_assert!(balanced(hg, &parts, &caps, mem));
    Ok(parts)
}

/// What one partitioning call works with: the options, the input's total weight (the targets'
/// base) and the derived limits.
struct Setting<'a> {
    targets: &'a [f64],
    epsilon: f64,
    total: f64,
    caps: &'a [f64],
    mem: Option<&'a [f64]>,
    slack: &'a [f64],
}

/// The multilevel scheme on `hg` under `setting`'s limits: community detection, coarsening,
/// initial partitioning, uncoarsening with refinement. The result may be unbalanced
/// (the caller falls back to packing).
fn multilevel(hg: &Hypergraph, setting: &Setting<'_>, rng: &mut Rng) -> Vec<u32> {
    let (caps, mem, slack) = (setting.caps, setting.mem, setting.slack);
    let k = caps.len();
    let n = hg.num_vertices();
    // Clusters stay inside communities.
    let communities = community::communities(hg, rng);
    let hierarchy = coarsen::coarsen(hg, k, caps, mem, &communities, rng);
    let coarsest = hierarchy.last().map_or(hg, |level| &level.coarse);
    // Recursive bisection cannot see past its own cut (a perfect first bisection may leave an
    // unsplittable half), so several independent runs compete on the k-way result.
    let mut best: Option<(bool, f64, Vec<u32>)> = None;
    // Small coarsest hypergraphs (tiny inputs) get more runs: they cost next to nothing. On
    // inputs of a few thousand vertices (a CNN's filters) the bisections are multilevel whatever
    // the nets' size (4 such runs matched 6 flat ones on the CNN hypergraphs in 80% of the
    // time); since ordered splits (`pipeline_candidate`) compete with the result, 3 runs reach
    // the km1 of 4 on the CNN network family in less time (2 left VGG-11 at a quarter width,
    // k = 8, at 1.26x Mt-KaHyPar's km1).
    let small_input = n <= SMALL_INPUT;
    let runs = if coarsest.num_vertices() < SMALL {
        4 * INITIAL_RUNS
    } else if small_input {
        SMALL_INPUT_RUNS
    } else {
        INITIAL_RUNS
    };
    for _ in 0..runs {
        let mut parts = initial::initial_partition(
            coarsest,
            &initial::Budget {
                targets: setting.targets,
                epsilon: setting.epsilon,
                total: setting.total,
                caps,
                multilevel_large_nets: small_input,
            },
            rng,
        );
        refine::refine(coarsest, &mut parts, caps, mem, None, rng);
        let ok = balanced(coarsest, &parts, caps, mem);
        let cut = coarsest.km1(&parts);
        if best
            .as_ref()
            .is_none_or(|(b_ok, b_cut, _)| (ok && !b_ok) || (ok == *b_ok && cut < *b_cut))
        {
            best = Some((ok, cut, parts));
        }
    }
    let parts = best.map(|(_, _, p)| p).unwrap_or_default();
    let parts = uncoarsen(hg, &hierarchy, parts, caps, mem, Some(slack), rng);
    if n <= SWEEP_MAX_VERTICES {
        return pipeline_candidate(hg, parts, setting, rng);
    }
    parts
}

/// Pipelines against the multilevel result: the cheapest ordered split (see `sweep`) of the
/// input order and of a BFS order, refined like the input level, replaces `parts` if it cuts
/// less. A chain of layers numbered in order is split there as a pipeline would be, across the
/// cheapest layers for each block's share, which recursive bisection under uneven targets misses
/// (a 5-conv CIFAR CNN at targets 1 : 0.5 : 0.25: 2.3x Mt-KaHyPar's km1 without it).
fn pipeline_candidate(
    hg: &Hypergraph,
    parts: Vec<u32>,
    setting: &Setting<'_>,
    rng: &mut Rng,
) -> Vec<u32> {
    let (caps, mem) = (setting.caps, setting.mem);
    let n = hg.num_vertices();
    let identity: Vec<u32> = (0..n as u32).collect();
    let start = initial::bfs_order(hg, 0).last().copied().unwrap_or(0) as usize;
    let bfs = initial::bfs_order(hg, start);
    let mut current = hg.km1(&parts);
    let mut current_ok = balanced(hg, &parts, caps, mem);
    let mut parts = parts;
    let none = vec![0.0; caps.len()];
    // Splits that may exceed a block's limit (for rebalancing to repair) first; if the best one
    // does, the best within the limits too, in case the repair costs more than it saved.
    for slack in [setting.slack, &none[..]] {
        let mut best: Option<(f64, Vec<u32>)> = None;
        for order in [&identity, &bfs] {
            let give_up = SWEEP_GIVE_UP * current;
            if let Some(candidate) = sweep::ordered_split(hg, order, caps, slack, mem, give_up, rng)
            {
                let cut = hg.km1(&candidate);
                if best.as_ref().is_none_or(|(b, _)| cut < *b) {
                    best = Some((cut, candidate));
                }
            }
        }
        let Some((cut, mut candidate)) = best else {
            return parts;
        };
        let within = balanced(hg, &candidate, caps, mem);
        // Refinement seldom takes more than a fifth off a start: worse starts are not worth
        // a pass (on random matrices and kNN inputs, whose order means nothing, they are
        // 1.3-1.5x the multilevel result).
        if cut <= SWEEP_REFINE_RATIO * current {
            refine::refine(hg, &mut candidate, caps, mem, Some(setting.slack), rng);
            let ok = balanced(hg, &candidate, caps, mem);
            let refined = hg.km1(&candidate);
            if ok && (refined < current || !current_ok) {
                parts = candidate;
                current = refined;
                current_ok = true;
            }
        }
        // The best split within the limits bounds no lower than this one: if this one was not
        // worth refining, neither is that.
        if within || cut > SWEEP_REFINE_RATIO * current {
            break;
        }
    }
    parts
}

/// Inputs of at most this many vertices are also tried as pipelines (`pipeline_candidate`).
const SWEEP_MAX_VERTICES: usize = 50_000;

/// A vertex order whose first few ordered splits bound km1 above this many times the
/// multilevel result's is not searched further (random matrices, kNN and power-law inputs).
const SWEEP_GIVE_UP: f64 = 2.0;

/// A pipeline start is refined only if its km1 is at most this many times the multilevel
/// result's.
const SWEEP_REFINE_RATIO: f64 = 1.25;

/// The hypergraph induced by the vertices not `dropped` (nets keep their pins among them, nets
/// left with fewer than two pins go, memory comes along), and the input id of each of its
/// vertices.
fn induced(hg: &Hypergraph, dropped: &[bool]) -> (Hypergraph, Vec<u32>) {
    let (mut sub, ids) = hg.induced_by(|v| !dropped[v]);
    if !hg.vertex_memory.is_empty() {
        sub.vertex_memory = ids.iter().map(|&v| hg.memory(v as usize)).collect();
    }
    (sub, ids)
}

/// Put each `isolated` vertex, heaviest first, into the block with the most room left that fits
/// it (weight and memory; the emptiest block when none fits, for rebalancing to repair).
fn place_isolated(
    hg: &Hypergraph,
    parts: &mut [u32],
    isolated: &[bool],
    caps: &[f64],
    mem: Option<&[f64]>,
) {
    let k = caps.len();
    let mut room = caps.to_vec();
    let mut memory_room = mem.map_or_else(|| vec![f64::INFINITY; k], <[f64]>::to_vec);
    for (v, &b) in parts.iter().enumerate() {
        if !isolated[v] {
            room[b as usize] -= hg.vertex_weights[v];
            memory_room[b as usize] -= hg.memory(v);
        }
    }
    let mut order: Vec<u32> = (0..parts.len() as u32)
        .filter(|&v| isolated[v as usize])
        .collect();
    order.sort_by(|&a, &b| {
        hg.vertex_weights[b as usize]
            .total_cmp(&hg.vertex_weights[a as usize])
            .then(a.cmp(&b))
    });
    for v in order {
        let (w, m) = (hg.vertex_weights[v as usize], hg.memory(v as usize));
        let most_room = |fit: bool| {
            (0..k)
                .filter(|&b| !fit || (w <= room[b] && m <= memory_room[b]))
                .max_by(|&x, &y| room[x].total_cmp(&room[y]).then(y.cmp(&x)))
        };
        let b = most_room(true).or_else(|| most_room(false)).unwrap_or(0);
        parts[v as usize] = b as u32;
        room[b] -= w;
        memory_room[b] -= m;
    }
}

/// Refine `parts` (a partition of the coarsest level of `hierarchy`) there, then project it level
/// by level back to `hg`, refining at each (with flows when `flow_slack` is given, see
/// [`refine::refine`]).
fn uncoarsen(
    hg: &Hypergraph,
    hierarchy: &[coarsen::Level],
    mut parts: Vec<u32>,
    caps: &[f64],
    mem: Option<&[f64]>,
    flow_slack: Option<&[f64]>,
    rng: &mut Rng,
) -> Vec<u32> {
    for level in (0..hierarchy.len()).rev() {
        let fine = if level == 0 {
            hg
        } else {
            &hierarchy[level - 1].coarse
        };
        parts = hierarchy[level]
            .map
            .iter()
            .map(|&c| parts[c as usize])
            .collect();
        // Flows on the input level only: on coarser levels they cost as much again and found
        // little that the finest level's flows did not (docs/partition.md).
        let flows = flow_slack.filter(|_| level == 0);
        refine::refine(fine, &mut parts, caps, mem, flows, rng);
    }
    parts
}

/// Independent initial partitions of the coarsest hypergraph; the best one is uncoarsened.
const INITIAL_RUNS: usize = 2;

/// Initial runs on inputs of at most `SMALL_INPUT` vertices (more than the coarsest level's
/// `SMALL`).
const SMALL_INPUT_RUNS: usize = 3;

/// Inputs of at most this many vertices get multilevel bisections (and `SMALL_INPUT_RUNS`).
const SMALL_INPUT: usize = 2500;

/// Below this many vertices the initial partitioner spends more tries.
pub(super) const SMALL: usize = 200;

/// `(1 + ε) · targets[b] · W` per block, after validating the options against `hg`.
fn capacities(hg: &Hypergraph, options: &PartitionOptions) -> Result<Vec<f64>> {
    let targets = &options.targets;
    let k = targets.len();
    if k == 0 {
        return Err(CoreError::invalid(
            "targets",
            "must hold at least one block",
        ));
    }
    if k > hg.num_vertices() {
        return Err(CoreError::invalid(
            "targets",
            format!(
                "asks for {k} blocks, more than the {} vertices",
                hg.num_vertices()
            ),
        ));
    }
    // Pin counts and gains are kept per (net, block) and (vertex, block).
    if (hg.num_vertices() + hg.num_nets()).saturating_mul(k) > 1 << 28 {
        return Err(CoreError::invalid(
            "targets",
            format!("{k} blocks x (num_vertices + len(nets)) exceeds 2**28 table entries"),
        ));
    }
    for (b, &t) in targets.iter().enumerate() {
        if !t.is_finite() || t <= 0.0 {
            return Err(CoreError::invalid(
                format!("targets[{b}]"),
                format!("must be finite and > 0, got {t}"),
            ));
        }
    }
    let sum: f64 = targets.iter().sum();
    if (sum - 1.0).abs() > 1e-9 {
        return Err(CoreError::invalid(
            "targets",
            format!("must sum to 1, got {sum}"),
        ));
    }
    let eps = options.epsilon;
    if !eps.is_finite() || eps < 0.0 {
        return Err(CoreError::invalid(
            "epsilon",
            format!("must be finite and >= 0, got {eps}"),
        ));
    }
    let total = hg.total_weight();
    let caps: Vec<f64> = targets.iter().map(|t| (1.0 + eps) * t * total).collect();
    let largest = caps.iter().copied().fold(0.0, f64::max);
    if let Some((v, w)) = hg
        .vertex_weights
        .iter()
        .enumerate()
        .find(|&(_, &w)| w > largest)
    {
        return Err(CoreError::infeasible(
            "vertex_weights",
            format!(
                "vertex {v} weighs {w}, more than the largest block may hold ({largest}); \
                 no balanced partition exists"
            ),
        ));
    }
    let capacity: f64 = caps.iter().sum();
    if capacity < total {
        return Err(CoreError::infeasible(
            "epsilon",
            format!("the blocks may hold {capacity} in all, less than the total weight {total}"),
        ));
    }
    Ok(caps)
}

/// Whether every block of `parts` weighs at most its capacity and, with `mem`, holds at most its
/// memory capacity (sums in vertex order).
fn balanced(hg: &Hypergraph, parts: &[u32], caps: &[f64], mem: Option<&[f64]>) -> bool {
    let mut w = vec![0.0; caps.len()];
    let mut m = vec![0.0; caps.len()];
    for (v, &b) in parts.iter().enumerate() {
        w[b as usize] += hg.vertex_weights[v];
        m[b as usize] += hg.memory(v);
    }
    w.iter().zip(caps).all(|(w, c)| w <= c)
        && mem.is_none_or(|mem| m.iter().zip(mem).all(|(m, c)| m <= c))
}

/// The validated memory capacities of `options` (`None`: memory not limited), refusing requests
/// whose memory cannot fit with the shortfall.
fn memory_capacities(hg: &Hypergraph, options: &PartitionOptions) -> Result<Option<Vec<f64>>> {
    let Some(cap) = &options.capacity else {
        return Ok(None);
    };
    let k = options.targets.len();
    if cap.len() != k {
        return Err(CoreError::invalid(
            "capacity",
            format!("must hold one entry per block ({k}), got {}", cap.len()),
        ));
    }
    if let Some((b, x)) = cap
        .iter()
        .enumerate()
        .find(|(_, x)| !x.is_finite() || **x < 0.0)
    {
        return Err(CoreError::invalid(
            format!("capacity[{b}]"),
            format!("must be finite and >= 0, got {x}"),
        ));
    }
    if hg.vertex_memory.is_empty() {
        return Err(CoreError::invalid(
            "vertex_memory",
            "is required when capacity is given",
        ));
    }
    let need: f64 = hg.vertex_memory.iter().sum();
    let held: f64 = cap.iter().sum();
    if need > held {
        return Err(CoreError::infeasible(
            "capacity",
            format!(
                "the vertices need {need} in all, the blocks hold {held} together ({} short)",
                need - held
            ),
        ));
    }
    let largest = cap.iter().copied().fold(0.0, f64::max);
    if let Some((v, &x)) = hg
        .vertex_memory
        .iter()
        .enumerate()
        .find(|(_, &x)| x > largest)
    {
        return Err(CoreError::infeasible(
            "capacity",
            format!(
                "vertex {v} needs {x}, more than any block holds (the largest, {largest}; \
                 {} short)",
                x - largest
            ),
        ));
    }
    Ok(Some(cap.clone()))
}

/// `Σ_e w(e) · (λ(e) − 1)` of a partition given as nets in compressed form.
pub fn km1(
    net_offsets: &[usize],
    pins: &[u32],
    parts: &[u32],
    net_weights: Option<&[f64]>,
) -> Result<f64> {
    let m = net_offsets.len().saturating_sub(1);
    if let Some(w) = net_weights {
        if w.len() != m {
            return Err(CoreError::invalid(
                "net_weights",
                format!("must hold {m} entries, got {}", w.len()),
            ));
        }
        if let Some((i, x)) = w
            .iter()
            .enumerate()
            .find(|(_, x)| !x.is_finite() || **x < 0.0)
        {
            return Err(CoreError::invalid(
                format!("net_weights[{i}]"),
                format!("must be finite and >= 0, got {x}"),
            ));
        }
    }
    let mut blocks = Vec::new();
    let mut total = 0.0;
    for e in 0..m {
        let net = &pins[net_offsets[e]..net_offsets[e + 1]];
        blocks.clear();
        for &v in net {
            let b = *parts.get(v as usize).ok_or_else(|| {
                CoreError::invalid(
                    format!("nets[{e}]"),
                    format!(
                        "vertex id {v} out of range 0..{n}: parts has {n} entries, one per vertex",
                        n = parts.len()
                    ),
                )
            })?;
            blocks.push(b);
        }
        blocks.sort_unstable();
        blocks.dedup();
        let lambda = blocks.len().max(1) as f64;
        total += net_weights.map_or(1.0, |w| w[e]) * (lambda - 1.0);
    }
    Ok(total)
}

/// SplitMix64: tiny, fast and good enough for shuffles and tie-breaks; deterministic per seed.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed ^ 0x6a09_e667_f3bc_c909)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (((self.next_u64() >> 11) as u128 * n as u128) >> 53) as usize
    }

    fn shuffle<T>(&mut self, xs: &mut [T]) {
        for i in (1..xs.len()).rev() {
            xs.swap(i, self.below(i + 1));
        }
    }
}

#[cfg(test)]
mod tests;
