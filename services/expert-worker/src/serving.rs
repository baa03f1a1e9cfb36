//! The serving thread: owns the expert compute (pinned pool + scratch) and the attached channel,
//! answers channel requests in slot order, and refuses malformed ones with a reason instead of
//! crashing. A heartbeat thread bumps the channel's liveness word so the engine can tell a busy
//! worker from a dead or stopped one.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use ninfer_artifact::{Artifact, NO_EXPERT};
use ninfer_channel::{Request, WorkerChannel};
use ninfer_cpu_experts::routed::{BankView, RoutedExpertComputer};
use ninfer_cpu_experts::{ExpertLayout, KernelIsa, ThreadPool};
use ninfer_protocol::v1::WorkerStatistics;

/// The MTP head's routed experts in the artifact.
const MTP_EXPERT_BANK: &str = "mtp.layers.0.moe.experts";

/// One MoE layer's bank inside the artifact mapping.
#[derive(Debug, Clone, Copy)]
struct Bank {
    offset: usize,
    length: usize,
}

/// The banks a worker serves: the MoE layers' routed experts, or in a model without MoE layers
/// (dense qwen3_5) each dense MLP as a bank of one expert, computed with routing weight 1 for
/// the layers the engine offloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServedBanks {
    pub num_experts: usize,
    pub top_k: usize,
    pub intermediate_size: usize,
    /// A dense model's one-expert MLP banks (`layers.L.mlp.experts`).
    pub dense_mlps: bool,
}

impl ServedBanks {
    pub fn of(common: &ninfer_artifact::CommonConfig) -> Self {
        if common.moe_layers.iter().any(|&moe| moe) {
            ServedBanks {
                num_experts: common.num_experts,
                top_k: common.num_experts_per_tok,
                intermediate_size: common.moe_intermediate_size,
                dense_mlps: false,
            }
        } else {
            ServedBanks {
                num_experts: 1,
                top_k: 1,
                intermediate_size: common.intermediate_size,
                dense_mlps: true,
            }
        }
    }
}

/// What the worker computes with.
pub struct WorkerModel {
    artifact: Arc<Artifact>,
    banks: Vec<Option<Bank>>,
    owned: Range<usize>,
    hidden_size: usize,
    top_k: usize,
    computer: RoutedExpertComputer,
    banks_locked: bool,
}

impl WorkerModel {
    pub fn load(
        artifact: Arc<Artifact>,
        owned: Range<usize>,
        threads: usize,
        cpus: &[usize],
        isa: KernelIsa,
        max_tokens: usize,
    ) -> anyhow::Result<Self> {
        let common = artifact.config().common().clone();
        let served = ServedBanks::of(&common);
        let mut banks = Vec::with_capacity(common.num_hidden_layers);
        let mut layout: Option<ExpertLayout> = None;
        for layer in 0..common.num_hidden_layers {
            let prefix = match (common.moe_layers[layer], served.dense_mlps) {
                (true, _) => format!("layers.{layer}.moe.experts"),
                (false, true) => format!("layers.{layer}.mlp.experts"),
                (false, false) => {
                    banks.push(None);
                    continue;
                }
            };
            let bank = artifact.expert_bank(&prefix).ok_or_else(|| {
                anyhow!("{}: no expert bank `{prefix}`", artifact.path().display())
            })?;
            let bank_layout =
                ExpertLayout::for_bank(bank, common.hidden_size, served.intermediate_size)
                    .with_context(|| artifact.path().display().to_string())?;
            layout = Some(bank_layout);
            banks.push(Some(Bank {
                offset: bank.offset as usize,
                length: (bank.num_experts * bank.expert_stride) as usize,
            }));
        }
        let layout = layout
            .ok_or_else(|| anyhow!("{}: the model has no MoE layer", artifact.path().display()))?;
        // The MTP head's layer, when it has routed experts, is the layer after the decoder
        // layers (the engine numbers it so): its experts go where the main model's go.
        if let Some(bank) = artifact.expert_bank(MTP_EXPERT_BANK) {
            let bank_layout =
                ExpertLayout::for_bank(bank, common.hidden_size, common.moe_intermediate_size)
                    .with_context(|| artifact.path().display().to_string())?;
            if bank_layout != layout || bank.num_experts as usize != common.num_experts {
                anyhow::bail!(
                    "{}: the MTP expert bank `{MTP_EXPERT_BANK}` is laid out unlike the decoder layers' banks",
                    artifact.path().display()
                );
            }
            banks.push(Some(Bank {
                offset: bank.offset as usize,
                length: (bank.num_experts * bank.expert_stride) as usize,
            }));
        }
        // The pool pins this thread to the node first, so the pages `mlock` faults in are
        // allocated on the node's memory (first touch).
        let pool =
            ThreadPool::new(threads, cpus, true).context("starting the expert thread pool")?;
        let residency = make_owned_experts_resident(
            artifact.bytes(),
            &banks,
            &owned,
            layout.stride,
            mlock_pages,
            physical_memory_bytes(),
        );
        let banks_locked = matches!(residency, BankResidency::Locked { .. });
        let computer = RoutedExpertComputer::new(
            pool,
            layout,
            isa,
            served.num_experts,
            max_tokens,
            served.top_k,
        )
        .context("preparing the expert kernels")?;
        Ok(WorkerModel {
            artifact,
            banks,
            owned,
            hidden_size: common.hidden_size,
            top_k: served.top_k,
            computer,
            banks_locked,
        })
    }

    /// Checks a request against the model and this worker's share; `Err` is sent back to the engine.
    fn compute(&mut self, request: &Request<'_>, output: &mut [f32]) -> Result<u64, String> {
        let (layer, token_count, top_k) = (request.layer, request.token_count, request.top_k);
        let (ids, weights, hidden) = (request.expert_ids, request.routing_weights, request.hidden);
        let bank = match self.banks.get(layer as usize) {
            Some(Some(bank)) => *bank,
            Some(None) => return Err(format!("layer {layer} has no bank on the workers")),
            None => {
                return Err(format!(
                    "layer {layer} does not exist (the model has {})",
                    self.banks.len()
                ))
            }
        };
        let (tokens, k) = (token_count as usize, top_k as usize);
        if k == 0 || k > self.top_k {
            return Err(format!("top-k {top_k} is outside 1..={}", self.top_k));
        }
        if ids.len() != tokens * k
            || hidden.len() != tokens * self.hidden_size
            || output.len() < tokens * self.hidden_size
        {
            return Err(format!(
                "token count {token_count} × top-k {top_k} does not fit the channel slot"
            ));
        }
        if let Some(&bad) = ids
            .iter()
            .find(|&&id| id != NO_EXPERT && !self.owned.contains(&(id as usize)))
        {
            return Err(format!(
                "expert id {bad} is not owned by this worker (it owns {}..{})",
                self.owned.start, self.owned.end
            ));
        }
        let bytes = &self.artifact.bytes()[bank.offset..bank.offset + bank.length];
        let view = BankView {
            bytes,
            num_experts: bank.length / self.computer.layout().stride,
        };
        self.computer
            .compute(
                view,
                hidden,
                tokens,
                k,
                ids,
                weights,
                &mut output[..tokens * self.hidden_size],
            )
            .map_err(|e| e.to_string())
    }
}

/// How the owned experts' pages became resident at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BankResidency {
    /// `mlock`ed: resident for the worker's life.
    Locked { bytes: usize },
    /// `mlock` refused: every owned page read once, so the first tokens pay no page faults.
    FaultedIn { pages: usize },
    /// `mlock` refused and the owned experts exceed 90% of RAM: pages are mapped on use.
    MappedOnUse,
}

/// `mlock` of a range of our own mapping.
fn mlock_pages(range: &[u8]) -> nix::Result<()> {
    // SAFETY: mlock only pins pages of our own live mapping; it does not change them.
    unsafe { nix::sys::mman::mlock(std::ptr::NonNull::from(range).cast(), range.len()) }
}

/// Locks the owned experts of every bank in RAM with `lock`; where it is refused (the
/// `RLIMIT_MEMLOCK` of an unprivileged user), says once how to raise the limit and faults the
/// pages in instead when they fit in `ram_bytes`.
fn make_owned_experts_resident(
    all: &[u8],
    banks: &[Option<Bank>],
    owned: &Range<usize>,
    stride: usize,
    lock: impl Fn(&[u8]) -> nix::Result<()>,
    ram_bytes: Option<u64>,
) -> BankResidency {
    for bank in banks.iter().flatten() {
        if let Err(error) = lock(&all[owned_range(bank, owned, stride)]) {
            tracing::warn!(
                "cannot lock the expert banks in RAM ({error}); running unlocked. Raise the limit: \
                 `LimitMEMLOCK=infinity` in the systemd unit, or `ulimit -l unlimited` in the shell"
            );
            return fault_in_owned_experts(all, banks, owned, stride, ram_bytes);
        }
    }
    let bytes = owned_bytes(banks, owned, stride);
    tracing::info!(
        "locked {:.1} MiB of expert banks in RAM",
        bytes as f64 / (1u64 << 20) as f64
    );
    BankResidency::Locked { bytes }
}

/// Bytes of the owned experts over every bank.
fn owned_bytes(banks: &[Option<Bank>], owned: &Range<usize>, stride: usize) -> usize {
    banks
        .iter()
        .flatten()
        .map(|bank| owned_range(bank, owned, stride).len())
        .sum()
}

/// The owned experts' byte range inside the mapping.
fn owned_range(bank: &Bank, owned: &Range<usize>, stride: usize) -> Range<usize> {
    let start = bank.offset + owned.start * stride;
    let end = (bank.offset + owned.end * stride).min(bank.offset + bank.length);
    start..end.max(start)
}

/// Without `mlock`, maps every owned page now: otherwise the first tokens that route to an
/// expert pay its page faults (seconds over a whole model), which shows as a slow first run.
/// Skipped when the owned experts would not fit in RAM: touching them all would only stream
/// the file through the page cache once.
fn fault_in_owned_experts(
    all: &[u8],
    banks: &[Option<Bank>],
    owned: &Range<usize>,
    stride: usize,
    ram_bytes: Option<u64>,
) -> BankResidency {
    const PAGE: usize = 4096;
    let bytes = owned_bytes(banks, owned, stride);
    if ram_bytes.is_some_and(|total| bytes as u64 > total / 10 * 9) {
        tracing::info!("the owned expert banks exceed 90% of RAM; their pages are mapped on use");
        return BankResidency::MappedOnUse;
    }
    let started = Instant::now();
    let (mut checksum, mut pages) = (0u8, 0usize);
    for bank in banks.iter().flatten() {
        for offset in owned_range(bank, owned, stride).step_by(PAGE) {
            // A volatile read per page so the loop cannot be optimised away.
            // SAFETY: a bounds-checked reference into the live read-only mapping.
            checksum ^= unsafe { std::ptr::read_volatile(&all[offset]) };
            pages += 1;
        }
    }
    tracing::info!(
        "mapped the unlocked expert banks' pages in {:.1} s ({pages} pages, checksum {checksum})",
        started.elapsed().as_secs_f64()
    );
    BankResidency::FaultedIn { pages }
}

/// `MemTotal` of `/proc/meminfo`, bytes (`None` off Linux or when unreadable).
fn physical_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|line| line.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[derive(Default)]
struct Counters {
    batches: AtomicU64,
    tokens: AtomicU64,
    bytes: AtomicU64,
    busy_microseconds: AtomicU64,
}

enum Command {
    Attach(String, tokio::sync::oneshot::Sender<anyhow::Result<()>>),
    Drain(tokio::sync::oneshot::Sender<()>),
}

/// The gRPC side's handle on the serving thread.
pub struct ServingHandle {
    commands: Mutex<mpsc::Sender<Command>>,
    counters: Arc<Counters>,
    banks_locked: bool,
}

impl ServingHandle {
    pub async fn attach(&self, name: String) -> anyhow::Result<()> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.send(Command::Attach(name, reply))?;
        answer
            .await
            .map_err(|_| anyhow!("the serving thread stopped"))?
    }

    pub async fn drain(&self) {
        let (reply, answer) = tokio::sync::oneshot::channel();
        if self.send(Command::Drain(reply)).is_ok() {
            let _ = answer.await;
        }
    }

    fn send(&self, command: Command) -> anyhow::Result<()> {
        let sender = self
            .commands
            .lock()
            .map_err(|_| anyhow!("serving handle poisoned"))?;
        sender
            .send(command)
            .map_err(|_| anyhow!("the serving thread stopped"))
    }

    pub fn banks_locked(&self) -> bool {
        self.banks_locked
    }

    pub fn statistics(&self) -> WorkerStatistics {
        WorkerStatistics {
            batches_computed: self.counters.batches.load(Ordering::Relaxed),
            tokens_computed: self.counters.tokens.load(Ordering::Relaxed),
            expert_bytes_streamed: self.counters.bytes.load(Ordering::Relaxed),
            busy_microseconds: self.counters.busy_microseconds.load(Ordering::Relaxed),
        }
    }
}

/// Starts the serving and heartbeat threads.
pub fn start(model: WorkerModel, test_delay: Duration) -> ServingHandle {
    let (sender, receiver) = mpsc::channel();
    let counters = Arc::new(Counters::default());
    let banks_locked = model.banks_locked;
    let attached: Arc<Mutex<Option<Arc<WorkerChannel>>>> = Arc::new(Mutex::new(None));
    let stop = Arc::new(AtomicBool::new(false));
    {
        let attached = Arc::clone(&attached);
        let stop = Arc::clone(&stop);
        std::thread::Builder::new()
            // Its name is how the engine finds it in /proc to tell a starved beat from a hang.
            .name(ninfer_channel::HEARTBEAT_THREAD_NAME.into())
            .spawn(move || heartbeat_loop(&attached, &stop))
            .ok();
    }
    let thread_counters = Arc::clone(&counters);
    let spawned = std::thread::Builder::new()
        .name("ninfer-serving".into())
        .spawn(move || {
            serving_loop(
                model,
                &receiver,
                &thread_counters,
                &attached,
                &stop,
                test_delay,
            )
        });
    if let Err(error) = spawned {
        tracing::error!("cannot start the serving thread: {error}");
    }
    ServingHandle {
        commands: Mutex::new(sender),
        counters,
        banks_locked,
    }
}

fn heartbeat_loop(attached: &Mutex<Option<Arc<WorkerChannel>>>, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        let channel = attached.lock().ok().and_then(|guard| guard.clone());
        if let Some(channel) = channel {
            channel.beat();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn serving_loop(
    mut model: WorkerModel,
    commands: &mpsc::Receiver<Command>,
    counters: &Counters,
    attached: &Mutex<Option<Arc<WorkerChannel>>>,
    stop: &AtomicBool,
    test_delay: Duration,
) {
    let mut channel: Option<Arc<WorkerChannel>> = None;
    loop {
        let command = if channel.is_some() {
            commands.try_recv().ok()
        } else {
            match commands.recv_timeout(Duration::from_millis(100)) {
                Ok(command) => Some(command),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        };
        match command {
            Some(Command::Attach(name, reply)) => {
                if channel.as_ref().is_some_and(|c| c.name() == name) {
                    let _ = reply.send(Ok(()));
                    continue;
                }
                match WorkerChannel::attach(&name, model.hidden_size as u32) {
                    Ok(new_channel) => {
                        let new_channel = Arc::new(new_channel);
                        tracing::info!(channel = %name, "attached to the engine's activation channel");
                        if let Ok(mut slot) = attached.lock() {
                            *slot = Some(Arc::clone(&new_channel));
                        }
                        channel = Some(new_channel);
                        let _ = reply.send(Ok(()));
                    }
                    Err(error) => {
                        let _ = reply.send(Err(anyhow!(error)));
                    }
                }
            }
            Some(Command::Drain(reply)) => {
                // Requests still posted when the drain arrives are refused ("worker is
                // draining"), not computed: the engine drains only a worker it stopped sending to.
                if let Some(current) = channel.take() {
                    while let Some((slot, _)) = current.next_request(Duration::from_millis(1)) {
                        current.complete(slot, Err("worker is draining"));
                    }
                }
                if let Ok(mut slot) = attached.lock() {
                    *slot = None;
                }
                tracing::info!("drained: detached from the activation channel");
                let _ = reply.send(());
            }
            None => {}
        }
        if let Some(current) = &channel {
            serve_one(&mut model, current, counters, test_delay);
        }
    }
    stop.store(true, Ordering::Relaxed);
}

fn serve_one(
    model: &mut WorkerModel,
    channel: &WorkerChannel,
    counters: &Counters,
    test_delay: Duration,
) {
    let Some((slot, request)) = channel.next_request(Duration::from_millis(20)) else {
        return;
    };
    if !test_delay.is_zero() {
        std::thread::sleep(test_delay);
    }
    let started = Instant::now();
    let (layer, token_count, top_k) = (request.layer, request.token_count, request.top_k);
    // SAFETY: between next_request and complete for this slot; the output area is disjoint from
    // the request areas the view borrows.
    let output = unsafe { channel.output_mut(slot) };
    let result = model.compute(&request, output);
    match result {
        Ok(bytes) => {
            let busy = started.elapsed();
            counters.batches.fetch_add(1, Ordering::Relaxed);
            counters
                .tokens
                .fetch_add(token_count as u64, Ordering::Relaxed);
            counters.bytes.fetch_add(bytes, Ordering::Relaxed);
            counters
                .busy_microseconds
                .fetch_add(busy.as_micros() as u64, Ordering::Relaxed);
            channel.complete_timed(slot, Ok(()), busy);
            // An answer is progress too: a worker that answers is alive even when its heartbeat
            // thread waits for a CPU.
            channel.beat();
        }
        Err(problem) => {
            tracing::warn!(
                layer,
                token_count,
                top_k,
                "refused a channel request: {problem}"
            );
            channel.complete(slot, Err(&problem));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two banks of 4 experts of 5000 bytes; this worker owns experts 1..3 (10,000 bytes, 3
    /// pages, of each bank).
    fn two_banks() -> (Vec<u8>, Vec<Option<Bank>>, Range<usize>, usize) {
        let stride = 5000;
        let banks = vec![
            Some(Bank {
                offset: 0,
                length: 4 * stride,
            }),
            None,
            Some(Bank {
                offset: 4 * stride,
                length: 4 * stride,
            }),
        ];
        (vec![1u8; 8 * stride], banks, 1..3, stride)
    }

    #[test]
    fn a_refused_lock_faults_the_owned_pages_in_or_leaves_them_when_ram_is_short() {
        let (all, banks, owned, stride) = two_banks();
        let locked = std::cell::RefCell::new(Vec::new());
        let lock = |range: &[u8]| {
            locked.borrow_mut().push(range.len());
            Ok(())
        };
        assert_eq!(
            make_owned_experts_resident(&all, &banks, &owned, stride, lock, Some(1 << 30)),
            BankResidency::Locked { bytes: 20_000 }
        );
        assert_eq!(
            *locked.borrow(),
            vec![10_000, 10_000],
            "each bank's owned range"
        );

        let refused = |_: &[u8]| Err(nix::errno::Errno::EPERM);
        assert_eq!(
            make_owned_experts_resident(&all, &banks, &owned, stride, refused, Some(1 << 30)),
            BankResidency::FaultedIn { pages: 6 }
        );
        assert_eq!(
            make_owned_experts_resident(&all, &banks, &owned, stride, refused, Some(20_000)),
            BankResidency::MappedOnUse,
            "20,000 owned bytes exceed 90% of 20,000"
        );
        assert_eq!(
            make_owned_experts_resident(&all, &banks, &owned, stride, refused, None),
            BankResidency::FaultedIn { pages: 6 },
            "RAM unknown: fault in"
        );
    }

    #[test]
    fn owned_ranges_stop_at_the_bank_end() {
        let bank = Bank {
            offset: 100,
            length: 250,
        };
        assert_eq!(owned_range(&bank, &(1..4), 100), 200..350);
        assert_eq!(owned_range(&bank, &(5..6), 100), 600..600);
    }
}
