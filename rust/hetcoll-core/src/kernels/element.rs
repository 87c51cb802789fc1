//! Element types the kernels accept, and the precision they accumulate in.
//!
//! 16-bit floats are widened to `f32` block by block, accumulated there and rounded once at the
//! end (round to nearest even), so a weighted sum of `f16`/`bf16` buffers costs one rounding to
//! the storage type, not one per term.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// A storage type with the accumulator it is summed in.
///
/// All arithmetic is a multiply followed by an add, never a fused multiply-add, so results do
/// not depend on the instruction set or on how a buffer is cut between threads.
pub trait Element: Copy + Default + Send + Sync + 'static {
    /// Accumulator: `f32` for `f32` and the 16-bit types, `f64` for `f64`.
    type Acc: Copy + Default + Send + Sync + 'static;
    /// Name used in error messages.
    const NAME: &'static str;
    /// Convert a weight given in `f64` to the accumulator type.
    fn weight(w: f64) -> Self::Acc;
    /// `acc[j] = w · src[j]`; `widened` is scratch of the same length.
    fn first(acc: &mut [Self::Acc], src: &[Self], w: Self::Acc, widened: &mut [Self::Acc]);
    /// `acc[j] += w · src[j]`; `widened` is scratch of the same length.
    fn add(acc: &mut [Self::Acc], src: &[Self], w: Self::Acc, widened: &mut [Self::Acc]);
    /// `dst[j] = acc[j]`, rounded to the storage type. (Plain stores: the outputs are read
    /// again at once, forwarded round a ring or handed back to the caller; non-temporal stores
    /// that bypassed the cache made an in-place 8 MiB sum 3.4x slower on a 32 MiB-L3 host.)
    fn store(acc: &[Self::Acc], dst: &mut [Self]);

    /// `block[j] = w · block[j]`, with the same rounding as [`Element::first`] then
    /// [`Element::store`] (which the default goes through); native types multiply in place,
    /// with no pass through the accumulator.
    #[inline]
    fn scale(block: &mut [Self], w: Self::Acc, acc: &mut [Self::Acc], widened: &mut [Self::Acc]) {
        Self::first(acc, block, w, widened);
        Self::store(acc, block);
    }

    /// `acc[j] = Σ_i w[i] · srcs[i][j]`, summed left to right. The default goes through
    /// [`Element::first`] and [`Element::add`]; native types keep partial sums in registers.
    #[inline]
    fn accumulate(
        acc: &mut [Self::Acc],
        srcs: &[&[Self]],
        w: &[Self::Acc],
        widened: &mut [Self::Acc],
    ) {
        Self::first(acc, srcs[0], w[0], widened);
        for (s, &wi) in srcs[1..].iter().zip(&w[1..]) {
            Self::add(acc, s, wi, widened);
        }
    }
}

/// Sources in groups of up to four, each group one pass over the L1-resident accumulator with
/// the partial sum in a register, left to right: `((acc + w0·s0) + w1·s1) + ...`, the same order
/// as one source at a time. Zipped iterators let the compiler drop bounds checks and vectorise.
#[inline(always)]
fn accumulate_native<T>(acc: &mut [T], srcs: &[&[T]], w: &[T])
where
    T: Copy + std::ops::Add<Output = T> + std::ops::Mul<Output = T>,
{
    let mut i = 0;
    while i < srcs.len() {
        let (s, w) = (&srcs[i..], &w[i..]);
        let g = (srcs.len() - i).min(4);
        let a = acc.iter_mut();
        match (i == 0, g) {
            (true, 1) => a.zip(s[0]).for_each(|(a, &x0)| *a = w[0] * x0),
            (false, 1) => a.zip(s[0]).for_each(|(a, &x0)| *a = *a + w[0] * x0),
            (true, 2) => a
                .zip(s[0])
                .zip(s[1])
                .for_each(|((a, &x0), &x1)| *a = w[0] * x0 + w[1] * x1),
            (false, 2) => a
                .zip(s[0])
                .zip(s[1])
                .for_each(|((a, &x0), &x1)| *a = *a + w[0] * x0 + w[1] * x1),
            (true, 3) => a
                .zip(s[0])
                .zip(s[1])
                .zip(s[2])
                .for_each(|(((a, &x0), &x1), &x2)| *a = w[0] * x0 + w[1] * x1 + w[2] * x2),
            (false, 3) => a
                .zip(s[0])
                .zip(s[1])
                .zip(s[2])
                .for_each(|(((a, &x0), &x1), &x2)| *a = *a + w[0] * x0 + w[1] * x1 + w[2] * x2),
            (true, _) => a.zip(s[0]).zip(s[1]).zip(s[2]).zip(s[3]).for_each(
                |((((a, &x0), &x1), &x2), &x3)| *a = w[0] * x0 + w[1] * x1 + w[2] * x2 + w[3] * x3,
            ),
            (false, _) => a.zip(s[0]).zip(s[1]).zip(s[2]).zip(s[3]).for_each(
                |((((a, &x0), &x1), &x2), &x3)| {
                    *a = *a + w[0] * x0 + w[1] * x1 + w[2] * x2 + w[3] * x3
                },
            ),
        }
        i += g;
    }
}

macro_rules! native {
    ($t:ty, $name:literal) => {
        impl Element for $t {
            type Acc = $t;
            const NAME: &'static str = $name;
            #[inline]
            fn weight(w: f64) -> $t {
                w as $t
            }
            #[inline(always)]
            fn first(acc: &mut [$t], src: &[$t], w: $t, _: &mut [$t]) {
                for (a, &s) in acc.iter_mut().zip(src) {
                    *a = w * s;
                }
            }
            #[inline(always)]
            fn add(acc: &mut [$t], src: &[$t], w: $t, _: &mut [$t]) {
                for (a, &s) in acc.iter_mut().zip(src) {
                    *a += w * s;
                }
            }
            #[inline(always)]
            fn store(acc: &[$t], dst: &mut [$t]) {
                dst.copy_from_slice(acc);
            }
            #[inline(always)]
            fn scale(block: &mut [$t], w: $t, _: &mut [$t], _: &mut [$t]) {
                block.iter_mut().for_each(|x| *x *= w);
            }
            #[inline(always)]
            fn accumulate(acc: &mut [$t], srcs: &[&[$t]], w: &[$t], _: &mut [$t]) {
                accumulate_native(acc, srcs, w);
            }
        }
    };
}
native!(f32, "float32");
native!(f64, "float64");

macro_rules! half_float {
    ($t:ty, $name:literal) => {
        impl Element for $t {
            type Acc = f32;
            const NAME: &'static str = $name;
            #[inline]
            fn weight(w: f64) -> f32 {
                w as f32
            }
            #[inline]
            fn first(acc: &mut [f32], src: &[$t], w: f32, widened: &mut [f32]) {
                src.convert_to_f32_slice(widened);
                <f32 as Element>::first(acc, widened, w, &mut []);
            }
            #[inline]
            fn add(acc: &mut [f32], src: &[$t], w: f32, widened: &mut [f32]) {
                src.convert_to_f32_slice(widened);
                <f32 as Element>::add(acc, widened, w, &mut []);
            }
            #[inline]
            fn store(acc: &[f32], dst: &mut [$t]) {
                dst.convert_from_f32_slice(acc);
            }
        }
    };
}
half_float!(f16, "float16");
half_float!(bf16, "bfloat16");
