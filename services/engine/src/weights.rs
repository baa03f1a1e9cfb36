//! Host-side views of stored weights and the f32-accumulating matrix kernels over them.
//!
//! Owns: decoding rows of f32 / bf16 / int8 / int4 matrices straight out of the mmapped artifact
//! (one block of rows at a time into a small scratch buffer, never the whole tensor) and
//! `x · Wᵀ` on the CPU. Used by the CPU backend and by the in-process expert executor.
//! Must not touch: the quantized byte layout itself (that is `ninfer_artifact::quant`).

use std::sync::Arc;

use half::bf16;
use ninfer_artifact::quant::dequantize_rows;
use ninfer_artifact::{Artifact, DType, QuantizedLayout, TensorView};

use crate::error::EngineError;

/// Rows decoded together: big enough to amortise the per-row call, small enough to stay in L1/L2.
const ROW_BLOCK: usize = 16;

/// Multiply-adds above which `matmul` splits the output rows over threads.
const PARALLEL_WORK_THRESHOLD: usize = 1 << 22;

/// A stored 2-D weight `[rows, cols]` (a 1-D tensor is seen as one row), borrowed from the mapping.
#[derive(Clone, Copy)]
pub struct WeightMatrix<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    bytes: &'a [u8],
    layout: Option<QuantizedLayout>,
}

impl<'a> WeightMatrix<'a> {
    /// Views a tensor of the artifact as a matrix.
    pub fn from_view(view: &TensorView<'a>) -> Result<Self, EngineError> {
        let invalid = |problem: String| EngineError::InvalidWeight {
            name: view.name().to_string(),
            problem,
        };
        let (rows, cols) = match view.shape() {
            [n] => (1, *n as usize),
            [rows, cols] => (*rows as usize, *cols as usize),
            other => {
                return Err(invalid(format!(
                    "expected a 1-D or 2-D tensor, shape is {other:?}"
                )))
            }
        };
        let layout = if view.dtype().is_quantized() {
            Some(view.quantized_layout().ok_or_else(|| {
                invalid(format!(
                    "{} tensor without a valid quantized layout",
                    view.dtype()
                ))
            })?)
        } else {
            None
        };
        let element_bytes = match view.dtype() {
            DType::F32 => 4,
            DType::Bf16 => 2,
            DType::Int8 | DType::Int4 => 0,
        };
        if element_bytes > 0 && view.bytes.len() != rows * cols * element_bytes {
            return Err(invalid(format!(
                "{} bytes do not hold {rows}×{cols} {} values",
                view.bytes.len(),
                view.dtype()
            )));
        }
        Ok(WeightMatrix {
            dtype: view.dtype(),
            rows,
            cols,
            bytes: view.bytes,
            layout,
        })
    }

    /// Views raw stored bytes (e.g. an expert copied out of its bank) as a `[rows, cols]`
    /// matrix of `dtype`, checking that they hold exactly that.
    pub fn from_raw(
        dtype: DType,
        rows: usize,
        cols: usize,
        bytes: &'a [u8],
    ) -> Result<Self, EngineError> {
        let invalid = |problem: String| EngineError::InvalidWeight {
            name: "expert slot".into(),
            problem,
        };
        let (layout, expected) = match dtype {
            DType::F32 => (None, rows * cols * 4),
            DType::Bf16 => (None, rows * cols * 2),
            DType::Int8 | DType::Int4 => {
                let layout = QuantizedLayout::new(dtype, rows, cols).map_err(invalid)?;
                let total = layout.total_bytes;
                (Some(layout), total)
            }
        };
        if bytes.len() < expected {
            return Err(invalid(format!(
                "{} bytes do not hold a {rows}×{cols} {dtype} matrix ({expected} bytes)",
                bytes.len()
            )));
        }
        Ok(WeightMatrix {
            dtype,
            rows,
            cols,
            bytes: &bytes[..expected],
            layout,
        })
    }

    /// Decodes rows `first..first+count` into `out` (`count × cols` f32 values).
    pub fn decode_rows(&self, first: usize, count: usize, out: &mut [f32]) {
        let cols = self.cols;
        let out = &mut out[..count * cols];
        match self.dtype {
            DType::F32 => {
                let source = &self.bytes[first * cols * 4..(first + count) * cols * 4];
                for (value, chunk) in out.iter_mut().zip(source.chunks_exact(4)) {
                    *value = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
                }
            }
            DType::Bf16 => {
                let source = &self.bytes[first * cols * 2..(first + count) * cols * 2];
                for (value, chunk) in out.iter_mut().zip(source.chunks_exact(2)) {
                    *value = bf16::from_le_bytes([chunk[0], chunk[1]]).to_f32();
                }
            }
            DType::Int8 | DType::Int4 => {
                if let Some(layout) = &self.layout {
                    dequantize_rows(self.bytes, layout, first, count, out);
                }
            }
        }
    }

    /// The whole tensor as f32 (for small parameter vectors only).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        self.decode_rows(0, self.rows, &mut out);
        out
    }

    /// `out[t, r] = Σ_c x[t, c] · W[r, c]` for `tokens` rows of `x` (`out` is `[tokens, rows]`).
    pub fn matmul(&self, x: &[f32], tokens: usize, out: &mut [f32]) {
        debug_assert_eq!(x.len(), tokens * self.cols);
        debug_assert_eq!(out.len(), tokens * self.rows);
        let work = tokens * self.rows * self.cols;
        let threads = if work >= PARALLEL_WORK_THRESHOLD {
            worker_threads().min(self.rows.div_ceil(ROW_BLOCK))
        } else {
            1
        };
        if threads <= 1 {
            let mut partial = vec![0.0f32; tokens * self.rows];
            self.matmul_row_range(x, tokens, 0, self.rows, &mut partial);
            out.copy_from_slice(&partial);
            return;
        }
        // Each thread owns a contiguous range of weight rows and writes a `[tokens, its rows]`
        // block; the blocks are scattered into `out` afterwards (outputs are row-major by token).
        let per_thread = self.rows.div_ceil(threads).div_ceil(ROW_BLOCK) * ROW_BLOCK;
        let ranges: Vec<(usize, usize)> = (0..self.rows)
            .step_by(per_thread)
            .map(|start| (start, (start + per_thread).min(self.rows)))
            .collect();
        let blocks: Vec<Vec<f32>> = std::thread::scope(|scope| {
            let handles: Vec<_> = ranges
                .iter()
                .map(|&(start, end)| {
                    scope.spawn(move || {
                        let mut block = vec![0.0f32; tokens * (end - start)];
                        self.matmul_row_range(x, tokens, start, end, &mut block);
                        block
                    })
                })
                .collect();
            handles
                .into_iter()
                // A panicking worker is a bug in this file: re-raise it rather than return zeros.
                .map(|handle| {
                    handle
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
                })
                .collect()
        });
        for (&(start, end), block) in ranges.iter().zip(&blocks) {
            let width = end - start;
            if block.len() != tokens * width {
                continue;
            }
            for t in 0..tokens {
                out[t * self.rows + start..t * self.rows + end]
                    .copy_from_slice(&block[t * width..(t + 1) * width]);
            }
        }
    }

    /// Rows `start..end` of the product into `block` (`[tokens, end-start]`).
    fn matmul_row_range(
        &self,
        x: &[f32],
        tokens: usize,
        start: usize,
        end: usize,
        block: &mut [f32],
    ) {
        let cols = self.cols;
        let width = end - start;
        let mut scratch = vec![0.0f32; ROW_BLOCK * cols];
        let mut first = start;
        while first < end {
            let count = ROW_BLOCK.min(end - first);
            self.decode_rows(first, count, &mut scratch);
            for t in 0..tokens {
                let input = &x[t * cols..(t + 1) * cols];
                for local in 0..count {
                    let row = &scratch[local * cols..(local + 1) * cols];
                    block[t * width + first - start + local] = dot(input, row);
                }
            }
            first += count;
        }
    }
}

/// f32 dot product with eight independent accumulators (lets the compiler vectorise it).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        for lane in 0..8 {
            lanes[lane] += a[i * 8 + lane] * b[i * 8 + lane];
        }
    }
    let mut sum = 0.0f32;
    for i in chunks * 8..a.len() {
        sum += a[i] * b[i];
    }
    let pairs = [
        lanes[0] + lanes[4],
        lanes[1] + lanes[5],
        lanes[2] + lanes[6],
        lanes[3] + lanes[7],
    ];
    sum + (pairs[0] + pairs[2]) + (pairs[1] + pairs[3])
}

/// Threads the CPU kernels may use (`NINFER_CPU_THREADS` overrides the core count).
pub fn worker_threads() -> usize {
    std::env::var("NINFER_CPU_THREADS")
        .ok()
        .and_then(|text| text.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        })
}

/// A validated weight of the artifact: the artifact stays mapped as long as any handle lives,
/// and the matrix view is rebuilt from the stored range without a lookup.
#[derive(Clone)]
pub struct StoredWeight {
    artifact: Arc<Artifact>,
    name: String,
    dtype: DType,
    rows: usize,
    cols: usize,
    layout: Option<QuantizedLayout>,
    range: std::ops::Range<usize>,
}

impl StoredWeight {
    pub fn new(artifact: &Arc<Artifact>, name: &str) -> Result<Self, EngineError> {
        let view = artifact.tensor(name)?;
        let matrix = WeightMatrix::from_view(&view)?;
        let start = view.entry.offset as usize;
        Ok(StoredWeight {
            artifact: Arc::clone(artifact),
            name: name.to_string(),
            dtype: matrix.dtype,
            rows: matrix.rows,
            cols: matrix.cols,
            layout: matrix.layout,
            range: start..start + view.bytes.len(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// The matrix view (validated at construction).
    pub fn matrix(&self) -> WeightMatrix<'_> {
        WeightMatrix {
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
            bytes: &self.artifact.bytes()[self.range.clone()],
            layout: self.layout,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The threaded path (large products) equals a plain triple loop.
    #[test]
    fn threaded_matmul_equals_plain_loop() {
        let (rows, cols, tokens) = (300, 64, 256);
        assert!(rows * cols * tokens >= PARALLEL_WORK_THRESHOLD);
        let weights: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0) - 0.5)
            .collect();
        let bytes = ninfer_artifact::quant::f32_to_bytes(&weights);
        let matrix = WeightMatrix {
            dtype: DType::F32,
            rows,
            cols,
            bytes: &bytes,
            layout: None,
        };
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| ((i * 104729 % 997) as f32 / 997.0) - 0.5)
            .collect();
        let mut out = vec![0.0f32; tokens * rows];
        matrix.matmul(&x, tokens, &mut out);
        let mut worst = 0.0f32;
        for t in 0..tokens {
            for r in 0..rows {
                let expected: f32 = (0..cols)
                    .map(|c| x[t * cols + c] * weights[r * cols + c])
                    .sum();
                worst = worst.max((expected - out[t * rows + r]).abs());
            }
        }
        assert!(worst < 1e-5, "{worst}");
    }
}
