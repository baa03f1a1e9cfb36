//! A minimal NVRTC binding: compile one CUDA C source to a cubin for one GPU architecture.
//!
//! Owns: the handful of NVRTC entry points the engine uses, called through function pointers
//! taken from the library [`super::loader`] found (any NVRTC 12.x or 13.x: the entry points used
//! here have the same C signatures in both). Needs no GPU.
//! Must not touch: the driver, kernel launches, the disk cache (see [`super::kernels`]).

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use super::loader::{self, Library};
use super::CudaError;

type Program = *mut c_void;
// nvrtcResult is a C enum; read as a plain int so an unknown value from a newer NVRTC is
// just a number in an error message.
type Status = c_int;

type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status;
type CreateFn = unsafe extern "C" fn(
    *mut Program,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> Status;
type CompileFn = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status;
type SizeFn = unsafe extern "C" fn(Program, *mut usize) -> Status;
type BytesFn = unsafe extern "C" fn(Program, *mut c_char) -> Status;
type DestroyFn = unsafe extern "C" fn(*mut Program) -> Status;
type ErrorStringFn = unsafe extern "C" fn(Status) -> *const c_char;

/// NVRTC, opened once.
pub struct Nvrtc {
    library: Library,
    version: (i32, i32),
    create: CreateFn,
    compile: CompileFn,
    log_size: SizeFn,
    log: BytesFn,
    cubin_size: SizeFn,
    cubin: BytesFn,
    destroy: DestroyFn,
    error_string: ErrorStringFn,
}

impl std::fmt::Debug for Nvrtc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvrtc")
            .field("library", &self.library.opened_as)
            .field("version", &self.version)
            .finish()
    }
}

/// Frees an NVRTC program however compilation ends.
struct ProgramGuard<'a> {
    nvrtc: &'a Nvrtc,
    program: Program,
}

impl Drop for ProgramGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: program came from a successful nvrtcCreateProgram and is destroyed once.
        unsafe { (self.nvrtc.destroy)(&mut self.program) };
    }
}

impl Nvrtc {
    /// Finds and opens NVRTC (see [`loader::NVRTC`] for where it looks).
    pub fn load() -> Result<Self, CudaError> {
        let library = loader::open(&loader::NVRTC)?;
        // SAFETY: each type alias matches the C prototype in nvrtc.h (12.x and 13.x).
        unsafe {
            let version_fn: VersionFn = library.function("nvrtcVersion")?;
            let mut version = (0, 0);
            let status = version_fn(&mut version.0, &mut version.1);
            let nvrtc = Nvrtc {
                create: library.function("nvrtcCreateProgram")?,
                compile: library.function("nvrtcCompileProgram")?,
                log_size: library.function("nvrtcGetProgramLogSize")?,
                log: library.function("nvrtcGetProgramLog")?,
                cubin_size: library.function("nvrtcGetCUBINSize")?,
                cubin: library.function("nvrtcGetCUBIN")?,
                destroy: library.function("nvrtcDestroyProgram")?,
                error_string: library.function("nvrtcGetErrorString")?,
                library,
                version,
            };
            nvrtc.check(status, "nvrtcVersion")?;
            Ok(nvrtc)
        }
    }

    /// `(major, minor)` of the NVRTC that was found.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// Where NVRTC was opened from.
    pub fn location(&self) -> &str {
        &self.library.opened_as
    }

    fn check(&self, status: Status, call: &str) -> Result<(), CudaError> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: nvrtcGetErrorString returns a static string (or NULL) for any value.
        let text = unsafe { (self.error_string)(status) };
        let message = if text.is_null() {
            format!("status {status}")
        } else {
            // SAFETY: non-NULL results are static NUL-terminated strings.
            unsafe { CStr::from_ptr(text) }
                .to_string_lossy()
                .into_owned()
        };
        Err(CudaError::Nvrtc {
            call: call.to_string(),
            message,
        })
    }

    /// Compiles `source` (named `name` in messages) to a cubin for `sm_{arch}` (e.g. 90), with
    /// `headers` (include name, source) available to its `#include "…"`s.
    /// A source that does not compile gives [`CudaError::Compile`] with NVRTC's log.
    pub fn compile_cubin(
        &self,
        name: &str,
        source: &str,
        headers: &[(&str, &str)],
        arch: u32,
    ) -> Result<Vec<u8>, CudaError> {
        let invalid = |what: &str| CudaError::Nvrtc {
            call: "nvrtcCreateProgram".into(),
            message: format!("{what} contains a NUL byte"),
        };
        let c_source = CString::new(source).map_err(|_| invalid("kernel source"))?;
        let c_name = CString::new(format!("{name}.cu")).map_err(|_| invalid("kernel name"))?;
        let options: Vec<CString> = [
            format!("--gpu-architecture=sm_{arch}"),
            "--std=c++17".to_string(),
        ]
        .into_iter()
        .map(|o| CString::new(o).map_err(|_| invalid("option")))
        .collect::<Result<_, _>>()?;
        let option_pointers: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let header_names: Vec<CString> = headers
            .iter()
            .map(|(include, _)| CString::new(*include).map_err(|_| invalid("header name")))
            .collect::<Result<_, _>>()?;
        let header_sources: Vec<CString> = headers
            .iter()
            .map(|(_, text)| CString::new(*text).map_err(|_| invalid("header source")))
            .collect::<Result<_, _>>()?;
        let name_pointers: Vec<*const c_char> = header_names.iter().map(|h| h.as_ptr()).collect();
        let source_pointers: Vec<*const c_char> =
            header_sources.iter().map(|h| h.as_ptr()).collect();

        let mut program: Program = std::ptr::null_mut();
        // SAFETY: valid NUL-terminated strings; the two header arrays have `headers.len()`
        // entries each and outlive the call (NVRTC copies them).
        let status = unsafe {
            (self.create)(
                &mut program,
                c_source.as_ptr(),
                c_name.as_ptr(),
                headers.len() as c_int,
                source_pointers.as_ptr(),
                name_pointers.as_ptr(),
            )
        };
        self.check(status, "nvrtcCreateProgram")?;
        let guard = ProgramGuard {
            nvrtc: self,
            program,
        };
        // SAFETY: program is live (guard); options outlive the call.
        let status = unsafe {
            (self.compile)(
                guard.program,
                option_pointers.len() as c_int,
                option_pointers.as_ptr(),
            )
        };
        if status != 0 {
            let log = self.program_log(guard.program);
            return Err(CudaError::Compile {
                kernel: format!("{name}.cu"),
                arch: format!("sm_{arch}"),
                log,
            });
        }
        let mut size = 0usize;
        // SAFETY: program compiled successfully; size is a valid out pointer.
        self.check(
            unsafe { (self.cubin_size)(guard.program, &mut size) },
            "nvrtcGetCUBINSize",
        )?;
        let mut cubin = vec![0u8; size];
        // SAFETY: the buffer holds exactly `size` bytes as NVRTC asked.
        self.check(
            unsafe { (self.cubin)(guard.program, cubin.as_mut_ptr().cast()) },
            "nvrtcGetCUBIN",
        )?;
        Ok(cubin)
    }

    fn program_log(&self, program: Program) -> String {
        let mut size = 0usize;
        // SAFETY: live program, valid out pointer.
        if unsafe { (self.log_size)(program, &mut size) } != 0 || size == 0 {
            return "(no log)".into();
        }
        let mut log = vec![0u8; size];
        // SAFETY: buffer of the size NVRTC reported.
        if unsafe { (self.log)(program, log.as_mut_ptr().cast()) } != 0 {
            return "(log unavailable)".into();
        }
        String::from_utf8_lossy(&log)
            .trim_end_matches('\0')
            .to_string()
    }
}
