//! Expert routing statistics: merged from every engine, per model, persisted across restarts.
//!
//! Owns: an actor holding per-model totals and per-engine last cumulative counts, turning the
//! engines' cumulative counts into deltas (reset on a new engine instance or a count going down),
//! and persisting totals to `STATE_DIR/expert-stats/<model>.json` (temp file + rename, so a crash
//! never leaves a half-written file). The engine reads that file at start for static placement.
//! Must not touch: engine connections (the pool forwards messages here) or HTTP.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ninfer_protocol::v1::RoutingStatistics;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use crate::error::GatewayError;

/// On-disk and `GET /v1/stats/experts` form of one model's totals.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ModelRoutingTotals {
    /// Always `ninfer-expert-stats-v1`.
    pub format: String,
    pub model: String,
    pub tokens_routed: u64,
    /// Layer index → tokens routed to each expert of that layer.
    pub layers: BTreeMap<u32, Vec<u64>>,
    pub updated_unix_ms: u64,
}

const FORMAT_NAME: &str = "ninfer-expert-stats-v1";

/// The last cumulative counts seen from one engine.
#[derive(Default)]
struct EngineCounts {
    instance_id: String,
    model: String,
    tokens_routed: u64,
    layers: BTreeMap<u32, Vec<u64>>,
}

enum StatsCommand {
    Observe {
        engine_key: String,
        statistics: RoutingStatistics,
    },
    Snapshot {
        reply: oneshot::Sender<Vec<ModelRoutingTotals>>,
    },
    Flush {
        reply: oneshot::Sender<Result<(), String>>,
    },
}

/// Handle to the statistics actor; cheap to clone.
#[derive(Clone)]
pub struct RoutingStatsHandle {
    commands: mpsc::UnboundedSender<StatsCommand>,
}

impl RoutingStatsHandle {
    /// Starts the actor, loading earlier totals from `state_directory` (if given).
    pub fn start(
        state_directory: Option<PathBuf>,
        persist_interval: Duration,
    ) -> Result<Self, GatewayError> {
        let mut totals = BTreeMap::new();
        if let Some(directory) = &state_directory {
            totals = load_totals(&directory.join("expert-stats"))?;
        }
        let (commands, receiver) = mpsc::unbounded_channel();
        let actor = StatsActor {
            totals,
            engines: BTreeMap::new(),
            state_directory,
            dirty: false,
        };
        tokio::spawn(actor.run(receiver, persist_interval));
        Ok(RoutingStatsHandle { commands })
    }

    /// Records one cumulative report of an engine (identified by its address).
    pub fn observe(&self, engine_key: String, statistics: RoutingStatistics) {
        let _ = self.commands.send(StatsCommand::Observe {
            engine_key,
            statistics,
        });
    }

    /// Current totals of every model.
    pub async fn snapshot(&self) -> Vec<ModelRoutingTotals> {
        let (reply, answer) = oneshot::channel();
        if self
            .commands
            .send(StatsCommand::Snapshot { reply })
            .is_err()
        {
            return Vec::new();
        }
        answer.await.unwrap_or_default()
    }

    /// Writes the totals now (tests, shutdown).
    pub async fn flush(&self) -> Result<(), GatewayError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(StatsCommand::Flush { reply })
            .map_err(|_| GatewayError::Internal("statistics store stopped".to_string()))?;
        answer
            .await
            .map_err(|_| GatewayError::Internal("statistics store stopped".to_string()))?
            .map_err(GatewayError::Internal)
    }
}

struct StatsActor {
    totals: BTreeMap<String, ModelRoutingTotals>,
    engines: BTreeMap<String, EngineCounts>,
    state_directory: Option<PathBuf>,
    dirty: bool,
}

impl StatsActor {
    async fn run(
        mut self,
        mut commands: mpsc::UnboundedReceiver<StatsCommand>,
        persist_interval: Duration,
    ) {
        let mut timer = tokio::time::interval(persist_interval);
        timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                command = commands.recv() => {
                    let Some(command) = command else { break };
                    match command {
                        StatsCommand::Observe { engine_key, statistics } => self.observe(engine_key, statistics),
                        StatsCommand::Snapshot { reply } => {
                            let _ = reply.send(self.totals.values().cloned().collect());
                        }
                        StatsCommand::Flush { reply } => {
                            let _ = reply.send(self.persist());
                        }
                    }
                }
                _ = timer.tick() => {
                    if self.dirty {
                        if let Err(error) = self.persist() {
                            tracing::warn!(%error, "could not persist routing statistics");
                        }
                    }
                }
            }
        }
        if self.dirty {
            let _ = self.persist();
        }
    }

    fn observe(&mut self, engine_key: String, statistics: RoutingStatistics) {
        let model = statistics.model_name.clone();
        let previous = self.engines.entry(engine_key).or_default();
        let current_layers: BTreeMap<u32, Vec<u64>> = statistics
            .layers
            .iter()
            .map(|layer| (layer.layer, layer.expert_token_counts.clone()))
            .collect();
        // A new instance (engine restarted), another model, or any count going down means the
        // counters restarted from zero: the whole report is new.
        let restarted = previous.instance_id != statistics.engine_instance_id
            || previous.model != model
            || statistics.tokens_routed < previous.tokens_routed
            || current_layers.iter().any(|(layer, counts)| {
                previous.layers.get(layer).is_some_and(|old| {
                    old.len() > counts.len()
                        || old
                            .iter()
                            .zip(counts)
                            .any(|(old_count, new_count)| new_count < old_count)
                })
            });
        if restarted {
            *previous = EngineCounts {
                instance_id: statistics.engine_instance_id.clone(),
                model: model.clone(),
                ..Default::default()
            };
        }
        let totals = self
            .totals
            .entry(model.clone())
            .or_insert_with(|| ModelRoutingTotals {
                format: FORMAT_NAME.to_string(),
                model: model.clone(),
                ..Default::default()
            });
        let token_delta = statistics.tokens_routed - previous.tokens_routed;
        totals.tokens_routed += token_delta;
        let mut changed = token_delta > 0;
        for (layer, counts) in &current_layers {
            let old = previous.layers.get(layer);
            let total_counts = totals.layers.entry(*layer).or_default();
            if total_counts.len() < counts.len() {
                total_counts.resize(counts.len(), 0);
            }
            for (expert, count) in counts.iter().enumerate() {
                let before = old.and_then(|old| old.get(expert)).copied().unwrap_or(0);
                let delta = count - before;
                if delta > 0 {
                    total_counts[expert] += delta;
                    changed = true;
                }
            }
        }
        previous.tokens_routed = statistics.tokens_routed;
        previous.layers = current_layers;
        if changed {
            totals.updated_unix_ms = unix_millis();
            self.dirty = true;
        }
    }

    fn persist(&mut self) -> Result<(), String> {
        let Some(directory) = &self.state_directory else {
            self.dirty = false;
            return Ok(());
        };
        let directory = directory.join("expert-stats");
        std::fs::create_dir_all(&directory)
            .map_err(|error| format!("create {}: {error}", directory.display()))?;
        for totals in self.totals.values() {
            let path = directory.join(format!("{}.json", file_name_for_model(&totals.model)));
            write_atomically(&path, totals)?;
        }
        self.dirty = false;
        Ok(())
    }
}

/// A model name as a file name: anything but `[A-Za-z0-9._-]` becomes `_`.
pub fn file_name_for_model(model: &str) -> String {
    let cleaned: String = model
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if cleaned.is_empty() || cleaned.starts_with('.') {
        format!("model{cleaned}")
    } else {
        cleaned
    }
}

fn write_atomically(path: &Path, totals: &ModelRoutingTotals) -> Result<(), String> {
    let text = serde_json::to_vec_pretty(totals).map_err(|error| error.to_string())?;
    let temporary = path.with_extension("json.tmp");
    std::fs::write(&temporary, text)
        .map_err(|error| format!("write {}: {error}", temporary.display()))?;
    std::fs::rename(&temporary, path)
        .map_err(|error| format!("rename to {}: {error}", path.display()))
}

fn load_totals(directory: &Path) -> Result<BTreeMap<String, ModelRoutingTotals>, GatewayError> {
    let mut totals = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(directory) else {
        return Ok(totals);
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        match std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|bytes| {
                serde_json::from_slice::<ModelRoutingTotals>(&bytes).map_err(|e| e.to_string())
            }) {
            Ok(model_totals) if model_totals.format == FORMAT_NAME => {
                totals.insert(model_totals.model.clone(), model_totals);
            }
            // A damaged statistics file costs only the history, never the start.
            Ok(_) => {
                tracing::warn!(path = %path.display(), "ignoring statistics file of another format")
            }
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "ignoring unreadable statistics file")
            }
        }
    }
    Ok(totals)
}

fn unix_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
