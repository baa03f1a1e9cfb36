//! Expert executor in front of CPU expert worker processes: per layer, each worker gets the
//! (token, expert) pairs it owns through its shared-memory channel; their sums are added here.
//!
//! Owns: one channel per worker (the segment lives in this process, so it survives worker
//! restarts), worker registration (the control secret a worker on TCP asks for, model-id
//! check, ownership), liveness (process gone, or no
//! heartbeat within the hang bound) and holding/replaying work across a worker restart.
//! Must not touch: expert math (the workers run `ninfer-cpu-experts`), routing.
//!
//! Failure model: when a worker dies or hangs mid-request, the request stays posted in its slot.
//! The registrar thread keeps dialing the worker's address; a restarted worker attaches to the
//! same segment, finds the request still pending and answers it — the interrupted layer is
//! replayed with the same inputs, so the generation continues exactly as if nothing happened.
//! Only when no worker comes back within `--worker-timeout` does the request fail.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ninfer_artifact::NO_EXPERT;
use ninfer_channel::{ChannelGeometry, EngineChannel, Request, WaitOutcome};
use ninfer_protocol::control_secret::SendSecret;
use ninfer_protocol::v1::expert_worker_client::ExpertWorkerClient;
use ninfer_protocol::v1::{AttachChannelRequest, WorkerInfoRequest};

use crate::error::EngineError;
use crate::moe::executor::{ExpertBatch, ExpertExecutor, WorkerChannels};

/// How to reach and supervise the workers.
#[derive(Debug, Clone)]
pub struct WorkerExpertExecutorOptions {
    /// One address per worker: `unix:PATH` or `HOST:PORT`.
    pub addresses: Vec<String>,
    /// The engine's artifact identity; a worker serving another model is refused.
    pub model_id: String,
    pub hidden_size: usize,
    pub num_experts: usize,
    pub top_k: usize,
    /// Tokens per channel request; larger batches are sent in chunks.
    pub max_tokens_per_request: usize,
    /// No heartbeat for this long = hung.
    pub hang_timeout: Duration,
    /// Requests held for a missing worker fail after this long.
    pub worker_timeout: Duration,
    /// Sent to every worker (`authorization: Bearer SECRET`); workers on TCP refuse callers
    /// without their secret.
    pub control_secret: Option<ControlSecret>,
}

/// A shared secret that never shows in logs or `Debug` output.
#[derive(Clone)]
pub struct ControlSecret(String);

impl ControlSecret {
    pub fn new(secret: String) -> Self {
        ControlSecret(secret)
    }
}

impl std::fmt::Debug for ControlSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ControlSecret(..)")
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Health {
    /// Never registered (or not yet after start).
    Unregistered,
    Up,
    /// The process is gone; waiting for a new one at the same address.
    Dead,
    /// The process exists but its heartbeat stopped (e.g. SIGSTOP).
    Hung,
}

struct WorkerState {
    health: Health,
    /// Owned expert range (valid once registered).
    owned: std::ops::Range<usize>,
    pid: u32,
    last_heartbeat: u64,
    heartbeat_seen_at: Instant,
    /// Since when the worker is dead or hung (`None` while up): past `--worker-timeout` a
    /// device waiting on its channel is released.
    lost_since: Option<Instant>,
    /// Last registration refusal we logged, so a wrong worker is not logged every 100 ms.
    last_refusal: Option<String>,
}

struct WorkerConnection {
    address: String,
    channel: EngineChannel,
    state: Mutex<WorkerState>,
    masked_ids: Mutex<Vec<u32>>,
}

/// Per-call bookkeeping, allocated once.
struct CallScratch {
    claimed: Vec<bool>,
    posted: Vec<(usize, u32)>,
}

struct Shared {
    options: WorkerExpertExecutorOptions,
    workers: Vec<WorkerConnection>,
    scratch: Mutex<CallScratch>,
    /// Signalled whenever a worker's health changes.
    changed: Condvar,
    changed_lock: Mutex<()>,
    requests_sent: AtomicU64,
    /// Whether every expert has a live owner, recomputed on each health change so the per-layer
    /// check is one atomic load.
    covered: std::sync::atomic::AtomicBool,
}

/// The executor; cheap to share (`Arc` inside).
pub struct WorkerExpertExecutor {
    shared: Arc<Shared>,
}

fn process_exists(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    !matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), None),
        Err(nix::errno::Errno::ESRCH)
    )
}

impl WorkerExpertExecutor {
    /// Creates one channel per worker and starts the registrar thread. Does not wait for the
    /// workers: work is held until they register.
    pub fn start(options: WorkerExpertExecutorOptions) -> Result<Self, EngineError> {
        if options.addresses.is_empty() {
            return Err(EngineError::InvalidConfig {
                problem: "no expert worker address given".into(),
            });
        }
        let geometry = ChannelGeometry {
            slot_count: 2,
            max_tokens: options.max_tokens_per_request.max(1) as u32,
            hidden_size: options.hidden_size as u32,
            max_top_k: options.top_k as u32,
        };
        let mut workers = Vec::with_capacity(options.addresses.len());
        for (index, address) in options.addresses.iter().enumerate() {
            let name = format!("ninfer-{}-w{index}-{:x}", std::process::id(), rand_suffix());
            let channel =
                EngineChannel::create(&name, geometry).map_err(|e| EngineError::InvalidConfig {
                    problem: format!("activation channel for worker {address}: {e}"),
                })?;
            workers.push(WorkerConnection {
                address: address.clone(),
                channel,
                state: Mutex::new(WorkerState {
                    health: Health::Unregistered,
                    owned: 0..0,
                    pid: 0,
                    last_heartbeat: 0,
                    heartbeat_seen_at: Instant::now(),
                    last_refusal: None,
                    lost_since: None,
                }),
                masked_ids: Mutex::new(vec![
                    NO_EXPERT;
                    geometry.max_tokens as usize * options.top_k
                ]),
            });
        }
        let shared = Arc::new(Shared {
            scratch: Mutex::new(CallScratch {
                claimed: vec![false; options.num_experts],
                posted: Vec::with_capacity(workers.len()),
            }),
            options,
            workers,
            changed: Condvar::new(),
            changed_lock: Mutex::new(()),
            requests_sent: AtomicU64::new(0),
            covered: std::sync::atomic::AtomicBool::new(false),
        });
        let registrar = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("ninfer-registrar".into())
            .spawn(move || registrar_loop(&registrar))
            .map_err(|e| EngineError::InvalidConfig {
                problem: format!("cannot start the worker registrar: {e}"),
            })?;
        Ok(WorkerExpertExecutor { shared })
    }

    /// True when every expert has a registered, live owner.
    pub fn ready(&self) -> bool {
        self.shared.covered.load(Ordering::Acquire)
    }

    /// A one-line description of missing workers, for readiness messages.
    pub fn not_ready_reason(&self) -> Option<String> {
        let missing: Vec<String> = self
            .shared
            .workers
            .iter()
            .filter_map(|worker| {
                let state = worker.state.lock().ok()?;
                (state.health != Health::Up).then(|| {
                    format!("expert worker {} {:?}", worker.address, state.health).to_lowercase()
                })
            })
            .collect();
        (!missing.is_empty()).then(|| missing.join(", "))
    }

    /// Channel requests sent so far.
    pub fn requests_sent(&self) -> u64 {
        self.shared.requests_sent.load(Ordering::Relaxed)
    }
}

fn rand_suffix() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ (nanos >> 29)
}

impl Shared {
    /// Called on every health change: refreshes `covered` and wakes waiting requests.
    fn notify(&self) {
        let _guard = self.changed_lock.lock();
        self.covered
            .store(self.coverage_complete(), Ordering::Release);
        self.changed.notify_all();
    }

    fn coverage_complete(&self) -> bool {
        let mut covered = vec![false; self.options.num_experts];
        for worker in &self.workers {
            if let Ok(state) = worker.state.lock() {
                if state.health == Health::Up {
                    for expert in state.owned.clone() {
                        if let Some(slot) = covered.get_mut(expert) {
                            *slot = true;
                        }
                    }
                }
            }
        }
        covered.iter().all(|c| *c)
    }

    /// Waits until every expert has a live owner, or fails after `worker_timeout`.
    fn wait_for_coverage(&self, layer: usize) -> Result<(), EngineError> {
        if self.covered.load(Ordering::Acquire) {
            return Ok(());
        }
        let deadline = Instant::now() + self.options.worker_timeout;
        let mut guard = self.changed_lock.lock().map_err(|_| poisoned(layer))?;
        while !self.covered.load(Ordering::Acquire) {
            let now = Instant::now();
            if now >= deadline {
                return Err(EngineError::ExpertExecutor {
                    executor: "remote-workers".into(),
                    layer,
                    problem: format!(
                        "no expert worker covers every expert within --worker-timeout {:.1}s",
                        self.options.worker_timeout.as_secs_f64()
                    ),
                });
            }
            guard = self
                .changed
                .wait_timeout(guard, (deadline - now).min(Duration::from_millis(100)))
                .map_err(|_| poisoned(layer))?
                .0;
        }
        Ok(())
    }

    /// Updates a worker's health from its pid and heartbeat; logs transitions.
    fn check_liveness(&self, worker: &WorkerConnection) {
        let Ok(mut state) = worker.state.lock() else {
            return;
        };
        if !matches!(state.health, Health::Up | Health::Hung) {
            return;
        }
        let pid = worker.channel.worker_pid();
        if !process_exists(pid) {
            tracing::warn!(worker = %worker.address, pid, "expert worker died; holding its requests until it registers again");
            state.health = Health::Dead;
            state.lost_since.get_or_insert_with(Instant::now);
            drop(state);
            self.notify();
            return;
        }
        let beat = worker.channel.heartbeat();
        if beat != state.last_heartbeat {
            state.last_heartbeat = beat;
            state.heartbeat_seen_at = Instant::now();
            if state.health == Health::Hung {
                tracing::info!(worker = %worker.address, pid, "expert worker resumed");
                state.health = Health::Up;
                state.lost_since = None;
                drop(state);
                self.notify();
            }
        } else if state.health == Health::Up
            && state.heartbeat_seen_at.elapsed() > self.options.hang_timeout
        {
            tracing::warn!(
                worker = %worker.address,
                pid,
                "expert worker hung (no heartbeat for {:.1}s); holding its requests",
                self.options.hang_timeout.as_secs_f64()
            );
            state.health = Health::Hung;
            state.lost_since.get_or_insert_with(Instant::now);
            drop(state);
            self.notify();
        }
    }
}

fn poisoned(layer: usize) -> EngineError {
    EngineError::ExpertExecutor {
        executor: "remote-workers".into(),
        layer,
        problem: "worker registry lock poisoned".into(),
    }
}

/// Dials unregistered or dead workers, checks them, attaches them to their channel; watches the
/// liveness of registered ones. Runs for the life of the process.
fn registrar_loop(shared: &Shared) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            tracing::error!("worker registrar cannot start: {error}");
            return;
        }
    };
    loop {
        for worker in &shared.workers {
            shared.check_liveness(worker);
            let given_up = worker.state.lock().is_ok_and(|state| {
                state
                    .lost_since
                    .is_some_and(|since| since.elapsed() > shared.options.worker_timeout)
            });
            if given_up {
                // A device waiting on this worker's answer stops waiting (its step fails).
                worker.channel.set_handoff_abort(true);
            }
            let needs_registration = worker
                .state
                .lock()
                .map(|s| matches!(s.health, Health::Unregistered | Health::Dead))
                .unwrap_or(false);
            if needs_registration {
                match runtime.block_on(register(shared, worker)) {
                    Ok((owned, pid)) => {
                        if let Ok(mut state) = worker.state.lock() {
                            tracing::info!(worker = %worker.address, pid, experts = ?owned, "expert worker registered");
                            state.health = Health::Up;
                            state.lost_since = None;
                            state.owned = owned;
                            state.pid = pid;
                            state.last_heartbeat = worker.channel.heartbeat();
                            state.heartbeat_seen_at = Instant::now();
                            state.last_refusal = None;
                        }
                        // A request posted before the worker attached is pending in its slot.
                        if worker.channel.request_pending(0) {
                            tracing::info!(worker = %worker.address, "expert worker back with a request pending; the interrupted layer is replayed");
                        }
                        worker.channel.ring();
                        shared.notify();
                    }
                    Err(Refusal::Unreachable) => {}
                    Err(Refusal::Refused(reason)) => {
                        if let Ok(mut state) = worker.state.lock() {
                            if state.last_refusal.as_ref() != Some(&reason) {
                                tracing::error!(worker = %worker.address, "expert worker refused: {reason}");
                                state.last_refusal = Some(reason);
                            }
                        }
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

enum Refusal {
    Unreachable,
    Refused(String),
}

async fn register(
    shared: &Shared,
    worker: &WorkerConnection,
) -> Result<(std::ops::Range<usize>, u32), Refusal> {
    let options = &shared.options;
    let channel = ninfer_protocol::transport::connect(&worker.address, Duration::from_millis(500))
        .await
        .map_err(|_| Refusal::Unreachable)?;
    let secret = options
        .control_secret
        .as_ref()
        .map(|secret| secret.0.as_str());
    let mut client = ExpertWorkerClient::with_interceptor(channel, SendSecret::new(secret));
    let info = tokio::time::timeout(
        Duration::from_secs(2),
        client.get_worker_info(WorkerInfoRequest {}),
    )
    .await
    .map_err(|_| Refusal::Unreachable)?
    .map_err(|status| {
        if status.code() == tonic::Code::Unauthenticated {
            Refusal::Refused(format!(
                "it refuses this engine's control secret ({}); give the engine and its workers the same secret (--control-secret-file, NINFER_CONTROL_SECRET_FILE or NINFER_CONTROL_SECRET)",
                status.message()
            ))
        } else {
            Refusal::Unreachable
        }
    })?
    .into_inner();
    if info.model_id != options.model_id {
        return Err(Refusal::Refused(format!(
            "it serves model {} ({}), this engine serves model {}",
            info.model_id, info.model_path, options.model_id
        )));
    }
    if info.hidden_size as usize != options.hidden_size
        || info.num_experts as usize != options.num_experts
    {
        return Err(Refusal::Refused(format!(
            "hidden size {} / {} experts, this engine has {} / {}",
            info.hidden_size, info.num_experts, options.hidden_size, options.num_experts
        )));
    }
    let first = info.first_owned_expert as usize;
    let owned = first..first + info.owned_expert_count as usize;
    if owned.end > options.num_experts || owned.is_empty() {
        return Err(Refusal::Refused(format!(
            "it claims experts {owned:?} of {}",
            options.num_experts
        )));
    }
    tokio::time::timeout(
        Duration::from_secs(5),
        client.attach_channel(AttachChannelRequest {
            shared_memory_path: worker.channel.name().to_string(),
            model_id: options.model_id.clone(),
        }),
    )
    .await
    .map_err(|_| Refusal::Unreachable)?
    .map_err(|status| Refusal::Refused(status.message().to_string()))?;
    Ok((owned, info.pid))
}

impl ExpertExecutor for WorkerExpertExecutor {
    fn name(&self) -> &str {
        "remote-workers"
    }

    fn compute(&self, batch: &ExpertBatch<'_>, out: &mut [f32]) -> Result<(), EngineError> {
        let shared = &*self.shared;
        let (h, k, tokens) = (batch.hidden_size, batch.experts_per_token, batch.tokens());
        let failure = |problem: String| EngineError::ExpertExecutor {
            executor: "remote-workers".into(),
            layer: batch.layer,
            problem,
        };
        if out.len() != tokens * h
            || batch.expert_ids.len() != tokens * k
            || batch.weights.len() != tokens * k
        {
            return Err(failure(format!(
                "inconsistent batch of {tokens} tokens × top-{k}"
            )));
        }
        out.iter_mut().for_each(|x| *x = 0.0);
        let chunk_tokens = shared.options.max_tokens_per_request.max(1);
        let mut first = 0;
        while first < tokens {
            let count = (tokens - first).min(chunk_tokens);
            shared.wait_for_coverage(batch.layer)?;
            // Owner of each expert at this moment (first live worker that owns it).
            let mut scratch = shared.scratch.lock().map_err(|_| poisoned(batch.layer))?;
            let CallScratch { claimed, posted } = &mut *scratch;
            claimed.iter_mut().for_each(|c| *c = false);
            posted.clear();
            for (index, worker) in shared.workers.iter().enumerate() {
                let owned = match worker.state.lock() {
                    Ok(state) if state.health == Health::Up => state.owned.clone(),
                    _ => continue,
                };
                let mut masked = worker
                    .masked_ids
                    .lock()
                    .map_err(|_| poisoned(batch.layer))?;
                let mut any = false;
                for (slot, &id) in masked[..count * k]
                    .iter_mut()
                    .zip(&batch.expert_ids[first * k..(first + count) * k])
                {
                    let expert = id as usize;
                    if owned.contains(&expert) && !claimed[expert] {
                        *slot = id;
                        any = true;
                    } else {
                        *slot = NO_EXPERT;
                    }
                }
                if !any {
                    continue;
                }
                for &id in masked[..count * k].iter().filter(|&&id| id != NO_EXPERT) {
                    claimed[id as usize] = true;
                }
                let sequence = worker
                    .channel
                    .post(
                        0,
                        &Request {
                            layer: batch.layer as u32,
                            token_count: count as u32,
                            top_k: k as u32,
                            expert_ids: &masked[..count * k],
                            routing_weights: &batch.weights[first * k..(first + count) * k],
                            hidden: &batch.hidden[first * h..(first + count) * h],
                        },
                    )
                    .map_err(|e| failure(e.to_string()))?;
                shared.requests_sent.fetch_add(1, Ordering::Relaxed);
                posted.push((index, sequence));
            }
            for &(index, sequence) in posted.iter() {
                let worker = &shared.workers[index];
                self.wait_for_response(worker, sequence, batch.layer)?;
                let sums = worker.channel.output(0);
                for (target, value) in out[first * h..(first + count) * h].iter_mut().zip(sums) {
                    *target += value;
                }
            }
            first += count;
        }
        Ok(())
    }

    /// The busiest worker's compute time as the workers report it (they compute in parallel,
    /// so that is about what the engine waited for), whoever posted the requests: the host or
    /// a backend's own hand-off.
    fn compute_nanos(&self) -> Option<u64> {
        self.shared
            .workers
            .iter()
            .map(|worker| worker.channel.worker_compute_nanos_total())
            .max()
    }

    fn worker_channels(&self) -> Option<&dyn WorkerChannels> {
        Some(self)
    }
}

/// How long a worker keeps spinning for requests after a step readied it for a backend's own
/// hand-off: past the gaps between steps (sampling, scheduling), short enough that an idle
/// engine leaves the workers' cores alone soon after its last step.
const HANDOFF_SPIN: Duration = Duration::from_millis(200);

impl WorkerChannels for WorkerExpertExecutor {
    fn channel_memory(&self) -> Vec<ninfer_channel::SegmentMemory> {
        self.shared
            .workers
            .iter()
            .filter_map(|worker| worker.channel.segment_memory(0).ok())
            .collect()
    }

    fn prepare_backend_handoff(&self) -> Option<Vec<std::ops::Range<usize>>> {
        let shared = &*self.shared;
        if !shared.covered.load(Ordering::Acquire) {
            return None;
        }
        let mut owned = Vec::with_capacity(shared.workers.len());
        for worker in &shared.workers {
            let state = worker.state.lock().ok()?;
            if state.health != Health::Up {
                return None;
            }
            owned.push(state.owned.clone());
        }
        let mut sorted = owned.clone();
        sorted.sort_by_key(|range| range.start);
        if sorted.windows(2).any(|pair| pair[0].end > pair[1].start) {
            return None;
        }
        for worker in &shared.workers {
            worker.channel.set_handoff_abort(false);
            worker.channel.keep_worker_spinning(HANDOFF_SPIN);
        }
        Some(owned)
    }

    fn refusal(&self, worker: usize) -> Option<String> {
        self.shared.workers.get(worker)?.channel.refusal(0)
    }

    fn worker_address(&self, worker: usize) -> String {
        self.shared
            .workers
            .get(worker)
            .map_or_else(|| format!("#{worker}"), |worker| worker.address.clone())
    }
}

impl WorkerExpertExecutor {
    /// Waits for `sequence` on the worker's slot, riding out a restart of the worker.
    fn wait_for_response(
        &self,
        worker: &WorkerConnection,
        sequence: u32,
        layer: usize,
    ) -> Result<(), EngineError> {
        let shared = &*self.shared;
        let mut lost_since: Option<Instant> = None;
        let mut interrupted = false;
        loop {
            match worker.channel.wait(0, sequence, Duration::from_millis(25)) {
                WaitOutcome::Done => {
                    if interrupted {
                        tracing::info!(worker = %worker.address, layer, "expert worker back; the interrupted layer was replayed");
                    }
                    return Ok(());
                }
                WaitOutcome::Refused(reason) => {
                    return Err(EngineError::ExpertExecutor {
                        executor: format!("remote worker {}", worker.address),
                        layer,
                        problem: reason,
                    })
                }
                WaitOutcome::TimedOut => {
                    shared.check_liveness(worker);
                    let healthy = worker
                        .state
                        .lock()
                        .map(|s| s.health == Health::Up)
                        .unwrap_or(false);
                    if healthy {
                        // Back (or never gone): the timeout clock stops; the replay is logged
                        // when its answer arrives.
                        lost_since = None;
                        continue;
                    }
                    interrupted = true;
                    let since = *lost_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > shared.options.worker_timeout {
                        return Err(EngineError::ExpertExecutor {
                            executor: format!("remote worker {}", worker.address),
                            layer,
                            problem: format!(
                                "the worker did not come back within --worker-timeout {:.1}s",
                                shared.options.worker_timeout.as_secs_f64()
                            ),
                        });
                    }
                }
            }
        }
    }
}
