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
    let vocab = model.vocab_size();
    let chunk = options.chunk_tokens.max(1);
    let mut scored = Vec::with_capacity(tokens.len());
    for (window_index, window) in tokens.chunks(options.max_context).enumerate() {
        let window_start = window_index * options.max_context;
        let mut state = model.new_sequence(window.len())?;
        let mut fed = 0;
        while fed < window.len() {
            let end = (fed + chunk).min(window.len());
            let mut batch = [SequenceInput {
                state: &mut state,
                tokens: &window[fed..end],
            }];
            let logits = model.forward(&mut batch, LogitsSelection::All)?;
            let logits = logits.into_iter().next().unwrap_or_default();
            // Row r predicts window token fed + r + 1.
            for r in 0..end - fed {
                let target_index = fed + r + 1;
                if target_index >= window.len() {
                    break;
                }
                let target = window[target_index];
                scored.push(TokenNll {
                    position: window_start + target_index,
                    token: target,
                    nll: negative_log_likelihood(&logits[r * vocab..(r + 1) * vocab], target),
                });
            }
            fed = end;
            progress(window_start + fed, tokens.len());
        }
    }
    Ok(scored)
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
