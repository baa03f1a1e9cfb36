//! Prometheus metrics of the gateway, plus the engine counters it re-exports.
//!
//! Owns: lock-free counters and fixed-bucket histograms (requests, tokens, time to first token,
//! inter-token latency, request duration, in-flight requests), the prompt-token cache's totals
//! (from `prompt_token_cache`) and the text exposition format of
//! `GET /metrics`, including per-engine gauges/counters taken from the pool snapshot (queue
//! depth, expert-cache hits/misses/refills, CPU expert calls, KV use) and routing totals.
//! Must not touch: request handling; handlers only call the `record_*` methods.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::backend::{BackendSnapshot, ResumeCounts};
use crate::routing_stats::ModelRoutingTotals;

/// Histogram with fixed upper bounds (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations above the bound before and at most this one: one increment per
    /// observation (inter-token latency is observed per token); exposition sums them into
    /// Prometheus' cumulative buckets.
    bucket_counts: Vec<AtomicU64>,
    count: AtomicU64,
    /// Sum in microseconds, so it fits an atomic integer.
    sum_micros: AtomicU64,
}

const LATENCY_BOUNDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const TOKEN_LATENCY_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
];
const DURATION_BOUNDS: &[f64] = &[
    0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            bucket_counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, seconds: f64) {
        // The first bound at or above `seconds` (none for NaN or past the last bound).
        let first_fitting = self.bounds.partition_point(|bound| *bound < seconds);
        if let Some(bucket) = self
            .bucket_counts
            .get(first_fitting)
            .filter(|_| !seconds.is_nan())
        {
            bucket.fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add((seconds.max(0.0) * 1e6) as u64, Ordering::Relaxed);
    }

    fn render(&self, output: &mut String, name: &str, help: &str) {
        let _ = writeln!(output, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, bucket) in self.bounds.iter().zip(&self.bucket_counts) {
            cumulative += bucket.load(Ordering::Relaxed);
            let _ = writeln!(output, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(output, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(
            output,
            "{name}_sum {}",
            self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(output, "{name}_count {count}");
    }
}

/// All gateway-side metrics.
pub struct GatewayMetrics {
    /// (endpoint, HTTP status) → count.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub in_flight_requests: AtomicU64,
    pub cancelled_generations: AtomicU64,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub request_duration: Histogram,
}

impl Default for GatewayMetrics {
    fn default() -> Self {
        GatewayMetrics {
            requests: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            in_flight_requests: AtomicU64::new(0),
            cancelled_generations: AtomicU64::new(0),
            time_to_first_token: Histogram::new(LATENCY_BOUNDS),
            inter_token_latency: Histogram::new(TOKEN_LATENCY_BOUNDS),
            request_duration: Histogram::new(DURATION_BOUNDS),
        }
    }
}

impl GatewayMetrics {
    pub fn record_request(&self, endpoint: &str, status: u16) {
        if let Ok(mut requests) = self.requests.lock() {
            *requests.entry((endpoint.to_string(), status)).or_insert(0) += 1;
        }
    }

    /// Prometheus text exposition of gateway metrics, engine counters and routing totals.
    pub fn render(
        &self,
        snapshot: &BackendSnapshot,
        routing: &[ModelRoutingTotals],
        resumes: ResumeCounts,
    ) -> String {
        let mut output = String::new();
        output.push_str(
            "# HELP ninfer_gateway_requests_total HTTP requests by endpoint and status.\n",
        );
        output.push_str("# TYPE ninfer_gateway_requests_total counter\n");
        if let Ok(requests) = self.requests.lock() {
            for ((endpoint, status), count) in requests.iter() {
                let _ = writeln!(output, "ninfer_gateway_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {count}");
            }
        }
        let counters = [
            (
                "ninfer_gateway_prompt_tokens_total",
                "Prompt tokens sent to engines.",
                &self.prompt_tokens,
            ),
            (
                "ninfer_gateway_completion_tokens_total",
                "Tokens generated for clients.",
                &self.completion_tokens,
            ),
            (
                "ninfer_gateway_cancelled_generations_total",
                "Generations cancelled (client gone or stop string).",
                &self.cancelled_generations,
            ),
        ];
        for (name, help, value) in counters {
            let _ = writeln!(
                output,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                value.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            output,
            "# HELP ninfer_gateway_resumed_streams_total Answers continued on another (or the restarted) engine after theirs went away.\n# TYPE ninfer_gateway_resumed_streams_total counter\nninfer_gateway_resumed_streams_total {}\n# HELP ninfer_gateway_abandoned_resumes_total Answers whose engine went away and that could not be continued (they ended with an error).\n# TYPE ninfer_gateway_abandoned_resumes_total counter\nninfer_gateway_abandoned_resumes_total {}",
            resumes.resumed, resumes.abandoned
        );
        let _ = writeln!(
            output,
            "# HELP ninfer_gateway_in_flight_requests Generations in progress (gateway queue depth).\n# TYPE ninfer_gateway_in_flight_requests gauge\nninfer_gateway_in_flight_requests {}",
            self.in_flight_requests.load(Ordering::Relaxed)
        );
        self.time_to_first_token.render(
            &mut output,
            "ninfer_gateway_time_to_first_token_seconds",
            "Time from request to first token.",
        );
        self.inter_token_latency.render(
            &mut output,
            "ninfer_gateway_inter_token_latency_seconds",
            "Time between consecutive tokens.",
        );
        self.request_duration.render(
            &mut output,
            "ninfer_gateway_request_duration_seconds",
            "Time from request to last token.",
        );
        crate::prompt_token_cache::render_metrics(&mut output);
        render_engines(&mut output, snapshot);
        output.push_str("# HELP ninfer_routing_tokens_total Tokens routed through the experts, all engines, per model.\n");
        output.push_str("# TYPE ninfer_routing_tokens_total counter\n");
        for totals in routing {
            let _ = writeln!(
                output,
                "ninfer_routing_tokens_total{{model=\"{}\"}} {}",
                escape_label(&totals.model),
                totals.tokens_routed
            );
        }
        output
    }
}

fn render_engines(output: &mut String, snapshot: &BackendSnapshot) {
    type Field = (
        &'static str,
        &'static str,
        &'static str,
        fn(&ninfer_protocol::v1::EngineStatus) -> u64,
    );
    let fields: [Field; 20] = [
        (
            "ninfer_engine_running_sequences",
            "gauge",
            "Sequences being decoded.",
            |s| u64::from(s.running_sequences),
        ),
        (
            "ninfer_engine_queued_sequences",
            "gauge",
            "Sequences waiting in the engine queue.",
            |s| u64::from(s.queued_sequences),
        ),
        (
            "ninfer_engine_expert_cache_hits_total",
            "counter",
            "Routed-expert lookups served from a GPU slot.",
            |s| s.expert_cache_hits_total,
        ),
        (
            "ninfer_engine_expert_cache_misses_total",
            "counter",
            "Routed-expert lookups sent to CPU workers.",
            |s| s.expert_cache_misses_total,
        ),
        (
            "ninfer_engine_expert_slot_refills_total",
            "counter",
            "GPU expert slot refills.",
            |s| s.expert_slot_refills_total,
        ),
        (
            "ninfer_engine_expert_cache_evictions_total",
            "counter",
            "GPU expert slot refills that replaced a resident expert.",
            |s| s.expert_cache_evictions_total,
        ),
        (
            "ninfer_engine_expert_cache_bytes_copied_total",
            "counter",
            "Expert weight bytes copied into GPU slots by refills.",
            |s| s.expert_cache_bytes_copied_total,
        ),
        (
            "ninfer_engine_gpu_expert_slots",
            "gauge",
            "GPU expert slots.",
            |s| u64::from(s.gpu_expert_slots),
        ),
        (
            "ninfer_engine_cpu_expert_calls_total",
            "counter",
            "Expert computations done by CPU workers.",
            |s| s.cpu_expert_calls_total,
        ),
        (
            "ninfer_engine_kv_cache_used_tokens",
            "gauge",
            "KV cache positions in use.",
            |s| s.kv_cache_used_tokens,
        ),
        (
            "ninfer_engine_generated_tokens_total",
            "counter",
            "Tokens generated by the engine.",
            |s| s.generated_tokens_total,
        ),
        (
            "ninfer_engine_speculative_steps_total",
            "counter",
            "Verification steps of sequences that drafted with the MTP head.",
            |s| s.speculative_steps_total,
        ),
        (
            "ninfer_engine_draft_tokens_total",
            "counter",
            "Tokens drafted with the MTP head.",
            |s| s.drafted_tokens_by_depth.iter().sum(),
        ),
        (
            "ninfer_engine_draft_tokens_accepted_total",
            "counter",
            "Drafted tokens the main model accepted.",
            |s| s.accepted_tokens_by_depth.iter().sum(),
        ),
        (
            "ninfer_engine_prefix_cache_lookups_total",
            "counter",
            "Prompts looked up in the prefix cache.",
            |s| s.prefix_cache_lookups_total,
        ),
        (
            "ninfer_engine_prefix_cache_hits_total",
            "counter",
            "Prompts that reused a cached prefix.",
            |s| s.prefix_cache_hits_total,
        ),
        (
            "ninfer_engine_prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens taken from the prefix cache instead of computed.",
            |s| s.prefix_cache_hit_tokens_total,
        ),
        (
            "ninfer_engine_prefix_cache_evictions_total",
            "counter",
            "Prefix cache blocks evicted to stay within the budget.",
            |s| s.prefix_cache_evictions_total,
        ),
        (
            "ninfer_engine_prefix_cache_bytes",
            "gauge",
            "Bytes the prefix cache's blocks and checkpoints take.",
            |s| s.prefix_cache_bytes,
        ),
        (
            "ninfer_engine_prefix_cache_budget_bytes",
            "gauge",
            "The prefix cache's budget in bytes (0: off).",
            |s| s.prefix_cache_budget_bytes,
        ),
    ];
    let _ = writeln!(output, "# HELP ninfer_engine_up Whether the engine is ready (1) or not (0).\n# TYPE ninfer_engine_up gauge");
    for engine in &snapshot.engines {
        let _ = writeln!(
            output,
            "ninfer_engine_up{{engine=\"{}\"}} {}",
            escape_label(&engine.address),
            u8::from(engine.ready)
        );
    }
    for (name, kind, help, read) in fields {
        let _ = writeln!(output, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for engine in &snapshot.engines {
            if let Some(status) = &engine.status {
                let _ = writeln!(
                    output,
                    "{name}{{engine=\"{}\"}} {}",
                    escape_label(&engine.address),
                    read(status)
                );
            }
        }
    }
    render_draft_depths(output, snapshot);
    render_expert_cache_layers(output, snapshot);
}

/// Acceptance per draft position: depth 1 is the first draft of a step.
fn render_draft_depths(output: &mut String, snapshot: &BackendSnapshot) {
    type DepthField = (
        &'static str,
        &'static str,
        fn(&ninfer_protocol::v1::EngineStatus) -> &[u64],
    );
    let depth_fields: [DepthField; 2] = [
        (
            "ninfer_engine_draft_tokens_by_depth_total",
            "Tokens drafted with the MTP head, per draft position.",
            |s| &s.drafted_tokens_by_depth,
        ),
        (
            "ninfer_engine_draft_tokens_accepted_by_depth_total",
            "Drafts accepted together with every draft before them, per draft position.",
            |s| &s.accepted_tokens_by_depth,
        ),
    ];
    for (name, help, read) in depth_fields {
        let _ = writeln!(output, "# HELP {name} {help}\n# TYPE {name} counter");
        for engine in &snapshot.engines {
            if let Some(status) = &engine.status {
                for (depth, count) in read(status).iter().enumerate() {
                    let _ = writeln!(
                        output,
                        "{name}{{engine=\"{}\",depth=\"{}\"}} {count}",
                        escape_label(&engine.address),
                        depth + 1
                    );
                }
            }
        }
    }
}

/// The expert cache's counters per engine and MoE layer.
fn render_expert_cache_layers(output: &mut String, snapshot: &BackendSnapshot) {
    type LayerField = (
        &'static str,
        &'static str,
        fn(&ninfer_protocol::v1::ExpertCacheLayerCounts) -> u64,
    );
    let fields: [LayerField; 5] = [
        (
            "ninfer_engine_expert_cache_layer_hits_total",
            "Routed-expert lookups of one MoE layer served from a GPU slot.",
            |l| l.hits,
        ),
        (
            "ninfer_engine_expert_cache_layer_misses_total",
            "Routed-expert lookups of one MoE layer sent to the CPU.",
            |l| l.misses,
        ),
        (
            "ninfer_engine_expert_cache_layer_fills_total",
            "GPU expert slot refills of one MoE layer.",
            |l| l.fills,
        ),
        (
            "ninfer_engine_expert_cache_layer_evictions_total",
            "Refills of one MoE layer that replaced a resident expert.",
            |l| l.evictions,
        ),
        (
            "ninfer_engine_expert_cache_layer_bytes_copied_total",
            "Expert weight bytes copied into one MoE layer's GPU slots.",
            |l| l.bytes_copied,
        ),
    ];
    for (name, help, read) in fields {
        let _ = writeln!(output, "# HELP {name} {help}\n# TYPE {name} counter");
        for engine in &snapshot.engines {
            let Some(status) = &engine.status else {
                continue;
            };
            for layer in &status.expert_cache_layers {
                let _ = writeln!(
                    output,
                    "{name}{{engine=\"{}\",layer=\"{}\"}} {}",
                    escape_label(&engine.address),
                    layer.layer,
                    read(layer)
                );
            }
        }
    }
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_counts_of_observations_at_or_below_each_bound() {
        let histogram = Histogram::new(TOKEN_LATENCY_BOUNDS);
        let observed = [
            0.0,
            0.0005,
            0.001,
            0.0011,
            0.02,
            0.019,
            0.5,
            1.28,
            1.3,
            100.0,
            -1.0,
            f64::NAN,
        ];
        for seconds in observed {
            histogram.observe(seconds);
        }
        let mut rendered = String::new();
        histogram.render(&mut rendered, "itl", "help");
        for bound in TOKEN_LATENCY_BOUNDS {
            let expected = observed
                .iter()
                .filter(|seconds| **seconds <= *bound)
                .count();
            let line = format!("itl_bucket{{le=\"{bound}\"}} {expected}\n");
            assert!(rendered.contains(&line), "{line} not in\n{rendered}");
        }
        assert!(rendered.contains(&format!("itl_bucket{{le=\"+Inf\"}} {}\n", observed.len())));
        assert!(rendered.contains(&format!("itl_count {}\n", observed.len())));
    }
}
