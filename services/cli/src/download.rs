//! Models by name: a repository `ORG/NAME` not in the models directory is downloaded from
//! Hugging Face (`HF_ENDPOINT` for a mirror, `HF_TOKEN` for gated models) or ModelScope
//! (`--source modelscope` or `NINFER_SOURCE=modelscope`) into `MODELS_DIR/ORG/NAME`.
//!
//! Owns: listing a repository's files through the hub's API, choosing what a run needs (a
//! published `.ninfer` conversion when there is one, else the checkpoint's safetensors,
//! configs and tokenizer), streaming each file to a `.part` file with a progress line, resuming
//! it with an HTTP range after a cut connection (also in a later run), checking its size and
//! SHA-256 against the hub's listing, and renaming it into place.
//! Must not touch: conversion (`serve::artifact_of` converts the checkpoint afterwards) or the
//! plan.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// Environment variable choosing the hub (`huggingface` or `modelscope`).
pub const SOURCE_VARIABLE: &str = "NINFER_SOURCE";

/// Attempts per file before a download is given up (each resumes where the last one stopped).
const ATTEMPTS_PER_FILE: usize = 5;

/// Where models are downloaded from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModelSource {
    /// Hugging Face (`HF_ENDPOINT` names a mirror; `HF_TOKEN` for gated models).
    Huggingface,
    /// ModelScope (`MODELSCOPE_ENDPOINT` names another site).
    Modelscope,
}

impl ModelSource {
    /// `--source`, else `NINFER_SOURCE`, else Hugging Face.
    pub fn chosen(flag: Option<ModelSource>) -> anyhow::Result<ModelSource> {
        if let Some(source) = flag {
            return Ok(source);
        }
        match std::env::var(SOURCE_VARIABLE) {
            Err(_) => Ok(ModelSource::Huggingface),
            Ok(text) => match text.trim().to_ascii_lowercase().as_str() {
                "" | "huggingface" | "hf" => Ok(ModelSource::Huggingface),
                "modelscope" | "ms" => Ok(ModelSource::Modelscope),
                other => bail!("{SOURCE_VARIABLE}={other}: give huggingface or modelscope"),
            },
        }
    }

    fn name(self) -> &'static str {
        match self {
            ModelSource::Huggingface => "Hugging Face",
            ModelSource::Modelscope => "ModelScope",
        }
    }

    fn endpoint(self) -> String {
        let (variable, default) = match self {
            ModelSource::Huggingface => ("HF_ENDPOINT", "https://huggingface.co"),
            ModelSource::Modelscope => ("MODELSCOPE_ENDPOINT", "https://www.modelscope.cn"),
        };
        std::env::var(variable)
            .ok()
            .filter(|value| !value.trim().is_empty())
            .unwrap_or_else(|| default.to_string())
            .trim_end_matches('/')
            .to_string()
    }

    fn listing_url(self, endpoint: &str, repository: &str) -> String {
        match self {
            ModelSource::Huggingface => {
                format!("{endpoint}/api/models/{repository}/tree/main?recursive=true")
            }
            ModelSource::Modelscope => format!(
                "{endpoint}/api/v1/models/{repository}/repo/files?Revision=master&Recursive=true"
            ),
        }
    }

    fn file_url(self, endpoint: &str, repository: &str, path: &str) -> String {
        match self {
            ModelSource::Huggingface => format!("{endpoint}/{repository}/resolve/main/{path}"),
            ModelSource::Modelscope => format!(
                "{endpoint}/api/v1/models/{repository}/repo?Revision=master&FilePath={path}"
            ),
        }
    }
}

/// One file of a repository as the hub lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepositoryFile {
    pub path: String,
    pub size: u64,
    /// Lower-case hex SHA-256 when the hub gives one (large files).
    pub sha256: Option<String>,
}

/// The files of a Hugging Face tree listing (`[{"type":"file","path","size","lfs":{"oid"}}]`)
/// or a ModelScope one (`{"Data":{"Files":[{"Type":"blob","Path","Size","Sha256"}]}}`).
fn parse_listing(source: ModelSource, text: &str) -> anyhow::Result<Vec<RepositoryFile>> {
    let json: serde_json::Value =
        serde_json::from_str(text).context("the hub's file list is not JSON")?;
    let entries = match source {
        ModelSource::Huggingface => json.as_array().cloned(),
        ModelSource::Modelscope => json
            .pointer("/Data/Files")
            .and_then(|files| files.as_array())
            .cloned(),
    }
    .context("the hub's file list has no files array")?;
    let mut files = Vec::new();
    for entry in entries {
        let text_field = |names: &[&str]| {
            names
                .iter()
                .find_map(|name| entry.get(*name).and_then(|v| v.as_str()))
                .map(str::to_string)
        };
        let kind = text_field(&["type", "Type"]).unwrap_or_default();
        if kind != "file" && kind != "blob" {
            continue;
        }
        let Some(path) = text_field(&["path", "Path"]) else {
            continue;
        };
        let size = ["size", "Size"]
            .iter()
            .find_map(|name| entry.get(*name).and_then(|v| v.as_u64()))
            .unwrap_or(0);
        let sha256 = entry
            .pointer("/lfs/oid")
            .and_then(|v| v.as_str())
            .map(str::to_string)
            .or_else(|| text_field(&["Sha256"]))
            .map(|hash| hash.trim_start_matches("sha256:").to_ascii_lowercase())
            .filter(|hash| hash.len() == 64 && hash.chars().all(|c| c.is_ascii_hexdigit()));
        files.push(RepositoryFile { path, size, sha256 });
    }
    Ok(files)
}

/// What a run needs of a repository: its `.ninfer` conversion when it publishes one, else the
/// checkpoint (safetensors, configs, tokenizer and chat template files).
pub fn files_to_download(files: &[RepositoryFile]) -> Vec<RepositoryFile> {
    let safe = |path: &str| !path.split('/').any(|part| part.is_empty() || part == "..");
    let conversion: Vec<RepositoryFile> = files
        .iter()
        .filter(|file| {
            safe(&file.path)
                && (file.path.ends_with(".ninfer") || file.path.contains(".ninfer.part-"))
        })
        .cloned()
        .collect();
    if !conversion.is_empty() {
        return conversion;
    }
    files
        .iter()
        .filter(|file| safe(&file.path) && !file.path.contains('/'))
        .filter(|file| {
            [
                ".safetensors",
                ".json",
                ".jinja",
                ".txt",
                ".model",
                ".tiktoken",
            ]
            .iter()
            .any(|suffix| file.path.ends_with(suffix))
        })
        .cloned()
        .collect()
}

/// A client for one hub.
struct Hub {
    source: ModelSource,
    endpoint: String,
    token: Option<String>,
    agent: ureq::Agent,
}

impl Hub {
    fn new(source: ModelSource) -> Self {
        let endpoint = source.endpoint();
        let token = match source {
            ModelSource::Huggingface => std::env::var("HF_TOKEN").ok(),
            ModelSource::Modelscope => std::env::var("MODELSCOPE_API_TOKEN").ok(),
        }
        .filter(|token| !token.trim().is_empty());
        let local = ["://127.0.0.1", "://localhost", "://[::1]"]
            .iter()
            .any(|host| endpoint.contains(host));
        let mut config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_per_read(Some(Duration::from_secs(60)))
            .user_agent(concat!("ninfer/", env!("CARGO_PKG_VERSION")));
        if local {
            // A mirror on this machine is reached directly, whatever proxy the environment sets.
            config = config.proxy(None);
        }
        Hub {
            source,
            endpoint,
            token,
            agent: config.build().into(),
        }
    }

    fn get(
        &self,
        url: &str,
        from_byte: u64,
    ) -> Result<ureq::http::Response<ureq::Body>, ureq::Error> {
        let mut request = self.agent.get(url);
        if let Some(token) = &self.token {
            request = request.header("Authorization", &format!("Bearer {token}"));
        }
        if from_byte > 0 {
            request = request.header("Range", &format!("bytes={from_byte}-"));
        }
        request.call()
    }

    fn list(&self, repository: &str) -> anyhow::Result<Vec<RepositoryFile>> {
        let url = self.source.listing_url(&self.endpoint, repository);
        let mut response = self
            .get(&url, 0)
            .with_context(|| format!("{repository}: asking {} ({url})", self.source.name()))?;
        let status = response.status().as_u16();
        match status {
            200 => {}
            401 | 403 => bail!(
                "{repository}: {} refuses access ({status} from {url}); for a gated or private model \
                 set {}",
                self.source.name(),
                match self.source {
                    ModelSource::Huggingface => "HF_TOKEN",
                    ModelSource::Modelscope => "MODELSCOPE_API_TOKEN",
                }
            ),
            404 => bail!(
                "{repository}: no such model on {} (404 from {url}); check the name, or choose \
                 another hub with --source / {SOURCE_VARIABLE}",
                self.source.name()
            ),
            _ => bail!(
                "{repository}: {} answered {status} listing the model's files ({url})",
                self.source.name()
            ),
        }
        let text = response
            .body_mut()
            .with_config()
            .limit(64 << 20)
            .read_to_string()
            .with_context(|| format!("{repository}: reading the file list from {url}"))?;
        parse_listing(self.source, &text).with_context(|| format!("{repository}: {url}"))
    }

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
        let url = self.source.file_url(&self.endpoint, repository, &file.path);
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
/// is not a local file or directory and the repository is not (wholly) downloaded there yet:
/// missing, or holding a `.part` file an interrupted download left.
pub fn repository_to_download(path: &Path, models_dir: &Path) -> Option<(String, PathBuf)> {
    if path.exists() {
        return None;
    }
    let (organisation, name) = crate::model_facts::repository_id(path)?;
    let local = models_dir.join(&organisation).join(&name);
    let interrupted = std::fs::read_dir(&local).is_ok_and(|entries| {
        entries
            .filter_map(|entry| entry.ok())
            .any(|entry| entry.file_name().to_string_lossy().ends_with(".part"))
    });
    (!local.exists() || interrupted).then(|| (format!("{organisation}/{name}"), local))
}

/// Downloads `ORG/NAME` from `source` into `directory` (made if missing); returns it.
pub fn download_model(
    repository: &str,
    directory: &Path,
    source: ModelSource,
) -> anyhow::Result<PathBuf> {
    let hub = Hub::new(source);
    let listed = hub.list(repository)?;
    let wanted = files_to_download(&listed);
    if wanted.is_empty() {
        bail!(
            "{repository}: {} lists no .ninfer conversion and no safetensors checkpoint",
            source.name()
        );
    }
    let total: u64 = wanted.iter().map(|file| file.size).sum();
    eprintln!(
        "downloading {repository} from {} ({} files, {:.2} GiB) into {}",
        source.name(),
        wanted.len(),
        total as f64 / (1u64 << 30) as f64,
        directory.display()
    );
    std::fs::create_dir_all(directory)
        .with_context(|| format!("creating {}", directory.display()))?;
    for file in &wanted {
        hub.fetch(repository, file, directory)?;
    }
    Ok(directory.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_hubs_listings_parse() {
        let huggingface = r#"[{"type":"directory","path":"original"},
            {"type":"file","path":"config.json","size":10},
            {"type":"file","path":"model.safetensors","size":20,"lfs":{"oid":"AB00000000000000000000000000000000000000000000000000000000000000","size":20}}]"#;
        let files = parse_listing(ModelSource::Huggingface, huggingface).unwrap();
        assert_eq!(files.len(), 2);
        assert_eq!(files[1].sha256.as_deref().map(|h| &h[..4]), Some("ab00"));
        let modelscope = r#"{"Code":200,"Data":{"Files":[{"Type":"tree","Path":"x"},{"Type":"blob","Path":"config.json","Size":10,"Sha256":""}]}}"#;
        let files = parse_listing(ModelSource::Modelscope, modelscope).unwrap();
        assert_eq!(
            files,
            vec![RepositoryFile {
                path: "config.json".into(),
                size: 10,
                sha256: None
            }]
        );
    }

    #[test]
    fn a_published_conversion_wins_over_the_checkpoint() {
        let file = |path: &str| RepositoryFile {
            path: path.into(),
            size: 1,
            sha256: None,
        };
        let checkpoint = [
            file("config.json"),
            file("model.safetensors"),
            file("README.md"),
            file("pytorch_model.bin"),
            file("original/consolidated.safetensors"),
            file("../escape.json"),
        ];
        let chosen: Vec<String> = files_to_download(&checkpoint)
            .into_iter()
            .map(|f| f.path)
            .collect();
        assert_eq!(chosen, ["config.json", "model.safetensors"]);
        let mut with_conversion = checkpoint.to_vec();
        with_conversion.push(file("model.ninfer"));
        let chosen: Vec<String> = files_to_download(&with_conversion)
            .into_iter()
            .map(|f| f.path)
            .collect();
        assert_eq!(chosen, ["model.ninfer"]);
    }
}
