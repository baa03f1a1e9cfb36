//! The pool's actor: the one owner of the engines' state (readiness, model files, in-flight
//! requests, the queue of requests waiting for a free sequence), driven by commands from the
//! engine monitors, the requests and their leases, and publishing a [`BackendSnapshot`] after
//! every change.
//!
//! Owns: the commands, the engine slots, picking the least-loaded ready engine, the waiting
//! queue and its refusals ([`OverloadLog`]), the leases and the published snapshot.
//! Must not touch: RPCs (the pool and the monitors make them; see `engine_pool`), HTTP.

use std::sync::Arc;
use std::time::Duration;

use ninfer_protocol::control_secret::SendSecret;
use ninfer_protocol::v1::engine_client::EngineClient;
use ninfer_protocol::v1::{EngineStatus, ModelInfo};
use tokio::sync::{mpsc, oneshot, watch};
use tonic::transport::Channel;

use super::{BackendSnapshot, EngineReport, ModelResources, ServedModel};
use crate::error::GatewayError;

/// An engine client that sends the control secret (when one is set) with every call.
pub(super) type EngineRpc =
    EngineClient<tonic::service::interceptor::InterceptedService<Channel, SendSecret>>;

/// Logs refusals for overload once per burst (the first one, then a summary when the next
/// burst starts), so an overload shows in the log without flooding it.
#[derive(Default)]
pub struct OverloadLog {
    state: std::sync::Mutex<OverloadBurst>,
}

#[derive(Default)]
struct OverloadBurst {
    last_refusal: Option<std::time::Instant>,
    refused_in_burst: u64,
}

/// Quiet time after which the next refusal starts a new burst (and is logged).
const OVERLOAD_BURST_GAP: Duration = Duration::from_secs(10);

impl OverloadLog {
    /// Records one refusal; logs it when it starts a burst.
    pub fn refused(&self, reason: &str) {
        let Ok(mut burst) = self.state.lock() else {
            return;
        };
        let now = std::time::Instant::now();
        let new_burst = burst
            .last_refusal
            .is_none_or(|last| now.duration_since(last) > OVERLOAD_BURST_GAP);
        if new_burst {
            if burst.refused_in_burst > 1 {
                tracing::info!(
                    refused = burst.refused_in_burst,
                    "the previous overload burst ended"
                );
            }
            tracing::warn!(
                reason,
                "overloaded: refusing requests with 429 (logged once per burst)"
            );
            burst.refused_in_burst = 0;
        }
        burst.refused_in_burst += 1;
        burst.last_refusal = Some(now);
    }
}

pub(super) enum PoolCommand {
    Observed {
        engine_index: usize,
        observation: Box<EngineObservation>,
    },
    Lost {
        engine_index: usize,
        error: String,
    },
    Acquire {
        model_name: String,
        reply: oneshot::Sender<Result<EngineLease, GatewayError>>,
    },
    Release {
        engine_index: usize,
    },
}

/// A request waiting for a free engine sequence.
struct Waiter {
    model_name: String,
    reply: oneshot::Sender<Result<EngineLease, GatewayError>>,
}

/// What picking an engine found.
enum Pick {
    Leased(EngineLease),
    /// Engines serving the model are up but all run their maximum of sequences.
    Full(String),
    Refused(GatewayError),
}

pub(super) struct EngineObservation {
    pub(super) info: ModelInfo,
    pub(super) status: EngineStatus,
    pub(super) resources: Arc<ModelResources>,
}

pub(super) struct EngineSlot {
    pub(super) address: String,
    pub(super) client: EngineRpc,
    pub(super) ready: bool,
    pub(super) info: Option<ModelInfo>,
    pub(super) status: Option<EngineStatus>,
    pub(super) resources: Option<Arc<ModelResources>>,
    pub(super) in_flight_requests: u32,
    pub(super) last_error: Option<String>,
}

impl EngineSlot {
    /// The engine's token socket: only for an engine reached over a unix socket, which puts it
    /// on this machine (a path reported by an engine on TCP may name a file elsewhere).
    fn token_socket(&self) -> Option<String> {
        let path = &self.info.as_ref()?.token_socket_path;
        (self.address.starts_with("unix:") && !path.is_empty()).then(|| path.clone())
    }
}

/// The right to send one request to one engine; dropping it tells the actor the request ended.
pub struct EngineLease {
    pub(super) engine_index: usize,
    pub(super) client: EngineRpc,
    /// Where the engine serves its token socket, when the gateway may use it.
    pub(super) token_socket: Option<String>,
    pub(super) commands: mpsc::UnboundedSender<PoolCommand>,
}

impl Drop for EngineLease {
    fn drop(&mut self) {
        // The actor may already be gone at shutdown; nothing to release then.
        let _ = self.commands.send(PoolCommand::Release {
            engine_index: self.engine_index,
        });
    }
}

pub(super) struct PoolActor {
    slots: Vec<EngineSlot>,
    snapshot_sender: watch::Sender<Arc<BackendSnapshot>>,
    max_in_flight_requests: u32,
    max_queued_requests: usize,
    /// Requests waiting for a free sequence, oldest first.
    waiting: std::collections::VecDeque<Waiter>,
    overload_log: Arc<OverloadLog>,
    /// For leases, which report their end through the same channel.
    command_sender: mpsc::UnboundedSender<PoolCommand>,
}

impl PoolActor {
    /// An actor over `slots` with nothing in flight or waiting; leases report their end through
    /// `command_sender`, the receiving end of which [`PoolActor::run`] takes.
    pub(super) fn new(
        slots: Vec<EngineSlot>,
        snapshot_sender: watch::Sender<Arc<BackendSnapshot>>,
        max_in_flight_requests: u32,
        max_queued_requests: usize,
        overload_log: Arc<OverloadLog>,
        command_sender: mpsc::UnboundedSender<PoolCommand>,
    ) -> Self {
        PoolActor {
            slots,
            snapshot_sender,
            max_in_flight_requests,
            max_queued_requests,
            waiting: std::collections::VecDeque::new(),
            overload_log,
            command_sender,
        }
    }

    pub(super) async fn run(mut self, mut commands: mpsc::UnboundedReceiver<PoolCommand>) {
        while let Some(command) = commands.recv().await {
            let changed = self.handle(command);
            if changed {
                let _ = self
                    .snapshot_sender
                    .send(Arc::new(build_snapshot(&self.slots)));
            }
        }
    }

    /// Applies one command; returns whether the published snapshot must be refreshed.
    fn handle(&mut self, command: PoolCommand) -> bool {
        match command {
            PoolCommand::Observed {
                engine_index,
                observation,
            } => {
                let Some(slot) = self.slots.get_mut(engine_index) else {
                    return false;
                };
                let was_ready = slot.ready;
                slot.ready = observation.status.ready;
                slot.last_error = if observation.status.ready {
                    None
                } else {
                    Some(format!(
                        "engine not ready: {}",
                        observation.status.not_ready_reason
                    ))
                };
                slot.info = Some(observation.info);
                slot.status = Some(observation.status);
                slot.resources = Some(observation.resources);
                if slot.ready != was_ready {
                    tracing::info!(engine = %slot.address, ready = slot.ready, "engine readiness changed");
                }
                self.serve_waiters();
                true
            }
            PoolCommand::Lost {
                engine_index,
                error,
            } => {
                let Some(slot) = self.slots.get_mut(engine_index) else {
                    return false;
                };
                if slot.ready {
                    tracing::warn!(engine = %slot.address, %error, "engine went away");
                }
                slot.ready = false;
                slot.last_error = Some(error);
                true
            }
            PoolCommand::Acquire { model_name, reply } => {
                // Waiters that gave up (deadline, client gone) hold no place in the queue.
                self.waiting.retain(|waiter| !waiter.reply.is_closed());
                // First come, first served: nobody overtakes a waiter.
                let pick = if self.waiting.is_empty() {
                    self.pick_engine(&model_name)
                } else {
                    Pick::Full("requests are already waiting".to_string())
                };
                match pick {
                    Pick::Leased(lease) => {
                        let _ = reply.send(Ok(lease));
                    }
                    Pick::Refused(error) => {
                        let _ = reply.send(Err(error));
                    }
                    Pick::Full(_) if self.waiting.len() < self.max_queued_requests => {
                        self.waiting.push_back(Waiter { model_name, reply });
                    }
                    Pick::Full(why) => {
                        let reason = format!(
                            "{why}, and {} requests wait already; retry later",
                            self.waiting.len()
                        );
                        self.overload_log.refused(&reason);
                        let _ = reply.send(Err(GatewayError::Overloaded(reason)));
                    }
                }
                true
            }
            PoolCommand::Release { engine_index } => {
                if let Some(slot) = self.slots.get_mut(engine_index) {
                    slot.in_flight_requests = slot.in_flight_requests.saturating_sub(1);
                }
                self.serve_waiters();
                true
            }
        }
    }

    /// Hands free sequences to waiters, oldest first, until none is free.
    fn serve_waiters(&mut self) {
        while let Some(waiter) = self.waiting.pop_front() {
            if waiter.reply.is_closed() {
                continue;
            }
            match self.pick_engine(&waiter.model_name) {
                // A waiter that left meanwhile drops the lease, which releases it again.
                Pick::Leased(lease) => {
                    let _ = waiter.reply.send(Ok(lease));
                }
                Pick::Refused(error) => {
                    let _ = waiter.reply.send(Err(error));
                }
                Pick::Full(_) => {
                    self.waiting.push_front(waiter);
                    return;
                }
            }
        }
    }

    /// Least-loaded ready engine serving `model_name` with a sequence free (load = gateway
    /// in-flight + engine queue); counts the lease in.
    fn pick_engine(&mut self, model_name: &str) -> Pick {
        let total_in_flight: u32 = self.slots.iter().map(|slot| slot.in_flight_requests).sum();
        if total_in_flight >= self.max_in_flight_requests {
            return Pick::Full(format!(
                "the gateway has {total_in_flight} requests in flight (limit {})",
                self.max_in_flight_requests
            ));
        }
        let serves_model = |slot: &EngineSlot| {
            model_name.is_empty()
                || slot
                    .info
                    .as_ref()
                    .is_some_and(|info| info.model_name == model_name)
        };
        // The engine's own bound (`--max-sequences`); 0 = it did not say.
        let has_free_sequence = |slot: &EngineSlot| {
            let max_sequences = slot
                .status
                .as_ref()
                .map_or(0, |status| status.max_sequences);
            max_sequences == 0 || slot.in_flight_requests < max_sequences
        };
        let candidates = || {
            self.slots
                .iter()
                .enumerate()
                .filter(|(_, slot)| slot.ready && serves_model(slot))
        };
        let any_ready = candidates().next().is_some();
        let best = candidates()
            .filter(|(_, slot)| has_free_sequence(slot))
            .min_by_key(|(_, slot)| {
                let engine_queue = slot
                    .status
                    .as_ref()
                    .map(|status| status.queued_sequences)
                    .unwrap_or(0);
                slot.in_flight_requests + engine_queue
            })
            .map(|(engine_index, slot)| (engine_index, slot.client.clone(), slot.token_socket()));
        match best {
            Some((engine_index, client, token_socket)) => {
                if let Some(slot) = self.slots.get_mut(engine_index) {
                    slot.in_flight_requests += 1;
                }
                Pick::Leased(EngineLease {
                    engine_index,
                    client,
                    token_socket,
                    commands: self.snapshot_commands(),
                })
            }
            None if any_ready => Pick::Full(format!(
                "every engine serving `{model_name}` runs its maximum of sequences"
            )),
            None => Pick::Refused(
                build_snapshot(&self.slots)
                    .resolve_model(model_name)
                    .err()
                    .unwrap_or_else(|| {
                        GatewayError::NoEngineAvailable(format!(
                            "no engine serving `{model_name}` is ready"
                        ))
                    }),
            ),
        }
    }

    fn snapshot_commands(&self) -> mpsc::UnboundedSender<PoolCommand> {
        self.command_sender.clone()
    }
}

/// The published view of the pool.
pub(super) fn build_snapshot(slots: &[EngineSlot]) -> BackendSnapshot {
    let mut snapshot = BackendSnapshot::default();
    for slot in slots {
        snapshot.engines.push(EngineReport {
            address: slot.address.clone(),
            ready: slot.ready,
            model_name: slot.info.as_ref().map(|info| info.model_name.clone()),
            status: slot.status.clone(),
            in_flight_requests: slot.in_flight_requests,
            last_error: slot.last_error.clone(),
        });
        let (Some(info), Some(resources)) = (&slot.info, &slot.resources) else {
            continue;
        };
        let entry = snapshot
            .models
            .entry(info.model_name.clone())
            .or_insert_with(|| ServedModel {
                name: info.model_name.clone(),
                architecture: info.architecture.clone(),
                created_unix_seconds: info.created_unix_seconds,
                resources: resources.clone(),
                ready_engines: 0,
            });
        if slot.ready {
            entry.ready_engines += 1;
            // Prefer the files of an engine that is up (it may have been restarted with new ones).
            entry.resources = resources.clone();
        }
    }
    snapshot
}
