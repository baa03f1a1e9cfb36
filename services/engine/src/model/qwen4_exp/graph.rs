//! The Qwen4-Exp (`qwen4_exp`) forward over [`Backend`]: the hyper-connection residual streams
//! with their low-rank mixers and gated injection, the PLE blocks (hashed n-gram rows gathered
//! from the host-RAM tables each step, a gated value and a dilated causal conv), QSA sparse
//! attention, and the model's usual Gated DeltaNet and MoE layers in between.
//!
//! Everything runs as backend ops, so on a GPU it runs there, except the PLE blocks' n-gram
//! rows: hashed from the token ids and gathered from the host-RAM tables on the host, while the
//! GPU works through the ops already queued, then one upload per PLE layer (`rows × embed`
//! floats). QSA attention is four backend ops (the cache append with block pooling, the
//! indexer queries, the block selection, the attention over the selected tokens). The residual
//! streams `[rows, n·H]`, their mixers, the PLE gate, norms and dilated conv (a plain causal
//! conv with its taps spread out), QSA, the Gated DeltaNet and MoE layers never leave the
//! device. The step graphs (one recorded decode step) are off for this model: the QSA ops and
//! the n-gram rows take per-step host uploads.
//!
//! Per sequence it keeps what transformers' cache slots carry: per QSA layer the keys and
//! values after norm and RoPE, the raw indexer keys and one pooled key per completed block; per
//! PLE layer the last `(kernel − 1) · ngram_size` normalised conv inputs (a backend conv state)
//! and the last `ngram_size − 1` token ids.
//!
//! Owns: the Qwen4-Exp weights beyond the shared layer types, their loading, the per-sequence
//! QSA and PLE states, and the layer loop of this architecture.
//! Must not touch: the Gated DeltaNet and MoE ops (the shared model code), op implementations.

use half::bf16;
use ninfer_artifact::{Artifact, OutputGateActivation, Qwen4ExpConfig};

use crate::backend::{Backend, NormStyle};
use crate::error::EngineError;
use crate::spec::MixerKind;

mod forward;

use super::ngram_hash::{NgramHashSettings, NgramHashTables};
use super::qsa_selection::QsaSelectionSettings;
use crate::model::loader::Loader;
use crate::model::qwen4_exp::ple_state::PleState;

/// One stream mixer: grouped zero-centred norm of the streams, a low-rank sigmoid gate per
/// feature, the streams' gated mean as the block input, and (in a layer) each stream's share
/// of the block output.
pub(crate) struct HyperConnection<B: Backend> {
    /// `[n·H]`, one `(1 + w)` weight per feature of every stream.
    norm: B::Weight,
    mix_down: B::Weight,
    mix_up: B::Weight,
    /// `[n, n·H]`; absent in the final mixer.
    inject: Option<B::Weight>,
}

/// The QSA indexer of an attention layer.
pub(crate) struct Indexer<B: Backend> {
    /// `[(heads + 1)·Di, H]`: the query heads, then the one key head.
    qk_proj: B::Weight,
    /// `[Di]` each, zero-centred RMSNorm weights of the query heads and the pooled keys.
    query_norm: B::Weight,
    key_norm: B::Weight,
}

/// A PLE layer's n-gram table: row shards as stored, in host RAM (the artifact's mapping).
pub(crate) struct NgramTable {
    /// Tensor name and first global row of each shard, in order.
    shards: Vec<(String, u64)>,
    rows: u64,
    width: usize,
    /// Whether the shards' pages are locked in RAM ([`lock_table_in_ram`]).
    locked_in_ram: bool,
}

/// At most this share of the machine's RAM is locked for the n-gram tables: past it (the
/// released table is ~100 GB in bf16) they stay mapped and the page cache keeps what is used.
const NGRAM_TABLE_LOCK_RAM_SHARE: f64 = 0.5;

/// Locks the pages of an n-gram table's shards (`bytes`) in RAM, so a step's row gather never
/// waits on the disk; says once per table why not where the table is too large for the RAM or
/// `mlock` is refused (`RLIMIT_MEMLOCK`). The mapping is the artifact's, shared page cache with
/// every process that maps it, so a locked table costs the RAM once.
fn lock_table_in_ram(prefix: &str, bytes: &[&[u8]]) -> bool {
    let total: usize = bytes.iter().map(|b| b.len()).sum();
    let ram = nix::sys::sysinfo::sysinfo().map(|info| info.ram_total());
    match ram {
        Ok(ram) if total as f64 <= ram as f64 * NGRAM_TABLE_LOCK_RAM_SHARE => {}
        Ok(ram) => {
            tracing::warn!(
                "n-gram table {prefix}: {total} bytes, more than half of the {ram} bytes of RAM; left mapped, not locked"
            );
            return false;
        }
        Err(error) => {
            tracing::warn!("n-gram table {prefix}: RAM size unknown ({error}); not locked");
            return false;
        }
    }
    for shard in bytes.iter().filter(|b| !b.is_empty()) {
        // SAFETY: mlock only pins pages of the artifact's live read-only mapping, which
        // outlives the model; it changes no byte.
        let locked =
            unsafe { nix::sys::mman::mlock(std::ptr::NonNull::from(*shard).cast(), shard.len()) };
        if let Err(error) = locked {
            tracing::warn!(
                "n-gram table {prefix}: cannot lock {total} bytes in RAM ({error}); running unlocked. Raise the limit: `LimitMEMLOCK=infinity` in the systemd unit, or `ulimit -l unlimited` in the shell"
            );
            return false;
        }
    }
    true
}

/// A PLE block.
pub(crate) struct Ple<B: Backend> {
    key_proj: B::Weight,
    value_proj: B::Weight,
    /// `[n·H]` each, `(1 + w)` weights per stream as the mixers' norms.
    norm_key: B::Weight,
    norm_query: B::Weight,
    norm_conv: B::Weight,
    /// The dilated conv as a plain causal conv: `[n·H, (kernel − 1)·ngram_size + 1]`, the
    /// stored taps `ngram_size` apart with zeros between them, the last on the current token
    /// (so [`Backend::causal_conv1d_silu`] runs it, its state holding the dilated history).
    conv: B::Weight,
    /// The plain conv's width, `(kernel − 1)·ngram_size + 1`.
    conv_width: usize,
    table: NgramTable,
    hash: NgramHashTables,
}

/// What a Qwen4-Exp layer has beyond the shared token mixer and feed-forward.
pub(crate) struct LayerExtras<B: Backend> {
    attn_hc: HyperConnection<B>,
    mlp_hc: HyperConnection<B>,
    indexer: Option<Indexer<B>>,
    ple: Option<Ple<B>>,
    /// The Gated DeltaNet output norm's weight on the host, when its gate is a sigmoid (the
    /// backend's gated norm multiplies by SiLU).
    sigmoid_gated_norm: Option<Vec<f32>>,
}

/// The Qwen4-Exp parts of a loaded model.
pub(crate) struct Qwen4ExpGraph<B: Backend> {
    config: Qwen4ExpConfig,
    qsa: QsaSelectionSettings,
    hash: Option<NgramHashSettings>,
    layers: Vec<LayerExtras<B>>,
    mixer: HyperConnection<B>,
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// A 1-D parameter read to the host, checked against its expected length.
fn host_vector(artifact: &Artifact, name: &str, length: usize) -> Result<Vec<f32>, EngineError> {
    let tensor = artifact
        .get(name)
        .ok_or_else(|| EngineError::InvalidWeight {
            name: name.to_string(),
            problem: "missing from the artifact".into(),
        })?;
    let values = tensor.to_f32_vec();
    if values.len() != length {
        return Err(EngineError::InvalidWeight {
            name: name.to_string(),
            problem: format!("{} values where the config implies {length}", values.len()),
        });
    }
    Ok(values)
}

impl NgramTable {
    /// The shards `{prefix}.shard_0 …` of one table, which must hold exactly `rows` rows of
    /// `width`.
    fn open(
        artifact: &Artifact,
        prefix: &str,
        rows: u64,
        width: usize,
    ) -> Result<Self, EngineError> {
        let mut shards = Vec::new();
        let mut total = 0u64;
        while let Some(shard) = artifact.get(&format!("{prefix}.shard_{}", shards.len())) {
            let name = shard.name().to_string();
            let shape = shard.shape();
            if shape.len() != 2 || shape[1] != width as u64 {
                return Err(EngineError::InvalidWeight {
                    name,
                    problem: format!("shape {shape:?} where rows of {width} are expected"),
                });
            }
            if shard.as_f32().is_none() && shard.as_bf16().is_none() {
                return Err(EngineError::InvalidWeight {
                    name,
                    problem: format!(
                        "stored as {}, an n-gram table must be f32 or bf16",
                        shard.dtype()
                    ),
                });
            }
            shards.push((name, total));
            total += shape[0];
        }
        if total != rows {
            return Err(EngineError::InvalidWeight {
                name: format!("{prefix}.shard_*"),
                problem: format!(
                    "{} shard(s) hold {total} rows, the n-gram hashing of the config needs {rows}",
                    shards.len()
                ),
            });
        }
        let bytes: Vec<&[u8]> = shards
            .iter()
            .filter_map(|(name, _)| artifact.get(name).map(|view| view.bytes))
            .collect();
        let locked_in_ram = lock_table_in_ram(prefix, &bytes);
        Ok(NgramTable {
            shards,
            rows,
            width,
            locked_in_ram,
        })
    }

    /// Appends the rows `ids` (in order) to `out`.
    fn gather(
        &self,
        artifact: &Artifact,
        ids: &[u64],
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        for &id in ids {
            if id >= self.rows {
                return Err(EngineError::InvalidConfig {
                    problem: format!("n-gram row {id} is past the table's {} rows", self.rows),
                });
            }
            let shard = self.shards.partition_point(|(_, first)| *first <= id) - 1;
            let (name, first) = &self.shards[shard];
            let view = artifact
                .get(name)
                .ok_or_else(|| EngineError::InvalidWeight {
                    name: name.clone(),
                    problem: "missing from the artifact".into(),
                })?;
            let start = (id - first) as usize * self.width;
            if let Some(values) = view.as_f32() {
                out.extend_from_slice(&values[start..start + self.width]);
            } else if let Some(values) = view.as_bf16() {
                out.extend(
                    values[start..start + self.width]
                        .iter()
                        .map(|v| bf16::to_f32(*v)),
                );
            }
        }
        Ok(())
    }
}

impl<B: Backend> Qwen4ExpGraph<B> {
    /// Whether every PLE layer's n-gram table is locked in RAM (true with no PLE layer).
    pub(crate) fn ngram_tables_locked_in_ram(&self) -> bool {
        self.layers
            .iter()
            .filter_map(|layer| layer.ple.as_ref())
            .all(|ple| ple.table.locked_in_ram)
    }

    /// Loads the Qwen4-Exp weights of every layer (layer `i`'s with `layer_loader(i)`, on its
    /// stage's backend) and the final mixer (with `head_loader`, beside the output head).
    pub(in crate::model) fn load<'a>(
        layer_loader: impl Fn(usize) -> Loader<'a, B>,
        head_loader: &Loader<'a, B>,
        config: &Qwen4ExpConfig,
        mixers: &[MixerKind],
    ) -> Result<Self, EngineError>
    where
        B: 'a,
    {
        let common = &config.hybrid.common;
        let invalid = |problem: String| EngineError::InvalidConfig { problem };
        if config.hyper_connection_streams < 2 || config.hyper_connection_rank == 0 {
            return Err(invalid(format!(
                "qwen4_exp needs at least 2 residual streams and a positive mixer rank (got {} and {})",
                config.hyper_connection_streams, config.hyper_connection_rank
            )));
        }
        let qsa = QsaSelectionSettings {
            budget: config.indexer_budget,
            compress_ratio: config.indexer_compress_ratio,
            index_heads: config.indexer_heads,
            index_head_dim: config.indexer_head_dim,
            rotary_dim: common.rotary_dim,
            rope_theta: common.rope_theta,
            norm_eps: common.rms_norm_eps as f32,
        };
        qsa.validate()?;
        let hash = if config.ple_layers.is_empty() {
            None
        } else {
            let eos_token_id = config.ngram_eos_token_id.ok_or_else(|| {
                invalid(
                    "qwen4_exp has PLE layers but no end-of-sequence id for the n-gram contexts"
                        .into(),
                )
            })?;
            Some(NgramHashSettings {
                vocab_size: common.vocab_size as u64,
                ngram_size: config.ngram_size,
                heads_per_ngram: config.heads_per_ngram,
                ngram_vocab_size_base: config.ngram_vocab_size_base,
                table_rows_divisor: config.ngram_table_rows_divisor,
                seed: config.ngram_seed,
                eos_token_id,
            })
        };
        let artifact = head_loader.artifact;
        let hidden = common.hidden_size;
        let streams_width = config.hyper_connection_streams * hidden;
        let mut layers = Vec::with_capacity(mixers.len());
        for (index, mixer) in mixers.iter().enumerate() {
            let loader = &layer_loader(index);
            let prefix = format!("layers.{index}");
            let indexer = match mixer {
                MixerKind::Attention => {
                    let (heads, width) = (config.indexer_heads, config.indexer_head_dim);
                    Some(Indexer {
                        qk_proj: loader.matrix(
                            &format!("{prefix}.attn.indexer.qk_proj"),
                            ((heads + 1) * width, hidden),
                        )?,
                        query_norm: loader
                            .parameter(&format!("{prefix}.attn.indexer.q_norm"), (1, width))?,
                        key_norm: loader
                            .parameter(&format!("{prefix}.attn.indexer.k_norm"), (1, width))?,
                    })
                }
                MixerKind::GatedDeltaNet => None,
            };
            let ple = match (config.ple_layers.iter().position(|&l| l == index), &hash) {
                (Some(ple_index), Some(hash)) => {
                    if *mixer != MixerKind::GatedDeltaNet {
                        return Err(invalid(format!(
                            "layer {index} has a PLE block but is not a linear-attention layer"
                        )));
                    }
                    let tables = NgramHashTables::for_layer(hash, ple_index)?;
                    let embed = config.ple_embed_dim;
                    let ple = |name: &str| format!("{prefix}.ple.{name}");
                    let kernel = config.ple_conv_kernel_size;
                    if kernel == 0 {
                        return Err(invalid(
                            "qwen4_exp has PLE layers with a conv kernel of size 0".into(),
                        ));
                    }
                    let dilation = config.ngram_size;
                    let conv_width = (kernel - 1) * dilation + 1;
                    let taps = host_vector(artifact, &ple("conv1d"), streams_width * kernel)?;
                    let mut spread = vec![0.0f32; streams_width * conv_width];
                    for (channel, channel_taps) in taps.chunks_exact(kernel).enumerate() {
                        for (tap, value) in channel_taps.iter().enumerate() {
                            spread[channel * conv_width + tap * dilation] = *value;
                        }
                    }
                    Some(Ple {
                        key_proj: loader.matrix(&ple("key_proj"), (streams_width, embed))?,
                        value_proj: loader.matrix(&ple("value_proj"), (hidden, embed))?,
                        norm_key: loader.parameter(&ple("norm_key"), (1, streams_width))?,
                        norm_query: loader.parameter(&ple("norm_query"), (1, streams_width))?,
                        norm_conv: loader.parameter(&ple("norm_conv"), (1, streams_width))?,
                        conv: loader.backend.parameter_from_values(
                            &spread,
                            streams_width,
                            conv_width,
                        )?,
                        conv_width,
                        table: NgramTable::open(
                            artifact,
                            &ple("ngram_embedding"),
                            tables.padded_rows,
                            config.ngram_row_width(),
                        )?,
                        hash: tables,
                    })
                }
                _ => None,
            };
            let sigmoid_gated_norm = match (mixer, config.output_gate) {
                (MixerKind::GatedDeltaNet, OutputGateActivation::Sigmoid) => Some(host_vector(
                    artifact,
                    &format!("{prefix}.gdn.norm"),
                    config.hybrid.linear_value_head_dim,
                )?),
                _ => None,
            };
            layers.push(LayerExtras {
                attn_hc: HyperConnection::load(loader, config, &format!("{prefix}.attn_hc"), true)?,
                mlp_hc: HyperConnection::load(loader, config, &format!("{prefix}.mlp_hc"), true)?,
                indexer,
                ple,
                sigmoid_gated_norm,
            });
        }
        Ok(Qwen4ExpGraph {
            config: config.clone(),
            qsa,
            hash,
            layers,
            mixer: HyperConnection::load(head_loader, config, "hc_mixer", false)?,
        })
    }

    fn streams(&self) -> usize {
        self.config.hyper_connection_streams
    }

    fn hidden(&self) -> usize {
        self.config.hybrid.common.hidden_size
    }

    fn eps(&self) -> f32 {
        self.config.hybrid.common.rms_norm_eps as f32
    }

    /// The PLE states of a new sequence, per layer (`None` where a layer has no PLE block),
    /// each on its layer's backend (`backend_of_layer`).
    pub(crate) fn new_ple_states<'b>(
        &self,
        backend_of_layer: impl Fn(usize) -> &'b B,
    ) -> Result<Vec<Option<PleState<B>>>, EngineError>
    where
        B: 'b,
    {
        let streams_width = self.streams() * self.hidden();
        self.layers
            .iter()
            .enumerate()
            .map(|(index, layer)| (backend_of_layer(index), layer))
            .map(|(backend, layer)| match (&layer.ple, &self.hash) {
                (Some(ple), Some(hash)) => Ok(Some(PleState {
                    conv: backend.new_conv_state(streams_width, ple.conv_width)?,
                    context: hash.sequence_start_context(),
                })),
                _ => Ok(None),
            })
            .collect()
    }

    /// Bytes one PLE state's conv history takes (f32, `conv_width − 1` rows of `n·H`), the
    /// largest over the PLE layers.
    pub(crate) fn ple_state_bytes(&self) -> usize {
        let streams_width = self.streams() * self.hidden();
        self.layers
            .iter()
            .filter_map(|layer| layer.ple.as_ref())
            .map(|ple| {
                streams_width * ple.conv_width.saturating_sub(1) * std::mem::size_of::<f32>()
            })
            .max()
            .unwrap_or(0)
    }

    /// The indexer settings every QSA layer shares.
    pub(crate) fn qsa_settings(&self) -> &QsaSelectionSettings {
        &self.qsa
    }

    /// The Gated DeltaNet output norm's host weight of `layer` when its gate is a sigmoid.
    pub(crate) fn sigmoid_gated_norm(&self, layer: usize) -> Option<&[f32]> {
        self.layers.get(layer)?.sigmoid_gated_norm.as_deref()
    }
}

impl<B: Backend> HyperConnection<B> {
    fn load(
        loader: &Loader<'_, B>,
        config: &Qwen4ExpConfig,
        prefix: &str,
        with_injection: bool,
    ) -> Result<Self, EngineError> {
        let streams = config.hyper_connection_streams;
        let width = streams * config.hybrid.common.hidden_size;
        let rank = config.hyper_connection_rank;
        Ok(HyperConnection {
            norm: loader.parameter(&format!("{prefix}.norm"), (1, width))?,
            mix_down: loader.matrix(&format!("{prefix}.mix_down"), (rank, width))?,
            mix_up: loader.matrix(&format!("{prefix}.mix_up"), (width, rank))?,
            inject: if with_injection {
                Some(loader.matrix(&format!("{prefix}.inject"), (streams, width))?)
            } else {
                None
            },
        })
    }

    /// The block input `[rows, H]` of `streams` `[rows, n·H]` and, with injection weights, the
    /// logits of each stream's share of the block output `[rows, n]` (the share is
    /// `2·sigmoid(·/n)`, [`Backend::inject_into_streams`]). All backend ops: the streams stay
    /// where the backend computes.
    fn mix(
        &self,
        backend: &B,
        graph: &Qwen4ExpGraph<B>,
        streams: &B::Tensor,
    ) -> Result<(B::Tensor, Option<B::Tensor>), EngineError> {
        let (count, hidden) = (graph.streams(), graph.hidden());
        let scale = 1.0 / count as f32;
        let normed = backend.row_weighted_rms_norm(
            streams,
            &self.norm,
            hidden,
            graph.eps(),
            NormStyle::ZeroCentred,
        )?;
        let down = backend.scaled_silu(&backend.matmul(&normed, &self.mix_down)?, scale)?;
        let up = backend.matmul(&down, &self.mix_up)?;
        let mixed = backend.stream_mix(&normed, &up, count, scale)?;
        let shares = match &self.inject {
            Some(inject) => Some(backend.matmul(&normed, inject)?),
            None => None,
        };
        Ok((mixed, shares))
    }
}

/// The Gated DeltaNet output norm with a sigmoid gate: per value head, plain-weight RMSNorm
/// times `sigmoid(z)`.
pub fn sigmoid_gated_rms_norm(x: &[f32], gate: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let width = weight.len();
    let mut out = Vec::with_capacity(x.len());
    for (head, gate) in x.chunks_exact(width).zip(gate.chunks_exact(width)) {
        let mean_square = head.iter().map(|v| v * v).sum::<f32>() / width as f32;
        let inverse = 1.0 / (mean_square + eps).sqrt();
        out.extend(
            head.iter()
                .zip(weight)
                .zip(gate)
                .map(|((v, w), z)| v * inverse * w * sigmoid(*z)),
        );
    }
    out
}

/// [`sigmoid_gated_rms_norm`] through backend ops, for a backend that computes off the host:
/// the plain-weight RMSNorm per value head, then `⊙ sigmoid(z)`, so the tensors stay where the
/// backend computes (the host function would cost two read-backs and an upload per Gated
/// DeltaNet layer). Same formula; the backend's norm may round differently in the last bit,
/// which is why the CPU backend keeps the host function.
pub fn sigmoid_gated_rms_norm_by_ops<B: Backend>(
    backend: &B,
    x: &B::Tensor,
    gate: &B::Tensor,
    weight: &B::Weight,
    eps: f32,
) -> Result<B::Tensor, EngineError> {
    let normed = backend.rms_norm(x, weight, eps, NormStyle::Plain)?;
    backend.mul_sigmoid(&normed, gate)
}
