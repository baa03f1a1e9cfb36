//! The preamble and JSON header of a `.ninfer` file (layout in `docs/FORMAT.md`), and the names
//! of its part files.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::config::{GenerationDefaults, ModelConfig};
use crate::error::ArtifactError;

/// `\x89NINFER\n`.
pub const MAGIC: [u8; 8] = [0x89, b'N', b'I', b'N', b'F', b'E', b'R', b'\n'];
pub const FORMAT_VERSION: u32 = 1;
pub const PREAMBLE_LENGTH: u64 = 4096;
/// Every part but the last is a multiple of this, so parts map at page boundaries on 4 KiB and
/// 64 KiB page kernels alike.
pub const PART_GRANULARITY: u64 = 64 * 1024;
/// Alignment of expert banks, large tensors and files (mmap, `cuMemHostRegister`, DMA).
pub const PAGE_ALIGNMENT: u64 = 4096;
/// Alignment of every tensor (one AVX-512 cache line).
pub const TENSOR_ALIGNMENT: u64 = 64;
/// Tensors at least this large start on a page.
pub const LARGE_TENSOR_BYTES: u64 = 1 << 20;

/// Element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    F32,
    Bf16,
    Int8,
    Int4,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::Int8 => "int8",
            DType::Int4 => "int4",
        }
    }

    pub fn is_quantized(self) -> bool {
        matches!(self, DType::Int8 | DType::Int4)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "f32" => Ok(DType::F32),
            "bf16" => Ok(DType::Bf16),
            "int8" => Ok(DType::Int8),
            "int4" => Ok(DType::Int4),
            other => Err(format!(
                "unknown dtype `{other}` (expected f32, bf16, int8 or int4)"
            )),
        }
    }
}

/// What a tensor is for; decides its dtype at conversion and who reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum TensorClass {
    Embedding,
    /// Every other weight the engine reads for each token: norms, token mixers, routers, shared
    /// experts, the final norm.
    Dense,
    /// A dense-MLP layer's SwiGLU matrices (`layers.L.mlp.*`): per-token weights like `dense`, kept
    /// apart so placement can size or move them separately from the token mixers.
    DenseMlp,
    /// A dense-MLP layer's SwiGLU stored a second time, as a bank of one expert
    /// (`layers.L.mlp.experts`, dense dtype): what the CPU expert workers compute when the
    /// layer's MLP is offloaded. Read per token only for offloaded layers.
    DenseMlpExpert,
    RoutedExpert,
    Mtp,
    Vision,
    /// A PLE layer's hashed n-gram embedding table (Qwen4-Exp): tens of GiB of rows of which a
    /// step reads a few per token, so it stays in host RAM and its rows are gathered there.
    NgramEmbedding,
}

impl TensorClass {
    pub fn name(self) -> &'static str {
        match self {
            TensorClass::Embedding => "embedding",
            TensorClass::Dense => "dense",
            TensorClass::DenseMlp => "dense_mlp",
            TensorClass::DenseMlpExpert => "dense_mlp_expert",
            TensorClass::RoutedExpert => "routed_expert",
            TensorClass::Mtp => "mtp",
            TensorClass::Vision => "vision",
            TensorClass::NgramEmbedding => "ngram_embedding",
        }
    }
}

impl std::fmt::Display for TensorClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Parameters of a group-quantized tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuantizationParams {
    /// Always `symmetric_group` in format version 1.
    pub scheme: QuantizationScheme,
    pub group_size: u32,
    /// Offset of the f16 scales from the start of the tensor's bytes.
    pub scales_offset: u64,
    pub scale_dtype: ScaleDType,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuantizationScheme {
    SymmetricGroup,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleDType {
    F16,
}

/// Checksum as 16 lower-case hex digits of XXH3-64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Checksum(pub u64);

impl Checksum {
    pub fn of(bytes: &[u8]) -> Self {
        Checksum(xxhash_rust::xxh3::xxh3_64(bytes))
    }
}

impl std::fmt::Display for Checksum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl Serialize for Checksum {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Checksum {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        if text.len() != 16 {
            return Err(serde::de::Error::custom(format!(
                "checksum `{text}` is not 16 hex digits"
            )));
        }
        u64::from_str_radix(&text, 16)
            .map(Checksum)
            .map_err(|_| serde::de::Error::custom(format!("checksum `{text}` is not hex")))
    }
}

/// One tensor of the index.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub class: TensorClass,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub offset: u64,
    pub length: u64,
    pub checksum: Checksum,
    pub quantization: Option<QuantizationParams>,
}

impl TensorEntry {
    pub fn element_count(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// An embedded file (tokenizer, chat template).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub offset: u64,
    pub length: u64,
    pub checksum: Checksum,
}

/// The experts of one MoE layer, stored back to back at a fixed page-aligned stride.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertBank {
    /// Name prefix of the bank's tensors, e.g. `layers.3.moe.experts`.
    pub prefix: String,
    pub class: TensorClass,
    pub offset: u64,
    pub expert_stride: u64,
    pub num_experts: u64,
    pub dtype: DType,
}

/// The expert id that names no expert: ids index an [`ExpertBank`] (`0..num_experts`, far below
/// `u32::MAX`), so this value is free to mark a routing entry whose expert is computed elsewhere
/// (on another worker, in a GPU slot). Every crate that reads routed expert ids uses this one.
pub const NO_EXPERT: u32 = u32::MAX;

/// Where the artifact came from (informational).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SourceInfo {
    pub converter: String,
    pub model_type: String,
    #[serde(default)]
    pub options: BTreeMap<String, String>,
}

/// The JSON header.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub format_version: u32,
    #[serde(flatten)]
    pub model: ModelConfig,
    pub generation: GenerationDefaults,
    pub files: BTreeMap<String, FileEntry>,
    pub tensors: Vec<TensorEntry>,
    pub expert_banks: Vec<ExpertBank>,
    pub source: SourceInfo,
}

/// The fixed-size preamble at offset 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preamble {
    pub format_version: u32,
    pub header_offset: u64,
    pub header_length: u64,
    pub header_checksum: Checksum,
    pub total_length: u64,
    pub part_count: u32,
    pub part_size: u64,
}

impl Preamble {
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = vec![0u8; PREAMBLE_LENGTH as usize];
        bytes[0..8].copy_from_slice(&MAGIC);
        bytes[8..12].copy_from_slice(&self.format_version.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.header_offset.to_le_bytes());
        bytes[24..32].copy_from_slice(&self.header_length.to_le_bytes());
        bytes[32..40].copy_from_slice(&self.header_checksum.0.to_le_bytes());
        bytes[40..48].copy_from_slice(&self.total_length.to_le_bytes());
        bytes[48..52].copy_from_slice(&self.part_count.to_le_bytes());
        bytes[56..64].copy_from_slice(&self.part_size.to_le_bytes());
        let checksum = Checksum::of(&bytes[0..64]);
        bytes[64..72].copy_from_slice(&checksum.0.to_le_bytes());
        bytes
    }

    /// Decodes and checks the preamble; `file` names the file in errors.
    pub fn decode(bytes: &[u8], file: &std::path::Path) -> Result<Self, ArtifactError> {
        let corrupt = |problem: String| ArtifactError::Corrupt {
            file: file.to_path_buf(),
            problem,
        };
        if bytes.len() >= 8 && bytes[0..8] != MAGIC {
            return Err(ArtifactError::NotAnArtifact {
                file: file.to_path_buf(),
            });
        }
        if bytes.len() < 72 {
            return Err(corrupt(format!(
                "file is {} bytes, shorter than the {PREAMBLE_LENGTH}-byte preamble",
                bytes.len()
            )));
        }
        if bytes[0..8] != MAGIC {
            return Err(ArtifactError::NotAnArtifact {
                file: file.to_path_buf(),
            });
        }
        let u32_at = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let u64_at = |at: usize| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(word)
        };
        let format_version = u32_at(8);
        if format_version != FORMAT_VERSION {
            return Err(ArtifactError::UnsupportedVersion {
                file: file.to_path_buf(),
                found: format_version,
                supported: FORMAT_VERSION,
            });
        }
        let stored_checksum = u64_at(64);
        if Checksum::of(&bytes[0..64]).0 != stored_checksum {
            return Err(corrupt(
                "preamble checksum mismatch (the file is incomplete or damaged)".into(),
            ));
        }
        let preamble = Preamble {
            format_version,
            header_offset: u64_at(16),
            header_length: u64_at(24),
            header_checksum: Checksum(u64_at(32)),
            total_length: u64_at(40),
            part_count: u32_at(48),
            part_size: u64_at(56),
        };
        if preamble.part_count == 0 {
            return Err(corrupt("preamble says the artifact has 0 parts".into()));
        }
        if preamble.part_count > 1
            && (preamble.part_size == 0 || preamble.part_size % PART_GRANULARITY != 0)
        {
            return Err(corrupt(format!(
                "part size {} is not a positive multiple of {PART_GRANULARITY}",
                preamble.part_size
            )));
        }
        let header_end = preamble.header_offset.checked_add(preamble.header_length);
        if preamble.header_offset < PREAMBLE_LENGTH
            || header_end.is_none_or(|end| end > preamble.total_length)
        {
            return Err(corrupt(format!(
                "header range {}+{} lies outside the artifact's {} bytes",
                preamble.header_offset, preamble.header_length, preamble.total_length
            )));
        }
        Ok(preamble)
    }
}

/// Rounds `value` up to a multiple of `alignment` (a power of two).
pub fn align_up(value: u64, alignment: u64) -> u64 {
    value.div_ceil(alignment) * alignment
}

/// Path of part `index` (1-based) of the artifact at `path`.
pub fn part_path(path: &Path, index: u32) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".part-{index:04}"));
    PathBuf::from(name)
}
