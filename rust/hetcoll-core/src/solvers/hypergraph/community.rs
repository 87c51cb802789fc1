//! Community detection before coarsening (Mt-KaHyPar's preprocessing): Louvain modularity
//! clustering of the hypergraph's star expansion, whose communities coarsening may not cross.
//!
//! Heavy-edge rating sees only a vertex's direct neighbours, so on hypergraphs without geometry
//! (power-law nets: hubs in many small nets) early levels glue vertices that the best cuts keep
//! apart, and refinement on the input level cannot undo all of it. Modularity looks at the whole
//! graph: a community is a set of vertices with more nets among them than chance predicts, and
//! clusters inside communities keep the coarse levels' cuts close to the fine level's.

use super::{Hypergraph, Rng};

/// Local-moving rounds per Louvain level (Mt-KaHyPar's `p-max-louvain-pass-iterations`).
const ROUNDS: usize = 5;
/// A round that moves fewer than this share of the nodes is the level's last.
const MIN_MOVED: f64 = 0.01;

/// A weighted undirected graph in compressed form (self-loops dropped; their weight stays in the
/// node volumes).
struct Graph {
    offsets: Vec<usize>,
    targets: Vec<u32>,
    weights: Vec<f64>,
    volume: Vec<f64>,
}

/// One community id per vertex of `hg`, numbered `0..c`; vertices without nets share one.
pub(super) fn communities(hg: &Hypergraph, rng: &mut Rng) -> Vec<u32> {
    let n = hg.num_vertices();
    let m = hg.num_nets();
    // Mt-KaHyPar's choice of arc weight for the star expansion by density (nets per vertex).
    let density = m as f64 / n.max(1) as f64;
    let largest = (0..m).map(|e| hg.net_size(e)).max().unwrap_or(0);
    let arc = |e: usize, v: usize| -> f64 {
        let w = hg.net_weights[e];
        let size = hg.net_size(e) as f64;
        if density < 0.75 {
            w * hg.nets(v).len() as f64 / size
        } else if density < 2.0 && largest > super::coarsen::RATING_NET_LIMIT {
            w / size
        } else {
            w
        }
    };
    let nodes = n + m;
    let mut offsets = vec![0usize; nodes + 1];
    for v in 0..n {
        offsets[v + 1] = hg.nets(v).len();
    }
    for e in 0..m {
        offsets[n + e + 1] = hg.net_size(e);
    }
    for i in 0..nodes {
        offsets[i + 1] += offsets[i];
    }
    let mut targets = vec![0u32; offsets[nodes]];
    let mut weights = vec![0.0; offsets[nodes]];
    let mut fill = offsets.clone();
    for e in 0..m {
        for &v in hg.pins(e) {
            let v = v as usize;
            let w = arc(e, v);
            targets[fill[v]] = (n + e) as u32;
            weights[fill[v]] = w;
            fill[v] += 1;
            targets[fill[n + e]] = v as u32;
            weights[fill[n + e]] = w;
            fill[n + e] += 1;
        }
    }
    let volume = (0..nodes)
        .map(|u| weights[offsets[u]..offsets[u + 1]].iter().sum())
        .collect();
    let graph = Graph {
        offsets,
        targets,
        weights,
        volume,
    };
    let clustering = louvain(&graph, rng);
    // Vertices only, renumbered densely; isolated vertices all in one community so that
    // coarsening can pack them together.
    let mut ids = vec![u32::MAX; nodes];
    let mut next = 0u32;
    let mut isolated = u32::MAX;
    let mut out = vec![0u32; n];
    for (v, slot) in out.iter_mut().enumerate() {
        if hg.nets(v).is_empty() {
            if isolated == u32::MAX {
                isolated = next;
                next += 1;
            }
            *slot = isolated;
            continue;
        }
        let c = clustering[v] as usize;
        if ids[c] == u32::MAX {
            ids[c] = next;
            next += 1;
        }
        *slot = ids[c];
    }
    out
}

/// Multilevel Louvain: local moving, then the communities contracted to nodes and clustered
/// again, while local moving changes something. One community per node of `graph`.
fn louvain(graph: &Graph, rng: &mut Rng) -> Vec<u32> {
    let mut clustering = local_moving(graph, rng);
    let nodes = graph.volume.len();
    // Renumber densely.
    let mut ids = vec![u32::MAX; nodes];
    let mut count = 0u32;
    for c in clustering.iter_mut() {
        if ids[*c as usize] == u32::MAX {
            ids[*c as usize] = count;
            count += 1;
        }
        *c = ids[*c as usize];
    }
    if count as usize == nodes {
        return clustering;
    }
    let coarse = contract(graph, &clustering, count as usize);
    let coarse_clustering = louvain(&coarse, rng);
    for c in clustering.iter_mut() {
        *c = coarse_clustering[*c as usize];
    }
    clustering
}

/// Rounds of moving each node (in random order) to the neighbouring community with the largest
/// modularity gain `w(u, C) − vol(u) · vol(C) / vol(G)`.
fn local_moving(graph: &Graph, rng: &mut Rng) -> Vec<u32> {
    let nodes = graph.volume.len();
    let total: f64 = graph.volume.iter().sum();
    let mut community: Vec<u32> = (0..nodes as u32).collect();
    if total <= 0.0 {
        return community;
    }
    let mut community_volume = graph.volume.clone();
    let mut weight_to = vec![0.0f64; nodes];
    let mut listed: Vec<u32> = Vec::new();
    let mut order: Vec<u32> = (0..nodes as u32).collect();
    for _ in 0..ROUNDS {
        rng.shuffle(&mut order);
        let mut moved = 0usize;
        for &u in &order {
            let u = u as usize;
            let from = community[u] as usize;
            for i in graph.offsets[u]..graph.offsets[u + 1] {
                let c = community[graph.targets[i] as usize] as usize;
                if weight_to[c] == 0.0 {
                    listed.push(c as u32);
                }
                weight_to[c] += graph.weights[i];
            }
            let vol = graph.volume[u];
            community_volume[from] -= vol;
            let mut best = from;
            let mut best_gain = weight_to[from] - vol * community_volume[from] / total;
            for &c in &listed {
                let c = c as usize;
                let gain = weight_to[c] - vol * community_volume[c] / total;
                if gain > best_gain + 1e-12 * best_gain.abs() {
                    best = c;
                    best_gain = gain;
                }
            }
            for &c in &listed {
                weight_to[c as usize] = 0.0;
            }
            listed.clear();
            community_volume[best] += vol;
            if best != from {
                community[u] = best as u32;
                moved += 1;
            }
        }
        if (moved as f64) < MIN_MOVED * nodes as f64 {
            break;
        }
    }
    community
}

/// The graph of `clustering`'s `count` communities: arcs between two summed, inner arcs dropped
/// (their weight stays in the volumes).
fn contract(graph: &Graph, clustering: &[u32], count: usize) -> Graph {
    let nodes = graph.volume.len();
    let mut members: Vec<Vec<u32>> = vec![Vec::new(); count];
    for u in 0..nodes {
        members[clustering[u] as usize].push(u as u32);
    }
    let mut volume = vec![0.0; count];
    let mut offsets = vec![0usize];
    let mut targets = Vec::new();
    let mut weights = Vec::new();
    let mut weight_to = vec![0.0f64; count];
    let mut listed: Vec<u32> = Vec::new();
    for (c, group) in members.iter().enumerate() {
        for &u in group {
            let u = u as usize;
            volume[c] += graph.volume[u];
            for i in graph.offsets[u]..graph.offsets[u + 1] {
                let d = clustering[graph.targets[i] as usize] as usize;
                if d == c {
                    continue;
                }
                if weight_to[d] == 0.0 {
                    listed.push(d as u32);
                }
                weight_to[d] += graph.weights[i];
            }
        }
        for &d in &listed {
            targets.push(d);
            weights.push(weight_to[d as usize]);
            weight_to[d as usize] = 0.0;
        }
        listed.clear();
        offsets.push(targets.len());
    }
    Graph {
        offsets,
        targets,
        weights,
        volume,
    }
}
