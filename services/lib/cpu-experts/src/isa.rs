//! Instruction-set paths and run-time CPU feature detection.
//!
//! Owns: the `KernelIsa` enum (the `--kernel-isa` choices), detection of what this CPU and OS
//! support, and the one-time Linux permission request that AMX tile state needs.

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

use crate::KernelError;

/// One kernel path. Each path also runs everything the path below it can.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum KernelIsa {
    /// Portable Rust; the reference the tests compare every other path with.
    Scalar,
    /// AVX2 + FMA + F16C: weights dequantized to f32 and multiplied with f32 activations.
    Avx2,
    /// AVX-512F/BW: as AVX2, 16 lanes.
    Avx512,
    /// AVX-512 VNNI (int8 dot products on activations quantized on the fly) and AVX-512 BF16.
    Avx512Vnni,
    /// AMX-BF16 tiles for batches of at least [`AMX_MIN_TOKENS`] tokens per expert, the
    /// AVX-512 VNNI path for smaller ones (decode).
    Amx,
}

/// Tokens per expert from which the AMX path uses tiles instead of VNNI streaming kernels.
/// One tile holds 16 tokens; below that the tiles are mostly padding.
pub const AMX_MIN_TOKENS: usize = 16;

impl KernelIsa {
    pub const ALL: [KernelIsa; 5] = [
        KernelIsa::Scalar,
        KernelIsa::Avx2,
        KernelIsa::Avx512,
        KernelIsa::Avx512Vnni,
        KernelIsa::Amx,
    ];

    pub fn name(self) -> &'static str {
        match self {
            KernelIsa::Scalar => "scalar",
            KernelIsa::Avx2 => "avx2",
            KernelIsa::Avx512 => "avx512",
            KernelIsa::Avx512Vnni => "avx512-vnni",
            KernelIsa::Amx => "amx",
        }
    }

    /// Whether this CPU (and, for AMX, the OS) can run the path.
    pub fn is_supported(self) -> bool {
        let features = cpu_features();
        match self {
            KernelIsa::Scalar => true,
            KernelIsa::Avx2 => features.avx2_fma_f16c,
            KernelIsa::Avx512 => features.avx2_fma_f16c && features.avx512_f_bw_vl,
            KernelIsa::Avx512Vnni => {
                features.avx2_fma_f16c
                    && features.avx512_f_bw_vl
                    && features.avx512_vnni
                    && features.avx512_bf16
            }
            KernelIsa::Amx => {
                KernelIsa::Avx512Vnni.is_supported()
                    && features.amx_tile_bf16
                    && amx_permission_granted()
            }
        }
    }

    /// Every path this machine supports, slowest first.
    pub fn supported() -> Vec<KernelIsa> {
        KernelIsa::ALL
            .into_iter()
            .filter(|isa| isa.is_supported())
            .collect()
    }

    /// The fastest supported path.
    pub fn best() -> KernelIsa {
        KernelIsa::ALL
            .into_iter()
            .rev()
            .find(|isa| isa.is_supported())
            .unwrap_or(KernelIsa::Scalar)
    }

    /// `Ok(self)` when supported, else an error that lists what is.
    pub fn require_supported(self) -> Result<KernelIsa, KernelError> {
        if self.is_supported() {
            Ok(self)
        } else {
            let names: Vec<&str> = KernelIsa::supported().iter().map(|i| i.name()).collect();
            Err(KernelError::UnsupportedIsa(
                self.name().to_string(),
                names.join(", "),
            ))
        }
    }
}

impl fmt::Display for KernelIsa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KernelIsa {
    type Err = KernelError;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        KernelIsa::ALL
            .into_iter()
            .find(|isa| isa.name().eq_ignore_ascii_case(text.trim()))
            .ok_or_else(|| KernelError::UnknownIsa(text.to_string()))
    }
}

/// CPU features the kernels care about, detected once.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuFeatures {
    pub avx2_fma_f16c: bool,
    pub avx512_f_bw_vl: bool,
    pub avx512_vnni: bool,
    pub avx512_bf16: bool,
    /// AMX-TILE and AMX-BF16 in CPUID (the OS permission is separate).
    pub amx_tile_bf16: bool,
}

pub fn cpu_features() -> CpuFeatures {
    static FEATURES: OnceLock<CpuFeatures> = OnceLock::new();
    *FEATURES.get_or_init(detect_features)
}

#[cfg(target_arch = "x86_64")]
fn detect_features() -> CpuFeatures {
    let avx2_fma_f16c = std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c");
    let avx512_f_bw_vl = std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl");
    // AMX detection macros are not stable yet: read CPUID leaf 7 directly
    // (EDX bit 22 AMX-BF16, bit 24 AMX-TILE).
    // Leaf 7 sub-leaf 0 exists whenever the max leaf is ≥ 7, which we check first.
    let amx_tile_bf16 = {
        let max_leaf = std::arch::x86_64::__cpuid(0).eax;
        if max_leaf >= 7 {
            let leaf7 = std::arch::x86_64::__cpuid_count(7, 0);
            (leaf7.edx >> 22) & 1 == 1 && (leaf7.edx >> 24) & 1 == 1
        } else {
            false
        }
    };
    CpuFeatures {
        avx2_fma_f16c,
        avx512_f_bw_vl,
        avx512_vnni: std::arch::is_x86_feature_detected!("avx512vnni"),
        avx512_bf16: std::arch::is_x86_feature_detected!("avx512bf16"),
        amx_tile_bf16,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_features() -> CpuFeatures {
    CpuFeatures::default()
}

/// Linux keeps AMX tile state disabled per process until it is requested with
/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`; a tile instruction before that
/// raises SIGILL. Requested once, the answer cached.
pub fn amx_permission_granted() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(request_amx_permission)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_amx_permission() -> bool {
    if !cpu_features().amx_tile_bf16 {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM only changes this process's permitted
    // xsave features; it reads no memory of ours.
    let result = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    result == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request_amx_permission() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for isa in KernelIsa::ALL {
            assert_eq!(isa.name().parse::<KernelIsa>().unwrap(), isa);
        }
        assert!("sse9".parse::<KernelIsa>().is_err());
    }

    #[test]
    fn scalar_is_always_supported() {
        assert!(KernelIsa::Scalar.is_supported());
        assert!(KernelIsa::supported().contains(&KernelIsa::best()));
    }
}
