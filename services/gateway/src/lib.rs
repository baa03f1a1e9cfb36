//! `ninfer-gateway`: the HTTP/gRPC front door of NInfer-Offload.
//!
//! Owns: everything clients see. A request flows one way: its API dialect reads it into the
//! neutral chat model (`chat`) and sampling options, `generation_plan` makes the plan (template,
//! grammar, sampling, checked against the context), the [`generation::Generator`] runs it on an
//! engine, and the same dialect renders the events. The dialects, none importing another: the
//! OpenAI API (`openai` chat, its per-token chunks `openai_chunks`, `openai_completions` raw
//! prompts), the Anthropic API (`anthropic`, its per-token events `anthropic_stream_deltas`),
//! the OpenAI Responses API (`responses`, its numbered events `responses_stream_events`) and the
//! public gRPC API with health and reflection (`grpc_api`); the JSON strings of every per-token
//! writer come from `json_text`; every stage of an answer runs in its HTTP connection's task
//! (`inline_stream`) and leaves as server-sent events rendered once (`event_stream`); `models`
//! answers `/v1/models` in the asking API's shape; `error` is the one error type and each
//! dialect's error envelope. Beside them: utility routes, auth and limits (`server`); reading
//! request bodies within their limit, refusing a prompt too long for the context or another
//! input over its limit while it arrives (`request_body`, measured by `body_scan`) and parsing
//! them (`json_body`); images and videos in chat requests (`images`, `videos`, fetched image URLs
//! `image_urls`); connection limits, timeouts and the shutdown drain (`connections`, streaming
//! bodies polled through only when woken `woken_body`); shared state (`state`); the tokenizer
//! and chat template taken from the engine (`tokenizer`, its byte-level decoding table
//! `token_bytes`, the token ids of long prompt pieces kept between turns `prompt_token_cache`,
//! `chat_template`); stop strings (`stop_strings`), `<think>` splitting (`reasoning`), tool-call
//! parsing (`tool_calls`), structured output and forced tool calls as grammars for the engine
//! (`structured`); the [`backend::GenerationBackend`] seam and its gRPC engine pool
//! (`backend::engine_pool`); routing statistics (`routing_stats`); Prometheus metrics
//! (`metrics`); systemd notifications (`sd_notify`).
//! Must not touch: weights, the artifact, CUDA, or the engine's internals. Among workspace crates
//! the gateway depends on `ninfer-protocol` and `ninfer-vision-input` (image headers read and
//! sized, never decoded) alone, and learns everything about the model (tokenizer.json, chat
//! template, context length, EOS ids) from the engine over gRPC.

pub mod anthropic;
pub mod anthropic_stream_deltas;
pub mod backend;
pub mod body_scan;
pub mod chat;
pub mod chat_template;
pub mod connections;
pub mod error;
pub mod event_stream;
pub mod generation;
pub mod generation_plan;
pub mod grpc_api;
pub mod image_urls;
pub mod images;
pub mod inline_stream;
pub mod json_body;
pub mod json_text;
pub mod metrics;
pub mod models;
pub mod openai;
pub mod openai_chunks;
pub mod openai_completions;
pub mod prompt_token_cache;
pub mod reasoning;
pub mod request_body;
pub mod responses;
pub mod responses_stream_events;
pub mod routing_stats;
/// systemd notifications live with the other wire protocols, shared by every service binary.
pub use ninfer_protocol::sd_notify;
pub mod server;
pub mod state;
pub mod stop_strings;
pub mod structured;
pub mod token_bytes;
pub mod tokenizer;
pub mod tool_calls;
pub mod videos;
pub mod woken_body;

pub use backend::engine_pool::{EnginePool, EnginePoolOptions};
pub use backend::GenerationBackend;
pub use error::GatewayError;
pub use server::{build_router, serve};
pub use state::{GatewaySettings, GatewayState};
