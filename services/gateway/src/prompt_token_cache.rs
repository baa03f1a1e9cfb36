//! Token ids of long prompt pieces, kept between requests so that a conversation's turn costs
//! tokenization in proportion to what it appended, not to the whole prompt.
//!
//! Owns: a bounded least-recently-used map from a piece's exact text (the text between two of the
//! chat template's control tokens) to the ids one tokenizer gave it, its byte accounting, and the
//! process-wide totals `/metrics` shows. An agent resends the same ~20K-token system prompt and
//! tools with every turn; their piece is found here instead of being tokenized again.
//! Entries are matched on the whole text (hashed with the standard library's randomly keyed
//! SipHash, then compared byte for byte), so a hit is exact: no collision can hand one client's
//! ids to another's text. A cache belongs to one tokenizer (it lives inside it), so ids never
//! cross tokenizers or encode modes.
//! Must not touch: how a prompt is cut into pieces or encoded (see `tokenizer`).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Pieces shorter than this are encoded every time: their tokenization costs about what a lookup
/// does, and chat turns' short pieces (role headers, brief answers) would churn the cache.
pub const MIN_CACHED_PIECE_BYTES: usize = 2048;

/// The default budget: a few agents' system prompts and conversations (a 19K-token system
/// prompt with tools takes about 170 KiB: its text plus four bytes per token).
pub const DEFAULT_PROMPT_TOKEN_CACHE_BYTES: usize = 8 << 20;

/// What an entry costs beyond its text and ids (map slot, recency slot, two `Arc` headers).
const ENTRY_OVERHEAD_BYTES: usize = 128;

/// What one cache has done and holds (for tests and the log).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptTokenCacheStats {
    /// Lookups of long pieces that found their ids.
    pub hits: u64,
    /// Lookups of long pieces that did not.
    pub misses: u64,
    /// Tokens whose encoding the hits saved.
    pub hit_tokens: u64,
    /// Entries dropped to stay within the budget.
    pub evictions: u64,
    pub entries: u64,
    pub bytes: u64,
    pub budget_bytes: u64,
}

/// Totals over every cache of the process (one per served model), for `/metrics`.
struct ProcessTotals {
    hits: AtomicU64,
    misses: AtomicU64,
    hit_tokens: AtomicU64,
    evictions: AtomicU64,
    entries: AtomicU64,
    bytes: AtomicU64,
    budget_bytes: AtomicU64,
}

static PROCESS_TOTALS: ProcessTotals = ProcessTotals {
    hits: AtomicU64::new(0),
    misses: AtomicU64::new(0),
    hit_tokens: AtomicU64::new(0),
    evictions: AtomicU64::new(0),
    entries: AtomicU64::new(0),
    bytes: AtomicU64::new(0),
    budget_bytes: AtomicU64::new(0),
};

/// The bounded piece → ids map of one tokenizer; shared by the blocking threads that encode.
pub struct PromptTokenCache {
    state: Mutex<CacheState>,
    budget_bytes: usize,
}

#[derive(Default)]
struct CacheState {
    entries: HashMap<Arc<str>, CachedPiece>,
    /// Last use → key, oldest first: what to evict.
    recency: BTreeMap<u64, Arc<str>>,
    next_use: u64,
    bytes: usize,
    stats: PromptTokenCacheStats,
}

struct CachedPiece {
    token_ids: Arc<[u32]>,
    last_use: u64,
}

fn entry_bytes(text: &str, token_count: usize) -> usize {
    text.len() + token_count * std::mem::size_of::<u32>() + ENTRY_OVERHEAD_BYTES
}

impl PromptTokenCache {
    /// A cache of at most `budget_bytes` (texts, ids and bookkeeping); 0 keeps nothing.
    pub fn new(budget_bytes: usize) -> Self {
        PROCESS_TOTALS
            .budget_bytes
            .fetch_add(budget_bytes as u64, Ordering::Relaxed);
        PromptTokenCache {
            state: Mutex::new(CacheState::default()),
            budget_bytes,
        }
    }

    /// Whether a piece of this text is looked up and kept at all.
    pub fn caches(&self, text: &str) -> bool {
        self.budget_bytes > 0 && text.len() >= MIN_CACHED_PIECE_BYTES
    }

    /// The ids cached for exactly `text`, marking them recently used; `None` for a short text
    /// (never cached) or one not held.
    pub fn get(&self, text: &str) -> Option<Arc<[u32]>> {
        if !self.caches(text) {
            return None;
        }
        let Ok(mut state) = self.state.lock() else {
            return None;
        };
        let state = &mut *state;
        let use_number = state.next_use;
        let Some(entry) = state.entries.get_mut(text) else {
            state.stats.misses += 1;
            PROCESS_TOTALS.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        state.next_use += 1;
        if let Some(key) = state.recency.remove(&entry.last_use) {
            state.recency.insert(use_number, key);
        }
        entry.last_use = use_number;
        let token_ids = entry.token_ids.clone();
        state.stats.hits += 1;
        state.stats.hit_tokens += token_ids.len() as u64;
        PROCESS_TOTALS.hits.fetch_add(1, Ordering::Relaxed);
        PROCESS_TOTALS
            .hit_tokens
            .fetch_add(token_ids.len() as u64, Ordering::Relaxed);
        Some(token_ids)
    }

    /// Keeps `token_ids` as `text`'s, evicting the least recently used entries to stay within
    /// the budget. A text too short, or an entry larger than half the budget, is not kept.
    pub fn insert(&self, text: &str, token_ids: &[u32]) {
        let bytes = entry_bytes(text, token_ids.len());
        if !self.caches(text) || bytes > self.budget_bytes / 2 {
            return;
        }
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        let state = &mut *state;
        if state.entries.contains_key(text) {
            // Another request encoded it meanwhile: same text, same tokenizer, same ids.
            return;
        }
        let (mut freed_bytes, mut evicted) = (0usize, 0u64);
        while state.bytes + bytes > self.budget_bytes {
            let Some((_, oldest)) = state.recency.pop_first() else {
                break;
            };
            if let Some(entry) = state.entries.remove(&oldest) {
                let freed = entry_bytes(&oldest, entry.token_ids.len());
                state.bytes -= freed;
                freed_bytes += freed;
                evicted += 1;
            }
        }
        let key: Arc<str> = Arc::from(text);
        let use_number = state.next_use;
        state.next_use += 1;
        state.recency.insert(use_number, key.clone());
        state.entries.insert(
            key,
            CachedPiece {
                token_ids: Arc::from(token_ids),
                last_use: use_number,
            },
        );
        state.bytes += bytes;
        state.stats.evictions += evicted;
        state.stats.entries = state.entries.len() as u64;
        state.stats.bytes = state.bytes as u64;
        PROCESS_TOTALS
            .evictions
            .fetch_add(evicted, Ordering::Relaxed);
        PROCESS_TOTALS.entries.fetch_add(1, Ordering::Relaxed);
        PROCESS_TOTALS.entries.fetch_sub(evicted, Ordering::Relaxed);
        PROCESS_TOTALS
            .bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        PROCESS_TOTALS
            .bytes
            .fetch_sub(freed_bytes as u64, Ordering::Relaxed);
    }

    /// What this cache has done and holds.
    pub fn stats(&self) -> PromptTokenCacheStats {
        let mut stats = self
            .state
            .lock()
            .map(|state| state.stats)
            .unwrap_or_default();
        stats.budget_bytes = self.budget_bytes as u64;
        stats
    }
}

impl Drop for PromptTokenCache {
    fn drop(&mut self) {
        let (entries, bytes) = self
            .state
            .lock()
            .map(|state| (state.entries.len() as u64, state.bytes as u64))
            .unwrap_or_default();
        PROCESS_TOTALS.entries.fetch_sub(entries, Ordering::Relaxed);
        PROCESS_TOTALS.bytes.fetch_sub(bytes, Ordering::Relaxed);
        PROCESS_TOTALS
            .budget_bytes
            .fetch_sub(self.budget_bytes as u64, Ordering::Relaxed);
    }
}

/// Appends the process's prompt-token-cache totals in the Prometheus text format.
pub fn render_metrics(output: &mut String) {
    let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    let rows = [
        (
            "hits_total",
            "counter",
            "Long prompt pieces whose token ids were reused instead of tokenized.",
            load(&PROCESS_TOTALS.hits),
        ),
        (
            "misses_total",
            "counter",
            "Long prompt pieces tokenized because no ids were cached.",
            load(&PROCESS_TOTALS.misses),
        ),
        (
            "hit_tokens_total",
            "counter",
            "Prompt tokens taken from the cache instead of tokenized.",
            load(&PROCESS_TOTALS.hit_tokens),
        ),
        (
            "evictions_total",
            "counter",
            "Cached prompt pieces dropped to stay within the budget.",
            load(&PROCESS_TOTALS.evictions),
        ),
        (
            "entries",
            "gauge",
            "Prompt pieces whose token ids are cached.",
            load(&PROCESS_TOTALS.entries),
        ),
        (
            "bytes",
            "gauge",
            "Memory the cached prompt pieces take (text, ids, bookkeeping).",
            load(&PROCESS_TOTALS.bytes),
        ),
        (
            "budget_bytes",
            "gauge",
            "Most memory the prompt-token caches may take.",
            load(&PROCESS_TOTALS.budget_bytes),
        ),
    ];
    for (suffix, kind, help, value) in rows {
        let name = format!("ninfer_gateway_prompt_token_cache_{suffix}");
        let _ = writeln!(
            output,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_of(byte: char, bytes: usize) -> String {
        std::iter::repeat_n(byte, bytes).collect()
    }

    #[test]
    fn short_texts_are_never_cached_and_long_ones_come_back_exactly() {
        let cache = PromptTokenCache::new(1 << 20);
        let short = text_of('a', MIN_CACHED_PIECE_BYTES - 1);
        cache.insert(&short, &[1, 2, 3]);
        assert_eq!(cache.get(&short), None);
        let long = text_of('a', MIN_CACHED_PIECE_BYTES);
        assert_eq!(cache.get(&long), None);
        cache.insert(&long, &[4, 5, 6]);
        assert_eq!(cache.get(&long).as_deref(), Some(&[4u32, 5, 6][..]));
        // A text that differs in its last byte is another entry.
        let mut other = long.clone();
        other.pop();
        other.push('b');
        assert_eq!(cache.get(&other), None);
        let stats = cache.stats();
        assert_eq!((stats.hits, stats.misses, stats.hit_tokens), (1, 2, 3));
        assert_eq!(stats.entries, 1);
    }

    #[test]
    fn the_least_recently_used_entry_goes_first_and_the_budget_holds() {
        let piece_bytes = entry_bytes(&text_of('a', MIN_CACHED_PIECE_BYTES), 10);
        let cache = PromptTokenCache::new(3 * piece_bytes);
        let texts: Vec<String> = ['a', 'b', 'c', 'd']
            .iter()
            .map(|byte| text_of(*byte, MIN_CACHED_PIECE_BYTES))
            .collect();
        for (index, text) in texts.iter().take(3).enumerate() {
            cache.insert(text, &[index as u32; 10]);
        }
        // Using `a` makes `b` the oldest: the fourth entry evicts `b`.
        assert!(cache.get(&texts[0]).is_some());
        cache.insert(&texts[3], &[3; 10]);
        assert!(cache.get(&texts[1]).is_none());
        for index in [0, 2, 3] {
            assert_eq!(
                cache.get(&texts[index]).as_deref(),
                Some(&[index as u32; 10][..])
            );
        }
        let stats = cache.stats();
        assert_eq!(stats.evictions, 1);
        assert!(stats.bytes <= stats.budget_bytes, "{stats:?}");
        assert_eq!(stats.bytes as usize, 3 * piece_bytes);
    }

    #[test]
    fn an_entry_over_half_the_budget_is_not_kept_and_a_zero_budget_keeps_nothing() {
        let text = text_of('a', 4 * MIN_CACHED_PIECE_BYTES);
        let cache = PromptTokenCache::new(entry_bytes(&text, 1));
        cache.insert(&text, &[1]);
        assert_eq!(cache.get(&text), None);
        let disabled = PromptTokenCache::new(0);
        disabled.insert(&text, &[1]);
        assert_eq!(disabled.get(&text), None);
        assert_eq!(disabled.stats().misses, 0);
    }

    #[test]
    fn the_metrics_name_every_total() {
        let mut output = String::new();
        render_metrics(&mut output);
        for suffix in [
            "hits_total",
            "misses_total",
            "bytes",
            "budget_bytes",
            "evictions_total",
        ] {
            assert!(
                output.contains(&format!(
                    "# TYPE ninfer_gateway_prompt_token_cache_{suffix} "
                )),
                "{output}"
            );
        }
    }
}
