//! `out[k] = Σ_i w_i · a_i[k]`: the sample-weighted combination at the heart of balanced data
//! parallelism, fused into one pass over memory.
//!
//! The buffer is cut into blocks of [`BLOCK`] elements that fit in L1; each block of `out` is
//! accumulated from every source in turn and written once, so memory sees `K` streaming reads and
//! one streaming write, with no full-size temporary. Threads take contiguous runs of blocks. Every
//! element is computed by the same sequence of operations in the same order whatever the thread
//! count, so the output is bitwise identical for any number of threads.

use std::sync::Mutex;
use std::sync::OnceLock;
use std::thread;

use super::element::Element;
use crate::error::{CoreError, Result};

/// Elements per block: the accumulator and its scratch stay in L1.
pub const BLOCK: usize = 2048;
/// Fewer elements than this per thread are not worth a thread: starting one costs 10-20 µs,
/// about what one core needs for 2^18 elements of a two-source sum (measured on a 2-core host).
pub const MIN_PER_THREAD: usize = 1 << 18;

/// One term of the sum.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a, T> {
    /// A buffer of the same length as `out`.
    Slice(&'a [T]),
    /// `out` itself (in-place accumulation: `out = w_0 · out + ...`).
    Out,
}

/// Environment variables by which launchers announce how many ranks of the job share this
/// node: torchrun's, MPICH's (Hydra) and Open MPI's.
pub const LOCAL_RANKS_VARS: [&str; 3] = [
    "LOCAL_WORLD_SIZE",
    "MPI_LOCALNRANKS",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
];

/// Threads the kernels use: `HETCOLL_NUM_THREADS` if set, else the node's cores divided among
/// the job's ranks on it ([`LOCAL_RANKS_VARS`]; one rank when no launcher says), at least one.
///
/// Ranks that each took every core would make their kernels' threads compete with the peers
/// whose messages they wait for. The count is read once per process: `available_parallelism`
/// reads the cgroup quota files on Linux, which cost about 25 µs, more than the whole kernel on
/// a small buffer.
pub fn default_threads() -> Result<usize> {
    static SHARE: OnceLock<usize> = OnceLock::new();
    match std::env::var("HETCOLL_NUM_THREADS") {
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n >= 1 => Ok(n),
            _ => Err(CoreError::invalid(
                "HETCOLL_NUM_THREADS",
                format!("must be a whole number >= 1, got {v:?}"),
            )),
        },
        Err(_) => Ok(*SHARE.get_or_init(|| {
            let cores = thread::available_parallelism().map_or(1, |n| n.get());
            let local = LOCAL_RANKS_VARS
                .iter()
                .find_map(|name| std::env::var(name).ok()?.trim().parse::<usize>().ok())
                .unwrap_or(1);
            threads_per_rank(cores, local)
        })),
    }
}

/// Each of `local_ranks` ranks' share of `cores`, at least one thread.
pub fn threads_per_rank(cores: usize, local_ranks: usize) -> usize {
    (cores / local_ranks.max(1)).max(1)
}

/// `out[k] = Σ_i weights[i] · sources[i][k]` on up to `threads` threads.
///
/// `Source::Out` reads `out` as it was before the call, wherever it appears in `sources`.
/// Errors name the argument: empty `sources`, a `weights` length that differs, a source whose
/// length differs from `out`'s, a non-finite weight, `threads == 0`.
///
/// ```
/// use hetcoll_core::kernels::{weighted_sum, Source};
/// let a = [1.0f32, 2.0];
/// let mut out = [10.0f32, 20.0];
/// weighted_sum(&[Source::Out, Source::Slice(&a)], &[0.5, 2.0], &mut out, 1).unwrap();
/// assert_eq!(out, [7.0, 14.0]);
/// ```
pub fn weighted_sum<T: Element>(
    sources: &[Source<'_, T>],
    weights: &[f64],
    out: &mut [T],
    threads: usize,
) -> Result<()> {
    if sources.is_empty() {
        return Err(CoreError::invalid("arrays", "must hold at least one array"));
    }
    if weights.len() != sources.len() {
        return Err(CoreError::invalid(
            "weights",
            format!(
                "has {} entries but arrays has {}",
                weights.len(),
                sources.len()
            ),
        ));
    }
    for (i, s) in sources.iter().enumerate() {
        if let Source::Slice(s) = s {
            if s.len() != out.len() {
                return Err(CoreError::invalid(
                    format!("arrays[{i}]"),
                    format!("has {} elements but out has {}", s.len(), out.len()),
                ));
            }
        }
    }
    if let Some(i) = weights.iter().position(|w| !w.is_finite()) {
        return Err(CoreError::invalid(
            format!("weights[{i}]"),
            format!("must be finite, got {}", weights[i]),
        ));
    }
    if threads == 0 {
        return Err(CoreError::invalid("threads", "must be at least 1"));
    }
    let w: Vec<T::Acc> = weights.iter().map(|&x| T::weight(x)).collect();
    let n = out.len();
    let threads = threads.min(n.div_ceil(MIN_PER_THREAD)).max(1);
    if threads == 1 {
        run_best(sources, &w, 0, out);
        return Ok(());
    }
    // Threads take chunks from a shared queue rather than one fixed run each: on a shared
    // machine a thread whose core is busy then does less, instead of holding everyone up.
    // Every element is still computed by the same operations, so the bytes do not change.
    let queue = Mutex::new(out.chunks_mut(CHUNK).enumerate());
    let work = || loop {
        let next = queue.lock().map(|mut q| q.next()).unwrap_or(None);
        let Some((i, chunk)) = next else { break };
        run_best(sources, &w, i * CHUNK, chunk);
    };
    thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(work);
        }
        work();
    });
    Ok(())
}

/// Elements per unit of work handed to a thread (a whole number of blocks).
pub const CHUNK: usize = 32 * BLOCK;

/// The block `[at, at + len)` of a source; `Source::Out` reads the output block itself.
#[inline]
fn pick<'b, T>(source: &Source<'b, T>, at: usize, len: usize, out_block: &'b [T]) -> &'b [T] {
    match *source {
        Source::Slice(s) => &s[at..at + len],
        Source::Out => out_block,
    }
}

/// [`run`] compiled for the widest vector unit this CPU has. The code is the same, a multiply
/// then an add per term in the same order (Rust never fuses them), so every instruction set
/// gives bitwise the same result: ranks on different CPUs still agree.
#[inline]
fn run_best<T: Element>(sources: &[Source<'_, T>], w: &[T::Acc], start: usize, out: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { run_avx2(sources, w, start, out) };
        return;
    }
    run(sources, w, start, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn run_avx2<T: Element>(
    sources: &[Source<'_, T>],
    w: &[T::Acc],
    start: usize,
    out: &mut [T],
) {
    run(sources, w, start, out);
}

/// One run of blocks: `out` is the slice of the whole output that starts at element `start`.
#[inline(always)]
fn run<T: Element>(sources: &[Source<'_, T>], w: &[T::Acc], start: usize, out: &mut [T]) {
    let mut acc = [T::Acc::default(); BLOCK];
    let mut widened = [T::Acc::default(); BLOCK];
    let mut pos = 0;
    for out_block in out.chunks_mut(BLOCK) {
        let len = out_block.len();
        let (acc, widened) = (&mut acc[..len], &mut widened[..len]);
        let at = start + pos;
        if let [Source::Out] = sources {
            // `out *= w`: in place, without the copy through the accumulator (same rounding).
            T::scale(out_block, w[0], acc, widened);
            pos += len;
            continue;
        }
        {
            let out_ro: &[T] = out_block;
            // Up to eight sources on the stack; more is rare enough for a small allocation.
            if sources.len() <= 8 {
                let mut srcs: [&[T]; 8] = [&[]; 8];
                for (slot, source) in srcs.iter_mut().zip(sources) {
                    *slot = pick(source, at, len, out_ro);
                }
                T::accumulate(acc, &srcs[..sources.len()], w, widened);
            } else {
                let srcs: Vec<&[T]> = sources.iter().map(|s| pick(s, at, len, out_ro)).collect();
                T::accumulate(acc, &srcs, w, widened);
            }
        }
        T::store(acc, out_block);
        pos += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn ranks_on_a_node_share_its_cores() {
        assert_eq!(threads_per_rank(8, 1), 8);
        assert_eq!(threads_per_rank(8, 2), 4);
        assert_eq!(threads_per_rank(8, 3), 2);
        assert_eq!(threads_per_rank(2, 4), 1);
        assert_eq!(threads_per_rank(1, 0), 1);
    }

    fn reference(sources: &[Vec<f64>], w: &[f64]) -> Vec<f64> {
        let n = sources[0].len();
        (0..n)
            .map(|k| {
                let mut a = w[0] * sources[0][k];
                for i in 1..sources.len() {
                    a += w[i] * sources[i][k];
                }
                a
            })
            .collect()
    }

    #[test]
    fn f64_matches_reference_for_any_thread_count() {
        let n = 3 * MIN_PER_THREAD + 17;
        let srcs: Vec<Vec<f64>> = (0..3)
            .map(|i| (0..n).map(|k| ((k * 7 + i) % 13) as f64 * 0.1).collect())
            .collect();
        let w = [0.25, -1.5, 3.0];
        let expected = reference(&srcs, &w);
        for threads in [1, 2, 3, 8] {
            let mut out = vec![0.0f64; n];
            let s: Vec<Source<f64>> = srcs.iter().map(|v| Source::Slice(v)).collect();
            weighted_sum(&s, &w, &mut out, threads).unwrap();
            assert_eq!(out, expected);
        }
    }

    /// The vector unit chosen at run time must not change a single bit: ranks on CPUs with
    /// and without AVX2 compute the same sums.
    fn same_bits_on_every_instruction_set<T: Element + PartialEq + std::fmt::Debug>(
        make: impl Fn(f64) -> T,
    ) {
        let n = 5 * BLOCK + 13;
        let srcs: Vec<Vec<T>> = (0..6)
            .map(|i| {
                (0..n)
                    .map(|k| make((((k * 2654435761 + i * 97) % 1000) as f64 - 500.0) / 37.0))
                    .collect()
            })
            .collect();
        let w: Vec<T::Acc> = [0.3, -1.7, 2.5e-3, 1.0, 7.25, -0.125]
            .iter()
            .map(|&x| T::weight(x))
            .collect();
        for k in 1..=6 {
            let s: Vec<Source<T>> = srcs[..k].iter().map(|v| Source::Slice(v)).collect();
            let mut base = vec![T::default(); n];
            let mut best = vec![T::default(); n];
            run(&s, &w[..k], 0, &mut base);
            run_best(&s, &w[..k], 0, &mut best);
            assert_eq!(base, best, "{} sources", k);
        }
    }

    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        same_bits_on_every_instruction_set(|x| x as f32);
        same_bits_on_every_instruction_set(|x| x);
        same_bits_on_every_instruction_set(f16::from_f64);
        same_bits_on_every_instruction_set(bf16::from_f64);
    }

    /// `out *= w` in place takes its own path: it must give the bits of the general one (the
    /// same buffer as a separate source), negative zeros, tiny and huge values included.
    fn scaling_in_place_matches_the_general_path<T: Element + PartialEq + std::fmt::Debug>(
        make: impl Fn(f64) -> T,
    ) {
        let n = 3 * BLOCK + 5;
        let values = [-0.0, 0.0, 1e-40, -3.5, 65504.0, 1e300, 0.1, -7.0 / 3.0];
        let src: Vec<T> = (0..n)
            .map(|k| make(values[k % values.len()] * (1.0 + k as f64 / 97.0)))
            .collect();
        for w in [0.3, -1.0, 1.0, 0.0, 1e-3] {
            let mut general = vec![T::default(); n];
            weighted_sum(&[Source::Slice(&src)], &[w], &mut general, 1).unwrap();
            for threads in [1, 2] {
                let mut inplace = src.clone();
                weighted_sum(&[Source::Out], &[w], &mut inplace, threads).unwrap();
                // Debug text tells -0.0 from 0.0 and, unlike ==, matches NaN (inf * 0) to NaN.
                let (got, want) = (format!("{inplace:?}"), format!("{general:?}"));
                assert!(got == want, "weight {w}, {threads} threads");
            }
        }
    }

    #[test]
    fn scaling_in_place_gives_the_general_paths_bits() {
        scaling_in_place_matches_the_general_path(|x| x as f32);
        scaling_in_place_matches_the_general_path(|x| x);
        scaling_in_place_matches_the_general_path(f16::from_f64);
        scaling_in_place_matches_the_general_path(bf16::from_f64);
    }

    #[test]
    fn out_aliases_any_position() {
        let a = vec![1.0f32, 2.0, 3.0];
        let b = vec![4.0f32, 5.0, 6.0];
        for pos in 0..3 {
            let mut out = vec![7.0f32, 8.0, 9.0];
            let mut srcs = vec![Source::Slice(&a[..]), Source::Slice(&b[..])];
            srcs.insert(pos, Source::Out);
            let mut all = vec![a.clone(), b.clone()];
            all.insert(pos, vec![7.0, 8.0, 9.0]);
            let w = [0.5, 2.0, -1.0];
            weighted_sum(&srcs, &w, &mut out, 1).unwrap();
            for k in 0..3 {
                let mut e = w[0] as f32 * all[0][k];
                e += w[1] as f32 * all[1][k];
                e += w[2] as f32 * all[2][k];
                assert_eq!(out[k], e);
            }
        }
    }

    #[test]
    fn half_types_accumulate_in_f32() {
        // 2048 + 1 + (-2048) in f16 steps loses the 1; accumulating in f32 keeps it.
        let a = [f16::from_f32(2048.0)];
        let b = [f16::from_f32(1.0)];
        let mut out = [f16::ZERO];
        let s = [
            Source::Slice(&a[..]),
            Source::Slice(&b[..]),
            Source::Slice(&a[..]),
        ];
        weighted_sum(&s, &[1.0, 1.0, -1.0], &mut out, 1).unwrap();
        assert_eq!(out[0].to_f32(), 1.0);
        let a = [bf16::from_f32(256.0)];
        let b = [bf16::from_f32(1.0)];
        let mut out = [bf16::ZERO];
        let s = [
            Source::Slice(&a[..]),
            Source::Slice(&b[..]),
            Source::Slice(&a[..]),
        ];
        weighted_sum(&s, &[1.0, 1.0, -1.0], &mut out, 1).unwrap();
        assert_eq!(out[0].to_f32(), 1.0);
    }

    #[test]
    fn errors_name_the_argument() {
        let a = [1.0f32; 4];
        let b = [1.0f32; 3];
        let mut out = [0.0f32; 4];
        let e = |r: Result<()>| r.unwrap_err().argument().to_string();
        assert_eq!(e(weighted_sum::<f32>(&[], &[], &mut out, 1)), "arrays");
        assert_eq!(
            e(weighted_sum(&[Source::Slice(&a)], &[1.0, 2.0], &mut out, 1)),
            "weights"
        );
        assert_eq!(
            e(weighted_sum(
                &[Source::Slice(&a), Source::Slice(&b)],
                &[1.0, 2.0],
                &mut out,
                1
            )),
            "arrays[1]"
        );
        assert_eq!(
            e(weighted_sum(&[Source::Slice(&a)], &[f64::NAN], &mut out, 1)),
            "weights[0]"
        );
    }
}
