//! The MoE ops of a backend, one body per backend:
//! * the router (softmax / top-k / renormalisation) against the host reference, ties included;
//! * the slotted-expert op against the f32 reference executor, per stored dtype, on random
//!   inputs, including a slot refilled with another expert;
//! * the same for prefill-sized batches (16, 77 and 300 tokens: the CUDA backend's grouped
//!   kernels) with uneven experts — one with most tokens, one with a single token, a resident
//!   one with none — and hidden > 512 (several staged input chunks), each token's row equal
//!   bit for bit to that token computed alone (the per-pair kernels); again with a hidden size
//!   and an expert width that are not multiples of the quantization group (552 and 40);
//! * a routing started on the backend and finished later (several in flight, one dropped)
//!   against the one-shot read-back, and the slotted experts computed from it before it reached
//!   the host against the op fed the host routing;
//! * the golden fixtures with 0, half and all experts resident: the split must not change the
//!   math (teacher-forced NLL and greedy tokens agree; NLL within 2e-2 of transformers).

use std::path::Path;
use std::sync::Arc;

use ninfer_artifact::{Artifact, CommonConfig, DType, ExpertBank, ModelConfig, NO_EXPERT};
use ninfer_convert::{convert_checkpoint, ConvertOptions, NoProgress};
use ninfer_cpu_experts::ExpertLayout;
use ninfer_engine::backend::Routing;
use ninfer_engine::host_math::route_top_k_host;
use ninfer_engine::perplexity::negative_log_likelihood;
use ninfer_engine::sampling::Xoshiro256;
use ninfer_engine::testing::{
    golden_fixture_dir, greedy_tokens, json_numbers, max_abs_difference, teacher_forced_logits,
    tiny_config, write_model, write_tiny_model, TinyArchitecture, TinyModelOptions,
    MOE_GOLDEN_FIXTURES,
};
use ninfer_engine::{
    open_artifact, test_device, Backend, ExpertBatch, ExpertExecutor, Model,
    ReferenceExpertExecutor,
};

const GREEDY_TOKENS: usize = 16;

fn uniform(rng: &mut Xoshiro256, count: usize) -> Vec<f32> {
    (0..count)
        .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
        .collect()
}

/// `[tokens, k]` distinct expert ids per token and positive weights.
fn random_routing(rng: &mut Xoshiro256, tokens: usize, k: usize, experts: usize) -> Routing {
    let mut routing = Routing {
        experts_per_token: k,
        expert_ids: Vec::new(),
        weights: Vec::new(),
    };
    for _ in 0..tokens {
        let mut chosen: Vec<u32> = Vec::new();
        while chosen.len() < k {
            let id = (rng.next_u64() % experts as u64) as u32;
            if !chosen.contains(&id) {
                chosen.push(id);
            }
        }
        routing.expert_ids.extend(&chosen);
        routing
            .weights
            .extend((0..k).map(|_| 0.1 + (rng.next_u64() % 1000) as f32 / 1000.0));
    }
    routing
}

/// The artifact at `path`, its first MoE layer, that layer's expert bank and the bank's layout.
fn first_moe_bank(
    path: &Path,
    common: &CommonConfig,
) -> (Arc<Artifact>, usize, ExpertBank, ExpertLayout) {
    let artifact = open_artifact(path).unwrap();
    let layer = (0..common.num_hidden_layers)
        .find(|&l| common.moe_layers[l])
        .unwrap();
    let bank = artifact
        .expert_bank(&format!("layers.{layer}.moe.experts"))
        .unwrap()
        .clone();
    let layout =
        ExpertLayout::for_bank(&bank, common.hidden_size, common.moe_intermediate_size).unwrap();
    (artifact, layer, bank, layout)
}

/// `slots` slots of `layout` filled by `(slot, expert)` in order (a later fill of a slot
/// replaces its expert).
fn filled_slots<B: Backend>(
    backend: &B,
    common: &CommonConfig,
    layout: &ExpertLayout,
    slots: usize,
    fills: &[(usize, usize)],
    artifact: &Arc<Artifact>,
    bank: &ExpertBank,
) -> B::ExpertSlots {
    let mut expert_slots = backend
        .new_expert_slots(layout, common.num_experts, slots)
        .unwrap();
    for &(slot, expert) in fills {
        backend
            .fill_expert_slot(&mut expert_slots, slot, expert, artifact, bank)
            .unwrap();
    }
    expert_slots
}

/// The slotted-expert op equals the reference executor restricted to the resident experts, for
/// every stored dtype (both dequantize the same stored values and accumulate in f32).
fn slotted_experts_match_the_reference_per_dtype<B: Backend>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    for dtype in [DType::F32, DType::Bf16, DType::Int8, DType::Int4] {
        let path = directory.path().join(format!("tiny-{dtype}.ninfer"));
        let options = TinyModelOptions {
            experts_dtype: dtype,
            ..TinyModelOptions::new(TinyArchitecture::Qwen3Moe)
        };
        let config = write_tiny_model(&path, options).unwrap();
        let common = config.common().clone();
        let (artifact, layer, bank, layout) = first_moe_bank(&path, &common);
        // Expert 1 first goes to slot 0, then slot 0 is refilled with expert 6: expert 1 must
        // no longer count as resident.
        let fills = [(0, 1), (1, 2), (2, 5), (3, 7), (0, 6)];
        let slots = filled_slots(&*backend, &common, &layout, 4, &fills, &artifact, &bank);
        let resident = [2u32, 5, 6, 7];
        let mut rng = Xoshiro256::seed_from_u64(7);
        let tokens = 7;
        let hidden_values = uniform(&mut rng, tokens * common.hidden_size);
        let routing = random_routing(
            &mut rng,
            tokens,
            common.num_experts_per_tok,
            common.num_experts,
        );
        let x = backend
            .upload(&hidden_values, tokens, common.hidden_size)
            .unwrap();
        let got = backend
            .download(&backend.slotted_experts(&slots, &x, &routing).unwrap())
            .unwrap();

        let masked: Vec<u32> = routing
            .expert_ids
            .iter()
            .map(|id| {
                if resident.contains(id) {
                    *id
                } else {
                    NO_EXPERT
                }
            })
            .collect();
        let mut expected = vec![0.0f32; tokens * common.hidden_size];
        ReferenceExpertExecutor::new(Arc::clone(&artifact))
            .compute(
                &ExpertBatch {
                    layer,
                    bank: &bank,
                    hidden_size: common.hidden_size,
                    intermediate_size: common.moe_intermediate_size,
                    hidden: &hidden_values,
                    experts_per_token: routing.experts_per_token,
                    expert_ids: &masked,
                    weights: &routing.weights,
                },
                &mut expected,
            )
            .unwrap();
        let scale = expected.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        let worst = max_abs_difference(&got, &expected);
        println!(
            "{} {dtype} experts: slotted vs reference max |Δ| / max |ref| = {:.2e}",
            backend.name(),
            worst / scale
        );
        assert!(
            worst / scale < 1e-4,
            "{dtype}: slotted experts differ from the reference by {worst} (scale {scale})"
        );
        assert!(
            expected.iter().any(|v| v.abs() > 0.0),
            "{dtype}: the test routed nothing to resident experts"
        );
    }
}
test_device!(slotted_experts_match_the_reference_per_dtype);

/// Prefill-sized batches: every dtype, 16 / 77 / 300 tokens over 10 experts (top-4), hidden 544
/// (two input chunks of the grouped kernels, the second partial), moe intermediate 96. Resident:
/// expert 0 (in ~80% of the tokens: many full tiles and a partial one), 3 (one token), 6 (no
/// token), 7 and 9 (9 refilled over 2); token 0 has no resident expert. The batch must match
/// the reference executor restricted to the resident experts, and each token's row must equal,
/// bit for bit, the same token computed alone: on CUDA the batch takes the grouped kernels and
/// the single token the per-pair ones, which sum in the same order.
fn grouped_slotted_experts_match_the_reference_and_single_tokens<B: Backend>(backend: Arc<B>) {
    check_grouped_slotted_experts(&backend, 544, 96);
}
test_device!(grouped_slotted_experts_match_the_reference_and_single_tokens);

/// As above with widths that are not a multiple of the quantization group of 32: hidden 552
/// (the `gate_up` input: a partial last input chunk ending in a partial group) and expert width
/// 40 (the `down` input). Quantized rows end in a group padded with zero codes; the kernels must
/// add exactly nothing for it (the padded activations are staged as 0).
fn slotted_experts_of_widths_not_multiple_of_the_group<B: Backend>(backend: Arc<B>) {
    check_grouped_slotted_experts(&backend, 552, 40);
}
test_device!(slotted_experts_of_widths_not_multiple_of_the_group);

fn check_grouped_slotted_experts<B: Backend>(
    backend: &Arc<B>,
    hidden_size: usize,
    intermediate_size: usize,
) {
    let directory = tempfile::tempdir().unwrap();
    let mut config = tiny_config(TinyArchitecture::Qwen3Moe);
    let ModelConfig::Qwen3Moe(ref mut qwen3) = config else {
        unreachable!("tiny Qwen3Moe config")
    };
    qwen3.common.hidden_size = hidden_size;
    qwen3.common.moe_intermediate_size = intermediate_size;
    qwen3.common.num_experts = 10;
    qwen3.common.num_experts_per_tok = 4;
    let common = config.common().clone();
    let (h, k) = (common.hidden_size, common.num_experts_per_tok);
    for dtype in [DType::F32, DType::Bf16, DType::Int8, DType::Int4] {
        let path = directory.path().join(format!("wide-{dtype}.ninfer"));
        let options = TinyModelOptions {
            experts_dtype: dtype,
            ..TinyModelOptions::new(TinyArchitecture::Qwen3Moe)
        };
        write_model(&path, &config, options).unwrap();
        let (artifact, layer, bank, layout) = first_moe_bank(&path, &common);
        let fills = [(0, 0), (1, 3), (2, 6), (3, 7), (4, 2), (4, 9)];
        let slots = filled_slots(&**backend, &common, &layout, 5, &fills, &artifact, &bank);
        let resident = [0u32, 3, 6, 7, 9];
        for tokens in [16usize, 77, 300] {
            let mut rng = Xoshiro256::seed_from_u64(tokens as u64);
            let hidden_values = uniform(&mut rng, tokens * h);
            let single = tokens / 2;
            let mut routing = Routing {
                experts_per_token: k,
                expert_ids: Vec::new(),
                weights: Vec::new(),
            };
            for t in 0..tokens {
                let mut chosen: Vec<u32> = if t == 0 {
                    vec![1, 2, 4, 5]
                } else if t == single {
                    vec![3]
                } else if rng.next_u64() % 10 < 8 {
                    vec![0]
                } else {
                    Vec::new()
                };
                while chosen.len() < k {
                    let id = [1u32, 2, 4, 5, 7, 8, 9][(rng.next_u64() % 7) as usize];
                    if !chosen.contains(&id) {
                        chosen.push(id);
                    }
                }
                // The popular expert at varying positions of the token's choices.
                chosen.rotate_left(t % k);
                routing.expert_ids.extend(&chosen);
                routing
                    .weights
                    .extend((0..k).map(|_| 0.1 + (rng.next_u64() % 1000) as f32 / 1000.0));
            }
            // The CUDA backend's grouped path needs ≥ 16 tokens and ≥ 4 slotted pairs per
            // distinct slotted expert (GROUPED_MIN_* in device/experts.rs).
            let slotted: Vec<u32> = routing
                .expert_ids
                .iter()
                .copied()
                .filter(|id| resident.contains(id))
                .collect();
            let mut distinct = slotted.clone();
            distinct.sort_unstable();
            distinct.dedup();
            assert!(tokens >= 16 && slotted.len() >= 4 * distinct.len());
            assert_eq!(slotted.iter().filter(|&&id| id == 3).count(), 1);
            assert!(!slotted.contains(&6));

            let x = backend.upload(&hidden_values, tokens, h).unwrap();
            let got = backend
                .download(&backend.slotted_experts(&slots, &x, &routing).unwrap())
                .unwrap();
            let masked: Vec<u32> = routing
                .expert_ids
                .iter()
                .map(|id| {
                    if resident.contains(id) {
                        *id
                    } else {
                        NO_EXPERT
                    }
                })
                .collect();
            let mut expected = vec![0.0f32; tokens * h];
            ReferenceExpertExecutor::new(Arc::clone(&artifact))
                .compute(
                    &ExpertBatch {
                        layer,
                        bank: &bank,
                        hidden_size: h,
                        intermediate_size: common.moe_intermediate_size,
                        hidden: &hidden_values,
                        experts_per_token: k,
                        expert_ids: &masked,
                        weights: &routing.weights,
                    },
                    &mut expected,
                )
                .unwrap();
            let scale = expected.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            let worst = max_abs_difference(&got, &expected);
            println!(
                "{} {dtype} experts, hidden {h}, width {}, {tokens} tokens: slotted vs reference max |Δ| / max |ref| = {:.2e}",
                backend.name(),
                common.moe_intermediate_size,
                worst / scale
            );
            assert!(
                worst / scale < 1e-4,
                "{dtype}, {tokens} tokens: slotted experts differ from the reference by {worst} (scale {scale})"
            );
            assert!(
                got[..h].iter().all(|&v| v == 0.0),
                "token 0 has no resident expert"
            );
            for t in 0..tokens {
                let one = Routing {
                    experts_per_token: k,
                    expert_ids: routing.expert_ids[t * k..(t + 1) * k].to_vec(),
                    weights: routing.weights[t * k..(t + 1) * k].to_vec(),
                };
                let x_one = backend
                    .upload(&hidden_values[t * h..(t + 1) * h], 1, h)
                    .unwrap();
                let alone = backend
                    .download(&backend.slotted_experts(&slots, &x_one, &one).unwrap())
                    .unwrap();
                let row = &got[t * h..(t + 1) * h];
                if let Some(r) = (0..h).find(|&r| row[r].to_bits() != alone[r].to_bits()) {
                    panic!(
                        "{dtype}, {tokens} tokens: token {t} row {r} is {} in the batch but {} alone (the batch must not change the bits)",
                        row[r], alone[r]
                    );
                }
            }
        }
    }
}

/// The backend's router picks the same experts as the host reference (ties → lower id) with
/// the same weights, for router widths of the supported models (8…512 experts, top-1…10).
fn router_matches_the_host_reference<B: Backend>(backend: Arc<B>) {
    let mut rng = Xoshiro256::seed_from_u64(11);
    for (experts, k) in [(8, 2), (64, 8), (128, 8), (256, 8), (512, 10), (1500, 8)] {
        let tokens = 33;
        let mut logits: Vec<f32> = uniform(&mut rng, tokens * experts)
            .into_iter()
            .map(|v| 4.0 * v)
            .collect();
        // An all-equal row and a row with a tie at the top.
        logits[..experts].iter_mut().for_each(|v| *v = 0.5);
        logits[experts + 3] = 9.0;
        logits[experts + 1] = 9.0;
        let tensor = backend.upload(&logits, tokens, experts).unwrap();
        for normalize in [false, true] {
            let got = backend.route_top_k(&tensor, k, normalize).unwrap();
            let expected = route_top_k_host(&logits, experts, k, normalize);
            assert_eq!(got.experts_per_token, expected.experts_per_token);
            assert_eq!(
                got.expert_ids, expected.expert_ids,
                "{experts} experts top-{k}: different experts"
            );
            assert_eq!(&got.expert_ids[..k.min(3)], &[0, 1, 2][..k.min(3)]);
            assert_eq!(got.expert_ids[k], 1, "tie at the top → lower id first");
            let worst = max_abs_difference(&got.weights, &expected.weights);
            assert!(
                worst < 1e-5,
                "{experts} experts top-{k} normalize={normalize}: weights differ by {worst}"
            );
        }
    }
}
test_device!(router_matches_the_host_reference);

/// A routing started on the backend and finished later gives what the one-shot read-back
/// gives, and the slotted experts computed from it before it reached the host equal the op fed
/// the host routing: decode-sized batches (1, 3, 8 tokens: on a GPU straight from the device
/// routing) and a grouped one (40 tokens: through the host). Several routings may be in flight
/// at once and finish in any order (layers whose routing waits for the forward's end), and one
/// dropped unfinished leaves the backend usable.
fn pending_routing_matches_the_routing_read_back<B: Backend>(backend: Arc<B>) {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("tiny-int8.ninfer");
    let options = TinyModelOptions {
        experts_dtype: DType::Int8,
        ..TinyModelOptions::new(TinyArchitecture::Qwen3Moe)
    };
    let config = write_tiny_model(&path, options).unwrap();
    let common = config.common().clone();
    let (artifact, _, bank, layout) = first_moe_bank(&path, &common);
    let fills = [(0, 1), (1, 4), (2, 6)];
    let slots = filled_slots(&*backend, &common, &layout, 3, &fills, &artifact, &bank);
    let (experts, k, hidden) = (
        common.num_experts,
        common.num_experts_per_tok,
        common.hidden_size,
    );
    let mut rng = Xoshiro256::seed_from_u64(23);
    let mut in_flight = Vec::new();
    for tokens in [1usize, 3, 8, 40] {
        let logits_values: Vec<f32> = uniform(&mut rng, tokens * experts)
            .into_iter()
            .map(|v| 3.0 * v)
            .collect();
        let hidden_values = uniform(&mut rng, tokens * hidden);
        let logits = backend.upload(&logits_values, tokens, experts).unwrap();
        let x = backend.upload(&hidden_values, tokens, hidden).unwrap();
        let pending = backend.start_routing(&logits, k, true, &x, true).unwrap();
        let by_pending = backend
            .slotted_experts_by_pending_routing(&slots, &x, &pending)
            .unwrap();
        in_flight.push((tokens, x, hidden_values, logits_values, pending, by_pending));
    }
    // An unfinished routing dropped mid-way must not disturb the others.
    let dropped_logits = backend
        .upload(&uniform(&mut rng, 5 * experts), 5, experts)
        .unwrap();
    let dropped_x = backend
        .upload(&uniform(&mut rng, 5 * hidden), 5, hidden)
        .unwrap();
    drop(
        backend
            .start_routing(&dropped_logits, k, true, &dropped_x, false)
            .unwrap(),
    );
    // Finished newest first.
    while let Some((tokens, x, hidden_values, logits_values, pending, by_pending)) = in_flight.pop()
    {
        let (routing, read_hidden) = backend.finish_routing(pending).unwrap();
        let expected = route_top_k_host(&logits_values, experts, k, true);
        assert_eq!(routing.experts_per_token, k);
        assert_eq!(
            routing.expert_ids, expected.expert_ids,
            "{tokens} tokens: experts"
        );
        let worst_weight = max_abs_difference(&routing.weights, &expected.weights);
        assert!(
            worst_weight < 1e-5,
            "{tokens} tokens: weights differ by {worst_weight}"
        );
        assert_eq!(
            read_hidden, hidden_values,
            "{tokens} tokens: hidden states read back"
        );
        let by_host = backend
            .download(&backend.slotted_experts(&slots, &x, &routing).unwrap())
            .unwrap();
        let by_pending = backend.download(&by_pending).unwrap();
        assert_eq!(by_pending.len(), by_host.len());
        let worst = max_abs_difference(&by_pending, &by_host);
        println!(
            "{} {tokens} tokens: slotted experts by pending vs host routing max |Δ| = {worst:.2e}",
            backend.name()
        );
        assert!(
            worst <= 1e-6,
            "{tokens} tokens: the two routings' experts differ by {worst}"
        );
        if tokens == 40 {
            assert!(
                by_host.iter().any(|v| v.abs() > 0.0),
                "the test routed nothing to resident experts"
            );
        }
    }
    // Without the hidden states the read-back is the routing alone.
    let logits_values = uniform(&mut rng, 2 * experts);
    let logits = backend.upload(&logits_values, 2, experts).unwrap();
    let x = backend
        .upload(&uniform(&mut rng, 2 * hidden), 2, hidden)
        .unwrap();
    let (routing, read_hidden) = backend
        .finish_routing(backend.start_routing(&logits, k, false, &x, false).unwrap())
        .unwrap();
    assert!(read_hidden.is_empty());
    assert_eq!(
        routing.expert_ids,
        route_top_k_host(&logits_values, experts, k, false).expert_ids
    );
}
test_device!(pending_routing_matches_the_routing_read_back);

/// `--moe-gpu-experts` 0, half and all on the golden fixtures: the same NLL (within f32
/// rounding for f32 experts, within bf16-level tolerance for quantized ones), the same greedy
/// tokens, and for f32 experts the transformers reference within 2e-2.
fn resident_expert_split_does_not_change_the_model<B: Backend>(backend: Arc<B>) {
    let work = tempfile::tempdir().unwrap();
    let mut ran = 0;
    for name in MOE_GOLDEN_FIXTURES {
        let fixture = golden_fixture_dir(name);
        let Ok(text) = std::fs::read_to_string(fixture.join("reference.json")) else {
            println!("SKIPPED golden fixture `{name}`: no reference.json");
            continue;
        };
        ran += 1;
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let tokens: Vec<u32> = json_numbers(&json["nll_token_ids"])
            .into_iter()
            .map(|x| x as u32)
            .collect();
        let reference = json_numbers(&json["token_nll"]);
        let reference = if reference.len() == tokens.len() {
            reference[1..].to_vec()
        } else {
            reference
        };
        let prompt: Vec<u32> = json_numbers(&json["prompts"][0]["prompt_token_ids"])
            .into_iter()
            .map(|x| x as u32)
            .collect();
        for dtype in [DType::F32, DType::Int8, DType::Int4] {
            let path = work.path().join(format!("{name}-{dtype}.ninfer"));
            // Dense weights in f32 so the f32-experts case compares with the f32 reference.
            let options = ConvertOptions {
                experts_dtype: dtype,
                dense_dtype: DType::F32,
                ..ConvertOptions::new(&fixture, &path)
            };
            convert_checkpoint(&options, &NoProgress).unwrap();
            let mut model = Model::open(Arc::clone(&backend), &path).unwrap();
            let common = model.spec().common.clone();
            let mut results = Vec::new();
            for (label, per_layer) in [
                ("0", 0),
                ("half", common.num_experts / 2),
                ("all", common.num_experts),
            ] {
                // Half: the odd experts, so resident and non-resident ids interleave.
                let chosen: Vec<u32> = if per_layer == common.num_experts / 2 {
                    (0..common.num_experts as u32)
                        .filter(|e| e % 2 == 1)
                        .collect()
                } else {
                    (0..per_layer as u32).collect()
                };
                let placement: Vec<Vec<u32>> = (0..common.num_hidden_layers)
                    .map(|l| {
                        if common.moe_layers[l] {
                            chosen.clone()
                        } else {
                            Vec::new()
                        }
                    })
                    .collect();
                let report = model.place_resident_experts(&placement).unwrap();
                assert_eq!(report.experts, chosen.len() * report.layers);
                let nll: Vec<f64> = teacher_forced_logits(&model, &tokens)
                    .unwrap()
                    .iter()
                    .zip(&tokens[1..])
                    .map(|(logits, &next)| negative_log_likelihood(logits, next))
                    .collect();
                let tokens_out = greedy_tokens(&model, &prompt, GREEDY_TOKENS).unwrap();
                results.push((label, nll, tokens_out));
            }
            let (_, base_nll, base_tokens) = &results[0];
            let tolerance = if dtype == DType::F32 { 1e-4 } else { 2e-3 };
            for (label, nll, greedy_tokens) in &results[1..] {
                let difference = nll
                    .iter()
                    .zip(base_nll)
                    .map(|(a, b)| (a - b).abs())
                    .sum::<f64>()
                    / nll.len() as f64;
                println!(
                    "{name} {dtype} experts on {}: {label} resident vs 0: mean |ΔNLL| = {difference:.2e}, greedy {}",
                    backend.name(),
                    if greedy_tokens == base_tokens { "identical" } else { "DIFFERENT" }
                );
                assert!(
                    difference <= tolerance,
                    "{name} {dtype} {label}: mean |ΔNLL| {difference} vs all-CPU experts"
                );
                assert_eq!(
                    greedy_tokens, base_tokens,
                    "{name} {dtype} {label}: greedy tokens differ from all-CPU experts"
                );
            }
            if dtype == DType::F32 {
                for (label, nll, _) in &results {
                    let difference = nll
                        .iter()
                        .zip(&reference)
                        .map(|(a, b)| (a - b).abs())
                        .sum::<f64>()
                        / nll.len() as f64;
                    assert!(
                        difference <= 2e-2,
                        "{name} {label}: mean |ΔNLL| {difference} vs transformers"
                    );
                }
            }
        }
    }
    if ran == 0 {
        println!("SKIPPED all golden fixtures: none is committed under tests/fixtures/");
    }
}
test_device!(resident_expert_split_does_not_change_the_model);
