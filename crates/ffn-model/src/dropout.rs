//! # Dropout masks, from the device's stream or a seeded one
//!
//! Dropout (Srivastava et al. 2014) multiplies a tensor by
//!
//! ```text
//! mask = m / (1 − p),   m_i ~ Bernoulli(1 − p) independently,
//! ```
//!
//! so that the expected value of every element is unchanged. burn's `Dropout` draws `m` from
//! the device's random stream, which is one per process: modules running forward on several
//! threads at once draw from it in whatever order the threads come, and a run can no longer be
//! repeated. Inside [`with_seed`], a [`FeedForward`](crate::FeedForward) on this thread draws
//! its masks from a stream of its own instead: the `c`-th mask drawn in the scope has element
//! `i` kept when
//!
//! ```text
//! u(seed, c, i) = mix(mix(seed ⊕ c) + i) / 2⁶⁴ < 1 − p
//! ```
//!
//! with `mix` the SplitMix64 finaliser (Steele et al. 2014): a counter-based generator, so the
//! masks depend on the seed and the order of draws on this thread only. Outside a scope, masks
//! come from the device as burn's `Dropout` draws them (the same values for the same seed).

use std::cell::Cell;

use burn::tensor::{DType, Device, Distribution, Shape, Tensor, TensorData};

thread_local! {
    /// The seed of this thread's scope and the masks drawn in it so far.
    static STREAM: Cell<Option<(u64, u64)>> = const { Cell::new(None) };
}

/// Runs `f` with this thread's dropout masks drawn from a stream seeded by `seed` (see the
/// [module docs](self)); scopes nest, and the outer one resumes when `f` returns or unwinds.
///
/// Use it to run modules with dropout on several threads at once reproducibly: one seed per
/// thread's work, fixed before the threads start. A rayon task that waits inside `f` may run
/// another task on this thread; that task's own scope then covers its draws, and this one
/// resumes after it.
///
/// ```
/// use burn::tensor::{Device, Distribution, Tensor};
/// use ffn_model::{FeedForwardConfig, dropout};
///
/// let device = Device::flex().autodiff();
/// let ffn = FeedForwardConfig::new(8, 32).with_dropout(0.5).init(&device);
/// let x = Tensor::<2>::random([4, 8], Distribution::Normal(0.0, 1.0), &device);
/// let a = dropout::with_seed(7, || ffn.forward(x.clone()));
/// let b = dropout::with_seed(7, || ffn.forward(x.clone()));
/// a.into_data().assert_eq(&b.into_data(), true);
/// ```
pub fn with_seed<R>(seed: u64, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<(u64, u64)>);
    impl Drop for Restore {
        fn drop(&mut self) {
            STREAM.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(STREAM.with(|s| s.replace(Some((seed, 0)))));
    f()
}

/// SplitMix64's finaliser: a bijection of `u64` whose outputs look independent.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The mask `m / (1 − p)` for a tensor of `shape` on `device` in `dtype`: from this thread's
/// seeded stream inside [`with_seed`], else from the device's stream.
pub(crate) fn mask<const D: usize>(
    shape: Shape,
    device: &Device,
    dtype: DType,
    p: f64,
) -> Tensor<D> {
    let keep = 1.0 - p;
    let options = (device, dtype);
    let Some((seed, count)) = STREAM.with(|s| s.get()) else {
        return Tensor::random(shape, Distribution::Bernoulli(keep), options) * (1.0 / keep);
    };
    STREAM.with(|s| s.set(Some((seed, count + 1))));
    let key = mix(seed ^ count);
    let threshold = keep * 2f64.powi(64);
    let m: Vec<f32> = (0..shape.num_elements() as u64)
        .map(|i| f32::from(u8::from((mix(key.wrapping_add(i)) as f64) < threshold)))
        .collect();
    // Scaled as on the device's path, in the tensor's dtype.
    Tensor::from_data(TensorData::new(m, shape), options) * (1.0 / keep)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a scope, the masks depend on the seed and the order of draws only, keep about
    /// `1 − p` of the elements, scale the kept ones by `1 / (1 − p)`, and the scope ends with
    /// `with_seed` (nested scopes resume the outer stream).
    #[test]
    fn seeded_masks_are_repeatable_and_have_the_right_rate() {
        let device = Device::flex();
        let mask = |p| mask::<2>(Shape::new([100, 200]), &device, DType::F32, p);
        let draw = |seed| with_seed(seed, || [mask(0.3), mask(0.3)]);
        let [a, b] = draw(1);
        let [a2, b2] = draw(1);
        a.clone().into_data().assert_eq(&a2.into_data(), true);
        b.clone().into_data().assert_eq(&b2.into_data(), true);
        let differs = |x: &Tensor<2>, y: &Tensor<2>| {
            (x.clone() - y.clone()).abs().sum().into_scalar::<f32>() > 0.0
        };
        assert!(differs(&a, &b), "two draws in one scope differ");
        assert!(differs(&a, &draw(2)[0]), "another seed, another mask");
        let values = a.into_data().try_to_vec::<f32>().unwrap();
        let kept = values.iter().filter(|&&v| v != 0.0).count() as f64 / values.len() as f64;
        // 20,000 Bernoulli(0.7) draws: σ ≈ 0.0032.
        assert!((kept - 0.7).abs() < 0.02, "kept {kept}");
        assert!(
            values
                .iter()
                .all(|&v| v == 0.0 || (v - 1.0 / 0.7).abs() < 1e-6)
        );
        // Nested: the inner scope does not advance the outer one's count.
        let outer = with_seed(3, || {
            let first = mask(0.5);
            let _ = with_seed(4, || mask(0.5));
            [first, mask(0.5)]
        });
        let plain = with_seed(3, || [mask(0.5), mask(0.5)]);
        outer[1]
            .clone()
            .into_data()
            .assert_eq(&plain[1].clone().into_data(), true);
        assert!(STREAM.with(|s| s.get()).is_none(), "the scope ended");
    }
}
