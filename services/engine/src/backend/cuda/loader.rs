//! Finding and opening the CUDA shared libraries at run time.
//!
//! Owns: the search for `libcuda` (driver), `libnvrtc` (run-time compiler) and `libcublas` (with
//! the `libcublasLt` it needs) across CUDA 12 and CUDA 13 installs, pip wheels and the paths users point at, and the exact list of what was
//! tried when nothing is found. Libraries are opened with `dlopen` and never closed (function
//! pointers taken from them stay valid for the life of the process).
//! Must not touch: anything that needs a GPU; CUDA calls beyond looking up symbols.
//!
//! Why not cudarc's own loader alone: cudarc 0.17 built for CUDA 12.8 tries `libnvrtc.so`,
//! `libnvrtc.so.12`, `.so.11`, `.so.10`, `.so.1` through the system search path only, so a
//! CUDA 13 install (`libnvrtc.so.13`) or a pip wheel outside `LD_LIBRARY_PATH` is missed, and it
//! panics when nothing loads (its cuBLAS loader has the same gaps). This loader searches more places and returns a typed error. The
//! driver itself is still used through cudarc: once `libcuda.so.1` is open here (by full path if
//! need be, with `RTLD_GLOBAL`), cudarc's `dlopen("libcuda.so.1")` finds the loaded object by
//! its soname.
//!
//! Environment variables read: `NINFER_NVRTC_PATH` (a `libnvrtc` file or a folder holding one,
//! tried first), `NINFER_CUDA_DRIVER_PATH` (same for `libcuda`), `NINFER_CUBLAS_PATH` (same for
//! `libcublas`; `libcublasLt` is taken from the same folder), `CUDA_PATH`, `CUDA_HOME`,
//! `LD_LIBRARY_PATH`, `VIRTUAL_ENV`, `HOME`.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};

use super::CudaError;

// glibc's dynamic loader (in libc.so.6 since 2.34, libdl before; std links both on linux-gnu).
extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *mut c_char;
}
const RTLD_NOW: c_int = 0x2;
const RTLD_GLOBAL: c_int = 0x100;

/// An opened shared library. Never closed: symbols handed out must stay valid.
#[derive(Debug)]
pub struct Library {
    handle: *mut c_void,
    /// What was passed to `dlopen` (a full path, or a bare name resolved by the system loader).
    pub opened_as: String,
}

// SAFETY: a dlopen handle is a process-wide token; dlsym on it is thread-safe (glibc locks).
unsafe impl Send for Library {}
// SAFETY: as above; the handle is never mutated or closed.
unsafe impl Sync for Library {}

impl Library {
    /// The address of `symbol` as a function pointer of type `F`.
    ///
    /// # Safety
    /// `F` must be an `extern "C"` function pointer type matching the symbol's C signature.
    pub unsafe fn function<F: Copy>(&self, symbol: &str) -> Result<F, CudaError> {
        debug_assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
        let name = CString::new(symbol).map_err(|_| CudaError::MissingSymbol {
            library: self.opened_as.clone(),
            symbol: symbol.to_string(),
        })?;
        // SAFETY: handle came from a successful dlopen; name is NUL-terminated.
        let address = unsafe { dlsym(self.handle, name.as_ptr()) };
        if address.is_null() {
            return Err(CudaError::MissingSymbol {
                library: self.opened_as.clone(),
                symbol: symbol.to_string(),
            });
        }
        // SAFETY: F is a function pointer type of pointer size (caller's contract), and the
        // address is that function's entry point.
        Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) })
    }
}

fn try_open(candidate: &str) -> Result<Library, String> {
    let name = CString::new(candidate).map_err(|_| "path contains NUL".to_string())?;
    // SAFETY: dlopen with a valid C string; RTLD_GLOBAL so later dlopen calls by soname (cudarc)
    // find this same object.
    let handle = unsafe { dlopen(name.as_ptr(), RTLD_NOW | RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local message or NULL.
        let message = unsafe { dlerror() };
        let reason = if message.is_null() {
            "not found".to_string()
        } else {
            // SAFETY: non-NULL dlerror results are NUL-terminated strings.
            unsafe { CStr::from_ptr(message) }
                .to_string_lossy()
                .into_owned()
        };
        return Err(reason);
    }
    Ok(Library {
        handle,
        opened_as: candidate.to_string(),
    })
}

/// One CUDA library to look for: `stem` as in `lib{stem}.so`, and its versioned file names,
/// newest first.
#[derive(Debug, Clone, Copy)]
pub struct LibrarySpec {
    pub what: &'static str,
    pub stem: &'static str,
    pub names: &'static [&'static str],
    pub env_var: &'static str,
    /// Sub-folders of a pip `site-packages` that hold this library.
    pub pip_dirs: &'static [&'static str],
    /// Stem of a library this one links against that may not be on the system search path
    /// (`cublasLt` for `cublas`): before a file is opened by full path, the file of the same
    /// version in the same folder is opened first, so the dependency resolves by soname to it.
    pub companion: Option<&'static str>,
}

pub const NVRTC: LibrarySpec = LibrarySpec {
    what: "NVRTC (the CUDA run-time compiler)",
    stem: "nvrtc",
    names: &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"],
    env_var: "NINFER_NVRTC_PATH",
    pip_dirs: &[
        "nvidia/cu13/lib",
        "nvidia/cuda_nvrtc/lib",
        "nvidia/cu12/lib",
    ],
    companion: None,
};

pub const DRIVER: LibrarySpec = LibrarySpec {
    what: "the CUDA driver",
    stem: "cuda",
    names: &["libcuda.so.1", "libcuda.so"],
    env_var: "NINFER_CUDA_DRIVER_PATH",
    pip_dirs: &[],
    companion: None,
};

pub const CUBLAS: LibrarySpec = LibrarySpec {
    what: "cuBLAS",
    stem: "cublas",
    names: &["libcublas.so.13", "libcublas.so.12", "libcublas.so"],
    env_var: "NINFER_CUBLAS_PATH",
    pip_dirs: &["nvidia/cu13/lib", "nvidia/cublas/lib", "nvidia/cu12/lib"],
    companion: Some("cublasLt"),
};

/// Folders that may hold CUDA libraries, in the order they are searched.
fn search_dirs(spec: &LibrarySpec) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["CUDA_PATH", "CUDA_HOME"] {
        if let Some(root) = std::env::var_os(var) {
            let root = PathBuf::from(root);
            dirs.push(root.join("lib64"));
            dirs.push(root.join("lib"));
            dirs.push(root.join("targets/x86_64-linux/lib"));
        }
    }
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(std::env::split_paths(&paths).filter(|p| !p.as_os_str().is_empty()));
    }
    // /usr/local/cuda, then versioned installs newest first (cuda-13.0 before cuda-12.8).
    let mut installs: Vec<PathBuf> = read_dir_names(Path::new("/usr/local"))
        .into_iter()
        .filter(|name| name.starts_with("cuda-"))
        .map(|name| PathBuf::from("/usr/local").join(name))
        .collect();
    installs.sort_by_key(|p| std::cmp::Reverse(version_key(p)));
    installs.insert(0, PathBuf::from("/usr/local/cuda"));
    for root in installs {
        dirs.push(root.join("lib64"));
        dirs.push(root.join("targets/x86_64-linux/lib"));
    }
    for dir in [
        "/usr/local/nvidia/lib64",
        "/usr/local/nvidia/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib/wsl/lib",
    ] {
        dirs.push(PathBuf::from(dir));
    }
    for site in site_packages() {
        for sub in spec.pip_dirs {
            dirs.push(site.join(sub));
        }
    }
    let mut unique = Vec::new();
    for dir in dirs {
        if !unique.contains(&dir) {
            unique.push(dir);
        }
    }
    unique
}

/// Python `site-packages`/`dist-packages` folders where pip puts `nvidia-*` wheels.
fn site_packages() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(venv).join("lib"));
    }
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(home).join(".local/lib"));
    }
    roots.push(PathBuf::from("/usr/local/lib"));
    roots.push(PathBuf::from("/usr/lib"));
    // Virtual environments under /opt (e.g. /opt/torch/.venv on the GPU machines).
    for name in read_dir_names(Path::new("/opt")) {
        roots.push(PathBuf::from("/opt").join(&name).join(".venv/lib"));
        roots.push(PathBuf::from("/opt").join(&name).join("lib"));
    }
    let mut found = Vec::new();
    for root in roots {
        for name in read_dir_names(&root) {
            if name.starts_with("python3") {
                for leaf in ["site-packages", "dist-packages"] {
                    let dir = root.join(&name).join(leaf);
                    if dir.is_dir() {
                        found.push(dir);
                    }
                }
            }
        }
    }
    found
}

fn read_dir_names(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Numeric parts of a name, for "newest first" ordering (`cuda-13.0` > `cuda-12.8`,
/// `libnvrtc.so.13` > `libnvrtc.so.12` > `libnvrtc.so`).
fn version_key(path: &Path) -> Vec<u64> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    name.split(|c: char| !c.is_ascii_digit())
        .filter(|part| !part.is_empty())
        .filter_map(|part| part.parse().ok())
        .collect()
}

/// `lib{stem}.so*` files in `dir`, newest version first (`libnvrtc-builtins` and `.alt`
/// variants excluded).
fn candidates_in(dir: &Path, spec: &LibrarySpec) -> Vec<PathBuf> {
    let prefix = format!("lib{}.so", spec.stem);
    let mut files: Vec<PathBuf> = read_dir_names(dir)
        .into_iter()
        .filter(|name| name == &prefix || name.starts_with(&format!("{prefix}.")))
        .map(|name| dir.join(name))
        .collect();
    files.sort_by_key(|p| std::cmp::Reverse(version_key(p)));
    files
}

/// `libcublasLt.so.12` next to `libcublas.so.12`: the companion's file of the same version
/// suffix in the same folder, if the spec has a companion and that file exists.
fn companion_of(file: &Path, spec: &LibrarySpec) -> Option<PathBuf> {
    let companion = spec.companion?;
    let name = file.file_name()?.to_str()?;
    let suffix = name.strip_prefix(&format!("lib{}.so", spec.stem))?;
    let sibling = file.with_file_name(format!("lib{companion}.so{suffix}"));
    sibling.is_file().then_some(sibling)
}

/// Opens the library: `$env_var` first (file or folder), then the bare names through the system
/// loader, then every folder of [`search_dirs`]. The error lists every attempt.
pub fn open(spec: &LibrarySpec) -> Result<Library, CudaError> {
    let mut tried: Vec<String> = Vec::new();
    let attempt = |candidate: String, tried: &mut Vec<String>| {
        // A full path: open its companion from the same folder first (a pip wheel's folder is
        // not on the system search path, so the dependency would not resolve otherwise).
        if let Some(companion) = companion_of(Path::new(&candidate), spec) {
            if let Err(reason) = try_open(&companion.to_string_lossy()) {
                tried.push(format!("{} ({reason})", companion.display()));
            }
        }
        match try_open(&candidate) {
            Ok(library) => Some(library),
            Err(reason) => {
                tried.push(format!("{candidate} ({reason})"));
                None
            }
        }
    };
    if let Some(value) = std::env::var_os(spec.env_var) {
        let path = PathBuf::from(&value);
        let files = if path.is_dir() {
            candidates_in(&path, spec)
        } else {
            vec![path.clone()]
        };
        if files.is_empty() {
            tried.push(format!(
                "${}={} (no lib{}.so* in it)",
                spec.env_var,
                path.display(),
                spec.stem
            ));
        }
        for file in files {
            if let Some(library) = attempt(file.to_string_lossy().into_owned(), &mut tried) {
                return Ok(library);
            }
        }
    }
    for name in spec.names {
        if let Some(library) = attempt(name.to_string(), &mut tried) {
            return Ok(library);
        }
    }
    let mut searched = Vec::new();
    for dir in search_dirs(spec) {
        let files = candidates_in(&dir, spec);
        if files.is_empty() {
            searched.push(dir.display().to_string());
        }
        for file in files {
            if let Some(library) = attempt(file.to_string_lossy().into_owned(), &mut tried) {
                return Ok(library);
            }
        }
    }
    if !searched.is_empty() {
        tried.push(format!(
            "no lib{}.so* in: {}",
            spec.stem,
            searched.join(", ")
        ));
    }
    Err(CudaError::LibraryNotFound {
        library: spec.what.to_string(),
        env_var: spec.env_var.to_string(),
        tried,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_versions_sort_first() {
        let mut names = [
            PathBuf::from("libnvrtc.so"),
            PathBuf::from("libnvrtc.so.12"),
            PathBuf::from("libnvrtc.so.13"),
        ];
        names.sort_by_key(|p| std::cmp::Reverse(version_key(p)));
        assert_eq!(names[0], PathBuf::from("libnvrtc.so.13"));
        assert_eq!(names[2], PathBuf::from("libnvrtc.so"));
    }

    #[test]
    fn a_missing_library_lists_what_was_tried() {
        let spec = LibrarySpec {
            what: "a library that does not exist",
            stem: "ninfer-does-not-exist",
            names: &["libninfer-does-not-exist.so.1"],
            env_var: "NINFER_TEST_NO_SUCH_LIBRARY_PATH",
            pip_dirs: &[],
            companion: None,
        };
        let error = open(&spec).map(|_| ()).unwrap_err().to_string();
        assert!(error.contains("libninfer-does-not-exist.so.1"), "{error}");
        assert!(
            error.contains("NINFER_TEST_NO_SUCH_LIBRARY_PATH"),
            "{error}"
        );
    }

    #[test]
    fn cublas_search_covers_cuda_12_13_and_pip_wheels() {
        assert!(CUBLAS.names.contains(&"libcublas.so.13"));
        assert!(CUBLAS.names.contains(&"libcublas.so.12"));
        assert!(CUBLAS.pip_dirs.contains(&"nvidia/cublas/lib"));
        assert_eq!(CUBLAS.env_var, "NINFER_CUBLAS_PATH");
    }

    #[test]
    fn the_companion_is_the_same_version_in_the_same_folder() {
        let dir = tempfile::tempdir().unwrap();
        let cublas = dir.path().join("libcublas.so.12");
        let lt = dir.path().join("libcublasLt.so.12");
        std::fs::write(&cublas, b"").unwrap();
        assert_eq!(companion_of(&cublas, &CUBLAS), None, "no sibling yet");
        std::fs::write(&lt, b"").unwrap();
        assert_eq!(companion_of(&cublas, &CUBLAS), Some(lt));
        assert_eq!(companion_of(&cublas, &NVRTC), None);
    }
}
