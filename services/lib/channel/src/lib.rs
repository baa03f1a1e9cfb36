//! The shared-memory activation channel between the engine and one CPU expert worker.
//!
//! Owns: the byte layout of the shared segment, the request/response protocol on it, the
//! doorbells (brief spin, then cross-process futex wait/wake) and the liveness words.
//! Must not touch: what experts compute, gRPC, model math. Both sides link this crate, so the
//! layout has exactly one definition.
//!
//! # Segment layout
//!
//! The engine creates one named POSIX shared-memory object per worker (`/dev/shm/NAME`), sizes it,
//! and tells the worker its name over gRPC (`AttachChannel`). The segment outlives worker restarts:
//! a restarted worker attaches to the same segment and finds the interrupted request still posted.
//!
//! ```text
//! offset 0      SegmentHeader (4096 bytes): geometry, worker pid, heartbeat, doorbell
//! offset 4096   slot 0: SlotHeader (256 bytes), expert ids, routing weights, hidden in, sums out
//! …             slot i at 4096 + i · slot_stride (slot_stride a multiple of 4096)
//! ```
//!
//! The segment header starts with the magic `NICHAN03`; the number is the layout version, bumped
//! whenever a header changes (02: the slot header's response half gained `compute_nanos`, the
//! worker's compute time for the answered request; 03: the segment header gained the words of
//! the device-driven hand-off below), so an engine and a worker of different layouts refuse each
//! other at attach instead of misreading bytes.
//!
//! Per slot, `[max_tokens, max_top_k]` u32 expert ids (`u32::MAX`, `ninfer_artifact::NO_EXPERT`: an unused entry),
//! `[max_tokens, max_top_k]` f32 routing weights, `[max_tokens, hidden]` f32 hidden states in and
//! `[max_tokens, hidden]` f32 weighted sums out.
//!
//! # Protocol and memory ordering
//!
//! A slot is free when `request_sequence == response_sequence`. The engine (the only writer of a
//! slot's request part) fills layer, counts, ids, weights and hidden states with plain stores, then
//! publishes with `request_sequence.store(n, Release)`, then bumps the segment doorbell
//! (`fetch_add`, SeqCst) and wakes the worker with `FUTEX_WAKE` only if the worker said it sleeps.
//! The worker's `Acquire` load of `request_sequence` that observes `n` therefore sees every byte of
//! the request. The worker writes the sums and status with plain stores and publishes with
//! `response_sequence.store(n, Release)`; the engine's `Acquire` load that observes `n` sees the
//! whole response. Each side writes only its own half between those two points, so no byte is ever
//! written by both processes at once.
//!
//! Sleeping cannot lose a wake-up: the worker sets `worker_sleeping` (SeqCst), reads the doorbell
//! value `v`, re-checks every slot, and only then calls `FUTEX_WAIT(doorbell, v)`, which returns at
//! once if the doorbell moved after the read. The engine waits on a slot the same way, on that
//! slot's `response_sequence`. The futex ops are the shared (not `_PRIVATE`) ones, since the two
//! sides are different processes. On the fast path — both sides busy — there is no syscall, no
//! allocation and no gRPC call per layer.
//!
//! # The device-driven hand-off
//!
//! The engine's GPU may post and collect requests itself, through its own mapping of the segment
//! ([`EngineChannel::segment_memory`] says where every word lies): it writes a request with plain
//! stores, fences, and stores `request_sequence`; it polls `response_sequence` and reads the sums.
//! A GPU cannot wake a futex, so the engine asks the worker to keep spinning for requests until
//! a deadline (`spin_until_nanos`, on `CLOCK_MONOTONIC`, which both processes share), renewed
//! every step; a worker that sleeps past it is woken by the engine's host once per step, never
//! per layer. A GPU waiting for an answer that cannot come (no worker within the engine's
//! timeout) is released by `handoff_abort`, which the engine sets and the GPU polls with the
//! response. The worker adds its compute time to `compute_nanos_total`, since per-request times
//! are overwritten before a host reads them.

use std::ffi::CString;
use std::num::NonZeroUsize;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::sys::mman::{mmap, munmap, shm_open, shm_unlink, MapFlags, ProtFlags};
use nix::sys::stat::Mode;

const MAGIC: u64 = u64::from_le_bytes(*b"NICHAN03");
const HEADER_BYTES: usize = 4096;
const SLOT_HEADER_BYTES: usize = 256;
const ERROR_TEXT_BYTES: usize = 192;
/// How long a waiter spins before it sleeps on the futex: `NINFER_CHANNEL_SPIN_US`, else 50 µs.
/// Measured on the 16-core device machine (qwen3-30b-a3b, all experts on the CPU workers): a
/// 1 ms spin made decode slower (18.9 against 26.7 tok/s; the spinning waiters take cores the
/// expert threads need), so the short spin stays the default.
fn spin_for() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        let configured = std::env::var("NINFER_CHANNEL_SPIN_US")
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok());
        Duration::from_micros(configured.unwrap_or(50))
    })
}

/// How long a worker spins for its next request before it sleeps: `NINFER_WORKER_SPIN_US`,
/// else the channel's spin. Separate because the worker waits while the engine runs the GPU
/// part of a layer, when its cores are idle, whereas the engine waits while the experts run on
/// every core (a long engine spin is what made decode slower). Not yet measured on the device.
fn request_spin_for() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        std::env::var("NINFER_WORKER_SPIN_US")
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
            .map(Duration::from_micros)
            .unwrap_or_else(spin_for)
    })
}

#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("shared memory `{name}`: {action}: {source}")]
    System {
        name: String,
        action: &'static str,
        #[source]
        source: nix::Error,
    },
    #[error("shared memory `{name}` is not an activation channel of this version")]
    NotAChannel { name: String },
    #[error("shared memory `{name}`: {problem}")]
    Geometry { name: String, problem: String },
    #[error("request does not fit slot: {0}")]
    RequestTooLarge(String),
}

/// Sizes of a channel; fixed at creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChannelGeometry {
    pub slot_count: u32,
    pub max_tokens: u32,
    pub hidden_size: u32,
    pub max_top_k: u32,
}

impl ChannelGeometry {
    fn slot_stride(&self) -> usize {
        let entries = self.max_tokens as usize * self.max_top_k as usize;
        let vectors = self.max_tokens as usize * self.hidden_size as usize;
        (SLOT_HEADER_BYTES + entries * 8 + vectors * 8).next_multiple_of(4096)
    }

    fn segment_bytes(&self) -> usize {
        HEADER_BYTES + self.slot_count as usize * self.slot_stride()
    }
}

/// Where the words of one slot and the hand-off words lie in a segment, in bytes from its start:
/// what a device-driven hand-off needs to post and collect requests through its own mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotLayout {
    /// u32, written by the engine side last (the publication of a request).
    pub request_sequence: usize,
    /// u32, written by the worker last (the publication of an answer).
    pub response_sequence: usize,
    /// u32 each, written by the engine side before `request_sequence`.
    pub layer: usize,
    pub token_count: usize,
    pub top_k: usize,
    /// u32, 0 when the worker answered, else it refused (the error text is in the slot).
    pub status: usize,
    /// `[max_tokens, max_top_k]` u32, then the same of f32, then `[max_tokens, hidden]` f32 in,
    /// then the same out.
    pub expert_ids: usize,
    pub routing_weights: usize,
    pub hidden: usize,
    pub output: usize,
    /// u32 in the segment header (see the module doc).
    pub handoff_abort: usize,
}

/// A channel segment as mapped in the engine: its address, length, sizes and one slot's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentMemory {
    pub address: usize,
    pub length: usize,
    pub geometry: ChannelGeometry,
    pub slot: SlotLayout,
}

/// `CLOCK_MONOTONIC` now, in nanoseconds: the clock both processes read the spin deadline on.
fn monotonic_nanos() -> u64 {
    let mut now = nix::libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we own; CLOCK_MONOTONIC always exists on Linux.
    unsafe { nix::libc::clock_gettime(nix::libc::CLOCK_MONOTONIC, &mut now) };
    (now.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(now.tv_nsec as u64)
}

#[repr(C)]
struct SegmentHeader {
    magic: u64,
    slot_count: u32,
    max_tokens: u32,
    hidden_size: u32,
    max_top_k: u32,
    slot_stride: u64,
    /// Written by the worker when it attaches.
    worker_pid: AtomicU32,
    worker_sleeping: AtomicU32,
    /// Futex word the worker sleeps on; the engine bumps it after posting.
    doorbell: AtomicU32,
    /// Bumped by the worker when it attaches, so the engine sees a restart.
    attach_generation: AtomicU32,
    /// Bumped by a worker thread every few milliseconds while the process runs.
    heartbeat: AtomicU64,
    /// Written by the engine: until this `CLOCK_MONOTONIC` time (ns) the worker spins for its
    /// next request instead of sleeping (a device-driven hand-off cannot wake it).
    spin_until_nanos: AtomicU64,
    /// Written by the worker: nanoseconds spent computing answers, summed over its life.
    compute_nanos_total: AtomicU64,
    /// Written by the engine: non-zero releases a device waiting for an answer on this segment.
    handoff_abort: AtomicU32,
}

#[repr(C)]
struct SlotHeader {
    request_sequence: AtomicU32,
    response_sequence: AtomicU32,
    engine_waiting: AtomicU32,
    layer: u32,
    token_count: u32,
    top_k: u32,
    /// 0 = ok; otherwise the worker refused the request and wrote `error_text`.
    status: u32,
    error_length: u32,
    error_text: [u8; ERROR_TEXT_BYTES],
    /// Response half: nanoseconds the worker spent computing the answer (0 when it does not
    /// say), so the engine can split its wait into compute and channel time.
    compute_nanos: u64,
}

const _: () = assert!(std::mem::size_of::<SlotHeader>() <= SLOT_HEADER_BYTES);
const _: () = assert!(std::mem::size_of::<SegmentHeader>() <= HEADER_BYTES);

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let spec = nix::libc::timespec {
        tv_sec: timeout.as_secs() as nix::libc::time_t,
        tv_nsec: timeout.subsec_nanos() as nix::libc::c_long,
    };
    // SAFETY: FUTEX_WAIT (shared) on a live, 4-byte-aligned word of our mapping; returns on wake,
    // value mismatch, signal or timeout, all of which the callers re-check.
    unsafe {
        nix::libc::syscall(
            nix::libc::SYS_futex,
            word.as_ptr(),
            nix::libc::FUTEX_WAIT,
            expected,
            &spec as *const nix::libc::timespec,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE (shared) on a live word of our mapping.
    unsafe {
        nix::libc::syscall(
            nix::libc::SYS_futex,
            word.as_ptr(),
            nix::libc::FUTEX_WAKE,
            i32::MAX,
        );
    }
}

/// A mapped segment (either side).
struct Mapping {
    name: String,
    base: NonNull<std::ffi::c_void>,
    length: usize,
    geometry: ChannelGeometry,
}

// SAFETY: all cross-thread/process access goes through atomics or the slot protocol above.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map_segment` mapped.
        let _ = unsafe { munmap(self.base, self.length) };
    }
}

fn system<'a>(name: &'a str, action: &'static str) -> impl FnOnce(nix::Error) -> ChannelError + 'a {
    move |source| ChannelError::System {
        name: name.to_string(),
        action,
        source,
    }
}

fn map_segment(
    name: &str,
    fd: &OwnedFd,
    length: usize,
) -> Result<NonNull<std::ffi::c_void>, ChannelError> {
    let size = NonZeroUsize::new(length).ok_or_else(|| ChannelError::Geometry {
        name: name.to_string(),
        problem: "empty segment".into(),
    })?;
    // SAFETY: a fresh shared mapping of a shm object we hold open; the kernel picks the address.
    unsafe {
        mmap(
            None,
            size,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_SHARED | MapFlags::MAP_POPULATE,
            fd,
            0,
        )
    }
    .map_err(system(name, "mapping"))
}

impl Mapping {
    fn header(&self) -> &SegmentHeader {
        // SAFETY: the mapping is at least HEADER_BYTES long and page-aligned.
        unsafe { &*(self.base.as_ptr() as *const SegmentHeader) }
    }

    fn slot_base(&self, slot: u32) -> *mut u8 {
        let offset = HEADER_BYTES + slot as usize * self.geometry.slot_stride();
        // SAFETY: slot < slot_count (checked by callers), so the offset is inside the mapping.
        unsafe { (self.base.as_ptr() as *mut u8).add(offset) }
    }

    fn slot_header(&self, slot: u32) -> &SlotHeader {
        // SAFETY: every slot starts with a SlotHeader, page-aligned.
        unsafe { &*(self.slot_base(slot) as *const SlotHeader) }
    }

    /// Raw pointer to the slot header for plain (non-atomic) field writes by the owning side.
    fn slot_header_mut(&self, slot: u32) -> *mut SlotHeader {
        self.slot_base(slot) as *mut SlotHeader
    }

    fn entries(&self) -> usize {
        self.geometry.max_tokens as usize * self.geometry.max_top_k as usize
    }

    fn vectors(&self) -> usize {
        self.geometry.max_tokens as usize * self.geometry.hidden_size as usize
    }

    fn ids_ptr(&self, slot: u32) -> *mut u32 {
        // SAFETY: inside the slot (layout in the module doc).
        unsafe { self.slot_base(slot).add(SLOT_HEADER_BYTES) as *mut u32 }
    }

    fn weights_ptr(&self, slot: u32) -> *mut f32 {
        // SAFETY: inside the slot.
        unsafe {
            self.slot_base(slot)
                .add(SLOT_HEADER_BYTES + self.entries() * 4) as *mut f32
        }
    }

    fn hidden_ptr(&self, slot: u32) -> *mut f32 {
        // SAFETY: inside the slot.
        unsafe {
            self.slot_base(slot)
                .add(SLOT_HEADER_BYTES + self.entries() * 8) as *mut f32
        }
    }

    fn output_ptr(&self, slot: u32) -> *mut f32 {
        // SAFETY: inside the slot.
        unsafe {
            self.slot_base(slot)
                .add(SLOT_HEADER_BYTES + self.entries() * 8 + self.vectors() * 4)
                as *mut f32
        }
    }
}

/// One request: as the engine posts it, and as the worker reads it back (then the counts are as
/// posted, so validate them before use; the slices are clamped to the slot).
pub struct Request<'a> {
    pub layer: u32,
    pub token_count: u32,
    pub top_k: u32,
    /// `[token_count, top_k]`; `ninfer_artifact::NO_EXPERT` for entries this worker does not own.
    pub expert_ids: &'a [u32],
    /// `[token_count, top_k]`.
    pub routing_weights: &'a [f32],
    /// `[token_count, hidden]`.
    pub hidden: &'a [f32],
}

/// What the engine learns while waiting for a response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitOutcome {
    /// The response is in; read it with `EngineChannel::output`.
    Done,
    /// The worker refused the request (bad input); the text says why.
    Refused(String),
    /// The deadline passed first.
    TimedOut,
}

/// The engine's end: creates and owns the segment (unlinked on drop).
pub struct EngineChannel {
    mapping: Mapping,
    shm_name: String,
    /// The heartbeat word last read and how many checks found the worker's heartbeat thread
    /// waiting for a CPU since (see [`EngineChannel::heartbeat`]).
    liveness: std::sync::Mutex<LivenessReading>,
}

#[derive(Default)]
struct LivenessReading {
    last_word: u64,
    starved_checks: u64,
    /// `(pid, tid)` of the worker's heartbeat thread, found once per worker process.
    heartbeat_thread: Option<(u32, u32)>,
}

impl EngineChannel {
    /// Creates the named segment `/NAME` (visible as `/dev/shm/NAME`).
    pub fn create(name: &str, geometry: ChannelGeometry) -> Result<Self, ChannelError> {
        if geometry.slot_count == 0
            || geometry.max_tokens == 0
            || geometry.hidden_size == 0
            || geometry.max_top_k == 0
        {
            return Err(ChannelError::Geometry {
                name: name.into(),
                problem: format!("every size must be positive: {geometry:?}"),
            });
        }
        let shm_name = format!("/{}", name.trim_start_matches('/'));
        let c_name = CString::new(shm_name.clone()).map_err(|_| ChannelError::Geometry {
            name: name.into(),
            problem: "name contains a NUL byte".into(),
        })?;
        let fd = shm_open(
            c_name.as_c_str(),
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(system(name, "creating"))?;
        let length = geometry.segment_bytes();
        nix::unistd::ftruncate(&fd, length as i64).map_err(system(name, "sizing"))?;
        let base = map_segment(name, &fd, length)?;
        let mapping = Mapping {
            name: shm_name.clone(),
            base,
            length,
            geometry,
        };
        // SAFETY: we just created the segment; nobody else has mapped it yet.
        unsafe {
            let header = mapping.base.as_ptr() as *mut SegmentHeader;
            (*header).magic = MAGIC;
            (*header).slot_count = geometry.slot_count;
            (*header).max_tokens = geometry.max_tokens;
            (*header).hidden_size = geometry.hidden_size;
            (*header).max_top_k = geometry.max_top_k;
            (*header).slot_stride = geometry.slot_stride() as u64;
        }
        register_created_segment(&shm_name);
        Ok(EngineChannel {
            mapping,
            shm_name,
            liveness: std::sync::Mutex::new(LivenessReading::default()),
        })
    }

    /// The name to send to the worker.
    pub fn name(&self) -> &str {
        &self.shm_name
    }

    pub fn geometry(&self) -> ChannelGeometry {
        self.mapping.geometry
    }

    /// Pid the attached worker wrote (0 before any attach).
    pub fn worker_pid(&self) -> u32 {
        self.mapping.header().worker_pid.load(Ordering::Acquire)
    }

    pub fn attach_generation(&self) -> u32 {
        self.mapping
            .header()
            .attach_generation
            .load(Ordering::Acquire)
    }

    /// The worker's liveness counter: it moves while the worker lives and stands still while it
    /// is stopped or stuck. It is the heartbeat word the worker bumps (its heartbeat thread every
    /// few milliseconds, its serving thread after every answer), advanced also by every check that
    /// finds the heartbeat thread runnable but not yet run: on a saturated machine the beat is
    /// late, not missing, and a wall-clock bound alone would call the worker hung.
    pub fn heartbeat(&self) -> u64 {
        let word = self.mapping.header().heartbeat.load(Ordering::Acquire);
        let Ok(mut reading) = self.liveness.lock() else {
            return word;
        };
        if word != reading.last_word {
            reading.last_word = word;
        } else if self.heartbeat_thread_waits_for_a_cpu(&mut reading) {
            reading.starved_checks += 1;
        }
        word.wrapping_add(reading.starved_checks)
    }

    /// Whether the attached worker's heartbeat thread is runnable (state `R` in `/proc`): ready
    /// to beat, kept from it only by other work on the CPUs. A stopped (`T`) or blocked (`S`,
    /// `D`) thread is not.
    fn heartbeat_thread_waits_for_a_cpu(&self, reading: &mut LivenessReading) -> bool {
        let pid = self.worker_pid();
        if pid == 0 {
            return false;
        }
        let known = reading
            .heartbeat_thread
            .filter(|(known_pid, _)| *known_pid == pid);
        let tid = match known {
            Some((_, tid)) => tid,
            None => match find_thread(pid, HEARTBEAT_THREAD_NAME) {
                Some(tid) => {
                    reading.heartbeat_thread = Some((pid, tid));
                    tid
                }
                None => return false,
            },
        };
        thread_state(pid, tid) == Some('R')
    }

    /// True when the slot's last request has been answered.
    pub fn slot_is_free(&self, slot: u32) -> bool {
        let header = self.mapping.slot_header(slot);
        header.request_sequence.load(Ordering::Acquire)
            == header.response_sequence.load(Ordering::Acquire)
    }

    /// True while the slot holds a posted request not yet answered (by the host or by a
    /// device-driven hand-off).
    pub fn request_pending(&self, slot: u32) -> bool {
        slot < self.mapping.geometry.slot_count && !self.slot_is_free(slot)
    }

    /// Where `slot`'s words lie in this segment, for a device-driven hand-off.
    pub fn segment_memory(&self, slot: u32) -> Result<SegmentMemory, ChannelError> {
        let geometry = self.mapping.geometry;
        if slot >= geometry.slot_count {
            return Err(ChannelError::Geometry {
                name: self.mapping.name.clone(),
                problem: format!("slot {slot} of {}", geometry.slot_count),
            });
        }
        let base = self.mapping.base.as_ptr() as usize;
        let slot_base = self.mapping.slot_base(slot) as usize - base;
        let header = |offset: usize| slot_base + offset;
        Ok(SegmentMemory {
            address: base,
            length: self.mapping.length,
            geometry,
            slot: SlotLayout {
                request_sequence: header(std::mem::offset_of!(SlotHeader, request_sequence)),
                response_sequence: header(std::mem::offset_of!(SlotHeader, response_sequence)),
                layer: header(std::mem::offset_of!(SlotHeader, layer)),
                token_count: header(std::mem::offset_of!(SlotHeader, token_count)),
                top_k: header(std::mem::offset_of!(SlotHeader, top_k)),
                status: header(std::mem::offset_of!(SlotHeader, status)),
                expert_ids: self.mapping.ids_ptr(slot) as usize - base,
                routing_weights: self.mapping.weights_ptr(slot) as usize - base,
                hidden: self.mapping.hidden_ptr(slot) as usize - base,
                output: self.mapping.output_ptr(slot) as usize - base,
                handoff_abort: std::mem::offset_of!(SegmentHeader, handoff_abort),
            },
        })
    }

    /// Asks the worker to spin for requests (not sleep) for the next `duration`, and wakes it
    /// if it sleeps: what a step whose requests the device posts calls first.
    pub fn keep_worker_spinning(&self, duration: Duration) {
        let until = monotonic_nanos().saturating_add(duration.as_nanos() as u64);
        let segment = self.mapping.header();
        segment.spin_until_nanos.store(until, Ordering::SeqCst);
        if segment.worker_sleeping.load(Ordering::SeqCst) != 0 {
            self.ring();
        }
    }

    /// Sets or clears the word that releases a device waiting on this segment.
    pub fn set_handoff_abort(&self, abort: bool) {
        self.mapping
            .header()
            .handoff_abort
            .store(u32::from(abort), Ordering::SeqCst);
    }

    /// Nanoseconds the worker spent computing answers since the segment was made.
    pub fn worker_compute_nanos_total(&self) -> u64 {
        self.mapping
            .header()
            .compute_nanos_total
            .load(Ordering::Acquire)
    }

    /// The refusal text of the last answered request on `slot`, if the worker refused it.
    pub fn refusal(&self, slot: u32) -> Option<String> {
        if slot >= self.mapping.geometry.slot_count || !self.slot_is_free(slot) {
            return None;
        }
        // SAFETY: the slot is answered (Acquire loads in `slot_is_free`); the worker does not
        // write it again until a new request is posted.
        let header = self.mapping.slot_header(slot);
        let (status, length) = unsafe {
            let raw = self.mapping.slot_header_mut(slot);
            (
                (*raw).status,
                ((*raw).error_length as usize).min(ERROR_TEXT_BYTES),
            )
        };
        (status != 0).then(|| String::from_utf8_lossy(&header.error_text[..length]).into_owned())
    }

    /// Writes `request` into a free slot and rings the doorbell. Returns its sequence number.
    pub fn post(&self, slot: u32, request: &Request<'_>) -> Result<u32, ChannelError> {
        let geometry = self.mapping.geometry;
        let entries = request.token_count as usize * request.top_k as usize;
        let vectors = request.token_count as usize * geometry.hidden_size as usize;
        if slot >= geometry.slot_count
            || request.token_count > geometry.max_tokens
            || request.top_k > geometry.max_top_k
            || request.expert_ids.len() != entries
            || request.routing_weights.len() != entries
            || request.hidden.len() != vectors
        {
            return Err(ChannelError::RequestTooLarge(format!(
                "slot {slot}, {} tokens × top-{} ({} ids, {} weights, {} hidden values) for geometry {geometry:?}",
                request.token_count,
                request.top_k,
                request.expert_ids.len(),
                request.routing_weights.len(),
                request.hidden.len()
            )));
        }
        let header = self.mapping.slot_header(slot);
        let sequence = header
            .response_sequence
            .load(Ordering::Acquire)
            .wrapping_add(1);
        // SAFETY: the slot is free (the worker finished with it, Acquire above), so only we touch
        // its request half until the Release store below; sizes were checked against the geometry.
        unsafe {
            let raw = self.mapping.slot_header_mut(slot);
            (*raw).layer = request.layer;
            (*raw).token_count = request.token_count;
            (*raw).top_k = request.top_k;
            std::ptr::copy_nonoverlapping(
                request.expert_ids.as_ptr(),
                self.mapping.ids_ptr(slot),
                entries,
            );
            std::ptr::copy_nonoverlapping(
                request.routing_weights.as_ptr(),
                self.mapping.weights_ptr(slot),
                entries,
            );
            std::ptr::copy_nonoverlapping(
                request.hidden.as_ptr(),
                self.mapping.hidden_ptr(slot),
                vectors,
            );
        }
        header.request_sequence.store(sequence, Ordering::Release);
        self.ring();
        Ok(sequence)
    }

    /// Wakes the worker if it sleeps (also used to re-announce a request after a restart).
    pub fn ring(&self) {
        let segment = self.mapping.header();
        segment.doorbell.fetch_add(1, Ordering::SeqCst);
        if segment.worker_sleeping.load(Ordering::SeqCst) != 0 {
            futex_wake(&segment.doorbell);
        }
    }

    /// Waits up to `timeout` for the response to `sequence` on `slot`: spins briefly, then sleeps
    /// on the slot's futex.
    pub fn wait(&self, slot: u32, sequence: u32, timeout: Duration) -> WaitOutcome {
        let header = self.mapping.slot_header(slot);
        let started = Instant::now();
        let spin = spin_for();
        loop {
            let answered = header.response_sequence.load(Ordering::Acquire);
            if answered == sequence {
                // SAFETY: the Acquire load above synchronises with the worker's Release store.
                let (status, length) = unsafe {
                    let raw = self.mapping.slot_header_mut(slot);
                    (
                        (*raw).status,
                        ((*raw).error_length as usize).min(ERROR_TEXT_BYTES),
                    )
                };
                if status != 0 {
                    let text = &header.error_text[..length];
                    return WaitOutcome::Refused(String::from_utf8_lossy(text).into_owned());
                }
                return WaitOutcome::Done;
            }
            let elapsed = started.elapsed();
            if elapsed >= timeout {
                return WaitOutcome::TimedOut;
            }
            if elapsed < spin {
                std::hint::spin_loop();
                continue;
            }
            header.engine_waiting.store(1, Ordering::SeqCst);
            if header.response_sequence.load(Ordering::SeqCst) == answered {
                futex_wait(
                    &header.response_sequence,
                    answered,
                    (timeout - elapsed).min(Duration::from_millis(20)),
                );
            }
            header.engine_waiting.store(0, Ordering::SeqCst);
        }
    }

    /// Nanoseconds the worker reported computing the last answered request on `slot` (call after
    /// `wait` returned `Done`; 0 when the worker did not time it).
    pub fn compute_nanos(&self, slot: u32) -> u64 {
        // SAFETY: as in `output`: the response is published and the worker will not write the
        // slot again until we post.
        unsafe { (*self.mapping.slot_header_mut(slot)).compute_nanos }
    }

    /// The weighted sums of the last answered request on `slot` (`[token_count, hidden]`).
    pub fn output(&self, slot: u32) -> &[f32] {
        let geometry = self.mapping.geometry;
        // SAFETY: called after `wait` returned Done for this slot, so the worker is done writing
        // and will not touch the slot again until we post a new request.
        unsafe {
            let tokens = (*self.mapping.slot_header_mut(slot)).token_count as usize;
            std::slice::from_raw_parts(
                self.mapping.output_ptr(slot),
                tokens * geometry.hidden_size as usize,
            )
        }
    }

    /// Test hook: overwrites a posted request's counts with arbitrary values, as a corrupt or
    /// hostile engine could, so tests can check the worker refuses instead of crashing.
    #[doc(hidden)]
    pub fn corrupt_request_for_tests(
        &self,
        slot: u32,
        token_count: u32,
        top_k: u32,
        first_expert_id: u32,
    ) -> u32 {
        let header = self.mapping.slot_header(slot);
        let sequence = header
            .response_sequence
            .load(Ordering::Acquire)
            .wrapping_add(1);
        // SAFETY: as in `post`: the slot is ours until the Release store.
        unsafe {
            let raw = self.mapping.slot_header_mut(slot);
            (*raw).token_count = token_count;
            (*raw).top_k = top_k;
            *self.mapping.ids_ptr(slot) = first_expert_id;
        }
        header.request_sequence.store(sequence, Ordering::Release);
        self.ring();
        sequence
    }
}

impl Drop for EngineChannel {
    fn drop(&mut self) {
        forget_created_segment(&self.shm_name);
        if let Ok(c_name) = CString::new(self.shm_name.clone()) {
            let _ = shm_unlink(c_name.as_c_str());
        }
    }
}

/// The name the worker gives its heartbeat thread (what `/proc/PID/task/TID/comm` shows: the
/// kernel keeps 15 bytes of a thread's name).
pub const HEARTBEAT_THREAD_NAME: &str = "ninfer-heartbea";

/// The thread of process `pid` named `name`, if any.
fn find_thread(pid: u32, name: &str) -> Option<u32> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    tasks.filter_map(|task| task.ok()).find_map(|task| {
        let tid: u32 = task.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(task.path().join("comm")).ok()?;
        (comm.trim_end() == name).then_some(tid)
    })
}

/// The scheduler state letter of one thread (`R`, `S`, `D`, `T`, `Z`...).
fn thread_state(pid: u32, tid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
    // The name field is in parentheses and may itself hold spaces and parentheses.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Segments this process created and has not unlinked: the exit paths unlink them even when
/// the channels themselves are never dropped (threads still hold them at exit).
static CREATED_SEGMENTS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

fn register_created_segment(name: &str) {
    if let Ok(mut names) = CREATED_SEGMENTS.lock() {
        names.push(name.to_string());
    }
}

fn forget_created_segment(name: &str) {
    if let Ok(mut names) = CREATED_SEGMENTS.lock() {
        names.retain(|known| known != name);
    }
}

/// Unlinks every segment this process created (call on the way out: a clean exit, a signal, a
/// fatal error). Workers still attached keep their mapping; the name is gone from `/dev/shm`.
pub fn unlink_created_segments() -> usize {
    let names = match CREATED_SEGMENTS.lock() {
        Ok(mut names) => std::mem::take(&mut *names),
        Err(_) => return 0,
    };
    let mut unlinked = 0;
    for name in names {
        if let Ok(c_name) = CString::new(name) {
            if shm_unlink(c_name.as_c_str()).is_ok() {
                unlinked += 1;
            }
        }
    }
    unlinked
}

/// Removes `/dev/shm/PREFIX-PID-*` segments whose creator (`PID`) no longer runs: what an
/// engine killed outright (SIGKILL, a crash) left behind. Returns how many were removed.
pub fn remove_stale_segments(prefix: &str) -> usize {
    let Ok(entries) = std::fs::read_dir("/dev/shm") else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.filter_map(|entry| entry.ok()) {
        let file_name = entry.file_name();
        let Some(name) = file_name.to_str() else {
            continue;
        };
        let Some(pid) = name
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_prefix('-'))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<i32>().ok())
        else {
            continue;
        };
        if pid > 0 && !process_runs(pid) && std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Whether a process with this pid exists (a zombie counts as gone).
fn process_runs(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_none_or(|(_, rest)| !rest.trim_start().starts_with('Z')),
        // No /proc (not Linux): ask the kernel directly.
        Err(_) => nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok(),
    }
}

/// The worker's end: attaches to a segment the engine created.
pub struct WorkerChannel {
    mapping: Mapping,
    /// Where the next scan starts (round robin); only the serving thread moves it.
    next_slot: AtomicU32,
}

impl WorkerChannel {
    /// Opens and maps `/NAME`, checking it is a channel whose hidden size is `hidden_size`.
    pub fn attach(name: &str, hidden_size: u32) -> Result<Self, ChannelError> {
        let c_name = CString::new(name).map_err(|_| ChannelError::Geometry {
            name: name.into(),
            problem: "name contains a NUL byte".into(),
        })?;
        let fd = shm_open(c_name.as_c_str(), OFlag::O_RDWR, Mode::empty())
            .map_err(system(name, "opening"))?;
        let length = nix::sys::stat::fstat(&fd)
            .map_err(system(name, "reading size"))?
            .st_size as usize;
        if length < HEADER_BYTES {
            return Err(ChannelError::NotAChannel { name: name.into() });
        }
        let base = map_segment(name, &fd, length)?;
        // SAFETY: at least HEADER_BYTES are mapped; the engine wrote the header before sending
        // us the name.
        let header = unsafe { &*(base.as_ptr() as *const SegmentHeader) };
        let geometry = ChannelGeometry {
            slot_count: header.slot_count,
            max_tokens: header.max_tokens,
            hidden_size: header.hidden_size,
            max_top_k: header.max_top_k,
        };
        let mapping = Mapping {
            name: name.to_string(),
            base,
            length,
            geometry,
        };
        if header.magic != MAGIC
            || header.slot_stride != geometry.slot_stride() as u64
            || geometry.segment_bytes() > length
        {
            return Err(ChannelError::NotAChannel { name: name.into() });
        }
        if geometry.hidden_size != hidden_size {
            return Err(ChannelError::Geometry {
                name: name.into(),
                problem: format!(
                    "hidden size {} but this worker's model has {hidden_size}",
                    geometry.hidden_size
                ),
            });
        }
        header
            .worker_pid
            .store(std::process::id(), Ordering::Release);
        header.attach_generation.fetch_add(1, Ordering::AcqRel);
        Ok(WorkerChannel {
            mapping,
            next_slot: AtomicU32::new(0),
        })
    }

    pub fn name(&self) -> &str {
        &self.mapping.name
    }

    pub fn geometry(&self) -> ChannelGeometry {
        self.mapping.geometry
    }

    /// Bumps the liveness counter the engine watches.
    pub fn beat(&self) {
        self.mapping
            .header()
            .heartbeat
            .fetch_add(1, Ordering::Release);
    }

    /// Whether the engine asked for spinning until a time not yet reached.
    fn spinning_requested(&self) -> bool {
        let until = self
            .mapping
            .header()
            .spin_until_nanos
            .load(Ordering::Relaxed);
        until != 0 && monotonic_nanos() < until
    }

    fn pending(&self, slot: u32) -> bool {
        let header = self.mapping.slot_header(slot);
        header.request_sequence.load(Ordering::Acquire)
            != header.response_sequence.load(Ordering::Acquire)
    }

    /// The next posted request, in slot order, waiting at most `timeout` (spin, then futex).
    pub fn next_request(&self, timeout: Duration) -> Option<(u32, Request<'_>)> {
        let segment = self.mapping.header();
        let slots = self.mapping.geometry.slot_count;
        let started = Instant::now();
        let spin = request_spin_for();
        let slot = 'found: loop {
            let start = self.next_slot.load(Ordering::Relaxed);
            for offset in 0..slots {
                let slot = (start + offset) % slots;
                if self.pending(slot) {
                    break 'found slot;
                }
            }
            let elapsed = started.elapsed();
            if elapsed >= timeout {
                return None;
            }
            if elapsed < spin || self.spinning_requested() {
                std::hint::spin_loop();
                continue;
            }
            segment.worker_sleeping.store(1, Ordering::SeqCst);
            let observed = segment.doorbell.load(Ordering::SeqCst);
            if !(0..slots).any(|slot| self.pending(slot)) {
                futex_wait(
                    &segment.doorbell,
                    observed,
                    (timeout - elapsed).min(Duration::from_millis(50)),
                );
            }
            segment.worker_sleeping.store(0, Ordering::SeqCst);
        };
        self.next_slot.store((slot + 1) % slots, Ordering::Relaxed);
        let geometry = self.mapping.geometry;
        // SAFETY: the request is published (Acquire in `pending`); the engine will not write this
        // slot again until we answer it. Counts are clamped to the slot's capacity here, so the
        // slices stay inside the slot even if the posted counts are corrupt; the caller checks
        // them against the model and refuses bad requests.
        unsafe {
            let raw = self.mapping.slot_header_mut(slot);
            let token_count = (*raw).token_count;
            let top_k = (*raw).top_k;
            let tokens = (token_count.min(geometry.max_tokens)) as usize;
            let k = (top_k.min(geometry.max_top_k)) as usize;
            Some((
                slot,
                Request {
                    layer: (*raw).layer,
                    token_count,
                    top_k,
                    expert_ids: std::slice::from_raw_parts(self.mapping.ids_ptr(slot), tokens * k),
                    routing_weights: std::slice::from_raw_parts(
                        self.mapping.weights_ptr(slot),
                        tokens * k,
                    ),
                    hidden: std::slice::from_raw_parts(
                        self.mapping.hidden_ptr(slot),
                        tokens * geometry.hidden_size as usize,
                    ),
                },
            ))
        }
    }

    /// The output area of `slot` (`[max_tokens, hidden]`), to be filled before `complete`.
    ///
    /// # Safety
    /// Only between `next_request` returning this slot and `complete` for it, and not while a
    /// `Request` read from the same slot is used to write (the areas are disjoint, so reading the
    /// view while writing here is fine).
    // The output lives in shared memory, not in `self`: the slot protocol, not the borrow of
    // `self`, is what makes the access exclusive (hence `unsafe` and the contract above).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn output_mut(&self, slot: u32) -> &mut [f32] {
        let geometry = self.mapping.geometry;
        std::slice::from_raw_parts_mut(
            self.mapping.output_ptr(slot),
            geometry.max_tokens as usize * geometry.hidden_size as usize,
        )
    }

    /// Publishes the answer to the request on `slot`: `Ok` or a refusal with a reason.
    pub fn complete(&self, slot: u32, result: Result<(), &str>) {
        self.complete_timed(slot, result, Duration::ZERO);
    }

    /// [`Self::complete`], also telling the engine how long computing the answer took.
    pub fn complete_timed(&self, slot: u32, result: Result<(), &str>, compute: Duration) {
        let header = self.mapping.slot_header(slot);
        let sequence = header.request_sequence.load(Ordering::Acquire);
        // SAFETY: we own the slot's response half until the Release store below.
        unsafe {
            let raw = self.mapping.slot_header_mut(slot);
            (*raw).compute_nanos = u64::try_from(compute.as_nanos()).unwrap_or(u64::MAX);
            self.mapping
                .header()
                .compute_nanos_total
                .fetch_add((*raw).compute_nanos, Ordering::Relaxed);
            match result {
                Ok(()) => {
                    (*raw).status = 0;
                    (*raw).error_length = 0;
                }
                Err(text) => {
                    let bytes = text.as_bytes();
                    let length = bytes.len().min(ERROR_TEXT_BYTES);
                    std::ptr::copy_nonoverlapping(
                        bytes.as_ptr(),
                        (*raw).error_text.as_mut_ptr(),
                        length,
                    );
                    (*raw).error_length = length as u32;
                    (*raw).status = 1;
                }
            }
        }
        header.response_sequence.store(sequence, Ordering::Release);
        if header.engine_waiting.load(Ordering::SeqCst) != 0 {
            futex_wake(&header.response_sequence);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ninfer_artifact::NO_EXPERT;

    /// Segment tests run one at a time: one of them unlinks every segment this process made.
    fn serial() -> std::sync::MutexGuard<'static, ()> {
        static SEGMENT_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());
        SEGMENT_TESTS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn geometry(
        slot_count: u32,
        max_tokens: u32,
        hidden_size: u32,
        max_top_k: u32,
    ) -> ChannelGeometry {
        ChannelGeometry {
            slot_count,
            max_tokens,
            hidden_size,
            max_top_k,
        }
    }

    fn unique_name(tag: &str) -> String {
        format!(
            "ninfer-test-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        )
        .replace(['(', ')'], "")
    }

    /// What a device-driven hand-off does, done by a thread through the raw segment memory:
    /// no ring, no futex; the worker finds the request because the engine asked it to spin.
    #[test]
    fn requests_written_through_the_segment_memory_are_found_and_answered() {
        let _serial = serial();
        let (hidden_size, top_k) = (8u32, 2u32);
        let engine =
            EngineChannel::create(&unique_name("device"), geometry(2, 4, hidden_size, top_k))
                .unwrap();
        let memory = engine.segment_memory(0).unwrap();
        assert!(engine.segment_memory(2).is_err());
        let worker_name = engine.name().to_string();
        // The worker has been idle long enough to sleep before the engine asks it to spin.
        let worker = std::thread::spawn(move || {
            let channel = WorkerChannel::attach(&worker_name, hidden_size).unwrap();
            let (slot, request) = channel.next_request(Duration::from_secs(10)).unwrap();
            assert_eq!(slot, 0);
            assert_eq!(
                (request.layer, request.token_count, request.top_k),
                (7, 1, top_k)
            );
            assert_eq!(request.expert_ids, &[3, NO_EXPERT]);
            assert_eq!(request.routing_weights, &[0.75, 0.25]);
            let sums: Vec<f32> = request.hidden.iter().map(|v| v * 0.75).collect();
            // SAFETY: between next_request and complete for slot 0.
            unsafe { channel.output_mut(slot)[..sums.len()].copy_from_slice(&sums) };
            channel.complete_timed(slot, Ok(()), Duration::from_micros(40));
        });
        std::thread::sleep(Duration::from_millis(120));
        engine.keep_worker_spinning(Duration::from_secs(5));
        // Woken, it spins: it never announces sleep again while the deadline holds.
        std::thread::sleep(Duration::from_millis(20));
        for _ in 0..3 {
            assert_eq!(
                engine
                    .mapping
                    .header()
                    .worker_sleeping
                    .load(Ordering::SeqCst),
                0,
                "the worker sleeps although the engine asked it to spin"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let word = |offset: usize| (memory.address + offset) as *mut u32;
        let hidden: Vec<f32> = (0..hidden_size).map(|i| i as f32 + 0.5).collect();
        // SAFETY: the slot is free and ours until the sequence store; every offset is inside
        // the mapping (the layout the accessors use).
        let sequence = unsafe {
            *word(memory.slot.layer) = 7;
            *word(memory.slot.token_count) = 1;
            *word(memory.slot.top_k) = top_k;
            let ids = word(memory.slot.expert_ids);
            *ids = 3;
            *ids.add(1) = NO_EXPERT;
            let weights = (memory.address + memory.slot.routing_weights) as *mut f32;
            *weights = 0.75;
            *weights.add(1) = 0.25;
            let hidden_in = (memory.address + memory.slot.hidden) as *mut f32;
            std::ptr::copy_nonoverlapping(hidden.as_ptr(), hidden_in, hidden.len());
            let response = &*(word(memory.slot.response_sequence) as *const AtomicU32);
            let sequence = response.load(Ordering::Acquire).wrapping_add(1);
            let request = &*(word(memory.slot.request_sequence) as *const AtomicU32);
            request.store(sequence, Ordering::Release);
            sequence
        };
        // SAFETY: as above; the worker publishes the response with a Release store.
        let response = unsafe { &*(word(memory.slot.response_sequence) as *const AtomicU32) };
        let started = Instant::now();
        while response.load(Ordering::Acquire) != sequence {
            assert!(started.elapsed() < Duration::from_secs(5), "no answer");
            std::hint::spin_loop();
        }
        worker.join().unwrap();
        // SAFETY: answered; the worker does not write the slot again.
        let output = unsafe {
            std::slice::from_raw_parts(
                (memory.address + memory.slot.output) as *const f32,
                hidden.len(),
            )
        };
        let expected: Vec<f32> = hidden.iter().map(|v| v * 0.75).collect();
        assert_eq!(output, &expected[..]);
        assert_eq!(output, engine.output(0));
        assert_eq!(unsafe { *word(memory.slot.status) }, 0);
        assert_eq!(engine.refusal(0), None);
        assert_eq!(engine.worker_compute_nanos_total(), 40_000);
        assert!(!engine.request_pending(0));
        engine.set_handoff_abort(true);
        assert_eq!(unsafe { *word(memory.slot.handoff_abort) }, 1);
        engine.set_handoff_abort(false);
        assert_eq!(unsafe { *word(memory.slot.handoff_abort) }, 0);
    }

    #[test]
    fn a_starved_heartbeat_thread_counts_as_alive_and_a_blocked_one_does_not() {
        let _serial = serial();
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        let geometry = geometry(1, 1, 8, 1);
        let engine = EngineChannel::create(&unique_name("beat"), geometry).unwrap();
        // The "worker" is this process: attaching writes its pid.
        let _worker = WorkerChannel::attach(engine.name(), 8).unwrap();
        let spinning = Arc::new(AtomicBool::new(true));
        let spin = Arc::clone(&spinning);
        // A heartbeat thread that never beats but is always runnable: what the engine sees of
        // a worker whose heartbeat is starved of CPU.
        let thread = std::thread::Builder::new()
            .name(HEARTBEAT_THREAD_NAME.into())
            .spawn(move || {
                while spin.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
                // Then blocked: asleep without beating, as a hung worker's thread would be.
                std::thread::sleep(Duration::from_secs(2));
            })
            .unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let mut readings = vec![engine.heartbeat()];
        for _ in 0..20 {
            std::thread::sleep(Duration::from_millis(5));
            readings.push(engine.heartbeat());
        }
        assert!(
            readings.windows(2).any(|pair| pair[1] != pair[0]),
            "a runnable heartbeat thread did not count as progress: {readings:?}"
        );
        spinning.store(false, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(100));
        let blocked = engine.heartbeat();
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            engine.heartbeat(),
            blocked,
            "a sleeping heartbeat thread counted as progress"
        );
        thread.join().unwrap();
    }

    #[test]
    fn segments_are_unlinked_on_exit_and_stale_ones_removed() {
        let _serial = serial();
        let geometry = geometry(1, 1, 8, 1);
        let engine = EngineChannel::create(&unique_name("exit"), geometry).unwrap();
        let path = format!("/dev/shm{}", engine.name());
        assert!(std::path::Path::new(&path).exists());
        assert!(unlink_created_segments() >= 1);
        assert!(!std::path::Path::new(&path).exists(), "{path} left behind");
        std::mem::forget(engine);
        // A segment named after a process that is gone.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead_pid = child.id();
        child.wait().unwrap();
        let stale = format!("/dev/shm/ninfer-stale-test-{dead_pid}-w0-1");
        let live = format!("/dev/shm/ninfer-stale-test-{}-w0-1", std::process::id());
        std::fs::write(&stale, b"").unwrap();
        std::fs::write(&live, b"").unwrap();
        assert_eq!(remove_stale_segments("ninfer-stale-test"), 1);
        assert!(!std::path::Path::new(&stale).exists());
        assert!(
            std::path::Path::new(&live).exists(),
            "a live process's segment was removed"
        );
        std::fs::remove_file(&live).unwrap();
    }

    #[test]
    fn round_trip_between_threads() {
        let _serial = serial();
        let geometry = geometry(2, 4, 8, 2);
        let engine = EngineChannel::create(&unique_name("rt"), geometry).unwrap();
        let name = engine.name().to_string();
        let worker = std::thread::spawn(move || {
            let channel = WorkerChannel::attach(&name, 8).unwrap();
            for _ in 0..20 {
                let (slot, request) = channel.next_request(Duration::from_secs(5)).unwrap();
                let hidden = request.hidden.to_vec();
                let scale: f32 = request.routing_weights.iter().sum();
                // SAFETY: between next_request and complete for this slot.
                let out = unsafe { channel.output_mut(slot) };
                for (o, h) in out.iter_mut().zip(&hidden) {
                    *o = h * scale;
                }
                channel.complete_timed(slot, Ok(()), Duration::from_nanos(1000 + slot as u64));
            }
        });
        for round in 0..20u32 {
            let slot = round % 2;
            let hidden: Vec<f32> = (0..16).map(|i| (i + round) as f32).collect();
            let sequence = engine
                .post(
                    slot,
                    &Request {
                        layer: 3,
                        token_count: 2,
                        top_k: 2,
                        expert_ids: &[0, 1, 2, NO_EXPERT],
                        routing_weights: &[0.5, 0.25, 1.0, 0.0],
                        hidden: &hidden,
                    },
                )
                .unwrap();
            assert_eq!(
                engine.wait(slot, sequence, Duration::from_secs(5)),
                WaitOutcome::Done
            );
            let expected: Vec<f32> = hidden.iter().map(|h| h * 1.75).collect();
            assert_eq!(engine.output(slot), &expected[..]);
            assert_eq!(engine.compute_nanos(slot), 1000 + slot as u64);
        }
        worker.join().unwrap();
        assert_eq!(engine.worker_pid(), std::process::id());
    }

    #[test]
    fn refusal_is_reported_and_oversized_requests_are_rejected() {
        let _serial = serial();
        let geometry = geometry(1, 2, 4, 1);
        let engine = EngineChannel::create(&unique_name("refuse"), geometry).unwrap();
        let too_big = engine.post(
            0,
            &Request {
                layer: 0,
                token_count: 3,
                top_k: 1,
                expert_ids: &[0; 3],
                routing_weights: &[0.0; 3],
                hidden: &[0.0; 12],
            },
        );
        assert!(matches!(too_big, Err(ChannelError::RequestTooLarge(_))));
        let worker = WorkerChannel::attach(engine.name(), 4).unwrap();
        let sequence = engine.corrupt_request_for_tests(0, 1_000_000, 7, 99);
        let (slot, request) = worker.next_request(Duration::from_secs(1)).unwrap();
        assert_eq!((request.token_count, request.top_k), (1_000_000, 7));
        assert!(request.hidden.len() <= 8, "views are clamped to the slot");
        worker.complete(slot, Err("token count 1000000 exceeds 2"));
        assert_eq!(
            engine.wait(0, sequence, Duration::from_secs(1)),
            WaitOutcome::Refused("token count 1000000 exceeds 2".into())
        );
    }

    #[test]
    fn attach_checks_the_segment() {
        let _serial = serial();
        let geometry = geometry(1, 1, 4, 1);
        let engine = EngineChannel::create(&unique_name("geo"), geometry).unwrap();
        assert!(matches!(
            WorkerChannel::attach(engine.name(), 8),
            Err(ChannelError::Geometry { .. })
        ));
        assert!(WorkerChannel::attach("/ninfer-test-does-not-exist", 4).is_err());
        // A segment of the previous layout (magic `NICHAN01`) is refused, not misread.
        use std::io::{Seek, Write};
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/dev/shm{}", engine.name()))
            .unwrap();
        file.seek(std::io::SeekFrom::Start(0)).unwrap();
        file.write_all(b"NICHAN01").unwrap();
        assert!(matches!(
            WorkerChannel::attach(engine.name(), 4),
            Err(ChannelError::NotAChannel { .. })
        ));
    }

    #[test]
    fn wait_times_out_without_a_worker() {
        let _serial = serial();
        let geometry = geometry(1, 1, 4, 1);
        let engine = EngineChannel::create(&unique_name("timeout"), geometry).unwrap();
        let sequence = engine
            .post(
                0,
                &Request {
                    layer: 0,
                    token_count: 1,
                    top_k: 1,
                    expert_ids: &[0],
                    routing_weights: &[1.0],
                    hidden: &[0.0; 4],
                },
            )
            .unwrap();
        assert_eq!(
            engine.wait(0, sequence, Duration::from_millis(30)),
            WaitOutcome::TimedOut
        );
    }
}
