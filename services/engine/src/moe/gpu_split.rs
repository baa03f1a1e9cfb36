//! Several GPUs in one machine: which cards a run uses (`--gpus`), how the decoder layers are
//! split over them (`--gpu-split`, else in proportion to each card's memory) and how many hot
//! experts per layer each card holds for the layers it owns.
//!
//! The split is a pipeline: every card owns one contiguous range of layers with their dense
//! weights, KV caches and expert slots; the ranges cover every layer once, in order. A card's
//! share of the dense weights and KV caches is its share of the layers; the MTP head, which
//! follows the last layer, goes to the last card. What a card has left after its share and its
//! working memory becomes expert slots for its own MoE layers, the same count for each.
//!
//! The engine runs the split (`crate::model`'s `Model::load_pipeline`, one backend per card,
//! the hidden state crossing from card to card by a peer copy where the driver allows it, else
//! through host memory): its layer ranges are [`layer_ranges`] of `--gpu-split` or of each
//! card's usable memory, as [`plan_gpu_split`] draws them, and each card fills the expert slots
//! of its own MoE layers from the memory it has left after loading (the single-card rule, per
//! card). The MTP head runs on the last card (`--spec mtp`), its embeddings looked up on the
//! first. `--host-kv-mib` gives each card a page-locked KV pool of its own, in proportion to the
//! KV caches its layers make ([`stage_host_kv_bytes`]). On a split model the staged prefill
//! route and layerwise prefill run on every card (its own staging slots for its own layers),
//! and decode steps go through step graphs spanning every card.
//!
//! Owns: the device list the planner reads, the flag parsers and checks, the pure split.
//! Must not touch: the CUDA driver (callers enumerate the cards), starting anything.

use std::ops::Range;

/// One GPU as the planner sees it: its CUDA ordinal among the visible cards
/// (`CUDA_VISIBLE_DEVICES` applied), its name and memory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GpuDevice {
    pub ordinal: usize,
    pub name: String,
    pub free_bytes: u64,
    pub total_bytes: u64,
}

/// A wrong `--gpus` / `--gpu-split` value, or a card that cannot hold its share.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuSplitError {
    #[error("--gpus {value}: {problem}")]
    Gpus { value: String, problem: String },
    #[error("--gpu-split {value}: {problem}")]
    Split { value: String, problem: String },
    #[error(
        "GPU {ordinal} ({name}) is too small for its share of the model: layers {first_layer}..={last_layer} need {needed_bytes} bytes of dense weights, KV caches and working memory, and it has {available_bytes} bytes; give it fewer layers (--gpu-split) or leave it out (--gpus)"
    )]
    CardTooSmall {
        ordinal: usize,
        name: String,
        first_layer: usize,
        last_layer: usize,
        needed_bytes: u64,
        available_bytes: u64,
    },
    #[error("{cards} GPUs for {layers} decoder layers: every card needs at least one layer")]
    MoreCardsThanLayers { cards: usize, layers: usize },
    #[error("no GPU to plan for")]
    NoCards,
}

/// Parses `--gpus`: comma-separated CUDA ordinals, each once (`0,1`).
pub fn parse_gpu_ordinals(text: &str) -> Result<Vec<usize>, GpuSplitError> {
    let problem = |problem: &str| GpuSplitError::Gpus {
        value: text.to_string(),
        problem: problem.to_string(),
    };
    let mut ordinals = Vec::new();
    for field in text.split(',') {
        let ordinal: usize = field
            .trim()
            .parse()
            .map_err(|_| problem("give GPU ordinals separated by commas, like 0,1"))?;
        if ordinals.contains(&ordinal) {
            return Err(problem("each GPU once"));
        }
        ordinals.push(ordinal);
    }
    Ok(ordinals)
}

/// Parses `--gpu-split`: one whole percentage per card, each at least 1, summing to 100.
pub fn parse_gpu_split(text: &str) -> Result<Vec<u64>, GpuSplitError> {
    let problem = |problem: &str| GpuSplitError::Split {
        value: text.to_string(),
        problem: problem.to_string(),
    };
    let mut percentages = Vec::new();
    for field in text.split(',') {
        let percentage: u64 = field
            .trim()
            .parse()
            .map_err(|_| problem("give whole percentages separated by commas, like 60,40"))?;
        if percentage == 0 {
            return Err(problem("every card needs a share of at least 1%"));
        }
        percentages.push(percentage);
    }
    if percentages.iter().sum::<u64>() != 100 {
        return Err(problem("the percentages must sum to 100"));
    }
    Ok(percentages)
}

/// The ordinals a run uses: `requested` (`--gpus`), each of which must be visible, else the
/// first visible card (several cards are used only when named: a machine with two cards keeps
/// running on one as it did);
/// `split` (`--gpu-split`), when given, must have one share per card chosen.
pub fn select_gpus(
    requested: Option<&[usize]>,
    visible: usize,
    split: Option<&[u64]>,
) -> Result<Vec<usize>, GpuSplitError> {
    let chosen = match requested {
        Some(ordinals) => {
            if let Some(&missing) = ordinals.iter().find(|&&ordinal| ordinal >= visible) {
                return Err(GpuSplitError::Gpus {
                    value: join(ordinals),
                    problem: format!(
                        "GPU {missing} is not visible ({visible} visible, ordinals 0..{visible}; CUDA_VISIBLE_DEVICES applies)"
                    ),
                });
            }
            ordinals.to_vec()
        }
        None => (0..visible.min(1)).collect(),
    };
    if let Some(split) = split {
        if split.len() != chosen.len() {
            return Err(GpuSplitError::Split {
                value: join(split),
                problem: format!(
                    "{} shares for {} GPUs ({}): give one share per GPU",
                    split.len(),
                    chosen.len(),
                    join(&chosen)
                ),
            });
        }
    }
    Ok(chosen)
}

/// `--host-kv-mib` over the stages of a split: each stage's page-locked KV pool in proportion
/// to the KV caches its layers make (`attention_layers[stage]`: its attention layers, the MTP
/// head's on the last), so every stage's caches move to the host at the same point; the bytes a
/// rounding leaves go to the last stage. One stage takes them all.
pub fn stage_host_kv_bytes(host_bytes: u64, attention_layers: &[usize]) -> Vec<u64> {
    let total: u64 = attention_layers.iter().map(|&layers| layers as u64).sum();
    if total == 0 {
        // No stage makes KV caches: no pool anywhere.
        return vec![0; attention_layers.len()];
    }
    let mut shares: Vec<u64> = attention_layers
        .iter()
        .map(|&layers| (host_bytes as u128 * layers as u128 / total as u128) as u64)
        .collect();
    let given: u64 = shares.iter().sum();
    if let Some(last) = shares.last_mut() {
        *last += host_bytes - given;
    }
    shares
}

/// The decoder layers of each card: contiguous ranges in proportion to `shares` (`--gpu-split`,
/// or each card's usable memory), every card at least one layer, as [`plan_gpu_split`] splits
/// them.
pub fn layer_ranges(shares: &[u64], layers: usize) -> Result<Vec<Range<usize>>, GpuSplitError> {
    if shares.is_empty() {
        return Err(GpuSplitError::NoCards);
    }
    if shares.len() > layers {
        return Err(GpuSplitError::MoreCardsThanLayers {
            cards: shares.len(),
            layers,
        });
    }
    let mut start = 0;
    Ok(layer_counts(shares, layers)
        .into_iter()
        .map(|count| {
            let range = start..start + count;
            start += count;
            range
        })
        .collect())
}

fn join<T: ToString>(values: &[T]) -> String {
    values
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// What the split places, for the whole model; the planner gives each card its share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitModel {
    /// Decoder layers, in order; `true` where a layer has routed experts.
    pub moe_layers: Vec<bool>,
    /// Dense weights of the decoder layers, embeddings and output head (spread by layer count:
    /// an estimate, as the plan's figures are).
    pub dense_bytes: u64,
    /// KV caches of every sequence at full context, and the prefix cache's blocks, for every
    /// layer (spread by layer count).
    pub kv_bytes: u64,
    /// Routed experts of every MoE layer (the banks the slots copy from).
    pub expert_bank_bytes: u64,
    /// Routed experts per MoE layer.
    pub experts_per_layer: usize,
    /// Most expert slots per layer on any card (`--moe-gpu-experts N`); `None`: as many as fit.
    pub max_slots_per_layer: Option<usize>,
    /// The MTP head besides its experts (on the last card).
    pub tail_dense_bytes: u64,
    /// The MTP layer's routed experts: one more MoE layer on the last card.
    pub tail_expert_bytes: u64,
    /// GPU memory each card keeps for the engine's working buffers (and its prefill staging
    /// slots).
    pub working_bytes_per_card: u64,
}

/// What each card is asked for: the devices in the order the layers go over them, an optional
/// `--gpu-split`, and `--gpu-mem-budget` as a cap on every card.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitRequest<'a> {
    pub devices: &'a [GpuDevice],
    /// Percent of the layers per card, in `devices` order; `None`: by usable memory.
    pub split_percentages: Option<&'a [u64]>,
    /// A card acts as if it had this many bytes (less what others already use of it).
    pub memory_cap_bytes: Option<u64>,
}

/// One card's share of the model.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CardPlan {
    pub ordinal: usize,
    pub name: String,
    /// The decoder layers this card owns, `first_layer..=last_layer`.
    pub first_layer: usize,
    pub last_layer: usize,
    /// Whether the model's MTP head (after the last layer) is on this card.
    pub holds_tail: bool,
    /// Memory the plan may use on this card (free, within `--gpu-mem-budget`).
    pub available_bytes: u64,
    pub dense_bytes: u64,
    pub kv_bytes: u64,
    pub working_bytes: u64,
    /// Hot experts held per MoE layer of this card.
    pub expert_slots_per_layer: usize,
    /// MoE layers on this card, the MTP layer counted.
    pub moe_layers: usize,
    pub expert_bytes: u64,
    /// Dense + KV + working + expert slots.
    pub total_bytes: u64,
}

impl CardPlan {
    pub fn layers(&self) -> Range<usize> {
        self.first_layer..self.last_layer + 1
    }
}

/// Memory a card offers: its free memory, or with a cap, the cap less what is already used.
fn available_bytes(device: &GpuDevice, cap: Option<u64>) -> u64 {
    match cap {
        Some(cap) => {
            let used = device.total_bytes.saturating_sub(device.free_bytes);
            cap.min(device.total_bytes).saturating_sub(used)
        }
        None => device.free_bytes,
    }
}

/// `total × part / whole` without overflow, rounded down.
fn share(total: u64, part: u64, whole: u64) -> u64 {
    if whole == 0 {
        return 0;
    }
    (u128::from(total) * u128::from(part) / u128::from(whole)) as u64
}

/// Contiguous layer counts in proportion to `weights`, each card at least one layer, summing
/// to `layers`: card `i` ends at the rounded cumulative share, kept after the card before it and
/// leaving one layer for each card after it.
fn layer_counts(weights: &[u64], layers: usize) -> Vec<usize> {
    let total: u128 = weights.iter().map(|&w| u128::from(w)).sum();
    let cards = weights.len();
    let mut counts = Vec::with_capacity(cards);
    let (mut start, mut cumulative) = (0usize, 0u128);
    for (index, &weight) in weights.iter().enumerate() {
        cumulative += u128::from(weight);
        let ideal_end = (cumulative * layers as u128 + total / 2)
            .checked_div(total)
            .map_or(layers * (index + 1) / cards, |end| end as usize);
        let end = if index + 1 == cards {
            layers
        } else {
            ideal_end.clamp(start + 1, layers - (cards - index - 1))
        };
        counts.push(end - start);
        start = end;
    }
    counts
}

/// Splits the model's layers over `request.devices` and places hot experts on the card owning
/// each layer. A card whose dense share, KV share and working memory exceed what it offers is
/// an error naming the card and the bytes.
pub fn plan_gpu_split(
    model: &SplitModel,
    request: &SplitRequest<'_>,
) -> Result<Vec<CardPlan>, GpuSplitError> {
    let devices = request.devices;
    let layers = model.moe_layers.len();
    if devices.is_empty() {
        return Err(GpuSplitError::NoCards);
    }
    if devices.len() > layers {
        return Err(GpuSplitError::MoreCardsThanLayers {
            cards: devices.len(),
            layers,
        });
    }
    let available: Vec<u64> = devices
        .iter()
        .map(|device| available_bytes(device, request.memory_cap_bytes))
        .collect();
    let weights: Vec<u64> = match request.split_percentages {
        Some(percentages) if percentages.len() == devices.len() => percentages.to_vec(),
        Some(percentages) => {
            return Err(GpuSplitError::Split {
                value: join(percentages),
                problem: format!(
                    "{} shares for {} GPUs: give one share per GPU",
                    percentages.len(),
                    devices.len()
                ),
            })
        }
        // Memory after working buffers: with every layer costing about the same, equal shares
        // of each card's memory per layer give every card the same fraction of hot experts.
        None => available
            .iter()
            .map(|&bytes| bytes.saturating_sub(model.working_bytes_per_card))
            .collect(),
    };
    let counts = layer_counts(&weights, layers);
    let total_moe_layers = model.moe_layers.iter().filter(|&&moe| moe).count() as u64;
    let mut plans = Vec::with_capacity(devices.len());
    let mut start = 0;
    for (index, (device, &count)) in devices.iter().zip(&counts).enumerate() {
        let range = start..start + count;
        start += count;
        let holds_tail =
            index + 1 == devices.len() && model.tail_dense_bytes + model.tail_expert_bytes > 0;
        // Cumulative shares, so the cards' shares add up to the whole exactly.
        let spread = |total: u64| {
            share(total, range.end as u64, layers as u64)
                - share(total, range.start as u64, layers as u64)
        };
        let dense_bytes = spread(model.dense_bytes)
            + if holds_tail {
                model.tail_dense_bytes
            } else {
                0
            };
        let kv_bytes = spread(model.kv_bytes);
        let working_bytes = model.working_bytes_per_card;
        let fixed = dense_bytes + kv_bytes + working_bytes;
        if fixed > available[index] {
            return Err(GpuSplitError::CardTooSmall {
                ordinal: device.ordinal,
                name: device.name.clone(),
                first_layer: range.start,
                last_layer: range.end - 1,
                needed_bytes: fixed,
                available_bytes: available[index],
            });
        }
        let own_moe_layers = model.moe_layers[range.clone()]
            .iter()
            .filter(|&&moe| moe)
            .count() as u64;
        let tail_moe = holds_tail && model.tail_expert_bytes > 0;
        // Every expert of this card's MoE layers: the bytes one slot per layer costs × experts.
        let all_experts_bytes = share(model.expert_bank_bytes, own_moe_layers, total_moe_layers)
            + if tail_moe { model.tail_expert_bytes } else { 0 };
        let experts = model.experts_per_layer as u64;
        let expert_slots_per_layer = if all_experts_bytes == 0 || experts == 0 {
            0
        } else {
            (u128::from(available[index] - fixed) * u128::from(experts)
                / u128::from(all_experts_bytes))
            .min(u128::from(experts)) as usize
        }
        .min(model.max_slots_per_layer.unwrap_or(usize::MAX));
        let expert_bytes = share(all_experts_bytes, expert_slots_per_layer as u64, experts);
        plans.push(CardPlan {
            ordinal: device.ordinal,
            name: device.name.clone(),
            first_layer: range.start,
            last_layer: range.end - 1,
            holds_tail,
            available_bytes: available[index],
            dense_bytes,
            kv_bytes,
            working_bytes,
            expert_slots_per_layer,
            moe_layers: (own_moe_layers + u64::from(tail_moe)) as usize,
            expert_bytes,
            total_bytes: fixed + expert_bytes,
        });
    }
    Ok(plans)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn card(ordinal: usize, gib: u64) -> GpuDevice {
        GpuDevice {
            ordinal,
            name: format!("card {ordinal}"),
            free_bytes: gib * GIB,
            total_bytes: gib * GIB,
        }
    }

    /// 48 MoE layers of 128 experts: 60 GiB of banks (10 MiB per expert and layer), 4.8 GiB
    /// dense, 9.6 GiB of KV; 1 GiB working memory per card.
    fn model() -> SplitModel {
        SplitModel {
            moe_layers: vec![true; 48],
            dense_bytes: 48 * GIB / 10,
            kv_bytes: 96 * GIB / 10,
            expert_bank_bytes: 60 * GIB,
            experts_per_layer: 128,
            max_slots_per_layer: None,
            tail_dense_bytes: 0,
            tail_expert_bytes: 0,
            working_bytes_per_card: GIB,
        }
    }

    fn split(devices: &[GpuDevice], percentages: Option<&[u64]>) -> Vec<CardPlan> {
        plan_gpu_split(
            &model(),
            &SplitRequest {
                devices,
                split_percentages: percentages,
                memory_cap_bytes: None,
            },
        )
        .unwrap()
    }

    /// Every layer exactly once, in order, every card at least one.
    fn assert_covers_every_layer(plans: &[CardPlan], layers: usize) {
        let mut next = 0;
        for plan in plans {
            assert_eq!(plan.first_layer, next, "{plans:?}");
            assert!(plan.last_layer >= plan.first_layer, "{plans:?}");
            next = plan.last_layer + 1;
        }
        assert_eq!(next, layers, "{plans:?}");
    }

    #[test]
    fn one_card_takes_every_layer_and_the_slots_its_memory_leaves() {
        let plans = split(&[card(0, 24)], None);
        assert_eq!(plans.len(), 1);
        assert!(!plans[0].holds_tail, "the model has no MTP head");
        assert_covers_every_layer(&plans, 48);
        let plan = &plans[0];
        assert_eq!(
            (plan.dense_bytes, plan.kv_bytes),
            (48 * GIB / 10, 96 * GIB / 10)
        );
        // 24 − 4.8 − 9.6 − 1 = 8.6 GiB over 48 layers × 10 MiB per expert → 18 per layer.
        let left = 24 * GIB - 48 * GIB / 10 - 96 * GIB / 10 - GIB;
        assert_eq!(
            plan.expert_slots_per_layer as u64,
            left / (48 * 10 * (1 << 20))
        );
        assert_eq!(plan.expert_slots_per_layer, 18);
        assert!(plan.total_bytes <= plan.available_bytes);
        assert_eq!(
            plan.total_bytes,
            plan.dense_bytes + plan.kv_bytes + plan.working_bytes + plan.expert_bytes
        );
    }

    #[test]
    fn equal_cards_take_equal_halves_and_thirds() {
        let two = split(&[card(0, 24), card(1, 24)], None);
        assert_covers_every_layer(&two, 48);
        assert_eq!(two[0].layers(), 0..24);
        assert_eq!(two[1].layers(), 24..48);
        // Each card: 24 − 2.4 − 4.8 − 1 = 15.8 GiB over 24 layers × 10 MiB → 67 per layer.
        assert_eq!(two[0].expert_slots_per_layer, 67);
        assert_eq!(two[1].expert_slots_per_layer, 67);
        let one = split(&[card(0, 24)], None);
        assert!(two[0].expert_slots_per_layer > 3 * one[0].expert_slots_per_layer);

        let three = split(&[card(0, 24), card(1, 24), card(2, 24)], None);
        assert_covers_every_layer(&three, 48);
        assert!(three.iter().all(|plan| plan.layers().len() == 16));
        assert!(three
            .iter()
            .all(|plan| plan.total_bytes <= plan.available_bytes));
    }

    #[test]
    fn unequal_cards_take_layers_in_proportion_to_their_memory() {
        // 48 and 24 GiB: 47 and 23 GiB after working memory → 32.2 and 15.8 layers.
        let plans = split(&[card(0, 48), card(1, 24)], None);
        assert_covers_every_layer(&plans, 48);
        assert_eq!(plans[0].layers().len(), 32);
        assert_eq!(plans[1].layers().len(), 16);
        assert_eq!(plans[0].dense_bytes, 48 * GIB / 10 * 32 / 48);
        assert_eq!(plans[0].dense_bytes + plans[1].dense_bytes, 48 * GIB / 10);
        assert_eq!(plans[0].kv_bytes + plans[1].kv_bytes, 96 * GIB / 10);
        // The bigger card's share of layers keeps the hot fraction about even.
        let difference = plans[0]
            .expert_slots_per_layer
            .abs_diff(plans[1].expert_slots_per_layer);
        assert!(difference <= 3, "{plans:?}");

        // Three cards of 80, 24 and 16 GiB, the small one last.
        let plans = split(&[card(0, 80), card(1, 24), card(2, 16)], None);
        assert_covers_every_layer(&plans, 48);
        let counts: Vec<usize> = plans.iter().map(|plan| plan.layers().len()).collect();
        assert!(counts[0] > counts[1] && counts[1] > counts[2], "{counts:?}");
        assert!(plans
            .iter()
            .all(|plan| plan.total_bytes <= plan.available_bytes));
        // A card's ordinal, not its place, names it: the split follows the order given.
        let plans = split(&[card(1, 16), card(0, 80)], None);
        assert_eq!((plans[0].ordinal, plans[1].ordinal), (1, 0));
        assert!(plans[0].layers().len() < plans[1].layers().len());
    }

    #[test]
    fn a_split_override_sets_the_layer_shares() {
        let plans = split(&[card(0, 24), card(1, 24)], Some(&[75, 25]));
        assert_covers_every_layer(&plans, 48);
        assert_eq!(plans[0].layers(), 0..36);
        assert_eq!(plans[1].layers(), 36..48);
        assert!(plans[0].expert_slots_per_layer < plans[1].expert_slots_per_layer);
        let plans = split(&[card(0, 24), card(1, 24), card(2, 24)], Some(&[1, 1, 98]));
        assert_covers_every_layer(&plans, 48);
        assert_eq!(plans[0].layers().len(), 1);
        assert_eq!(plans[1].layers().len(), 1);
    }

    #[test]
    fn the_tail_and_dense_layers_count_where_they_sit() {
        let mut model = model();
        model.moe_layers[..24].fill(false);
        model.expert_bank_bytes = 30 * GIB;
        model.tail_dense_bytes = GIB / 2;
        model.tail_expert_bytes = 30 * GIB / 24;
        let devices = [card(0, 24), card(1, 24)];
        let plans = plan_gpu_split(
            &model,
            &SplitRequest {
                devices: &devices,
                split_percentages: None,
                memory_cap_bytes: None,
            },
        )
        .unwrap();
        assert_eq!(plans[0].moe_layers, 0);
        assert_eq!(plans[0].expert_slots_per_layer, 0);
        assert_eq!(plans[0].expert_bytes, 0);
        assert!(!plans[0].holds_tail && plans[1].holds_tail);
        assert_eq!(plans[1].moe_layers, 25);
        assert_eq!(
            plans[1].dense_bytes,
            48 * GIB / 10 - 48 * GIB / 10 / 2 + GIB / 2
        );
    }

    #[test]
    fn a_slot_count_caps_every_card() {
        let devices = [card(0, 80), card(1, 24)];
        let capped = plan_gpu_split(
            &SplitModel {
                max_slots_per_layer: Some(20),
                ..model()
            },
            &SplitRequest {
                devices: &devices,
                split_percentages: None,
                memory_cap_bytes: None,
            },
        )
        .unwrap();
        let free = split(&devices, None);
        assert!(
            free.iter().all(|plan| plan.expert_slots_per_layer > 20),
            "{free:?}"
        );
        assert!(capped.iter().all(|plan| plan.expert_slots_per_layer == 20));
        // 20 slots of 10 MiB over each card's layers.
        assert_eq!(
            capped[1].expert_bytes,
            20 * capped[1].layers().len() as u64 * 10 * (1 << 20)
        );
        assert_eq!(capped[0].layers(), free[0].layers());
    }

    #[test]
    fn a_memory_cap_applies_to_every_card() {
        let devices = [card(0, 80), card(1, 80)];
        let capped = plan_gpu_split(
            &model(),
            &SplitRequest {
                devices: &devices,
                split_percentages: None,
                memory_cap_bytes: Some(24 * GIB),
            },
        )
        .unwrap();
        assert_eq!(capped, split(&[card(0, 24), card(1, 24)], None));
    }

    #[test]
    fn a_card_too_small_for_its_dense_share_is_named_with_the_bytes() {
        let mut model = model();
        model.dense_bytes = 40 * GIB;
        let devices = [card(0, 48), card(1, 8)];
        let error = plan_gpu_split(
            &model,
            &SplitRequest {
                devices: &devices,
                split_percentages: Some(&[50, 50]),
                memory_cap_bytes: None,
            },
        )
        .unwrap_err();
        assert!(
            matches!(error, GpuSplitError::CardTooSmall { ordinal: 1, .. }),
            "{error}"
        );
        let message = error.to_string();
        assert!(
            message.contains("GPU 1 (card 1)")
                && message.contains(&(8 * GIB).to_string())
                && message.contains("layers 24..=47"),
            "{message}"
        );
        let error = plan_gpu_split(
            &SplitModel {
                moe_layers: vec![true; 2],
                ..model
            },
            &SplitRequest {
                devices: &[card(0, 24), card(1, 24), card(2, 24)],
                split_percentages: None,
                memory_cap_bytes: None,
            },
        )
        .unwrap_err();
        assert_eq!(
            error,
            GpuSplitError::MoreCardsThanLayers {
                cards: 3,
                layers: 2
            }
        );
    }

    #[test]
    fn flag_values_are_checked_and_named() {
        assert_eq!(parse_gpu_ordinals("0,1").unwrap(), vec![0, 1]);
        assert_eq!(parse_gpu_ordinals(" 2 ").unwrap(), vec![2]);
        for bad in ["", "0,,1", "a", "0,0", "-1"] {
            let message = parse_gpu_ordinals(bad).unwrap_err().to_string();
            assert!(message.starts_with(&format!("--gpus {bad}:")), "{message}");
        }
        assert_eq!(parse_gpu_split("60,40").unwrap(), vec![60, 40]);
        for bad in ["60,50", "100,0", "sixty,40", "", "60.5,39.5"] {
            let message = parse_gpu_split(bad).unwrap_err().to_string();
            assert!(
                message.starts_with(&format!("--gpu-split {bad}:")),
                "{message}"
            );
        }
        // Default: the first visible card; none visible, none chosen.
        assert_eq!(select_gpus(None, 2, None).unwrap(), vec![0]);
        assert_eq!(select_gpus(None, 0, None).unwrap(), Vec::<usize>::new());
        assert_eq!(select_gpus(Some(&[1]), 2, None).unwrap(), vec![1]);
        let message = select_gpus(Some(&[0, 2]), 2, None).unwrap_err().to_string();
        assert!(
            message.contains("--gpus 0,2") && message.contains("GPU 2 is not visible"),
            "{message}"
        );
        let message = select_gpus(None, 3, Some(&[60, 40]))
            .unwrap_err()
            .to_string();
        assert!(
            message.contains("--gpu-split 60,40") && message.contains("2 shares for 1 GPUs"),
            "{message}"
        );
    }

    #[test]
    fn layer_ranges_follow_the_shares_and_cover_every_layer() {
        assert_eq!(layer_ranges(&[60, 40], 10).unwrap(), vec![0..6, 6..10]);
        assert_eq!(layer_ranges(&[1, 1, 1], 4).unwrap(), vec![0..1, 1..3, 3..4]);
        // Every card keeps a layer, however small its share.
        assert_eq!(layer_ranges(&[99, 1], 4).unwrap(), vec![0..3, 3..4]);
        assert_eq!(layer_ranges(&[1, 99], 4).unwrap(), vec![0..1, 1..4]);
        let split = layer_ranges(&[70, 30], 48).unwrap();
        assert_covers(&split, 48);
        assert!(matches!(
            layer_ranges(&[1, 1, 1], 2),
            Err(GpuSplitError::MoreCardsThanLayers {
                cards: 3,
                layers: 2
            })
        ));
        assert!(matches!(layer_ranges(&[], 2), Err(GpuSplitError::NoCards)));
    }

    fn assert_covers(ranges: &[Range<usize>], layers: usize) {
        let mut next = 0;
        for range in ranges {
            assert_eq!(range.start, next, "{ranges:?}");
            assert!(!range.is_empty(), "{ranges:?}");
            next = range.end;
        }
        assert_eq!(next, layers, "{ranges:?}");
    }

    #[test]
    fn the_host_kv_pool_is_shared_by_the_stages_kv_caches() {
        let gib = 1u64 << 30;
        assert_eq!(stage_host_kv_bytes(8 * gib, &[48]), vec![8 * gib]);
        assert_eq!(
            stage_host_kv_bytes(8 * gib, &[3, 1]),
            vec![6 * gib, 2 * gib]
        );
        // A stage of linear-attention layers only makes no KV cache.
        assert_eq!(stage_host_kv_bytes(8 * gib, &[0, 4]), vec![0, 8 * gib]);
        // Roundings go to the last stage: the shares add up to the request.
        let shares = stage_host_kv_bytes(1000, &[1, 1, 1]);
        assert_eq!(shares, vec![333, 333, 334]);
        assert_eq!(stage_host_kv_bytes(1000, &[0, 0]), vec![0, 0]);
        assert_eq!(stage_host_kv_bytes(0, &[2, 2]), vec![0, 0]);
    }
}
