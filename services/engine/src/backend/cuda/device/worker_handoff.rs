//! The device-driven hand-off to the CPU expert workers (`kernels/handoff.cu`): the GPU posts a
//! MoE layer's non-resident routed experts into the workers' activation channels and collects
//! their sums itself, so a decode step with experts on the CPU has no host thread in it per layer
//! and records as one step graph.
//!
//! Owns: registering the channel segments with CUDA (page-locked and mapped into the device's
//! address space), the device table of the words the kernels touch, the expert → worker owner
//! table, the per-layer posted/sequence words, the failure word, and the two launches.
//! Must not touch: the channel protocol (the channel crate defines it; the kernels follow it),
//! worker supervision (the expert executor), which route a layer takes (the MoE layer).

use std::ops::Range;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaSlice, DevicePtr, LaunchConfig};
use ninfer_channel::SegmentMemory;

use super::pinned_staging::PinnedStaging;
use super::{driver_error, int, CudaBackend, CudaExpertSlots, CudaPendingRouting, CudaTensor};
use crate::backend::cuda::CudaError;
use crate::backend::WorkerHandoffFailure;

/// `HANDOFF_MAX_WORKERS` in `kernels/handoff.cu`.
pub(super) const HANDOFF_MAX_WORKERS: usize = 8;
/// `HANDOFF_WORDS` in `kernels/handoff.cu`: device addresses per worker, in this order.
pub(super) const HANDOFF_WORDS: usize = 11;
/// `HANDOFF_POST_THREADS` in `kernels/handoff.cu`: the post kernel is one block of these.
pub(super) const HANDOFF_POST_THREADS: u32 = 1024;
/// `HANDOFF_COLLECT_THREADS` in `kernels/handoff.cu`.
pub(super) const HANDOFF_COLLECT_THREADS: u32 = 256;
/// `HANDOFF_REFUSED` and `HANDOFF_ABANDONED` in `kernels/handoff.cu` (low byte of the failure
/// word; the worker index in the next byte, the layer in the high half).
pub(super) const HANDOFF_REFUSED: u32 = 1;
pub(super) const HANDOFF_ABANDONED: u32 = 2;

/// A channel segment registered with CUDA, unregistered on drop by the hand-off that
/// registered it. Another stage of a layer split finds the (portable) registration already
/// made and only maps it; the model drops the later stages' hand-offs first.
struct RegisteredSegment {
    context: Arc<CudaContext>,
    host: *mut std::ffi::c_void,
    device: u64,
    /// Whether this hand-off registered the segment (and so unregisters it).
    owned: bool,
}

// SAFETY: the pointer is the start of the segment mapping, used only as a token for
// cuMemHostUnregister; the mapping outlives the registration (the handoff keeps its owner).
unsafe impl Send for RegisteredSegment {}
// SAFETY: as above.
unsafe impl Sync for RegisteredSegment {}

impl Drop for RegisteredSegment {
    fn drop(&mut self) {
        if self.owned && self.context.bind_to_thread().is_ok() {
            // SAFETY: `host` is exactly the address a successful cuMemHostRegister took.
            unsafe {
                let _ = sys::cuMemHostUnregister(self.host);
            }
        }
    }
}

/// The workers' channels as the GPU sees them. Made once per model (the segments live as long
/// as the expert executor, which `keep_alive` holds).
pub struct CudaWorkerHandoff {
    workers: usize,
    num_experts: usize,
    max_tokens: usize,
    max_top_k: usize,
    hidden_size: usize,
    /// `[workers, HANDOFF_WORDS]` device addresses of the channel words.
    worker_words: CudaSlice<u64>,
    /// `[num_experts]` the worker owning each expert (`-1`: none), and its host copy.
    owners: Mutex<(CudaSlice<i32>, Vec<i32>)>,
    /// `[workers, 2]`: posted flag and sequence of the last post (written by the post kernel).
    posted: CudaSlice<u32>,
    /// The failure word the collect kernel sets, page-locked and mapped; the host touches it
    /// only under this lock, with the stream idle. Its device address never changes.
    failure: Mutex<PinnedStaging>,
    failure_address: u64,
    /// Recorded after a hand-off step and waited on with blocking sync: the host thread sleeps
    /// through the step instead of spinning on a core the workers compute on (a spinning
    /// wait halved the speed of the worker thread pinned beside it, and a layer waits for
    /// its slowest thread).
    step_finished: CudaEvent,
    _segments: Vec<RegisteredSegment>,
    _keep_alive: Box<dyn Send + Sync>,
}

fn registered(
    context: &Arc<CudaContext>,
    memory: &SegmentMemory,
) -> Result<RegisteredSegment, CudaError> {
    let host = memory.address as *mut std::ffi::c_void;
    // SAFETY: [address, address + length) is the engine's live shared mapping of the segment,
    // page-aligned (mmap), kept alive by the handoff's `keep_alive`.
    let status = unsafe {
        sys::cuMemHostRegister_v2(
            host,
            memory.length,
            sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE,
        )
    };
    // Registered already: by the hand-off of another stage of a layer split (portable, so
    // every context may map it).
    let owned = status != sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    if owned && status != sys::CUresult::CUDA_SUCCESS {
        return Err(CudaError::Driver {
            what: format!(
                "cuMemHostRegister of a {}-byte activation channel",
                memory.length
            ),
            message: format!("{status:?}"),
        });
    }
    let mut segment = RegisteredSegment {
        context: Arc::clone(context),
        host,
        device: 0,
        owned,
    };
    let mut device: sys::CUdeviceptr = 0;
    // SAFETY: `host` was registered with DEVICEMAP just above; valid out pointer; flags 0.
    let status = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0) };
    if status != sys::CUresult::CUDA_SUCCESS {
        return Err(CudaError::Driver {
            what: "mapping an activation channel into the device".into(),
            message: format!("{status:?}"),
        });
    }
    segment.device = device;
    Ok(segment)
}

impl CudaBackend {
    /// Registers the workers' channel segments and builds the device tables.
    pub(super) fn open_worker_handoff(
        &self,
        channels: &[SegmentMemory],
        num_experts: usize,
        keep_alive: Box<dyn Send + Sync>,
    ) -> Result<CudaWorkerHandoff, CudaError> {
        let invalid = |problem: String| CudaError::Invalid { problem };
        let first = channels
            .first()
            .ok_or_else(|| invalid("a worker hand-off without workers".into()))?;
        if channels.len() > HANDOFF_MAX_WORKERS {
            return Err(invalid(format!(
                "{} expert workers; the device hand-off takes at most {HANDOFF_MAX_WORKERS}",
                channels.len()
            )));
        }
        if channels.iter().any(|c| c.geometry != first.geometry) {
            return Err(invalid("the workers' channels have different sizes".into()));
        }
        self._context
            .bind_to_thread()
            .map_err(driver_error("binding the CUDA context"))?;
        let mut segments = Vec::with_capacity(channels.len());
        let mut words = Vec::with_capacity(channels.len() * HANDOFF_WORDS);
        for memory in channels {
            let segment = registered(&self._context, memory)?;
            let slot = &memory.slot;
            let at = |offset: usize| segment.device + offset as u64;
            // The order of the HANDOFF_* indices in kernels/handoff.cu.
            words.extend([
                at(slot.request_sequence),
                at(slot.response_sequence),
                at(slot.layer),
                at(slot.token_count),
                at(slot.top_k),
                at(slot.status),
                at(slot.expert_ids),
                at(slot.routing_weights),
                at(slot.hidden),
                at(slot.output),
                at(slot.handoff_abort),
            ]);
            segments.push(segment);
        }
        let worker_words = self
            .stream
            .memcpy_stod(&words)
            .map_err(driver_error("uploading the hand-off's channel addresses"))?;
        let owners_host = vec![-1i32; num_experts.max(1)];
        let owners = self
            .stream
            .memcpy_stod(&owners_host)
            .map_err(driver_error("uploading the expert owners"))?;
        let posted = self
            .stream
            .alloc_zeros::<u32>(2 * channels.len())
            .map_err(driver_error("allocating the hand-off's posted words"))?;
        let failure = PinnedStaging::allocate(&self._context, 4096)?;
        // SAFETY: no kernel uses the word yet.
        unsafe { *failure.host_word(0)? = 0 };
        let failure_address = failure.device_address(0)?;
        let step_finished = self
            .stream
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(driver_error("creating the hand-off's blocking event"))?;
        Ok(CudaWorkerHandoff {
            workers: channels.len(),
            num_experts,
            max_tokens: first.geometry.max_tokens as usize,
            max_top_k: first.geometry.max_top_k as usize,
            hidden_size: first.geometry.hidden_size as usize,
            worker_words,
            owners: Mutex::new((owners, owners_host)),
            posted,
            failure: Mutex::new(failure),
            failure_address,
            step_finished,
            _segments: segments,
            _keep_alive: keep_alive,
        })
    }

    /// Sets which worker owns each expert (uploaded only when it changed; stream-ordered, so
    /// between steps it never races a kernel that reads the table).
    pub(super) fn set_handoff_owners(
        &self,
        handoff: &CudaWorkerHandoff,
        owned: &[Range<usize>],
    ) -> Result<(), CudaError> {
        if owned.len() != handoff.workers {
            return Err(CudaError::Invalid {
                problem: format!(
                    "expert ranges for {} workers, the hand-off has {}",
                    owned.len(),
                    handoff.workers
                ),
            });
        }
        let mut table = vec![-1i32; handoff.num_experts.max(1)];
        for (worker, range) in owned.iter().enumerate() {
            for expert in range.clone() {
                if let Some(owner) = table.get_mut(expert) {
                    *owner = worker as i32;
                }
            }
        }
        let mut owners = handoff.owners.lock().map_err(|_| CudaError::Invalid {
            problem: "the hand-off's owner table lock is poisoned".into(),
        })?;
        if owners.1 != table {
            let (device, host) = &mut *owners;
            self.stream
                .memcpy_htod(&table, device)
                .map_err(driver_error("updating the expert owners"))?;
            *host = table;
        }
        Ok(())
    }

    /// Queues the post kernel: this layer's non-resident routed experts of `pending` to their
    /// workers, published once every byte is written.
    pub(super) fn launch_handoff_post(
        &self,
        handoff: &CudaWorkerHandoff,
        layer: usize,
        x: &CudaTensor,
        pending: &CudaPendingRouting,
        resident: Option<&CudaExpertSlots>,
    ) -> Result<(), CudaError> {
        let tokens = x.rows;
        let k = pending.experts_per_token();
        if tokens == 0 {
            return Ok(());
        }
        if tokens > handoff.max_tokens || k > handoff.max_top_k || x.cols != handoff.hidden_size {
            return Err(CudaError::Invalid {
                problem: format!(
                    "a hand-off of {tokens} rows × top-{k} × {} features; the channels take {} × top-{} × {}",
                    x.cols, handoff.max_tokens, handoff.max_top_k, handoff.hidden_size
                ),
            });
        }
        let uploaded;
        let (ids, weights) = match pending.device_routing(tokens) {
            Some(routing) => routing,
            None => {
                // A routing computed on the host (a router wider than the kernel takes).
                let routing = pending.host_routing().ok_or_else(|| CudaError::Invalid {
                    problem: "a pending routing with neither a device nor a host routing".into(),
                })?;
                let ids: Vec<f32> = routing
                    .expert_ids
                    .iter()
                    .map(|&id| f32::from_bits(id))
                    .collect();
                uploaded = (
                    self.upload_tensor(&ids, tokens, k)?,
                    self.upload_tensor(&routing.weights, tokens, k)?,
                );
                (&uploaded.0, &uploaded.1)
            }
        };
        let table = resident.map_or(0, |slots| slots.device_table_address(&self.stream));
        let owners = handoff.owners.lock().map_err(|_| CudaError::Invalid {
            problem: "the hand-off's owner table lock is poisoned".into(),
        })?;
        let owners_address = owners.0.device_ptr(&self.stream).0;
        let words_address = handoff.worker_words.device_ptr(&self.stream).0;
        let posted_address = handoff.posted.device_ptr(&self.stream).0;
        let config = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (HANDOFF_POST_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (workers, tokens_arg, k_arg, width, layer_arg, experts) = (
            int(handoff.workers, "workers")?,
            int(tokens, "tokens")?,
            int(k, "top-k")?,
            int(x.cols, "hidden size")?,
            int(layer, "layer")?,
            int(handoff.num_experts, "experts")?,
        );
        launch!(self, "handoff_post", config;
            &*ids.data, &*weights.data, &*x.data, &table, &owners_address, &words_address,
            &workers, &posted_address, &tokens_arg, &k_arg, &width, &layer_arg, &experts)
    }

    /// Queues the collect kernel: waits for the posted workers' answers and sums them (zeros
    /// where no worker had work) into a new `[rows, hidden]` tensor.
    pub(super) fn launch_handoff_collect(
        &self,
        handoff: &CudaWorkerHandoff,
        rows: usize,
    ) -> Result<CudaTensor, CudaError> {
        let mut out = self.output_uninit(rows, handoff.hidden_size)?;
        if rows == 0 {
            return Ok(out);
        }
        let words_address = handoff.worker_words.device_ptr(&self.stream).0;
        let posted_address = handoff.posted.device_ptr(&self.stream).0;
        let failure_address = handoff.failure_address;
        let config = LaunchConfig {
            grid_dim: (
                u32::try_from(rows).map_err(|_| CudaError::Invalid {
                    problem: format!("{rows} rows in one hand-off"),
                })?,
                1,
                1,
            ),
            block_dim: (HANDOFF_COLLECT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (workers, width) = (
            int(handoff.workers, "workers")?,
            int(handoff.hidden_size, "hidden size")?,
        );
        let wide_reads = i32::from(self.options.wide_handoff_reads);
        launch!(self, "handoff_collect", config;
            &words_address, &workers, &posted_address, &width, &mut *out.data, &failure_address,
            &wide_reads)?;
        Ok(out)
    }

    /// Waits for the stream, then reads and clears the failure word.
    pub(super) fn take_handoff_failure(
        &self,
        handoff: &CudaWorkerHandoff,
    ) -> Result<Option<WorkerHandoffFailure>, CudaError> {
        handoff
            .step_finished
            .record(&self.stream)
            .map_err(driver_error("recording the hand-off step's end"))?;
        handoff
            .step_finished
            .synchronize()
            .map_err(driver_error("waiting for the hand-off step's end"))?;
        self.synchronize()?;
        let failure = handoff.failure.lock().map_err(|_| CudaError::Invalid {
            problem: "the hand-off's failure word lock is poisoned".into(),
        })?;
        let word = failure.host_word(0)?;
        // SAFETY: the stream is idle, so no kernel writes the word now; the lock keeps other
        // host threads off it.
        let value = unsafe {
            let value = std::ptr::read_volatile(word);
            std::ptr::write_volatile(word, 0);
            value
        };
        let (worker, layer) = (((value >> 8) & 0xff) as usize, (value >> 16) as usize);
        match value & 0xff {
            0 => Ok(None),
            HANDOFF_REFUSED => Ok(Some(WorkerHandoffFailure::Refused { worker, layer })),
            HANDOFF_ABANDONED => Ok(Some(WorkerHandoffFailure::Abandoned { worker, layer })),
            other => Err(CudaError::Invalid {
                problem: format!("the hand-off's failure word holds an unknown code {other}"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_kernels() {
        use crate::backend::cuda::kernels::kernel_define;
        let define = |name: &str| kernel_define("handoff", name);
        assert_eq!(HANDOFF_MAX_WORKERS as i64, define("HANDOFF_MAX_WORKERS"));
        assert_eq!(HANDOFF_WORDS as i64, define("HANDOFF_WORDS"));
        assert_eq!(
            i64::from(HANDOFF_POST_THREADS),
            define("HANDOFF_POST_THREADS")
        );
        assert_eq!(
            i64::from(HANDOFF_COLLECT_THREADS),
            define("HANDOFF_COLLECT_THREADS")
        );
        assert_eq!(i64::from(HANDOFF_REFUSED), define("HANDOFF_REFUSED"));
        assert_eq!(i64::from(HANDOFF_ABANDONED), define("HANDOFF_ABANDONED"));
        // The word order the Rust side uploads.
        for (index, name) in [
            "HANDOFF_REQUEST_SEQUENCE",
            "HANDOFF_RESPONSE_SEQUENCE",
            "HANDOFF_LAYER",
            "HANDOFF_TOKEN_COUNT",
            "HANDOFF_TOP_K",
            "HANDOFF_STATUS",
            "HANDOFF_EXPERT_IDS",
            "HANDOFF_ROUTING_WEIGHTS",
            "HANDOFF_HIDDEN",
            "HANDOFF_OUTPUT",
            "HANDOFF_ABORT",
        ]
        .into_iter()
        .enumerate()
        {
            assert_eq!(index as i64, define(name), "{name}");
        }
    }
}
