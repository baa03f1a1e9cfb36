//! Models by name without the checkpoint on disk, against a fake hub on loopback serving the
//! trained fixture as a two-shard checkpoint: `run` by name converts into the models directory
//! once and answers, a streaming conversion equals a local one byte for byte with a cache bound smaller than a shard (and the cache measured below it), resumes
//! after being killed half-way fetching little again, a dry run by name reads config and
//! headers only, the second hub answers for a dead first one, a published conversion is
//! downloaded and verified, and bad input ends with a clear message and no artifact.

mod common;
use common::fake_hub::{dead_endpoint, silent_endpoint, FakeHub, Repo};
use common::fixture;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SHARDS: [&str; 2] = [
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
];
const SMALL_FILES: [&str; 6] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
];
/// A cache bound below either shard (12.6 and 7.8 MB) and above the largest tensor (3.1 MB).
const CACHE_GB: &str = "0.004";
const CACHE_BOUND: u64 = 4_000_000;

fn trained() -> PathBuf {
    fixture("qwen3_5_moe_trained")
}

fn checkpoint_repo() -> Repo {
    let names: Vec<&str> = SMALL_FILES.iter().chain(SHARDS.iter()).copied().collect();
    Repo::from_directory(&trained(), &names)
}

fn bytes_of(repo: &Repo, names: &[&str]) -> u64 {
    names.iter().map(|name| repo.bytes(name).len() as u64).sum()
}

fn hub_with(repos: Vec<(&str, Repo)>) -> FakeHub {
    FakeHub::start(
        repos
            .into_iter()
            .map(|(name, repo)| (name.to_string(), repo))
            .collect::<HashMap<_, _>>(),
    )
}

fn ninfer(scratch: &Path, huggingface: &str, modelscope: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ninfer"));
    std::fs::create_dir_all(scratch.join("runtime")).unwrap();
    command
        .env("XDG_RUNTIME_DIR", scratch.join("runtime"))
        .env("XDG_CACHE_HOME", scratch.join("cache"))
        .env("XDG_STATE_HOME", scratch.join("state"))
        .env("NINFER_MODELS_DIR", scratch.join("models"))
        .env("HF_ENDPOINT", huggingface)
        .env("MODELSCOPE_ENDPOINT", modelscope)
        .env_remove("NINFER_SOURCE")
        .env_remove("HF_TOKEN")
        .env_remove("MODELSCOPE_API_TOKEN")
        .stdin(Stdio::null());
    command
}

fn stderr_of(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).to_string()
}

/// The fixture converted from its directory (bf16, the default), once per test.
fn local_conversion(scratch: &Path) -> Vec<u8> {
    let output = scratch.join("local.ninfer");
    let result = Command::new(env!("CARGO_BIN_EXE_ninfer"))
        .arg("convert")
        .arg(trained())
        .arg(&output)
        .output()
        .unwrap();
    assert!(result.status.success(), "{}", stderr_of(&result));
    std::fs::read(&output).unwrap()
}

/// Sums the sizes of the files in `directory` every millisecond until `done`; the largest sum.
fn watch_directory(directory: PathBuf, done: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut peak = 0;
        while !done.load(Ordering::SeqCst) {
            let total: u64 = std::fs::read_dir(&directory)
                .map(|entries| {
                    entries
                        .flatten()
                        .filter_map(|entry| entry.metadata().ok())
                        .map(|metadata| metadata.len())
                        .sum()
                })
                .unwrap_or(0);
            peak = peak.max(total);
            std::thread::sleep(Duration::from_millis(1));
        }
        peak
    })
}

fn ranges_directory(scratch: &Path, repository: &str) -> PathBuf {
    scratch
        .join("cache/ninfer/hub")
        .join(repository)
        .join("ranges")
}

/// `name` and every file beside it whose name starts with it (parts, journal).
fn files_named_like(path: &Path) -> Vec<String> {
    let prefix = path.file_name().unwrap().to_string_lossy().to_string();
    std::fs::read_dir(path.parent().unwrap())
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| entry.file_name().to_string_lossy().to_string())
                .filter(|name| name.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn streaming_conversion_equals_a_local_one_within_a_cache_smaller_than_a_shard() {
    let scratch = tempfile::tempdir().unwrap();
    let mut repo = checkpoint_repo();
    // The first answer for the second shard is cut halfway: its range is resumed.
    repo.cut_first = vec![SHARDS[1].to_string()];
    let checkpoint_bytes = bytes_of(&repo, &SHARDS);
    let small_bytes = bytes_of(&repo, &SMALL_FILES);
    let hub = hub_with(vec![("Org/Trained", repo)]);
    let local = local_conversion(scratch.path());

    let done = Arc::new(AtomicBool::new(false));
    let watcher = watch_directory(
        ranges_directory(scratch.path(), "Org/Trained"),
        done.clone(),
    );
    let output = scratch.path().join("streamed.ninfer");
    let result = ninfer(scratch.path(), &hub.endpoint, &hub.endpoint)
        .args(["convert", "Org/Trained", "--cache-gb", CACHE_GB])
        .arg(&output)
        .output()
        .unwrap();
    done.store(true, Ordering::SeqCst);
    let measured_peak = watcher.join().unwrap();
    let stderr = stderr_of(&result);
    assert!(result.status.success(), "{stderr}");
    assert!(
        std::fs::read(&output).unwrap() == local,
        "the streamed artifact differs from the local conversion"
    );
    assert!(
        measured_peak > 0 && measured_peak <= CACHE_BOUND,
        "measured peak cache {measured_peak} bytes, bound {CACHE_BOUND}"
    );
    let reported_peak: u64 = stderr
        .split("peak cache ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|number| number.parse().ok())
        .unwrap_or_else(|| panic!("no peak cache reported:\n{stderr}"));
    assert!(reported_peak <= CACHE_BOUND, "{stderr}");
    assert!(
        stderr.contains("tensors, fetched"),
        "no progress line:\n{stderr}"
    );
    // Every byte of both shards once (each tensor, each header), plus the small files whole:
    // the answer that was cut is continued, not repeated.
    let served = hub.served.load(Ordering::SeqCst);
    let requests = hub.requests.lock().unwrap().clone();
    let resumed = requests
        .iter()
        .any(|(_, file, range)| file == SHARDS[1] && range.as_deref() == Some("bytes=4-7"));
    assert!(resumed, "the cut range was not resumed: {requests:?}");
    assert_eq!(served, checkpoint_bytes + small_bytes, "{stderr}");
    // The cache is gone after a finished conversion.
    assert!(!ranges_directory(scratch.path(), "Org/Trained").exists());
}

#[test]
fn a_killed_streaming_conversion_resumes_and_fetches_little_again() {
    let scratch = tempfile::tempdir().unwrap();
    let repo = checkpoint_repo();
    let checkpoint_bytes = bytes_of(&repo, &SHARDS);
    let small_bytes = bytes_of(&repo, &SMALL_FILES);
    let hub = hub_with(vec![("Org/Trained", repo)]);
    let local = local_conversion(scratch.path());
    let output = scratch.path().join("streamed.ninfer");
    let convert = || {
        let mut command = ninfer(scratch.path(), &hub.endpoint, &hub.endpoint);
        command
            .args(["convert", "Org/Trained", "--cache-gb", CACHE_GB])
            .arg(&output);
        command
    };

    // Slow the hub down so that half-way is a moment the test can catch.
    hub.delay_ms.store(3, Ordering::SeqCst);
    let mut child = convert()
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let half = small_bytes + checkpoint_bytes / 2;
    let deadline = Instant::now() + Duration::from_secs(120);
    while hub.served.load(Ordering::SeqCst) < half {
        assert!(
            Instant::now() < deadline && child.try_wait().unwrap().is_none(),
            "the conversion ended before half of it was fetched"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let at_kill = hub.served.load(Ordering::SeqCst);
    assert!(
        !output.exists(),
        "a killed conversion left {}",
        output.display()
    );
    assert!(at_kill < small_bytes + checkpoint_bytes * 9 / 10);

    hub.delay_ms.store(0, Ordering::SeqCst);
    let result = convert().output().unwrap();
    let stderr = stderr_of(&result);
    assert!(result.status.success(), "{stderr}");
    assert!(stderr.contains("resuming"), "{stderr}");
    assert!(std::fs::read(&output).unwrap() == local);
    let total = hub.served.load(Ordering::SeqCst);
    let once = small_bytes + checkpoint_bytes;
    eprintln!("killed at {at_kill} bytes; both runs fetched {total}, one run fetches {once}");
    assert!(
        total < once + once / 10,
        "two runs fetched {total} bytes, one run fetches {once}: more than 10% extra"
    );
    assert_eq!(files_named_like(&output), ["streamed.ninfer"]);
}

/// A plan as JSON for a 16 GB card with 64 GB of RAM.
fn dry_run(scratch: &Path, model: &str, huggingface: &str, modelscope: &str) -> Output {
    let profile = scratch.join("machine.json");
    std::fs::write(
        &profile,
        r#"{"cpus": 8, "numa_nodes": 1, "ram_gib": 64, "gpu_vram_gib": 16}"#,
    )
    .unwrap();
    ninfer(scratch, huggingface, modelscope)
        .args([
            "run",
            model,
            "--dry-run",
            "--plan-json",
            "--machine-profile",
        ])
        .arg(&profile)
        .output()
        .unwrap()
}

#[test]
fn a_dry_run_by_name_reads_the_config_and_the_headers_only() {
    let scratch = tempfile::tempdir().unwrap();
    let repo = checkpoint_repo();
    let checkpoint_bytes = bytes_of(&repo, &SHARDS);
    let hub = hub_with(vec![("Org/Trained", repo)]);
    let by_name = dry_run(scratch.path(), "Org/Trained", &hub.endpoint, &hub.endpoint);
    assert!(by_name.status.success(), "{}", stderr_of(&by_name));
    let served = hub.served.load(Ordering::SeqCst);
    assert!(
        served * 100 < checkpoint_bytes,
        "a dry run fetched {served} of the checkpoint's {checkpoint_bytes} bytes"
    );
    assert!(!scratch.path().join("models").exists());
    let local = dry_run(
        scratch.path(),
        trained().to_str().unwrap(),
        &hub.endpoint,
        &hub.endpoint,
    );
    assert!(local.status.success(), "{}", stderr_of(&local));
    let by_name: serde_json::Value = serde_json::from_slice(&by_name.stdout).unwrap();
    let local: serde_json::Value = serde_json::from_slice(&local.stdout).unwrap();
    assert_eq!(by_name["model"], "Org/Trained");
    // The disk it takes: the artifact (what the local conversion writes, give or take its
    // index) and the cache, at most the default bound and at most the checkpoint.
    let artifact = local_conversion(scratch.path()).len() as f64;
    let disk = &by_name["disk"];
    let planned = disk["artifact_bytes"].as_f64().unwrap();
    assert!(
        (planned - artifact).abs() < 0.05 * artifact,
        "{disk} vs {artifact}"
    );
    let cache = disk["cache_bytes"].as_u64().unwrap();
    assert!(
        cache < checkpoint_bytes && cache > checkpoint_bytes * 99 / 100,
        "{disk}"
    );
    assert_eq!(disk["fits"], true, "{disk}");
    for field in [
        "architecture",
        "parameters",
        "expert_bank_bytes",
        "host_ram_bytes",
        "gpu_experts_estimate",
        "max_context",
    ] {
        assert_eq!(by_name[field], local[field], "{field}: {by_name}");
    }
}

#[test]
fn the_second_hub_answers_when_the_first_does_not() {
    let scratch = tempfile::tempdir().unwrap();
    let hub = hub_with(vec![("Org/Trained", checkpoint_repo())]);
    let dead = dead_endpoint();
    let output = dry_run(scratch.path(), "Org/Trained", &dead, &hub.endpoint);
    let stderr = stderr_of(&output);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("using ModelScope"), "{stderr}");

    // A first hub that takes connections and never answers is given a few seconds.
    let started = Instant::now();
    let output = dry_run(
        scratch.path(),
        "Org/Trained",
        &silent_endpoint(),
        &hub.endpoint,
    );
    let stderr = stderr_of(&output);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("using ModelScope"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );

    let neither = dry_run(scratch.path(), "Org/Trained", &dead, &dead_endpoint());
    let stderr = stderr_of(&neither);
    assert!(!neither.status.success());
    assert!(
        stderr.contains("Org/Trained")
            && stderr.contains("tried Hugging Face, then ModelScope")
            && stderr.contains(&dead),
        "{stderr}"
    );
}

#[test]
fn a_published_conversion_is_downloaded_and_verified() {
    let scratch = tempfile::tempdir().unwrap();
    let local = local_conversion(scratch.path());
    // A byte in the middle of the weights changed; the listing's SHA-256 is of the changed
    // file, so only the artifact's own checksums can tell.
    let mut broken = local.clone();
    let length = broken.len();
    for step in 0..64 {
        broken[length / 10 + step * (length * 7 / 10) / 64] ^= 0x55;
    }
    let hub = hub_with(vec![
        (
            "Org/Ready",
            Repo::default().with_file("Trained.ninfer", local.clone()),
        ),
        (
            "Org/Broken",
            Repo::default().with_file("Trained.ninfer", broken),
        ),
    ]);
    let models = scratch.path().join("models");
    let run = |model: &str| {
        ninfer(scratch.path(), &hub.endpoint, &hub.endpoint)
            .args(["run", model, "--moe-threads", "1", "--max-tokens", "2"])
            .args(["--temperature", "0", "--prompt", "import os"])
            .output()
            .unwrap()
    };
    let ready = run("Org/Ready");
    let stderr = stderr_of(&ready);
    assert!(ready.status.success(), "{stderr}");
    assert!(stderr.contains("verified its checksums"), "{stderr}");
    assert!(std::fs::read(models.join("Org/Ready/Trained.ninfer")).unwrap() == local);
    assert!(!stderr.contains("converting"), "{stderr}");

    let refused = run("Org/Broken");
    let stderr = stderr_of(&refused);
    assert!(!refused.status.success());
    assert!(stderr.contains("fails its checks"), "{stderr}");
    assert!(!models.join("Org/Broken").exists());

    // A dry run by name plans from the published header, fetched by range.
    let before = hub.served.load(Ordering::SeqCst);
    let planned = dry_run(scratch.path(), "Org/Broken", &hub.endpoint, &hub.endpoint);
    assert!(planned.status.success(), "{}", stderr_of(&planned));
    let plan: serde_json::Value = serde_json::from_slice(&planned.stdout).unwrap();
    assert_eq!(plan["architecture"], "qwen3_5_moe");
    let fetched = hub.served.load(Ordering::SeqCst) - before;
    assert!(
        fetched * 100 < local.len() as u64,
        "{fetched} bytes fetched"
    );
    assert!(!models.join("Org/Broken").exists());
}

#[test]
fn run_by_name_converts_into_the_models_directory_once_and_answers() {
    let scratch = tempfile::tempdir().unwrap();
    let hub = hub_with(vec![("Org/Trained", checkpoint_repo())]);
    let local = local_conversion(scratch.path());
    let run = || {
        ninfer(scratch.path(), &hub.endpoint, &hub.endpoint)
            .args(["run", "Org/Trained", "--cache-gb", CACHE_GB])
            .args([
                "--moe-threads",
                "1",
                "--max-tokens",
                "2",
                "--temperature",
                "0",
            ])
            .args(["--prompt", "import os"])
            .output()
            .unwrap()
    };
    let first = run();
    let stderr = stderr_of(&first);
    assert!(first.status.success(), "{stderr}");
    assert!(!String::from_utf8_lossy(&first.stdout).trim().is_empty());
    let artifact = scratch.path().join("models/Org/Trained/Trained.ninfer");
    assert!(std::fs::read(&artifact).unwrap() == local);
    let served = hub.served.load(Ordering::SeqCst);
    let second = run();
    assert!(second.status.success(), "{}", stderr_of(&second));
    assert_eq!(hub.served.load(Ordering::SeqCst), served, "fetched again");
}

/// Converts `repository` by name into `scratch/NAME.ninfer`; the failure's stderr.
fn failed_conversion(scratch: &Path, hub: &FakeHub, repository: &str) -> String {
    let output = scratch.join(format!("{}.ninfer", repository.replace('/', "-")));
    let result = ninfer(scratch, &hub.endpoint, &hub.endpoint)
        .args(["convert", repository, "--cache-gb", CACHE_GB])
        .arg(&output)
        .output()
        .unwrap();
    let stderr = stderr_of(&result);
    assert!(
        !result.status.success(),
        "{repository} converted:\n{stderr}"
    );
    assert!(!output.exists(), "{repository} left {}", output.display());
    stderr
}

/// The second shard with one tensor's offsets moved past the end of its data.
fn lying_shard(repo: &Repo) -> Vec<u8> {
    let bytes = repo.bytes(SHARDS[1]);
    let length = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let data = &bytes[8 + length..];
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + length]).unwrap();
    let (name, entry) = header
        .iter_mut()
        .find(|(name, _)| name.contains("embed") || name.contains("experts"))
        .unwrap();
    let offsets = entry["data_offsets"].as_array().unwrap();
    let (start, end) = (offsets[0].as_u64().unwrap(), offsets[1].as_u64().unwrap());
    let shift = data.len() as u64;
    entry["data_offsets"] = serde_json::json!([start + shift, end + shift]);
    eprintln!("moved {name} past the data");
    let json = serde_json::to_vec(&header).unwrap();
    let mut lying = (json.len() as u64).to_le_bytes().to_vec();
    lying.extend(json);
    lying.extend(data);
    lying
}

#[test]
fn bad_input_ends_with_a_clear_message_and_no_artifact() {
    let scratch = tempfile::tempdir().unwrap();
    let full = checkpoint_repo();
    let mut gated = checkpoint_repo();
    gated.gated = true;
    let mut truncated = checkpoint_repo();
    let second = truncated.bytes(SHARDS[1]).len();
    truncated
        .truncated
        .insert(SHARDS[1].to_string(), second / 2);
    let lying = checkpoint_repo().with_file(SHARDS[1], lying_shard(&full));
    let no_weights = Repo::from_directory(&trained(), &SMALL_FILES);
    let hub = hub_with(vec![
        ("Org/Full", full),
        ("Org/Gated", gated),
        ("Org/Truncated", truncated),
        ("Org/Lying", lying),
        ("Org/NoWeights", no_weights),
    ]);

    let message = failed_conversion(scratch.path(), &hub, "Org/NoWeights");
    assert!(
        message.contains("Org/NoWeights") && message.contains("no safetensors checkpoint"),
        "{message}"
    );
    let message = failed_conversion(scratch.path(), &hub, "Org/Gated");
    assert!(
        message.contains("Org/Gated")
            && message.contains("refuses access (401")
            && message.contains("HF_TOKEN"),
        "{message}"
    );
    let message = failed_conversion(scratch.path(), &hub, "Org/Truncated");
    assert!(
        message.contains(SHARDS[1])
            && message.contains("shorter than its header says")
            && message.contains("running the same command again continues"),
        "{message}"
    );
    let message = failed_conversion(scratch.path(), &hub, "Org/Lying");
    assert!(
        message.contains(SHARDS[1]) && message.contains("ends at byte"),
        "{message}"
    );
    // A cache that cannot hold the largest tensor (3.1 MB) is refused before anything is read.
    let served = hub.served.load(Ordering::SeqCst);
    let small = scratch.path().join("small-cache.ninfer");
    let result = ninfer(scratch.path(), &hub.endpoint, &hub.endpoint)
        .args(["convert", "Org/Full", "--cache-gb", "0.001"])
        .arg(&small)
        .output()
        .unwrap();
    let message = stderr_of(&result);
    assert!(!result.status.success());
    assert!(message.contains("raise --cache-gb"), "{message}");
    assert!(files_named_like(&small).is_empty());
    let fetched = hub.served.load(Ordering::SeqCst) - served;
    assert!(fetched < 1 << 20, "{fetched} bytes fetched before refusing");
    // Only a network failure keeps partial output, for the next run to continue.
    for refused in ["Org-NoWeights", "Org-Gated", "Org-Lying"] {
        let output = scratch.path().join(format!("{refused}.ninfer"));
        assert!(files_named_like(&output).is_empty(), "{refused}");
    }

    // A disk that fills up: no file of this process may grow past 2 MB (the cache's largest
    // range and the artifact are bigger).
    let output = scratch.path().join("full.ninfer");
    let mut command = ninfer(scratch.path(), &hub.endpoint, &hub.endpoint);
    command
        .args(["convert", "Org/Full", "--cache-gb", CACHE_GB])
        .arg(&output);
    // SAFETY: between fork and exec only async-signal-safe calls (setrlimit, sigaction).
    unsafe {
        use std::os::unix::process::CommandExt;
        command.pre_exec(|| {
            use nix::sys::resource::{setrlimit, Resource};
            use nix::sys::signal::{signal, SigHandler, Signal};
            // Past the limit a write fails (EFBIG) instead of the signal ending the process.
            signal(Signal::SIGXFSZ, SigHandler::SigIgn).map_err(std::io::Error::from)?;
            setrlimit(Resource::RLIMIT_FSIZE, 2_000_000, 2_000_000)
                .map_err(std::io::Error::from)?;
            Ok(())
        });
    }
    let result = command.output().unwrap();
    let message = stderr_of(&result);
    assert!(!result.status.success(), "{message}");
    assert!(message.contains("File too large"), "{message}");
    assert!(
        files_named_like(&output).is_empty(),
        "{:?}",
        files_named_like(&output)
    );
}
