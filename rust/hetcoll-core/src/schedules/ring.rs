//! Ring allreduce over chunks of unequal sizes: which element ranges each rank sends, receives
//! and reduces at every step.
//!
//! The buffer of `N` elements is cut into `p` contiguous chunks of `counts[c]` elements (from the
//! split solver: equal by default, proportional to speeds when ranks differ). Rank `r` sends to
//! `r + 1` and receives from `r − 1` (mod `p`). Reduce-scatter, steps `s = 0 .. p−2`: send chunk
//! `r−s−1`, receive chunk `r−s−2` and add it into the local copy; after it rank `r` holds chunk
//! `r` fully reduced. Allgather, steps `s = 0 .. p−2`: send chunk `r−s`, receive chunk `r−s−1`
//! in place. So every step sends exactly the chunk received one step before, which lets a
//! transport pipeline segment by segment across steps; every rank moves
//! `2 (p−1)/p · N` elements with even chunks, the lower bound of Patarasuk & Yuan (2009).
//! Each chunk is reduced in one place and then copied, so every rank ends bitwise identical.

use crate::error::{CoreError, Result};

/// What a step does with the data it receives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Received data is added into the local chunk (`local = w · local + received` on the first
    /// touch of a rank's own data, `local += received` never happens twice on one chunk).
    ReduceScatter,
    /// Received data overwrites the local chunk.
    Allgather,
}

/// One step of the ring for one rank: element ranges `[lo, hi)` of the buffer, cut in segments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Reduce-scatter or allgather.
    pub phase: Phase,
    /// Chunk index sent to the right neighbour.
    pub send_chunk: usize,
    /// Chunk index received from the left neighbour.
    pub recv_chunk: usize,
    /// Segments of the sent chunk, in order.
    pub send: Vec<(usize, usize)>,
    /// Segments of the received chunk, in order.
    pub recv: Vec<(usize, usize)>,
}

/// Offsets of the chunks: `bounds[c] .. bounds[c + 1]` is chunk `c`; `bounds[p]` is the total.
pub fn chunk_bounds(counts: &[u64]) -> Result<Vec<usize>> {
    let mut bounds = Vec::with_capacity(counts.len() + 1);
    let mut at: usize = 0;
    bounds.push(0);
    for (i, &c) in counts.iter().enumerate() {
        let c = usize::try_from(c)
            .map_err(|_| CoreError::invalid(format!("counts[{i}]"), "does not fit in memory"))?;
        at = at
            .checked_add(c)
            .ok_or_else(|| CoreError::invalid("counts", "total overflows"))?;
        bounds.push(at);
    }
    Ok(bounds)
}

/// The most segments a schedule may list over all chunks (each is two `usize`s, listed twice).
pub const MAX_SEGMENTS: u128 = 1 << 24;

/// `[lo, hi)` cut into consecutive segments of at most `segment` elements (one empty segment
/// when `lo == hi`, so that every step sends and receives one message at least and the two
/// sides always agree on the message count).
pub fn segments(lo: usize, hi: usize, segment: usize) -> Vec<(usize, usize)> {
    if lo >= hi {
        return vec![(lo, lo)];
    }
    let mut out = Vec::with_capacity((hi - lo).div_ceil(segment));
    let mut a = lo;
    while a < hi {
        let b = hi.min(a.saturating_add(segment)); // a + segment may exceed usize::MAX
        out.push((a, b));
        a = b;
    }
    out
}

/// The `2 (p − 1)` steps of the ring allreduce for `rank`, over chunks of `counts[c]` elements,
/// each chunk cut into segments of at most `segment` elements.
///
/// Errors name the argument: empty `counts`, `rank >= p`, `segment == 0`, more than
/// [`MAX_SEGMENTS`] segments.
///
/// ```
/// use hetcoll_core::schedules::ring::{ring_allreduce, Phase};
/// let steps = ring_allreduce(&[2, 3, 1], 0, 2).unwrap();
/// assert_eq!(steps.len(), 4);
/// assert_eq!(steps[0].phase, Phase::ReduceScatter);
/// assert_eq!((steps[0].send_chunk, steps[0].recv_chunk), (2, 1));
/// assert_eq!(steps[0].recv, vec![(2, 4), (4, 5)]);
/// ```
pub fn ring_allreduce(counts: &[u64], rank: usize, segment: usize) -> Result<Vec<Step>> {
    let p = counts.len();
    if p == 0 {
        return Err(CoreError::invalid("counts", "must hold one count per rank"));
    }
    if rank >= p {
        return Err(CoreError::invalid(
            "rank",
            format!("must be < {p} (the number of counts), got {rank}"),
        ));
    }
    if segment == 0 {
        return Err(CoreError::invalid("segment", "must be at least 1 element"));
    }
    let bounds = chunk_bounds(counts)?;
    // Every chunk is listed twice per rank's schedule; refuse a schedule that would not fit in
    // memory (an allocation failure aborts the process) rather than build it.
    let listed: u128 = counts
        .iter()
        .map(|&c| u128::from(c).div_ceil(segment as u128).max(1))
        .sum();
    if listed > MAX_SEGMENTS {
        return Err(CoreError::invalid(
            "segment",
            format!(
                "{segment} elements cut counts into {listed} segments, more than {MAX_SEGMENTS}"
            ),
        ));
    }
    let chunk = |offset: usize| (rank + p - offset % p) % p;
    let segs = |c: usize| segments(bounds[c], bounds[c + 1], segment);
    let mut steps = Vec::with_capacity(2 * (p - 1));
    for s in 0..p - 1 {
        let (send_chunk, recv_chunk) = (chunk(s + 1), chunk(s + 2));
        steps.push(Step {
            phase: Phase::ReduceScatter,
            send_chunk,
            recv_chunk,
            send: segs(send_chunk),
            recv: segs(recv_chunk),
        });
    }
    for s in 0..p - 1 {
        let (send_chunk, recv_chunk) = (chunk(s), chunk(s + 1));
        steps.push(Step {
            phase: Phase::Allgather,
            send_chunk,
            recv_chunk,
            send: segs(send_chunk),
            recv: segs(recv_chunk),
        });
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Run every rank's schedule in lockstep on integer data and check the allreduce result.
    #[allow(clippy::needless_range_loop)] // ranks and steps index several tables at once
    fn simulate(counts: &[u64], segment: usize) -> Vec<Vec<i64>> {
        let p = counts.len();
        let n: usize = counts.iter().map(|&c| c as usize).sum();
        let mut bufs: Vec<Vec<i64>> = (0..p)
            .map(|r| (0..n).map(|k| ((r + 1) * 1000 + k) as i64).collect())
            .collect();
        let sched: Vec<Vec<Step>> = (0..p)
            .map(|r| ring_allreduce(counts, r, segment).unwrap())
            .collect();
        for t in 0..2 * (p - 1) {
            let sent: Vec<Vec<i64>> = (0..p)
                .map(|r| {
                    sched[r][t]
                        .send
                        .iter()
                        .flat_map(|&(a, b)| bufs[r][a..b].to_vec())
                        .collect()
                })
                .collect();
            for r in 0..p {
                let left = (r + p - 1) % p;
                let step = &sched[r][t];
                // Both sides agree on the segment layout of the message.
                assert_eq!(step.recv, sched[left][t].send);
                let mut it = sent[left].iter();
                for &(a, b) in &step.recv {
                    for k in a..b {
                        let v = *it.next().unwrap();
                        match step.phase {
                            Phase::ReduceScatter => bufs[r][k] += v,
                            Phase::Allgather => bufs[r][k] = v,
                        }
                    }
                }
            }
        }
        bufs
    }

    #[test]
    fn every_rank_ends_with_the_sum() {
        for counts in [
            vec![5u64],
            vec![3, 4],
            vec![0, 7, 1],
            vec![2, 0, 0, 9],
            vec![1; 5],
        ] {
            let p = counts.len();
            let bufs = simulate(&counts, 2);
            let n = bufs[0].len();
            for b in &bufs {
                for (k, &x) in b.iter().enumerate().take(n) {
                    let want: i64 = (0..p).map(|r| ((r + 1) * 1000 + k) as i64).sum();
                    assert_eq!(x, want);
                }
            }
        }
    }

    #[test]
    fn each_step_sends_what_the_previous_one_received() {
        let steps = ring_allreduce(&[4, 1, 3, 2], 2, 3).unwrap();
        for w in steps.windows(2) {
            assert_eq!(w[1].send_chunk, w[0].recv_chunk);
            assert_eq!(w[1].send, w[0].recv);
        }
        // After reduce-scatter rank r owns chunk r.
        assert_eq!(steps[2].recv_chunk, 2);
        assert_eq!(steps[3].send_chunk, 2);
    }

    #[test]
    fn errors_name_the_argument() {
        let e = |r: Result<Vec<Step>>| r.unwrap_err().argument().to_string();
        assert_eq!(e(ring_allreduce(&[], 0, 1)), "counts");
        assert_eq!(e(ring_allreduce(&[1, 2], 2, 1)), "rank");
        assert_eq!(e(ring_allreduce(&[1, 2], 0, 0)), "segment");
    }

    proptest! {
        #[test]
        fn simulated_ring_is_an_allreduce(
            counts in proptest::collection::vec(0u64..20, 1..6),
            segment in 1usize..8,
        ) {
            let p = counts.len();
            let bufs = simulate(&counts, segment);
            for b in &bufs {
                prop_assert_eq!(b, &bufs[0]);
                for (k, &x) in b.iter().enumerate() {
                    let want: i64 = (0..p).map(|r| ((r + 1) * 1000 + k) as i64).sum();
                    prop_assert_eq!(x, want);
                }
            }
        }
    }
}
