//! The model's profile counters (`ninfer_engine::profile`) on a tiny artifact: forwards, tokens
//! and phases; per MoE layer call the distinct experts the routing selected, split between the
//! CPU executor and resident slots, and their bytes (count × bank stride); the dense weight
//! bytes per forward; expert time reported apart from waiting when the executor reports it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ninfer_artifact::TensorClass;
use ninfer_engine::testing::{write_tiny_model, TinyArchitecture, TinyModelOptions};
use ninfer_engine::{
    open_artifact, CpuBackend, EngineError, ExpertBatch, ExpertExecutor, Model,
    ReferenceExpertExecutor, SequenceInput,
};

/// Records the full routing of every MoE layer call, and pretends to report compute time.
struct Recording {
    inner: ReferenceExpertExecutor,
    /// One entry per layer call: the `[tokens, k]` ids as routed.
    calls: Mutex<Vec<Vec<u32>>>,
    reported_nanos: AtomicU64,
}

impl ExpertExecutor for Recording {
    fn name(&self) -> &str {
        "recording"
    }

    fn observe_routing(&self, _layer: usize, expert_ids: &[u32], _tokens: usize) {
        if let Ok(mut calls) = self.calls.lock() {
            calls.push(expert_ids.to_vec());
        }
    }

    fn compute(&self, batch: &ExpertBatch<'_>, out: &mut [f32]) -> Result<(), EngineError> {
        self.reported_nanos.fetch_add(1, Ordering::Relaxed);
        self.inner.compute(batch, out)
    }

    fn compute_nanos(&self) -> Option<u64> {
        Some(self.reported_nanos.load(Ordering::Relaxed))
    }
}

fn distinct(ids: &[u32], keep: impl Fn(u32) -> bool) -> u64 {
    let mut seen: Vec<u32> = ids.iter().copied().filter(|&id| keep(id)).collect();
    seen.sort_unstable();
    seen.dedup();
    seen.len() as u64
}

#[test]
fn counters_match_the_routing_and_the_placement() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("tiny.ninfer");
    write_tiny_model(&path, TinyModelOptions::new(TinyArchitecture::Qwen3Moe)).unwrap();
    let artifact = open_artifact(&path).unwrap();
    let common = artifact.config().common().clone();
    let executor = Arc::new(Recording {
        inner: ReferenceExpertExecutor::new(Arc::clone(&artifact)),
        calls: Mutex::new(Vec::new()),
        reported_nanos: AtomicU64::new(0),
    });
    let mut model = Model::load(
        Arc::new(CpuBackend::new()),
        Arc::clone(&artifact),
        Arc::clone(&executor) as Arc<dyn ExpertExecutor>,
    )
    .unwrap();
    let stride = model.expert_slot_bytes().unwrap();
    // Experts 0 and 1 of every MoE layer resident: the rest goes to the executor.
    let resident: Vec<u32> = vec![0, 1];
    let placement: Vec<Vec<u32>> = common
        .moe_layers
        .iter()
        .map(|&moe| if moe { resident.clone() } else { Vec::new() })
        .collect();
    model.place_resident_experts(&placement).unwrap();
    let moe_layers = common.moe_layers.iter().filter(|&&m| m).count() as u64;
    assert!(moe_layers >= 1);

    // Dense bytes: every dense tensor plus the head (untied: `lm_head`; the table is only looked up).
    let expected_dense: u64 = artifact
        .header()
        .tensors
        .iter()
        .filter(|t| {
            t.class == TensorClass::Dense
                || (t.class == TensorClass::Embedding
                    && (common.tie_word_embeddings || t.name != "embed_tokens"))
        })
        .map(|t| t.length)
        .sum();

    // A prefill of 7 tokens, then 3 decode steps, one sequence; then a batch of two sequences
    // decoding one token each (a decode forward of 2 tokens).
    let mut first = model.new_sequence(32).unwrap();
    let mut second = model.new_sequence(32).unwrap();
    model
        .prefill(&mut first, &[3, 9, 27, 81, 5, 15, 45])
        .unwrap();
    model.prefill(&mut second, &[2, 4]).unwrap();
    let prefill_calls = executor.calls.lock().unwrap().len();
    assert_eq!(prefill_calls as u64, 2 * moe_layers);
    for token in [1, 2, 3] {
        model.prefill(&mut first, &[token]).unwrap();
    }
    let mut batch = [
        SequenceInput {
            state: &mut first,
            tokens: &[7],
        },
        SequenceInput {
            state: &mut second,
            tokens: &[8],
        },
    ];
    model
        .forward(&mut batch, ninfer_engine::LogitsSelection::Last)
        .unwrap();

    let snapshot = model.profile().snapshot(true);
    let calls = executor.calls.lock().unwrap().clone();
    let is_resident = |id: u32| resident.contains(&id);
    let tally = |calls: &[Vec<u32>]| {
        let cpu: u64 = calls
            .iter()
            .map(|ids| distinct(ids, |id| !is_resident(id)))
            .sum();
        let gpu: u64 = calls.iter().map(|ids| distinct(ids, is_resident)).sum();
        (cpu, gpu)
    };
    let (prefill_cpu, prefill_gpu) = tally(&calls[..prefill_calls]);
    let (decode_cpu, decode_gpu) = tally(&calls[prefill_calls..]);

    let prefill = snapshot.prefill;
    assert_eq!((prefill.forwards, prefill.tokens), (2, 9));
    assert_eq!(prefill.moe_layer_calls, 2 * moe_layers);
    assert_eq!(
        (prefill.cpu_experts, prefill.resident_experts),
        (prefill_cpu, prefill_gpu)
    );
    assert_eq!(prefill.cpu_expert_bytes, prefill_cpu * stride);
    assert_eq!(prefill.resident_expert_bytes, prefill_gpu * stride);

    let decode = snapshot.decode;
    assert_eq!((decode.forwards, decode.tokens), (4, 5));
    assert_eq!(decode.moe_layer_calls, 4 * moe_layers);
    assert_eq!(
        (decode.cpu_experts, decode.resident_experts),
        (decode_cpu, decode_gpu)
    );
    assert_eq!(decode.cpu_expert_bytes, decode_cpu * stride);
    assert_eq!(decode.resident_expert_bytes, decode_gpu * stride);
    // One token's experts are distinct: per single-token call, k experts in all.
    let k = common.num_experts_per_tok as u64;
    let single: Vec<&Vec<u32>> = calls[prefill_calls..prefill_calls + 3 * moe_layers as usize]
        .iter()
        .collect();
    for ids in single {
        assert_eq!(ids.len() as u64, k);
    }

    assert_eq!(snapshot.dense_weight_bytes_per_forward, expected_dense);
    assert!(snapshot.expert_compute_reported);
    for phase in [prefill, decode] {
        assert!(phase.forward_nanos > 0);
        assert!(phase.expert_wait_nanos + phase.transfer_nanos <= phase.forward_nanos);
        // The executor "reported" 1 ns per call: compute is that, not the whole wait.
        assert!(phase.expert_compute_nanos <= phase.expert_wait_nanos);
        assert!(phase.expert_compute_nanos <= phase.moe_layer_calls);
    }
    // The reset zeroed everything.
    let after = model.profile().snapshot(false);
    assert_eq!(after.prefill, Default::default());
    assert_eq!(after.decode, Default::default());
}
