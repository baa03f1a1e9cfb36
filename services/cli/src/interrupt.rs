//! Ctrl-C and SIGTERM during a conversion: a flag the converter polls between tensors, so it
//! deletes its temporary files instead of dying with them on disk.
//!
//! Owns: the signal handler and its flag. Must not touch: what is cancelled.

use std::sync::atomic::{AtomicBool, Ordering};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Whether Ctrl-C or SIGTERM arrived since `install_interrupt_handler`.
pub(crate) fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

extern "C" fn on_interrupt(_signal: nix::libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Ctrl-C / SIGTERM set a flag the converter polls between tensors, so it can delete its
/// temporary files instead of dying with them on disk.
pub(crate) fn install_interrupt_handler() {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let action = SigAction::new(
        SigHandler::Handler(on_interrupt),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        let _ = unsafe { sigaction(signal, &action) };
    }
}
