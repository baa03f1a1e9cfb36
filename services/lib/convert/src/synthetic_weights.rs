//! The synthetic weights' values: the distributions each tensor is drawn from, and the Zipf and
//! trained routing biases (with the trained fixture's measured popularity table) written into
//! the embeddings and router rows (see `synthetic.rs` for the distributions and the routing
//! construction).
//!
//! Owns: drawing a tensor's values from a seeded stream. Must not touch: shapes (the presets),
//! quantization and writing.

use ninfer_artifact::{DType, ModelConfig};

use crate::plan::{PlannedBank, PlannedTensor};
use crate::routing_locality::{probit_biases, Locality, TRAINED_CONTEXT_SHARES};
use crate::synthetic_options::{Routing, SyntheticOptions};
use crate::{encode_expert, encode_float};

/// Deterministic per-tensor random streams and the weight distributions.
pub(crate) struct Drawer {
    seed: u64,
    plain_norms: bool,
    hidden: usize,
    /// From the preset's full depth (not `--layers`), so a truncated model's layers equal the
    /// full model's first layers.
    output_scale: f32,
    /// Unit vector ĉ shared by every embedding row (Zipf and trained routing).
    direction: Option<Vec<f32>>,
    routing: Routing,
    num_experts: usize,
    /// The preset's full depth (the trained profile is stretched over it).
    num_layers: usize,
    experts_per_token: usize,
    /// Trained routing: the hidden layout and layer-0 carrier of the temporal reuse (`None`
    /// for the other modes, or when the shape cannot carry context).
    locality: Option<Locality>,
    /// The `lm_head` row that always wins (`--ends-turns`): it reads the shared direction ĉ,
    /// which every hidden state carries.
    winning_row: Option<usize>,
}

/// How strongly the winning `lm_head` row reads ĉ: its logit is about this times √(H/2), far
/// above the other rows' logits (std about 1).
const WINNING_ROW_WEIGHT: f32 = 4.0;

/// Logit noise of the random router part, as the scale of a Gumbel (see the module doc).
const ROUTER_TEMPERATURE: f64 = 0.55;

impl Drawer {
    pub(crate) fn new(
        options: &SyntheticOptions,
        model: &ModelConfig,
        winning_row: Option<usize>,
    ) -> Self {
        let hidden = model.common().hidden_size;
        let unit_vector = |len: usize| {
            let mut rng = Rng::for_name(options.seed, "shared direction");
            let mut c = vec![0.0f32; len];
            rng.fill_uniform(&mut c, 1.0);
            let norm = c.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
            c.iter_mut().for_each(|x| *x /= norm);
            c
        };
        // Without routers (a dense model) there is no popularity or reuse to steer.
        let has_routers = model.common().num_experts > 0;
        let locality = match options.routing {
            Routing::Trained if has_routers => Locality::new(model, unit_vector),
            Routing::Trained | Routing::Zipf { .. } | Routing::Uniform => None,
        };
        let direction = match (&options.routing, &locality) {
            // A winning head row needs the shared direction whatever the routing.
            _ if winning_row.is_some() && locality.is_none() => Some(unit_vector(hidden)),
            _ if !has_routers => None,
            (Routing::Uniform, _) => None,
            (_, Some(locality)) => Some(locality.direction().to_vec()),
            (Routing::Zipf { .. } | Routing::Trained, None) => Some(unit_vector(hidden)),
        };
        Drawer {
            seed: options.seed,
            plain_norms: matches!(model, ModelConfig::Qwen3Moe(_)),
            hidden,
            output_scale: 0.5 / (options.preset.num_hidden_layers as f32).sqrt(),
            direction,
            routing: options.routing,
            num_experts: model.common().num_experts,
            num_layers: options.preset.num_hidden_layers,
            experts_per_token: model.common().num_experts_per_tok,
            locality,
            winning_row,
        }
    }

    /// The encoded bytes of one planned tensor, generated row by row (no f32 copy of a large
    /// embedding).
    pub(crate) fn tensor(&self, tensor: &PlannedTensor) -> Vec<u8> {
        let rows = tensor.shape[0] as usize;
        let cols = tensor.shape[1..].iter().product::<u64>().max(1) as usize;
        let name = tensor.name.as_str();
        let mut rng = Rng::for_name(self.seed, name);
        let element = if tensor.dtype == DType::Bf16 { 2 } else { 4 };
        let mut out = Vec::with_capacity(rows * cols * element);
        if tensor.shape.len() == 1 {
            if let Some(values) = self
                .locality
                .as_ref()
                .and_then(|locality| locality.carrier_vector(name, rows))
            {
                return encode_float(&values, tensor.dtype);
            }
            let mut values = vec![0.0f32; rows];
            self.vector(name, &mut rng, &mut values);
            return encode_float(&values, tensor.dtype);
        }
        if let Some(matrix) = self
            .locality
            .as_ref()
            .and_then(|locality| locality.carrier_matrix(name, rows, cols))
        {
            return encode_float(&matrix, tensor.dtype);
        }
        let mut row = vec![0.0f32; cols];
        let router_bias = name
            .ends_with(".moe.router")
            .then(|| self.router_bias(name))
            .flatten();
        let bound = uniform_bound(self.matrix_std(name, cols));
        for r in 0..rows {
            if let (Some(locality), Some(bias), Some(c)) =
                (&self.locality, &router_bias, &self.direction)
            {
                // Trained routing with a carrier: fresh part on the token coordinates, context
                // parts on the carried blocks, popularity along ĉ.
                let shares = context_shares(name, self.num_layers.max(1));
                let fresh = locality.token_coordinates();
                let fresh_std = ((1.0 - shares.0 - shares.1) / fresh as f64).sqrt() as f32;
                row.fill(0.0);
                rng.fill_uniform(&mut row[..fresh], uniform_bound(fresh_std));
                remove_component(&mut row, c);
                locality.add_context_parts(&mut row, shares, |values, bound| {
                    rng.fill_uniform(values, bound)
                });
                row.iter_mut().zip(c).for_each(|(x, c)| *x += bias[r] * c);
                out.extend(encode_float(&row, tensor.dtype));
                continue;
            }
            if let (Some(locality), "embed_tokens", Some(c)) =
                (&self.locality, name, &self.direction)
            {
                // Nothing on the carried blocks: the carrier writes them.
                let fresh = locality.token_coordinates();
                row.fill(0.0);
                rng.fill_uniform(&mut row[..fresh], bound);
                let kappa = (self.hidden as f32).sqrt();
                row.iter_mut().zip(c).for_each(|(x, c)| *x += kappa * c);
                out.extend(encode_float(&row, tensor.dtype));
                continue;
            }
            rng.fill_uniform(&mut row, bound);
            match (name, &self.direction) {
                ("embed_tokens", Some(c)) => {
                    let kappa = (self.hidden as f32).sqrt();
                    row.iter_mut().zip(c).for_each(|(x, c)| *x += kappa * c);
                }
                ("lm_head", Some(c)) => {
                    remove_component(&mut row, c);
                    if self.winning_row == Some(r) {
                        row.iter_mut()
                            .zip(c)
                            .for_each(|(x, c)| *x += WINNING_ROW_WEIGHT * c);
                    }
                }
                _ => {}
            }
            if let (Some(bias), Some(c)) = (&router_bias, &self.direction) {
                remove_component(&mut row, c);
                row.iter_mut().zip(c).for_each(|(x, c)| *x += bias[r] * c);
            }
            out.extend(encode_float(&row, tensor.dtype));
        }
        out
    }

    /// A plain matrix drawn as [`Drawer::tensor`] draws `name` (row by row from its stream).
    pub(crate) fn plain_matrix(&self, name: &str, rows: usize, cols: usize) -> Vec<f32> {
        let mut rng = Rng::for_name(self.seed, name);
        let bound = uniform_bound(self.matrix_std(name, cols));
        let mut values = vec![0.0f32; rows * cols];
        for row in values.chunks_exact_mut(cols.max(1)) {
            rng.fill_uniform(row, bound);
        }
        values
    }

    /// One expert's `[gate; up]` and `down`, encoded in the bank's dtype.
    pub(crate) fn expert(&self, bank: &PlannedBank, index: usize) -> (Vec<u8>, Vec<u8>) {
        let (h, im) = (bank.hidden_size, bank.intermediate_size);
        if bank.class == ninfer_artifact::TensorClass::DenseMlpExpert {
            // The layer's dense MLP itself: the same numbers as its `mlp.*` matrices.
            let mlp = bank.prefix.trim_end_matches(".experts");
            let mut gate_up = self.plain_matrix(&format!("{mlp}.gate_proj"), im, h);
            gate_up.extend(self.plain_matrix(&format!("{mlp}.up_proj"), im, h));
            let down = self.plain_matrix(&format!("{mlp}.down_proj"), h, im);
            return (
                encode_expert(&gate_up, bank.dtype, 2 * im, h),
                encode_expert(&down, bank.dtype, h, im),
            );
        }
        let mut rng = Rng::for_name(self.seed, &format!("{}.{index}", bank.prefix));
        let mut gate_up = vec![0.0f32; 2 * im * h];
        rng.fill_uniform(&mut gate_up, uniform_bound(1.0 / (h as f32).sqrt()));
        let gate_up = encode_expert(&gate_up, bank.dtype, 2 * im, h);
        let mut down = vec![0.0f32; h * im];
        rng.fill_uniform(
            &mut down,
            uniform_bound(self.output_scale / (im as f32).sqrt()),
        );
        let down = encode_expert(&down, bank.dtype, h, im);
        (gate_up, down)
    }

    pub(crate) fn matrix_std(&self, name: &str, fan_in: usize) -> f32 {
        let base = 1.0 / (fan_in as f32).sqrt();
        if name == "embed_tokens" {
            1.0
        } else if name.ends_with("gdn.conv1d") {
            // PyTorch's default conv init, U(±1/√Kc), as a std.
            base / 3f32.sqrt()
        } else if name.ends_with("o_proj")
            || name.ends_with("out_proj")
            || name.ends_with("down_proj")
        {
            self.output_scale * base
        } else {
            base
        }
    }

    /// 1-D tensors: norm weights at identity, GDN decay parameters in Mamba's ranges.
    pub(crate) fn vector(&self, name: &str, rng: &mut Rng, out: &mut [f32]) {
        if name.ends_with("gdn.A_log") {
            // A ~ U(1, 16).
            for x in out.iter_mut() {
                *x = (1.0 + 15.0 * rng.unit()).ln();
            }
        } else if name.ends_with("gdn.dt_bias") {
            // dt log-uniform in [1e-3, 0.1]; dt_bias = softplus⁻¹(dt) = ln(e^dt − 1).
            for x in out.iter_mut() {
                let dt = (1e-3f32.ln() + (0.1f32.ln() - 1e-3f32.ln()) * rng.unit()).exp();
                *x = dt.exp_m1().ln();
            }
        } else if name.ends_with("gdn.norm") || self.plain_norms {
            // The gated GDN norm and qwen3_moe's norms are plain `w`.
            out.fill(1.0);
        } else {
            // Zero-centred `1 + w` norms.
            out.fill(0.0);
        }
    }

    /// Per-expert coefficient α_e along ĉ for one router (Zipf and trained routing).
    pub(crate) fn router_bias(&self, name: &str) -> Option<Vec<f32>> {
        self.direction.as_ref()?;
        let experts = self.num_experts;
        // Popularity rank of each expert: a seeded permutation per layer.
        let mut ranks: Vec<usize> = (0..experts).collect();
        let mut rng = Rng::for_name(self.seed, &format!("{name} popularity"));
        for i in (1..experts).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            ranks.swap(i, j);
        }
        // x·ĉ of a normalised hidden state (κ = √H: half its energy along ĉ).
        let along = (self.hidden as f64 / 2.0).sqrt();
        let by_rank: Vec<f64> = match self.routing {
            Routing::Zipf { exponent } => (0..experts)
                .map(|rank| -exponent * ((rank + 1) as f64).ln())
                .collect(),
            Routing::Trained => {
                let shares: Vec<f64> =
                    trained_log_shares(router_layer(name), self.num_layers.max(1), experts)
                        .iter()
                        .map(|l| l.exp())
                        .collect();
                // The logit noise has variance ½ (a unit-norm row against x with |x|² = H,
                // half of it along ĉ).
                let biases = probit_biases(&shares, self.experts_per_token, 0.5f64.sqrt());
                return Some(
                    ranks
                        .iter()
                        .map(|&rank| (biases[rank] / along) as f32)
                        .collect(),
                );
            }
            Routing::Uniform => return None,
        };
        let log_weights: Vec<f64> = ranks.iter().map(|&rank| by_rank[rank]).collect();
        let mean = log_weights.iter().sum::<f64>() / experts.max(1) as f64;
        Some(
            log_weights
                .iter()
                .map(|w| (ROUTER_TEMPERATURE * (w - mean) / along) as f32)
                .collect(),
        )
    }
}

/// Expert share by popularity rank (most popular first) of each MoE layer of the trained fixture
/// (`tests/fixtures/qwen3_5_moe_trained/reference.json` → `routing.layers[i].share_by_rank`,
/// rounded): 32 experts, top-4, measured over held-out Python code and documentation. One
/// layer per line.
const TRAINED_SHARE_BY_RANK_TEXT: &str = include_str!("trained_share_by_rank.txt");

/// [`TRAINED_SHARE_BY_RANK_TEXT`] as numbers, one row per layer.
fn trained_share_by_rank() -> &'static [Vec<f64>] {
    static TABLE: std::sync::OnceLock<Vec<Vec<f64>>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        TRAINED_SHARE_BY_RANK_TEXT
            .lines()
            .map(|line| {
                line.split_whitespace()
                    .filter_map(|word| word.parse().ok())
                    .collect()
            })
            .filter(|row: &Vec<f64>| !row.is_empty())
            .collect()
    })
}

/// The decoder layer a router tensor belongs to (`layers.{i}.…`; 0 when the name has none).
fn router_layer(name: &str) -> usize {
    name.split('.')
        .skip_while(|part| *part != "layers")
        .nth(1)
        .and_then(|index| index.parse().ok())
        .unwrap_or(0)
}

/// The context shares of a router (`layers.{i}.moe.router`): the trained layer at the same
/// relative depth as for popularity. MTP routers read no context: their input is not a decoder
/// layer's residual stream.
fn context_shares(name: &str, layers: usize) -> (f64, f64) {
    if !name.starts_with("layers.") {
        return (0.0, 0.0);
    }
    let table = &TRAINED_CONTEXT_SHARES;
    table[(router_layer(name) * table.len() / layers).min(table.len() - 1)]
}

/// ln(share) by rank for layer `layer` of `layers` with `experts` experts: the trained layer at
/// the same relative depth, its rank profile resampled at the rank quantiles (r + ½)/E and
/// renormalised, so the shape (share relative to the mean) survives any expert count.
fn trained_log_shares(layer: usize, layers: usize, experts: usize) -> Vec<f64> {
    let table = trained_share_by_rank();
    let trained_layers = table.len();
    let profile = &table[(layer * trained_layers / layers).min(trained_layers - 1)];
    let last = profile.len() - 1;
    let shares: Vec<f64> = (0..experts)
        .map(|rank| {
            let position = ((rank as f64 + 0.5) / experts as f64 * profile.len() as f64 - 0.5)
                .clamp(0.0, last as f64);
            let low = position.floor() as usize;
            let high = (low + 1).min(last);
            let fraction = position - low as f64;
            profile[low] * (1.0 - fraction) + profile[high] * fraction
        })
        .collect();
    let total: f64 = shares.iter().sum();
    shares.iter().map(|s| (s / total).ln()).collect()
}

/// Half-width of a uniform distribution with standard deviation `std`.
fn uniform_bound(std: f32) -> f32 {
    std * 3f32.sqrt()
}

/// `row -= (row·c) c` for a unit vector `c`.
fn remove_component(row: &mut [f32], c: &[f32]) {
    let dot: f32 = row.iter().zip(c).map(|(x, c)| x * c).sum();
    row.iter_mut().zip(c).for_each(|(x, c)| *x -= dot * c);
}

/// xoshiro256++ seeded through splitmix64: fast, and one independent stream per tensor name.
pub(crate) struct Rng([u64; 4]);

impl Rng {
    pub(crate) fn for_name(seed: u64, name: &str) -> Self {
        // FNV-1a of the name, mixed with the seed.
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        for byte in name.bytes() {
            hash = (hash ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
        let mut state = seed ^ hash.rotate_left(17);
        let mut next = || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Rng([next(), next(), next(), next()])
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Fills `out` with U(−bound, bound), two values per 64 random bits.
    pub(crate) fn fill_uniform(&mut self, out: &mut [f32], bound: f32) {
        let scale = 2.0 * bound / (1u32 << 24) as f32;
        let mut pairs = out.chunks_exact_mut(2);
        for pair in &mut pairs {
            let bits = self.next_u64();
            pair[0] = ((bits >> 40) as f32) * scale - bound;
            pair[1] = (((bits >> 8) & 0xff_ffff) as f32) * scale - bound;
        }
        for x in pairs.into_remainder() {
            *x = ((self.next_u64() >> 40) as f32) * scale - bound;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trained_share_table_is_the_fixtures_measurement_rounded() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../tests/fixtures/qwen3_5_moe_trained/reference.json"
        );
        let reference: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).expect("reading the trained reference"))
                .expect("parsing the trained reference");
        let layers = reference["routing"]["layers"]
            .as_array()
            .expect("routing layers");
        let table = trained_share_by_rank();
        assert_eq!(table.len(), layers.len());
        for (row, layer) in table.iter().zip(layers) {
            let measured = layer["share_by_rank"].as_array().expect("share_by_rank");
            assert_eq!(row.len(), measured.len());
            for (rounded, exact) in row.iter().zip(measured) {
                let exact = exact.as_f64().expect("a share");
                assert!((rounded - exact).abs() <= 5e-6, "{rounded} vs {exact}");
            }
        }
    }

    #[test]
    fn trained_profile_keeps_its_shape_at_any_expert_count() {
        // How far below uniform the popularity is, ln E − H: the same for any E when the shape
        // (share relative to the mean) is kept.
        let below_uniform = |log_shares: &[f64]| {
            let entropy: f64 = log_shares.iter().map(|l| -l.exp() * l).sum();
            (log_shares.len() as f64).ln() - entropy
        };
        for (layer, profile) in trained_share_by_rank().iter().enumerate() {
            let total: f64 = profile.iter().sum();
            assert!((total - 1.0).abs() < 1e-3, "layer {layer} sums to {total}");
            assert!(
                profile.windows(2).all(|w| w[0] >= w[1]),
                "layer {layer} not by rank"
            );
            // Same count and depth: the measured profile itself.
            let same = trained_log_shares(layer, 8, 32);
            for (l, p) in same.iter().zip(profile) {
                assert!((l.exp() - p / total).abs() < 1e-12);
            }
            // A 256-expert, 40-layer preset: the layer at the same depth, the same shape.
            let stretched = trained_log_shares(layer * 5, 40, 256);
            let (a, b) = (below_uniform(&same), below_uniform(&stretched));
            assert!((a - b).abs() < 0.01, "layer {layer}: ln E − H {a} vs {b}");
            let top_ratio = stretched[0].exp() * 256.0 / (same[0].exp() * 32.0);
            assert!(
                (0.8..=1.05).contains(&top_ratio),
                "layer {layer}: top share ratio {top_ratio}"
            );
        }
        assert_eq!(router_layer("layers.17.moe.router"), 17);
        assert_eq!(router_layer("mtp.layers.0.moe.router"), 0);
    }

    #[test]
    fn uniform_fill_has_the_requested_spread() {
        let mut rng = Rng::for_name(1, "x");
        let mut values = vec![0.0f32; 100_001];
        rng.fill_uniform(&mut values, uniform_bound(0.5));
        let mean = values.iter().sum::<f32>() / values.len() as f32;
        let std =
            (values.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / values.len() as f32).sqrt();
        assert!(
            mean.abs() < 0.01 && (std - 0.5).abs() < 0.01,
            "{mean} {std}"
        );
    }
}
