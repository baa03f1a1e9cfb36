//! A tiny process supervisor for `ninfer serve` and `ninfer run`: starts the service processes on
//! a private runtime directory, reports a child that dies before the pipeline was ever ready (with
//! the end of its log) instead of restarting it, restarts a child that dies after it was healthy
//! (as systemd's `Restart=on-failure` would), and stops them all — SIGTERM to each child in the
//! reverse of the start order, the next one only once the last is gone (the gateway's drain
//! errors go out while the engine still serves), SIGKILL for any still running at
//! [`STOP_BUDGET`] — on Ctrl-C, SIGTERM or SIGHUP.
//!
//! Owns: child processes, their pid files under the runtime directory, their logs under a
//! persistent log directory, and the shared-memory segments a stopped child left behind.
//! Must not touch: what the children do.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;

/// The CPUs `ninfer` was started with (`taskset` and cgroups respected), read once at start-up.
static STARTUP_AFFINITY: std::sync::OnceLock<Option<CpuSet>> = std::sync::OnceLock::new();

/// Records the process's CPU affinity before anything pins a thread (call first in `main`).
/// Children start with it, not with whatever the spawning thread was pinned to since (a
/// bandwidth measurement pins its threads; a pipeline inheriting one CPU ran ~100× slower).
pub fn remember_startup_affinity() {
    STARTUP_AFFINITY.get_or_init(|| sched_getaffinity(Pid::from_raw(0)).ok());
}

static STOP_REQUESTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(_signal: nix::libc::c_int) {
    STOP_REQUESTED.store(true, Ordering::SeqCst);
}

/// Ctrl-C, SIGTERM and SIGHUP (the terminal closed) ask the supervisor to stop its children and
/// exit.
pub fn install_stop_handler() {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let action = SigAction::new(
        SigHandler::Handler(on_stop_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        let _ = unsafe { sigaction(signal, &action) };
    }
}

pub fn stop_requested() -> bool {
    STOP_REQUESTED.load(Ordering::SeqCst)
}

/// How long stopping every child may take, SIGTERM to the last SIGKILL.
pub const STOP_BUDGET: Duration = Duration::from_millis(1800);

/// Lines of a child's log quoted when it fails during start-up.
const LOG_TAIL_LINES: usize = 20;

/// How many run log directories are kept under the log root (the oldest are removed).
const KEPT_LOG_RUNS: usize = 20;

/// One supervised process.
#[derive(Debug, Clone)]
pub struct ChildSpec {
    pub label: String,
    pub program: PathBuf,
    pub args: Vec<String>,
}

struct Supervised {
    spec: ChildSpec,
    child: Option<Child>,
    /// Pid of the last process started for this child (for the shared-memory sweep).
    last_pid: Option<u32>,
    restarts: u32,
    next_start: Instant,
    /// Set once the pipeline answered; only a healthy child is restarted when it exits.
    healthy: bool,
}

/// A private runtime directory (sockets and pid files, removed on drop), a persistent log
/// directory, and the supervised children.
pub struct Supervisor {
    runtime_dir: PathBuf,
    log_dir: PathBuf,
    children: Vec<Supervised>,
}

/// A child exited before the pipeline was ready: said at once, never restarted.
#[derive(Debug)]
pub struct StartupFailure {
    pub label: String,
    pub status: String,
    pub log: PathBuf,
    pub log_tail: String,
}

impl std::fmt::Display for StartupFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} exited while starting ({}); the end of its log {}:",
            self.label,
            self.status,
            self.log.display()
        )?;
        write!(f, "{}", self.log_tail)
    }
}

impl std::error::Error for StartupFailure {}

/// A program of this installation: next to the running `ninfer`, else on `PATH`.
pub fn sibling_binary(name: &str) -> PathBuf {
    if let Ok(exe) = std::env::current_exe() {
        if let Some(directory) = exe.parent() {
            let candidate = directory.join(name);
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    PathBuf::from(name)
}

/// Where `ninfer` keeps state across runs (routing statistics, logs): `$XDG_STATE_HOME/ninfer`,
/// else `~/.local/state/ninfer`.
pub fn state_dir() -> PathBuf {
    std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".local/state")))
        .unwrap_or_else(std::env::temp_dir)
        .join("ninfer")
}

/// The last `lines` lines of a file (empty when it cannot be read).
pub fn file_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn seconds_since_epoch() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Removes the oldest run directories under `root` so that at most `keep` remain (best effort).
fn prune_log_runs(root: &Path, keep: usize) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    let mut runs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    // Names start with the start time in seconds, zero-padded, so the name order is the age order.
    runs.sort();
    let excess = runs.len().saturating_sub(keep);
    for old in &runs[..excess] {
        let _ = std::fs::remove_dir_all(old);
    }
}

impl Supervisor {
    /// Creates `$XDG_RUNTIME_DIR/ninfer-<pid>` (or under the temp dir), mode 0700, and the log
    /// directory `<state dir>/logs/<start time>-<pid>`, which is kept after the run.
    pub fn new() -> anyhow::Result<Self> {
        let base = std::env::var_os("XDG_RUNTIME_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let runtime_dir = base.join(format!("ninfer-{}", std::process::id()));
        std::fs::create_dir_all(&runtime_dir)
            .with_context(|| format!("creating {}", runtime_dir.display()))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&runtime_dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("securing {}", runtime_dir.display()))?;
        let log_root = state_dir().join("logs");
        prune_log_runs(&log_root, KEPT_LOG_RUNS.saturating_sub(1));
        let log_dir = log_root.join(format!(
            "{:012}-{}",
            seconds_since_epoch(),
            std::process::id()
        ));
        std::fs::create_dir_all(&log_dir)
            .with_context(|| format!("creating the log directory {}", log_dir.display()))?;
        Ok(Supervisor {
            runtime_dir,
            log_dir,
            children: Vec::new(),
        })
    }

    /// Where the children's logs are written; it outlives the supervisor.
    pub fn log_dir(&self) -> &Path {
        &self.log_dir
    }

    /// The log file of the child `label`.
    pub fn log_path(&self, label: &str) -> PathBuf {
        self.log_dir.join(format!("{label}.log"))
    }

    /// A unix-socket address inside the runtime directory.
    pub fn socket(&self, name: &str) -> String {
        format!(
            "unix:{}",
            self.runtime_dir.join(format!("{name}.sock")).display()
        )
    }

    pub fn add(&mut self, spec: ChildSpec) -> anyhow::Result<()> {
        let mut supervised = Supervised {
            spec,
            child: None,
            last_pid: None,
            restarts: 0,
            next_start: Instant::now(),
            healthy: false,
        };
        start_child(&self.runtime_dir, &self.log_dir, &mut supervised)?;
        self.children.push(supervised);
        Ok(())
    }

    /// The pipeline answered: from now on a child that exits is restarted, not reported.
    pub fn mark_healthy(&mut self) {
        for supervised in &mut self.children {
            supervised.healthy = true;
        }
    }
}

fn start_child(
    runtime_dir: &Path,
    log_dir: &Path,
    supervised: &mut Supervised,
) -> anyhow::Result<()> {
    let spec = &supervised.spec;
    let log_path = log_dir.join(format!("{}.log", spec.label));
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let mut command = Command::new(&spec.program);
    command
        .args(&spec.args)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        // Its own process group: a terminal's Ctrl-C reaches only `ninfer`, which stops the
        // children in order (gateway first, so the engine has no client left to wait for).
        .process_group(0);
    let startup = STARTUP_AFFINITY.get().copied().flatten();
    // SAFETY: runs in the forked child before exec; prctl and sched_setaffinity are plain
    // system calls (async-signal-safe) on values copied into the closure.
    unsafe {
        command.pre_exec(move || {
            // The child goes when `ninfer` goes, even when `ninfer` is killed outright.
            let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM);
            if let Some(startup) = &startup {
                // A mask the child cannot take is not a reason to fail its start.
                let _ = sched_setaffinity(Pid::from_raw(0), startup);
            }
            Ok(())
        });
    }
    let child = command
        .spawn()
        .with_context(|| format!("starting {} ({})", spec.label, spec.program.display()))?;
    std::fs::write(
        runtime_dir.join(format!("{}.pid", spec.label)),
        child.id().to_string(),
    )?;
    tracing::debug!(child = %spec.label, pid = child.id(), log = %log_path.display(), "started");
    supervised.last_pid = Some(child.id());
    supervised.child = Some(child);
    Ok(())
}

impl Supervisor {
    /// Notices children that exited: one that was never healthy is a [`StartupFailure`] (the
    /// caller stops everything and says why); a healthy one is restarted, with a growing delay
    /// for one that keeps dying.
    pub fn poll(&mut self) -> Result<(), StartupFailure> {
        let now = Instant::now();
        for index in 0..self.children.len() {
            let exited = match self.children[index].child.as_mut().map(|c| c.try_wait()) {
                Some(Ok(Some(status))) => Some(status.to_string()),
                Some(Err(error)) => Some(error.to_string()),
                _ => None,
            };
            if let Some(status) = exited {
                let supervised = &mut self.children[index];
                supervised.child = None;
                if !supervised.healthy {
                    let log = self.log_dir.join(format!("{}.log", supervised.spec.label));
                    return Err(StartupFailure {
                        label: supervised.spec.label.clone(),
                        status,
                        log_tail: file_tail(&log, LOG_TAIL_LINES),
                        log,
                    });
                }
                supervised.restarts += 1;
                let delay = Duration::from_millis(200 * u64::from(supervised.restarts.min(25)));
                supervised.next_start = now + delay;
                tracing::warn!(child = %supervised.spec.label, %status, "exited; restarting in {:.1}s", delay.as_secs_f64());
            }
            let supervised = &mut self.children[index];
            if supervised.child.is_none() && now >= supervised.next_start {
                if let Err(error) = start_child(&self.runtime_dir, &self.log_dir, supervised) {
                    tracing::error!("{error:#}");
                    supervised.next_start = now + Duration::from_secs(2);
                }
            }
        }
        Ok(())
    }

    /// Runs until a stop signal, supervising; a start-up failure ends it early.
    pub fn run_until_stopped(&mut self) -> Result<(), StartupFailure> {
        while !stop_requested() {
            self.poll()?;
            std::thread::sleep(Duration::from_millis(50));
        }
        tracing::info!("stopping");
        Ok(())
    }

    /// Stops every child in the reverse of their start order, each one gone before the next is
    /// told: the gateway first (its drain ends every stream with its documented error while the
    /// engine still serves), then the engine (no client left to wait for), then the workers.
    /// SIGKILL for any still running at [`STOP_BUDGET`]; removes the shared-memory segments the
    /// stopped processes left behind.
    pub fn stop_all(&mut self) {
        use nix::sys::signal::{kill, Signal};
        let deadline = Instant::now() + STOP_BUDGET;
        for supervised in self.children.iter_mut().rev() {
            let Some(child) = supervised.child.as_mut() else {
                continue;
            };
            let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
            while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        for supervised in self.children.iter_mut().rev() {
            let Some(child) = supervised.child.as_mut() else {
                continue;
            };
            if let Ok(None) = child.try_wait() {
                tracing::warn!(child = %supervised.spec.label, "did not stop in time; killing");
                let _ = child.kill();
            }
            let _ = child.wait();
            supervised.child = None;
        }
        for supervised in &self.children {
            if let Some(pid) = supervised.last_pid {
                remove_shared_memory_of(pid);
            }
        }
    }
}

/// Removes `/dev/shm/ninfer-<pid>-*`: the channel segments a process creates are named after
/// its pid and unlinked when it exits cleanly; a killed one leaves them.
fn remove_shared_memory_of(pid: u32) {
    let prefix = format!("ninfer-{pid}-");
    let Ok(entries) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    for entry in entries.filter_map(|e| e.ok()) {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// A directory that receives the children's logs when the supervisor stops (benchmarks on a
/// machine that is gone afterwards).
pub const KEEP_LOGS_VARIABLE: &str = "NINFER_KEEP_LOGS";

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.stop_all();
        if let Some(keep) = std::env::var_os(KEEP_LOGS_VARIABLE) {
            keep_logs(&self.log_dir, Path::new(&keep));
        }
        let _ = std::fs::remove_dir_all(&self.runtime_dir);
    }
}

/// Copies every `*.log` of `log_dir` into `keep` (best effort: a failure is logged, the
/// shutdown goes on).
fn keep_logs(log_dir: &Path, keep: &Path) {
    let copied = std::fs::create_dir_all(keep).and_then(|()| {
        for entry in std::fs::read_dir(log_dir)? {
            let path = entry?.path();
            if path.extension().is_some_and(|extension| extension == "log") {
                if let Some(name) = path.file_name() {
                    std::fs::copy(&path, keep.join(name))?;
                }
            }
        }
        Ok(())
    });
    if let Err(error) = copied {
        tracing::warn!(
            "{KEEP_LOGS_VARIABLE}: keeping the logs in {}: {error}",
            keep.display()
        );
    }
}

/// NUMA nodes of this machine (`/sys/devices/system/node/nodeN`); `[0]` when there is no such
/// directory (not Linux, or no NUMA support).
pub fn numa_nodes() -> Vec<usize> {
    let mut nodes: Vec<usize> = std::fs::read_dir("/sys/devices/system/node")
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str()?.strip_prefix("node")?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    nodes.sort_unstable();
    if nodes.is_empty() {
        nodes.push(0);
    }
    nodes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_logs_copies_only_the_logs() {
        let base = std::env::temp_dir().join(format!("ninfer-keep-logs-{}", std::process::id()));
        let (runtime, keep) = (base.join("runtime"), base.join("kept/deeper"));
        std::fs::create_dir_all(&runtime).unwrap();
        std::fs::write(runtime.join("engine.log"), "engine says hi").unwrap();
        std::fs::write(runtime.join("experts-0.log"), "worker says hi").unwrap();
        std::fs::write(runtime.join("channel.shm"), "not a log").unwrap();
        keep_logs(&runtime, &keep);
        let mut kept: Vec<String> = std::fs::read_dir(&keep)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        kept.sort();
        assert_eq!(kept, ["engine.log", "experts-0.log"]);
        assert_eq!(
            std::fs::read_to_string(keep.join("engine.log")).unwrap(),
            "engine says hi"
        );
        std::fs::remove_dir_all(&base).unwrap();
    }
}
