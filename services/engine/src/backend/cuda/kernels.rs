//! The CUDA C sources of `kernels/`, embedded in the binary, and their compiled cache on disk.
//!
//! Owns: the list of kernel files and the functions each must define; compiling them with NVRTC
//! for the GPU present; the on-disk cache `$XDG_CACHE_HOME/ninfer/kernels/<file>-<hash>.cubin`
//! (else `$HOME/.cache/...`), keyed by the source, the target arch, the driver version and the
//! NVRTC version, written under a temporary name and renamed so a crash never leaves a torn file.
//! Must not touch: kernel launches and tensors (see the backend).

use std::path::{Path, PathBuf};

use super::nvrtc::Nvrtc;
use super::CudaError;

/// One file of `kernels/` and the `extern "C"` kernels it defines.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    pub name: &'static str,
    pub source: &'static str,
    pub functions: &'static [&'static str],
}

/// Headers every kernel file may `#include`, as (include name, source): handed to NVRTC with
/// each compile (it reads no files) and part of every cache key.
pub const KERNEL_HEADERS: &[(&str, &str)] = &[
    (
        "common.cuh",
        include_str!("../../../../../kernels/common.cuh"),
    ),
    (
        "mma_common.cuh",
        include_str!("../../../../../kernels/mma_common.cuh"),
    ),
    (
        "attention_common.cuh",
        include_str!("../../../../../kernels/attention_common.cuh"),
    ),
    (
        "experts_common.cuh",
        include_str!("../../../../../kernels/experts_common.cuh"),
    ),
    (
        "matmul_common.cuh",
        include_str!("../../../../../kernels/matmul_common.cuh"),
    ),
    (
        "norm_common.cuh",
        include_str!("../../../../../kernels/norm_common.cuh"),
    ),
];

/// Every kernel file. A kernel added to a file must be listed here so the backend loads it and
/// the NVRTC test checks that it compiled.
pub const KERNEL_SOURCES: &[KernelSource] = &[
    KernelSource {
        name: "elementwise",
        source: include_str!("../../../../../kernels/elementwise.cu"),
        functions: &[
            "embed",
            "embed_bf16",
            "gather_rows",
            "columns",
            "split_interleaved",
            "add_assign",
            "silu_mul_halves",
            "silu_mul",
            "mul_sigmoid",
            "add_sigmoid_scaled_rows",
            "scaled_silu",
            "stream_mix",
            "inject_into_streams",
            "ple_gate",
            "delta_rule_gates",
            "rope",
            "rope_per_frequency",
            "causal_conv1d_silu",
            "causal_conv1d_silu_split3",
            "kv_append",
        ],
    },
    KernelSource {
        name: "norm",
        source: include_str!("../../../../../kernels/norm.cu"),
        functions: &[
            "rms_norm",
            "add_rms_norm",
            "gated_rms_norm",
            "row_weighted_rms_norm",
            "rms_norm_rope",
            "rms_norm_rope_pair",
        ],
    },
    KernelSource {
        name: "matmul",
        source: include_str!("../../../../../kernels/matmul.cu"),
        functions: &[
            "matmul",
            "matmul_bf16",
            "matmul3_bf16",
            "add_norm_matmul3_bf16",
            "matmul_bf16_silu_mul",
            "matmul_bf16_mul_sigmoid",
            "f32_to_bf16",
            "f32_to_bf16_split",
        ],
    },
    KernelSource {
        name: "attention",
        source: include_str!("../../../../../kernels/attention.cu"),
        functions: &[
            "attention",
            "attention_bf16",
            "kv_append_bf16",
            "attention_split",
            "attention_split_bf16",
            "attention_combine",
            "kv_append_batched",
            "kv_append_batched_bf16",
            "attention_split_batched",
            "attention_split_batched_bf16",
            "attention_combine_batched",
            "attention_tiled",
            "attention_tiled_bf16",
            "attention_mma_64",
            "attention_mma_128",
            "attention_mma_256",
        ],
    },
    KernelSource {
        name: "attention_decode",
        source: include_str!("../../../../../kernels/attention_decode.cu"),
        functions: &[
            "attention_decode_bf16_64_16",
            "attention_decode_batched_bf16_64_16",
            "attention_decode_bf16_64_32",
            "attention_decode_batched_bf16_64_32",
            "attention_decode_bf16_128_16",
            "attention_decode_batched_bf16_128_16",
            "attention_decode_bf16_128_32",
            "attention_decode_batched_bf16_128_32",
            "attention_decode_bf16_256_32",
            "attention_decode_batched_bf16_256_32",
            "attention_decode_mma_bf16_64",
            "attention_decode_mma_batched_bf16_64",
            "attention_decode_mma_bf16_128",
            "attention_decode_mma_batched_bf16_128",
            "attention_decode_mma_bf16_256",
            "attention_decode_mma_batched_bf16_256",
        ],
    },
    KernelSource {
        name: "delta_rule",
        source: include_str!("../../../../../kernels/delta_rule.cu"),
        functions: &[
            "gated_delta_rule_recurrent",
            "gated_delta_rule_chunked",
            "gated_delta_rule_chunked_32",
            "gated_delta_rule_chunked_mma",
            "gated_delta_rule_chunked_mma_32",
        ],
    },
    KernelSource {
        name: "experts",
        source: include_str!("../../../../../kernels/experts.cu"),
        functions: &[
            "expert_gate_up",
            "expert_gate_up_tasks",
            "expert_decode_fused",
            "expert_down",
            "expert_down_sum",
            "expert_gate_up_by_expert",
            "expert_down_by_expert",
            "expert_gate_up_grouped",
            "expert_down_grouped",
            "expert_pair_sum",
        ],
    },
    KernelSource {
        name: "experts_mma",
        source: include_str!("../../../../../kernels/experts_mma.cu"),
        functions: &["expert_gate_up_mma", "expert_down_mma"],
    },
    KernelSource {
        name: "router",
        source: include_str!("../../../../../kernels/router.cu"),
        functions: &[
            "route_top_k",
            "route_decode_fused",
            "route_decode_add_norm_fused",
        ],
    },
    KernelSource {
        name: "handoff",
        source: include_str!("../../../../../kernels/handoff.cu"),
        functions: &["handoff_post", "handoff_collect", "mapped_copy"],
    },
    KernelSource {
        name: "qsa",
        source: include_str!("../../../../../kernels/qsa.cu"),
        functions: &[
            "qsa_append",
            "qsa_append_bf16",
            "qsa_pool_blocks",
            "qsa_score_blocks",
            "qsa_select",
            "qsa_attend",
            "qsa_attend_bf16",
            "qsa_attend_merge",
        ],
    },
    KernelSource {
        name: "vision",
        source: include_str!("../../../../../kernels/vision.cu"),
        functions: &[
            "vision_patch_positions",
            "vision_layer_norm",
            "vision_layer_norm_f32",
            "vision_rope_pack",
            "vision_rope_pack_f32",
            "vision_bias_gelu",
            "vision_bias_gelu_f32",
            "vision_add_bias",
            "vision_attention_f32",
            "vision_attention_16",
            "vision_attention_32",
            "vision_attention_64",
            "vision_attention_80",
            "vision_attention_128",
        ],
    },
    KernelSource {
        name: "sampling",
        source: include_str!("../../../../../kernels/sampling.cu"),
        functions: &["logit_candidates_partial", "logit_candidates_merge"],
    },
];

/// 64-bit FNV-1a: stable across builds and platforms (std's hasher is not), enough to tell
/// cache entries apart.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &byte in *part {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // Separator so ("ab", "c") and ("a", "bc") differ.
        hash ^= 0xff;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// The cache key of one kernel file compiled for `arch` by this NVRTC for this driver.
pub fn cache_key(kernel: &KernelSource, arch: u32, driver_version: i32, nvrtc: (i32, i32)) -> u64 {
    let settings = [
        format!("sm_{arch}"),
        format!("driver {driver_version}"),
        format!("nvrtc {}.{}", nvrtc.0, nvrtc.1),
    ];
    let parts: Vec<&[u8]> = std::iter::once(kernel.source)
        .chain(KERNEL_HEADERS.iter().map(|(_, header)| *header))
        .map(str::as_bytes)
        .chain(settings.iter().map(|setting| setting.as_bytes()))
        .collect();
    fnv1a(&parts)
}

/// `$NINFER_KERNEL_CACHE`, else `$XDG_CACHE_HOME/ninfer/kernels`, else
/// `$HOME/.cache/ninfer/kernels`, else a folder under the system temp dir.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("NINFER_KERNEL_CACHE") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir).join("ninfer/kernels");
    }
    if let Some(home) = std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(home).join(".cache/ninfer/kernels");
    }
    std::env::temp_dir().join("ninfer-kernels")
}

/// The cubin of `kernel` for `arch`: read from the cache, or compiled and stored there. Returns
/// the file's path (the driver loads modules from files) and whether it was a cache hit.
pub fn cached_cubin(
    nvrtc: &Nvrtc,
    kernel: &KernelSource,
    arch: u32,
    driver_version: i32,
) -> Result<(PathBuf, bool), CudaError> {
    let key = cache_key(kernel, arch, driver_version, nvrtc.version());
    let file_name = format!("{}-sm_{arch}-{key:016x}.cubin", kernel.name);
    let preferred = cache_dir();
    if let Some(path) = existing(&preferred.join(&file_name)) {
        return Ok((path, true));
    }
    let cubin = nvrtc.compile_cubin(kernel.name, kernel.source, KERNEL_HEADERS, arch)?;
    // An unwritable cache is not fatal: fall back to the temp dir, which every process has.
    let fallback = std::env::temp_dir().join("ninfer-kernels");
    let mut last_error = None;
    for dir in [preferred, fallback] {
        match store(&dir, &file_name, &cubin) {
            Ok(path) => return Ok((path, false)),
            Err(error) => {
                tracing::warn!(dir = %dir.display(), "cannot write the kernel cache: {error}");
                last_error = Some(error);
            }
        }
    }
    Err(CudaError::Cache {
        path: file_name,
        problem: last_error.map(|e| e.to_string()).unwrap_or_default(),
    })
}

fn existing(path: &Path) -> Option<PathBuf> {
    let metadata = std::fs::metadata(path).ok()?;
    (metadata.is_file() && metadata.len() > 0).then(|| path.to_path_buf())
}

fn store(dir: &Path, file_name: &str, bytes: &[u8]) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(file_name);
    let temporary = dir.join(format!("{file_name}.tmp{}", std::process::id()));
    std::fs::write(&temporary, bytes)?;
    std::fs::rename(&temporary, &path)?;
    Ok(path)
}

/// The value of `#define NAME …` in `kernels/FILE.cu`, for the tests that hold the host's
/// mirrored constants to the kernels' (a launch sized from a stale mirror reads or writes out of
/// bounds on the GPU, where no test on this machine would see it). Understands integer literals
/// (decimal or hex, optional `u`), other defines of the same file, `+ - * /` and parentheses;
/// panics on anything else.
#[cfg(test)]
pub(crate) fn kernel_define(file: &str, name: &str) -> i64 {
    let source = KERNEL_SOURCES
        .iter()
        .find(|kernel| kernel.name == file)
        .unwrap_or_else(|| panic!("no kernel file `{file}`"))
        .source;
    // The file's own defines, then those of the headers it is compiled with.
    let body = std::iter::once(source)
        .chain(KERNEL_HEADERS.iter().map(|(_, header)| *header))
        .flat_map(str::lines)
        .find_map(|line| {
            let rest = line.trim_start().strip_prefix("#define ")?;
            let (defined, value) = rest.split_once(char::is_whitespace)?;
            (defined == name).then(|| value.split("//").next().unwrap_or("").trim())
        })
        .unwrap_or_else(|| panic!("kernels/{file}.cu and its headers have no `#define {name}`"));
    let mut tokens: Vec<String> = Vec::new();
    let mut chars = body.chars().peekable();
    while let Some(&c) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
        } else if c.is_ascii_alphanumeric() || c == '_' {
            let mut token = String::new();
            while let Some(&c) = chars
                .peek()
                .filter(|c| c.is_ascii_alphanumeric() || **c == '_')
            {
                token.push(c);
                chars.next();
            }
            tokens.push(token);
        } else {
            tokens.push(c.to_string());
            chars.next();
        }
    }
    let mut at = 0;
    let value = define_sum(file, &tokens, &mut at);
    assert_eq!(
        at,
        tokens.len(),
        "`#define {name} {body}`: unexpected `{:?}`",
        tokens.get(at)
    );
    value
}

#[cfg(test)]
fn define_sum(file: &str, tokens: &[String], at: &mut usize) -> i64 {
    define_left_fold(file, tokens, at, ["+", "-"], define_product)
}

#[cfg(test)]
fn define_product(file: &str, tokens: &[String], at: &mut usize) -> i64 {
    define_left_fold(file, tokens, at, ["*", "/"], define_factor)
}

/// `operand (op operand)*` for one precedence level's two operators, left to right as C does.
#[cfg(test)]
fn define_left_fold(
    file: &str,
    tokens: &[String],
    at: &mut usize,
    operators: [&str; 2],
    operand: fn(&str, &[String], &mut usize) -> i64,
) -> i64 {
    let mut value = operand(file, tokens, at);
    while let Some(op) = tokens
        .get(*at)
        .filter(|token| operators.contains(&token.as_str()))
        .cloned()
    {
        *at += 1;
        let right = operand(file, tokens, at);
        value = match op.as_str() {
            "+" => value + right,
            "-" => value - right,
            "*" => value * right,
            _ => value / right,
        };
    }
    value
}

#[cfg(test)]
fn define_factor(file: &str, tokens: &[String], at: &mut usize) -> i64 {
    let token = tokens
        .get(*at)
        .unwrap_or_else(|| panic!("a define of kernels/{file}.cu ends early"))
        .clone();
    *at += 1;
    if token == "(" {
        let value = define_sum(file, tokens, at);
        assert_eq!(
            tokens.get(*at).map(String::as_str),
            Some(")"),
            "unbalanced parentheses"
        );
        *at += 1;
        return value;
    }
    let digits = token.trim_end_matches(['u', 'U']);
    if let Some(hex) = digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
    {
        return i64::from_str_radix(hex, 16).unwrap_or_else(|_| panic!("`{token}`"));
    }
    if digits.starts_with(|c: char| c.is_ascii_digit()) {
        return digits.parse().unwrap_or_else(|_| panic!("`{token}`"));
    }
    kernel_define(file, &token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_defines_evaluate_literals_and_expressions() {
        assert_eq!(kernel_define("attention", "TILE_ROWS"), 32);
        assert_eq!(kernel_define("experts", "CHUNK_STRIDE"), 512 / 16 * 20);
        assert_eq!(kernel_define("sampling", "SAMPLING_NONE"), 0xffff_ffff);
        assert_eq!(
            kernel_define("delta_rule", "DR_ROWS_PER_WARP"),
            64 / (256 / 32)
        );
    }

    #[test]
    fn every_listed_function_is_defined_in_its_source() {
        for kernel in KERNEL_SOURCES {
            for function in kernel.functions {
                assert!(
                    defined_kernels(kernel.source)
                        .iter()
                        .any(|(name, _)| name == function),
                    "kernels/{}.cu does not define `{function}`",
                    kernel.name
                );
            }
        }
    }

    /// The `extern "C" __global__` functions `source` defines: each name and where it stands
    /// (`__launch_bounds__(…)` may come between the qualifiers and the name).
    fn defined_kernels(source: &str) -> Vec<(String, usize)> {
        let prefix = "extern \"C\" __global__";
        source
            .match_indices(prefix)
            .filter_map(|(at, _)| {
                let mut rest = source[at + prefix.len()..].trim_start();
                loop {
                    if let Some(after) = rest.strip_prefix("void") {
                        rest = after.trim_start();
                    } else if let Some(after) = rest.strip_prefix("__launch_bounds__") {
                        let close = after.find(')')?;
                        rest = after[close + 1..].trim_start();
                    } else {
                        break;
                    }
                }
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                (!name.is_empty()).then(|| (name, source.len() - rest.len()))
            })
            .collect()
    }

    /// A kernel missing from its module's list is not loaded, and its first launch fails at run
    /// time ("not loaded"): every kernel a source defines must be listed.
    #[test]
    fn every_defined_kernel_is_listed() {
        for kernel in KERNEL_SOURCES {
            let defined = defined_kernels(kernel.source);
            assert!(
                !defined.is_empty(),
                "kernels/{}.cu: no kernels found",
                kernel.name
            );
            for (function, _) in defined {
                assert!(
                    kernel.functions.contains(&function.as_str()),
                    "kernels/{}.cu defines `{function}`, which its KernelSource does not list",
                    kernel.name
                );
            }
        }
    }

    /// kernels/common.cuh: under programmatic dependent launch a kernel may start while its
    /// predecessor runs, so each must wait for it before touching memory; the one statement
    /// allowed before the wait is a `PDL_L2_PREFETCH(…);` of the kernel's weights.
    #[test]
    fn every_listed_function_starts_with_the_pdl_prologue() {
        for kernel in KERNEL_SOURCES {
            for function in kernel.functions {
                let defined = defined_kernels(kernel.source);
                let starts = defined
                    .iter()
                    .filter(|(name, _)| name == function)
                    .any(|&(_, at)| {
                        let rest = &kernel.source[at..];
                        rest.find('{').is_some_and(|open| {
                            let body = rest[open + 1..].trim_start();
                            let body = match body.strip_prefix("PDL_L2_PREFETCH(") {
                                // One statement: its only `;` ends it.
                                Some(prefetch) => prefetch
                                    .split_once(';')
                                    .map_or("", |(_, after)| after.trim_start()),
                                None => body,
                            };
                            body.starts_with("PDL_WAIT_AND_RELEASE();")
                        })
                    });
                assert!(
                    starts,
                    "kernels/{}.cu: `{function}` does not start with PDL_WAIT_AND_RELEASE()",
                    kernel.name
                );
            }
        }
    }

    #[test]
    fn cache_keys_change_with_arch_driver_and_nvrtc() {
        let kernel = &KERNEL_SOURCES[0];
        let base = cache_key(kernel, 90, 13000, (13, 0));
        assert_ne!(base, cache_key(kernel, 89, 13000, (13, 0)));
        assert_ne!(base, cache_key(kernel, 90, 12080, (13, 0)));
        assert_ne!(base, cache_key(kernel, 90, 13000, (12, 9)));
        assert_eq!(base, cache_key(kernel, 90, 13000, (13, 0)));
    }
}
