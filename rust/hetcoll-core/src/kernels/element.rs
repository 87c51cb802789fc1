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
    /// `dst[j] = acc[j]`, rounded to the storage type.
    fn store(acc: &[Self::Acc], dst: &mut [Self]);
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
            #[inline]
            fn first(acc: &mut [$t], src: &[$t], w: $t, _: &mut [$t]) {
                for (a, &s) in acc.iter_mut().zip(src) {
                    *a = w * s;
                }
            }
            #[inline]
            fn add(acc: &mut [$t], src: &[$t], w: $t, _: &mut [$t]) {
                for (a, &s) in acc.iter_mut().zip(src) {
                    *a += w * s;
                }
            }
            #[inline]
            fn store(acc: &[$t], dst: &mut [$t]) {
                dst.copy_from_slice(acc);
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
