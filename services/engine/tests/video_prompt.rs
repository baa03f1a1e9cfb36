//! A chat prompt with two videos given as frames through the `qwen3_5_moe` golden fixture on
//! each backend, against `transformers` (`video_prompt_reference.json`, made by
//! `scripts/make_video_reference.py`): the frames pre-processed and paired by the engine's image
//! path (`ImageEncoding`, the request's form: one `ImageInput` of frames per video), each pair
//! encoded as its own tower segment, attached as one `<|video_pad|>` run per pair between the
//! timestamps, and fed as one prefill.
//!
//! On CUDA the decoder is the exact one (as for the image prompt) and the frames are encoded
//! twice: by the host tower, held to the CPU bars, and by the GPU tower the engine serves with,
//! whose embeddings are held to the host's within the f32 tower bar and whose prompt is held to
//! the CUDA golden bars (mean |ΔNLL| ≤ 2e-2 against `transformers`, top-1 agreement ≥ 99% with
//! the host tower's).

use std::path::Path;
use std::sync::Arc;

use ninfer_engine::backend::cuda::CudaBackend;
use ninfer_engine::sampling::argmax;
use ninfer_engine::service::images::{ImageEncoding, TowerDevice};
use ninfer_engine::testing::{
    golden_fixture_dir, json_numbers, max_abs_difference, mean_abs_difference, next_token_nll,
};
use ninfer_engine::{test_device, Backend, CpuBackend, LogitsSelection, Model, SequenceInput};
use ninfer_protocol::v1::ImageInput;

mod support;

/// The largest |Δ| of the GPU tower's f32 embeddings from the host tower's, over the largest
/// |host| value (the f32 tower bar of the GPU vision tests).
const F32_TOWER_BAR: f32 = 1e-4;

/// Where the engine runs the vision tower when it serves on a backend: the host forward beside
/// the CPU backend, the GPU tower on the same GPU beside a CUDA one.
trait ServingTower {
    fn serving_tower(&self) -> TowerDevice;
}

impl ServingTower for CpuBackend {
    fn serving_tower(&self) -> TowerDevice {
        TowerDevice::Host
    }
}

impl ServingTower for CudaBackend {
    fn serving_tower(&self) -> TowerDevice {
        TowerDevice::Cuda {
            ordinal: self.info().ordinal,
            options: self.options(),
        }
    }
}

fn reference() -> serde_json::Value {
    let path = golden_fixture_dir("qwen3_5_moe").join("video_prompt_reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("readable")).expect("valid JSON")
}

fn open_model<B: Backend>(backend: Arc<B>, scratch: &Path) -> Model<B> {
    let path = scratch.join("model.ninfer");
    support::convert_f32(golden_fixture_dir("qwen3_5_moe"), &path);
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

/// Per-position logits of `tokens` with the encoded videos attached, one prefill.
fn video_prompt_logits<B: Backend>(
    model: &Model<B>,
    tokens: &[u32],
    encoded: ninfer_engine::service::scheduler::PromptImages,
) -> Vec<f32> {
    let mut state = model.new_sequence(tokens.len() + 4).expect("sequence");
    model
        .attach_images(&mut state, tokens, &encoded.grids, encoded.embeddings)
        .expect("videos attach");
    model
        .forward(
            &mut [SequenceInput {
                state: &mut state,
                tokens,
            }],
            LogitsSelection::All,
        )
        .expect("forward")
        .pop()
        .expect("one sequence")
}

fn a_video_prompt_matches_transformers<B: Backend + ServingTower>(backend: Arc<B>) {
    let reference = reference();
    let scratch = tempfile::tempdir().expect("scratch directory");
    let serving_tower = backend.serving_tower();
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

    let host_embeddings = encoded.embeddings.clone();
    let logits = video_prompt_logits(&model, &tokens, encoded);
    let vocab = model.vocab_size();
    let expected_nll = json_numbers(&reference["token_nll"]);
    let expected_last: Vec<f32> = json_numbers(&reference["last_logits"])
        .into_iter()
        .map(|v| v as f32)
        .collect();
    let nll = next_token_nll(&tokens, &logits, vocab);
    let mean_difference = mean_abs_difference(&nll, &expected_nll);
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

    // The tower the engine serves this backend with, when it is not the host's.
    if matches!(serving_tower, TowerDevice::Host) {
        return;
    }
    let on_device = ImageEncoding::for_artifact(model.artifact())
        .expect("image path")
        .expect("the fixture has a vision tower")
        .on_device(serving_tower);
    let encoded = on_device
        .encode_now(&tokens, &videos)
        .expect("videos encode on the device");
    let description = on_device.tower_description().unwrap_or_default();
    assert!(
        description.starts_with("cuda"),
        "the frames were encoded by {description:?}"
    );
    let scale = host_embeddings.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let embedding_error = max_abs_difference(&encoded.embeddings, &host_embeddings) / scale;
    assert!(
        embedding_error < F32_TOWER_BAR,
        "embeddings: max |Δ| / max |host| {embedding_error}"
    );
    let device_logits = video_prompt_logits(&model, &tokens, encoded);
    let device_nll = next_token_nll(&tokens, &device_logits, vocab);
    let device_difference = mean_abs_difference(&device_nll, &expected_nll);
    let agreeing = device_logits
        .chunks(vocab)
        .zip(logits.chunks(vocab))
        .filter(|(device, host)| argmax(device) == argmax(host))
        .count();
    let agreement = agreeing as f64 / tokens.len() as f64;
    println!(
        "{description}: embeddings max |Δ| / max |host| {embedding_error:.2e}, mean |ΔNLL| {device_difference:.3e}, top-1 agreement with the host tower {:.1}%",
        100.0 * agreement
    );
    assert!(
        device_difference <= 2e-2,
        "device tower: mean |ΔNLL| {device_difference}"
    );
    assert!(
        agreement >= 0.99,
        "device tower: top-1 agreement {agreement}"
    );
}

test_device!(a_video_prompt_matches_transformers);

#[test]
fn videos_out_of_order_or_with_bad_frames_are_refused() {
    let reference = reference();
    let scratch = tempfile::tempdir().expect("scratch directory");
    let model = open_model(Arc::new(CpuBackend::new()), scratch.path());
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
