//! Routing statistics: how many tokens each layer sent to each expert, counted where the engine
//! hands a layer's routed work to an expert executor, cumulative since start.
//!
//! Owns: the counters, their snapshot, and the `--moe-record-stats` file (written periodically
//! and at exit, temp file + rename).
//! Must not touch: the experts' math (it wraps any executor and delegates).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ninfer_protocol::v1::{LayerRoutingCounts, RoutingStatistics};

use crate::error::EngineError;
use crate::experts::{ExpertBatch, ExpertExecutor};

/// Per-layer, per-expert token counts.
pub struct RoutingCounters {
    experts: usize,
    counts: Vec<AtomicU64>,
    tokens_routed: AtomicU64,
}

impl RoutingCounters {
    pub fn new(layers: usize, experts: usize) -> Self {
        RoutingCounters {
            experts,
            counts: (0..layers * experts).map(|_| AtomicU64::new(0)).collect(),
            tokens_routed: AtomicU64::new(0),
        }
    }

    fn record(&self, layer: usize, ids: &[u32], tokens: usize) {
        self.tokens_routed
            .fetch_add(tokens as u64, Ordering::Relaxed);
        for &id in ids {
            if let Some(counter) = self.counts.get(layer * self.experts + id as usize) {
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Cumulative counts of every layer that saw traffic or is a MoE layer.
    pub fn snapshot(&self, model_name: &str, instance_id: &str) -> RoutingStatistics {
        let layers = self.counts.len() / self.experts.max(1);
        RoutingStatistics {
            tokens_routed: self.tokens_routed.load(Ordering::Relaxed),
            layers: (0..layers)
                .map(|layer| LayerRoutingCounts {
                    layer: layer as u32,
                    expert_token_counts: self.counts
                        [layer * self.experts..(layer + 1) * self.experts]
                        .iter()
                        .map(|c| c.load(Ordering::Relaxed))
                        .collect(),
                })
                .collect(),
            model_name: model_name.to_string(),
            engine_instance_id: instance_id.to_string(),
        }
    }

    /// Writes the snapshot as JSON to `path` (temp file, then rename: never half-written).
    pub fn write_file(&self, path: &Path, model_name: &str) -> std::io::Result<()> {
        let snapshot = self.snapshot(model_name, "");
        let layers: Vec<serde_json::Value> = snapshot
            .layers
            .iter()
            .map(|l| serde_json::json!({"layer": l.layer, "expert_token_counts": l.expert_token_counts}))
            .collect();
        let body = serde_json::json!({
            "model": model_name,
            "tokens_routed": snapshot.tokens_routed,
            "layers": layers,
        });
        let temporary = path.with_extension(format!("tmp-{}", std::process::id()));
        std::fs::write(
            &temporary,
            serde_json::to_vec_pretty(&body).unwrap_or_default(),
        )?;
        std::fs::rename(&temporary, path)
    }
}

/// Counts routing, then delegates to the real executor.
pub struct CountingExecutor {
    pub inner: Arc<dyn ExpertExecutor>,
    pub counters: Arc<RoutingCounters>,
}

impl ExpertExecutor for CountingExecutor {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn compute(&self, batch: &ExpertBatch<'_>, out: &mut [f32]) -> Result<(), EngineError> {
        self.counters
            .record(batch.layer, batch.expert_ids, batch.tokens());
        self.inner.compute(batch, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_file_round_trip() {
        let counters = RoutingCounters::new(2, 4);
        counters.record(1, &[0, 3, 3, 2], 2);
        let snapshot = counters.snapshot("m", "i");
        assert_eq!(snapshot.tokens_routed, 2);
        assert_eq!(snapshot.layers[1].expert_token_counts, vec![1, 0, 1, 2]);
        assert_eq!(snapshot.layers[0].expert_token_counts, vec![0; 4]);
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("stats.json");
        counters.write_file(&path, "m").unwrap();
        let written: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(written["layers"][1]["expert_token_counts"][3], 2);
    }
}
