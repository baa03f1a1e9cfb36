//! Where KV caches live: `--host-kv-mib` lets a GPU backend put attention layers' KV caches in
//! page-locked, device-mapped host memory (read and written by the attention kernels over PCIe)
//! once its own share of GPU memory for KV caches is used up.
//!
//! Owns: the request ([`HostKvRequest`]) and the report ([`KvPlacement`]) types of the
//! [`Backend`](super::Backend) methods; the CUDA side is `cuda/device/host_kv.rs`.
//! Must not touch: how caches are laid out or read (the backends).

/// How much GPU memory KV caches may take before they go to the host pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DeviceKvShare {
    /// Decided at the first KV cache: the GPU's free memory then (within `budget_bytes` of
    /// total use, `--gpu-mem-budget`, when given) less 1 GiB of working memory.
    Auto { budget_bytes: Option<u64> },
    /// Exactly this many bytes (0: every KV cache goes to the host pool while it has room).
    Bytes(u64),
}

/// `--host-kv-mib N` and the GPU share of KV caches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostKvRequest {
    /// Page-locked host memory to reserve for KV caches (0: none, every cache on the device).
    pub host_bytes: u64,
    pub device_share: DeviceKvShare,
}

/// Live KV caches (one per attention layer per sequence) by where they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvPlacement {
    pub device_caches: usize,
    pub device_bytes: u64,
    pub host_caches: usize,
    pub host_bytes: u64,
    /// The reserved host pool, bytes.
    pub host_pool_bytes: u64,
    /// The GPU share of KV caches once decided, bytes.
    pub device_share_bytes: Option<u64>,
}
