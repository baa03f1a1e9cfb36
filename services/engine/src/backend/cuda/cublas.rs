//! A minimal cuBLAS binding: one handle on the backend's stream, and `cublasGemmEx` for the
//! dense layers' `y = x · Wᵀ` at prefill sizes.
//!
//! Owns: opening `libcublas` (through [`super::loader`], never cudarc's cuBLAS loader: it misses
//! the CUDA 13 names and panics when nothing loads), the handle's life (created on the backend's
//! context, bound to its stream, given a workspace allocated on that stream), and the mapping of a
//! row-major linear layer onto column-major GEMM arguments. Every entry point used here has the
//! same C signature in cuBLAS 12.x and 13.x.
//! Must not touch: kernel launches, the choice of when to use cuBLAS and the self-check against
//! the kernels (`device/matmul.rs`, `device/self_checks.rs`), what the op's caller does with an
//! error this returns.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::loader::{self, Library};
use super::CudaError;

type Handle = *mut c_void;
// cublasStatus_t and the other cuBLAS enums are C enums (int); read as plain ints so a value
// from a newer cuBLAS is just a number in a message.
type Status = c_int;

type CreateFn = unsafe extern "C" fn(*mut Handle) -> Status;
type DestroyFn = unsafe extern "C" fn(Handle) -> Status;
type SetStreamFn = unsafe extern "C" fn(Handle, *mut c_void) -> Status;
type SetWorkspaceFn = unsafe extern "C" fn(Handle, *mut c_void, usize) -> Status;
type SetMathModeFn = unsafe extern "C" fn(Handle, c_int) -> Status;
type GetVersionFn = unsafe extern "C" fn(Handle, *mut c_int) -> Status;
type StatusStringFn = unsafe extern "C" fn(Status) -> *const c_char;
type GemmExFn = unsafe extern "C" fn(
    Handle,
    c_int,         // transa
    c_int,         // transb
    c_int,         // m
    c_int,         // n
    c_int,         // k
    *const c_void, // alpha
    *const c_void, // A
    c_int,         // Atype
    c_int,         // lda
    *const c_void, // B
    c_int,         // Btype
    c_int,         // ldb
    *const c_void, // beta
    *mut c_void,   // C
    c_int,         // Ctype
    c_int,         // ldc
    c_int,         // computeType
    c_int,         // algo
) -> Status;

const CUBLAS_OP_N: c_int = 0;
const CUBLAS_OP_T: c_int = 1;
const CUDA_R_32F: c_int = 0;
const CUDA_R_16BF: c_int = 14;
/// f32 accumulation; with f32 inputs and the default math mode this is full f32 (no TF32).
const CUBLAS_COMPUTE_32F: c_int = 68;
const CUBLAS_GEMM_DEFAULT: c_int = -1;
/// Tensor cores where the types allow (bf16 inputs), never TF32 for f32 inputs.
const CUBLAS_DEFAULT_MATH: c_int = 0;
/// NVIDIA's recommended workspace for Hopper (smaller GPUs need less; 32 MiB is cheap).
const WORKSPACE_BYTES: usize = 32 << 20;

/// The operands of one linear layer; both of the same element type.
pub enum GemmOperands<'a> {
    /// bf16 activations and weights (u16 bit patterns), f32 result.
    Bf16 {
        x: &'a CudaSlice<u16>,
        w: &'a CudaSlice<u16>,
    },
    /// f32 activations and weights, f32 result (f32 compute, no TF32).
    F32 {
        x: &'a CudaSlice<f32>,
        w: &'a CudaSlice<f32>,
    },
}

/// cuBLAS, opened once per backend, with one handle.
pub struct Cublas {
    library: Library,
    version: i32,
    stream: Arc<CudaStream>,
    /// The handle; the mutex serialises calls (a handle must not be used by two host threads
    /// at once, and the backend is shared between threads).
    handle: Mutex<Handle>,
    // Kept alive as long as the handle: cuBLAS writes to it during every GEMM.
    _workspace: Option<CudaSlice<u8>>,
    destroy: DestroyFn,
    gemm_ex: GemmExFn,
    status_string: Option<StatusStringFn>,
}

// SAFETY: the raw handle is only used under the mutex; function pointers and the library handle
// are process-wide and immutable.
unsafe impl Send for Cublas {}
// SAFETY: as above.
unsafe impl Sync for Cublas {}

impl std::fmt::Debug for Cublas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cublas")
            .field("library", &self.library.opened_as)
            .field("version", &self.version)
            .finish()
    }
}

fn describe_status(status: Status, status_string: Option<StatusStringFn>) -> String {
    let name = match status {
        1 => "CUBLAS_STATUS_NOT_INITIALIZED",
        3 => "CUBLAS_STATUS_ALLOC_FAILED",
        7 => "CUBLAS_STATUS_INVALID_VALUE",
        8 => "CUBLAS_STATUS_ARCH_MISMATCH",
        11 => "CUBLAS_STATUS_MAPPING_ERROR",
        13 => "CUBLAS_STATUS_EXECUTION_FAILED",
        14 => "CUBLAS_STATUS_INTERNAL_ERROR",
        15 => "CUBLAS_STATUS_NOT_SUPPORTED",
        16 => "CUBLAS_STATUS_LICENSE_ERROR",
        _ => "",
    };
    let text = status_string
        // SAFETY: cublasGetStatusString returns a static string (or NULL) for any value.
        .map(|f| unsafe { f(status) })
        .filter(|p| !p.is_null())
        // SAFETY: non-NULL results are static NUL-terminated strings.
        .map(|p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
    match (name.is_empty(), text) {
        (false, Some(text)) if text != name => format!("{name} ({text})"),
        (false, _) => name.to_string(),
        (true, Some(text)) => format!("status {status} ({text})"),
        (true, None) => format!("status {status}"),
    }
}

impl Cublas {
    /// Opens cuBLAS (see [`loader::CUBLAS`] for where it looks) and creates a handle on
    /// `stream`'s context that queues its work on `stream`.
    pub fn load(stream: &Arc<CudaStream>) -> Result<Self, CudaError> {
        let library = loader::open(&loader::CUBLAS)?;
        // SAFETY: each type alias matches the C prototype in cublas_api.h (12.x and 13.x).
        let (create, destroy, set_stream, gemm_ex) = unsafe {
            (
                library.function::<CreateFn>("cublasCreate_v2")?,
                library.function::<DestroyFn>("cublasDestroy_v2")?,
                library.function::<SetStreamFn>("cublasSetStream_v2")?,
                library.function::<GemmExFn>("cublasGemmEx")?,
            )
        };
        // Optional: older 12.x releases may lack some; none is needed for correct results.
        // SAFETY: as above.
        let (set_workspace, set_math_mode, get_version, status_string) = unsafe {
            (
                library
                    .function::<SetWorkspaceFn>("cublasSetWorkspace_v2")
                    .ok(),
                library.function::<SetMathModeFn>("cublasSetMathMode").ok(),
                library.function::<GetVersionFn>("cublasGetVersion_v2").ok(),
                library
                    .function::<StatusStringFn>("cublasGetStatusString")
                    .ok(),
            )
        };
        let check = |status: Status, call: &str| {
            if status == 0 {
                Ok(())
            } else {
                Err(CudaError::Cublas {
                    call: call.to_string(),
                    message: describe_status(status, status_string),
                })
            }
        };
        // cuBLAS creates its state on the calling thread's current context: make it ours.
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| CudaError::Cublas {
                call: "binding the CUDA context".into(),
                message: format!("{e:?}"),
            })?;
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: valid out pointer; the library is loaded.
        check(unsafe { create(&mut handle) }, "cublasCreate_v2")?;
        // From here on the handle is destroyed on every early return (by `Cublas::drop`).
        let mut cublas = Cublas {
            library,
            version: 0,
            stream: Arc::clone(stream),
            handle: Mutex::new(handle),
            _workspace: None,
            destroy,
            gemm_ex,
            status_string,
        };
        // SAFETY: handle is live; the stream belongs to the current context (cudaStream_t and
        // CUstream are the same object).
        check(
            unsafe { set_stream(handle, stream.cu_stream() as *mut c_void) },
            "cublasSetStream_v2",
        )?;
        if let Some(set_math_mode) = set_math_mode {
            // SAFETY: handle is live.
            check(
                unsafe { set_math_mode(handle, CUBLAS_DEFAULT_MATH) },
                "cublasSetMathMode",
            )?;
        }
        // Our own workspace, allocated on our stream (set after the stream: setting the stream
        // resets the workspace). Without the entry point cuBLAS uses its own pool.
        if let Some(set_workspace) = set_workspace {
            let mut workspace =
                stream
                    .alloc_zeros::<u8>(WORKSPACE_BYTES)
                    .map_err(|e| CudaError::Cublas {
                        call: format!("allocating a {WORKSPACE_BYTES}-byte workspace"),
                        message: format!("{e:?}"),
                    })?;
            {
                let (pointer, _record) = workspace.device_ptr_mut(stream);
                // SAFETY: handle is live; the buffer is WORKSPACE_BYTES long and outlives the
                // handle (dropped after it, see `Drop`).
                check(
                    unsafe { set_workspace(handle, pointer as *mut c_void, WORKSPACE_BYTES) },
                    "cublasSetWorkspace_v2",
                )?;
            }
            cublas._workspace = Some(workspace);
        }
        if let Some(get_version) = get_version {
            let mut version = 0;
            // SAFETY: handle is live; valid out pointer.
            if unsafe { get_version(handle, &mut version) } == 0 {
                cublas.version = version;
            }
        }
        Ok(cublas)
    }

    /// Where cuBLAS was opened from, and its version (e.g. 130100 for 13.1.0; 0 if unknown).
    pub fn describe(&self) -> String {
        format!("{} (version {})", self.library.opened_as, self.version)
    }

    /// `y[n, m] = x[n, k] · w[m, k]ᵀ`, all row-major, f32 result, f32 accumulation; queued on
    /// the backend's stream.
    ///
    /// Column-major view: `w` row-major `[m, k]` is column-major `[k, m]` (ld k), `x` is
    /// column-major `[k, n]` (ld k), and `y` row-major `[n, m]` is column-major `[m, n]`
    /// (ld m), so `yᵀ = op_T(w) · x`: `GemmEx(T, N, m, n, k, w, lda = k, x, ldb = k, y,
    /// ldc = m)`.
    pub fn linear(
        &self,
        operands: GemmOperands<'_>,
        y: &mut CudaSlice<f32>,
        n: usize,
        k: usize,
        m: usize,
    ) -> Result<(), CudaError> {
        self.linear_into(operands, y, n, k, m, false)
    }

    /// [`Self::linear`], adding into `y` (`β = 1`) when `accumulate`.
    pub fn linear_into(
        &self,
        operands: GemmOperands<'_>,
        y: &mut CudaSlice<f32>,
        n: usize,
        k: usize,
        m: usize,
        accumulate: bool,
    ) -> Result<(), CudaError> {
        let (x_len, w_len) = match &operands {
            GemmOperands::Bf16 { x, w } => (x.len(), w.len()),
            GemmOperands::F32 { x, w } => (x.len(), w.len()),
        };
        if n == 0 || k == 0 || m == 0 || x_len < n * k || w_len < m * k || y.len() < n * m {
            return Err(CudaError::Invalid {
                problem: format!(
                    "cuBLAS linear: {n}×{k} · ({m}×{k})ᵀ with buffers of {x_len}, {w_len} and {} elements",
                    y.len()
                ),
            });
        }
        let int = |value: usize, what: &str| {
            c_int::try_from(value).map_err(|_| CudaError::Invalid {
                problem: format!("cuBLAS linear: {what} = {value} does not fit a C int"),
            })
        };
        let (n, k, m) = (int(n, "n")?, int(k, "k")?, int(m, "m")?);
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let stream = &*self.stream;
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| CudaError::Cublas {
                call: "binding the CUDA context".into(),
                message: format!("{e:?}"),
            })?;
        let handle = self.handle.lock().map_err(|_| CudaError::Cublas {
            call: "cublasGemmEx".into(),
            message: "an earlier call panicked while holding the handle".into(),
        })?;
        let (y_pointer, _record_y) = y.device_ptr_mut(stream);
        let status = match operands {
            GemmOperands::Bf16 { x, w } => {
                let (x_pointer, _record_x) = x.device_ptr(stream);
                let (w_pointer, _record_w) = w.device_ptr(stream);
                // SAFETY: handle is live and used by this thread only (mutex held); the buffers
                // hold at least m·k, n·k and n·m elements of the declared types (checked above);
                // alpha/beta are host floats as the default pointer mode expects.
                unsafe {
                    (self.gemm_ex)(
                        *handle,
                        CUBLAS_OP_T,
                        CUBLAS_OP_N,
                        m,
                        n,
                        k,
                        (&alpha as *const f32).cast(),
                        w_pointer as *const c_void,
                        CUDA_R_16BF,
                        k,
                        x_pointer as *const c_void,
                        CUDA_R_16BF,
                        k,
                        (&beta as *const f32).cast(),
                        y_pointer as *mut c_void,
                        CUDA_R_32F,
                        m,
                        CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT,
                    )
                }
            }
            GemmOperands::F32 { x, w } => {
                let (x_pointer, _record_x) = x.device_ptr(stream);
                let (w_pointer, _record_w) = w.device_ptr(stream);
                // SAFETY: as above, with f32 operands.
                unsafe {
                    (self.gemm_ex)(
                        *handle,
                        CUBLAS_OP_T,
                        CUBLAS_OP_N,
                        m,
                        n,
                        k,
                        (&alpha as *const f32).cast(),
                        w_pointer as *const c_void,
                        CUDA_R_32F,
                        k,
                        x_pointer as *const c_void,
                        CUDA_R_32F,
                        k,
                        (&beta as *const f32).cast(),
                        y_pointer as *mut c_void,
                        CUDA_R_32F,
                        m,
                        CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT,
                    )
                }
            }
        };
        if status != 0 {
            return Err(CudaError::Cublas {
                call: format!("cublasGemmEx ({m}×{k} weight, {n} rows)"),
                message: describe_status(status, self.status_string),
            });
        }
        Ok(())
    }
}

impl Drop for Cublas {
    fn drop(&mut self) {
        let handle = match self.handle.get_mut() {
            Ok(handle) => *handle,
            Err(poisoned) => *poisoned.into_inner(),
        };
        if handle.is_null() {
            return;
        }
        // Queued GEMMs may still use the workspace: let them finish before it is freed.
        let _ = self.stream.synchronize();
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: the handle came from cublasCreate_v2 and is destroyed once, here.
        unsafe { (self.destroy)(handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_named() {
        assert_eq!(describe_status(15, None), "CUBLAS_STATUS_NOT_SUPPORTED");
        assert_eq!(describe_status(99, None), "status 99");
    }
}
