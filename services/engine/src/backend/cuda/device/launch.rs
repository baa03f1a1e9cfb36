//! Kernel launches: the loaded kernel modules, a launch's argument list, and the two ways a
//! launch reaches the driver — plain `cuLaunchKernel` (the reference), or `cuLaunchKernelEx`
//! with programmatic dependent launch (PDL) on sm_90+.
//!
//! Owns: [`KernelModules`] (the cubins loaded into the context, unloaded with the backend),
//! [`Kernel`] (one function's handle), [`KernelArgs`] (what the `launch!` macro and the few
//! hand-built launches collect), [`Pdl`] (whether and how launches carry the PDL attribute) and
//! [`super::CudaBackend::launch_kernel`].
//! Must not touch: which kernel an op runs, or its grid.
//!
//! Why not cudarc's `launch_builder`: its argument list and the function handle are private, and
//! PDL needs `cuLaunchKernelEx` with the same handle and arguments. [`KernelArgs`] marshals
//! arguments exactly as cudarc's `PushKernelArg` does (a pointer to each scalar, a pointer to a
//! copy of each buffer's device address, the buffers' sync guards kept until after the launch),
//! and the plain path is the same `cudarc::driver::result::launch_kernel` call the builder makes.
//! (The backend turns cudarc's event tracking off at start-up, so the guards record nothing.)
//!
//! PDL: a launch with `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 1` may start its
//! blocks while the kernel before it on the stream is still running; every kernel of
//! `kernels/*.cu` begins with `PDL_WAIT_AND_RELEASE()` (kernels/common.cuh says why that keeps
//! stream order for memory; a unit test in kernels.rs holds every kernel to it). Only launches
//! of these kernels carry the attribute: cuBLAS's do not, and memcpy / memset / events keep full
//! serialization. PDL changes no result, only when blocks start.

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
    DriverError, SyncOnDrop,
};

use super::driver::describe;
use crate::backend::cuda::CudaError;

/// `cuDriverGetVersion` of CUDA 12.3, the first whose stream capture records PDL launches as
/// programmatic graph edges.
pub(super) const PDL_CAPTURE_DRIVER: i32 = 12030;

/// Whether launches carry the PDL attribute (decided once at start-up, [`Pdl::decide`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pdl {
    /// Plain launches only (option off, GPU below sm_90, or no `cuLaunchKernelEx`).
    Off,
    /// Every kernel launch, also while a step graph is being captured.
    On,
    /// Outside stream capture only: the driver is older than CUDA 12.3, whose capture may reject
    /// or drop the attribute, so launches recorded into a step graph stay plain (their graphs
    /// keep full kernel-to-kernel edges).
    OutsideCapture,
}

impl Pdl {
    /// PDL for `options_allow` (`CudaOptions::programmatic_dependent_launch`) on a GPU of
    /// `compute_capability` whose driver (`driver_version`) does or does not export
    /// `cuLaunchKernelEx`; with the reason when it is off.
    pub fn decide(
        options_allow: bool,
        compute_capability: (i32, i32),
        driver_version: i32,
        has_launch_ex: bool,
    ) -> (Pdl, Option<String>) {
        let (major, minor) = compute_capability;
        if !options_allow {
            (Pdl::Off, Some("off in the options (--cuda-pdl off)".into()))
        } else if major < 9 {
            (
                Pdl::Off,
                Some(format!(
                    "the GPU is sm_{major}{minor}; PDL needs sm_90 or newer"
                )),
            )
        } else if !has_launch_ex {
            (
                Pdl::Off,
                Some("the CUDA driver does not export cuLaunchKernelEx".into()),
            )
        } else if driver_version < PDL_CAPTURE_DRIVER {
            (
                Pdl::OutsideCapture,
                Some(format!(
                    "driver {driver_version} predates CUDA 12.3: step graphs are recorded with plain launches"
                )),
            )
        } else {
            (Pdl::On, None)
        }
    }

    /// Whether any launch may carry the attribute.
    pub fn in_use(self) -> bool {
        self != Pdl::Off
    }
}

/// One kernel of the loaded modules.
pub(super) struct Kernel {
    pub(super) function: sys::CUfunction,
    pub(super) name: &'static str,
    /// Its `__shared__` arrays (`CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES`), which every block takes
    /// on top of the launch's dynamic shared memory.
    pub(super) static_shared_bytes: usize,
}

/// Refuses a launch whose block would take more shared memory (`static_bytes` of the kernel's
/// own arrays + `dynamic_bytes`) than `limit`, the GPU's opt-in maximum or the cap the backend
/// was opened with. The driver would refuse a launch over the GPU's own limit too, but not one
/// over a cap: this is what makes a capped run fail where a consumer card would.
pub(super) fn check_shared_memory(
    kernel: &str,
    static_bytes: usize,
    dynamic_bytes: usize,
    limit: usize,
) -> Result<(), CudaError> {
    let total = static_bytes + dynamic_bytes;
    if total > limit {
        return Err(CudaError::Invalid {
            problem: format!(
                "kernel `{kernel}` asks for {total} bytes of shared memory per block ({static_bytes} static + {dynamic_bytes} dynamic); the limit is {limit}"
            ),
        });
    }
    Ok(())
}

// SAFETY: a CUfunction is a handle valid in every thread for as long as its module is loaded
// (the backend keeps the modules as long as the kernels: `KernelModules` outlives them).
unsafe impl Send for Kernel {}
// SAFETY: as above; the handle is never mutated (attributes are set through the driver).
unsafe impl Sync for Kernel {}

impl Kernel {
    /// `cuFuncSetAttribute`.
    pub fn set_attribute(
        &self,
        attribute: sys::CUfunction_attribute,
        value: i32,
    ) -> Result<(), DriverError> {
        // SAFETY: the function handle is live (its module is loaded).
        unsafe {
            cudarc::driver::result::function::set_function_attribute(
                self.function,
                attribute,
                value,
            )
        }
    }
}

/// The kernel modules loaded into the backend's context; unloaded (context bound first) when
/// the backend dies. Holds the context so it outlives them.
pub(super) struct KernelModules {
    context: Arc<CudaContext>,
    modules: Vec<sys::CUmodule>,
}

// SAFETY: module handles are valid in every thread of the process while loaded; they are only
// unloaded in `drop`, with the context bound.
unsafe impl Send for KernelModules {}
// SAFETY: as above; nothing mutates the handles.
unsafe impl Sync for KernelModules {}

impl KernelModules {
    pub fn new(context: Arc<CudaContext>) -> Self {
        KernelModules {
            context,
            modules: Vec::new(),
        }
    }

    /// Loads the cubin at `path` (what cudarc's `load_module` does for a file) and returns its
    /// `functions`, by name.
    pub fn load(
        &mut self,
        path: &std::path::Path,
        functions: &[&'static str],
    ) -> Result<Vec<(&'static str, Kernel)>, CudaError> {
        let what = || format!("loading module {}", path.display());
        let name = path
            .to_str()
            .and_then(|text| CString::new(text).ok())
            .ok_or_else(|| CudaError::Cache {
                path: path.display().to_string(),
                problem: "the kernel cache path is not UTF-8 (set NINFER_KERNEL_CACHE)".into(),
            })?;
        self.context
            .bind_to_thread()
            .map_err(|error| CudaError::Driver {
                what: what(),
                message: describe(&error),
            })?;
        let module =
            cudarc::driver::result::module::load(name).map_err(|error| CudaError::Driver {
                what: what(),
                message: describe(&error),
            })?;
        let found: Result<Vec<_>, CudaError> = functions
            .iter()
            .map(|&function| {
                let c_name = CString::new(function).map_err(|_| CudaError::Invalid {
                    problem: format!("kernel name `{function}` holds a NUL"),
                })?;
                // SAFETY: `module` was just loaded.
                let handle =
                    unsafe { cudarc::driver::result::module::get_function(module, c_name) }
                        .map_err(|error| CudaError::Driver {
                            what: format!("loading kernel `{function}`"),
                            message: describe(&error),
                        })?;
                // SAFETY: `handle` was just returned by the driver for a loaded module.
                let static_shared_bytes = unsafe {
                    cudarc::driver::result::function::get_function_attribute(
                        handle,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                    )
                }
                .map_err(|error| CudaError::Driver {
                    what: format!("reading the static shared memory of `{function}`"),
                    message: describe(&error),
                })?;
                Ok((
                    function,
                    Kernel {
                        function: handle,
                        name: function,
                        static_shared_bytes: usize::try_from(static_shared_bytes).unwrap_or(0),
                    },
                ))
            })
            .collect();
        match found {
            // From here the module stays loaded as long as `self`.
            Ok(_) => self.modules.push(module),
            // SAFETY: loaded above; no handle from it was handed out.
            Err(_) => drop(unsafe { cudarc::driver::result::module::unload(module) }),
        }
        found
    }
}

impl Drop for KernelModules {
    fn drop(&mut self) {
        if self.context.bind_to_thread().is_err() {
            return;
        }
        for module in self.modules.drain(..) {
            // SAFETY: loaded by `load`; the backend's kernels (and its stream's work, which
            // the context's teardown waits for) die with it.
            let _ = unsafe { cudarc::driver::result::module::unload(module) };
        }
    }
}

/// One launch's arguments, in the kernel's parameter order.
pub(super) struct KernelArgs<'a> {
    stream: &'a CudaStream,
    slots: Vec<Slot>,
    /// Buffers' sync guards, dropped after the launch (cudarc's `records`).
    pub(super) guards: Vec<SyncOnDrop<'a>>,
}

enum Slot {
    /// A pointer to the caller's value (a scalar or a `#[repr(C)]` struct).
    Value(*const c_void),
    /// A buffer's device address: the kernel parameter points at this copy.
    Device(sys::CUdeviceptr),
}

impl<'a> KernelArgs<'a> {
    pub fn new(stream: &'a CudaStream) -> Self {
        KernelArgs {
            stream,
            slots: Vec::with_capacity(16),
            guards: Vec::new(),
        }
    }

    /// Appends one argument.
    pub fn arg(&mut self, arg: impl KernelArg<'a>) -> &mut Self {
        arg.push_to(self);
        self
    }

    fn device(&mut self, (address, guard): (sys::CUdeviceptr, SyncOnDrop<'a>)) {
        self.slots.push(Slot::Device(address));
        self.guards.push(guard);
    }

    /// The `void**` parameter array: pointers into `self.slots` (for device addresses) or to
    /// the caller's values, valid while `self` is neither moved nor changed.
    pub(super) fn params(&self) -> Vec<*mut c_void> {
        self.slots
            .iter()
            .map(|slot| match slot {
                Slot::Value(pointer) => pointer.cast_mut(),
                Slot::Device(address) => (address as *const sys::CUdeviceptr).cast_mut().cast(),
            })
            .collect()
    }
}

/// What can be passed to a kernel: scalars and `#[repr(C)]` values by reference
/// ([`KernelValue`]), and device buffers (their address).
pub(super) trait KernelArg<'a> {
    fn push_to(self, args: &mut KernelArgs<'a>);
}

/// A value a kernel takes by value, passed as a pointer to it (cudarc's `DeviceRepr` types the
/// kernels take).
///
/// # Safety
/// The type must have the layout of the kernel's C parameter (a C scalar or a `#[repr(C)]`
/// struct of them).
pub(super) unsafe trait KernelValue {}

macro_rules! kernel_values {
    ($($type:ty),*) => {$(
        // SAFETY: C scalars.
        unsafe impl KernelValue for $type {}
    )*};
}
kernel_values!(i8, u8, i16, u16, i32, u32, i64, u64, f32, f64);

impl<'a, T: KernelValue> KernelArg<'a> for &'a T {
    fn push_to(self, args: &mut KernelArgs<'a>) {
        args.slots.push(Slot::Value((self as *const T).cast()));
    }
}

impl<'a, T> KernelArg<'a> for &'a CudaSlice<T> {
    fn push_to(self, args: &mut KernelArgs<'a>) {
        let stream = args.stream;
        args.device(self.device_ptr(stream));
    }
}

impl<'a, T> KernelArg<'a> for &'a mut CudaSlice<T> {
    fn push_to(self, args: &mut KernelArgs<'a>) {
        let stream = args.stream;
        args.device(self.device_ptr_mut(stream));
    }
}

impl<'a, 'b: 'a, T> KernelArg<'a> for &'a CudaView<'b, T> {
    fn push_to(self, args: &mut KernelArgs<'a>) {
        let stream = args.stream;
        args.device(self.device_ptr(stream));
    }
}

impl<'a, 'b: 'a, T> KernelArg<'a> for &'a mut CudaViewMut<'b, T> {
    fn push_to(self, args: &mut KernelArgs<'a>) {
        let stream = args.stream;
        args.device(self.device_ptr_mut(stream));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_over_the_shared_memory_limit_is_refused_naming_the_kernel() {
        assert!(check_shared_memory("fits", 1024, 100_352, 101_376).is_ok());
        let error = check_shared_memory("gated_delta_rule_chunked", 0, 108_032, 101_376)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("gated_delta_rule_chunked")
                && error.contains("108032")
                && error.contains("101376"),
            "{error}"
        );
        // Static arrays count too.
        assert!(check_shared_memory("static", 4096, 100_000, 101_376).is_err());
    }

    #[test]
    fn pdl_needs_the_option_sm_90_and_launch_ex() {
        assert_eq!(Pdl::decide(true, (9, 0), 12080, true), (Pdl::On, None));
        assert_eq!(Pdl::decide(true, (10, 0), 13000, true).0, Pdl::On);
        assert_eq!(Pdl::decide(false, (9, 0), 12080, true).0, Pdl::Off);
        assert_eq!(Pdl::decide(true, (8, 9), 12080, true).0, Pdl::Off);
        assert_eq!(Pdl::decide(true, (9, 0), 12080, false).0, Pdl::Off);
        let (pdl, why) = Pdl::decide(true, (9, 0), 12020, true);
        assert_eq!(pdl, Pdl::OutsideCapture);
        assert!(why.is_some_and(|why| why.contains("12.3")));
        assert!(!Pdl::Off.in_use() && Pdl::OutsideCapture.in_use() && Pdl::On.in_use());
    }
}
