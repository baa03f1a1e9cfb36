//! Image prompts through the engine's serving path on the `qwen3_5_moe` fixture: encoded files
//! decoded, pre-processed and encoded by the service's image path (the fixture's own
//! `preprocessor_config.json`), attached by the scheduler, then generated. The reference chat
//! prompt's first token is `transformers`' pick; the prefix cache reuses a prefix only for the
//! same images (a different image with the same grid and the same tokens gets nothing past the
//! text before it) and never changes a token, with and without MTP drafting; hostile files are
//! refused naming their problem.

use std::path::Path;
use std::sync::Arc;

use ninfer_engine::prefix_cache::PrefixCacheSettings;
use ninfer_engine::sampling::argmax;
use ninfer_engine::service::images::ImageEncoding;
use ninfer_engine::service::scheduler::{
    self, PromptImages, SchedulerCommand, SchedulerCounters, SchedulerLimits, SpeculativeDecoding,
    DEFAULT_PREFILL_TIME_SHARE,
};
use ninfer_engine::testing::{
    collect_tokens, golden_fixture_dir, greedy_request, greedy_tokens_of, json_numbers,
};
use ninfer_engine::{test_device, Backend, Model, SequenceState};
use ninfer_protocol::v1::ImageInput;
use tokio::sync::mpsc as async_mpsc;

mod support;

const IMAGE_PAD: u32 = 491;
const VISION_START: u32 = 489;
const VISION_END: u32 = 490;
const NEW_TOKENS: usize = 6;

fn open<B: Backend>(backend: &Arc<B>, work: &Path) -> Arc<Model<B>> {
    let path = work.join("qwen3_5_moe.ninfer");
    support::convert_f32(golden_fixture_dir("qwen3_5_moe"), &path);
    Arc::new(Model::open(Arc::clone(backend), &path).expect("the model opens"))
}

fn image(name: &str) -> ImageInput {
    let path = golden_fixture_dir("vision_input").join(name);
    ImageInput {
        encoded: std::fs::read(&path).expect("fixture image"),
        media_type: String::new(),
        frames: Vec::new(),
    }
}

struct Scheduler {
    commands: std::sync::mpsc::Sender<SchedulerCommand>,
    next_id: usize,
}

impl Scheduler {
    fn start<B: Backend + 'static>(
        model: &Arc<Model<B>>,
        prefix: PrefixCacheSettings,
        max_draft_tokens: usize,
    ) -> Self
    where
        B::Tensor: Send,
        SequenceState<B>: Send,
        Model<B>: Send + Sync,
    {
        let limits = SchedulerLimits {
            max_context: 1024,
            max_sequences: 4,
            prefill_chunk_tokens: 0,
            prefill_time_share: DEFAULT_PREFILL_TIME_SHARE,
        };
        let commands = scheduler::start_serving(
            Arc::clone(model),
            limits,
            SpeculativeDecoding { max_draft_tokens },
            prefix,
            Arc::new(SchedulerCounters::default()),
        )
        .expect("start the scheduler");
        Scheduler {
            commands,
            next_id: 0,
        }
    }

    /// Greedy tokens and the cached prompt tokens the last event reports.
    fn generate(&mut self, prompt: &[u32], images: Option<PromptImages>) -> (Vec<u32>, u32) {
        let (events, mut receiver) = async_mpsc::channel(4096);
        self.next_id += 1;
        let id = format!("request-{}", self.next_id);
        let mut request = greedy_request(id, prompt.to_vec(), NEW_TOKENS, events);
        request.images = images;
        self.commands
            .send(SchedulerCommand::Submit(request))
            .expect("submit");
        collect_tokens(&mut receiver)
    }
}

/// `count` text tokens (below the special tokens) from a simple generator.
fn text(seed: u32, count: usize) -> Vec<u32> {
    (0..count as u32)
        .map(|i| (seed.wrapping_mul(2_654_435_761) ^ i.wrapping_mul(40_503)) % 470 + 5)
        .collect()
}

fn placeholder(tokens: usize) -> Vec<u32> {
    [
        vec![VISION_START],
        vec![IMAGE_PAD; tokens],
        vec![VISION_END],
    ]
    .concat()
}

/// Greedy tokens of `prompt` with `images` straight through the model (no scheduler, no cache).
fn direct_greedy<B: Backend>(model: &Model<B>, prompt: &[u32], images: PromptImages) -> Vec<u32> {
    let mut state = model
        .new_sequence(prompt.len() + NEW_TOKENS)
        .expect("sequence");
    model
        .attach_images(&mut state, prompt, &images.grids, images.embeddings)
        .expect("images attach");
    greedy_tokens_of(model, state, prompt, NEW_TOKENS).expect("greedy tokens")
}

fn image_prompts_are_served_and_cached_by_their_images<B: Backend + 'static>(backend: Arc<B>)
where
    B::Tensor: Send,
    SequenceState<B>: Send,
    Model<B>: Send + Sync,
{
    let work = tempfile::tempdir().expect("scratch directory");
    let model = open(&backend, work.path());
    let encoding = Arc::new(
        ImageEncoding::for_artifact(model.artifact())
            .expect("vision settings")
            .expect("the fixture has a vision tower"),
    );

    // The reference chat prompt with its three images: the first token is transformers' pick.
    let path = golden_fixture_dir("qwen3_5_moe").join("image_prompt_reference.json");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("reference")).expect("JSON");
    let prompt: Vec<u32> = json_numbers(&reference["token_ids"])
        .into_iter()
        .map(|v| v as u32)
        .collect();
    let files: Vec<ImageInput> = reference["image_files"]
        .as_array()
        .expect("files")
        .iter()
        .map(|name| image(name.as_str().expect("name")))
        .collect();
    let images = encoding.encode_now(&prompt, &files).expect("images encode");
    let expected_first = argmax(
        &json_numbers(&reference["last_logits"])
            .into_iter()
            .map(|v| v as f32)
            .collect::<Vec<_>>(),
    );
    let direct = direct_greedy(&model, &prompt, images.clone());
    assert_eq!(direct[0], expected_first, "transformers' first token");
    let mut plain = Scheduler::start(&model, PrefixCacheSettings::off(), 0);
    let (served, _) = plain.generate(&prompt, Some(images.clone()));
    assert_eq!(served, direct, "served tokens");

    // Two JPEGs of the same picture and size, with different chroma subsampling (the same grid,
    // so the same tokens; different pixels) in a longer prompt.
    let grid_tokens = |name: &str| {
        let one = [placeholder(1), text(9, 2)].concat();
        let probe = encoding.encode_now(&one, &[image(name)]);
        // The refusal names the run the image needs.
        let message = probe
            .expect_err("a 1-token run is too short")
            .message()
            .to_string();
        assert!(message.contains("placeholder run"), "{message}");
        let settings = ninfer_vision_input::ImageProcessorSettings::from_preprocessor_config(
            &std::fs::read_to_string(
                golden_fixture_dir("qwen3_5_moe").join("preprocessor_config.json"),
            )
            .expect("the fixture's processor settings"),
        )
        .expect("valid settings");
        let limits = Default::default();
        let grid =
            ninfer_vision_input::preprocess_image(&image(name).encoded, None, &settings, &limits)
                .expect("pre-processed")
                .grid;
        grid.merged_tokens(2)
    };
    let first_tokens = grid_tokens("jpeg_420.jpg");
    assert_eq!(first_tokens, grid_tokens("jpeg_444.jpg"), "same grid");
    let second_tokens = first_tokens;
    let long_prompt = [
        text(1, 100),
        placeholder(first_tokens),
        text(2, 60),
        placeholder(second_tokens),
        text(3, 40),
    ]
    .concat();
    let image_start = 101;
    let second_start = 100 + first_tokens + 2 + 60 + 1;
    let encode = |names: [&str; 2]| {
        encoding
            .encode_now(&long_prompt, &names.map(image))
            .expect("images encode")
    };
    let same = encode(["jpeg_420.jpg", "jpeg_444.jpg"]);
    let other_first = encode(["jpeg_444.jpg", "jpeg_444.jpg"]);
    let other_second = encode(["jpeg_420.jpg", "jpeg_420.jpg"]);
    assert_ne!(same.embeddings, other_first.embeddings);

    let block = 64;
    let settings = PrefixCacheSettings {
        budget_bytes: 1 << 30,
        block_tokens: block,
        checkpoint_interval_blocks: 1,
    };
    let reusable_before = |image_token: usize| image_token / block * block;
    for drafts in [0, 2] {
        let mut plain = Scheduler::start(&model, PrefixCacheSettings::off(), drafts);
        let mut cached = Scheduler::start(&model, settings, drafts);
        let cases = [
            ("first", &same, 0),
            // The same images again: every block that leaves a rest.
            (
                "same images",
                &same,
                (long_prompt.len() - 1) / block * block,
            ),
            // The first image differs: only the text before it.
            (
                "other first image",
                &other_first,
                reusable_before(image_start),
            ),
            // The second image differs: up to the block it starts in.
            (
                "other second image",
                &other_second,
                reusable_before(second_start),
            ),
        ];
        for (what, images, reused) in cases {
            let (expected, _) = plain.generate(&long_prompt, Some(images.clone()));
            let (tokens, cached_tokens) = cached.generate(&long_prompt, Some(images.clone()));
            assert_eq!(tokens, expected, "{what}, {drafts} drafts: tokens");
            assert_eq!(
                cached_tokens as usize, reused,
                "{what}, {drafts} drafts: cached tokens"
            );
            if drafts == 0 {
                assert_eq!(
                    tokens,
                    direct_greedy(&model, &long_prompt, images.clone()),
                    "{what}: served against the model alone"
                );
            }
        }
        // A text-only prompt with the same tokens takes nothing past the text either.
        let (_, cached_tokens) = cached.generate(&long_prompt, None);
        assert_eq!(cached_tokens as usize, reusable_before(image_start));
    }
}

test_device!(image_prompts_are_served_and_cached_by_their_images);

#[test]
fn hostile_images_are_refused_naming_the_problem() {
    let work = tempfile::tempdir().expect("scratch directory");
    let model = open(&Arc::new(ninfer_engine::CpuBackend::new()), work.path());
    let encoding = ImageEncoding::for_artifact(model.artifact())
        .expect("vision settings")
        .expect("the fixture has a vision tower");
    let prompt = [placeholder(6), text(4, 3)].concat();
    let png = image("png_rgb_downscale.png").encoded;
    let refused = |input: ImageInput| {
        encoding
            .encode_now(&prompt, &[input])
            .expect_err("refused")
            .message()
            .to_string()
    };
    let truncated = ImageInput {
        encoded: png[..png.len() / 2].to_vec(),
        media_type: "image/png".into(),
        frames: Vec::new(),
    };
    assert!(refused(truncated).contains("corrupt or truncated"));
    let svg = ImageInput {
        encoded: b"<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"10\" height=\"10\"/>".to_vec(),
        media_type: "image/svg+xml".into(),
        frames: Vec::new(),
    };
    assert!(refused(svg).contains("image/svg+xml"));
    let mislabelled = ImageInput {
        encoded: png.clone(),
        media_type: "image/jpeg".into(),
        frames: Vec::new(),
    };
    assert!(refused(mislabelled).contains("declared as `image/jpeg`"));
    // A PNG header declaring 20,000 × 20,000 pixels (a bomb's shape): refused from the header.
    let mut huge = png.clone();
    huge[16..20].copy_from_slice(&20_000u32.to_be_bytes());
    huge[20..24].copy_from_slice(&20_000u32.to_be_bytes());
    let message = refused(ImageInput {
        encoded: huge,
        media_type: String::new(),
        frames: Vec::new(),
    });
    assert!(
        message.contains("20000x20000") || message.contains("corrupt"),
        "{message}"
    );
    // The right image for the run is taken.
    let grids = encoding
        .encode_now(&prompt, &[image("png_rgb_downscale.png")])
        .expect("encodes")
        .grids;
    assert_eq!(grids.len(), 1);
}
