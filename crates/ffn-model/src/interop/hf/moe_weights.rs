//! # A sparse block's tensors, in and out
//!
//! [`HfModel::load_moe_layer`] reads one sparse layer of a checkpoint (router, experts per
//! expert, packed or as rows, shared experts) into a [`Moe`], and
//! [`Moe::to_safetensors_bytes_as`] writes one back in a [`MoeScheme`]'s names and layout. Which
//! layers are sparse, and their config, are `moe.rs`'s.

use std::path::Path;

use burn::tensor::{Device, Tensor, TensorData};

use super::moe::{MoeScheme, PACKED, SELECTION_BIAS, SHARED, bias_key};
use crate::interop::host::{HostTensor, to_host, to_pytorch, transpose};
use crate::interop::safetensors::{TensorFiles, serialize};
use crate::interop::weights::load_param;
use crate::{Activation, Error, HfModel, Moe, Scheme};

impl HfModel {
    /// Builds the layer of [`moe_config`](Self::moe_config) on `device` and loads the router,
    /// experts and shared experts of layer `layer` into it. Every expert `0..n_experts` must be
    /// there with the config's shapes, and nothing else under the block's prefix.
    pub fn load_moe_layer(&mut self, layer: usize, device: &Device) -> Result<Moe, Error> {
        let config = self.moe_config()?;
        let prefix = self.moe_layer_prefix(layer)?;
        // Every tensor is read (and its shape checked against config.json) before the layer
        // is built: a config whose sizes disagree with the file allocates nothing.
        let (e_count, d, f) = (config.n_experts, config.d_model(), config.expert.d_ff);
        let router_key = self.router_key(&prefix);
        let names_of = self.expert_names(&prefix);
        let mut reader = Reader {
            files: &mut self.files,
            used: Vec::new(),
        };

        let router = reader.take(&router_key, &[e_count, d])?;
        let router_bias = if config.router_bias {
            Some(reader.take(&bias_key(&router_key), &[e_count])?)
        } else {
            None
        };
        let bias = if config.selection_bias {
            let key = SELECTION_BIAS
                .iter()
                .map(|key| format!("{prefix}{key}"))
                .find(|key| reader.files.info(key).is_some())
                .expect("moe_config found it");
            // ERNIE 4.5 keeps it as `[1, E]`.
            let row = reader.files.info(&key).map(|i| i.shape.as_slice()) == Some(&[1, e_count]);
            let shape: &[usize] = if row { &[1, e_count] } else { &[e_count] };
            let bias = reader.take(&key, shape)?;
            Some(TensorData::new(values(&bias), [e_count]))
        } else {
            None
        };
        let expert = &config.expert;
        let interleaved = expert.activation == Activation::SwigluOai;
        let packed = PACKED
            .iter()
            .map(|(gate_up, down)| (format!("{prefix}{gate_up}"), format!("{prefix}{down}")))
            .find(|(gate_up, _)| reader.files.info(gate_up).is_some());
        // [gate, up, down] stacked in burn's layout: [E, d, f], [E, d, f], [E, f, d]; and the
        // biases [E, f], [E, f], [E, d].
        let mut stacked = [Vec::new(), Vec::new(), Vec::new()];
        let mut biases: [Option<Vec<f64>>; 3] = Default::default();
        let dbrx = ["w1", "v1", "w2"].map(|n| format!("{prefix}experts.mlp.{n}"));
        if reader.files.info(&dbrx[0]).is_some() {
            // DBRX: each [E·f, d], expert e's rows e·f..(e + 1)·f; gate (w1) and up (v1) in
            // Linear's layout, down (w2) as the product takes it ([f, d], burn's layout).
            for (i, key) in dbrx.iter().enumerate() {
                let rows = values(&reader.take(key, &[e_count * f, d])?);
                for e in 0..e_count {
                    let block = TensorData::new(rows[e * f * d..(e + 1) * f * d].to_vec(), [f, d]);
                    if i == 2 {
                        stacked[i].extend(values(&block));
                    } else {
                        stacked[i].extend(values(&transpose(&block, f, d)));
                    }
                }
            }
        } else if let Some((packed, down)) = packed {
            // PyTorch's Linear layout, or both transposed (gpt-oss, Llama 4): the last two
            // dimensions of `gate_up` tell which, or where d = 2f those of `down` (d = f and
            // d = 2f cannot both hold). The full shapes are checked as the tensors are read.
            let ends_with = |key: &str, tail: [usize; 2]| {
                reader
                    .files
                    .info(key)
                    .is_some_and(|i| i.shape.len() == 3 && i.shape[1..] == tail)
            };
            let transposed = if d != 2 * f {
                ends_with(&packed, [d, 2 * f])
            } else {
                ends_with(&down, [f, d])
            };
            let (gate_up_shape, down_shape) = if transposed {
                ([e_count, d, 2 * f], [e_count, f, d])
            } else {
                ([e_count, 2 * f, d], [e_count, d, f])
            };
            let gate_up = values(&reader.take(&packed, &gate_up_shape)?);
            let down_values = values(&reader.take(&down, &down_shape)?);
            // Where unit c of the gate (half 0) or of up (half 1) lies along the packed axis:
            // interleaved (gpt-oss: gate, up, gate, up, …) or in halves.
            let at = |half: usize, c: usize| {
                if interleaved {
                    2 * c + half
                } else {
                    half * f + c
                }
            };
            for e in 0..e_count {
                for (half, out) in stacked.iter_mut().take(2).enumerate() {
                    for i in 0..d {
                        out.extend((0..f).map(|c| {
                            let j = at(half, c);
                            if transposed {
                                gate_up[(e * d + i) * 2 * f + j]
                            } else {
                                gate_up[(e * 2 * f + j) * d + i]
                            }
                        }));
                    }
                }
                for c in 0..f {
                    stacked[2].extend((0..d).map(|i| {
                        if transposed {
                            down_values[(e * f + c) * d + i]
                        } else {
                            down_values[(e * d + i) * f + c]
                        }
                    }));
                }
            }
            if expert.bias_gate {
                let b = values(&reader.take(&format!("{packed}_bias"), &[e_count, 2 * f])?);
                for (half, out) in biases.iter_mut().take(2).enumerate() {
                    let units = (0..e_count).flat_map(|e| (0..f).map(move |c| (e, c)));
                    *out = Some(units.map(|(e, c)| b[e * 2 * f + at(half, c)]).collect());
                }
            }
            if expert.bias_down {
                biases[2] = Some(values(
                    &reader.take(&format!("{down}_bias"), &[e_count, d])?,
                ));
            }
        } else {
            let layout = [
                (expert.bias_gate, [f, d]),
                (expert.bias_up, [f, d]),
                (expert.bias_down, [d, f]),
            ];
            for e in 0..e_count {
                for (i, (name, (has_bias, shape))) in names_of.iter().zip(layout).enumerate() {
                    let key = format!("{prefix}experts.{e}.{name}");
                    let w = reader.take(&format!("{key}.weight"), &shape)?;
                    stacked[i].extend(values(&transpose(&w, shape[0], shape[1])));
                    if has_bias {
                        let b = reader.take(&format!("{key}.bias"), &shape[..1])?;
                        biases[i].get_or_insert_with(Vec::new).extend(values(&b));
                    }
                }
            }
        }

        // The shared experts' prefix: the first of `SHARED` with keys (`moe_config` found one).
        let shared_prefix = (config.n_shared_experts > 0).then(|| {
            SHARED
                .iter()
                .map(|s| format!("{prefix}{s}"))
                .find(|s| reader.files.keys().any(|k| k.starts_with(s.as_str())))
                .unwrap_or_else(|| format!("{prefix}{}", SHARED[0]))
        });
        let shared_gate = if config.shared_expert_gate {
            Some(reader.take(&format!("{prefix}shared_expert_gate.weight"), &[1, d])?)
        } else {
            None
        };
        let Reader { files, used } = reader;
        // Anything else under the prefix (an extra expert, a bias the layer does not have) is
        // an error, except the shared experts' own keys, which their loader checks.
        let unexpected = files.keys().find(|key| {
            key.starts_with(&prefix)
                && !used.iter().any(|u| u == key)
                && !shared_prefix
                    .as_ref()
                    .is_some_and(|p| key.starts_with(p.as_str()))
        });
        if let Some(key) = unexpected {
            let biased = [
                expert.bias_gate,
                expert.bias_up,
                expert.bias_down,
                config.router_bias,
            ];
            let biases = if biased.iter().any(|b| *b) {
                "the biases config.json and the file's other keys imply"
            } else {
                "no biases"
            };
            return Err(Error::UnexpectedTensor {
                key: key.to_string(),
                hint: format!(" (the layer has {e_count} experts of [{f}, {d}] and {biases})"),
            });
        }
        let mut moe = config.try_init(device)?;
        if let (Some(p), Some(shared)) = (&shared_prefix, moe.shared.take()) {
            moe.shared = Some(shared.load_from(files, Scheme::Llama, p)?);
        }
        let [gate, up, down] = stacked;
        let [b_gate, b_up, b_down] = biases;
        Ok(moe.load_parts(Parts {
            router: transpose(&router, e_count, d),
            router_bias,
            selection_bias: bias,
            w_gate: TensorData::new(gate, [e_count, d, f]),
            w_up: TensorData::new(up, [e_count, d, f]),
            w_down: TensorData::new(down, [e_count, f, d]),
            b_gate: b_gate.map(|b| TensorData::new(b, [e_count, f])),
            b_up: b_up.map(|b| TensorData::new(b, [e_count, f])),
            b_down: b_down.map(|b| TensorData::new(b, [e_count, d])),
            shared_gate: shared_gate.map(|g| transpose(&g, 1, d)),
        }))
    }
}

impl Moe {
    /// The bytes of a safetensors file holding this layer under `prefix` (such as
    /// `model.layers.3.mlp.`) in the names and layout of `scheme`, as `save_pretrained`
    /// writes them: the router (and its bias), the experts per expert or packed (and their
    /// biases), the shared experts and their gate, DeepSeek-V3's `e_score_correction_bias`.
    ///
    /// # Errors
    ///
    /// [`Error::Scheme`] for a layer the scheme cannot hold: ungated experts; biases in the
    /// experts or the router (gpt-oss's only, which needs all four); shared experts where the
    /// scheme has none or of another form; a missing selection bias for DeepSeek-V3.
    pub fn to_safetensors_bytes_as(
        &self,
        scheme: MoeScheme,
        prefix: &str,
    ) -> Result<Vec<u8>, Error> {
        let refuse = |what: &str| {
            Err(Error::Scheme(format!(
                "a `{scheme}` MoE layer cannot hold this layer: {what}"
            )))
        };
        let Some(w_gate) = &self.w_gate else {
            return refuse("its experts are ungated");
        };
        let gpt_oss = scheme == MoeScheme::GptOss;
        let biases = [
            self.b_gate.is_some(),
            self.b_up.is_some(),
            self.b_down.is_some(),
            self.router.bias.is_some(),
        ];
        if gpt_oss && biases.contains(&false) {
            return refuse("gpt-oss's router and experts have biases, and this layer's not all");
        }
        if !gpt_oss && biases.contains(&true) {
            return refuse("its experts or its router have biases");
        }
        // Where the scheme keeps the selection bias, which it needs: DeepSeek-V3's on its
        // router, ERNIE 4.5's `[1, E]` in `moe_statics`, LFM2-MoE's and AFMoE's
        // `expert_bias`, MiniMax-M2's beside the router.
        let selection_bias = match scheme {
            MoeScheme::DeepseekV3 => Some("gate.e_score_correction_bias"),
            MoeScheme::Ernie45Moe => Some("moe_statics.e_score_correction_bias"),
            MoeScheme::Lfm2Moe | MoeScheme::Afmoe => Some("expert_bias"),
            MoeScheme::MinimaxM2 => Some("e_score_correction_bias"),
            _ => None,
        };
        if self.selection_bias.is_some() != selection_bias.is_some() {
            return refuse(
                "a selection bias is DeepSeek-V3's, ERNIE 4.5's, MiniMax-M2's, LFM2-MoE's and \
                 AFMoE's only, and they need one",
            );
        }
        // (shared experts, their gate) the scheme holds, and their stem.
        let (shared_form, shared_stem) = match scheme {
            MoeScheme::Qwen2Moe => ((true, true), "shared_expert"),
            MoeScheme::DeepseekV2
            | MoeScheme::DeepseekV3
            | MoeScheme::Ernie45Moe
            | MoeScheme::Afmoe => ((self.shared.is_some(), false), "shared_experts"),
            MoeScheme::Llama4 => ((true, false), "shared_expert"),
            MoeScheme::HunyuanMoe => ((true, false), "shared_mlp"),
            MoeScheme::Mixtral
            | MoeScheme::Qwen3Moe
            | MoeScheme::GraniteMoe
            | MoeScheme::Dbrx
            | MoeScheme::GptOss
            | MoeScheme::MinimaxM2
            | MoeScheme::Lfm2Moe => ((false, false), "shared_expert"),
        };
        if (self.shared.is_some(), self.shared_gate.is_some()) != shared_form {
            return refuse("its shared experts (or their gate) differ from the type's");
        }
        let mut tensors: Vec<(String, HostTensor)> = Vec::new();
        let mut put =
            |name: &str, tensor: HostTensor| tensors.push((format!("{prefix}{name}"), tensor));
        let router = match scheme {
            MoeScheme::GraniteMoe | MoeScheme::Dbrx => "router.layer.weight",
            MoeScheme::GptOss | MoeScheme::Llama4 => "router.weight",
            MoeScheme::HunyuanMoe => "gate.wg.weight",
            MoeScheme::Afmoe => "router.gate.weight",
            _ => "gate.weight",
        };
        put(router, to_pytorch(self.router.weight.val()));
        if let Some(bias) = &self.router.bias {
            put(&bias_key(router), to_pytorch(bias.val()));
        }
        if let (Some(bias), Some(key)) = (&self.selection_bias, selection_bias) {
            let bias = bias.val();
            let bias = if scheme == MoeScheme::Ernie45Moe {
                to_host(bias.unsqueeze_dim::<2>(0))
            } else {
                to_pytorch(bias)
            };
            put(key, bias);
        }
        let [gate, up, down] = [w_gate, &self.w_up, &self.w_down].map(|p| p.val());
        match scheme {
            MoeScheme::Dbrx => {
                // [E·d_ff, d_model] each: gate and up in Linear's layout, down as it is.
                let e = self.n_experts();
                let (d, f) = (self.d_model(), self.d_ff());
                let rows = |t: Tensor<3>| to_host(t.reshape([e * f, d]));
                put("experts.mlp.w1", rows(gate.swap_dims(1, 2)));
                put("experts.mlp.v1", rows(up.swap_dims(1, 2)));
                put("experts.mlp.w2", rows(down));
            }
            MoeScheme::GraniteMoe => {
                // PyTorch's layout: [E, 2·d_ff, d_model] (gate rows first), [E, d_model, d_ff].
                let [gate, up, down] = [gate, up, down].map(|t| t.swap_dims(1, 2));
                put(
                    "input_linear.weight",
                    to_pytorch(Tensor::cat(vec![gate, up], 1)),
                );
                put("output_linear.weight", to_pytorch(down));
            }
            MoeScheme::GptOss | MoeScheme::Llama4 => {
                // burn's own layout: [E, d_model, 2·d_ff], [E, d_ff, d_model]; gpt-oss
                // interleaves gate and up along the last axis, Llama 4 stacks the halves.
                let pack = |gate: Tensor<3>, up: Tensor<3>| -> Tensor<3> {
                    let [e, rows, f] = gate.dims();
                    if gpt_oss {
                        Tensor::stack::<4>(vec![gate, up], 3).reshape([e, rows, 2 * f])
                    } else {
                        Tensor::cat(vec![gate, up], 2)
                    }
                };
                put("experts.gate_up_proj", to_pytorch(pack(gate, up)));
                put("experts.down_proj", to_pytorch(down));
                if let (Some(b_gate), Some(b_up), Some(b_down)) =
                    (&self.b_gate, &self.b_up, &self.b_down)
                {
                    let packed = pack(b_gate.val().unsqueeze_dim(1), b_up.val().unsqueeze_dim(1));
                    // 2-D, but not weights: [E, 2·d_ff] and [E, d_model] as they are.
                    put(
                        "experts.gate_up_proj_bias",
                        to_host(packed.squeeze_dim::<2>(1)),
                    );
                    put("experts.down_proj_bias", to_host(b_down.val()));
                }
            }
            _ => {
                let names = match scheme {
                    MoeScheme::Mixtral | MoeScheme::MinimaxM2 | MoeScheme::Lfm2Moe => {
                        ["w1", "w3", "w2"]
                    }
                    _ => ["gate_proj", "up_proj", "down_proj"],
                };
                for e in 0..self.n_experts() {
                    for (name, param) in names.iter().zip([&gate, &up, &down]) {
                        let matrix = param.clone().narrow(0, e, 1).squeeze_dim::<2>(0);
                        put(&format!("experts.{e}.{name}.weight"), to_pytorch(matrix));
                    }
                }
            }
        }
        if let Some(shared) = &self.shared {
            let Some(gate) = shared.gate().filter(|_| !shared.is_fused()) else {
                return refuse("its shared experts are not an unfused gated network");
            };
            if [shared.gate(), shared.up()]
                .iter()
                .flatten()
                .any(|l| l.bias.is_some())
                || shared.down().bias.is_some()
            {
                return refuse("its shared experts have biases");
            }
            let up = shared.up().expect("unfused");
            let stem = shared_stem;
            for (name, linear) in [
                ("gate_proj", gate),
                ("up_proj", up),
                ("down_proj", shared.down()),
            ] {
                put(
                    &format!("{stem}.{name}.weight"),
                    to_pytorch(linear.weight.val()),
                );
            }
        }
        if let Some(gate) = &self.shared_gate {
            put("shared_expert_gate.weight", to_pytorch(gate.weight.val()));
        }
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(serialize(&tensors, &[]))
    }

    /// Writes [`to_safetensors_bytes_as`](Self::to_safetensors_bytes_as) to `path`
    /// atomically (a temporary file beside it, then a rename): a failure leaves an earlier
    /// file intact.
    pub fn save_safetensors_as(
        &self,
        path: impl AsRef<Path>,
        scheme: MoeScheme,
        prefix: &str,
    ) -> Result<(), Error> {
        let path = path.as_ref();
        let bytes = self.to_safetensors_bytes_as(scheme, prefix)?;
        crate::files::write_atomically(path, &bytes).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// Loaded values in burn's layout.
pub(crate) struct Parts {
    router: TensorData,
    router_bias: Option<TensorData>,
    selection_bias: Option<TensorData>,
    w_gate: TensorData,
    w_up: TensorData,
    w_down: TensorData,
    b_gate: Option<TensorData>,
    b_up: Option<TensorData>,
    b_down: Option<TensorData>,
    shared_gate: Option<TensorData>,
}

impl Moe {
    fn load_parts(mut self, parts: Parts) -> Self {
        self.router.weight = load_param(&self.router.weight, parts.router);
        if let (Some(param), Some(b)) = (self.router.bias.as_mut(), parts.router_bias) {
            *param = load_param(param, b);
        }
        for (param, b) in [
            (self.b_gate.as_mut(), parts.b_gate),
            (self.b_up.as_mut(), parts.b_up),
            (self.b_down.as_mut(), parts.b_down),
        ] {
            if let (Some(param), Some(b)) = (param, b) {
                *param = load_param(param, b);
            }
        }
        if let (Some(param), Some(bias)) = (self.selection_bias.as_mut(), parts.selection_bias) {
            *param = load_param(param, bias);
        }
        if let Some(param) = self.w_gate.as_mut() {
            *param = load_param(param, parts.w_gate);
        }
        self.w_up = load_param(&self.w_up, parts.w_up);
        self.w_down = load_param(&self.w_down, parts.w_down);
        if let (Some(gate), Some(w)) = (self.shared_gate.as_mut(), parts.shared_gate) {
            gate.weight = load_param(&gate.weight, w);
        }
        self
    }
}

fn values(data: &TensorData) -> Vec<f64> {
    data.iter::<f64>().collect()
}

/// Reads tensors by key, checking shapes and noting the keys used.
struct Reader<'a> {
    files: &'a mut TensorFiles,
    used: Vec<String>,
}

impl Reader<'_> {
    fn take(&mut self, key: &str, shape: &[usize]) -> Result<TensorData, Error> {
        let info = self.files.info(key).ok_or_else(|| Error::MissingTensor {
            key: key.to_string(),
            hint: String::new(),
        })?;
        if info.shape != shape {
            return Err(Error::Shape {
                key: key.to_string(),
                expected: shape.to_vec(),
                actual: info.shape.clone(),
            });
        }
        let data = self.files.read_float(key)?;
        self.used.push(key.to_string());
        Ok(data)
    }
}
