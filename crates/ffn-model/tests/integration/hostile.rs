//! Hostile weight files and model folders: each defect found by hand has a test, and seeded
//! property tests mutate valid files (bit flips, truncations, edited header fields, huge
//! numbers) and assert that every case ends in a typed error or a success, never a panic.
//!
//! `FFN_FUZZ_CASES=N` sets the cases per property (default 2500, CI's count); each property
//! also stops after `FFN_FUZZ_SECONDS` (default 60).

use std::path::Path;

use ffn_model::interop::inspect;
use ffn_model::{Error, FeedForward, FeedForwardConfig, HfModel};
use ffn_test_support::{Rng, Scratch, data_file, device, property, scratch};

/// A safetensors file from a header (as JSON text) and a data section.
fn file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    bytes
}

fn corrupt_reason(bytes: &[u8]) -> String {
    match inspect::from_bytes(bytes) {
        Err(Error::Corrupt { reason, .. }) => reason,
        Err(other) => panic!("expected Corrupt, got {other}"),
        Ok(_) => panic!("accepted"),
    }
}

#[test]
fn headers_are_validated_like_the_safetensors_crate() {
    // A shape whose product wraps in 64 bits, with empty offsets.
    let wraps = r#"{"w":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}}"#;
    assert!(corrupt_reason(&file(wraps, &[])).contains("claims bytes"));
    // Overlapping tensors.
    let overlap = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    assert!(corrupt_reason(&file(overlap, &[0; 12])).contains("without gaps or overlaps"));
    // The same key twice.
    let twice = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    assert!(corrupt_reason(&file(twice, &[0; 8])).contains("twice"));
    // A gap, and bytes no tensor covers.
    let gap = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    assert!(corrupt_reason(&file(gap, &[0; 8])).contains("starts at byte 4"));
    let tail = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    assert!(corrupt_reason(&file(tail, &[0; 8])).contains("cover 4 bytes"));
    // A valid file still opens, and zero-sized tensors may share an offset.
    let ok = r#"{"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]},"c":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    assert_eq!(
        inspect::from_bytes(&file(ok, &[0; 4]))
            .unwrap()
            .tensors
            .len(),
        3
    );
}

/// A temporary model folder with `config.json` and the given files.
fn model_folder(tag: &str, config: &str, files: &[(&str, &[u8])]) -> Scratch {
    let dir = scratch(&format!("hostile-{tag}"));
    std::fs::write(dir.join("config.json"), config).unwrap();
    for (name, bytes) in files {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    dir
}

const LLAMA: &str = r#"{"model_type":"llama","hidden_size":4,"intermediate_size":8,"num_hidden_layers":1,"hidden_act":"silu"}"#;

#[test]
fn shard_names_cannot_leave_the_model_folder() {
    let elsewhere = scratch("hostile-outside");
    let outside = elsewhere.join("secret");
    std::fs::write(&outside, b"secret").unwrap();
    let names = [
        "../../../../etc/passwd".to_string(),
        "/etc/passwd".to_string(),
        outside.display().to_string(),
        "..".to_string(),
        "sub/model.safetensors".to_string(),
        "".to_string(),
        ".".to_string(),
    ];
    for name in names {
        let index =
            serde_json::json!({ "weight_map": { "model.layers.0.mlp.up_proj.weight": name } });
        let dir = model_folder(
            "traversal",
            LLAMA,
            &[("model.safetensors.index.json", index.to_string().as_bytes())],
        );
        let err = HfModel::open(&dir).err().expect("refused");
        assert!(
            err.to_string().contains("not a plain file name"),
            "{name}: {err}"
        );
        assert!(!err.to_string().contains("bytes"), "{name}: {err}");
    }
}

#[test]
fn hf_sizes_are_bounded() {
    for (field, value) in [
        ("intermediate_size", u64::MAX.to_string()),
        ("intermediate_size", "0".to_string()),
        ("num_hidden_layers", "0".to_string()),
        ("hidden_size", "4611686018427387904".to_string()),
        ("num_hidden_layers", "1e300".to_string()),
    ] {
        let config = LLAMA.replace(
            &format!(
                "\"{field}\":{}",
                if field == "num_hidden_layers" {
                    "1"
                } else if field == "hidden_size" {
                    "4"
                } else {
                    "8"
                }
            ),
            &format!("\"{field}\":{value}"),
        );
        let dir = model_folder("sizes", &config, &[("model.safetensors", &file("{}", &[]))]);
        let model = HfModel::open(&dir).unwrap();
        let err = if field == "num_hidden_layers" {
            model.num_layers().err()
        } else {
            model.ffn_config().err()
        };
        let err = err
            .unwrap_or_else(|| panic!("{field} = {value} accepted"))
            .to_string();
        assert!(err.contains(field), "{err}");
    }
}

#[test]
fn only_loadable_ffns_are_reported() {
    let f32s = |n: usize| vec![0u8; 4 * n];
    let ffn = |key: &str, dtype: &str, shape: &str, bytes: usize| {
        format!(r#""{key}":{{"dtype":"{dtype}","shape":{shape},"data_offsets":[0,{bytes}]}}"#)
    };
    // d_ff 0 (an empty up projection).
    let header = format!("{{{}}}", ffn("mlp.up_proj.weight", "F32", "[0,4]", 0));
    assert!(
        inspect::from_bytes(&file(&header, &[]))
            .unwrap()
            .ffns
            .is_empty()
    );
    // An odd number of rows in a packed [W_gate; W_up].
    let header = format!("{{{}}}", ffn("ffn.w12.weight", "F32", "[3,2]", 24));
    assert!(
        inspect::from_bytes(&file(&header, &f32s(6)))
            .unwrap()
            .ffns
            .is_empty()
    );
    // Integer weights.
    let header = format!("{{{}}}", ffn("mlp.fc1.weight", "I32", "[8,4]", 128));
    assert!(
        inspect::from_bytes(&file(&header, &f32s(32)))
            .unwrap()
            .ffns
            .is_empty()
    );
}

#[test]
fn printable_escapes_and_clips() {
    assert_eq!(
        ffn_model::printable("a\u{1b}[2Jb\n", 100),
        "a\\u{1b}[2Jb\\n"
    );
    let long = "y".repeat(5000);
    let shown = ffn_model::printable(&long, 10);
    assert_eq!(shown, format!("{}… (4990 more characters)", "y".repeat(10)));
}

/// A valid weight file to mutate: a small gated FFN with biases.
fn valid_weights() -> (FeedForward, Vec<u8>) {
    let config = FeedForwardConfig::new(4, 6)
        .with_gated(true)
        .with_bias_up(true)
        .with_bias_gate(true)
        .with_bias_down(true);
    let ffn = config.init(&device());
    let bytes = ffn.to_safetensors_bytes();
    (ffn, bytes)
}

/// One mutation of `bytes`: bit flips, a truncation, an edited header field, a huge number.
fn mutate(rng: &mut Rng, bytes: &[u8]) -> Vec<u8> {
    let mut out = bytes.to_vec();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    match rng.below(6) {
        0 => {
            for _ in 0..1 + rng.below(8) {
                let i = rng.below(out.len());
                out[i] ^= 1 << rng.below(8);
            }
        }
        1 => out.truncate(rng.below(out.len())),
        2 => {
            // Overwrite a digit run of the header with a huge or odd number.
            let header = &out[8..8 + header_len];
            let digits: Vec<usize> = (0..header.len())
                .filter(|&i| header[i].is_ascii_digit())
                .collect();
            if let Some(&at) = digits.get(rng.below(digits.len())) {
                let numbers = [
                    "18446744073709551615",
                    "4294967296",
                    "0",
                    "-1",
                    "1e400",
                    "9999999999999999999999",
                    "3.5",
                ];
                let number = numbers[rng.below(numbers.len())].as_bytes();
                let start = 8 + at;
                let mut end = start;
                while end < 8 + header_len && out[end].is_ascii_digit() {
                    end += 1;
                }
                out.splice(start..end, number.iter().copied());
                let new_len = (header_len + number.len()) as u64 - (end - start) as u64;
                out[..8].copy_from_slice(&new_len.to_le_bytes());
            }
        }
        3 => {
            // Replace a dtype, key or field name.
            let text = String::from_utf8_lossy(&out[8..8 + header_len]).into_owned();
            let swaps = [
                ("F32", "I32"),
                ("F32", "BF16"),
                ("F32", "XX"),
                ("shape", "shap"),
                ("data_offsets", "offsets"),
                ("up", "down"),
                ("gate", "up"),
                ("\"weight", "\"weight\\u0000"),
            ];
            let (from, to) = swaps[rng.below(swaps.len())];
            let text = text.replacen(from, to, 1 + rng.below(3));
            let mut rebuilt = (text.len() as u64).to_le_bytes().to_vec();
            rebuilt.extend_from_slice(text.as_bytes());
            rebuilt.extend_from_slice(&out[8 + header_len..]);
            out = rebuilt;
        }
        4 => {
            // A huge or inconsistent header length.
            let lens = [
                u64::MAX,
                1 << 40,
                0,
                1,
                header_len as u64 + 1,
                header_len as u64 - 1,
            ];
            out[..8].copy_from_slice(&lens[rng.below(lens.len())].to_le_bytes());
        }
        _ => {
            // Random bytes appended or spliced into the data.
            let at = 8 + header_len + rng.below(out.len() - 8 - header_len + 1);
            let extra: Vec<u8> = (0..1 + rng.below(16))
                .map(|_| rng.next_u64() as u8)
                .collect();
            out.splice(at..at, extra);
        }
    }
    out
}

#[test]
fn mutated_weight_files_never_panic() {
    let (ffn, bytes) = valid_weights();
    let mut accepted = 0;
    property("safetensors mutations", 0x5AFE, 2500, |rng| {
        let mutated = mutate(rng, &bytes);
        let _ = inspect::from_bytes(&mutated);
        if ffn.clone().load_safetensors_bytes(&mutated).is_ok() {
            accepted += 1;
        }
    });
    // Mutations of the data bytes only are still valid files: some must load.
    assert!(accepted > 0);
}

#[test]
fn mutated_model_folders_never_panic() {
    let base = data_file("hf/llama");
    let config = std::fs::read_to_string(base.join("config.json")).unwrap();
    let weights = std::fs::read(base.join("model.safetensors")).unwrap();
    let dir = model_folder("fuzz-folder", &config, &[]);
    let device = device();
    property("model folder mutations", 0xF01D, 2500, |rng| {
        let config_bytes = mutate_json(rng, &config);
        std::fs::write(dir.join("config.json"), config_bytes).unwrap();
        let _ = std::fs::remove_file(dir.join("model.safetensors.index.json"));
        if rng.below(3) == 0 {
            let index = mutate_json(
                rng,
                r#"{"metadata":{"total_size":64},"weight_map":{"model.layers.0.mlp.up_proj.weight":"model.safetensors","model.layers.0.mlp.gate_proj.weight":"model.safetensors"}}"#,
            );
            std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
        }
        let weights = if rng.below(2) == 0 {
            mutate(rng, &weights)
        } else {
            weights.clone()
        };
        std::fs::write(dir.join("model.safetensors"), weights).unwrap();
        if let Ok(mut model) = HfModel::open(&dir) {
            let _ = model.ffn_config();
            if let Ok(layers) = model.num_layers() {
                let _ = model.load_layer(rng.below(layers.min(4) + 1), &device);
            }
        }
    });
}

/// MoE checkpoints (Mixtral, Qwen2-MoE, DeepSeek-V3) with mutated `config.json` and weight
/// bytes: reading the config, loading a sparse layer, running and saving it never panic.
#[test]
fn mutated_moe_folders_never_panic() {
    let bases: Vec<(&str, String, Vec<u8>)> = ["mixtral", "qwen2_moe", "deepseek_v3"]
        .iter()
        .map(|name| {
            let base = data_file(&format!("hf/{name}"));
            (
                *name,
                std::fs::read_to_string(base.join("config.json")).unwrap(),
                std::fs::read(base.join("model.safetensors")).unwrap(),
            )
        })
        .collect();
    let dir = model_folder("fuzz-moe", &bases[0].1, &[]);
    let device = device();
    let mut loaded = 0;
    property("MoE folder mutations", 0x30E5, 900, |rng| {
        let (name, config, weights) = &bases[rng.below(bases.len())];
        let config = if rng.below(3) == 0 {
            config.as_bytes().to_vec()
        } else {
            mutate_json(rng, config)
        };
        std::fs::write(dir.join("config.json"), config).unwrap();
        let weights = if rng.below(2) == 0 {
            mutate(rng, weights)
        } else {
            weights.clone()
        };
        std::fs::write(dir.join("model.safetensors"), weights).unwrap();
        if let Ok(mut model) = HfModel::open(&dir) {
            let _ = model.moe_config();
            let layer = rng.below(3);
            let _ = model.moe_layer_prefix(layer);
            if let Ok(moe) = model.load_moe_layer(layer, &device) {
                loaded += 1;
                let x = burn::tensor::Tensor::<2>::ones([3, moe.d_model()], &device);
                let _ = moe.forward(x);
                let scheme: ffn_model::MoeScheme = name.parse().unwrap();
                let _ = moe.to_safetensors_bytes_as(scheme, "p.");
            }
        }
    });
    assert!(loaded > 0, "some mutations still load");
}

/// One mutation of a JSON text: a value replaced by a hostile one, or bytes flipped.
fn mutate_json(rng: &mut Rng, text: &str) -> Vec<u8> {
    let values = [
        "0",
        "-1",
        "18446744073709551615",
        "1e308",
        "null",
        "true",
        "\"\"",
        "[]",
        "{}",
        "\"../x\"",
        "\"\\u0000\"",
        "4294967296",
        "1.5",
        "\"gelu\"",
        "\"swish\"",
        "\"nope\"",
    ];
    let mut value: serde_json::Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(_) => return text.as_bytes().to_vec(),
    };
    if rng.below(5) == 0 {
        let mut bytes = text.as_bytes().to_vec();
        for _ in 0..1 + rng.below(4) {
            let i = rng.below(bytes.len());
            bytes[i] ^= 1 << rng.below(8);
        }
        return bytes;
    }
    for _ in 0..1 + rng.below(3) {
        let replacement: serde_json::Value =
            serde_json::from_str(values[rng.below(values.len())]).unwrap();
        replace_random(rng, &mut value, replacement);
    }
    value.to_string().into_bytes()
}

fn replace_random(rng: &mut Rng, value: &mut serde_json::Value, replacement: serde_json::Value) {
    match value {
        serde_json::Value::Object(map) if !map.is_empty() => {
            let key = map.keys().nth(rng.below(map.len())).unwrap().clone();
            let child = map.get_mut(&key).unwrap();
            if child.is_object() && rng.below(2) == 0 {
                replace_random(rng, child, replacement);
            } else {
                *child = replacement;
            }
        }
        other => *other = replacement,
    }
}

#[test]
fn non_regular_files_are_refused() {
    let err = inspect::open(Path::new("/dev/zero")).err().unwrap();
    assert!(err.to_string().contains("not a regular file"), "{err}");
    let dir = model_folder("dev-zero", LLAMA, &[]);
    std::fs::remove_file(dir.join("config.json")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.join("config.json")).unwrap();
    let err = HfModel::open(&dir).err().unwrap();
    assert!(err.to_string().contains("not a regular file"), "{err}");
}
