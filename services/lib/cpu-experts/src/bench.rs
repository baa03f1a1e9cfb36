//! Measurements behind `ninfer bench`: this machine's multi-threaded read bandwidth (the
//! reference) and how fast the expert kernels stream expert weights.
//!
//! Owns: the benchmark loops, random weight banks for them, and the result records the CLI
//! prints. Weights are written by the pool's (pinned) threads, so first touch places each page
//! on the node of the thread that later reads it. The expert benchmark rotates through enough
//! layers that the working set far exceeds the caches, as decoding a real model does.
//! Must not touch: output formatting (the CLI's job).

use std::time::{Duration, Instant};

use crate::buffer::AlignedBuffer;
use crate::isa::KernelIsa;
use crate::layer::{compute_layer, ExpertTask, ExpertWeights, LayerScratch, ScratchCapacity};
use crate::layout::{ExpertLayout, MatrixLayout, WeightDType};
use crate::pool::{ThreadPool, WorkerContext};
use crate::KernelError;

/// Read bandwidth of the pool's threads over one large buffer.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BandwidthResult {
    pub threads: usize,
    pub buffer_bytes: usize,
    pub passes: usize,
    /// Best pass, 10⁹ bytes per second.
    pub best_gbps: f64,
    pub median_gbps: f64,
    /// The process's anonymous memory on 2 MiB pages while the buffer was read (see
    /// `buffer::HUGE_PAGES_VARIABLE`); `None` where the kernel does not say.
    pub huge_page_bytes: Option<u64>,
}

/// Sends a raw pointer to the pool's threads (each touches a disjoint range).
#[derive(Clone, Copy)]
struct SharedPointer(*mut u8);
// SAFETY: used only for disjoint per-thread ranges inside one job.
unsafe impl Sync for SharedPointer {}
unsafe impl Send for SharedPointer {}

impl SharedPointer {
    /// A method (not `.0`) so closures capture the whole Sync wrapper, not the raw field.
    fn get(&self) -> *mut u8 {
        self.0
    }
}

/// Page-aligned per-thread share of `len` bytes.
fn thread_share(len: usize, index: usize, count: usize) -> std::ops::Range<usize> {
    let pages = len / 4096;
    let start = pages * index / count * 4096;
    let end = if index + 1 == count {
        len
    } else {
        pages * (index + 1) / count * 4096
    };
    start..end
}

/// Fills `buffer` with pseudo-random bytes from the pool's threads (first touch).
pub fn fill_random(
    pool: &ThreadPool,
    buffer: &mut AlignedBuffer,
    seed: u64,
) -> Result<(), KernelError> {
    let len = buffer.len();
    let base = SharedPointer(buffer.as_mut_ptr());
    pool.run(&|context: &WorkerContext<'_>| {
        let range = thread_share(len, context.index, context.count);
        let mut state = seed ^ (context.index as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        // SAFETY: each thread writes only its own range of the buffer.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(base.get().add(range.start), range.len()) };
        for chunk in bytes.chunks_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let value = state.to_le_bytes();
            chunk.copy_from_slice(&value[..chunk.len()]);
        }
    })
}

/// Sums `bytes` as u64 words with the widest loads this CPU has (the result only keeps the
/// loads from being optimised away).
fn read_sum(bytes: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        if KernelIsa::Avx512.is_supported() {
            // SAFETY: AVX-512F checked just above.
            return unsafe { read_sum_avx512(bytes) };
        }
        if KernelIsa::Avx2.is_supported() {
            // SAFETY: AVX2 checked just above.
            return unsafe { read_sum_avx2(bytes) };
        }
    }
    bytes.chunks_exact(8).fold(0u64, |acc, c| {
        acc.wrapping_add(u64::from_le_bytes([
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7],
        ]))
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn read_sum_avx512(bytes: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    // Eight independent accumulators (512 bytes per step) keep enough loads in flight.
    let mut acc = [_mm512_setzero_si512(); 8];
    let blocks = bytes.len() / 512;
    let pointer = bytes.as_ptr();
    for block in 0..blocks {
        for (lane, slot) in acc.iter_mut().enumerate() {
            // SAFETY: block·512 + lane·64 + 64 ≤ len.
            let value = unsafe { _mm512_loadu_si512(pointer.add(block * 512 + lane * 64).cast()) };
            *slot = _mm512_add_epi64(*slot, value);
        }
    }
    let total = acc.iter().fold(_mm512_setzero_si512(), |sum, &value| {
        _mm512_add_epi64(sum, value)
    });
    _mm512_reduce_add_epi64(total) as u64
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn read_sum_avx2(bytes: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_si256(); 4];
    let blocks = bytes.len() / 128;
    let pointer = bytes.as_ptr();
    for block in 0..blocks {
        for (lane, slot) in acc.iter_mut().enumerate() {
            // SAFETY: block·128 + lane·32 + 32 ≤ len.
            let value = unsafe { _mm256_loadu_si256(pointer.add(block * 128 + lane * 32).cast()) };
            *slot = _mm256_add_epi64(*slot, value);
        }
    }
    let mut words = [0u64; 4];
    let total = _mm256_add_epi64(
        _mm256_add_epi64(acc[0], acc[1]),
        _mm256_add_epi64(acc[2], acc[3]),
    );
    // SAFETY: `words` holds 32 bytes.
    unsafe { _mm256_storeu_si256(words.as_mut_ptr().cast(), total) };
    words.iter().fold(0, |a, &w| a.wrapping_add(w))
}

/// Multi-threaded read bandwidth over a `buffer_bytes` buffer, `passes` timed passes.
pub fn measure_read_bandwidth(
    pool: &ThreadPool,
    buffer_bytes: usize,
    passes: usize,
) -> Result<BandwidthResult, KernelError> {
    let mut buffer = AlignedBuffer::zeroed(buffer_bytes)?;
    fill_random(pool, &mut buffer, 1)?;
    let rates = read_rates_of(pool, buffer.as_slice(), passes)?;
    // While the buffer is alive: how much of it (and of the rest) sits on huge pages.
    let huge_page_bytes = crate::buffer::anonymous_huge_page_bytes();
    drop(buffer);
    Ok(BandwidthResult {
        threads: pool.threads(),
        buffer_bytes,
        passes: rates.len(),
        best_gbps: rates.last().copied().unwrap_or(0.0),
        median_gbps: rates[rates.len() / 2],
        huge_page_bytes,
    })
}

/// GB/s of `passes` timed multi-threaded read passes over `bytes` (each thread a contiguous
/// share), sorted ascending; an untimed pass first warms TLBs and wakes the threads.
fn read_rates_of(pool: &ThreadPool, bytes: &[u8], passes: usize) -> Result<Vec<f64>, KernelError> {
    let sink = std::sync::atomic::AtomicU64::new(0);
    let mut rates = Vec::with_capacity(passes + 1);
    for pass in 0..passes.max(1) + 1 {
        let start = Instant::now();
        pool.run(&|context: &WorkerContext<'_>| {
            let share = &bytes[thread_share(bytes.len(), context.index, context.count)];
            sink.fetch_add(read_sum(share), std::sync::atomic::Ordering::Relaxed);
        })?;
        let seconds = start.elapsed().as_secs_f64();
        if pass > 0 {
            rates.push(bytes.len() as f64 / seconds / 1e9);
        }
    }
    std::hint::black_box(sink.load(std::sync::atomic::Ordering::Relaxed));
    rates.sort_by(|a, b| a.total_cmp(b));
    Ok(rates)
}

/// One expert-throughput measurement.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ExpertBenchResult {
    pub isa: KernelIsa,
    pub dtype: WeightDType,
    pub hidden: usize,
    pub intermediate: usize,
    pub experts_per_layer: usize,
    /// Tokens each expert of a layer computes.
    pub tokens: usize,
    pub threads: usize,
    pub layers: usize,
    pub working_set_bytes: usize,
    pub layer_calls: usize,
    /// Mean wall time of one layer (`experts_per_layer` experts), microseconds.
    pub layer_us: f64,
    /// Expert weight bytes (values + scales) read per layer.
    pub weight_bytes_per_layer: usize,
    /// Weight bytes streamed per second, 10⁹.
    pub weight_gbps: f64,
    /// 2 · tokens · experts · 3 · H · Im per second, 10⁹.
    pub gflops: f64,
    /// Mean time of each phase of a layer (prepare, gate/up + SwiGLU, down), microseconds.
    pub phase_us: [f64; 3],
    /// The process's anonymous memory on 2 MiB pages while the working set was streamed.
    pub huge_page_bytes: Option<u64>,
    /// Best of a few plain multi-threaded read passes over this very working set, right after
    /// the kernels streamed it (GB/s): on a VM whose bandwidth depends on which memory backs a
    /// buffer, the like-for-like reference.
    pub working_set_read_gbps: f64,
}

/// What `bench_experts` runs.
#[derive(Debug, Clone)]
pub struct ExpertBenchConfig {
    pub layout: ExpertLayout,
    pub experts_per_layer: usize,
    pub tokens: usize,
    pub working_set_bytes: usize,
    pub min_seconds: f64,
    /// The kernels' tuning for every call.
    pub tuning: crate::KernelTuning,
}

/// A bank of random, valid expert weights: `layers × experts_per_layer` experts.
pub struct RandomBank {
    pub layout: ExpertLayout,
    pub experts: usize,
    buffer: AlignedBuffer,
}

impl RandomBank {
    pub fn new(
        pool: &ThreadPool,
        layout: ExpertLayout,
        experts: usize,
    ) -> Result<Self, KernelError> {
        let mut buffer = AlignedBuffer::zeroed(experts * layout.stride)?;
        fill_random(pool, &mut buffer, 7)?;
        let base = SharedPointer(buffer.as_mut_ptr());
        // Random bytes are valid int8 / int4 codes but not valid scales or floats: make every
        // scale a small f16 and every float a finite, modest value.
        pool.run(&|context: &WorkerContext<'_>| {
            for expert in context.split(experts) {
                // SAFETY: each thread rewrites only its own experts' bytes.
                let slot = unsafe {
                    std::slice::from_raw_parts_mut(
                        base.get().add(expert * layout.stride),
                        layout.stride,
                    )
                };
                sanitize(&mut slot[..layout.gate_up.total_bytes], &layout.gate_up);
                sanitize(
                    &mut slot[layout.down_offset..][..layout.down.total_bytes],
                    &layout.down,
                );
            }
        })?;
        Ok(RandomBank {
            layout,
            experts,
            buffer,
        })
    }

    pub fn expert(&self, index: usize) -> Result<ExpertWeights<'_>, KernelError> {
        let slot = &self.buffer.as_slice()[index * self.layout.stride..][..self.layout.stride];
        ExpertWeights::from_slot(slot, &self.layout)
    }
}

fn sanitize(bytes: &mut [u8], layout: &MatrixLayout) {
    match layout.dtype {
        WeightDType::Int8 | WeightDType::Int4 => {
            for scale in bytes[layout.scales_offset..].chunks_exact_mut(2) {
                // f16 in [2⁻⁸, 2⁻⁷): exponent 7, random mantissa.
                let bits = 0x1c00 | (u16::from_le_bytes([scale[0], scale[1]]) & 0x03ff);
                scale.copy_from_slice(&bits.to_le_bytes());
            }
        }
        WeightDType::Bf16 => {
            for value in bytes.chunks_exact_mut(2) {
                // bf16 with |x| in [2⁻⁸, 2⁻⁷), random sign and mantissa.
                let bits = 0x3b80 | (u16::from_le_bytes([value[0], value[1]]) & 0x807f);
                value.copy_from_slice(&bits.to_le_bytes());
            }
        }
        WeightDType::F32 => {
            for value in bytes.chunks_exact_mut(4) {
                let raw = u32::from_le_bytes([value[0], value[1], value[2], value[3]]);
                let bits = 0x3b80_0000 | (raw & 0x807f_ffff);
                value.copy_from_slice(&bits.to_le_bytes());
            }
        }
    }
}

/// Streams random experts through `compute_layer`, rotating over a bank of at least
/// `working_set_bytes`, for each path in `isas`, with `config.tuning`.
pub fn bench_experts(
    pool: &ThreadPool,
    config: &ExpertBenchConfig,
    isas: &[KernelIsa],
) -> Result<Vec<ExpertBenchResult>, KernelError> {
    let layout = config.layout;
    let per_layer = config.experts_per_layer.max(1);
    let layers = config
        .working_set_bytes
        .div_ceil(per_layer * layout.stride)
        .max(2);
    let bank = RandomBank::new(pool, layout, layers * per_layer)?;
    let tokens = config.tokens.max(1);
    let h = layout.hidden;
    let hidden: Vec<f32> = (0..tokens * h)
        .map(|i| ((i * 2_654_435_761) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let mut output = vec![0.0f32; tokens * h];
    let token_list: Vec<u32> = (0..tokens as u32).collect();
    let weights = vec![1.0 / per_layer as f32; tokens];
    let mut layer_tasks = Vec::with_capacity(layers);
    for layer in 0..layers {
        let mut tasks = Vec::with_capacity(per_layer);
        for expert in 0..per_layer {
            tasks.push(ExpertTask {
                weights: bank.expert(layer * per_layer + expert)?,
                tokens: &token_list,
                routing_weights: &weights,
            });
        }
        layer_tasks.push(tasks);
    }
    let capacity = ScratchCapacity {
        max_tasks: per_layer,
        max_pairs: per_layer * tokens,
    };
    let weight_bytes_per_layer = per_layer * layout.streamed_bytes();
    let flops_per_layer =
        2.0 * tokens as f64 * per_layer as f64 * 3.0 * h as f64 * layout.intermediate as f64;
    let mut results: Vec<ExpertBenchResult> = Vec::new();
    for &isa in isas {
        let mut scratch =
            LayerScratch::new(layout, isa, pool.threads(), capacity)?.with_tuning(config.tuning);
        let mut run_for =
            |duration: Duration, next: &mut usize| -> Result<(usize, f64, [f64; 3]), KernelError> {
                let start = Instant::now();
                let mut calls = 0;
                let mut phases = [0.0f64; 3];
                loop {
                    compute_layer(
                        pool,
                        &mut scratch,
                        &hidden,
                        tokens,
                        &layer_tasks[*next % layers],
                        &mut output,
                    )?;
                    for (sum, time) in phases.iter_mut().zip(scratch.last_phase_times()) {
                        *sum += time.as_secs_f64();
                    }
                    *next += 1;
                    calls += 1;
                    let elapsed = start.elapsed();
                    if elapsed >= duration && calls >= 3 {
                        return Ok((calls, elapsed.as_secs_f64(), phases));
                    }
                }
            };
        let mut next = 0usize;
        run_for(Duration::from_secs_f64(config.min_seconds * 0.2), &mut next)?;
        let (calls, seconds, phases) =
            run_for(Duration::from_secs_f64(config.min_seconds), &mut next)?;
        let layer_seconds = seconds / calls as f64;
        results.push(ExpertBenchResult {
            isa,
            dtype: layout.dtype,
            hidden: h,
            intermediate: layout.intermediate,
            experts_per_layer: per_layer,
            tokens,
            threads: pool.threads(),
            layers,
            working_set_bytes: layers * per_layer * layout.stride,
            layer_calls: calls,
            layer_us: layer_seconds * 1e6,
            weight_bytes_per_layer,
            weight_gbps: weight_bytes_per_layer as f64 / layer_seconds / 1e9,
            gflops: flops_per_layer / layer_seconds / 1e9,
            phase_us: phases.map(|p| p / calls as f64 * 1e6),
            huge_page_bytes: crate::buffer::anonymous_huge_page_bytes(),
            working_set_read_gbps: 0.0,
        });
    }
    std::hint::black_box(&output);
    let working_set_read = read_rates_of(pool, bank.buffer.as_slice(), 5)?
        .last()
        .copied()
        .unwrap_or(0.0);
    for result in &mut results {
        result.working_set_read_gbps = working_set_read;
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_benchmarks_run() {
        let pool = ThreadPool::new(2, &[], false).unwrap();
        let bandwidth = measure_read_bandwidth(&pool, 1 << 20, 2).unwrap();
        assert!(bandwidth.best_gbps > 0.0);
        let layout = ExpertLayout::new(WeightDType::Int4, 64, 32).unwrap();
        let config = ExpertBenchConfig {
            layout,
            experts_per_layer: 2,
            tokens: 2,
            working_set_bytes: 1 << 16,
            min_seconds: 0.01,
            tuning: Default::default(),
        };
        let results = bench_experts(&pool, &config, &KernelIsa::supported()).unwrap();
        assert_eq!(results.len(), KernelIsa::supported().len());
        assert!(results.iter().all(|r| r.weight_gbps > 0.0 && r.layers >= 2));
    }
}
