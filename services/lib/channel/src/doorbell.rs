//! The doorbells: a brief spin, then a cross-process futex wait or wake on a shared word, and the
//! monotonic clock both processes read.
//!
//! Owns: the spin budgets and the futex calls. Must not touch: what a word means (the ends).

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// How long a waiter spins before it sleeps on the futex: `NINFER_CHANNEL_SPIN_US`, else 50 µs.
/// Measured on the 16-core device machine (qwen3-30b-a3b, all experts on the CPU workers): a
/// 1 ms spin made decode slower (18.9 against 26.7 tok/s; the spinning waiters take cores the
/// expert threads need), so the short spin stays the default.
pub(crate) fn spin_for() -> Duration {
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
pub(crate) fn request_spin_for() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        std::env::var("NINFER_WORKER_SPIN_US")
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
            .map(Duration::from_micros)
            .unwrap_or_else(spin_for)
    })
}

/// `CLOCK_MONOTONIC` now, in nanoseconds: the clock both processes read the spin deadline on.
pub(crate) fn monotonic_nanos() -> u64 {
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

pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
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

pub(crate) fn futex_wake(word: &AtomicU32) {
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
