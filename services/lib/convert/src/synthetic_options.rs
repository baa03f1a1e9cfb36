//! What a synthetic model is asked for: the preset, the routing its router rows follow (uniform,
//! Zipf or the trained fixture's), the seed, dtypes and layer count.
//!
//! Owns: [`SyntheticOptions`] and [`Routing`]. Must not touch: generating or writing.

use std::path::PathBuf;
use std::str::FromStr;

use ninfer_artifact::DType;

use crate::error::ConvertError;
use crate::synthetic_presets::Preset;
use crate::synthetic_tokenizer::SyntheticTokenizer;

/// How the router weights are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing {
    /// Expert popularity per layer follows a Zipf law with this exponent (a trained model's skew).
    Zipf { exponent: f64 },
    /// Plain random router weights: every expert about equally popular.
    Uniform,
    /// Expert popularity per layer follows the rank profile measured on the trained fixture
    /// (`tests/fixtures/qwen3_5_moe_trained`, held-out Python code and documentation), stretched
    /// to the preset's expert count and depth.
    Trained,
}

impl Default for Routing {
    fn default() -> Self {
        Routing::Zipf { exponent: 1.0 }
    }
}

impl std::fmt::Display for Routing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Routing::Zipf { exponent } => write!(f, "zipf:{exponent}"),
            Routing::Uniform => f.write_str("uniform"),
            Routing::Trained => f.write_str("trained"),
        }
    }
}

impl FromStr for Routing {
    type Err = ConvertError;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let invalid = |why: &str| {
            ConvertError::InvalidOption {
            option: "--routing",
            problem: format!(
                "`{text}` {why} (valid: `zipf`, `zipf:S` with an exponent S in (0, 8], `uniform`, `trained`)"
            ),
        }
        };
        match text {
            "uniform" => Ok(Routing::Uniform),
            "trained" => Ok(Routing::Trained),
            "zipf" => Ok(Routing::default()),
            _ => {
                let Some(exponent) = text.strip_prefix("zipf:") else {
                    return Err(invalid("is not a routing mode"));
                };
                match exponent.parse::<f64>() {
                    Ok(s) if s > 0.0 && s <= 8.0 => Ok(Routing::Zipf { exponent: s }),
                    _ => Err(invalid("has no valid exponent")),
                }
            }
        }
    }
}

/// What to generate and where.
#[derive(Debug, Clone)]
pub struct SyntheticOptions {
    pub preset: Preset,
    pub output: PathBuf,
    pub experts_dtype: DType,
    pub dense_dtype: DType,
    /// Decoder layers to keep (the first `N`, so the layer-type pattern is the model's); all when
    /// `None`.
    pub layers: Option<usize>,
    pub routing: Routing,
    pub seed: u64,
    pub max_file_bytes: Option<u64>,
    /// Generator threads (default: the available cores).
    pub threads: Option<usize>,
    /// The tokenizer files and generation defaults the artifact carries; `None`: the fixtures'
    /// small built-in tokenizer.
    pub tokenizer: Option<SyntheticTokenizer>,
    /// The head always ranks `<|im_end|>` first, so every answer ends at once (for tests of
    /// clients that need a finished turn; the model is random either way).
    pub ends_turns: bool,
}

/// Default `--seed`.
pub const DEFAULT_SEED: u64 = 0x6e69_6e66_6572;

impl SyntheticOptions {
    pub fn new(preset: Preset, output: impl Into<PathBuf>) -> Self {
        SyntheticOptions {
            preset,
            output: output.into(),
            experts_dtype: DType::Bf16,
            dense_dtype: DType::Bf16,
            layers: None,
            routing: Routing::default(),
            seed: DEFAULT_SEED,
            max_file_bytes: None,
            threads: None,
            tokenizer: None,
            ends_turns: false,
        }
    }
}
