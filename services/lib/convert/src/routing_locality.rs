//! Temporal routing locality of `--routing trained`: the weights that make a synthetic model's
//! router in one layer pick, for consecutive tokens, the same experts about as often as the
//! trained fixture's layer at the same relative depth did.
//!
//! Owns: the hidden-space layout of a trained-routing model (which coordinates carry what), the
//! weights of layer 0's token mixer (the *carrier*), the context part of every router row, the
//! mixing table fitted to the fixture, and the probit popularity biases.
//! Must not touch: tensor names, shapes or dtypes (the carrier is an ordinary attention or Gated
//! DeltaNet layer whose weights happen to be arranged), nor anything about Zipf or uniform
//! routing, whose weights stay as they were.
//!
//! Mechanism. A router's logit for expert e is `bias_e + n_e(t)` where the noise `n_e(t)` is a
//! random projection of the token's normalised hidden state. Temporal reuse comes from the
//! autocorrelation of that noise over positions, so the noise is split into three independent
//! parts with variance shares 1 − s₁ − s₂, s₁ and s₂:
//! * a fresh part read from the token's own embedding (as before);
//! * a *short* part read from `B_short`, a block of the hidden state to which layer 0 writes a
//!   weighted average of the current and the last two or three tokens' states (Gaussian weights
//!   of width one token);
//! * a *long* part read from `B_long`, to which layer 0 writes a running average over about the
//!   last hundred tokens (the fixture's topic-level persistence, what its shuffled-within-window
//!   baseline shows).
//!
//! The hidden coordinates are laid out as `[A_c | rest | B_short | B_long]`: embeddings carry
//! random values on `A_c` and the rest, nothing on the two `B` blocks; the shared popularity
//! direction ĉ lives in the rest. The carrier reads `A_c` of its input at every position and
//! writes the two averages, at the per-coordinate variance of the embedding, into the `B`
//! blocks, so the router reading `B_short` with the same kind of random row as `A_c` sees the
//! recent tokens' noise. The carrier is layer 0's mixer:
//! * attention (qwen3_moe): query and key are constant (read from ĉ), so with RoPE the score of
//!   a key d tokens back is Σ_j A·cos(θ_j d) over a chosen band of rotary pairs; the band and A
//!   are set so the score falls like −d²/2σ² (σ = 1 for one group of heads, 60 for the other)
//!   and stays at least tens of nats below the peak over thousands of positions. Values read
//!   `A_c`; `o_proj` writes each group into its block.
//! * Gated DeltaNet (qwen3_next, qwen3_5_moe): with q = k constant and unit, the delta rule's
//!   read-out is an exponential moving average m_t = (1 − β)·g·m_{t−1} + β·v_t. Short heads use
//!   β = 1 and Gaussian taps of the causal conv (the last four tokens); long heads β = 0.01,
//!   g = 1 (an average over ~100 tokens). Values enter as c ± ε·u (a large constant c from ĉ,
//!   in pairs of opposite sign), where SiLU is linear to 10⁻³ and the gated RMSNorm divides by
//!   the constant c instead of the fluctuating part; `out_proj` takes the pair differences.
//!
//! The shares (s₁, s₂) per trained layer were fitted to the fixture's reuse at 1, 4 and 16
//! tokens with a Gaussian-noise model of the router (top-4 of 32 under these biases and the
//! same windows); every fit is within 0.01 of the measurement, and the engine test
//! `synthetic_routing_locality` measures the result through the engine. A preset with another
//! expert count keeps the shares: the same fraction of each router's logit variance comes from
//! the recent context as in the trained layer at that depth, which is what carries over; the
//! reuse then follows from its E and k. Both averages are normalised over the tokens seen, so
//! the first ~100 tokens of a sequence see a long average of fewer tokens and somewhat more
//! reuse; `ninfer bench` prompts (512 and 4096 tokens) are past that.
//!
//! Popularity: the bias of expert e is σ·Φ⁻¹(k·p_e) with σ the logit noise's standard deviation
//! (1/√2) and p_e its target share of selections: in the large-E limit an expert is picked when
//! its logit clears a common threshold, which it does with probability k·p_e. This matches the
//! fixture's popularity entropy to within 0.002 of ln E under the Gaussian model, where the
//! Zipf-style τ·ln p_e bias is 0.02–0.03 too skewed.

use ninfer_artifact::{LayerType, ModelConfig};

/// (s_short, s_long) per trained-fixture layer: the shares of the router's logit noise variance
/// read from the short and the long context average. Fitted to
/// `tests/fixtures/qwen3_5_moe_trained/reference.json` → `routing.layers[i].reuse`.
pub(crate) const TRAINED_CONTEXT_SHARES: [(f64, f64); 8] = [
    (0.0, 0.05),
    (0.0, 0.05),
    (0.0, 0.05),
    (0.12, 0.25),
    (0.15, 0.2),
    (0.3, 0.15),
    (0.38, 0.15),
    (0.35, 0.3),
];

/// Width (tokens, a Gaussian's σ) of the short context average.
const SHORT_WINDOW_TOKENS: f64 = 1.0;
/// Width of the attention carrier's long context average.
const LONG_WINDOW_TOKENS: f64 = 60.0;
/// The Gated DeltaNet carrier's long average: β of the delta rule (so r = 1 − β per token).
const LONG_AVERAGE_BETA: f64 = 0.01;
/// Largest block each context average writes (coordinates of the hidden state).
const MAX_CARRIED_COORDINATES: usize = 256;
/// The attention carrier's window must keep this much of its weight within 4σ of the newest
/// token at this context length, or the preset gets no carrier.
const WINDOW_CHECK_CONTEXT: usize = 8192;
const WINDOW_MAX_LEAK: f64 = 0.02;
/// Value offset c, value scale ε, gate input z of the Gated DeltaNet carrier.
const DELTA_OFFSET: f64 = 12.0;
const DELTA_VALUE_SCALE: f64 = 1.0;
const DELTA_GATE_INPUT: f64 = 4.0;

/// Which context average a head or block belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Window {
    Short,
    Long,
}

/// A Gaussian attention window built from RoPE pairs: the rotary pairs whose query and key are
/// non-zero and the per-dimension norm weight that sets the score's scale.
#[derive(Debug, Clone, PartialEq)]
struct AttentionWindow {
    pairs: Vec<usize>,
    norm_weight: f64,
    /// Σ w(d)² of the softmax weights over positions (the average's variance factor).
    sum_of_squared_weights: f64,
}

#[derive(Debug, Clone, PartialEq)]
enum Carrier {
    Attention {
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        rotary_dim: usize,
        gated: bool,
        zero_centred_norms: bool,
        short: AttentionWindow,
        long: AttentionWindow,
    },
    DeltaNet {
        key_heads: usize,
        key_head_dim: usize,
        value_heads: usize,
        value_head_dim: usize,
        kernel: usize,
        heads_per_window: usize,
        short_taps: Vec<f64>,
    },
}

/// The layout and carrier of one trained-routing model.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Locality {
    hidden: usize,
    /// Coordinates of `A_c` and of each `B` block.
    carried: usize,
    carrier: Carrier,
    /// ĉ, unit, zero outside the `rest` coordinates.
    direction: Vec<f32>,
}

/// x·ĉ of a normalised hidden state: κ = √H along ĉ and about H of random energy, so |x|² = H
/// puts √(H/2) on ĉ.
fn along_direction(hidden: usize) -> f64 {
    (hidden as f64 / 2.0).sqrt()
}

impl Locality {
    /// The layout for `model`, or `None` when its layer-0 mixer cannot carry context (too few
    /// heads, too few rotary pairs in the bands, or a hidden size too small for the blocks).
    /// `unit_vector` draws the seeded ĉ on a given number of coordinates.
    pub(crate) fn new(
        model: &ModelConfig,
        unit_vector: impl FnOnce(usize) -> Vec<f32>,
    ) -> Option<Locality> {
        let common = model.common();
        let hidden = common.hidden_size;
        let (carrier, carried) = match model {
            // Dense: no routers to carry context to.
            ModelConfig::Qwen35(_) => return None,
            // Synthetic artifacts do not build the hyper-connection streams.
            ModelConfig::Qwen4Exp(_) => return None,
            ModelConfig::Qwen3Moe(_) => attention_carrier(model, false, true)?,
            ModelConfig::Qwen3Next(c) | ModelConfig::Qwen35Moe(c) => {
                match c.layer_types.first()? {
                    LayerType::FullAttention => attention_carrier(model, true, false)?,
                    LayerType::LinearAttention => {
                        let (nv, dv) = (c.linear_num_value_heads, c.linear_value_head_dim);
                        if nv < 2 || dv < 2 || dv % 2 != 0 || c.linear_conv_kernel_dim < 1 {
                            return None;
                        }
                        let heads_per_window =
                            (nv / 2).min((MAX_CARRIED_COORDINATES / (dv / 2)).max(1));
                        let kernel = c.linear_conv_kernel_dim;
                        let taps = gaussian_weights(SHORT_WINDOW_TOKENS, kernel);
                        (
                            Carrier::DeltaNet {
                                key_heads: c.linear_num_key_heads,
                                key_head_dim: c.linear_key_head_dim,
                                value_heads: nv,
                                value_head_dim: dv,
                                kernel,
                                heads_per_window,
                                short_taps: taps,
                            },
                            heads_per_window * dv / 2,
                        )
                    }
                }
            }
        };
        // Keep at least half the coordinates for ĉ and the fresh part.
        if carried == 0 || 4 * carried > hidden {
            return None;
        }
        let rest = hidden - 3 * carried;
        let mut direction = vec![0.0f32; hidden];
        direction[carried..carried + rest].copy_from_slice(&unit_vector(rest));
        Some(Locality {
            hidden,
            carried,
            carrier,
            direction,
        })
    }

    pub(crate) fn direction(&self) -> &[f32] {
        &self.direction
    }

    /// Coordinates that embeddings and fresh router parts use (`A_c` and the rest).
    pub(crate) fn token_coordinates(&self) -> usize {
        self.hidden - 2 * self.carried
    }

    fn block(&self, window: Window) -> std::ops::Range<usize> {
        let start = match window {
            Window::Short => self.hidden - 2 * self.carried,
            Window::Long => self.hidden - self.carried,
        };
        start..start + self.carried
    }

    /// RMS of the carrier's input (an embedding): per-coordinate variance 1 on the token
    /// coordinates and H along ĉ.
    fn carrier_input_rms(&self) -> f64 {
        ((self.token_coordinates() + self.hidden) as f64 / self.hidden as f64).sqrt()
    }

    /// One router row's context parts, added to a fresh row that covers the token coordinates
    /// only: `row[B_short] = √s₁ · w₁`, `row[B_long] = √s₂ · w₂` with w uniform of per-entry
    /// variance 1/carried, drawn by `fill_uniform(values, bound)`.
    pub(crate) fn add_context_parts(
        &self,
        row: &mut [f32],
        shares: (f64, f64),
        mut fill_uniform: impl FnMut(&mut [f32], f32),
    ) {
        let std = 1.0 / (self.carried as f64).sqrt();
        for (window, share) in [(Window::Short, shares.0), (Window::Long, shares.1)] {
            let block = self.block(window);
            let values = &mut row[block];
            fill_uniform(values, (3.0f64.sqrt() * std * share.sqrt()) as f32);
        }
    }

    /// The full matrix of a carrier tensor (`layers.0.attn.*` or `layers.0.gdn.*`), or `None`
    /// for any other tensor.
    pub(crate) fn carrier_matrix(&self, name: &str, rows: usize, cols: usize) -> Option<Vec<f32>> {
        let part = name.strip_prefix("layers.0.")?;
        let mut m = vec![0.0f32; rows * cols];
        let c = &self.direction;
        let along = along_direction(self.hidden);
        let set_direction_row = |m: &mut [f32], row: usize, scale: f64| {
            for (x, &d) in m[row * cols..(row + 1) * cols].iter_mut().zip(c) {
                *x = (scale * d as f64) as f32;
            }
        };
        match (&self.carrier, part) {
            (
                Carrier::Attention {
                    heads,
                    kv_heads,
                    head_dim,
                    gated,
                    ..
                },
                _,
            ) => {
                let (nh, nkv, hd) = (*heads, *kv_heads, *head_dim);
                let group = nh / nkv;
                match part {
                    "attn.q_proj" => {
                        let per_head = if *gated { 2 * hd } else { hd };
                        for head in 0..nh {
                            let pattern = self.pair_pattern(window_of_group(head / group));
                            for (i, &on) in pattern.iter().enumerate() {
                                if on {
                                    set_direction_row(&mut m, head * per_head + i, 1.0 / along);
                                }
                            }
                            // Gate rows stay 0: sigmoid(0) = ½ on every output.
                        }
                    }
                    "attn.k_proj" => {
                        for kv in 0..nkv {
                            let pattern = self.pair_pattern(window_of_group(kv));
                            for (i, &on) in pattern.iter().enumerate() {
                                if on {
                                    set_direction_row(&mut m, kv * hd + i, 1.0 / along);
                                }
                            }
                        }
                    }
                    "attn.v_proj" => {
                        for kv in 0..nkv {
                            for i in 0..self.carried.min(hd) {
                                m[(kv * hd + i) * cols + i] = 1.0;
                            }
                        }
                    }
                    "attn.o_proj" => {
                        let heads_of = |window: Window| {
                            (0..nh)
                                .filter(|h| window_of_group(h / group) == window)
                                .count()
                        };
                        let gate = if *gated { 2.0 } else { 1.0 };
                        for head in 0..nh {
                            let window = window_of_group(head / group);
                            let sum_sq = self
                                .attention_window(window)
                                .map_or(1.0, |design| design.sum_of_squared_weights);
                            let gain = self.carrier_input_rms() / sum_sq.sqrt() * gate
                                / heads_of(window) as f64;
                            let block = self.block(window);
                            for i in 0..self.carried.min(hd) {
                                m[(block.start + i) * cols + head * hd + i] = gain as f32;
                            }
                        }
                    }
                    _ => return None,
                }
            }
            (
                Carrier::DeltaNet {
                    key_heads,
                    key_head_dim,
                    value_heads,
                    value_head_dim,
                    kernel,
                    heads_per_window,
                    short_taps,
                },
                _,
            ) => {
                let (nk, dk, nv, dv, w) = (
                    *key_heads,
                    *key_head_dim,
                    *value_heads,
                    *value_head_dim,
                    *heads_per_window,
                );
                let half = dv / 2;
                let key_width = nk * dk;
                // Head h < 2w carries a context average; its `A_c` slice.
                let carrying = |head: usize| {
                    (head < 2 * w).then(|| {
                        let window = if head < w {
                            Window::Short
                        } else {
                            Window::Long
                        };
                        (window, (head % w) * half)
                    })
                };
                match part {
                    "gdn.in_proj_qkv" => {
                        // q and k: constant, equal, positive after the conv's SiLU.
                        for row in 0..2 * key_width {
                            set_direction_row(&mut m, row, 1.0 / along);
                        }
                        for head in 0..nv {
                            let Some((_, slice)) = carrying(head) else {
                                continue;
                            };
                            for p in 0..half {
                                for (sign, row) in
                                    [(1.0, head * dv + p), (-1.0, head * dv + half + p)]
                                {
                                    let row = 2 * key_width + row;
                                    set_direction_row(&mut m, row, DELTA_OFFSET / along);
                                    m[row * cols + slice + p] = (sign * DELTA_VALUE_SCALE) as f32;
                                }
                            }
                        }
                    }
                    "gdn.in_proj_z" => {
                        for row in 0..rows {
                            set_direction_row(&mut m, row, DELTA_GATE_INPUT / along);
                        }
                    }
                    "gdn.in_proj_b" => {
                        for head in 0..nv {
                            let beta_logit = match carrying(head) {
                                Some((Window::Short, _)) => 30.0,
                                Some((Window::Long, _)) => {
                                    (LONG_AVERAGE_BETA / (1.0 - LONG_AVERAGE_BETA)).ln()
                                }
                                None => continue,
                            };
                            set_direction_row(&mut m, head, beta_logit / along);
                        }
                    }
                    "gdn.in_proj_a" => {}
                    "gdn.conv1d" => {
                        // Tap kernel − 1 is the current token, kernel − 1 − d the one d back.
                        let current = kernel - 1;
                        for channel in 0..2 * key_width {
                            m[channel * cols + current] = 1.0;
                        }
                        for head in 0..nv {
                            let Some((window, _)) = carrying(head) else {
                                continue;
                            };
                            for j in 0..dv {
                                let channel = 2 * key_width + head * dv + j;
                                match window {
                                    Window::Short => {
                                        for (d, &tap) in short_taps.iter().enumerate() {
                                            m[channel * cols + current - d] = tap as f32;
                                        }
                                    }
                                    Window::Long => m[channel * cols + current] = 1.0,
                                }
                            }
                        }
                    }
                    "gdn.out_proj" => {
                        // The gated norm leaves 2ε·ū/c per pair difference, times silu(z).
                        let gate = silu(DELTA_GATE_INPUT);
                        for head in 0..nv {
                            let Some((window, slice)) = carrying(head) else {
                                continue;
                            };
                            let sum_sq = match window {
                                Window::Short => short_taps.iter().map(|t| t * t).sum::<f64>(),
                                Window::Long => LONG_AVERAGE_BETA / (2.0 - LONG_AVERAGE_BETA),
                            };
                            let gain = DELTA_OFFSET * self.carrier_input_rms()
                                / (2.0 * DELTA_VALUE_SCALE * gate * sum_sq.sqrt());
                            let block = self.block(window);
                            for p in 0..half {
                                let row = block.start + slice + p;
                                m[row * cols + head * dv + p] = gain as f32;
                                m[row * cols + head * dv + half + p] = -gain as f32;
                            }
                        }
                    }
                    _ => return None,
                }
            }
        }
        Some(m)
    }

    /// A carrier's 1-D tensor (RoPE-pair norm weights; delta-rule decay parameters), or `None`.
    pub(crate) fn carrier_vector(&self, name: &str, len: usize) -> Option<Vec<f32>> {
        let part = name.strip_prefix("layers.0.")?;
        match (&self.carrier, part) {
            (
                Carrier::Attention {
                    rotary_dim,
                    zero_centred_norms,
                    ..
                },
                "attn.q_norm" | "attn.k_norm",
            ) => {
                // Zero-centred norms store w for a scale of 1 + w.
                let stored = |scale: f64| {
                    if *zero_centred_norms {
                        scale - 1.0
                    } else {
                        scale
                    }
                };
                let mut weights = vec![stored(1.0) as f32; len];
                for window in [Window::Short, Window::Long] {
                    let design = self.attention_window(window)?;
                    for &pair in &design.pairs {
                        for dim in [pair, pair + rotary_dim / 2] {
                            weights[dim] = stored(design.norm_weight) as f32;
                        }
                    }
                }
                Some(weights)
            }
            // A = e⁰ = 1 and softplus(−30) ≈ 10⁻¹³: g = 1, no decay besides (1 − β).
            (Carrier::DeltaNet { .. }, "gdn.A_log") => Some(vec![0.0; len]),
            (Carrier::DeltaNet { .. }, "gdn.dt_bias") => Some(vec![-30.0; len]),
            _ => None,
        }
    }

    /// The attention carrier's window design for `window` (`None` for a Gated DeltaNet carrier).
    fn attention_window(&self, window: Window) -> Option<&AttentionWindow> {
        match &self.carrier {
            Carrier::Attention { short, long, .. } => Some(match window {
                Window::Short => short,
                Window::Long => long,
            }),
            Carrier::DeltaNet { .. } => None,
        }
    }

    /// Which head dimensions of a query / key of `window`'s heads are non-zero.
    fn pair_pattern(&self, window: Window) -> Vec<bool> {
        let (
            Carrier::Attention {
                head_dim,
                rotary_dim,
                ..
            },
            Some(design),
        ) = (&self.carrier, self.attention_window(window))
        else {
            return Vec::new();
        };
        let mut pattern = vec![false; *head_dim];
        for &pair in &design.pairs {
            pattern[pair] = true;
            pattern[pair + rotary_dim / 2] = true;
        }
        pattern
    }
}

/// Even key/value groups average the short window, odd ones the long.
fn window_of_group(group: usize) -> Window {
    if group % 2 == 0 {
        Window::Short
    } else {
        Window::Long
    }
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// Gaussian weights exp(−d²/2σ²) for d = 0..count, summing to 1.
fn gaussian_weights(sigma: f64, count: usize) -> Vec<f64> {
    let raw: Vec<f64> = (0..count)
        .map(|d| (-((d * d) as f64) / (2.0 * sigma * sigma)).exp())
        .collect();
    let total: f64 = raw.iter().sum();
    raw.iter().map(|w| w / total).collect()
}

/// An attention carrier for `model` (layer 0 is full attention), and the coordinates it
/// carries per block (one head's dimensions).
fn attention_carrier(
    model: &ModelConfig,
    gated: bool,
    plain_norms: bool,
) -> Option<(Carrier, usize)> {
    let common = model.common();
    let (nh, nkv, hd, rot) = (
        common.num_attention_heads,
        common.num_key_value_heads,
        common.head_dim,
        common.rotary_dim,
    );
    if nkv < 2 || nh % nkv != 0 || rot < 2 || rot > hd {
        return None;
    }
    let frequencies = rope_inverse_frequencies(rot, common.rope_theta);
    let short = design_window(&frequencies, SHORT_WINDOW_TOKENS, hd)?;
    let long = design_window(&frequencies, LONG_WINDOW_TOKENS, hd)?;
    if short.pairs.iter().any(|p| long.pairs.contains(p)) {
        return None;
    }
    Some((
        Carrier::Attention {
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            rotary_dim: rot,
            gated,
            zero_centred_norms: !plain_norms,
            short,
            long,
        },
        hd.min(MAX_CARRIED_COORDINATES),
    ))
}

/// RoPE inverse frequencies as the engine computes them (f32 exponent and power).
fn rope_inverse_frequencies(rotary_dim: usize, theta: f64) -> Vec<f64> {
    let base = theta as f32;
    (0..rotary_dim / 2)
        .map(|i| (1.0 / base.powf((2 * i) as f32 / rotary_dim as f32)) as f64)
        .collect()
}

/// Score peak the band is chosen for: θ·σ·√PEAK between 0.3 and 3 puts a pair where its
/// cosine bends within a few σ.
const DESIGN_PEAK: f64 = 40.0;

/// The rotary pairs and norm weight whose attention weights fall like a Gaussian of width
/// `sigma` tokens: score(d) = S·mean_j cos(θ_j d) has curvature S·mean θ² = 1/σ² at d = 0.
/// `None` when no pair is in the band or the window leaks weight to far positions.
fn design_window(frequencies: &[f64], sigma: f64, head_dim: usize) -> Option<AttentionWindow> {
    let pairs: Vec<usize> = frequencies
        .iter()
        .enumerate()
        .filter(|(_, &theta)| {
            let x = theta * sigma * DESIGN_PEAK.sqrt();
            (0.3..=3.0).contains(&x)
        })
        .map(|(j, _)| j)
        .collect();
    if pairs.is_empty() {
        return None;
    }
    let mean_square =
        pairs.iter().map(|&j| frequencies[j].powi(2)).sum::<f64>() / pairs.len() as f64;
    let peak = 1.0 / (sigma * sigma * mean_square);
    let weights = window_weights(frequencies, &pairs, peak, WINDOW_CHECK_CONTEXT);
    let near = (4.0 * sigma).ceil() as usize + 1;
    let leak: f64 = weights[near.min(weights.len())..].iter().sum();
    if leak > WINDOW_MAX_LEAK {
        return None;
    }
    // score(0) = √hd · n² (q and k normalised to RMS n on the pairs' dimensions).
    let norm_weight = (peak / (head_dim as f64).sqrt()).sqrt();
    Some(AttentionWindow {
        pairs,
        norm_weight,
        sum_of_squared_weights: weights.iter().map(|w| w * w).sum(),
    })
}

/// Softmax weights over d = 0..context of score(d) = peak · mean_j cos(θ_j d).
fn window_weights(frequencies: &[f64], pairs: &[usize], peak: f64, context: usize) -> Vec<f64> {
    let scores: Vec<f64> = (0..context)
        .map(|d| {
            peak * pairs
                .iter()
                .map(|&j| (frequencies[j] * d as f64).cos())
                .sum::<f64>()
                / pairs.len() as f64
        })
        .collect();
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let total: f64 = exps.iter().sum();
    exps.iter().map(|e| e / total).collect()
}

/// The router bias of each expert (in logit units, mean 0) that gives expert e the share
/// `shares[e]` of top-`k` selections under logit noise of standard deviation `noise_std`.
pub(crate) fn probit_biases(shares: &[f64], k: usize, noise_std: f64) -> Vec<f64> {
    let total: f64 = shares.iter().sum();
    let biases: Vec<f64> = shares
        .iter()
        .map(|s| noise_std * inverse_normal_cdf((k as f64 * s / total).clamp(1e-6, 0.999)))
        .collect();
    let mean = biases.iter().sum::<f64>() / biases.len().max(1) as f64;
    biases.iter().map(|b| b - mean).collect()
}

/// Φ⁻¹(p) for p in (0, 1) (Acklam's rational approximation, relative error < 1.2·10⁻⁹).
pub(crate) fn inverse_normal_cdf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let low = 0.02425;
    if p < low {
        let q = (-2.0 * p.ln()).sqrt();
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    } else if p <= 1.0 - low {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    } else {
        -inverse_normal_cdf(1.0 - p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::preset;

    #[test]
    fn inverse_normal_cdf_matches_known_quantiles() {
        for (p, z) in [
            (0.5, 0.0),
            (0.975, 1.959_963_985),
            (0.025, -1.959_963_985),
            (0.001, -3.090_232_306),
            (0.8413447461, 1.0),
        ] {
            assert!((inverse_normal_cdf(p) - z).abs() < 1e-6, "Φ⁻¹({p})");
        }
    }

    fn locality(name: &str) -> Option<Locality> {
        let p = preset(name).unwrap();
        let model = p.model_config(p.num_hidden_layers).unwrap();
        Locality::new(&model, |n| vec![1.0 / (n as f32).sqrt(); n])
    }

    /// Every released preset gets a carrier; attention windows stay local over 8k positions.
    #[test]
    fn every_preset_has_a_carrier_and_local_windows() {
        for name in [
            "qwen3-30b-a3b",
            "qwen3.5-35b-a3b",
            "qwen3-next-80b-a3b",
            "qwen3-235b-a22b",
        ] {
            let locality = locality(name).unwrap_or_else(|| panic!("{name}: no carrier"));
            let norm: f32 = locality.direction().iter().map(|x| x * x).sum();
            assert!((norm - 1.0).abs() < 1e-4, "{name}: |ĉ|² = {norm}");
            assert!(locality.direction()[..locality.carried]
                .iter()
                .all(|&x| x == 0.0));
            assert!(locality.direction()[locality.token_coordinates()..]
                .iter()
                .all(|&x| x == 0.0));
            if let Carrier::Attention { short, long, .. } = &locality.carrier {
                println!(
                    "{name}: short pairs {:?}, long pairs {:?}",
                    short.pairs, long.pairs
                );
                // Σw² of a Gaussian window of width σ is about 1/(σ√π) for σ ≫ 1.
                let expected_long = 1.0 / (LONG_WINDOW_TOKENS * std::f64::consts::PI.sqrt());
                assert!(
                    (long.sum_of_squared_weights / expected_long - 1.0).abs() < 0.15,
                    "{name}: long window Σw² {}",
                    long.sum_of_squared_weights
                );
                assert!(short.sum_of_squared_weights > 0.3, "{name}");
            }
        }
    }

    #[test]
    fn probit_biases_order_the_experts_by_share() {
        let shares = [0.3, 0.2, 0.2, 0.1, 0.1, 0.05, 0.05];
        let biases = probit_biases(&shares, 2, 0.7);
        assert!(biases.windows(2).all(|w| w[0] >= w[1]));
        assert!(biases.iter().sum::<f64>().abs() < 1e-9);
        assert!((biases[1] - biases[2]).abs() < 1e-12);
    }
}
