//! A tiny process supervisor for `ninfer serve`: starts the service processes on a private
//! runtime directory, restarts one that dies (as systemd's `Restart=on-failure` would), and stops
//! them all — SIGTERM, then SIGKILL after a grace period — on Ctrl-C or SIGTERM.
//!
//! Owns: child processes, their pid files and logs under the runtime directory.
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

/// Ctrl-C and SIGTERM ask the supervisor to stop its children and exit.
pub fn install_stop_handler() {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let action = SigAction::new(
        SigHandler::Handler(on_stop_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        let _ = unsafe { sigaction(signal, &action) };
    }
}

pub fn stop_requested() -> bool {
    STOP_REQUESTED.load(Ordering::SeqCst)
}

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
    restarts: u32,
    next_start: Instant,
}

/// A private runtime directory (removed on drop) with the supervised children.
pub struct Supervisor {
    runtime_dir: PathBuf,
    children: Vec<Supervised>,
    /// Label of the first child that exited (for callers that treat any exit as failure).
    first_exited: Option<String>,
}

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

impl Supervisor {
    /// Creates `$XDG_RUNTIME_DIR/ninfer-<pid>` (or under the temp dir), mode 0700.
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
        Ok(Supervisor {
            runtime_dir,
            children: Vec::new(),
            first_exited: None,
        })
    }

    pub fn runtime_dir(&self) -> &Path {
        &self.runtime_dir
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
            restarts: 0,
            next_start: Instant::now(),
        };
        start_child(&self.runtime_dir, &mut supervised)?;
        self.children.push(supervised);
        Ok(())
    }
}

fn start_child(runtime_dir: &Path, supervised: &mut Supervised) -> anyhow::Result<()> {
    {
        let spec = &supervised.spec;
        let log_path = runtime_dir.join(format!("{}.log", spec.label));
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
            .stderr(log);
        if let Some(Some(startup)) = STARTUP_AFFINITY.get().copied() {
            // SAFETY: runs in the forked child before exec; sched_setaffinity is a plain
            // system call (async-signal-safe) on a mask copied into the closure.
            unsafe {
                command.pre_exec(move || {
                    // A mask the child cannot take is not a reason to fail its start.
                    let _ = sched_setaffinity(Pid::from_raw(0), &startup);
                    Ok(())
                });
            }
        }
        let child = command
            .spawn()
            .with_context(|| format!("starting {} ({})", spec.label, spec.program.display()))?;
        std::fs::write(
            runtime_dir.join(format!("{}.pid", spec.label)),
            child.id().to_string(),
        )?;
        tracing::info!(child = %spec.label, pid = child.id(), log = %log_path.display(), "started");
        supervised.child = Some(child);
        Ok(())
    }
}

impl Supervisor {
    /// Restarts children that exited, with a growing delay for one that keeps dying.
    pub fn poll(&mut self) {
        let now = Instant::now();
        for index in 0..self.children.len() {
            let exited = match self.children[index].child.as_mut().map(|c| c.try_wait()) {
                Some(Ok(Some(status))) => Some(status.to_string()),
                Some(Err(error)) => Some(error.to_string()),
                _ => None,
            };
            if let Some(status) = exited {
                let supervised = &mut self.children[index];
                self.first_exited
                    .get_or_insert_with(|| supervised.spec.label.clone());
                supervised.child = None;
                supervised.restarts += 1;
                let delay = Duration::from_millis(200 * u64::from(supervised.restarts.min(25)));
                supervised.next_start = now + delay;
                tracing::warn!(child = %supervised.spec.label, %status, "exited; restarting in {:.1}s", delay.as_secs_f64());
            }
            let supervised = &mut self.children[index];
            if supervised.child.is_none() && now >= supervised.next_start {
                if let Err(error) = start_child(&self.runtime_dir, supervised) {
                    tracing::error!("{error:#}");
                    supervised.next_start = now + Duration::from_secs(2);
                }
            }
        }
    }

    /// The first child seen exiting by [`Self::poll`], if any (it was restarted meanwhile).
    pub fn first_exited(&self) -> Option<String> {
        self.first_exited.clone()
    }

    /// Runs until a stop signal, supervising; then stops every child.
    pub fn run_until_stopped(&mut self) {
        while !stop_requested() {
            self.poll();
            std::thread::sleep(Duration::from_millis(100));
        }
        tracing::info!("stopping");
    }

    /// SIGTERM to every child, SIGKILL to those still running after `grace`.
    pub fn stop_all(&mut self, grace: Duration) {
        use nix::sys::signal::{kill, Signal};
        for supervised in self.children.iter().rev() {
            if let Some(child) = &supervised.child {
                let _ = kill(
                    nix::unistd::Pid::from_raw(child.id() as i32),
                    Signal::SIGTERM,
                );
            }
        }
        let deadline = Instant::now() + grace;
        for supervised in &mut self.children {
            if let Some(child) = supervised.child.as_mut() {
                while Instant::now() < deadline {
                    if let Ok(Some(_)) = child.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                if let Ok(None) = child.try_wait() {
                    tracing::warn!(child = %supervised.spec.label, "did not stop in time; killing");
                    let _ = child.kill();
                }
                let _ = child.wait();
            }
            supervised.child = None;
        }
    }
}

/// A directory that receives the children's logs when the supervisor removes its runtime
/// directory (benchmarks on a machine that is gone afterwards).
pub const KEEP_LOGS_VARIABLE: &str = "NINFER_KEEP_LOGS";

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.stop_all(Duration::from_secs(5));
        if let Some(keep) = std::env::var_os(KEEP_LOGS_VARIABLE) {
            keep_logs(&self.runtime_dir, Path::new(&keep));
        }
        let _ = std::fs::remove_dir_all(&self.runtime_dir);
    }
}

/// Copies every `*.log` of `runtime_dir` into `keep` (best effort: a failure is logged, the
/// shutdown goes on).
fn keep_logs(runtime_dir: &Path, keep: &Path) {
    let copied = std::fs::create_dir_all(keep).and_then(|()| {
        for entry in std::fs::read_dir(runtime_dir)? {
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
