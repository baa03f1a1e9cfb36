//! The MoE router on the GPU (`kernels/router.cu`): softmax, top-k and renormalisation per
//! token, so only `[tokens, k]` ids and weights come back to the host (launched and read back
//! by device/pending_routing.rs).
//!
//! Owns: the router kernel's limits and the one-shot routing.
//! Must not touch: what the routing is used for (the model splits it between slots and workers).

use cudarc::driver::CudaSlice;

use super::{CudaBackend, CudaTensor, CudaWeight, WeightData};
use crate::backend::cuda::CudaError;
use crate::backend::Routing;

/// `ROUTER_MAX_EXPERTS` in `kernels/router.cu`: the row lives in shared memory.
pub(super) const ROUTER_MAX_EXPERTS: usize = 1024;
/// `ROUTER_WARPS` in `kernels/router.cu`: tokens per block, one warp each.
pub(super) const ROUTER_WARPS: u32 = 4;
/// `ROUTER_MAX_TOP_K` in `kernels/router.cu`: most experts per token the kernel keeps.
pub(super) const ROUTER_MAX_TOP_K: usize = 32;
/// `ROUTER_FUSED_WARPS` in `kernels/router.cu`: warps per block of `route_decode_fused`, one
/// logit each.
pub(super) const ROUTER_FUSED_WARPS: u32 = 4;

/// What the router kernel routes: logits computed before it (`route_top_k`, any batch), one
/// token's hidden row and the f32 router weights, whose logits the same launch computes
/// (`route_decode_fused`), or the same with the residual add and RMSNorm that form the row
/// before them in that launch (`route_decode_add_norm_fused`).
pub(super) enum RouterInput<'a> {
    Logits(&'a CudaTensor),
    Router {
        x: &'a CudaTensor,
        router: &'a CudaSlice<f32>,
        experts: usize,
    },
    AddNormRouter {
        /// The residual row; the launch adds `delta` to it.
        residual: &'a mut CudaTensor,
        delta: &'a CudaTensor,
        norm_weight: &'a CudaSlice<f32>,
        eps: f32,
        /// What the norm's style adds to its weight (0 or 1).
        offset: f32,
        /// The normed row's buffer (`[1, hidden]`), which the launch fills.
        normed: &'a CudaTensor,
        router: &'a CudaSlice<f32>,
        experts: usize,
    },
}

impl RouterInput<'_> {
    pub(super) fn tokens_and_experts(&self) -> (usize, usize) {
        match self {
            RouterInput::Logits(logits) => (logits.rows, logits.cols),
            RouterInput::Router { x, experts, .. } => (x.rows, *experts),
            RouterInput::AddNormRouter { delta, experts, .. } => (delta.rows, *experts),
        }
    }
}

impl CudaBackend {
    /// The router's f32 weights when the one-launch decode router takes `rows` token(s) of
    /// `hidden` values routed to `k` of the router's experts (the option on, one token, a router
    /// as wide as the row, experts and k within the kernel's limits); `None`: the separate launches.
    pub(super) fn fused_router_weights<'w>(
        &self,
        router: &'w CudaWeight,
        rows: usize,
        hidden: usize,
        k: usize,
    ) -> Option<&'w CudaSlice<f32>> {
        let WeightData::F32(weights) = &router.data else {
            return None;
        };
        (self.fused_router_counter.is_some()
            && rows == 1
            && hidden > 0
            && router.cols == hidden
            && (1..=ROUTER_MAX_EXPERTS).contains(&router.rows)
            && (1..=ROUTER_MAX_TOP_K).contains(&k))
        .then_some(weights)
    }

    /// Routing of every row of `logits` (`[tokens, experts]`) computed on the GPU.
    pub(super) fn route_top_k_on_device(
        &self,
        logits: &CudaTensor,
        k: usize,
        normalize: bool,
    ) -> Result<Routing, CudaError> {
        let mut pending =
            self.launch_routing_and_read_back(RouterInput::Logits(logits), k, normalize, None)?;
        self.read_routing(&mut pending).map(|(routing, _)| routing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_match_the_kernels() {
        use crate::backend::cuda::kernels::kernel_define;
        assert_eq!(
            ROUTER_MAX_EXPERTS as i64,
            kernel_define("router", "ROUTER_MAX_EXPERTS")
        );
        assert_eq!(
            i64::from(ROUTER_WARPS),
            kernel_define("router", "ROUTER_WARPS")
        );
        assert_eq!(
            ROUTER_MAX_TOP_K as i64,
            kernel_define("router", "ROUTER_MAX_TOP_K")
        );
        assert_eq!(
            i64::from(ROUTER_FUSED_WARPS),
            kernel_define("router", "ROUTER_FUSED_WARPS")
        );
    }
}
