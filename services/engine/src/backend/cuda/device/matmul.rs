//! Launches of `kernels/matmul.cu` and the cuBLAS path: `x · Wᵀ` for every weight dtype, the
//! three-projection `matmul3`, and prefill-sized bf16 GEMMs on tensor cores.
//!
//! Owns: the choice between the matmul kernel and cuBLAS per call, and the kernel's launch
//! geometry.
//! Must not touch: cuBLAS loading and its start-up check (`cublas.rs`, `self_checks.rs`).

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::super::cublas::{Cublas, GemmOperands};
use super::super::CudaError;
use super::norm::NORM_THREADS;
use super::{driver_error, elementwise, int, CudaBackend, CudaTensor, CudaWeight, WeightData};

/// `ROWS` in `kernels/matmul.cu`: rows one warp computes together.
pub(super) const MATMUL_ROWS: u64 = 8;
/// `MAX_COLS` in `kernels/matmul.cu`: the most output features one warp computes together.
pub(super) const MATMUL_MAX_COLS: u64 = 2;
/// Warps per block of the matmul kernel.
pub(super) const MATMUL_WARPS: u32 = 8;
/// bf16 matmuls of at least this many rows go through cuBLAS (when it loaded and passed its
/// start-up check); fewer rows (decode) stay on the matmul kernel, which streams the weights
/// once for up to `MATMUL_ROWS` rows and keeps f32 activations.
pub(super) const CUBLAS_MIN_ROWS: usize = 9;
/// Two features per warp pay only for batches of several rows of a wide projection (the kernel
/// bench, `scripts/bench/kernel_microbench.py --sweep`, on an H200: q/k/v of 5120 features at 4
/// and 8 rows 5% and 18% faster; at 1 row, or with fewer features, slower: fewer warps leave
/// multiprocessors short of loads in flight).
const MATMUL_TWO_COLUMN_MIN_ROWS: usize = 4;
const MATMUL_TWO_COLUMN_MIN_FEATURES: usize = 4096;

/// `ADD_NORM_MATMUL_BLOCKS_PER_SM` in kernels/matmul.cu: `add_norm_matmul3_bf16`'s blocks per
/// SM at most (as many as its registers let an SM hold), so the grid is one wave and each
/// block forms the norm once.
const ADD_NORM_MATMUL_BLOCKS_PER_SM: usize = 2;

/// Output features per warp for `features` outputs of `rows` rows.
fn matmul_columns_per_warp(features: usize, rows: usize) -> u64 {
    if rows >= MATMUL_TWO_COLUMN_MIN_ROWS && features >= MATMUL_TWO_COLUMN_MIN_FEATURES {
        MATMUL_MAX_COLS
    } else {
        1
    }
}

/// The matmul kernel's arguments for `x · wᵀ` and its grid: one warp per (group of `cols`
/// output features, group of MATMUL_ROWS rows); see kernels/matmul.cu.
struct MatmulLaunch {
    n: i32,
    k: i32,
    m: i32,
    cols: i32,
    config: LaunchConfig,
}

fn matmul_launch(x: &CudaTensor, weight: &CudaWeight) -> Result<MatmulLaunch, CudaError> {
    let (n, k, m) = (
        int(x.rows, "rows")?,
        int(x.cols, "in")?,
        int(weight.rows, "out")?,
    );
    let row_groups = (x.rows as u64).div_ceil(MATMUL_ROWS);
    let columns = matmul_columns_per_warp(weight.rows, x.rows);
    let tasks = (weight.rows as u64).div_ceil(columns) * row_groups;
    let blocks =
        u32::try_from(tasks.div_ceil(u64::from(MATMUL_WARPS))).map_err(|_| CudaError::Invalid {
            problem: format!(
                "matmul of {}×{} by {}×{} is too large",
                x.rows, x.cols, weight.rows, weight.cols
            ),
        })?;
    Ok(MatmulLaunch {
        n,
        k,
        m,
        cols: columns as i32,
        config: LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (32 * MATMUL_WARPS, 1, 1),
            shared_mem_bytes: 0,
        },
    })
}

/// How a matmul kernel forms its input from two tensors as it reads them.
#[derive(Debug, Clone, Copy)]
pub(super) enum TwoInputs {
    /// `silu(a) · b` (`matmul_bf16_silu_mul`).
    SiluMul,
    /// `a · sigmoid(b)` (`matmul_bf16_mul_sigmoid`).
    MulSigmoid,
}

impl TwoInputs {
    /// The backend op it serves.
    pub(super) fn op(self) -> &'static str {
        match self {
            TwoInputs::SiluMul => "matmul_silu_mul",
            TwoInputs::MulSigmoid => "matmul_mul_sigmoid",
        }
    }
}

impl CudaBackend {
    /// Whether a bf16 matmul of `rows` rows goes through cuBLAS (tests print it).
    pub fn uses_cublas_for(&self, rows: usize) -> bool {
        self.cublas.is_some() && rows >= CUBLAS_MIN_ROWS
    }

    pub(super) fn launch_matmul(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
    ) -> Result<CudaTensor, CudaError> {
        // Prefill-sized bf16 GEMMs on tensor cores; a cuBLAS error here is the op's error (no
        // fallback): the start-up check already proved the path, so a failure now means the
        // GPU or the context is in trouble, not that cuBLAS is unsuitable.
        if let (Some(cublas), WeightData::Bf16(data)) = (&self.cublas, &weight.data) {
            if x.rows >= CUBLAS_MIN_ROWS && x.cols == weight.cols && weight.rows > 0 && x.cols > 0 {
                return self.matmul_cublas(cublas, x, data, weight.rows);
            }
        }
        self.matmul_kernel(x, weight)
    }

    /// `x · wᵀ` through cuBLAS on tensor cores: `x` split into two bf16 terms `hi + lo`
    /// (`f32_to_bf16_split` in kernels/matmul.cu) and multiplied twice, the second GEMM adding
    /// into the first, so the activations keep ~16 mantissa bits (one bf16 term alone moved
    /// the tiny models' logits by up to 0.9); f32 accumulation and result.
    pub(super) fn matmul_cublas(
        &self,
        cublas: &Cublas,
        x: &CudaTensor,
        w: &CudaSlice<u16>,
        out_features: usize,
    ) -> Result<CudaTensor, CudaError> {
        let input = &*x.data;
        let count = x.rows * x.cols;
        let mut x_hi = self
            .stream
            .alloc_zeros::<u16>(count.max(1))
            .map_err(driver_error(format!("allocating {count} bf16 activations")))?;
        let mut x_lo = self
            .stream
            .alloc_zeros::<u16>(count.max(1))
            .map_err(driver_error(format!("allocating {count} bf16 activations")))?;
        let count_arg = count as i64;
        launch!(self, "f32_to_bf16_split", elementwise(count);
            input, &mut x_hi, &mut x_lo, &count_arg)?;
        // The first GEMM overwrites every element (beta 0), the second adds to it.
        let mut out = self.output_uninit(x.rows, out_features)?;
        for (part, accumulate) in [(&x_hi, false), (&x_lo, true)] {
            cublas.linear_into(
                GemmOperands::Bf16 { x: part, w },
                &mut out.data,
                x.rows,
                x.cols,
                out_features,
                accumulate,
            )?;
        }
        Ok(out)
    }

    /// A matmul kernel whose input it forms from two same-shaped tensors as it reads them (the
    /// arguments of `matmul_bf16` with the two inputs first): bf16 weights and the row counts
    /// the matmul kernel serves (not cuBLAS), else `None`.
    pub(super) fn launch_matmul_of_two_inputs(
        &self,
        kernel: TwoInputs,
        a: &CudaTensor,
        b: &CudaTensor,
        weight: &CudaWeight,
    ) -> Result<Option<CudaTensor>, CudaError> {
        let WeightData::Bf16(data) = &weight.data else {
            return Ok(None);
        };
        if (a.rows, a.cols) != (b.rows, b.cols)
            || a.cols != weight.cols
            || a.rows == 0
            || weight.rows == 0
            || self.uses_cublas_for(a.rows)
        {
            return Ok(None);
        }
        // One warp per (output, row group) writes each element.
        let mut out = self.output_uninit(a.rows, weight.rows)?;
        let MatmulLaunch {
            n,
            k,
            m,
            cols,
            config,
        } = matmul_launch(a, weight)?;
        let (a_data, b_data, output) = (&*a.data, &*b.data, &mut *out.data);
        let prefetch = self.weight_prefetch();
        match kernel {
            TwoInputs::SiluMul => launch!(self, "matmul_bf16_silu_mul", config;
                a_data, b_data, data, output, &n, &k, &m, &cols, &prefetch)?,
            TwoInputs::MulSigmoid => launch!(self, "matmul_bf16_mul_sigmoid", config;
                a_data, b_data, data, output, &n, &k, &m, &cols, &prefetch)?,
        }
        Ok(Some(out))
    }

    /// `x · wᵀ` with the matmul kernel (every dtype, every row count).
    pub(super) fn matmul_kernel(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
    ) -> Result<CudaTensor, CudaError> {
        let input = &*x.data;
        // Same contract as the CPU backend: an inconsistent call leaves zeros (shapes are
        // validated at model load).
        if x.cols != weight.cols || x.rows == 0 || weight.rows == 0 {
            return self.output(x.rows, weight.rows);
        }
        // One warp per (output, row group) writes each element.
        let mut out = self.output_uninit(x.rows, weight.rows)?;
        let MatmulLaunch {
            n,
            k,
            m,
            cols,
            config,
        } = matmul_launch(x, weight)?;
        let output = &mut *out.data;
        let prefetch = self.weight_prefetch();
        match &weight.data {
            WeightData::F32(data) => {
                launch!(self, "matmul", config; input, data, output, &n, &k, &m, &cols, &prefetch)?
            }
            WeightData::Bf16(data) => launch!(self, "matmul_bf16", config;
                    input, data, output, &n, &k, &m, &cols, &prefetch)?,
        }
        Ok(out)
    }

    /// Three bf16 projections of `x` in one `matmul3_bf16` launch, where the matmul kernel
    /// (not cuBLAS) would compute each and their shapes agree; `None` where they are not.
    pub(super) fn launch_matmul3(
        &self,
        x: &CudaTensor,
        weights: [&CudaWeight; 3],
    ) -> Result<Option<[CudaTensor; 3]>, CudaError> {
        let [WeightData::Bf16(w0), WeightData::Bf16(w1), WeightData::Bf16(w2)] =
            weights.map(|weight| &weight.data)
        else {
            return Ok(None);
        };
        if x.rows == 0
            || self.uses_cublas_for(x.rows)
            || weights
                .iter()
                .any(|weight| weight.cols != x.cols || weight.rows == 0)
        {
            return Ok(None);
        }
        let input = &*x.data;
        // One warp per (feature group of one of the three, row group) writes each element.
        let mut outputs = [
            self.output_uninit(x.rows, weights[0].rows)?,
            self.output_uninit(x.rows, weights[1].rows)?,
            self.output_uninit(x.rows, weights[2].rows)?,
        ];
        let features: usize = weights.iter().map(|weight| weight.rows).sum();
        let row_groups = (x.rows as u64).div_ceil(MATMUL_ROWS);
        let columns = matmul_columns_per_warp(features, x.rows);
        let cols = columns as i32;
        let feature_groups: u64 = weights
            .iter()
            .map(|weight| (weight.rows as u64).div_ceil(columns))
            .sum();
        let (n, k, m0, m1, m2) = (
            int(x.rows, "rows")?,
            int(x.cols, "in")?,
            int(weights[0].rows, "out")?,
            int(weights[1].rows, "out")?,
            int(weights[2].rows, "out")?,
        );
        int(features, "outputs of three projections")?;
        let tasks = feature_groups * row_groups;
        let blocks = u32::try_from(tasks.div_ceil(u64::from(MATMUL_WARPS))).map_err(|_| {
            CudaError::Invalid {
                problem: format!("three projections of {}×{} are too large", x.rows, x.cols),
            }
        })?;
        let config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (32 * MATMUL_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        {
            let [out0, out1, out2] = &mut outputs;
            let (o0, o1, o2) = (&mut *out0.data, &mut *out1.data, &mut *out2.data);
            let prefetch = self.weight_prefetch();
            launch!(self, "matmul3_bf16", config;
                input, w0, w1, w2, o0, o1, o2, &n, &k, &m0, &m1, &m2, &cols, &prefetch)?;
        }
        Ok(Some(outputs))
    }

    /// `residual += delta` (one row that `foldable_residual_norm` admits), the RMSNorm of it
    /// (f32 `norm_weight` over the whole row, `offset` the style's), then the normed row's three bf16 projections, in one `add_norm_matmul3_bf16`
    /// launch (one token, `--cuda-fused-decode-qkv-norm`): the normed row and the projections,
    /// with the bits of `add_rms_norm` then `matmul3_bf16`. `None` where the kernel does not
    /// apply (nothing launched, the residual untouched).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_add_norm_matmul3(
        &self,
        residual: &mut CudaTensor,
        delta: &CudaTensor,
        norm_weight: &CudaSlice<f32>,
        eps: f32,
        offset: f32,
        weights: [&CudaWeight; 3],
    ) -> Result<Option<(CudaTensor, [CudaTensor; 3])>, CudaError> {
        let Some(counter) = self.fused_qkv_norm_counter.as_ref() else {
            return Ok(None);
        };
        let [WeightData::Bf16(w0), WeightData::Bf16(w1), WeightData::Bf16(w2)] =
            weights.map(|weight| &weight.data)
        else {
            return Ok(None);
        };
        // The row, its width and the norm are the caller's (`foldable_residual_norm`).
        let hidden = delta.cols;
        if weights
            .iter()
            .any(|weight| weight.cols != hidden || weight.rows == 0)
        {
            return Ok(None);
        }
        let mut normed = self.output_uninit(1, hidden)?;
        let mut outputs = [
            self.output_uninit(1, weights[0].rows)?,
            self.output_uninit(1, weights[1].rows)?,
            self.output_uninit(1, weights[2].rows)?,
        ];
        // matmul3_bf16's tasks at one row, in blocks of the norm's threads (the same warps).
        let features: usize = weights.iter().map(|weight| weight.rows).sum();
        let columns = matmul_columns_per_warp(features, 1);
        let feature_groups: u64 = weights
            .iter()
            .map(|weight| (weight.rows as u64).div_ceil(columns))
            .sum();
        // Each block forms the norm before its first weight read: as few blocks as keep every
        // SM busy, their warps striding over the tasks (one wave, the norm once per block).
        let one_task_a_warp = feature_groups.div_ceil(u64::from(NORM_THREADS / 32));
        let one_wave = (self.info.multiprocessor_count * ADD_NORM_MATMUL_BLOCKS_PER_SM) as u64;
        let blocks = u32::try_from(one_task_a_warp.min(one_wave.max(1))).map_err(|_| {
            CudaError::Invalid {
                problem: format!("three projections of {features} features are too large"),
            }
        })?;
        let config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (NORM_THREADS, 1, 1),
            shared_mem_bytes: (hidden * std::mem::size_of::<f32>()) as u32,
        };
        let (k, m0, m1, m2, cols) = (
            int(hidden, "in")?,
            int(weights[0].rows, "out")?,
            int(weights[1].rows, "out")?,
            int(weights[2].rows, "out")?,
            columns as i32,
        );
        let prefetch = self.weight_prefetch();
        {
            let [out0, out1, out2] = &mut outputs;
            let (o0, o1, o2) = (&mut *out0.data, &mut *out1.data, &mut *out2.data);
            launch!(self, "add_norm_matmul3_bf16", config;
                &mut *residual.data, &*delta.data, norm_weight, &eps, &offset,
                &mut *normed.data, w0, w1, w2, o0, o1, o2, counter, &k, &m0, &m1, &m2, &cols,
                &prefetch)?;
        }
        Ok(Some((normed, outputs)))
    }

    /// The matmul kernels' `prefetch` argument: 1 where their blocks can start before the
    /// kernel before them ends (programmatic dependent launch) and the option is on.
    pub(super) fn weight_prefetch(&self) -> i32 {
        i32::from(self.options.weight_prefetch && self.info.programmatic_dependent_launch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_kernels() {
        use super::super::super::kernels::kernel_define;
        assert_eq!(MATMUL_ROWS as i64, kernel_define("matmul", "ROWS"));
        assert_eq!(MATMUL_MAX_COLS as i64, kernel_define("matmul", "MAX_COLS"));
        // add_norm_matmul3_bf16 runs matmul3_bf16's warp tasks in blocks of the norm's threads.
        assert_eq!(NORM_THREADS, 32 * MATMUL_WARPS);
        assert_eq!(
            ADD_NORM_MATMUL_BLOCKS_PER_SM as i64,
            kernel_define("matmul", "ADD_NORM_MATMUL_BLOCKS_PER_SM")
        );
    }
}
