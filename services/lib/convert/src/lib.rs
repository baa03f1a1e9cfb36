//! `ninfer convert`: Hugging Face checkpoint directory → `.ninfer` artifact.
//!
//! Owns: reading `config.json` / `*.safetensors` / tokenizer files, mapping checkpoint tensor
//! names onto the artifact's internal names, re-laying and quantizing weights while streaming;
//! random-weight artifacts with released models' shapes (`synthetic`), planned the same way.
//! Must not touch: the artifact's byte layout (it goes through `ninfer-artifact`'s writer), model
//! math, processes.

mod error;
mod hf_config;
mod plan;
mod plan_layers;
mod plan_model;
mod progress;
mod routing_locality;
mod safetensors_file;
mod side_files;
mod source;
pub mod synthetic;
mod synthetic_options;
mod synthetic_presets;
pub mod synthetic_tokenizer;
mod synthetic_weights;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ninfer_artifact::quant::{f32_to_bf16_bytes, f32_to_bytes, quantize_matrix, QuantizedLayout};
use ninfer_artifact::{
    Artifact, ArtifactWriter, DType, ModelConfig, SourceInfo, TensorClass, TensorSpec,
    WriterOptions,
};

pub use error::ConvertError;
pub use hf_config::{read_config, ParsedConfig};
use plan::{
    DTypeChoice, ExpertSource, PlannedBank, PlannedItem, PlannedTensor, RowSelection, SourceNames,
};
use plan_model::build_plan;
pub use progress::{ConvertProgress, NoProgress};
use safetensors_file::{Checkpoint, SourceDType};
pub use source::{ByteRange, RangeSource, RemoteShard};
pub use synthetic::{write_synthetic, Preset, Routing, SyntheticOptions, PRESETS};

/// What to convert and how.
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    pub input_dir: PathBuf,
    pub output: PathBuf,
    pub experts_dtype: DType,
    /// `bf16` or `f32` for embeddings and dense matrices (1-D tensors are always f32).
    pub dense_dtype: DType,
    /// Split the output into parts of at most this many bytes.
    pub max_file_bytes: Option<u64>,
    /// Copy tensors that already exist (same name, dtype, shape) from this artifact. It must
    /// be a conversion of the same model: same architecture and normalised config (the MTP
    /// layer count aside, so MTP can be added later); anything else is refused.
    pub reuse: Option<PathBuf>,
    pub skip_vision: bool,
}

impl ConvertOptions {
    /// Options with the defaults of the CLI (bf16 experts and dense weights, one file).
    pub fn new(input_dir: impl Into<PathBuf>, output: impl Into<PathBuf>) -> Self {
        ConvertOptions {
            input_dir: input_dir.into(),
            output: output.into(),
            experts_dtype: DType::Bf16,
            dense_dtype: DType::Bf16,
            max_file_bytes: None,
            reuse: None,
            skip_vision: false,
        }
    }
}

/// What a finished conversion produced.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    pub files: Vec<PathBuf>,
    pub architecture: String,
    pub tensors_written: u64,
    pub tensors_reused: u64,
    pub bytes: u64,
    pub notes: Vec<String>,
}

/// Converts a checkpoint directory into an artifact. On any error, no output file is left.
pub fn convert_checkpoint(
    options: &ConvertOptions,
    progress: &dyn ConvertProgress,
) -> Result<ConvertReport, ConvertError> {
    check_dense_dtype(options)?;
    let checkpoint = Checkpoint::open(&options.input_dir)?;
    convert_from(options, &checkpoint, false, progress)
}

/// Converts a checkpoint whose shards `source` serves by range (`options.input_dir` holds its
/// config and tokenizer files). Every range is announced to `source` in reading order before
/// the first read. The conversion is resumable: it writes under stable temporary names with a
/// journal (`ArtifactWriter::create_resumable`), and a run stopped by a fetch error or an
/// interruption leaves them for the next run of the same conversion, which continues after
/// the last checkpoint. Any other error leaves no output file.
pub fn convert_remote_checkpoint(
    options: &ConvertOptions,
    shards: &[RemoteShard],
    source: Arc<dyn RangeSource>,
    progress: &dyn ConvertProgress,
) -> Result<ConvertReport, ConvertError> {
    check_dense_dtype(options)?;
    let checkpoint = Checkpoint::remote(&options.input_dir, shards, Some(source))?;
    convert_from(options, &checkpoint, true, progress)
}

/// What converting a remote checkpoint will write and read, from its headers alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConversionSize {
    /// Bytes of the artifact's tensors (its files and header add a little).
    pub output_bytes: u64,
    /// Bytes read from the checkpoint's shards.
    pub read_bytes: u64,
    /// The largest single read (a cache must hold at least this).
    pub largest_read: u64,
}

/// The size of converting the remote checkpoint `shards` with `options`, without reading it.
pub fn remote_conversion_size(
    options: &ConvertOptions,
    shards: &[RemoteShard],
) -> Result<ConversionSize, ConvertError> {
    check_dense_dtype(options)?;
    let checkpoint = Checkpoint::remote(&options.input_dir, shards, None)?;
    let (_, plan) = plan_of(options, &checkpoint)?;
    let reads = planned_reads(&plan, &checkpoint, |_| false, |_, _| false)?;
    Ok(ConversionSize {
        output_bytes: planned_output_bytes(&checkpoint, &plan)?,
        read_bytes: reads.iter().map(ByteRange::len).sum(),
        largest_read: reads.iter().map(ByteRange::len).max().unwrap_or(0),
    })
}

fn check_dense_dtype(options: &ConvertOptions) -> Result<(), ConvertError> {
    if !matches!(options.dense_dtype, DType::Bf16 | DType::F32) {
        return Err(ConvertError::Input {
            file: options.output.clone(),
            problem: format!(
                "--dense-dtype must be bf16 or f32, not {}",
                options.dense_dtype
            ),
        });
    }
    Ok(())
}

/// The normalised model and the checked plan of a checkpoint.
fn plan_of(
    options: &ConvertOptions,
    checkpoint: &Checkpoint,
) -> Result<(ModelConfig, plan::Plan), ConvertError> {
    let parsed = read_config(&options.input_dir)?;
    let mut model = parsed.model.clone();
    let mut names = SourceNames::new(checkpoint);
    let plan = build_plan(
        &model,
        &mut names,
        DTypeChoice {
            experts: options.experts_dtype,
            dense: options.dense_dtype,
        },
        options.skip_vision,
    )?;
    if let Some(c) = model.hybrid_mut() {
        c.mtp_num_layers = plan.mtp_layers;
    }
    Ok((model, plan))
}

/// What identifies a conversion for resuming: its options, model and source tensors.
fn resume_key(options: &ConvertOptions, model: &ModelConfig, checkpoint: &Checkpoint) -> String {
    let mut text = format!(
        "{} {} {:?} {:?} {}\n{:?}\n",
        options.experts_dtype,
        options.dense_dtype,
        options.max_file_bytes,
        options.reuse,
        options.skip_vision,
        model
    );
    for tensor in checkpoint.tensors.values() {
        text.push_str(&format!(
            "{} {} {:?} {:?} {}..{}\n",
            tensor.name, tensor.shard, tensor.dtype, tensor.shape, tensor.start, tensor.end
        ));
    }
    format!(
        "ninfer {} {}",
        env!("CARGO_PKG_VERSION"),
        ninfer_artifact::Checksum::of(text.as_bytes())
    )
}

fn convert_from(
    options: &ConvertOptions,
    checkpoint: &Checkpoint,
    resumable: bool,
    progress: &dyn ConvertProgress,
) -> Result<ConvertReport, ConvertError> {
    let parsed = read_config(&options.input_dir)?;
    let (model, plan) = plan_of(options, checkpoint)?;
    let mut side = side_files::read_side_files(&options.input_dir, progress)?;
    if options.skip_vision {
        // Without its tensors the vision tower's settings would only mislead a reader.
        side.vision_config_json = None;
        side.preprocessor_config_json = None;
        side.video_preprocessor_config_json = None;
    }
    let reuse = match &options.reuse {
        Some(path) => {
            let old = Artifact::open(path)?;
            check_same_model(path, old.config(), &options.input_dir, &model)?;
            Some(old)
        }
        None => None,
    };

    let total_tensors: u64 = plan
        .items
        .iter()
        .map(|item| match item {
            PlannedItem::Tensor(_) => 1,
            PlannedItem::Bank(bank) => 2 * bank.experts.len() as u64,
        })
        .sum();
    progress.start(total_tensors);
    for note in &plan.notes {
        progress.note(note);
    }

    let writer_options = WriterOptions {
        max_part_bytes: options.max_file_bytes,
    };
    let mut writer = if resumable {
        let key = resume_key(options, &model, checkpoint);
        ArtifactWriter::create_resumable(&options.output, writer_options, &key)?
    } else {
        ArtifactWriter::create(&options.output, writer_options)?
    };
    let mut run = Run {
        checkpoint,
        reuse: reuse.as_ref(),
        progress,
        written: 0,
        reused: 0,
        since_checkpoint: 0,
        // About a hundred checkpoints per conversion, at most a GiB of output apart: a
        // resumed run redoes at most that much.
        checkpoint_every: (planned_output_bytes(checkpoint, &plan)? / 100).min(1 << 30),
    };
    if writer.resumed() {
        progress.note(&format!(
            "resuming an interrupted conversion of {} at byte {}",
            options.output.display(),
            writer.position()
        ));
    }
    let body = run.write_all(&mut writer, &plan, &side);
    if let Err(error) = body {
        writer.keep_for_resume(error.is_resumable());
        return Err(error);
    }
    let (written, reused) = (run.written, run.reused);
    if reuse.is_some() {
        progress.note(&format!(
            "reused {reused} tensor(s) from the old artifact, converted {written}"
        ));
    }
    let bytes = writer.position();
    let mut source_options = BTreeMap::new();
    source_options.insert("experts_dtype".into(), options.experts_dtype.to_string());
    source_options.insert("dense_dtype".into(), options.dense_dtype.to_string());
    source_options.insert("skip_vision".into(), options.skip_vision.to_string());
    let files = writer.finish(
        model.clone(),
        side.generation,
        SourceInfo {
            converter: format!("ninfer {}", env!("CARGO_PKG_VERSION")),
            model_type: parsed.model_type.clone(),
            options: source_options,
        },
    )?;
    Ok(ConvertReport {
        files,
        architecture: model.architecture().to_string(),
        tensors_written: written,
        tensors_reused: reused,
        bytes,
        notes: plan.notes.clone(),
    })
}

/// Bytes of every tensor the plan writes.
fn planned_output_bytes(checkpoint: &Checkpoint, plan: &plan::Plan) -> Result<u64, ConvertError> {
    let mut total = 0;
    for item in &plan.items {
        total += match item {
            PlannedItem::Tensor(tensor) => tensor_bytes(checkpoint, &tensor_spec(tensor))?,
            PlannedItem::Bank(bank) => {
                let (gate_up, down) = bank_tensor_bytes(checkpoint, bank)?;
                bank.experts.len() as u64 * (gate_up + down)
            }
        };
    }
    Ok(total)
}

/// The artifact spec of a planned (non-expert) tensor.
fn tensor_spec(tensor: &PlannedTensor) -> TensorSpec {
    TensorSpec {
        name: tensor.name.clone(),
        class: tensor.class,
        dtype: tensor.dtype,
        shape: tensor.shape.clone(),
        quantization: None,
    }
}

fn tensor_bytes(checkpoint: &Checkpoint, spec: &TensorSpec) -> Result<u64, ConvertError> {
    ninfer_artifact::writer::expected_tensor_bytes(spec).map_err(|problem| ConvertError::Input {
        file: checkpoint.directory.clone(),
        problem: format!("tensor `{}`: {problem}", spec.name),
    })
}

/// The bytes of one expert's `gate_up` and `down` tensors in a bank.
fn bank_tensor_bytes(
    checkpoint: &Checkpoint,
    bank: &PlannedBank,
) -> Result<(u64, u64), ConvertError> {
    let (h, im) = (bank.hidden_size as u64, bank.intermediate_size as u64);
    Ok((
        tensor_bytes(checkpoint, &expert_spec(bank, 0, "gate_up", &[2 * im, h])?)?,
        tensor_bytes(checkpoint, &expert_spec(bank, 0, "down", &[h, im])?)?,
    ))
}

/// Every range the conversion reads, in order: a whole tensor per planned tensor and per
/// per-expert matrix, one slice per expert of a fused bank. `tensor_done` and `expert_done`
/// (bank, index) name what is not read (reused or written before a resume). `Run` reads exactly
/// these, in this order.
fn planned_reads(
    plan: &plan::Plan,
    checkpoint: &Checkpoint,
    tensor_done: impl Fn(&PlannedTensor) -> bool,
    expert_done: impl Fn(&PlannedBank, usize) -> bool,
) -> Result<Vec<ByteRange>, ConvertError> {
    let whole = |name: &String| {
        let tensor = &checkpoint.tensors[name];
        checkpoint.range_of(tensor, 0, tensor.element_count() as usize)
    };
    let mut reads = Vec::new();
    for item in &plan.items {
        match item {
            PlannedItem::Tensor(tensor) => {
                if !tensor_done(tensor) {
                    reads.push(whole(&tensor.source));
                }
            }
            PlannedItem::Bank(bank) => {
                let (h, im) = (bank.hidden_size, bank.intermediate_size);
                for (index, expert) in bank.experts.iter().enumerate() {
                    if expert_done(bank, index) {
                        continue;
                    }
                    match expert {
                        ExpertSource::PerExpert { gate, up, down } => {
                            reads.extend([whole(gate), whole(up), whole(down)]);
                        }
                        ExpertSource::Fused {
                            gate_up,
                            down,
                            index,
                        } => {
                            let (per_gate_up, per_down) = (2 * im * h, h * im);
                            reads.push(checkpoint.range_of(
                                &checkpoint.tensors[gate_up],
                                index * per_gate_up,
                                per_gate_up,
                            ));
                            reads.push(checkpoint.range_of(
                                &checkpoint.tensors[down],
                                index * per_down,
                                per_down,
                            ));
                        }
                    }
                }
            }
        }
    }
    Ok(reads)
}

struct Run<'a> {
    checkpoint: &'a Checkpoint,
    reuse: Option<&'a Artifact>,
    progress: &'a dyn ConvertProgress,
    written: u64,
    reused: u64,
    /// Output bytes since the resumable writer's last checkpoint, and the interval.
    since_checkpoint: u64,
    checkpoint_every: u64,
}

impl Run<'_> {
    fn check_cancel(&self) -> Result<(), ConvertError> {
        if self.progress.cancelled() {
            return Err(ConvertError::Interrupted);
        }
        Ok(())
    }

    /// Everything but the header: embedded files, then each planned item (skipping what a
    /// resumed writer holds already).
    fn write_all(
        &mut self,
        writer: &mut ArtifactWriter,
        plan: &plan::Plan,
        side: &side_files::SideFiles,
    ) -> Result<(), ConvertError> {
        if let Some(source) = self.checkpoint.range_source() {
            let reads = planned_reads(
                plan,
                self.checkpoint,
                |tensor| {
                    let spec = tensor_spec(tensor);
                    writer.has_tensor(&spec.name) || reusable(self.reuse, &spec).is_some()
                },
                |bank, index| self.expert_done(writer, bank, index),
            )?;
            source.announce(&reads)?;
        }
        let files = [
            ("tokenizer.json", side.tokenizer_json.as_deref()),
            (
                "tokenizer_config.json",
                side.tokenizer_config_json.as_deref(),
            ),
            (
                "chat_template.jinja",
                side.chat_template.as_ref().map(|text| text.as_bytes()),
            ),
            // The vision tower's settings travel with its tensors.
            ("vision_config.json", side.vision_config_json.as_deref()),
            (
                "preprocessor_config.json",
                side.preprocessor_config_json.as_deref(),
            ),
            (
                "video_preprocessor_config.json",
                side.video_preprocessor_config_json.as_deref(),
            ),
        ];
        for (name, bytes) in files {
            if let Some(bytes) = bytes.filter(|_| !writer.has_file(name)) {
                writer.add_file(name, bytes)?;
            }
        }
        for item in &plan.items {
            match item {
                PlannedItem::Tensor(tensor) => self.write_tensor(writer, tensor)?,
                PlannedItem::Bank(bank) => self.write_bank(writer, bank)?,
            }
        }
        Ok(())
    }

    /// Whether expert `index` of `bank` needs no reading: written before a resume, or reused.
    fn expert_done(&self, writer: &ArtifactWriter, bank: &PlannedBank, index: usize) -> bool {
        if writer.has_bank(&bank.prefix)
            || writer
                .open_bank_experts(&bank.prefix)
                .is_some_and(|written| (index as u64) < written)
        {
            return true;
        }
        let (h, im) = (bank.hidden_size as u64, bank.intermediate_size as u64);
        match (
            expert_spec(bank, index, "gate_up", &[2 * im, h]),
            expert_spec(bank, index, "down", &[h, im]),
        ) {
            (Ok(gate_up), Ok(down)) => {
                reusable(self.reuse, &gate_up).is_some() && reusable(self.reuse, &down).is_some()
            }
            _ => false,
        }
    }

    /// Output written since the last checkpoint; a resumable writer records its progress
    /// every `checkpoint_every` bytes.
    fn advance(&mut self, writer: &mut ArtifactWriter, bytes: u64) -> Result<(), ConvertError> {
        self.since_checkpoint += bytes;
        if self.since_checkpoint >= self.checkpoint_every {
            writer.checkpoint()?;
            self.since_checkpoint = 0;
        }
        Ok(())
    }

    fn write_tensor(
        &mut self,
        writer: &mut ArtifactWriter,
        tensor: &PlannedTensor,
    ) -> Result<(), ConvertError> {
        self.check_cancel()?;
        let spec = tensor_spec(tensor);
        if writer.has_tensor(&spec.name) {
            self.progress.tensor_written(&tensor.name, 0);
            return Ok(());
        }
        if let Some(bytes) = reusable(self.reuse, &spec) {
            writer.add_tensor(spec, bytes)?;
            self.reused += 1;
            self.progress
                .tensor_written(&tensor.name, bytes.len() as u64);
            return self.advance(writer, bytes.len() as u64);
        }
        let source = &self.checkpoint.tensors[&tensor.source];
        let raw_copy = matches!(tensor.rows, RowSelection::All)
            && matches!(
                (source.dtype, tensor.dtype),
                (SourceDType::F32, DType::F32) | (SourceDType::Bf16, DType::Bf16)
            );
        let bytes = if raw_copy {
            // Bit-exact, and no f32 copy of a large embedding.
            self.checkpoint.bytes(source)?.into_owned()
        } else {
            let whole = self.checkpoint.read_f32(source)?;
            let values = match &tensor.rows {
                RowSelection::All => whole,
                RowSelection::Rows(rows) => {
                    let row_len = (source.element_count() / source.shape[0]) as usize;
                    let mut values = Vec::with_capacity(rows.len() * row_len);
                    for &row in rows {
                        let Some(slice) = whole.get(row * row_len..(row + 1) * row_len) else {
                            return Err(ConvertError::Input {
                                file: self.checkpoint.shard_path(source).to_path_buf(),
                                problem: format!("tensor `{}` has no row {row}", source.name),
                            });
                        };
                        values.extend_from_slice(slice);
                    }
                    values
                }
            };
            encode_float(&values, tensor.dtype)
        };
        let length = bytes.len() as u64;
        writer.add_tensor(spec, &bytes)?;
        self.checkpoint.release(source);
        self.written += 1;
        self.progress.tensor_written(&tensor.name, length);
        self.advance(writer, length)
    }

    fn write_bank(
        &mut self,
        writer: &mut ArtifactWriter,
        bank: &PlannedBank,
    ) -> Result<(), ConvertError> {
        if writer.has_bank(&bank.prefix) {
            for _ in &bank.experts {
                self.progress.tensor_written(&bank.prefix, 0);
            }
            return Ok(());
        }
        let (h, im) = (bank.hidden_size, bank.intermediate_size);
        let gate_up_shape = vec![2 * im as u64, h as u64];
        let down_shape = vec![h as u64, im as u64];
        let (gate_up_bytes, down_bytes) = bank_tensor_bytes(self.checkpoint, bank)?;
        let already = match writer.open_bank_experts(&bank.prefix) {
            Some(written) => written as usize,
            None => {
                writer.begin_expert_bank(
                    &bank.prefix,
                    bank.class,
                    bank.dtype,
                    bank.experts.len() as u64,
                    gate_up_bytes,
                    down_bytes,
                )?;
                0
            }
        };
        for (index, expert) in bank.experts.iter().enumerate() {
            self.check_cancel()?;
            if index < already {
                self.progress.tensor_written(&bank.prefix, 0);
                continue;
            }
            let gate_up = expert_spec(bank, index, "gate_up", &gate_up_shape)?;
            let down = expert_spec(bank, index, "down", &down_shape)?;
            if let (Some(old_gate_up), Some(old_down)) =
                (reusable(self.reuse, &gate_up), reusable(self.reuse, &down))
            {
                writer.add_expert(gate_up, old_gate_up, down, old_down)?;
                self.reused += 2;
                self.progress
                    .tensor_written(&bank.prefix, gate_up_bytes + down_bytes);
                self.advance(writer, gate_up_bytes + down_bytes)?;
                continue;
            }
            let (gate_up_values, down_values) = self.read_expert(expert, h, im)?;
            let gate_up_encoded = encode_expert(&gate_up_values, bank.dtype, 2 * im, h);
            let down_encoded = encode_expert(&down_values, bank.dtype, h, im);
            writer.add_expert(gate_up, &gate_up_encoded, down, &down_encoded)?;
            self.written += 2;
            self.progress
                .tensor_written(&bank.prefix, gate_up_bytes + down_bytes);
            self.advance(writer, gate_up_bytes + down_bytes)?;
        }
        writer.end_expert_bank()?;
        Ok(())
    }

    /// One expert's `[gate; up]` `[2Im, H]` and `down` `[H, Im]` as f32.
    fn read_expert(
        &self,
        expert: &ExpertSource,
        h: usize,
        im: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), ConvertError> {
        let tensors = &self.checkpoint.tensors;
        match expert {
            ExpertSource::PerExpert { gate, up, down } => {
                let mut gate_up = self.checkpoint.read_f32(&tensors[gate])?;
                gate_up.extend(self.checkpoint.read_f32(&tensors[up])?);
                let down_values = self.checkpoint.read_f32(&tensors[down])?;
                for name in [gate, up, down] {
                    self.checkpoint.release(&tensors[name]);
                }
                Ok((gate_up, down_values))
            }
            ExpertSource::Fused {
                gate_up,
                down,
                index,
            } => {
                let per_gate_up = 2 * im * h;
                let per_down = h * im;
                Ok((
                    self.checkpoint.read_f32_range(
                        &tensors[gate_up],
                        index * per_gate_up,
                        per_gate_up,
                    )?,
                    self.checkpoint
                        .read_f32_range(&tensors[down], index * per_down, per_down)?,
                ))
            }
        }
    }
}

/// `--reuse` copies tensors by name: an artifact of another model (architecture or config)
/// would put its weights into this one, so it is refused. The MTP layer count may differ (an
/// old artifact made without MTP is how MTP gets added).
fn check_same_model(
    reuse_path: &Path,
    old: &ModelConfig,
    input_dir: &Path,
    new: &ModelConfig,
) -> Result<(), ConvertError> {
    let without_mtp = |config: &ModelConfig| {
        let mut config = config.clone();
        if let Some(c) = config.hybrid_mut() {
            c.mtp_num_layers = 0;
        }
        config
    };
    if without_mtp(old) == without_mtp(new) {
        return Ok(());
    }
    let describe = |config: &ModelConfig| {
        let common = config.common();
        format!(
            "{}, {} layers, hidden {}, {} experts",
            config.architecture(),
            common.num_hidden_layers,
            common.hidden_size,
            common.num_experts
        )
    };
    Err(ConvertError::Input {
        file: reuse_path.to_path_buf(),
        problem: format!(
            "--reuse needs an artifact of the same model, but this one holds a different model ({}) than {} ({})",
            describe(old),
            input_dir.display(),
            describe(new)
        ),
    })
}

/// The bytes of an identical tensor in the `--reuse` artifact, checksum-verified.
fn reusable<'r>(reuse: Option<&'r Artifact>, spec: &TensorSpec) -> Option<&'r [u8]> {
    let old = reuse?.get(&spec.name)?;
    let same = old.entry.dtype == spec.dtype
        && old.entry.shape == spec.shape
        && old.entry.quantization == spec.quantization;
    (same && ninfer_artifact::Checksum::of(old.bytes) == old.entry.checksum).then_some(old.bytes)
}

fn expert_spec(
    bank: &PlannedBank,
    index: usize,
    which: &str,
    shape: &[u64],
) -> Result<TensorSpec, ConvertError> {
    let quantization = if bank.dtype.is_quantized() {
        let layout = QuantizedLayout::new(bank.dtype, shape[0] as usize, shape[1] as usize)
            .map_err(|problem| ConvertError::Input {
                file: PathBuf::from(&bank.prefix),
                problem,
            })?;
        Some(layout.params())
    } else {
        None
    };
    Ok(TensorSpec {
        name: format!("{}.{index}.{which}", bank.prefix),
        class: bank.class,
        dtype: bank.dtype,
        shape: shape.to_vec(),
        quantization,
    })
}

fn encode_float(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::Bf16 => f32_to_bf16_bytes(values),
        _ => f32_to_bytes(values),
    }
}

fn encode_expert(values: &[f32], dtype: DType, rows: usize, cols: usize) -> Vec<u8> {
    match dtype {
        DType::Int8 | DType::Int4 => match QuantizedLayout::new(dtype, rows, cols) {
            Ok(layout) => quantize_matrix(values, &layout),
            // Any width quantizes (a last partial group is padded); only a float dtype is
            // refused, and this arm has none.
            Err(_) => Vec::new(),
        },
        other => encode_float(values, other),
    }
}

/// Tensor classes in the order `inspect` prints them.
pub const CLASS_ORDER: [TensorClass; 8] = [
    TensorClass::Embedding,
    TensorClass::Dense,
    TensorClass::DenseMlp,
    TensorClass::DenseMlpExpert,
    TensorClass::RoutedExpert,
    TensorClass::Mtp,
    TensorClass::Vision,
    TensorClass::NgramEmbedding,
];

/// True when `path` looks like a Hugging Face checkpoint directory.
pub fn is_checkpoint_dir(path: &Path) -> bool {
    path.is_dir() && path.join("config.json").is_file()
}
