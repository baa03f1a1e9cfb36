//! The [`Backend`] trait for [`CudaBackend`]: each op of the model's vocabulary mapped onto the
//! launches of its family's module, timed under the op's name (`NINFER_CUDA_OP_TIMING`), a CUDA
//! error turned into [`EngineError::Device`] naming the op.
//!
//! Owns: the op → launch mapping and the backend's associated types. Must not touch: the
//! launches themselves (each family's module), the backend's buffers and helpers (mod.rs).

use std::ops::Range;
use std::sync::Arc;

use ninfer_artifact::{Artifact, ExpertBank};
use ninfer_cpu_experts::ExpertLayout;

use super::matmul::TwoInputs;
use super::norm::foldable_residual_norm;
use super::router::{self, RouterInput};
use super::{
    describe, driver_error, elementwise, CudaBackend, CudaConvState, CudaExpertSlots, CudaKvCache,
    CudaPendingRouting, CudaQsaCache, CudaRecurrentState, CudaStepGraph, CudaTensor, CudaWeight,
    CudaWorkerHandoff, WeightData,
};
use crate::backend::cuda::CudaError;
use crate::backend::{
    AttentionSpec, Backend, DeltaRuleForm, DeltaRuleSpec, NormStyle, ResidualNorm, Rotation,
    Routing, Segment,
};
use crate::error::EngineError;
use crate::host_math::route_top_k_host;
use crate::model::qwen4_exp::qsa_selection::QsaSelectionSettings;

/// Maps a CUDA error to the engine's, naming the backend op it failed in.
fn device(op: &'static str) -> impl FnOnce(CudaError) -> EngineError {
    move |source| EngineError::Device { op, source }
}

/// Writes the `Backend` methods that are one `launch_*` call: the same arguments passed on,
/// timed under the op's name (by rows where the cost follows the batch), and a CUDA error
/// turned into [`EngineError::Device`] naming the op.
macro_rules! timed_launches {
    ($($op:ident($($arg:ident: $type:ty),* $(,)?) -> $output:ty
        = $launch:ident $(, timed by rows of $rows:ident)?;)*) => {$(
        fn $op(&self, $($arg: $type),*) -> Result<$output, EngineError> {
            let _timer = timed_launches!(@timer self, $op $(, $rows)?);
            self.$launch($($arg),*).map_err(device(stringify!($op)))
        }
    )*};
    (@timer $backend:ident, $op:ident) => {
        $backend.op_timer(stringify!($op))
    };
    (@timer $backend:ident, $op:ident, $rows:ident) => {
        $backend.op_timer_by_rows(stringify!($op), $rows.rows)
    };
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type KvCache = CudaKvCache;
    type ConvState = CudaConvState;
    type RecurrentState = CudaRecurrentState;
    type ExpertSlots = CudaExpertSlots;
    type QsaCache = CudaQsaCache;
    type PendingRouting = CudaPendingRouting;
    type StepGraph = CudaStepGraph;
    type WorkerHandoff = CudaWorkerHandoff;

    fn name(&self) -> String {
        format!("cuda:{}", self.info.ordinal)
    }

    fn load_matrix(&self, artifact: &Arc<Artifact>, name: &str) -> Result<CudaWeight, EngineError> {
        self.load_weight(artifact, name, true)
    }

    fn load_parameter(
        &self,
        artifact: &Arc<Artifact>,
        name: &str,
    ) -> Result<CudaWeight, EngineError> {
        self.load_weight(artifact, name, false)
    }

    fn parameter_from_values(
        &self,
        values: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<CudaWeight, EngineError> {
        if values.len() != rows * cols {
            return Err(EngineError::InvalidConfig {
                problem: format!("a parameter of {} values for {rows}×{cols}", values.len()),
            });
        }
        let data = self
            .upload_f32(values)
            .map_err(device("parameter_from_values"))?;
        Ok(CudaWeight {
            rows,
            cols,
            data: WeightData::F32(data),
        })
    }

    fn weight_shape(&self, weight: &CudaWeight) -> (usize, usize) {
        (weight.rows, weight.cols)
    }

    fn upload(&self, values: &[f32], rows: usize, cols: usize) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("upload");
        self.upload_tensor(values, rows, cols)
            .map_err(device("upload"))
    }

    fn download(&self, tensor: &CudaTensor) -> Result<Vec<f32>, EngineError> {
        let _timer = self.op_timer("download");
        self.download_values(tensor).map_err(device("download"))
    }

    fn move_tensor_to(
        &self,
        tensor: &CudaTensor,
        target: &CudaBackend,
    ) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("move_tensor_to");
        self.move_tensor_on_device(tensor, target)
            .map_err(device("move_tensor_to"))
    }

    fn shape(&self, tensor: &CudaTensor) -> (usize, usize) {
        (tensor.rows, tensor.cols)
    }

    fn reshape(
        &self,
        mut tensor: CudaTensor,
        rows: usize,
        cols: usize,
    ) -> Result<CudaTensor, EngineError> {
        // The buffer stays as it is (the pool files buffers by length, which does not change).
        crate::backend::check_reshape((tensor.rows, tensor.cols), (rows, cols))?;
        tensor.rows = rows;
        tensor.cols = cols;
        Ok(tensor)
    }

    // The ops that are one launch: each times itself and names itself in its error.
    timed_launches! {
        gather_rows(tensor: &CudaTensor, rows: &[usize]) -> CudaTensor = launch_gather_rows;
        columns(tensor: &CudaTensor, range: Range<usize>) -> CudaTensor = launch_columns;
        concat_rows(a: &CudaTensor, b: &CudaTensor) -> CudaTensor = launch_concat_rows;
        split_interleaved(tensor: &CudaTensor, groups: usize, first: usize, second: usize)
            -> (CudaTensor, CudaTensor) = launch_split_interleaved;
        embed(table: &CudaWeight, ids: &[u32]) -> CudaTensor = launch_embed;
        rms_norm(x: &CudaTensor, weight: &CudaWeight, eps: f32, style: NormStyle)
            -> CudaTensor = launch_rms_norm;
        add_rms_norm(x: &mut CudaTensor, delta: &CudaTensor, weight: &CudaWeight, eps: f32,
            style: NormStyle) -> CudaTensor = launch_add_rms_norm;
        gated_rms_norm(x: &CudaTensor, gate: &CudaTensor, weight: &CudaWeight, eps: f32)
            -> CudaTensor = launch_gated_rms_norm;
        rope(x: &mut CudaTensor, rotation: &Rotation<'_>) -> () = launch_rope;
        rms_norm_rope(x: &CudaTensor, weight: &CudaWeight, eps: f32, style: NormStyle,
            rotation: &Rotation<'_>) -> CudaTensor = launch_rms_norm_rope;
        rms_norm_rope_pair(q: &CudaTensor, q_weight: &CudaWeight, k: &CudaTensor,
            k_weight: &CudaWeight, eps: f32, style: NormStyle, rotation: &Rotation<'_>)
            -> (CudaTensor, CudaTensor) = launch_rms_norm_rope_pair;
        add_assign(a: &mut CudaTensor, b: &CudaTensor) -> () = launch_add_assign;
        silu_mul_halves(gate_up: &CudaTensor) -> CudaTensor = launch_silu_mul_halves;
        add_sigmoid_scaled_rows(a: &mut CudaTensor, b: &CudaTensor, gate: &CudaTensor)
            -> () = launch_add_sigmoid_scaled_rows;
        row_weighted_rms_norm(x: &CudaTensor, weight: &CudaWeight, group: usize, eps: f32,
            style: NormStyle) -> CudaTensor = launch_row_weighted_rms_norm;
        scaled_silu(x: &CudaTensor, scale: f32) -> CudaTensor = launch_scaled_silu;
        stream_mix(x: &CudaTensor, gate: &CudaTensor, streams: usize, scale: f32)
            -> CudaTensor = launch_stream_mix;
        inject_into_streams(streams: &mut CudaTensor, output: &CudaTensor, shares: &CudaTensor,
            scale: f32) -> () = launch_inject_into_streams;
        ple_gate(keys: &CudaTensor, queries: &CudaTensor, values: &CudaTensor, streams: usize,
            scale: f32) -> CudaTensor = launch_ple_gate;
        slotted_experts_by_pending_routing(slots: &CudaExpertSlots, x: &CudaTensor,
            routing: &CudaPendingRouting) -> CudaTensor
            = launch_slotted_experts_by_pending_routing, timed by rows of x;
        causal_conv1d_silu(x: &CudaTensor, weight: &CudaWeight,
            segments: &mut [Segment<'_, CudaConvState>]) -> CudaTensor
            = launch_causal_conv1d_silu;
        causal_conv1d_silu_split3(x: &CudaTensor, weight: &CudaWeight,
            segments: &mut [Segment<'_, CudaConvState>], widths: [usize; 3]) -> [CudaTensor; 3]
            = launch_causal_conv1d_silu_split3;
        delta_rule_gates(a: &CudaTensor, b: &CudaTensor, a_log: &CudaWeight,
            dt_bias: &CudaWeight) -> (CudaTensor, CudaTensor) = launch_delta_rule_gates;
        // Chunked for multi-token segments (`Auto`) once the kernel passed its start-up check
        // (on the tensor cores with `tensor_core_prefill`), else the recurrent kernel
        // (device/delta_rule.rs).
        gated_delta_rule(q: &CudaTensor, k: &CudaTensor, v: &CudaTensor, g: &CudaTensor,
            beta: &CudaTensor, spec: &DeltaRuleSpec, form: DeltaRuleForm,
            segments: &mut [Segment<'_, CudaRecurrentState>]) -> CudaTensor
            = launch_gated_delta_rule, timed by rows of q;
        slotted_experts(slots: &CudaExpertSlots, x: &CudaTensor, routing: &Routing)
            -> CudaTensor = launch_slotted_experts, timed by rows of x;
    }

    fn matmul(&self, x: &CudaTensor, weight: &CudaWeight) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer_named(|| {
            format!(
                "matmul {}x{} by {}x{}{}",
                x.rows,
                x.cols,
                weight.rows,
                weight.cols,
                if self.uses_cublas_for(x.rows) {
                    " (cublas)"
                } else {
                    ""
                }
            )
        });
        self.launch_matmul(x, weight).map_err(device("matmul"))
    }

    fn matmul3(
        &self,
        x: &CudaTensor,
        weights: [&CudaWeight; 3],
    ) -> Result<[CudaTensor; 3], EngineError> {
        let fused = {
            let _timer = self.op_timer_named(|| {
                format!(
                    "matmul3 {}x{} by {}+{}+{}x{}",
                    x.rows, x.cols, weights[0].rows, weights[1].rows, weights[2].rows, x.cols
                )
            });
            self.launch_matmul3(x, weights).map_err(device("matmul3"))?
        };
        match fused {
            Some(outputs) => Ok(outputs),
            None => {
                let [w0, w1, w2] = weights;
                Ok([
                    self.matmul(x, w0)?,
                    self.matmul(x, w1)?,
                    self.matmul(x, w2)?,
                ])
            }
        }
    }

    fn matmul_silu_mul(
        &self,
        gate: &CudaTensor,
        up: &CudaTensor,
        weight: &CudaWeight,
    ) -> Result<CudaTensor, EngineError> {
        self.matmul_of_two_inputs(TwoInputs::SiluMul, gate, up, weight)
    }

    fn matmul_mul_sigmoid(
        &self,
        x: &CudaTensor,
        gate: &CudaTensor,
        weight: &CudaWeight,
    ) -> Result<CudaTensor, EngineError> {
        self.matmul_of_two_inputs(TwoInputs::MulSigmoid, x, gate, weight)
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("silu_mul");
        self.binary(
            gate,
            up,
            "silu_mul",
            |a, b, out, n| launch!(self, "silu_mul", elementwise(n as usize); a, b, out, &n),
        )
        .map_err(device("silu_mul"))
    }

    fn mul_sigmoid(&self, x: &CudaTensor, gate: &CudaTensor) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("mul_sigmoid");
        self.binary(
            x,
            gate,
            "mul_sigmoid",
            |a, b, out, n| launch!(self, "mul_sigmoid", elementwise(n as usize); a, b, out, &n),
        )
        .map_err(device("mul_sigmoid"))
    }

    fn start_routing(
        &self,
        logits: &CudaTensor,
        k: usize,
        normalize: bool,
        hidden: &CudaTensor,
        read_hidden: bool,
    ) -> Result<CudaPendingRouting, EngineError> {
        let _timer = self.op_timer("start_routing");
        if logits.cols <= router::ROUTER_MAX_EXPERTS && k <= router::ROUTER_MAX_TOP_K {
            let hidden_part = read_hidden.then_some(hidden);
            return self
                .launch_routing_and_read_back(
                    RouterInput::Logits(logits),
                    k,
                    normalize,
                    hidden_part,
                )
                .map_err(device("start_routing"));
        }
        // Routers wider than the kernel takes: `route_top_k` routes them on the host.
        let routing = self.route_top_k(logits, k, normalize)?;
        let hidden = if read_hidden {
            self.download(hidden)?
        } else {
            Vec::new()
        };
        Ok(Self::ready_routing(routing, hidden))
    }

    fn start_routing_by_router(
        &self,
        x: &CudaTensor,
        router: &CudaWeight,
        k: usize,
        normalize: bool,
        read_hidden: bool,
    ) -> Result<CudaPendingRouting, EngineError> {
        // One token, f32 router weights the kernel takes: logits and routing in one launch.
        if let Some(weights) = self.fused_router_weights(router, x.rows, x.cols, k) {
            let _timer = self.op_timer("start_routing_by_router");
            if self.note_kernel_choice(("route_decode_fused", router.rows, k)) {
                tracing::info!(
                    "router of {} experts, top-{k}: logits and routing in one launch",
                    router.rows
                );
            }
            let input = RouterInput::Router {
                x,
                router: weights,
                experts: router.rows,
            };
            return self
                .launch_routing_and_read_back(input, k, normalize, read_hidden.then_some(x))
                .map_err(device("start_routing_by_router"));
        }
        let logits = self.matmul(x, router)?;
        self.start_routing(&logits, k, normalize, x, read_hidden)
    }

    fn add_rms_norm_and_matmul3(
        &self,
        x: &mut CudaTensor,
        delta: &CudaTensor,
        norm: ResidualNorm<'_, CudaWeight>,
        weights: [&CudaWeight; 3],
    ) -> Result<(CudaTensor, [CudaTensor; 3]), EngineError> {
        // One token, a foldable norm and bf16 projections: the add, the norm and the three
        // projections in one launch.
        if let Some((norm_weight, offset)) = foldable_residual_norm(x, delta, &norm) {
            let fused = {
                let _timer = self.op_timer("add_rms_norm_and_matmul3");
                self.launch_add_norm_matmul3(x, delta, norm_weight, norm.eps, offset, weights)
                    .map_err(device("add_rms_norm_and_matmul3"))?
            };
            if let Some(done) = fused {
                if self.note_kernel_choice(("add_norm_matmul3_bf16", delta.cols, 3)) {
                    tracing::info!(
                        "projections of {} inputs: the residual add and its norm in their launch",
                        delta.cols
                    );
                }
                return Ok(done);
            }
        }
        let normed = self.add_rms_norm(x, delta, norm.weight, norm.eps, norm.style)?;
        let projections = self.matmul3(&normed, weights)?;
        Ok((normed, projections))
    }

    fn add_rms_norm_and_start_routing_by_router(
        &self,
        x: &mut CudaTensor,
        delta: &CudaTensor,
        norm: ResidualNorm<'_, CudaWeight>,
        router: &CudaWeight,
        k: usize,
        normalize: bool,
        read_hidden: bool,
    ) -> Result<(CudaTensor, CudaPendingRouting), EngineError> {
        // One token, a foldable norm and f32 router weights: the add, the norm, the logits and
        // the routing in one launch.
        let hidden = delta.cols;
        if let (Some(router_weights), Some((norm_weight, offset))) = (
            self.fused_router_weights(router, delta.rows, hidden, k),
            foldable_residual_norm(x, delta, &norm),
        ) {
            let _timer = self.op_timer("add_rms_norm_and_start_routing_by_router");
            if self.note_kernel_choice(("route_decode_add_norm_fused", router.rows, k)) {
                tracing::info!(
                    "router of {} experts, top-{k}: the residual add, its norm, logits and routing in one launch",
                    router.rows
                );
            }
            let normed = self
                .output_uninit(1, hidden)
                .map_err(device("add_rms_norm_and_start_routing_by_router"))?;
            let input = RouterInput::AddNormRouter {
                residual: x,
                delta,
                norm_weight,
                eps: norm.eps,
                offset,
                normed: &normed,
                router: router_weights,
                experts: router.rows,
            };
            let pending = self
                .launch_routing_and_read_back(input, k, normalize, read_hidden.then_some(&normed))
                .map_err(device("add_rms_norm_and_start_routing_by_router"))?;
            return Ok((normed, pending));
        }
        let normed = self.add_rms_norm(x, delta, norm.weight, norm.eps, norm.style)?;
        let pending = self.start_routing_by_router(&normed, router, k, normalize, read_hidden)?;
        Ok((normed, pending))
    }

    fn finish_routing(
        &self,
        mut routing: CudaPendingRouting,
    ) -> Result<(Routing, Vec<f32>), EngineError> {
        let _timer = self.op_timer("finish_routing");
        self.read_routing(&mut routing)
            .map_err(device("finish_routing"))
    }

    fn route_top_k(
        &self,
        logits: &CudaTensor,
        k: usize,
        normalize: bool,
    ) -> Result<Routing, EngineError> {
        let _timer = self.op_timer("route_top_k");
        // Softmax/top-k on the GPU; only the routing comes back to the host (the expert
        // executor needs it there). Routers wider than the kernel takes run on the host.
        if logits.cols <= router::ROUTER_MAX_EXPERTS && k <= router::ROUTER_MAX_TOP_K {
            return self
                .route_top_k_on_device(logits, k, normalize)
                .map_err(device("route_top_k"));
        }
        let values = self.download(logits)?;
        Ok(route_top_k_host(&values, logits.cols, k, normalize))
    }

    fn new_kv_cache(&self, max_tokens: usize, kv_width: usize) -> Result<CudaKvCache, EngineError> {
        self.allocate_kv_cache(max_tokens, kv_width)
            .map_err(device("new_kv_cache"))
    }

    fn attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        spec: &AttentionSpec,
        segments: &mut [Segment<'_, CudaKvCache>],
    ) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer_by_rows("attention", q.rows);
        // The launches live in `attention.rs`.
        self.attention_on(self.info.attention_path, q, k, v, spec, segments)
    }

    fn copy_kv_rows(
        &self,
        source: &CudaKvCache,
        from: Range<usize>,
        target: &mut CudaKvCache,
        to: usize,
    ) -> Result<(), EngineError> {
        self.copy_kv_rows_on(source, from, target, to)
            .map_err(device("copy_kv_rows"))
    }

    fn kv_cache_bytes(&self, cache: &CudaKvCache) -> usize {
        cache.device_bytes()
    }

    fn copy_qsa_rows(
        &self,
        source: &CudaQsaCache,
        from: Range<usize>,
        target: &mut CudaQsaCache,
        to: usize,
    ) -> Result<(), EngineError> {
        self.copy_qsa_rows_on(source, from, target, to)
            .map_err(device("copy_qsa_rows"))
    }

    fn qsa_cache_bytes(&self, cache: &CudaQsaCache) -> usize {
        cache.device_bytes()
    }

    fn new_qsa_cache(
        &self,
        max_tokens: usize,
        kv_width: usize,
        settings: &QsaSelectionSettings,
    ) -> Result<CudaQsaCache, EngineError> {
        self.allocate_qsa_cache(max_tokens, kv_width, settings)
            .map_err(device("new_qsa_cache"))
    }

    fn qsa_cache_tokens(&self, cache: &CudaQsaCache) -> usize {
        cache.tokens()
    }

    fn truncate_qsa_cache(&self, cache: &mut CudaQsaCache, tokens: usize) {
        cache.truncate(tokens);
    }

    fn qsa_append(
        &self,
        k: &CudaTensor,
        v: &CudaTensor,
        index_qk: &CudaTensor,
        key_norm: &CudaWeight,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, CudaQsaCache>],
    ) -> Result<(), EngineError> {
        for segment in segments.iter() {
            let (held, added) = (segment.start_position, segment.rows.len());
            if held + added > segment.state.max_tokens() {
                return Err(EngineError::ContextFull {
                    held,
                    added,
                    max_context: segment.state.max_tokens(),
                });
            }
        }
        let _timer = self.op_timer_by_rows("qsa_append", k.rows);
        self.launch_qsa_append(k, v, index_qk, key_norm, settings, segments)
            .map_err(device("qsa_append"))
    }

    fn qsa_index_queries(
        &self,
        index_qk: &CudaTensor,
        query_norm: &CudaWeight,
        settings: &QsaSelectionSettings,
        positions: &[usize],
    ) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer_by_rows("qsa_index_queries", index_qk.rows);
        self.launch_qsa_index_queries(index_qk, query_norm, settings, positions)
            .map_err(device("qsa_index_queries"))
    }

    fn qsa_attention(
        &self,
        q: &CudaTensor,
        index_queries: &CudaTensor,
        spec: &AttentionSpec,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, CudaQsaCache>],
    ) -> Result<CudaTensor, EngineError> {
        // Timed in two parts, `qsa_select` and `qsa_attend` (device/qsa.rs).
        self.launch_qsa_attention(q, index_queries, spec, settings, segments)
            .map_err(device("qsa_attention"))
    }

    fn qsa_selected_tokens(
        &self,
        index_queries: &CudaTensor,
        settings: &QsaSelectionSettings,
        segments: &mut [Segment<'_, CudaQsaCache>],
    ) -> Result<Vec<Vec<usize>>, EngineError> {
        self.qsa_selected_tokens_on_device(index_queries, settings, segments)
            .map_err(device("qsa_selected_tokens"))
    }

    fn new_conv_state(&self, channels: usize, kernel: usize) -> Result<CudaConvState, EngineError> {
        let history = self
            .alloc(kernel.saturating_sub(1) * channels)
            .map_err(device("new_conv_state"))?;
        Ok(CudaConvState {
            channels,
            kernel,
            history,
        })
    }

    fn copy_conv_state(&self, state: &CudaConvState) -> Result<CudaConvState, EngineError> {
        let history = self
            .stream
            .clone_dtod(&state.history)
            .map_err(driver_error("copying a conv state"))
            .map_err(device("copy_conv_state"))?;
        Ok(CudaConvState {
            channels: state.channels,
            kernel: state.kernel,
            history,
        })
    }

    fn copy_recurrent_state(
        &self,
        state: &CudaRecurrentState,
    ) -> Result<CudaRecurrentState, EngineError> {
        let copy = self
            .stream
            .clone_dtod(&state.state)
            .map_err(driver_error("copying a delta-rule state"))
            .map_err(device("copy_recurrent_state"))?;
        Ok(CudaRecurrentState {
            spec: state.spec,
            state: copy,
        })
    }

    fn new_recurrent_state(&self, spec: &DeltaRuleSpec) -> Result<CudaRecurrentState, EngineError> {
        let size = spec.value_heads * spec.key_head_dim * spec.value_head_dim;
        let state = self.alloc(size).map_err(device("new_recurrent_state"))?;
        Ok(CudaRecurrentState { spec: *spec, state })
    }

    fn new_expert_slots(
        &self,
        layout: &ExpertLayout,
        num_experts: usize,
        slots: usize,
    ) -> Result<CudaExpertSlots, EngineError> {
        self.allocate_expert_slots(layout, num_experts, slots)
            .map_err(device("new_expert_slots"))
    }

    fn fill_expert_slot(
        &self,
        slots: &mut CudaExpertSlots,
        slot: usize,
        expert: usize,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) -> Result<(), EngineError> {
        self.copy_expert_into_slot(slots, slot, expert, artifact, bank)
    }

    fn prepare_expert_source(
        &self,
        slots: &mut CudaExpertSlots,
        artifact: &Arc<Artifact>,
        bank: &ExpertBank,
    ) {
        // The raw register call needs the context on this thread.
        match self.stream.context().bind_to_thread() {
            Ok(()) => self.pin_bank(slots, artifact, bank),
            Err(error) => tracing::warn!(
                bank = %bank.prefix,
                "not page-locking this expert bank ahead of time: binding the CUDA context failed: {}",
                describe(&error)
            ),
        }
    }

    fn logit_candidates(
        &self,
        logits: &CudaTensor,
        k: usize,
        extra: &[Vec<u32>],
    ) -> Result<Vec<crate::backend::LogitCandidates>, EngineError> {
        let _timer = self.op_timer("logit_candidates");
        crate::backend::candidates::check_candidate_request(logits.rows, logits.cols, k, extra)?;
        self.launch_logit_candidates(logits, k, extra)
            .map_err(device("logit_candidates"))
    }

    fn reserve_host_kv(&self, request: &crate::backend::HostKvRequest) -> Result<(), EngineError> {
        self.reserve_host_kv_pool(request)
            .map_err(device("reserve_host_kv"))
    }

    fn kv_placement(&self) -> Option<crate::backend::KvPlacement> {
        self.host_kv_placement()
    }

    fn new_step_graph(&self, rows: usize) -> Result<Option<CudaStepGraph>, EngineError> {
        self.create_step_graph(rows)
            .map_err(device("new_step_graph"))
    }

    fn begin_step_graph(
        &self,
        graph: &mut CudaStepGraph,
        ids: &[u32],
        positions: &[usize],
    ) -> Result<crate::backend::StepGraphRun, EngineError> {
        self.start_step_graph(graph, &mut [], ids, positions)
            .map_err(device("begin_step_graph"))
    }

    fn end_step_graph(
        &self,
        graph: &mut CudaStepGraph,
        ops_succeeded: bool,
    ) -> Result<crate::backend::StepGraphEnd, EngineError> {
        self.finish_step_graph(graph, &mut [], ops_succeeded)
            .map_err(device("end_step_graph"))
    }

    fn begin_split_step_graph(
        &self,
        graph: &mut CudaStepGraph,
        followers: &mut [crate::backend::FollowingStepGraph<'_, Self>],
        ids: &[u32],
        positions: &[usize],
    ) -> Result<crate::backend::StepGraphRun, EngineError> {
        self.start_step_graph(graph, followers, ids, positions)
            .map_err(device("begin_split_step_graph"))
    }

    fn end_split_step_graph(
        &self,
        graph: &mut CudaStepGraph,
        followers: &mut [crate::backend::FollowingStepGraph<'_, Self>],
        ops_succeeded: bool,
    ) -> Result<crate::backend::StepGraphEnd, EngineError> {
        self.finish_step_graph(graph, followers, ops_succeeded)
            .map_err(device("end_split_step_graph"))
    }

    fn wait_for_queued_ops(&self) -> Result<(), EngineError> {
        self.synchronize().map_err(device("wait_for_queued_ops"))
    }

    fn peek_routing(&self, pending: &CudaPendingRouting) -> Result<Routing, EngineError> {
        self.peek_pending_routing(pending)
            .map_err(device("peek_routing"))
    }

    fn new_worker_handoff(
        &self,
        channels: &[ninfer_channel::SegmentMemory],
        num_experts: usize,
        keep_alive: Box<dyn Send + Sync>,
    ) -> Result<Option<CudaWorkerHandoff>, EngineError> {
        if !self.options.worker_handoff || channels.is_empty() {
            return Ok(None);
        }
        self.open_worker_handoff(channels, num_experts, keep_alive)
            .map(Some)
            .map_err(device("new_worker_handoff"))
    }

    fn set_worker_handoff_owners(
        &self,
        handoff: &CudaWorkerHandoff,
        owned: &[Range<usize>],
    ) -> Result<(), EngineError> {
        self.set_handoff_owners(handoff, owned)
            .map_err(device("set_worker_handoff_owners"))
    }

    fn post_to_workers(
        &self,
        handoff: &CudaWorkerHandoff,
        layer: usize,
        x: &CudaTensor,
        pending: &CudaPendingRouting,
        resident: Option<&CudaExpertSlots>,
    ) -> Result<(), EngineError> {
        let _timer = self.op_timer("post_to_workers");
        self.launch_handoff_post(handoff, layer, x, pending, resident)
            .map_err(device("post_to_workers"))
    }

    fn collect_from_workers(
        &self,
        handoff: &CudaWorkerHandoff,
        rows: usize,
    ) -> Result<CudaTensor, EngineError> {
        let _timer = self.op_timer("collect_from_workers");
        self.launch_handoff_collect(handoff, rows)
            .map_err(device("collect_from_workers"))
    }

    fn take_worker_handoff_failure(
        &self,
        handoff: &CudaWorkerHandoff,
    ) -> Result<Option<crate::backend::WorkerHandoffFailure>, EngineError> {
        self.take_handoff_failure(handoff)
            .map_err(device("take_worker_handoff_failure"))
    }
}

impl CudaBackend {
    /// `matmul_silu_mul` / `matmul_mul_sigmoid`: one launch where the matmul kernel serves the
    /// shape, else the elementwise op then `matmul` (the same values either way).
    fn matmul_of_two_inputs(
        &self,
        kind: TwoInputs,
        a: &CudaTensor,
        b: &CudaTensor,
        weight: &CudaWeight,
    ) -> Result<CudaTensor, EngineError> {
        let fused = {
            let _timer = self.op_timer_named(|| {
                format!(
                    "{} {}x{} by {}x{}",
                    kind.op(),
                    a.rows,
                    a.cols,
                    weight.rows,
                    weight.cols
                )
            });
            self.launch_matmul_of_two_inputs(kind, a, b, weight)
                .map_err(device(kind.op()))?
        };
        match fused {
            Some(out) => Ok(out),
            None => {
                let input = match kind {
                    TwoInputs::SiluMul => self.silu_mul(a, b)?,
                    TwoInputs::MulSigmoid => self.mul_sigmoid(a, b)?,
                };
                self.matmul(&input, weight)
            }
        }
    }
}
