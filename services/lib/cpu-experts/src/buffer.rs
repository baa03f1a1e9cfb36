//! Page-aligned byte buffers for expert weights (benchmarks, tests, and any caller that wants
//! its banks 4096-byte aligned like an mmap'd artifact).
//!
//! Owns: allocation and release of such buffers. Must not touch: what is stored in them.

use std::alloc::{alloc_zeroed, dealloc, Layout};

use crate::KernelError;

/// `NINFER_HUGE_PAGES`: `huge` asks the kernel for 2 MiB pages for every buffer of at least
/// 2 MiB (a 2 MiB-aligned anonymous mapping with `madvise(MADV_HUGEPAGE)` before the first
/// write), `small` forbids them (`MADV_NOHUGEPAGE`); unset or anything else: the heap, and the
/// system's policy. A knob for measuring what the page size does to streaming bandwidth
/// (`ninfer bench memory|experts` report how much anonymous memory is on huge pages).
pub const HUGE_PAGES_VARIABLE: &str = "NINFER_HUGE_PAGES";

const HUGE_PAGE: usize = 2 << 20;

fn page_size_advice() -> Option<libc::c_int> {
    match std::env::var(HUGE_PAGES_VARIABLE).as_deref() {
        Ok("huge") => Some(libc::MADV_HUGEPAGE),
        Ok("small") => Some(libc::MADV_NOHUGEPAGE),
        _ => None,
    }
}

/// Bytes of this process's anonymous memory on transparent huge pages (`AnonHugePages` of
/// `/proc/self/smaps_rollup`), where the kernel reports it.
pub fn anonymous_huge_page_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let line = text
        .lines()
        .find(|line| line.starts_with("AnonHugePages:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// A zeroed, 4096-byte-aligned buffer (2 MiB-aligned under `NINFER_HUGE_PAGES`).
pub struct AlignedBuffer {
    pointer: *mut u8,
    len: usize,
    source: Source,
}

enum Source {
    Heap(Layout),
    /// An anonymous mapping of `length` bytes at `base` (`pointer` is its first 2 MiB
    /// boundary).
    Mapping {
        base: *mut libc::c_void,
        length: usize,
    },
}

// SAFETY: the buffer is uniquely owned memory, like a Vec<u8>.
unsafe impl Send for AlignedBuffer {}
unsafe impl Sync for AlignedBuffer {}

impl AlignedBuffer {
    pub fn zeroed(len: usize) -> Result<Self, KernelError> {
        if let (Some(advice), true) = (page_size_advice(), len >= HUGE_PAGE) {
            return Self::mapped(len, advice);
        }
        let layout = Layout::from_size_align(len.max(1), 4096)
            .map_err(|error| KernelError::Input(format!("buffer of {len} bytes: {error}")))?;
        // SAFETY: the layout has a non-zero size.
        let pointer = unsafe { alloc_zeroed(layout) };
        if pointer.is_null() {
            return Err(KernelError::Input(format!("cannot allocate {len} bytes")));
        }
        Ok(AlignedBuffer {
            pointer,
            len: layout.size(),
            source: Source::Heap(layout),
        })
    }

    /// An anonymous mapping (zero pages until written) with `advice` given before any page is
    /// touched, so the first writes fault pages of the asked size.
    fn mapped(len: usize, advice: libc::c_int) -> Result<Self, KernelError> {
        let length = len
            .checked_add(HUGE_PAGE)
            .ok_or_else(|| KernelError::Input(format!("buffer of {len} bytes is too large")))?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                length,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(KernelError::Input(format!(
                "cannot map {len} bytes: {}",
                std::io::Error::last_os_error()
            )));
        }
        let start = (base as usize).next_multiple_of(HUGE_PAGE);
        let pointer = start as *mut u8;
        // SAFETY: [start, start + len) lies inside the mapping (it has HUGE_PAGE to spare);
        // the advice changes how untouched pages will be backed, not any contents.
        if unsafe { libc::madvise(start as *mut libc::c_void, len, advice) } != 0 {
            eprintln!(
                "{HUGE_PAGES_VARIABLE}: madvise failed: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(AlignedBuffer {
            pointer,
            len,
            source: Source::Mapping { base, length },
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `pointer` is a live allocation of `len` initialised (zeroed) bytes.
        unsafe { std::slice::from_raw_parts(self.pointer, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.pointer, self.len) }
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.pointer
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        match self.source {
            // SAFETY: allocated in `zeroed` with this layout.
            Source::Heap(layout) => unsafe { dealloc(self.pointer, layout) },
            // SAFETY: the mapping made in `mapped`, unmapped once.
            Source::Mapping { base, length } => unsafe {
                libc::munmap(base, length);
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_buffers_are_zeroed_page_aligned_and_writable() {
        let mut buffer = AlignedBuffer::zeroed(3 * 4096 + 5).unwrap();
        assert_eq!(buffer.len(), 3 * 4096 + 5);
        assert_eq!(buffer.as_mut_ptr() as usize % 4096, 0);
        assert!(buffer.as_slice().iter().all(|&b| b == 0));
        buffer.as_mut_slice()[7] = 9;
        assert_eq!(buffer.as_slice()[7], 9);
    }

    #[test]
    fn mapped_buffers_are_zeroed_huge_page_aligned_and_writable() {
        for advice in [libc::MADV_HUGEPAGE, libc::MADV_NOHUGEPAGE] {
            let len = HUGE_PAGE + 12345;
            let mut buffer = AlignedBuffer::mapped(len, advice).unwrap();
            assert_eq!(buffer.len(), len);
            assert_eq!(buffer.as_mut_ptr() as usize % HUGE_PAGE, 0);
            assert!(buffer.as_slice().iter().all(|&b| b == 0));
            buffer.as_mut_slice()[len - 1] = 3;
            assert_eq!(buffer.as_slice()[len - 1], 3);
        }
    }
}
