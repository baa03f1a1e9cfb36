//! The HTTP side of `ninfer bench serve`: what a user's client does and sees. Builds prompts of
//! an exact token count with the server's own tokenizer (`/tokenize`, `/detokenize`), sends
//! streaming OpenAI chat requests and timestamps every server-sent event, probes `/health`
//! while the load runs, and reads a process's CPU time from `/proc`.
//!
//! Owns: the request and event shapes of the benchmark, the per-request timings.
//! Must not touch: what is started or how the figures are summarised (`bench_serve`).

use std::io::{BufRead, BufReader};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};

/// A blocking HTTP client for one server.
#[derive(Clone)]
pub(crate) struct ApiClient {
    base_url: String,
    api_key: Option<String>,
    agent: ureq::Agent,
    /// What the chat template adds around a user message, once known (one model per server).
    template_tokens: Arc<std::sync::OnceLock<usize>>,
}

/// What one streamed answer looked like at the client.
#[derive(Debug, Clone)]
pub(crate) struct StreamTiming {
    pub sent_at: Instant,
    /// Arrival of each event that carried text (answer or reasoning).
    pub text_arrivals: Vec<Instant>,
    /// Tokens the server counted (`usage.completion_tokens`), else the text events.
    pub completion_tokens: usize,
    pub prompt_tokens: usize,
    /// Prompt tokens the server took from its prefix cache (`prompt_tokens_details`).
    pub cached_tokens: usize,
    /// The answer's text (reasoning left out).
    pub answer: String,
}

impl StreamTiming {
    pub fn time_to_first_token(&self) -> Option<Duration> {
        self.text_arrivals
            .first()
            .map(|first| first.saturating_duration_since(self.sent_at))
    }

    /// Decode rate of this stream: tokens after the first over the time after the first.
    pub fn decode_tokens_per_second(&self) -> Option<f64> {
        let (first, last) = (self.text_arrivals.first()?, self.text_arrivals.last()?);
        let seconds = last.saturating_duration_since(*first).as_secs_f64();
        (seconds > 0.0 && self.completion_tokens > 1)
            .then(|| (self.completion_tokens - 1) as f64 / seconds)
    }
}

impl ApiClient {
    pub fn new(base_url: &str, api_key: Option<String>) -> Self {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(10)))
            .timeout_per_read(Some(Duration::from_secs(600)))
            // The server is on this machine or named by the user: no proxy in between.
            .proxy(None)
            .build()
            .into();
        ApiClient {
            base_url: base_url.trim_end_matches('/').to_string(),
            api_key,
            agent,
            template_tokens: Arc::default(),
        }
    }

    /// `request` with the API key, when one is set.
    fn authorized<B>(&self, request: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.api_key {
            Some(key) => request.header("authorization", &format!("Bearer {key}")),
            None => request,
        }
    }

    fn post_json(&self, path: &str, body: &Value) -> anyhow::Result<Value> {
        let url = format!("{}{path}", self.base_url);
        let request = self.authorized(
            self.agent
                .post(&url)
                .header("content-type", "application/json"),
        );
        let mut response = request
            .send(body.to_string())
            .with_context(|| format!("POST {url}"))?;
        let status = response.status().as_u16();
        let text = response
            .body_mut()
            .with_config()
            .limit(256 << 20)
            .read_to_string()
            .with_context(|| format!("reading the answer of POST {url}"))?;
        if status != 200 {
            bail!("POST {url} answered {status}: {text}");
        }
        serde_json::from_str(&text).with_context(|| format!("POST {url}: the answer is not JSON"))
    }

    /// `GET path`: the status and how long the answer took.
    pub fn get_status(&self, path: &str) -> anyhow::Result<(u16, Duration)> {
        let url = format!("{}{path}", self.base_url);
        let started = Instant::now();
        let request = self.authorized(self.agent.get(&url));
        let mut response = request.call().with_context(|| format!("GET {url}"))?;
        let status = response.status().as_u16();
        let _ = response.body_mut().read_to_string();
        Ok((status, started.elapsed()))
    }

    /// The first model `/v1/models` lists.
    pub fn first_model(&self) -> anyhow::Result<String> {
        let url = format!("{}/v1/models", self.base_url);
        let request = self.authorized(self.agent.get(&url));
        let mut response = request.call().with_context(|| format!("GET {url}"))?;
        let text = response.body_mut().read_to_string()?;
        let listing: Value =
            serde_json::from_str(&text).with_context(|| format!("GET {url}: {text}"))?;
        listing["data"][0]["id"]
            .as_str()
            .map(str::to_string)
            .with_context(|| format!("GET {url} lists no model: {text}"))
    }

    /// Tokens the chat template adds around one user message (asked once per client).
    fn chat_template_tokens(&self, model: &str) -> anyhow::Result<usize> {
        if let Some(count) = self.template_tokens.get() {
            return Ok(*count);
        }
        let count = self.chat_token_count(model, "")?;
        Ok(*self.template_tokens.get_or_init(|| count))
    }

    /// Tokens of a chat of one user message, as the server renders and encodes it.
    fn chat_token_count(&self, model: &str, content: &str) -> anyhow::Result<usize> {
        let answer = self.post_json(
            "/tokenize",
            &json!({
                "model": model,
                "messages": [{"role": "user", "content": content}],
                "add_generation_prompt": true,
            }),
        )?;
        answer["count"]
            .as_u64()
            .map(|count| count as usize)
            .context("/tokenize gave no `count`")
    }

    /// A user message whose chat prompt is `prompt_tokens` tokens long (as close as the
    /// tokenizer allows), of random words drawn from `seed`: every prompt differs, so no
    /// server can answer one from another's work.
    pub fn prompt_of_length(
        &self,
        model: &str,
        prompt_tokens: usize,
        seed: u64,
    ) -> anyhow::Result<String> {
        let overhead = self.chat_template_tokens(model)?;
        if prompt_tokens <= overhead {
            bail!(
                "--prompt-tokens {prompt_tokens}: the chat template alone takes {overhead} tokens"
            );
        }
        // Words enough for the tokens wanted and not many more (a long prompt's words must stay
        // within the server's context): the tokens per word of a sample tell how many.
        let wanted = prompt_tokens - overhead;
        let sample = self.tokens_of(model, &random_words(64, seed))?.len().max(1);
        let mut count = wanted * 64 / sample + wanted / 10 + 8;
        let ids = loop {
            let ids = self.tokens_of(model, &random_words(count, seed))?;
            if ids.len() >= wanted || count >= 64 * wanted {
                break ids;
            }
            count *= 2;
        };
        let mut content_tokens = wanted.min(ids.len());
        let mut content = String::new();
        // Cutting the token list and decoding can merge or split a token at the seam: correct
        // the length a few times with the server's own count.
        for _ in 0..6 {
            let decoded = self.post_json(
                "/detokenize",
                &json!({"model": model, "tokens": &ids[..content_tokens]}),
            )?;
            content = decoded["prompt"]
                .as_str()
                .context("/detokenize gave no `prompt`")?
                .to_string();
            let total = self.chat_token_count(model, &content)?;
            if total == prompt_tokens {
                break;
            }
            let corrected = content_tokens as i64 + prompt_tokens as i64 - total as i64;
            content_tokens = corrected.clamp(1, ids.len() as i64) as usize;
        }
        Ok(content)
    }

    /// `GET path`'s body as text (e.g. `/metrics`).
    pub fn get_text(&self, path: &str) -> anyhow::Result<String> {
        let url = format!("{}{path}", self.base_url);
        let request = self.authorized(self.agent.get(&url));
        let mut response = request.call().with_context(|| format!("GET {url}"))?;
        let status = response.status().as_u16();
        let text = response.body_mut().read_to_string()?;
        if status != 200 {
            bail!("GET {url} answered {status}: {text}");
        }
        Ok(text)
    }

    /// The server's token ids of `text` (no special tokens added).
    fn tokens_of(&self, model: &str, text: &str) -> anyhow::Result<Vec<u64>> {
        let encoded = self.post_json(
            "/tokenize",
            &json!({"model": model, "prompt": text, "add_special_tokens": false}),
        )?;
        Ok(encoded["tokens"]
            .as_array()
            .context("/tokenize gave no `tokens`")?
            .iter()
            .filter_map(Value::as_u64)
            .collect())
    }

    /// One streaming chat completion of `max_tokens` tokens (end-of-sequence ignored, so every
    /// answer has the same length), timed event by event.
    pub fn stream_chat(
        &self,
        model: &str,
        content: &str,
        max_tokens: u32,
    ) -> anyhow::Result<StreamTiming> {
        let messages = json!([{"role": "user", "content": content}]);
        self.stream_conversation(model, &messages, None, max_tokens)
    }

    /// [`ApiClient::stream_chat`] of a whole conversation (OpenAI `messages`) and, when given,
    /// the tools it declares.
    pub fn stream_conversation(
        &self,
        model: &str,
        messages: &Value,
        tools: Option<&Value>,
        max_tokens: u32,
    ) -> anyhow::Result<StreamTiming> {
        let url = format!("{}/v1/chat/completions", self.base_url);
        let mut body = json!({
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
            "ignore_eos": true,
        });
        if let Some(tools) = tools {
            body["tools"] = tools.clone();
        }
        let request = self.authorized(
            self.agent
                .post(&url)
                .header("content-type", "application/json"),
        );
        let sent_at = Instant::now();
        let mut response = request
            .send(body.to_string())
            .with_context(|| format!("POST {url}"))?;
        let status = response.status().as_u16();
        if status != 200 {
            let text = response.body_mut().read_to_string().unwrap_or_default();
            let hint = if status == 429 {
                " (the server runs fewer sequences than streams: raise its --max-sequences or lower --concurrency)"
            } else {
                ""
            };
            bail!("POST {url} answered {status}{hint}: {text}");
        }
        let mut timing = StreamTiming {
            sent_at,
            text_arrivals: Vec::new(),
            completion_tokens: 0,
            prompt_tokens: 0,
            cached_tokens: 0,
            answer: String::new(),
        };
        let reader = BufReader::new(response.body_mut().as_reader());
        for line in reader.lines() {
            let line = line.with_context(|| format!("reading the stream of {url}"))?;
            let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                continue;
            };
            if data == "[DONE]" {
                break;
            }
            let arrived = Instant::now();
            let event: Value = serde_json::from_str(data)
                .with_context(|| format!("{url}: an event is not JSON: {data}"))?;
            if let Some(error) = event.get("error") {
                bail!("{url}: the stream ended with an error: {error}");
            }
            let delta = &event["choices"][0]["delta"];
            let carries_text = ["content", "reasoning_content"]
                .iter()
                .any(|key| delta[key].as_str().is_some_and(|text| !text.is_empty()));
            if carries_text {
                timing.text_arrivals.push(arrived);
            }
            if let Some(text) = delta["content"].as_str() {
                timing.answer.push_str(text);
            }
            if let Some(usage) = event.get("usage").filter(|usage| !usage.is_null()) {
                timing.completion_tokens =
                    usage["completion_tokens"].as_u64().unwrap_or(0) as usize;
                timing.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0) as usize;
                timing.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0) as usize;
            }
        }
        if timing.completion_tokens == 0 {
            timing.completion_tokens = timing.text_arrivals.len();
        }
        Ok(timing)
    }
}

/// Pseudo-words of two to four syllables from a seeded generator: text that tokenizes like
/// prose (spaces, word pieces) in any language's tokenizer.
fn random_words(count: usize, seed: u64) -> String {
    const SYLLABLES: [&str; 24] = [
        "ka", "lo", "mi", "ter", "san", "do", "ri", "ven", "pa", "qui", "mor", "te", "lu", "zan",
        "bi", "ro", "fe", "gal", "ni", "sto", "we", "hu", "cor", "ya",
    ];
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        // xorshift64*: quick, seeded, good enough for word shapes.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let mut text = String::with_capacity(count * 8);
    for index in 0..count {
        if index > 0 {
            text.push(if next() % 13 == 0 { '\n' } else { ' ' });
        }
        for _ in 0..2 + next() % 3 {
            text.push_str(SYLLABLES[(next() % SYLLABLES.len() as u64) as usize]);
        }
    }
    text
}

/// `/health` answer times while a load runs.
pub(crate) struct HealthProbe {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<Result<Duration, String>>>>,
}

impl HealthProbe {
    /// Asks `/health` every `interval` until stopped.
    pub fn start(client: ApiClient, interval: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut answers = Vec::new();
            while !stopping.load(Ordering::Relaxed) {
                answers.push(match client.get_status("/health") {
                    Ok((200, took)) => Ok(took),
                    Ok((status, _)) => Err(format!("status {status}")),
                    Err(error) => Err(format!("{error:#}")),
                });
                std::thread::sleep(interval);
            }
            answers
        });
        HealthProbe {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops probing: each answer's time, or why it failed.
    pub fn finish(mut self) -> Vec<Result<Duration, String>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .and_then(|thread| thread.join().ok())
            .unwrap_or_default()
    }
}

/// CPU time (user plus system) a process has used, all its threads together (also those that
/// have ended): read from its CPU-time clock, to the nanosecond, where the system lets us, else
/// from `/proc/PID/stat` (whole clock ticks: 10 ms, too coarse for a few hundred tokens).
pub(crate) fn process_cpu_time(pid: u32) -> anyhow::Result<Duration> {
    match process_cpu_clock(pid) {
        Some(time) => Ok(time),
        None => process_cpu_ticks(pid),
    }
}

/// The process's CPU-time clock (`clock_getcpuclockid`), or `None` where it cannot be read.
fn process_cpu_clock(pid: u32) -> Option<Duration> {
    let pid = nix::libc::pid_t::try_from(pid).ok()?;
    let mut clock: nix::libc::clockid_t = 0;
    // SAFETY: writes one clockid_t into `clock`, which lives through the call.
    if unsafe { nix::libc::clock_getcpuclockid(pid, &mut clock) } != 0 {
        return None;
    }
    let mut time = nix::libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec into `time`, which lives through the call.
    if unsafe { nix::libc::clock_gettime(clock, &mut time) } != 0 {
        return None;
    }
    let seconds = u64::try_from(time.tv_sec).ok()?;
    let nanos = u32::try_from(time.tv_nsec).ok()?;
    Some(Duration::new(seconds, nanos))
}

/// User plus system CPU time from `/proc/PID/stat`, in whole clock ticks.
fn process_cpu_ticks(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let after_name = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .with_context(|| format!("/proc/{pid}/stat has no command name"))?;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after the name.
    let ticks = |index: usize| -> anyhow::Result<u64> {
        fields
            .get(index)
            .and_then(|field| field.parse().ok())
            .with_context(|| format!("/proc/{pid}/stat field {} is not a number", index + 3))
    };
    let total = ticks(11)? + ticks(12)?;
    // SAFETY: sysconf reads a constant of the running system.
    let per_second = unsafe { nix::libc::sysconf(nix::libc::_SC_CLK_TCK) };
    let per_second = if per_second > 0 {
        per_second as u64
    } else {
        100
    };
    Ok(Duration::from_nanos(total * 1_000_000_000 / per_second))
}

/// The first process named `name` among `root`'s descendants (its children, theirs, ...).
pub(crate) fn descendant_named(root: u32, name: &str) -> Option<u32> {
    let mut parents = vec![root];
    let mut seen = 0;
    while seen < parents.len() {
        let parent = parents[seen];
        seen += 1;
        let entries = std::fs::read_dir("/proc").ok()?;
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                continue;
            };
            let command = &stat[open + 1..close];
            let parent_pid = stat[close + 1..]
                .split_whitespace()
                .nth(1)
                .and_then(|field| field.parse::<u32>().ok());
            if parent_pid == Some(parent) {
                if command == name {
                    return Some(pid);
                }
                parents.push(pid);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_clock_counts_what_the_process_burns_and_agrees_with_proc() {
        let pid = std::process::id();
        let clock_before = process_cpu_clock(pid).unwrap_or_else(|| panic!("no CPU clock"));
        let ticks_before = process_cpu_ticks(pid).unwrap_or_else(|e| panic!("{e}"));
        let started = std::time::Instant::now();
        let mut sum = 0u64;
        while started.elapsed() < Duration::from_millis(200) {
            sum = std::hint::black_box(sum.wrapping_mul(31).wrapping_add(7));
        }
        let clock = process_cpu_clock(pid).unwrap_or_else(|| panic!("no CPU clock")) - clock_before;
        let ticks = process_cpu_ticks(pid).unwrap_or_else(|e| panic!("{e}")) - ticks_before;
        // The loop runs 200 ms of wall time; on a loaded machine it gets less of the CPU.
        assert!(clock > Duration::from_millis(5), "{clock:?}");
        assert!(clock < Duration::from_secs(5), "{clock:?}");
        // Other threads of the test binary may run too; ticks are 10 ms coarse.
        assert!(
            clock.abs_diff(ticks) < Duration::from_millis(60),
            "{clock:?} {ticks:?}"
        );
    }

    #[test]
    fn random_words_are_seeded_and_differ_between_seeds() {
        assert_eq!(random_words(50, 7), random_words(50, 7));
        assert_ne!(random_words(50, 7), random_words(50, 8));
        assert_eq!(random_words(50, 7).split_whitespace().count(), 50);
    }

    #[test]
    fn this_process_has_cpu_time_and_no_descendant_of_that_name() {
        let pid = std::process::id();
        let spent = process_cpu_time(pid).unwrap_or_else(|e| panic!("{e:#}"));
        let mut sum = 0u64;
        for i in 0..20_000_000u64 {
            sum = sum.wrapping_add(i * i);
        }
        assert!(sum > 0);
        let later = process_cpu_time(pid).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(later >= spent);
        assert_eq!(descendant_named(pid, "no-such-process-name"), None);
    }
}
