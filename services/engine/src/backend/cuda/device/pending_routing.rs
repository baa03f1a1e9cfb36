//! Routing that stays on the GPU until the host needs it ([`Backend::start_routing`]).
//!
//! The router's ids and weights are device buffers the slotted-expert kernels read directly;
//! their copies to the host (with the hidden states, when the expert workers need them) go
//! into a page-locked buffer of their own, queued right behind the router, with an event
//! recorded after them. Finishing waits for that event only, so the resident and shared
//! experts queued after the router run while the host reads the routing and posts the CPU
//! experts; a layer whose experts are all resident is finished at the forward's end, when
//! every copy has long landed, so its forward never waits mid-way.
//!
//! Owns: the pool of page-locked buffers pending routings copy into, and the pending state.
//! Must not touch: what the routing is used for (the model splits it between slots and
//! workers).
//!
//! [`Backend::start_routing`]: crate::backend::Backend::start_routing

use std::sync::Arc;

use cudarc::driver::{CudaEvent, DevicePtr, LaunchConfig};

use super::norm::NORM_THREADS;
use super::pinned_staging::{PinnedStaging, RoutingStagingPool};
use super::readback::{decode_staged, staging_layout, HostValues, ReadBack, ReadBackShape};
use super::router::{
    RouterInput, ROUTER_FUSED_WARPS, ROUTER_MAX_EXPERTS, ROUTER_MAX_TOP_K, ROUTER_WARPS,
};
use super::{driver_error, int, CudaBackend, CudaTensor};
use crate::backend::cuda::CudaError;
use crate::backend::Routing;

/// Most rows whose hidden states the router kernel stores into the staging buffer itself.
const KERNEL_WRITTEN_HIDDEN_MAX_ROWS: usize = 64;

/// Smallest buffer the pool hands out: a decode step's routing is a few hundred bytes, and
/// one size for all keeps the pool from growing a buffer per size.
const SMALLEST_ROUTING_STAGING: usize = 64 << 10;

/// A routing [`CudaBackend`] started and has not brought to the host yet.
pub struct CudaPendingRouting {
    experts_per_token: usize,
    state: PendingState,
}

enum PendingState {
    /// Already on the host: the host router (wide routers), an empty batch, or an error.
    Ready {
        routing: Routing,
        hidden: Vec<f32>,
    },
    OnDevice(OnDevice),
}

struct OnDevice {
    tokens: usize,
    /// `[tokens, k]` expert ids (u32 bits in a recycled f32 buffer) and routing weights.
    ids: CudaTensor,
    weights: CudaTensor,
    /// The page-locked buffer the copies go to and the event recorded right after them;
    /// `None` only while being returned to the pool.
    staging: Option<(PinnedStaging, CudaEvent)>,
    /// ids, weights and (when asked) the hidden states, in that order.
    shapes: Vec<ReadBackShape>,
    offsets: Vec<usize>,
    pool: RoutingStagingPool,
}

impl Drop for OnDevice {
    fn drop(&mut self) {
        // Copies into the buffer may still be in flight (a pending routing dropped unfinished,
        // on an error path): wait for them before the buffer is handed out again. If the wait
        // fails the context is broken and no copy will land; the buffer is freed.
        if let Some((staging, copied)) = self.staging.take() {
            if copied.synchronize().is_ok() {
                if let Ok(mut pool) = self.pool.lock() {
                    pool.push((staging, copied));
                }
            }
        }
    }
}

impl OnDevice {
    /// The first `parts` parts, once their copies landed.
    fn read(&self, parts: usize) -> Result<Vec<HostValues>, CudaError> {
        let (_, copied) = self.staging.as_ref().ok_or_else(|| CudaError::Invalid {
            problem: "a pending routing lost its staging buffer".into(),
        })?;
        copied
            .synchronize()
            .map_err(driver_error("waiting for the routing's read-back"))?;
        // SAFETY: the wait above saw the copies complete.
        unsafe { self.read_landed(parts) }
    }

    /// The first `parts` parts, as the copies left them, without waiting on the event (an
    /// event recorded while a step graph was being recorded cannot be waited on).
    ///
    /// # Safety
    /// Every copy into the buffer must have completed (the caller waited for the stream).
    unsafe fn read_landed(&self, parts: usize) -> Result<Vec<HostValues>, CudaError> {
        let (staging, _) = self.staging.as_ref().ok_or_else(|| CudaError::Invalid {
            problem: "a pending routing lost its staging buffer".into(),
        })?;
        let parts = parts.min(self.shapes.len());
        // SAFETY: the copies into `staging` at these offsets completed (this function's
        // contract).
        Ok(unsafe { decode_staged(staging, &self.shapes[..parts], &self.offsets[..parts]) })
    }
}

fn routing_of(
    values: &mut impl Iterator<Item = HostValues>,
    experts_per_token: usize,
) -> Result<Routing, CudaError> {
    match (values.next(), values.next()) {
        (Some(HostValues::U32(expert_ids)), Some(HostValues::F32(weights))) => Ok(Routing {
            experts_per_token,
            expert_ids,
            weights,
        }),
        _ => Err(CudaError::Invalid {
            problem: "the routing read-back came back in the wrong shape".into(),
        }),
    }
}

impl CudaPendingRouting {
    /// Experts chosen per token.
    pub(super) fn experts_per_token(&self) -> usize {
        self.experts_per_token
    }

    /// The routing's device ids (u32 bits) and weights when it is on the device for `tokens`
    /// rows.
    pub(super) fn device_routing(&self, tokens: usize) -> Option<(&CudaTensor, &CudaTensor)> {
        match &self.state {
            PendingState::OnDevice(on_device) if on_device.tokens == tokens => {
                Some((&on_device.ids, &on_device.weights))
            }
            _ => None,
        }
    }

    /// The routing when it was computed on the host.
    pub(super) fn host_routing(&self) -> Option<&Routing> {
        match &self.state {
            PendingState::Ready { routing, .. } => Some(routing),
            PendingState::OnDevice(_) => None,
        }
    }
}

impl CudaBackend {
    /// A free page-locked buffer of at least `bytes` and its event, from the pool or new.
    fn take_routing_staging(&self, bytes: usize) -> Result<(PinnedStaging, CudaEvent), CudaError> {
        if let Ok(mut pool) = self.routing_staging.lock() {
            if let Some(index) = pool
                .iter()
                .position(|(staging, _)| staging.bytes() >= bytes)
            {
                return Ok(pool.swap_remove(index));
            }
        }
        let staging = PinnedStaging::allocate(
            &self._context,
            bytes.max(SMALLEST_ROUTING_STAGING).next_power_of_two(),
        )?;
        let event = self
            .stream
            .context()
            .new_event(None)
            .map_err(driver_error("creating the routing read-back's event"))?;
        Ok((staging, event))
    }

    /// The router kernel on `input` and the queued copies of its result (and of `hidden`).
    pub(super) fn launch_routing_and_read_back(
        &self,
        input: RouterInput<'_>,
        k: usize,
        normalize: bool,
        hidden: Option<&CudaTensor>,
    ) -> Result<CudaPendingRouting, CudaError> {
        let (tokens, experts) = input.tokens_and_experts();
        let k = k.min(experts);
        if tokens == 0 || k == 0 {
            let hidden = match hidden {
                Some(hidden) => self.download_values(hidden)?,
                None => Vec::new(),
            };
            return Ok(CudaPendingRouting {
                experts_per_token: k,
                state: PendingState::Ready {
                    routing: Routing {
                        experts_per_token: k,
                        expert_ids: Vec::new(),
                        weights: Vec::new(),
                    },
                    hidden,
                },
            });
        }
        if experts > ROUTER_MAX_EXPERTS || k > ROUTER_MAX_TOP_K {
            return Err(CudaError::Invalid {
                problem: format!(
                    "the GPU router takes at most {ROUTER_MAX_EXPERTS} experts and top-{ROUTER_MAX_TOP_K}, not {experts} and top-{k}"
                ),
            });
        }
        // Recycled buffers: the router kernel writes every element of both.
        let mut ids = self.output_uninit(tokens, k)?;
        let mut weights = self.output_uninit(tokens, k)?;
        let mut shapes = vec![
            ReadBackShape::U32(tokens * k),
            ReadBackShape::F32(tokens * k),
        ];
        if let Some(hidden) = hidden {
            shapes.push(ReadBackShape::F32(hidden.rows * hidden.cols));
        }
        let (offsets, total) = staging_layout(&shapes);
        let (staging, copied) = self.take_routing_staging(total)?;
        // With `routing_stores` the kernel stores ids and weights into the mapped staging buffer
        // itself, and a small batch's hidden rows too; a big batch's hidden states go by a
        // copy (the copy engine moves megabytes faster than stores from a handful of blocks).
        let stores = self.options.routing_stores;
        let hidden_by_kernel =
            hidden.filter(|_| stores && tokens <= KERNEL_WRITTEN_HIDDEN_MAX_ROWS);
        let (mapped_ids, mapped_weights) = if stores {
            (
                staging.device_address(offsets[0])?,
                staging.device_address(offsets[1])?,
            )
        } else {
            (0, 0)
        };
        let (hidden_source, mapped_hidden, hidden_width) = match hidden_by_kernel {
            Some(hidden) => (
                hidden.data.device_ptr(&self.stream).0,
                staging.device_address(offsets[2])?,
                int(hidden.cols, "hidden width")?,
            ),
            None => (0, 0, 0),
        };
        let tokens_arg = i32::try_from(tokens).map_err(|_| CudaError::Invalid {
            problem: format!("{tokens} tokens in one routing launch"),
        })?;
        let (experts_arg, k_arg, normalize_arg) = (
            int(experts, "experts")?,
            int(k, "top-k")?,
            i32::from(normalize),
        );
        let launched =
            {
                let ids_data = &mut *ids.data;
                // SAFETY: u32 and f32 have the same size and every bit pattern is valid in both.
                let mut ids_view = unsafe { ids_data.transmute_mut::<u32>(tokens * k) }
                    .ok_or_else(|| CudaError::Invalid {
                        problem: "the routing ids' buffer is too small".into(),
                    })?;
                match input {
                    RouterInput::Logits(logits) => {
                        // One warp per token.
                        let blocks = (tokens_arg as u32).div_ceil(ROUTER_WARPS);
                        let config = LaunchConfig {
                            grid_dim: (blocks, 1, 1),
                            block_dim: (32 * ROUTER_WARPS, 1, 1),
                            shared_mem_bytes: 0,
                        };
                        launch!(self, "route_top_k", config;
                        &*logits.data, &mut ids_view, &mut *weights.data, &tokens_arg,
                        &experts_arg, &k_arg, &normalize_arg, &mapped_ids, &mapped_weights,
                        &hidden_source, &mapped_hidden, &hidden_width)
                    }
                    RouterInput::Router { x, router, .. } => {
                        let counter = self.fused_router_counter.as_ref().ok_or_else(|| {
                            CudaError::Invalid {
                                problem: "the fused decode router has no counter".into(),
                            }
                        })?;
                        // One warp per expert's logit; the last block out routes them.
                        let mut logits = self.output_uninit(1, experts)?;
                        let config = LaunchConfig {
                            grid_dim: ((experts as u32).div_ceil(ROUTER_FUSED_WARPS), 1, 1),
                            block_dim: (32 * ROUTER_FUSED_WARPS, 1, 1),
                            shared_mem_bytes: 0,
                        };
                        let hidden_arg = int(x.cols, "hidden width")?;
                        let prefetch = self.weight_prefetch();
                        launch!(self, "route_decode_fused", config;
                        &*x.data, router, &mut *logits.data, counter, &mut ids_view,
                        &mut *weights.data, &hidden_arg, &experts_arg, &k_arg, &normalize_arg,
                        &mapped_ids, &mapped_weights, &mapped_hidden, &prefetch)
                    }
                    RouterInput::AddNormRouter {
                        residual,
                        delta,
                        norm_weight,
                        eps,
                        offset,
                        normed,
                        router,
                        ..
                    } => {
                        let counter = self.fused_router_counter.as_ref().ok_or_else(|| {
                            CudaError::Invalid {
                                problem: "the fused decode router has no counter".into(),
                            }
                        })?;
                        // One warp per expert's logit, NORM_THREADS threads a block (the
                        // norm's tree); the last block out stores the residual and routes.
                        let mut logits = self.output_uninit(1, experts)?;
                        let warps = NORM_THREADS / 32;
                        let config = LaunchConfig {
                            grid_dim: ((experts as u32).div_ceil(warps), 1, 1),
                            block_dim: (NORM_THREADS, 1, 1),
                            shared_mem_bytes: (normed.cols * std::mem::size_of::<f32>()) as u32,
                        };
                        let hidden_arg = int(normed.cols, "hidden width")?;
                        let prefetch = self.weight_prefetch();
                        // `normed` is written through its shared handle: a fresh buffer of
                        // this stream that nothing reads before the launch.
                        launch!(self, "route_decode_add_norm_fused", config;
                        &mut *residual.data, &*delta.data, norm_weight, &eps, &offset,
                        &*normed.data, router, &mut *logits.data, counter, &mut ids_view,
                        &mut *weights.data, &hidden_arg, &experts_arg, &k_arg, &normalize_arg,
                        &mapped_ids, &mapped_weights, &mapped_hidden, &prefetch)
                    }
                }
            };
        // What the kernel did not store goes by copies, into the same places.
        let mut copies: Vec<(ReadBack<'_>, usize)> = Vec::new();
        if !stores {
            copies.push((ReadBack::U32Bits(&ids.data, tokens * k), offsets[0]));
            copies.push((ReadBack::F32(&weights.data, tokens * k), offsets[1]));
        }
        if let Some(hidden) = hidden.filter(|_| hidden_by_kernel.is_none()) {
            copies.push((
                ReadBack::F32(&hidden.data, hidden.rows * hidden.cols),
                offsets[2],
            ));
        }
        let (parts, part_offsets): (Vec<ReadBack<'_>>, Vec<usize>) = copies.into_iter().unzip();
        let queued = launched
            .and_then(|()| self.queue_read_backs(&staging, &parts, &part_offsets))
            .and_then(|()| {
                copied
                    .record(&self.stream)
                    .map_err(driver_error("recording the routing read-back's event"))
            });
        drop(parts);
        if let Err(error) = queued {
            // A store or copy may be queued: let it land before the buffer is freed.
            let _ = self.stream.synchronize();
            return Err(error);
        }
        Ok(CudaPendingRouting {
            experts_per_token: k,
            state: PendingState::OnDevice(OnDevice {
                tokens,
                ids,
                weights,
                staging: Some((staging, copied)),
                shapes,
                offsets,
                pool: Arc::clone(&self.routing_staging),
            }),
        })
    }

    /// A routing computed on the host (routers wider than the kernel takes).
    pub(super) fn ready_routing(routing: Routing, hidden: Vec<f32>) -> CudaPendingRouting {
        CudaPendingRouting {
            experts_per_token: routing.experts_per_token,
            state: PendingState::Ready { routing, hidden },
        }
    }

    /// The routing and hidden values on the host; waits for their copies only. A routing
    /// already on the host is moved out (left empty).
    pub(super) fn read_routing(
        &self,
        pending: &mut CudaPendingRouting,
    ) -> Result<(Routing, Vec<f32>), CudaError> {
        let k = pending.experts_per_token;
        match &mut pending.state {
            PendingState::Ready { routing, hidden } => {
                let empty = Routing {
                    experts_per_token: k,
                    expert_ids: Vec::new(),
                    weights: Vec::new(),
                };
                Ok((std::mem::replace(routing, empty), std::mem::take(hidden)))
            }
            PendingState::OnDevice(on_device) => {
                let mut values = on_device.read(on_device.shapes.len())?.into_iter();
                let routing = routing_of(&mut values, k)?;
                let hidden = match values.next() {
                    Some(HostValues::F32(values)) => values,
                    _ => Vec::new(),
                };
                Ok((routing, hidden))
            }
        }
    }

    /// The routing of `pending` as its copies left it, without finishing it (a step graph's
    /// pending routings are refreshed by every replay; the caller waited for the replay).
    pub(super) fn peek_pending_routing(
        &self,
        pending: &CudaPendingRouting,
    ) -> Result<Routing, CudaError> {
        match &pending.state {
            PendingState::Ready { routing, .. } => Ok(routing.clone()),
            PendingState::OnDevice(on_device) => {
                self.synchronize()?;
                // SAFETY: the stream is idle, so every copy queued into the buffer landed.
                let values = unsafe { on_device.read_landed(2)? };
                routing_of(&mut values.into_iter(), pending.experts_per_token)
            }
        }
    }

    /// Slotted experts by a pending routing: straight from the device routing for decode-sized
    /// batches, through the host routing (a wait for its copies) for bigger ones, which group
    /// their pairs by expert on the host.
    pub(super) fn launch_slotted_experts_by_pending_routing(
        &self,
        slots: &super::CudaExpertSlots,
        x: &CudaTensor,
        pending: &CudaPendingRouting,
    ) -> Result<CudaTensor, CudaError> {
        match &pending.state {
            PendingState::Ready { routing, .. } => self.launch_slotted_experts(slots, x, routing),
            PendingState::OnDevice(on_device)
                if on_device.tokens == x.rows
                    && Self::pairwise_in_one_launch(x.rows, pending.experts_per_token) =>
            {
                self.launch_slotted_experts_by_device_routing(
                    slots,
                    x,
                    &on_device.ids,
                    &on_device.weights,
                    pending.experts_per_token,
                )
            }
            PendingState::OnDevice(on_device) => {
                let mut values = on_device.read(2)?.into_iter();
                let routing = routing_of(&mut values, pending.experts_per_token)?;
                self.launch_slotted_experts(slots, x, &routing)
            }
        }
    }
}
