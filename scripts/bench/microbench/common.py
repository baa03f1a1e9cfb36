"""What every section shares: the shapes of one decode layer, NVRTC module loading, the integers
kernel files `#define`, bf16 conversion, the graph-replay timer, copies sizing, the inputs of a
folded residual add + norm, and `BenchCore`: the results table, the bit checks against a baseline
and the device floor (copy rate, empty kernel) every share is measured against."""

import os

import numpy as np
import cupy as cp

# One Qwen3-30B-A3B layer.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, TOP_K, MOE_INTERMEDIATE = 128, 8, 768


def module(kernel_dir, name, defines=(), replacements=(), append=""):
    """`replacements`: (old, new) text substitutions, for variants the source has no knob for;
    `append`: source compiled after the file's (a candidate kernel using its helpers)."""
    with open(os.path.join(kernel_dir, name + ".cu")) as f:
        source = f.read() + append
    for old, new in replacements:
        if old not in source:
            raise ValueError("%s.cu has no %r" % (name, old))
        source = source.replace(old, new)
    options = ("-I" + kernel_dir, "--std=c++17") + tuple(
        "-D%s=%s" % kv for kv in defines
    )
    return cp.RawModule(code=source, options=options, backend="nvrtc")


def kernel_define(kernel_dir, file_name, name):
    """The integer a kernel file (or header) `#define`s for `name`, as the launches must use it."""
    with open(os.path.join(kernel_dir, file_name)) as f:
        return next(int(line.split()[2]) for line in f if line.startswith("#define %s " % name))


def residual_add_trials(rng):
    """Inputs of a folded residual add + RMSNorm, one set per trial (plain, zero-centred, plain
    norm): trial, the style's offset, delta, the norm's weight, and two copies each of the
    residual and of a normed row (the separate launches' and the fused kernel's)."""
    for trial, offset in enumerate((0.0, 1.0, 0.0)):
        x0 = rng.standard_normal((1, HIDDEN), dtype=np.float32)
        delta = cp.asarray(rng.standard_normal((1, HIDDEN), dtype=np.float32))
        norm_w = cp.asarray(rng.standard_normal(HIDDEN, dtype=np.float32) * 0.1)
        residual = [cp.asarray(x0) for _ in range(2)]
        normed = [cp.zeros((1, HIDDEN), dtype=cp.float32) for _ in range(2)]
        yield trial, np.float32(offset), delta, norm_w, residual, normed


def raw_kernel(kernel_dir, name, function, defines=()):
    """One kernel of `kernels/NAME.cu` as a CuPy RawKernel (which, unlike a module's function,
    takes more than 48 KB of dynamic shared memory)."""
    with open(os.path.join(kernel_dir, name + ".cu")) as f:
        source = f.read()
    options = ("-I" + kernel_dir, "--std=c++17") + tuple("-D%s=%s" % kv for kv in defines)
    return cp.RawKernel(source, function, options=options, backend="nvrtc")


def bf16(array):
    """Round-to-nearest-even bf16 bits of an f32 array (as the converter stores them)."""
    bits = array.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.astype(np.uint16)


def timed(launches, replays=20, warm=3):
    """Microseconds per launch: `launches` is a list of zero-argument callables, captured in one
    graph; the graph is replayed and the best replay is kept."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for launch in launches:
            launch()
        stream.synchronize()
        stream.begin_capture()
        for launch in launches:
            launch()
        graph = stream.end_capture()
        for _ in range(warm):
            graph.launch(stream)
        stream.synchronize()
        best = float("inf")
        for _ in range(replays):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(start, stop) * 1000.0 / len(launches))
    return best


def copies_for(bytes_each, at_least=256 << 20):
    return max(2, -(-at_least // bytes_each))


class BenchCore:
    """The state every section's rows land in (the arguments, the table, the failures) and the
    checks and floor they share; `cli.Bench` adds the sections."""

    def __init__(self, args):
        self.args = args
        self.results = []
        self.failures = []
        self.rng = np.random.default_rng(7)
        self.copy_tbs = None

    def record(self, name, variant, us, moved_bytes=None, note=""):
        """One row: µs per launch, and with `moved_bytes` the bandwidth and its share of the copy."""
        row = {"kernel": name, "variant": variant, "us": round(us, 2)}
        extra = ""
        if moved_bytes:
            row["TB/s"] = round(moved_bytes / us / 1e6, 2)
            extra = "  %.2f TB/s" % row["TB/s"]
            if self.copy_tbs:
                row["share"] = round(row["TB/s"] / self.copy_tbs, 2)
                extra += " (%d%% of copy)" % round(100 * row["share"])
        if note:
            row["note"] = note
        self.results.append(row)
        print("%-34s %-26s %8.2f us%s %s" % (name, variant, us, extra, note), flush=True)

    def floor(self):
        """The device copy rate (bytes read + written, as `ninfer bench` counts it), the
        reference of every share printed, and an empty kernel's time per launch in a graph:
        what a launch costs before it moves a byte."""
        size = 1 << 30
        a = cp.empty(size, dtype=cp.uint8)
        b = cp.empty(size, dtype=cp.uint8)
        a.fill(1)
        best = float("inf")
        for _ in range(5):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            b[...] = a
            stop.record()
            stop.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(start, stop) * 1000.0)
        del a, b
        self.copy_tbs = 2 * size / best / 1e6
        print("device copy: %.2f TB/s (read + write)" % self.copy_tbs, flush=True)
        empty = cp.RawKernel('extern "C" __global__ void empty_kernel() {}', "empty_kernel")
        us = timed([lambda: empty((132,), (128,), ())] * 20)
        self.record("empty kernel (launch floor)", "-", us)

    def same_bits(self, name, a, b):
        a, b = cp.asnumpy(a), cp.asnumpy(b)
        if a.tobytes() != b.tobytes():
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64)).max()
            self.failures.append("%s: bits differ from the baseline (max |diff| %g)" % (name, diff))
            print("  !! %s: bits differ (max |diff| %g)" % (name, diff), flush=True)
        else:
            print("  == %s: bit-identical to the baseline" % name, flush=True)

    def close(self, name, a, b, rtol=1e-5, atol=1e-6):
        a, b = cp.asnumpy(a), cp.asnumpy(b)
        if not np.allclose(a, b, rtol=rtol, atol=atol):
            diff = np.abs(a - b).max()
            self.failures.append("%s: differs from the baseline by %g" % (name, diff))
            print("  !! %s: differs by %g" % (name, diff), flush=True)
        else:
            print("  ~= %s: within rtol %g, atol %g of the baseline" % (name, rtol, atol), flush=True)
