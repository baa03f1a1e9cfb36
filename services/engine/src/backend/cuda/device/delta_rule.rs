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

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::self_checks::self_check_values;
use super::{driver_error, int, CudaBackend, CudaRecurrentState, CudaTensor};
use crate::backend::cuda::CudaError;
use crate::backend::{DeltaRuleForm, DeltaRuleSpec, Segment};
use crate::error::EngineError;

/// `DR_CHUNK` in `kernels/delta_rule.cu` (the CPU's `DELTA_RULE_CHUNK`).
const CHUNK: usize = 64;
/// `DR_SMALL_CHUNK`: tokens per chunk of the `_32` variants, which fit the 99 KB of shared
/// memory per block of RTX 30/40/50 cards at dk 128.
const SMALL_CHUNK: usize = 32;
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
/// `DRT_RS`, `DRT_VS`: row strides of the tensor-core kernel's f32 R and f16 V' / state copy.
const MMA_RS: usize = MMA_COLUMNS + 4;
const MMA_VS: usize = MMA_COLUMNS + MMA_PAD;
/// Segments of at least this many rows take the tensor-core kernel; shorter ones keep the f32
/// chunked kernel (a 64-row chunk of a few rows would be mostly padding, and the f32 kernel skips
/// the rows past a segment's end).
pub(super) const MMA_MIN_ROWS: usize = 16;
/// The key head dims the start-up checks run a variant at, the first that fits: Qwen3-Next's
/// and Qwen3.5's 128, else 64.
const CHECK_KEY_DIMS: [usize; 2] = [128, 64];

/// The row strides of the tensor-core kernel's f32 A and T (`TS`) and f16 P (`PS`) at `chunk`.
fn mma_strides(chunk: usize) -> (usize, usize) {
    (chunk + 1, chunk + MMA_PAD)
}

/// Whether the tensor-core kernel keeps V' (hi and lo, `2 · chunk · MMA_VS` f16) in A's f32
/// array, which no phase reads between the triangular solve and the next chunk
/// (`VALUE_PAIR_OVER_A` in the kernel): at 64-token chunks, not at 32.
fn mma_value_pair_fits_over_a(chunk: usize) -> bool {
    let (ts, _) = mma_strides(chunk);
    2 * chunk * MMA_VS * std::mem::size_of::<u16>() <= chunk * ts * std::mem::size_of::<f32>()
}

/// Dynamic shared memory of the chunked kernel at `chunk` tokens, in bytes (the layout in
/// `kernels/delta_rule.cu`).
fn chunked_shared_bytes(dk: usize, chunk: usize) -> usize {
    let row_stride = dk | 1;
    std::mem::size_of::<f32>()
        * (2 * chunk * row_stride
            + chunk * chunk
            + chunk * CHUNK_COLUMNS
            + dk * CHUNK_COLUMNS
            + 4 * chunk)
}

/// Dynamic shared memory of the tensor-core kernel at `chunk` tokens, in bytes (the layout in
/// `kernels/delta_rule.cu`): f32 A, T, R and four per-row vectors, then f16 pairs (hi and lo
/// arrays) of K̂, Q̂, P, e^{γ_last−γ} V' and the state tile's copy, then V' (also a pair) where it
/// does not fit over A ([`mma_value_pair_fits_over_a`]).
fn mma_shared_bytes(dk: usize, chunk: usize) -> usize {
    let (ts, ps) = mma_strides(chunk);
    let value_pair = if mma_value_pair_fits_over_a(chunk) {
        0
    } else {
        2 * chunk * MMA_VS
    };
    std::mem::size_of::<f32>() * (2 * chunk * ts + chunk * MMA_RS + 4 * chunk)
        + 2 * std::mem::size_of::<u16>()
            * (2 * chunk * (dk + MMA_PAD) + chunk * ps + chunk * MMA_VS + dk * MMA_VS)
        + std::mem::size_of::<u16>() * value_pair
}

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
    /// `gated_delta_rule_chunked`: chunks of 64 tokens in f32 (the reference of the others).
    Chunked,
    /// `gated_delta_rule_chunked_32`: the same in chunks of 32 tokens, for GPUs whose shared
    /// memory per block is too small for 64 at the model's key head dim (RTX cards at dk 128).
    Chunked32,
    /// `gated_delta_rule_recurrent`: one token after the other.
    Recurrent,
    /// `gated_delta_rule_chunked_mma`: the chunked form with its matrix products on the tensor
    /// cores (operands as f16 hi + lo pairs, f32 accumulation), chunks of 64 tokens.
    TensorCore,
    /// `gated_delta_rule_chunked_mma_32`: the same in chunks of 32 tokens.
    TensorCore32,
}

/// The f32 chunked variants, largest chunk first (the first that fits runs).
const CHUNKED_VARIANTS: [DeltaRuleKernel; 2] =
    [DeltaRuleKernel::Chunked, DeltaRuleKernel::Chunked32];
/// The tensor-core variants, largest chunk first.
const TENSOR_CORE_VARIANTS: [DeltaRuleKernel; 2] =
    [DeltaRuleKernel::TensorCore, DeltaRuleKernel::TensorCore32];

impl DeltaRuleKernel {
    /// The kernel's name in `kernels/delta_rule.cu`.
    pub fn function(self) -> &'static str {
        match self {
            DeltaRuleKernel::Chunked => "gated_delta_rule_chunked",
            DeltaRuleKernel::Chunked32 => "gated_delta_rule_chunked_32",
            DeltaRuleKernel::Recurrent => "gated_delta_rule_recurrent",
            DeltaRuleKernel::TensorCore => "gated_delta_rule_chunked_mma",
            DeltaRuleKernel::TensorCore32 => "gated_delta_rule_chunked_mma_32",
        }
    }

    /// Tokens per chunk (`None`: the recurrent kernel).
    pub fn chunk(self) -> Option<usize> {
        match self {
            DeltaRuleKernel::Chunked | DeltaRuleKernel::TensorCore => Some(CHUNK),
            DeltaRuleKernel::Chunked32 | DeltaRuleKernel::TensorCore32 => Some(SMALL_CHUNK),
            DeltaRuleKernel::Recurrent => None,
        }
    }

    fn is_tensor_core(self) -> bool {
        matches!(
            self,
            DeltaRuleKernel::TensorCore | DeltaRuleKernel::TensorCore32
        )
    }

    /// Dynamic shared memory of one block at key head dim `dk`, bytes.
    pub fn shared_bytes(self, dk: usize) -> usize {
        match (self.chunk(), self.is_tensor_core()) {
            (None, _) => 2 * dk * std::mem::size_of::<f32>(),
            (Some(chunk), false) => chunked_shared_bytes(dk, chunk),
            (Some(chunk), true) => mma_shared_bytes(dk, chunk),
        }
    }

    /// Whether the kernel takes `dk` × `dv` heads at all (shared memory aside).
    fn takes(self, dk: usize, dv: usize) -> bool {
        match (self.chunk(), self.is_tensor_core()) {
            (None, _) => true,
            (Some(_), false) => dk <= CHUNKED_MAX_KEY_DIM,
            (Some(_), true) => mma_supports(dk, dv),
        }
    }

    /// The launch of one segment: grid over (value head, column tile), the block and its
    /// shared memory.
    fn launch_config(self, dk: usize, dv: usize, nv: usize) -> LaunchConfig {
        match self.chunk() {
            None => LaunchConfig {
                grid_dim: (nv as u32, 1, 1),
                block_dim: ((dv as u32).div_ceil(32) * 32, 1, 1),
                shared_mem_bytes: self.shared_bytes(dk) as u32,
            },
            Some(_) => {
                let (threads, columns) = if self.is_tensor_core() {
                    (MMA_THREADS, MMA_COLUMNS)
                } else {
                    (CHUNK_THREADS, CHUNK_COLUMNS)
                };
                LaunchConfig {
                    grid_dim: (nv as u32, dv.div_ceil(columns) as u32, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: self.shared_bytes(dk) as u32,
                }
            }
        }
    }
}

impl std::fmt::Display for DeltaRuleKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeltaRuleKernel::Chunked => "chunked",
            DeltaRuleKernel::Chunked32 => "chunked, 32-token chunks",
            DeltaRuleKernel::Recurrent => "recurrent",
            DeltaRuleKernel::TensorCore => "tensor-core",
            DeltaRuleKernel::TensorCore32 => "tensor-core, 32-token chunks",
        })
    }
}

impl CudaBackend {
    /// Whether `kernel` takes `dk` × `dv` heads within this backend's shared memory per block.
    fn delta_rule_fits(&self, kernel: DeltaRuleKernel, dk: usize, dv: usize) -> bool {
        kernel.takes(dk, dv) && kernel.shared_bytes(dk) <= self.info.shared_memory_per_block
    }

    /// The first of `variants` that passed its start-up check and fits `dk` × `dv` here.
    fn delta_rule_variant(
        &self,
        variants: &[DeltaRuleKernel],
        dk: usize,
        dv: usize,
    ) -> Option<DeltaRuleKernel> {
        variants.iter().copied().find(|&kernel| {
            self.info.delta_rule_variants.contains(&kernel) && self.delta_rule_fits(kernel, dk, dv)
        })
    }

    /// Whether prefill segments of `dk` × `dv` heads take a tensor-core kernel here (see
    /// [`DeltaRuleKernel::TensorCore`]); the tests ask before they compare it.
    pub fn tensor_core_delta_rule_takes(&self, dk: usize, dv: usize) -> bool {
        self.delta_rule_variant(&TENSOR_CORE_VARIANTS, dk, dv)
            .is_some()
    }

    /// The tensor-core variant prefill segments of `dk` × `dv` heads take under the options.
    fn tensor_core_prefill_variant(&self, dk: usize, dv: usize) -> Option<DeltaRuleKernel> {
        (self.options.tensor_core_prefill && self.options.tensor_core_delta_rule)
            .then(|| self.delta_rule_variant(&TENSOR_CORE_VARIANTS, dk, dv))
            .flatten()
    }

    /// The kernel long prefill segments of `dk` × `dv` heads run here: a tensor-core variant
    /// where one is enabled and fits, else an f32 chunked one, else the recurrent kernel.
    pub fn delta_rule_prefill_kernel(&self, dk: usize, dv: usize) -> DeltaRuleKernel {
        self.tensor_core_prefill_variant(dk, dv)
            .or_else(|| self.delta_rule_variant(&CHUNKED_VARIANTS, dk, dv))
            .unwrap_or(DeltaRuleKernel::Recurrent)
    }

    /// Whether `kernel` passed its start-up check and fits `dk` × `dv` here (the tests ask
    /// before they run a variant).
    pub fn delta_rule_kernel_usable(&self, kernel: DeltaRuleKernel, dk: usize, dv: usize) -> bool {
        kernel == DeltaRuleKernel::Recurrent
            || (self.info.delta_rule_variants.contains(&kernel)
                && self.delta_rule_fits(kernel, dk, dv))
    }

    /// Logs, once per head shape, which kernel its prefill takes and why not a larger one.
    fn log_delta_rule_choice(&self, dk: usize, dv: usize) {
        if !self.note_kernel_choice(("gated_delta_rule", dk, dv)) {
            return;
        }
        let chosen = self.delta_rule_prefill_kernel(dk, dv);
        let limit = self.info.shared_memory_per_block;
        let passed_over: Vec<String> = [
            DeltaRuleKernel::TensorCore,
            DeltaRuleKernel::TensorCore32,
            DeltaRuleKernel::Chunked,
            DeltaRuleKernel::Chunked32,
        ]
        .into_iter()
        .take_while(|&kernel| kernel != chosen)
        .filter(|&kernel| kernel.takes(dk, dv) && kernel.shared_bytes(dk) > limit)
        .map(|kernel| format!("{kernel} needs {} bytes", kernel.shared_bytes(dk)))
        .collect();
        if passed_over.is_empty() {
            tracing::info!("gated delta rule, dk {dk} × dv {dv}: prefill on the {chosen} kernel");
        } else {
            tracing::info!(
                "gated delta rule, dk {dk} × dv {dv}: prefill on the {chosen} kernel ({}; the limit is {limit} bytes of shared memory per block)",
                passed_over.join(", ")
            );
        }
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
        let (dk, dv) = (spec.key_head_dim, spec.value_head_dim);
        self.log_delta_rule_choice(dk, dv);
        let chunked = self.delta_rule_variant(&CHUNKED_VARIANTS, dk, dv);
        let tensor_cores = self.tensor_core_prefill_variant(dk, dv);
        self.delta_rule_segments(q, k, v, g, beta, spec, segments, |tokens| {
            let wants_chunked = match form {
                DeltaRuleForm::Auto => tokens > 1,
                DeltaRuleForm::Chunked => true,
                DeltaRuleForm::Recurrent => false,
            };
            match (wants_chunked, tensor_cores, chunked) {
                (false, _, _) => DeltaRuleKernel::Recurrent,
                (true, Some(kernel), _) if tokens >= MMA_MIN_ROWS => kernel,
                (true, _, Some(kernel)) => kernel,
                (true, _, None) => DeltaRuleKernel::Recurrent,
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
        // Every delta-rule kernel writes all heads and columns of each of a segment's rows.
        let mut out = self.output_for_segments(
            rows,
            nv * dv,
            segments.iter().map(|segment| segment.rows.clone()),
        )?;
        let (nk_arg, nv_arg, dk_arg, dv_arg) = (
            int(nk, "key heads")?,
            int(nv, "value heads")?,
            int(dk, "dk")?,
            int(dv, "dv")?,
        );
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
            let kernel = choose(n);
            if !self.delta_rule_fits(kernel, dk, dv) {
                return Err(CudaError::Invalid {
                    problem: format!(
                        "gated_delta_rule: the {kernel} kernel does not take dk {dk} × dv {dv} in {} bytes of shared memory per block (it needs {})",
                        self.info.shared_memory_per_block,
                        kernel.shared_bytes(dk)
                    ),
                });
            }
            let config = kernel.launch_config(dk, dv, nv);
            match kernel {
                DeltaRuleKernel::Chunked => launch_segment!("gated_delta_rule_chunked", config)?,
                DeltaRuleKernel::Chunked32 => {
                    launch_segment!("gated_delta_rule_chunked_32", config)?
                }
                DeltaRuleKernel::TensorCore => {
                    launch_segment!("gated_delta_rule_chunked_mma", config)?
                }
                DeltaRuleKernel::TensorCore32 => {
                    launch_segment!("gated_delta_rule_chunked_mma_32", config)?
                }
                DeltaRuleKernel::Recurrent => {
                    launch_segment!("gated_delta_rule_recurrent", config)?
                }
            }
        }
        Ok(out)
    }

    /// Start-up: lets every chunked variant use the shared memory per block (the GPU's opt-in
    /// maximum or the cap) and runs its self-check at the first of [`CHECK_KEY_DIMS`] it fits.
    /// The variants that pass go into `info.delta_rule_variants`; `info.delta_rule_path` says
    /// `chunked` if an f32 one passed. Then, with `tensor_core_prefill` and
    /// `tensor_core_delta_rule`, the same for the tensor-core variants (path `tensor-core` if
    /// one passed). A variant that does not fit or fails is logged with the reason; with no
    /// f32 variant the recurrent kernel runs every form for the life of the process.
    pub(super) fn start_chunked_delta_rule(&mut self) {
        self.info.delta_rule_path = PATH_RECURRENT;
        self.info.delta_rule_variants.clear();
        for kernel in CHUNKED_VARIANTS {
            self.start_delta_rule_variant(kernel, SELF_CHECK_TOLERANCE);
        }
        if !CHUNKED_VARIANTS
            .iter()
            .any(|kernel| self.info.delta_rule_variants.contains(kernel))
        {
            tracing::warn!("no chunked gated delta rule passed its start-up check: the recurrent kernel runs every form");
            return;
        }
        self.info.delta_rule_path = PATH_CHUNKED;
        if !(self.options.tensor_core_prefill && self.options.tensor_core_delta_rule) {
            return;
        }
        for kernel in TENSOR_CORE_VARIANTS {
            self.start_delta_rule_variant(kernel, MMA_SELF_CHECK_TOLERANCE);
        }
        if TENSOR_CORE_VARIANTS
            .iter()
            .any(|kernel| self.info.delta_rule_variants.contains(kernel))
        {
            self.info.delta_rule_path = PATH_TENSOR_CORE;
        }
    }

    /// Enables `kernel` if it fits at one of [`CHECK_KEY_DIMS`] and passes its self-check there.
    fn start_delta_rule_variant(&mut self, kernel: DeltaRuleKernel, tolerance: f32) {
        match self.enable_delta_rule_variant(kernel, tolerance) {
            Ok((dk, worst)) => {
                self.info.delta_rule_variants.push(kernel);
                tracing::info!(
                    "gated delta rule: the {kernel} kernel passed its start-up check at dk {dk} (max |Δ| / scale {worst:.1e} vs the recurrent kernel)"
                );
            }
            Err(error) => {
                tracing::info!("gated delta rule: the {kernel} kernel is not used: {error}");
                // A failed check may have left an error on the stream: drain it (nothing else
                // has run yet).
                let _ = self.stream.synchronize();
            }
        }
    }

    fn enable_delta_rule_variant(
        &self,
        kernel: DeltaRuleKernel,
        tolerance: f32,
    ) -> Result<(usize, f32), CudaError> {
        let limit = self.info.shared_memory_per_block;
        let Some(dk) = CHECK_KEY_DIMS
            .into_iter()
            .find(|&dk| self.delta_rule_fits(kernel, dk, 64))
        else {
            return Err(CudaError::Unsupported {
                problem: format!(
                    "it needs {} bytes of shared memory per block at dk 64; the limit is {limit}",
                    kernel.shared_bytes(64)
                ),
            });
        };
        self.function(kernel.function())?
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                i32::try_from(limit).unwrap_or(i32::MAX),
            )
            .map_err(driver_error(format!(
                "raising the dynamic shared memory limit of `{}`",
                kernel.function()
            )))?;
        let worst = self.check_chunked_delta_rule(kernel, dk, tolerance)?;
        Ok((dk, worst))
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
            SMALL_CHUNK as i64,
            kernel_define("delta_rule", "DR_SMALL_CHUNK")
        );
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
            (MMA_RS as i64, "DRT_RS"),
            (MMA_VS as i64, "DRT_VS"),
        ];
        for (host, name) in mma {
            assert_eq!(host, kernel_define("delta_rule", name), "{name}");
        }
        // Every variant's function is a kernel of the file.
        let source = include_str!("../../../../../../kernels/delta_rule.cu");
        for kernel in [
            DeltaRuleKernel::Chunked,
            DeltaRuleKernel::Chunked32,
            DeltaRuleKernel::Recurrent,
            DeltaRuleKernel::TensorCore,
            DeltaRuleKernel::TensorCore32,
        ] {
            let signature = format!("{}(", kernel.function());
            assert!(source.contains(&signature), "{signature}");
        }
    }

    #[test]
    fn tensor_core_shapes_and_shared_memory() {
        // Qwen3-Next / Qwen3.5 heads (dk 128) fit an A100's opt-in 163 KiB (V' over A is what
        // makes them fit), dk 192 an H100's 227 KiB; dk 256 fits neither (the f32 kernel runs).
        assert_eq!(mma_shared_bytes(128, CHUNK), 162_304);
        assert!(mma_shared_bytes(128, CHUNK) <= 163 * 1024);
        assert!(mma_shared_bytes(192, CHUNK) <= 227 * 1024);
        assert!(mma_shared_bytes(256, CHUNK) > 227 * 1024);
        assert!(mma_value_pair_fits_over_a(CHUNK) && !mma_value_pair_fits_over_a(SMALL_CHUNK));
        assert!(mma_supports(128, 128) && mma_supports(64, 48) && mma_supports(256, 128));
        assert!(!mma_supports(72, 128) && !mma_supports(128, 40) && !mma_supports(272, 128));
        assert!(!mma_supports(0, 128) && !mma_supports(128, 0));
    }

    #[test]
    fn the_32_token_variants_fit_a_consumer_card_at_dk_128() {
        use crate::backend::cuda::device::options::CONSUMER_CARD_SHARED_MEMORY as RTX;
        // Neither 64-token kernel fits 99 KB at dk 128 ...
        assert_eq!(chunked_shared_bytes(128, CHUNK), 108_032);
        assert!(DeltaRuleKernel::Chunked.shared_bytes(128) > RTX);
        assert!(DeltaRuleKernel::TensorCore.shared_bytes(128) > RTX);
        // ... both 32-token ones do, with V' in a region of its own for the tensor cores.
        assert_eq!(chunked_shared_bytes(128, SMALL_CHUNK), 58_112);
        assert_eq!(mma_shared_bytes(128, SMALL_CHUNK), 84_224);
        assert!(DeltaRuleKernel::Chunked32.shared_bytes(128) <= RTX);
        assert!(DeltaRuleKernel::TensorCore32.shared_bytes(128) <= RTX);
        // The start-up check of the 64-token f32 kernel still fits there, at dk 64.
        assert!(DeltaRuleKernel::Chunked.shared_bytes(64) <= RTX);
        // The recurrent kernel needs two rows of dk floats.
        assert_eq!(DeltaRuleKernel::Recurrent.shared_bytes(128), 1024);
    }
}
