//! Whole-file downloads from a hub: a repository's published `.ninfer` conversion, and the
//! small files (configs, tokenizer, chat template) a streaming conversion needs.
//!
//! Owns: streaming each file to a `.part` file with a progress line, resuming it with an HTTP
//! range after a cut connection (also in a later run), checking its size and SHA-256 against
//! the hub's listing, and renaming it into place; knowing when a model directory is complete.
//! Must not touch: the hubs' APIs (`hub`), conversion (`stream`), the plan.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::hub::{Connected, Hub, RepositoryFile};

/// Attempts per file before a download is given up (each resumes where the last one stopped).
const ATTEMPTS_PER_FILE: usize = 5;

impl Hub {
    /// Streams `file` into `directory`, resuming a `.part` left by an earlier attempt.
    fn fetch(
        &self,
        repository: &str,
        file: &RepositoryFile,
        directory: &Path,
    ) -> anyhow::Result<()> {
        let target = directory.join(&file.path);
        if target.is_file() {
            return Ok(());
        }
        let partial = directory.join(format!("{}.part", file.path));
        if let Some(parent) = partial.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        let url = self.file_url(repository, &file.path);
        let mut last_problem = None;
        for _ in 0..ATTEMPTS_PER_FILE {
            match self.fetch_once(&url, file, &partial) {
                Ok(()) => {
                    verify(file, &partial)?;
                    std::fs::rename(&partial, &target)
                        .with_context(|| format!("moving {} into place", partial.display()))?;
                    return Ok(());
                }
                Err(Attempt::Fatal(error)) => return Err(error),
                Err(Attempt::Retry(error)) => {
                    eprintln!("\n{}: {error:#}; resuming", file.path);
                    last_problem = Some(error);
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
        Err(last_problem
            .unwrap_or_else(|| anyhow::anyhow!("no attempt made"))
            .context(format!(
                "{repository}: downloading {} failed {ATTEMPTS_PER_FILE} times",
                file.path
            )))
    }

    fn fetch_once(&self, url: &str, file: &RepositoryFile, partial: &Path) -> Result<(), Attempt> {
        let have = std::fs::metadata(partial).map(|m| m.len()).unwrap_or(0);
        if file.size > 0 && have == file.size {
            return Ok(());
        }
        let mut response = self
            .get(url, have)
            .map_err(|error| Attempt::Retry(anyhow::Error::new(error).context(url.to_string())))?;
        let status = response.status().as_u16();
        let append = match status {
            206 => true,
            200 => false,
            // The range starts at the end: the file is whole already.
            416 if have > 0 => return Ok(()),
            404 => {
                return Err(Attempt::Fatal(anyhow::anyhow!(
                    "{}: the hub lists it but answers 404 ({url})",
                    file.path
                )))
            }
            500..=599 => return Err(Attempt::Retry(anyhow::anyhow!("{status} from {url}"))),
            _ => {
                return Err(Attempt::Fatal(anyhow::anyhow!(
                    "{}: {status} from {url}",
                    file.path
                )))
            }
        };
        let mut output = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(partial)
            .map_err(|error| {
                Attempt::Fatal(anyhow::Error::new(error).context(partial.display().to_string()))
            })?;
        let mut written = if append { have } else { 0 };
        let mut reader = response.body_mut().as_reader();
        let mut buffer = vec![0u8; 1 << 20];
        let mut last_report = Instant::now();
        loop {
            let read = reader.read(&mut buffer).map_err(|error| {
                Attempt::Retry(anyhow::Error::new(error).context("connection cut"))
            })?;
            if read == 0 {
                break;
            }
            output.write_all(&buffer[..read]).map_err(|error| {
                Attempt::Fatal(anyhow::Error::new(error).context(partial.display().to_string()))
            })?;
            written += read as u64;
            if last_report.elapsed() > Duration::from_millis(500) {
                report_progress(&file.path, written, file.size);
                last_report = Instant::now();
            }
        }
        report_progress(&file.path, written, file.size);
        eprintln!();
        if file.size > 0 && written < file.size {
            return Err(Attempt::Retry(anyhow::anyhow!(
                "the connection ended at byte {written} of {}",
                file.size
            )));
        }
        Ok(())
    }
}

enum Attempt {
    /// Worth another try from where it stopped (a cut connection, a 5xx).
    Retry(anyhow::Error),
    Fatal(anyhow::Error),
}

fn report_progress(path: &str, written: u64, total: u64) {
    let mib = |bytes: u64| bytes as f64 / (1 << 20) as f64;
    if total > 0 {
        eprint!(
            "\r{path}: {:.1} / {:.1} MiB ({:.0}%)",
            mib(written),
            mib(total),
            written as f64 * 100.0 / total as f64
        );
    } else {
        eprint!("\r{path}: {:.1} MiB", mib(written));
    }
}

/// Size and SHA-256 (when listed) of a finished download; a mismatch deletes it.
fn verify(file: &RepositoryFile, partial: &Path) -> anyhow::Result<()> {
    let size = std::fs::metadata(partial)
        .map(|m| m.len())
        .with_context(|| format!("reading {}", partial.display()))?;
    if file.size > 0 && size != file.size {
        let _ = std::fs::remove_file(partial);
        bail!(
            "{}: downloaded {size} bytes, the hub lists {}; removed, run again",
            file.path,
            file.size
        );
    }
    if let Some(expected) = &file.sha256 {
        let mut context = ring::digest::Context::new(&ring::digest::SHA256);
        let mut input = std::fs::File::open(partial)
            .with_context(|| format!("reading {}", partial.display()))?;
        let mut buffer = vec![0u8; 1 << 20];
        loop {
            let read = input
                .read(&mut buffer)
                .with_context(|| format!("reading {}", partial.display()))?;
            if read == 0 {
                break;
            }
            context.update(&buffer[..read]);
        }
        let actual: String = context
            .finish()
            .as_ref()
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect();
        if &actual != expected {
            let _ = std::fs::remove_file(partial);
            bail!(
                "{}: SHA-256 {actual} does not match the hub's {expected}; the corrupt download \
                 was removed, run again",
                file.path
            );
        }
    }
    Ok(())
}

/// The repository `path` names (`ORG/NAME`) and its directory under `models_dir`, when `path`
/// is not a local file or directory and the repository is not (wholly) there yet: missing, or
/// holding what an interrupted download (`.part`) or conversion (`.partial`) left.
pub fn repository_to_download(path: &Path, models_dir: &Path) -> Option<(String, PathBuf)> {
    if path.exists() {
        return None;
    }
    let (organisation, name) = crate::model_facts::repository_id(path)?;
    let local = models_dir.join(&organisation).join(&name);
    let interrupted = std::fs::read_dir(&local).is_ok_and(|entries| {
        entries.filter_map(|entry| entry.ok()).any(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            name.ends_with(".part") || name.contains(".partial")
        })
    });
    (!local.exists() || interrupted).then(|| (format!("{organisation}/{name}"), local))
}

/// Downloads `files` of the connected repository into `directory` (made if missing).
pub fn download_files(
    connected: &Connected,
    files: &[RepositoryFile],
    directory: &Path,
) -> anyhow::Result<()> {
    let total: u64 = files.iter().map(|file| file.size).sum();
    eprintln!(
        "downloading {} from {} ({} files, {:.2} GiB) into {}",
        connected.repository,
        connected.hub.source.name(),
        files.len(),
        total as f64 / (1u64 << 30) as f64,
        directory.display()
    );
    std::fs::create_dir_all(directory)
        .with_context(|| format!("creating {}", directory.display()))?;
    for file in files {
        connected
            .hub
            .fetch(&connected.repository, file, directory)?;
    }
    Ok(())
}
