#!/usr/bin/env python3
"""Mapped host reads beside host-to-device copies: what the expert cache's fills do to the hand-off.

The GPU-driven hand-off to the CPU expert workers reads page-locked host memory from kernels
(polls of a worker's answer word, then the answer's rows) while the expert cache copies experts
into GPU slots from the page-locked banks over the same PCIe link. This measures, on a CUDA
machine with CuPy (no Rust needed):

* the latency of one mapped read (a chain of dependent reads, one thread), and the time of one
  block reading a hand-off answer's rows (`--answer-kib`), alone;
* the same beside a DMA copy (`cudaMemcpyAsync` from page-locked memory on another stream: how
  the cache fills today), and beside a copy made by a kernel of 1, 2, 4 or 8 blocks reading the
  mapped source (a paced fill: fewer reads in flight on the link), with each copy's GB/s.

    python3 scripts/bench/pcie_contention.py [--copy-mib 1024] [--answer-kib 64] [--json FILE]
"""

import argparse
import json
import sys

try:
    import cupy as cp
except ImportError:  # pragma: no cover - the GPU machine has it
    sys.exit("pcie_contention needs CuPy (and a CUDA GPU)")

SOURCE = r"""
// One thread: `reads` dependent reads of mapped host words (each address depends on the value
// read before), as a poll loop waits for a worker's answer.
extern "C" __global__ void chase(const volatile unsigned int* host, unsigned int* sink, int reads) {
    unsigned int index = 0;
    for (int i = 0; i < reads; ++i) index = host[(index + 97u * (unsigned int)i) & 4095u];
    sink[0] = index;
}

// One block reads `words` 16-byte words of mapped host memory (an answer's rows), `rounds`
// times over.
extern "C" __global__ void read_answer(const uint4* host, unsigned int* sink, int words,
                                       int rounds) {
    unsigned int acc = 0;
    for (int r = 0; r < rounds; ++r)
        for (int i = threadIdx.x; i < words; i += blockDim.x) {
            uint4 v = ((const volatile uint4*)host)[i];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    if (acc == 0x12345678u) sink[1] = acc;
}

// A copy of `words` 16-byte words from mapped host memory to device memory by the launch's
// blocks (a paced fill: each thread keeps one read in flight).
extern "C" __global__ void kernel_copy(const uint4* host, uint4* device, long long words) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < words;
         i += (long long)gridDim.x * blockDim.x)
        device[i] = host[i];
}
"""


def mapped(nbytes):
    """Page-locked, mapped host memory (its pointer is the device's under unified addressing)."""
    memory = cp.cuda.alloc_pinned_memory(nbytes)
    return memory, memory.ptr


def event_ms(stream, launch):
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    launch()
    stop.record(stream)
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copy-mib", type=int, default=1024, help="MiB each copy moves (far more than the probes take)")
    parser.add_argument("--answer-kib", type=int, default=64, help="bytes of one answer read")
    parser.add_argument("--reads", type=int, default=1000, help="dependent reads per chain")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    module = cp.RawModule(code=SOURCE, options=("--std=c++17",), backend="nvrtc")
    chase = module.get_function("chase")
    read_answer = module.get_function("read_answer")
    kernel_copy = module.get_function("kernel_copy")
    props = cp.cuda.runtime.getDeviceProperties(0)
    print("device: %s" % props["name"].decode(), flush=True)

    probe_memory, probe = mapped(1 << 16)
    answer_memory, answer = mapped(args.answer_kib << 10)
    copy_bytes = args.copy_mib << 20
    source_memory, source = mapped(copy_bytes)
    destination = cp.empty(copy_bytes, dtype=cp.uint8)
    sink = cp.zeros(4, dtype=cp.uint32)
    probe_stream = cp.cuda.Stream(non_blocking=True)
    copy_stream = cp.cuda.Stream(non_blocking=True)
    answer_words = (args.answer_kib << 10) // 16
    rounds = 8

    def probes():
        """µs per dependent mapped read, and µs per answer read, on the probe stream."""
        chain = event_ms(probe_stream,
                         lambda: chase((1,), (1,), (probe, sink, args.reads), stream=probe_stream))
        rows = event_ms(probe_stream, lambda: read_answer(
            (1,), (256,), (answer, sink, answer_words, rounds), stream=probe_stream))
        return chain * 1000.0 / args.reads, rows * 1000.0 / rounds

    results = []

    def row(label, copy_gbs, read_us, answer_us):
        results.append({"beside": label, "copy GB/s": copy_gbs, "read us": read_us,
                        "answer us": answer_us})
        print("%-30s copy %7s GB/s   mapped read %6.2f us   %d KiB answer %7.2f us" % (
            label, "-" if copy_gbs is None else "%.1f" % copy_gbs, read_us, args.answer_kib,
            answer_us), flush=True)

    for _ in range(2):  # warm: module load, first touches
        probes()
    read_us, answer_us = probes()
    row("nothing", None, read_us, answer_us)

    def beside(label, start_copy):
        """The probes while `start_copy()` runs on the copy stream (it lasts far longer)."""
        probes()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(copy_stream)
        start_copy()
        stop.record(copy_stream)
        read_us, answer_us = probes()
        stop.synchronize()
        ms = cp.cuda.get_elapsed_time(start, stop)
        row(label, copy_bytes / ms / 1e6, read_us, answer_us)

    dma = lambda: cp.cuda.runtime.memcpyAsync(destination.data.ptr, source, copy_bytes,
                                              cp.cuda.runtime.memcpyHostToDevice, copy_stream.ptr)
    beside("a DMA copy", dma)
    for blocks in (1, 2, 4, 8, 32):
        beside("a kernel copy, %d block(s)" % blocks, lambda blocks=blocks: kernel_copy(
            (blocks,), (256,), (source, destination, copy_bytes // 16), stream=copy_stream))
    beside("a DMA copy (again)", dma)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    del probe_memory, answer_memory, source_memory


if __name__ == "__main__":
    main()
