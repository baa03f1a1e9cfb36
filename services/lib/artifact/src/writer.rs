//! Streaming writer: tensors are appended one at a time (memory stays near the largest tensor),
//! the header goes last, then the preamble, then temporary files are renamed into place.
//! Dropping an unfinished writer deletes its temporary files, so an interrupted conversion never
//! leaves a file that looks complete. A resumable writer (`create_resumable`) writes under
//! stable temporary names with a journal beside them, so a later process can continue from the
//! last `checkpoint` instead of starting over.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::config::{GenerationDefaults, ModelConfig};
use crate::error::ArtifactError;
use crate::header::{
    align_up, Checksum, DType, ExpertBank, FileEntry, Header, Preamble, SourceInfo, TensorClass,
    TensorEntry, FORMAT_VERSION, LARGE_TENSOR_BYTES, PAGE_ALIGNMENT, PART_GRANULARITY,
    PREAMBLE_LENGTH, TENSOR_ALIGNMENT,
};
// Where they have always been named from (the reader takes them from their own files).
pub use crate::header::part_path;
pub use crate::tensor_spec::{expected_tensor_bytes, TensorSpec};

/// Options of a new artifact.
#[derive(Debug, Clone, Copy, Default)]
pub struct WriterOptions {
    /// Split into parts of at most this many bytes (rounded down to 64 KiB, at least 64 KiB).
    pub max_part_bytes: Option<u64>,
}

fn temporary_path(path: &Path, resumable: bool) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    if resumable {
        name.push(".partial");
    } else {
        name.push(format!(".tmp-{}", std::process::id()));
    }
    PathBuf::from(name)
}

/// The journal of a resumable artifact at `path`: what its temporary files hold so far.
pub fn journal_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".partial.json");
    PathBuf::from(name)
}

/// What a resumable writer has written, as of its last checkpoint.
#[derive(serde::Serialize, serde::Deserialize)]
struct Journal {
    /// The caller's identity of the conversion; another key starts over.
    key: String,
    part_size: u64,
    part_count: usize,
    position: u64,
    tensors: Vec<TensorEntry>,
    files: BTreeMap<String, FileEntry>,
    banks: Vec<ExpertBank>,
    /// The open bank, the experts written to it and its two tensor sizes.
    open_bank: Option<(ExpertBank, u64, u64, u64)>,
}

struct PartFile {
    final_path: PathBuf,
    temporary_path: PathBuf,
    writer: BufWriter<File>,
}

struct OpenBank {
    bank: ExpertBank,
    next_expert: u64,
    gate_up_bytes: u64,
    down_bytes: u64,
}

/// Writes one `.ninfer` artifact.
pub struct ArtifactWriter {
    final_path: PathBuf,
    part_size: u64,
    parts: Vec<PartFile>,
    position: u64,
    tensors: Vec<TensorEntry>,
    names: HashSet<String>,
    files: BTreeMap<String, FileEntry>,
    banks: Vec<ExpertBank>,
    open_bank: Option<OpenBank>,
    finished: bool,
    /// `Some(key)` for a resumable writer.
    resume_key: Option<String>,
    /// Keep the temporary files and journal when dropped unfinished (a later run resumes).
    keep_for_resume: bool,
    /// Continued from an earlier run's journal.
    resumed: bool,
}

impl ArtifactWriter {
    /// Starts a new artifact at `path` (written under a temporary name until `finish`).
    pub fn create(path: &Path, options: WriterOptions) -> Result<Self, ArtifactError> {
        Self::create_with(path, options, None)
    }

    /// Starts, or continues, a resumable artifact at `path`: written under `PATH.partial`
    /// (and `PATH.part-NNNN.partial`) with a journal `PATH.partial.json`. When a journal of the
    /// same `key` and split is there and its files hold what it records, the writer continues
    /// after its last checkpoint (bytes written after it are cut off); otherwise it starts over.
    pub fn create_resumable(
        path: &Path,
        options: WriterOptions,
        key: &str,
    ) -> Result<Self, ArtifactError> {
        match Self::resume(path, options, key) {
            Some(writer) => Ok(writer),
            None => {
                // A journal of another conversion must not describe these new files.
                let _ = std::fs::remove_file(journal_path(path));
                Self::create_with(path, options, Some(key.to_string()))
            }
        }
    }

    fn create_with(
        path: &Path,
        options: WriterOptions,
        resume_key: Option<String>,
    ) -> Result<Self, ArtifactError> {
        let part_size = match options.max_part_bytes {
            Some(limit) => (limit / PART_GRANULARITY).max(1) * PART_GRANULARITY,
            None => u64::MAX,
        };
        let mut writer = ArtifactWriter {
            final_path: path.to_path_buf(),
            part_size,
            parts: Vec::new(),
            position: 0,
            tensors: Vec::new(),
            names: HashSet::new(),
            files: BTreeMap::new(),
            banks: Vec::new(),
            open_bank: None,
            finished: false,
            resume_key,
            keep_for_resume: false,
            resumed: false,
        };
        writer.open_part(path.to_path_buf())?;
        // Placeholder preamble: all zeros until `finish`, so a partial file never validates.
        writer.write_bytes(&vec![0u8; PREAMBLE_LENGTH as usize])?;
        Ok(writer)
    }

    /// The writer a journal describes, or `None` when there is nothing usable to resume.
    fn resume(path: &Path, options: WriterOptions, key: &str) -> Option<Self> {
        let text = std::fs::read(journal_path(path)).ok()?;
        let journal: Journal = serde_json::from_slice(&text).ok()?;
        let part_size = match options.max_part_bytes {
            Some(limit) => (limit / PART_GRANULARITY).max(1) * PART_GRANULARITY,
            None => u64::MAX,
        };
        if journal.key != key || journal.part_size != part_size || journal.part_count == 0 {
            return None;
        }
        let mut parts = Vec::new();
        for index in 0..journal.part_count {
            let final_path = if index == 0 {
                path.to_path_buf()
            } else {
                part_path(path, index as u32)
            };
            let temporary_path = temporary_path(&final_path, true);
            let first = index as u64 * part_size;
            let length = journal.position.saturating_sub(first).min(part_size);
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .open(&temporary_path)
                .ok()?;
            if file.metadata().ok()?.len() < length {
                return None;
            }
            // Bytes after the checkpoint belong to work that will be done again.
            file.set_len(length).ok()?;
            file.seek(SeekFrom::End(0)).ok()?;
            parts.push(PartFile {
                final_path,
                temporary_path,
                writer: BufWriter::with_capacity(8 << 20, file),
            });
        }
        let names = journal.tensors.iter().map(|t| t.name.clone()).collect();
        Some(ArtifactWriter {
            final_path: path.to_path_buf(),
            part_size,
            parts,
            position: journal.position,
            tensors: journal.tensors,
            names,
            files: journal.files,
            banks: journal.banks,
            open_bank: journal
                .open_bank
                .map(|(bank, next_expert, gate_up_bytes, down_bytes)| OpenBank {
                    bank,
                    next_expert,
                    gate_up_bytes,
                    down_bytes,
                }),
            finished: false,
            resume_key: Some(key.to_string()),
            keep_for_resume: false,
            resumed: true,
        })
    }

    /// Records what is written so far, so a later `create_resumable` continues from here
    /// (no-op for a writer that is not resumable). The journal is replaced atomically.
    pub fn checkpoint(&mut self) -> Result<(), ArtifactError> {
        let Some(key) = self.resume_key.clone() else {
            return Ok(());
        };
        for part in &mut self.parts {
            part.writer
                .flush()
                .map_err(|e| ArtifactError::io(&part.temporary_path, "flushing", e))?;
        }
        let journal = Journal {
            key,
            part_size: self.part_size,
            part_count: self.parts.len(),
            position: self.position,
            tensors: self.tensors.clone(),
            files: self.files.clone(),
            banks: self.banks.clone(),
            open_bank: self.open_bank.as_ref().map(|open| {
                (
                    open.bank.clone(),
                    open.next_expert,
                    open.gate_up_bytes,
                    open.down_bytes,
                )
            }),
        };
        let bytes = serde_json::to_vec(&journal)
            .map_err(|e| self.write_error(format!("encoding the journal: {e}")))?;
        let path = journal_path(&self.final_path);
        let mut staging = path.as_os_str().to_owned();
        staging.push(".new");
        let staging = PathBuf::from(staging);
        std::fs::write(&staging, bytes)
            .and_then(|_| std::fs::rename(&staging, &path))
            .map_err(|e| ArtifactError::io(&path, "writing the journal", e))
    }

    /// Whether this writer continued an earlier run's journal.
    pub fn resumed(&self) -> bool {
        self.resumed
    }

    /// Whether a tensor of this name is written (after resuming: before the checkpoint).
    pub fn has_tensor(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    /// Whether an embedded file of this name is written.
    pub fn has_file(&self, name: &str) -> bool {
        self.files.contains_key(name)
    }

    /// Whether the bank `prefix` is written and closed.
    pub fn has_bank(&self, prefix: &str) -> bool {
        self.banks.iter().any(|bank| bank.prefix == prefix)
    }

    /// The experts written to the open bank when it is `prefix`.
    pub fn open_bank_experts(&self, prefix: &str) -> Option<u64> {
        self.open_bank
            .as_ref()
            .filter(|open| open.bank.prefix == prefix)
            .map(|open| open.next_expert)
    }

    /// Whether dropping this writer unfinished keeps its files for a later run (resumable
    /// writers only; a fatal input error should not keep them).
    pub fn keep_for_resume(&mut self, keep: bool) {
        self.keep_for_resume = keep && self.resume_key.is_some();
    }

    fn open_part(&mut self, final_path: PathBuf) -> Result<(), ArtifactError> {
        let temporary_path = temporary_path(&final_path, self.resume_key.is_some());
        let file = File::create(&temporary_path)
            .map_err(|e| ArtifactError::io(&temporary_path, "creating output file", e))?;
        self.parts.push(PartFile {
            final_path,
            temporary_path,
            writer: BufWriter::with_capacity(8 << 20, file),
        });
        Ok(())
    }

    /// Appends bytes to the logical space, starting new part files at part boundaries.
    fn write_bytes(&mut self, mut bytes: &[u8]) -> Result<(), ArtifactError> {
        while !bytes.is_empty() {
            let part_index = self.position / self.part_size;
            while self.parts.len() as u64 <= part_index {
                let next = part_path(&self.final_path, self.parts.len() as u32);
                self.open_part(next)?;
            }
            let room = (part_index + 1).saturating_mul(self.part_size) - self.position;
            let take = (bytes.len() as u64).min(room) as usize;
            let part = &mut self.parts[part_index as usize];
            part.writer
                .write_all(&bytes[..take])
                .map_err(|e| ArtifactError::io(&part.temporary_path, "writing", e))?;
            self.position += take as u64;
            bytes = &bytes[take..];
        }
        Ok(())
    }

    fn pad_to(&mut self, alignment: u64) -> Result<(), ArtifactError> {
        let target = align_up(self.position, alignment);
        const ZEROS: [u8; 4096] = [0u8; 4096];
        while self.position < target {
            let step = ((target - self.position) as usize).min(ZEROS.len());
            self.write_bytes(&ZEROS[..step])?;
        }
        Ok(())
    }

    fn write_error(&self, problem: String) -> ArtifactError {
        ArtifactError::Write {
            file: self.final_path.clone(),
            problem,
        }
    }

    /// Embeds a file (tokenizer.json, chat template) under `name`.
    pub fn add_file(&mut self, name: &str, bytes: &[u8]) -> Result<(), ArtifactError> {
        if self.files.contains_key(name) {
            return Err(self.write_error(format!("file `{name}` added twice")));
        }
        self.pad_to(PAGE_ALIGNMENT)?;
        let entry = FileEntry {
            offset: self.position,
            length: bytes.len() as u64,
            checksum: Checksum::of(bytes),
        };
        self.write_bytes(bytes)?;
        self.files.insert(name.to_string(), entry);
        Ok(())
    }

    fn check_tensor(&mut self, spec: &TensorSpec, bytes: &[u8]) -> Result<(), ArtifactError> {
        if self.names.contains(&spec.name) {
            return Err(self.write_error(format!("tensor `{}` added twice", spec.name)));
        }
        let expected =
            expected_tensor_bytes(spec).map_err(|problem| ArtifactError::InvalidTensor {
                name: spec.name.clone(),
                problem,
            })?;
        if expected != bytes.len() as u64 {
            return Err(ArtifactError::InvalidTensor {
                name: spec.name.clone(),
                problem: format!(
                    "{} bytes given, {} {:?} needs {expected}",
                    bytes.len(),
                    spec.dtype,
                    spec.shape
                ),
            });
        }
        self.names.insert(spec.name.clone());
        Ok(())
    }

    fn append_tensor(&mut self, spec: TensorSpec, bytes: &[u8]) -> Result<(), ArtifactError> {
        let entry = TensorEntry {
            name: spec.name,
            class: spec.class,
            dtype: spec.dtype,
            shape: spec.shape,
            offset: self.position,
            length: bytes.len() as u64,
            checksum: Checksum::of(bytes),
            quantization: spec.quantization,
        };
        self.write_bytes(bytes)?;
        self.tensors.push(entry);
        Ok(())
    }

    /// Appends one tensor (not a routed expert: those go through `begin_expert_bank`).
    pub fn add_tensor(&mut self, spec: TensorSpec, bytes: &[u8]) -> Result<(), ArtifactError> {
        if self.open_bank.is_some() {
            return Err(self.write_error(format!(
                "tensor `{}` added while an expert bank is open",
                spec.name
            )));
        }
        self.check_tensor(&spec, bytes)?;
        let alignment = if bytes.len() as u64 >= LARGE_TENSOR_BYTES {
            PAGE_ALIGNMENT
        } else {
            TENSOR_ALIGNMENT
        };
        self.pad_to(alignment)?;
        self.append_tensor(spec, bytes)
    }

    /// Opens the bank of one MoE layer. Every expert must then be written in order with
    /// `add_expert`, each with a `gate_up` tensor of `gate_up_bytes` and a `down` tensor of
    /// `down_bytes`; `end_expert_bank` closes it.
    pub fn begin_expert_bank(
        &mut self,
        prefix: &str,
        class: TensorClass,
        dtype: DType,
        num_experts: u64,
        gate_up_bytes: u64,
        down_bytes: u64,
    ) -> Result<(), ArtifactError> {
        if self.open_bank.is_some() {
            return Err(
                self.write_error(format!("expert bank `{prefix}` opened inside another bank"))
            );
        }
        self.pad_to(PAGE_ALIGNMENT)?;
        let expert_stride = align_up(
            align_up(gate_up_bytes, TENSOR_ALIGNMENT) + down_bytes,
            PAGE_ALIGNMENT,
        );
        self.open_bank = Some(OpenBank {
            bank: ExpertBank {
                prefix: prefix.to_string(),
                class,
                offset: self.position,
                expert_stride,
                num_experts,
                dtype,
            },
            next_expert: 0,
            gate_up_bytes,
            down_bytes,
        });
        Ok(())
    }

    /// Writes the next expert of the open bank.
    pub fn add_expert(
        &mut self,
        gate_up: TensorSpec,
        gate_up_bytes: &[u8],
        down: TensorSpec,
        down_bytes: &[u8],
    ) -> Result<(), ArtifactError> {
        let Some(open) = self.open_bank.as_ref() else {
            return Err(self.write_error(format!(
                "expert `{}` written with no bank open",
                gate_up.name
            )));
        };
        let expert = open.next_expert;
        let start = open.bank.offset + expert * open.bank.expert_stride;
        let count = open.bank.num_experts;
        let prefix = open.bank.prefix.clone();
        let sizes = (open.gate_up_bytes, open.down_bytes);
        if (gate_up_bytes.len() as u64, down_bytes.len() as u64) != sizes {
            return Err(self.write_error(format!(
                "expert {expert} of bank `{prefix}` has tensor sizes ({}, {}), the bank was opened for {sizes:?}",
                gate_up_bytes.len(),
                down_bytes.len()
            )));
        }
        if expert >= count {
            return Err(self.write_error(format!(
                "bank `{prefix}` holds {count} experts; got one more"
            )));
        }
        self.check_tensor(&gate_up, gate_up_bytes)?;
        self.check_tensor(&down, down_bytes)?;
        // Sizes are equal for every expert, so the previous expert ended inside this stride slot.
        self.pad_to(PAGE_ALIGNMENT)?;
        if self.position != start {
            return Err(self.write_error(format!(
                "expert {expert} of bank `{prefix}` would start at {}, not at its slot {start}",
                self.position
            )));
        }
        self.append_tensor(gate_up, gate_up_bytes)?;
        self.pad_to(TENSOR_ALIGNMENT)?;
        self.append_tensor(down, down_bytes)?;
        if let Some(open) = self.open_bank.as_mut() {
            open.next_expert += 1;
        }
        Ok(())
    }

    /// Closes the open bank; fails if it is missing experts.
    pub fn end_expert_bank(&mut self) -> Result<(), ArtifactError> {
        let Some(open) = self.open_bank.take() else {
            return Err(self.write_error("end_expert_bank with no bank open".into()));
        };
        if open.next_expert != open.bank.num_experts {
            return Err(self.write_error(format!(
                "bank `{}` closed after {} of {} experts",
                open.bank.prefix, open.next_expert, open.bank.num_experts
            )));
        }
        // The last expert occupies its whole stride, so `offset + E · stride` stays in the file.
        self.pad_to(PAGE_ALIGNMENT)?;
        self.banks.push(open.bank);
        Ok(())
    }

    /// Bytes written so far (logical).
    pub fn position(&self) -> u64 {
        self.position
    }

    /// Writes the header and preamble, syncs, and renames every part into place.
    /// Returns the paths of the finished files, part 0 first.
    pub fn finish(
        mut self,
        model: ModelConfig,
        generation: GenerationDefaults,
        source: SourceInfo,
    ) -> Result<Vec<PathBuf>, ArtifactError> {
        if let Some(open) = &self.open_bank {
            return Err(self.write_error(format!("bank `{}` was never closed", open.bank.prefix)));
        }
        let header = Header {
            format_version: FORMAT_VERSION,
            model,
            generation,
            files: std::mem::take(&mut self.files),
            tensors: std::mem::take(&mut self.tensors),
            expert_banks: std::mem::take(&mut self.banks),
            source,
        };
        let header_bytes = serde_json::to_vec(&header)
            .map_err(|e| self.write_error(format!("encoding the header: {e}")))?;
        self.pad_to(TENSOR_ALIGNMENT)?;
        let header_offset = self.position;
        self.write_bytes(&header_bytes)?;
        let total_length = self.position;
        let part_count = self.parts.len() as u32;
        let preamble = Preamble {
            format_version: FORMAT_VERSION,
            header_offset,
            header_length: header_bytes.len() as u64,
            header_checksum: Checksum::of(&header_bytes),
            total_length,
            part_count,
            part_size: if part_count > 1 {
                self.part_size
            } else {
                total_length
            },
        };
        self.seal(&preamble)
    }

    /// Writes `preamble` over the placeholder, syncs every part and renames them into place.
    fn seal(&mut self, preamble: &Preamble) -> Result<Vec<PathBuf>, ArtifactError> {
        for part in &mut self.parts {
            part.writer
                .flush()
                .map_err(|e| ArtifactError::io(&part.temporary_path, "flushing", e))?;
        }
        {
            let first = &mut self.parts[0];
            let file = first.writer.get_mut();
            file.seek(SeekFrom::Start(0))
                .and_then(|_| file.write_all(&preamble.encode()))
                .map_err(|e| ArtifactError::io(&first.temporary_path, "writing the preamble", e))?;
        }
        for part in &mut self.parts {
            part.writer
                .get_ref()
                .sync_all()
                .map_err(|e| ArtifactError::io(&part.temporary_path, "syncing", e))?;
        }
        // Parts first, part 0 last: only a complete set ever carries the final name of part 0.
        for part in self.parts.iter().skip(1) {
            std::fs::rename(&part.temporary_path, &part.final_path)
                .map_err(|e| ArtifactError::io(&part.final_path, "renaming into place", e))?;
        }
        remove_stale_parts(&self.final_path, preamble.part_count);
        let first = &self.parts[0];
        std::fs::rename(&first.temporary_path, &first.final_path)
            .map_err(|e| ArtifactError::io(&first.final_path, "renaming into place", e))?;
        self.finished = true;
        if self.resume_key.is_some() {
            let _ = std::fs::remove_file(journal_path(&self.final_path));
        }
        Ok(self.parts.iter().map(|p| p.final_path.clone()).collect())
    }

    /// Writes `input` again at `output` split into files of at most `max_part_bytes` (one file
    /// when `None`), without its checkpoint: the logical byte space, and with it the header and
    /// every offset and checksum, is copied unchanged; only the preamble's part count and part
    /// size differ. `output` must not be one of `input`'s files.
    pub fn reshard(
        input: &crate::Artifact,
        output: &Path,
        max_part_bytes: Option<u64>,
    ) -> Result<Vec<PathBuf>, ArtifactError> {
        let same_file = |path: &Path| match (path.canonicalize(), output.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        if input.part_paths().iter().any(|path| same_file(path)) {
            return Err(ArtifactError::Write {
                file: output.to_path_buf(),
                problem: "is a file of the artifact being resharded; write to another path".into(),
            });
        }
        let mut writer = ArtifactWriter::create(output, WriterOptions { max_part_bytes })?;
        let old = input.preamble();
        let bytes = input.bytes();
        let total = usize::try_from(old.total_length)
            .ok()
            .filter(|&total| total <= bytes.len())
            .ok_or_else(|| writer.write_error("the input's length exceeds its mapping".into()))?;
        // Chunks keep the copy's resident memory small on a 100 GB artifact.
        for chunk in bytes[PREAMBLE_LENGTH as usize..total].chunks(64 << 20) {
            writer.write_bytes(chunk)?;
        }
        let part_count = writer.parts.len() as u32;
        let preamble = Preamble {
            part_count,
            part_size: if part_count > 1 {
                writer.part_size
            } else {
                old.total_length
            },
            ..*old
        };
        writer.seal(&preamble)
    }
}

/// Deletes `path.part-N` files left by an earlier artifact with more parts than this one.
fn remove_stale_parts(path: &Path, part_count: u32) {
    let mut index = part_count.max(1);
    loop {
        let stale = part_path(path, index);
        if std::fs::remove_file(&stale).is_err() {
            break;
        }
        tracing::info!(file = %stale.display(), "removed a stale part file of an earlier artifact");
        index += 1;
    }
}

impl Drop for ArtifactWriter {
    fn drop(&mut self) {
        if !self.finished && !self.keep_for_resume {
            for part in &self.parts {
                let _ = std::fs::remove_file(&part.temporary_path);
            }
            if self.resume_key.is_some() {
                let _ = std::fs::remove_file(journal_path(&self.final_path));
            }
        }
    }
}
