//! The plan of `ninfer run` / `ninfer serve`: every user value checked against the model and the
//! machine (`plan_machine`) before anything starts (the message names the flag and the limit),
//! and what will run where — expert workers, GPU expert slots, context; `plan_print` prints it.
//!
//! Owns: the value checks and the plan.
//! Must not touch: processes (the supervisor starts them), model files (`model_facts` reads them),
//! the machine probe (`plan_machine`).

use anyhow::bail;
use ninfer_engine::moe::gpu_split::CardPlan;
use ninfer_engine::moe::placement::GpuExpertCount;

use crate::model_facts::{ModelFacts, ModelLocation};
pub use crate::plan_gpus::Gpu;
use crate::plan_machine::Machine;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// GPU memory the engine keeps for its own working buffers, besides weights, KV and slots.
const GPU_WORKING_BYTES: u64 = GIB;

/// Context length used when `--max-context` is not given (or the model's limit when lower).
pub const DEFAULT_MAX_CONTEXT: usize = 8192;

/// The user's values that the plan depends on (shared by `run` and `serve`).
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub max_context: Option<usize>,
    pub moe_threads: Option<usize>,
    pub moe_gpu_experts: Option<String>,
    pub gpu_mem_budget: Option<f64>,
    pub host_kv_mib: Option<u64>,
    /// `--prefix-cache-gib`; `None`: the plan's default ([`default_prefix_cache_bytes`]).
    pub prefix_cache_gib: Option<f64>,
    /// Bytes per cached K/V element (4 for `--kv-dtype f32`, else 2).
    pub kv_element_bytes: u64,
    pub max_sequences: usize,
    pub no_workers: bool,
    /// `--device cpu`: no GPU experts by default, whatever the machine has.
    pub cpu_only: bool,
    pub moe_expert_stats: Option<std::path::PathBuf>,
    pub api: Option<String>,
    /// `--gpus`: CUDA ordinals; `None`: every visible GPU.
    pub gpus: Option<String>,
    /// `--gpu-split`: percent of the layers per chosen GPU.
    pub gpu_split: Option<String>,
}

/// What will start.
#[derive(Debug, serde::Serialize)]
pub struct Plan {
    pub model: String,
    /// The checkpoint is converted before the run (`--dry-run` does not convert).
    pub needs_conversion: bool,
    pub architecture: String,
    /// The model has a vision tower: its chat takes images.
    pub takes_images: bool,
    pub parameters: u64,
    pub device: String,
    /// What `--moe-gpu-experts` asked for (`auto` by default on a machine with a GPU, else `0`).
    pub gpu_experts: String,
    /// Experts per MoE layer in GPU slots; `None` for `auto` (the engine fits them at start).
    pub gpu_experts_per_layer: Option<usize>,
    /// For `auto`: how many per layer fit in the GPU's free memory now, by the plan's estimate.
    pub gpu_experts_estimate: Option<usize>,
    pub gpu_mem_budget_gib: Option<f64>,
    /// Each chosen GPU's share: its layers, dense and KV bytes, expert slots per layer (one
    /// entry on a machine with one GPU; none on the CPU). Several entries are a layer split.
    pub gpus: Vec<CardPlan>,
    pub numa_nodes: Vec<usize>,
    pub expert_workers: Vec<WorkerPlan>,
    pub max_context: usize,
    /// Element type of the KV cache (`--kv-dtype`).
    pub kv_dtype: String,
    /// Tokens the model's multi-token-prediction head drafts per step (0: it has none).
    pub mtp_draft_tokens: usize,
    pub expert_bank_bytes: u64,
    /// The MTP layer's routed experts (placed like one more MoE layer's when it drafts).
    pub mtp_expert_bytes: u64,
    /// The rest of the MTP head, loaded by the engine.
    pub mtp_dense_bytes: u64,
    pub dense_bytes: u64,
    /// The dense-MLP layers' share of `dense_bytes`.
    pub dense_mlp_bytes: u64,
    /// The PLE n-gram tables (qwen4_exp), which stay in host RAM.
    pub ngram_table_bytes: u64,
    pub host_kv_mib: u64,
    /// The engine's prefix cache budget (`--prefix-cache-gib`): on a GPU its blocks are KV
    /// caches (GPU first, the expert slots leave them room), else host RAM.
    pub prefix_cache_bytes: u64,
    /// Host RAM the run uses: the expert banks the workers map and lock, the KV kept in host
    /// RAM, the n-gram tables, and the dense weights when they run on the CPU.
    pub host_ram_bytes: u64,
    /// Whether the expert banks fit in the RAM available now (else the workers read on use).
    pub expert_banks_fit_in_ram: bool,
    pub machine: Machine,
    pub api: Option<String>,
    /// GPU memory of the prefill staging slots (two layer-sized halves for layerwise
    /// prefill), 0 without a GPU or routed experts.
    pub prefill_staging_bytes: u64,
    /// Prompt batches from this many tokens prefill layerwise (the engine's default).
    pub layerwise_min_tokens: usize,
    /// For a model by name not yet on this machine: the disk fetching it takes.
    pub disk: Option<DiskPlan>,
}

/// The disk a model by name takes before it runs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DiskPlan {
    /// Where the artifact goes.
    pub directory: String,
    /// The artifact (converted, or the published one).
    pub artifact_bytes: u64,
    /// The range cache of a streaming conversion at its fullest (0 for a published one).
    pub cache_bytes: u64,
    /// Free space there now, when it could be read.
    pub free_bytes: Option<u64>,
    pub fits: bool,
}

/// The engine's `--moe-prefill-layerwise-min-tokens` default.
const LAYERWISE_MIN_TOKENS: usize = 256;

#[derive(Debug, serde::Serialize)]
pub struct WorkerPlan {
    pub numa_node: usize,
    pub experts: String,
    pub threads: usize,
}

/// Checks every value against the model and the machine, then plans.
pub fn plan(facts: &ModelFacts, machine: &Machine, request: &Request) -> anyhow::Result<Plan> {
    let (chosen_gpus, gpu_split) = crate::plan_gpus::chosen_gpus(
        &crate::plan_gpus::machine_gpus(&machine.gpus, machine.gpu.as_ref()),
        request.gpus.as_deref(),
        request.gpu_split.as_deref(),
    )?;
    // One chosen card is the card the single-GPU figures describe.
    let mut machine_for_cards = machine.clone();
    if let [only] = &chosen_gpus[..] {
        machine_for_cards.gpu = Some(crate::plan_gpus::gpu_of(only));
    }
    let machine = &machine_for_cards;
    let common = &facts.common;
    let limit = common.max_position_embeddings;
    let max_context = match request.max_context {
        Some(0) => bail!("--max-context 0: a sequence needs at least 1 token"),
        Some(context) if context > limit => bail!(
            "--max-context {context}: the model handles at most {limit} tokens \
             (max_position_embeddings in its config)"
        ),
        Some(context) => context,
        None => limit.min(DEFAULT_MAX_CONTEXT),
    };
    if let Some(threads) = request.moe_threads {
        if threads == 0 {
            bail!("--moe-threads 0: give at least 1 (leave it out for one per physical core of each node)");
        }
        if threads > machine.cpus {
            bail!(
                "--moe-threads {threads}: this machine lets ninfer use {} CPUs",
                machine.cpus
            );
        }
    }
    if let Some(gib) = request.gpu_mem_budget {
        if !(gib.is_finite() && gib > 0.0) {
            bail!("--gpu-mem-budget {gib}: give a positive number of GiB");
        }
        if let Some(gpu) = &machine.gpu {
            let total = gpu.total_bytes as f64 / GIB as f64;
            if gib > total {
                bail!("--gpu-mem-budget {gib}: the GPU has {total:.1} GiB");
            }
        }
    }
    let host_kv_mib = request.host_kv_mib.unwrap_or(0);
    if host_kv_mib > 0 && machine.ram_available_bytes > 0 {
        let available_mib = machine.ram_available_bytes / MIB;
        if host_kv_mib > available_mib {
            bail!(
                "--host-kv-mib {host_kv_mib}: this machine has {available_mib} MiB of RAM available"
            );
        }
    }
    if let Some(gib) = request.prefix_cache_gib {
        if !(gib.is_finite() && gib >= 0.0) {
            bail!("--prefix-cache-gib {gib}: give a number of GiB, 0 or more");
        }
    }
    let on_gpu = machine.gpu.is_some() && !request.cpu_only;
    let prefix_cache_bytes = match request.prefix_cache_gib {
        Some(gib) => (gib * GIB as f64) as u64,
        None => default_prefix_cache_bytes(machine, on_gpu, request.gpu_mem_budget, facts),
    };
    if let Some(path) = &request.moe_expert_stats {
        if !path.is_file() {
            bail!("--moe-expert-stats {}: no such file", path.display());
        }
    }
    let has_experts = common.num_experts > 0 && common.moe_layers.iter().any(|&moe| moe);
    let default_count = if machine.gpu.is_some() && !request.cpu_only && has_experts {
        "auto"
    } else {
        "0"
    };
    let gpu_request: GpuExpertCount = request
        .moe_gpu_experts
        .as_deref()
        .unwrap_or(default_count)
        .parse()
        .map_err(|problem| anyhow::anyhow!("--moe-gpu-experts: {problem}"))?;
    let gpu_experts_per_layer = match gpu_request {
        GpuExpertCount::Count(count) if count > 0 && !has_experts => bail!(
            "--moe-gpu-experts {count}: the model has no routed experts (every layer is a dense MLP)"
        ),
        GpuExpertCount::Count(count) if count > common.num_experts => bail!(
            "--moe-gpu-experts {count}: the model has {} experts per layer",
            common.num_experts
        ),
        GpuExpertCount::Count(count) => Some(count),
        GpuExpertCount::Half => Some(common.num_experts / 2),
        GpuExpertCount::All => Some(common.num_experts),
        GpuExpertCount::Auto => None,
    };
    // Two halves of one layer's experts for layerwise prefill, on every card that runs MoE
    // layers.
    let prefill_staging_bytes = if on_gpu && has_experts {
        let moe_layers = common.moe_layers.iter().filter(|&&moe| moe).count().max(1);
        2 * facts.expert_bank_bytes / moe_layers as u64
    } else {
        0
    };
    let gpu_experts_estimate = match gpu_request {
        GpuExpertCount::Auto if has_experts => machine.gpu.as_ref().map(|gpu| {
            fitting_gpu_experts(
                facts,
                gpu,
                request,
                max_context,
                host_kv_mib,
                prefix_cache_bytes + prefill_staging_bytes,
            )
        }),
        _ => None,
    };
    let nodes = &machine.numa_nodes;
    // A model without routed experts gives the workers nothing to compute.
    let expert_workers = if request.no_workers || !has_experts {
        Vec::new()
    } else {
        nodes
            .iter()
            .enumerate()
            .map(|(index, node)| WorkerPlan {
                numa_node: node.node,
                experts: if nodes.len() == 1 {
                    "all".into()
                } else {
                    format!("shard={index}/{}", nodes.len())
                },
                threads: request.moe_threads.unwrap_or(node.cores),
            })
            .collect()
    };
    let (model, needs_conversion) = match &facts.location {
        ModelLocation::Artifact(path) => (path.display().to_string(), false),
        ModelLocation::Checkpoint(path) => (path.display().to_string(), true),
    };
    let dense_on_cpu = machine.gpu.is_none() || request.cpu_only;
    // The workers map the MTP layer's bank with the others.
    let host_ram_bytes = facts.expert_bank_bytes
        + facts.mtp_expert_bytes
        + facts.ngram_table_bytes
        + host_kv_mib * MIB
        + if on_gpu { 0 } else { prefix_cache_bytes }
        + if dense_on_cpu {
            facts.dense_bytes + facts.mtp_dense_bytes
        } else {
            0
        };
    let gpus = if on_gpu {
        crate::plan_gpus::plan_cards(
            facts,
            &chosen_gpus,
            gpu_split.as_deref(),
            request.gpu_mem_budget,
            &crate::plan_gpus::SplitFigures {
                kv_bytes: crate::plan_gpus::gpu_kv_bytes(
                    facts,
                    request.kv_element_bytes,
                    request.max_sequences,
                    max_context,
                    host_kv_mib,
                ) + prefix_cache_bytes,
                working_bytes_per_card: GPU_WORKING_BYTES + prefill_staging_bytes,
                max_slots_per_layer: gpu_experts_per_layer,
            },
        )?
    } else {
        Vec::new()
    };
    Ok(Plan {
        model,
        needs_conversion,
        architecture: facts.architecture.clone(),
        takes_images: facts.vision_bytes > 0,
        parameters: facts.parameters,
        device: crate::plan_gpus::device_description(&chosen_gpus, machine.gpu.as_ref()),
        gpu_experts: gpu_request.to_string(),
        gpu_experts_per_layer,
        gpu_experts_estimate,
        prefill_staging_bytes,
        layerwise_min_tokens: LAYERWISE_MIN_TOKENS,
        disk: None,
        gpu_mem_budget_gib: request.gpu_mem_budget,
        gpus,
        numa_nodes: nodes.iter().map(|node| node.node).collect(),
        expert_workers,
        max_context,
        kv_dtype: if request.kv_element_bytes == 4 {
            "f32".into()
        } else {
            "bf16".into()
        },
        mtp_draft_tokens: usize::from(facts.mtp_layers > 0),
        expert_bank_bytes: facts.expert_bank_bytes,
        mtp_expert_bytes: facts.mtp_expert_bytes,
        mtp_dense_bytes: facts.mtp_dense_bytes,
        dense_bytes: facts.dense_bytes,
        dense_mlp_bytes: facts.dense_mlp_bytes,
        ngram_table_bytes: facts.ngram_table_bytes,
        host_kv_mib,
        prefix_cache_bytes,
        host_ram_bytes,
        expert_banks_fit_in_ram: machine.ram_available_bytes == 0
            || facts.expert_bank_bytes + facts.mtp_expert_bytes <= machine.ram_available_bytes,
        machine: machine.clone(),
        api: request.api.clone(),
    })
}

/// The prefix cache's budget when `--prefix-cache-gib` is not given. On the CPU: an eighth of
/// the RAM available less the expert banks and n-gram tables the run maps, at most 16 GiB; 2 GiB
/// on a machine whose RAM is unknown. On a GPU, whose blocks are KV caches in GPU memory taken
/// from the expert slots: a sixteenth of the card (or of `--gpu-mem-budget`), at most 2 GiB —
/// 1 GiB on a 16 GB card holds an agent's ~20K-token prompt with its recurrent-state
/// checkpoints several times over, for ~8% of the slots' memory.
fn default_prefix_cache_bytes(
    machine: &Machine,
    on_gpu: bool,
    gpu_mem_budget_gib: Option<f64>,
    facts: &ModelFacts,
) -> u64 {
    const MOST: u64 = 16 * GIB;
    const MOST_ON_GPU: u64 = 2 * GIB;
    let room = match (&machine.gpu, on_gpu) {
        (Some(gpu), true) => {
            let card = match gpu_mem_budget_gib {
                Some(gib) if gib.is_finite() && gib > 0.0 => (gib * GIB as f64) as u64,
                _ => gpu.total_bytes,
            };
            return (card / 16).min(MOST_ON_GPU);
        }
        _ if machine.ram_available_bytes == 0 => return 2 * GIB,
        _ => machine.ram_available_bytes.saturating_sub(
            facts.expert_bank_bytes + facts.mtp_expert_bytes + facts.ngram_table_bytes,
        ),
    };
    (room / 8).min(MOST)
}

/// Experts per MoE layer that fit in the GPU memory left after the dense weights, the KV caches
/// of every sequence at full context (less what `--host-kv-mib` keeps in host RAM), the
/// engine's working memory and `reserved_bytes` (the prefix cache's blocks and the prefill
/// staging slots). An estimate for the plan: the engine measures again at start.
fn fitting_gpu_experts(
    facts: &ModelFacts,
    gpu: &Gpu,
    request: &Request,
    max_context: usize,
    host_kv_mib: u64,
    reserved_bytes: u64,
) -> usize {
    let common = &facts.common;
    let budget = match request.gpu_mem_budget {
        Some(gib) => {
            let used = gpu.total_bytes.saturating_sub(gpu.free_bytes);
            ((gib * GIB as f64) as u64).saturating_sub(used)
        }
        None => gpu.free_bytes,
    };
    let kv = crate::plan_gpus::gpu_kv_bytes(
        facts,
        request.kv_element_bytes,
        request.max_sequences,
        max_context,
        host_kv_mib,
    );
    // `ninfer run` drafts with the MTP head when the model has one: its weights load beside
    // the dense ones and its layer's experts take slots like one more MoE layer's.
    let left = budget
        .saturating_sub(facts.dense_bytes + facts.mtp_dense_bytes)
        .saturating_sub(kv)
        .saturating_sub(reserved_bytes)
        .saturating_sub(GPU_WORKING_BYTES);
    let per_expert_everywhere = ((facts.expert_bank_bytes + facts.mtp_expert_bytes)
        / common.num_experts.max(1) as u64)
        .max(1);
    ((left / per_expert_everywhere) as usize).min(common.num_experts)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::plan_machine::NumaNode;
    use std::path::PathBuf;

    pub(crate) fn facts() -> ModelFacts {
        let config = ninfer_convert::read_config(
            &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe"),
        )
        .unwrap();
        let mut common = config.model.common().clone();
        // A large model's proportions: 128 experts, 48 layers, 60 GiB of banks, 4 GiB dense.
        common.num_experts = 128;
        common.num_hidden_layers = 48;
        common.moe_layers = vec![true; 48];
        common.num_key_value_heads = 4;
        common.head_dim = 128;
        common.max_position_embeddings = 32768;
        ModelFacts {
            location: ModelLocation::Artifact(PathBuf::from("big.ninfer")),
            architecture: "qwen3_moe".into(),
            common,
            parameters: 30_000_000_000,
            expert_bank_bytes: 60 * GIB,
            dense_bytes: 4 * GIB,
            dense_mlp_bytes: 0,
            ngram_table_bytes: 0,
            mtp_layers: 1,
            mtp_expert_bytes: 0,
            mtp_dense_bytes: 0,
            vision_bytes: 0,
        }
    }

    /// A dense model's proportions: 64 layers, no experts, 50 GiB of dense weights (40 of them
    /// dense MLPs).
    fn dense_facts() -> ModelFacts {
        let mut facts = facts();
        facts.architecture = "qwen3_5".into();
        facts.common.num_experts = 0;
        facts.common.num_experts_per_tok = 0;
        facts.common.num_hidden_layers = 64;
        facts.common.moe_layers = vec![false; 64];
        facts.expert_bank_bytes = 0;
        facts.dense_bytes = 50 * GIB;
        facts.dense_mlp_bytes = 40 * GIB;
        facts
    }

    pub(crate) fn machine(gpu_gib: Option<u64>, ram_gib: u64, nodes: usize) -> Machine {
        Machine {
            cpus: 16 * nodes,
            numa_nodes: (0..nodes)
                .map(|node| NumaNode {
                    node,
                    cpus: 16,
                    cores: 16,
                })
                .collect(),
            ram_total_bytes: ram_gib * GIB,
            ram_available_bytes: ram_gib * GIB - 2 * GIB,
            gpu: gpu_gib.map(|gib| Gpu {
                free_bytes: gib * GIB - GIB / 2,
                total_bytes: gib * GIB,
            }),
            gpus: Vec::new(),
        }
    }

    /// The figures below leave the prefix cache out (its own test says what it takes).
    pub(crate) fn request() -> Request {
        Request {
            kv_element_bytes: 2,
            max_sequences: 32,
            prefix_cache_gib: Some(0.0),
            ..Request::default()
        }
    }

    #[test]
    fn the_prefix_cache_has_a_default_budget_by_device_and_the_slots_leave_it_room() {
        let facts = facts();
        let defaults = Request {
            prefix_cache_gib: None,
            ..request()
        };
        // On the GPU a sixteenth of the card, at most 2 GiB, taken from the slots (102 per
        // layer without it); a 16 GiB budget gives 1 GiB.
        let server = plan(&facts, &machine(Some(80), 512, 2), &defaults).unwrap();
        assert_eq!(server.prefix_cache_bytes, 2 * GIB);
        let without_cache = plan(&facts, &machine(Some(80), 512, 2), &request()).unwrap();
        assert_eq!(without_cache.gpu_experts_estimate, Some(102));
        assert!(server.gpu_experts_estimate < Some(102), "{server:?}");
        let sixteen = Request {
            gpu_mem_budget: Some(16.0),
            ..defaults.clone()
        };
        let card = plan(&facts, &machine(Some(80), 512, 2), &sixteen).unwrap();
        assert_eq!(card.prefix_cache_bytes, GIB);
        // Without a GPU it is host RAM: an eighth of what the banks leave, at most 16 GiB.
        let laptop = plan(&facts, &machine(None, 128, 1), &defaults).unwrap();
        assert_eq!(laptop.prefix_cache_bytes, (126 * GIB - 60 * GIB) / 8);
        let without = plan(&facts, &machine(None, 128, 1), &request()).unwrap();
        assert_eq!(
            laptop.host_ram_bytes,
            without.host_ram_bytes + laptop.prefix_cache_bytes
        );
        let big = plan(&facts, &machine(None, 1024, 1), &defaults).unwrap();
        assert_eq!(big.prefix_cache_bytes, 16 * GIB);
        let asked = Request {
            prefix_cache_gib: Some(2.5),
            ..request()
        };
        let asked = plan(&facts, &machine(Some(80), 512, 2), &asked).unwrap();
        assert_eq!(asked.prefix_cache_bytes, 5 * GIB / 2);
        // Asked for on the 80 GiB card, it is taken from the slots' 50.5 GiB → 48 GiB → 102.
        assert!(
            asked.gpu_experts_estimate < Some(107),
            "{:?}",
            asked.gpu_experts_estimate
        );
        let nonsense = Request {
            prefix_cache_gib: Some(-1.0),
            ..request()
        };
        let message = plan(&facts, &machine(None, 128, 1), &nonsense)
            .unwrap_err()
            .to_string();
        assert!(message.contains("--prefix-cache-gib -1"), "{message}");
    }

    /// Three machines: a laptop without a GPU, a workstation with a 24 GiB card, a two-socket
    /// server with an 80 GiB card.
    #[test]
    fn plans_for_three_machines() {
        let facts = facts();
        let cpu_only = plan(&facts, &machine(None, 32, 1), &request()).unwrap();
        assert_eq!(cpu_only.gpu_experts, "0");
        assert_eq!(cpu_only.gpu_experts_per_layer, Some(0));
        assert!(
            !cpu_only.expert_banks_fit_in_ram,
            "60 GiB of banks in 30 GiB"
        );
        assert_eq!(cpu_only.max_context, DEFAULT_MAX_CONTEXT);

        let workstation = plan(&facts, &machine(Some(24), 128, 1), &request()).unwrap();
        assert_eq!(workstation.gpu_experts, "auto");
        assert_eq!(workstation.gpu_experts_per_layer, None);
        // 23.5 GiB free − 4 dense − 1 working − 24 KV (32 × 8192 tokens × 96 KiB) → none fit.
        assert_eq!(workstation.gpu_experts_estimate, Some(0));
        assert!(workstation.expert_banks_fit_in_ram);
        let single_sequence = Request {
            max_sequences: 1,
            ..request()
        };
        let workstation = plan(&facts, &machine(Some(24), 128, 1), &single_sequence).unwrap();
        // 23.5 − 4 − 1 − 0.75 − 2.5 (staging slots) = 15.25 GiB over 0.47 GiB per expert
        // across layers → 32.
        assert_eq!(workstation.gpu_experts_estimate, Some(32));

        let server = plan(&facts, &machine(Some(80), 512, 2), &request()).unwrap();
        // 79.5 − 4 − 1 − 24 − 2.5 = 48 GiB → 102 per layer.
        assert_eq!(server.gpu_experts_estimate, Some(102));
        assert_eq!(server.expert_workers.len(), 2);
        assert_eq!(server.expert_workers[1].experts, "shard=1/2");
        let json = serde_json::to_value(&server).unwrap();
        assert_eq!(json["machine"]["gpu"]["total_bytes"], 80 * GIB);
    }

    #[test]
    fn nonsense_values_name_the_flag_and_the_limit() {
        let facts = facts();
        let machine = machine(Some(24), 64, 1);
        let refuse = |request: Request| plan(&facts, &machine, &request).unwrap_err().to_string();
        let message = refuse(Request {
            max_context: Some(40000),
            ..request()
        });
        assert!(
            message.contains("--max-context 40000") && message.contains("32768"),
            "{message}"
        );
        let message = refuse(Request {
            moe_threads: Some(99),
            ..request()
        });
        assert!(
            message.contains("--moe-threads 99") && message.contains("16"),
            "{message}"
        );
        let message = refuse(Request {
            moe_gpu_experts: Some("129".into()),
            ..request()
        });
        assert!(
            message.contains("--moe-gpu-experts 129") && message.contains("128"),
            "{message}"
        );
        let message = refuse(Request {
            gpu_mem_budget: Some(30.0),
            ..request()
        });
        assert!(
            message.contains("--gpu-mem-budget 30") && message.contains("24.0"),
            "{message}"
        );
        let message = refuse(Request {
            host_kv_mib: Some(1 << 20),
            ..request()
        });
        assert!(message.contains("--host-kv-mib 1048576"), "{message}");
        let message = refuse(Request {
            max_context: Some(0),
            ..request()
        });
        assert!(message.contains("--max-context 0"), "{message}");
    }

    #[test]
    fn a_model_without_experts_plans_no_workers_and_no_gpu_experts() {
        let facts = dense_facts();
        for machine in [machine(None, 128, 1), machine(Some(80), 512, 2)] {
            let planned = plan(&facts, &machine, &request()).unwrap();
            assert!(planned.expert_workers.is_empty(), "{planned:?}");
            assert_eq!(planned.gpu_experts, "0");
            assert_eq!(planned.gpu_experts_per_layer, Some(0));
            assert_eq!(planned.gpu_experts_estimate, None);
            assert_eq!(planned.dense_mlp_bytes, 40 * GIB);
        }
        let auto = Request {
            moe_gpu_experts: Some("auto".into()),
            ..request()
        };
        let planned = plan(&facts, &machine(Some(80), 512, 1), &auto).unwrap();
        assert_eq!(planned.gpu_experts_estimate, None);
        let message = plan(
            &facts,
            &machine(Some(80), 512, 1),
            &Request {
                moe_gpu_experts: Some("4".into()),
                ..request()
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            message.contains("--moe-gpu-experts 4") && message.contains("no routed experts"),
            "{message}"
        );
    }

    #[test]
    fn ngram_tables_count_as_host_ram_and_never_as_gpu_weights() {
        let mut facts = facts();
        facts.architecture = "qwen4_exp".into();
        facts.ngram_table_bytes = 90 * GIB;
        let machine = machine(Some(80), 512, 1);
        let planned = plan(&facts, &machine, &request()).unwrap();
        assert_eq!(planned.ngram_table_bytes, 90 * GIB);
        assert_eq!(
            planned.dense_bytes,
            4 * GIB,
            "the tables are no dense weights"
        );
        assert_eq!(
            planned.host_ram_bytes,
            planned.expert_bank_bytes + 90 * GIB + planned.host_kv_mib * MIB
        );
    }

    #[test]
    fn host_kv_leaves_room_for_experts() {
        let facts = facts();
        let machine = machine(Some(24), 128, 1);
        let with_host_kv = Request {
            host_kv_mib: Some(24 * 1024),
            ..request()
        };
        let planned = plan(&facts, &machine, &with_host_kv).unwrap();
        // 23.5 − 4 − 1 − (24 − 24) − 2.5 = 16 GiB → 34 per layer.
        assert_eq!(planned.gpu_experts_estimate, Some(34));
    }

    #[test]
    fn the_mtp_layer_counts_as_one_more_moe_layer() {
        let machine = machine(Some(80), 512, 1);
        let without = plan(&facts(), &machine, &request()).unwrap();
        // The MTP layer: 1.25 GiB of experts (one more layer's worth of 60 GiB over 48) and
        // half a GiB of the rest of its block.
        let mut with_mtp = facts();
        with_mtp.mtp_expert_bytes = 60 * GIB / 48;
        with_mtp.mtp_dense_bytes = GIB / 2;
        let planned = plan(&with_mtp, &machine, &request()).unwrap();
        // 79.5 − 4.5 − 1 − 24 − 2.5 (staging) = 47.5 GiB over 49 layers × 1/128 × 1.25 GiB
        // → 99 per layer (102 without the MTP layer).
        assert_eq!(without.gpu_experts_estimate, Some(102));
        assert_eq!(planned.gpu_experts_estimate, Some(99));
        assert_eq!(
            planned.host_ram_bytes,
            without.host_ram_bytes + 60 * GIB / 48,
            "the workers map the MTP layer's bank too"
        );
        assert_eq!(planned.mtp_expert_bytes, 60 * GIB / 48);
    }
}
