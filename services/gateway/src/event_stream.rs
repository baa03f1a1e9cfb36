//! Server-sent events as every streaming API sends them: each event rendered once into the
//! bytes the connection writes, and the response body that hands them over.
//!
//! Owns: [`Event`] (the same builder and the same bytes as axum's `sse::Event` for the fields the
//! APIs use: `event:`, `data:`), [`event_stream_response`] and its body, which keeps a silent
//! stream alive with a comment (`:`) as axum's default keep-alive does, at most 15 s apart.
//! Why not axum's `Sse`: it copies every event into a growing buffer and resets a timer per
//! event; with one event per generated token that was a good share of the gateway's work per
//! token. Here an event is one allocation of its final size, and the keep-alive timer is
//! re-armed only when it fires.
//! Must not touch: what the events say (each API's writer decides).

use std::future::Future as _;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::Stream;
use http_body::Frame;

use crate::inline_stream::InlineStream;

/// The longest silence a stream keeps before it sends a keep-alive comment.
const KEEP_ALIVE_SILENCE: Duration = Duration::from_secs(15);

/// The keep-alive comment (axum's default).
const KEEP_ALIVE_COMMENT: &[u8] = b":\n\n";

/// One server-sent event being built; [`Event::into_frame`] gives its bytes.
#[derive(Debug, Default, Clone)]
pub struct Event {
    buffer: Vec<u8>,
}

impl Event {
    /// An event of `data` alone, with room for it reserved at once.
    pub fn data_only(data: &str) -> Self {
        Event {
            buffer: Vec::with_capacity(data.len() + 9),
        }
        .data(data)
    }

    /// An event named `name` carrying `data`, with room for both reserved at once.
    pub fn named(name: &str, data: &str) -> Self {
        Event {
            buffer: Vec::with_capacity(name.len() + data.len() + 17),
        }
        .event(name)
        .data(data)
    }

    /// An event whose `data:` line `write` appends (text without line breaks, such as JSON), of
    /// about `capacity` bytes: written in place, no copy.
    pub fn data_written(capacity: usize, write: impl FnOnce(&mut Vec<u8>)) -> Self {
        let mut buffer = Vec::with_capacity(capacity + 9);
        buffer.extend_from_slice(b"data: ");
        write(&mut buffer);
        debug_assert!(
            memchr::memchr2(b'\n', b'\r', &buffer).is_none(),
            "a data line written in place holds a line break"
        );
        buffer.push(b'\n');
        Event { buffer }
    }

    /// The `event:` field. `name` is one of the APIs' event types (no line breaks).
    pub fn event(mut self, name: &str) -> Self {
        self.buffer.extend_from_slice(b"event: ");
        self.buffer.extend_from_slice(name.as_bytes());
        self.buffer.push(b'\n');
        self
    }

    /// The `data:` field: one `data:` line per line of `data`, as axum writes it (each line
    /// break is kept and followed by a new `data: `; empty data writes no field).
    pub fn data(mut self, data: impl AsRef<str>) -> Self {
        let data = data.as_ref().as_bytes();
        if data.is_empty() {
            return self;
        }
        self.buffer.reserve(data.len() + 9);
        self.buffer.extend_from_slice(b"data: ");
        let mut line_start = 0;
        for line_break in memchr::memchr2_iter(b'\n', b'\r', data) {
            self.buffer
                .extend_from_slice(&data[line_start..=line_break]);
            self.buffer.extend_from_slice(b"data: ");
            line_start = line_break + 1;
        }
        self.buffer.extend_from_slice(&data[line_start..]);
        self.buffer.push(b'\n');
        self
    }

    /// The event's bytes, ending with the blank line that ends an event.
    pub fn into_frame(mut self) -> Bytes {
        self.buffer.push(b'\n');
        Bytes::from(self.buffer)
    }
}

/// An API's event producer as a `text/event-stream` response, run by the client's connection as
/// it writes. When the client disconnects, the body is dropped, the producer with its
/// generations, and the engines cancel.
pub fn event_stream_response(events: InlineStream<Event>) -> Response {
    (
        [
            (axum::http::header::CONTENT_TYPE, "text/event-stream"),
            (axum::http::header::CACHE_CONTROL, "no-cache"),
        ],
        Body::new(EventStreamBody::new(events, KEEP_ALIVE_SILENCE)),
    )
        .into_response()
}

/// The body of an event stream: the producer's events, and a keep-alive comment after a silence.
struct EventStreamBody {
    events: InlineStream<Event>,
    /// Fires every half `longest_silence`; a period that saw no event ends with a comment, so
    /// no silence lasts longer than the whole.
    keep_alive: Pin<Box<tokio::time::Sleep>>,
    keep_alive_period: Duration,
    sent_this_period: bool,
}

impl EventStreamBody {
    fn new(events: InlineStream<Event>, longest_silence: Duration) -> Self {
        let keep_alive_period = longest_silence / 2;
        EventStreamBody {
            events,
            keep_alive: Box::pin(tokio::time::sleep(keep_alive_period)),
            keep_alive_period,
            sent_this_period: false,
        }
    }
}

impl http_body::Body for EventStreamBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.events).poll_next(context) {
            Poll::Ready(Some(event)) => {
                this.sent_this_period = true;
                return Poll::Ready(Some(Ok(Frame::data(event.into_frame()))));
            }
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => {}
        }
        // Re-armed only when it fires (not per event), then polled once more so it wakes us.
        while this.keep_alive.as_mut().poll(context).is_ready() {
            let silent = !std::mem::replace(&mut this.sent_this_period, false);
            let next = tokio::time::Instant::now() + this.keep_alive_period;
            this.keep_alive.as_mut().reset(next);
            if silent {
                return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(
                    KEEP_ALIVE_COMMENT,
                )))));
            }
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::response::sse::{Event as AxumEvent, Sse};
    use futures_util::StreamExt;

    /// What axum's `Sse` writes for `event`.
    async fn axum_bytes(event: AxumEvent) -> Bytes {
        let stream = futures_util::stream::iter([Ok::<_, std::convert::Infallible>(event)]);
        let response = Sse::new(stream).into_response();
        match axum::body::to_bytes(response.into_body(), usize::MAX).await {
            Ok(bytes) => bytes,
            Err(error) => panic!("axum's body failed: {error}"),
        }
    }

    #[tokio::test]
    async fn events_are_the_bytes_axum_writes() {
        let texts = [
            "",
            "[DONE]",
            "{\"a\":\"b\"}",
            "two\nlines",
            "carriage\rreturn and\r\nboth\n",
            "\n\nleading breaks",
            "naïve — 漢字 🐉",
        ];
        for text in texts {
            assert_eq!(
                Event::default().data(text).into_frame(),
                axum_bytes(AxumEvent::default().data(text)).await,
                "{text:?}"
            );
            assert_eq!(
                Event::data_only(text).into_frame(),
                axum_bytes(AxumEvent::default().data(text)).await,
                "{text:?}"
            );
            for name in ["message_start", "response.output_text.delta"] {
                assert_eq!(
                    Event::named(name, text).into_frame(),
                    axum_bytes(AxumEvent::default().event(name).data(text)).await,
                    "{name} {text:?}"
                );
            }
        }
        let written = Event::data_written(4, |line| line.extend_from_slice(b"{\"x\":1}"));
        assert_eq!(
            written.into_frame(),
            axum_bytes(AxumEvent::default().data("{\"x\":1}")).await
        );
    }

    #[tokio::test]
    async fn the_response_streams_each_event_and_ends_with_the_producer() {
        let events = InlineStream::new(|sender| async move {
            sender.send(Event::named("ping", "1")).await;
            sender.send(Event::data_only("[DONE]")).await;
        });
        let response = event_stream_response(events);
        assert_eq!(
            response.headers()[axum::http::header::CONTENT_TYPE],
            "text/event-stream"
        );
        assert_eq!(
            response.headers()[axum::http::header::CACHE_CONTROL],
            "no-cache"
        );
        let mut frames = response.into_body().into_data_stream();
        let mut seen = Vec::new();
        while let Some(frame) = frames.next().await {
            match frame {
                Ok(frame) => seen.push(frame),
                Err(error) => panic!("the body failed: {error}"),
            }
        }
        assert_eq!(
            seen,
            vec![
                Bytes::from_static(b"event: ping\ndata: 1\n\n"),
                Bytes::from_static(b"data: [DONE]\n\n"),
            ]
        );
    }

    #[tokio::test]
    async fn a_silent_stream_gets_a_comment_within_the_silence_limit_and_a_busy_one_none() {
        let longest_silence = Duration::from_millis(400);
        let (sender, mut receiver) = tokio::sync::mpsc::channel::<&'static str>(4);
        let events = InlineStream::new(|emitter| async move {
            while let Some(text) = receiver.recv().await {
                emitter.send(Event::data_only(text)).await;
            }
        });
        let mut body = Body::new(EventStreamBody::new(events, longest_silence)).into_data_stream();
        // Busy: an event every 100 ms for 1.2 s (three keep-alive periods each), no comment.
        let feeder = tokio::spawn(async move {
            for _ in 0..12 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if sender.send("token").await.is_err() {
                    return;
                }
            }
            // Then silence, the sender kept open.
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(sender);
        });
        for _ in 0..12 {
            let frame = body.next().await;
            assert!(
                matches!(&frame, Some(Ok(bytes)) if bytes.as_ref() == b"data: token\n\n"),
                "{frame:?}"
            );
        }
        let last_event = std::time::Instant::now();
        let frame = body.next().await;
        assert!(
            matches!(&frame, Some(Ok(bytes)) if bytes.as_ref() == KEEP_ALIVE_COMMENT),
            "{frame:?}"
        );
        let silence = last_event.elapsed();
        // Within the limit (a loaded machine's timer may fire a little late).
        assert!(
            silence >= longest_silence / 2
                && silence <= longest_silence + Duration::from_millis(100),
            "{silence:?}"
        );
        feeder.abort();
    }
}
