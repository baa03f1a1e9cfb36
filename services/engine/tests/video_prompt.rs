//! A chat prompt with two videos given as frames through the `qwen3_5_moe` golden fixture on
//! each backend, against `transformers` (`video_prompt_reference.json`, made by
//! `scripts/make_video_reference.py`): the frames pre-processed and paired by the engine's image
//! path (`ImageEncoding`, the request's form: one `ImageInput` of frames per video), each pair
//! encoded as its own tower segment, attached as one `<|video_pad|>` run per pair between the
//! timestamps, and fed as one prefill.

use std::path::Path;
use std::sync::Arc;

use ninfer_artifact::DType;
use ninfer_convert::{convert_checkpoint, ConvertOptions, NoProgress};
use ninfer_engine::service::images::ImageEncoding;
use ninfer_engine::testing::{golden_fixture_dir, json_numbers, max_abs_difference};
use ninfer_engine::{test_device, Backend, LogitsSelection, Model, SequenceInput};
use ninfer_protocol::v1::ImageInput;

fn reference() -> serde_json::Value {
    let path = golden_fixture_dir("qwen3_5_moe").join("video_prompt_reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("readable")).expect("valid JSON")
}

fn open_model<B: Backend>(backend: Arc<B>, scratch: &Path) -> Model<B> {
    let path = scratch.join("model.ninfer");
    let options = ConvertOptions {
        experts_dtype: DType::F32,
        dense_dtype: DType::F32,
        ..ConvertOptions::new(golden_fixture_dir("qwen3_5_moe"), &path)
    };
    convert_checkpoint(&options, &NoProgress).expect("fixture converts");
    Model::open(backend, &path).expect("model opens")
}

/// Each video of the reference as the engine request carries it.
fn videos(reference: &serde_json::Value) -> Vec<ImageInput> {
    let frames_dir = golden_fixture_dir("vision_input");
    reference["frame_files"]
        .as_array()
        .expect("videos")
        .iter()
        .map(|files| ImageInput {
            encoded: Vec::new(),
            media_type: String::new(),
            frames: files
                .as_array()
                .expect("frames")
                .iter()
                .map(|name| ImageInput {
                    encoded: std::fs::read(frames_dir.join(name.as_str().expect("name")))
                        .expect("frame"),
                    media_type: "image/png".into(),
                    frames: Vec::new(),
                })
                .collect(),
        })
        .collect()
}

fn a_video_prompt_matches_transformers<B: Backend>(backend: Arc<B>) {
    let reference = reference();
    let scratch = tempfile::tempdir().expect("scratch directory");
    let model = open_model(backend, scratch.path());
    let tokens: Vec<u32> = json_numbers(&reference["token_ids"])
        .into_iter()
        .map(|v| v as u32)
        .collect();
    let encoding = ImageEncoding::for_artifact(model.artifact())
        .expect("image path")
        .expect("the fixture has a vision tower");
    let videos = videos(&reference);
    let encoded = encoding
        .encode_now(&tokens, &videos)
        .expect("videos encode");
    // One segment per frame pair, each the grid of one temporal patch of its video.
    let expected_segments: Vec<(usize, usize)> = reference["video_grid_thw"]
        .as_array()
        .expect("grids")
        .iter()
        .flat_map(|grid| {
            let number = |i: usize| grid[i].as_u64().expect("whole") as usize;
            std::iter::repeat_n((number(1), number(2)), number(0))
        })
        .collect();
    let segments: Vec<(usize, usize)> = encoded
        .grids
        .iter()
        .map(|grid| {
            assert_eq!(grid.temporal, 1);
            (grid.height, grid.width)
        })
        .collect();
    assert_eq!(segments, expected_segments);

    let mut state = model.new_sequence(tokens.len() + 4).expect("sequence");
    model
        .attach_images(&mut state, &tokens, &encoded.grids, encoded.embeddings)
        .expect("videos attach");
    let logits = model
        .forward(
            &mut [SequenceInput {
                state: &mut state,
                tokens: &tokens,
            }],
            LogitsSelection::All,
        )
        .expect("forward")
        .pop()
        .expect("one sequence");
    let vocab = model.vocab_size();
    let expected_nll = json_numbers(&reference["token_nll"]);
    let expected_last: Vec<f32> = json_numbers(&reference["last_logits"])
        .into_iter()
        .map(|v| v as f32)
        .collect();
    let nll: Vec<f64> = tokens
        .iter()
        .skip(1)
        .zip(logits.chunks(vocab))
        .map(|(&token, row)| ninfer_engine::perplexity::negative_log_likelihood(row, token))
        .collect();
    let mean_difference = nll
        .iter()
        .zip(&expected_nll)
        .map(|(a, b)| (a - b).abs())
        .sum::<f64>()
        / nll.len() as f64;
    let last = &logits[(tokens.len() - 1) * vocab..];
    let last_difference = max_abs_difference(last, &expected_last);
    println!("mean |ΔNLL| {mean_difference:.3e}, last logits max |Δ| {last_difference:.3e}");
    assert!(mean_difference < 1e-4, "mean |ΔNLL| {mean_difference}");
    assert!(last_difference < 1e-3, "last logits {last_difference}");

    // Without the videos the same tokens score differently: the frames are seen.
    let mut blind = model.new_sequence(tokens.len()).expect("sequence");
    let blind_logits = model
        .forward(
            &mut [SequenceInput {
                state: &mut blind,
                tokens: &tokens,
            }],
            LogitsSelection::Last,
        )
        .expect("forward")
        .pop()
        .expect("one sequence");
    assert!(max_abs_difference(&blind_logits, &expected_last) > 1e-2);
}

test_device!(a_video_prompt_matches_transformers);

#[test]
fn videos_out_of_order_or_with_bad_frames_are_refused() {
    let reference = reference();
    let scratch = tempfile::tempdir().expect("scratch directory");
    let model = open_model(Arc::new(ninfer_engine::CpuBackend::new()), scratch.path());
    let tokens: Vec<u32> = json_numbers(&reference["token_ids"])
        .into_iter()
        .map(|v| v as u32)
        .collect();
    let encoding = ImageEncoding::for_artifact(model.artifact())
        .expect("image path")
        .expect("the fixture has a vision tower");
    let mut videos = videos(&reference);
    let refused = |videos: &[ImageInput]| match encoding.encode_now(&tokens, videos) {
        Ok(_) => panic!("the videos were taken"),
        Err(status) => status.message().to_string(),
    };
    // The two videos swapped: their runs no longer fit the prompt's.
    let swapped = [videos[1].clone(), videos[0].clone()];
    assert!(
        refused(&swapped).contains("placeholder run"),
        "{}",
        refused(&swapped)
    );
    // A frame of another size.
    let mut resized = videos.clone();
    resized[0].frames[1] = videos[1].frames[0].clone();
    let message = refused(&resized);
    assert!(
        message.starts_with("video 1: frame 2 is 32x16"),
        "{message}"
    );
    // A truncated frame.
    let frame = &mut videos[1].frames[2].encoded;
    frame.truncate(frame.len() / 2);
    let message = refused(&videos);
    assert!(message.starts_with("video 2: frame 3: "), "{message}");
    assert!(message.contains("corrupt or truncated"), "{message}");
}
