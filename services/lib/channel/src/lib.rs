//! The shared-memory activation channel between the engine and one CPU expert worker.
//!
//! Owns: the byte layout of the shared segment, the request/response protocol on it, the
//! doorbells (brief spin, then cross-process futex wait/wake) and the liveness words.
//! Must not touch: what experts compute, gRPC, model math. Both sides link this crate, so the
//! layout has exactly one definition.
//!
//! The parts: `layout.rs` (the segment's bytes), `segments.rs` (mapping and removing segments),
//! `doorbell.rs` (spins and futexes), `engine_end.rs` and `worker_end.rs` (each side's protocol).
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

mod doorbell;
mod engine_end;
mod layout;
mod segments;
mod worker_end;

pub use engine_end::{EngineChannel, WaitOutcome, HEARTBEAT_THREAD_NAME};
pub use layout::{ChannelGeometry, Request, SegmentMemory, SlotLayout};
pub use segments::{remove_stale_segments, unlink_created_segments};
pub use worker_end::WorkerChannel;

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

#[cfg(test)]
mod tests {
    use super::*;
    use ninfer_artifact::NO_EXPERT;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::{Duration, Instant};

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
