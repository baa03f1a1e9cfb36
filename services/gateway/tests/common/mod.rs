//! Test harness: a deterministic in-process Engine gRPC server, a gateway on loopback, and a tiny
//! raw HTTP/1.1 client (raw so that hostile bytes reach the server unchanged).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::Stream;
use ninfer_gateway::backend::engine_pool::{EnginePool, EnginePoolOptions};
use ninfer_gateway::routing_stats::RoutingStatsHandle;
use ninfer_gateway::{GatewaySettings, GatewayState};
use ninfer_protocol::v1::engine_server::{Engine, EngineServer};
use ninfer_protocol::v1::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::{Request, Response, Status};

pub const MODEL: &str = "test-model";

pub fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe")
}

/// What the scripted engine does; tests change it between requests.
pub struct EngineScript {
    /// The completion text, tokenized and sent one token at a time, then EOS.
    pub completion_text: Mutex<String>,
    /// When set: the completion once the last user turn carries a tool result (a client's tool
    /// round trip ends instead of calling the tool again).
    pub completion_after_tool_result: Mutex<Option<String>>,
    pub token_delay: Mutex<Duration>,
    pub overloaded: AtomicBool,
    pub max_context: AtomicU32,
    /// What `GetStatus` reports as `max_sequences` (0: unknown).
    pub max_sequences: AtomicU32,
    pub last_request: Mutex<Option<GenerateRequest>>,
    pub cancels: AtomicU32,
    /// Generations whose stream the gateway dropped before the end.
    pub dropped_streams: AtomicU32,
    pub generations: AtomicU32,
    pub tokens_routed: AtomicU64,
    pub instance_id: Mutex<String>,
    /// Serve the multimodal `qwen3_5_moe` fixture's tokenizer, template and image processor
    /// settings instead of `qwen3_moe`'s text-only files (read when the engine starts).
    pub vision: AtomicBool,
    /// The video processor settings the engine reports with them (empty: none).
    pub video_preprocessor_config_json: Mutex<String>,
    /// The token socket `GetModelInfo` reports (empty: none).
    pub token_socket_path: Mutex<String>,
}

impl Default for EngineScript {
    fn default() -> Self {
        EngineScript {
            completion_text: Mutex::new("Hello there, friend.".to_string()),
            completion_after_tool_result: Mutex::new(None),
            token_delay: Mutex::new(Duration::from_millis(1)),
            overloaded: AtomicBool::new(false),
            max_context: AtomicU32::new(4096),
            max_sequences: AtomicU32::new(0),
            last_request: Mutex::new(None),
            cancels: AtomicU32::new(0),
            dropped_streams: AtomicU32::new(0),
            generations: AtomicU32::new(0),
            tokens_routed: AtomicU64::new(0),
            instance_id: Mutex::new("instance-1".to_string()),
            vision: AtomicBool::new(false),
            video_preprocessor_config_json: Mutex::new(String::new()),
            token_socket_path: Mutex::new(String::new()),
        }
    }
}

impl EngineScript {
    pub fn set_text(&self, text: &str) {
        *self
            .completion_text
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = text.to_string();
    }
    pub fn set_delay(&self, delay: Duration) {
        *self.token_delay.lock().unwrap_or_else(|e| e.into_inner()) = delay;
    }
    pub fn last_request(&self) -> GenerateRequest {
        self.last_request
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default()
    }
}

#[derive(Clone)]
pub struct ScriptedEngine {
    pub script: Arc<EngineScript>,
    tokenizer: Arc<tokenizers::Tokenizer>,
    tokenizer_json: Arc<Vec<u8>>,
    chat_template: Arc<String>,
    preprocessor_config_json: Arc<String>,
    video_preprocessor_config_json: Arc<String>,
}

impl ScriptedEngine {
    pub fn new(script: Arc<EngineScript>) -> Self {
        let vision = script.vision.load(Ordering::SeqCst);
        let directory = if vision {
            fixture_dir().join("../qwen3_5_moe")
        } else {
            fixture_dir()
        };
        let tokenizer_json = std::fs::read(directory.join("tokenizer.json"))
            .unwrap_or_else(|e| panic!("tokenizer.json: {e}"));
        let tokenizer = tokenizers::Tokenizer::from_bytes(&tokenizer_json)
            .unwrap_or_else(|e| panic!("tokenizer: {e}"));
        let chat_template = std::fs::read_to_string(directory.join("chat_template.jinja"))
            .unwrap_or_else(|e| panic!("template: {e}"));
        let preprocessor_config_json = match vision {
            true => std::fs::read_to_string(directory.join("preprocessor_config.json"))
                .unwrap_or_else(|e| panic!("preprocessor_config.json: {e}")),
            false => String::new(),
        };
        let video_preprocessor_config_json = script
            .video_preprocessor_config_json
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        ScriptedEngine {
            tokenizer: Arc::new(tokenizer),
            tokenizer_json: Arc::new(tokenizer_json),
            chat_template: Arc::new(chat_template),
            preprocessor_config_json: Arc::new(preprocessor_config_json),
            video_preprocessor_config_json: Arc::new(video_preprocessor_config_json),
            script,
        }
    }
}

/// Sends the scripted tokens; counts a drop before the end (the gateway cancelling).
struct ScriptedStream {
    receiver: tokio::sync::mpsc::Receiver<Result<GeneratedToken, Status>>,
    finished: bool,
    script: Arc<EngineScript>,
}

impl Stream for ScriptedStream {
    type Item = Result<GeneratedToken, Status>;
    fn poll_next(
        mut self: Pin<&mut Self>,
        context: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let polled = self.receiver.poll_recv(context);
        if let std::task::Poll::Ready(Some(Ok(token))) = &polled {
            if token.finish_reason != 0 {
                self.finished = true;
            }
        }
        if let std::task::Poll::Ready(None) = &polled {
            self.finished = true;
        }
        polled
    }
}

impl Drop for ScriptedStream {
    fn drop(&mut self) {
        if !self.finished {
            self.script.dropped_streams.fetch_add(1, Ordering::SeqCst);
        }
    }
}

#[tonic::async_trait]
impl Engine for ScriptedEngine {
    type GenerateStream = Pin<Box<dyn Stream<Item = Result<GeneratedToken, Status>> + Send>>;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let request = request.into_inner();
        *self
            .script
            .last_request
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(request.clone());
        if self.script.overloaded.load(Ordering::SeqCst) {
            return Err(Status::resource_exhausted("queue full"));
        }
        self.script.generations.fetch_add(1, Ordering::SeqCst);
        let mut text = self
            .script
            .completion_text
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let after_tool = self
            .script
            .completion_after_tool_result
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(after_tool) = after_tool {
            let prompt = self
                .tokenizer
                .decode(&request.prompt_token_ids, false)
                .unwrap_or_default();
            let last_user_turn = prompt.rsplit("<|im_start|>user").next().unwrap_or_default();
            if last_user_turn.contains("<tool_response>") {
                text = after_tool;
            }
        }
        // `{seed}` in the script stands for the seed the request carries (distinct samples show
        // as distinct texts).
        let seed = request
            .sampling
            .as_ref()
            .and_then(|sampling| sampling.seed)
            .map(|seed| seed.to_string())
            .unwrap_or_default();
        let text = text.replace("{seed}", &seed);
        let mut token_ids = self
            .tokenizer
            .encode(text.as_str(), false)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default();
        token_ids.push(482); // <|im_end|>
        let delay = *self
            .script
            .token_delay
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let prompt_tokens = request.prompt_token_ids.len() as u32;
        let max_new = request.max_new_tokens.max(1) as usize;
        let (sender, receiver) = tokio::sync::mpsc::channel(4);
        let script = self.script.clone();
        tokio::spawn(async move {
            for (index, token_id) in token_ids.iter().enumerate() {
                tokio::time::sleep(delay).await;
                let is_eos = index + 1 == token_ids.len();
                let at_limit = index + 1 == max_new;
                let finish_reason = if is_eos {
                    FinishReason::StopToken as i32
                } else if at_limit {
                    FinishReason::Length as i32
                } else {
                    0
                };
                let token = GeneratedToken {
                    token_id: *token_id,
                    logprob: -0.5,
                    top_logprobs: (0..request.top_logprobs)
                        .map(|k| TokenLogprob {
                            token_id: 65 + k,
                            logprob: -1.0 - k as f32,
                        })
                        .collect(),
                    finish_reason,
                    prompt_tokens,
                    completion_tokens: index as u32 + 1,
                    cached_prompt_tokens: 0,
                    no_token: false,
                };
                script.tokens_routed.fetch_add(1, Ordering::SeqCst);
                if sender.send(Ok(token)).await.is_err() {
                    return;
                }
                if finish_reason != 0 {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ScriptedStream {
            receiver,
            finished: false,
            script: self.script.clone(),
        })))
    }

    async fn cancel(
        &self,
        _request: Request<CancelRequest>,
    ) -> Result<Response<CancelResponse>, Status> {
        self.script.cancels.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(CancelResponse { found: true }))
    }

    async fn get_model_info(
        &self,
        _request: Request<ModelInfoRequest>,
    ) -> Result<Response<ModelInfo>, Status> {
        Ok(Response::new(ModelInfo {
            model_name: MODEL.to_string(),
            architecture: "qwen3_moe".to_string(),
            vocab_size: 512,
            max_context: self.script.max_context.load(Ordering::SeqCst),
            eos_token_ids: vec![482, 480],
            engine_instance_id: self
                .script
                .instance_id
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            model_files_digest: "digest-1".to_string(),
            created_unix_seconds: 1_700_000_000,
            token_socket_path: self
                .script
                .token_socket_path
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }))
    }

    type StreamRoutingStatisticsStream =
        Pin<Box<dyn Stream<Item = Result<RoutingStatistics, Status>> + Send>>;

    async fn stream_routing_statistics(
        &self,
        request: Request<RoutingStatisticsRequest>,
    ) -> Result<Response<Self::StreamRoutingStatisticsStream>, Status> {
        let interval = Duration::from_millis(u64::from(request.into_inner().interval_ms.max(20)));
        let script = self.script.clone();
        let (sender, receiver) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                let routed = script.tokens_routed.load(Ordering::SeqCst);
                // Two layers, four experts; expert (routed % 4) gets everything: deterministic.
                let layers = (0..2)
                    .map(|layer| LayerRoutingCounts {
                        layer,
                        expert_token_counts: vec![routed, routed * 2, 0, u64::from(layer)],
                    })
                    .collect();
                let statistics = RoutingStatistics {
                    tokens_routed: routed,
                    layers,
                    model_name: MODEL.to_string(),
                    engine_instance_id: script
                        .instance_id
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .clone(),
                };
                if sender.send(Ok(statistics)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(receiver),
        )))
    }

    async fn get_model_files(
        &self,
        _request: Request<ModelFilesRequest>,
    ) -> Result<Response<ModelFiles>, Status> {
        Ok(Response::new(ModelFiles {
            model_name: MODEL.to_string(),
            tokenizer_json: self.tokenizer_json.as_ref().clone(),
            chat_template: self.chat_template.as_ref().clone(),
            tokenizer_config_json: r#"{"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}"#
                .to_string(),
            generation_defaults: Some(GenerationDefaults {
                temperature: Some(0.6),
                top_p: Some(0.95),
                top_k: Some(20),
                ..Default::default()
            }),
            eos_token_ids: vec![482, 480],
            max_context: self.script.max_context.load(Ordering::SeqCst),
            model_files_digest: "digest-1".to_string(),
            preprocessor_config_json: self.preprocessor_config_json.as_ref().clone(),
            video_preprocessor_config_json: self.video_preprocessor_config_json.as_ref().clone(),
        }))
    }

    async fn get_status(
        &self,
        _request: Request<EngineStatusRequest>,
    ) -> Result<Response<EngineStatus>, Status> {
        Ok(Response::new(EngineStatus {
            ready: true,
            engine_instance_id: self
                .script
                .instance_id
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            expert_cache_hits_total: 7,
            expert_cache_misses_total: 3,
            gpu_expert_slots: 16,
            expert_cache_layers: vec![ExpertCacheLayerCounts {
                layer: 3,
                hits: 2,
                ..Default::default()
            }],
            speculative_steps_total: 8,
            drafted_tokens_by_depth: vec![8, 5],
            accepted_tokens_by_depth: vec![6, 3],
            max_sequences: self.script.max_sequences.load(Ordering::SeqCst),
            ..Default::default()
        }))
    }

    async fn get_profile(
        &self,
        _request: Request<ProfileRequest>,
    ) -> Result<Response<EngineProfile>, Status> {
        Err(Status::unimplemented(
            "the scripted engine keeps no profile",
        ))
    }

    type ScoreTokensStream = Pin<Box<dyn Stream<Item = Result<TokenScores, Status>> + Send>>;

    async fn score_tokens(
        &self,
        _request: Request<ScoreRequest>,
    ) -> Result<Response<Self::ScoreTokensStream>, Status> {
        Err(Status::unimplemented(
            "the scripted engine scores nothing (the gateway never asks)",
        ))
    }
}

/// A running scripted engine on its own runtime, so `kill` drops every connection like a crash.
pub struct RunningEngine {
    pub address: SocketAddr,
    pub script: Arc<EngineScript>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl RunningEngine {
    pub async fn start(script: Arc<EngineScript>, address: Option<SocketAddr>) -> RunningEngine {
        let listener = std::net::TcpListener::bind(
            address.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0))),
        )
        .unwrap_or_else(|e| panic!("bind engine: {e}"));
        listener
            .set_nonblocking(true)
            .unwrap_or_else(|e| panic!("nonblocking: {e}"));
        let address = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("addr: {e}"));
        let engine = ScriptedEngine::new(script.clone());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("engine runtime: {e}"));
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener)
                .unwrap_or_else(|e| panic!("listener: {e}"));
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            let _ = tonic::transport::Server::builder()
                .add_service(EngineServer::new(engine).max_encoding_message_size(64 << 20))
                .serve_with_incoming(incoming)
                .await;
        });
        RunningEngine {
            address,
            script,
            runtime: Some(runtime),
        }
    }

    /// Stops the engine abruptly (listener and every connection), returning its address.
    pub fn kill(mut self) -> SocketAddr {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
        self.address
    }
}

impl Drop for RunningEngine {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

pub struct RunningGateway {
    pub address: SocketAddr,
    pub state: Arc<GatewayState>,
    pub pool: EnginePool,
    pub routing_stats: RoutingStatsHandle,
}

pub struct GatewayOptions {
    pub api_key: Option<String>,
    /// `NAME=MODEL` entries, as `--model-alias` takes them.
    pub model_aliases: Vec<String>,
    pub non_text_content: ninfer_gateway::chat::NonTextContent,
    /// The image URLs fetched (none by default, as the gateway's own default).
    pub image_urls: Option<Arc<ninfer_gateway::image_urls::ImageUrlPolicy>>,
    pub state_dir: Option<PathBuf>,
    pub max_in_flight_requests: u32,
}

impl Default for GatewayOptions {
    fn default() -> Self {
        GatewayOptions {
            api_key: None,
            model_aliases: Vec::new(),
            non_text_content: Default::default(),
            image_urls: None,
            state_dir: None,
            max_in_flight_requests: 512,
        }
    }
}

impl RunningGateway {
    pub async fn start(engines: &[SocketAddr], options: GatewayOptions) -> RunningGateway {
        let addresses: Vec<String> = engines.iter().map(|a| a.to_string()).collect();
        Self::start_with_engine_addresses(&addresses, options).await
    }

    /// A gateway for engines at `addresses` as `--engine` takes them (`unix:PATH` or `HOST:PORT`).
    pub async fn start_with_engine_addresses(
        addresses: &[String],
        options: GatewayOptions,
    ) -> RunningGateway {
        let routing_stats =
            RoutingStatsHandle::start(options.state_dir.clone(), Duration::from_millis(100))
                .unwrap_or_else(|e| panic!("stats: {e}"));
        let pool_options = EnginePoolOptions {
            poll_interval: Duration::from_millis(50),
            poll_timeout: Duration::from_millis(1000),
            max_in_flight_requests: options.max_in_flight_requests,
            routing_statistics_interval_ms: 50,
            ..Default::default()
        };
        let pool = EnginePool::start(addresses, pool_options, Some(routing_stats.clone()))
            .unwrap_or_else(|e| panic!("pool: {e}"));
        let settings = GatewaySettings {
            api_key: options.api_key,
            max_body_bytes: 1024 * 1024,
            model_aliases: ninfer_gateway::generation::ModelAliases::parse(&options.model_aliases)
                .unwrap_or_else(|e| panic!("aliases: {e}")),
            non_text_content: options.non_text_content,
            image_urls: options.image_urls,
        };
        let state = GatewayState::new(
            Arc::new(pool.clone()),
            Some(routing_stats.clone()),
            settings,
        );
        let router = ninfer_gateway::build_router(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("bind gateway: {e}"));
        let address = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("addr: {e}"));
        tokio::spawn(async move {
            let _ = ninfer_gateway::serve(listener, router, std::future::pending()).await;
        });
        RunningGateway {
            address,
            state,
            pool,
            routing_stats,
        }
    }

    /// Waits until `/health` has the wanted status (bounded: 20 s, for slow shared CI machines).
    pub async fn wait_for_health(&self, want_status: u16) {
        for _ in 0..800 {
            if get(self.address, "/health").await.status == want_status {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("/health never became {want_status}");
    }
}

#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).to_string()
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    /// SSE events as (event name, data).
    pub fn sse_events(&self) -> Vec<(Option<String>, String)> {
        let text = self.text();
        let mut events = Vec::new();
        for block in text.split("\n\n") {
            let mut name = None;
            let mut data = Vec::new();
            for line in block.lines() {
                if let Some(value) = line.strip_prefix("event:") {
                    name = Some(value.trim().to_string());
                } else if let Some(value) = line.strip_prefix("data:") {
                    data.push(value.strip_prefix(' ').unwrap_or(value).to_string());
                }
            }
            if !data.is_empty() {
                events.push((name, data.join("\n")));
            }
        }
        events
    }
}

/// One HTTP/1.1 request with `Connection: close`; the body is written concurrently with reading so
/// a server that answers early (413) is still heard.
pub async fn raw_request(address: SocketAddr, head: &str, body: &[u8]) -> HttpResponse {
    let stream = TcpStream::connect(address)
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"));
    let (mut reader, mut writer) = stream.into_split();
    let mut request = head.as_bytes().to_vec();
    request.extend_from_slice(body);
    let writing = tokio::spawn(async move {
        let _ = writer.write_all(&request).await;
        let _ = writer.flush().await;
        writer
    });
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), reader.read_to_end(&mut raw)).await;
    drop(writing);
    parse_response(&raw)
}

pub async fn request(
    address: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> HttpResponse {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    raw_request(address, &head, body).await
}

pub async fn post_json(address: SocketAddr, path: &str, body: &serde_json::Value) -> HttpResponse {
    request(
        address,
        "POST",
        path,
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
    )
    .await
}

pub async fn get(address: SocketAddr, path: &str) -> HttpResponse {
    request(address, "GET", path, &[], b"").await
}

fn parse_response(raw: &[u8]) -> HttpResponse {
    let Some(split) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return HttpResponse {
            status: 0,
            headers: Vec::new(),
            body: raw.to_vec(),
        };
    };
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|line| line.split(' ').nth(1))
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if headers
        .iter()
        .any(|(n, v)| n.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"))
    {
        body = dechunk(&body);
    }
    HttpResponse {
        status,
        headers,
        body,
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(line_end) = data.windows(2).position(|w| w == b"\r\n") {
        let size_text = String::from_utf8_lossy(&data[..line_end]).to_string();
        let Ok(size) = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
        else {
            break;
        };
        data = &data[line_end + 2..];
        if size == 0 || data.len() < size {
            out.extend_from_slice(&data[..size.min(data.len())]);
            break;
        }
        out.extend_from_slice(&data[..size]);
        data = &data[(size + 2).min(data.len())..];
    }
    out
}

/// Token count of a text with the fixture tokenizer (no special tokens).
pub fn count_tokens(text: &str) -> usize {
    let tokenizer = tokenizers::Tokenizer::from_file(fixture_dir().join("tokenizer.json"))
        .unwrap_or_else(|e| panic!("tokenizer: {e}"));
    tokenizer.encode(text, false).map(|e| e.len()).unwrap_or(0)
}

/// This process's resident memory in bytes (the gateway runs inside the test), 0 where
/// `/proc` does not say.
pub fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| {
            value
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kib| kib * 1024)
}
