//! The gateway's HTTP connections: accepting, limiting and closing them.
//!
//! Owns: [`ConnectionLimits`] and [`serve_connections`], the accept loop that replaces
//! `axum::serve` so that no client can hold the server: a cap on open connections (one over it
//! gets a 503 and is closed at once), a deadline for a request's headers (a connection that has
//! not sent a whole request in time is closed), a deadline for a request's body (slow bodies and
//! a `Content-Length` larger than what is sent end in an error, not a wait), idle keep-alive
//! connections (HTTP/1.1 and HTTP/2) closed after a quiet spell, and a graceful drain with a
//! deadline at shutdown (idle connections close at once, requests in flight get until the
//! deadline and the process waits for nothing else; an answer still streaming then ends with its API's error event, and every
//! connection is dropped).
//! Must not touch: routes, authentication or API shapes (see `server`).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::Router;
use bytes::Bytes;
use http_body::Frame;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

use crate::woken_body::WokenBody;

/// How long connections and requests may take; see the module doc.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Open connections at most; one more is answered 503 and closed.
    pub max_connections: usize,
    /// A connection must deliver a request's headers within this (HTTP/1.1: each request's;
    /// any connection: its first request), else it is closed.
    pub header_read_timeout: Duration,
    /// A request body must arrive whole within this, and never pause longer than
    /// [`Self::body_idle_timeout`]; else the request fails (400) and the connection closes.
    pub body_read_timeout: Duration,
    pub body_idle_timeout: Duration,
    /// A connection that moved no byte for this long is closed gracefully (requests on it
    /// finish first).
    pub idle_timeout: Duration,
    /// At shutdown, requests in flight get this long before every connection is dropped.
    pub drain_deadline: Duration,
}

/// After the drain deadline, how long streams get to write their final error event and end
/// before their connections are dropped.
const FINAL_EVENT_GRACE: Duration = Duration::from_millis(250);

/// At shutdown, how long connections get to flush and close once no answer is in flight.
const FLUSH_GRACE: Duration = Duration::from_millis(100);

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits {
            max_connections: 8192,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(60),
            body_idle_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            drain_deadline: Duration::from_millis(1200),
        }
    }
}

impl ConnectionLimits {
    /// The cap, lowered to what the process's open-file limit allows (a few descriptors are
    /// kept for the engines, logs and the state directory).
    pub fn within_open_file_limit(mut self) -> Self {
        if let Some(soft) = open_file_limit() {
            let usable = soft.saturating_sub(64).max(16);
            if usable < self.max_connections as u64 {
                tracing::warn!(
                    open_file_limit = soft,
                    "the connection cap is lowered to {usable} by the open-file limit (raise LimitNOFILE / ulimit -n)"
                );
                self.max_connections = usable as usize;
            }
        }
        self
    }
}

/// Raises the soft open-file limit to the hard one (systemd and shells start services with a
/// soft limit of 1024 while allowing far more); returns the limit now in force.
pub fn raise_open_file_limit() -> Option<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).ok()?;
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        return Some(hard);
    }
    Some(soft)
}

fn open_file_limit() -> Option<u64> {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .ok()
        .map(|(soft, _)| soft)
}

/// What a refused connection reads before it is closed.
fn too_many_connections_response() -> Vec<u8> {
    let body = r#"{"error":{"message":"the gateway has too many open connections; retry later","type":"service_unavailable","param":null,"code":null}}"#;
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Serves `router` on `listener` within `limits` until `shutdown` resolves, then drains.
pub async fn serve_connections(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    limits: ConnectionLimits,
) -> std::io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let (stop_sender, stop) = watch::channel(false);
    let (cut_sender, cut_streams) = watch::channel(false);
    let event_streams = Arc::new(AtomicUsize::new(0));
    let answers_in_flight = Arc::new(AtomicUsize::new(0));
    let open = Arc::new(AtomicUsize::new(0));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    // No server pings on HTTP/2: they would count as traffic and keep idle connections open;
    // a dead peer's connection goes with the idle timeout.
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        let (stream, _peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of descriptors (or a connection reset before accept): pause instead of
                // spinning; the header deadline frees descriptors soon.
                tracing::debug!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            refuse_connection(stream);
            continue;
        };
        let connection = ServedConnection {
            router: router.clone(),
            builder: builder.clone(),
            limits,
            stop: stop.clone(),
            cut_streams: cut_streams.clone(),
            event_streams: event_streams.clone(),
            answers_in_flight: answers_in_flight.clone(),
            open: open.clone(),
        };
        open.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            connection.run(stream).await;
            drop(permit);
        });
    }
    drop(listener);
    let _ = stop_sender.send(true);
    let deadline = Instant::now() + limits.drain_deadline;
    // Only answers are waited for: an idle connection whose peer ignores the close holds nothing
    // (the process exits with it open), so a stop without requests in flight is quick. Once the
    // last answer is out, connections get a moment to flush and close by themselves.
    let mut answers_done_at: Option<Instant> = None;
    while open.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
        if answers_in_flight.load(Ordering::SeqCst) > 0 {
            answers_done_at = None;
        } else if answers_done_at.get_or_insert_with(Instant::now).elapsed() > FLUSH_GRACE {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let left = answers_in_flight.load(Ordering::SeqCst);
    if left > 0 {
        tracing::warn!(
            answers = left,
            "requests still in flight at the drain deadline; ending their streams with an error event and closing their connections"
        );
        // Only streams are waited for: an idle peer that ignores the close holds nothing.
        if event_streams.load(Ordering::SeqCst) > 0 {
            let _ = cut_sender.send(true);
            let grace_end = Instant::now() + FINAL_EVENT_GRACE;
            while event_streams.load(Ordering::SeqCst) > 0 && Instant::now() < grace_end {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // The last event leaves the connection's buffers.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(())
}

/// Answers 503 and closes, without reading the request (best effort, bounded in time).
fn refuse_connection(mut stream: tokio::net::TcpStream) {
    static REFUSED: AtomicU64 = AtomicU64::new(0);
    let refused = REFUSED.fetch_add(1, Ordering::Relaxed);
    if refused.is_power_of_two() {
        tracing::warn!(
            refused_connections = refused + 1,
            "connection cap reached; refusing connections with 503"
        );
    }
    tokio::spawn(async move {
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            let _ = stream.write_all(&too_many_connections_response()).await;
            let _ = stream.shutdown().await;
        })
        .await;
    });
}

struct ServedConnection {
    router: Router,
    builder: Arc<auto::Builder<TokioExecutor>>,
    limits: ConnectionLimits,
    stop: watch::Receiver<bool>,
    /// Turns true at the drain deadline: streaming answers end with a final error event.
    cut_streams: watch::Receiver<bool>,
    /// Streaming answers not yet ended (on every connection).
    event_streams: Arc<AtomicUsize>,
    /// Requests whose answer has not been sent whole (on every connection).
    answers_in_flight: Arc<AtomicUsize>,
    open: Arc<AtomicUsize>,
}

impl ServedConnection {
    async fn run(mut self, stream: tokio::net::TcpStream) {
        let activity = Arc::new(Activity::new());
        let requests = Arc::new(AtomicU64::new(0));
        // Handlers still computing an answer (a non-streaming generation may send nothing for
        // minutes): the connection is not idle while one runs.
        let answering = Arc::new(AtomicUsize::new(0));
        let io = TokioIo::new(ActivityIo {
            inner: stream,
            activity: activity.clone(),
        });
        let (router, limits, counted) = (self.router.clone(), self.limits, requests.clone());
        let in_handler = answering.clone();
        let cut_streams = self.cut_streams.clone();
        let event_streams = self.event_streams.clone();
        let answers_in_flight = self.answers_in_flight.clone();
        let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            counted.fetch_add(1, Ordering::Relaxed);
            let in_flight = Answering::new(answers_in_flight.clone());
            let path = request.uri().path().to_string();
            let request: Request = request.map(|body| Body::new(DeadlineBody::new(body, &limits)));
            let answer = router.clone().oneshot(request);
            let guard = Answering::new(in_handler.clone());
            let cut_streams = cut_streams.clone();
            let event_streams = event_streams.clone();
            async move {
                let response = answer.await;
                drop(guard);
                // The request counts as in flight until its answer's body is gone.
                response.map(|response| {
                    if is_event_stream(&response) {
                        response.map(|body| {
                            Body::new(WokenBody::new(StreamCutAtDeadline::new(
                                body,
                                cut_streams,
                                event_streams,
                                &path,
                                in_flight,
                            )))
                        })
                    } else {
                        response.map(|body| {
                            Body::new(CountedBody {
                                inner: body,
                                _in_flight: in_flight,
                            })
                        })
                    }
                })
            }
        });
        let connection = self.builder.serve_connection_with_upgrades(io, service);
        tokio::pin!(connection);
        let started = Instant::now();
        let mut closing = false;
        // One timer, set to the next moment a limit could be reached (not a periodic check):
        // a connection streaming tokens wakes for it once per idle timeout, not per tick.
        let check = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(check);
        loop {
            tokio::select! {
                _ = connection.as_mut() => break,
                changed = self.stop.changed(), if !closing => {
                    // The server is stopping (or gone): finish what is in flight, take nothing new.
                    let _ = changed;
                    closing = true;
                    connection.as_mut().graceful_shutdown();
                }
                _ = check.as_mut() => {
                    let next_check = match idle_check(
                        &self.limits,
                        IdleState {
                            connected_for: started.elapsed(),
                            requests: requests.load(Ordering::Relaxed),
                            answering: answering.load(Ordering::Relaxed),
                            quiet_for: activity.quiet_for(),
                            closing,
                        },
                    ) {
                        IdleVerdict::Drop => break,
                        IdleVerdict::Close => {
                            closing = true;
                            connection.as_mut().graceful_shutdown();
                            self.limits.drain_deadline
                        }
                        IdleVerdict::CheckAgainIn(wait) => wait,
                    };
                    check
                        .as_mut()
                        .reset(tokio::time::Instant::now() + next_check.max(MIN_CHECK_WAIT));
                }
            }
        }
        self.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The shortest wait between two limit checks of one connection (the clock of [`Activity`]
/// counts whole milliseconds).
const MIN_CHECK_WAIT: Duration = Duration::from_millis(5);

/// While a handler computes an answer the connection may be silent for long; how often it is
/// looked at meanwhile.
const ANSWERING_CHECK_WAIT: Duration = Duration::from_secs(1);

/// What the limit check of one connection sees.
#[derive(Debug, Clone, Copy)]
struct IdleState {
    connected_for: Duration,
    requests: u64,
    /// Handlers still computing an answer.
    answering: usize,
    quiet_for: Duration,
    /// Graceful shutdown of the connection has begun.
    closing: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IdleVerdict {
    /// Drop the connection outright.
    Drop,
    /// Begin a graceful shutdown (requests on it finish first).
    Close,
    /// Nothing to do before this much time has passed.
    CheckAgainIn(Duration),
}

/// The connection's limits applied to `state`: what to do now, or when to look again.
fn idle_check(limits: &ConnectionLimits, state: IdleState) -> IdleVerdict {
    if state.requests == 0 {
        // Connected but never sent a whole request: dropped at the header deadline. The first
        // request may arrive right after this look, and nothing else wakes the check; so it
        // looks again within an idle timeout, lest a quiet keep-alive stay open until the
        // header deadline.
        return match limits.header_read_timeout.checked_sub(state.connected_for) {
            Some(left) if !left.is_zero() => {
                IdleVerdict::CheckAgainIn(left.min(limits.idle_timeout))
            }
            _ => IdleVerdict::Drop,
        };
    }
    if state.answering > 0 {
        return IdleVerdict::CheckAgainIn(ANSWERING_CHECK_WAIT);
    }
    // A peer that ignores the close (no FIN, no GOAWAY answer) is dropped a drain later.
    let quiet_limit = if state.closing {
        limits.idle_timeout + limits.drain_deadline
    } else {
        limits.idle_timeout
    };
    match quiet_limit.checked_sub(state.quiet_for) {
        Some(left) if !left.is_zero() => IdleVerdict::CheckAgainIn(left),
        _ if state.closing => IdleVerdict::Drop,
        _ => IdleVerdict::Close,
    }
}

fn is_event_stream(response: &axum::response::Response) -> bool {
    response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("text/event-stream"))
}

/// A streaming answer that, at the drain deadline, ends with its API's error event (so a
/// client learns the answer was cut, not finished) and drops the generation behind it; it
/// counts its request as in flight until it is dropped.
struct StreamCutAtDeadline {
    inner: Body,
    deadline: Pin<Box<dyn Future<Output = ()> + Send>>,
    /// Tells at the cost of an atomic load whether the deadline may have come (the cut was
    /// sent, or the server is gone): the deadline's future is polled again only then, or for
    /// a waker other than the one it holds, not once per event.
    cut_streams: watch::Receiver<bool>,
    deadline_waker: Option<Waker>,
    final_event: Option<Bytes>,
    finished: bool,
    /// Counts this stream until it is dropped.
    event_streams: Arc<AtomicUsize>,
    _in_flight: Answering,
}

impl StreamCutAtDeadline {
    fn new(
        inner: Body,
        mut cut_streams: watch::Receiver<bool>,
        event_streams: Arc<AtomicUsize>,
        path: &str,
        in_flight: Answering,
    ) -> Self {
        event_streams.fetch_add(1, Ordering::SeqCst);
        let final_event = crate::error::GatewayError::ShuttingDown(
            "the gateway is shutting down; this answer was cut at the drain deadline".to_string(),
        )
        .final_stream_event(path);
        StreamCutAtDeadline {
            inner,
            cut_streams: cut_streams.clone(),
            deadline_waker: None,
            _in_flight: in_flight,
            deadline: Box::pin(async move {
                // Also when the server is gone without saying so.
                let _ = cut_streams.wait_for(|cut| *cut).await;
            }),
            final_event: Some(Bytes::from(final_event)),
            finished: false,
            event_streams,
        }
    }
}

impl Drop for StreamCutAtDeadline {
    fn drop(&mut self) {
        self.event_streams.fetch_sub(1, Ordering::SeqCst);
    }
}

impl http_body::Body for StreamCutAtDeadline {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.finished {
            return Poll::Ready(None);
        }
        let may_have_come = !matches!(self.cut_streams.has_changed(), Ok(false));
        let registered = self
            .deadline_waker
            .as_ref()
            .is_some_and(|waker| waker.will_wake(context.waker()));
        if may_have_come || !registered {
            if self.deadline.as_mut().poll(context).is_ready() {
                self.finished = true;
                // Dropping the answer's body cancels its generation.
                self.inner = Body::empty();
                return Poll::Ready(self.final_event.take().map(|event| Ok(Frame::data(event))));
            }
            self.deadline_waker = Some(context.waker().clone());
        }
        let polled = Pin::new(&mut self.inner).poll_frame(context);
        if let Poll::Ready(None) = polled {
            self.finished = true;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.finished
    }
}

/// An answer's body that counts its request as in flight until it is dropped (sent whole, or
/// its connection gone).
struct CountedBody {
    inner: Body,
    _in_flight: Answering,
}

impl http_body::Body for CountedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(context)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Counts a handler as running until dropped (also when its future is dropped unfinished).
struct Answering(Arc<AtomicUsize>);

impl Answering {
    fn new(counter: Arc<AtomicUsize>) -> Self {
        counter.fetch_add(1, Ordering::Relaxed);
        Answering(counter)
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// When a connection last moved a byte.
struct Activity {
    epoch: Instant,
    last_millis: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            epoch: Instant::now(),
            last_millis: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let now = self.epoch.elapsed().as_millis() as u64;
        self.last_millis.store(now, Ordering::Relaxed);
    }

    fn quiet_for(&self) -> Duration {
        let now = self.epoch.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last_millis.load(Ordering::Relaxed)))
    }
}

/// A socket that records when bytes move in either direction.
struct ActivityIo {
    inner: tokio::net::TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for ActivityIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buffer.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(context, buffer);
        if buffer.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl AsyncWrite for ActivityIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(context, data);
        if matches!(polled, Poll::Ready(Ok(written)) if written > 0) {
            self.activity.touch();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffers: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(context, buffers);
        if matches!(polled, Poll::Ready(Ok(written)) if written > 0) {
            self.activity.touch();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(context)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(context)
    }
}

/// Why a request body was cut off.
#[derive(Debug, thiserror::Error)]
pub enum BodyReadError {
    #[error("the request body did not arrive within {0:?}")]
    TooSlow(Duration),
    #[error("the request body stalled for {0:?} (is Content-Length larger than the body?)")]
    Stalled(Duration),
    #[error("reading the request body: {0}")]
    Transport(#[from] hyper::Error),
}

/// A request body that fails when it takes too long in all, or pauses too long.
struct DeadlineBody {
    inner: Incoming,
    total: Duration,
    idle: Duration,
    deadline: Pin<Box<tokio::time::Sleep>>,
    idle_deadline: Pin<Box<tokio::time::Sleep>>,
    total_deadline: tokio::time::Instant,
}

impl DeadlineBody {
    fn new(inner: Incoming, limits: &ConnectionLimits) -> Self {
        let now = tokio::time::Instant::now();
        DeadlineBody {
            inner,
            total: limits.body_read_timeout,
            idle: limits.body_idle_timeout,
            deadline: Box::pin(tokio::time::sleep_until(now + limits.body_read_timeout)),
            idle_deadline: Box::pin(tokio::time::sleep_until(now + limits.body_idle_timeout)),
            total_deadline: now + limits.body_read_timeout,
        }
    }
}

impl http_body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = BodyReadError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyReadError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(context) {
            Poll::Ready(Some(Ok(frame))) => {
                let next_idle = (tokio::time::Instant::now() + this.idle).min(this.total_deadline);
                this.idle_deadline.as_mut().reset(next_idle);
                return Poll::Ready(Some(Ok(frame)));
            }
            Poll::Ready(Some(Err(error))) => return Poll::Ready(Some(Err(error.into()))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => {}
        }
        if this.deadline.as_mut().poll(context).is_ready() {
            return Poll::Ready(Some(Err(BodyReadError::TooSlow(this.total))));
        }
        if this.idle_deadline.as_mut().poll(context).is_ready() {
            return Poll::Ready(Some(Err(BodyReadError::Stalled(this.idle))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ConnectionLimits {
        ConnectionLimits {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            drain_deadline: Duration::from_secs(2),
            ..Default::default()
        }
    }

    fn state(requests: u64, answering: usize, quiet_secs: u64, closing: bool) -> IdleState {
        IdleState {
            connected_for: Duration::from_secs(4),
            requests,
            answering,
            quiet_for: Duration::from_secs(quiet_secs),
            closing,
        }
    }

    #[test]
    fn a_connection_without_a_request_waits_for_the_header_deadline_then_drops() {
        let limits = limits();
        assert_eq!(
            idle_check(&limits, state(0, 0, 4, false)),
            IdleVerdict::CheckAgainIn(Duration::from_secs(6))
        );
        let late = IdleState {
            connected_for: Duration::from_secs(10),
            ..state(0, 0, 10, false)
        };
        assert_eq!(idle_check(&limits, late), IdleVerdict::Drop);
    }

    #[test]
    fn a_connection_looked_at_before_its_first_request_is_looked_at_again_within_the_idle_timeout()
    {
        let limits = ConnectionLimits {
            idle_timeout: Duration::from_millis(500),
            ..limits()
        };
        let before_the_first_request = IdleState {
            connected_for: Duration::ZERO,
            ..state(0, 0, 0, false)
        };
        assert_eq!(
            idle_check(&limits, before_the_first_request),
            IdleVerdict::CheckAgainIn(Duration::from_millis(500))
        );
    }

    #[test]
    fn a_quiet_connection_closes_after_the_idle_timeout_and_drops_a_drain_later() {
        let limits = limits();
        assert_eq!(
            idle_check(&limits, state(1, 0, 15, false)),
            IdleVerdict::CheckAgainIn(Duration::from_secs(45))
        );
        assert_eq!(
            idle_check(&limits, state(1, 0, 60, false)),
            IdleVerdict::Close
        );
        assert_eq!(
            idle_check(&limits, state(1, 0, 61, true)),
            IdleVerdict::CheckAgainIn(Duration::from_secs(1))
        );
        assert_eq!(
            idle_check(&limits, state(1, 0, 62, true)),
            IdleVerdict::Drop
        );
    }

    #[test]
    fn a_connection_whose_handler_computes_is_never_idle() {
        assert_eq!(
            idle_check(&limits(), state(1, 1, 600, false)),
            IdleVerdict::CheckAgainIn(ANSWERING_CHECK_WAIT)
        );
    }
}
