//! ffn-train's ops against PyTorch: `tools/golden_train_ops.py` wrote causal attention
//! (`F.scaled_dot_product_attention(is_causal=True)` over heads side by side in the last
//! dimension) with the gradients of `L = Σ O ⊙ g`, and `F.cross_entropy` with its gradient, in
//! f64 from f32 inputs. The ops must match in f32 (1e-5) and in f64 (1e-12), relative to each
//! tensor's largest magnitude.
#![cfg(feature = "flex")]

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use ffn_train::ops::attention::causal_attention;
use ffn_train::ops::loss::cross_entropy;
use safetensors::SafeTensors;

fn golden() -> Vec<u8> {
    let path = ffn_test_support::data_file("golden_ops.safetensors");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn read<const D: usize>(
    file: &SafeTensors<'_>,
    key: &str,
    dtype: DType,
    device: &Device,
) -> Tensor<D> {
    let view = file
        .tensor(key)
        .unwrap_or_else(|e| panic!("golden key {key}: {e}"));
    let values: Vec<f64> = view
        .data()
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    Tensor::<D>::from_data(
        TensorData::new(values, view.shape().to_vec()),
        (device, dtype),
    )
}

/// `max |a − b| / max(1, max |b|)`.
fn error<const D: usize>(actual: Tensor<D>, expected: Tensor<D>) -> f64 {
    assert_eq!(actual.dims(), expected.dims());
    let (a, b) = (actual.cast(DType::F64), expected.cast(DType::F64));
    let scale = b.clone().abs().max().into_scalar::<f64>().max(1.0);
    (a - b).abs().max().into_scalar::<f64>() / scale
}

fn tolerance(dtype: DType) -> f64 {
    if dtype == DType::F32 { 1e-5 } else { 1e-12 }
}

#[test]
fn causal_attention_matches_pytorch() {
    let bytes = golden();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let device = Device::flex().autodiff();
    for (name, heads) in [("small", 3), ("tiles", 2), ("one", 1)] {
        for dtype in [DType::F32, DType::F64] {
            let get =
                |key: &str| read::<3>(&file, &format!("attention/{name}/{key}"), dtype, &device);
            let (q, k, v) = (
                get("q").require_grad(),
                get("k").require_grad(),
                get("v").require_grad(),
            );
            let o = causal_attention(
                q.clone(),
                k.clone(),
                v.clone(),
                heads,
                ffn_model::Precision::F32,
            );
            let grads = (o.clone() * get("g")).sum().backward();
            let checks = [
                ("o", o.inner()),
                ("dq", q.grad(&grads).unwrap()),
                ("dk", k.grad(&grads).unwrap()),
                ("dv", v.grad(&grads).unwrap()),
            ];
            for (key, actual) in checks {
                let e = error(actual, get(key).inner());
                assert!(
                    e < tolerance(dtype),
                    "attention {name} {dtype:?} {key}: {e:e}"
                );
            }
        }
    }
}

#[test]
fn cross_entropy_matches_pytorch() {
    let bytes = golden();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let device = Device::flex().autodiff();
    let view = file.tensor("cross_entropy/targets").unwrap();
    let targets: Vec<i64> = view
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let n = targets.len();
    let targets = Tensor::<1, Int>::from_data(TensorData::new(targets, [n]), &device);
    for dtype in [DType::F32, DType::F64] {
        let z = read::<2>(&file, "cross_entropy/logits", dtype, &device).require_grad();
        let loss = cross_entropy(z.clone(), targets.clone());
        let grads = loss.clone().backward();
        let expected = read::<1>(&file, "cross_entropy/loss", dtype, &device);
        let e = error(loss.inner(), expected.inner());
        assert!(e < tolerance(dtype), "cross-entropy {dtype:?} loss: {e:e}");
        let expected = read::<2>(&file, "cross_entropy/dlogits", dtype, &device);
        let e = error(z.grad(&grads).unwrap(), expected.inner());
        assert!(
            e < tolerance(dtype),
            "cross-entropy {dtype:?} gradient: {e:e}"
        );
    }
}
