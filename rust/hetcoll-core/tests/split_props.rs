//! Property tests of the split solver: identical to the unit-at-a-time greedy (whose optimality
//! the module documentation proves) and never worse than any other feasible split found by brute
//! force.

use hetcoll_core::solvers::{finish_times, split, SplitOptions};
use proptest::prelude::*;

fn makespan(shares: &[u64], speeds: &[f64], latency: &[f64]) -> f64 {
    finish_times(shares, speeds, Some(latency))
        .unwrap()
        .into_iter()
        .fold(f64::NEG_INFINITY, f64::max)
}

fn greedy(total: u64, speeds: &[f64], latency: &[f64], cap: &[u64], q: u64, min: u64) -> Vec<u64> {
    let p = speeds.len();
    let lo = min.div_ceil(q);
    let mut u = vec![lo; p];
    for _ in 0..(total / q - lo * p as u64) {
        let f = |i: usize| latency[i] + (((u[i] + 1) * q) as f64) / speeds[i];
        let best = (0..p)
            .filter(|&i| u[i] < cap[i] / q)
            .min_by(|&a, &b| f(a).total_cmp(&f(b)).then(a.cmp(&b)))
            .unwrap();
        u[best] += 1;
    }
    u.iter().map(|&x| x * q).collect()
}

fn brute(
    total: u64,
    speeds: &[f64],
    latency: &[f64],
    cap: &[u64],
    q: u64,
    min: u64,
) -> Option<f64> {
    fn rec(
        i: usize,
        left: u64,
        cur: &mut Vec<u64>,
        ctx: &(&[f64], &[f64], &[u64], u64, u64),
        best: &mut Option<f64>,
    ) {
        let (speeds, latency, cap, q, min) = *ctx;
        if i == speeds.len() {
            if left == 0 {
                let m = makespan(cur, speeds, latency);
                *best = Some(best.map_or(m, |b: f64| b.min(m)));
            }
            return;
        }
        let mut b = 0;
        while b <= left.min(cap[i]) {
            if b >= min {
                cur.push(b);
                rec(i + 1, left - b, cur, ctx, best);
                cur.pop();
            }
            b += q;
        }
    }
    let mut best = None;
    rec(
        0,
        total,
        &mut Vec::new(),
        &(speeds, latency, cap, q, min),
        &mut best,
    );
    best
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn optimal_and_equal_to_greedy(
        p in 1usize..5,
        seed in prop::collection::vec((0.05f64..10.0, 0.0f64..3.0, 0u64..16), 4),
        q in 1u64..4,
        min in 0u64..3,
        units in 0u64..10,
        capped in any::<bool>(),
    ) {
        let speeds: Vec<f64> = seed[..p].iter().map(|s| s.0).collect();
        let latency: Vec<f64> = seed[..p].iter().map(|s| s.1).collect();
        let total = units * q;
        let cap: Vec<u64> = if capped { seed[..p].iter().map(|s| s.2).collect() } else { vec![total; p] };
        let o = SplitOptions { latency: Some(&latency), capacity: Some(&cap), multiple_of: q, minimum: min };
        match (split(total, &speeds, &o), brute(total, &speeds, &latency, &cap, q, min)) {
            (Ok(shares), Some(best)) => {
                prop_assert_eq!(shares.iter().sum::<u64>(), total);
                prop_assert_eq!(makespan(&shares, &speeds, &latency), best);
                prop_assert_eq!(shares, greedy(total, &speeds, &latency, &cap, q, min));
            }
            (Err(_), None) => {}
            (got, best) => prop_assert!(false, "solver {:?} vs brute force {:?}", got, best),
        }
    }

    #[test]
    fn equal_to_greedy_on_many_ranks(
        speeds in prop::collection::vec(0.01f64..100.0, 1..40),
        total in 0u64..5000,
    ) {
        let p = speeds.len();
        let zeros = vec![0.0; p];
        let cap = vec![total; p];
        let shares = split(total, &speeds, &SplitOptions::default()).unwrap();
        prop_assert_eq!(shares, greedy(total, &speeds, &zeros, &cap, 1, 0));
    }
}
