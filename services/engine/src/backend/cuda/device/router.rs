//! The MoE router on the GPU (`kernels/router.cu`): softmax, top-k and renormalisation per
//! token, so only `[tokens, k]` ids and weights come back to the host.
//!
//! Owns: the launch and the read-back of the routing.
//! Must not touch: what the routing is used for (the model splits it between slots and workers).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::readback::{HostValues, ReadBack};
use super::{driver_error, int, present, CudaBackend, CudaTensor};
use crate::backend::cuda::CudaError;
use crate::backend::Routing;

/// `ROUTER_MAX_EXPERTS` in `kernels/router.cu`: the row lives in shared memory.
pub(super) const ROUTER_MAX_EXPERTS: usize = 1024;
/// `ROUTER_THREADS` in `kernels/router.cu` (a power of two: tree reductions).
const ROUTER_THREADS: u32 = 256;
/// Most experts per token the kernel keeps (`chosen_probability[32]`).
pub(super) const ROUTER_MAX_TOP_K: usize = 32;

impl CudaBackend {
    /// Routing of every row of `logits` (`[tokens, experts]`) computed on the GPU.
    pub(super) fn try_route_top_k_on_device(
        &self,
        logits: &CudaTensor,
        k: usize,
        normalize: bool,
    ) -> Result<Routing, CudaError> {
        self.try_route_and_read_back(logits, k, normalize, None)
            .map(|(routing, _)| routing)
    }

    /// The routing of `logits` and, if given, the values of `hidden`, read back with one wait
    /// (device/readback.rs).
    pub(super) fn try_route_and_read_back(
        &self,
        logits: &CudaTensor,
        k: usize,
        normalize: bool,
        hidden: Option<&CudaTensor>,
    ) -> Result<(Routing, Vec<f32>), CudaError> {
        let (tokens, experts) = (logits.rows, logits.cols);
        let k = k.min(experts);
        if tokens == 0 || k == 0 {
            let values = match hidden {
                Some(hidden) => self.try_download(hidden)?,
                None => Vec::new(),
            };
            let routing = Routing {
                experts_per_token: k,
                expert_ids: Vec::new(),
                weights: Vec::new(),
            };
            return Ok((routing, values));
        }
        if experts > ROUTER_MAX_EXPERTS || k > ROUTER_MAX_TOP_K {
            return Err(CudaError::Invalid {
                problem: format!(
                    "the GPU router takes at most {ROUTER_MAX_EXPERTS} experts and top-{ROUTER_MAX_TOP_K}, not {experts} and top-{k}"
                ),
            });
        }
        let input = present(&logits.data)?;
        let mut ids = self
            .stream
            .alloc_zeros::<u32>(tokens * k)
            .map_err(driver_error("allocating the routing ids"))?;
        let mut weights = self.alloc(tokens * k)?;
        let blocks = u32::try_from(tokens).map_err(|_| CudaError::Invalid {
            problem: format!("{tokens} tokens in one routing launch"),
        })?;
        let config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (ROUTER_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (experts_arg, k_arg, normalize_arg) = (
            int(experts, "experts")?,
            int(k, "top-k")?,
            i32::from(normalize),
        );
        launch!(self, "route_top_k", config;
            input, &mut ids, &mut weights, &experts_arg, &k_arg, &normalize_arg)?;
        let mut parts = vec![
            ReadBack::U32(&ids, tokens * k),
            ReadBack::F32(&weights, tokens * k),
        ];
        if let Some(hidden) = hidden {
            parts.push(ReadBack::F32(
                present(&hidden.data)?,
                hidden.rows * hidden.cols,
            ));
        }
        let mut values = self.read_back_together(&parts)?.into_iter();
        let (Some(HostValues::U32(expert_ids)), Some(HostValues::F32(weights))) =
            (values.next(), values.next())
        else {
            return Err(CudaError::Invalid {
                problem: "the routing read-back came back in the wrong shape".into(),
            });
        };
        let hidden_values = match values.next() {
            Some(HostValues::F32(values)) => values,
            _ => Vec::new(),
        };
        let routing = Routing {
            experts_per_token: k,
            expert_ids,
            weights,
        };
        Ok((routing, hidden_values))
    }
}
