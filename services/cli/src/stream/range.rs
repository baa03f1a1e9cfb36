//! One byte range of one file on a hub, fetched whole: an HTTP range request, resumed from
//! the last byte received after a cut connection or a 5xx, with exponential backoff.
//!
//! Owns: the status and length checks of a range answer and the words of its failures (a
//! missing file, a refused token, a file shorter than its header says).
//! Must not touch: where the bytes go beyond the writer it is given, caching, conversion.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::hub::Hub;

/// Attempts per range; each resumes where the previous one stopped.
const ATTEMPTS: u32 = 6;
/// The first wait between attempts; it doubles each time.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// A range request to make.
pub struct RangeRequest<'a> {
    pub hub: &'a Hub,
    pub url: &'a str,
    /// The file's name, for messages.
    pub file: &'a str,
    pub start: u64,
    pub end: u64,
    /// Every byte received is added here (what the hub sent, retries included).
    pub fetched: &'a AtomicU64,
    /// Set to give up between chunks.
    pub stop: &'a AtomicBool,
}

/// Why a range was not fetched.
#[derive(Debug)]
pub enum RangeError {
    /// The hub will not serve it however often it is asked (a 404, 401/403, 416, no ranges).
    Refused(String),
    /// Every attempt failed (cut connections, 5xx, short answers).
    GaveUp(String),
    Stopped,
    /// Writing the received bytes failed (a full disk).
    Local(String),
}

impl std::fmt::Display for RangeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RangeError::Refused(text) | RangeError::GaveUp(text) | RangeError::Local(text) => {
                f.write_str(text)
            }
            RangeError::Stopped => f.write_str("stopped"),
        }
    }
}

/// Fetches bytes `start + have .. end` of the request into `sink`, `have` being the bytes
/// `sink` already holds (from an earlier run); returns when `sink` holds all of them.
pub fn fetch_range(
    request: &RangeRequest<'_>,
    mut have: u64,
    sink: &mut dyn Write,
) -> Result<(), RangeError> {
    let length = request.end - request.start;
    let mut last_problem = String::new();
    let mut backoff = FIRST_BACKOFF;
    for attempt in 0..ATTEMPTS {
        if have >= length {
            return Ok(());
        }
        if attempt > 0 {
            std::thread::sleep(backoff);
            backoff *= 2;
        }
        match fetch_once(request, have, sink) {
            Ok(received) => {
                have += received;
                if have < length {
                    last_problem = format!(
                        "the hub sent {have} of the {length} bytes {}..{} of {}",
                        request.start, request.end, request.file
                    );
                }
            }
            Err(Once::Retry(problem, received)) => {
                have += received;
                last_problem = problem;
            }
            Err(Once::Fatal(error)) => return Err(error),
        }
        if request.stop.load(Ordering::Relaxed) {
            return Err(RangeError::Stopped);
        }
    }
    if have >= length {
        return Ok(());
    }
    Err(RangeError::GaveUp(format!(
        "bytes {}..{} of {}: {last_problem}, {ATTEMPTS} times; if this repeats, the file on the \
         hub is shorter than its header says",
        request.start, request.end, request.file
    )))
}

enum Once {
    /// Worth another try; the bytes received before the problem are counted.
    Retry(String, u64),
    Fatal(RangeError),
}

/// One request for bytes `start + have .. end`; returns the bytes received.
fn fetch_once(request: &RangeRequest<'_>, have: u64, sink: &mut dyn Write) -> Result<u64, Once> {
    let (file, url) = (request.file, request.url);
    let from = request.start + have;
    let mut response = request
        .hub
        .get_range(url, from, request.end)
        .map_err(|error| Once::Retry(format!("{file}: {error}"), 0))?;
    let status = response.status().as_u16();
    match status {
        206 => {}
        200 => {
            return Err(Once::Fatal(RangeError::Refused(format!(
                "{file}: the hub ignores byte ranges (200 to a range request, {url}); a streaming \
                 conversion needs them"
            ))))
        }
        401 | 403 => {
            return Err(Once::Fatal(RangeError::Refused(format!(
                "{file}: the hub refuses access ({status} from {url}); for a gated or private \
                 model set {}",
                request.hub.token_variable()
            ))))
        }
        404 => {
            return Err(Once::Fatal(RangeError::Refused(format!(
                "{file}: the hub lists it but answers 404 ({url})"
            ))))
        }
        416 => {
            return Err(Once::Fatal(RangeError::Refused(format!(
                "{file}: bytes {from}..{} are not in the file on the hub (416); the file is \
                 shorter than its header says",
                request.end
            ))))
        }
        500..=599 => return Err(Once::Retry(format!("{file}: {status} from {url}"), 0)),
        _ => {
            return Err(Once::Fatal(RangeError::Refused(format!(
                "{file}: {status} from {url}"
            ))))
        }
    }
    let content_range = response
        .headers()
        .get("content-range")
        .and_then(|value| value.to_str().ok())
        .unwrap_or("")
        .to_string();
    let starts_at = content_range
        .strip_prefix("bytes ")
        .and_then(|rest| rest.split('-').next())
        .and_then(|start| start.trim().parse::<u64>().ok());
    if starts_at != Some(from) {
        return Err(Once::Fatal(RangeError::Refused(format!(
            "{file}: asked for bytes from {from}, the hub answered `content-range: \
             {content_range}` ({url})"
        ))));
    }
    let wanted = request.end - from;
    // A longer answer than asked for is cut at the range's end.
    let mut reader = response.body_mut().as_reader().take(wanted);
    let mut buffer = vec![0u8; 1 << 20];
    let mut received = 0u64;
    loop {
        if request.stop.load(Ordering::Relaxed) {
            return Err(Once::Fatal(RangeError::Stopped));
        }
        let read = match reader.read(&mut buffer) {
            Ok(read) => read,
            Err(error) => {
                return Err(Once::Retry(
                    format!("{file}: connection cut ({error})"),
                    received,
                ))
            }
        };
        if read == 0 {
            return Ok(received);
        }
        sink.write_all(&buffer[..read])
            .map_err(|error| Once::Fatal(RangeError::Local(error.to_string())))?;
        received += read as u64;
        request.fetched.fetch_add(read as u64, Ordering::Relaxed);
    }
}
