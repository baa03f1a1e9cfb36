//! Logit candidates on the GPU (`kernels/sampling.cu`): per row of logits its k largest logits,
//! max, log-sum-exp and the logits of asked-for ids, so a decode step reads back a few KB per
//! sequence instead of the whole `[vocab]` row.
//!
//! Owns: the two launches (per-chunk top-k, per-row merge) and the read-back's decoding.
//! Must not touch: sampling (`crate::sampling` turns candidates into tokens).

use cudarc::driver::LaunchConfig;

use super::{driver_error, int, CudaBackend, CudaTensor};
use crate::backend::candidates::{LogitCandidates, MAX_CANDIDATES};
use crate::backend::cuda::CudaError;

/// `SAMPLING_THREADS` in `kernels/sampling.cu`; also the most chunks a row may have (the merge
/// takes one thread per chunk).
const SAMPLING_THREADS: u32 = 256;
/// `SAMPLING_PER_THREAD` in `kernels/sampling.cu`: a chunk is at most this many values per
/// thread.
const SAMPLING_PER_THREAD: usize = 16;
/// Chunks a long row is cut into (blocks of the first launch per row).
const TARGET_CHUNKS: usize = 128;
/// `SAMPLING_NONE` in `kernels/sampling.cu`.
const NONE: u32 = u32::MAX;

/// `(chunk length, chunks)` for a row of `cols` logits.
fn chunking(cols: usize) -> (usize, usize) {
    let threads = SAMPLING_THREADS as usize;
    let chunk_len = cols
        .div_ceil(TARGET_CHUNKS)
        .clamp(threads, threads * SAMPLING_PER_THREAD);
    (chunk_len, cols.div_ceil(chunk_len))
}

impl CudaBackend {
    /// [`crate::backend::Backend::logit_candidates`] on the GPU (arguments already checked).
    pub(super) fn launch_logit_candidates(
        &self,
        logits: &CudaTensor,
        k: usize,
        extra: &[Vec<u32>],
    ) -> Result<Vec<LogitCandidates>, CudaError> {
        let (rows, cols) = (logits.rows, logits.cols);
        if rows == 0 {
            return Ok(Vec::new());
        }
        let invalid = |problem: String| CudaError::Invalid { problem };
        let (chunk_len, chunks) = chunking(cols);
        if cols == 0 || chunks > SAMPLING_THREADS as usize || k == 0 || k > MAX_CANDIDATES {
            return Err(invalid(format!(
                "logit candidates: rows of {cols} logits (at most {} on the GPU), k = {k} (1..={MAX_CANDIDATES})",
                SAMPLING_THREADS as usize * SAMPLING_THREADS as usize * SAMPLING_PER_THREAD
            )));
        }
        if extra.len() != rows {
            return Err(invalid(format!(
                "logit candidates: {} extra-token lists for {rows} rows",
                extra.len()
            )));
        }
        let input = &*logits.data;
        let parts = rows * chunks;
        let mut part_ids = self
            .stream
            .alloc_zeros::<u32>(parts * k)
            .map_err(driver_error("allocating candidate ids"))?;
        let mut part_values = self.alloc(parts * k)?;
        let mut part_max = self.alloc(parts)?;
        let mut part_sum = self
            .stream
            .alloc_zeros::<f64>(parts)
            .map_err(driver_error("allocating candidate sums"))?;
        let mut extra_ids = Vec::new();
        let mut extra_offsets = Vec::with_capacity(rows + 1);
        extra_offsets.push(0i32);
        for ids in extra {
            extra_ids.extend_from_slice(ids);
            extra_offsets.push(int(extra_ids.len(), "extra tokens")?);
        }
        let extra_ids_device = self.upload_u32(&extra_ids)?;
        let extra_offsets_device = self
            .stream
            .memcpy_stod(&extra_offsets)
            .map_err(driver_error("copying extra-token offsets to the GPU"))?;
        let stride = 2 * k + 2;
        let out_len = rows * stride + extra_ids.len();
        let mut out = self
            .stream
            .alloc_zeros::<u32>(out_len)
            .map_err(driver_error("allocating the candidates"))?;
        let grid_rows = u32::try_from(rows)
            .ok()
            .filter(|&r| r <= 65_535)
            .ok_or_else(|| invalid(format!("logit candidates: {rows} rows in one launch")))?;
        let (cols_arg, chunk_arg, k_arg, chunks_arg, rows_arg) = (
            int(cols, "columns")?,
            int(chunk_len, "chunk length")?,
            int(k, "k")?,
            int(chunks, "chunks")?,
            int(rows, "rows")?,
        );
        let partial = LaunchConfig {
            grid_dim: (chunks as u32, grid_rows, 1),
            block_dim: (SAMPLING_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(self, "logit_candidates_partial", partial;
            input, &cols_arg, &chunk_arg, &k_arg, &mut part_ids, &mut part_values,
            &mut part_max, &mut part_sum)?;
        let merge = LaunchConfig {
            grid_dim: (grid_rows, 1, 1),
            block_dim: (SAMPLING_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(self, "logit_candidates_merge", merge;
            &part_ids, &part_values, &part_max, &part_sum, &chunks_arg, &k_arg, input,
            &cols_arg, &extra_ids_device, &extra_offsets_device, &rows_arg, &mut out)?;
        let values = self
            .stream
            .memcpy_dtov(&out)
            .map_err(driver_error("copying the candidates to the host"))?;
        decode(&values, rows, cols, k, extra)
    }
}

/// The candidates of every row from the merge kernel's output.
fn decode(
    values: &[u32],
    rows: usize,
    cols: usize,
    k: usize,
    extra: &[Vec<u32>],
) -> Result<Vec<LogitCandidates>, CudaError> {
    let stride = 2 * k + 2;
    let short = || CudaError::Invalid {
        problem: format!(
            "the candidates came back with {} values, not {}",
            values.len(),
            rows * stride
        ),
    };
    let mut extra_values = values.get(rows * stride..).ok_or_else(short)?;
    let mut out = Vec::with_capacity(rows);
    for (row, asked) in extra.iter().enumerate().take(rows) {
        let part = values
            .get(row * stride..(row + 1) * stride)
            .ok_or_else(short)?;
        let count = k.min(cols);
        let top = part[..count]
            .iter()
            .zip(&part[k..k + count])
            .filter(|(&id, _)| id != NONE)
            .map(|(&id, &bits)| (id, f32::from_bits(bits)))
            .collect();
        let (row_extra, rest) = extra_values
            .split_at_checked(asked.len())
            .ok_or_else(short)?;
        extra_values = rest;
        out.push(LogitCandidates {
            vocab: cols,
            top,
            max: f32::from_bits(part[2 * k]),
            log_sum_exp: f32::from_bits(part[2 * k + 1]),
            extra: asked
                .iter()
                .zip(row_extra)
                .map(|(&id, &bits)| (id, f32::from_bits(bits)))
                .collect(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_kernels() {
        use crate::backend::cuda::kernels::kernel_define;
        assert_eq!(
            i64::from(SAMPLING_THREADS),
            kernel_define("sampling", "SAMPLING_THREADS")
        );
        assert_eq!(
            SAMPLING_PER_THREAD as i64,
            kernel_define("sampling", "SAMPLING_PER_THREAD")
        );
        assert_eq!(i64::from(NONE), kernel_define("sampling", "SAMPLING_NONE"));
    }

    #[test]
    fn long_rows_fit_the_merge() {
        for cols in [1usize, 97, 256, 4096, 151_936, 262_144, 1 << 20] {
            let (chunk_len, chunks) = chunking(cols);
            assert!(chunk_len <= SAMPLING_THREADS as usize * SAMPLING_PER_THREAD);
            assert!(chunks * chunk_len >= cols);
            assert!(chunks <= SAMPLING_THREADS as usize, "{cols}: {chunks}");
        }
    }
}
