//! Host math shared by the backends and the in-process expert executor: activations, the
//! SwiGLU of one expert row, RoPE's inverse frequencies and the host router. One definition
//! each, so the CPU reference, the CUDA backend's host-side tables and the executors agree.
//!
//! Owns: these scalar and per-row reference functions.
//! Must not touch: tensors, backends or devices (plain slices in, plain values out).

use crate::backend::Routing;

/// `x · sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// PyTorch's softplus (beta 1, threshold 20).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// SwiGLU of one row laid out `[gate ‖ up]`: `out[c] = silu(gate[c]) · up[c]` for the
/// `out.len()` columns of each half.
pub fn swiglu_halves(gate_up: &[f32], out: &mut [f32]) {
    let (gate, up) = gate_up.split_at(out.len());
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu(g) * u;
    }
}

/// RoPE inverse frequencies as transformers computes them (f32 exponent and power).
pub fn rope_inverse_frequencies(rotary_dim: usize, theta: f64) -> Vec<f32> {
    let base = theta as f32;
    (0..rotary_dim / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / rotary_dim as f32))
        .collect()
}

/// Router on host values: softmax per row (fp32), top-k (ties → lower expert id), optional
/// renormalisation.
pub fn route_top_k_host(logits: &[f32], experts: usize, k: usize, normalize: bool) -> Routing {
    let tokens = logits.len().checked_div(experts).unwrap_or(0);
    let k = k.min(experts);
    let mut routing = Routing {
        experts_per_token: k,
        expert_ids: Vec::with_capacity(tokens * k),
        weights: Vec::with_capacity(tokens * k),
    };
    let mut order: Vec<usize> = Vec::with_capacity(experts);
    for row in logits.chunks_exact(experts.max(1)).take(tokens) {
        let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = row.iter().map(|&x| (x - max).exp()).collect();
        let total: f32 = exps.iter().sum();
        let probabilities: Vec<f32> = exps.iter().map(|e| e / total).collect();
        order.clear();
        order.extend(0..experts);
        order.sort_by(|&a, &b| {
            probabilities[b]
                .partial_cmp(&probabilities[a])
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.cmp(&b))
        });
        let chosen = &order[..k];
        let sum: f32 = chosen.iter().map(|&e| probabilities[e]).sum();
        for &expert in chosen {
            routing.expert_ids.push(expert as u32);
            let weight = probabilities[expert];
            routing.weights.push(if normalize && sum > 0.0 {
                weight / sum
            } else {
                weight
            });
        }
    }
    routing
}
