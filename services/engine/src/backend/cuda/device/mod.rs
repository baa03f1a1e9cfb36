//! [`CudaBackend`]: the backend's types (tensors, weights, KV caches, states) and every
//! [`Backend`] op as kernel launches on one stream.
//!
//! Owns: device buffers (`CudaSlice<f32>`) behind the backend's types and the shared launch
//! helpers (output buffers, uploads, kernel launches, `launch!`, op timers); the `Backend` impl,
//! which maps each op onto its family's module, is `backend_ops`. The families mirror
//! `kernels/*.cu`: `attention` (with `attention_batched`, the decode batch's launches, and
//! `attention_decode`, the group kernels), `delta_rule`, `elementwise`, `experts`, `matmul`,
//! `norm`, `router`, `sampling`, `vision` (the vision tower, with `vision_launches` and `vision_weights`). Beside them: `options` (what the backend is opened with),
//! `start_up` (driver, context, kernels), `self_checks` (cuBLAS), and the buffers' helpers
//! (`readback`, `pending_routing`, `host_kv`, `bandwidth`).
//!
//! Layers: this file's types hold state from modules that know nothing of [`CudaBackend`]
//! (`driver` the driver-call helpers, `launch` the loaded kernels and their arguments,
//! `pinned_staging`, `host_kv_pool`, `tensor_pool`, `op_timing`); the op files build on both,
//! and this file uses none of them (no import circles, a tidy test holds it).
//! Must not touch: model structure, routed experts, the artifact byte layout.
//!
//! Errors: every op returns its error as [`EngineError::Device`], naming the op and keeping the
//! [`CudaError`] (an out-of-memory says so, with the bytes asked for). A CUDA context that hit a
//! launch error is unusable anyway, so nothing tries to recover.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DriverError, LaunchConfig};
use ninfer_artifact::{Artifact, DType};

use super::cublas::Cublas;
use super::CudaError;
use crate::backend::DeltaRuleSpec;
use crate::error::EngineError;
use crate::weights::StoredWeight;
// The op files take the driver helpers from here, with the rest of their parent.
use driver::{describe, driver_error, elementwise, int, no_panic, wait_for_stream};
pub use qsa::CudaQsaCache;

/// The CUDA backend on one GPU. Every op is queued on one stream; `download` and the routing
/// read-back synchronise.
pub struct CudaBackend {
    // Kept so the context outlives every buffer and module made from it.
    _context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<&'static str, launch::Kernel>,
    /// Whether launches carry the programmatic-dependent-launch attribute (device/launch.rs).
    pdl: launch::Pdl,
    info: DeviceInfo,
    /// cuBLAS for bf16 prefill GEMMs, only once it passed the start-up check.
    cublas: Option<Cublas>,
    options: CudaOptions,
    /// `NINFER_CUDA_OP_TIMING`: per-op timing for profiling (device/op_timing.rs).
    op_timing: Option<op_timing::OpTiming>,
    /// Page-locked buffer the read-backs go through (device/readback.rs).
    staging: pinned_staging::StagingSlot,
    /// Page-locked buffers of the routings started and not finished (device/pending_routing.rs).
    routing_staging: pinned_staging::RoutingStagingPool,
    /// Buffers of dead op outputs, reused by the next op of the same length.
    tensor_pool: Arc<tensor_pool::TensorPool>,
    /// Rope's device tables: inverse frequencies per (rotary dim, θ), the last positions.
    rope_tables: Mutex<RopeTables>,
    /// `--host-kv-mib`: the page-locked KV pool and placement counters (device/host_kv.rs).
    host_kv: host_kv_pool::HostKvSlot,
    /// The step graph the current step's ops run in (device/step_graph.rs), if any.
    active_step_graph: Mutex<Option<ActiveStepGraph>>,
    /// The op shapes whose kernel variant has been logged (once each).
    kernel_choices_logged: Mutex<std::collections::HashSet<(&'static str, usize, usize)>>,
    /// `--cuda-fused-decode-experts`: the two counters `expert_decode_fused` waits on, zero
    /// between its launches (each launch's last block sets them back), allocated at start so a
    /// step graph's launches take the same buffer.
    fused_expert_counters: Option<CudaSlice<u32>>,
    /// `--cuda-fused-decode-router`: the ticket `route_decode_fused`'s blocks take (the last
    /// one routes), zero between launches (that block sets it back), allocated at start so a
    /// step graph's launches take the same buffer.
    fused_router_counter: Option<CudaSlice<u32>>,
    /// `--cuda-fused-decode-qkv-norm`: the ticket `add_norm_matmul3_bf16`'s blocks take (the
    /// last one stores the residual and sets it back to 0), allocated at start so a step graph's
    /// launches take the same buffer.
    fused_qkv_norm_counter: Option<CudaSlice<u32>>,
    /// Tensors this backend sent to another stage by a peer copy (device/stage_crossing.rs).
    peer_crossings: std::sync::atomic::AtomicU64,
    /// While a step graph records, each op checks the capture after it: the first op after
    /// which it was no longer active (device/step_graph.rs).
    capture_watch: capture_watch::CaptureWatch,
    /// The kernels' modules, held only to be dropped: last, so they are unloaded after everything
    /// else of the backend.
    _modules: launch::KernelModules,
}

/// Rope's device tables (filled by device/elementwise.rs).
#[derive(Default)]
pub(super) struct RopeTables {
    inverse: HashMap<(usize, u64), CudaSlice<f32>>,
    positions: Option<(Vec<u32>, CudaSlice<u32>)>,
}

/// What the ops of a step running through a graph (device/step_graph.rs) read instead of host
/// values.
#[derive(Clone)]
pub(super) struct ActiveStepGraph {
    pub rows: usize,
    /// Device addresses of the graph's id and position inputs (`u32` per row).
    pub ids: u64,
    pub positions: u64,
    pub pool: Arc<tensor_pool::TensorPool>,
    /// The ops are being recorded: no buffer may be allocated and nothing may wait.
    pub recording: bool,
}

/// A row-major `[rows, cols]` f32 buffer on the GPU.
pub struct CudaTensor {
    pub rows: usize,
    pub cols: usize,
    /// Dropped by hand: `Drop` hands it to `pool` instead when there is one.
    data: ManuallyDrop<CudaSlice<f32>>,
    /// Where the buffer goes when the tensor dies (op outputs: device/tensor_pool.rs); `None`:
    /// freed.
    pool: Option<Arc<tensor_pool::TensorPool>>,
}

impl CudaTensor {
    /// A tensor that owns `data` and frees it when it dies.
    fn unpooled(rows: usize, cols: usize, data: CudaSlice<f32>) -> Self {
        CudaTensor {
            rows,
            cols,
            data: ManuallyDrop::new(data),
            pool: None,
        }
    }
}

impl Drop for CudaTensor {
    fn drop(&mut self) {
        // SAFETY: `data` is taken or dropped exactly once, here, and never used after.
        unsafe {
            match self.pool.take() {
                Some(pool) => pool.give_back(ManuallyDrop::take(&mut self.data)),
                None => ManuallyDrop::drop(&mut self.data),
            }
        }
    }
}

/// A weight on the GPU: bf16 matrices stay bf16 (half the memory; bf16 → f32 in the kernel is
/// exact); everything else (f32, int8/int4 dense matrices, and every parameter) is decoded to
/// f32 at load.
pub struct CudaWeight {
    pub rows: usize,
    pub cols: usize,
    data: WeightData,
}

pub(super) enum WeightData {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

impl CudaWeight {
    /// The f32 buffer of a parameter (parameters are always loaded as f32).
    fn f32(&self) -> Result<&CudaSlice<f32>, CudaError> {
        match &self.data {
            WeightData::F32(data) => Ok(data),
            WeightData::Bf16(_) => Err(CudaError::Invalid {
                problem: "a bf16 matrix was passed where an f32 parameter is expected".into(),
            }),
        }
    }

    /// Bytes this weight takes on the GPU.
    pub fn device_bytes(&self) -> usize {
        match &self.data {
            WeightData::F32(data) => data.len() * 4,
            WeightData::Bf16(data) => data.len() * 2,
        }
    }
}

/// Keys and values of one attention layer of one sequence, `[max_tokens, kv_width]` each, in
/// the backend's [`KvDtype`].
pub struct CudaKvCache {
    pub max_tokens: usize,
    pub kv_width: usize,
    /// Positions held after the last append launched op by op (for inspection: the kernels
    /// take positions from the segments, and a step graph's replays append on the device).
    pub len: usize,
    pub dtype: KvDtype,
    /// Dropped by hand: host-pool buffers must never reach `cuMemFree` (device/host_kv.rs).
    keys: ManuallyDrop<KvBuffer>,
    values: ManuallyDrop<KvBuffer>,
    /// GPU memory or the host KV pool (device/host_kv.rs).
    placement: host_kv_pool::KvPlacementToken,
}

enum KvBuffer {
    F32(CudaSlice<f32>),
    /// bf16 bit patterns.
    Bf16(CudaSlice<u16>),
}

impl CudaKvCache {
    /// Bytes the keys and values take on the GPU.
    pub fn device_bytes(&self) -> usize {
        [&*self.keys, &*self.values]
            .into_iter()
            .map(|buffer| match buffer {
                KvBuffer::F32(data) => data.len() * 4,
                KvBuffer::Bf16(data) => data.len() * 2,
            })
            .sum()
    }
}

/// The last `kernel − 1` pre-conv inputs, `[kernel − 1, channels]`, oldest first.
pub struct CudaConvState {
    pub channels: usize,
    pub kernel: usize,
    history: CudaSlice<f32>,
}

/// The delta-rule state `[nv, dk, dv]` (row index = key dim).
pub struct CudaRecurrentState {
    pub spec: DeltaRuleSpec,
    state: CudaSlice<f32>,
}

/// Queues one kernel launch (device/launch.rs: plain, or with programmatic dependent launch).
/// Arguments are references to locals (the launch keeps pointers to them until it returns).
macro_rules! launch {
    ($backend:expr, $kernel:literal, $config:expr; $($arg:expr),* $(,)?) => {{
        let kernel = $backend.function($kernel)?;
        let mut args = $crate::backend::cuda::device::launch::KernelArgs::new(&$backend.stream);
        $( args.arg($arg); )*
        // SAFETY: the argument list matches the kernel's C signature in kernels/*.cu (types and
        // order; the op tests exercise every launch), and the caller sized every buffer for the
        // launch's index range.
        unsafe { $backend.launch_kernel(kernel, $config, &mut args) }
    }};
}

impl CudaBackend {
    /// The options this backend was opened with.
    pub fn options(&self) -> CudaOptions {
        self.options
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Waits for every queued op; reports a launch failure that surfaced late.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream
            .synchronize()
            .map_err(driver_error("synchronising the stream"))
    }

    fn function(&self, name: &str) -> Result<&launch::Kernel, CudaError> {
        self.functions.get(name).ok_or_else(|| CudaError::Invalid {
            problem: format!("kernel `{name}` is not loaded"),
        })
    }

    /// Lets kernel `name` launch with `bytes` of dynamic shared memory (past the 48 KB a launch
    /// gets without asking).
    fn allow_shared_memory(&self, name: &str, bytes: usize) -> Result<(), CudaError> {
        self.function(name)?
            .set_attribute(
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                i32::try_from(bytes).unwrap_or(i32::MAX),
            )
            .map_err(driver_error(format!(
                "allowing `{name}` {bytes} bytes of shared memory"
            )))
    }

    fn alloc(&self, len: usize) -> Result<CudaSlice<f32>, CudaError> {
        // Zero-length device allocations are an error in CUDA: keep one element.
        self.stream
            .alloc_zeros::<f32>(len.max(1))
            .map_err(driver_error(format!(
                "allocating {len} floats ({} bytes)",
                len * 4
            )))
    }

    /// A zeroed `[rows, cols]` output (a recycled buffer and a memset when one is free).
    fn output(&self, rows: usize, cols: usize) -> Result<CudaTensor, CudaError> {
        let mut tensor = self.output_uninit(rows, cols)?;
        self.stream
            .memset_zeros(&mut *tensor.data)
            .map_err(driver_error("zeroing an op's output"))?;
        Ok(tensor)
    }

    /// The output of an op whose kernels write every row of each segment they are given: left
    /// unzeroed when the segments' `row_ranges` tile `0..rows` in order (every forward's batch),
    /// so a step graph gets no memset node (each costs a node and breaks the chain of
    /// programmatic launches), else zeroed (rows no segment covers read as 0).
    fn output_for_segments(
        &self,
        rows: usize,
        cols: usize,
        row_ranges: impl IntoIterator<Item = std::ops::Range<usize>>,
    ) -> Result<CudaTensor, CudaError> {
        let mut next_row = 0;
        let tiled_in_order = row_ranges.into_iter().all(|range| {
            let in_order = range.start == next_row;
            next_row = range.end;
            in_order
        }) && next_row == rows;
        if tiled_in_order {
            self.output_uninit(rows, cols)
        } else {
            self.output(rows, cols)
        }
    }

    /// A `[rows, cols]` output with unspecified contents, for ops whose kernels write every
    /// element: a recycled buffer (no driver call at all) or a new allocation.
    fn output_uninit(&self, rows: usize, cols: usize) -> Result<CudaTensor, CudaError> {
        // Zero-length device allocations are an error in CUDA: keep one element.
        let len = (rows * cols).max(1);
        // A step running through a graph draws from the graph's own pool.
        let active = self.active_step_graph();
        let pool = match &active {
            Some(active) => &active.pool,
            None => &self.tensor_pool,
        };
        let data = match pool.take(len) {
            Some(data) => data,
            None if active.as_ref().is_some_and(|active| active.recording) => {
                return Err(CudaError::Invalid {
                    problem: format!(
                        "a recorded step asked for a buffer of {len} floats its first step did not use"
                    ),
                })
            }
            // SAFETY: the caller's kernel writes every element before anything reads it (the
            // contract of this function); the buffer is never read uninitialised.
            None => unsafe { self.stream.alloc::<f32>(len) }.map_err(driver_error(format!(
                "allocating {len} floats ({} bytes)",
                len * 4
            )))?,
        };
        Ok(CudaTensor {
            rows,
            cols,
            data: ManuallyDrop::new(data),
            pool: Some(Arc::clone(pool)),
        })
    }

    fn upload_u32(&self, values: &[u32]) -> Result<CudaSlice<u32>, CudaError> {
        let padded;
        let values = if values.is_empty() {
            padded = [0u32];
            &padded[..]
        } else {
            values
        };
        self.stream
            .memcpy_stod(values)
            .map_err(driver_error("copying indices to the GPU"))
    }

    fn upload_f32(&self, values: &[f32]) -> Result<CudaSlice<f32>, CudaError> {
        if values.is_empty() {
            return self.alloc(0);
        }
        self.stream
            .memcpy_stod(values)
            .map_err(driver_error("copying to the GPU"))
    }

    /// `values` as a new `[rows, cols]` tensor.
    fn upload_tensor(
        &self,
        values: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<CudaTensor, CudaError> {
        if values.len() != rows * cols {
            return Err(CudaError::Invalid {
                problem: format!("upload: {} values for {rows}×{cols}", values.len()),
            });
        }
        Ok(CudaTensor::unpooled(rows, cols, self.upload_f32(values)?))
    }

    /// the values are decoded to f32 (parameters, and any other dtype).
    fn load_weight(
        &self,
        artifact: &Arc<Artifact>,
        name: &str,
        keep_bf16: bool,
    ) -> Result<CudaWeight, EngineError> {
        let stored = StoredWeight::new(artifact, name)?;
        let (rows, cols) = stored.shape();
        let copy_error = |error: CudaError| EngineError::InvalidWeight {
            name: name.to_string(),
            problem: format!("copying to the GPU: {error}"),
        };
        let data = if keep_bf16 && stored.matrix().dtype == DType::Bf16 {
            let view = artifact.tensor(name)?;
            // Little-endian bf16 words, read without assuming the mapping's alignment.
            let words: Vec<u16> = view
                .bytes
                .chunks_exact(2)
                .map(|pair| u16::from_le_bytes([pair[0], pair[1]]))
                .collect();
            if words.is_empty() || words.len() != rows * cols {
                return Err(EngineError::InvalidWeight {
                    name: name.to_string(),
                    problem: format!("{} bf16 values for {rows}×{cols}", words.len()),
                });
            }
            WeightData::Bf16(
                self.stream
                    .memcpy_stod(&words)
                    .map_err(driver_error("copying a bf16 weight to the GPU"))
                    .map_err(copy_error)?,
            )
        } else {
            let values = stored.matrix().to_f32_vec();
            WeightData::F32(self.upload_f32(&values).map_err(copy_error)?)
        };
        Ok(CudaWeight { rows, cols, data })
    }

    /// A weight from host values (op tests compare against the CPU backend on the same values).
    pub fn weight_from_host(
        &self,
        values: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<CudaWeight, CudaError> {
        if values.len() != rows * cols {
            return Err(CudaError::Invalid {
                problem: format!("{} values for a {rows}×{cols} weight", values.len()),
            });
        }
        Ok(CudaWeight {
            rows,
            cols,
            data: WeightData::F32(self.upload_f32(values)?),
        })
    }

    /// A bf16 weight from host values, rounded to nearest even (as the converter stores bf16):
    /// the op tests' way to reach the bf16 paths (the kernel and cuBLAS) with chosen shapes.
    pub fn weight_from_host_bf16(
        &self,
        values: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<CudaWeight, CudaError> {
        if values.len() != rows * cols || values.is_empty() {
            return Err(CudaError::Invalid {
                problem: format!("{} values for a {rows}×{cols} weight", values.len()),
            });
        }
        let bits: Vec<u16> = values
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect();
        let data = self
            .stream
            .memcpy_stod(&bits)
            .map_err(driver_error("copying a bf16 weight to the GPU"))?;
        Ok(CudaWeight {
            rows,
            cols,
            data: WeightData::Bf16(data),
        })
    }

    fn unary(
        &self,
        x: &CudaTensor,
        out_cols: usize,
        run: impl FnOnce(&CudaSlice<f32>, &mut CudaSlice<f32>) -> Result<(), CudaError>,
    ) -> Result<CudaTensor, CudaError> {
        let input = &*x.data;
        // Every unary kernel writes each element of its output (grid-stride or per group).
        let mut out = self.output_uninit(x.rows, out_cols)?;
        if x.rows * out_cols > 0 {
            run(input, &mut out.data)?;
        }
        Ok(out)
    }

    fn check_same_shape(a: &CudaTensor, b: &CudaTensor, op: &str) -> Result<(), CudaError> {
        if (a.rows, a.cols) != (b.rows, b.cols) {
            return Err(CudaError::Invalid {
                problem: format!(
                    "{op}: shapes {}×{} and {}×{}",
                    a.rows, a.cols, b.rows, b.cols
                ),
            });
        }
        Ok(())
    }

    fn binary(
        &self,
        a: &CudaTensor,
        b: &CudaTensor,
        op: &str,
        run: impl FnOnce(
            &CudaSlice<f32>,
            &CudaSlice<f32>,
            &mut CudaSlice<f32>,
            i64,
        ) -> Result<(), CudaError>,
    ) -> Result<CudaTensor, CudaError> {
        Self::check_same_shape(a, b, op)?;
        let other = &*b.data;
        let total = a.rows * a.cols;
        self.unary(a, a.cols, |input, output| {
            run(input, other, output, total as i64)
        })
    }
}

/// Kernel launches (device/launch.rs holds the kernels and their arguments).
impl CudaBackend {
    /// Whether the next launch carries the PDL attribute: [`launch::Pdl::On`], or
    /// [`launch::Pdl::OutsideCapture`] while the stream is not being captured.
    fn programmatic_launch(&self) -> bool {
        match self.pdl {
            launch::Pdl::Off => false,
            launch::Pdl::On => true,
            launch::Pdl::OutsideCapture => matches!(
                self.stream.capture_status(),
                Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
            ),
        }
    }

    /// Queues `kernel` on the backend's stream with `args`.
    ///
    /// # Safety
    /// `args` must match the kernel's C parameters (count, types, order), and every buffer must
    /// hold the indices the kernel reaches under `config`.
    /// Fails without launching where the block would take more shared memory than the
    /// (capped) limit, [`check_shared_memory`].
    unsafe fn launch_kernel(
        &self,
        kernel: &launch::Kernel,
        config: LaunchConfig,
        args: &mut launch::KernelArgs<'_>,
    ) -> Result<(), CudaError> {
        launch::check_shared_memory(
            kernel.name,
            kernel.static_shared_bytes,
            config.shared_mem_bytes as usize,
            self.info.shared_memory_per_block,
        )?;
        let what = || format!("launching `{}`", kernel.name);
        // SAFETY: forwarded from the caller.
        unsafe { self.launch_checked(kernel, config, args) }.map_err(|error| CudaError::Driver {
            what: what(),
            message: describe(&error),
        })
    }

    /// [`CudaBackend::launch_kernel`] after its shared-memory check.
    unsafe fn launch_checked(
        &self,
        kernel: &launch::Kernel,
        config: LaunchConfig,
        args: &mut launch::KernelArgs<'_>,
    ) -> Result<(), DriverError> {
        self.stream.context().bind_to_thread()?;
        let mut params = args.params();
        let result = if self.programmatic_launch() {
            // SAFETY: an all-zero CUlaunchAttribute / CUlaunchConfig is valid plain data (no
            // attributes, null stream), filled in below.
            let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attribute.id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attribute.value.programmaticStreamSerializationAllowed = 1;
            let mut launch: sys::CUlaunchConfig = unsafe { std::mem::zeroed() };
            (launch.gridDimX, launch.gridDimY, launch.gridDimZ) = config.grid_dim;
            (launch.blockDimX, launch.blockDimY, launch.blockDimZ) = config.block_dim;
            launch.sharedMemBytes = config.shared_mem_bytes;
            launch.hStream = self.stream.cu_stream();
            launch.attrs = &mut attribute;
            launch.numAttrs = 1;
            // SAFETY: the handle is live, `params` points at the arguments (alive until this
            // returns; the caller vouches for their types), the config and its attribute are
            // live locals; `Pdl` is only on where the driver exports the symbol.
            unsafe {
                sys::cuLaunchKernelEx(
                    &launch,
                    kernel.function,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
            .result()
        } else {
            // SAFETY: as above; the call cudarc's `LaunchArgs::launch` makes.
            unsafe {
                cudarc::driver::result::launch_kernel(
                    kernel.function,
                    config.grid_dim,
                    config.block_dim,
                    config.shared_mem_bytes,
                    self.stream.cu_stream(),
                    &mut params,
                )
            }
        };
        // The buffers' read / write records come after the launch, as in cudarc's builder.
        args.guards.clear();
        result
    }
}

/// Times one op while it lives (device/op_timing.rs); inert without `NINFER_CUDA_OP_TIMING`.
pub(crate) struct OpTimer<'a> {
    backend: &'a CudaBackend,
    running: Option<(String, std::time::Instant)>,
    /// The op's name while a step graph records: its capture is checked when the op ends.
    watched: Option<String>,
}

impl CudaBackend {
    pub(crate) fn op_timer(&self, name: &str) -> OpTimer<'_> {
        self.op_timer_named(|| name.to_string())
    }

    /// As [`CudaBackend::op_timer`], the name built only when timing is on or a step graph
    /// records.
    pub(crate) fn op_timer_named(&self, name: impl FnOnce() -> String) -> OpTimer<'_> {
        let watching = self.capture_watch.recording();
        let (running, watched) = match (&self.op_timing, watching) {
            (None, false) => (None, None),
            (timing, _) => {
                let name = name();
                let running = timing.as_ref().map(|timing| (name.clone(), timing.begin()));
                (running, watching.then_some(name))
            }
        };
        OpTimer {
            backend: self,
            running,
            watched,
        }
    }

    /// As [`CudaBackend::op_timer`], one row apart from many (decode from prefill): `op (1 rows)`
    /// or `op (n rows)`.
    pub(crate) fn op_timer_by_rows(&self, op: &str, rows: usize) -> OpTimer<'_> {
        self.op_timer_named(|| format!("{op} ({} rows)", if rows == 1 { "1" } else { "n" }))
    }
}

impl Drop for OpTimer<'_> {
    fn drop(&mut self) {
        if let Some(op) = self.watched.take() {
            self.backend
                .capture_watch
                .check_after(&self.backend.stream, op);
        }
        if let (Some((name, start)), Some(timing)) =
            (self.running.take(), self.backend.op_timing.as_ref())
        {
            if timing.synchronise {
                let _ = self.backend.stream.synchronize();
            }
            timing.end(&name, start);
        }
    }
}

mod attention;
mod attention_batched;
mod attention_decode;
mod backend_ops;
mod bandwidth;
mod cache_copies;
mod capture_watch;
mod delta_rule;
mod driver;
mod elementwise;
mod expert_fills;
mod expert_slots;
mod experts;
mod graph_census;
mod host_kv;
mod host_kv_pool;
mod launch;
mod matmul;
mod norm;
mod op_timing;
mod options;
mod pending_routing;
mod pinned_staging;
mod qsa;
mod readback;
mod router;
mod sampling;
mod self_checks;
mod stage_crossing;
mod start_up;
mod step_graph;
mod tensor_pool;
mod vision;
mod vision_launches;
mod vision_weights;
mod worker_handoff;

pub use attention::AttentionPath;
pub use delta_rule::DeltaRuleKernel;
pub use expert_slots::CudaExpertSlots;
pub use experts::GroupedExpertKernels;
pub use launch::Pdl;
pub use options::{
    parse_memory_gib, parse_shared_memory_bytes, CudaOptions, KvDtype, CONSUMER_CARD_SHARED_MEMORY,
    MEMORY_CAP_ENV, SHARED_MEMORY_CAP_ENV,
};
pub use pending_routing::CudaPendingRouting;
pub use stage_crossing::PeerPath;
pub use start_up::DeviceInfo;
pub use step_graph::CudaStepGraph;
pub use vision::{CudaVisionOutput, CudaVisionTower};
pub use vision_launches::{vision_attention_width, VISION_ATTENTION_HEAD_WIDTHS};
pub use vision_weights::VisionPrecision;
pub use worker_handoff::CudaWorkerHandoff;
