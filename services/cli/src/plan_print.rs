//! The plan as `ninfer run` / `ninfer serve` print it before anything starts: the model, the
//! device and cards, the expert workers, memory, caches and context, one line each.
//!
//! Owns: the text of the printed plan.
//! Must not touch: the plan's figures (`plan` makes them; this only shows them).

use crate::plan::Plan;

const GIB: u64 = 1 << 30;

pub fn print_plan(plan: &Plan) {
    let gib = |bytes: u64| bytes as f64 / GIB as f64;
    println!(
        "model         {} ({}, {:.2}B parameters)",
        plan.model,
        plan.architecture,
        plan.parameters as f64 / 1e9
    );
    if plan.needs_conversion {
        println!("              a checkpoint: converted once (bf16) before the first run");
    }
    if let Some(disk) = &plan.disk {
        let free = disk
            .free_bytes
            .map_or("free space unknown".to_string(), |free| {
                format!("{:.2} GB free", free as f64 / 1e9)
            });
        println!(
            "disk          artifact {:.2} GB + range cache up to {:.2} GB in {}: {} ({free})",
            disk.artifact_bytes as f64 / 1e9,
            disk.cache_bytes as f64 / 1e9,
            disk.directory,
            if disk.fits { "fits" } else { "does NOT fit" }
        );
    }
    println!("device        {}", plan.device);
    crate::plan_gpus::print_cards(&plan.gpus);
    match (plan.gpu_experts_per_layer, plan.gpu_experts_estimate) {
        _ if plan.expert_bank_bytes == 0 => {
            println!("gpu experts   none (no routed experts: every layer is a dense MLP)")
        }
        (Some(count), _) => println!("gpu experts   {count} per MoE layer"),
        (None, Some(estimate)) => println!(
            "gpu experts   auto: about {estimate} per MoE layer fit now (the engine fits them at start)"
        ),
        (None, None) => {
            println!("gpu experts   auto (as many per MoE layer as fit; the engine decides)")
        }
    }
    if let Some(gib) = plan.gpu_mem_budget_gib {
        println!("gpu memory    budget {gib} GiB");
    }
    for worker in &plan.expert_workers {
        println!(
            "expert worker NUMA node {}: experts {}, {} threads",
            worker.numa_node, worker.experts, worker.threads
        );
    }
    let dense_mlp = if plan.dense_mlp_bytes > 0 {
        format!(", {:.2} GiB of it dense MLPs", gib(plan.dense_mlp_bytes))
    } else {
        String::new()
    };
    if plan.ngram_table_bytes > 0 {
        println!(
            "memory        n-gram tables {:.2} GiB (host RAM, read by the engine)",
            gib(plan.ngram_table_bytes)
        );
    }
    if plan.expert_bank_bytes == 0 {
        println!(
            "memory        dense {:.2} GiB (engine{dense_mlp}); no expert banks",
            gib(plan.dense_bytes)
        );
    } else {
        println!(
            "memory        expert banks {:.2} GiB (locked by the workers), dense {:.2} GiB (engine{dense_mlp})",
            gib(plan.expert_bank_bytes),
            gib(plan.dense_bytes)
        );
    }
    if plan.mtp_draft_tokens > 0 && plan.mtp_expert_bytes + plan.mtp_dense_bytes > 0 {
        println!(
            "memory        MTP head {:.2} GiB (engine), its layer's experts {:.2} GiB (placed like one more MoE layer's)",
            gib(plan.mtp_dense_bytes),
            gib(plan.mtp_expert_bytes)
        );
    }
    if plan.machine.ram_total_bytes > 0 {
        println!(
            "ram           {:.1} GiB available of {:.1} GiB{}",
            gib(plan.machine.ram_available_bytes),
            gib(plan.machine.ram_total_bytes),
            if plan.expert_banks_fit_in_ram {
                ""
            } else {
                " — the expert banks do not fit: the workers read them from disk on use (slow)"
            }
        );
    }
    if plan.host_kv_mib > 0 {
        println!("kv cache      {} MiB in host RAM", plan.host_kv_mib);
    }
    if plan.prefix_cache_bytes > 0 {
        println!(
            "prefix cache  {:.2} GiB: prompts reuse what earlier prompts computed, by blocks of 256 tokens, least recently used evicted",
            gib(plan.prefix_cache_bytes)
        );
    } else {
        println!("prefix cache  off");
    }
    if plan.prefill_staging_bytes > 0 {
        println!(
            "prefill       layerwise from {} tokens: staging slots {:.2} GiB on the GPU (two halves of one layer's experts, streamed over PCIe while the layer before computes)",
            plan.layerwise_min_tokens,
            gib(plan.prefill_staging_bytes)
        );
    }
    println!("context       {} tokens per sequence", plan.max_context);
    if let Some(api) = &plan.api {
        println!("api           {api} (OpenAI /v1/chat/completions, Anthropic /v1/messages, gRPC)");
    }
}
