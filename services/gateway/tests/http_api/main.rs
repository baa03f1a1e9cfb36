//! The HTTP APIs against a scripted in-process engine: OpenAI and Anthropic shapes, streaming
//! event order, stop strings across token boundaries, reasoning split, usage, errors, auth,
//! cancellation, metrics and routing statistics.

#[path = "../common/mod.rs"]
mod common;
mod helpers;

mod anthropic;
mod auth_and_failures;
mod openai;
mod service_endpoints;
mod tool_calls;
