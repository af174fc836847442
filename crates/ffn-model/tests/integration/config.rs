//! The config: serde round trips, every validation error, presets, activation names.

use burn::config::Config;
use burn::nn::Initializer;
use ffn_model::{Activation, ConfigError, DropoutAt, FeedForwardConfig, Precision, Variant};

fn every_field_set() -> FeedForwardConfig {
    FeedForwardConfig::new(96, 256)
        .with_activation(Activation::GeluTanh)
        .with_gated(true)
        .with_bias_up(true)
        .with_bias_gate(true)
        .with_bias_down(false)
        .with_dropout(0.25)
        .with_dropout_at(DropoutAt::Output)
        .with_precision(Precision::Bf16)
        .with_initializer(Initializer::Normal {
            mean: 0.0,
            std: 0.02,
        })
}

#[test]
fn toml_and_json_round_trip() {
    let mut configs: Vec<FeedForwardConfig> = vec![every_field_set(), FeedForwardConfig::new(1, 1)];
    configs.extend(Variant::ALL.map(|v| FeedForwardConfig::preset(v, 64)));
    configs.extend([
        FeedForwardConfig::bert(768),
        FeedForwardConfig::vaswani(512),
        FeedForwardConfig::labml(512, 2048),
    ]);
    for config in configs {
        let toml = config.to_toml();
        assert_eq!(
            FeedForwardConfig::from_toml(&toml).unwrap(),
            config,
            "{toml}"
        );
        let json = config.to_json();
        assert_eq!(
            FeedForwardConfig::from_json(&json).unwrap(),
            config,
            "{json}"
        );
    }
}

#[test]
fn burn_config_trait_saves_and_loads_json() {
    let dir = ffn_test_support::scratch("config-burn");
    let path = dir.join("ffn.json");
    let config = every_field_set();
    config.save(&path).unwrap();
    assert_eq!(FeedForwardConfig::load(&path).unwrap(), config);
}

#[test]
fn a_short_toml_file_takes_the_defaults() {
    let config = FeedForwardConfig::from_toml("d_model = 8\nd_ff = 32\n").unwrap();
    assert_eq!(config, FeedForwardConfig::new(8, 32));
    assert_eq!(config.activation, Activation::Gelu);
    assert!(!config.gated && !config.bias_up && !config.bias_gate && !config.bias_down);
    assert_eq!(
        (config.dropout, config.dropout_at),
        (0.0, DropoutAt::Hidden)
    );
    assert_eq!(
        config.initializer,
        Initializer::KaimingUniform {
            gain: 1.0 / 3f64.sqrt(),
            fan_out_only: false
        }
    );

    let swiglu = FeedForwardConfig::from_toml(
        "d_model = 8\nd_ff = 21\nactivation = \"swish\"\ngated = true\ndropout_at = \"output\"",
    )
    .unwrap();
    assert_eq!(swiglu.activation, Activation::Silu);
    assert!(swiglu.gated);
    assert_eq!(swiglu.dropout_at, DropoutAt::Output);
}

#[test]
fn every_validation_error() {
    let ok = FeedForwardConfig::new(4, 8);
    assert_eq!(ok.validate(), Ok(()));
    let cases = [
        (
            FeedForwardConfig::new(0, 8),
            ConfigError::ZeroSize { field: "d_model" },
        ),
        (
            FeedForwardConfig::new(4, 0),
            ConfigError::ZeroSize { field: "d_ff" },
        ),
        (ok.clone().with_dropout(1.0), ConfigError::Dropout(1.0)),
        (ok.clone().with_dropout(-0.1), ConfigError::Dropout(-0.1)),
        (
            ok.clone().with_dropout(f64::INFINITY),
            ConfigError::Dropout(f64::INFINITY),
        ),
        (
            ok.clone().with_bias_gate(true),
            ConfigError::GateBiasWithoutGating,
        ),
    ];
    for (config, expected) in cases {
        assert_eq!(config.validate(), Err(expected.clone()));
        let device = burn::tensor::Device::flex();
        assert_eq!(config.try_init(&device).err(), Some(expected));
    }
    // NaN is not equal to itself: match instead.
    let nan = ok.clone().with_dropout(f64::NAN).validate();
    assert!(matches!(nan, Err(ConfigError::Dropout(p)) if p.is_nan()));
    // The boundary cases are valid.
    assert_eq!(ok.clone().with_dropout(0.0).validate(), Ok(()));
    assert_eq!(ok.with_dropout(0.999).validate(), Ok(()));
}

#[test]
#[should_panic(expected = "invalid FeedForwardConfig: `d_ff` must be at least 1, got 0")]
fn init_panics_with_the_validation_message() {
    FeedForwardConfig::new(4, 0).init(&burn::tensor::Device::flex());
}

#[test]
fn parsing_errors_are_typed_and_clear() {
    let unknown = FeedForwardConfig::from_toml("d_model = 4\nd_ff = 8\nactivation = \"gleu\"");
    let Err(ConfigError::UnknownActivation { name, known }) = unknown else {
        panic!("{unknown:?}")
    };
    assert_eq!(name, "gleu");
    for expected in [
        "relu",
        "gelu",
        "gelu_tanh",
        "silu",
        "sigmoid",
        "identity",
        "relu2",
        "tanh",
    ] {
        assert!(known.split(", ").any(|k| k == expected), "{known}");
    }
    let json = FeedForwardConfig::from_json(r#"{"d_model": 4, "d_ff": 8, "activation": "foo"}"#);
    assert!(
        matches!(json, Err(ConfigError::UnknownActivation { .. })),
        "{json:?}"
    );

    // Misspelt key.
    let err = FeedForwardConfig::from_toml("d_model = 4\nd_ff = 8\ndropuot = 0.1").unwrap_err();
    assert!(
        matches!(&err, ConfigError::Parse { format: "TOML", message } if message.contains("dropuot")),
        "{err}"
    );
    // Missing required field.
    let err = FeedForwardConfig::from_json(r#"{"d_model": 4}"#).unwrap_err();
    assert!(err.to_string().contains("d_ff"), "{err}");
    // Wrong type.
    let err = FeedForwardConfig::from_toml("d_model = \"big\"\nd_ff = 8").unwrap_err();
    assert!(matches!(err, ConfigError::Parse { .. }), "{err}");
    // Syntax.
    let err = FeedForwardConfig::from_json("{d_model: 4").unwrap_err();
    assert!(
        matches!(err, ConfigError::Parse { format: "JSON", .. }),
        "{err}"
    );
    // Values are validated on parsing.
    let err = FeedForwardConfig::from_toml("d_model = 4\nd_ff = 8\ndropout = 1.5").unwrap_err();
    assert_eq!(err, ConfigError::Dropout(1.5));
    let err = FeedForwardConfig::from_toml("d_model = 4\nd_ff = 8\nbias_gate = true").unwrap_err();
    assert_eq!(err, ConfigError::GateBiasWithoutGating);
    assert_eq!(
        err.to_string(),
        "`bias_gate = true` needs `gated = true`: an ungated network has no gate projection"
    );
    // Unknown dropout position.
    let err = FeedForwardConfig::from_toml("d_model = 4\nd_ff = 8\ndropout_at = \"input\"");
    assert!(err.unwrap_err().to_string().contains("hidden"));
    // Precision: f32 by default, "bf16" (or "bfloat16"); anything else names the choices.
    let parse = |p: &str| FeedForwardConfig::from_toml(&format!("d_model = 4\nd_ff = 8\n{p}"));
    assert_eq!(parse("").unwrap().precision, Precision::F32);
    assert_eq!(
        parse("precision = \"bf16\"").unwrap().precision,
        Precision::Bf16
    );
    assert_eq!(
        parse("precision = \"bfloat16\"").unwrap().precision,
        Precision::Bf16
    );
    let err = parse("precision = \"fp8\"").unwrap_err();
    assert!(
        matches!(&err, ConfigError::Parse { message, .. }
            if message.contains("fp8") && message.contains("bf16") && message.contains("f32")),
        "{err}"
    );
}

#[test]
fn hugging_face_activation_names() {
    let expected = [
        ("relu", Activation::Relu),
        ("gelu", Activation::Gelu),
        ("gelu_python", Activation::Gelu),
        ("gelu_new", Activation::GeluTanh),
        ("gelu_fast", Activation::GeluTanh),
        ("gelu_pytorch_tanh", Activation::GeluTanh),
        ("gelu_tanh", Activation::GeluTanh),
        ("silu", Activation::Silu),
        ("swish", Activation::Silu),
        ("sigmoid", Activation::Sigmoid),
        ("linear", Activation::Identity),
        ("identity", Activation::Identity),
        ("relu2", Activation::Relu2),
        ("squared_relu", Activation::Relu2),
        ("tanh", Activation::Tanh),
        ("GELU-New", Activation::GeluTanh),
    ];
    for (name, activation) in expected {
        assert_eq!(name.parse::<Activation>(), Ok(activation), "{name}");
        let json = format!(r#"{{"d_model": 2, "d_ff": 2, "activation": "{name}"}}"#);
        assert_eq!(
            FeedForwardConfig::from_json(&json).unwrap().activation,
            activation
        );
    }
    // Canonical names are written back.
    let config = FeedForwardConfig::new(2, 2).with_activation("gelu_new".parse().unwrap());
    assert!(config.to_toml().contains("activation = \"gelu_tanh\""));
    for activation in Activation::ALL {
        assert_eq!(activation.name().parse::<Activation>(), Ok(activation));
        assert_eq!(activation.to_string(), activation.name());
    }
    // quick_gelu is a function of its own (CLIP's), not mapped to either GELU; a name no
    // activation has is refused.
    assert_eq!(
        "quick_gelu".parse::<Activation>(),
        Ok(Activation::QuickGelu)
    );
    assert!("quickgelu".parse::<Activation>().is_err());
}

#[test]
fn presets_match_shazeer_at_parameter_parity() {
    let expected = [
        (Variant::FfnRelu, Activation::Relu, false),
        (Variant::FfnGelu, Activation::Gelu, false),
        (Variant::FfnSwish, Activation::Silu, false),
        (Variant::Glu, Activation::Sigmoid, true),
        (Variant::Bilinear, Activation::Identity, true),
        (Variant::ReGlu, Activation::Relu, true),
        (Variant::GeGlu, Activation::Gelu, true),
        (Variant::SwiGlu, Activation::Silu, true),
    ];
    assert_eq!(Variant::ALL.to_vec(), expected.map(|e| e.0).to_vec());
    for d_model in [64, 512, 768, 1000, 4096] {
        let baseline = FeedForwardConfig::preset(Variant::FfnRelu, d_model).num_params() as f64;
        for (variant, activation, gated) in expected {
            let config = FeedForwardConfig::preset(variant, d_model);
            assert_eq!(
                (config.activation, config.gated),
                (activation, gated),
                "{variant}"
            );
            assert!(!config.bias_up && !config.bias_gate && !config.bias_down);
            assert_eq!(config.dropout, 0.0);
            assert_eq!(config.validate(), Ok(()));
            let ratio = config.num_params() as f64 / baseline;
            assert!(
                (ratio - 1.0).abs() < 0.01,
                "{variant} d_model {d_model}: {ratio}"
            );
            let d_ff = if gated {
                (8.0 * d_model as f64 / 3.0).round() as usize
            } else {
                4 * d_model
            };
            assert_eq!(config.d_ff, d_ff);
        }
    }
    // The paper's d_model = 768: 3072 and 2048; the issue's 512: 2048 and 1365.
    assert_eq!(FeedForwardConfig::preset(Variant::GeGlu, 768).d_ff, 2048);
    assert_eq!(FeedForwardConfig::preset(Variant::SwiGlu, 512).d_ff, 1365);
    assert_eq!(FeedForwardConfig::preset(Variant::FfnGelu, 512).d_ff, 2048);
}

#[test]
fn presets_round_up_to_a_multiple() {
    // LLaMA-7B: d_model 4096, multiple_of 256 → 11008.
    let llama = FeedForwardConfig::preset_multiple_of(Variant::SwiGlu, 4096, 256).unwrap();
    assert_eq!(llama.d_ff, 11008);
    let c = FeedForwardConfig::preset_multiple_of(Variant::SwiGlu, 512, 64).unwrap();
    assert_eq!(c.d_ff, 1408);
    let c = FeedForwardConfig::preset_multiple_of(Variant::FfnRelu, 512, 64).unwrap();
    assert_eq!(c.d_ff, 2048);
    assert_eq!(
        FeedForwardConfig::preset_multiple_of(Variant::SwiGlu, 512, 0),
        Err(ConfigError::ZeroSize {
            field: "multiple_of"
        })
    );
}

#[test]
fn variant_names() {
    for variant in Variant::ALL {
        assert_eq!(variant.name().parse::<Variant>(), Ok(variant));
    }
    assert_eq!("swiglu".parse::<Variant>(), Ok(Variant::SwiGlu));
    assert_eq!("ffn-relu".parse::<Variant>(), Ok(Variant::FfnRelu));
    assert_eq!("GEGLU".parse::<Variant>(), Ok(Variant::GeGlu));
    let Err(ConfigError::UnknownPreset { known, .. }) = "swigloo".parse::<Variant>() else {
        panic!()
    };
    assert!(known.contains("FFN_SwiGLU"));
}

#[test]
fn seed_faithful_configs() {
    let bert = FeedForwardConfig::bert(768);
    assert_eq!(
        (bert.d_ff, bert.activation, bert.gated),
        (3072, Activation::Gelu, false)
    );
    assert!(bert.bias_up && bert.bias_down);
    assert_eq!((bert.dropout, bert.dropout_at), (0.1, DropoutAt::Output));
    assert_eq!(bert.num_params(), 768 * 3072 * 2 + 3072 + 768);

    let vaswani = FeedForwardConfig::vaswani(512);
    assert_eq!((vaswani.d_ff, vaswani.activation), (2048, Activation::Relu));
    assert!(vaswani.bias_up && vaswani.bias_down && !vaswani.gated);
    assert_eq!(vaswani.num_params(), 2_099_712); // 512·2048·2 + 2048 + 512

    let labml = FeedForwardConfig::labml(512, 2048);
    assert_eq!(
        (labml.activation, labml.dropout_at, labml.dropout),
        (Activation::Relu, DropoutAt::Hidden, 0.1)
    );
    assert!(labml.bias_up && labml.bias_down && !labml.bias_gate);
}

#[test]
fn flops_per_token() {
    assert_eq!(
        FeedForwardConfig::new(512, 2048).flops_per_token(),
        4 * 512 * 2048
    );
    let gated = FeedForwardConfig::new(512, 1365).with_gated(true);
    assert_eq!(gated.flops_per_token(), 6 * 512 * 1365);
}
