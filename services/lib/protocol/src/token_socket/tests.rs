use super::*;
use crate::v1::TokenLogprob;

fn token(token_id: u32, top_logprobs: u32) -> GeneratedToken {
    GeneratedToken {
        token_id,
        logprob: -0.25,
        top_logprobs: (0..top_logprobs)
            .map(|k| TokenLogprob {
                token_id: k,
                logprob: -1.0 - k as f32,
            })
            .collect(),
        completion_tokens: token_id,
        ..Default::default()
    }
}

fn token_frame(token: &GeneratedToken) -> Vec<u8> {
    let mut bytes = Vec::new();
    append_token_frame(token, &mut bytes);
    bytes
}

/// The stream a gateway reads, over one end of a socket pair; the test writes the other.
fn stream_and_engine_end() -> (TokenSocketStream, UnixStream) {
    let (gateway_end, engine_end) =
        UnixStream::pair().unwrap_or_else(|error| panic!("socket pair: {error}"));
    let stream = TokenSocketStream {
        reader: FrameReader::new(gateway_end),
        done: false,
    };
    (stream, engine_end)
}

async fn write(engine_end: &mut UnixStream, bytes: &[u8]) {
    engine_end
        .write_all(bytes)
        .await
        .unwrap_or_else(|error| panic!("write: {error}"));
}

#[tokio::test]
async fn frames_cut_anywhere_and_larger_than_a_read_arrive_whole_and_in_order() {
    let (stream, mut engine_end) = stream_and_engine_end();
    // The third token's frame is several reads long (its buffer must grow).
    let sent = vec![token(1, 0), token(2, 3), token(3, 3000), token(4, 1)];
    let mut bytes: Vec<u8> = sent.iter().flat_map(token_frame).collect();
    bytes.extend_from_slice(&frame(END, 0, |_| {}));
    let writer = tokio::spawn(async move {
        for piece in bytes.chunks(7) {
            write(&mut engine_end, piece).await;
            tokio::task::yield_now().await;
        }
        engine_end
    });
    let received: Vec<_> = stream.collect().await;
    let _engine_end = writer.await;
    let expected: Vec<Result<GeneratedToken, Status>> = sent.into_iter().map(Ok).collect();
    assert_eq!(received.len(), expected.len());
    for (received, expected) in received.iter().zip(&expected) {
        assert_eq!(received.as_ref().ok(), expected.as_ref().ok());
    }
}

#[tokio::test]
async fn a_connection_that_closes_before_the_end_reads_as_a_lost_engine() {
    for cut_inside_a_frame in [false, true] {
        let (mut stream, mut engine_end) = stream_and_engine_end();
        write(&mut engine_end, &token_frame(&token(9, 0))).await;
        if cut_inside_a_frame {
            write(&mut engine_end, &token_frame(&token(10, 2))[..6]).await;
        }
        drop(engine_end);
        let first = stream.next().await;
        assert_eq!(first.and_then(Result::ok).map(|t| t.token_id), Some(9));
        match stream.next().await {
            Some(Err(status)) => assert_eq!(status.code(), Code::Unavailable, "{status:?}"),
            other => panic!("expected Unavailable, got {other:?}"),
        }
        assert!(stream.next().await.is_none());
    }
}

#[tokio::test]
async fn a_failed_generation_ends_with_the_engines_status() {
    let (mut stream, mut engine_end) = stream_and_engine_end();
    let failure = Status::resource_exhausted("every sequence is taken");
    write(&mut engine_end, &status_frame(&failure)).await;
    match stream.next().await {
        Some(Err(status)) => {
            assert_eq!(status.code(), Code::ResourceExhausted);
            assert_eq!(status.message(), "every sequence is taken");
        }
        other => panic!("expected the status, got {other:?}"),
    }
    assert!(stream.next().await.is_none());
}

#[tokio::test]
async fn a_frame_beyond_the_limit_is_refused_without_reading_it() {
    let (mut stream, mut engine_end) = stream_and_engine_end();
    let mut header = vec![TOKEN];
    header.extend_from_slice(&(MAX_FRAME_BYTES as u32 + 1).to_le_bytes());
    write(&mut engine_end, &header).await;
    match stream.next().await {
        Some(Err(status)) => assert_eq!(status.code(), Code::Unavailable, "{status:?}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn request_payload(secret: &[u8], request: &GenerateRequest) -> Vec<u8> {
    let mut payload = (secret.len() as u32).to_le_bytes().to_vec();
    payload.extend_from_slice(secret);
    request
        .encode(&mut payload)
        .unwrap_or_else(|error| panic!("{error}"));
    payload
}

#[test]
fn a_request_is_read_only_with_the_secret_when_one_is_set() {
    let request = GenerateRequest {
        request_id: "r-1".to_string(),
        prompt_token_ids: vec![1, 2, 3],
        max_new_tokens: 7,
        ..Default::default()
    };
    let read = |secret: &[u8], expected: Option<&str>| {
        parse_request(&request_payload(secret, &request), expected)
    };
    assert_eq!(read(b"", None).ok().as_ref(), Some(&request));
    assert_eq!(read(b"anything", None).ok().as_ref(), Some(&request));
    assert_eq!(
        read(b"s3cret", Some("s3cret")).ok().as_ref(),
        Some(&request)
    );
    for wrong in [&b""[..], b"s3cre", b"s3cret!", b"S3cret"] {
        let refused = read(wrong, Some("s3cret"))
            .err()
            .map(|status| status.code());
        assert_eq!(refused, Some(Code::Unauthenticated), "{wrong:?}");
    }
    // A secret length beyond the payload is malformed, not a panic.
    let refused = parse_request(&[200, 0, 0, 0, 1, 2], None)
        .err()
        .map(|s| s.code());
    assert_eq!(refused, Some(Code::InvalidArgument));
}

#[test]
fn a_token_socket_sits_beside_a_unix_socket_only() {
    assert_eq!(
        path_beside("unix:/run/ninfer/engine.sock").as_deref(),
        Some("/run/ninfer/engine.sock.tokens")
    );
    assert_eq!(path_beside("127.0.0.1:50051"), None);
}
