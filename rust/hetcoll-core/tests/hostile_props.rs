//! Hostile-input property tests: every public entry point of the core, fed huge integers, NaN,
//! infinities, subnormals, empty and mismatched inputs, returns `Ok` with its invariants or an
//! `Err` naming an argument; it never panics and never spins (a spinning case would hang the
//! test). `PROPTEST_CASES` raises the case count (`make fuzz`).

use hetcoll_core::kernels::{pack, unpack, weighted_sum, Source};
use hetcoll_core::schedules::ring::ring_allreduce;
use hetcoll_core::solvers::{
    assign_items_near, assignment_time, finish_times, km1, partition_chain, partition_hypergraph,
    refine_assignment, split, stage_times, Hypergraph, PartitionOptions, SplitOptions,
};
use hetcoll_core::CoreError;
use proptest::prelude::*;

/// Cases per property: `PROPTEST_CASES` if set, else a brief run for `make test`.
fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    ProptestConfig::with_cases(cases)
}

/// Any double, biased towards the hostile ones: subnormals, the extremes, NaN, infinities, and
/// magnitudes spread over the whole exponent range.
fn hostile_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        (-325i32..309, 1.0f64..10.0).prop_map(|(e, m)| m * 10f64.powi(e)),
        any::<f64>(),
        Just(f64::from_bits(1)),
        Just(f64::MIN_POSITIVE),
        Just(f64::MAX),
        Just(0.0),
        Just(-1.0),
        Just(f64::NAN),
        Just(f64::INFINITY),
        0.1f64..10.0,
    ]
}

/// Any u64, biased towards the extremes.
fn hostile_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        any::<u64>(),
        Just(u64::MAX),
        Just(u64::MAX - 1),
        Just(1u64 << 53),
        Just((1u64 << 53) + 1),
        Just(0),
        0u64..100,
    ]
}

fn names_an_argument(e: &CoreError) -> bool {
    !e.argument().is_empty() && e.to_string().starts_with(e.argument())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn split_never_panics(
        total in hostile_u64(),
        speeds in prop::collection::vec(hostile_f64(), 0..5),
        latency in prop::option::of(prop::collection::vec(hostile_f64(), 0..5)),
        capacity in prop::option::of(prop::collection::vec(hostile_u64(), 0..5)),
        multiple_of in prop_oneof![Just(1u64), hostile_u64()],
        minimum in prop_oneof![Just(0u64), hostile_u64()],
    ) {
        let options = SplitOptions {
            latency: latency.as_deref(),
            capacity: capacity.as_deref(),
            multiple_of,
            minimum,
        };
        match split(total, &speeds, &options) {
            Ok(shares) => {
                prop_assert_eq!(shares.len(), speeds.len());
                prop_assert_eq!(shares.iter().map(|&b| u128::from(b)).sum::<u128>(), u128::from(total));
                for (i, &b) in shares.iter().enumerate() {
                    prop_assert!(b >= minimum && b % multiple_of == 0);
                    if let Some(c) = &capacity {
                        prop_assert!(b <= c[i]);
                    }
                }
                prop_assert!(finish_times(&shares, &speeds, latency.as_deref()).is_ok());
            }
            Err(e) => prop_assert!(names_an_argument(&e), "{e}"),
        }
    }

    #[test]
    fn chain_never_panics(
        costs in prop::collection::vec(hostile_f64(), 0..7),
        speeds in prop::collection::vec(hostile_f64(), 0..4),
        bytes in prop::option::of(prop::collection::vec(hostile_f64(), 0..7)),
        bandwidth in prop::option::of(hostile_f64()),
    ) {
        match partition_chain(&costs, &speeds, bytes.as_deref(), bandwidth) {
            Ok(layers) => {
                prop_assert_eq!(layers.len(), speeds.len());
                prop_assert_eq!(layers.iter().sum::<u64>(), costs.len() as u64);
                prop_assert!(stage_times(&costs, &speeds, &layers, bytes.as_deref(), bandwidth).is_ok());
            }
            Err(e) => prop_assert!(names_an_argument(&e), "{e}"),
        }
    }

    #[test]
    fn assign_never_panics(
        loads in prop::collection::vec(hostile_f64(), 0..9),
        speeds in prop::collection::vec(hostile_f64(), 0..4),
        capacity in prop::option::of(prop::collection::vec(hostile_u64(), 0..4)),
        max_nodes in 0u64..100_000,
        gap in prop_oneof![Just(0.0), hostile_f64()],
    ) {
        match assign_items_near(&loads, &speeds, capacity.as_deref(), max_nodes, gap) {
            Ok(a) => {
                prop_assert_eq!(a.owner.len(), loads.len());
                prop_assert!(a.owner.iter().all(|&d| d < speeds.len()));
                if let Some(c) = &capacity {
                    for (d, &cap) in c.iter().enumerate() {
                        prop_assert!(a.owner.iter().filter(|&&o| o == d).count() as u64 <= cap);
                    }
                }
                prop_assert!(assignment_time(&loads, &speeds, &a.owner).is_ok());
            }
            Err(e) => prop_assert!(names_an_argument(&e), "{e}"),
        }
    }

    #[test]
    fn refine_assignment_never_panics(
        loads in prop::collection::vec(hostile_f64(), 0..9),
        speeds in prop::collection::vec(hostile_f64(), 0..4),
        owner in prop::collection::vec(0usize..5, 0..9),
        capacity in prop::option::of(prop::collection::vec(hostile_u64(), 0..4)),
    ) {
        match refine_assignment(&loads, &speeds, &owner, capacity.as_deref()) {
            Ok(got) => {
                prop_assert_eq!(got.len(), loads.len());
                prop_assert!(got.iter().all(|&d| d < speeds.len()));
                let before = assignment_time(&loads, &speeds, &owner).unwrap();
                let after = assignment_time(&loads, &speeds, &got).unwrap();
                // (NaN where huge loads overflow: no order to keep.)
                prop_assert!(
                    after.partial_cmp(&before) != Some(std::cmp::Ordering::Greater),
                    "{after} > {before}"
                );
            }
            Err(e) => prop_assert!(names_an_argument(&e), "{e}"),
        }
    }

    #[test]
    fn hypergraph_never_panics(
        n in 0usize..12,
        nets in prop::collection::vec(prop::collection::vec(0u32..14, 0..5), 0..10),
        targets in prop::collection::vec(hostile_f64(), 0..4),
        vertex_weights in prop::option::of(prop::collection::vec(hostile_f64(), 0..12)),
        net_weights in prop::option::of(prop::collection::vec(hostile_f64(), 0..10)),
        epsilon in hostile_f64(),
        seed in hostile_u64(),
    ) {
        let mut offsets = vec![0usize];
        let mut pins = Vec::new();
        for net in &nets {
            pins.extend_from_slice(net);
            offsets.push(pins.len());
        }
        let hg = Hypergraph::new(n, offsets.clone(), pins.clone(), vertex_weights, net_weights.clone());
        let hg = match hg {
            Ok(hg) => hg,
            Err(e) => {
                prop_assert!(names_an_argument(&e), "{e}");
                return Ok(());
            }
        };
        let k = targets.len();
        let mut options = PartitionOptions::new(targets);
        options.epsilon = epsilon;
        options.seed = seed;
        match partition_hypergraph(&hg, &options) {
            Ok(parts) => {
                prop_assert_eq!(parts.len(), n);
                prop_assert!(parts.iter().all(|&b| (b as usize) < k));
                let cut = km1(&offsets, &pins, &parts, net_weights.as_deref());
                prop_assert!(cut.is_ok(), "{:?}", cut);
            }
            Err(e) => prop_assert!(names_an_argument(&e), "{e}"),
        }
    }

    #[test]
    fn km1_never_panics(
        nets in prop::collection::vec(prop::collection::vec(any::<u32>(), 0..4), 0..6),
        parts in prop::collection::vec(any::<u32>(), 0..8),
        net_weights in prop::option::of(prop::collection::vec(hostile_f64(), 0..6)),
    ) {
        let mut offsets = vec![0usize];
        let mut pins = Vec::new();
        for net in &nets {
            pins.extend_from_slice(net);
            offsets.push(pins.len());
        }
        if let Err(e) = km1(&offsets, &pins, &parts, net_weights.as_deref()) {
            prop_assert!(names_an_argument(&e), "{e}");
        }
    }

    #[test]
    fn kernels_never_panic(
        n in 0usize..64,
        lens in prop::collection::vec(0usize..64, 0..4),
        weights in prop::collection::vec(hostile_f64(), 0..4),
        scale in hostile_f64(),
        threads in 0usize..5,
        in_place in any::<bool>(),
    ) {
        let data: Vec<Vec<f32>> = lens.iter().map(|&l| (0..l).map(|x| x as f32).collect()).collect();
        let mut sources: Vec<Source<'_, f32>> = data.iter().map(|d| Source::Slice(d)).collect();
        if in_place && !sources.is_empty() {
            sources[0] = Source::Out;
        }
        let mut out = vec![1.0f32; n];
        if let Err(e) = weighted_sum(&sources, &weights, &mut out, threads) {
            prop_assert!(names_an_argument(&e), "{e}");
        }
        let slices: Vec<&[f32]> = data.iter().map(|d| d.as_slice()).collect();
        match pack(&slices, scale, &mut out, threads) {
            Ok(()) => prop_assert_eq!(out.len(), lens.iter().sum::<usize>()),
            Err(e) => prop_assert!(names_an_argument(&e), "{e}"),
        }
        let mut back: Vec<Vec<f32>> = lens.iter().map(|&l| vec![0.0; l]).collect();
        let mut dests: Vec<&mut [f32]> = back.iter_mut().map(|d| d.as_mut_slice()).collect();
        if let Err(e) = unpack(&out, &mut dests, scale, threads) {
            prop_assert!(names_an_argument(&e), "{e}");
        }
    }

    #[test]
    fn ring_never_panics(
        counts in prop::collection::vec(prop_oneof![0u64..1000, hostile_u64()], 0..5),
        rank in 0usize..6,
        segment in prop_oneof![0usize..100, Just(usize::MAX)],
    ) {
        match ring_allreduce(&counts, rank, segment) {
            Ok(steps) => {
                prop_assert_eq!(steps.len(), 2 * (counts.len() - 1));
                for s in &steps {
                    prop_assert!(s.send.iter().chain(&s.recv).all(|&(a, b)| a <= b));
                }
            }
            Err(e) => prop_assert!(names_an_argument(&e), "{e}"),
        }
    }
}

/// The findings of issue 26, kept as fixed cases.
#[test]
fn split_of_u64_max_hands_out_everything() {
    let shares = split(u64::MAX, &[1.0, 2.0], &SplitOptions::default()).unwrap();
    assert_eq!(
        shares.iter().map(|&b| u128::from(b)).sum::<u128>(),
        u128::from(u64::MAX)
    );
}

#[test]
fn split_with_an_overflowing_finish_time_ends() {
    // 10^18 / 1e-300 overflows: the slow rank's finish time is infinite at any share > 0.
    let shares = split(
        1_000_000_000_000_000_000,
        &[1e308, 1e-300],
        &SplitOptions::default(),
    )
    .unwrap();
    assert_eq!(shares, vec![1_000_000_000_000_000_000, 0]);
}

#[test]
fn split_with_a_dominating_latency_ends() {
    // Every finish time rounds to the latency: 10^15 units tie, the greedy must not walk them.
    let lat = [1e300, 1e300];
    let options = SplitOptions {
        latency: Some(&lat),
        ..SplitOptions::default()
    };
    let shares = split(1_000_000_000_000_000, &[1.0, 1.0], &options).unwrap();
    assert_eq!(shares.iter().sum::<u64>(), 1_000_000_000_000_000);
}
