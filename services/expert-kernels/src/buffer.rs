//! Page-aligned byte buffers for expert weights (benchmarks, tests, and any caller that wants
//! its banks 4096-byte aligned like an mmap'd artifact).
//!
//! Owns: allocation and release of such buffers. Must not touch: what is stored in them.

use std::alloc::{alloc_zeroed, dealloc, Layout};

use crate::KernelError;

/// A zeroed, 4096-byte-aligned heap buffer.
pub struct AlignedBuffer {
    pointer: *mut u8,
    layout: Layout,
}

// SAFETY: the buffer is uniquely owned heap memory, like a Vec<u8>.
unsafe impl Send for AlignedBuffer {}
unsafe impl Sync for AlignedBuffer {}

impl AlignedBuffer {
    pub fn zeroed(len: usize) -> Result<Self, KernelError> {
        let layout = Layout::from_size_align(len.max(1), 4096)
            .map_err(|error| KernelError::Input(format!("buffer of {len} bytes: {error}")))?;
        // SAFETY: the layout has a non-zero size.
        let pointer = unsafe { alloc_zeroed(layout) };
        if pointer.is_null() {
            return Err(KernelError::Input(format!("cannot allocate {len} bytes")));
        }
        Ok(AlignedBuffer { pointer, layout })
    }

    pub fn len(&self) -> usize {
        self.layout.size()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `pointer` is a live allocation of `len` initialised (zeroed) bytes.
        unsafe { std::slice::from_raw_parts(self.pointer, self.layout.size()) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.pointer, self.layout.size()) }
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.pointer
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { dealloc(self.pointer, self.layout) }
    }
}
