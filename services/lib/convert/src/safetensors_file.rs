//! Memory-mapped `.safetensors` shards of a checkpoint directory, validated up front so a
//! truncated or malformed file is reported by name before any output is written.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;

use crate::error::ConvertError;

/// Element type of a checkpoint tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceDType {
    F32,
    Bf16,
    F16,
    /// Integer buffers (Qwen4-Exp's PLE hash tables), which the converter only skips.
    I64,
}

impl SourceDType {
    fn parse(text: &str) -> Option<Self> {
        match text {
            "F32" => Some(SourceDType::F32),
            "BF16" => Some(SourceDType::Bf16),
            "F16" => Some(SourceDType::F16),
            "I64" => Some(SourceDType::I64),
            _ => None,
        }
    }

    pub fn size(self) -> usize {
        match self {
            SourceDType::I64 => 8,
            SourceDType::F32 => 4,
            SourceDType::Bf16 | SourceDType::F16 => 2,
        }
    }
}

/// Where one checkpoint tensor lives.
#[derive(Debug, Clone)]
pub struct SourceTensor {
    pub name: String,
    pub shard: usize,
    pub dtype: SourceDType,
    pub shape: Vec<u64>,
    /// Absolute byte range inside the shard file.
    pub start: usize,
    pub end: usize,
}

impl SourceTensor {
    pub fn element_count(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// All shards of a checkpoint, mapped, with one name → tensor index.
pub struct Checkpoint {
    pub directory: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    pub tensors: BTreeMap<String, SourceTensor>,
}

impl Checkpoint {
    /// Maps every `*.safetensors` file of `directory` and validates its header.
    pub fn open(directory: &Path) -> Result<Self, ConvertError> {
        let entries = std::fs::read_dir(directory)
            .map_err(|e| ConvertError::io(directory, "listing the directory", e))?;
        let mut files: Vec<PathBuf> = entries
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(ConvertError::Input {
                file: directory.to_path_buf(),
                problem: "no *.safetensors files in this directory".into(),
            });
        }
        let mut checkpoint = Checkpoint {
            directory: directory.to_path_buf(),
            shards: Vec::new(),
            tensors: BTreeMap::new(),
        };
        for path in files {
            let file = File::open(&path).map_err(|e| ConvertError::io(&path, "opening", e))?;
            // SAFETY: the checkpoint is read-only input; we never write through the mapping.
            // A file truncated under us while converting would SIGBUS; that is the usual mmap
            // contract for inputs and is not something a user does by accident mid-run.
            let map =
                unsafe { Mmap::map(&file) }.map_err(|e| ConvertError::io(&path, "mapping", e))?;
            let shard = checkpoint.shards.len();
            let tensors = parse_header(&path, &map, shard)?;
            for tensor in tensors {
                if let Some(previous) = checkpoint.tensors.get(&tensor.name) {
                    let first = &checkpoint.shards[previous.shard].0;
                    return Err(ConvertError::Input {
                        file: path.clone(),
                        problem: format!(
                            "tensor `{}` also appears in {}",
                            tensor.name,
                            first.display()
                        ),
                    });
                }
                checkpoint.tensors.insert(tensor.name.clone(), tensor);
            }
            checkpoint.shards.push((path, map));
        }
        Ok(checkpoint)
    }

    /// A checkpoint with tensor names and shapes but no data, for planning only (synthetic
    /// models go through the same plan as real checkpoints). Reading its tensors is a bug.
    pub fn shapes_only(
        directory: &Path,
        tensors: impl IntoIterator<Item = (String, Vec<u64>)>,
    ) -> Self {
        Checkpoint {
            directory: directory.to_path_buf(),
            shards: Vec::new(),
            tensors: tensors
                .into_iter()
                .map(|(name, shape)| {
                    let tensor = SourceTensor {
                        name: name.clone(),
                        shard: 0,
                        dtype: SourceDType::Bf16,
                        shape,
                        start: 0,
                        end: 0,
                    };
                    (name, tensor)
                })
                .collect(),
        }
    }

    pub fn shard_path(&self, tensor: &SourceTensor) -> &Path {
        // A shapes-only checkpoint has no shard files: name its directory instead.
        self.shards
            .get(tensor.shard)
            .map_or(self.directory.as_path(), |(path, _)| path.as_path())
    }

    /// Raw little-endian bytes of a tensor.
    pub fn bytes(&self, tensor: &SourceTensor) -> &[u8] {
        &self.shards[tensor.shard].1[tensor.start..tensor.end]
    }

    /// Elements `first..first+count` of a tensor (row-major), decoded to f32.
    pub fn read_f32_range(&self, tensor: &SourceTensor, first: usize, count: usize) -> Vec<f32> {
        let size = tensor.dtype.size();
        let bytes = &self.bytes(tensor)[first * size..(first + count) * size];
        match tensor.dtype {
            SourceDType::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            SourceDType::Bf16 => bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            SourceDType::F16 => bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            SourceDType::I64 => bytes
                .chunks_exact(8)
                .map(|c| {
                    let mut value = [0u8; 8];
                    value.copy_from_slice(c);
                    i64::from_le_bytes(value) as f32
                })
                .collect(),
        }
    }

    /// The whole tensor decoded to f32.
    pub fn read_f32(&self, tensor: &SourceTensor) -> Vec<f32> {
        self.read_f32_range(tensor, 0, tensor.element_count() as usize)
    }

    /// Tells the kernel the pages of a finished tensor may be dropped, keeping the resident
    /// set near one tensor while streaming a checkpoint far larger than RAM.
    pub fn release(&self, tensor: &SourceTensor) {
        let map = &self.shards[tensor.shard].1;
        // SAFETY: a read-only shared file mapping; dropped pages are re-read from the file on
        // the next access, so no data can be lost or changed.
        let _ = unsafe {
            map.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                tensor.start,
                tensor.end - tensor.start,
            )
        };
    }
}

fn parse_header(
    path: &Path,
    bytes: &[u8],
    shard: usize,
) -> Result<Vec<SourceTensor>, ConvertError> {
    let problem = |text: String| ConvertError::Input {
        file: path.to_path_buf(),
        problem: text,
    };
    if bytes.len() < 8 {
        return Err(problem(format!(
            "truncated safetensors file: {} bytes, no header",
            bytes.len()
        )));
    }
    let mut length_bytes = [0u8; 8];
    length_bytes.copy_from_slice(&bytes[..8]);
    let header_length = u64::from_le_bytes(length_bytes);
    let data_start = 8u64
        .checked_add(header_length)
        .filter(|&end| end <= bytes.len() as u64)
        .ok_or_else(|| {
            problem(format!(
            "truncated safetensors file: header of {header_length} bytes does not fit in {} bytes",
            bytes.len()
        ))
        })? as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..data_start])
            .map_err(|e| problem(format!("safetensors header is not valid JSON: {e}")))?;
    let data_length = (bytes.len() - data_start) as u64;
    let mut tensors = Vec::with_capacity(header.len());
    for (name, value) in header {
        if name == "__metadata__" {
            continue;
        }
        let dtype_text = value.get("dtype").and_then(|v| v.as_str()).unwrap_or("");
        let dtype = SourceDType::parse(dtype_text).ok_or_else(|| {
            problem(format!(
                "tensor `{name}` has dtype `{dtype_text}`; supported checkpoint dtypes are F32, BF16, F16 (and I64 for buffers)"
            ))
        })?;
        let shape: Vec<u64> = value
            .get("shape")
            .and_then(|v| v.as_array())
            .map(|dims| dims.iter().filter_map(|d| d.as_u64()).collect())
            .ok_or_else(|| problem(format!("tensor `{name}` has no shape")))?;
        let offsets: Vec<u64> = value
            .get("data_offsets")
            .and_then(|v| v.as_array())
            .map(|o| o.iter().filter_map(|d| d.as_u64()).collect())
            .unwrap_or_default();
        let [start, end] = offsets[..] else {
            return Err(problem(format!(
                "tensor `{name}` has no valid data_offsets"
            )));
        };
        let elements: u64 = shape.iter().product();
        if end < start || end - start != elements * dtype.size() as u64 {
            return Err(problem(format!(
                "tensor `{name}`: data_offsets {start}..{end} do not match shape {shape:?} of {dtype_text}"
            )));
        }
        if end > data_length {
            return Err(problem(format!(
                "truncated safetensors file: tensor `{name}` ends at byte {end} of the data section, which has only {data_length}"
            )));
        }
        tensors.push(SourceTensor {
            name,
            shard,
            dtype,
            shape,
            start: data_start + start as usize,
            end: data_start + end as usize,
        });
    }
    Ok(tensors)
}
