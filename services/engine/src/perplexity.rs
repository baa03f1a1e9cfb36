//! Windowed negative log-likelihood of a token stream (what `ninfer perplexity` reports).
//!
//! Owns: the windowing rule and the NLL arithmetic. Windows are **non-overlapping**: the stream
//! is cut into consecutive windows of `max_context` tokens, each evaluated from an empty state;
//! every token except the first of each window is scored given the tokens before it in its
//! window. Within a window the tokens are fed in chunks of `chunk_tokens` (continuing the
//! state), so logits for the whole window never have to be held at once.
//! Must not touch: tokenization, file output (the CLI does both).

use crate::backend::Backend;
use crate::error::EngineError;
use crate::model::{LogitsSelection, Model, SequenceInput};

/// Settings of a perplexity run.
#[derive(Debug, Clone, Copy)]
pub struct PerplexityOptions {
    /// Tokens per window (≥ 2).
    pub max_context: usize,
    /// Tokens per forward inside a window.
    pub chunk_tokens: usize,
}

/// One scored token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenNll {
    /// Index of the predicted token in the stream.
    pub position: usize,
    pub token: u32,
    pub nll: f64,
}

/// `logsumexp(logits) − logits[target]` in f64.
pub fn negative_log_likelihood(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    max + sum.ln() - logits.get(target as usize).copied().unwrap_or(f32::NAN) as f64
}

/// NLL of every scored token of `tokens`; `progress(done, total)` after every chunk.
pub fn token_nlls<B: Backend>(
    model: &Model<B>,
    tokens: &[u32],
    options: PerplexityOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<TokenNll>, EngineError> {
    if options.max_context < 2 {
        return Err(EngineError::InvalidConfig {
            problem: format!(
                "perplexity needs a context of at least 2 tokens, got {}",
                options.max_context
            ),
        });
    }
    if tokens.len() < 2 {
        return Err(EngineError::EmptyInput {
            what: format!(
                "perplexity needs at least 2 tokens, the text has {}",
                tokens.len()
            ),
        });
    }
    let chunk = options.chunk_tokens.max(1);
    let mut scored = Vec::with_capacity(tokens.len());
    for (window_index, window) in tokens.chunks(options.max_context).enumerate() {
        let window_start = window_index * options.max_context;
        let mut state = model.new_sequence(window.len())?;
        let mut fed = 0;
        while fed < window.len() {
            let end = (fed + chunk).min(window.len());
            let nlls = score_chunk(model, &mut state, window, fed..end)?;
            scored.extend(nlls.into_iter().enumerate().map(|(r, nll)| {
                let target_index = fed + r + 1;
                TokenNll {
                    position: window_start + target_index,
                    token: window[target_index],
                    nll,
                }
            }));
            fed = end;
            progress(window_start + fed, tokens.len());
        }
    }
    Ok(scored)
}

/// Feeds `window[chunk]` to `state` (which must hold exactly `window[..chunk.start]`) in one
/// forward and returns the NLL of each window token the chunk predicts: entry `r` is the NLL
/// of `window[chunk.start + r + 1]`, so the chunk that ends the window scores one token fewer
/// than it feeds. The one chunk scorer of the in-process [`token_nlls`] and of the serving
/// engine's scoring requests, so both compute the same bits from the same logits.
pub fn score_chunk<B: Backend>(
    model: &Model<B>,
    state: &mut crate::model::SequenceState<B>,
    window: &[u32],
    chunk: std::ops::Range<usize>,
) -> Result<Vec<f64>, EngineError> {
    let vocab = model.vocab_size();
    let Some(fed) = window.get(chunk.clone()) else {
        return Err(EngineError::InvalidConfig {
            problem: format!(
                "scoring chunk {chunk:?} lies outside the window of {} tokens",
                window.len()
            ),
        });
    };
    let mut batch = [SequenceInput { state, tokens: fed }];
    let logits = model.forward(&mut batch, LogitsSelection::All)?;
    let logits = logits.into_iter().next().unwrap_or_default();
    // Row r predicts window token chunk.start + r + 1.
    let scored_rows = fed.len().min(window.len().saturating_sub(chunk.start + 1));
    if logits.len() < scored_rows * vocab {
        return Err(EngineError::InvalidConfig {
            problem: format!(
                "the forward returned {} logits for {scored_rows} rows of {vocab}",
                logits.len()
            ),
        });
    }
    Ok((0..scored_rows)
        .map(|r| {
            let target = window[chunk.start + r + 1];
            negative_log_likelihood(&logits[r * vocab..(r + 1) * vocab], target)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_of_uniform_logits_is_log_vocab() {
        let nll = negative_log_likelihood(&[0.5; 8], 3);
        assert!((nll - (8f64).ln()).abs() < 1e-12);
    }
}
