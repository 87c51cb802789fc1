//! Flow-based refinement between two blocks (the scheme of KaHyPar-MF: Heuer, Sanders & Schlag,
//! "Network Flow-Based Refinement for Multilevel Hypergraph Partitioning", SEA 2018).
//!
//! FM moves one vertex at a time and stops where every single move loses, so it misses cuts that
//! need a whole group of vertices to change sides together (a layer of a CNN, a front in a mesh).
//! A minimum cut sees those: for a pair of blocks `(a, b)`, grow a region around their common cut
//! (BFS into each block, up to what the other block could take in, scaled by `α`), contract the
//! rest of `a` into the source and the rest of `b` into the sink, and compute a maximum flow in
//! Lawler's network of the hypergraph (net `e` becomes an edge `e_in → e_out` of capacity `w(e)`,
//! pins are joined to it by infinite edges). Its minimum cut is the cheapest way to split the
//! region between `a` and `b` given everything outside it; km1 changes by exactly the change of
//! this two-block cut, since only pins of `a` and `b` move (a net's other blocks still count once).
//! Of the minimum cuts, the best balanced one that meets the limits is taken (a sweep over the
//! residual network's strongly connected components, KaHyPar-MF's "most balanced minimum cut");
//! if none does, `α` is halved and the region shrinks. The result is applied only if it lowers km1 and keeps every block within its weight
//! and memory limits, so refinement never worsens a partition.

use super::refine::State;

/// Initial region scale: the region in `a` may weigh up to `room(b) + (α − 1) · ε · target(b)`.
/// KaHyPar-MF starts at 16. The max-flow's cost grows with the region faster than the cuts it
/// finds: 4 found the same cuts as 8 on the stencil (km1 within 0.5%) and 0.6% worse ones on 2-D
/// kNN, in 60% and 85% of the time (development runs, seeds 0-2; docs/partition.md).
const ALPHA: f64 = 4.0;
/// Rounds over all block pairs while a round improves km1.
const ROUNDS: usize = 3;
/// Work budget of one refinement: the flow networks built may hold at most this many edges per
/// pin of the hypergraph in all; then it stops (heaviest cuts are tried first). kNN hypergraphs
/// used 4 per pin, random matrices 9 and power-law nets 28 on the quick benchmark at k = 8, where
/// flows improved the first and cost the others a third of their time for nothing.
const EDGES_PER_PIN: usize = 8;

/// Improve `state` by flow-based refinement on every pair of blocks that share cut nets (heaviest
/// shared cut first), for up to [`ROUNDS`] rounds. `slack[b]` is `ε · target(b) · W`, the weight
/// the balance constraint lets block `b` exceed its ideal. Returns whether km1 went down.
pub(super) fn flow_refine(state: &mut State<'_>, slack: &[f64]) -> bool {
    let k = state.k;
    let mut improved_any = false;
    let mut network = Network::default();
    let budget = EDGES_PER_PIN * state.hg.pins.len();
    let mut spent = 0usize;
    // Blocks that changed in the last round: later rounds revisit only pairs with one of them
    // (KaHyPar-MF's active block scheduling).
    let mut active = vec![true; k];
    for _ in 0..ROUNDS {
        let mut pairs = pair_cuts(state);
        pairs.retain(|&(a, b, _)| active[a] || active[b]);
        pairs.sort_by(|x, y| y.2.total_cmp(&x.2).then((x.0, x.1).cmp(&(y.0, y.1))));
        let mut changed = vec![false; k];
        for &(a, b, _) in &pairs {
            debug_assert!(a < k && b < k && a != b);
            let mut alpha = ALPHA;
            while alpha >= 1.0 && spent < budget {
                let outcome = refine_pair(state, a, b, alpha, slack, &mut network);
                spent += network.pending.len();
                match outcome {
                    Outcome::Improved => {
                        changed[a] = true;
                        changed[b] = true;
                        break;
                    }
                    Outcome::NoBetterCut => break,
                    Outcome::Unbalanced => alpha /= 2.0,
                }
            }
        }
        if !changed.contains(&true) || spent >= budget {
            improved_any |= changed.contains(&true);
            break;
        }
        improved_any = true;
        active = changed;
    }
    improved_any
}

/// The pairs of blocks `(a, b)`, `a < b`, with the weight of the nets touching both.
fn pair_cuts(state: &State<'_>) -> Vec<(usize, usize, f64)> {
    let k = state.k;
    let hg = state.hg;
    let mut cut = vec![0.0; k * k];
    let mut present = Vec::with_capacity(k);
    for e in 0..hg.num_nets() {
        present.clear();
        present.extend((0..k).filter(|&b| state.phi(e, b) > 0));
        if present.len() < 2 {
            continue;
        }
        for (i, &a) in present.iter().enumerate() {
            for &b in &present[i + 1..] {
                cut[a * k + b] += hg.net_weights[e];
            }
        }
    }
    let mut out = Vec::new();
    for a in 0..k {
        for b in a + 1..k {
            if cut[a * k + b] > 0.0 {
                out.push((a, b, cut[a * k + b]));
            }
        }
    }
    out
}

enum Outcome {
    Improved,
    /// The minimum cut is no better than the current one: a smaller region cannot do better.
    NoBetterCut,
    /// A better cut exists but neither extreme one is balanced.
    Unbalanced,
}

/// Node ids of the flow network: source, sink, then region vertices, then `(e_in, e_out)` pairs.
const SOURCE: usize = 0;
const SINK: usize = 1;

/// A flow network in adjacency-array form, rebuilt for each pair and reused across calls.
#[derive(Default)]
struct Network {
    /// Edges as `(to, residual capacity)`; edge `i ^ 1` is the reverse of edge `i`.
    head: Vec<u32>,
    residual: Vec<f64>,
    /// Edges out of each node, as edge ids (filled from `edges_of` when the network is built).
    first: Vec<usize>,
    adjacency: Vec<u32>,
    /// Edge list before the adjacency arrays are built: `(from, to, capacity)`.
    pending: Vec<(u32, u32, f64)>,
    level: Vec<u32>,
    cursor: Vec<usize>,
    queue: Vec<u32>,
}

impl Network {
    fn clear(&mut self) {
        self.pending.clear();
    }

    fn add(&mut self, from: usize, to: usize, capacity: f64) {
        self.pending.push((from as u32, to as u32, capacity));
    }

    fn build(&mut self, nodes: usize) {
        let m = self.pending.len();
        self.head.clear();
        self.residual.clear();
        self.head.reserve(2 * m);
        self.residual.reserve(2 * m);
        let mut degree = vec![0usize; nodes + 1];
        for &(from, to, capacity) in &self.pending {
            self.head.push(to);
            self.residual.push(capacity);
            self.head.push(from);
            self.residual.push(0.0);
            degree[from as usize + 1] += 1;
            degree[to as usize + 1] += 1;
        }
        for i in 0..nodes {
            degree[i + 1] += degree[i];
        }
        self.first = degree.clone();
        self.adjacency.clear();
        self.adjacency.resize(2 * m, 0);
        let mut fill = degree;
        for (i, &(from, to, _)) in self.pending.iter().enumerate() {
            self.adjacency[fill[from as usize]] = (2 * i) as u32;
            fill[from as usize] += 1;
            self.adjacency[fill[to as usize]] = (2 * i + 1) as u32;
            fill[to as usize] += 1;
        }
    }

    /// Dinic's algorithm: the value of a maximum flow from [`SOURCE`] to [`SINK`], stopping as
    /// soon as it reaches `stop_at` (then no cheaper cut than `stop_at` exists).
    fn max_flow(&mut self, nodes: usize, stop_at: f64) -> f64 {
        let mut flow = 0.0;
        let mut path: Vec<u32> = Vec::new();
        loop {
            if !self.bfs_levels(nodes) {
                return flow;
            }
            self.cursor.clear();
            self.cursor.extend_from_slice(&self.first[..nodes]);
            // Blocking flow by iterative depth-first search along increasing levels.
            let mut u = SOURCE;
            path.clear();
            loop {
                if u == SINK {
                    let bottleneck = path
                        .iter()
                        .map(|&e| self.residual[e as usize])
                        .fold(f64::INFINITY, f64::min);
                    let mut back_to = path.len();
                    for (i, &e) in path.iter().enumerate() {
                        let e = e as usize;
                        self.residual[e] -= bottleneck;
                        self.residual[e ^ 1] += bottleneck;
                        if self.residual[e] <= 0.0 && back_to == path.len() {
                            back_to = i;
                        }
                    }
                    flow += bottleneck;
                    if flow >= stop_at {
                        return flow;
                    }
                    // Resume from the tail of the first saturated edge.
                    path.truncate(back_to);
                    u = path
                        .last()
                        .map_or(SOURCE, |&e| self.head[e as usize] as usize);
                    continue;
                }
                let mut advanced = false;
                while self.cursor[u] < self.first[u + 1] {
                    let e = self.adjacency[self.cursor[u]] as usize;
                    let v = self.head[e] as usize;
                    if self.residual[e] > 0.0 && self.level[v] == self.level[u] + 1 {
                        path.push(e as u32);
                        u = v;
                        advanced = true;
                        break;
                    }
                    self.cursor[u] += 1;
                }
                if advanced {
                    continue;
                }
                // Dead end: no more augmenting paths through `u` in this phase.
                self.level[u] = u32::MAX;
                match path.pop() {
                    None => break,
                    Some(e) => {
                        u = self.head[e as usize ^ 1] as usize;
                        self.cursor[u] += 1;
                    }
                }
            }
        }
    }

    /// BFS levels from the source over residual edges; whether the sink is reachable.
    fn bfs_levels(&mut self, nodes: usize) -> bool {
        self.level.clear();
        self.level.resize(nodes, u32::MAX);
        self.queue.clear();
        self.level[SOURCE] = 0;
        self.queue.push(SOURCE as u32);
        let mut i = 0;
        while i < self.queue.len() {
            let u = self.queue[i] as usize;
            i += 1;
            for j in self.first[u]..self.first[u + 1] {
                let e = self.adjacency[j] as usize;
                let v = self.head[e] as usize;
                if self.residual[e] > 0.0 && self.level[v] == u32::MAX {
                    self.level[v] = self.level[u] + 1;
                    self.queue.push(v as u32);
                }
            }
        }
        self.level[SINK] != u32::MAX
    }

    /// The strongly connected components (over edges with residual capacity) of the nodes neither
    /// reachable from the source nor reaching the sink, each component after every component it
    /// has an edge into: so the union of any prefix is closed under residual edges (Kosaraju's
    /// algorithm, iterative).
    fn middle_components(
        &self,
        nodes: usize,
        from_source: &[bool],
        to_sink: &[bool],
    ) -> Vec<Vec<u32>> {
        let middle = |u: usize| !from_source[u] && !to_sink[u];
        // Pass 1: depth-first finishing order over residual edges.
        let mut visited = vec![false; nodes];
        let mut finished: Vec<u32> = Vec::new();
        let mut stack: Vec<(u32, usize)> = Vec::new();
        for root in 0..nodes {
            if visited[root] || !middle(root) {
                continue;
            }
            visited[root] = true;
            stack.push((root as u32, self.first[root]));
            while let Some(top) = stack.last_mut() {
                let u = top.0 as usize;
                if top.1 < self.first[u + 1] {
                    let e = self.adjacency[top.1] as usize;
                    top.1 += 1;
                    let v = self.head[e] as usize;
                    if self.residual[e] > 0.0 && !visited[v] && middle(v) {
                        visited[v] = true;
                        stack.push((v as u32, self.first[v]));
                    }
                } else {
                    finished.push(u as u32);
                    stack.pop();
                }
            }
        }
        // Pass 2: over reversed residual edges in decreasing finishing time; components come out
        // in topological order (a component before those it has edges into), so reverse them.
        let mut component = vec![u32::MAX; nodes];
        let mut components: Vec<Vec<u32>> = Vec::new();
        let mut todo: Vec<u32> = Vec::new();
        for &root in finished.iter().rev() {
            if component[root as usize] != u32::MAX {
                continue;
            }
            let id = components.len() as u32;
            let mut members = vec![root];
            component[root as usize] = id;
            todo.push(root);
            while let Some(u) = todo.pop() {
                let u = u as usize;
                for j in self.first[u]..self.first[u + 1] {
                    let e = self.adjacency[j] as usize;
                    let v = self.head[e] as usize;
                    // Edge v → u is e ^ 1.
                    if self.residual[e ^ 1] > 0.0 && middle(v) && component[v] == u32::MAX {
                        component[v] = id;
                        members.push(v as u32);
                        todo.push(v as u32);
                    }
                }
            }
            components.push(members);
        }
        components.reverse();
        components
    }

    /// Nodes reachable from `start` over edges with residual capacity (`forward`), or from
    /// which `start` is reachable so (not `forward`).
    fn reachable(&mut self, nodes: usize, start: usize, forward: bool) -> Vec<bool> {
        let mut seen = vec![false; nodes];
        seen[start] = true;
        self.queue.clear();
        self.queue.push(start as u32);
        let mut i = 0;
        while i < self.queue.len() {
            let u = self.queue[i] as usize;
            i += 1;
            for j in self.first[u]..self.first[u + 1] {
                let e = self.adjacency[j] as usize;
                let v = self.head[e] as usize;
                // Forward: u → v has residual. Backward: v → u (edge e ^ 1) has residual.
                let open = if forward {
                    self.residual[e] > 0.0
                } else {
                    self.residual[e ^ 1] > 0.0
                };
                if open && !seen[v] {
                    seen[v] = true;
                    self.queue.push(v as u32);
                }
            }
        }
        seen
    }
}

/// One attempt at a better cut between blocks `a` and `b` with region scale `alpha`.
fn refine_pair(
    state: &mut State<'_>,
    a: usize,
    b: usize,
    alpha: f64,
    slack: &[f64],
    network: &mut Network,
) -> Outcome {
    let hg = state.hg;
    let n = hg.num_vertices();
    network.clear();
    // Region: vertices of `a` that may go to `b` (up to what `b` could take in) and vice versa.
    let limit_a = state.room(b).0 + (alpha - 1.0) * slack[b];
    let limit_b = state.room(a).0 + (alpha - 1.0) * slack[a];
    let mut node_of = vec![u32::MAX; n];
    let mut region: Vec<u32> = Vec::new();
    // The side whose growth last read each net's pins. The weight taken only grows, so a pin
    // a net's first reading left out (taken, in another block, or too heavy) stays out: a
    // second reading adds nothing, and reading each net once per side keeps the growth linear
    // in the pins (a CNN's nets, each a filter and the whole next layer, made it quadratic).
    let mut read_by = vec![usize::MAX; hg.num_nets()];
    for (side, other, limit) in [(a, b, limit_a), (b, a, limit_b)] {
        // Seeds: pins in `side` of nets that touch both blocks.
        let start = region.len();
        let mut weight = 0.0;
        for (e, read) in read_by.iter_mut().enumerate() {
            if state.phi(e, side) == 0 || state.phi(e, other) == 0 {
                continue;
            }
            *read = side;
            for &v in hg.pins(e) {
                let v = v as usize;
                if state.parts[v] as usize == side && node_of[v] == u32::MAX {
                    let w = hg.vertex_weights[v];
                    if weight + w <= limit {
                        weight += w;
                        node_of[v] = (2 + region.len()) as u32;
                        region.push(v as u32);
                    }
                }
            }
        }
        // Breadth-first into `side` from the seeds.
        let mut i = start;
        while i < region.len() {
            let v = region[i] as usize;
            i += 1;
            for &e in hg.nets(v) {
                let e = e as usize;
                if read_by[e] == side {
                    continue;
                }
                read_by[e] = side;
                for &u in hg.pins(e) {
                    let u = u as usize;
                    if state.parts[u] as usize == side && node_of[u] == u32::MAX {
                        let w = hg.vertex_weights[u];
                        if weight + w <= limit {
                            weight += w;
                            node_of[u] = (2 + region.len()) as u32;
                            region.push(u as u32);
                        }
                    }
                }
            }
        }
    }
    if region.is_empty() {
        return Outcome::NoBetterCut;
    }
    // Nets with a region pin, restricted to pins in `a` and `b`: Lawler's gadget, joined to the
    // source (sink) when a pin of `a` (`b`) lies outside the region.
    let mut nodes = 2 + region.len();
    let mut current_cut = 0.0;
    let mut net_seen = vec![false; hg.num_nets()];
    let mut included: Vec<u32> = Vec::new();
    let mut big = 0.0;
    for &v in &region {
        for &e in hg.nets(v as usize) {
            let e = e as usize;
            if net_seen[e] {
                continue;
            }
            net_seen[e] = true;
            let pins_ab = state.phi(e, a) + state.phi(e, b);
            if pins_ab < 2 {
                continue;
            }
            let mut to_source = false;
            let mut to_sink = false;
            for &u in hg.pins(e) {
                let u = u as usize;
                let p = state.parts[u] as usize;
                if node_of[u] == u32::MAX {
                    to_source |= p == a;
                    to_sink |= p == b;
                }
            }
            if to_source && to_sink {
                continue; // cut whatever happens inside the region
            }
            let w = hg.net_weights[e];
            if state.phi(e, a) > 0 && state.phi(e, b) > 0 {
                current_cut += w;
            }
            included.push(e as u32);
            big += w;
            let (e_in, e_out) = (nodes, nodes + 1);
            nodes += 2;
            network.add(e_in, e_out, w);
            if to_source {
                network.add(SOURCE, e_in, f64::INFINITY);
            }
            if to_sink {
                network.add(e_out, SINK, f64::INFINITY);
            }
            for &u in hg.pins(e) {
                let node = node_of[u as usize];
                if node != u32::MAX {
                    network.add(node as usize, e_in, f64::INFINITY);
                    network.add(e_out, node as usize, f64::INFINITY);
                }
            }
        }
    }
    if current_cut <= 0.0 || big <= 0.0 {
        return Outcome::NoBetterCut;
    }
    network.build(nodes);
    let flow = network.max_flow(nodes, current_cut);
    if flow >= current_cut {
        return Outcome::NoBetterCut;
    }
    // Minimum cuts: every source side that contains the nodes the source reaches in the residual
    // network, none that reach the sink, and is closed under residual edges. The nodes in between
    // form strongly connected components whose DAG's successor-closed prefixes are exactly those
    // cuts (Picard & Queyranne); sweep one such order and take the best balanced prefix (KaHyPar-
    // MF's "most balanced minimum cut"), the extreme ones included.
    let from_source = network.reachable(nodes, SOURCE, true);
    let to_sink = network.reachable(nodes, SINK, false);
    let components = network.middle_components(nodes, &from_source, &to_sink);
    // Change of block a's weight and memory when region vertices on the source side go to `a`.
    let mut delta = [0.0, 0.0];
    for (i, &v) in region.iter().enumerate() {
        let v = v as usize;
        let now_a = state.parts[v] as usize == a;
        if now_a != from_source[2 + i] {
            let sign = if now_a { -1.0 } else { 1.0 };
            delta[0] += sign * hg.vertex_weights[v];
            delta[1] += sign * hg.memory(v);
        }
    }
    let (room_a, memory_room_a) = state.room(a);
    let (room_b, memory_room_b) = state.room(b);
    let fits = |d: [f64; 2]| {
        d[0] <= room_a && -d[0] <= room_b && d[1] <= memory_room_a && -d[1] <= memory_room_b
    };
    // Among the balanced ones, the one leaving the fuller of the two blocks most room.
    let imbalance = |d: [f64; 2]| {
        ((state.block_weights[a] + d[0]) / state.caps[a])
            .max((state.block_weights[b] - d[0]) / state.caps[b])
    };
    let mut best: Option<(f64, usize)> = None;
    let region_nodes = 2..2 + region.len();
    for prefix in 0..=components.len() {
        if prefix > 0 {
            for &node in &components[prefix - 1] {
                let node = node as usize;
                if region_nodes.contains(&node) {
                    let v = region[node - 2] as usize;
                    delta[0] += hg.vertex_weights[v];
                    delta[1] += hg.memory(v);
                }
            }
        }
        if fits(delta) && best.is_none_or(|(x, _)| imbalance(delta) < x) {
            best = Some((imbalance(delta), prefix));
        }
    }
    let Some((_, chosen)) = best else {
        return Outcome::Unbalanced;
    };
    let mut source_side = from_source;
    for component in &components[..chosen] {
        for &node in component {
            source_side[node as usize] = true;
        }
    }
    let to_a = |node: usize| source_side[node];
    // Check the cut exactly before applying (flows in floating point): the included nets' cut
    // between `a` and `b` under the new assignment must be lower.
    let side_of = |u: usize| -> Option<bool> {
        let node = node_of[u];
        if node != u32::MAX {
            Some(to_a(node as usize))
        } else {
            match state.parts[u] as usize {
                p if p == a => Some(true),
                p if p == b => Some(false),
                _ => None,
            }
        }
    };
    let mut new_cut = 0.0;
    for &e in &included {
        let e = e as usize;
        let (mut in_a, mut in_b) = (false, false);
        for &u in hg.pins(e) {
            match side_of(u as usize) {
                Some(true) => in_a = true,
                Some(false) => in_b = true,
                None => {}
            }
        }
        if in_a && in_b {
            new_cut += hg.net_weights[e];
        }
    }
    if new_cut >= current_cut {
        return Outcome::NoBetterCut;
    }
    for (i, &v) in region.iter().enumerate() {
        let v = v as usize;
        let target = if to_a(2 + i) { a } else { b };
        if state.parts[v] as usize != target {
            state.apply(v, target, |_| {});
        }
    }
    Outcome::Improved
}
