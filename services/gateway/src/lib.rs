//! `ninfer-gateway`: the HTTP/gRPC front door of NInfer-Offload.
//!
//! Owns: everything clients see. The OpenAI API (`openai`; its per-token
//! chunks `openai_chunks`), the Anthropic API (`anthropic`), the
//! public gRPC API with health and reflection (`grpc_api`) — each only converts its wire types to
//! and from the neutral chat model (`chat`) and the generator's events; utility routes, auth and
//! limits (`server`); reading request bodies within their limit, refusing a prompt too long
//! for the context or another input over its limit while it arrives (`request_body`, measured by
//! `body_scan`) and parsing them (`json_body`); connection limits, timeouts and the shutdown drain (`connections`);
//! shared state (`state`); the tokenizer and chat template taken from the engine (`tokenizer`,
//! its byte-level decoding table `token_bytes`,
//! `chat_template`); stop strings (`stop_strings`), `<think>` splitting
//! (`reasoning`), tool-call parsing (`tool_calls`), structured output and forced tool calls as
//! grammars for the engine (`structured`), the OpenAI Responses API (`responses`) and the
//! [`generation::Generator`] every API
//! generates through; the [`backend::GenerationBackend`] seam and its gRPC engine
//! pool (`backend::engine_pool`); routing statistics (`routing_stats`); Prometheus metrics
//! (`metrics`); systemd notifications (`sd_notify`).
//! Must not touch: weights, the artifact, CUDA, or the engine's internals. The gateway depends on
//! `ninfer-protocol` alone among workspace crates and learns everything about the model
//! (tokenizer.json, chat template, context length, EOS ids) from the engine over gRPC.

pub mod anthropic;
pub mod backend;
pub mod body_scan;
pub mod chat;
pub mod chat_template;
pub mod connections;
pub mod error;
pub mod generation;
pub mod grpc_api;
pub mod json_body;
pub mod metrics;
pub mod openai;
pub mod openai_chunks;
pub mod reasoning;
pub mod request_body;
pub mod responses;
pub mod routing_stats;
/// systemd notifications live with the other wire protocols, shared by every service binary.
pub use ninfer_protocol::sd_notify;
pub mod server;
pub mod state;
pub mod stop_strings;
pub mod stream_deltas;
pub mod structured;
pub mod token_bytes;
pub mod tokenizer;
pub mod tool_calls;

pub use backend::engine_pool::{EnginePool, EnginePoolOptions};
pub use backend::GenerationBackend;
pub use error::GatewayError;
pub use server::{build_router, serve};
pub use state::{GatewaySettings, GatewayState};
