//! [`CudaBackend`]: device start-up (driver, context, kernels) and every [`Backend`] op as a
//! kernel launch on one stream.
//!
//! Owns: device buffers (`CudaSlice<f32>`) behind the backend's tensor, weight and state types,
//! and the mapping of each op onto the kernels of `kernels/*.cu`.
//! Must not touch: model structure, routed experts, the artifact byte layout.
//!
//! Errors: every op returns its error as [`EngineError::Device`], naming the op and keeping the
//! [`CudaError`] (an out-of-memory says so, with the bytes asked for). A CUDA context that hit a
//! launch error is unusable anyway, so nothing tries to recover.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use ninfer_artifact::{Artifact, DType, ExpertBank};
use ninfer_cpu_experts::ExpertLayout;

use super::cublas::{Cublas, GemmOperands};
use super::kernels::{cached_cubin, KERNEL_SOURCES};
use super::loader;
use super::nvrtc::Nvrtc;
use super::CudaError;
use crate::backend::cpu::{rope_inverse_frequencies, route_top_k_host};
use crate::backend::{
    AttentionSpec, Backend, DeltaRuleForm, DeltaRuleSpec, NormStyle, Rotation, Routing, Segment,
};
use crate::error::EngineError;
use crate::weights::StoredWeight;

/// Threads per block of the element-wise kernels.
const BLOCK: u32 = 256;
/// `NORM_THREADS` in `kernels/norm.cu`.
const NORM_THREADS: u32 = 256;
/// `ROWS` in `kernels/matmul.cu`: rows one warp computes together.
const MATMUL_ROWS: u64 = 8;
/// Warps per block of the matmul kernel.
const MATMUL_WARPS: u32 = 8;
/// Warps per block of `kernels/attention.cu`.
const ATTENTION_WARPS: u32 = 4;
/// `32 * MAX_DIMS_PER_LANE` in `kernels/attention.cu`.
const ATTENTION_MAX_HEAD_DIM: usize = 256;
/// bf16 matmuls of at least this many rows go through cuBLAS (when it loaded and passed its
/// start-up check); fewer rows (decode) stay on the matmul kernel, which streams the weights
/// once for up to `MATMUL_ROWS` rows and keeps f32 activations.
const CUBLAS_MIN_ROWS: usize = 9;

/// The element type of the KV cache (`--kv-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// Half the memory; keys and values are rounded to bf16 (nearest even) when appended.
    Bf16,
    /// Exactly the values the projections produced (the CPU backend's cache).
    F32,
}

impl KvDtype {
    /// Bytes per cached element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::Bf16 => 2,
            KvDtype::F32 => 4,
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::Bf16 => "bf16",
            KvDtype::F32 => "f32",
        })
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "bf16" => Ok(KvDtype::Bf16),
            "f32" => Ok(KvDtype::F32),
            other => Err(format!("KV cache dtype `{other}`: expected bf16 or f32")),
        }
    }
}

/// How the backend computes where there is a choice. `Default`: bf16 KV cache, cuBLAS for bf16
/// prefill GEMMs when it loads. [`CudaOptions::exact`]: f32 KV cache and the matmul kernel only,
/// which computes what the CPU backend computes to f32 rounding, batch invariant (the tests of
/// issue 3's tolerances use it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    pub kv_dtype: KvDtype,
    /// Try cuBLAS at start-up (it is still only used if it loads and passes its check).
    pub cublas: bool,
    /// Run every attention through the reference kernel (one warp per row and head) instead of
    /// the split-K decode / tiled prefill kernels.
    pub reference_attention: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            kv_dtype: KvDtype::Bf16,
            cublas: true,
            reference_attention: false,
        }
    }
}

impl CudaOptions {
    /// f32 KV cache, no cuBLAS: the CPU backend's math, batch invariant.
    pub fn exact() -> Self {
        CudaOptions {
            kv_dtype: KvDtype::F32,
            cublas: false,
            // The flash kernels are batch invariant and agree with the CPU to f32 rounding.
            reference_attention: false,
        }
    }
}

/// What the backend found at start-up.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
    pub driver_library: String,
    pub nvrtc_version: (i32, i32),
    pub nvrtc_library: String,
    /// Kernel files read from the disk cache / compiled now.
    pub kernels_cached: usize,
    pub kernels_compiled: usize,
    /// The cuBLAS that loaded and passed the start-up check (path and version), or `None`: not
    /// found, failed the check, or off in the options (the matmul kernel does everything then).
    pub cublas_library: Option<String>,
    pub kv_dtype: KvDtype,
    /// The kernel multi-token delta-rule segments run: `"chunked"` (it passed its start-up check
    /// against the recurrent kernel) or `"recurrent"` (every form; the check failed or the
    /// GPU's shared memory is too small, with a warning logged).
    pub delta_rule_path: &'static str,
    /// Dynamic shared memory a block may use (opt-in maximum), bytes.
    pub shared_memory_per_block: usize,
    /// The attention kernels in use: `flash` (split-K decode, tiled prefill) once they passed
    /// their start-up check against the reference, else `reference`.
    pub attention_path: AttentionPath,
}

/// The CUDA backend on one GPU. Every op is queued on one stream; `download` and the routing
/// read-back synchronise.
pub struct CudaBackend {
    // Kept so the context outlives every buffer and module made from it.
    _context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<&'static str, CudaFunction>,
    info: DeviceInfo,
    /// cuBLAS for bf16 prefill GEMMs, only once it passed the start-up check.
    cublas: Option<Cublas>,
    options: CudaOptions,
    /// `NINFER_CUDA_OP_TIMING`: per-op timing for profiling (device/op_timing.rs).
    op_timing: Option<op_timing::OpTiming>,
    /// Page-locked buffer the read-backs go through (device/readback.rs).
    staging: readback::StagingSlot,
    /// Page-locked buffers of the routings started and not finished (device/pending_routing.rs).
    routing_staging: pending_routing::RoutingStagingPool,
    /// Buffers of dead op outputs, reused by the next op of the same length.
    tensor_pool: Arc<tensor_pool::TensorPool>,
    /// Rope's device tables: inverse frequencies per (rotary dim, θ), the last positions.
    rope_tables: Mutex<RopeTables>,
    /// `--host-kv-mib`: the page-locked KV pool and placement counters (device/host_kv.rs).
    host_kv: host_kv::HostKvSlot,
}

#[derive(Default)]
struct RopeTables {
    inverse: HashMap<(usize, u64), CudaSlice<f32>>,
    positions: Option<(Vec<u32>, CudaSlice<u32>)>,
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

enum WeightData {
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
    pub len: usize,
    pub dtype: KvDtype,
    /// Dropped by hand: host-pool buffers must never reach `cuMemFree` (device/host_kv.rs).
    keys: ManuallyDrop<KvBuffer>,
    values: ManuallyDrop<KvBuffer>,
    /// GPU memory or the host KV pool (device/host_kv.rs).
    placement: host_kv::KvPlacementToken,
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

fn driver_error(what: impl Into<String>) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    let what = what.into();
    move |error| CudaError::Driver {
        what,
        message: describe(&error),
    }
}

/// `CUDA_ERROR_OUT_OF_MEMORY (out of memory)`: cudarc's `Display` needs its `std` feature.
fn describe(error: &cudarc::driver::DriverError) -> String {
    let name = error
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", error.0));
    match error.error_string() {
        Ok(text) => format!("{name} ({})", text.to_string_lossy()),
        Err(_) => name,
    }
}

/// What the RMSNorm kernels take for `x` normed in groups of `weight`'s length: the group
/// count (as a count and as the kernel's `long long`), the group length, and the offset
/// `style` adds to the weight.
fn norm_groups(
    x: &CudaTensor,
    weight: &CudaWeight,
    style: NormStyle,
    op: &str,
) -> Result<(usize, i64, i32, f32), CudaError> {
    let group = weight.rows * weight.cols;
    if group == 0 || (x.rows * x.cols) % group != 0 {
        return Err(CudaError::Invalid {
            problem: format!("{op}: weight of {group} over rows of {}", x.cols),
        });
    }
    let groups = x.rows * x.cols / group;
    let offset = match style {
        NormStyle::Plain => 0.0,
        NormStyle::ZeroCentred => 1.0,
    };
    Ok((groups, groups as i64, int(group, "group")?, offset))
}

/// Kernel arguments are C `int`: refuse sizes that do not fit rather than wrap.
fn int(value: usize, what: &str) -> Result<i32, CudaError> {
    i32::try_from(value).map_err(|_| CudaError::Invalid {
        problem: format!("{what} = {value} does not fit a 32-bit kernel argument"),
    })
}

/// One thread per element, grid-stride beyond 2^16 blocks.
fn elementwise(count: usize) -> LaunchConfig {
    let blocks = count.div_ceil(BLOCK as usize).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Runs `f`, turning a panic inside cudarc (it panics when its own loader misses a library or a
/// symbol) into a typed error.
fn no_panic<T>(what: &str, f: impl FnOnce() -> T + std::panic::UnwindSafe) -> Result<T, CudaError> {
    std::panic::catch_unwind(f).map_err(|payload| {
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panicked".into());
        CudaError::Driver {
            what: what.to_string(),
            message,
        }
    })
}

/// Queues one kernel launch. Arguments are references to locals (cudarc keeps pointers to
/// them until the launch call returns).
macro_rules! launch {
    ($backend:expr, $kernel:literal, $config:expr; $($arg:expr),* $(,)?) => {{
        let function = $backend.function($kernel)?;
        let mut builder = $backend.stream.launch_builder(function);
        $( builder.arg($arg); )*
        // SAFETY: the argument list matches the kernel's C signature in kernels/*.cu (types and
        // order; the op tests exercise every launch), and the caller sized every buffer for the
        // launch's index range.
        unsafe { builder.launch($config) }
            .map(|_| ())
            .map_err(driver_error(concat!("launching `", $kernel, "`")))
    }};
}

/// Stream-ordered allocations come from the device's default memory pool, whose release
/// threshold is 0: every synchronisation (two per MoE layer at decode) hands the freed memory
/// back to the driver and the next allocation maps it again. Keeping it makes an op's output
/// allocation a pool lookup. Failure only costs speed, so it is logged, not raised.
fn keep_freed_device_memory(context: &CudaContext) {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the context (and so the driver) is live; valid out pointer.
    let status = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, context.cu_device()) };
    if status != sys::CUresult::CUDA_SUCCESS {
        tracing::debug!("no default memory pool ({status:?}); allocations stay synchronous");
        return;
    }
    let mut threshold = u64::MAX;
    // SAFETY: `pool` came from the driver; the attribute takes a pointer to a cuuint64_t.
    let status = unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    };
    if status != sys::CUresult::CUDA_SUCCESS {
        tracing::warn!("could not keep freed GPU memory in the pool ({status:?})");
    }
}

static SHARED: OnceLock<Result<Arc<CudaBackend>, CudaError>> = OnceLock::new();
static SHARED_EXACT: OnceLock<Result<Arc<CudaBackend>, CudaError>> = OnceLock::new();

impl CudaBackend {
    /// Opens GPU `ordinal` with the default [`CudaOptions`] (bf16 KV cache, cuBLAS if present).
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        Self::with_options(ordinal, CudaOptions::default())
    }

    /// Opens GPU `ordinal`: finds the driver and NVRTC, creates a context, and loads every kernel
    /// (from the disk cache or compiled now for this GPU's architecture); with `options.cublas`,
    /// loads cuBLAS and keeps it only if it passes a check against the matmul kernel.
    pub fn with_options(ordinal: usize, options: CudaOptions) -> Result<Self, CudaError> {
        let driver = loader::open(&loader::DRIVER)?;
        let context =
            no_panic("binding the CUDA driver", || CudaContext::new(ordinal))?.map_err(|e| {
                CudaError::NoDevice {
                    problem: format!(
                        "the driver ({}) is present but opening GPU {ordinal} failed: {}",
                        driver.opened_as,
                        describe(&e)
                    ),
                }
            })?;
        // One stream does all the work, so cudarc's per-buffer events (two created per
        // allocation, waited on and destroyed at every free) only cost driver calls.
        // SAFETY: nothing in this backend creates a second stream (the stream order is the
        // only synchronisation the buffers need).
        unsafe { context.disable_event_tracking() };
        keep_freed_device_memory(&context);
        let name = context.name().unwrap_or_else(|_| "unknown GPU".into());
        let (major, minor) = context
            .compute_capability()
            .map_err(driver_error("reading the compute capability"))?;
        if major < 8 {
            return Err(CudaError::Unsupported {
                problem: format!(
                    "{name} is sm_{major}{minor}; the kernels need sm_80 (Ampere) or newer"
                ),
            });
        }
        let mut driver_version = 0;
        // SAFETY: the driver library is loaded (the context exists); valid out pointer.
        let status = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) };
        if status != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(CudaError::Driver {
                what: "cuDriverGetVersion".into(),
                message: format!("{status:?}"),
            });
        }
        let nvrtc = Nvrtc::load()?;
        let arch = (major * 10 + minor) as u32;
        let mut functions = HashMap::new();
        let (mut cached, mut compiled) = (0, 0);
        for kernel in KERNEL_SOURCES {
            let (path, hit) = cached_cubin(&nvrtc, kernel, arch, driver_version)?;
            let module = match load_module(&context, &path) {
                Ok(module) => module,
                Err(error) if hit => {
                    // A stale or torn cache entry: drop it and compile afresh once.
                    tracing::warn!(file = %path.display(), "cached kernel did not load ({error}); recompiling");
                    let _ = std::fs::remove_file(&path);
                    let (path, _) = cached_cubin(&nvrtc, kernel, arch, driver_version)?;
                    load_module(&context, &path)?
                }
                Err(error) => return Err(error),
            };
            if hit {
                cached += 1;
            } else {
                compiled += 1;
            }
            for &function in kernel.functions {
                let loaded = module
                    .load_function(function)
                    .map_err(driver_error(format!("loading kernel `{function}`")))?;
                functions.insert(function, loaded);
            }
        }
        let info = DeviceInfo {
            ordinal,
            name,
            compute_capability: (major, minor),
            driver_version,
            driver_library: driver.opened_as.clone(),
            nvrtc_version: nvrtc.version(),
            nvrtc_library: nvrtc.location().to_string(),
            kernels_cached: cached,
            kernels_compiled: compiled,
            cublas_library: None,
            kv_dtype: options.kv_dtype,
            delta_rule_path: delta_rule::PATH_RECURRENT,
            shared_memory_per_block: 0,
            attention_path: AttentionPath::Reference,
        };
        let mut backend = CudaBackend {
            stream: context.default_stream(),
            _context: context,
            functions,
            info,
            cublas: None,
            options,
            op_timing: None,
            staging: Default::default(),
            routing_staging: Default::default(),
            tensor_pool: Default::default(),
            rope_tables: Default::default(),
            host_kv: Default::default(),
        };
        // NINFER_CUDA_REFERENCE_KERNELS=1: the reference kernels only (no cuBLAS, no chunked
        // delta rule, no flash attention, no self-checks) — the way out on a GPU where one of
        // the newer kernels faults in its self-check and takes the context down with it.
        let reference_only = std::env::var("NINFER_CUDA_REFERENCE_KERNELS").is_ok_and(|v| v == "1");
        if reference_only {
            tracing::warn!("NINFER_CUDA_REFERENCE_KERNELS=1: reference kernels only");
        } else {
            if options.cublas {
                backend.cublas = backend.start_cublas();
                backend.info.cublas_library = backend.cublas.as_ref().map(Cublas::describe);
            }
            backend.start_chunked_delta_rule();
            backend.info.attention_path = backend.start_attention();
        }
        // A self-check kernel that faulted leaves the context unusable (sticky error): say so
        // here, naming the switch, rather than at the first op.
        backend.stream.synchronize().map_err(|error| CudaError::NoDevice {
            problem: format!(
                "the GPU context failed during the kernels' start-up self-checks ({}); set NINFER_CUDA_REFERENCE_KERNELS=1 to run the reference kernels only",
                describe(&error)
            ),
        })?;
        backend.op_timing = op_timing::OpTiming::from_env();
        tracing::info!(info = ?backend.info, "CUDA backend ready");
        Ok(backend)
    }

    /// cuBLAS if it loads and computes what the matmul kernel computes (to bf16 rounding of the
    /// activations) on two test shapes; otherwise `None`, with the reason logged: the kernel
    /// then does every matmul for the life of the process.
    fn start_cublas(&self) -> Option<Cublas> {
        let cublas = match Cublas::load(&self.stream) {
            Ok(cublas) => cublas,
            Err(error @ CudaError::LibraryNotFound { .. }) => {
                tracing::info!("cuBLAS not found, the matmul kernel does every GEMM: {error}");
                return None;
            }
            Err(error) => {
                tracing::warn!("cuBLAS unusable, the matmul kernel does every GEMM: {error}");
                return None;
            }
        };
        match self.check_cublas(&cublas) {
            Ok(worst) => {
                tracing::info!(
                    cublas = %cublas.describe(),
                    "cuBLAS passed its start-up check (max |Δ| / scale {worst:.1e} vs the kernel); bf16 GEMMs of {CUBLAS_MIN_ROWS}+ rows use it"
                );
                Some(cublas)
            }
            Err(error) => {
                tracing::warn!(
                    cublas = %cublas.describe(),
                    "cuBLAS failed its start-up check, the matmul kernel does every GEMM: {error}"
                );
                // A failed check may have left an error on the stream: drain it.
                let _ = self.stream.synchronize();
                None
            }
        }
    }

    /// Odd (37×300 · 300×129: no tensor-core alignment) and aligned (64×256 · 256×160) bf16
    /// GEMMs through cuBLAS and through the kernel; the largest difference relative to the
    /// largest result must stay under 1e-2 (the activations' bf16 rounding gives ~1e-3).
    fn check_cublas(&self, cublas: &Cublas) -> Result<f32, CudaError> {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            // xorshift64*: deterministic values in [-1, 1).
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let bits = state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
            bits as f32 / (1u64 << 23) as f32 - 1.0
        };
        let mut worst = 0.0f32;
        for (n, k, m) in [(37usize, 300usize, 129usize), (64, 256, 160)] {
            let x: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let w: Vec<u16> = (0..m * k)
                .map(|_| half::bf16::from_f32(next()).to_bits())
                .collect();
            let tensor = CudaTensor::unpooled(n, k, self.upload_f32(&x)?);
            let w_data = self
                .stream
                .memcpy_stod(&w)
                .map_err(driver_error("copying the cuBLAS check's weight"))?;
            let got = self.matmul_cublas(cublas, &tensor, &w_data, m)?;
            let weight = CudaWeight {
                rows: m,
                cols: k,
                data: WeightData::Bf16(w_data),
            };
            let expected = self.matmul_kernel(&tensor, &weight)?;
            let read = |t: &CudaTensor| {
                self.stream
                    .memcpy_dtov(&*t.data)
                    .map_err(driver_error("reading the cuBLAS check back"))
            };
            let (expected, got) = (read(&expected)?, read(&got)?);
            let scale = expected.iter().fold(1.0f32, |a, v| a.max(v.abs()));
            let difference = expected
                .iter()
                .zip(&got)
                .take(n * m)
                .map(|(a, b)| (a - b).abs())
                .fold(
                    0.0f32,
                    |a, d| if d.is_nan() { f32::INFINITY } else { a.max(d) },
                )
                / scale;
            if difference.is_nan() || difference > 1e-2 {
                return Err(CudaError::Invalid {
                    problem: format!(
                        "{n}×{k} · ({m}×{k})ᵀ differs from the kernel by {difference:.2e} of the largest value (allowed 1e-2)"
                    ),
                });
            }
            worst = worst.max(difference);
        }
        Ok(worst)
    }

    /// One backend on GPU 0 for the whole process, default options (tests share it: a context
    /// per test would cost seconds each). The error, if any, is the one every caller sees.
    pub fn shared() -> Result<Arc<CudaBackend>, CudaError> {
        SHARED
            .get_or_init(|| CudaBackend::new(0).map(Arc::new))
            .clone()
    }

    /// Like [`CudaBackend::shared`] with [`CudaOptions::exact`]: for the tests that hold the GPU
    /// to the CPU backend's f32 results and to batch invariance.
    pub fn shared_exact() -> Result<Arc<CudaBackend>, CudaError> {
        SHARED_EXACT
            .get_or_init(|| CudaBackend::with_options(0, CudaOptions::exact()).map(Arc::new))
            .clone()
    }

    /// The options this backend was opened with.
    pub fn options(&self) -> CudaOptions {
        self.options
    }

    /// Whether a bf16 matmul of `rows` rows goes through cuBLAS (tests print it).
    pub fn uses_cublas_for(&self, rows: usize) -> bool {
        self.cublas.is_some() && rows >= CUBLAS_MIN_ROWS
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

    fn function(&self, name: &str) -> Result<&CudaFunction, CudaError> {
        self.functions.get(name).ok_or_else(|| CudaError::Invalid {
            problem: format!("kernel `{name}` is not loaded"),
        })
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

    /// A `[rows, cols]` output with unspecified contents, for ops whose kernels write every
    /// element: a recycled buffer (no driver call at all) or a new allocation.
    fn output_uninit(&self, rows: usize, cols: usize) -> Result<CudaTensor, CudaError> {
        // Zero-length device allocations are an error in CUDA: keep one element.
        let len = (rows * cols).max(1);
        let data = match self.tensor_pool.take(len) {
            Some(data) => data,
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
            pool: Some(Arc::clone(&self.tensor_pool)),
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

    /// An empty K/V cache in the backend's [`KvDtype`]: in GPU memory, or in the host KV pool
    /// once the device share is used up (device/host_kv.rs).
    fn allocate_kv_cache(
        &self,
        max_tokens: usize,
        kv_width: usize,
    ) -> Result<CudaKvCache, CudaError> {
        let placement = match self.place_kv_cache(max_tokens, kv_width)? {
            host_kv::KvPlace::Host(cache) => return Ok(cache),
            host_kv::KvPlace::Device(placement) => placement,
        };
        let dtype = self.options.kv_dtype;
        let count = max_tokens * kv_width;
        let allocate = || -> Result<KvBuffer, CudaError> {
            Ok(match dtype {
                KvDtype::F32 => KvBuffer::F32(self.alloc(count)?),
                // Zero-length device allocations are an error in CUDA: keep one element.
                KvDtype::Bf16 => {
                    KvBuffer::Bf16(self.stream.alloc_zeros::<u16>(count.max(1)).map_err(
                        driver_error(format!(
                            "allocating {count} bf16 KV values ({} bytes)",
                            count * 2
                        )),
                    )?)
                }
            })
        };
        Ok(CudaKvCache {
            max_tokens,
            kv_width,
            len: 0,
            dtype,
            keys: ManuallyDrop::new(allocate()?),
            values: ManuallyDrop::new(allocate()?),
            placement,
        })
    }

    /// Every value of `tensor`, through the page-locked staging buffer.
    fn download_values(&self, tensor: &CudaTensor) -> Result<Vec<f32>, CudaError> {
        let len = tensor.rows * tensor.cols;
        if len == 0 {
            return Ok(Vec::new());
        }
        let data = &*tensor.data;
        // Big read-backs (a prefill's logits) go straight to pageable memory rather than grow
        // the page-locked buffer for good.
        if len * 4 > readback::STAGING_MAX_BYTES {
            let mut values = self
                .stream
                .memcpy_dtov(data)
                .map_err(driver_error("copying to the host"))?;
            values.truncate(len);
            return Ok(values);
        }
        match self
            .read_back_together(&[readback::ReadBack::F32(data, len)])?
            .pop()
        {
            Some(readback::HostValues::F32(values)) => Ok(values),
            _ => Err(CudaError::Invalid {
                problem: "a read-back came back in the wrong shape".into(),
            }),
        }
    }

    /// Loads a weight; `keep_bf16` keeps a bf16 tensor's bits as they are (matrices), else
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

    fn launch_gather_rows(&self, x: &CudaTensor, rows: &[usize]) -> Result<CudaTensor, CudaError> {
        let input = &*x.data;
        if let Some(&bad) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(CudaError::Invalid {
                problem: format!("gather_rows: row {bad} of a {}-row tensor", x.rows),
            });
        }
        let indices: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let indices = self.upload_u32(&indices)?;
        // `gather_rows` writes every element.
        let mut out = self.output_uninit(rows.len(), x.cols)?;
        let total = rows.len() * x.cols;
        if total > 0 {
            let (count, cols) = (int(rows.len(), "rows")?, int(x.cols, "cols")?);
            let output = &mut *out.data;
            launch!(self, "gather_rows", elementwise(total); input, &indices, output, &count, &cols)?;
        }
        Ok(out)
    }

    fn launch_columns(&self, x: &CudaTensor, range: Range<usize>) -> Result<CudaTensor, CudaError> {
        if range.end > x.cols {
            return Err(CudaError::Invalid {
                problem: format!("columns {range:?} of a {}-column tensor", x.cols),
            });
        }
        let width = range.len();
        let rows = int(x.rows, "rows")?;
        let (cols, start, width_arg) = (x.cols as i32, range.start as i32, width as i32);
        self.unary(x, width, |input, output| {
            launch!(self, "columns", elementwise(x.rows * width);
                input, output, &rows, &cols, &start, &width_arg)
        })
    }

    fn launch_silu_mul_halves(&self, gate_up: &CudaTensor) -> Result<CudaTensor, CudaError> {
        let half = gate_up.cols / 2;
        let rows = int(gate_up.rows, "rows")?;
        let half_arg = half as i32;
        self.unary(gate_up, half, |input, output| {
            launch!(self, "silu_mul_halves", elementwise(gate_up.rows * half);
                input, output, &rows, &half_arg)
        })
    }

    fn launch_split_interleaved(
        &self,
        x: &CudaTensor,
        groups: usize,
        first: usize,
        second: usize,
    ) -> Result<(CudaTensor, CudaTensor), CudaError> {
        let input = &*x.data;
        if groups * (first + second) != x.cols {
            return Err(CudaError::Invalid {
                problem: format!(
                    "split_interleaved: {groups}×({first}+{second}) columns of a {}-column tensor",
                    x.cols
                ),
            });
        }
        // `split_interleaved` writes every element of both.
        let mut a = self.output_uninit(x.rows, groups * first)?;
        let mut b = self.output_uninit(x.rows, groups * second)?;
        let total = x.rows * x.cols;
        if total > 0 {
            let rows = int(x.rows, "rows")?;
            let (groups, first, second) = (
                int(groups, "groups")?,
                int(first, "first")?,
                int(second, "second")?,
            );
            let (out_a, out_b) = (&mut *a.data, &mut *b.data);
            launch!(self, "split_interleaved", elementwise(total);
                input, out_a, out_b, &rows, &groups, &first, &second)?;
        }
        Ok((a, b))
    }

    fn launch_embed(&self, table: &CudaWeight, ids: &[u32]) -> Result<CudaTensor, CudaError> {
        let indices = self.upload_u32(ids)?;
        // `embed` writes every element (zero for an id outside the table).
        let mut out = self.output_uninit(ids.len(), table.cols)?;
        let total = ids.len() * table.cols;
        if total > 0 {
            let (rows, cols, vocab) = (
                int(ids.len(), "tokens")?,
                int(table.cols, "hidden")?,
                int(table.rows, "vocab")?,
            );
            let output = &mut *out.data;
            match &table.data {
                WeightData::F32(data) => launch!(self, "embed", elementwise(total);
                    data, &indices, output, &rows, &cols, &vocab)?,
                WeightData::Bf16(data) => launch!(self, "embed_bf16", elementwise(total);
                    data, &indices, output, &rows, &cols, &vocab)?,
            }
        }
        Ok(out)
    }

    fn launch_matmul(&self, x: &CudaTensor, weight: &CudaWeight) -> Result<CudaTensor, CudaError> {
        // Prefill-sized bf16 GEMMs on tensor cores; a cuBLAS error here is the op's error (the
        // sticky one): the start-up check already proved the path, so a failure now means the
        // GPU or the context is in trouble, not that cuBLAS is unsuitable.
        if let (Some(cublas), WeightData::Bf16(data)) = (&self.cublas, &weight.data) {
            if x.rows >= CUBLAS_MIN_ROWS && x.cols == weight.cols && weight.rows > 0 && x.cols > 0 {
                return self.matmul_cublas(cublas, x, data, weight.rows);
            }
        }
        self.matmul_kernel(x, weight)
    }

    /// `x · wᵀ` through cuBLAS on tensor cores: `x` split into two bf16 terms `hi + lo`
    /// (`f32_to_bf16_split` in kernels/matmul.cu) and multiplied twice, the second GEMM adding
    /// into the first, so the activations keep ~16 mantissa bits (one bf16 term alone moved
    /// the tiny models' logits by up to 0.9); f32 accumulation and result.
    fn matmul_cublas(
        &self,
        cublas: &Cublas,
        x: &CudaTensor,
        w: &CudaSlice<u16>,
        out_features: usize,
    ) -> Result<CudaTensor, CudaError> {
        let input = &*x.data;
        let count = x.rows * x.cols;
        let mut x_hi = self
            .stream
            .alloc_zeros::<u16>(count.max(1))
            .map_err(driver_error(format!("allocating {count} bf16 activations")))?;
        let mut x_lo = self
            .stream
            .alloc_zeros::<u16>(count.max(1))
            .map_err(driver_error(format!("allocating {count} bf16 activations")))?;
        let count_arg = count as i64;
        launch!(self, "f32_to_bf16_split", elementwise(count);
            input, &mut x_hi, &mut x_lo, &count_arg)?;
        // The first GEMM overwrites every element (beta 0), the second adds to it.
        let mut out = self.output_uninit(x.rows, out_features)?;
        for (part, accumulate) in [(&x_hi, false), (&x_lo, true)] {
            cublas.linear_into(
                GemmOperands::Bf16 { x: part, w },
                &mut out.data,
                x.rows,
                x.cols,
                out_features,
                accumulate,
            )?;
        }
        Ok(out)
    }

    /// `x · wᵀ` with the matmul kernel (every dtype, every row count).
    fn matmul_kernel(&self, x: &CudaTensor, weight: &CudaWeight) -> Result<CudaTensor, CudaError> {
        let input = &*x.data;
        // Same contract as the CPU backend: an inconsistent call leaves zeros (shapes are
        // validated at model load).
        if x.cols != weight.cols || x.rows == 0 || weight.rows == 0 {
            return self.output(x.rows, weight.rows);
        }
        // One warp per (output, row group) writes each element.
        let mut out = self.output_uninit(x.rows, weight.rows)?;
        let (n, k, m) = (
            int(x.rows, "rows")?,
            int(x.cols, "in")?,
            int(weight.rows, "out")?,
        );
        // One warp per (output feature, group of MATMUL_ROWS rows); see kernels/matmul.cu.
        let tasks = (weight.rows as u64) * (x.rows as u64).div_ceil(MATMUL_ROWS);
        let blocks = u32::try_from(tasks.div_ceil(u64::from(MATMUL_WARPS))).map_err(|_| {
            CudaError::Invalid {
                problem: format!(
                    "matmul of {}×{} by {}×{} is too large",
                    x.rows, x.cols, weight.rows, weight.cols
                ),
            }
        })?;
        let config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (32 * MATMUL_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        let output = &mut *out.data;
        match &weight.data {
            WeightData::F32(data) => {
                launch!(self, "matmul", config; input, data, output, &n, &k, &m)?
            }
            WeightData::Bf16(data) => {
                launch!(self, "matmul_bf16", config; input, data, output, &n, &k, &m)?
            }
        }
        Ok(out)
    }

    /// Three bf16 projections of `x` in one `matmul3_bf16` launch, where the matmul kernel
    /// (not cuBLAS) would compute each and their shapes agree; `None` where they are not.
    fn launch_matmul3(
        &self,
        x: &CudaTensor,
        weights: [&CudaWeight; 3],
    ) -> Result<Option<[CudaTensor; 3]>, CudaError> {
        let [WeightData::Bf16(w0), WeightData::Bf16(w1), WeightData::Bf16(w2)] =
            weights.map(|weight| &weight.data)
        else {
            return Ok(None);
        };
        if x.rows == 0
            || self.uses_cublas_for(x.rows)
            || weights
                .iter()
                .any(|weight| weight.cols != x.cols || weight.rows == 0)
        {
            return Ok(None);
        }
        let input = &*x.data;
        // One warp per (output feature of any of the three, row group) writes each element.
        let mut outputs = [
            self.output_uninit(x.rows, weights[0].rows)?,
            self.output_uninit(x.rows, weights[1].rows)?,
            self.output_uninit(x.rows, weights[2].rows)?,
        ];
        let features: usize = weights.iter().map(|weight| weight.rows).sum();
        let (n, k, m0, m1, m2) = (
            int(x.rows, "rows")?,
            int(x.cols, "in")?,
            int(weights[0].rows, "out")?,
            int(weights[1].rows, "out")?,
            int(weights[2].rows, "out")?,
        );
        int(features, "outputs of three projections")?;
        let tasks = (features as u64) * (x.rows as u64).div_ceil(MATMUL_ROWS);
        let blocks = u32::try_from(tasks.div_ceil(u64::from(MATMUL_WARPS))).map_err(|_| {
            CudaError::Invalid {
                problem: format!("three projections of {}×{} are too large", x.rows, x.cols),
            }
        })?;
        let config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (32 * MATMUL_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        {
            let [out0, out1, out2] = &mut outputs;
            let (o0, o1, o2) = (&mut *out0.data, &mut *out1.data, &mut *out2.data);
            launch!(self, "matmul3_bf16", config;
                input, w0, w1, w2, o0, o1, o2, &n, &k, &m0, &m1, &m2)?;
        }
        Ok(Some(outputs))
    }

    fn norm_config(groups: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (groups.clamp(1, 1 << 20) as u32, 1, 1),
            block_dim: (NORM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn launch_rms_norm(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
        style: NormStyle,
    ) -> Result<CudaTensor, CudaError> {
        let (groups, groups_arg, group_arg, offset) = norm_groups(x, weight, style, "rms_norm")?;
        self.unary(x, x.cols, |input, output| {
            launch!(self, "rms_norm", Self::norm_config(groups);
                input, weight.f32()?, output, &groups_arg, &group_arg, &eps, &offset)
        })
    }

    fn launch_add_rms_norm(
        &self,
        x: &mut CudaTensor,
        delta: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
        style: NormStyle,
    ) -> Result<CudaTensor, CudaError> {
        Self::check_same_shape(x, delta, "add_rms_norm")?;
        let (groups, groups_arg, group_arg, offset) =
            norm_groups(x, weight, style, "add_rms_norm")?;
        let other = &*delta.data;
        // Every group's every element is written.
        let mut out = self.output_uninit(x.rows, x.cols)?;
        if groups > 0 {
            let residual = &mut *x.data;
            launch!(self, "add_rms_norm", Self::norm_config(groups);
                residual, other, weight.f32()?, &mut *out.data, &groups_arg,
                &group_arg, &eps, &offset)?;
        }
        Ok(out)
    }

    fn launch_gated_rms_norm(
        &self,
        x: &CudaTensor,
        gate: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
    ) -> Result<CudaTensor, CudaError> {
        let gate_data = &*gate.data;
        let group = weight.rows * weight.cols;
        if group == 0
            || (x.rows * x.cols) % group != 0
            || (gate.rows, gate.cols) != (x.rows, x.cols)
        {
            return Err(CudaError::Invalid {
                problem: format!("gated_rms_norm: weight of {group} over rows of {}", x.cols),
            });
        }
        let groups = x.rows * x.cols / group;
        let (groups_arg, group_arg) = (groups as i64, int(group, "group")?);
        self.unary(x, x.cols, |input, output| {
            launch!(self, "gated_rms_norm", Self::norm_config(groups);
                input, gate_data, weight.f32()?, output, &groups_arg, &group_arg, &eps)
        })
    }

    fn launch_rope(
        &self,
        x: &mut CudaTensor,
        positions: &[usize],
        head_dim: usize,
        rotary_dim: usize,
        theta: f64,
    ) -> Result<(), CudaError> {
        let half = rotary_dim / 2;
        let rows = positions.len().min(x.rows);
        if half == 0 || rows == 0 || head_dim == 0 {
            return Ok(());
        }
        if rotary_dim > head_dim || x.cols % head_dim != 0 {
            return Err(CudaError::Invalid {
                problem: format!(
                    "rope: rotary_dim {rotary_dim}, head_dim {head_dim}, {} columns",
                    x.cols
                ),
            });
        }
        let total = rows * (x.cols / head_dim) * half;
        let (rows_arg, cols, head_dim, half) = (
            int(rows, "rows")?,
            int(x.cols, "cols")?,
            int(head_dim, "head_dim")?,
            int(half, "rotary half")?,
        );
        let data = &mut *x.data;
        self.with_rope_tables(
            &positions[..rows],
            rotary_dim,
            theta,
            |positions, inverse| {
                launch!(self, "rope", elementwise(total);
                data, positions, inverse, &rows_arg, &cols, &head_dim, &half)
            },
        )
    }

    /// Runs `launch` with the device tables of a rotation: `positions` as u32 (uploaded when
    /// they differ from the last ones: every attention layer of a forward rotates q and k at
    /// the same positions) and the inverse frequencies of `(rotary_dim, theta)` (uploaded once).
    fn with_rope_tables<T>(
        &self,
        positions: &[usize],
        rotary_dim: usize,
        theta: f64,
        launch: impl FnOnce(&CudaSlice<u32>, &CudaSlice<f32>) -> Result<T, CudaError>,
    ) -> Result<T, CudaError> {
        let positions: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let mut tables = self.rope_tables.lock().map_err(|_| CudaError::Invalid {
            problem: "the rope cache's lock is poisoned".into(),
        })?;
        let key = (rotary_dim, theta.to_bits());
        if let std::collections::hash_map::Entry::Vacant(entry) = tables.inverse.entry(key) {
            entry.insert(self.upload_f32(&rope_inverse_frequencies(rotary_dim, theta))?);
        }
        if tables
            .positions
            .as_ref()
            .is_none_or(|(held, _)| *held != positions)
        {
            let uploaded = self.upload_u32(&positions)?;
            tables.positions = Some((positions, uploaded));
        }
        let (Some(inverse), Some((_, positions))) =
            (tables.inverse.get(&key), tables.positions.as_ref())
        else {
            return Err(CudaError::Invalid {
                problem: "rope tables missing after upload".into(),
            });
        };
        launch(positions, inverse)
    }

    /// `rms_norm` per head then `rope`, in one launch where the norm's groups are the heads
    /// and every row has a position; otherwise the two ops.
    fn launch_rms_norm_rope(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
        style: NormStyle,
        rotation: &Rotation<'_>,
    ) -> Result<CudaTensor, CudaError> {
        let group = weight.rows * weight.cols;
        let half = rotation.rotary_dim / 2;
        if group == 0
            || group != rotation.head_dim
            || x.cols % group != 0
            || x.rows == 0
            || half == 0
            || rotation.rotary_dim > rotation.head_dim
            || rotation.positions.len() < x.rows
        {
            let mut out = self.launch_rms_norm(x, weight, eps, style)?;
            self.launch_rope(
                &mut out,
                rotation.positions,
                rotation.head_dim,
                rotation.rotary_dim,
                rotation.theta,
            )?;
            return Ok(out);
        }
        let (groups, groups_arg, group_arg, offset) =
            norm_groups(x, weight, style, "rms_norm_rope")?;
        let (heads, half) = (int(x.cols / group, "heads")?, int(half, "rotary half")?);
        self.with_rope_tables(
            &rotation.positions[..x.rows],
            rotation.rotary_dim,
            rotation.theta,
            |positions, inverse| {
                self.unary(x, x.cols, |input, output| {
                    launch!(self, "rms_norm_rope", Self::norm_config(groups);
                        input, weight.f32()?, output, &groups_arg, &group_arg, &eps, &offset,
                        positions, inverse, &heads, &half)
                })
            },
        )
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

    fn launch_add_assign(&self, a: &mut CudaTensor, b: &CudaTensor) -> Result<(), CudaError> {
        Self::check_same_shape(a, b, "add_assign")?;
        let other = &*b.data;
        let total = a.rows * a.cols;
        let n = total as i64;
        let data = &mut *a.data;
        if total > 0 {
            launch!(self, "add_assign", elementwise(total); data, other, &n)?;
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

    fn launch_add_sigmoid_scaled_rows(
        &self,
        a: &mut CudaTensor,
        b: &CudaTensor,
        gate: &CudaTensor,
    ) -> Result<(), CudaError> {
        Self::check_same_shape(a, b, "add_sigmoid_scaled_rows")?;
        if gate.rows != a.rows || gate.cols == 0 {
            return Err(CudaError::Invalid {
                problem: format!(
                    "add_sigmoid_scaled_rows: gate {}×{} for {} rows",
                    gate.rows, gate.cols, a.rows
                ),
            });
        }
        let (other, gate_data) = (&*b.data, &*gate.data);
        let total = a.rows * a.cols;
        let (rows, cols, gate_cols) = (
            int(a.rows, "rows")?,
            int(a.cols, "cols")?,
            int(gate.cols, "gate cols")?,
        );
        let data = &mut *a.data;
        if total > 0 {
            launch!(self, "add_sigmoid_scaled_rows", elementwise(total);
                data, other, gate_data, &rows, &cols, &gate_cols)?;
        }
        Ok(())
    }

    fn launch_causal_conv1d_silu(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        segments: &mut [Segment<'_, CudaConvState>],
    ) -> Result<CudaTensor, CudaError> {
        let input = &*x.data;
        let mut out = self.output(x.rows, x.cols)?;
        for segment in segments.iter_mut() {
            let state = &mut *segment.state;
            if state.channels != x.cols || weight.rows != x.cols || weight.cols != state.kernel {
                return Err(CudaError::Invalid {
                    problem: format!(
                        "causal_conv1d: {} channels, taps {}×{}, state {}×{}",
                        x.cols, weight.rows, weight.cols, state.channels, state.kernel
                    ),
                });
            }
            let n = segment.rows.len();
            if n == 0 {
                continue;
            }
            let (row_start, rows, channels, kernel) = (
                int(segment.rows.start, "row")?,
                int(n, "rows")?,
                int(x.cols, "channels")?,
                int(state.kernel, "kernel")?,
            );
            let history = &mut state.history;
            let output = &mut *out.data;
            launch!(self, "causal_conv1d_silu", elementwise(x.cols);
                input, weight.f32()?, history, output, &row_start, &rows, &channels, &kernel)?;
        }
        Ok(out)
    }

    fn launch_delta_rule_gates(
        &self,
        a: &CudaTensor,
        b: &CudaTensor,
        a_log: &CudaWeight,
        dt_bias: &CudaWeight,
    ) -> Result<(CudaTensor, CudaTensor), CudaError> {
        Self::check_same_shape(a, b, "delta_rule_gates")?;
        let nv = a.cols;
        if a_log.rows * a_log.cols != nv || dt_bias.rows * dt_bias.cols != nv {
            return Err(CudaError::Invalid {
                problem: format!("delta_rule_gates: {nv} heads, A_log / dt_bias sizes differ"),
            });
        }
        let (a_data, b_data) = (&*a.data, &*b.data);
        let mut g = self.output(a.rows, nv)?;
        let mut beta = self.output(a.rows, nv)?;
        let total = a.rows * nv;
        if total > 0 {
            let (rows, heads) = (int(a.rows, "rows")?, int(nv, "heads")?);
            let (g_out, beta_out) = (&mut *g.data, &mut *beta.data);
            launch!(self, "delta_rule_gates", elementwise(total);
                a_data, b_data, a_log.f32()?, dt_bias.f32()?, g_out, beta_out, &rows, &heads)?;
        }
        Ok((g, beta))
    }
}

fn load_module(
    context: &Arc<CudaContext>,
    path: &std::path::Path,
) -> Result<Arc<cudarc::driver::CudaModule>, CudaError> {
    // cudarc hands the path to cuModuleLoad as UTF-8 (and would panic on anything else).
    if path.to_str().is_none() {
        return Err(CudaError::Cache {
            path: path.display().to_string(),
            problem: "the kernel cache path is not UTF-8 (set NINFER_KERNEL_CACHE)".into(),
        });
    }
    context
        .load_module(cudarc::nvrtc::Ptx::from_file(path))
        .map_err(driver_error(format!("loading module {}", path.display())))
}

/// Maps a CUDA error to the engine's, naming the backend op it failed in.
fn device(op: &'static str) -> impl FnOnce(CudaError) -> EngineError {
    move |source| EngineError::Device { op, source }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type KvCache = CudaKvCache;
    type ConvState = CudaConvState;
    type RecurrentState = CudaRecurrentState;
    type ExpertSlots = CudaExpertSlots;
    type PendingRouting = CudaPendingRouting;

    fn name(&self) -> String {
        format!("cuda:{}", self.info.ordinal)
    }

    fn load_matrix(&self, artifact: &Arc<Artifact>, name: &str) -> Result<CudaWeight, EngineError> {
        self.load_weight(artifact, name, true)
    }

    fn load_parameter(
        &self,
        artifact: &Arc<Artifact>,
        name: &str,
    ) -> Result<CudaWeight, EngineError> {
        self.load_weight(artifact, name, false)
    }

    fn weight_shape(&self, weight: &CudaWeight) -> (usize, usize) {
        (weight.rows, weight.cols)
    }

    fn upload(&self, values: &[f32], rows: usize, cols: usize) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("upload");
        self.upload_tensor(values, rows, cols)
            .map_err(device("upload"))
    }

    fn download(&self, tensor: &CudaTensor) -> Result<Vec<f32>, EngineError> {
        let _timer = self.op_timer("download");
        self.download_values(tensor).map_err(device("download"))
    }

    fn shape(&self, tensor: &CudaTensor) -> (usize, usize) {
        (tensor.rows, tensor.cols)
    }

    fn gather_rows(&self, tensor: &CudaTensor, rows: &[usize]) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("gather_rows");
        self.launch_gather_rows(tensor, rows)
            .map_err(device("gather_rows"))
    }

    fn columns(&self, tensor: &CudaTensor, range: Range<usize>) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("columns");
        self.launch_columns(tensor, range)
            .map_err(device("columns"))
    }

    fn split_interleaved(
        &self,
        tensor: &CudaTensor,
        groups: usize,
        first: usize,
        second: usize,
    ) -> Result<(CudaTensor, CudaTensor), EngineError> {
        let _timer = self.op_timer("split_interleaved");
        self.launch_split_interleaved(tensor, groups, first, second)
            .map_err(device("split_interleaved"))
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32]) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("embed");
        self.launch_embed(table, ids).map_err(device("embed"))
    }

    fn matmul(&self, x: &CudaTensor, weight: &CudaWeight) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer_named(|| {
            format!(
                "matmul {}x{} by {}x{}{}",
                x.rows,
                x.cols,
                weight.rows,
                weight.cols,
                if self.uses_cublas_for(x.rows) {
                    " (cublas)"
                } else {
                    ""
                }
            )
        });
        self.launch_matmul(x, weight).map_err(device("matmul"))
    }

    fn matmul3(
        &self,
        x: &CudaTensor,
        weights: [&CudaWeight; 3],
    ) -> Result<[CudaTensor; 3], EngineError> {
        let fused = {
            let _timer = self.op_timer_named(|| {
                format!(
                    "matmul3 {}x{} by {}+{}+{}x{}",
                    x.rows, x.cols, weights[0].rows, weights[1].rows, weights[2].rows, x.cols
                )
            });
            self.launch_matmul3(x, weights).map_err(device("matmul3"))?
        };
        match fused {
            Some(outputs) => Ok(outputs),
            None => {
                let [w0, w1, w2] = weights;
                Ok([
                    self.matmul(x, w0)?,
                    self.matmul(x, w1)?,
                    self.matmul(x, w2)?,
                ])
            }
        }
    }

    fn rms_norm(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
        style: NormStyle,
    ) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("rms_norm");
        self.launch_rms_norm(x, weight, eps, style)
            .map_err(device("rms_norm"))
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        delta: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
        style: NormStyle,
    ) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("add_rms_norm");
        self.launch_add_rms_norm(x, delta, weight, eps, style)
            .map_err(device("add_rms_norm"))
    }

    fn gated_rms_norm(
        &self,
        x: &CudaTensor,
        gate: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
    ) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("gated_rms_norm");
        self.launch_gated_rms_norm(x, gate, weight, eps)
            .map_err(device("gated_rms_norm"))
    }

    fn rope(
        &self,
        x: &mut CudaTensor,
        positions: &[usize],
        head_dim: usize,
        rotary_dim: usize,
        theta: f64,
    ) -> Result<(), EngineError> {
        let _timer = self.op_timer("rope");
        self.launch_rope(x, positions, head_dim, rotary_dim, theta)
            .map_err(device("rope"))
    }

    fn rms_norm_rope(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
        style: NormStyle,
        rotation: &Rotation<'_>,
    ) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("rms_norm_rope");
        self.launch_rms_norm_rope(x, weight, eps, style, rotation)
            .map_err(device("rms_norm_rope"))
    }

    fn add_assign(&self, a: &mut CudaTensor, b: &CudaTensor) -> Result<(), EngineError> {
        let _timer = self.op_timer("add_assign");
        self.launch_add_assign(a, b).map_err(device("add_assign"))
    }

    fn silu_mul_halves(&self, gate_up: &CudaTensor) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("silu_mul_halves");
        self.launch_silu_mul_halves(gate_up)
            .map_err(device("silu_mul_halves"))
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("silu_mul");
        self.binary(
            gate,
            up,
            "silu_mul",
            |a, b, out, n| launch!(self, "silu_mul", elementwise(n as usize); a, b, out, &n),
        )
        .map_err(device("silu_mul"))
    }

    fn mul_sigmoid(&self, x: &CudaTensor, gate: &CudaTensor) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("mul_sigmoid");
        self.binary(
            x,
            gate,
            "mul_sigmoid",
            |a, b, out, n| launch!(self, "mul_sigmoid", elementwise(n as usize); a, b, out, &n),
        )
        .map_err(device("mul_sigmoid"))
    }

    fn add_sigmoid_scaled_rows(
        &self,
        a: &mut CudaTensor,
        b: &CudaTensor,
        gate: &CudaTensor,
    ) -> Result<(), EngineError> {
        let _timer = self.op_timer("add_sigmoid_scaled_rows");
        self.launch_add_sigmoid_scaled_rows(a, b, gate)
            .map_err(device("add_sigmoid_scaled_rows"))
    }

    fn start_routing(
        &self,
        logits: &CudaTensor,
        k: usize,
        normalize: bool,
        hidden: &CudaTensor,
        read_hidden: bool,
    ) -> Result<CudaPendingRouting, EngineError> {
        let _timer = self.op_timer("start_routing");
        if logits.cols <= router::ROUTER_MAX_EXPERTS && k <= router::ROUTER_MAX_TOP_K {
            let hidden_part = read_hidden.then_some(hidden);
            return self
                .launch_routing_and_read_back(logits, k, normalize, hidden_part)
                .map_err(device("start_routing"));
        }
        // Routers wider than the kernel takes: `route_top_k` routes them on the host.
        let routing = self.route_top_k(logits, k, normalize)?;
        let hidden = if read_hidden {
            self.download(hidden)?
        } else {
            Vec::new()
        };
        Ok(Self::ready_routing(routing, hidden))
    }

    fn slotted_experts_by_pending_routing(
        &self,
        slots: &CudaExpertSlots,
        x: &CudaTensor,
        routing: &CudaPendingRouting,
    ) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer_by_rows("slotted_experts_by_pending_routing", x.rows);
        self.launch_slotted_experts_by_pending_routing(slots, x, routing)
            .map_err(device("slotted_experts_by_pending_routing"))
    }

    fn finish_routing(
        &self,
        mut routing: CudaPendingRouting,
    ) -> Result<(Routing, Vec<f32>), EngineError> {
        let _timer = self.op_timer("finish_routing");
        self.read_routing(&mut routing)
            .map_err(device("finish_routing"))
    }

    fn route_top_k(
        &self,
        logits: &CudaTensor,
        k: usize,
        normalize: bool,
    ) -> Result<Routing, EngineError> {
        let _timer = self.op_timer("route_top_k");
        // Softmax/top-k on the GPU; only the routing comes back to the host (the expert
        // executor needs it there). Routers wider than the kernel takes run on the host.
        if logits.cols <= router::ROUTER_MAX_EXPERTS && k <= router::ROUTER_MAX_TOP_K {
            return self
                .route_top_k_on_device(logits, k, normalize)
                .map_err(device("route_top_k"));
        }
        let values = self.download(logits)?;
        Ok(route_top_k_host(&values, logits.cols, k, normalize))
    }

    fn new_kv_cache(&self, max_tokens: usize, kv_width: usize) -> Result<CudaKvCache, EngineError> {
        self.allocate_kv_cache(max_tokens, kv_width)
            .map_err(device("new_kv_cache"))
    }

    fn attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        spec: &AttentionSpec,
        segments: &mut [Segment<'_, CudaKvCache>],
    ) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer_by_rows("attention", q.rows);
        // The launches live in `attention.rs`.
        self.attention_on(self.info.attention_path, q, k, v, spec, segments)
    }

    fn new_conv_state(&self, channels: usize, kernel: usize) -> Result<CudaConvState, EngineError> {
        let history = self
            .alloc(kernel.saturating_sub(1) * channels)
            .map_err(device("new_conv_state"))?;
        Ok(CudaConvState {
            channels,
            kernel,
            history,
        })
    }

    fn causal_conv1d_silu(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        segments: &mut [Segment<'_, CudaConvState>],
    ) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("causal_conv1d_silu");
        self.launch_causal_conv1d_silu(x, weight, segments)
            .map_err(device("causal_conv1d_silu"))
    }

    fn delta_rule_gates(
        &self,
        a: &CudaTensor,
        b: &CudaTensor,
        a_log: &CudaWeight,
        dt_bias: &CudaWeight,
    ) -> Result<(CudaTensor, CudaTensor), EngineError> {
        let _timer = self.op_timer("delta_rule_gates");
        self.launch_delta_rule_gates(a, b, a_log, dt_bias)
            .map_err(device("delta_rule_gates"))
    }

    fn new_recurrent_state(&self, spec: &DeltaRuleSpec) -> Result<CudaRecurrentState, EngineError> {
        let size = spec.value_heads * spec.key_head_dim * spec.value_head_dim;
        let state = self.alloc(size).map_err(device("new_recurrent_state"))?;
        Ok(CudaRecurrentState { spec: *spec, state })
    }

    fn gated_delta_rule(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        g: &CudaTensor,
        beta: &CudaTensor,
        spec: &DeltaRuleSpec,
        form: DeltaRuleForm,
        segments: &mut [Segment<'_, CudaRecurrentState>],
    ) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer_by_rows("gated_delta_rule", q.rows);
        // Chunked for multi-token segments (`Auto`) once the kernel passed its start-up check,
        // else the recurrent kernel (device/delta_rule.rs).
        self.launch_gated_delta_rule(q, k, v, g, beta, spec, form, segments)
            .map_err(device("gated_delta_rule"))
    }

    fn new_expert_slots(
        &self,
        layout: &ExpertLayout,
        num_experts: usize,
        slots: usize,
    ) -> Result<CudaExpertSlots, EngineError> {
        self.allocate_expert_slots(layout, num_experts, slots)
            .map_err(device("new_expert_slots"))
    }

    fn fill_expert_slot(
        &self,
        slots: &mut CudaExpertSlots,
        slot: usize,
        expert: usize,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), EngineError> {
        self.copy_expert_into_slot(slots, slot, expert, artifact, bank)
    }

    fn prepare_expert_source(
        &self,
        slots: &mut CudaExpertSlots,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) {
        // The raw register call needs the context on this thread.
        match self.stream.context().bind_to_thread() {
            Ok(()) => self.pin_bank(slots, artifact, bank),
            Err(error) => tracing::warn!(
                bank = %bank.prefix,
                "not page-locking this expert bank ahead of time: binding the CUDA context failed: {}",
                describe(&error)
            ),
        }
    }

    fn slotted_experts(
        &self,
        slots: &CudaExpertSlots,
        x: &CudaTensor,
        routing: &Routing,
    ) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer_by_rows("slotted_experts", x.rows);
        self.launch_slotted_experts(slots, x, routing)
            .map_err(device("slotted_experts"))
    }

    fn logit_candidates(
        &self,
        logits: &CudaTensor,
        k: usize,
        extra: &[Vec<u32>],
    ) -> Result<Vec<crate::backend::LogitCandidates>, EngineError> {
        let _timer = self.op_timer("logit_candidates");
        crate::backend::candidates::check_candidate_request(logits.rows, logits.cols, k, extra)?;
        self.launch_logit_candidates(logits, k, extra)
            .map_err(device("logit_candidates"))
    }

    fn reserve_host_kv(&self, request: &crate::backend::HostKvRequest) -> Result<(), EngineError> {
        self.reserve_host_kv_pool(request)
            .map_err(device("reserve_host_kv"))
    }

    fn kv_placement(&self) -> Option<crate::backend::KvPlacement> {
        self.host_kv_placement()
    }
}

mod attention;
mod bandwidth;
mod delta_rule;
mod expert_slots;
mod host_kv;
mod sampling;
pub use attention::AttentionPath;
mod op_timing;
mod pending_routing;
mod readback;
mod router;
mod tensor_pool;
pub use expert_slots::CudaExpertSlots;
pub use pending_routing::CudaPendingRouting;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_kernels() {
        use super::super::kernels::kernel_define;
        assert_eq!(
            i64::from(NORM_THREADS),
            kernel_define("norm", "NORM_THREADS")
        );
        assert_eq!(MATMUL_ROWS as i64, kernel_define("matmul", "ROWS"));
        assert_eq!(
            ATTENTION_MAX_HEAD_DIM as i64,
            32 * kernel_define("attention", "MAX_DIMS_PER_LANE")
        );
    }
}
