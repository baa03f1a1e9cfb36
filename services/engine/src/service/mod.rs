//! The engine as a gRPC service (`proto/ninfer/v1/engine.proto`): the gateway's API in front of
//! the scheduler actor.
//!
//! Owns: request validation and translation (a prompt's images encoded in `images.rs`), the
//! token streams (the scheduler's events and errors
//! converted to messages and statuses here, at the edge), model info and files for the
//! gateway, status and routing-statistics streams.
//! Must not touch: the model's math (scheduler + model), HTTP, text.

pub mod images;
pub mod routing_stats;
pub mod scheduler;
pub mod scoring;

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use ninfer_artifact::Artifact;
use ninfer_protocol::v1::engine_server::Engine;
use ninfer_protocol::v1::{
    CancelRequest, CancelResponse, EngineProfile, EngineStatus, EngineStatusRequest,
    ExpertCacheLayerCounts, FinishReason, GenerateRequest, GeneratedToken, GenerationDefaults,
    ModelFiles, ModelFilesRequest, ModelInfo, ModelInfoRequest, PhaseProfile, ProfileRequest,
    RoutingStatistics, RoutingStatisticsRequest, ScoreRequest, TokenLogprob, TokenScores,
};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::constraint::{guide_for_request, GuidanceCache, Guide, ReasoningRule};
use crate::moe::expert_cache::{CacheCounts, ExpertCacheCounters};
use crate::profile::{ForwardProfile, PhaseTotals};
use crate::sampling::SamplingParams;
use routing_stats::RoutingCounters;
use scheduler::{
    GenerationRequest, SchedulerCommand, SchedulerCounters, SchedulerError, SchedulerEvent,
    SchedulerLimits, SequenceFinish,
};
use scoring::{ChunkScores, ScoringRequest};

/// Whether the experts are ready (remote workers registered) and why not.
pub trait Readiness: Send + Sync {
    fn not_ready_reason(&self) -> Option<String>;
    fn cpu_expert_calls(&self) -> u64 {
        0
    }
}

/// Always ready (in-process experts).
pub struct AlwaysReady;
impl Readiness for AlwaysReady {
    fn not_ready_reason(&self) -> Option<String> {
        None
    }
}

impl Readiness for crate::moe::WorkerExpertExecutor {
    fn not_ready_reason(&self) -> Option<String> {
        crate::moe::WorkerExpertExecutor::not_ready_reason(self)
    }
    fn cpu_expert_calls(&self) -> u64 {
        self.requests_sent()
    }
}

/// Everything the gRPC handlers read.
pub struct EngineService {
    pub artifact: Arc<Artifact>,
    pub model_name: String,
    pub instance_id: String,
    pub created_unix_seconds: u64,
    pub limits: SchedulerLimits,
    pub scheduler: Mutex<mpsc::Sender<SchedulerCommand>>,
    pub scheduler_counters: Arc<SchedulerCounters>,
    pub routing: Arc<RoutingCounters>,
    pub readiness: Arc<dyn Readiness>,
    pub profiling: Profiling,
    /// One permit per sequence the scheduler may run (`--max-sequences`): a request that finds
    /// none is refused before its response starts, so the gateway can answer 429 instead of
    /// an error inside a 200 stream.
    pub sequence_permits: Arc<tokio::sync::Semaphore>,
    /// The model's tokens for constrained decoding, built on the first constrained request.
    pub guidance: Arc<GuidanceCache>,
    /// How a prompt's images become embeddings; `None`: the model has no vision tower.
    pub images: Option<Arc<images::ImageEncoding>>,
    /// The unix socket `Generate` is also served on (`ninfer_protocol::token_socket`); `None`
    /// for an engine on TCP.
    pub token_socket_path: Option<String>,
}

/// Times a device-to-device copy on the GPU: bytes per second, or why not.
pub type DeviceBandwidthProbe = Box<dyn Fn() -> Result<f64, String> + Send + Sync>;

/// What `GetProfile` reports besides the counters.
pub struct Profiling {
    pub counters: Arc<ForwardProfile>,
    /// `cpu` or `cuda`.
    pub device: String,
    pub expert_stride_bytes: u64,
    /// Routed experts per MoE layer placed in GPU slots at load.
    pub gpu_experts_per_layer: u32,
    pub expert_executor: String,
    /// `None` on the CPU device.
    pub device_bandwidth: Option<DeviceBandwidthProbe>,
    /// What layerwise prefill measured at start (`None`: it is off).
    pub prefill_throughputs: Option<crate::PrefillThroughputs>,
    /// The dynamic expert cache's counters, when some experts are in slots.
    pub expert_cache: Option<Arc<ExpertCacheCounters>>,
}

fn phase_message(totals: &PhaseTotals) -> PhaseProfile {
    PhaseProfile {
        forwards: totals.forwards,
        tokens: totals.tokens,
        forward_nanos: totals.forward_nanos,
        expert_wait_nanos: totals.expert_wait_nanos,
        expert_compute_nanos: totals.expert_compute_nanos,
        transfer_nanos: totals.transfer_nanos,
        moe_layer_calls: totals.moe_layer_calls,
        cpu_experts: totals.cpu_experts,
        resident_experts: totals.resident_experts,
        cpu_expert_bytes: totals.cpu_expert_bytes,
        resident_expert_bytes: totals.resident_expert_bytes,
        streamed_experts: totals.streamed_experts,
        streamed_expert_bytes: totals.streamed_expert_bytes,
    }
}

impl EngineService {
    /// The checks every sequence-starting request passes (model name, readiness, a free
    /// sequence slot); the slot's permit is held while the scheduler keeps the sequence.
    fn admit(&self, model_name: &str) -> Result<tokio::sync::OwnedSemaphorePermit, Status> {
        if !model_name.is_empty() && model_name != self.model_name {
            return Err(Status::not_found(format!(
                "this engine serves model `{}`, not `{model_name}`",
                self.model_name
            )));
        }
        if let Some(reason) = self.readiness.not_ready_reason() {
            // Requests are held while a worker restarts; before the first registration there
            // is nothing to hold them for yet, so say so.
            if self.readiness.cpu_expert_calls() == 0 {
                return Err(Status::unavailable(format!("not ready: {reason}")));
            }
        }
        Arc::clone(&self.sequence_permits)
            .try_acquire_owned()
            .map_err(|_| {
                status_of(&SchedulerError::Busy {
                    max_sequences: self.limits.max_sequences,
                })
            })
    }

    fn send(&self, command: SchedulerCommand) -> Result<(), Status> {
        let sender = self
            .scheduler
            .lock()
            .map_err(|_| Status::internal("scheduler handle poisoned"))?;
        sender
            .send(command)
            .map_err(|_| Status::unavailable("the scheduler has stopped"))
    }

    fn eos_token_ids(&self) -> Vec<u32> {
        self.artifact.header().generation.eos_token_ids.clone()
    }

    fn files_digest(&self) -> String {
        let mut bytes = Vec::new();
        for name in [
            "tokenizer.json",
            "chat_template.jinja",
            "tokenizer_config.json",
        ] {
            bytes.extend_from_slice(self.artifact.file(name).unwrap_or_default());
            bytes.push(0);
        }
        ninfer_artifact::Checksum::of(&bytes).to_string()
    }

    /// The request's output grammar and reasoning block, compiled off the async workers (the
    /// first one also builds the vocabulary's token trie).
    async fn guide(&self, request: &GenerateRequest) -> Result<Option<Box<Guide>>, Status> {
        let reasoning = request.reasoning.as_ref().map(|r| ReasoningRule {
            start_token: r.start_token_id,
            end_token: r.end_token_id,
            budget: r.budget_tokens as usize,
            close_tokens: r.close_token_ids.clone(),
        });
        if request.lark_grammar.is_empty() && reasoning.as_ref().is_none_or(|r| r.budget == 0) {
            return Ok(None);
        }
        let artifact = Arc::clone(&self.artifact);
        let cache = Arc::clone(&self.guidance);
        let grammar = request.lark_grammar.clone();
        let stop_tokens = request.stop_token_ids.clone();
        let eos = self.eos_token_ids();
        tokio::task::spawn_blocking(move || {
            let vocab = artifact.config().common().vocab_size;
            let tokenizer = artifact.file("tokenizer.json").unwrap_or_default();
            guide_for_request(
                &cache,
                tokenizer,
                vocab,
                &eos,
                reasoning,
                &grammar,
                stop_tokens,
            )
        })
        .await
        .map_err(|error| Status::internal(format!("compiling the output grammar failed: {error}")))?
        .map(|guide| guide.map(Box::new))
        .map_err(|error| Status::invalid_argument(error.to_string()))
    }
}

/// A resumed generation's guide moved past the output it already produced (the last
/// `resumed_output_tokens` of the prompt): its reasoning block and grammar stand where the
/// interrupted generation left them.
async fn resume_guide(
    guide: Option<Box<Guide>>,
    request: &GenerateRequest,
) -> Result<Option<Box<Guide>>, Status> {
    let resumed = request.resumed_output_tokens as usize;
    let prompt = &request.prompt_token_ids;
    if resumed > prompt.len() {
        return Err(Status::invalid_argument(format!(
            "resumed_output_tokens {resumed} exceeds the prompt's {} tokens",
            prompt.len()
        )));
    }
    let mut guide = match guide {
        Some(guide) if resumed > 0 => guide,
        unchanged => return Ok(unchanged),
    };
    let output = prompt[prompt.len() - resumed..].to_vec();
    tokio::task::spawn_blocking(move || {
        for token in output {
            // `allowed` first: it is what turns a spent reasoning budget into the forced close.
            guide.allowed()?;
            guide.accept(token)?;
        }
        Ok::<_, crate::constraint::ConstraintError>(Some(guide))
    })
    .await
    .map_err(|error| Status::internal(format!("replaying the resumed output failed: {error}")))?
    .map_err(|error| {
        Status::invalid_argument(format!(
            "the resumed output does not follow the request's grammar: {error}"
        ))
    })
}

fn sampling_from(request: &GenerateRequest) -> SamplingParams {
    let Some(s) = &request.sampling else {
        return SamplingParams::greedy();
    };
    // proto3 zero values mean "unset": map them to the neutral setting.
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: if s.top_p == 0.0 { 1.0 } else { s.top_p },
        min_p: s.min_p,
        repetition_penalty: if s.repetition_penalty == 0.0 {
            1.0
        } else {
            s.repetition_penalty
        },
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        seed: s.seed.unwrap_or(0),
        stream_position: s.random_stream_position,
    }
}

/// Per-depth draft counters up to the deepest depth that drafted.
fn depth_counts(counters: &[std::sync::atomic::AtomicU64]) -> Vec<u64> {
    let mut counts: Vec<u64> = counters.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    while counts.last() == Some(&0) {
        counts.pop();
    }
    counts
}

/// A scheduler event as the wire message of engine.proto.
fn generated_token(event: SchedulerEvent) -> GeneratedToken {
    let finish_reason = match event.finish {
        None => FinishReason::Unspecified,
        Some(SequenceFinish::StopToken) => FinishReason::StopToken,
        Some(SequenceFinish::Length) => FinishReason::Length,
        Some(SequenceFinish::ContextFull) => FinishReason::ContextFull,
        Some(SequenceFinish::Cancelled) => FinishReason::Cancelled,
    };
    let (token_id, logprob, top_logprobs, no_token) = match event.token {
        Some(token) => (
            token.token_id,
            token.logprob,
            token
                .top_logprobs
                .into_iter()
                .map(|alternative| TokenLogprob {
                    token_id: alternative.token_id,
                    logprob: alternative.logprob,
                })
                .collect(),
            false,
        ),
        None => (0, 0.0, Vec::new(), true),
    };
    GeneratedToken {
        token_id,
        logprob,
        top_logprobs,
        finish_reason: finish_reason as i32,
        prompt_tokens: event.prompt_tokens,
        completion_tokens: event.completion_tokens,
        cached_prompt_tokens: event.cached_tokens,
        no_token,
    }
}

/// Forwards a sequence's events to its response and keeps `permit` until the scheduler lets go
/// of the sequence (drops its sender), not merely until the client leaves: the scheduler frees
/// the sequence at its next step, and admitting a new one before that would overfill it.
fn hold_permit_while_scheduled<Event: Send + 'static>(
    mut from_scheduler: tokio::sync::mpsc::Receiver<Event>,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> tokio::sync::mpsc::Receiver<Event> {
    let (to_client, receiver) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            tokio::select! {
                event = from_scheduler.recv() => match event {
                    Some(event) => {
                        if to_client.send(event).await.is_err() {
                            break;
                        }
                    }
                    None => break,
                },
                // The client went away: tell the scheduler (its sender sees the channel
                // closed, which cancels the sequence), then wait for it to let go.
                () = to_client.closed() => break,
            }
        }
        from_scheduler.close();
        while from_scheduler.recv().await.is_some() {}
        drop(permit);
    });
    receiver
}

/// A scheduler error as the gRPC status the engine.proto contract names for it.
fn status_of(error: &SchedulerError) -> Status {
    let message = error.to_string();
    match error {
        SchedulerError::InvalidRequest(_) => Status::invalid_argument(message),
        SchedulerError::ContextExceeded { .. } | SchedulerError::ScoringContextExceeded { .. } => {
            Status::out_of_range(message)
        }
        SchedulerError::Busy { .. } => Status::resource_exhausted(message),
        SchedulerError::GenerationFailed(_) => Status::internal(message),
    }
}

type TokenStream = Pin<Box<dyn Stream<Item = Result<GeneratedToken, Status>> + Send>>;
type ScoreStream = Pin<Box<dyn Stream<Item = Result<TokenScores, Status>> + Send>>;

/// A chunk's scores as the wire message of engine.proto.
fn token_scores(chunk: ChunkScores) -> TokenScores {
    TokenScores {
        first_position: chunk.first_position as u32,
        nll: chunk.nll,
        tokens_done: chunk.tokens_done as u32,
        tokens_total: chunk.tokens_total as u32,
    }
}

/// A unique id for a request that came without one (the scheduler cancels by id).
fn request_id_or_unnamed(request_id: &str) -> String {
    static UNNAMED_REQUESTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    if request_id.is_empty() {
        format!(
            "ninfer-unnamed-{}",
            UNNAMED_REQUESTS.fetch_add(1, Ordering::Relaxed)
        )
    } else {
        request_id.to_string()
    }
}

type StatisticsStream = Pin<Box<dyn Stream<Item = Result<RoutingStatistics, Status>> + Send>>;

#[tonic::async_trait]
impl Engine for EngineService {
    type GenerateStream = TokenStream;
    type StreamRoutingStatisticsStream = StatisticsStream;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<TokenStream>, Status> {
        let mut request = request.into_inner();
        let permit = self.admit(&request.model_name)?;
        let images = match (std::mem::take(&mut request.images), &self.images) {
            (images, _) if images.is_empty() => None,
            (_, None) => {
                return Err(Status::invalid_argument(
                    "this model has no vision tower: it does not take images",
                ))
            }
            (images, Some(encoding)) => {
                Some(encoding.encode(&request.prompt_token_ids, images).await?)
            }
        };
        let (events, from_scheduler) = tokio::sync::mpsc::channel(4096);
        let receiver = hold_permit_while_scheduled(from_scheduler, permit);
        let request_id = request_id_or_unnamed(&request.request_id);
        let guide = resume_guide(self.guide(&request).await?, &request).await?;
        self.send(SchedulerCommand::Submit(GenerationRequest {
            guide,
            request_id,
            sampling: sampling_from(&request),
            prompt: request.prompt_token_ids,
            max_new_tokens: request.max_new_tokens as usize,
            stop_token_ids: request.stop_token_ids,
            top_logprobs: request.top_logprobs.min(20) as usize,
            sampleable_vocabulary: request.sampleable_vocabulary_size as usize,
            logit_bias: request.logit_bias.into_iter().collect(),
            draft_tokens: request.draft_tokens.map(|n| n as usize),
            images,
            events,
        }))?;
        Ok(Response::new(Box::pin(tokio_stream::StreamExt::map(
            tokio_stream::wrappers::ReceiverStream::new(receiver),
            |event| {
                event
                    .map(generated_token)
                    .map_err(|error| status_of(&error))
            },
        ))))
    }

    type ScoreTokensStream = ScoreStream;

    async fn score_tokens(
        &self,
        request: Request<ScoreRequest>,
    ) -> Result<Response<ScoreStream>, Status> {
        let request = request.into_inner();
        let permit = self.admit(&request.model_name)?;
        let (scores, from_scheduler) = tokio::sync::mpsc::channel(4096);
        let receiver = hold_permit_while_scheduled(from_scheduler, permit);
        self.send(SchedulerCommand::Score(ScoringRequest {
            request_id: request_id_or_unnamed(&request.request_id),
            tokens: request.token_ids,
            chunk_tokens: request.chunk_tokens as usize,
            scores,
        }))?;
        Ok(Response::new(Box::pin(tokio_stream::StreamExt::map(
            tokio_stream::wrappers::ReceiverStream::new(receiver),
            |scores| scores.map(token_scores).map_err(|error| status_of(&error)),
        ))))
    }

    async fn cancel(
        &self,
        request: Request<CancelRequest>,
    ) -> Result<Response<CancelResponse>, Status> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.send(SchedulerCommand::Cancel(
            request.into_inner().request_id,
            reply,
        ))?;
        let found = answer.await.unwrap_or(false);
        Ok(Response::new(CancelResponse { found }))
    }

    async fn get_model_info(
        &self,
        _: Request<ModelInfoRequest>,
    ) -> Result<Response<ModelInfo>, Status> {
        let common = self.artifact.config().common();
        Ok(Response::new(ModelInfo {
            model_name: self.model_name.clone(),
            architecture: self.artifact.config().architecture().to_string(),
            vocab_size: common.vocab_size as u32,
            max_context: self.limits.max_context as u32,
            eos_token_ids: self.eos_token_ids(),
            engine_instance_id: self.instance_id.clone(),
            model_files_digest: self.files_digest(),
            created_unix_seconds: self.created_unix_seconds,
            token_socket_path: self.token_socket_path.clone().unwrap_or_default(),
        }))
    }

    async fn stream_routing_statistics(
        &self,
        request: Request<RoutingStatisticsRequest>,
    ) -> Result<Response<StatisticsStream>, Status> {
        let interval =
            Duration::from_millis(request.into_inner().interval_ms.clamp(100, 3_600_000) as u64);
        let (sender, receiver) = tokio::sync::mpsc::channel(4);
        let counters = Arc::clone(&self.routing);
        let (model, instance) = (self.model_name.clone(), self.instance_id.clone());
        tokio::spawn(async move {
            loop {
                if sender
                    .send(Ok(counters.snapshot(&model, &instance)))
                    .await
                    .is_err()
                {
                    return;
                }
                tokio::time::sleep(interval).await;
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(receiver),
        )))
    }

    async fn get_model_files(
        &self,
        _: Request<ModelFilesRequest>,
    ) -> Result<Response<ModelFiles>, Status> {
        let generation = &self.artifact.header().generation;
        let text = |name: &str| {
            String::from_utf8_lossy(self.artifact.file(name).unwrap_or_default()).into_owned()
        };
        Ok(Response::new(ModelFiles {
            model_name: self.model_name.clone(),
            tokenizer_json: self
                .artifact
                .file("tokenizer.json")
                .unwrap_or_default()
                .to_vec(),
            chat_template: text("chat_template.jinja"),
            tokenizer_config_json: text("tokenizer_config.json"),
            generation_defaults: Some(GenerationDefaults {
                temperature: generation.temperature,
                top_p: generation.top_p,
                top_k: generation.top_k,
                min_p: generation.min_p,
                repetition_penalty: generation.repetition_penalty,
            }),
            eos_token_ids: self.eos_token_ids(),
            max_context: self.limits.max_context as u32,
            model_files_digest: self.files_digest(),
            preprocessor_config_json: self
                .images
                .as_ref()
                .map(|images| images.settings_json())
                .unwrap_or_default(),
            video_preprocessor_config_json: self
                .images
                .as_ref()
                .map(|images| images.video_settings().to_json())
                .unwrap_or_default(),
        }))
    }

    async fn get_status(
        &self,
        _: Request<EngineStatusRequest>,
    ) -> Result<Response<EngineStatus>, Status> {
        let not_ready = self.readiness.not_ready_reason();
        let counters = &self.scheduler_counters;
        let expert_cache = self.profiling.expert_cache.as_deref();
        let cache = expert_cache.map(|c| c.total()).unwrap_or_default();
        let expert_cache_layers = expert_cache
            .map(|c| {
                c.per_layer()
                    .iter()
                    .enumerate()
                    .filter(|(_, counts)| **counts != CacheCounts::default())
                    .map(|(layer, counts)| ExpertCacheLayerCounts {
                        layer: layer as u32,
                        hits: counts.hits,
                        misses: counts.misses,
                        fills: counts.fills,
                        evictions: counts.evictions,
                        bytes_copied: counts.bytes_copied,
                    })
                    .collect()
            })
            .unwrap_or_default();
        let gpu_expert_slots =
            expert_cache.map_or(0, |c| u32::try_from(c.total_slots()).unwrap_or(u32::MAX));
        let prefix = &counters.prefix_cache;
        Ok(Response::new(EngineStatus {
            ready: not_ready.is_none(),
            engine_instance_id: self.instance_id.clone(),
            running_sequences: counters.running.load(Ordering::Relaxed) as u32,
            queued_sequences: 0,
            max_sequences: self.limits.max_sequences as u32,
            prompt_tokens_total: counters.prompt_tokens.load(Ordering::Relaxed),
            generated_tokens_total: counters.generated_tokens.load(Ordering::Relaxed),
            cpu_expert_calls_total: self.readiness.cpu_expert_calls(),
            expert_cache_hits_total: cache.hits,
            expert_cache_misses_total: cache.misses,
            expert_slot_refills_total: cache.fills,
            gpu_expert_slots,
            kv_cache_used_tokens: counters.kv_used_tokens.load(Ordering::Relaxed),
            kv_cache_capacity_tokens: (self.limits.max_context * self.limits.max_sequences) as u64,
            not_ready_reason: not_ready.unwrap_or_default(),
            expert_cache_evictions_total: cache.evictions,
            expert_cache_bytes_copied_total: cache.bytes_copied,
            expert_cache_layers,
            speculative_steps_total: counters.speculative_steps.load(Ordering::Relaxed),
            drafted_tokens_by_depth: depth_counts(&counters.drafted_at_depth),
            accepted_tokens_by_depth: depth_counts(&counters.accepted_at_depth),
            prefix_cache_lookups_total: prefix.lookups.load(Ordering::Relaxed),
            prefix_cache_hits_total: prefix.hits.load(Ordering::Relaxed),
            prefix_cache_hit_tokens_total: prefix.hit_tokens.load(Ordering::Relaxed),
            prefix_cache_evictions_total: prefix.evictions.load(Ordering::Relaxed),
            prefix_cache_bytes: prefix.bytes.load(Ordering::Relaxed),
            prefix_cache_budget_bytes: prefix.budget_bytes.load(Ordering::Relaxed),
        }))
    }

    async fn get_profile(
        &self,
        request: Request<ProfileRequest>,
    ) -> Result<Response<EngineProfile>, Status> {
        let request = request.into_inner();
        let profiling = &self.profiling;
        let (mut bandwidth, mut bandwidth_error) = (0.0, String::new());
        if request.measure_device_bandwidth {
            match &profiling.device_bandwidth {
                // The copy blocks for a fraction of a second: off the async workers.
                Some(probe) => match tokio::task::block_in_place(probe) {
                    Ok(bytes_per_second) => bandwidth = bytes_per_second,
                    Err(problem) => bandwidth_error = problem,
                },
                None => bandwidth_error = format!("the {} device has no GPU", profiling.device),
            }
        }
        let snapshot = profiling.counters.snapshot(request.reset);
        let throughputs = profiling.prefill_throughputs;
        Ok(Response::new(EngineProfile {
            device: profiling.device.clone(),
            prefill: Some(phase_message(&snapshot.prefill)),
            decode: Some(phase_message(&snapshot.decode)),
            dense_weight_bytes_per_forward: snapshot.dense_weight_bytes_per_forward,
            expert_stride_bytes: profiling.expert_stride_bytes,
            expert_compute_reported: snapshot.expert_compute_reported,
            expert_executor: profiling.expert_executor.clone(),
            device_copy_bytes_per_second: bandwidth,
            device_bandwidth_error: bandwidth_error,
            gpu_experts_per_layer: profiling.gpu_experts_per_layer,
            prefill_copy_bytes_per_second: throughputs.map_or(0.0, |t| t.copy_bytes_per_second),
            prefill_gpu_pairs_per_second: throughputs.map_or(0.0, |t| t.backend_pairs_per_second),
            prefill_executor_pairs_per_second: throughputs
                .map_or(0.0, |t| t.executor_pairs_per_second),
            expert_flops_per_pair: throughputs.map_or(0.0, |t| t.flops_per_pair),
        }))
    }
}
