//! Opening a GPU: the driver and NVRTC, a context and its stream, every kernel (from the disk
//! cache or compiled now), then the optional paths behind their self-checks (`self_checks.rs`,
//! `attention.rs`, `delta_rule.rs`); the process-wide shared backends the tests use.
//!
//! Owns: [`DeviceInfo`], [`CudaBackend::with_options`] and the memory-pool setting.
//! Must not touch: op launches.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaContext};

use super::super::cublas::Cublas;
use super::super::kernels::{cached_cubin, KERNEL_SOURCES};
use super::super::loader;
use super::super::nvrtc::Nvrtc;
use super::super::CudaError;
use super::launch::{KernelModules, Pdl};
use super::{
    delta_rule, describe, driver_error, no_panic, op_timing, AttentionPath, CudaBackend,
    CudaOptions, KvDtype,
};

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
    /// against the recurrent kernel), `"tensor-core"` (as `"chunked"`, and with
    /// `CudaOptions::tensor_core_prefill` the tensor-core kernel passed its own check: it runs
    /// prefill segments of the shapes it takes) or `"recurrent"` (every form; the check failed
    /// or the GPU's shared memory is too small, with a warning logged).
    pub delta_rule_path: &'static str,
    /// Shared memory a block may use, bytes: the GPU's opt-in maximum, or less where the
    /// options cap it ([`CudaOptions::shared_memory_cap`]). Every kernel sizes itself by this
    /// and every launch is checked against it.
    pub shared_memory_per_block: usize,
    /// The GPU's own opt-in maximum of shared memory per block, bytes.
    pub device_shared_memory_per_block: usize,
    /// 32-bit registers a block may use.
    pub registers_per_block: usize,
    /// Streaming multiprocessors.
    pub multiprocessor_count: usize,
    /// [`CudaOptions::memory_cap_bytes`]: the memory this backend reports at most.
    pub memory_cap_bytes: Option<u64>,
    /// The delta-rule kernel variants that passed their start-up checks (see
    /// [`DeltaRuleKernel`](super::DeltaRuleKernel)); the largest chunk that fits a shape runs it.
    pub delta_rule_variants: Vec<super::DeltaRuleKernel>,
    /// The attention kernels in use: `flash` (split-K decode, tiled prefill) once they passed
    /// their start-up check against the reference, else `reference`.
    pub attention_path: AttentionPath,
    /// Kernel launches carry the programmatic-dependent-launch attribute (device/launch.rs):
    /// on in the options, an sm_90+ GPU, and a driver with `cuLaunchKernelEx`.
    pub programmatic_dependent_launch: bool,
}

/// Stream-ordered allocations come from the device's default memory pool, whose release
/// threshold is 0: every synchronisation (two per MoE layer at decode) hands the freed memory
/// back to the driver and the next allocation maps it again. Keeping it makes an op's output
/// allocation a pool lookup. Failure only costs speed, so it is logged, not raised.
fn keep_freed_device_memory(context: &CudaContext) {
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

/// The limits of a GPU the kernels size themselves by.
struct DeviceLimits {
    shared_memory_per_block: usize,
    registers_per_block: usize,
    multiprocessor_count: usize,
}

impl DeviceLimits {
    fn read(context: &CudaContext) -> Result<Self, CudaError> {
        let read = |attribute, what: &str| -> Result<usize, CudaError> {
            let value = context
                .attribute(attribute)
                .map_err(driver_error(format!("reading the GPU's {what}")))?;
            Ok(usize::try_from(value).unwrap_or(0))
        };
        Ok(DeviceLimits {
            shared_memory_per_block: read(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                "shared memory per block (opt-in)",
            )?,
            registers_per_block: read(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK,
                "registers per block",
            )?,
            multiprocessor_count: read(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                "multiprocessor count",
            )?,
        })
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
        let options = options
            .with_environment_caps()
            .map_err(|problem| CudaError::Invalid { problem })?;
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
        let limits = DeviceLimits::read(&context)?;
        let shared_memory_per_block = match options.shared_memory_cap {
            Some(cap) => cap.min(limits.shared_memory_per_block),
            None => limits.shared_memory_per_block,
        };
        let nvrtc = Nvrtc::load()?;
        let arch = (major * 10 + minor) as u32;
        let mut functions = HashMap::new();
        let mut modules = KernelModules::new(context.clone());
        let (mut cached, mut compiled) = (0, 0);
        for kernel in KERNEL_SOURCES {
            let (path, hit) = cached_cubin(&nvrtc, kernel, arch, driver_version)?;
            let loaded = match modules.load(&path, kernel.functions) {
                Ok(loaded) => loaded,
                Err(error) if hit => {
                    // A stale or torn cache entry: drop it and compile afresh once.
                    tracing::warn!(file = %path.display(), "cached kernel did not load ({error}); recompiling");
                    let _ = std::fs::remove_file(&path);
                    let (path, _) = cached_cubin(&nvrtc, kernel, arch, driver_version)?;
                    modules.load(&path, kernel.functions)?
                }
                Err(error) => return Err(error),
            };
            if hit {
                cached += 1;
            } else {
                compiled += 1;
            }
            functions.extend(loaded);
        }
        // SAFETY: `cuLaunchKernelEx`'s C signature.
        let has_launch_ex = unsafe {
            driver.function::<unsafe extern "C" fn(
                *const sys::CUlaunchConfig,
                sys::CUfunction,
                *mut *mut std::ffi::c_void,
                *mut *mut std::ffi::c_void,
            ) -> sys::CUresult>("cuLaunchKernelEx")
        }
        .is_ok();
        let (pdl, pdl_off_because) = Pdl::decide(
            options.programmatic_dependent_launch,
            (major, minor),
            driver_version,
            has_launch_ex,
        );
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
            shared_memory_per_block,
            device_shared_memory_per_block: limits.shared_memory_per_block,
            registers_per_block: limits.registers_per_block,
            multiprocessor_count: limits.multiprocessor_count,
            memory_cap_bytes: options.memory_cap_bytes,
            delta_rule_variants: Vec::new(),
            attention_path: AttentionPath::Reference,
            programmatic_dependent_launch: pdl.in_use(),
        };
        let mut backend = CudaBackend {
            // A stream of its own: the legacy default stream cannot be recorded into a graph.
            stream: context
                .new_stream()
                .map_err(driver_error("creating the backend's stream"))?,
            _context: context,
            functions,
            pdl,
            _modules: modules,
            info,
            cublas: None,
            options,
            op_timing: None,
            staging: Default::default(),
            routing_staging: Default::default(),
            tensor_pool: Default::default(),
            rope_tables: Default::default(),
            active_step_graph: Default::default(),
            kernel_choices_logged: Default::default(),
            host_kv: Default::default(),
            fused_expert_counters: None,
            fused_router_counter: None,
            fused_qkv_norm_counter: None,
            peer_crossings: Default::default(),
            capture_watch: Default::default(),
        };
        // The counters a fused kernel's blocks take tickets on: zero, allocated once, only for
        // the kernels turned on.
        let counters = |on: bool, count: usize, what: &str| {
            on.then(|| backend.stream.alloc_zeros::<u32>(count))
                .transpose()
                .map_err(driver_error(format!("allocating {what}")))
        };
        let fused_expert_counters = counters(
            options.fused_decode_experts,
            2,
            "the fused experts' counters",
        )?;
        let fused_router_counter =
            counters(options.fused_decode_router, 1, "the fused router's counter")?;
        backend.fused_expert_counters = fused_expert_counters;
        backend.fused_router_counter = fused_router_counter;
        backend.fused_qkv_norm_counter = counters(
            options.fused_decode_qkv_norm,
            1,
            "the fused projections' counter",
        )?;
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
        if let Some(cap) = options.shared_memory_cap {
            tracing::info!(
                "shared memory per block capped at {cap} bytes (the GPU gives {}): kernels take the variants that fit {}",
                limits.shared_memory_per_block,
                backend.info.shared_memory_per_block
            );
        }
        match (pdl, pdl_off_because) {
            (Pdl::Off, why) => tracing::info!(
                "programmatic dependent launch off: {}",
                why.unwrap_or_default()
            ),
            (_, Some(why)) => tracing::info!("programmatic dependent launch on; {why}"),
            (_, None) => tracing::info!(
                "programmatic dependent launch on (kernels start while their predecessor finishes)"
            ),
        }
        Ok(backend)
    }

    /// True the first time `key` (an op and two dims of its shape) is noted: the caller then
    /// logs which kernel variant that shape takes, so the log says it once per shape.
    pub(super) fn note_kernel_choice(&self, key: (&'static str, usize, usize)) -> bool {
        match self.kernel_choices_logged.lock() {
            Ok(mut logged) => logged.insert(key),
            Err(_) => false,
        }
    }

    /// Whether `op` has taken a kernel variant it notes (see [`CudaBackend::note_kernel_choice`])
    /// for some shape: tests check that the variant they hold to another actually ran.
    pub fn kernel_choice_noted(&self, op: &str) -> bool {
        self.kernel_choices_logged
            .lock()
            .is_ok_and(|logged| logged.iter().any(|(noted, _, _)| *noted == op))
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
}
