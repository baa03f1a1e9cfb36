//! Launches of `kernels/norm.cu`: RMSNorm, its fused forms (residual add + norm, per-head norm
//! + RoPE) and the gated GDN output norm.
//!
//! Owns: how a tensor's rows split into norm groups, and the norm kernels' launch geometry.
//! Must not touch: RoPE's tables (`elementwise.rs`).

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::super::CudaError;
use super::{int, CudaBackend, CudaTensor, CudaWeight, WeightData};
use crate::backend::{NormStyle, ResidualNorm, Rotation};

/// `NORM_THREADS` in `kernels/norm_common.cuh`.
pub(super) const NORM_THREADS: u32 = 256;
/// `NORM_CACHED` in `kernels/norm_common.cuh`: a row of at most `NORM_THREADS · NORM_CACHED`
/// values stays in registers (the widest row the fused add + norm + router kernel takes).
pub(super) const NORM_CACHED: u32 = 16;

/// The residual add and norm a one-token kernel folds into its own launch (each block forms the
/// normed row with the norm kernel's registers and tree): `x` and `delta` one row of the same
/// width, at most `NORM_THREADS · NORM_CACHED` values, normed as one group by f32 weights. The
/// weights and the style's offset, or `None` where the separate `add_rms_norm` must run.
pub(super) fn foldable_residual_norm<'w>(
    x: &CudaTensor,
    delta: &CudaTensor,
    norm: &ResidualNorm<'w, CudaWeight>,
) -> Option<(&'w CudaSlice<f32>, f32)> {
    let WeightData::F32(weight) = &norm.weight.data else {
        return None;
    };
    let width = delta.cols;
    (delta.rows == 1
        && (x.rows, x.cols) == (delta.rows, delta.cols)
        && width > 0
        && width <= (NORM_THREADS * NORM_CACHED) as usize
        && norm.weight.rows * norm.weight.cols == width)
        .then_some((weight, style_offset(norm.style)))
}

/// What the norm kernels add to the weight for `style`.
fn style_offset(style: NormStyle) -> f32 {
    match style {
        NormStyle::Plain => 0.0,
        NormStyle::ZeroCentred => 1.0,
    }
}

/// What the RMSNorm kernels take for `x` normed in groups of `weight`'s length: the group
/// count (as a count and as the kernel's `long long`), the group length, and the offset
/// `style` adds to the weight.
pub(super) fn norm_groups(
    x: &CudaTensor,
    weight: &CudaWeight,
    style: NormStyle,
    op: &str,
) -> Result<(usize, i64, i32, f32), CudaError> {
    let group = weight.rows * weight.cols;
    if group == 0 || (x.rows * x.cols) % group != 0 {
        return Err(CudaError::Invalid {
            problem: format!("{op}: weight of {group} over rows of {}", x.cols),
        });
    }
    let groups = x.rows * x.cols / group;
    Ok((
        groups,
        groups as i64,
        int(group, "group")?,
        style_offset(style),
    ))
}

/// The head size of `x` normed per head by `weight` and rotated by `rotation` in one
/// `rms_norm_rope` launch, or `None` where the kernel does not apply (the norm's groups are not
/// the heads, nothing rotates, or a row has no position).
fn one_launch_norm_rope_group(
    x: &CudaTensor,
    weight: &CudaWeight,
    rotation: &Rotation<'_>,
) -> Option<usize> {
    let group = weight.rows * weight.cols;
    let applies = group != 0
        && group == rotation.head_dim
        && x.cols % group == 0
        && x.rows != 0
        && rotation.rotary_dim / 2 != 0
        && rotation.rotary_dim <= rotation.head_dim
        && rotation.positions.len() >= x.rows
        // The fused kernel turns by one position per row; image prompts take the refusing path.
        && rotation.multimodal.is_none();
    applies.then_some(group)
}

impl CudaBackend {
    pub(super) fn norm_config(groups: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (groups.clamp(1, 1 << 20) as u32, 1, 1),
            block_dim: (NORM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    pub(super) fn launch_rms_norm(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
        style: NormStyle,
    ) -> Result<CudaTensor, CudaError> {
        let (groups, groups_arg, group_arg, offset) = norm_groups(x, weight, style, "rms_norm")?;
        self.unary(x, x.cols, |input, output| {
            launch!(self, "rms_norm", Self::norm_config(groups);
                input, weight.f32()?, output, &groups_arg, &group_arg, &eps, &offset)
        })
    }

    pub(super) fn launch_row_weighted_rms_norm(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        group: usize,
        eps: f32,
        style: NormStyle,
    ) -> Result<CudaTensor, CudaError> {
        let width = weight.rows * weight.cols;
        if group == 0 || width != x.cols || x.cols % group != 0 {
            return Err(CudaError::Invalid {
                problem: format!(
                    "row_weighted_rms_norm: groups of {group} with a weight of {width} over rows of {}",
                    x.cols
                ),
            });
        }
        let groups = x.rows * x.cols / group;
        let offset: f32 = match style {
            NormStyle::Plain => 0.0,
            NormStyle::ZeroCentred => 1.0,
        };
        let (groups_arg, group_arg) = (groups as i64, int(group, "group")?);
        let weight_groups = int(width / group, "weight groups")?;
        self.unary(x, x.cols, |input, output| {
            launch!(self, "row_weighted_rms_norm", Self::norm_config(groups);
                input, weight.f32()?, output, &groups_arg, &group_arg, &weight_groups, &eps,
                &offset)
        })
    }

    pub(super) fn launch_add_rms_norm(
        &self,
        x: &mut CudaTensor,
        delta: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
        style: NormStyle,
    ) -> Result<CudaTensor, CudaError> {
        Self::check_same_shape(x, delta, "add_rms_norm")?;
        let (groups, groups_arg, group_arg, offset) =
            norm_groups(x, weight, style, "add_rms_norm")?;
        let other = &*delta.data;
        // Every group's every element is written.
        let mut out = self.output_uninit(x.rows, x.cols)?;
        if groups > 0 {
            let residual = &mut *x.data;
            launch!(self, "add_rms_norm", Self::norm_config(groups);
                residual, other, weight.f32()?, &mut *out.data, &groups_arg,
                &group_arg, &eps, &offset)?;
        }
        Ok(out)
    }

    pub(super) fn launch_gated_rms_norm(
        &self,
        x: &CudaTensor,
        gate: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
    ) -> Result<CudaTensor, CudaError> {
        let gate_data = &*gate.data;
        let group = weight.rows * weight.cols;
        if group == 0
            || (x.rows * x.cols) % group != 0
            || (gate.rows, gate.cols) != (x.rows, x.cols)
        {
            return Err(CudaError::Invalid {
                problem: format!("gated_rms_norm: weight of {group} over rows of {}", x.cols),
            });
        }
        let groups = x.rows * x.cols / group;
        let (groups_arg, group_arg) = (groups as i64, int(group, "group")?);
        self.unary(x, x.cols, |input, output| {
            launch!(self, "gated_rms_norm", Self::norm_config(groups);
                input, gate_data, weight.f32()?, output, &groups_arg, &group_arg, &eps)
        })
    }

    /// `rms_norm` per head then `rope`, in one launch where the norm's groups are the heads
    /// and every row has a position; otherwise the two ops.
    pub(super) fn launch_rms_norm_rope(
        &self,
        x: &CudaTensor,
        weight: &CudaWeight,
        eps: f32,
        style: NormStyle,
        rotation: &Rotation<'_>,
    ) -> Result<CudaTensor, CudaError> {
        let Some(group) = one_launch_norm_rope_group(x, weight, rotation) else {
            let mut out = self.launch_rms_norm(x, weight, eps, style)?;
            self.launch_rope(&mut out, rotation)?;
            return Ok(out);
        };
        let half = rotation.rotary_dim / 2;
        let (groups, groups_arg, group_arg, offset) =
            norm_groups(x, weight, style, "rms_norm_rope")?;
        let (heads, half) = (int(x.cols / group, "heads")?, int(half, "rotary half")?);
        self.with_rope_tables(
            &rotation.positions[..x.rows],
            rotation.rotary_dim,
            rotation.theta,
            |positions, inverse| {
                self.unary(x, x.cols, |input, output| {
                    launch!(self, "rms_norm_rope", Self::norm_config(groups);
                        input, weight.f32()?, output, &groups_arg, &group_arg, &eps, &offset,
                        positions, inverse, &heads, &half)
                })
            },
        )
    }
}

impl CudaBackend {
    /// `rms_norm_rope` of q and k in one `rms_norm_rope_pair` launch where both would take the
    /// one-launch path with the same head size; otherwise the two ops.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_rms_norm_rope_pair(
        &self,
        q: &CudaTensor,
        q_weight: &CudaWeight,
        k: &CudaTensor,
        k_weight: &CudaWeight,
        eps: f32,
        style: NormStyle,
        rotation: &Rotation<'_>,
    ) -> Result<(CudaTensor, CudaTensor), CudaError> {
        let q_group = one_launch_norm_rope_group(q, q_weight, rotation);
        let k_group = one_launch_norm_rope_group(k, k_weight, rotation);
        let (Some(group), true) = (q_group, q_group == k_group && q.rows == k.rows) else {
            return Ok((
                self.launch_rms_norm_rope(q, q_weight, eps, style, rotation)?,
                self.launch_rms_norm_rope(k, k_weight, eps, style, rotation)?,
            ));
        };
        let half = rotation.rotary_dim / 2;
        let (q_groups, q_groups_arg, group_arg, offset) =
            norm_groups(q, q_weight, style, "rms_norm_rope_pair")?;
        let (k_groups, k_groups_arg, _, _) = norm_groups(k, k_weight, style, "rms_norm_rope_pair")?;
        let (q_heads, k_heads, half) = (
            int(q.cols / group, "heads")?,
            int(k.cols / group, "kv heads")?,
            int(half, "rotary half")?,
        );
        // Each kernel group writes every element of its head.
        let mut q_out = self.output_uninit(q.rows, q.cols)?;
        let mut k_out = self.output_uninit(k.rows, k.cols)?;
        self.with_rope_tables(
            &rotation.positions[..q.rows],
            rotation.rotary_dim,
            rotation.theta,
            |positions, inverse| {
                launch!(self, "rms_norm_rope_pair", Self::norm_config(q_groups + k_groups);
                    &*q.data, q_weight.f32()?, &mut *q_out.data, &q_groups_arg, &q_heads,
                    &*k.data, k_weight.f32()?, &mut *k_out.data, &k_groups_arg, &k_heads,
                    &group_arg, &eps, &offset, positions, inverse, &half)
            },
        )?;
        Ok((q_out, k_out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_kernels() {
        use super::super::super::kernels::kernel_define;
        assert_eq!(
            i64::from(NORM_THREADS),
            kernel_define("norm", "NORM_THREADS")
        );
        assert_eq!(i64::from(NORM_CACHED), kernel_define("norm", "NORM_CACHED"));
    }
}
