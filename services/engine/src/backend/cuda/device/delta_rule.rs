//! The gated delta rule on the GPU: the chunked form (`gated_delta_rule_chunked`, prefill) and
//! the recurrent form (`gated_delta_rule_recurrent`, decode) of `kernels/delta_rule.cu`, which
//! form each segment takes, and the start-up self-check that holds the chunked kernel to the
//! recurrent one before it is used.
//!
//! Owns: the launches of both kernels, the chunked kernel's shared-memory sizing, the choice per
//! segment ([`DeltaRuleForm`]: `Auto` = chunked for segments of more than one token, recurrent
//! for single tokens; `Chunked` / `Recurrent` = that form everywhere) and the self-check.
//! Must not touch: the model's choice of form, other ops.
//!
//! The chunked kernel is used only if it passed the self-check at start-up
//! ([`DeviceInfo::delta_rule_path`] says `chunked`); otherwise, and for shapes it does not take
//! (`dk` over [`CHUNKED_MAX_KEY_DIM`] or more shared memory than the GPU gives a block), every
//! form runs the recurrent kernel, which computes the same function.
//!
//! [`DeviceInfo::delta_rule_path`]: super::DeviceInfo::delta_rule_path

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::self_checks::self_check_values;
use super::{driver_error, int, CudaBackend, CudaRecurrentState, CudaTensor};
use crate::backend::cuda::CudaError;
use crate::backend::{DeltaRuleForm, DeltaRuleSpec, Segment};

/// `DR_CHUNK` in `kernels/delta_rule.cu` (the CPU's `DELTA_RULE_CHUNK`).
const CHUNK: usize = 64;
/// `DR_COLUMNS`: value columns per block of the chunked kernel.
const CHUNK_COLUMNS: usize = 32;
/// `DR_THREADS`: threads per block of the chunked kernel.
const CHUNK_THREADS: u32 = 256;
/// The largest key head dim the chunked kernel takes (its shared memory grows with `dk`).
pub(super) const CHUNKED_MAX_KEY_DIM: usize = 256;
/// The largest value head dim the recurrent kernel takes (one thread per column).
const RECURRENT_MAX_VALUE_DIM: usize = 1024;
/// `DeviceInfo::delta_rule_path` values.
pub(super) const PATH_CHUNKED: &str = "chunked";
pub(super) const PATH_RECURRENT: &str = "recurrent";
/// The self-check's limit on max |chunked − recurrent| / max(1, max |recurrent|), outputs and
/// states alike. The two forms differ only by f32 reassociation (~1e-7 on this case).
const SELF_CHECK_TOLERANCE: f32 = 1e-4;

/// Dynamic shared memory of the chunked kernel, in bytes (the layout in `kernels/delta_rule.cu`).
fn chunked_shared_bytes(dk: usize) -> usize {
    let row_stride = dk | 1;
    std::mem::size_of::<f32>()
        * (2 * CHUNK * row_stride
            + CHUNK * CHUNK
            + CHUNK * CHUNK_COLUMNS
            + dk * CHUNK_COLUMNS
            + 4 * CHUNK)
}

/// Which kernel runs a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kernel {
    Chunked,
    Recurrent,
}

impl CudaBackend {
    /// Whether the chunked kernel may run this shape here (it passed the self-check, `dk` is in
    /// range and its shared memory fits).
    fn chunked_available(&self, dk: usize) -> bool {
        self.info.delta_rule_path == PATH_CHUNKED && self.chunked_fits(dk)
    }

    fn chunked_fits(&self, dk: usize) -> bool {
        dk <= CHUNKED_MAX_KEY_DIM && chunked_shared_bytes(dk) <= self.info.shared_memory_per_block
    }

    /// The gated delta rule of [`crate::backend::Backend::gated_delta_rule`] over `segments`,
    /// each segment in the form `form` asks for where the chunked kernel is available.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_gated_delta_rule(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        g: &CudaTensor,
        beta: &CudaTensor,
        spec: &DeltaRuleSpec,
        form: DeltaRuleForm,
        segments: &mut [Segment<'_, CudaRecurrentState>],
    ) -> Result<CudaTensor, CudaError> {
        let chunked = self.chunked_available(spec.key_head_dim);
        self.delta_rule_segments(q, k, v, g, beta, spec, segments, |tokens| {
            let wants_chunked = match form {
                DeltaRuleForm::Auto => tokens > 1,
                DeltaRuleForm::Chunked => true,
                DeltaRuleForm::Recurrent => false,
            };
            if chunked && wants_chunked {
                Kernel::Chunked
            } else {
                Kernel::Recurrent
            }
        })
    }

    /// Launches one kernel per segment (`choose` picks it from the segment's token count).
    #[allow(clippy::too_many_arguments)]
    fn delta_rule_segments(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        g: &CudaTensor,
        beta: &CudaTensor,
        spec: &DeltaRuleSpec,
        segments: &mut [Segment<'_, CudaRecurrentState>],
        choose: impl Fn(usize) -> Kernel,
    ) -> Result<CudaTensor, CudaError> {
        let (dk, dv, nv, nk) = (
            spec.key_head_dim,
            spec.value_head_dim,
            spec.value_heads,
            spec.key_heads,
        );
        if dv == 0 || dv > RECURRENT_MAX_VALUE_DIM || dk == 0 || nk == 0 || nv == 0 {
            return Err(CudaError::Invalid {
                problem: format!(
                    "gated_delta_rule: dk {dk}, dv {dv} (at most {RECURRENT_MAX_VALUE_DIM}), nk {nk}, nv {nv}"
                ),
            });
        }
        let rows = q.rows;
        let shapes = [
            ("q", q.rows, q.cols, nk * dk),
            ("k", k.rows, k.cols, nk * dk),
            ("v", v.rows, v.cols, nv * dv),
            ("g", g.rows, g.cols, nv),
            ("beta", beta.rows, beta.cols, nv),
        ];
        for (what, r, c, expected) in shapes {
            if r != rows || c != expected {
                return Err(CudaError::Invalid {
                    problem: format!(
                        "gated_delta_rule: {what} is {r}×{c}, expected {rows}×{expected}"
                    ),
                });
            }
        }
        let (q_data, k_data, v_data) = (&*q.data, &*k.data, &*v.data);
        let (g_data, beta_data) = (&*g.data, &*beta.data);
        let mut out = self.output(rows, nv * dv)?;
        let (nk_arg, nv_arg, dk_arg, dv_arg) = (
            int(nk, "key heads")?,
            int(nv, "value heads")?,
            int(dk, "dk")?,
            int(dv, "dv")?,
        );
        let recurrent = LaunchConfig {
            grid_dim: (nv as u32, 1, 1),
            block_dim: ((dv as u32).div_ceil(32) * 32, 1, 1),
            shared_mem_bytes: (2 * dk * std::mem::size_of::<f32>()) as u32,
        };
        let chunked = LaunchConfig {
            grid_dim: (nv as u32, dv.div_ceil(CHUNK_COLUMNS) as u32, 1),
            block_dim: (CHUNK_THREADS, 1, 1),
            shared_mem_bytes: chunked_shared_bytes(dk) as u32,
        };
        for segment in segments.iter_mut() {
            let n = segment.rows.len();
            if n == 0 {
                continue;
            }
            if segment.rows.end > rows || segment.state.spec != *spec {
                return Err(CudaError::Invalid {
                    problem: format!(
                        "gated_delta_rule: segment rows {:?} of {rows}, state {:?} for {spec:?}",
                        segment.rows, segment.state.spec
                    ),
                });
            }
            let (row_start, n_arg) = (int(segment.rows.start, "row")?, int(n, "rows")?);
            let state = &mut segment.state.state;
            let output = &mut *out.data;
            match choose(n) {
                Kernel::Chunked => {
                    if !self.chunked_fits(dk) {
                        return Err(CudaError::Invalid {
                            problem: format!(
                                "gated_delta_rule_chunked: dk {dk} needs {} bytes of shared memory, the GPU gives {} (dk at most {CHUNKED_MAX_KEY_DIM})",
                                chunked_shared_bytes(dk),
                                self.info.shared_memory_per_block
                            ),
                        });
                    }
                    launch!(self, "gated_delta_rule_chunked", chunked;
                        q_data, k_data, v_data, g_data, beta_data, state, output, &row_start,
                        &n_arg, &nk_arg, &nv_arg, &dk_arg, &dv_arg)?;
                }
                Kernel::Recurrent => {
                    launch!(self, "gated_delta_rule_recurrent", recurrent;
                        q_data, k_data, v_data, g_data, beta_data, state, output, &row_start,
                        &n_arg, &nk_arg, &nv_arg, &dk_arg, &dv_arg)?;
                }
            }
        }
        Ok(out)
    }

    /// Start-up: reads the GPU's shared memory per block (opt-in), lets the chunked kernel use
    /// it, and runs the self-check. Sets `info.delta_rule_path` to `chunked` only if all of that
    /// worked; otherwise logs a warning naming the problem, and the recurrent kernel runs every
    /// form for the life of the process.
    pub(super) fn start_chunked_delta_rule(&mut self) {
        self.info.delta_rule_path = PATH_RECURRENT;
        match self.enable_chunked_delta_rule() {
            Ok(worst) => {
                self.info.delta_rule_path = PATH_CHUNKED;
                tracing::info!(
                    "chunked gated delta rule passed its start-up check (max |Δ| / scale {worst:.1e} vs the recurrent kernel); multi-token segments use it"
                );
            }
            Err(error) => {
                tracing::warn!(
                    "chunked gated delta rule disabled, the recurrent kernel runs every form: {error}"
                );
                // A failed check may have left an error on the stream or in the slot: drain the
                // stream and clear the slot (nothing else has run yet).
                let _ = self.stream.synchronize();
            }
        }
    }

    fn enable_chunked_delta_rule(&mut self) -> Result<f32, CudaError> {
        let available = self
            ._context
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(driver_error("reading the shared memory per block (opt-in)"))?;
        self.info.shared_memory_per_block = usize::try_from(available).unwrap_or(0);
        let needed = chunked_shared_bytes(128);
        if needed > self.info.shared_memory_per_block {
            return Err(CudaError::Unsupported {
                problem: format!(
                    "the chunked kernel needs {needed} bytes of shared memory per block at dk 128; this GPU gives {}",
                    self.info.shared_memory_per_block
                ),
            });
        }
        self.function("gated_delta_rule_chunked")?
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                available,
            )
            .map_err(driver_error(
                "raising the chunked delta rule's dynamic shared memory limit",
            ))?;
        self.check_chunked_delta_rule()
    }

    /// Two segments (1 and 150 tokens: a one-token chunk, two full chunks and a partial one)
    /// with non-zero initial states through both kernels; nk 2, nv 4 (two value heads per key
    /// head), dk = dv = 64 (two column tiles). Returns the worst of max |Δ| / max(1, max |ref|)
    /// over the outputs and the final states.
    fn check_chunked_delta_rule(&self) -> Result<f32, CudaError> {
        let spec = DeltaRuleSpec {
            key_heads: 2,
            value_heads: 4,
            key_head_dim: 64,
            value_head_dim: 64,
        };
        let lengths = [1usize, 150];
        let total: usize = lengths.iter().sum();
        let mut next = self_check_values(0x2545_f491_4f6c_dd1d);
        let mut values = |count: usize, map: &dyn Fn(f32) -> f32| -> Vec<f32> {
            (0..count).map(|_| map(next())).collect()
        };
        let (nk, nv, dk, dv) = (2, 4, 64, 64);
        let q = values(total * nk * dk, &|x| x);
        let k = values(total * nk * dk, &|x| x);
        let v = values(total * nv * dv, &|x| x);
        let g = values(total * nv, &|x| -x.abs() * 0.5);
        let beta = values(total * nv, &|x| 0.5 + 0.5 * x);
        let states: Vec<Vec<f32>> = lengths
            .iter()
            .map(|_| values(nv * dk * dv, &|x| 0.5 * x))
            .collect();
        let tensor = |values: &[f32], cols: usize| -> Result<CudaTensor, CudaError> {
            Ok(CudaTensor {
                rows: total,
                cols,
                data: std::mem::ManuallyDrop::new(self.upload_f32(values)?),
                pool: None,
            })
        };
        let inputs = (
            tensor(&q, nk * dk)?,
            tensor(&k, nk * dk)?,
            tensor(&v, nv * dv)?,
            tensor(&g, nv)?,
            tensor(&beta, nv)?,
        );
        let read = |data: &CudaSlice<f32>| {
            self.stream
                .memcpy_dtov(data)
                .map_err(driver_error("reading the delta rule check back"))
        };
        let mut results = Vec::new();
        for kernel in [Kernel::Chunked, Kernel::Recurrent] {
            let mut owned = Vec::new();
            for initial in &states {
                owned.push(CudaRecurrentState {
                    spec,
                    state: self.upload_f32(initial)?,
                });
            }
            let mut start = 0;
            let mut segments = Vec::new();
            for (state, &length) in owned.iter_mut().zip(&lengths) {
                segments.push(Segment {
                    rows: start..start + length,
                    start_position: 0,
                    state,
                });
                start += length;
            }
            let out = self.delta_rule_segments(
                &inputs.0,
                &inputs.1,
                &inputs.2,
                &inputs.3,
                &inputs.4,
                &spec,
                &mut segments,
                |_| kernel,
            )?;
            self.stream
                .synchronize()
                .map_err(driver_error("running the delta rule check"))?;
            let mut values = read(&out.data)?;
            for state in &owned {
                values.extend(read(&state.state)?);
            }
            results.push(values);
        }
        let (chunked, recurrent) = (&results[0], &results[1]);
        let scale = recurrent.iter().fold(1.0f32, |a, v| a.max(v.abs()));
        let difference = chunked
            .iter()
            .zip(recurrent)
            .map(|(a, b)| (a - b).abs())
            .fold(
                0.0f32,
                |a, d| if d.is_nan() { f32::INFINITY } else { a.max(d) },
            )
            / scale;
        if difference.is_nan() || difference > SELF_CHECK_TOLERANCE {
            return Err(CudaError::Invalid {
                problem: format!(
                    "on {lengths:?} tokens (nk {nk}, nv {nv}, dk {dk}, dv {dv}) the chunked kernel differs from the recurrent one by {difference:.2e} of the largest value (allowed {SELF_CHECK_TOLERANCE:.0e})"
                ),
            });
        }
        Ok(difference)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_kernels() {
        use crate::backend::cuda::kernels::kernel_define;
        assert_eq!(CHUNK as i64, kernel_define("delta_rule", "DR_CHUNK"));
        assert_eq!(
            CHUNK_COLUMNS as i64,
            kernel_define("delta_rule", "DR_COLUMNS")
        );
        assert_eq!(
            i64::from(CHUNK_THREADS),
            kernel_define("delta_rule", "DR_THREADS")
        );
    }
}
