//! `ninfer run` when something is wrong or the user stops it: a nonsense value is refused before
//! anything converts or starts, naming the flag and the limit; a child that cannot start is
//! reported at once with the end of its log (kept where the message says); SIGTERM stops every
//! process within 2 s and leaves no shared-memory segment. Needs the workspace binaries built
//! next to `ninfer` (`cargo build --workspace --bins`).

mod common;
use common::fixture;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A scratch home for one test: runtime, cache and state directories of its own.
struct Scratch {
    directory: tempfile::TempDir,
}

impl Scratch {
    fn new() -> Self {
        let scratch = Scratch {
            directory: tempfile::tempdir().unwrap(),
        };
        std::fs::create_dir_all(scratch.path("runtime")).unwrap();
        scratch
    }

    fn path(&self, name: &str) -> PathBuf {
        self.directory.path().join(name)
    }

    fn ninfer(&self) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_ninfer"));
        command
            .env("XDG_RUNTIME_DIR", self.path("runtime"))
            .env("XDG_CACHE_HOME", self.path("cache"))
            .env("XDG_STATE_HOME", self.path("state"))
            .stdin(Stdio::null());
        command
    }

    /// The fixture converted (f32) into the scratch directory.
    fn artifact(&self) -> PathBuf {
        let output = self.path("qwen3_moe.ninfer");
        common::convert_fixture_f32("qwen3_moe", &output);
        output
    }

    /// Every file and directory under `name` (empty when it does not exist).
    fn entries(&self, name: &str) -> Vec<PathBuf> {
        fn walk(directory: &Path, into: &mut Vec<PathBuf>) {
            if let Ok(entries) = std::fs::read_dir(directory) {
                for entry in entries.flatten() {
                    into.push(entry.path());
                    walk(&entry.path(), into);
                }
            }
        }
        let mut found = Vec::new();
        walk(&self.path(name), &mut found);
        found
    }
}

/// Runs to the end within `limit`; the output and how long it took.
fn finish_within(mut child: Child, limit: Duration) -> (Output, Duration) {
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            let output = child.wait_with_output().unwrap();
            panic!(
                "still running after {limit:?}:\n{}\n{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    (child.wait_with_output().unwrap(), started.elapsed())
}

fn spawn_piped(command: &mut Command) -> Child {
    command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn nonsense_values_are_refused_before_anything_converts_or_starts() {
    let scratch = Scratch::new();
    for (arguments, needles) in [
        (
            vec!["--max-context", "9000"],
            vec!["--max-context 9000", "4096"],
        ),
        (
            vec!["--moe-gpu-experts", "9"],
            vec!["--moe-gpu-experts 9", "8"],
        ),
        (
            vec!["--moe-threads", "100000"],
            vec!["--moe-threads 100000"],
        ),
        (vec!["--gpu-mem-budget=-1"], vec!["--gpu-mem-budget -1"]),
        (
            vec!["--max-tokens", "5000"],
            vec!["--max-tokens 5000", "4096"],
        ),
        (vec!["--temperature", "NaN"], vec!["--temperature NaN"]),
    ] {
        let child = spawn_piped(
            scratch
                .ninfer()
                .arg("run")
                .arg(fixture("qwen3_moe"))
                .args(&arguments),
        );
        let (output, took) = finish_within(child, Duration::from_secs(5));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{arguments:?} was accepted");
        for needle in needles {
            assert!(
                stderr.contains(needle),
                "{arguments:?}: {needle:?} not in:\n{stderr}"
            );
        }
        assert!(took < Duration::from_secs(5));
    }
    assert!(
        scratch.entries("cache").is_empty() && scratch.entries("state").is_empty(),
        "a refused run wrote files: {:?} {:?}",
        scratch.entries("cache"),
        scratch.entries("state")
    );
}

#[test]
fn dry_run_on_a_checkpoint_reads_headers_and_writes_nothing() {
    let scratch = Scratch::new();
    let child = spawn_piped(
        scratch
            .ninfer()
            .args(["run", "--dry-run", "--json"])
            .arg(fixture("qwen3_moe")),
    );
    let (output, _) = finish_within(child, Duration::from_secs(20));
    assert!(output.status.success(), "{output:?}");
    let plan: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(plan["architecture"], "qwen3_moe");
    assert_eq!(plan["needs_conversion"], true);
    assert!(plan["expert_bank_bytes"].as_u64() > Some(0), "{plan}");
    assert!(
        plan["machine"]["ram_total_bytes"].as_u64() > Some(0),
        "{plan}"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("converting"), "{stderr}");
    for directory in ["cache", "state", "runtime"] {
        assert!(
            scratch.entries(directory).is_empty(),
            "--dry-run wrote {:?}",
            scratch.entries(directory)
        );
    }
}

#[test]
fn a_child_that_cannot_start_is_reported_at_once_with_its_log() {
    let scratch = Scratch::new();
    let artifact = scratch.artifact();
    let child = spawn_piped(scratch.ninfer().arg("run").arg(&artifact).args([
        "--moe-threads",
        "1",
        "--engine-arg",
        "--no-such-engine-flag",
    ]));
    let (output, took) = finish_within(child, Duration::from_secs(15));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(took < Duration::from_secs(5), "took {took:?}:\n{stderr}");
    assert!(stderr.contains("engine exited while starting"), "{stderr}");
    assert!(
        stderr.contains("--no-such-engine-flag"),
        "the log's end is not quoted:\n{stderr}"
    );
    let logs: Vec<PathBuf> = scratch
        .entries("state")
        .into_iter()
        .filter(|path| path.file_name().is_some_and(|name| name == "engine.log"))
        .collect();
    assert_eq!(logs.len(), 1, "{:?}", scratch.entries("state"));
    assert!(
        stderr.contains(&logs[0].display().to_string()),
        "the message does not name the kept log {}:\n{stderr}",
        logs[0].display()
    );
    assert!(
        scratch.entries("runtime").is_empty(),
        "{:?}",
        scratch.entries("runtime")
    );
}

fn alive(pid: i32) -> bool {
    // A zombie (exited, not yet reaped by a parent that is gone) counts as stopped.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| {
            !stat
                .rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(false)
}

#[test]
fn sigterm_stops_run_serve_and_every_child_within_two_seconds() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    use std::io::{BufRead, BufReader};
    let scratch = Scratch::new();
    let artifact = scratch.artifact();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut run = scratch
        .ninfer()
        .arg("run")
        .arg(&artifact)
        .args(["--moe-threads", "1", "--serve", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(run.stdout.take().unwrap());
    let mut ready = false;
    for line in stdout.lines() {
        if line.unwrap().starts_with("ready: ") {
            ready = true;
            break;
        }
    }
    assert!(ready, "run --serve never said ready");
    let runtime_dir = scratch.path("runtime").join(format!("ninfer-{}", run.id()));
    let mut pids = vec![run.id() as i32];
    for label in ["gateway", "engine", "experts-0"] {
        let text = std::fs::read_to_string(runtime_dir.join(format!("{label}.pid"))).unwrap();
        pids.push(text.trim().parse().unwrap());
    }
    let engine_pid = pids[2];
    kill(Pid::from_raw(run.id() as i32), Signal::SIGTERM).unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = run.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "run --serve still running 2 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "{status}");
    for pid in &pids[1..] {
        assert!(
            !alive(*pid),
            "child {pid} still running after run --serve stopped"
        );
    }
    let leaked: Vec<_> = std::fs::read_dir("/dev/shm")
        .map(|entries| {
            entries
                .flatten()
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .filter(|name| name.starts_with(&format!("ninfer-{engine_pid}-")))
                .collect()
        })
        .unwrap_or_default();
    assert!(leaked.is_empty(), "shared memory left behind: {leaked:?}");
    assert!(
        !runtime_dir.exists(),
        "the runtime directory was not removed"
    );
}
