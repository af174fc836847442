//! Every config shipped in `configs/` parses, validates and means what its name says.

use std::path::Path;

use ffn::train::config::{ModelConfig, TaskConfig};
use ffn::train::{DEFAULT_CONFIG, TrainConfig};
use ffn::{Activation, Variant};

fn configs() -> Vec<std::path::PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut files: Vec<_> = ["", "variants"]
        .iter()
        .flat_map(|sub| std::fs::read_dir(root.join(sub)).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    files
}

/// Each loads, and (without a mixture of experts) loads in bf16 too.
#[test]
fn every_shipped_config_is_valid() {
    let files = configs();
    assert_eq!(files.len(), 7 + 8, "{files:?}");
    for file in &files {
        let config = TrainConfig::load(file, &[]).unwrap_or_else(|e| panic!("{e}"));
        config.ffn().unwrap();
        if config.moe().unwrap().is_none() {
            let bf16 = TrainConfig::load(file, &["train.precision=bf16".into()])
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            assert_eq!(bf16.ffn().unwrap().precision, ffn::model::Precision::Bf16);
        }
    }
}

/// `configs/gpt.toml` is a small GPT at nanoGPT's scale, where the products dominate: d_model
/// 256, 4 layers, a SwiGLU FFN at parameter parity, 128 tokens of context, on a Markov source
/// (a known optimum), in f32 unless told otherwise.
#[test]
fn the_gpt_config_is_a_small_gpt_on_the_markov_source() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let gpt = TrainConfig::load(&root.join("configs/gpt.toml"), &[]).unwrap();
    let TaskConfig::Markov(task) = &gpt.task else {
        panic!("a Markov task")
    };
    assert_eq!(task.seq_len, 128);
    let ModelConfig::Transformer(model) = &gpt.model else {
        panic!("a transformer")
    };
    assert!(model.d_model >= 256 && model.n_layers >= 4, "{model:?}");
    let ffn = gpt.ffn().unwrap();
    assert_eq!(
        (ffn.activation, ffn.gated, ffn.d_ff),
        (Activation::Silu, true, 683)
    );
    assert_eq!(ffn.precision, ffn::model::Precision::F32);
}

/// `configs/moe.toml` is the default run with each FFN replaced by 8 experts of half its
/// width, 2 per token: the same active FFN parameters per token (±1 hidden unit), 4× in all.
#[test]
fn the_moe_config_is_the_default_run_with_a_mixture_of_experts() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let moe = TrainConfig::load(&root.join("configs/moe.toml"), &[]).unwrap();
    let dense = TrainConfig::load(&root.join("configs/default.toml"), &[]).unwrap();
    assert_eq!(moe.task, dense.task);
    assert_eq!(moe.train, dense.train);
    assert_eq!(moe.seed, dense.seed);
    let (experts, ffn) = (moe.moe().unwrap().unwrap(), dense.ffn().unwrap());
    assert_eq!((experts.n_experts, experts.top_k), (8, 2));
    assert_eq!(experts.expert.activation, ffn.activation);
    assert!(experts.expert.gated);
    assert!((experts.top_k * experts.expert.d_ff).abs_diff(ffn.d_ff) <= 1);
    assert!(dense.moe().unwrap().is_none());
}

#[test]
fn the_default_config_is_the_built_in_one_swiglu_on_the_markov_source() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let file = TrainConfig::load(&root.join("configs/default.toml"), &[]).unwrap();
    assert_eq!(file, TrainConfig::from_toml(DEFAULT_CONFIG, &[]).unwrap());
    assert!(matches!(file.task, TaskConfig::Markov(_)));
    assert!(matches!(file.model, ModelConfig::Transformer(_)));
    let ffn = file.ffn().unwrap();
    assert_eq!(
        (ffn.activation, ffn.gated, ffn.d_ff),
        (Activation::Silu, true, 171)
    );
}

#[test]
fn each_variant_config_trains_its_variant_and_differs_only_there() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let default = TrainConfig::from_toml(DEFAULT_CONFIG, &[]).unwrap();
    for variant in Variant::ALL {
        let file = root.join(format!(
            "configs/variants/{}.toml",
            variant.name().to_lowercase()
        ));
        let config = TrainConfig::load(&file, &[]).unwrap();
        let ffn = config.ffn().unwrap();
        assert_eq!(
            ffn,
            ffn::FeedForwardConfig::preset(variant, 64),
            "{}",
            file.display()
        );
        let as_default = TrainConfig::load(&file, &["model.ffn.preset=SwiGLU".into()]).unwrap();
        assert_eq!(
            as_default,
            default,
            "{} differs from the default elsewhere",
            file.display()
        );
    }
}

/// The shipped sweeps plan: every cell's config resolves and validates, at parameter parity,
/// and the presets are the grids their files and docs/training.md describe.
#[test]
fn every_shipped_sweep_plans_the_grid_it_describes() {
    use ffn::train::sweep::{Sweep, SweepVariant};
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/sweeps");
    let quick = Sweep::load(&root.join("quick.toml"), None).unwrap();
    assert_eq!(quick.config.variants.len(), 8);
    assert_eq!(quick.config.seeds.len(), 3);
    assert_eq!(quick.cells.len(), 2 * 8 * 3);
    assert_eq!(quick.folder, Path::new("runs/quick"));
    let full = Sweep::load(&root.join("full.toml"), None).unwrap();
    assert_eq!(
        full.config.variants,
        Variant::ALL.map(SweepVariant::Preset).to_vec()
    );
    assert!(full.config.seeds.len() >= 5);
    // Two language tasks × 4 LRs and two teacher tasks × 3 LRs, 8 variants, 5 seeds.
    assert_eq!(full.cells.len(), (2 * 4 + 2 * 3) * 8 * 5);
    for cell in quick.cells.iter().chain(&full.cells) {
        assert_eq!(cell.config.seed, cell.seed);
        assert_eq!(cell.config.train.lr, cell.lr);
        let SweepVariant::Preset(variant) = &cell.variant else {
            panic!("{} is not a preset", cell.variant.name());
        };
        assert_eq!(
            cell.config.ffn().unwrap().d_ff,
            ffn::FeedForwardConfig::preset(*variant, cell.config.ffn().unwrap().d_model).d_ff
        );
    }
    // The mixture-of-experts study: the dense baseline, a mixture at its active parameters, a
    // dense FFN at the mixture's total and a mixture at the baseline's total, each within 3 %.
    let moe = Sweep::load(&root.join("moe.toml"), None).unwrap();
    assert_eq!(moe.cells.len(), 4 * 5 * 3);
    let params = |name: &str| {
        let cell = moe.cells.iter().find(|c| c.variant.name() == name).unwrap();
        assert_eq!(cell.config.train.steps, 1200, "the default run's length");
        cell.config.ffn_params().unwrap()
    };
    let near = |a: usize, b: usize| (a as f64 / b as f64 - 1.0).abs() < 0.03;
    let (dense, _) = params("FFN_SwiGLU");
    let (moe_total, moe_active) = params("MoE-8x86");
    assert!(moe_total > 3 * moe_active);
    assert!(near(moe_active, dense), "{moe_active} vs {dense}");
    assert!(near(params("SwiGLU-688").0, moe_total));
    let (small_total, small_active) = params("MoE-8x21");
    assert!(near(small_total, dense) && small_active < dense / 3);
}
