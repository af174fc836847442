//! Saving and loading: burn records and safetensors files, round trips on rank-3 inputs, the
//! activation surviving both, PyTorch layout, and a typed error for every bad file.

use std::fs;

use burn::module::Module;
use burn::tensor::{Device, Tensor, TensorData};
use ffn_model::{Activation, Error, FeedForward, FeedForwardConfig, Variant};
use ffn_test_support::{device, scratch, strip_metadata};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

fn biased(variant: Variant) -> FeedForwardConfig {
    let config = FeedForwardConfig::preset(variant, 12);
    let gated = config.gated;
    config
        .with_bias_up(true)
        .with_bias_gate(gated)
        .with_bias_down(true)
}

fn input(device: &Device) -> Tensor<3> {
    let values: Vec<f32> = (0..2 * 5 * 12)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
        .collect();
    Tensor::from_data(TensorData::new(values, [2, 5, 12]), device)
}

fn values(t: Tensor<3>) -> Vec<f32> {
    t.into_data().try_to_vec().unwrap()
}

#[test]
fn safetensors_round_trip_on_every_variant() {
    let device = device();
    let dir = scratch("persist-st-round-trip");
    for variant in Variant::ALL {
        for config in [FeedForwardConfig::preset(variant, 12), biased(variant)] {
            let original = config.init(&device);
            let path = dir.join(format!("{variant}.safetensors"));
            original.save_safetensors(&path).unwrap();
            let loaded = config.init(&device).load_safetensors(&path).unwrap();
            assert_eq!(
                values(loaded.forward(input(&device))),
                values(original.forward(input(&device)))
            );
        }
    }
}

#[test]
fn burn_record_round_trip_on_every_variant() {
    let device = device();
    let dir = scratch("persist-record-round-trip");
    for variant in Variant::ALL {
        let config = biased(variant);
        let original = config.init(&device);
        let expected = values(original.forward(input(&device)));

        let path = dir.join(format!("{variant}.bpk"));
        original.clone().save_file(&path).unwrap();
        let loaded = config.init(&device).load_file(&path);
        assert_eq!(values(loaded.forward(input(&device))), expected);

        let record = original.clone().into_record();
        let bytes = record.into_bytes().unwrap();
        let record = burn::store::ModuleRecord::from_bytes(bytes).unwrap();
        let loaded = config.init(&device).load_record(record);
        assert_eq!(values(loaded.forward(input(&device))), expected);
    }
}

/// burn's `PositionWiseFeedForward` records no activation: loading its file into a module
/// built with another one silently changes the function. Here the activation comes back.
#[test]
fn the_activation_survives_records_and_files() {
    let device = device();
    let dir = scratch("persist-activation");
    let swiglu = FeedForwardConfig::preset(Variant::SwiGlu, 12).init(&device);
    let expected = values(swiglu.forward(input(&device)));
    // Same shapes, another activation: ReGLU.
    let reglu = || FeedForwardConfig::preset(Variant::ReGlu, 12).init(&device);
    assert_eq!(reglu().activation(), Activation::Relu);

    let bpk = dir.join("swiglu.bpk");
    swiglu.clone().save_file(&bpk).unwrap();
    let loaded = reglu().load_file(&bpk);
    assert_eq!(loaded.activation(), Activation::Silu);
    assert_eq!(values(loaded.forward(input(&device))), expected);

    let loaded = reglu().load_record(swiglu.clone().into_record());
    assert_eq!(loaded.activation(), Activation::Silu);
    assert_eq!(values(loaded.forward(input(&device))), expected);

    let st = dir.join("swiglu.safetensors");
    swiglu.save_safetensors(&st).unwrap();
    let loaded = reglu().load_safetensors(&st).unwrap();
    assert_eq!(loaded.activation(), Activation::Silu);
    assert_eq!(values(loaded.forward(input(&device))), expected);

    // It survives device moves, validation mode, and the record keys are as documented.
    let moved = loaded.valid().to_device(&Device::flex());
    assert_eq!(moved.activation(), Activation::Silu);
    let mut keys = Vec::new();
    struct Keys<'a>(&'a mut Vec<String>, Vec<String>);
    impl burn::module::ModuleVisitor for Keys<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.1.push(name.into());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.1.pop();
        }
        fn visit_float<const D: usize>(&mut self, _: &burn::module::Param<Tensor<D>>) {
            self.0.push(self.1.join("."));
        }
        fn visit_int<const D: usize>(
            &mut self,
            _: &burn::module::Param<Tensor<D, burn::tensor::Int>>,
        ) {
            self.0.push(self.1.join("."));
        }
    }
    swiglu.visit(&mut Keys(&mut keys, Vec::new()));
    assert_eq!(
        keys,
        ["gate.weight", "up.weight", "down.weight", "activation"]
    );
}

#[test]
fn a_record_of_another_structure_is_an_error() {
    let device = device();
    let gated = FeedForwardConfig::preset(Variant::SwiGlu, 12).init(&device);
    let ungated = FeedForwardConfig::new(12, 32).with_activation(Activation::Silu);
    let err = ungated
        .init(&device)
        .try_load_record(gated.into_record())
        .unwrap_err();
    assert!(err.to_string().contains("gate.weight"), "{err}");
}

#[test]
fn safetensors_files_use_pytorch_names_and_layout() {
    let device = device();
    let ffn = biased(Variant::GeGlu).init(&device);
    let bytes = ffn.to_safetensors_bytes();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut names = file.names();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "down.bias",
            "down.weight",
            "gate.bias",
            "gate.weight",
            "up.bias",
            "up.weight"
        ]
    );
    let (d_model, d_ff) = (12, 32);
    for (key, shape) in [
        ("up.weight", vec![d_ff, d_model]),
        ("gate.weight", vec![d_ff, d_model]),
        ("down.weight", vec![d_model, d_ff]),
        ("up.bias", vec![d_ff]),
        ("gate.bias", vec![d_ff]),
        ("down.bias", vec![d_model]),
    ] {
        let view = file.tensor(key).unwrap();
        assert_eq!(view.shape(), shape.as_slice(), "{key}");
        assert_eq!(view.dtype(), Dtype::F32, "{key}");
    }
    // file[o, i] == burn[i, o]
    let burn: Vec<f32> = ffn.down().weight.val().into_data().try_to_vec().unwrap();
    let file_down: Vec<f32> = file
        .tensor("down.weight")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    for o in 0..d_model {
        for i in 0..d_ff {
            assert_eq!(file_down[o * d_ff + i], burn[i * d_model + o]);
        }
    }
    let (_, metadata) = SafeTensors::read_metadata(&bytes).unwrap();
    let metadata = metadata.metadata().clone().unwrap();
    assert_eq!(metadata["format"], "pt");
    assert_eq!(metadata["ffn.activation"], "gelu");
}

#[test]
fn half_precision_files_are_widened() {
    let device = device();
    let config = FeedForwardConfig::new(4, 6).with_bias_down(true);
    let reference = config.init(&device);
    let file_bytes = reference.to_safetensors_bytes();
    let file = SafeTensors::deserialize(&file_bytes).unwrap();
    for (dtype, encode) in [
        (
            Dtype::F16,
            (|v: f32| burn::tensor::f16::from_f32(v).to_le_bytes()) as fn(f32) -> [u8; 2],
        ),
        (Dtype::BF16, |v: f32| {
            burn::tensor::bf16::from_f32(v).to_le_bytes()
        }),
    ] {
        let converted: Vec<(String, Vec<u8>, Vec<usize>)> = file
            .tensors()
            .into_iter()
            .map(|(name, view)| {
                let bytes = view
                    .data()
                    .chunks_exact(4)
                    .flat_map(|c| encode(f32::from_le_bytes(c.try_into().unwrap())))
                    .collect();
                (name, bytes, view.shape().to_vec())
            })
            .collect();
        let views = converted
            .iter()
            .map(|(n, b, s)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()));
        let bytes = safetensors::serialize(views, None).unwrap();
        let loaded = config.init(&device).load_safetensors_bytes(&bytes).unwrap();
        let expected: Vec<f32> = reference
            .up()
            .unwrap()
            .weight
            .val()
            .into_data()
            .try_to_vec()
            .unwrap();
        let actual: Vec<f32> = loaded
            .up()
            .unwrap()
            .weight
            .val()
            .into_data()
            .try_to_vec()
            .unwrap();
        let rounded: Vec<f32> = expected
            .iter()
            .map(|v| match dtype {
                Dtype::F16 => burn::tensor::f16::from_f32(*v).to_f32(),
                _ => burn::tensor::bf16::from_f32(*v).to_f32(),
            })
            .collect();
        assert_eq!(actual, rounded, "{dtype:?}");
    }
}

/// Builds a safetensors file from `(name, shape)` pairs of f32 zeros, with one dtype override.
fn file_with(tensors: &[(&str, Vec<usize>)], int_key: Option<&str>) -> Vec<u8> {
    let data: Vec<(String, Vec<u8>, Vec<usize>, Dtype)> = tensors
        .iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let dtype = if Some(*name) == int_key {
                Dtype::I32
            } else {
                Dtype::F32
            };
            (name.to_string(), vec![0u8; 4 * n], shape.clone(), dtype)
        })
        .collect();
    let views = data
        .iter()
        .map(|(n, b, s, d)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()));
    safetensors::serialize(views, None).unwrap()
}

#[test]
fn every_bad_file_gives_a_typed_error_naming_the_key() {
    let device = device();
    let ungated = || {
        FeedForwardConfig::new(4, 8)
            .with_bias_up(true)
            .init(&device)
    };
    let good = vec![
        ("up.weight", vec![8, 4]),
        ("up.bias", vec![8]),
        ("down.weight", vec![4, 8]),
    ];
    assert!(
        ungated()
            .load_safetensors_bytes(&file_with(&good, None))
            .is_ok()
    );

    // Missing tensor.
    let err = ungated()
        .load_safetensors_bytes(&file_with(&good[..2], None))
        .unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { key, .. } if key == "down.weight"),
        "{err}"
    );
    // Missing bias, with a hint.
    let no_bias = vec![good[0].clone(), good[2].clone()];
    let err = ungated()
        .load_safetensors_bytes(&file_with(&no_bias, None))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "missing tensor `up.bias` (the file has no bias here: build the module with bias_up = false)"
    );
    // Extra tensor: a gated file into an ungated module.
    let mut gated = good.clone();
    gated.push(("gate.weight", vec![8, 4]));
    let err = ungated()
        .load_safetensors_bytes(&file_with(&gated, None))
        .unwrap_err();
    assert!(
        matches!(&err, Error::UnexpectedTensor { key, .. } if key == "gate.weight"),
        "{err}"
    );
    assert!(err.to_string().contains("gated = true"), "{err}");
    // An ungated file into a gated module.
    let gated_module = FeedForwardConfig::new(4, 8)
        .with_bias_up(true)
        .with_gated(true);
    let err = gated_module
        .init(&device)
        .load_safetensors_bytes(&file_with(&good, None))
        .unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { key, .. } if key == "gate.weight"),
        "{err}"
    );
    // Wrong shape (another d_ff), in PyTorch layout.
    let mut wide = good.clone();
    wide[0].1 = vec![16, 4];
    let err = ungated()
        .load_safetensors_bytes(&file_with(&wide, None))
        .unwrap_err();
    let Error::Shape {
        key,
        expected,
        actual,
    } = &err
    else {
        panic!("{err}")
    };
    assert_eq!(
        (key.as_str(), expected.as_slice(), actual.as_slice()),
        ("up.weight", &[8, 4][..], &[16, 4][..])
    );
    assert_eq!(
        err.to_string(),
        "tensor `up.weight` has shape [16, 4], expected [8, 4]"
    );
    // Transposed weight (a burn-layout file) is a shape error too.
    let mut transposed = good.clone();
    transposed[0].1 = vec![4, 8];
    let err = ungated()
        .load_safetensors_bytes(&file_with(&transposed, None))
        .unwrap_err();
    assert!(matches!(err, Error::Shape { .. }));
    // Wrong dtype.
    let err = ungated()
        .load_safetensors_bytes(&file_with(&good, Some("up.bias")))
        .unwrap_err();
    assert!(
        matches!(&err, Error::DType { key, dtype } if key == "up.bias" && dtype == "I32"),
        "{err}"
    );
    // Truncated file.
    let bytes = file_with(&good, None);
    for cut in [bytes.len() - 1, bytes.len() / 2, 10, 3, 0] {
        let err = ungated().load_safetensors_bytes(&bytes[..cut]).unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "cut at {cut}: {err}");
    }
    // Not a safetensors file at all.
    let err = ungated()
        .load_safetensors_bytes(b"PK\x03\x04 a zip file")
        .unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    // Unknown activation in our metadata.
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let metadata = [("ffn.activation".to_string(), "gleu".to_string())].into();
    let with_metadata = safetensors::serialize(file.tensors(), Some(metadata)).unwrap();
    let err = ungated()
        .load_safetensors_bytes(&with_metadata)
        .unwrap_err();
    assert!(
        matches!(&err, Error::Metadata(name) if name == "gleu"),
        "{err}"
    );
    // No such file.
    let err = ungated()
        .load_safetensors("/nonexistent/ffn.safetensors")
        .unwrap_err();
    assert!(
        matches!(&err, Error::Io { path, .. } if path.ends_with("ffn.safetensors")),
        "{err}"
    );
}

#[test]
fn a_file_without_metadata_keeps_the_module_activation() {
    let device = device();
    let bytes = strip_metadata(
        &FeedForwardConfig::new(4, 8)
            .init(&device)
            .to_safetensors_bytes(),
    );
    let loaded = FeedForwardConfig::new(4, 8)
        .with_activation(Activation::Tanh)
        .init(&device)
        .load_safetensors_bytes(&bytes)
        .unwrap();
    assert_eq!(loaded.activation(), Activation::Tanh);
}

#[test]
fn saving_is_atomic_and_never_loses_a_file() {
    let device = device();
    let dir = scratch("persist-atomic");
    let path = dir.join("ffn.safetensors");
    let first = FeedForwardConfig::new(4, 8).init(&device);
    let second = FeedForwardConfig::new(4, 8).init(&device);
    first.save_safetensors(&path).unwrap();
    second.save_safetensors(&path).unwrap();
    assert_eq!(fs::read(&path).unwrap(), second.to_safetensors_bytes());
    // Nothing but the file is left behind.
    let entries: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(entries, [std::ffi::OsString::from("ffn.safetensors")]);

    // A save that cannot complete leaves what was there.
    let occupied = dir.join("a-directory");
    fs::create_dir(&occupied).unwrap();
    fs::write(occupied.join("keep"), "data").unwrap();
    let err = first.save_safetensors(&occupied).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
    assert_eq!(fs::read_to_string(occupied.join("keep")).unwrap(), "data");
    let err = first
        .save_safetensors(dir.join("missing/ffn.safetensors"))
        .unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
    assert_eq!(fs::read(&path).unwrap(), second.to_safetensors_bytes());
}

#[test]
fn loading_keeps_the_device_and_gradients() {
    let device = device();
    let ffn = FeedForwardConfig::new(4, 8)
        .with_bias_up(true)
        .init(&device);
    let bytes = ffn.to_safetensors_bytes();
    let loaded: FeedForward = FeedForwardConfig::new(4, 8)
        .with_bias_up(true)
        .init(&device)
        .load_safetensors_bytes(&bytes)
        .unwrap();
    assert_eq!(loaded.up().unwrap().weight.val().device(), device);
    let x = Tensor::<2>::ones([3, 4], &device);
    let grads = loaded.forward(x).sum().backward();
    assert!(loaded.up().unwrap().weight.val().grad(&grads).is_some());
    assert!(
        loaded
            .up()
            .unwrap()
            .bias
            .as_ref()
            .unwrap()
            .val()
            .grad(&grads)
            .is_some()
    );
    assert!(loaded.down().weight.val().grad(&grads).is_some());
}
