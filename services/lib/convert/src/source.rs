//! Checkpoints that are not on this disk: the byte ranges a conversion reads, and the trait
//! through which a caller (the CLI's hub client) serves them.
//!
//! Owns: `ByteRange`, `RemoteShard` (a shard known by its name, size and header bytes) and the
//! `RangeSource` contract: the converter announces every range it will read, in order, before
//! the first read, then reads each exactly once in that order.
//! Must not touch: networking, caching or retries (the source's business), the plan.

use crate::error::ConvertError;

/// Bytes `start..end` of shard `shard` (an index into the checkpoint's shards, in name order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ByteRange {
    pub shard: usize,
    pub start: u64,
    pub end: u64,
}

impl ByteRange {
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// A safetensors shard of a remote checkpoint.
#[derive(Debug, Clone)]
pub struct RemoteShard {
    /// Its file name in the repository (errors name it).
    pub name: String,
    /// Its size as the hub lists it.
    pub size: u64,
    /// Its first bytes: the 8-byte length and the whole JSON header.
    pub header: Vec<u8>,
}

/// Serves the bytes of a remote checkpoint's shards.
pub trait RangeSource: Send + Sync {
    /// Every range the conversion will read, in reading order; called once, before any read,
    /// so the source can fetch ahead.
    fn announce(&self, reads: &[ByteRange]) -> Result<(), ConvertError>;
    /// The bytes of `range` (exactly `range.len()` of them).
    fn read(&self, range: &ByteRange) -> Result<Vec<u8>, ConvertError>;
}
