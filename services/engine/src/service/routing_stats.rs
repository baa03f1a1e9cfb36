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
use crate::moe::{ExpertBatch, ExpertExecutor};

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

    /// Writes the snapshot to `path` in the gateway's `ninfer-expert-stats-v1` format (temp file,
    /// then rename: never half-written), so either file can seed `--moe-expert-stats`.
    pub fn write_file(&self, path: &Path, model_name: &str) -> std::io::Result<()> {
        let snapshot = self.snapshot(model_name, "");
        let layers: serde_json::Map<String, serde_json::Value> = snapshot
            .layers
            .iter()
            .map(|l| {
                (
                    l.layer.to_string(),
                    serde_json::json!(l.expert_token_counts),
                )
            })
            .collect();
        let updated_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let body = serde_json::json!({
            "format": STATS_FORMAT,
            "model": model_name,
            "tokens_routed": snapshot.tokens_routed,
            "layers": layers,
            "updated_unix_ms": updated_unix_ms,
        });
        let temporary = path.with_extension(format!("tmp-{}", std::process::id()));
        std::fs::write(
            &temporary,
            serde_json::to_vec_pretty(&body).unwrap_or_default(),
        )?;
        std::fs::rename(&temporary, path)
    }
}

/// Name of the routing-statistics file format shared with the gateway's store.
pub const STATS_FORMAT: &str = "ninfer-expert-stats-v1";

/// Routing counts read back from a statistics file, for expert placement.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertStatistics {
    /// `[layer][expert]` token counts (layers without data are all zero).
    pub counts: Vec<Vec<u64>>,
}

impl ExpertStatistics {
    /// Reads a `ninfer-expert-stats-v1` file and checks it against the model's shape.
    pub fn load(path: &Path, layers: usize, experts: usize) -> Result<Self, String> {
        let text = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let value: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| format!("{}: not valid JSON: {e}", path.display()))?;
        let format = value.get("format").and_then(|f| f.as_str()).unwrap_or("");
        if format != STATS_FORMAT {
            return Err(format!(
                "{}: field `format` is `{format}`, expected `{STATS_FORMAT}`",
                path.display()
            ));
        }
        let Some(map) = value.get("layers").and_then(|l| l.as_object()) else {
            return Err(format!(
                "{}: field `layers` is missing or not an object",
                path.display()
            ));
        };
        let mut counts = vec![vec![0u64; experts]; layers];
        for (key, row) in map {
            let layer: usize = key.parse().ok().filter(|&l| l < layers).ok_or_else(|| {
                format!(
                    "{}: layer `{key}` is not a layer of this {layers}-layer model",
                    path.display()
                )
            })?;
            let row = row
                .as_array()
                .filter(|r| r.len() == experts)
                .ok_or_else(|| {
                    format!(
                        "{}: layer {layer} must list {experts} expert counts",
                        path.display()
                    )
                })?;
            for (slot, count) in counts[layer].iter_mut().zip(row) {
                *slot = count.as_u64().ok_or_else(|| {
                    format!(
                        "{}: layer {layer} has a non-integer count {count}",
                        path.display()
                    )
                })?;
            }
        }
        Ok(ExpertStatistics { counts })
    }

    /// Static placement: the `slots` most used experts of each layer, most used first (ties by
    /// index), and the share of that layer's routed tokens they would serve.
    pub fn placement(&self, slots: usize) -> Vec<(Vec<u32>, f64)> {
        self.counts
            .iter()
            .map(|row| {
                let mut order: Vec<u32> = (0..row.len() as u32).collect();
                order.sort_by(|&a, &b| row[b as usize].cmp(&row[a as usize]).then(a.cmp(&b)));
                order.truncate(slots);
                let total: u64 = row.iter().sum();
                let covered: u64 = order.iter().map(|&e| row[e as usize]).sum();
                let share = if total == 0 {
                    0.0
                } else {
                    covered as f64 / total as f64
                };
                (order, share)
            })
            .collect()
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

    fn observe_routing(&self, layer: usize, expert_ids: &[u32], tokens: usize) {
        self.counters.record(layer, expert_ids, tokens);
        self.inner.observe_routing(layer, expert_ids, tokens);
    }

    fn compute(&self, batch: &ExpertBatch<'_>, out: &mut [f32]) -> Result<(), EngineError> {
        self.inner.compute(batch, out)
    }

    fn compute_nanos(&self) -> Option<u64> {
        self.inner.compute_nanos()
    }

    // Forwarded, or counting would hide the workers from a backend that hands layers to them
    // itself.
    fn worker_channels(&self) -> Option<&dyn crate::moe::executor::WorkerChannels> {
        self.inner.worker_channels()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An executor with workers, to see that counting forwards what a backend hand-off needs.
    struct WithWorkers;

    impl crate::moe::executor::WorkerChannels for WithWorkers {
        fn channel_memory(&self) -> Vec<ninfer_channel::SegmentMemory> {
            Vec::new()
        }
        fn prepare_backend_handoff(&self) -> Option<Vec<std::ops::Range<usize>>> {
            Some(vec![0..2, 2..4])
        }
        fn refusal(&self, _worker: usize) -> Option<String> {
            None
        }
        fn worker_address(&self, worker: usize) -> String {
            format!("worker {worker}")
        }
    }

    impl ExpertExecutor for WithWorkers {
        fn name(&self) -> &str {
            "with workers"
        }
        fn compute(&self, _batch: &ExpertBatch<'_>, _out: &mut [f32]) -> Result<(), EngineError> {
            Ok(())
        }
        fn compute_nanos(&self) -> Option<u64> {
            Some(7)
        }
        fn worker_channels(&self) -> Option<&dyn crate::moe::executor::WorkerChannels> {
            Some(self)
        }
    }

    #[test]
    fn counting_forwards_the_workers_and_their_compute_time() {
        let counting = CountingExecutor {
            inner: Arc::new(WithWorkers),
            counters: Arc::new(RoutingCounters::new(1, 4)),
        };
        let channels = counting
            .worker_channels()
            .expect("the workers are forwarded");
        assert_eq!(channels.prepare_backend_handoff(), Some(vec![0..2, 2..4]));
        assert_eq!(channels.worker_address(1), "worker 1");
        assert_eq!(counting.compute_nanos(), Some(7));
        assert_eq!(counting.name(), "with workers");
    }

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
        assert_eq!(written["layers"]["1"][3], 2);
        let read = ExpertStatistics::load(&path, 2, 4).unwrap();
        assert_eq!(read.counts[1], vec![1, 0, 1, 2]);
        let placement = read.placement(2);
        assert_eq!(placement[1].0, vec![3, 0]);
        assert!((placement[1].1 - 0.75).abs() < 1e-12);
        assert_eq!(placement[0].1, 0.0);
        let error = ExpertStatistics::load(&path, 2, 5).unwrap_err();
        assert!(error.contains("5 expert counts"), "{error}");
        let error = ExpertStatistics::load(&path, 1, 4).unwrap_err();
        assert!(error.contains("layer `1`"), "{error}");
    }
}
