//! Models by name without the checkpoint on disk. A repository `ORG/NAME` that publishes a
//! `.ninfer` conversion is downloaded as it is and verified; otherwise its safetensors are
//! converted while they stream: the shards' headers are fetched by range, the conversion is
//! planned from them, and only the byte ranges of the next tensors are fetched, into a cache
//! bounded by `--cache-gb` and emptied as the converter reads it. A plan (`--dry-run`) needs
//! only `config.json` and the headers.
//!
//! Owns: choosing between a published conversion and streaming, the hub cache directory of a
//! repository (small files, range cache), the up-front disk check, the final report.
//! Must not touch: the conversion itself (`ninfer_convert`), HTTP details (`hub`, `range`).

mod cache;
mod disk;
mod progress;
mod range;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context};
use ninfer_convert::{ConvertOptions, ConvertReport, RemoteShard};

use crate::download::download_files;
use crate::hub::{connect, Connected, RepositoryFile, SourceChoice};
use cache::{FetchStats, RangeCache, ShardUrl};
use range::{fetch_range, RangeRequest};

/// The cache bound when `--cache-gb` is not given.
pub const DEFAULT_CACHE_GB: f64 = 20.0;

/// Largest safetensors header fetched (the format's own readers refuse bigger ones too).
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// `--cache-gb` in bytes (10^9 bytes a GB).
pub fn cache_bytes(gb: Option<f64>) -> anyhow::Result<u64> {
    match gb.unwrap_or(DEFAULT_CACHE_GB) {
        gb if gb.is_finite() && gb > 0.0 => Ok((gb * 1e9) as u64),
        gb => bail!("--cache-gb must be a positive number, got {gb}"),
    }
}

/// Where the files of a repository fetched from a hub live: `$XDG_CACHE_HOME/ninfer/hub/ORG/NAME`
/// (its small files under `files/`, the range cache under `ranges/`).
fn hub_cache_dir(repository: &str) -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("ninfer/hub")
        .join(repository)
}

/// The top-level files of a listing whose names end with one of `suffixes`, by name.
fn top_level(files: &[RepositoryFile], suffixes: &[&str]) -> Vec<RepositoryFile> {
    let mut chosen: Vec<RepositoryFile> = files
        .iter()
        .filter(|file| {
            !file.path.contains('/')
                && file.path != ".."
                && suffixes.iter().any(|suffix| file.path.ends_with(suffix))
        })
        .cloned()
        .collect();
    chosen.sort_by(|a, b| a.path.cmp(&b.path));
    chosen
}

/// The files of a published conversion (`*.ninfer` and its parts), if the repository has one.
fn published_conversion(connected: &Connected) -> Vec<RepositoryFile> {
    let files = crate::hub::files_to_download(&connected.files);
    if files.iter().any(|file| file.path.ends_with(".ninfer")) {
        files
    } else {
        Vec::new()
    }
}

/// The repository's safetensors shards, or an error naming what it holds instead.
fn shards_of(connected: &Connected) -> anyhow::Result<Vec<RepositoryFile>> {
    let shards = top_level(&connected.files, &[".safetensors"]);
    if shards.is_empty() {
        let listed: Vec<&str> = connected
            .files
            .iter()
            .take(8)
            .map(|f| f.path.as_str())
            .collect();
        bail!(
            "{}: {} lists no .ninfer conversion and no safetensors checkpoint (files: {}{})",
            connected.repository,
            connected.hub.source.name(),
            listed.join(", "),
            if connected.files.len() > listed.len() {
                ", …"
            } else {
                ""
            }
        );
    }
    Ok(shards)
}

/// Bytes `start..end` of the repository's file `path`.
fn fetch_bytes(
    connected: &Connected,
    path: &str,
    start: u64,
    end: u64,
    stats: &FetchStats,
) -> anyhow::Result<Vec<u8>> {
    let stop = AtomicBool::new(false);
    let url = connected.hub.file_url(&connected.repository, path);
    let mut bytes = Vec::new();
    let request = RangeRequest {
        hub: &connected.hub,
        url: &url,
        file: path,
        start,
        end,
        fetched: &stats.fetched,
        stop: &stop,
    };
    fetch_range(&request, 0, &mut bytes)
        .map_err(|error| anyhow::anyhow!("{}: {error}", connected.repository))?;
    Ok(bytes)
}

/// Fetches each shard's header by two range requests (its length, then the JSON).
fn fetch_headers(
    connected: &Connected,
    shards: &[RepositoryFile],
    stats: &FetchStats,
) -> anyhow::Result<Vec<RemoteShard>> {
    let mut headers = Vec::with_capacity(shards.len());
    for shard in shards {
        if shard.size < 8 {
            bail!(
                "{}: {} is {} bytes, too short for a safetensors header",
                connected.repository,
                shard.path,
                shard.size
            );
        }
        let mut header = fetch_bytes(connected, &shard.path, 0, 8, stats)?;
        let mut length = [0u8; 8];
        length.copy_from_slice(&header[..8]);
        let length = u64::from_le_bytes(length);
        if length > MAX_HEADER_BYTES || 8 + length > shard.size {
            bail!(
                "{}: {} announces a safetensors header of {length} bytes, which does not fit in \
                 its {} bytes (limit {MAX_HEADER_BYTES})",
                connected.repository,
                shard.path,
                shard.size
            );
        }
        header.extend(fetch_bytes(connected, &shard.path, 8, 8 + length, stats)?);
        headers.push(RemoteShard {
            name: shard.path.clone(),
            size: shard.size,
            header,
        });
    }
    Ok(headers)
}

/// The header of a published conversion, by range: its preamble, then the JSON it points at.
fn published_header(
    connected: &Connected,
    files: &[RepositoryFile],
) -> anyhow::Result<ninfer_artifact::Header> {
    use ninfer_artifact::header::{Preamble, PREAMBLE_LENGTH};
    let repository = &connected.repository;
    let Some(first) = files.iter().find(|file| file.path.ends_with(".ninfer")) else {
        bail!("{repository}: no .ninfer file among {files:?}");
    };
    let stats = FetchStats::new();
    let bytes = fetch_bytes(
        connected,
        &first.path,
        0,
        PREAMBLE_LENGTH.min(first.size),
        &stats,
    )?;
    let preamble = Preamble::decode(&bytes, Path::new(&first.path))
        .with_context(|| format!("{repository}: the published conversion"))?;
    let (part, offset) = if preamble.part_count > 1 && preamble.part_size > 0 {
        (
            preamble.header_offset / preamble.part_size,
            preamble.header_offset % preamble.part_size,
        )
    } else {
        (0, preamble.header_offset)
    };
    if preamble.part_count > 1 && offset + preamble.header_length > preamble.part_size {
        bail!(
            "{repository}: the header of {} crosses two of its parts; download it to plan",
            first.path
        );
    }
    let path = if part == 0 {
        first.path.clone()
    } else {
        format!("{}.part-{part:04}", first.path)
    };
    let json = fetch_bytes(
        connected,
        &path,
        offset,
        offset + preamble.header_length,
        &stats,
    )?;
    if ninfer_artifact::Checksum::of(&json) != preamble.header_checksum {
        bail!(
            "{repository}: the header of {} does not match its checksum",
            first.path
        );
    }
    serde_json::from_slice(&json)
        .with_context(|| format!("{repository}: the header of {} is not valid", first.path))
}

/// Downloads the small files a conversion or a plan reads (`config_only`: `config.json` alone)
/// into `directory`.
fn fetch_small_files(
    connected: &Connected,
    directory: &Path,
    config_only: bool,
) -> anyhow::Result<()> {
    let files = if config_only {
        top_level(&connected.files, &["config.json"])
            .into_iter()
            .filter(|file| file.path == "config.json")
            .collect()
    } else {
        top_level(
            &connected.files,
            &[".json", ".jinja", ".txt", ".model", ".tiktoken"],
        )
    };
    if !files.iter().any(|file| file.path == "config.json") {
        bail!(
            "{}: {} lists no config.json",
            connected.repository,
            connected.hub.source.name()
        );
    }
    download_files(connected, &files, directory)
}

/// Converts the connected repository's safetensors into `options.output` while they stream
/// (`options.input_dir` is replaced by the directory of its small files), with at most
/// `cache_bound` bytes of fetched ranges on disk at once. An interrupted run leaves the
/// output's journal and range files; running it again continues.
pub fn convert_by_name(
    connected: &Connected,
    options: &ConvertOptions,
    cache_bound: u64,
) -> anyhow::Result<ConvertReport> {
    let repository = &connected.repository;
    let shards = shards_of(connected)?;
    let root = hub_cache_dir(repository);
    let files_dir = root.join("files");
    let ranges_dir = root.join("ranges");
    fetch_small_files(connected, &files_dir, false)?;
    let stats = Arc::new(FetchStats::new());
    let remote = fetch_headers(connected, &shards, &stats)?;
    let options = ConvertOptions {
        input_dir: files_dir,
        ..options.clone()
    };
    let size = ninfer_convert::remote_conversion_size(&options, &remote)
        .with_context(|| format!("planning the conversion of {repository}"))?;
    if size.largest_read > cache_bound {
        bail!(
            "--cache-gb {:.3}: {repository} has a tensor of {} bytes to read at once, more than \
             the cache bound of {cache_bound} bytes; raise --cache-gb to at least {:.3}",
            cache_bound as f64 / 1e9,
            size.largest_read,
            size.largest_read as f64 / 1e9
        );
    }
    let mut needs = vec![disk::Need {
        what: "the artifact".into(),
        path: options.output.clone(),
        // The artifact's index and alignment add a little to its tensors.
        bytes: size.output_bytes + size.output_bytes / 50 + (16 << 20),
    }];
    needs.push(disk::Need {
        what: "the range cache".into(),
        path: ranges_dir.clone(),
        bytes: cache_bound.min(size.read_bytes),
    });
    disk::check_space(&needs)?;
    eprintln!(
        "converting {repository} from {} while it streams: {:.2} GB of tensors to read in {} \
         shard(s), a cache of at most {:.2} GB in {}",
        connected.hub.source.name(),
        size.read_bytes as f64 / 1e9,
        remote.len(),
        cache_bound as f64 / 1e9,
        ranges_dir.display()
    );
    let shard_urls = shards
        .iter()
        .map(|shard| ShardUrl {
            name: shard.path.clone(),
            url: connected.hub.file_url(repository, &shard.path),
        })
        .collect();
    let hub = crate::hub::Hub::new(connected.hub.source, None);
    let source = Arc::new(RangeCache::new(
        hub,
        shard_urls,
        ranges_dir.clone(),
        cache_bound,
        Arc::clone(&stats),
    ));
    let progress = progress::StreamProgress::new(Arc::clone(&stats), cache_bound);
    let result =
        ninfer_convert::convert_remote_checkpoint(&options, &remote, source.clone(), &progress);
    drop(source);
    progress.finish();
    let report = match result {
        Ok(report) => report,
        // A network failure or an interruption keeps what is done for the next run.
        Err(error) if error.is_resumable() => {
            return Err(anyhow::Error::new(error).context(format!(
                "converting {repository} into {} stopped; what is done is kept beside it \
                 (.partial), and running the same command again continues from there",
                options.output.display()
            )))
        }
        Err(error) => {
            return Err(anyhow::Error::new(error).context(format!(
                "converting {repository} into {}",
                options.output.display()
            )))
        }
    };
    let _ = std::fs::remove_dir_all(&ranges_dir);
    eprintln!(
        "fetched {} bytes from {} ({} of tensors), peak cache {} bytes (bound {cache_bound})",
        stats.fetched.load(Ordering::SeqCst),
        connected.hub.source.name(),
        stats.consumed.load(Ordering::SeqCst),
        stats.peak.load(Ordering::SeqCst),
    );
    Ok(report)
}

/// Downloads a published conversion into `directory` and verifies every checksum in it.
fn download_conversion(
    connected: &Connected,
    files: &[RepositoryFile],
    directory: &Path,
) -> anyhow::Result<()> {
    let total: u64 = files.iter().map(|file| file.size).sum();
    disk::check_space(&[disk::Need {
        what: "the published conversion".into(),
        path: directory.to_path_buf(),
        bytes: total,
    }])?;
    download_files(connected, files, directory)?;
    let Some(first) = files.iter().find(|file| file.path.ends_with(".ninfer")) else {
        bail!("{}: no .ninfer file among {files:?}", connected.repository);
    };
    let path = directory.join(&first.path);
    let checked =
        ninfer_artifact::Artifact::open(&path).and_then(|artifact| artifact.verify(|_| {}));
    if let Err(error) = checked {
        for file in files {
            let _ = std::fs::remove_file(directory.join(&file.path));
        }
        bail!(
            "{}: the published conversion {} fails its checks ({error}); removed, run again",
            connected.repository,
            first.path
        );
    }
    eprintln!(
        "{}: downloaded the published conversion {} and verified its checksums",
        connected.repository, first.path
    );
    Ok(())
}

/// Makes `repository` runnable from `directory` (its place in the models directory): its
/// published conversion downloaded and verified, else its checkpoint converted while it
/// streams into `directory/NAME.ninfer` (bf16).
pub fn obtain(
    repository: &str,
    directory: &Path,
    choice: Option<SourceChoice>,
    cache_bound: u64,
) -> anyhow::Result<()> {
    let connected = connect(repository, SourceChoice::chosen(choice)?)?;
    let published = published_conversion(&connected);
    let result = if published.is_empty() {
        let name = repository.rsplit('/').next().unwrap_or(repository);
        std::fs::create_dir_all(directory)
            .with_context(|| format!("creating {}", directory.display()))?;
        let output = directory.join(format!("{name}.ninfer"));
        let options = ConvertOptions::new(PathBuf::new(), &output);
        convert_by_name(&connected, &options, cache_bound).map(|_| ())
    } else {
        download_conversion(&connected, &published, directory)
    };
    if result.is_err() {
        // An empty directory would look like a model that is there; what a later run can
        // continue from (partial files) stays.
        let _ = std::fs::remove_dir(directory);
    }
    result
}

/// Converts `repository` into `options.output` while it streams (for `ninfer convert
/// ORG/NAME`).
pub fn convert_named(
    repository: &str,
    options: &ConvertOptions,
    choice: Option<SourceChoice>,
    cache_bound: u64,
) -> anyhow::Result<ConvertReport> {
    let connected = connect(repository, SourceChoice::chosen(choice)?)?;
    if top_level(&connected.files, &[".safetensors"]).is_empty()
        && !published_conversion(&connected).is_empty()
    {
        bail!(
            "{repository}: {} publishes a .ninfer conversion, not a checkpoint; `ninfer run \
             {repository}` downloads it as it is",
            connected.hub.source.name()
        );
    }
    convert_by_name(&connected, options, cache_bound)
}

/// What a plan needs of `repository`, from its `config.json` and its shards' headers alone, or
/// from the header of the conversion it publishes; and the disk fetching it into `local` takes.
pub fn facts_by_name(
    repository: &str,
    choice: Option<SourceChoice>,
    local: &Path,
    cache_bound: u64,
) -> anyhow::Result<(crate::model_facts::ModelFacts, crate::plan::DiskPlan)> {
    use crate::model_facts::{ModelFacts, ModelLocation};
    let connected = connect(repository, SourceChoice::chosen(choice)?)?;
    let published = published_conversion(&connected);
    let disk_plan = |artifact_bytes: u64, cache_bytes: u64| {
        let free_bytes = disk::available_bytes(local);
        crate::plan::DiskPlan {
            directory: local.display().to_string(),
            artifact_bytes,
            cache_bytes,
            free_bytes,
            fits: free_bytes.is_none_or(|free| artifact_bytes + cache_bytes <= free),
        }
    };
    if !published.is_empty() {
        let header = published_header(&connected, &published)?;
        let facts = ModelFacts::of_artifact_header(
            &header,
            &ModelLocation::Artifact(PathBuf::from(repository)),
        );
        let size = published.iter().map(|file| file.size).sum();
        return Ok((facts, disk_plan(size, 0)));
    }
    let shards = shards_of(&connected)?;
    let files_dir = hub_cache_dir(repository).join("files");
    fetch_small_files(&connected, &files_dir, true)?;
    let stats = FetchStats::new();
    let remote = fetch_headers(&connected, &shards, &stats)?;
    let headers: Vec<(String, Vec<u8>)> = remote
        .iter()
        .map(|shard| {
            (
                shard.name.clone(),
                shard.header.get(8..).unwrap_or(&[]).to_vec(),
            )
        })
        .collect();
    let facts = ModelFacts::of_checkpoint_headers(
        &files_dir,
        &ModelLocation::Checkpoint(PathBuf::from(repository)),
        &headers,
    )?;
    let name = repository.rsplit('/').next().unwrap_or(repository);
    let options = ConvertOptions::new(&files_dir, local.join(format!("{name}.ninfer")));
    let size = ninfer_convert::remote_conversion_size(&options, &remote)
        .with_context(|| format!("planning the conversion of {repository}"))?;
    Ok((
        facts,
        disk_plan(size.output_bytes, cache_bound.min(size.read_bytes)),
    ))
}
