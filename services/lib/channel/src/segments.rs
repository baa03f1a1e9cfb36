//! The shared-memory segments: creating or opening and mapping one, unmapping it, and removing
//! the segments this process created (at exit) or that dead processes left.
//!
//! Owns: the mapping and the segment registry. Must not touch: the layout inside a segment.

use std::ffi::CString;
use std::num::NonZeroUsize;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;

use nix::sys::mman::{mmap, munmap, shm_unlink, MapFlags, ProtFlags};

use crate::layout::{ChannelGeometry, SegmentHeader, SlotHeader, HEADER_BYTES, SLOT_HEADER_BYTES};
use crate::ChannelError;

/// A mapped segment (either side).
pub(crate) struct Mapping {
    pub(crate) name: String,
    pub(crate) base: NonNull<std::ffi::c_void>,
    pub(crate) length: usize,
    pub(crate) geometry: ChannelGeometry,
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

pub(crate) fn system<'a>(
    name: &'a str,
    action: &'static str,
) -> impl FnOnce(nix::Error) -> ChannelError + 'a {
    move |source| ChannelError::System {
        name: name.to_string(),
        action,
        source,
    }
}

pub(crate) fn map_segment(
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
    pub(crate) fn header(&self) -> &SegmentHeader {
        // SAFETY: the mapping is at least HEADER_BYTES long and page-aligned.
        unsafe { &*(self.base.as_ptr() as *const SegmentHeader) }
    }

    pub(crate) fn slot_base(&self, slot: u32) -> *mut u8 {
        let offset = HEADER_BYTES + slot as usize * self.geometry.slot_stride();
        // SAFETY: slot < slot_count (checked by callers), so the offset is inside the mapping.
        unsafe { (self.base.as_ptr() as *mut u8).add(offset) }
    }

    pub(crate) fn slot_header(&self, slot: u32) -> &SlotHeader {
        // SAFETY: every slot starts with a SlotHeader, page-aligned.
        unsafe { &*(self.slot_base(slot) as *const SlotHeader) }
    }

    /// Raw pointer to the slot header for plain (non-atomic) field writes by the owning side.
    pub(crate) fn slot_header_mut(&self, slot: u32) -> *mut SlotHeader {
        self.slot_base(slot) as *mut SlotHeader
    }

    pub(crate) fn entries(&self) -> usize {
        self.geometry.max_tokens as usize * self.geometry.max_top_k as usize
    }

    pub(crate) fn vectors(&self) -> usize {
        self.geometry.max_tokens as usize * self.geometry.hidden_size as usize
    }

    pub(crate) fn ids_ptr(&self, slot: u32) -> *mut u32 {
        // SAFETY: inside the slot (layout in the module doc).
        unsafe { self.slot_base(slot).add(SLOT_HEADER_BYTES) as *mut u32 }
    }

    pub(crate) fn weights_ptr(&self, slot: u32) -> *mut f32 {
        // SAFETY: inside the slot.
        unsafe {
            self.slot_base(slot)
                .add(SLOT_HEADER_BYTES + self.entries() * 4) as *mut f32
        }
    }

    pub(crate) fn hidden_ptr(&self, slot: u32) -> *mut f32 {
        // SAFETY: inside the slot.
        unsafe {
            self.slot_base(slot)
                .add(SLOT_HEADER_BYTES + self.entries() * 8) as *mut f32
        }
    }

    pub(crate) fn output_ptr(&self, slot: u32) -> *mut f32 {
        // SAFETY: inside the slot.
        unsafe {
            self.slot_base(slot)
                .add(SLOT_HEADER_BYTES + self.entries() * 8 + self.vectors() * 4)
                as *mut f32
        }
    }
}

/// Segments this process created and has not unlinked: the exit paths unlink them even when
/// the channels themselves are never dropped (threads still hold them at exit).
pub(crate) static CREATED_SEGMENTS: std::sync::Mutex<Vec<String>> =
    std::sync::Mutex::new(Vec::new());

pub(crate) fn register_created_segment(name: &str) {
    if let Ok(mut names) = CREATED_SEGMENTS.lock() {
        names.push(name.to_string());
    }
}

pub(crate) fn forget_created_segment(name: &str) {
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
pub(crate) fn process_runs(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(')')
            .is_none_or(|(_, rest)| !rest.trim_start().starts_with('Z')),
        // No /proc (not Linux): ask the kernel directly.
        Err(_) => nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok(),
    }
}
