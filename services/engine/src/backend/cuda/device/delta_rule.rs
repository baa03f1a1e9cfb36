//! The gated delta rule on the GPU: the chunked form (`gated_delta_rule_chunked`, prefill; and
//! `gated_delta_rule_chunked_mma`, the same on the tensor cores) and the recurrent form
//! (`gated_delta_rule_recurrent`, decode) of `kernels/delta_rule.cu`, which kernel each segment
//! takes, and the start-up self-checks that hold the chunked kernels to the recurrent one before
//! they are used.
//!
//! Owns: the launches of the three kernels, the chunked kernels' shared-memory sizing, the choice
//! per segment ([`DeltaRuleForm`]: `Auto` = chunked for segments of more than one token,
//! recurrent for single tokens; `Chunked` / `Recurrent` = that form everywhere) and the
//! self-checks. Must not touch: the model's choice of form, other ops.
//!
//! The chunked kernel is used only if it passed the self-check at start-up
//! ([`DeviceInfo::delta_rule_path`] says `chunked` or `tensor-core`); otherwise, and for shapes
//! it does not take (`dk` over [`CHUNKED_MAX_KEY_DIM`] or more shared memory than the GPU gives a
//! block), every form runs the recurrent kernel, which computes the same function. With
//! `CudaOptions::tensor_core_prefill` and `tensor_core_delta_rule` (both on by default) the
//! tensor-core kernel gets its own check after that (path `tensor-core`) and then runs the
//! chunked form of segments of at least [`MMA_MIN_ROWS`] rows whose shape it takes
//! ([`mma_supports`]); its operands are split into f16 pairs (hi + lo, three products each), so
//! results stay within ~1e-6 of scale of the f32 kernels. The f32 chunked kernel stays the
//! reference and runs everything else.
//!
//! [`DeviceInfo::delta_rule_path`]: super::DeviceInfo::delta_rule_path

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::self_checks::self_check_values;
use super::{driver_error, int, CudaBackend, CudaRecurrentState, CudaTensor};
use crate::backend::cuda::CudaError;
use crate::backend::{DeltaRuleForm, DeltaRuleSpec, Segment};
use crate::error::EngineError;

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
pub(super) const PATH_TENSOR_CORE: &str = "tensor-core";
/// The self-check's limit on max |chunked − recurrent| / max(1, max |recurrent|), outputs and
/// states alike. The two forms differ only by f32 reassociation (~1e-7 on this case).
const SELF_CHECK_TOLERANCE: f32 = 1e-4;
/// The same limit for the tensor-core kernel. Its operands are f16 pairs (hi + lo: ~2⁻²²
/// relative each), so it lands near the f32 kernels; a lost lo half is ~2⁻¹² off, a misplaced
/// fragment or a state not carried by tenths.
const MMA_SELF_CHECK_TOLERANCE: f32 = 1e-4;

/// `DRT_THREADS`: threads per block of the tensor-core kernel.
const MMA_THREADS: u32 = 256;
/// `DRT_COLUMNS`: value columns per block of the tensor-core kernel.
const MMA_COLUMNS: usize = 32;
/// `DRT_PAD`: f16 of padding per staged row.
const MMA_PAD: usize = 8;
/// `DRT_MAX_KEY_DIM`: the state tiles of a warp's accumulators cover this many key rows.
const MMA_MAX_KEY_DIM: usize = 256;
/// `DRT_TS`, `DRT_RS`, `DRT_PS`, `DRT_VS`: row strides of the tensor-core kernel's f32 A and T,
/// f32 R, f16 P and f16 V' / state copy.
const MMA_TS: usize = CHUNK + 1;
const MMA_RS: usize = MMA_COLUMNS + 4;
const MMA_PS: usize = CHUNK + MMA_PAD;
const MMA_VS: usize = MMA_COLUMNS + MMA_PAD;
/// Segments of at least this many rows take the tensor-core kernel; shorter ones keep the f32
/// chunked kernel (a 64-row chunk of a few rows would be mostly padding, and the f32 kernel skips
/// the rows past a segment's end).
pub(super) const MMA_MIN_ROWS: usize = 16;
/// The key head dim of the tensor-core kernel's self-check (Qwen3-Next's and Qwen3.5's): the
/// GPU must give its block that much shared memory.
const MMA_CHECK_KEY_DIM: usize = 128;

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

/// Dynamic shared memory of the tensor-core kernel, in bytes (the layout in
/// `kernels/delta_rule.cu`): f32 A, T, R and four per-row vectors, then f16 pairs (hi and lo
/// arrays) of K̂, Q̂, P, e^{γ_last−γ} V' and the state tile's copy. V' (also a pair) lives over
/// A ([`MMA_VALUE_PAIR_FITS_OVER_A`]).
fn mma_shared_bytes(dk: usize) -> usize {
    std::mem::size_of::<f32>() * (2 * CHUNK * MMA_TS + CHUNK * MMA_RS + 4 * CHUNK)
        + 2 * std::mem::size_of::<u16>()
            * (2 * CHUNK * (dk + MMA_PAD) + CHUNK * MMA_PS + CHUNK * MMA_VS + dk * MMA_VS)
}

/// The tensor-core kernel keeps V' (hi and lo, `2 · CHUNK · MMA_VS` f16) in A's f32 array,
/// which no phase reads between the triangular solve and the next chunk.
const MMA_VALUE_PAIR_FITS_OVER_A: bool =
    2 * CHUNK * MMA_VS * std::mem::size_of::<u16>() <= CHUNK * MMA_TS * std::mem::size_of::<f32>();
const _: () = assert!(MMA_VALUE_PAIR_FITS_OVER_A);

/// Whether the tensor-core kernel takes `dk` × `dv` heads: its mma tiles are 16 keys deep and
/// its state and value tiles are loaded in pairs of 16-column halves, so both dims must be
/// multiples of 16, and the state tile lives in the accumulators of its warps, which cover
/// [`MMA_MAX_KEY_DIM`] key rows (Qwen3-Next and Qwen3.5 use 128 for both).
fn mma_supports(dk: usize, dv: usize) -> bool {
    dk > 0 && dk % 16 == 0 && dk <= MMA_MAX_KEY_DIM && dv > 0 && dv % 16 == 0
}

/// Which kernel runs a segment (the tests may pick one with
/// [`CudaBackend::gated_delta_rule_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeltaRuleKernel {
    /// `gated_delta_rule_chunked`: chunks of 64 tokens in f32 (the reference of the other two).
    Chunked,
    /// `gated_delta_rule_recurrent`: one token after the other.
    Recurrent,
    /// `gated_delta_rule_chunked_mma`: the chunked form with its matrix products on the tensor
    /// cores (operands as f16 hi + lo pairs, f32 accumulation).
    TensorCore,
}

impl std::fmt::Display for DeltaRuleKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeltaRuleKernel::Chunked => "chunked",
            DeltaRuleKernel::Recurrent => "recurrent",
            DeltaRuleKernel::TensorCore => "tensor-core",
        })
    }
}

impl CudaBackend {
    /// Whether the chunked kernel may run this shape here (it passed the self-check, `dk` is in
    /// range and its shared memory fits).
    fn chunked_available(&self, dk: usize) -> bool {
        self.info.delta_rule_path != PATH_RECURRENT && self.chunked_fits(dk)
    }

    fn chunked_fits(&self, dk: usize) -> bool {
        dk <= CHUNKED_MAX_KEY_DIM && chunked_shared_bytes(dk) <= self.info.shared_memory_per_block
    }

    /// Whether the tensor-core kernel may run this shape here (the options ask for it, it passed
    /// its self-check, and it takes the shape in this GPU's shared memory).
    fn mma_available(&self, dk: usize, dv: usize) -> bool {
        self.info.delta_rule_path == PATH_TENSOR_CORE && self.mma_fits(dk, dv)
    }

    /// Whether prefill segments of `dk` × `dv` heads take the tensor-core kernel here (see
    /// [`DeltaRuleKernel::TensorCore`]); the tests ask before they compare it.
    pub fn tensor_core_delta_rule_takes(&self, dk: usize, dv: usize) -> bool {
        self.mma_available(dk, dv)
    }

    fn mma_fits(&self, dk: usize, dv: usize) -> bool {
        mma_supports(dk, dv) && mma_shared_bytes(dk) <= self.info.shared_memory_per_block
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
        let tensor_cores = self.mma_available(spec.key_head_dim, spec.value_head_dim);
        self.delta_rule_segments(q, k, v, g, beta, spec, segments, |tokens| {
            let wants_chunked = match form {
                DeltaRuleForm::Auto => tokens > 1,
                DeltaRuleForm::Chunked => true,
                DeltaRuleForm::Recurrent => false,
            };
            // The tensor-core kernel is only ever enabled after the f32 one passed its check.
            if !wants_chunked {
                DeltaRuleKernel::Recurrent
            } else if tensor_cores && tokens >= MMA_MIN_ROWS {
                DeltaRuleKernel::TensorCore
            } else if chunked {
                DeltaRuleKernel::Chunked
            } else {
                DeltaRuleKernel::Recurrent
            }
        })
    }

    /// [`Backend::gated_delta_rule`](crate::backend::Backend::gated_delta_rule) with every
    /// segment on `kernel`, whatever the options, the start-up checks and the segment lengths
    /// say (the tests compare the kernels); fails where `kernel` does not take the shape.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_rule_with(
        &self,
        kernel: DeltaRuleKernel,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        g: &CudaTensor,
        beta: &CudaTensor,
        spec: &DeltaRuleSpec,
        segments: &mut [Segment<'_, CudaRecurrentState>],
    ) -> Result<CudaTensor, EngineError> {
        self.delta_rule_segments(q, k, v, g, beta, spec, segments, |_| kernel)
            .map_err(|source| EngineError::Device {
                op: "gated_delta_rule",
                source,
            })
    }

    /// A delta-rule state holding `values` (`[nv, dk, dv]`), for tests that start a sequence
    /// from a state of their choosing.
    pub fn recurrent_state_from(
        &self,
        spec: &DeltaRuleSpec,
        values: &[f32],
    ) -> Result<CudaRecurrentState, EngineError> {
        let expected = spec.value_heads * spec.key_head_dim * spec.value_head_dim;
        let device = |source| EngineError::Device {
            op: "recurrent_state_from",
            source,
        };
        if values.len() != expected {
            return Err(device(CudaError::Invalid {
                problem: format!(
                    "{} state values for {spec:?}, expected {expected}",
                    values.len()
                ),
            }));
        }
        Ok(CudaRecurrentState {
            spec: *spec,
            state: self.upload_f32(values).map_err(device)?,
        })
    }

    /// The values of a delta-rule state (`[nv, dk, dv]`), after the work queued before.
    pub fn recurrent_state_values(
        &self,
        state: &CudaRecurrentState,
    ) -> Result<Vec<f32>, EngineError> {
        self.stream
            .memcpy_dtov(&state.state)
            .map_err(driver_error("reading a delta-rule state back"))
            .map_err(|source| EngineError::Device {
                op: "recurrent_state_values",
                source,
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
        choose: impl Fn(usize) -> DeltaRuleKernel,
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
        let tensor_core = LaunchConfig {
            grid_dim: (nv as u32, dv.div_ceil(MMA_COLUMNS) as u32, 1),
            block_dim: (MMA_THREADS, 1, 1),
            shared_mem_bytes: mma_shared_bytes(dk) as u32,
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
            // The three kernels take the same arguments.
            macro_rules! launch_segment {
                ($kernel:literal, $config:expr) => {
                    launch!(self, $kernel, $config;
                        q_data, k_data, v_data, g_data, beta_data, state, output, &row_start,
                        &n_arg, &nk_arg, &nv_arg, &dk_arg, &dv_arg)
                };
            }
            match choose(n) {
                DeltaRuleKernel::Chunked => {
                    if !self.chunked_fits(dk) {
                        return Err(CudaError::Invalid {
                            problem: format!(
                                "gated_delta_rule_chunked: dk {dk} needs {} bytes of shared memory, the GPU gives {} (dk at most {CHUNKED_MAX_KEY_DIM})",
                                chunked_shared_bytes(dk),
                                self.info.shared_memory_per_block
                            ),
                        });
                    }
                    launch_segment!("gated_delta_rule_chunked", chunked)?;
                }
                DeltaRuleKernel::TensorCore => {
                    if !self.mma_fits(dk, dv) {
                        return Err(CudaError::Invalid {
                            problem: format!(
                                "gated_delta_rule_chunked_mma: dk {dk}, dv {dv} (multiples of 16, dk at most {MMA_MAX_KEY_DIM}) need {} bytes of shared memory, the GPU gives {}",
                                mma_shared_bytes(dk),
                                self.info.shared_memory_per_block
                            ),
                        });
                    }
                    launch_segment!("gated_delta_rule_chunked_mma", tensor_core)?;
                }
                DeltaRuleKernel::Recurrent => {
                    launch_segment!("gated_delta_rule_recurrent", recurrent)?;
                }
            }
        }
        Ok(out)
    }

    /// Start-up: reads the GPU's shared memory per block (opt-in), lets the chunked kernel use
    /// it, and runs the self-check. Sets `info.delta_rule_path` to `chunked` only if all of that
    /// worked; otherwise logs a warning naming the problem, and the recurrent kernel runs every
    /// form for the life of the process. Then, with `tensor_core_prefill`, the same for the
    /// tensor-core kernel (`tensor-core`; on failure the f32 chunked kernel keeps prefill).
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
                return;
            }
        }
        if !(self.options.tensor_core_prefill && self.options.tensor_core_delta_rule) {
            return;
        }
        match self.enable_tensor_core_delta_rule() {
            Ok(worst) => {
                self.info.delta_rule_path = PATH_TENSOR_CORE;
                tracing::info!(
                    "tensor-core gated delta rule passed its start-up check (max |Δ| / scale {worst:.1e} vs the recurrent kernel); prefill segments of at least {MMA_MIN_ROWS} rows use it"
                );
            }
            Err(error) => {
                tracing::warn!(
                    "tensor-core gated delta rule unusable, the f32 chunked kernel does prefill: {error}"
                );
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
        self.check_chunked_delta_rule(DeltaRuleKernel::Chunked, 64, SELF_CHECK_TOLERANCE)
    }

    /// Lets the tensor-core kernel use the shared memory it needs at [`MMA_CHECK_KEY_DIM`] (the
    /// opt-in maximum, as the chunked kernel, so larger key dims fit where the GPU has room) and
    /// runs its self-check. Needs `info.shared_memory_per_block`, which the chunked kernel's
    /// start-up read.
    fn enable_tensor_core_delta_rule(&mut self) -> Result<f32, CudaError> {
        let needed = mma_shared_bytes(MMA_CHECK_KEY_DIM);
        let available = self.info.shared_memory_per_block;
        if needed > available {
            return Err(CudaError::Unsupported {
                problem: format!(
                    "the tensor-core kernel needs {needed} bytes of shared memory per block at dk {MMA_CHECK_KEY_DIM}; this GPU gives {available}"
                ),
            });
        }
        let limit = i32::try_from(available).unwrap_or(i32::MAX);
        self.function("gated_delta_rule_chunked_mma")?
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                limit,
            )
            .map_err(driver_error(
                "raising the tensor-core delta rule's dynamic shared memory limit",
            ))?;
        self.check_chunked_delta_rule(
            DeltaRuleKernel::TensorCore,
            MMA_CHECK_KEY_DIM,
            MMA_SELF_CHECK_TOLERANCE,
        )
    }

    /// Two segments (1 and 150 tokens: a one-token chunk, two full chunks and a partial one)
    /// with non-zero initial states through `kernel` and the recurrent kernel; nk 2, nv 4 (two
    /// value heads per key head), key head dim `dk`, dv 64 (two column tiles). Returns the worst
    /// of max |Δ| / max(1, max |ref|) over the outputs and the final states; fails over
    /// `tolerance`.
    fn check_chunked_delta_rule(
        &self,
        kernel: DeltaRuleKernel,
        dk: usize,
        tolerance: f32,
    ) -> Result<f32, CudaError> {
        let (nk, nv, dv) = (2, 4, 64);
        let spec = DeltaRuleSpec {
            key_heads: nk,
            value_heads: nv,
            key_head_dim: dk,
            value_head_dim: dv,
        };
        let lengths = [1usize, 150];
        let total: usize = lengths.iter().sum();
        let mut next = self_check_values(0x2545_f491_4f6c_dd1d);
        let mut values = |count: usize, map: &dyn Fn(f32) -> f32| -> Vec<f32> {
            (0..count).map(|_| map(next())).collect()
        };
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
        for kernel in [kernel, DeltaRuleKernel::Recurrent] {
            let mut owned = Vec::new();
            for initial in &states {
                owned.push(CudaRecurrentState {
                    spec,
                    state: self.upload_f32(initial)?,
                });
            }
            let mut segments = Segment::consecutive_from_position_zero(&mut owned, &lengths);
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
        if difference.is_nan() || difference > tolerance {
            return Err(CudaError::Invalid {
                problem: format!(
                    "on {lengths:?} tokens (nk {nk}, nv {nv}, dk {dk}, dv {dv}) the {kernel} kernel differs from the recurrent one by {difference:.2e} of the largest value (allowed {tolerance:.0e})"
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
        let mma = [
            (i64::from(MMA_THREADS), "DRT_THREADS"),
            (MMA_COLUMNS as i64, "DRT_COLUMNS"),
            (MMA_PAD as i64, "DRT_PAD"),
            (MMA_MAX_KEY_DIM as i64, "DRT_MAX_KEY_DIM"),
            (MMA_TS as i64, "DRT_TS"),
            (MMA_RS as i64, "DRT_RS"),
            (MMA_PS as i64, "DRT_PS"),
            (MMA_VS as i64, "DRT_VS"),
        ];
        for (host, name) in mma {
            assert_eq!(host, kernel_define("delta_rule", name), "{name}");
        }
    }

    #[test]
    fn tensor_core_shapes_and_shared_memory() {
        // Qwen3-Next / Qwen3.5 heads (dk 128) fit an A100's opt-in 163 KiB (V' over A is what
        // makes them fit), dk 192 an H100's 227 KiB; dk 256 fits neither (the f32 kernel runs).
        assert_eq!(mma_shared_bytes(128), 162_304);
        assert!(mma_shared_bytes(128) <= 163 * 1024);
        assert!(mma_shared_bytes(192) <= 227 * 1024);
        assert!(mma_shared_bytes(256) > 227 * 1024);
        assert!(mma_supports(128, 128) && mma_supports(64, 48) && mma_supports(256, 128));
        assert!(!mma_supports(72, 128) && !mma_supports(128, 40) && !mma_supports(272, 128));
        assert!(!mma_supports(0, 128) && !mma_supports(128, 0));
    }
}
