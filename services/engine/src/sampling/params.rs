//! A request's sampling settings: temperature, top-k, top-p, min-p, the penalties and the seed,
//! with their checks.
//!
//! Owns: [`SamplingParams`]. Must not touch: sampling itself.

use crate::error::EngineError;

/// Sampling settings of one request. `temperature == 0` means greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1 = off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the most likely one (0 = off).
    pub min_p: f32,
    /// transformers-style: a seen token's logit is divided by it if positive, multiplied if not
    /// (1 = off).
    pub repetition_penalty: f32,
    /// OpenAI-style: subtracted once from every seen token's logit (0 = off).
    pub presence_penalty: f32,
    /// OpenAI-style: subtracted per occurrence of a seen token (0 = off).
    pub frequency_penalty: f32,
    pub seed: u64,
    /// Draws of the random stream an earlier part of this generation already used (a resumed
    /// generation continues the stream there); 0: from the start.
    pub stream_position: u64,
}

/// Most draws a sampler skips at its start (far more than any context's tokens).
pub const MAX_STREAM_POSITION: u64 = 1 << 24;

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            stream_position: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams::default()
    }

    pub fn validate(&self) -> Result<(), EngineError> {
        let invalid = |problem: String| Err(EngineError::InvalidSampling { problem });
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return invalid(format!("temperature {} must be ≥ 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return invalid(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return invalid(format!("min_p {} must be in [0, 1]", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return invalid(format!(
                "repetition_penalty {} must be > 0",
                self.repetition_penalty
            ));
        }
        if !self.presence_penalty.is_finite() || !self.frequency_penalty.is_finite() {
            return invalid("presence and frequency penalties must be finite".into());
        }
        if self.stream_position > MAX_STREAM_POSITION {
            return invalid(format!(
                "random stream position {} must be at most {MAX_STREAM_POSITION}",
                self.stream_position
            ));
        }
        Ok(())
    }
}
