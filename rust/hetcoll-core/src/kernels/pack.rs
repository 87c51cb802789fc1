//! Fusion buffers: `out = scale · (a_0 ‖ a_1 ‖ …)` and back, `a_i = scale · flat[o_i .. o_i + n_i]`.
//!
//! Collectives pay a latency per call, so many small gradient tensors are packed into one flat
//! buffer, reduced once and unpacked. The pre-scale (a sample weight, `1 / N`) rides along in
//! the same pass, so no separate scaling sweep touches memory. Both directions are one streaming
//! read and one streaming write per element, cut into contiguous runs across threads; each
//! element sees the same operations whatever the thread count, so results are bitwise identical
//! for any number of threads. `scale == 1` is a plain copy (exact, NaN payloads included).

use std::thread;

use super::element::Element;
use super::weighted_sum::{BLOCK, MIN_PER_THREAD};
use crate::error::{CoreError, Result};

/// `out = scale · concat(sources)` on up to `threads` threads.
///
/// Errors name the argument: `out` whose length is not the sum of the sources' lengths, a
/// non-finite `scale`, `threads == 0`.
///
/// ```
/// use hetcoll_core::kernels::pack;
/// let (a, b) = ([1.0f32, 2.0], [3.0f32]);
/// let mut out = [0.0f32; 3];
/// pack(&[&a[..], &b[..]], 0.5, &mut out, 1).unwrap();
/// assert_eq!(out, [0.5, 1.0, 1.5]);
/// ```
pub fn pack<T: Element>(sources: &[&[T]], scale: f64, out: &mut [T], threads: usize) -> Result<()> {
    let total: usize = sources.iter().map(|s| s.len()).sum();
    if out.len() != total {
        return Err(CoreError::invalid(
            "out",
            format!("has {} elements but the arrays hold {total}", out.len()),
        ));
    }
    check(scale, threads)?;
    let mut pairs = Vec::with_capacity(sources.len());
    let mut rest = out;
    for s in sources {
        let (dst, tail) = rest.split_at_mut(s.len());
        rest = tail;
        pairs.push((*s, dst));
    }
    run_pairs(pairs, scale, threads);
    Ok(())
}

/// `dests[i] = scale · flat[o_i .. o_i + dests[i].len()]` with `o_i` the running sum of lengths.
///
/// Errors name the argument: `flat` whose length is not the sum of the destinations' lengths, a
/// non-finite `scale`, `threads == 0`.
///
/// ```
/// use hetcoll_core::kernels::unpack;
/// let flat = [1.0f64, 2.0, 3.0];
/// let (mut a, mut b) = ([0.0f64; 1], [0.0f64; 2]);
/// unpack(&flat, &mut [&mut a[..], &mut b[..]], 2.0, 1).unwrap();
/// assert_eq!((a, b), ([2.0], [4.0, 6.0]));
/// ```
pub fn unpack<T: Element>(
    flat: &[T],
    dests: &mut [&mut [T]],
    scale: f64,
    threads: usize,
) -> Result<()> {
    let total: usize = dests.iter().map(|d| d.len()).sum();
    if flat.len() != total {
        return Err(CoreError::invalid(
            "flat",
            format!("has {} elements but the arrays hold {total}", flat.len()),
        ));
    }
    check(scale, threads)?;
    let mut pairs = Vec::with_capacity(dests.len());
    let mut rest = flat;
    for d in dests.iter_mut() {
        let (src, tail) = rest.split_at(d.len());
        rest = tail;
        pairs.push((src, &mut **d));
    }
    run_pairs(pairs, scale, threads);
    Ok(())
}

fn check(scale: f64, threads: usize) -> Result<()> {
    if !scale.is_finite() {
        return Err(CoreError::invalid(
            "scale",
            format!("must be finite, got {scale}"),
        ));
    }
    if threads == 0 {
        return Err(CoreError::invalid("threads", "must be at least 1"));
    }
    Ok(())
}

type Pair<'a, T> = (&'a [T], &'a mut [T]);

/// Deal the (source, destination) pairs out to threads in contiguous runs of about equal
/// element counts, cutting a pair where a run ends.
fn run_pairs<T: Element>(pairs: Vec<Pair<'_, T>>, scale: f64, threads: usize) {
    let n: usize = pairs.iter().map(|(s, _)| s.len()).sum();
    let threads = threads.min(n.div_ceil(MIN_PER_THREAD)).max(1);
    let w = T::weight(scale);
    let exact = scale == 1.0;
    if threads == 1 {
        for (s, d) in pairs {
            scaled_copy(s, d, w, exact);
        }
        return;
    }
    let per = n.div_ceil(threads);
    let mut runs: Vec<Vec<Pair<'_, T>>> = vec![Vec::new()];
    let mut room = per;
    for (mut s, mut d) in pairs {
        while !s.is_empty() {
            if room == 0 {
                runs.push(Vec::new());
                room = per;
            }
            let take = room.min(s.len());
            let (s_head, s_tail) = s.split_at(take);
            let (d_head, d_tail) = d.split_at_mut(take);
            runs.last_mut()
                .expect("one run at least")
                .push((s_head, d_head));
            (s, d) = (s_tail, d_tail);
            room -= take;
        }
    }
    thread::scope(|scope| {
        let mut runs = runs.into_iter();
        let mine = runs.next();
        for run in runs {
            scope.spawn(move || {
                for (s, d) in run {
                    scaled_copy(s, d, w, exact);
                }
            });
        }
        for (s, d) in mine.into_iter().flatten() {
            scaled_copy(s, d, w, exact);
        }
    });
}

/// `dst = w · src`, through an L1-sized accumulator so 16-bit types round once.
fn scaled_copy<T: Element>(src: &[T], dst: &mut [T], w: T::Acc, exact: bool) {
    if exact {
        dst.copy_from_slice(src);
        return;
    }
    let mut acc = [T::Acc::default(); BLOCK];
    let mut widened = [T::Acc::default(); BLOCK];
    for (s, d) in src.chunks(BLOCK).zip(dst.chunks_mut(BLOCK)) {
        let len = s.len();
        T::first(&mut acc[..len], s, w, &mut widened[..len]);
        T::store(&acc[..len], d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};
    use proptest::prelude::*;

    #[test]
    fn pack_then_unpack_round_trips_for_any_thread_count() {
        let lens = [0, 1, 5, MIN_PER_THREAD + 3, 2 * MIN_PER_THREAD - 1, 7];
        let srcs: Vec<Vec<f64>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|k| (k * 3 + i) as f64 * 0.25).collect())
            .collect();
        let total: usize = lens.iter().sum();
        let views: Vec<&[f64]> = srcs.iter().map(|v| &v[..]).collect();
        let mut expected = Vec::with_capacity(total);
        for v in &srcs {
            expected.extend(v.iter().map(|x| x * -2.0));
        }
        for threads in [1, 2, 3, 8] {
            let mut out = vec![0.0f64; total];
            pack(&views, -2.0, &mut out, threads).unwrap();
            assert_eq!(out, expected);
            let mut back: Vec<Vec<f64>> = lens.iter().map(|&n| vec![0.0; n]).collect();
            let mut dests: Vec<&mut [f64]> = back.iter_mut().map(|v| &mut v[..]).collect();
            unpack(&out, &mut dests, -0.5, threads).unwrap();
            assert_eq!(back, srcs);
        }
    }

    #[test]
    fn half_types_round_once() {
        let a = [f16::from_f32(3.0), f16::from_f32(65504.0)];
        let mut out = [f16::ZERO; 2];
        pack(&[&a[..]], 0.5, &mut out, 1).unwrap();
        assert_eq!(out, [f16::from_f32(1.5), f16::from_f32(32752.0)]);
        let b = [bf16::from_f32(1.0), bf16::from_f32(-3.0)];
        let mut back = [bf16::ZERO; 2];
        unpack(&b, &mut [&mut back[..]], 0.25, 1).unwrap();
        assert_eq!(back, [bf16::from_f32(0.25), bf16::from_f32(-0.75)]);
    }

    #[test]
    fn errors_name_the_argument() {
        let a = [1.0f32; 3];
        let mut out = [0.0f32; 2];
        let e = |r: Result<()>| r.unwrap_err().argument().to_string();
        assert_eq!(e(pack(&[&a[..]], 1.0, &mut out, 1)), "out");
        let mut out = [0.0f32; 3];
        assert_eq!(e(pack(&[&a[..]], f64::INFINITY, &mut out, 1)), "scale");
        assert_eq!(e(pack(&[&a[..]], 1.0, &mut out, 0)), "threads");
        let mut d = [0.0f32; 4];
        assert_eq!(e(unpack(&a, &mut [&mut d[..]], 1.0, 1)), "flat");
    }

    proptest! {
        #[test]
        fn pack_equals_scaled_concatenation(
            lens in proptest::collection::vec(0usize..300, 0..6),
            scale in -4.0f64..4.0,
            threads in 1usize..5,
        ) {
            let srcs: Vec<Vec<f32>> = lens
                .iter()
                .enumerate()
                .map(|(i, &n)| (0..n).map(|k| (k as f32) - i as f32 * 1.5).collect())
                .collect();
            let views: Vec<&[f32]> = srcs.iter().map(|v| &v[..]).collect();
            let expected: Vec<f32> =
                srcs.iter().flatten().map(|&x| scale as f32 * x).collect();
            let mut out = vec![0.0f32; expected.len()];
            pack(&views, scale, &mut out, threads).unwrap();
            prop_assert_eq!(out, expected);
        }
    }
}
