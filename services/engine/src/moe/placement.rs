//! Expert placement, `--moe-gpu-experts`: how many routed experts of each MoE layer the GPU
//! holds, and which.
//!
//! Owns: parsing the count (`N`, `half`, `all`, `auto`), the GPU memory budget of the expert
//! slots (what is left after the dense weights, the KV caches and working memory), fitting the
//! count into it, and choosing the experts per layer (the most used ones from routing
//! statistics, else the first N). All of it pure functions of their inputs. Filling the slots
//! is [`crate::model::Model::place_resident_experts`].
//! Must not touch: the slots themselves (backends), the CPU side of the split, the device (the
//! caller reads its free and total memory).

use std::fmt;
use std::str::FromStr;

use crate::service::routing_stats::ExpertStatistics;
use crate::spec::{MixerKind, ModelSpec};

/// Device memory kept free for the forward's working buffers when sizing the expert slots.
pub const WORKING_MEMORY_BYTES: u64 = 1 << 30;

/// What the device has and what else must fit beside the expert slots.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlotMemoryBudget {
    /// Free device bytes now, after the dense weights (and any prefill staging slots) are loaded.
    pub free_bytes: u64,
    /// Total device bytes.
    pub total_bytes: u64,
    /// `--gpu-mem-budget` in GiB: behave as if the device had this much (`None`: it has
    /// `free_bytes` to give).
    pub limit_gib: Option<f64>,
    /// KV caches of every sequence's full context ([`kv_cache_bytes`]).
    pub kv_cache_bytes: u64,
    /// `--host-kv-mib` in bytes: KV caches that may live in host memory instead.
    pub host_kv_bytes: u64,
}

/// `gib` GiB in bytes, rounded down.
pub fn gib_to_bytes(gib: f64) -> u64 {
    (gib * (1u64 << 30) as f64) as u64
}

/// Bytes of the K and V caches of every attention layer for `max_sequences` sequences of
/// `max_context` tokens, `kv_element_bytes` per cached element (`--kv-dtype`).
pub fn kv_cache_bytes(
    spec: &ModelSpec,
    kv_element_bytes: u64,
    max_context: usize,
    max_sequences: usize,
) -> u64 {
    let attention_layers = spec
        .mixers
        .iter()
        .filter(|mixer| **mixer == MixerKind::Attention)
        .count() as u64;
    let kv_bytes_per_token = attention_layers
        * 2
        * (spec.attention.kv_heads * spec.attention.head_dim) as u64
        * kv_element_bytes;
    kv_bytes_per_token
        .saturating_mul(max_context as u64)
        .saturating_mul(max_sequences as u64)
}

/// Device bytes the expert slots may take: the budget (`limit_gib` less what is already used,
/// else the free memory) less the KV caches that do not go to host memory and
/// [`WORKING_MEMORY_BYTES`].
pub fn expert_slot_budget(memory: &SlotMemoryBudget) -> u64 {
    let used = memory.total_bytes - memory.free_bytes.min(memory.total_bytes);
    let limit = match memory.limit_gib {
        Some(gib) => gib_to_bytes(gib).saturating_sub(used),
        None => memory.free_bytes,
    };
    let kv = memory.kv_cache_bytes.saturating_sub(memory.host_kv_bytes);
    limit
        .saturating_sub(kv)
        .saturating_sub(WORKING_MEMORY_BYTES)
}

/// The `--moe-gpu-experts` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuExpertCount {
    /// This many experts per MoE layer (0: every routed expert on the CPU).
    Count(usize),
    /// Half of each layer's experts.
    Half,
    /// Every expert; an error when they do not fit.
    All,
    /// As many per layer as the memory budget allows.
    Auto,
}

impl FromStr for GpuExpertCount {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text.trim() {
            "all" => Ok(GpuExpertCount::All),
            "half" => Ok(GpuExpertCount::Half),
            "auto" => Ok(GpuExpertCount::Auto),
            other => other
                .parse::<usize>()
                .map(GpuExpertCount::Count)
                .map_err(|_| {
                    format!("`{other}` is not a number of experts, `half`, `all` or `auto`")
                }),
        }
    }
}

impl fmt::Display for GpuExpertCount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuExpertCount::Count(count) => write!(f, "{count}"),
            GpuExpertCount::Half => f.write_str("half"),
            GpuExpertCount::All => f.write_str("all"),
            GpuExpertCount::Auto => f.write_str("auto"),
        }
    }
}

/// The model facts the choice needs.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuExpertShape {
    pub num_experts: usize,
    /// Per layer: whether it has routed experts.
    pub moe_layers: Vec<bool>,
    /// Bytes one expert takes in a slot.
    pub expert_bytes: u64,
}

impl GpuExpertShape {
    fn moe_layer_count(&self) -> u64 {
        self.moe_layers.iter().filter(|&&moe| moe).count() as u64
    }
}

/// Experts per MoE layer for `count`, given `budget_bytes` of device memory for expert slots
/// (`None`: unlimited, as on the CPU backend). Explicit counts that do not fit are errors that
/// say how much they need.
pub fn experts_per_layer(
    count: GpuExpertCount,
    shape: &GpuExpertShape,
    budget_bytes: Option<u64>,
) -> Result<usize, String> {
    let layers = shape.moe_layer_count();
    let per_expert_everywhere = shape.expert_bytes.saturating_mul(layers).max(1);
    let fitting = budget_bytes
        .map(|budget| (budget / per_expert_everywhere) as usize)
        .unwrap_or(usize::MAX)
        .min(shape.num_experts);
    let wanted = match count {
        GpuExpertCount::Count(n) => {
            if n > shape.num_experts {
                return Err(format!(
                    "{n} experts per layer asked for, the model has {}",
                    shape.num_experts
                ));
            }
            n
        }
        GpuExpertCount::Half => shape.num_experts / 2,
        GpuExpertCount::All => shape.num_experts,
        GpuExpertCount::Auto => return Ok(fitting),
    };
    if wanted > fitting {
        let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
        return Err(format!(
            "{wanted} experts per layer ({count}) need {:.2} GiB of GPU memory, {:.2} GiB is free for expert slots (fits {fitting} per layer; `auto` takes that many)",
            gib(per_expert_everywhere.saturating_mul(wanted as u64)),
            gib(budget_bytes.unwrap_or(0)),
        ));
    }
    Ok(wanted)
}

/// Which experts each layer keeps on the GPU: the `per_layer` most used ones in `statistics`
/// (ties and layers without data: lowest ids first), else experts `0..per_layer`. Dense layers
/// get none.
pub fn choose_gpu_experts(
    shape: &GpuExpertShape,
    per_layer: usize,
    statistics: Option<&ExpertStatistics>,
) -> Vec<Vec<u32>> {
    let per_layer = per_layer.min(shape.num_experts);
    let ranked = statistics.map(|statistics| statistics.placement(per_layer));
    shape
        .moe_layers
        .iter()
        .enumerate()
        .map(|(layer, &moe)| {
            if !moe || per_layer == 0 {
                return Vec::new();
            }
            match ranked.as_ref().and_then(|ranked| ranked.get(layer)) {
                Some((experts, _)) if experts.len() == per_layer => experts.clone(),
                _ => (0..per_layer as u32).collect(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn shape() -> GpuExpertShape {
        GpuExpertShape {
            num_experts: 8,
            moe_layers: vec![false, true, true],
            expert_bytes: 1000,
        }
    }

    #[test]
    fn counts_parse_and_name_bad_values() {
        assert_eq!("3".parse(), Ok(GpuExpertCount::Count(3)));
        assert_eq!("half".parse(), Ok(GpuExpertCount::Half));
        assert_eq!("all".parse(), Ok(GpuExpertCount::All));
        assert_eq!("auto".parse(), Ok(GpuExpertCount::Auto));
        let error = "many".parse::<GpuExpertCount>().unwrap_err();
        assert!(error.contains("`many`"), "{error}");
    }

    #[test]
    fn budgets_bound_the_count() {
        let shape = shape();
        // Two MoE layers × 1000 bytes per expert: 5000 bytes fit two experts per layer.
        assert_eq!(
            experts_per_layer(GpuExpertCount::Auto, &shape, Some(5000)),
            Ok(2)
        );
        assert_eq!(experts_per_layer(GpuExpertCount::Auto, &shape, None), Ok(8));
        assert_eq!(experts_per_layer(GpuExpertCount::Half, &shape, None), Ok(4));
        assert_eq!(
            experts_per_layer(GpuExpertCount::All, &shape, Some(16_000)),
            Ok(8)
        );
        let error = experts_per_layer(GpuExpertCount::All, &shape, Some(5000)).unwrap_err();
        assert!(error.contains("fits 2 per layer"), "{error}");
        let error = experts_per_layer(GpuExpertCount::Count(9), &shape, None).unwrap_err();
        assert!(error.contains("has 8"), "{error}");
    }

    #[test]
    fn statistics_pick_the_hottest_experts() {
        let shape = shape();
        let statistics = ExpertStatistics {
            counts: vec![vec![0; 8], vec![0, 9, 0, 7, 0, 0, 0, 1], vec![0; 8]],
        };
        let chosen = choose_gpu_experts(&shape, 2, Some(&statistics));
        assert_eq!(chosen, vec![vec![], vec![1, 3], vec![0, 1]]);
        let chosen = choose_gpu_experts(&shape, 3, None);
        assert_eq!(chosen, vec![vec![], vec![0, 1, 2], vec![0, 1, 2]]);
        assert_eq!(
            choose_gpu_experts(&shape, 0, None),
            vec![Vec::<u32>::new(); 3]
        );
    }

    fn memory(free_gib: u64, total_gib: u64, limit_gib: Option<f64>) -> SlotMemoryBudget {
        SlotMemoryBudget {
            free_bytes: free_gib * GIB,
            total_bytes: total_gib * GIB,
            limit_gib,
            kv_cache_bytes: 0,
            host_kv_bytes: 0,
        }
    }

    #[test]
    fn the_slot_budget_is_free_memory_less_kv_and_working_memory() {
        // 80 GiB card, 70 free after the dense weights, no KV: 69 GiB for slots.
        assert_eq!(expert_slot_budget(&memory(70, 80, None)), 69 * GIB);
        // KV caches of 12 GiB come off the budget, less what host memory takes.
        let with_kv = SlotMemoryBudget {
            kv_cache_bytes: 12 * GIB,
            ..memory(70, 80, None)
        };
        assert_eq!(expert_slot_budget(&with_kv), 57 * GIB);
        let host_kv = SlotMemoryBudget {
            host_kv_bytes: 4 * GIB,
            ..with_kv
        };
        assert_eq!(expert_slot_budget(&host_kv), 61 * GIB);
        // More host KV than KV: nothing comes off.
        let all_on_host = SlotMemoryBudget {
            host_kv_bytes: 20 * GIB,
            ..with_kv
        };
        assert_eq!(expert_slot_budget(&all_on_host), 69 * GIB);
        // Nothing left: zero, not an underflow.
        assert_eq!(expert_slot_budget(&memory(0, 80, None)), 0);
    }

    #[test]
    fn a_memory_limit_counts_what_is_already_used() {
        // `--gpu-mem-budget 24` on an 80 GiB card with 10 GiB of dense weights loaded: 24 − 10
        // − 1 GiB of working memory.
        assert_eq!(expert_slot_budget(&memory(70, 80, Some(24.0))), 13 * GIB);
        // Fractions of a GiB round down to whole bytes.
        assert_eq!(expert_slot_budget(&memory(70, 80, Some(11.5))), GIB / 2);
        // A limit below what is used leaves nothing.
        assert_eq!(expert_slot_budget(&memory(70, 80, Some(8.0))), 0);
        // Free memory above total (a driver quirk) counts as nothing used.
        assert_eq!(expert_slot_budget(&memory(90, 80, Some(16.0))), 15 * GIB);
    }

    #[test]
    fn kv_caches_count_attention_layers_only() {
        let spec = ModelSpec::from_config(&crate::testing::tiny_config(
            crate::testing::TinyArchitecture::Qwen3Next,
        ))
        .unwrap();
        let attention_layers = spec
            .mixers
            .iter()
            .filter(|mixer| **mixer == MixerKind::Attention)
            .count() as u64;
        assert!(attention_layers > 0 && (attention_layers as usize) < spec.mixers.len());
        let width = (spec.attention.kv_heads * spec.attention.head_dim) as u64;
        assert_eq!(
            kv_cache_bytes(&spec, 2, 100, 3),
            attention_layers * 2 * width * 2 * 100 * 3
        );
        assert_eq!(kv_cache_bytes(&spec, 4, 0, 3), 0);
    }

    #[test]
    fn a_budget_gives_the_experts_per_layer() {
        // Two MoE layers × 1000-byte experts; 24 GiB limit with 10 used, KV 12 GiB of which
        // 12 GiB − 9 GiB on the host: 24 − 10 − 3 − 1 = 10 GiB, 5 GiB per layer's worth.
        let budget = expert_slot_budget(&SlotMemoryBudget {
            kv_cache_bytes: 12 * GIB,
            host_kv_bytes: 9 * GIB,
            ..memory(70, 80, Some(24.0))
        });
        assert_eq!(budget, 10 * GIB);
        let shape = GpuExpertShape {
            num_experts: 1 << 30,
            moe_layers: vec![true, false, true],
            expert_bytes: 1000,
        };
        assert_eq!(
            experts_per_layer(GpuExpertCount::Auto, &shape, Some(budget)),
            Ok((10 * GIB / 2000) as usize)
        );
    }
}
