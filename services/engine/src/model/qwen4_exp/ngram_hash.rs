//! Hashed n-gram row ids of a Qwen4-Exp PLE layer (per-layer n-gram embedding), exactly as
//! transformers computes them, in integers.
//!
//! For every token and every n-gram order `n = 2 … ngram_size`, the token and its `n − 1`
//! predecessors are mixed by XOR of `token · multiplier[s]` (odd per-layer multipliers from a
//! splitmix64 stream, small enough that no product overflows 63 bits), and each of the order's
//! `heads_per_ngram` heads reduces the mix modulo its own prime table size, offset into one table
//! shared by the layer's heads. Predecessors never cross an end-of-sequence token: walking back,
//! the first EOS met and everything before it read as EOS. Before the sequence start the
//! predecessors are EOS too, so a sequence's state is just its last `ngram_size − 1` ids.
//!
//! Owns: the hash constants, the per-layer multipliers and head tables, the row ids.
//! Must not touch: the embedding table itself (host-RAM rows looked up by the model graph).

use crate::error::EngineError;

const SPLITMIX_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
const SPLITMIX_MULTIPLIER_1: u64 = 0xBF58_476D_1CE4_E5B9;
const SPLITMIX_MULTIPLIER_2: u64 = 0x94D0_49BB_1331_11EB;
/// Spreads the seeds of successive PLE layers.
const LAYER_SEED_STRIDE: u64 = 10007;

/// The hashing fields of a Qwen4-Exp config.
#[derive(Debug, Clone, PartialEq)]
pub struct NgramHashSettings {
    /// Token vocabulary (`vocab_size`): bounds the multipliers.
    pub vocab_size: u64,
    /// Longest n-gram (`ngram_size`); orders 2 … ngram_size are hashed.
    pub ngram_size: usize,
    pub heads_per_ngram: usize,
    /// Head table sizes are the primes at or above this (`ngram_vocab_size_base`).
    pub ngram_vocab_size_base: u64,
    /// The summed table is padded to a multiple of this (`make_ngram_vocab_size_divisible_by`).
    pub table_rows_divisor: u64,
    pub seed: u64,
    pub eos_token_id: u32,
}

impl NgramHashSettings {
    /// Hashed heads per token: `(ngram_size − 1) · heads_per_ngram`.
    pub fn heads(&self) -> usize {
        self.ngram_size.saturating_sub(1) * self.heads_per_ngram
    }

    /// Ids a sequence carries between steps (`ngram_size − 1`).
    pub fn context_length(&self) -> usize {
        self.ngram_size.saturating_sub(1)
    }

    /// The carried ids at the start of a sequence: all EOS.
    pub fn sequence_start_context(&self) -> Vec<u32> {
        vec![self.eos_token_id; self.context_length()]
    }
}

/// One splitmix64 output step.
pub fn splitmix64(value: u64) -> u64 {
    let mut value = value.wrapping_add(SPLITMIX_GAMMA);
    value = (value ^ (value >> 30)).wrapping_mul(SPLITMIX_MULTIPLIER_1);
    value = (value ^ (value >> 27)).wrapping_mul(SPLITMIX_MULTIPLIER_2);
    value ^ (value >> 31)
}

/// The odd multipliers of PLE layer `ple_layer_index` (0-based among the PLE layers), one per
/// n-gram position; each is below `(2^63 − 1) / vocab_size`.
pub fn layer_multipliers(
    vocab_size: u64,
    ngram_size: usize,
    ple_layer_index: u64,
    seed: u64,
) -> Vec<u64> {
    let multiplier_max = (i64::MAX as u64) / vocab_size.max(1);
    let half_bound = (multiplier_max / 2).max(1);
    let base_seed = seed.wrapping_add(LAYER_SEED_STRIDE.wrapping_mul(ple_layer_index));
    (0..ngram_size as u64)
        .map(|index| {
            let value = base_seed.wrapping_add(SPLITMIX_GAMMA.wrapping_mul(index + 1));
            2 * (splitmix64(value) % half_bound) + 1
        })
        .collect()
}

pub use ninfer_artifact::config::{is_prime, ngram_head_table_sizes};

/// The tables of one PLE layer: multipliers, per-head table sizes and offsets, padded rows.
#[derive(Debug, Clone, PartialEq)]
pub struct NgramHashTables {
    pub multipliers: Vec<u64>,
    pub head_sizes: Vec<u64>,
    pub head_offsets: Vec<u64>,
    /// Rows of the layer's embedding table (sum of head sizes, padded).
    pub padded_rows: u64,
}

impl NgramHashTables {
    /// Tables of PLE layer `ple_layer_index`: its heads take the next primes after the earlier
    /// PLE layers' heads, counting from `ngram_vocab_size_base`.
    pub fn for_layer(
        settings: &NgramHashSettings,
        ple_layer_index: usize,
    ) -> Result<Self, EngineError> {
        if settings.ngram_size < 2 || settings.heads_per_ngram == 0 {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "PLE needs ngram_size ≥ 2 and heads_per_ngram ≥ 1 (got {} and {})",
                    settings.ngram_size, settings.heads_per_ngram
                ),
            });
        }
        if settings.vocab_size == 0 || settings.table_rows_divisor == 0 {
            return Err(EngineError::InvalidConfig {
                problem: "PLE needs a positive vocab_size and make_ngram_vocab_size_divisible_by"
                    .to_string(),
            });
        }
        let head_sizes = ngram_head_table_sizes(
            settings.ngram_vocab_size_base,
            settings.heads(),
            ple_layer_index,
        );
        let mut head_offsets = Vec::with_capacity(head_sizes.len());
        let mut total = 0u64;
        for size in &head_sizes {
            head_offsets.push(total);
            total += size;
        }
        let padded_rows = total.div_ceil(settings.table_rows_divisor) * settings.table_rows_divisor;
        Ok(Self {
            multipliers: layer_multipliers(
                settings.vocab_size,
                settings.ngram_size,
                ple_layer_index as u64,
                settings.seed,
            ),
            head_sizes,
            head_offsets,
            padded_rows,
        })
    }

    /// Row ids `[tokens.len(), heads]` (all bigram heads, then trigram heads, …) of `tokens`,
    /// following the carried `previous_context` (the sequence's last `ngram_size − 1` ids, or
    /// [`NgramHashSettings::sequence_start_context`]).
    pub fn row_ids(
        &self,
        settings: &NgramHashSettings,
        previous_context: &[u32],
        tokens: &[u32],
    ) -> Result<Vec<u64>, EngineError> {
        let context_length = settings.context_length();
        if previous_context.len() != context_length {
            return Err(EngineError::InvalidConfig {
                problem: format!(
                    "PLE carried context has {} ids, ngram_size − 1 is {context_length}",
                    previous_context.len()
                ),
            });
        }
        if let Some(&token) = tokens
            .iter()
            .chain(previous_context)
            .find(|&&token| u64::from(token) >= settings.vocab_size)
        {
            return Err(EngineError::TokenOutOfVocabulary {
                token,
                vocab_size: settings.vocab_size as usize,
            });
        }
        let eos = settings.eos_token_id;
        let history: Vec<u32> = previous_context.iter().chain(tokens).copied().collect();
        let mut row_ids = Vec::with_capacity(tokens.len() * settings.heads());
        let mut context = vec![eos; settings.ngram_size];
        for index in context_length..history.len() {
            // context[s] = the token s places back, or EOS once an EOS lies among the tokens
            // 1 … s places back. `index ≥ context_length` keeps every look-back in `history`.
            context[0] = history[index];
            let mut crossed_eos = false;
            for shift in 1..settings.ngram_size {
                let earlier = history[index - shift];
                crossed_eos |= earlier == eos;
                context[shift] = if crossed_eos { eos } else { earlier };
            }
            for order in 2..=settings.ngram_size {
                let mix = context[..order]
                    .iter()
                    .zip(&self.multipliers)
                    .fold(0u64, |mix, (&token, &multiplier)| {
                        mix ^ u64::from(token).wrapping_mul(multiplier)
                    });
                let first_head = (order - 2) * settings.heads_per_ngram;
                for head in first_head..first_head + settings.heads_per_ngram {
                    row_ids.push(mix % self.head_sizes[head] + self.head_offsets[head]);
                }
            }
        }
        Ok(row_ids)
    }
}
