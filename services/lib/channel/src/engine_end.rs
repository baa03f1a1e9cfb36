//! The engine's end of the channel: it creates the segment, posts requests, rings the doorbell,
//! waits for answers and reads the worker's liveness words.
//!
//! Owns: [`EngineChannel`]. Must not touch: the worker's end (`worker_end.rs`).

use std::ffi::CString;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::sys::mman::{shm_open, shm_unlink};
use nix::sys::stat::Mode;

use crate::doorbell::{futex_wait, futex_wake, monotonic_nanos, spin_for};
use crate::layout::{
    ChannelGeometry, Request, SegmentHeader, SegmentMemory, SlotHeader, SlotLayout,
    ERROR_TEXT_BYTES, MAGIC,
};
use crate::segments::{
    forget_created_segment, map_segment, register_created_segment, system, Mapping,
};
use crate::ChannelError;

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
    // The tests corrupt a request through it.
    pub(crate) mapping: Mapping,
    shm_name: String,
    /// The heartbeat word last read and how many checks found the worker's heartbeat thread
    /// waiting for a CPU since (see [`EngineChannel::heartbeat`]).
    liveness: std::sync::Mutex<LivenessReading>,
}

#[derive(Default)]
pub(crate) struct LivenessReading {
    pub(crate) last_word: u64,
    pub(crate) starved_checks: u64,
    /// `(pid, tid)` of the worker's heartbeat thread, found once per worker process.
    pub(crate) heartbeat_thread: Option<(u32, u32)>,
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
    pub(crate) fn heartbeat_thread_waits_for_a_cpu(&self, reading: &mut LivenessReading) -> bool {
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
pub(crate) fn find_thread(pid: u32, name: &str) -> Option<u32> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    tasks.filter_map(|task| task.ok()).find_map(|task| {
        let tid: u32 = task.file_name().to_str()?.parse().ok()?;
        let comm = std::fs::read_to_string(task.path().join("comm")).ok()?;
        (comm.trim_end() == name).then_some(tid)
    })
}

/// The scheduler state letter of one thread (`R`, `S`, `D`, `T`, `Z`...).
pub(crate) fn thread_state(pid: u32, tid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
    // The name field is in parentheses and may itself hold spaces and parentheses.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}
