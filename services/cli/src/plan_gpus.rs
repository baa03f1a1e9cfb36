//! The GPUs of the plan: every card the NVIDIA driver reports, in the order and numbering CUDA
//! gives the ones `CUDA_VISIBLE_DEVICES` leaves visible; which of them a run uses (`--gpus`,
//! `--gpu-split`) and, for several, each card's share of the layers, dense weights, KV caches
//! and expert slots (the engine's planner, fed the model's figures).
//!
//! Owns: the card probe, the choice of cards, the per-card plan and its printed lines.
//! Must not touch: the rest of the plan (plan.rs), starting anything.

use anyhow::bail;
use ninfer_engine::moe::gpu_split::{
    parse_gpu_ordinals, parse_gpu_split, plan_gpu_split, select_gpus, CardPlan, GpuDevice,
    GpuSplitError, SplitModel, SplitRequest,
};

use crate::model_facts::ModelFacts;

/// Free and total memory of one GPU, as the single-card plan reads them.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Gpu {
    pub free_bytes: u64,
    pub total_bytes: u64,
}

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Every card the driver reports (`nvidia-smi`: only the engine links CUDA), narrowed and
/// renumbered by `CUDA_VISIBLE_DEVICES`; empty without a driver or a GPU.
pub fn probe_gpus() -> Vec<GpuDevice> {
    let output = std::process::Command::new("nvidia-smi")
        .args([
            "--query-gpu=index,uuid,name,memory.free,memory.total",
            "--format=csv,noheader,nounits",
        ])
        .stderr(std::process::Stdio::null())
        .output();
    match output {
        Ok(output) if output.status.success() => visible_gpus(
            &String::from_utf8_lossy(&output.stdout),
            std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
        ),
        _ => Vec::new(),
    }
}

/// One line of `nvidia-smi --query-gpu=index,uuid,name,memory.free,memory.total`.
struct ReportedGpu {
    index: usize,
    uuid: String,
    name: String,
    free_bytes: u64,
    total_bytes: u64,
}

fn parse_reported_gpu(line: &str) -> Option<ReportedGpu> {
    let fields: Vec<&str> = line.split(',').map(str::trim).collect();
    let [index, uuid, name, free, total] = fields[..] else {
        return None;
    };
    Some(ReportedGpu {
        index: index.parse().ok()?,
        uuid: uuid.to_string(),
        name: name.to_string(),
        free_bytes: free.parse::<u64>().ok()? * MIB,
        total_bytes: total.parse::<u64>().ok()? * MIB,
    })
}

/// The cards CUDA shows a process: with `CUDA_VISIBLE_DEVICES` unset, all of them; else those
/// it names (by index or UUID prefix), in its order, numbered from 0, stopping at the first
/// entry that names none (as CUDA does). The driver's numbering is taken as CUDA's, which holds
/// with `CUDA_DEVICE_ORDER=PCI_BUS_ID` and on machines of one kind of card.
pub fn visible_gpus(report: &str, cuda_visible_devices: Option<&str>) -> Vec<GpuDevice> {
    let reported: Vec<ReportedGpu> = report.lines().filter_map(parse_reported_gpu).collect();
    let chosen: Vec<&ReportedGpu> = match cuda_visible_devices {
        None => reported.iter().collect(),
        Some(list) => {
            let mut chosen: Vec<&ReportedGpu> = Vec::new();
            for entry in list.split(',').map(str::trim) {
                let found = match entry.parse::<usize>() {
                    Ok(index) => reported.iter().find(|gpu| gpu.index == index),
                    Err(_) if entry.len() >= 4 => {
                        let wanted = entry.strip_prefix("GPU-").unwrap_or(entry);
                        reported.iter().find(|gpu| {
                            gpu.uuid
                                .strip_prefix("GPU-")
                                .unwrap_or(&gpu.uuid)
                                .starts_with(wanted)
                        })
                    }
                    Err(_) => None,
                };
                match found {
                    Some(gpu) if !chosen.iter().any(|seen| seen.index == gpu.index) => {
                        chosen.push(gpu)
                    }
                    _ => break,
                }
            }
            chosen
        }
    };
    chosen
        .into_iter()
        .enumerate()
        .map(|(ordinal, gpu)| GpuDevice {
            ordinal,
            name: gpu.name.clone(),
            free_bytes: gpu.free_bytes,
            total_bytes: gpu.total_bytes,
        })
        .collect()
}

/// One card of a `--machine-profile` file's `gpus` list.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileGpu {
    /// Default: `GPU N`.
    pub name: Option<String>,
    pub vram_gib: f64,
    /// Default: all of `vram_gib`.
    pub free_gib: Option<f64>,
}

/// The cards a profile describes, numbered in their order.
pub fn profile_gpus(gpus: &[ProfileGpu]) -> anyhow::Result<Vec<GpuDevice>> {
    gpus.iter()
        .enumerate()
        .map(|(ordinal, gpu)| {
            let bytes = |gib: f64, what: &str| -> anyhow::Result<u64> {
                if !(gib.is_finite() && gib >= 0.0) {
                    bail!("gpus[{ordinal}].{what} {gib}: give a number of GiB");
                }
                Ok((gib * GIB as f64) as u64)
            };
            let total_bytes = bytes(gpu.vram_gib, "vram_gib")?;
            let free_bytes = match gpu.free_gib {
                Some(free) => bytes(free, "free_gib")?.min(total_bytes),
                None => total_bytes,
            };
            Ok(GpuDevice {
                ordinal,
                name: gpu.name.clone().unwrap_or_else(|| format!("GPU {ordinal}")),
                free_bytes,
                total_bytes,
            })
        })
        .collect()
}

/// The memory figures of one card, as the single-card plan reads them.
pub fn gpu_of(device: &GpuDevice) -> Gpu {
    Gpu {
        free_bytes: device.free_bytes,
        total_bytes: device.total_bytes,
    }
}

/// The cards a machine offers: its list, or the one card a machine described by its first
/// card alone carries.
pub fn machine_gpus(gpus: &[GpuDevice], gpu: Option<&Gpu>) -> Vec<GpuDevice> {
    match (gpus, gpu) {
        ([], Some(gpu)) => vec![GpuDevice {
            ordinal: 0,
            name: "GPU 0".into(),
            free_bytes: gpu.free_bytes,
            total_bytes: gpu.total_bytes,
        }],
        (gpus, _) => gpus.to_vec(),
    }
}

/// The cards `--gpus` chooses (the first visible one by default), `--gpu-split` parsed and checked
/// against them. The flags are checked on a machine without a GPU too.
pub fn chosen_gpus(
    available: &[GpuDevice],
    gpus_flag: Option<&str>,
    gpu_split_flag: Option<&str>,
) -> anyhow::Result<(Vec<GpuDevice>, Option<Vec<u64>>)> {
    let requested = gpus_flag.map(parse_gpu_ordinals).transpose()?;
    let split = gpu_split_flag.map(parse_gpu_split).transpose()?;
    let ordinals = select_gpus(requested.as_deref(), available.len(), split.as_deref())?;
    let chosen = ordinals
        .iter()
        .filter_map(|&ordinal| available.get(ordinal).cloned())
        .collect();
    Ok((chosen, split))
}

/// Figures of the model the split spreads (the single-card plan's estimate of each).
pub struct SplitFigures {
    /// KV caches of every sequence at full context less what host RAM keeps, plus the prefix
    /// cache's blocks.
    pub kv_bytes: u64,
    /// The engine's working memory and each card's prefill staging slots.
    pub working_bytes_per_card: u64,
    /// `--moe-gpu-experts N` (or `half`, `all`); `None` for `auto`.
    pub max_slots_per_layer: Option<usize>,
}

/// Each chosen card's share. With one card a card too small is left to the engine (as before
/// several cards were planned): the list is then empty; with several it is an error.
pub fn plan_cards(
    facts: &ModelFacts,
    chosen: &[GpuDevice],
    split: Option<&[u64]>,
    gpu_mem_budget_gib: Option<f64>,
    figures: &SplitFigures,
) -> anyhow::Result<Vec<CardPlan>> {
    if chosen.is_empty() {
        return Ok(Vec::new());
    }
    let common = &facts.common;
    let has_experts = common.num_experts > 0 && common.moe_layers.iter().any(|&moe| moe);
    let model = SplitModel {
        moe_layers: (0..common.num_hidden_layers)
            .map(|layer| has_experts && common.moe_layers.get(layer).copied().unwrap_or(false))
            .collect(),
        dense_bytes: facts.dense_bytes,
        kv_bytes: figures.kv_bytes,
        expert_bank_bytes: if has_experts {
            facts.expert_bank_bytes
        } else {
            0
        },
        experts_per_layer: common.num_experts,
        max_slots_per_layer: figures.max_slots_per_layer,
        tail_dense_bytes: facts.mtp_dense_bytes,
        tail_expert_bytes: if has_experts {
            facts.mtp_expert_bytes
        } else {
            0
        },
        working_bytes_per_card: figures.working_bytes_per_card,
    };
    let planned = plan_gpu_split(
        &model,
        &SplitRequest {
            devices: chosen,
            split_percentages: split,
            memory_cap_bytes: gpu_mem_budget_gib.map(ninfer_engine::moe::placement::gib_to_bytes),
        },
    );
    match planned {
        Ok(cards) => Ok(cards),
        Err(GpuSplitError::CardTooSmall { .. }) if chosen.len() == 1 => Ok(Vec::new()),
        Err(error) => Err(error.into()),
    }
}

/// The `--dry-run` lines of a plan over several cards (one card prints none: the single-card
/// lines say it all).
pub fn print_cards(cards: &[CardPlan]) {
    if cards.len() < 2 {
        return;
    }
    let gib = |bytes: u64| bytes as f64 / GIB as f64;
    for card in cards {
        let tail = if card.holds_tail { " + MTP head" } else { "" };
        println!(
            "gpu {:<9} {}: layers {}..={}{tail}; dense {:.2} GiB, kv {:.2} GiB, working and staging {:.2} GiB, experts {} per MoE layer over {} layers ({:.2} GiB); {:.2} of {:.2} GiB",
            card.ordinal,
            card.name,
            card.first_layer,
            card.last_layer,
            gib(card.dense_bytes),
            gib(card.kv_bytes),
            gib(card.working_bytes),
            card.expert_slots_per_layer,
            card.moe_layers,
            gib(card.expert_bytes),
            gib(card.total_bytes),
            gib(card.available_bytes),
        );
    }
}

/// KV caches of every sequence at full context in GPU memory, less what `--host-kv-mib` keeps
/// in host RAM; every layer counted as attention: an upper bound for hybrid models.
pub fn gpu_kv_bytes(
    facts: &ModelFacts,
    kv_element_bytes: u64,
    max_sequences: usize,
    max_context: usize,
    host_kv_mib: u64,
) -> u64 {
    let common = &facts.common;
    let kv_per_token = common.num_hidden_layers as u64
        * 2
        * (common.num_key_value_heads * common.head_dim) as u64
        * kv_element_bytes.max(1);
    (kv_per_token * max_context as u64 * max_sequences.max(1) as u64)
        .saturating_sub(host_kv_mib * MIB)
}

/// The plan's `device` line: the card it runs on, or the cards it splits over, or the CPU.
pub fn device_description(chosen: &[GpuDevice], gpu: Option<&Gpu>) -> String {
    match gpu {
        Some(_) if chosen.len() > 1 => {
            format!("cuda: GPUs {} (layers split over them)", ordinals(chosen))
        }
        Some(gpu) => format!(
            "cuda: GPU {}, {:.1} of {:.1} GiB free",
            chosen.first().map_or(0, |card| card.ordinal),
            gpu.free_bytes as f64 / GIB as f64,
            gpu.total_bytes as f64 / GIB as f64
        ),
        None => "cpu (no CUDA driver or GPU found)".into(),
    }
}

/// `0,1`.
fn ordinals(cards: &[GpuDevice]) -> String {
    cards
        .iter()
        .map(|card| card.ordinal.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Request;
    use crate::plan_machine::Machine;

    const REPORT: &str = "0, GPU-1111aaaa-0000, NVIDIA RTX 4090, 23000, 24564\n\
                          1, GPU-2222bbbb-0000, NVIDIA RTX 3090, 20000, 24576\n\
                          2, GPU-3333cccc-0000, NVIDIA A6000, 48000, 49140\n";

    fn two_cards(first_gib: u64, second_gib: u64) -> Machine {
        let mut machine = crate::plan::tests::machine(Some(first_gib), 512, 1);
        machine.gpus = profile_gpus(&[
            ProfileGpu {
                name: None,
                vram_gib: first_gib as f64,
                free_gib: None,
            },
            ProfileGpu {
                name: None,
                vram_gib: second_gib as f64,
                free_gib: None,
            },
        ])
        .unwrap();
        machine
    }

    #[test]
    fn one_card_plans_as_before_with_its_share_listed() {
        let facts = crate::plan::tests::facts();
        let machine = crate::plan::tests::machine(Some(80), 512, 1);
        let planned = crate::plan::plan(&facts, &machine, &crate::plan::tests::request()).unwrap();
        assert_eq!(planned.device, "cuda: GPU 0, 79.5 of 80.0 GiB free");
        let [card] = &planned.gpus[..] else {
            panic!("{:?}", planned.gpus)
        };
        assert_eq!((card.first_layer, card.last_layer), (0, 47));
        assert_eq!(card.dense_bytes, facts.dense_bytes);
        // The same memory as the single-card estimate, within a rounding of the expert size.
        let estimate = planned.gpu_experts_estimate.unwrap();
        assert!(
            card.expert_slots_per_layer.abs_diff(estimate) <= 1,
            "{card:?} against {estimate}"
        );
        // Without a GPU: no cards.
        let cpu = crate::plan::tests::machine(None, 512, 1);
        let planned = crate::plan::plan(&facts, &cpu, &crate::plan::tests::request()).unwrap();
        assert!(planned.gpus.is_empty());
    }

    #[test]
    fn two_cards_split_the_layers_and_their_kv_caches() {
        let facts = crate::plan::tests::facts();
        // Unnamed, a second card is left alone: the run stays on the first, as before.
        let planned =
            crate::plan::plan(&facts, &two_cards(48, 24), &crate::plan::tests::request()).unwrap();
        assert_eq!(planned.gpus.len(), 1, "{:?}", planned.gpus);
        let request = Request {
            gpus: Some("0,1".into()),
            ..crate::plan::tests::request()
        };
        let planned = crate::plan::plan(&facts, &two_cards(48, 24), &request).unwrap();
        assert_eq!(planned.gpus.len(), 2, "{:?}", planned.gpus);
        let (first, second) = (&planned.gpus[0], &planned.gpus[1]);
        assert_eq!(first.first_layer, 0);
        assert_eq!(second.first_layer, first.last_layer + 1);
        assert_eq!(second.last_layer, 47);
        assert!(
            first.last_layer + 1 > 24,
            "the bigger card takes more layers"
        );
        assert_eq!(first.dense_bytes + second.dense_bytes, facts.dense_bytes);
        assert!(planned.device.contains("GPUs 0,1"), "{}", planned.device);
        // --host-kv-mib: the KV caches the cards keep shrink by the pools' bytes.
        let with_host_kv = Request {
            host_kv_mib: Some(512),
            ..request.clone()
        };
        let pooled = crate::plan::plan(&facts, &two_cards(48, 24), &with_host_kv).unwrap();
        assert_eq!(pooled.gpus.len(), 2, "{:?}", pooled.gpus);
        let kv = |cards: &[CardPlan]| cards.iter().map(|card| card.kv_bytes).sum::<u64>();
        assert!(
            kv(&pooled.gpus) < kv(&planned.gpus),
            "{:?} against {:?}",
            pooled.gpus,
            planned.gpus
        );
        let json = serde_json::to_value(&planned).unwrap();
        assert_eq!(json["gpus"][1]["first_layer"], second.first_layer);
        assert_eq!(json["machine"]["gpus"][1]["total_bytes"], 24 * GIB);

        // --moe-gpu-experts caps every card's slots.
        let three = Request {
            moe_gpu_experts: Some("3".into()),
            ..request.clone()
        };
        let planned = crate::plan::plan(&facts, &two_cards(48, 24), &three).unwrap();
        assert!(planned
            .gpus
            .iter()
            .all(|card| card.expert_slots_per_layer == 3));

        // --gpu-split sets the shares; --gpus 1 runs on the second card alone.
        let even = Request {
            gpu_split: Some("50,50".into()),
            ..request.clone()
        };
        let planned = crate::plan::plan(&facts, &two_cards(48, 24), &even).unwrap();
        assert_eq!(planned.gpus[0].last_layer, 23);
        // One sequence, so the 24 GiB card holds all 48 layers' KV.
        let second_only = Request {
            gpus: Some("1".into()),
            max_sequences: 1,
            ..request.clone()
        };
        let planned = crate::plan::plan(&facts, &two_cards(48, 24), &second_only).unwrap();
        assert_eq!(planned.gpus.len(), 1);
        assert_eq!(planned.gpus[0].ordinal, 1);
        assert_eq!(planned.machine.gpu.as_ref().unwrap().total_bytes, 24 * GIB);
        assert!(
            planned.device.starts_with("cuda: GPU 1,"),
            "{}",
            planned.device
        );
    }

    #[test]
    fn wrong_gpu_flags_and_small_cards_are_named() {
        let facts = crate::plan::tests::facts();
        let refuse = |machine: &Machine, request: Request| {
            crate::plan::plan(&facts, machine, &request)
                .unwrap_err()
                .to_string()
        };
        let request = crate::plan::tests::request;
        let message = refuse(
            &two_cards(24, 24),
            Request {
                gpus: Some("0,2".into()),
                ..request()
            },
        );
        assert!(message.contains("--gpus 0,2"), "{message}");
        let message = refuse(
            &two_cards(24, 24),
            Request {
                gpus: Some("0,1".into()),
                gpu_split: Some("60,30".into()),
                ..request()
            },
        );
        assert!(message.contains("--gpu-split 60,30"), "{message}");
        let message = refuse(
            &two_cards(24, 24),
            Request {
                gpus: Some("0,1".into()),
                gpu_split: Some("100".into()),
                ..request()
            },
        );
        assert!(
            message.contains("--gpu-split 100") && message.contains("1 shares for 2 GPUs"),
            "{message}"
        );
        // The flags are checked on a machine without a GPU too.
        let message = refuse(
            &crate::plan::tests::machine(None, 64, 1),
            Request {
                gpu_split: Some("abc".into()),
                ..request()
            },
        );
        assert!(message.contains("--gpu-split abc"), "{message}");
        // 32 sequences of 8192 tokens need 24 GiB of KV: the 8 GiB card cannot hold half.
        let message = refuse(
            &two_cards(48, 8),
            Request {
                gpus: Some("0,1".into()),
                gpu_split: Some("50,50".into()),
                ..request()
            },
        );
        assert!(
            message.contains("GPU 1 (GPU 1)") && message.contains("too small"),
            "{message}"
        );
    }

    #[test]
    fn the_visible_cards_follow_cuda_visible_devices() {
        let all = visible_gpus(REPORT, None);
        assert_eq!(all.len(), 3);
        assert_eq!(
            all[2],
            GpuDevice {
                ordinal: 2,
                name: "NVIDIA A6000".into(),
                free_bytes: 48000 * MIB,
                total_bytes: 49140 * MIB,
            }
        );
        // Named by index and by UUID prefix, renumbered in the variable's order.
        let two = visible_gpus(REPORT, Some("2,GPU-1111"));
        let names: Vec<(usize, &str)> = two.iter().map(|g| (g.ordinal, g.name.as_str())).collect();
        assert_eq!(names, vec![(0, "NVIDIA A6000"), (1, "NVIDIA RTX 4090")]);
        assert_eq!(visible_gpus(REPORT, Some("1"))[0].name, "NVIDIA RTX 3090");
        // An entry naming no card ends the list; an empty variable hides every card.
        assert_eq!(visible_gpus(REPORT, Some("0,7,2")).len(), 1);
        assert!(visible_gpus(REPORT, Some("")).is_empty());
        assert!(visible_gpus(REPORT, Some("-1")).is_empty());
        assert!(visible_gpus("[N/A], x, y, [N/A], [N/A]", None).is_empty());
        assert!(visible_gpus("", None).is_empty());
    }

    #[test]
    fn profile_cards_are_numbered_in_order_and_checked() {
        let cards = profile_gpus(&[
            ProfileGpu {
                name: None,
                vram_gib: 24.0,
                free_gib: Some(23.5),
            },
            ProfileGpu {
                name: Some("A6000".into()),
                vram_gib: 48.0,
                free_gib: None,
            },
        ])
        .unwrap();
        assert_eq!(cards[0].name, "GPU 0");
        assert_eq!(cards[0].free_bytes, 47 * GIB / 2);
        assert_eq!((cards[1].ordinal, cards[1].total_bytes), (1, 48 * GIB));
        let message = profile_gpus(&[ProfileGpu {
            name: None,
            vram_gib: -1.0,
            free_gib: None,
        }])
        .unwrap_err()
        .to_string();
        assert!(message.contains("gpus[0].vram_gib -1"), "{message}");
    }
}
