//! The bounded range cache of a streaming conversion: a few fetch threads fetch the ranges the
//! converter announced, in its reading order, into files of one cache directory, never holding
//! more than the bound on disk; the converter reads each file once and it is deleted.
//!
//! Owns: the order and the bound (a range is fetched only when it fits beside every fetched
//! range not yet read), the cache files and their names, reusing complete or partial range
//! files an interrupted run left, the measured cache use and its peak.
//! Must not touch: HTTP details (`range`), the conversion's order (it is told), the artifact.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use ninfer_convert::{ByteRange, ConvertError, RangeSource};

use super::range::{fetch_range, RangeError, RangeRequest};
use crate::hub::Hub;

/// Range requests in flight at once: enough to hide a request's latency behind the others.
const FETCH_THREADS: usize = 4;

/// Counters the progress line and the final report read.
pub struct FetchStats {
    pub started: Instant,
    /// Bytes the hub sent (headers, retries and all).
    pub fetched: AtomicU64,
    /// Bytes of range files in the cache directory now, and the most there ever were.
    pub cached: AtomicU64,
    pub peak: AtomicU64,
    /// Bytes the converter will read, and has read.
    pub planned: AtomicU64,
    pub consumed: AtomicU64,
}

impl FetchStats {
    pub fn new() -> Self {
        FetchStats {
            started: Instant::now(),
            fetched: AtomicU64::new(0),
            cached: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            planned: AtomicU64::new(0),
            consumed: AtomicU64::new(0),
        }
    }

    fn add_cached(&self, bytes: u64) {
        let now = self.cached.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.peak.fetch_max(now, Ordering::SeqCst);
    }

    fn remove_cached(&self, bytes: u64) {
        let _ = self
            .cached
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |now| {
                Some(now.saturating_sub(bytes))
            });
    }
}

/// One shard as the cache fetches it.
pub struct ShardUrl {
    pub name: String,
    pub url: String,
}

struct State {
    reads: Vec<ByteRange>,
    /// The cache file of each read (`SHARD-START-END-K`, K counting repeats of a range).
    names: Vec<String>,
    next_fetch: usize,
    next_read: usize,
    /// Bytes of fetched (or fetching) ranges not yet read: never above the bound.
    reserved: u64,
    done: Vec<Option<Result<(), RangeError>>>,
}

struct Inner {
    hub: Hub,
    shards: Vec<ShardUrl>,
    directory: PathBuf,
    bound: u64,
    stats: Arc<FetchStats>,
    stop: AtomicBool,
    state: Mutex<State>,
    changed: Condvar,
}

/// Serves a remote checkpoint's ranges to the converter through the cache directory.
pub struct RangeCache {
    inner: Arc<Inner>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl RangeCache {
    pub fn new(
        hub: Hub,
        shards: Vec<ShardUrl>,
        directory: PathBuf,
        bound: u64,
        stats: Arc<FetchStats>,
    ) -> Self {
        RangeCache {
            inner: Arc::new(Inner {
                hub,
                shards,
                directory,
                bound,
                stats,
                stop: AtomicBool::new(false),
                state: Mutex::new(State {
                    reads: Vec::new(),
                    names: Vec::new(),
                    next_fetch: 0,
                    next_read: 0,
                    reserved: 0,
                    done: Vec::new(),
                }),
                changed: Condvar::new(),
            }),
            threads: Mutex::new(Vec::new()),
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A fetch thread never panics while holding the lock; recover the data if one did.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn shard_name(&self, range: &ByteRange) -> String {
        self.shards
            .get(range.shard)
            .map_or_else(|| format!("shard {}", range.shard), |s| s.name.clone())
    }

    fn fetch_error(&self, range: &ByteRange, problem: String) -> ConvertError {
        ConvertError::Fetch {
            file: PathBuf::from(self.shard_name(range)),
            problem,
        }
    }

    /// Fetch thread: takes the next range in order once it fits under the bound.
    fn fetch_loop(&self) {
        loop {
            let (index, range, name) = {
                let mut state = self.lock();
                loop {
                    if self.stop.load(Ordering::SeqCst) || state.next_fetch >= state.reads.len() {
                        return;
                    }
                    let next = state.reads[state.next_fetch];
                    if state.reserved + next.len() <= self.bound {
                        break;
                    }
                    state = self
                        .changed
                        .wait(state)
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                }
                let index = state.next_fetch;
                state.next_fetch += 1;
                let range = state.reads[index];
                state.reserved += range.len();
                (index, range, state.names[index].clone())
            };
            let result = self.fetch_into_cache(&range, &name);
            let mut state = self.lock();
            state.done[index] = Some(result);
            self.changed.notify_all();
        }
    }

    /// Fetches `range` into its cache file, continuing a partial file from an earlier attempt.
    fn fetch_into_cache(&self, range: &ByteRange, name: &str) -> Result<(), RangeError> {
        let complete = self.directory.join(name);
        if std::fs::metadata(&complete).is_ok_and(|m| m.len() == range.len()) {
            return Ok(());
        }
        let partial = self.directory.join(format!("{name}.part"));
        let have = std::fs::metadata(&partial).map_or(0, |m| m.len());
        let have = if have > range.len() {
            self.stats.remove_cached(have);
            let _ = std::fs::remove_file(&partial);
            0
        } else {
            have
        };
        let local =
            |error: std::io::Error| RangeError::Local(format!("{}: {error}", partial.display()));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&partial)
            .map_err(local)?;
        let Some(shard) = self.shards.get(range.shard) else {
            return Err(RangeError::Refused(format!("no shard {}", range.shard)));
        };
        let request = RangeRequest {
            hub: &self.hub,
            url: &shard.url,
            file: &shard.name,
            start: range.start,
            end: range.end,
            fetched: &self.stats.fetched,
            stop: &self.stop,
        };
        let mut sink = CountingFile {
            file,
            stats: &self.stats,
        };
        fetch_range(&request, have, &mut sink)?;
        sink.file.flush().map_err(local)?;
        std::fs::rename(&partial, &complete).map_err(local)?;
        Ok(())
    }

    /// Deletes range files of the directory that no read among the first `bound` bytes of
    /// `names` will use, and counts the rest as cached: what an interrupted run fetched ahead
    /// is kept only where it cannot push the cache past its bound.
    fn adopt_leftovers(&self, reads: &[ByteRange], names: &[String]) {
        let mut window = HashMap::new();
        let mut total = 0;
        for (range, name) in reads.iter().zip(names) {
            total += range.len();
            if total > self.bound {
                break;
            }
            window.insert(name.clone(), range.len());
        }
        let Ok(entries) = std::fs::read_dir(&self.directory) else {
            return;
        };
        for entry in entries.flatten() {
            let file = entry.file_name().to_string_lossy().into_owned();
            let base = file.trim_end_matches(".part");
            let size = entry.metadata().map_or(0, |m| m.len());
            match window.get(base) {
                Some(&length) if size <= length => self.stats.add_cached(size),
                _ => {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
    }
}

/// The cache file a fetch writes, counting its bytes as cached as they land.
struct CountingFile<'a> {
    file: std::fs::File,
    stats: &'a FetchStats,
}

impl Write for CountingFile<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let written = self.file.write(bytes)?;
        self.stats.add_cached(written as u64);
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

impl RangeSource for RangeCache {
    fn announce(&self, reads: &[ByteRange]) -> Result<(), ConvertError> {
        let inner = &self.inner;
        if let Some(largest) = reads.iter().max_by_key(|range| range.len()) {
            if largest.len() > inner.bound {
                return Err(ConvertError::InvalidOption {
                    option: "--cache-gb",
                    problem: format!(
                        "{}: one read of {} bytes (bytes {}..{}) is larger than the cache bound \
                         of {} bytes; raise --cache-gb",
                        inner.shard_name(largest),
                        largest.len(),
                        largest.start,
                        largest.end,
                        inner.bound
                    ),
                });
            }
        }
        std::fs::create_dir_all(&inner.directory).map_err(|e| ConvertError::Fetch {
            file: inner.directory.clone(),
            problem: format!("creating the cache directory: {e}"),
        })?;
        let mut repeats: HashMap<ByteRange, usize> = HashMap::new();
        let names: Vec<String> = reads
            .iter()
            .map(|range| {
                let count = repeats.entry(*range).or_default();
                *count += 1;
                format!("{}-{}-{}-{}", range.shard, range.start, range.end, *count)
            })
            .collect();
        inner.adopt_leftovers(reads, &names);
        inner
            .stats
            .planned
            .store(reads.iter().map(ByteRange::len).sum(), Ordering::SeqCst);
        {
            let mut state = inner.lock();
            state.reads = reads.to_vec();
            state.done = reads.iter().map(|_| None).collect();
            state.names = names;
        }
        let mut threads = self
            .threads
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for _ in 0..FETCH_THREADS {
            let inner = Arc::clone(&self.inner);
            threads.push(std::thread::spawn(move || inner.fetch_loop()));
        }
        Ok(())
    }

    fn read(&self, range: &ByteRange) -> Result<Vec<u8>, ConvertError> {
        let inner = &self.inner;
        let mut state = inner.lock();
        let index = state.next_read;
        if state.reads.get(index) != Some(range) {
            return Err(inner.fetch_error(
                range,
                format!(
                    "bytes {}..{} were read out of the announced order (read {index})",
                    range.start, range.end
                ),
            ));
        }
        let result = loop {
            if let Some(result) = state.done[index].take() {
                break result;
            }
            state = inner
                .changed
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        };
        let name = state.names[index].clone();
        drop(state);
        if let Err(error) = result {
            inner.stop.store(true, Ordering::SeqCst);
            inner.changed.notify_all();
            return Err(match error {
                // A full disk is not the network's fault: nothing is kept for a later run.
                RangeError::Local(problem) => ConvertError::Io {
                    file: inner.directory.clone(),
                    action: "writing the range cache",
                    source: std::io::Error::other(problem),
                },
                other => inner.fetch_error(range, other.to_string()),
            });
        }
        let path = inner.directory.join(&name);
        let bytes = std::fs::read(&path).map_err(|e| ConvertError::Fetch {
            file: path.clone(),
            problem: format!("reading the cached range: {e}"),
        })?;
        // Read once: the file goes as soon as its bytes are in memory.
        let _ = std::fs::remove_file(&path);
        inner.stats.remove_cached(range.len());
        inner
            .stats
            .consumed
            .fetch_add(range.len(), Ordering::Relaxed);
        let mut state = inner.lock();
        state.reserved -= range.len();
        state.next_read += 1;
        inner.changed.notify_all();
        Ok(bytes)
    }
}

impl Drop for RangeCache {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        self.inner.changed.notify_all();
        let threads = std::mem::take(
            &mut *self
                .threads
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
        for thread in threads {
            let _ = thread.join();
        }
    }
}
