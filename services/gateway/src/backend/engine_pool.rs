//! The gRPC engine pool: the production [`GenerationBackend`].
//!
//! Owns: one lazily-reconnecting tonic channel per `--engine` address, a monitor task per engine
//! (polls `GetStatus`/`GetModelInfo`, fetches `GetModelFiles` when the engine restarts, streams
//! routing statistics to the store), and the handle that asks the pool's actor (`pool_actor`:
//! readiness, in-flight counts, behind a channel) for the least-loaded ready engine per request.
//! An engine that goes away is marked down (requests get 503) and comes back by itself when it
//! answers again; the gateway never needs a restart. An answer whose engine goes away mid-way
//! waits for a ready engine and continues there (`resume`), so its client sees no seam.
//! Must not touch: HTTP, tokenization of requests, or stop strings.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::{Stream, StreamExt};
use ninfer_protocol::control_secret::SendSecret;
use ninfer_protocol::v1::engine_client::EngineClient;
use ninfer_protocol::v1::{
    CancelRequest, EngineStatus, EngineStatusRequest, FinishReason, GenerateRequest,
    GeneratedToken, ModelFilesRequest, ModelInfoRequest, RoutingStatisticsRequest,
};
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tonic::transport::{Channel, Endpoint};

use super::poll_schedule::{PollSchedule, SteadyState};
use super::pool_actor::{
    build_snapshot, EngineLease, EngineObservation, EngineRpc, EngineSlot, OverloadLog, PoolActor,
    PoolCommand,
};
use super::resume::{is_connection_failure, resuming_token_stream, EngineSource, ResumeCounters};
use super::{BackendSnapshot, GenerationBackend, ModelResources, ResumeCounts, TokenStream};
use crate::error::{error_from_engine_status, GatewayError};
use crate::routing_stats::RoutingStatsHandle;
use crate::tokenizer::TypedControlTokens;

/// Pause before asking a busy engine again.
const ENGINE_BUSY_RETRY: Duration = Duration::from_millis(20);

/// Largest message accepted from an engine: `tokenizer.json` of real models is several MiB.
const MAX_ENGINE_MESSAGE_BYTES: usize = 256 * 1024 * 1024;

/// Tunables of the pool.
#[derive(Clone, Debug)]
pub struct EnginePoolOptions {
    /// How often each engine is polled for readiness and load while anything about it changes;
    /// a steady ready engine is polled up to `STEADY_POLL_BACKOFF` times less often.
    pub poll_interval: Duration,
    /// Timeout of one poll RPC; an engine slower than this is considered down.
    pub poll_timeout: Duration,
    /// Requests in flight across all engines above which new ones wait (or get "overloaded").
    pub max_in_flight_requests: u32,
    /// Requests that may wait for a free sequence when every engine runs its
    /// `--max-sequences`; one more is refused at once ("overloaded": 429 before any body).
    pub max_queued_requests: u32,
    /// Longest wait in that queue before "overloaded".
    pub queue_timeout: Duration,
    /// Interval asked of `StreamRoutingStatistics`.
    pub routing_statistics_interval_ms: u32,
    /// How control tokens typed in chat messages are encoded (as text unless the operator opts in).
    pub typed_control_tokens: TypedControlTokens,
    /// The engines' control secret, sent with every call (engines on TCP ask for it).
    pub control_secret: Option<String>,
    /// How long an answer whose engine went away waits for a ready engine to continue it on
    /// (zero: it ends with an error at once).
    pub resume_timeout: Duration,
}

impl Default for EnginePoolOptions {
    fn default() -> Self {
        EnginePoolOptions {
            poll_interval: Duration::from_millis(500),
            poll_timeout: Duration::from_secs(3),
            max_in_flight_requests: 512,
            max_queued_requests: 256,
            queue_timeout: Duration::from_secs(5),
            routing_statistics_interval_ms: 5000,
            typed_control_tokens: TypedControlTokens::default(),
            control_secret: None,
            resume_timeout: Duration::from_secs(30),
        }
    }
}

/// Handle to the pool actor; cheap to clone.
#[derive(Clone)]
pub struct EnginePool {
    commands: mpsc::UnboundedSender<PoolCommand>,
    snapshot: watch::Receiver<Arc<BackendSnapshot>>,
    queue_timeout: Duration,
    overload_log: Arc<OverloadLog>,
    resume_timeout: Duration,
    resume_counters: Arc<ResumeCounters>,
    /// Per engine: wakes its monitor for a poll now (a request found the engine gone).
    poll_now: Arc<[Arc<Notify>]>,
    /// Sent with every call on an engine's token socket, as with every gRPC call.
    control_secret: Option<Arc<str>>,
}

/// A lazily connecting channel to `unix:PATH` or `HOST:PORT` (optionally with a scheme): the
/// same address forms the engine's `--listen` takes.
fn lazy_channel(address: &str) -> Result<Channel, GatewayError> {
    let tuned = |endpoint: Endpoint| {
        endpoint
            .connect_timeout(Duration::from_secs(2))
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_while_idle(true)
    };
    if let Some(path) = address.strip_prefix("unix:") {
        let path = path.to_string();
        // The URI is ignored for unix sockets; the connector dials the path.
        return Ok(
            tuned(Endpoint::from_static("http://localhost")).connect_with_connector_lazy(
                tower::service_fn(move |_: tonic::transport::Uri| {
                    let path = path.clone();
                    async move {
                        let stream = tokio::net::UnixStream::connect(path).await?;
                        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                    }
                }),
            ),
        );
    }
    let uri = if address.contains("://") {
        address.to_string()
    } else {
        format!("http://{address}")
    };
    let endpoint = Endpoint::from_shared(uri).map_err(|error| {
        GatewayError::invalid(format!("bad engine address `{address}`: {error}"))
    })?;
    Ok(tuned(endpoint).tcp_nodelay(true).connect_lazy())
}

impl EnginePool {
    /// Starts the actor and one monitor per address. Must be called inside a tokio runtime.
    pub fn start(
        addresses: &[String],
        options: EnginePoolOptions,
        routing_stats: Option<RoutingStatsHandle>,
    ) -> Result<EnginePool, GatewayError> {
        let (commands, command_receiver) = mpsc::unbounded_channel();
        let mut slots = Vec::new();
        for address in addresses {
            // Lazy: connects on first use and reconnects after the engine comes back.
            let client = EngineClient::with_interceptor(
                lazy_channel(address)?,
                SendSecret::new(options.control_secret.as_deref()),
            )
            .max_decoding_message_size(MAX_ENGINE_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_ENGINE_MESSAGE_BYTES);
            slots.push(EngineSlot {
                address: address.clone(),
                client,
                ready: false,
                info: None,
                status: None,
                resources: None,
                in_flight_requests: 0,
                last_error: Some("not contacted yet".to_string()),
            });
        }
        let initial = Arc::new(build_snapshot(&slots));
        let (snapshot_sender, snapshot) = watch::channel(initial);
        let poll_now: Arc<[Arc<Notify>]> = slots.iter().map(|_| Arc::new(Notify::new())).collect();
        for (engine_index, slot) in slots.iter().enumerate() {
            tokio::spawn(monitor_engine(
                EngineMonitor {
                    engine_index,
                    address: slot.address.clone(),
                    client: slot.client.clone(),
                    poll_now: poll_now[engine_index].clone(),
                },
                options.clone(),
                commands.clone(),
                routing_stats.clone(),
            ));
        }
        let overload_log = Arc::new(OverloadLog::default());
        let actor = PoolActor::new(
            slots,
            snapshot_sender,
            options.max_in_flight_requests,
            options.max_queued_requests as usize,
            overload_log.clone(),
            commands.clone(),
        );
        tokio::spawn(actor.run(command_receiver));
        Ok(EnginePool {
            commands,
            snapshot,
            queue_timeout: options.queue_timeout,
            overload_log,
            resume_timeout: options.resume_timeout,
            resume_counters: Arc::new(ResumeCounters::default()),
            poll_now,
            control_secret: options.control_secret.as_deref().map(Arc::from),
        })
    }

    async fn acquire(&self, model_name: &str) -> Result<EngineLease, GatewayError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(PoolCommand::Acquire {
                model_name: model_name.to_string(),
                reply,
            })
            .map_err(|_| GatewayError::Internal("the engine pool has stopped".to_string()))?;
        match tokio::time::timeout(self.queue_timeout, answer).await {
            Ok(answer) => answer
                .map_err(|_| GatewayError::Internal("the engine pool has stopped".to_string()))?,
            Err(_) => {
                let reason = format!(
                    "every engine sequence stayed busy for {:.1}s; retry later",
                    self.queue_timeout.as_secs_f64()
                );
                self.overload_log.refused(&reason);
                Err(GatewayError::Overloaded(reason))
            }
        }
    }

    fn report_lost(&self, engine_index: usize, error: String) {
        let _ = self.commands.send(PoolCommand::Lost {
            engine_index,
            error,
        });
        // Its monitor may be in a long steady wait: it should see the engine come back soon.
        if let Some(poll_now) = self.poll_now.get(engine_index) {
            poll_now.notify_one();
        }
    }

    /// Waits until the snapshot changes (for tests and readiness waits).
    pub fn subscribe(&self) -> watch::Receiver<Arc<BackendSnapshot>> {
        self.snapshot.clone()
    }
}

impl EnginePool {
    /// Starts `request` on the least-loaded ready engine. An engine found dead only now
    /// (connection refused) is marked down and the request goes to another one, if any;
    /// bounded so a dead pool answers quickly.
    async fn start_engine_stream(
        &self,
        request: GenerateRequest,
    ) -> Result<EngineTokenStream, GatewayError> {
        let pool = self;
        let mut attempts_left = 3;
        let busy_deadline = tokio::time::Instant::now() + pool.queue_timeout;
        loop {
            let lease = pool.acquire(&request.model_name).await?;
            let started = match lease.token_socket.as_deref() {
                Some(path) => {
                    let secret = pool.control_secret.as_deref();
                    ninfer_protocol::token_socket::generate(path, secret, &request)
                        .await
                        .map(EngineTokens::Socket)
                }
                None => {
                    let mut client = lease.client.clone();
                    client
                        .generate(request.clone())
                        .await
                        .map(|response| EngineTokens::Grpc(response.into_inner()))
                }
            };
            match started {
                Ok(tokens) => {
                    return Ok(EngineTokenStream {
                        inner: Some(tokens),
                        finished: false,
                        ended: false,
                        request_id: request.request_id.clone(),
                        cancel_client: lease.client.clone(),
                        _lease: lease,
                    });
                }
                // A dead engine shows up as Unavailable (cannot connect) or, when its
                // connection breaks under the call, as Unknown/Cancelled transport errors.
                Err(status) if is_connection_failure(&status) => {
                    pool.report_lost(lease.engine_index, status.message().to_string());
                    attempts_left -= 1;
                    if attempts_left == 0 {
                        return Err(error_from_engine_status(&status));
                    }
                }
                // The engine still holds a sequence the gateway saw end (it frees it at its
                // next step): wait a moment for it, within the queue's deadline.
                Err(status)
                    if status.code() == tonic::Code::ResourceExhausted
                        && tokio::time::Instant::now() + ENGINE_BUSY_RETRY < busy_deadline =>
                {
                    drop(lease);
                    tokio::time::sleep(ENGINE_BUSY_RETRY).await;
                }
                Err(status) => {
                    if status.code() == tonic::Code::ResourceExhausted {
                        pool.overload_log.refused(status.message());
                    }
                    return Err(error_from_engine_status(&status));
                }
            }
        }
    }
}

impl EngineSource for EnginePool {
    type Stream = EngineTokenStream;

    fn start(
        &self,
        request: GenerateRequest,
    ) -> BoxFuture<'static, Result<EngineTokenStream, GatewayError>> {
        let pool = self.clone();
        Box::pin(async move { pool.start_engine_stream(request).await })
    }

    fn model_ready(&self, model_name: &str) -> bool {
        let snapshot = self.snapshot.borrow();
        if model_name.is_empty() {
            return snapshot.any_engine_ready();
        }
        snapshot
            .models
            .get(model_name)
            .is_some_and(|model| model.ready_engines > 0)
    }

    fn report_lost(&self, stream: &EngineTokenStream, error: String) {
        EnginePool::report_lost(self, stream._lease.engine_index, error);
    }

    fn resume_timeout(&self) -> Duration {
        self.resume_timeout
    }

    fn counters(&self) -> &ResumeCounters {
        &self.resume_counters
    }
}

impl GenerationBackend for EnginePool {
    fn generate(
        &self,
        request: GenerateRequest,
    ) -> BoxFuture<'static, Result<TokenStream, GatewayError>> {
        let pool = self.clone();
        Box::pin(async move {
            let first = pool.start_engine_stream(request.clone()).await?;
            Ok(resuming_token_stream(pool, request, first))
        })
    }

    fn snapshot(&self) -> Arc<BackendSnapshot> {
        self.snapshot.borrow().clone()
    }

    fn snapshot_changes(&self) -> Option<watch::Receiver<Arc<BackendSnapshot>>> {
        Some(self.snapshot.clone())
    }

    fn resume_counts(&self) -> ResumeCounts {
        self.resume_counters.counts()
    }
}

/// The tokens of one engine call, over gRPC or the engine's token socket.
enum EngineTokens {
    Grpc(tonic::Streaming<GeneratedToken>),
    Socket(ninfer_protocol::token_socket::TokenSocketStream),
}

impl Stream for EngineTokens {
    type Item = Result<GeneratedToken, tonic::Status>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Self::Item>> {
        match self.get_mut() {
            EngineTokens::Grpc(tokens) => tokens.poll_next_unpin(context),
            EngineTokens::Socket(tokens) => tokens.poll_next_unpin(context),
        }
    }
}

/// Token stream of one engine call; cancels the sequence on the engine if dropped early.
pub struct EngineTokenStream {
    /// `None` once handed to the task that reads its end (see `Drop`).
    inner: Option<EngineTokens>,
    /// The last token (or an error) arrived.
    finished: bool,
    /// The HTTP/2 stream itself ended (trailers read).
    ended: bool,
    request_id: String,
    cancel_client: EngineRpc,
    _lease: EngineLease,
}

impl Stream for EngineTokenStream {
    type Item = Result<GeneratedToken, tonic::Status>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Self::Item>> {
        if self.finished {
            return Poll::Ready(None);
        }
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match inner.poll_next_unpin(context) {
            Poll::Ready(Some(Ok(token))) => {
                if token.finish_reason != FinishReason::Unspecified as i32 {
                    self.finished = true;
                }
                Poll::Ready(Some(Ok(token)))
            }
            Poll::Ready(Some(Err(status))) => {
                self.finished = true;
                self.ended = true;
                Poll::Ready(Some(Err(status)))
            }
            Poll::Ready(None) => {
                self.finished = true;
                self.ended = true;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for EngineTokenStream {
    fn drop(&mut self) {
        if self.finished {
            // The last token came but the stream's trailers may not have: read them rather
            // than reset the stream. Frames arriving on streams the client reset count against
            // HTTP/2's limit of such resets, and past it the whole engine connection is torn
            // down, failing every generation on it.
            // A token socket's connection has no such limit: it just closes.
            if let (false, Some(EngineTokens::Grpc(mut inner))) = (self.ended, self.inner.take()) {
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    runtime.spawn(async move {
                        let _ = tokio::time::timeout(Duration::from_secs(5), async move {
                            while inner.next().await.is_some() {}
                        })
                        .await;
                    });
                }
            }
            return;
        }
        // Dropping the HTTP/2 stream already tells the engine; the explicit Cancel makes sure the
        // KV cache is freed at once even if the engine only notices resets lazily.
        let mut client = self.cancel_client.clone();
        let request_id = std::mem::take(&mut self.request_id);
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = tokio::time::timeout(
                    Duration::from_secs(2),
                    client.cancel(CancelRequest { request_id }),
                )
                .await;
            });
        }
    }
}

/// The engine one monitor polls.
struct EngineMonitor {
    engine_index: usize,
    address: String,
    client: EngineRpc,
    /// Notified when a request found the engine gone: poll at once.
    poll_now: Arc<Notify>,
}

/// Polls one engine forever: readiness, load, model files when they change, routing statistics.
/// Often while the engine changes, seldom while it stays ready and the same ([`PollSchedule`]).
async fn monitor_engine(
    monitor: EngineMonitor,
    options: EnginePoolOptions,
    commands: mpsc::UnboundedSender<PoolCommand>,
    routing_stats: Option<RoutingStatsHandle>,
) {
    let EngineMonitor {
        engine_index,
        address,
        mut client,
        poll_now,
    } = monitor;
    let mut cached_resources: Option<(String, String, Arc<ModelResources>)> = None;
    let mut statistics_task: Option<tokio::task::JoinHandle<()>> = None;
    let mut schedule = PollSchedule::new(options.poll_interval);
    loop {
        let wait = match poll_engine(&mut client, &mut cached_resources, &options).await {
            Ok(observation) => {
                let steady_state = SteadyState::of(&observation.info, &observation.status);
                let model_name = observation.info.model_name.clone();
                if commands
                    .send(PoolCommand::Observed {
                        engine_index,
                        observation: Box::new(observation),
                    })
                    .is_err()
                {
                    return; // the pool is gone: shutting down
                }
                if let Some(store) = &routing_stats {
                    if statistics_task
                        .as_ref()
                        .is_none_or(|task| task.is_finished())
                    {
                        statistics_task = Some(tokio::spawn(forward_routing_statistics(
                            address.clone(),
                            model_name,
                            client.clone(),
                            options.routing_statistics_interval_ms,
                            store.clone(),
                        )));
                    }
                }
                schedule.after(Some(steady_state))
            }
            Err(error) => {
                if commands
                    .send(PoolCommand::Lost {
                        engine_index,
                        error,
                    })
                    .is_err()
                {
                    return;
                }
                schedule.after(None)
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = poll_now.notified() => schedule.restart(),
        }
    }
}

/// Longest wait for `GetModelFiles` plus parsing: a real tokenizer.json is several MiB and the
/// machine may be busy loading weights. Kept apart from the short poll timeout on purpose, so a
/// slow first download is not mistaken for a dead engine over and over.
const MODEL_FILES_TIMEOUT: Duration = Duration::from_secs(300);

/// One poll: model info, status (optional RPC), and the model files when the engine is new to us.
async fn poll_engine(
    client: &mut EngineRpc,
    cached_resources: &mut Option<(String, String, Arc<ModelResources>)>,
    options: &EnginePoolOptions,
) -> Result<EngineObservation, String> {
    let poll_timeout = options.poll_timeout;
    let typed_control_tokens = options.typed_control_tokens;
    let too_slow = |rpc: &str| format!("{rpc} did not answer within {poll_timeout:?}");
    let info = tokio::time::timeout(poll_timeout, client.get_model_info(ModelInfoRequest {}))
        .await
        .map_err(|_| too_slow("GetModelInfo"))?
        .map_err(|status| format!("GetModelInfo failed: {}", status.message()))?
        .into_inner();
    let status_answer =
        tokio::time::timeout(poll_timeout, client.get_status(EngineStatusRequest {}))
            .await
            .map_err(|_| too_slow("GetStatus"))?;
    let status = match status_answer {
        Ok(response) => response.into_inner(),
        // An engine without GetStatus that answers GetModelInfo is taken as ready.
        Err(status) if status.code() == tonic::Code::Unimplemented => EngineStatus {
            ready: true,
            engine_instance_id: info.engine_instance_id.clone(),
            ..Default::default()
        },
        Err(status) => return Err(format!("GetStatus failed: {}", status.message())),
    };
    let files_key = format!("{}|{}", info.model_files_digest, info.model_name);
    let instance = info.engine_instance_id.clone();
    let reuse = cached_resources
        .as_ref()
        .filter(|(key, cached_instance, _)| {
            *key == files_key
                && (!info.model_files_digest.is_empty() || *cached_instance == instance)
        });
    let resources = match reuse {
        Some((_, _, resources)) => resources.clone(),
        None => {
            let files = tokio::time::timeout(
                MODEL_FILES_TIMEOUT,
                client.get_model_files(ModelFilesRequest {}),
            )
            .await
            .map_err(|_| format!("GetModelFiles did not answer within {MODEL_FILES_TIMEOUT:?}"))?
            .map_err(|status| format!("GetModelFiles failed: {}", status.message()))?
            .into_inner();
            // Parsing a real tokenizer.json takes a while: keep it off the async workers.
            let resources = tokio::task::spawn_blocking(move || {
                ModelResources::from_model_files(&files, typed_control_tokens)
            })
            .await
            .map_err(|error| format!("loading model files panicked: {error}"))?
            .map_err(|error| error.to_string())?;
            let resources = Arc::new(resources);
            *cached_resources = Some((files_key, instance, resources.clone()));
            resources
        }
    };
    Ok(EngineObservation {
        info,
        status,
        resources,
    })
}

/// Streams routing statistics of one engine into the store until the stream ends.
async fn forward_routing_statistics(
    address: String,
    model_name: String,
    mut client: EngineRpc,
    interval_ms: u32,
    store: RoutingStatsHandle,
) {
    let response = match client
        .stream_routing_statistics(RoutingStatisticsRequest { interval_ms })
        .await
    {
        Ok(response) => response,
        Err(status) => {
            tracing::debug!(engine = %address, error = %status.message(), "routing statistics unavailable");
            // Do not hammer an engine that does not implement it: the monitor retries later.
            tokio::time::sleep(Duration::from_secs(10)).await;
            return;
        }
    };
    let mut stream = response.into_inner();
    while let Some(Ok(mut statistics)) = stream.next().await {
        if statistics.model_name.is_empty() {
            statistics.model_name = model_name.clone();
        }
        store.observe(address.clone(), statistics);
    }
}
