use proptest::prelude::*;

use super::*;

fn build(
    n: usize,
    nets: &[Vec<u32>],
    vw: Option<Vec<f64>>,
    nw: Option<Vec<f64>>,
) -> Result<Hypergraph> {
    let mut offsets = vec![0usize];
    for net in nets {
        offsets.push(offsets.last().unwrap() + net.len());
    }
    Hypergraph::new(n, offsets, nets.concat(), vw, nw)
}

fn block_weights(hg: &Hypergraph, parts: &[u32], k: usize) -> Vec<f64> {
    let mut w = vec![0.0; k];
    for (v, &b) in parts.iter().enumerate() {
        w[b as usize] += hg.vertex_weights[v];
    }
    w
}

/// Smallest km1 over all balanced partitions (k^n of them).
fn brute_force(hg: &Hypergraph, caps: &[f64]) -> f64 {
    let n = hg.num_vertices();
    let k = caps.len();
    let mut best = f64::INFINITY;
    let mut parts = vec![0u32; n];
    for code in 0..k.pow(n as u32) {
        let mut c = code;
        for p in parts.iter_mut() {
            *p = (c % k) as u32;
            c /= k;
        }
        let w = block_weights(hg, &parts, k);
        if w.iter().zip(caps).all(|(w, c)| w <= c) {
            best = best.min(hg.km1(&parts));
        }
    }
    best
}

fn tiny_hypergraph() -> impl Strategy<Value = (usize, Vec<Vec<u32>>, Vec<f64>, Vec<f64>)> {
    (4usize..9).prop_flat_map(|n| {
        let net = prop::sample::subsequence((0..n as u32).collect::<Vec<_>>(), 2..=n.min(4));
        (
            Just(n),
            prop::collection::vec(net, 1..12),
            prop::collection::vec(1u32..4, n),
            prop::collection::vec(1u32..5, 12),
        )
            .prop_map(|(n, nets, vw, nw)| {
                let m = nets.len();
                (
                    n,
                    nets,
                    vw.into_iter().map(f64::from).collect(),
                    nw[..m].iter().map(|&w| f64::from(w)).collect(),
                )
            })
    })
}

#[test]
fn two_cliques_are_separated() {
    let nets = vec![
        vec![0, 1, 2],
        vec![1, 2],
        vec![0, 2],
        vec![3, 4, 5],
        vec![4, 5],
        vec![3, 5],
        vec![2, 3],
    ];
    let hg = build(6, &nets, None, None).unwrap();
    let parts = partition_hypergraph(&hg, &PartitionOptions::new(vec![0.5, 0.5])).unwrap();
    assert_eq!(hg.km1(&parts), 1.0);
    assert_ne!(parts[0], parts[5]);
}

#[test]
fn bad_input_names_the_argument() {
    let arg = |r: Result<Hypergraph>| r.unwrap_err().argument().to_string();
    assert_eq!(arg(build(3, &[vec![0, 3]], None, None)), "nets[0]");
    assert_eq!(arg(build(3, &[vec![0, 1], vec![]], None, None)), "nets[1]");
    assert_eq!(arg(build(3, &[vec![1, 1]], None, None)), "nets[0]");
    assert_eq!(
        arg(build(2, &[vec![0, 1]], Some(vec![1.0, f64::NAN]), None)),
        "vertex_weights[1]"
    );
    assert_eq!(
        arg(build(2, &[vec![0, 1]], None, Some(vec![-1.0]))),
        "net_weights[0]"
    );
    assert_eq!(
        arg(build(2, &[vec![0, 1]], Some(vec![1.0]), None)),
        "vertex_weights"
    );
    let hg = build(3, &[vec![0, 1, 2]], None, None).unwrap();
    let run = |targets: Vec<f64>, eps: f64| {
        let mut o = PartitionOptions::new(targets);
        o.epsilon = eps;
        partition_hypergraph(&hg, &o)
            .unwrap_err()
            .argument()
            .to_string()
    };
    assert_eq!(run(vec![0.5, 0.6], 0.03), "targets");
    assert_eq!(run(vec![0.25; 4], 0.03), "targets");
    assert_eq!(run(vec![0.5, 0.5], -0.1), "epsilon");
    assert_eq!(run(vec![1.0, 0.0], 0.0), "targets[1]");
    // Three unit vertices cannot be split 1.5 / 1.5 without slack.
    assert_eq!(run(vec![0.5, 0.5], 0.0), "targets");
    let heavy = build(3, &[vec![0, 1, 2]], Some(vec![10.0, 1.0, 1.0]), None).unwrap();
    let err = partition_hypergraph(&heavy, &PartitionOptions::new(vec![0.5, 0.5])).unwrap_err();
    assert_eq!(err.argument(), "vertex_weights");
}

#[test]
fn km1_counts_connectivity_minus_one() {
    let offsets = [0, 3, 5];
    let pins = [0, 1, 2, 2, 3];
    assert_eq!(km1(&offsets, &pins, &[0, 1, 2, 2], None).unwrap(), 2.0);
    assert_eq!(
        km1(&offsets, &pins, &[0, 1, 2, 2], Some(&[2.0, 5.0])).unwrap(),
        4.0
    );
    assert!(km1(&offsets, &pins, &[0, 1, 2], None).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn balanced_and_deterministic(
        (n, nets, vw, nw) in tiny_hypergraph(),
        k in 2usize..4,
        skew in 0u32..3,
        seed in 0u64..4,
    ) {
        let hg = build(n, &nets, Some(vw), Some(nw)).unwrap();
        // Heterogeneous targets: block 0 gets (1 + skew) shares.
        let shares: Vec<f64> = (0..k).map(|b| if b == 0 { 1.0 + f64::from(skew) } else { 1.0 }).collect();
        let sum: f64 = shares.iter().sum();
        let mut options = PartitionOptions::new(shares.iter().map(|s| s / sum).collect());
        options.epsilon = 0.2;
        options.seed = seed;
        let caps = capacities(&hg, &options);
        let optimum = caps.as_ref().ok().map(|c| brute_force(&hg, c));
        match partition_hypergraph(&hg, &options) {
            Ok(parts) => {
                let caps = caps.unwrap();
                let w = block_weights(&hg, &parts, k);
                prop_assert!(w.iter().zip(&caps).all(|(w, c)| w <= c), "{w:?} > {caps:?}");
                prop_assert_eq!(&parts, &partition_hypergraph(&hg, &options).unwrap());
                prop_assert!(hg.km1(&parts) >= optimum.unwrap());
            }
            Err(e) => {
                // Only when no balanced partition exists at all.
                prop_assert!(optimum.is_none_or(|o| o.is_infinite()), "{e}");
            }
        }
    }
}

/// On 300 seeded random tiny instances (k = 2..4, unequal targets) the partitioner must find the
/// brute-force optimum in at least 75% of the cases (it reaches 82%, 230 of 281: local search
/// cannot swap heavy vertices between tight blocks).
#[test]
fn near_optimal_on_tiny_instances() {
    let mut rng = super::Rng::new(7);
    let (mut optimal, mut total, mut worst) = (0usize, 0usize, 0.0f64);
    for _ in 0..300 {
        let n = 5 + rng.below(5);
        let m = 3 + rng.below(10);
        let nets: Vec<Vec<u32>> = (0..m)
            .map(|_| {
                let mut vs: Vec<u32> = (0..n as u32).collect();
                rng.shuffle(&mut vs);
                vs.truncate(2 + rng.below(3));
                vs
            })
            .collect();
        let vw: Vec<f64> = (0..n).map(|_| 1.0 + rng.below(3) as f64).collect();
        let nw: Vec<f64> = (0..m).map(|_| 1.0 + rng.below(4) as f64).collect();
        let hg = build(n, &nets, Some(vw), Some(nw)).unwrap();
        let k = 2 + rng.below(3);
        let shares: Vec<f64> = (0..k).map(|b| 1.0 + (b == 0) as u32 as f64).collect();
        let sum: f64 = shares.iter().sum();
        let mut options = PartitionOptions::new(shares.iter().map(|s| s / sum).collect());
        options.epsilon = 0.25;
        let Ok(caps) = capacities(&hg, &options) else {
            continue;
        };
        let best = brute_force(&hg, &caps);
        if best.is_infinite() {
            continue;
        }
        let got = hg.km1(&partition_hypergraph(&hg, &options).unwrap());
        total += 1;
        optimal += (got == best) as usize;
        worst = worst.max(got - best);
    }
    eprintln!("optimal in {optimal}/{total}, worst excess {worst}");
    assert!(total >= 200);
    assert!(
        optimal * 4 >= total * 3,
        "optimal in only {optimal}/{total}"
    );
}

/// Whether `parts` holds at most `cap[b]` memory in every block `b`.
fn fits_memory(hg: &Hypergraph, parts: &[u32], cap: &[f64]) -> bool {
    let mut used = vec![0.0; cap.len()];
    for (v, &b) in parts.iter().enumerate() {
        used[b as usize] += hg.memory(v);
    }
    used.iter().zip(cap).all(|(u, c)| u <= c)
}

/// Smallest km1 over partitions that are balanced and fit the memory capacities (∞: none).
fn brute_force_memory(hg: &Hypergraph, caps: &[f64], cap: &[f64]) -> f64 {
    let n = hg.num_vertices();
    let k = caps.len();
    let mut best = f64::INFINITY;
    let mut parts = vec![0u32; n];
    for code in 0..k.pow(n as u32) {
        let mut c = code;
        for p in parts.iter_mut() {
            *p = (c % k) as u32;
            c /= k;
        }
        let w = block_weights(hg, &parts, k);
        if w.iter().zip(caps).all(|(w, c)| w <= c) && fits_memory(hg, &parts, cap) {
            best = best.min(hg.km1(&parts));
        }
    }
    best
}

#[test]
fn memory_capacity_is_respected_on_a_grid() {
    // A 40x40 grid (a net per row segment and column segment of 2 pins); the left half's vertices
    // need 3 units of memory, the right half's 1. Uniform targets would put the whole left half in
    // one block (the smallest cut); block 0 may hold only 1100 units, so it cannot.
    let side = 40u32;
    let mut nets = Vec::new();
    for r in 0..side {
        for c in 0..side - 1 {
            nets.push(vec![r * side + c, r * side + c + 1]);
            nets.push(vec![c * side + r, (c + 1) * side + r]);
        }
    }
    let n = (side * side) as usize;
    let memory: Vec<f64> = (0..n)
        .map(|v| {
            if (v as u32 % side) < side / 2 {
                3.0
            } else {
                1.0
            }
        })
        .collect();
    let hg = build(n, &nets, None, None)
        .unwrap()
        .with_vertex_memory(memory)
        .unwrap();
    let mut options = PartitionOptions::new(vec![0.5, 0.5]);
    let cap = vec![1650.0, 1650.0];
    options.capacity = Some(cap.clone());
    let parts = partition_hypergraph(&hg, &options).unwrap();
    assert!(fits_memory(&hg, &parts, &cap));
    let caps = capacities(&hg, &options).unwrap();
    let w = block_weights(&hg, &parts, 2);
    assert!(w.iter().zip(&caps).all(|(w, c)| w <= c), "{w:?}");
    assert_eq!(parts, partition_hypergraph(&hg, &options).unwrap());
}

#[test]
fn infeasible_memory_says_by_how_much() {
    let hg = build(4, &[vec![0, 1], vec![2, 3], vec![1, 2]], None, None)
        .unwrap()
        .with_vertex_memory(vec![3.0, 1.0, 1.0, 1.0])
        .unwrap();
    let run = |cap: Vec<f64>| {
        let mut options = PartitionOptions::new(vec![0.5, 0.5]);
        options.capacity = Some(cap);
        partition_hypergraph(&hg, &options).unwrap_err()
    };
    let total = run(vec![3.0, 2.5]).to_string();
    assert!(
        total.contains("need 6 in all") && total.contains("(0.5 short)"),
        "{total}"
    );
    let mut options = PartitionOptions::new(vec![1.0 / 3.0; 3]);
    options.capacity = Some(vec![2.5; 3]);
    let single = partition_hypergraph(&hg, &options).unwrap_err().to_string();
    assert!(
        single.contains("vertex 0 needs 3") && single.contains("0.5 short"),
        "{single}"
    );
    assert_eq!(run(vec![1.0]).argument(), "capacity");
    assert_eq!(run(vec![4.0, f64::NAN]).argument(), "capacity[1]");
    let plain = build(2, &[vec![0, 1]], None, None).unwrap();
    let mut options = PartitionOptions::new(vec![0.5, 0.5]);
    options.capacity = Some(vec![1.0, 1.0]);
    let err = partition_hypergraph(&plain, &options).unwrap_err();
    assert_eq!(err.argument(), "vertex_memory");
    let bad = plain.with_vertex_memory(vec![1.0, -1.0]).unwrap_err();
    assert_eq!(bad.argument(), "vertex_memory[1]");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Every partition returned fits the memory capacities and is balanced; when the brute force
    /// finds a fitting partition the partitioner finds one too (it failed on none of the seeds).
    #[test]
    fn memory_fits_against_brute_force(
        (n, nets, vw, nw) in tiny_hypergraph(),
        memory in prop::collection::vec(0u32..5, 8),
        k in 2usize..4,
        slack in 0u32..6,
        seed in 0u64..4,
    ) {
        let memory: Vec<f64> = memory[..n].iter().map(|&m| f64::from(m)).collect();
        let total: f64 = memory.iter().sum();
        let hg = build(n, &nets, Some(vw), Some(nw)).unwrap().with_vertex_memory(memory).unwrap();
        let mut options = PartitionOptions::new(vec![1.0 / k as f64; k]);
        options.epsilon = 0.5;
        options.seed = seed;
        // Block 0 holds little memory, the others share the rest plus some slack.
        let rest = (total + f64::from(slack)) / k as f64;
        let cap: Vec<f64> = (0..k).map(|b| if b == 0 { (rest / 2.0).floor() } else { rest }).collect();
        options.capacity = Some(cap.clone());
        let caps = capacities(&hg, &options);
        let optimum = caps.as_ref().ok().map(|c| brute_force_memory(&hg, c, &cap));
        match partition_hypergraph(&hg, &options) {
            Ok(parts) => {
                let caps = caps.unwrap();
                let w = block_weights(&hg, &parts, k);
                prop_assert!(w.iter().zip(&caps).all(|(w, c)| w <= c), "{w:?} > {caps:?}");
                prop_assert!(fits_memory(&hg, &parts, &cap));
                prop_assert!(hg.km1(&parts) >= optimum.unwrap());
                prop_assert_eq!(&parts, &partition_hypergraph(&hg, &options).unwrap());
            }
            Err(e) => prop_assert!(optimum.is_none_or(|o| o.is_infinite()), "{e}"),
        }
    }
}

/// A refinement's starting point from a tiny hypergraph's draws: the hypergraph with vertex
/// memory `memory`, the partition `start` (blocks mod k), and limits the start meets - weight
/// caps at its heaviest block or the balanced share if that is more, memory caps at its fullest
/// block.
fn start_within_limits(
    (n, nets, vw, nw): (usize, Vec<Vec<u32>>, Vec<f64>, Vec<f64>),
    k: usize,
    eps: f64,
    start: &[u32],
    memory: &[u32],
) -> (Hypergraph, Vec<u32>, Vec<f64>, Vec<f64>) {
    let hg = build(n, &nets, Some(vw), Some(nw)).unwrap();
    let parts: Vec<u32> = start[..n].iter().map(|&b| b % k as u32).collect();
    let heaviest = block_weights(&hg, &parts, k)
        .into_iter()
        .fold(0.0, f64::max);
    let caps = vec![heaviest.max((1.0 + eps) * hg.total_weight() / k as f64); k];
    let mem_of: Vec<f64> = memory[..n].iter().map(|&m| f64::from(m)).collect();
    let mut used = vec![0.0; k];
    for (v, &b) in parts.iter().enumerate() {
        used[b as usize] += mem_of[v];
    }
    let mem_caps = vec![used.iter().copied().fold(0.0, f64::max); k];
    (
        hg.with_vertex_memory(mem_of).unwrap(),
        parts,
        caps,
        mem_caps,
    )
}

/// Flow refinement of a given partition: km1 before and after, and the partition after.
fn flow_once(
    hg: &Hypergraph,
    parts: Vec<u32>,
    caps: &[f64],
    eps: f64,
    mem: Option<&[f64]>,
) -> (f64, f64, Vec<u32>) {
    let before = hg.km1(&parts);
    let mut state = refine::State::new(hg, parts, caps);
    if let Some(mem) = mem {
        state.limit_memory(mem);
    }
    let slack: Vec<f64> = caps.iter().map(|c| c * eps / (1.0 + eps)).collect();
    let improved = flow::flow_refine(&mut state, &slack);
    let after = hg.km1(&state.parts);
    // The state's own bookkeeping agrees with a recount.
    assert!((state.km1() - after).abs() < 1e-9);
    assert_eq!(improved, after < before);
    (before, after, state.parts)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// From any balanced partition, flow refinement never raises km1, keeps every block within its
    /// weight and memory limits, and is deterministic.
    #[test]
    fn flows_never_worsen_and_keep_balance(
        drawn in tiny_hypergraph(),
        k in 2usize..4,
        eps in prop::sample::select(vec![0.03, 0.2, 0.5]),
        start in prop::collection::vec(0u32..3, 9),
        memory in prop::collection::vec(0u32..4, 9),
        limit_memory in any::<bool>(),
    ) {
        let (hg, parts, caps, mem_caps) = start_within_limits(drawn, k, eps, &start, &memory);
        let mem = limit_memory.then_some(mem_caps.as_slice());
        let (before, after, out) = flow_once(&hg, parts.clone(), &caps, eps, mem);
        prop_assert!(after <= before, "{after} > {before}");
        let w = block_weights(&hg, &out, k);
        prop_assert!(w.iter().zip(&caps).all(|(w, c)| w <= c), "{w:?} > {caps:?}");
        if let Some(mem) = mem {
            prop_assert!(fits_memory(&hg, &out, mem));
        }
        prop_assert_eq!(out, flow_once(&hg, parts, &caps, eps, mem).2);
    }
}

/// An 8x8 grid (2-pin nets between neighbours) bisected with a zig-zag boundary: every odd row
/// has its two middle cells swapped. Flows must find a straight cut (8 nets) and keep balance.
#[test]
fn flows_straighten_a_zigzag_cut() {
    let side = 8u32;
    let id = |x: u32, y: u32| y * side + x;
    let mut nets: Vec<Vec<u32>> = Vec::new();
    for y in 0..side {
        for x in 0..side {
            if x + 1 < side {
                nets.push(vec![id(x, y), id(x + 1, y)]);
            }
            if y + 1 < side {
                nets.push(vec![id(x, y), id(x, y + 1)]);
            }
        }
    }
    let hg = build(64, &nets, None, None).unwrap();
    let mut parts: Vec<u32> = (0..64).map(|v| u32::from(v % side >= 4)).collect();
    for y in (1..side).step_by(2) {
        parts.swap(id(3, y) as usize, id(4, y) as usize);
    }
    let eps = 0.1;
    let caps = [32.0 * (1.0 + eps), 32.0 * (1.0 + eps)];
    let (before, after, parts) = flow_once(&hg, parts, &caps, eps, None);
    assert!(before > 8.0);
    assert_eq!(after, 8.0, "{parts:?}");
    assert!(block_weights(&hg, &parts, 2).iter().all(|&w| w <= caps[0]));
}

/// A chain of layers as in a CNN's hypergraph: each vertex's output net holds it and the whole
/// next layer. Cuts between layers cost that layer's output nets; the partitioner must find the
/// cheap, balanced boundary (layers of 4 vertices; the boundary after layer 2 is the only
/// balanced one, and its nets are light).
#[test]
fn layered_chain_is_cut_between_layers() {
    let layers = 4usize;
    let width = 4usize;
    let mut nets: Vec<Vec<u32>> = Vec::new();
    let mut nw: Vec<f64> = Vec::new();
    for l in 0..layers - 1 {
        for i in 0..width {
            let mut net = vec![(l * width + i) as u32];
            net.extend((0..width).map(|j| ((l + 1) * width + j) as u32));
            nets.push(net);
            nw.push(if l == 1 { 1.0 } else { 10.0 });
        }
    }
    let hg = build(layers * width, &nets, None, Some(nw)).unwrap();
    let parts = partition_hypergraph(&hg, &PartitionOptions::new(vec![0.5, 0.5])).unwrap();
    assert_eq!(hg.km1(&parts), 4.0, "{parts:?}");
}

/// A CNN's hypergraph from its layers `(filters, weight of each, weight of its output nets)`:
/// each filter's output net holds it and the whole next layer.
fn layered(layers: &[(usize, f64, f64)]) -> Hypergraph {
    let mut vw = Vec::new();
    let mut nets: Vec<Vec<u32>> = Vec::new();
    let mut nw = Vec::new();
    let mut start = 0u32;
    for (l, &(count, weight, out)) in layers.iter().enumerate() {
        vw.extend(std::iter::repeat_n(weight, count));
        if let Some(&(next, _, _)) = layers.get(l + 1) {
            let readers: Vec<u32> = (start + count as u32..start + (count + next) as u32).collect();
            for f in 0..count as u32 {
                let mut net = vec![start + f];
                net.extend_from_slice(&readers);
                nets.push(net);
                nw.push(out);
            }
        }
        start += count as u32;
    }
    build(vw.len(), &nets, Some(vw), Some(nw)).unwrap()
}

/// VGG-11 at k = 2: the cheapest balanced cut is between the 4th and 5th convolution (8192),
/// which needs whole layers on each side. The heavy 4th layer's filters cannot pair with each
/// other under the cluster weight limit; they used to pair with the 5th layer's, erasing that cut
/// at the coarse levels, and greedy growing plus FM landed at 4x (32768). The BFS sweep and the
/// weak-partner rule in coarsening find it.
#[test]
fn vgg_is_cut_between_layers() {
    // VGG-11's convolutional stack at half width, weights scaled as in
    // benches/compare_partitioners.py (filters by FLOPs, feature maps by bytes).
    let hg = layered(&[
        (32, 3750.0, 1024.0),
        (64, 10000.0, 256.0),
        (128, 5000.0, 256.0),
        (128, 10000.0, 64.0),
        (256, 2500.0, 64.0),
        (256, 5000.0, 16.0),
        (256, 1250.0, 16.0),
        (256, 1250.0, 4.0),
        (10, 35.0, 0.0),
    ]);
    for seed in 0..3 {
        let mut options = PartitionOptions::new(vec![0.5, 0.5]);
        options.seed = seed;
        let parts = partition_hypergraph(&hg, &options).unwrap();
        assert_eq!(hg.km1(&parts), 8192.0, "seed {seed}");
    }
}

/// VGG-11 at quarter width, k = 2: the cut between the 4th and 5th convolution leaves the first
/// side 1.4% over its limit, and no balanced cut between layers is cheap. Mt-KaHyPar's partition
/// (7168) takes that cut and moves 3 of the 16 first-layer filters over (cheap per unit of
/// weight): the relaxed BFS sweep offers the slightly unbalanced cut, rebalancing moves those.
#[test]
fn vgg_quarter_width_rebalances_a_layer_cut() {
    let hg = layered(&[
        (16, 7500.0, 1024.0),
        (32, 10000.0, 256.0),
        (64, 5000.0, 256.0),
        (64, 10000.0, 64.0),
        (128, 2500.0, 64.0),
        (128, 5000.0, 16.0),
        (128, 1250.0, 16.0),
        (128, 1250.0, 4.0),
        (10, 35.0, 0.0),
    ]);
    for seed in 0..3 {
        let mut options = PartitionOptions::new(vec![0.5, 0.5]);
        options.seed = seed;
        let parts = partition_hypergraph(&hg, &options).unwrap();
        assert_eq!(hg.km1(&parts), 7168.0, "seed {seed}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// From any partition within its limits, localized FM never raises km1, keeps every block
    /// within its weight and memory limits, and is deterministic for a seed.
    #[test]
    fn localized_fm_never_worsens_and_keeps_balance(
        drawn in tiny_hypergraph(),
        k in 2usize..4,
        eps in prop::sample::select(vec![0.03, 0.2, 0.5]),
        start in prop::collection::vec(0u32..3, 9),
        memory in prop::collection::vec(0u32..4, 9),
        limit_memory in any::<bool>(),
        seed in 0u64..1000,
    ) {
        let (hg, parts, caps, mem_caps) = start_within_limits(drawn, k, eps, &start, &memory);
        let run = |parts: Vec<u32>| {
            let mut state = refine::State::new(&hg, parts, &caps);
            if limit_memory {
                state.limit_memory(&mem_caps);
            }
            refine::localized_fm(&mut state, &mut super::Rng::new(seed), 10);
            // The state's own bookkeeping agrees with a recount.
            assert!((state.km1() - hg.km1(&state.parts)).abs() < 1e-9);
            state.parts
        };
        let out = run(parts.clone());
        prop_assert!(hg.km1(&out) <= hg.km1(&parts));
        let w = block_weights(&hg, &out, k);
        prop_assert!(w.iter().zip(&caps).all(|(w, c)| w <= c), "{w:?} > {caps:?}");
        if limit_memory {
            prop_assert!(fits_memory(&hg, &out, &mem_caps));
        }
        prop_assert_eq!(out, run(parts));
    }
}

/// Two 5-cliques (as 2-pin nets) joined by one net: Louvain puts each clique in a community of
/// its own, and the vertices without nets share one.
#[test]
fn communities_are_the_cliques() {
    let mut nets: Vec<Vec<u32>> = Vec::new();
    for base in [0u32, 5] {
        for a in 0..5 {
            for b in a + 1..5 {
                nets.push(vec![base + a, base + b]);
            }
        }
    }
    nets.push(vec![4, 5]);
    let hg = build(12, &nets, None, None).unwrap();
    for seed in 0..10 {
        let c = community::communities(&hg, &mut super::Rng::new(seed));
        assert!(c[..5].iter().all(|&x| x == c[0]), "{c:?}");
        assert!(c[5..10].iter().all(|&x| x == c[5]), "{c:?}");
        assert_ne!(c[0], c[5]);
        assert_eq!(c[10], c[11]);
        assert!(c[10] != c[0] && c[10] != c[5]);
    }
}

/// A path of 16 vertices and 24 vertices without nets, targets 0.4 : 0.6 (16 and 24), no slack:
/// the path stays whole (km1 0) only if the free vertices make room for it in one block, which
/// the partition must find for every seed (with or without setting them aside: this checks the
/// result, the power-law benchmark shows the gain).
#[test]
fn vertices_without_nets_fill_the_room_left() {
    let nets: Vec<Vec<u32>> = (0..15).map(|v| vec![v, v + 1]).collect();
    let hg = build(40, &nets, None, None).unwrap();
    for seed in 0..10 {
        let mut options = PartitionOptions::new(vec![0.4, 0.6]);
        options.seed = seed;
        options.epsilon = 0.0;
        let parts = partition_hypergraph(&hg, &options).unwrap();
        assert_eq!(hg.km1(&parts), 0.0, "{parts:?}");
    }
}

/// The 5-convolution CIFAR CNN of benches/compare_partitioners.py (filters by FLOPs, maps by
/// bytes, as scaled there) at speeds 1 : 0.5 : 0.25 and 0.5 : 0.3 : 0.2. Its cheapest partitions
/// are pipelines whose blocks are not in the order recursive bisection fixes first (199,680
/// and 116,224 before ordered splits, 2.3x and 1.3x Mt-KaHyPar's); at 0.5 : 0.3 : 0.2 the
/// cheap layer boundary leaves the first block a hair over its share, and two first-layer
/// filters moved elsewhere repair it (Mt-KaHyPar's partition, 90,112).
#[test]
fn cifar_cnn_is_split_as_a_pipeline() {
    let hg = layered(&[
        (32, 938.0, 4096.0),
        (32, 10000.0, 1024.0),
        (64, 2500.0, 1024.0),
        (64, 5000.0, 256.0),
        (128, 1250.0, 64.0),
        (256, 69.0, 4.0),
        (10, 9.0, 0.0),
    ]);
    for (speeds, want) in [
        (vec![1.0, 0.5, 0.25], 86272.0),
        (vec![0.5, 0.3, 0.2], 90112.0),
    ] {
        let total: f64 = speeds.iter().sum();
        let targets: Vec<f64> = speeds.iter().map(|s| s / total).collect();
        let parts = partition_hypergraph(&hg, &PartitionOptions::new(targets.clone())).unwrap();
        assert_eq!(hg.km1(&parts), want, "{speeds:?}");
        let caps: Vec<f64> = targets
            .iter()
            .map(|t| 1.03 * t * hg.total_weight())
            .collect();
        assert!(balanced(&hg, &parts, &caps, None));
    }
}

#[test]
fn a_hypergraph_larger_than_memory_is_refused_by_name() {
    let gib = 1u64 << 30;
    let err = check_memory(1 << 31, 0, Some(8 * gib)).unwrap_err();
    assert_eq!(err.argument(), "num_vertices");
    assert!(
        err.to_string().contains("GiB of memory is available"),
        "{err}"
    );
    assert!(check_memory(1 << 20, 5 << 20, Some(8 * gib)).is_ok());
    assert!(check_memory(1 << 31, 0, None).is_ok()); // unknown: nothing to judge by
}
