//! A model split over pipeline stages with KV caches in host memory (`--host-kv-mib`): every
//! stage's backend reserves its own page-locked pool, its share of the request in proportion to
//! the KV caches its layers make (its attention layers, the MTP head's on the last stage), and
//! the split computes the unsplit model's logits and greedy tokens bit for bit with every KV
//! cache in the pools (a GPU share of 0 sends each cache there). On CUDA each stage's pool
//! holds the caches of its own layers; the CPU backend keeps every cache in host memory anyway
//! and reports no placement. The stages are backends of one device (`OpenOnSameDevice`).

#![allow(clippy::single_range_in_vec_init)] // a stage's layers are one range

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ninfer_artifact::Artifact;
use ninfer_engine::backend::same_device::OpenOnSameDevice;
use ninfer_engine::backend::{DeviceKvShare, HostKvRequest};
use ninfer_engine::sampling::argmax;
use ninfer_engine::spec::MixerKind;
use ninfer_engine::testing::golden_fixture_dir;
use ninfer_engine::{
    open_artifact, test_device, Backend, LogitsSelection, Model, PipelineStage,
    ReferenceExpertExecutor, SequenceInput, SequenceState,
};

mod support;

const MAX_CONTEXT: usize = 64;
const DECODE_STEPS: usize = 4;

fn convert(fixture: &str, output: &Path) -> PathBuf {
    let path = output.join(format!("{fixture}.ninfer"));
    support::convert_f32(golden_fixture_dir(fixture), &path);
    path
}

fn load<B: Backend>(
    backends: &[Arc<B>],
    split: &[Range<usize>],
    artifact: &Arc<Artifact>,
) -> Model<B> {
    let stages = PipelineStage::over(backends, split);
    let executor = Arc::new(ReferenceExpertExecutor::new(Arc::clone(artifact)));
    let model = Model::load_pipeline(stages, Arc::clone(artifact), executor, 0).unwrap();
    model.set_step_graphs(false);
    model
}

/// A prompt's last logits, then greedy decode steps' logits, and the sequence (its KV caches
/// stay placed while it lives).
fn logits<B: Backend>(model: &Model<B>, prompt: &[u32]) -> (Vec<Vec<f32>>, SequenceState<B>) {
    let mut state = model.new_sequence(MAX_CONTEXT).unwrap();
    let mut out = model
        .forward(
            &mut [SequenceInput {
                state: &mut state,
                tokens: prompt,
            }],
            LogitsSelection::Last,
        )
        .unwrap();
    for _ in 0..DECODE_STEPS {
        let token = argmax(out.last().unwrap());
        let step = model
            .forward(
                &mut [SequenceInput {
                    state: &mut state,
                    tokens: &[token],
                }],
                LogitsSelection::Last,
            )
            .unwrap();
        out.extend(step);
    }
    (out, state)
}

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|row| row.iter().map(|value| value.to_bits()).collect())
        .collect()
}

/// Each stage counts the attention layers it owns, the last one the MTP head's too.
fn stages_count_the_kv_caches_their_layers_make<B: OpenOnSameDevice>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    let backends = vec![
        Arc::clone(&backend),
        Arc::new(backend.open_on_same_device().unwrap()),
    ];
    for fixture in ["qwen3_next", "qwen3_5_moe", "qwen3_moe"] {
        let artifact = open_artifact(&convert(fixture, directory.path())).unwrap();
        let layers = artifact.config().common().num_hidden_layers;
        let unsplit = load(&backends[..1], &[0..layers], &artifact);
        let attention: Vec<bool> = unsplit
            .spec()
            .mixers
            .iter()
            .map(|&mixer| mixer == MixerKind::Attention)
            .collect();
        let mtp = usize::from(unsplit.has_mtp());
        let all = attention.iter().filter(|&&a| a).count();
        assert_eq!(unsplit.attention_layers_per_stage(), vec![all + mtp]);
        for cut in 1..layers {
            let split = load(&backends, &[0..cut, cut..layers], &artifact);
            let first = attention[..cut].iter().filter(|&&a| a).count();
            assert_eq!(
                split.attention_layers_per_stage(),
                vec![first, all - first + mtp],
                "{fixture} cut at {cut}"
            );
        }
    }
}
test_device!(stages_count_the_kv_caches_their_layers_make);

fn a_split_model_with_host_kv_pools_computes_the_unsplit_logits<B: OpenOnSameDevice>(
    backend: Arc<B>,
) {
    let directory = tempfile::tempdir().unwrap();
    // Every cache to the pools: the GPU's share of KV caches is 0.
    let request = HostKvRequest {
        host_bytes: 64 << 20,
        device_share: DeviceKvShare::Bytes(0),
    };
    for fixture in ["qwen3_moe", "qwen3_next", "qwen3_5_moe"] {
        let artifact = open_artifact(&convert(fixture, directory.path())).unwrap();
        let common = artifact.config().common();
        let (layers, vocab) = (common.num_hidden_layers, common.vocab_size as u32);
        let prompt: Vec<u32> = (0..19u32).map(|i| (i * 41 + 3) % vocab).collect();
        // Backends of their own: a pool belongs to its backend.
        let alone = vec![Arc::new(backend.open_on_same_device().unwrap())];
        let unsplit = load(&alone, &[0..layers], &artifact);
        unsplit.reserve_host_kv(&request).unwrap();
        let (expected, _unsplit_sequence) = logits(&unsplit, &prompt);
        let stage_backends = vec![
            Arc::new(backend.open_on_same_device().unwrap()),
            Arc::new(backend.open_on_same_device().unwrap()),
        ];
        let split = load(
            &stage_backends,
            &[0..layers - 1, layers - 1..layers],
            &artifact,
        );
        split.reserve_host_kv(&request).unwrap();
        let (got, _split_sequence) = logits(&split, &prompt);
        assert!(
            bits(&got) == bits(&expected),
            "{fixture} on {}: the split's logits differ from the unsplit model's",
            backend.name()
        );
        // Where the backend keeps a pool (CUDA): every cache of every stage is in its own.
        if let Some(placement) = unsplit.kv_placement() {
            assert!(placement.host_caches > 0, "{fixture}: {placement:?}");
            assert_eq!(placement.device_caches, 0, "{fixture}: {placement:?}");
            let together = split.kv_placement().unwrap();
            assert_eq!(together.host_caches, placement.host_caches, "{fixture}");
            assert_eq!(together.device_caches, 0, "{fixture}: {together:?}");
            // One cache per attention layer of the sequence (no MTP state was made).
            let mut counts = split.attention_layers_per_stage();
            if let (true, Some(last)) = (split.has_mtp(), counts.last_mut()) {
                *last -= 1;
            }
            for (stage, count) in counts.into_iter().enumerate() {
                let own = stage_backends[stage].kv_placement().unwrap();
                assert_eq!(own.host_caches, count, "{fixture} stage {stage}: {own:?}");
            }
        }
    }
}
test_device!(a_split_model_with_host_kv_pools_computes_the_unsplit_logits);
