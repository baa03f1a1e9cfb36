//! `--moe-gpu-experts`: how many routed experts of each MoE layer the GPU holds, and which.
//!
//! Owns: parsing the count (`N`, `half`, `all`, `auto`), fitting it into a memory budget, and
//! choosing the experts per layer (the most used ones from routing statistics, else the first
//! N). Placing them is [`crate::model::Model::place_resident_experts`].
//! Must not touch: the slots themselves (backends), the CPU side of the split.

use std::fmt;
use std::str::FromStr;

use crate::service::routing_stats::ExpertStatistics;

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
}
