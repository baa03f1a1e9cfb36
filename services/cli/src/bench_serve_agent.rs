//! The agent replay of `ninfer bench serve` (`--agent-turns`): one conversation the way a coding
//! agent holds it. Every turn sends a long fixed system prompt, the same tool definitions and
//! the whole conversation so far; between turns the conversation grows by the previous answer
//! and a tool result. What a server that reuses prompt prefixes shows here: time to first
//! token of later turns far below the first's, and the prompt tokens each turn took from the
//! prefix cache (`usage.prompt_tokens_details.cached_tokens`).
//!
//! Owns: the conversation, its turns' figures and their table.
//! Must not touch: the HTTP requests (`bench_serve_client`), the server it runs against
//! (`bench_serve`).

use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use serde_json::{json, Value};

use crate::bench_serve_client::ApiClient;

/// The shape of the replayed conversation.
#[derive(Debug, Clone, Copy)]
pub struct AgentConversation {
    pub turns: usize,
    /// Tokens of the system prompt alone (the tools come on top).
    pub system_tokens: usize,
    /// Tokens of the tool result each turn after the first appends.
    pub turn_tokens: usize,
    pub output_tokens: u32,
    pub seed: u64,
}

/// One turn's figures.
#[derive(Debug, Serialize)]
pub struct AgentTurn {
    pub turn: usize,
    pub prompt_tokens: usize,
    /// Prompt tokens taken from the server's prefix cache.
    pub cached_tokens: usize,
    pub ttft_ms: f64,
    /// This turn's time to first token ÷ the first turn's.
    pub ttft_over_first: f64,
}

#[derive(Debug, Serialize)]
pub struct AgentReport {
    pub model: String,
    pub url: String,
    pub turns: Vec<AgentTurn>,
    /// The server's prefix cache after the replay (`/metrics`): bytes held and its budget;
    /// `None` where the server does not report them.
    pub prefix_cache_bytes: Option<u64>,
    pub prefix_cache_budget_bytes: Option<u64>,
}

/// Tools a coding agent declares with every request (names and shapes after Claude Code's:
/// read, run, edit, search).
fn agent_tools() -> Value {
    let tool = |name: &str, description: &str, properties: Value, required: &[&str]| {
        json!({"type": "function", "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        }})
    };
    let string = |description: &str| json!({"type": "string", "description": description});
    json!([
        tool(
            "Read",
            "Reads a file from the local filesystem. The path must be absolute. Reads up to 2000 lines from the start unless an offset and a limit are given; lines longer than 2000 characters are cut.",
            json!({"file_path": string("The absolute path of the file to read"),
                   "offset": {"type": "integer", "description": "The line number to start reading from"},
                   "limit": {"type": "integer", "description": "The number of lines to read"}}),
            &["file_path"],
        ),
        tool(
            "Bash",
            "Runs a bash command in a persistent shell session with an optional timeout, and returns its output. Quote paths that contain spaces; prefer the dedicated tools for reading and searching files.",
            json!({"command": string("The command to run"),
                   "timeout": {"type": "integer", "description": "Milliseconds before the command is stopped (at most 600000)"},
                   "description": string("What the command does, in five to ten words")}),
            &["command"],
        ),
        tool(
            "Edit",
            "Replaces exact text in a file. The old string must occur exactly once unless replace_all is set; keep the indentation of the file.",
            json!({"file_path": string("The absolute path of the file to change"),
                   "old_string": string("The text to replace"),
                   "new_string": string("The text to put in its place"),
                   "replace_all": {"type": "boolean", "description": "Replace every occurrence"}}),
            &["file_path", "old_string", "new_string"],
        ),
        tool(
            "Grep",
            "Searches file contents with a regular expression (ripgrep syntax) and lists the matching files or lines.",
            json!({"pattern": string("The regular expression to search for"),
                   "path": string("The file or directory to search in"),
                   "glob": string("Only files whose names match this glob")}),
            &["pattern"],
        ),
    ])
}

/// Replays `conversation` against `model` on `client`'s server, turn after turn.
pub fn replay(
    client: &ApiClient,
    model: &str,
    conversation: AgentConversation,
) -> anyhow::Result<Vec<AgentTurn>> {
    // Texts first: their tokenizing is not part of what is measured.
    let system = client
        .prompt_of_length(model, conversation.system_tokens, conversation.seed)
        .context("the system prompt")?;
    let results: Vec<String> = (1..conversation.turns)
        .map(|turn| {
            client.prompt_of_length(
                model,
                conversation.turn_tokens,
                conversation.seed.wrapping_add(turn as u64),
            )
        })
        .collect::<anyhow::Result<_>>()
        .context("the tool results")?;
    let tools = agent_tools();
    let mut messages = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": "Find where the configuration is read and explain it."}),
    ];
    let mut turns = Vec::with_capacity(conversation.turns);
    for turn in 1..=conversation.turns {
        let timing = client
            .stream_conversation(
                model,
                &Value::Array(messages.clone()),
                Some(&tools),
                conversation.output_tokens,
            )
            .with_context(|| format!("turn {turn}"))?;
        let ttft = timing
            .time_to_first_token()
            .with_context(|| format!("turn {turn} answered no text"))?;
        turns.push(turn_figures(
            turn,
            timing.prompt_tokens,
            timing.cached_tokens,
            ttft,
            turns.first(),
        ));
        if let Some(result) = results.get(turn - 1) {
            messages.push(json!({"role": "assistant", "content": timing.answer}));
            messages.push(json!({"role": "user", "content": result}));
        }
    }
    Ok(turns)
}

fn turn_figures(
    turn: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    ttft: Duration,
    first: Option<&AgentTurn>,
) -> AgentTurn {
    let ttft_ms = ttft.as_secs_f64() * 1e3;
    AgentTurn {
        turn,
        prompt_tokens,
        cached_tokens,
        ttft_ms,
        ttft_over_first: first.map_or(1.0, |first| ttft_ms / first.ttft_ms.max(1e-9)),
    }
}

/// The prefix cache's bytes and budget from the server's `/metrics` (the gateway polls its
/// engines about twice a second: read after a second's pause).
pub fn prefix_cache_memory(client: &ApiClient) -> (Option<u64>, Option<u64>) {
    std::thread::sleep(Duration::from_millis(1200));
    let Ok(metrics) = client.get_text("/metrics") else {
        return (None, None);
    };
    (
        metric_sum(&metrics, "ninfer_engine_prefix_cache_bytes"),
        metric_sum(&metrics, "ninfer_engine_prefix_cache_budget_bytes"),
    )
}

/// The sum of a metric's samples over its labels (one per engine); `None` without a sample.
fn metric_sum(metrics: &str, name: &str) -> Option<u64> {
    let values: Vec<u64> = metrics
        .lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|value| value as u64)
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

pub fn print_table(report: &AgentReport, conversation: &AgentConversation) {
    println!(
        "{} through {}: agent replay (streaming /v1/chat/completions, a {}-token system prompt and 4 tools, {} tokens appended per turn, {} tokens each answer)",
        report.model,
        report.url,
        conversation.system_tokens,
        conversation.turn_tokens,
        conversation.output_tokens
    );
    println!("| turn | prompt tokens | cached tokens | TTFT ms | TTFT ÷ turn 1 |");
    println!("|---|---|---|---|---|");
    for turn in &report.turns {
        println!(
            "| {} | {} | {} | {:.1} | {:.1}% |",
            turn.turn,
            turn.prompt_tokens,
            turn.cached_tokens,
            turn.ttft_ms,
            turn.ttft_over_first * 100.0
        );
    }
    let mib = |bytes: u64| bytes as f64 / (1u64 << 20) as f64;
    match (report.prefix_cache_bytes, report.prefix_cache_budget_bytes) {
        (Some(bytes), Some(budget)) if budget > 0 => println!(
            "prefix cache: {:.1} MiB held of a {:.1} MiB budget",
            mib(bytes),
            mib(budget)
        ),
        (Some(_), Some(_)) => println!("prefix cache: off"),
        _ => println!("prefix cache: the server reports no figures"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_summed_over_engines_by_exact_name() {
        let metrics = "# HELP ninfer_engine_prefix_cache_bytes Bytes.\n\
            ninfer_engine_prefix_cache_bytes{engine=\"a\"} 1048576\n\
            ninfer_engine_prefix_cache_bytes{engine=\"b\"} 2\n\
            ninfer_engine_prefix_cache_bytes_total{engine=\"a\"} 7\n\
            ninfer_engine_prefix_cache_budget_bytes 4e9\n";
        assert_eq!(
            metric_sum(metrics, "ninfer_engine_prefix_cache_bytes"),
            Some(1_048_578)
        );
        assert_eq!(
            metric_sum(metrics, "ninfer_engine_prefix_cache_budget_bytes"),
            Some(4_000_000_000)
        );
        assert_eq!(metric_sum(metrics, "ninfer_engine_prefix_cache_hits"), None);
    }

    #[test]
    fn later_turns_are_measured_against_the_first() {
        let first = turn_figures(1, 1000, 0, Duration::from_millis(400), None);
        assert_eq!(first.ttft_over_first, 1.0);
        let second = turn_figures(2, 1300, 768, Duration::from_millis(100), Some(&first));
        assert!((second.ttft_over_first - 0.25).abs() < 1e-9);
        assert_eq!((second.prompt_tokens, second.cached_tokens), (1300, 768));
    }

    #[test]
    fn every_tool_is_a_function_with_required_parameters_it_declares() {
        let tools = agent_tools();
        let tools = tools.as_array().map(Vec::as_slice).unwrap_or_default();
        assert_eq!(tools.len(), 4);
        for tool in tools {
            let function = &tool["function"];
            let properties = &function["parameters"]["properties"];
            let required = function["parameters"]["required"].as_array();
            assert!(
                required.is_some_and(|required| required.iter().all(|name| name
                    .as_str()
                    .is_some_and(|name| properties.get(name).is_some())))
            );
        }
    }
}
