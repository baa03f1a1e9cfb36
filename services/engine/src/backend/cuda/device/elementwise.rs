//! Launches of `kernels/elementwise.cu`: row gathers and column slices, embedding, RoPE (with
//! its device tables), residual adds, SiLU / sigmoid gating, the causal conv1d of Gated
//! DeltaNet and its delta-rule gates.
//!
//! Owns: each of these ops' shape checks and launch geometry, and the rope tables' cache.
//! Must not touch: the norm kernels (`norm.rs`), matmuls (`matmul.rs`).

use std::ops::Range;

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};

use super::super::CudaError;
use super::{
    elementwise, int, CudaBackend, CudaConvState, CudaTensor, CudaWeight, RopeTables, WeightData,
};
use crate::backend::{MultimodalRotation, Rotation, Segment};
use crate::host_math::rope_inverse_frequencies;

/// `PLE_GATE_THREADS` in `kernels/elementwise.cu`: one warp per (row, stream).
const PLE_GATE_THREADS: u32 = 32;

impl CudaBackend {
    pub(super) fn launch_gather_rows(
        &self,
        x: &CudaTensor,
        rows: &[usize],
    ) -> Result<CudaTensor, CudaError> {
        let input = &*x.data;
        if let Some(&bad) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(CudaError::Invalid {
                problem: format!("gather_rows: row {bad} of a {}-row tensor", x.rows),
            });
        }
        let indices: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let indices = self.upload_u32(&indices)?;
        // `gather_rows` writes every element.
        let mut out = self.output_uninit(rows.len(), x.cols)?;
        let total = rows.len() * x.cols;
        if total > 0 {
            let (count, cols) = (int(rows.len(), "rows")?, int(x.cols, "cols")?);
            let output = &mut *out.data;
            launch!(self, "gather_rows", elementwise(total); input, &indices, output, &count, &cols)?;
        }
        Ok(out)
    }

    /// `[a; b]` by two device copies (rows are contiguous).
    pub(super) fn launch_concat_rows(
        &self,
        a: &CudaTensor,
        b: &CudaTensor,
    ) -> Result<CudaTensor, CudaError> {
        if a.cols != b.cols {
            return Err(CudaError::Invalid {
                problem: format!("concat_rows of {} columns and {} columns", a.cols, b.cols),
            });
        }
        let (first, second) = (a.rows * a.cols, b.rows * b.cols);
        // Both copies together write every element.
        let mut out = self.output_uninit(a.rows + b.rows, a.cols)?;
        if first > 0 {
            self.copy_range(&a.data, 0..first, &mut out.data, 0..first)?;
        }
        if second > 0 {
            self.copy_range(&b.data, 0..second, &mut out.data, first..first + second)?;
        }
        Ok(out)
    }

    pub(super) fn launch_columns(
        &self,
        x: &CudaTensor,
        range: Range<usize>,
    ) -> Result<CudaTensor, CudaError> {
        if range.end > x.cols {
            return Err(CudaError::Invalid {
                problem: format!("columns {range:?} of a {}-column tensor", x.cols),
            });
        }
        let width = range.len();
        let rows = int(x.rows, "rows")?;
        let (cols, start, width_arg) = (x.cols as i32, range.start as i32, width as i32);
        self.unary(x, width, |input, output| {
            launch!(self, "columns", elementwise(x.rows * width);
                input, output, &rows, &cols, &start, &width_arg)
        })
    }

    pub(super) fn launch_silu_mul_halves(
        &self,
        gate_up: &CudaTensor,
    ) -> Result<CudaTensor, CudaError> {
        let half = gate_up.cols / 2;
        let rows = int(gate_up.rows, "rows")?;
        let half_arg = half as i32;
        self.unary(gate_up, half, |input, output| {
            launch!(self, "silu_mul_halves", elementwise(gate_up.rows * half);
                input, output, &rows, &half_arg)
        })
    }

    pub(super) fn launch_split_interleaved(
        &self,
        x: &CudaTensor,
        groups: usize,
        first: usize,
        second: usize,
    ) -> Result<(CudaTensor, CudaTensor), CudaError> {
        let input = &*x.data;
        if groups * (first + second) != x.cols {
            return Err(CudaError::Invalid {
                problem: format!(
                    "split_interleaved: {groups}×({first}+{second}) columns of a {}-column tensor",
                    x.cols
                ),
            });
        }
        // `split_interleaved` writes every element of both.
        let mut a = self.output_uninit(x.rows, groups * first)?;
        let mut b = self.output_uninit(x.rows, groups * second)?;
        let total = x.rows * x.cols;
        if total > 0 {
            let rows = int(x.rows, "rows")?;
            let (groups, first, second) = (
                int(groups, "groups")?,
                int(first, "first")?,
                int(second, "second")?,
            );
            let (out_a, out_b) = (&mut *a.data, &mut *b.data);
            launch!(self, "split_interleaved", elementwise(total);
                input, out_a, out_b, &rows, &groups, &first, &second)?;
        }
        Ok((a, b))
    }

    pub(super) fn launch_embed(
        &self,
        table: &CudaWeight,
        ids: &[u32],
    ) -> Result<CudaTensor, CudaError> {
        // A step graph's ids are its device inputs; otherwise they are uploaded.
        let uploaded;
        let indices: u64 = match self.active_step_graph() {
            Some(graph) if graph.rows == ids.len() => graph.ids,
            Some(graph) => {
                return Err(CudaError::Invalid {
                    problem: format!(
                        "embedding {} ids in a step graph of {} rows",
                        ids.len(),
                        graph.rows
                    ),
                })
            }
            None => {
                uploaded = self.upload_u32(ids)?;
                uploaded.device_ptr(&self.stream).0
            }
        };
        // `embed` writes every element (zero for an id outside the table).
        let mut out = self.output_uninit(ids.len(), table.cols)?;
        let total = ids.len() * table.cols;
        if total > 0 {
            let (rows, cols, vocab) = (
                int(ids.len(), "tokens")?,
                int(table.cols, "hidden")?,
                int(table.rows, "vocab")?,
            );
            let output = &mut *out.data;
            match &table.data {
                WeightData::F32(data) => launch!(self, "embed", elementwise(total);
                    data, &indices, output, &rows, &cols, &vocab)?,
                WeightData::Bf16(data) => launch!(self, "embed_bf16", elementwise(total);
                    data, &indices, output, &rows, &cols, &vocab)?,
            }
        }
        Ok(out)
    }

    pub(super) fn launch_rope(
        &self,
        x: &mut CudaTensor,
        rotation: &Rotation<'_>,
    ) -> Result<(), CudaError> {
        let (positions, head_dim) = (rotation.positions, rotation.head_dim);
        let (rotary_dim, theta) = (rotation.rotary_dim, rotation.theta);
        let half = rotary_dim / 2;
        let rows = positions.len().min(x.rows);
        if half == 0 || rows == 0 || head_dim == 0 {
            return Ok(());
        }
        if rotary_dim > head_dim || x.cols % head_dim != 0 {
            return Err(CudaError::Invalid {
                problem: format!(
                    "rope: rotary_dim {rotary_dim}, head_dim {head_dim}, {} columns",
                    x.cols
                ),
            });
        }
        if let Some(multimodal) = &rotation.multimodal {
            return self.launch_multimodal_rope(x, multimodal, rows, head_dim, rotary_dim, theta);
        }
        let total = rows * (x.cols / head_dim) * half;
        let (rows_arg, cols, head_dim, half) = (
            int(rows, "rows")?,
            int(x.cols, "cols")?,
            int(head_dim, "head_dim")?,
            int(half, "rotary half")?,
        );
        let data = &mut *x.data;
        self.with_rope_tables(
            &positions[..rows],
            rotary_dim,
            theta,
            |positions, inverse| {
                launch!(self, "rope", elementwise(total);
                data, positions, inverse, &rows_arg, &cols, &head_dim, &half)
            },
        )
    }

    /// Interleaved M-RoPE (image prompts, never inside a step graph): each row's position per
    /// frequency, picked from its three streams here, in a table of `rows · rotary_dim / 2`.
    fn launch_multimodal_rope(
        &self,
        x: &mut CudaTensor,
        multimodal: &MultimodalRotation<'_>,
        rows: usize,
        head_dim: usize,
        rotary_dim: usize,
        theta: f64,
    ) -> Result<(), CudaError> {
        if self.active_step_graph().is_some() {
            return Err(CudaError::Invalid {
                problem: "multimodal rotary positions inside a step graph".into(),
            });
        }
        let half = rotary_dim / 2;
        if multimodal.streams.len() < rows {
            return Err(CudaError::Invalid {
                problem: format!(
                    "{} multimodal positions for {rows} rows",
                    multimodal.streams.len()
                ),
            });
        }
        let mut per_frequency = Vec::with_capacity(rows * half);
        for streams in &multimodal.streams[..rows] {
            for frequency in 0..half {
                let position = streams[multimodal.stream_of_frequency(frequency)];
                per_frequency.push(u32::try_from(position).map_err(|_| CudaError::Invalid {
                    problem: format!("rotary position {position} does not fit 32 bits"),
                })?);
            }
        }
        // Freed in stream order after the launch that reads it.
        let positions = self.upload_u32(&per_frequency)?;
        let positions_pointer = positions.device_ptr(&self.stream).0;
        let inverse = self.rope_inverse_table(rotary_dim, theta)?;
        let total = rows * (x.cols / head_dim) * half;
        let (rows_arg, cols, head_dim, half) = (
            int(rows, "rows")?,
            int(x.cols, "cols")?,
            int(head_dim, "head_dim")?,
            int(half, "rotary half")?,
        );
        let data = &mut *x.data;
        launch!(self, "rope_per_frequency", elementwise(total);
            data, &positions_pointer, &inverse, &rows_arg, &cols, &head_dim, &half)
    }

    fn lock_rope_tables(&self) -> Result<std::sync::MutexGuard<'_, RopeTables>, CudaError> {
        self.rope_tables.lock().map_err(|_| CudaError::Invalid {
            problem: "the rope cache's lock is poisoned".into(),
        })
    }

    /// Uploads the inverse frequencies of `(rotary_dim, theta)` into `tables` unless they are
    /// there; their key.
    fn upload_inverse_frequencies_once(
        &self,
        tables: &mut RopeTables,
        rotary_dim: usize,
        theta: f64,
    ) -> Result<(usize, u64), CudaError> {
        let key = (rotary_dim, theta.to_bits());
        if let std::collections::hash_map::Entry::Vacant(entry) = tables.inverse.entry(key) {
            entry.insert(self.upload_f32(&rope_inverse_frequencies(rotary_dim, theta))?);
        }
        Ok(key)
    }

    /// The device pointer of the inverse frequencies of `(rotary_dim, theta)` (uploaded once;
    /// the table's buffer lives as long as the backend, entries are never removed).
    pub(super) fn rope_inverse_table(
        &self,
        rotary_dim: usize,
        theta: f64,
    ) -> Result<u64, CudaError> {
        let mut tables = self.lock_rope_tables()?;
        let key = self.upload_inverse_frequencies_once(&mut tables, rotary_dim, theta)?;
        let inverse = tables.inverse.get(&key).ok_or_else(|| CudaError::Invalid {
            problem: "rope tables missing after upload".into(),
        })?;
        let pointer = inverse.device_ptr(&self.stream).0;
        Ok(pointer)
    }

    /// Runs `launch` with the device tables of a rotation: `positions` as u32 (uploaded when
    /// they differ from the last ones: every attention layer of a forward rotates q and k at
    /// the same positions) and the inverse frequencies of `(rotary_dim, theta)` (uploaded once).
    pub(super) fn with_rope_tables<T>(
        &self,
        positions: &[usize],
        rotary_dim: usize,
        theta: f64,
        launch: impl FnOnce(&u64, &CudaSlice<f32>) -> Result<T, CudaError>,
    ) -> Result<T, CudaError> {
        let mut tables = self.lock_rope_tables()?;
        let key = self.upload_inverse_frequencies_once(&mut tables, rotary_dim, theta)?;
        // A step graph's positions are its device inputs (one per row, the rows in order).
        if let Some(graph) = self.active_step_graph() {
            if positions.len() > graph.rows {
                return Err(CudaError::Invalid {
                    problem: format!(
                        "rope over {} rows in a step graph of {}",
                        positions.len(),
                        graph.rows
                    ),
                });
            }
            let inverse = tables.inverse.get(&key).ok_or_else(|| CudaError::Invalid {
                problem: "rope tables missing after upload".into(),
            })?;
            return launch(&graph.positions, inverse);
        }
        let positions: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        if tables
            .positions
            .as_ref()
            .is_none_or(|(held, _)| *held != positions)
        {
            let uploaded = self.upload_u32(&positions)?;
            tables.positions = Some((positions, uploaded));
        }
        let (Some(inverse), Some((_, positions))) =
            (tables.inverse.get(&key), tables.positions.as_ref())
        else {
            return Err(CudaError::Invalid {
                problem: "rope tables missing after upload".into(),
            });
        };
        let positions = positions.device_ptr(&self.stream).0;
        launch(&positions, inverse)
    }

    pub(super) fn launch_add_assign(
        &self,
        a: &mut CudaTensor,
        b: &CudaTensor,
    ) -> Result<(), CudaError> {
        Self::check_same_shape(a, b, "add_assign")?;
        let other = &*b.data;
        let total = a.rows * a.cols;
        let n = total as i64;
        let data = &mut *a.data;
        if total > 0 {
            launch!(self, "add_assign", elementwise(total); data, other, &n)?;
        }
        Ok(())
    }

    pub(super) fn launch_add_sigmoid_scaled_rows(
        &self,
        a: &mut CudaTensor,
        b: &CudaTensor,
        gate: &CudaTensor,
    ) -> Result<(), CudaError> {
        Self::check_same_shape(a, b, "add_sigmoid_scaled_rows")?;
        if gate.rows != a.rows || gate.cols == 0 {
            return Err(CudaError::Invalid {
                problem: format!(
                    "add_sigmoid_scaled_rows: gate {}×{} for {} rows",
                    gate.rows, gate.cols, a.rows
                ),
            });
        }
        let (other, gate_data) = (&*b.data, &*gate.data);
        let total = a.rows * a.cols;
        let (rows, cols, gate_cols) = (
            int(a.rows, "rows")?,
            int(a.cols, "cols")?,
            int(gate.cols, "gate cols")?,
        );
        let data = &mut *a.data;
        if total > 0 {
            launch!(self, "add_sigmoid_scaled_rows", elementwise(total);
                data, other, gate_data, &rows, &cols, &gate_cols)?;
        }
        Ok(())
    }

    pub(super) fn launch_scaled_silu(
        &self,
        x: &CudaTensor,
        scale: f32,
    ) -> Result<CudaTensor, CudaError> {
        let total = x.rows * x.cols;
        let n = total as i64;
        self.unary(x, x.cols, |input, output| {
            launch!(self, "scaled_silu", elementwise(total); input, output, &scale, &n)
        })
    }

    pub(super) fn launch_stream_mix(
        &self,
        x: &CudaTensor,
        gate: &CudaTensor,
        streams: usize,
        scale: f32,
    ) -> Result<CudaTensor, CudaError> {
        Self::check_same_shape(x, gate, "stream_mix")?;
        if streams == 0 || x.cols % streams != 0 {
            return Err(CudaError::Invalid {
                problem: format!("stream_mix: {streams} streams over rows of {}", x.cols),
            });
        }
        let width = x.cols / streams;
        let gate_data = &*gate.data;
        let (rows, width_arg, streams_arg) = (
            int(x.rows, "rows")?,
            int(width, "stream width")?,
            int(streams, "streams")?,
        );
        self.unary(x, width, |input, output| {
            launch!(self, "stream_mix", elementwise(x.rows * width);
                input, gate_data, output, &rows, &width_arg, &streams_arg, &scale)
        })
    }

    pub(super) fn launch_inject_into_streams(
        &self,
        streams: &mut CudaTensor,
        output: &CudaTensor,
        shares: &CudaTensor,
        scale: f32,
    ) -> Result<(), CudaError> {
        let count = shares.cols;
        if count == 0
            || shares.rows != streams.rows
            || output.rows != streams.rows
            || streams.cols != count * output.cols
        {
            return Err(CudaError::Invalid {
                problem: format!(
                    "inject_into_streams: streams {}×{}, output {}×{}, shares {}×{}",
                    streams.rows, streams.cols, output.rows, output.cols, shares.rows, shares.cols
                ),
            });
        }
        let total = streams.rows * streams.cols;
        let (rows, width, count_arg) = (
            int(streams.rows, "rows")?,
            int(output.cols, "stream width")?,
            int(count, "streams")?,
        );
        let (output_data, shares_data) = (&*output.data, &*shares.data);
        let data = &mut *streams.data;
        if total > 0 {
            launch!(self, "inject_into_streams", elementwise(total);
                data, output_data, shares_data, &rows, &width, &count_arg, &scale)?;
        }
        Ok(())
    }

    pub(super) fn launch_ple_gate(
        &self,
        keys: &CudaTensor,
        queries: &CudaTensor,
        values: &CudaTensor,
        streams: usize,
        scale: f32,
    ) -> Result<CudaTensor, CudaError> {
        Self::check_same_shape(keys, queries, "ple_gate")?;
        let width = values.cols;
        if keys.rows != values.rows || keys.cols != streams * width {
            return Err(CudaError::Invalid {
                problem: format!(
                    "ple_gate: keys {}×{}, values {}×{}, {streams} streams",
                    keys.rows, keys.cols, values.rows, values.cols
                ),
            });
        }
        let pairs = keys.rows * streams;
        let config = LaunchConfig {
            grid_dim: (pairs.clamp(1, 1 << 20) as u32, 1, 1),
            block_dim: (PLE_GATE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (query_data, value_data) = (&*queries.data, &*values.data);
        let (rows, width_arg, streams_arg) = (
            int(keys.rows, "rows")?,
            int(width, "stream width")?,
            int(streams, "streams")?,
        );
        self.unary(keys, keys.cols, |input, output| {
            launch!(self, "ple_gate", config;
                input, query_data, value_data, output, &rows, &width_arg, &streams_arg, &scale)
        })
    }

    pub(super) fn launch_causal_conv1d_silu(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        segments: &mut [Segment<'_, CudaConvState>],
    ) -> Result<CudaTensor, CudaError> {
        let input = &*x.data;
        // The kernel writes every channel of each of a segment's rows.
        let mut out = self.output_for_segments(
            x.rows,
            x.cols,
            segments.iter().map(|segment| segment.rows.clone()),
        )?;
        conv_segments(
            x,
            weight,
            segments,
            |[row_start, rows, channels, kernel], history| {
                let output = &mut *out.data;
                launch!(self, "causal_conv1d_silu", elementwise(x.cols);
                input, weight.f32()?, history, output, &row_start, &rows, &channels, &kernel)
            },
        )?;
        Ok(out)
    }

    pub(super) fn launch_causal_conv1d_silu_split3(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        segments: &mut [Segment<'_, CudaConvState>],
        widths: [usize; 3],
    ) -> Result<[CudaTensor; 3], CudaError> {
        if widths.iter().sum::<usize>() != x.cols {
            return Err(CudaError::Invalid {
                problem: format!(
                    "causal_conv1d_silu_split3: {}+{}+{} channels of a {}-channel input",
                    widths[0], widths[1], widths[2], x.cols
                ),
            });
        }
        let input = &*x.data;
        // The kernel writes every channel of each of a segment's rows.
        let ranges = || segments.iter().map(|segment| segment.rows.clone());
        let mut outputs = [
            self.output_for_segments(x.rows, widths[0], ranges())?,
            self.output_for_segments(x.rows, widths[1], ranges())?,
            self.output_for_segments(x.rows, widths[2], ranges())?,
        ];
        let (w0, w1) = (int(widths[0], "width")?, int(widths[1], "width")?);
        conv_segments(
            x,
            weight,
            segments,
            |[row_start, rows, channels, kernel], history| {
                let [a, b, c] = &mut outputs;
                let (out_a, out_b, out_c) = (&mut *a.data, &mut *b.data, &mut *c.data);
                launch!(self, "causal_conv1d_silu_split3", elementwise(x.cols);
                input, weight.f32()?, history, out_a, out_b, out_c, &row_start, &rows,
                &channels, &kernel, &w0, &w1)
            },
        )?;
        Ok(outputs)
    }

    pub(super) fn launch_delta_rule_gates(
        &self,
        a: &CudaTensor,
        b: &CudaTensor,
        a_log: &CudaWeight,
        dt_bias: &CudaWeight,
    ) -> Result<(CudaTensor, CudaTensor), CudaError> {
        Self::check_same_shape(a, b, "delta_rule_gates")?;
        let nv = a.cols;
        if a_log.rows * a_log.cols != nv || dt_bias.rows * dt_bias.cols != nv {
            return Err(CudaError::Invalid {
                problem: format!("delta_rule_gates: {nv} heads, A_log / dt_bias sizes differ"),
            });
        }
        let (a_data, b_data) = (&*a.data, &*b.data);
        // The kernel writes every element of both (nothing when there are none).
        let mut g = self.output_uninit(a.rows, nv)?;
        let mut beta = self.output_uninit(a.rows, nv)?;
        let total = a.rows * nv;
        if total > 0 {
            let (rows, heads) = (int(a.rows, "rows")?, int(nv, "heads")?);
            let (g_out, beta_out) = (&mut *g.data, &mut *beta.data);
            launch!(self, "delta_rule_gates", elementwise(total);
                a_data, b_data, a_log.f32()?, dt_bias.f32()?, g_out, beta_out, &rows, &heads)?;
        }
        Ok((g, beta))
    }
}

/// Each non-empty segment of a causal conv over `x` with taps `weight`, its state checked
/// against both: `launch` gets the kernel's (row_start, rows, channels, kernel) and the
/// segment's history.
fn conv_segments(
    x: &CudaTensor,
    weight: &CudaWeight,
    segments: &mut [Segment<'_, CudaConvState>],
    mut launch: impl FnMut([i32; 4], &mut CudaSlice<f32>) -> Result<(), CudaError>,
) -> Result<(), CudaError> {
    for segment in segments.iter_mut() {
        let state = &mut *segment.state;
        if state.channels != x.cols || weight.rows != x.cols || weight.cols != state.kernel {
            return Err(CudaError::Invalid {
                problem: format!(
                    "causal_conv1d: {} channels, taps {}×{}, state {}×{}",
                    x.cols, weight.rows, weight.cols, state.channels, state.kernel
                ),
            });
        }
        let n = segment.rows.len();
        if n == 0 {
            continue;
        }
        let arguments = [
            int(segment.rows.start, "row")?,
            int(n, "rows")?,
            int(x.cols, "channels")?,
            int(state.kernel, "kernel")?,
        ];
        launch(arguments, &mut state.history)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_kernels() {
        use super::super::super::kernels::kernel_define;
        assert_eq!(
            PLE_GATE_THREADS as i64,
            kernel_define("elementwise", "PLE_GATE_THREADS")
        );
    }
}
