//! The `.safetensors` shards of a checkpoint: memory-mapped from a directory, or read by byte
//! range through a `RangeSource` (a checkpoint on a hub). Headers are validated up front so a
//! truncated or malformed file is reported by name before any output is written.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::{bf16, f16};
use memmap2::Mmap;

use crate::error::ConvertError;
use crate::source::{ByteRange, RangeSource, RemoteShard};

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

/// Where the shards' bytes come from.
enum Storage {
    Mapped(Vec<Mmap>),
    Remote(Arc<dyn RangeSource>),
    /// Names and shapes only (synthetic models); nothing can be read.
    None,
}

/// All shards of a checkpoint with one name → tensor index.
pub struct Checkpoint {
    pub directory: PathBuf,
    /// Each shard's path (for a remote checkpoint, its name in the repository).
    shard_paths: Vec<PathBuf>,
    storage: Storage,
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
            shard_paths: Vec::new(),
            storage: Storage::None,
            tensors: BTreeMap::new(),
        };
        let mut maps = Vec::new();
        for path in files {
            let file = File::open(&path).map_err(|e| ConvertError::io(&path, "opening", e))?;
            // SAFETY: the checkpoint is read-only input; we never write through the mapping.
            // A file truncated under us while converting would SIGBUS; that is the usual mmap
            // contract for inputs and is not something a user does by accident mid-run.
            let map =
                unsafe { Mmap::map(&file) }.map_err(|e| ConvertError::io(&path, "mapping", e))?;
            let shard = checkpoint.shard_paths.len();
            let tensors = parse_header(&path, &map, shard)?;
            checkpoint.add_shard(path, tensors)?;
            maps.push(map);
        }
        checkpoint.storage = Storage::Mapped(maps);
        Ok(checkpoint)
    }

    /// A checkpoint whose shards are read by range through `source` (none: for planning
    /// only); `directory` holds its config and tokenizer files. Each shard's header was fetched already; offsets past the
    /// shard's listed size are refused here, before anything is fetched.
    pub fn remote(
        directory: &Path,
        shards: &[RemoteShard],
        source: Option<Arc<dyn RangeSource>>,
    ) -> Result<Self, ConvertError> {
        if shards.is_empty() {
            return Err(ConvertError::Input {
                file: directory.to_path_buf(),
                problem: "the repository holds no *.safetensors files".into(),
            });
        }
        let mut checkpoint = Checkpoint {
            directory: directory.to_path_buf(),
            shard_paths: Vec::new(),
            storage: Storage::None,
            tensors: BTreeMap::new(),
        };
        for shard in shards {
            let path = PathBuf::from(&shard.name);
            let index = checkpoint.shard_paths.len();
            let tensors = parse_header_prefix(&path, &shard.header, shard.size, index)?;
            checkpoint.add_shard(path, tensors)?;
        }
        checkpoint.storage = source.map_or(Storage::None, Storage::Remote);
        Ok(checkpoint)
    }

    fn add_shard(&mut self, path: PathBuf, tensors: Vec<SourceTensor>) -> Result<(), ConvertError> {
        for tensor in tensors {
            if let Some(previous) = self.tensors.get(&tensor.name) {
                let first = &self.shard_paths[previous.shard];
                return Err(ConvertError::Input {
                    file: path.clone(),
                    problem: format!(
                        "tensor `{}` also appears in {}",
                        tensor.name,
                        first.display()
                    ),
                });
            }
            self.tensors.insert(tensor.name.clone(), tensor);
        }
        self.shard_paths.push(path);
        Ok(())
    }

    /// The source of a remote checkpoint.
    pub fn range_source(&self) -> Option<&Arc<dyn RangeSource>> {
        match &self.storage {
            Storage::Remote(source) => Some(source),
            _ => None,
        }
    }

    /// The byte range of elements `first..first+count` of `tensor` in its shard.
    pub fn range_of(&self, tensor: &SourceTensor, first: usize, count: usize) -> ByteRange {
        let size = tensor.dtype.size();
        ByteRange {
            shard: tensor.shard,
            start: (tensor.start + first * size) as u64,
            end: (tensor.start + (first + count) * size) as u64,
        }
    }

    /// A checkpoint with tensor names and shapes but no data, for planning only (synthetic
    /// models go through the same plan as real checkpoints). Reading its tensors is a bug.
    pub fn shapes_only(
        directory: &Path,
        tensors: impl IntoIterator<Item = (String, Vec<u64>)>,
    ) -> Self {
        Checkpoint {
            directory: directory.to_path_buf(),
            shard_paths: Vec::new(),
            storage: Storage::None,
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
        self.shard_paths
            .get(tensor.shard)
            .map_or(self.directory.as_path(), |path| path.as_path())
    }

    /// Raw little-endian bytes of elements `first..first+count` of a tensor.
    pub fn bytes_range(
        &self,
        tensor: &SourceTensor,
        first: usize,
        count: usize,
    ) -> Result<Cow<'_, [u8]>, ConvertError> {
        let range = self.range_of(tensor, first, count);
        match &self.storage {
            Storage::Mapped(maps) => Ok(Cow::Borrowed(
                &maps[tensor.shard][range.start as usize..range.end as usize],
            )),
            Storage::Remote(source) => {
                let bytes = source.read(&range)?;
                if bytes.len() as u64 != range.end - range.start {
                    return Err(ConvertError::Fetch {
                        file: self.shard_path(tensor).to_path_buf(),
                        problem: format!(
                            "bytes {}..{} of tensor `{}`: got {} bytes",
                            range.start,
                            range.end,
                            tensor.name,
                            bytes.len()
                        ),
                    });
                }
                Ok(Cow::Owned(bytes))
            }
            Storage::None => Err(ConvertError::Input {
                file: self.directory.clone(),
                problem: format!("tensor `{}` has no data (shapes only)", tensor.name),
            }),
        }
    }

    /// Raw little-endian bytes of a tensor.
    pub fn bytes(&self, tensor: &SourceTensor) -> Result<Cow<'_, [u8]>, ConvertError> {
        self.bytes_range(tensor, 0, tensor.element_count() as usize)
    }

    /// Elements `first..first+count` of a tensor (row-major), decoded to f32.
    pub fn read_f32_range(
        &self,
        tensor: &SourceTensor,
        first: usize,
        count: usize,
    ) -> Result<Vec<f32>, ConvertError> {
        let bytes = self.bytes_range(tensor, first, count)?;
        Ok(decode_f32(tensor.dtype, &bytes))
    }

    /// The whole tensor decoded to f32.
    pub fn read_f32(&self, tensor: &SourceTensor) -> Result<Vec<f32>, ConvertError> {
        self.read_f32_range(tensor, 0, tensor.element_count() as usize)
    }

    /// Tells the kernel the pages of a finished tensor may be dropped, keeping the resident
    /// set near one tensor while streaming a checkpoint far larger than RAM.
    pub fn release(&self, tensor: &SourceTensor) {
        let Storage::Mapped(maps) = &self.storage else {
            return;
        };
        let map = &maps[tensor.shard];
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

/// Little-endian elements of `dtype` decoded to f32.
pub fn decode_f32(dtype: SourceDType, bytes: &[u8]) -> Vec<f32> {
    {
        match dtype {
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
}

fn parse_header(
    path: &Path,
    bytes: &[u8],
    shard: usize,
) -> Result<Vec<SourceTensor>, ConvertError> {
    parse_header_prefix(path, bytes, bytes.len() as u64, shard)
}

/// The tensors of a safetensors file of `file_size` bytes whose first bytes (at least the
/// length and the JSON header) are `bytes`.
fn parse_header_prefix(
    path: &Path,
    bytes: &[u8],
    file_size: u64,
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
    let data_length = file_size.saturating_sub(data_start as u64);
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
    // Two tensors sharing bytes means the header lies about one of them.
    let mut by_start: Vec<&SourceTensor> = tensors.iter().filter(|t| t.end > t.start).collect();
    by_start.sort_by_key(|t| t.start);
    for pair in by_start.windows(2) {
        if pair[1].start < pair[0].end {
            return Err(problem(format!(
                "tensors `{}` and `{}` overlap in the data section (bytes {}..{} and {}..{}); the header is wrong",
                pair[0].name,
                pair[1].name,
                pair[0].start - data_start,
                pair[0].end - data_start,
                pair[1].start - data_start,
                pair[1].end - data_start
            )));
        }
    }
    Ok(tensors)
}
