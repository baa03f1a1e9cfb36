//! The CPU backend's norms, rotary embedding and the qwen4_exp hyper-connection stream ops
//! (stream mix, injection, PLE gate).
//!
//! Owns: those ops. Must not touch: the model's use of them.

use super::tensors::{CpuBackend, CpuTensor, CpuWeight};
use crate::backend::{Backend, NormStyle, Rotation};
use crate::error::EngineError;
use crate::host_math::{rope_inverse_frequencies, sigmoid, silu};

impl CpuBackend {
    /// [`Backend::rms_norm`](crate::backend::Backend::rms_norm) on the host.
    pub(super) fn rms_norm_on_host(
        &self,
        x: &CpuTensor,
        weight: &CpuWeight,
        eps: f32,
        style: NormStyle,
    ) -> Result<CpuTensor, EngineError> {
        let w = weight.parameter();
        let group = w.len().max(1);
        let offset = match style {
            NormStyle::Plain => 0.0,
            NormStyle::ZeroCentred => 1.0,
        };
        let mut out = x.clone();
        for chunk in out.data.chunks_mut(group) {
            let mean_square = chunk.iter().map(|v| v * v).sum::<f32>() / group as f32;
            let inverse = 1.0 / (mean_square + eps).sqrt();
            for (value, wi) in chunk.iter_mut().zip(w) {
                *value = *value * inverse * (offset + wi);
            }
        }
        Ok(out)
    }

    /// [`Backend::gated_rms_norm`](crate::backend::Backend::gated_rms_norm) on the host.
    pub(super) fn gated_rms_norm_on_host(
        &self,
        x: &CpuTensor,
        gate: &CpuTensor,
        weight: &CpuWeight,
        eps: f32,
    ) -> Result<CpuTensor, EngineError> {
        let normed = self.rms_norm(x, weight, eps, NormStyle::Plain)?;
        Ok(self.zip(&normed, gate, |value, z| value * silu(z)))
    }

    /// [`Backend::rope`](crate::backend::Backend::rope) on the host.
    pub(super) fn rope_on_host(
        &self,
        x: &mut CpuTensor,
        rotation: &Rotation<'_>,
    ) -> Result<(), EngineError> {
        let (positions, head_dim) = (rotation.positions, rotation.head_dim);
        let (rotary_dim, theta) = (rotation.rotary_dim, rotation.theta);
        let inverse_frequencies = rope_inverse_frequencies(rotary_dim, theta);
        let half = rotary_dim / 2;
        let mut cos = vec![0.0f32; half];
        let mut sin = vec![0.0f32; half];
        if let Some(multimodal) = &rotation.multimodal {
            if multimodal.streams.len() < positions.len().min(x.rows) {
                return Err(EngineError::InvalidConfig {
                    problem: format!(
                        "{} multimodal positions for {} rows",
                        multimodal.streams.len(),
                        positions.len().min(x.rows)
                    ),
                });
            }
        }
        for (row, &position) in positions.iter().enumerate().take(x.rows) {
            for i in 0..half {
                // Text rows turn every frequency by their one position; image prompts pick one
                // of the row's three positions per frequency.
                let position = match &rotation.multimodal {
                    Some(multimodal) => multimodal.streams[row][multimodal.stream_of_frequency(i)],
                    None => position,
                };
                let angle = position as f32 * inverse_frequencies[i];
                cos[i] = angle.cos();
                sin[i] = angle.sin();
            }
            for head in x.row_mut(row).chunks_mut(head_dim) {
                for i in 0..half {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos[i] - b * sin[i];
                    head[i + half] = b * cos[i] + a * sin[i];
                }
            }
        }
        Ok(())
    }

    /// [`Backend::add_sigmoid_scaled_rows`](crate::backend::Backend::add_sigmoid_scaled_rows) on the host.
    pub(super) fn add_sigmoid_scaled_rows_on_host(
        &self,
        a: &mut CpuTensor,
        b: &CpuTensor,
        gate: &CpuTensor,
    ) -> Result<(), EngineError> {
        for row in 0..a.rows {
            let scale = sigmoid(gate.data[row * gate.cols]);
            let source = b.row(row).to_vec();
            for (x, y) in a.row_mut(row).iter_mut().zip(&source) {
                *x += scale * y;
            }
        }
        Ok(())
    }

    /// [`Backend::row_weighted_rms_norm`](crate::backend::Backend::row_weighted_rms_norm) on the host.
    pub(super) fn row_weighted_rms_norm_on_host(
        &self,
        x: &CpuTensor,
        weight: &CpuWeight,
        group: usize,
        eps: f32,
        style: NormStyle,
    ) -> Result<CpuTensor, EngineError> {
        let w = weight.parameter();
        if group == 0 || w.len() != x.cols || x.cols % group != 0 {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "row_weighted_rms_norm: groups of {group} with a weight of {} over rows of {}",
                    w.len(),
                    x.cols
                ),
            });
        }
        let offset = match style {
            NormStyle::Plain => 0.0,
            NormStyle::ZeroCentred => 1.0,
        };
        let mut out = x.clone();
        for row in out.data.chunks_exact_mut(x.cols) {
            for (chunk, weights) in row.chunks_exact_mut(group).zip(w.chunks_exact(group)) {
                let mean_square = chunk.iter().map(|v| v * v).sum::<f32>() / group as f32;
                let inverse = 1.0 / (mean_square + eps).sqrt();
                for (value, wi) in chunk.iter_mut().zip(weights) {
                    *value = *value * inverse * (offset + wi);
                }
            }
        }
        Ok(out)
    }

    /// [`Backend::stream_mix`](crate::backend::Backend::stream_mix) on the host.
    pub(super) fn stream_mix_on_host(
        &self,
        x: &CpuTensor,
        gate: &CpuTensor,
        streams: usize,
        scale: f32,
    ) -> Result<CpuTensor, EngineError> {
        if streams == 0 || x.cols % streams != 0 || (gate.rows, gate.cols) != (x.rows, x.cols) {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "stream_mix: {streams} streams over {}×{} with a gate of {}×{}",
                    x.rows, x.cols, gate.rows, gate.cols
                ),
            });
        }
        let width = x.cols / streams;
        let mut out = CpuTensor::zeros(x.rows, width);
        for row in 0..x.rows {
            let (values, gates) = (x.row(row), gate.row(row));
            let mixed = out.row_mut(row);
            for stream in 0..streams {
                let base = stream * width;
                for (i, value) in mixed.iter_mut().enumerate() {
                    *value += sigmoid(gates[base + i]) * values[base + i];
                }
            }
            for value in mixed.iter_mut() {
                *value *= scale;
            }
        }
        Ok(out)
    }

    /// [`Backend::inject_into_streams`](crate::backend::Backend::inject_into_streams) on the host.
    pub(super) fn inject_into_streams_on_host(
        &self,
        streams: &mut CpuTensor,
        output: &CpuTensor,
        shares: &CpuTensor,
        scale: f32,
    ) -> Result<(), EngineError> {
        let count = shares.cols;
        if count == 0
            || shares.rows != streams.rows
            || output.rows != streams.rows
            || streams.cols != count * output.cols
        {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "inject_into_streams: streams {}×{}, output {}×{}, shares {}×{}",
                    streams.rows, streams.cols, output.rows, output.cols, shares.rows, shares.cols
                ),
            });
        }
        let width = output.cols;
        for row in 0..streams.rows {
            let out = output.row(row);
            let row_shares = shares.row(row);
            let target = streams.row_mut(row);
            for (stream, share) in row_shares.iter().enumerate() {
                let share = 2.0 * sigmoid(share * scale);
                for (value, o) in target[stream * width..(stream + 1) * width]
                    .iter_mut()
                    .zip(out)
                {
                    *value += share * o;
                }
            }
        }
        Ok(())
    }

    /// [`Backend::ple_gate`](crate::backend::Backend::ple_gate) on the host.
    pub(super) fn ple_gate_on_host(
        &self,
        keys: &CpuTensor,
        queries: &CpuTensor,
        values: &CpuTensor,
        streams: usize,
        scale: f32,
    ) -> Result<CpuTensor, EngineError> {
        let width = values.cols;
        if (keys.rows, keys.cols) != (queries.rows, queries.cols)
            || keys.rows != values.rows
            || keys.cols != streams * width
        {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "ple_gate: keys {}×{}, queries {}×{}, values {}×{}, {streams} streams",
                    keys.rows, keys.cols, queries.rows, queries.cols, values.rows, values.cols
                ),
            });
        }
        let mut out = Vec::with_capacity(keys.rows * keys.cols);
        for row in 0..keys.rows {
            let (key_row, query_row, value) = (keys.row(row), queries.row(row), values.row(row));
            for stream in 0..streams {
                let base = stream * width;
                let dot: f32 = key_row[base..base + width]
                    .iter()
                    .zip(&query_row[base..base + width])
                    .map(|(k, q)| k * q)
                    .sum::<f32>()
                    * scale;
                // sign(g)·sqrt(max(|g|, 1e-6)), with sign(0) = 0 as in torch.
                let gate = if dot == 0.0 {
                    0.0
                } else {
                    dot.signum() * dot.abs().max(1e-6).sqrt()
                };
                let gate = sigmoid(gate);
                out.extend(value.iter().map(|v| gate * v));
            }
        }
        Ok(CpuTensor {
            rows: keys.rows,
            cols: keys.cols,
            data: out,
        })
    }
}
