//! The public gRPC API (`proto/ninfer/v1/gateway.proto`), `grpc.health.v1` and server reflection.
//!
//! Owns: the `ninfer.v1.Gateway` service (ListModels, Generate, GenerateStream, Chat, ChatStream)
//! on top of the same [`crate::generation::Generator`] as the HTTP APIs (converting its messages
//! to the neutral chat model), the health service (SERVING while an engine
//! is ready), and reflection from `ninfer_protocol::FILE_DESCRIPTOR_SET` so `grpcurl` needs no
//! proto files. Routed on the gateway's HTTP port by path (`/ninfer.v1.Gateway/...`).
//! Must not touch: HTTP JSON shapes, authentication (the server's middleware covers gRPC too).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use ninfer_protocol::v1::gateway_server::{Gateway, GatewayServer};
use ninfer_protocol::v1::{
    ChatChunk, ChatRequest, ChatResponse, GatewayFinishReason, GatewayModel,
    GatewaySamplingOptions, GatewayUsage, ListModelsRequest, ListModelsResponse,
    TextGenerationChunk, TextGenerationRequest, TextGenerationResponse,
};
use tonic::{Request, Response, Status};

use crate::chat::{
    template_variables_from_object, ChatContent, ChatContentPart, ChatConversation, ChatMessage,
    ChatRole,
};
use crate::error::GatewayError;
use crate::generation::{
    collect_generation, ChoiceReceiver, FinishKind, GenerationEvent, GenerationSummary,
};
use crate::generation_plan::{plan_text, ChatGenerationRequest, GenerationPlan, SamplingOptions};
use crate::images::{ChatImage, ChatImagePart};
use crate::state::GatewayState;

/// The `ninfer.v1.Gateway` implementation.
pub struct GatewayGrpcService {
    state: Arc<GatewayState>,
}

/// gRPC routes (public API, health, reflection) as an axum router to merge with the HTTP one.
/// Must be called inside a tokio runtime (the health reporter runs as a task).
pub fn grpc_routes(state: Arc<GatewayState>) -> axum::Router {
    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    let health_state = state.clone();
    tokio::spawn(async move {
        // Mirrors /health: SERVING while at least one engine is ready. Woken by each new
        // snapshot where the backend publishes them (no timer while streams run), else polled.
        let mut changes = health_state.backend.snapshot_changes();
        let mut last: Option<bool> = None;
        loop {
            let ready = match changes.as_mut() {
                Some(changes) => changes.borrow_and_update().any_engine_ready(),
                None => health_state.backend.snapshot().any_engine_ready(),
            };
            if last != Some(ready) {
                if ready {
                    health_reporter
                        .set_serving::<GatewayServer<GatewayGrpcService>>()
                        .await;
                    health_reporter
                        .set_service_status("", tonic_health::ServingStatus::Serving)
                        .await;
                } else {
                    health_reporter
                        .set_not_serving::<GatewayServer<GatewayGrpcService>>()
                        .await;
                    health_reporter
                        .set_service_status("", tonic_health::ServingStatus::NotServing)
                        .await;
                }
                last = Some(ready);
            }
            match changes.as_mut() {
                Some(changes) => {
                    if changes.changed().await.is_err() {
                        break; // the backend is gone: the server is shutting down
                    }
                }
                None => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    });
    let mut routes = tonic::service::Routes::new(GatewayServer::new(GatewayGrpcService { state }))
        .add_service(health_service);
    // Both reflection versions: grpcurl before 1.9 and some GUI clients speak only v1alpha.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(ninfer_protocol::FILE_DESCRIPTOR_SET)
    };
    match (reflection().build_v1(), reflection().build_v1alpha()) {
        (Ok(v1), Ok(v1alpha)) => routes = routes.add_service(v1).add_service(v1alpha),
        (Err(error), _) | (_, Err(error)) => {
            tracing::warn!(%error, "gRPC reflection disabled: descriptor set rejected")
        }
    }
    routes.into_axum_router()
}

fn sampling_options(options: Option<GatewaySamplingOptions>) -> SamplingOptions {
    let options = options.unwrap_or_default();
    SamplingOptions {
        temperature: options.temperature,
        top_p: options.top_p,
        top_k: options.top_k,
        min_p: options.min_p,
        repetition_penalty: options.repetition_penalty,
        presence_penalty: options.presence_penalty,
        frequency_penalty: options.frequency_penalty,
        seed: options.seed,
        max_tokens: if options.max_tokens == 0 {
            None
        } else {
            Some(options.max_tokens)
        },
        stop: options.stop,
        logprobs: false,
        top_logprobs: 0,
        choices: 1,
        logit_bias: Vec::new(),
        draft_tokens: None,
        ignore_eos: false,
    }
}

fn finish_reason(finish: FinishKind) -> i32 {
    match finish {
        FinishKind::Stop => GatewayFinishReason::Stop as i32,
        FinishKind::Length => GatewayFinishReason::Length as i32,
        FinishKind::Cancelled => GatewayFinishReason::Cancelled as i32,
    }
}

fn usage(summary: &GenerationSummary) -> GatewayUsage {
    GatewayUsage {
        prompt_tokens: summary.prompt_tokens,
        completion_tokens: summary.completion_tokens,
        cached_prompt_tokens: summary.cached_tokens.min(summary.prompt_tokens),
    }
}

type BoxedStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

impl GatewayGrpcService {
    async fn text_plan(
        &self,
        request: TextGenerationRequest,
    ) -> Result<GenerationPlan, GatewayError> {
        let model = self.state.generator.resolve_model(&request.model)?;
        plan_text(model, request.prompt, sampling_options(request.options)).await
    }

    /// Starts a chat's one choice.
    async fn start_chat(&self, request: ChatRequest) -> Result<ChoiceReceiver, GatewayError> {
        let generator = &self.state.generator;
        let model = generator.resolve_model(&request.model)?;
        let conversation = chat_conversation(&request)?;
        let chat = ChatGenerationRequest {
            model,
            conversation,
            options: sampling_options(request.options),
        };
        Ok(generator
            .start_chat(&chat)
            .await?
            .into_only_choice()?
            .receiver)
    }
}

/// Converts a gRPC chat request to the neutral conversation.
fn chat_conversation(request: &ChatRequest) -> Result<ChatConversation, GatewayError> {
    if request.messages.is_empty() {
        return Err(GatewayError::invalid_parameter(
            "messages",
            "`messages` must not be empty",
        ));
    }
    let mut messages = Vec::new();
    for (index, message) in request.messages.iter().enumerate() {
        let role = ChatRole::from_name(&message.role)
            .ok_or_else(|| ChatRole::unknown_role_error(index, &message.role))?;
        let mut converted = ChatMessage::text(role, message.content.as_str());
        if !message.images.is_empty() {
            let mut parts: Vec<ChatContentPart> = message
                .images
                .iter()
                .enumerate()
                .map(|(image_index, image)| {
                    let location = format!("messages[{index}].images[{image_index}]");
                    let media_type = Some(image.media_type.as_str()).filter(|m| !m.is_empty());
                    ChatContentPart::Image(ChatImagePart {
                        image: ChatImage::from_bytes(image.encoded.clone(), media_type, &location)
                            .map_err(|error| error.to_string()),
                        location,
                        fetch_from: None,
                    })
                })
                .collect();
            parts.push(ChatContentPart::Text(message.content.clone()));
            converted.content = Some(ChatContent::Parts(parts));
        }
        if !message.reasoning_content.is_empty() {
            converted.reasoning = Some(message.reasoning_content.clone());
        }
        messages.push(converted);
    }
    let mut template_variables = Vec::new();
    if !request.chat_template_kwargs_json.trim().is_empty() {
        let parsed: minijinja::Value = serde_json::from_str(&request.chat_template_kwargs_json)
            .map_err(|error| {
                GatewayError::invalid_parameter(
                    "chat_template_kwargs_json",
                    format!("not JSON: {error}"),
                )
            })?;
        if parsed.kind() != minijinja::value::ValueKind::Map {
            return Err(GatewayError::invalid_parameter(
                "chat_template_kwargs_json",
                "must be a JSON object",
            ));
        }
        template_variables = template_variables_from_object("chat_template_kwargs_json", &parsed)?;
    }
    if let Some(enable_thinking) = request.enable_thinking {
        template_variables.push((
            "enable_thinking".to_string(),
            minijinja::Value::from(enable_thinking),
        ));
    }
    Ok(ChatConversation {
        messages,
        tools: Vec::new(),
        add_generation_prompt: true,
        template_variables,
        ..Default::default()
    })
}

#[tonic::async_trait]
impl Gateway for GatewayGrpcService {
    async fn list_models(
        &self,
        _request: Request<ListModelsRequest>,
    ) -> Result<Response<ListModelsResponse>, Status> {
        let snapshot = self.state.backend.snapshot();
        let models = snapshot
            .models
            .values()
            .map(|model| GatewayModel {
                name: model.name.clone(),
                max_context: model.resources.max_context,
                ready_engines: model.ready_engines as u32,
                architecture: model.architecture.clone(),
            })
            .collect();
        Ok(Response::new(ListModelsResponse { models }))
    }

    async fn generate(
        &self,
        request: Request<TextGenerationRequest>,
    ) -> Result<Response<TextGenerationResponse>, Status> {
        let result = async {
            let plan = self.text_plan(request.into_inner()).await?;
            let generation =
                collect_generation(self.state.generator.start_choice(&plan, 0).await?).await?;
            Ok::<_, GatewayError>(TextGenerationResponse {
                text: generation.content,
                finish_reason: finish_reason(generation.summary.finish),
                usage: Some(usage(&generation.summary)),
                matched_stop: generation.summary.matched_stop.unwrap_or_default(),
            })
        }
        .await;
        result
            .map(Response::new)
            .map_err(|error| error.to_grpc_status())
    }

    type GenerateStreamStream = BoxedStream<TextGenerationChunk>;

    async fn generate_stream(
        &self,
        request: Request<TextGenerationRequest>,
    ) -> Result<Response<Self::GenerateStreamStream>, Status> {
        let plan = self
            .text_plan(request.into_inner())
            .await
            .map_err(|error| error.to_grpc_status())?;
        let receiver = self
            .state
            .generator
            .start_choice(&plan, 0)
            .await
            .map_err(|error| error.to_grpc_status())?;
        let stream = receiver.map(|event| match event {
            Ok(GenerationEvent::Delta { text, .. }) => Ok(TextGenerationChunk {
                text: text.content,
                ..Default::default()
            }),
            Ok(GenerationEvent::Finished(summary)) => Ok(TextGenerationChunk {
                text: String::new(),
                finish_reason: finish_reason(summary.finish),
                usage: Some(usage(&summary)),
                matched_stop: summary.matched_stop.unwrap_or_default(),
            }),
            Err(error) => Err(error.to_grpc_status()),
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn chat(&self, request: Request<ChatRequest>) -> Result<Response<ChatResponse>, Status> {
        let result = async {
            let generation =
                collect_generation(self.start_chat(request.into_inner()).await?).await?;
            Ok::<_, GatewayError>(ChatResponse {
                content: generation.content,
                reasoning_content: generation.reasoning,
                finish_reason: finish_reason(generation.summary.finish),
                usage: Some(usage(&generation.summary)),
                matched_stop: generation.summary.matched_stop.unwrap_or_default(),
            })
        }
        .await;
        result
            .map(Response::new)
            .map_err(|error| error.to_grpc_status())
    }

    type ChatStreamStream = BoxedStream<ChatChunk>;

    async fn chat_stream(
        &self,
        request: Request<ChatRequest>,
    ) -> Result<Response<Self::ChatStreamStream>, Status> {
        let receiver = self
            .start_chat(request.into_inner())
            .await
            .map_err(|error| error.to_grpc_status())?;
        let stream = receiver.map(|event| match event {
            Ok(GenerationEvent::Delta { text, .. }) => Ok(ChatChunk {
                content: text.content,
                reasoning_content: text.reasoning,
                ..Default::default()
            }),
            Ok(GenerationEvent::Finished(summary)) => Ok(ChatChunk {
                finish_reason: finish_reason(summary.finish),
                usage: Some(usage(&summary)),
                matched_stop: summary.matched_stop.unwrap_or_default(),
                ..Default::default()
            }),
            Err(error) => Err(error.to_grpc_status()),
        });
        Ok(Response::new(Box::pin(stream)))
    }
}
