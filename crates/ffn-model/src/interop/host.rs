//! # Tensors on the host, in PyTorch's layout
//!
//! Weights travel between a burn module and a file as row-major buffers of `f32` or `f64`
//! values: burn's `Linear` holds `W` as `[d_input, d_output]`, PyTorch's `nn.Linear` as
//! `[out_features, in_features]`, GPT-2's `Conv1D` as `[in, out]`, and the packed layouts stack
//! two projections' rows. These helpers do those transposes, row ranges and concatenations.

use burn::tensor::{DType, Tensor, TensorData};

/// One tensor on its way to a file: its shape and data (f32 or f64).
pub(crate) struct HostTensor {
    pub(crate) shape: Vec<usize>,
    pub(crate) data: TensorData,
}

/// A burn tensor to a host tensor in PyTorch layout (`[out, in]` for a weight), as f32 unless
/// it is f64.
pub(crate) fn to_pytorch<const D: usize>(tensor: Tensor<D>) -> HostTensor {
    let HostTensor { shape, data } = to_host(tensor);
    match shape.as_slice() {
        [rows, cols] => HostTensor {
            shape: vec![*cols, *rows],
            data: transpose(&data, *rows, *cols),
        },
        _ => HostTensor { shape, data },
    }
}

/// A tensor's values as they are (f64 kept, anything else as f32), in its own layout.
pub(crate) fn to_host<const D: usize>(tensor: Tensor<D>) -> HostTensor {
    let data = tensor.into_data();
    let data = if data.dtype() == DType::F64 {
        data
    } else {
        data.convert::<f32>()
    };
    HostTensor {
        shape: data.shape().to_vec(),
        data,
    }
}

/// Applies `f` to the values of f32 or f64 data.
fn with_values(
    data: &TensorData,
    f32s: impl FnOnce(&[f32]) -> (Vec<f32>, Vec<usize>),
    f64s: impl FnOnce(&[f64]) -> (Vec<f64>, Vec<usize>),
) -> TensorData {
    match data.dtype() {
        DType::F64 => {
            let (v, shape) = f64s(data.as_slice::<f64>().expect("f64"));
            TensorData::new(v, shape)
        }
        _ => {
            let (v, shape) = f32s(data.as_slice::<f32>().expect("f32"));
            TensorData::new(v, shape)
        }
    }
}

/// The transpose of a row-major `[rows, cols]` matrix, copied into a new row-major buffer.
pub(crate) fn transpose(data: &TensorData, rows: usize, cols: usize) -> TensorData {
    fn t<E: Copy>(src: &[E], rows: usize, cols: usize) -> (Vec<E>, Vec<usize>) {
        let v = (0..cols)
            .flat_map(|c| (0..rows).map(move |r| src[r * cols + c]))
            .collect();
        (v, vec![cols, rows])
    }
    with_values(data, |s| t(s, rows, cols), |s| t(s, rows, cols))
}

/// Rows `start..start + count` of a row-major matrix with `cols` columns (a vector: `cols = 1`).
pub(crate) fn rows(data: &TensorData, start: usize, count: usize, cols: usize) -> TensorData {
    let shape = if data.shape().len() == 1 {
        vec![count]
    } else {
        vec![count, cols]
    };
    let (s1, s2) = (shape.clone(), shape);
    with_values(
        data,
        |s| (s[start * cols..(start + count) * cols].to_vec(), s1),
        |s| (s[start * cols..(start + count) * cols].to_vec(), s2),
    )
}

/// `[a; b]`: the rows of `a` then those of `b`.
pub(crate) fn concat_rows(a: &HostTensor, b: &HostTensor) -> HostTensor {
    let mut shape = a.shape.clone();
    shape[0] += b.shape[0];
    let (s1, s2) = (shape.clone(), shape.clone());
    let data = with_values(
        &a.data,
        |x| {
            (
                [x, b.data.as_slice::<f32>().expect("same dtype")].concat(),
                s1,
            )
        },
        |x| {
            (
                [x, b.data.as_slice::<f64>().expect("same dtype")].concat(),
                s2,
            )
        },
    );
    HostTensor { shape, data }
}
