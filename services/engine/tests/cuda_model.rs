//! Whole models through the CUDA backend against the CPU backend: tiny random-weight models of
//! every architecture (f32 and bf16 dense weights, bf16 and int8 experts), teacher-forced
//! per-token NLL and top-1 agreement, and greedy decoding of 16 tokens (the CUDA fidelity bars,
//! with the CPU backend as the reference; `golden.rs` runs the transformers fixtures through
//! both backends). Twice: with `CudaOptions::exact` (f32 KV cache, matmul kernel only) held to
//! f32 tolerances (mean |ΔNLL| < 1e-3, top-1 ≥ 99%, identical greedy tokens), and with the
//! default options (bf16 KV cache, cuBLAS for bf16 prefill GEMMs) held to bf16 tolerances (mean
//! |ΔNLL| ≤ 2e-2, top-1 ≥ 95%; greedy agreement printed: on random tiny models a near-tie can
//! flip under bf16 rounding). Skipped without a GPU (fails under `NINFER_REQUIRE_GPU=1`).

use std::sync::Arc;

use ninfer_artifact::DType;
use ninfer_engine::backend::cuda::{CudaBackend, CudaOptions};
use ninfer_engine::backend::same_device::OpenOnSameDevice;
use ninfer_engine::perplexity::negative_log_likelihood;
use ninfer_engine::sampling::argmax;
use ninfer_engine::testing::{
    greedy_tokens, teacher_forced_logits, write_tiny_model, TinyArchitecture, TinyModelOptions,
};
use ninfer_engine::{
    open_artifact, Backend, CpuBackend, ExpertExecutor, Model, PipelineStage,
    ReferenceExpertExecutor, SequenceInput,
};

const GREEDY_TOKENS: usize = 16;

/// The tiny models' mixture-of-experts architectures, which these tests run each.
const MOE_ARCHITECTURES: [TinyArchitecture; 3] = [
    TinyArchitecture::Qwen3Moe,
    TinyArchitecture::Qwen3Next,
    TinyArchitecture::Qwen35Moe,
];

/// This file's tests one at a time: one of them keeps another thread synchronising on the
/// device, and the step graph tests count recordings and replays, which should see only their
/// own model's steps beside it.
fn one_test_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static GPU: std::sync::Mutex<()> = std::sync::Mutex::new(());
    GPU.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What one run is held to.
struct Bars {
    mean_nll: f64,
    top1: f64,
    greedy_identical: bool,
}

#[test]
fn tiny_models_on_cuda_match_the_cpu_backend() {
    let _one_at_a_time = one_test_at_a_time();
    for (label, backend, bars) in [
        (
            "exact",
            CudaBackend::shared_exact(),
            Bars {
                mean_nll: 1e-3,
                top1: 0.99,
                greedy_identical: true,
            },
        ),
        (
            "default",
            CudaBackend::shared(),
            Bars {
                mean_nll: 2e-2,
                top1: 0.95,
                greedy_identical: false,
            },
        ),
    ] {
        let gpu = match backend {
            Ok(backend) => backend,
            Err(error) => {
                if std::env::var("NINFER_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                    panic!("NINFER_REQUIRE_GPU=1 but the GPU is unusable: {error}");
                }
                println!("skipped `tiny_models_on_cuda_match_the_cpu_backend` on cuda: {error}");
                return;
            }
        };
        println!(
            "{label} options: KV cache {}, cuBLAS {}",
            gpu.info().kv_dtype,
            gpu.info().cublas_library.as_deref().unwrap_or("off")
        );
        compare_tiny_models(&gpu, label, &bars);
    }
}

fn compare_tiny_models(gpu: &Arc<CudaBackend>, label: &str, bars: &Bars) {
    let cpu = Arc::new(CpuBackend::new());
    let directory = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (0..96u32).map(|i| (i * 37 + 11) % 97).collect();
    let prompt = &tokens[..20];
    for architecture in MOE_ARCHITECTURES {
        for (experts, dense) in [
            (DType::F32, DType::F32),
            (DType::Bf16, DType::Bf16),
            (DType::Int8, DType::Bf16),
        ] {
            let options = TinyModelOptions {
                experts_dtype: experts,
                dense_dtype: dense,
                ..TinyModelOptions::new(architecture)
            };
            let path = directory
                .path()
                .join(format!("{architecture:?}-{experts}-{dense}.ninfer"));
            write_tiny_model(&path, options).unwrap();
            let on_gpu = Model::open(Arc::clone(gpu), &path).unwrap();
            let on_cpu = Model::open(Arc::clone(&cpu), &path).unwrap();

            let (logits_g, logits_c) = (
                teacher_forced_logits(&on_gpu, &tokens).unwrap(),
                teacher_forced_logits(&on_cpu, &tokens).unwrap(),
            );
            let (mut nll_difference, mut agree, mut worst_logit) = (0.0f64, 0usize, 0.0f32);
            for t in 0..tokens.len() - 1 {
                let (g, c) = (&logits_g[t], &logits_c[t]);
                nll_difference += (negative_log_likelihood(g, tokens[t + 1])
                    - negative_log_likelihood(c, tokens[t + 1]))
                .abs();
                agree += usize::from(argmax(g) == argmax(c));
                worst_logit = g
                    .iter()
                    .zip(c)
                    .fold(worst_logit, |m, (a, b)| m.max((a - b).abs()));
            }
            let scored = tokens.len() - 1;
            let mean_nll_difference = nll_difference / scored as f64;
            let agreement = agree as f64 / scored as f64;
            let (greedy_g, greedy_c) = (
                greedy_tokens(&on_gpu, prompt, GREEDY_TOKENS).unwrap(),
                greedy_tokens(&on_cpu, prompt, GREEDY_TOKENS).unwrap(),
            );
            let same_greedy = greedy_g
                .iter()
                .zip(&greedy_c)
                .take_while(|(a, b)| a == b)
                .count();
            println!(
                "{architecture:?} experts {experts} dense {dense}: cuda ({label}) vs cpu over {scored} teacher-forced tokens: mean |ΔNLL| {mean_nll_difference:.2e}, max |Δlogit| {worst_logit:.2e}, top-1 agreement {:.1}%, greedy tokens identical {same_greedy}/{GREEDY_TOKENS}",
                100.0 * agreement
            );
            assert!(
                mean_nll_difference <= bars.mean_nll,
                "{architecture:?} {experts}/{dense} ({label}): mean |ΔNLL| {mean_nll_difference}"
            );
            assert!(
                agreement >= bars.top1,
                "{architecture:?} {experts}/{dense} ({label}): top-1 agreement {agreement}"
            );
            if bars.greedy_identical {
                assert_eq!(
                    greedy_g, greedy_c,
                    "{architecture:?} {experts}/{dense} ({label}): greedy tokens differ"
                );
            }
        }
    }
    gpu.synchronize().unwrap();
}

/// Decode steps through step graphs (CUDA graphs: a shaped step, a recorded step, then
/// replays) give the logits of the same steps launched op by op, bit for bit, for every
/// architecture, a batch of one and a batch of three sequences, every routed expert resident.
#[test]
fn step_graphs_give_the_logits_of_uncaptured_steps() {
    let _one_at_a_time = one_test_at_a_time();
    let Some(gpu) = gpu_or_skip(
        CudaBackend::shared(),
        "step_graphs_give_the_logits_of_uncaptured_steps",
    ) else {
        return;
    };
    let directory = tempfile::tempdir().unwrap();
    for architecture in MOE_ARCHITECTURES {
        let path = write_int8_model(directory.path(), architecture);
        let (with_graphs, without) = (
            open_with_resident_experts(&gpu, &path, 1, true),
            open_with_resident_experts(&gpu, &path, 1, false),
        );
        for sequences in [1usize, 3] {
            let prompts: Vec<Vec<u32>> = (0..sequences as u32)
                .map(|s| (0..9 + 4 * s).map(|i| (i * 31 + 7 * s + 3) % 97).collect())
                .collect();
            let graph_steps = decode_on_backend(&with_graphs, &prompts, 20);
            let plain_steps = decode_on_backend(&without, &prompts, 20);
            println!(
                "{architecture:?}, {sequences} sequences: step graphs {:?}, last recording failure: {:?}",
                with_graphs.step_graph_counts(),
                with_graphs.step_graph_last_abandoned()
            );
            for (step, (graph, plain)) in graph_steps.iter().zip(&plain_steps).enumerate() {
                let same_bits = graph.len() == plain.len()
                    && graph
                        .iter()
                        .zip(plain)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                let worst = graph
                    .iter()
                    .zip(plain)
                    .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    same_bits,
                    "{architecture:?}, {sequences} sequences: step {step}'s logits differ with step graphs (max |Δ| {worst:e})"
                );
            }
        }
        let counts = with_graphs.step_graph_counts();
        println!("{architecture:?}: step graphs {counts:?}");
        assert_eq!(counts.abandoned, 0, "{architecture:?}: a recording failed");
        assert!(counts.replayed >= 30, "{architecture:?}: {counts:?}");
        assert_eq!(without.step_graph_counts().replayed, 0);
    }
}

/// The scheduler records in the relaxed capture mode, so another thread's synchronising calls
/// leave a recording whole (the image tower's read-backs and the expert cache's fills run beside
/// decode): while another thread waits on another backend's idle stream, on the context and on
/// the model's own stream, over and over, the model's decode steps record once and replay,
/// none interrupted or abandoned, with the logits of steps launched op by op, bit for bit.
#[test]
fn recordings_beside_another_threads_synchronisation_stay_whole() {
    let _one_at_a_time = one_test_at_a_time();
    let test = "recordings_beside_another_threads_synchronisation_stay_whole";
    let opened = CudaBackend::shared().and_then(|gpu| {
        let other = CudaBackend::with_options(0, CudaOptions::default())?;
        Ok((gpu, Arc::new(other)))
    });
    let Some((gpu, other)) = gpu_or_skip(opened, test) else {
        return;
    };
    let directory = tempfile::tempdir().unwrap();
    let path = write_int8_model(directory.path(), TinyArchitecture::Qwen3Next);
    let (with_graphs, without) = (
        open_with_resident_experts(&gpu, &path, 1, true),
        open_with_resident_experts(&gpu, &path, 1, false),
    );
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|s| (0..9 + 4 * s).map(|i| (i * 29 + 5 * s + 1) % 97).collect())
        .collect();
    let plain_steps = decode_on_backend(&without, &prompts, 12);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let waiting = {
        let (stop, model_backend) = (Arc::clone(&stop), Arc::clone(&gpu));
        std::thread::spawn(move || {
            // The other backend's stream, the whole context, and the model's own stream (a wait
            // on a stream that records surely breaks the recording): a wait that meets a
            // capture may fail, which is not this test's concern.
            let context = cudarc::driver::CudaContext::new(0).ok();
            let mut waits = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = other.wait_for_queued_ops();
                if let Some(context) = &context {
                    let _ = context.synchronize();
                }
                let _ = model_backend.wait_for_queued_ops();
                waits += 1;
            }
            waits
        })
    };
    let graph_steps = decode_on_backend(&with_graphs, &prompts, 12);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let waits = waiting.join().unwrap();
    let counts = with_graphs.step_graph_counts();
    println!(
        "step graphs {counts:?} beside {waits} waits of another thread; last failure: {:?}",
        with_graphs.step_graph_last_abandoned()
    );
    for (step, (graph, plain)) in graph_steps.iter().zip(&plain_steps).enumerate() {
        assert!(
            graph.len() == plain.len()
                && graph
                    .iter()
                    .zip(plain)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
            "step {step}'s logits differ from the op-by-op step's"
        );
    }
    assert!(waits > 0, "the other thread never waited");
    assert!(
        counts.interrupted == 0 && counts.abandoned == 0,
        "{waits} waits of another thread broke a recording: {counts:?}, last failure {:?}",
        with_graphs.step_graph_last_abandoned()
    );
    assert!(
        counts.recorded >= 1 && counts.replayed >= 8,
        "beside {waits} waits of another thread: {counts:?}"
    );
}

/// A model split over pipeline stages of one card decodes through step graphs that span every
/// stage (one recording, then one launch per step) with the unsplit model's logits, bit for
/// bit, and so its greedy tokens: two and three stages crossing within the card's context, and
/// two stages crossing by the peer copy that stages on two cards take (`peer_stage_crossings`),
/// for every architecture, a batch of one and a batch of three sequences, every routed expert
/// resident. The steps were recorded and replayed, none abandoned.
#[test]
fn split_step_graphs_give_the_unsplit_logits() {
    let _one_at_a_time = one_test_at_a_time();
    let test = "split_step_graphs_give_the_unsplit_logits";
    let opened = CudaBackend::shared().and_then(|gpu| {
        let peer = CudaBackend::with_options(
            0,
            CudaOptions {
                peer_stage_crossings: true,
                ..gpu.options()
            },
        )?;
        Ok((gpu, Arc::new(peer)))
    });
    let Some((gpu, peer)) = gpu_or_skip(opened, test) else {
        return;
    };
    let same_context = vec![
        Arc::clone(&gpu),
        Arc::new(gpu.open_on_same_device().unwrap()),
        Arc::new(gpu.open_on_same_device().unwrap()),
    ];
    let peer_path = vec![
        Arc::clone(&peer),
        Arc::new(peer.open_on_same_device().unwrap()),
    ];
    // (name, the stages' backends, each stage's layers of the tiny models' 4)
    let splits = [
        ("halves", &same_context, vec![0..2, 2..4]),
        ("three stages", &same_context, vec![0..1, 1..2, 2..4]),
        ("halves, peer copies", &peer_path, vec![0..2, 2..4]),
    ];
    let directory = tempfile::tempdir().unwrap();
    for architecture in MOE_ARCHITECTURES {
        let path = write_int8_model(directory.path(), architecture);
        let unsplit = open_with_resident_experts(&gpu, &path, 1, false);
        for (name, backends, split) in &splits {
            let with_graphs = open_split_with_resident_experts(backends, &path, split);
            assert!(with_graphs.is_split());
            let peer_crossings_before = peer.peer_stage_crossings();
            for sequences in [1usize, 3] {
                let prompts: Vec<Vec<u32>> = (0..sequences as u32)
                    .map(|s| (0..9 + 4 * s).map(|i| (i * 31 + 7 * s + 3) % 97).collect())
                    .collect();
                let graph_steps = decode_on_backend(&with_graphs, &prompts, 12);
                let plain_steps = decode_on_backend(&unsplit, &prompts, 12);
                let greedy = |steps: &[Vec<f32>]| -> Vec<Vec<u32>> {
                    steps
                        .iter()
                        .map(|step| step.chunks(with_graphs.vocab_size()).map(argmax).collect())
                        .collect()
                };
                assert_eq!(
                    greedy(&graph_steps),
                    greedy(&plain_steps),
                    "{architecture:?} split in {name}, {sequences} sequences: greedy tokens"
                );
                assert_eq!(graph_steps.len(), plain_steps.len());
                for (step, (graph, plain)) in graph_steps.iter().zip(&plain_steps).enumerate() {
                    let worst = graph
                        .iter()
                        .zip(plain)
                        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(
                        graph.len() == plain.len()
                            && graph
                                .iter()
                                .zip(plain)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{architecture:?} split in {name}, {sequences} sequences: step {step}'s logits differ from the unsplit model's (max |Δ| {worst:e})"
                    );
                }
            }
            let counts = with_graphs.step_graph_counts();
            let last_failure = with_graphs.step_graph_last_abandoned();
            println!("{architecture:?} split in {name}: step graphs {counts:?}, last recording failure: {last_failure:?}");
            assert_eq!(
                counts.abandoned, 0,
                "{architecture:?} split in {name}: a recording failed: {last_failure:?}"
            );
            assert!(
                counts.recorded >= 2 && counts.replayed >= 16,
                "{architecture:?} split in {name}: {counts:?}, last failure {last_failure:?}"
            );
            if backends[0].options().peer_stage_crossings {
                assert!(
                    peer.peer_stage_crossings() > peer_crossings_before,
                    "{architecture:?} split in {name}: no crossing took the peer path"
                );
            }
        }
    }
}

/// The router kernel storing the routing (and a decode step's hidden states) into mapped
/// page-locked memory gives the bits the stream's copies give: every routed expert on the GPU
/// (the routing read at the forward's end, with and without step graphs) and half of them
/// (the in-process expert executor computes the rest from the stored hidden states, every
/// layer waiting for the routing mid-forward).
#[test]
fn routing_stored_by_the_router_equals_routing_copied_back() {
    let _one_at_a_time = one_test_at_a_time();
    // Two backends of this test's own: a backend records one step graph at a time, and the
    // shared one is recording the other tests' graphs meanwhile.
    assert!(CudaOptions::default().routing_stores);
    let with_stores = |routing_stores| {
        let options = CudaOptions {
            routing_stores,
            ..CudaOptions::default()
        };
        CudaBackend::with_options(0, options).map(Arc::new)
    };
    let backends = with_stores(false).and_then(|copies| Ok((copies, with_stores(true)?)));
    let Some((copies, stores)) = gpu_or_skip(
        backends,
        "routing_stored_by_the_router_equals_routing_copied_back",
    ) else {
        return;
    };
    let directory = tempfile::tempdir().unwrap();
    for architecture in [TinyArchitecture::Qwen3Moe, TinyArchitecture::Qwen35Moe] {
        let path = write_int8_model(directory.path(), architecture);
        for (label, resident_share, graphs) in [
            ("every expert resident, graphs", 1, true),
            ("every expert resident, no graphs", 1, false),
            ("half resident", 2, false),
        ] {
            let by_copies = open_with_resident_experts(&copies, &path, resident_share, graphs);
            let by_stores = open_with_resident_experts(&stores, &path, resident_share, graphs);
            let prompts: Vec<Vec<u32>> = (0..3u32)
                .map(|s| (0..9 + 4 * s).map(|i| (i * 31 + 7 * s + 3) % 97).collect())
                .collect();
            let copied_steps = decode_on_backend(&by_copies, &prompts, 12);
            let stored_steps = decode_on_backend(&by_stores, &prompts, 12);
            for (step, (copied, stored)) in copied_steps.iter().zip(&stored_steps).enumerate() {
                assert!(
                    copied.len() == stored.len()
                        && copied.iter().zip(stored).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{architecture:?}, {label}: step {step}'s logits differ with the routing stored by the router"
                );
            }
        }
    }
}

/// The GPU value, or `None` after saying why the test is skipped (a panic instead under
/// `NINFER_REQUIRE_GPU=1`).
fn gpu_or_skip<T>(
    opened: Result<T, ninfer_engine::backend::cuda::CudaError>,
    test: &str,
) -> Option<T> {
    match opened {
        Ok(value) => Some(value),
        Err(error) => {
            if std::env::var("NINFER_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("NINFER_REQUIRE_GPU=1 but the GPU is unusable: {error}");
            }
            println!("skipped `{test}` on cuda: {error}");
            None
        }
    }
}

/// A tiny model of `architecture` with int8 experts and bf16 dense weights, written in `directory`.
fn write_int8_model(
    directory: &std::path::Path,
    architecture: TinyArchitecture,
) -> std::path::PathBuf {
    let options = TinyModelOptions {
        experts_dtype: DType::Int8,
        dense_dtype: DType::Bf16,
        ..TinyModelOptions::new(architecture)
    };
    let path = directory.join(format!("{architecture:?}.ninfer"));
    write_tiny_model(&path, options).unwrap();
    path
}

/// The model at `path` on `backend` with every `share`-th expert of each MoE layer resident
/// (1: all of them) and step graphs on or off.
fn open_with_resident_experts(
    backend: &Arc<CudaBackend>,
    path: &std::path::Path,
    share: u32,
    graphs: bool,
) -> Model<CudaBackend> {
    let mut model = Model::open(Arc::clone(backend), path).unwrap();
    place_every_share_th_expert(&mut model, share);
    model.set_step_graphs(graphs);
    model
}

/// Every `share`-th expert of each MoE layer of `model` resident (1: all of them).
fn place_every_share_th_expert(model: &mut Model<CudaBackend>, share: u32) {
    let common = &model.spec().common;
    let resident: Vec<u32> = (0..common.num_experts as u32)
        .filter(|expert| expert % share == 0)
        .collect();
    let placement: Vec<Vec<u32>> = common
        .moe_layers
        .iter()
        .map(|&moe| if moe { resident.clone() } else { Vec::new() })
        .collect();
    model.place_resident_experts(&placement).unwrap();
}

/// The model at `path` split at `split` over `backends` (stage `i` on `backends[i]`), every
/// routed expert resident in its stage's slots, step graphs on.
fn open_split_with_resident_experts(
    backends: &[Arc<CudaBackend>],
    path: &std::path::Path,
    split: &[std::ops::Range<usize>],
) -> Model<CudaBackend> {
    let artifact = open_artifact(path).unwrap();
    let stages = PipelineStage::over(backends, split);
    let experts: Arc<dyn ExpertExecutor> =
        Arc::new(ReferenceExpertExecutor::new(Arc::clone(&artifact)));
    let mut model = Model::load_pipeline(stages, artifact, experts, 0).unwrap();
    place_every_share_th_expert(&mut model, 1);
    model.set_step_graphs(true);
    model
}

/// Prefills each prompt alone, then decodes all of them together greedily for `steps` steps
/// through `forward_logits_on_backend` (the scheduler's call); every step's logits, all rows.
fn decode_on_backend(
    model: &Model<CudaBackend>,
    prompts: &[Vec<u32>],
    steps: usize,
) -> Vec<Vec<f32>> {
    let mut states: Vec<_> = prompts
        .iter()
        .map(|_| model.new_sequence(64).unwrap())
        .collect();
    let mut next: Vec<u32> = states
        .iter_mut()
        .zip(prompts)
        .map(|(state, prompt)| argmax(&model.prefill(state, prompt).unwrap()))
        .collect();
    let vocab = model.vocab_size();
    let mut out = Vec::new();
    for _ in 0..steps {
        let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let mut batch: Vec<SequenceInput<'_, CudaBackend>> = states
            .iter_mut()
            .zip(&tokens)
            .map(|(state, token)| SequenceInput {
                state,
                tokens: token,
            })
            .collect();
        let logits = model.forward_logits_on_backend(&mut batch).unwrap();
        let values = model.output_backend().download(&logits).unwrap();
        next = values.chunks(vocab).map(argmax).collect();
        out.push(values);
    }
    out
}
