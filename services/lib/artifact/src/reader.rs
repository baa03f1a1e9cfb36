//! Zero-copy reader: the whole logical space (all parts) is one contiguous read-only mapping,
//! so every tensor — including one that crosses a part boundary — is a plain `&[u8]`.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::num::NonZeroUsize;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use half::bf16;
use nix::sys::mman::{mmap, mmap_anonymous, munmap, MapFlags, ProtFlags};

use crate::config::ModelConfig;
use crate::error::ArtifactError;
use crate::header::part_path;
use crate::header::{
    Checksum, DType, ExpertBank, Header, Preamble, TensorEntry, FORMAT_VERSION, PREAMBLE_LENGTH,
};
use crate::quant::{dequantize_matrix, float_bytes_to_f32, QuantizedLayout};
use crate::tensor_spec::{expected_tensor_bytes, TensorSpec};

/// One reserved address range with every part file mapped into it, back to back.
struct ContiguousMapping {
    base: NonNull<std::ffi::c_void>,
    reserved_length: usize,
    length: usize,
}

// SAFETY: the mapping is read-only and owned; nothing mutates it after construction.
unsafe impl Send for ContiguousMapping {}
unsafe impl Sync for ContiguousMapping {}

impl ContiguousMapping {
    fn map(
        artifact: &Path,
        parts: &[(PathBuf, File, u64)],
        part_size: u64,
    ) -> Result<Self, ArtifactError> {
        let length: u64 = parts.iter().map(|(_, _, size)| size).sum();
        let page = 64 * 1024;
        let reserved_length = (length.div_ceil(page) * page).max(page) as usize;
        let reserved =
            NonZeroUsize::new(reserved_length).ok_or_else(|| ArtifactError::Corrupt {
                file: artifact.to_path_buf(),
                problem: "empty artifact".into(),
            })?;
        // SAFETY: a fresh anonymous PROT_NONE reservation; the kernel picks the address.
        let base = unsafe {
            mmap_anonymous(
                None,
                reserved,
                ProtFlags::PROT_NONE,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE,
            )
        }
        .map_err(|e| ArtifactError::io(artifact, "reserving address space", e.into()))?;
        let mapping = ContiguousMapping {
            base,
            reserved_length,
            length: length as usize,
        };
        for (index, (path, file, size)) in parts.iter().enumerate() {
            let Some(part_length) = NonZeroUsize::new(*size as usize) else {
                continue;
            };
            let offset = index as u64 * part_size;
            let address = NonZeroUsize::new(mapping.base.as_ptr() as usize + offset as usize);
            // SAFETY: the target range lies inside our own reservation (sizes were checked by
            // the caller), so MAP_FIXED replaces only pages we own.
            unsafe {
                mmap(
                    address,
                    part_length,
                    ProtFlags::PROT_READ,
                    MapFlags::MAP_SHARED | MapFlags::MAP_FIXED,
                    file.as_fd(),
                    0,
                )
            }
            .map_err(|e| ArtifactError::io(path, "mapping part file", e.into()))?;
        }
        Ok(mapping)
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `length` bytes from `base` are mapped readable for the life of `self`.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr() as *const u8, self.length) }
    }
}

impl Drop for ContiguousMapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the range we reserved.
        let _ = unsafe { munmap(self.base, self.reserved_length) };
    }
}

/// An opened artifact.
pub struct Artifact {
    path: PathBuf,
    preamble: Preamble,
    header: Header,
    tensor_index: HashMap<String, usize>,
    part_paths: Vec<PathBuf>,
    mapping: ContiguousMapping,
}

/// A tensor's entry and its bytes inside the mapping.
#[derive(Clone, Copy)]
pub struct TensorView<'a> {
    pub entry: &'a TensorEntry,
    pub bytes: &'a [u8],
}

impl<'a> TensorView<'a> {
    pub fn name(&self) -> &'a str {
        &self.entry.name
    }

    pub fn dtype(&self) -> DType {
        self.entry.dtype
    }

    pub fn shape(&self) -> &'a [u64] {
        &self.entry.shape
    }

    /// The stored f32 values, borrowed (tensors are 64-byte aligned in the mapping).
    pub fn as_f32(&self) -> Option<&'a [f32]> {
        if self.entry.dtype != DType::F32 {
            return None;
        }
        bytemuck::try_cast_slice(self.bytes).ok()
    }

    /// The stored bf16 values, borrowed.
    pub fn as_bf16(&self) -> Option<&'a [bf16]> {
        if self.entry.dtype != DType::Bf16 {
            return None;
        }
        bytemuck::try_cast_slice(self.bytes).ok()
    }

    /// Layout of a quantized matrix (`None` for float tensors).
    pub fn quantized_layout(&self) -> Option<QuantizedLayout> {
        let [rows, cols] = self.entry.shape[..] else {
            return None;
        };
        QuantizedLayout::new(self.entry.dtype, rows as usize, cols as usize).ok()
    }

    /// Decodes any dtype to f32 (copies; for reference paths and tests).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self.entry.dtype {
            DType::F32 | DType::Bf16 => float_bytes_to_f32(self.entry.dtype, self.bytes),
            DType::Int8 | DType::Int4 => match self.quantized_layout() {
                Some(layout) => dequantize_matrix(self.bytes, &layout),
                None => Vec::new(),
            },
        }
    }
}

impl Artifact {
    /// Opens and validates an artifact (all parts, preamble, header, tensor ranges).
    /// Checksums of tensor data are checked only by `verify`.
    pub fn open(path: &Path) -> Result<Self, ArtifactError> {
        let mut first = File::open(path).map_err(|e| ArtifactError::io(path, "opening", e))?;
        let mut preamble_bytes = vec![0u8; PREAMBLE_LENGTH as usize];
        let mut filled = 0;
        while filled < preamble_bytes.len() {
            match first.read(&mut preamble_bytes[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) => return Err(ArtifactError::io(path, "reading the preamble", e)),
            }
        }
        let preamble = Preamble::decode(&preamble_bytes[..filled], path)?;
        let corrupt = |problem: String| ArtifactError::Corrupt {
            file: path.to_path_buf(),
            problem,
        };

        let mut parts = Vec::with_capacity(preamble.part_count as usize);
        let mut part_paths = Vec::with_capacity(preamble.part_count as usize);
        for index in 0..preamble.part_count {
            let (part_file_path, file) = if index == 0 {
                (
                    path.to_path_buf(),
                    first
                        .try_clone()
                        .map_err(|e| ArtifactError::io(path, "opening", e))?,
                )
            } else {
                let part = part_path(path, index);
                match File::open(&part) {
                    Ok(file) => (part, file),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        return Err(ArtifactError::MissingPart {
                            file: path.to_path_buf(),
                            part,
                            part_count: preamble.part_count,
                        })
                    }
                    Err(e) => return Err(ArtifactError::io(part, "opening part file", e)),
                }
            };
            let found = file
                .metadata()
                .map_err(|e| ArtifactError::io(&part_file_path, "reading file size", e))?
                .len();
            let is_last = index + 1 == preamble.part_count;
            let expected = if is_last {
                preamble
                    .total_length
                    .checked_sub(preamble.part_size * index as u64)
                    .ok_or_else(|| corrupt("part sizes exceed the total length".into()))?
            } else {
                preamble.part_size
            };
            if found != expected {
                return Err(ArtifactError::PartSize {
                    file: path.to_path_buf(),
                    part: part_file_path,
                    found,
                    expected,
                });
            }
            part_paths.push(part_file_path.clone());
            parts.push((part_file_path, file, found));
        }
        let mapping = ContiguousMapping::map(path, &parts, preamble.part_size)?;

        let all = mapping.bytes();
        let header_range = preamble.header_offset as usize
            ..(preamble.header_offset + preamble.header_length) as usize;
        let header_bytes = &all[header_range];
        let computed = Checksum::of(header_bytes);
        if computed != preamble.header_checksum {
            return Err(ArtifactError::ChecksumMismatch {
                file: path.to_path_buf(),
                what: "the header".into(),
                stored: preamble.header_checksum.to_string(),
                computed: computed.to_string(),
            });
        }
        let header: Header = serde_json::from_slice(header_bytes)
            .map_err(|e| corrupt(format!("header is not valid: {e}")))?;
        if header.format_version != FORMAT_VERSION {
            return Err(ArtifactError::UnsupportedVersion {
                file: path.to_path_buf(),
                found: header.format_version,
                supported: FORMAT_VERSION,
            });
        }
        let data_end = preamble.header_offset;
        let in_data = |offset: u64, length: u64| {
            offset >= PREAMBLE_LENGTH
                && offset
                    .checked_add(length)
                    .is_some_and(|end| end <= data_end)
        };
        let mut tensor_index = HashMap::with_capacity(header.tensors.len());
        for (position, tensor) in header.tensors.iter().enumerate() {
            if !in_data(tensor.offset, tensor.length) {
                return Err(corrupt(format!(
                    "tensor `{}` range {}+{} lies outside the data section",
                    tensor.name, tensor.offset, tensor.length
                )));
            }
            if tensor.offset % 64 != 0 {
                return Err(corrupt(format!(
                    "tensor `{}` is not 64-byte aligned",
                    tensor.name
                )));
            }
            let spec = TensorSpec {
                name: tensor.name.clone(),
                class: tensor.class,
                dtype: tensor.dtype,
                shape: tensor.shape.clone(),
                quantization: tensor.quantization,
            };
            let expected = expected_tensor_bytes(&spec)
                .map_err(|problem| corrupt(format!("tensor `{}`: {problem}", tensor.name)))?;
            if expected != tensor.length {
                return Err(corrupt(format!(
                    "tensor `{}` is {} bytes, its dtype and shape need {expected}",
                    tensor.name, tensor.length
                )));
            }
            if tensor_index.insert(tensor.name.clone(), position).is_some() {
                return Err(corrupt(format!("tensor `{}` appears twice", tensor.name)));
            }
        }
        for (name, file) in &header.files {
            if !in_data(file.offset, file.length) {
                return Err(corrupt(format!(
                    "embedded file `{name}` lies outside the data section"
                )));
            }
        }
        for bank in &header.expert_banks {
            let end = bank
                .num_experts
                .checked_mul(bank.expert_stride)
                .and_then(|b| b.checked_add(bank.offset));
            if end.is_none_or(|end| end > data_end)
                || bank.offset % 4096 != 0
                || bank.expert_stride % 4096 != 0
            {
                return Err(corrupt(format!(
                    "expert bank `{}` is misplaced",
                    bank.prefix
                )));
            }
        }
        Ok(Artifact {
            path: path.to_path_buf(),
            preamble,
            header,
            tensor_index,
            part_paths,
            mapping,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn part_paths(&self) -> &[PathBuf] {
        &self.part_paths
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn config(&self) -> &ModelConfig {
        &self.header.model
    }

    /// Identity of the model: XXH3-64 of the header, as 16 hex digits. Two artifacts with the
    /// same tensors, config and files have the same id; any difference changes it.
    pub fn model_id(&self) -> String {
        self.preamble.header_checksum.to_string()
    }

    /// The preamble: where the header is, and how the logical space is split into files.
    pub fn preamble(&self) -> &Preamble {
        &self.preamble
    }

    pub fn total_length(&self) -> u64 {
        self.preamble.total_length
    }

    /// The whole logical byte space (for banks and DMA registration).
    pub fn bytes(&self) -> &[u8] {
        self.mapping.bytes()
    }

    pub fn tensors(&self) -> impl Iterator<Item = TensorView<'_>> {
        self.header.tensors.iter().map(|entry| self.view(entry))
    }

    fn view<'a>(&'a self, entry: &'a TensorEntry) -> TensorView<'a> {
        let bytes =
            &self.mapping.bytes()[entry.offset as usize..(entry.offset + entry.length) as usize];
        TensorView { entry, bytes }
    }

    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        self.tensor_index
            .get(name)
            .map(|&i| self.view(&self.header.tensors[i]))
    }

    /// The tensor called `name`, or an error naming the artifact and the tensor.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, ArtifactError> {
        self.get(name).ok_or_else(|| ArtifactError::MissingTensor {
            file: self.path.clone(),
            name: name.to_string(),
        })
    }

    /// An embedded file's bytes (`tokenizer.json`, `chat_template.jinja`).
    pub fn file(&self, name: &str) -> Option<&[u8]> {
        let entry = self.header.files.get(name)?;
        Some(&self.mapping.bytes()[entry.offset as usize..(entry.offset + entry.length) as usize])
    }

    pub fn expert_bank(&self, prefix: &str) -> Option<&ExpertBank> {
        self.header
            .expert_banks
            .iter()
            .find(|bank| bank.prefix == prefix)
    }

    /// Recomputes every checksum (files and tensors). `progress` gets bytes checked so far.
    pub fn verify(&self, mut progress: impl FnMut(u64)) -> Result<(), ArtifactError> {
        let mut checked = 0u64;
        for (name, file) in &self.header.files {
            let bytes =
                &self.mapping.bytes()[file.offset as usize..(file.offset + file.length) as usize];
            self.compare(format!("embedded file `{name}`"), file.checksum, bytes)?;
            checked += file.length;
            progress(checked);
        }
        for tensor in self.tensors() {
            self.compare(
                format!("tensor `{}`", tensor.entry.name),
                tensor.entry.checksum,
                tensor.bytes,
            )?;
            checked += tensor.entry.length;
            progress(checked);
        }
        Ok(())
    }

    fn compare(&self, what: String, stored: Checksum, bytes: &[u8]) -> Result<(), ArtifactError> {
        let computed = Checksum::of(bytes);
        if computed != stored {
            return Err(ArtifactError::ChecksumMismatch {
                file: self.path.clone(),
                what,
                stored: stored.to_string(),
                computed: computed.to_string(),
            });
        }
        Ok(())
    }
}
