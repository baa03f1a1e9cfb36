//! A chat prompt with three images through the `qwen3_5_moe` golden fixture on each backend,
//! against `transformers` (`image_prompt_reference.json`, made by
//! `scripts/make_image_prompt_reference.py`): the images pre-processed by
//! `ninfer-vision-input`, encoded by the f32 vision tower, attached to the sequence (embeddings
//! and three-stream positions) and fed as one prefill, in chunks, batched beside a text-only
//! sequence, and then decoded.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ninfer_engine::testing::{
    golden_fixture_dir, image_prompt_patches, json_numbers, max_abs_difference,
    mean_abs_difference, next_token_nll,
};
use ninfer_engine::vision::{encode_images, ImageGrid, VisionWeights};
use ninfer_engine::{test_device, Backend, LogitsSelection, Model, SequenceInput};

mod support;

fn reference() -> serde_json::Value {
    let path = golden_fixture_dir("qwen3_5_moe").join("image_prompt_reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("readable")).expect("valid JSON")
}

fn convert(output: &Path) -> PathBuf {
    let path = output.join("model.ninfer");
    support::convert_f32(golden_fixture_dir("qwen3_5_moe"), &path);
    path
}

/// The prompt's images pre-processed and encoded: grids and the image tokens' embeddings.
fn encoded_images<B: Backend>(
    model: &Model<B>,
    reference: &serde_json::Value,
) -> (Vec<ImageGrid>, Vec<f32>) {
    let (grids, rows) = image_prompt_patches(reference);
    let weights = VisionWeights::load(model.artifact())
        .expect("loads")
        .expect("the fixture has a vision tower");
    let output = encode_images(&weights, &rows, &grids).expect("encodes");
    (grids, output.merged)
}

fn an_image_prompt_matches_transformers_in_one_prefill_and_in_chunks<B: Backend>(backend: Arc<B>) {
    let reference = reference();
    let scratch = tempfile::tempdir().expect("scratch directory");
    let path = convert(scratch.path());
    let model = Model::open(backend, &path).expect("model opens");
    let (grids, embeddings) = encoded_images(&model, &reference);
    let tokens: Vec<u32> = json_numbers(&reference["token_ids"])
        .into_iter()
        .map(|v| v as u32)
        .collect();
    let expected_nll = json_numbers(&reference["token_nll"]);
    let expected_last: Vec<f32> = json_numbers(&reference["last_logits"])
        .into_iter()
        .map(|v| v as f32)
        .collect();
    let vocab = model.vocab_size();

    // One prefill, every position's logits.
    let mut state = model.new_sequence(tokens.len() + 4).expect("sequence");
    model
        .attach_images(&mut state, &tokens, &grids, embeddings.clone())
        .expect("images attach");
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
    let nll = next_token_nll(&tokens, &logits, vocab);
    let mean_difference = mean_abs_difference(&nll, &expected_nll);
    let last = &logits[(tokens.len() - 1) * vocab..];
    let last_difference = max_abs_difference(last, &expected_last);
    println!("mean |ΔNLL| {mean_difference:.3e}, last logits max |Δ| {last_difference:.3e}");
    assert!(mean_difference < 1e-4, "mean |ΔNLL| {mean_difference}");
    assert!(last_difference < 1e-3, "last logits {last_difference}");

    // Without the images the same tokens score differently: the images are seen.
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

    // In chunks that cut through the images: the same last logits.
    let mut chunked = model.new_sequence(tokens.len() + 4).expect("sequence");
    let embeddings_copy = embeddings.clone();
    model
        .attach_images(&mut chunked, &tokens, &grids, embeddings)
        .expect("images attach");
    let mut chunk_logits = Vec::new();
    for chunk in tokens.chunks(11) {
        chunk_logits = model
            .forward(
                &mut [SequenceInput {
                    state: &mut chunked,
                    tokens: chunk,
                }],
                LogitsSelection::Last,
            )
            .expect("forward")
            .pop()
            .expect("one sequence");
    }
    let chunk_difference = max_abs_difference(&chunk_logits, last);
    assert!(
        chunk_difference < 1e-4,
        "chunked prefill {chunk_difference}"
    );

    // Batched beside a text-only sequence: each gets the logits it gets alone.
    let text_tokens: Vec<u32> = tokens
        .iter()
        .copied()
        .filter(|&t| t < 480)
        .take(9)
        .collect();
    let mut text_alone = model.new_sequence(text_tokens.len()).expect("sequence");
    let text_logits = model
        .forward(
            &mut [SequenceInput {
                state: &mut text_alone,
                tokens: &text_tokens,
            }],
            LogitsSelection::Last,
        )
        .expect("forward")
        .pop()
        .expect("one sequence");
    let mut image_batched = model.new_sequence(tokens.len()).expect("sequence");
    model
        .attach_images(&mut image_batched, &tokens, &grids, embeddings_copy)
        .expect("images attach");
    let mut text_batched = model.new_sequence(text_tokens.len()).expect("sequence");
    let batched = model
        .forward(
            &mut [
                SequenceInput {
                    state: &mut text_batched,
                    tokens: &text_tokens,
                },
                SequenceInput {
                    state: &mut image_batched,
                    tokens: &tokens,
                },
            ],
            LogitsSelection::Last,
        )
        .expect("forward");
    assert!(
        max_abs_difference(&batched[0], &text_logits) < 1e-4,
        "text beside images"
    );
    assert!(
        max_abs_difference(&batched[1], last) < 1e-4,
        "images beside text"
    );

    // A decoded token after the prompt turns by its index plus the prompt's delta: the same
    // logits as the one-prefill sequence fed that token.
    let next = ninfer_engine::sampling::argmax(last);
    let decode = |state: &mut ninfer_engine::SequenceState<B>| {
        model
            .forward(
                &mut [SequenceInput {
                    state,
                    tokens: &[next],
                }],
                LogitsSelection::Last,
            )
            .expect("decode")
            .pop()
            .expect("one sequence")
    };
    let after_one = decode(&mut state);
    let after_chunks = decode(&mut chunked);
    assert!(max_abs_difference(&after_one, &after_chunks) < 1e-4);
}

test_device!(an_image_prompt_matches_transformers_in_one_prefill_and_in_chunks);

/// The prompt's three images step by step against the processor and the tower of
/// `transformers`: their pixel values (before any bf16 rounding) and the merger's rows, the
/// image tokens' embeddings.
#[test]
fn the_prompts_pixel_values_and_image_features_equal_transformers() {
    let reference = reference();
    let (_, rows) = image_prompt_patches(&reference);
    let pixel_file = reference["pixel_values_file"]
        .as_str()
        .expect("the reference names its pixel values");
    let expected_pixels: Vec<f32> =
        std::fs::read(golden_fixture_dir("qwen3_5_moe").join(pixel_file))
            .expect("pixel values readable")
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
    let shape = json_numbers(&reference["pixel_values_shape"]);
    assert_eq!(expected_pixels.len() as f64, shape[0] * shape[1]);
    let pixel_difference = max_abs_difference(&rows, &expected_pixels);

    let scratch = tempfile::tempdir().expect("scratch directory");
    let model = Model::open(
        Arc::new(ninfer_engine::CpuBackend::new()),
        &convert(scratch.path()),
    )
    .expect("model opens");
    let (_, features) = encoded_images(&model, &reference);
    let expected_features: Vec<f32> = json_numbers(&reference["image_features"])
        .into_iter()
        .map(|v| v as f32)
        .collect();
    let feature_shape = json_numbers(&reference["image_features_shape"]);
    assert_eq!(
        expected_features.len() as f64,
        feature_shape[0] * feature_shape[1]
    );
    let feature_difference = max_abs_difference(&features, &expected_features);
    println!(
        "pixel values max |Δ| {pixel_difference:.3e}, image features max |Δ| {feature_difference:.3e}"
    );
    assert!(pixel_difference <= 1e-5, "pixel values {pixel_difference}");
    assert!(
        feature_difference < 2e-5,
        "image features {feature_difference}"
    );
}

#[test]
fn images_are_refused_for_a_started_sequence_or_mismatched_embeddings() {
    let reference = reference();
    let scratch = tempfile::tempdir().expect("scratch directory");
    let path = convert(scratch.path());
    let model =
        Model::open(Arc::new(ninfer_engine::CpuBackend::new()), &path).expect("model opens");
    let (grids, embeddings) = encoded_images(&model, &reference);
    let tokens: Vec<u32> = json_numbers(&reference["token_ids"])
        .into_iter()
        .map(|v| v as u32)
        .collect();
    let mut state = model.new_sequence(tokens.len()).expect("sequence");
    assert!(model
        .attach_images(&mut state, &tokens, &grids, embeddings[1..].to_vec())
        .is_err());
    assert!(model
        .attach_images(&mut state, &tokens, &grids[..2], embeddings.clone())
        .is_err());
    model
        .forward(
            &mut [SequenceInput {
                state: &mut state,
                tokens: &tokens[..3],
            }],
            LogitsSelection::Last,
        )
        .expect("forward");
    assert!(model
        .attach_images(&mut state, &tokens, &grids, embeddings)
        .is_err());
}
