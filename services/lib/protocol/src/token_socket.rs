//! An engine's token socket: the tokens of one generation over a unix socket of their own, for
//! a gateway on the same machine.
//!
//! Why: over gRPC every token crosses HTTP/2 (frame decoding, flow control, the stream store,
//! a second task that wakes the one reading the answer) before the gateway can render it; here
//! a token is one read of a few bytes in the task that renders it. The gRPC `Generate` call
//! stays for engines reached over TCP and for engines that serve no token socket.
//!
//! One connection carries one generation. The gateway sends one request frame; the engine
//! answers with an accepted frame (the call is admitted, as gRPC's response headers say) or a
//! status frame (refused), then one token frame per token and an end frame (the stream ended
//! as gRPC's trailers say OK) or a status frame (it failed). Closing the connection cancels the
//! generation, as a reset gRPC stream does. A frame is a kind byte, the payload's length
//! (u32, little-endian) and the payload.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};
use tokio::net::UnixStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Code, Status};

use crate::v1::engine_server::Engine;
use crate::v1::{GenerateRequest, GeneratedToken};

const REQUEST: u8 = 1;
const ACCEPTED: u8 = 2;
const TOKEN: u8 = 3;
const STATUS: u8 = 4;
const END: u8 = 5;
/// Kind byte and length.
const HEADER_BYTES: usize = 5;
/// Largest frame either side takes: a request carries its images inline.
pub const MAX_FRAME_BYTES: usize = 64 << 20;
/// What a read asks of the socket at least: several tokens' frames.
const READ_BYTES: usize = 8 << 10;

/// The token socket an engine serving its gRPC API on `unix:PATH` serves beside it; `None` for
/// an engine on TCP (its gateway may be on another machine).
pub fn path_beside(listen: &str) -> Option<String> {
    listen
        .strip_prefix("unix:")
        .map(|path| format!("{path}.tokens"))
}

/// A frame's bytes.
fn frame(kind: u8, payload_bytes: usize, write_payload: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(HEADER_BYTES + payload_bytes);
    bytes.push(kind);
    bytes.extend_from_slice(&[0; 4]);
    write_payload(&mut bytes);
    let length = u32::try_from(bytes.len() - HEADER_BYTES).unwrap_or(u32::MAX);
    bytes[1..HEADER_BYTES].copy_from_slice(&length.to_le_bytes());
    bytes
}

fn status_frame(status: &Status) -> Vec<u8> {
    frame(STATUS, 4 + status.message().len(), |bytes| {
        bytes.extend_from_slice(&i32::from(status.code()).to_le_bytes());
        bytes.extend_from_slice(status.message().as_bytes());
    })
}

fn append_token_frame(token: &GeneratedToken, bytes: &mut Vec<u8>) {
    bytes.push(TOKEN);
    bytes.extend_from_slice(
        &u32::try_from(token.encoded_len())
            .unwrap_or(u32::MAX)
            .to_le_bytes(),
    );
    // Encoding into a Vec only fails for lack of room, and a Vec grows.
    let _ = token.encode(bytes);
}

/// What one frame from the engine says.
enum EngineFrame {
    Accepted,
    Token(GeneratedToken),
    Failed(Status),
    End,
}

/// A whole frame in a [`FrameReader`]'s buffer: its kind and where its payload lies.
type FrameAt = (u8, std::ops::Range<usize>);

/// Frames read off a connection, parsed in place from one reused buffer.
struct FrameReader {
    socket: UnixStream,
    buffer: Vec<u8>,
    /// `buffer[start..end]` is read and not yet parsed.
    start: usize,
    end: usize,
}

impl FrameReader {
    fn new(socket: UnixStream) -> Self {
        FrameReader {
            socket,
            buffer: vec![0; READ_BYTES],
            start: 0,
            end: 0,
        }
    }

    /// The next whole frame's kind and where its payload lies in the buffer, reading as needed;
    /// `None`: the peer closed the connection between frames.
    fn poll_frame(&mut self, context: &mut Context<'_>) -> Poll<std::io::Result<Option<FrameAt>>> {
        loop {
            let unread = &self.buffer[self.start..self.end];
            if unread.len() >= HEADER_BYTES {
                let mut length = [0; 4];
                length.copy_from_slice(&unread[1..HEADER_BYTES]);
                let length = u32::from_le_bytes(length) as usize;
                if length > MAX_FRAME_BYTES {
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("a token socket frame of {length} bytes (most {MAX_FRAME_BYTES})"),
                    )));
                }
                if unread.len() >= HEADER_BYTES + length {
                    let kind = unread[0];
                    let payload = self.start + HEADER_BYTES..self.start + HEADER_BYTES + length;
                    self.start = payload.end;
                    return Poll::Ready(Ok(Some((kind, payload))));
                }
                self.make_room(HEADER_BYTES + length);
            } else {
                self.make_room(HEADER_BYTES);
            }
            let mut read_into = ReadBuf::new(&mut self.buffer[self.end..]);
            ready!(Pin::new(&mut self.socket).poll_read(context, &mut read_into))?;
            let read = read_into.filled().len();
            if read == 0 {
                return Poll::Ready(if self.start == self.end {
                    Ok(None)
                } else {
                    Err(std::io::ErrorKind::UnexpectedEof.into())
                });
            }
            self.end += read;
        }
    }

    /// Room after the unread bytes for a frame of `frame_bytes` and a read's worth more.
    fn make_room(&mut self, frame_bytes: usize) {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        }
        let wanted = frame_bytes.max(READ_BYTES);
        if self.buffer.len() - self.start >= wanted
            && self.buffer.len() - self.end >= READ_BYTES / 4
        {
            return;
        }
        self.buffer.copy_within(self.start..self.end, 0);
        (self.start, self.end) = (0, self.end - self.start);
        if self.buffer.len() < wanted {
            self.buffer.resize(wanted, 0);
        }
    }

    fn poll_engine_frame(&mut self, context: &mut Context<'_>) -> Poll<EngineFrame> {
        let (kind, payload) = match ready!(self.poll_frame(context)) {
            Ok(Some((kind, payload))) => (kind, &self.buffer[payload]),
            Ok(None) => {
                return Poll::Ready(EngineFrame::Failed(Status::unavailable(
                    "the engine's token stream closed before its end: connection closed",
                )))
            }
            Err(error) => {
                return Poll::Ready(EngineFrame::Failed(Status::unavailable(format!(
                    "the engine's token stream broke: connection error: {error}"
                ))))
            }
        };
        Poll::Ready(match (kind, payload) {
            (ACCEPTED, _) => EngineFrame::Accepted,
            (END, _) => EngineFrame::End,
            (TOKEN, payload) => match GeneratedToken::decode(payload) {
                Ok(token) => EngineFrame::Token(token),
                Err(error) => EngineFrame::Failed(Status::internal(format!(
                    "the engine sent a token the gateway cannot read: {error}"
                ))),
            },
            (STATUS, payload) if payload.len() >= 4 => {
                let mut code = [0; 4];
                code.copy_from_slice(&payload[..4]);
                let message = String::from_utf8_lossy(&payload[4..]).into_owned();
                EngineFrame::Failed(Status::new(Code::from(i32::from_le_bytes(code)), message))
            }
            (kind, _) => EngineFrame::Failed(Status::internal(format!(
                "the engine's token stream sent a frame of unknown kind {kind}"
            ))),
        })
    }
}

/// The tokens of one generation read off an engine's token socket, as gRPC's `Generate` stream
/// yields them: the last item is an error status if the generation failed or the connection
/// broke (as `Unavailable`, so it reads as a lost engine).
pub struct TokenSocketStream {
    reader: FrameReader,
    done: bool,
}

impl Stream for TokenSocketStream {
    type Item = Result<GeneratedToken, Status>;

    fn poll_next(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        let item = match ready!(self.reader.poll_engine_frame(context)) {
            EngineFrame::Token(token) => return Poll::Ready(Some(Ok(token))),
            EngineFrame::End => None,
            EngineFrame::Failed(status) => Some(Err(status)),
            EngineFrame::Accepted => Some(Err(Status::internal(
                "the engine's token stream accepted its call twice",
            ))),
        };
        self.done = true;
        Poll::Ready(item)
    }
}

/// Starts `request` on the engine whose token socket is at `path`, with the engine's control
/// secret if it has one. Refusals come back here as the gRPC call's would; a socket that
/// cannot be reached is `Unavailable`.
pub async fn generate(
    path: &str,
    secret: Option<&str>,
    request: &GenerateRequest,
) -> Result<TokenSocketStream, Status> {
    let unreachable = |error: std::io::Error| {
        Status::unavailable(format!(
            "connection to the engine's token socket {path}: {error}"
        ))
    };
    let mut socket = UnixStream::connect(path).await.map_err(unreachable)?;
    let secret = secret.unwrap_or_default().as_bytes();
    let request_frame = frame(REQUEST, 4 + secret.len() + request.encoded_len(), |bytes| {
        bytes.extend_from_slice(
            &u32::try_from(secret.len())
                .unwrap_or(u32::MAX)
                .to_le_bytes(),
        );
        bytes.extend_from_slice(secret);
        let _ = request.encode(bytes);
    });
    socket
        .write_all(&request_frame)
        .await
        .map_err(unreachable)?;
    let mut reader = FrameReader::new(socket);
    match std::future::poll_fn(|context| reader.poll_engine_frame(context)).await {
        EngineFrame::Accepted => Ok(TokenSocketStream {
            reader,
            done: false,
        }),
        EngineFrame::Failed(status) => Err(status),
        EngineFrame::Token(_) | EngineFrame::End => Err(Status::internal(
            "the engine's token stream began without accepting its call",
        )),
    }
}

/// Serves `engine`'s `Generate` on `listener` until `shutdown`, then gives the generations in
/// flight `drain` to end before it closes them. Calls must carry `secret` when one is set.
pub async fn serve<E: Engine>(
    listener: tokio::net::UnixListener,
    engine: Arc<E>,
    secret: Option<String>,
    shutdown: impl Future<Output = ()>,
    drain: std::time::Duration,
) {
    let secret: Option<Arc<str>> = secret.map(Into::into);
    let mut connections = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((socket, _)) => {
                    connections.spawn(serve_connection(socket, Arc::clone(&engine), secret.clone()));
                }
                Err(error) => {
                    tracing::warn!(%error, "accepting on the token socket");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
            // Reaps finished connections so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    let _ = tokio::time::timeout(drain, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
}

/// Whether `presented` is the secret, in time independent of where they differ.
fn secret_matches(expected: Option<&str>, presented: &[u8]) -> bool {
    let Some(expected) = expected else {
        return true;
    };
    presented.len() == expected.len()
        && presented
            .iter()
            .zip(expected.as_bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// The request frame's secret and call.
fn parse_request(payload: &[u8], secret: Option<&str>) -> Result<GenerateRequest, Status> {
    let malformed = || Status::invalid_argument("a malformed token socket request");
    let secret_bytes = payload
        .get(..4)
        .map(|length| u32::from_le_bytes([length[0], length[1], length[2], length[3]]) as usize)
        .ok_or_else(malformed)?;
    let presented = payload.get(4..4 + secret_bytes).ok_or_else(malformed)?;
    if !secret_matches(secret, presented) {
        return Err(Status::unauthenticated(
            "this control API needs its shared secret",
        ));
    }
    GenerateRequest::decode(&payload[4 + secret_bytes..])
        .map_err(|error| Status::invalid_argument(format!("a malformed generate request: {error}")))
}

async fn serve_connection<E: Engine>(socket: UnixStream, engine: Arc<E>, secret: Option<Arc<str>>) {
    let mut reader = FrameReader::new(socket);
    let request = match std::future::poll_fn(|context| reader.poll_frame(context)).await {
        Ok(Some((REQUEST, payload))) => parse_request(&reader.buffer[payload], secret.as_deref()),
        Ok(Some(_)) => Err(Status::invalid_argument(
            "a token socket call begins with its request",
        )),
        Ok(None) | Err(_) => return,
    };
    let mut socket = reader.socket;
    let tokens = match request {
        Ok(request) => engine.generate(tonic::Request::new(request)).await,
        Err(status) => Err(status),
    };
    let mut tokens = match tokens {
        Ok(response) => Box::pin(response.into_inner()),
        Err(status) => {
            let _ = socket.write_all(&status_frame(&status)).await;
            return;
        }
    };
    if socket.write_all(&frame(ACCEPTED, 0, |_| {})).await.is_err() {
        return;
    }
    let (mut from_gateway, mut to_gateway) = socket.into_split();
    let mut pending = Vec::new();
    loop {
        let mut hangup = [0u8; 1];
        let first = tokio::select! {
            biased;
            item = tokens.next() => item,
            // The gateway sends nothing after its request: readable means it went away,
            // and dropping the stream cancels the generation.
            _ = from_gateway.read(&mut hangup) => return,
        };
        // Tokens already waiting behind the first (a speculative step's) go in the same write,
        // so the gateway wakes once for them; none is waited for.
        pending.clear();
        let mut item = first;
        let ended = loop {
            match item {
                Some(Ok(token)) => append_token_frame(&token, &mut pending),
                Some(Err(status)) => {
                    pending.extend_from_slice(&status_frame(&status));
                    break true;
                }
                None => {
                    pending.extend_from_slice(&frame(END, 0, |_| {}));
                    break true;
                }
            }
            match std::future::poll_fn(|context| Poll::Ready(tokens.as_mut().poll_next(context)))
                .await
            {
                Poll::Ready(next) => item = next,
                Poll::Pending => break false,
            }
        };
        if to_gateway.write_all(&pending).await.is_err() || ended {
            return;
        }
    }
}

#[cfg(test)]
mod tests;
