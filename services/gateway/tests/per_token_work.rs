//! The gateway's work per generated token does not grow with the vocabulary: streaming
//! detokenisation over the real Qwen3.5 vocabulary (248,077 tokens) allocates a bounded number
//! of times per token (counted by this test binary's allocator), and the OpenAI text chunk of a
//! token is written without a JSON value per token. Counts, not timings: they do not depend on
//! the machine.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use ninfer_gateway::openai_chunks::ChatChunkText;
use ninfer_gateway::tokenizer::{IncrementalDetokenizer, ModelTokenizer};

/// The system allocator, counting allocations (and reallocations) of every thread.
struct CountingAllocator;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        unsafe { System.dealloc(pointer, layout) }
    }
    unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(pointer, layout, size) }
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

fn real_tokenizer() -> ModelTokenizer {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/qwen3_5_tokenizer/tokenizer.json.gz");
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{e}"));
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(file)
        .read_to_end(&mut json)
        .unwrap_or_else(|e| panic!("{e}"));
    ModelTokenizer::from_json_bytes(&json).unwrap_or_else(|e| panic!("{e}"))
}

/// Allocations `work` makes.
fn allocations_of(work: impl FnOnce()) -> u64 {
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    work();
    ALLOCATIONS.load(Ordering::Relaxed) - before
}

#[test]
fn streaming_a_token_allocates_a_few_times_whatever_the_vocabulary() {
    let tokenizer = real_tokenizer();
    let text = "The knight rode north — past café tables, 漢字 signs and 🐉 banners — \
                until the road ended.\n\nThen he wrote: {\"done\": true}";
    let ids = tokenizer
        .encode(&text.repeat(8), false)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(ids.len() > 200, "{}", ids.len());
    let chunks = ChatChunkText::new("chatcmpl-0123456789abcdef", 1_796_535_894, "tiny", true);
    let mut detokenizer = IncrementalDetokenizer::new(true);
    // The detokenizer's buffers reach their size on the first repetition.
    let (warm, measured) = ids.split_at(ids.len() / 4);
    for id in warm {
        let _ = detokenizer.push(&tokenizer, *id);
    }
    let mut streamed = String::new();
    let allocations = allocations_of(|| {
        for id in measured {
            let delta = detokenizer
                .push(&tokenizer, *id)
                .unwrap_or_else(|e| panic!("{e}"));
            if !delta.is_empty() {
                let chunk = chunks.delta(0, "", &delta);
                streamed.push_str(&delta);
                drop(chunk);
            }
        }
    });
    let per_token = allocations as f64 / measured.len() as f64;
    eprintln!("{per_token:.2} allocations per token");
    // The delta and the chunk (one string each), the token list's doubling and `streamed`'s
    // (measured: 3). Decoding the window through the tokenizers crate costs about 20 (a string
    // per token and per decode); whole-vocabulary work hundreds of thousands.
    assert!(
        per_token <= 6.0,
        "{allocations} allocations for {} tokens",
        measured.len()
    );
    let whole = tokenizer
        .decode(measured, true)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(whole.ends_with(&streamed[streamed.len().saturating_sub(40)..]));
}
