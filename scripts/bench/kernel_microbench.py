#!/usr/bin/env python3
"""Decode kernels one at a time, at the shapes of one Qwen3-30B-A3B decode layer.

Runs on a CUDA machine with CuPy (no Rust needed): compiles `kernels/*.cu` with NVRTC as the
engine does, launches each decode kernel with the engine's launch geometry on random data, and
prints microseconds per launch. Launches are captured in a CUDA graph and replayed, as the
engine's step graphs do, and weights rotate through enough copies that every launch reads them
from HBM, not from the 60 MB L2.

With `--baseline DIR` (the kernel files of another revision with the same kernel signatures,
e.g. `git archive REV kernels`) it runs both and checks that kernels meant to keep their bits
do: the matmuls, the norms, the router and the experts; the attention combine is compared
within f32 rounding.

Each kernel's row gives its bandwidth and that as a share of the device copy rate measured at
the start (bytes read + written, as `ninfer bench` counts it); an empty kernel's row is the
floor a launch costs in a graph. Alternative kernels (e.g. `expert_gate_up_tasks`) are timed
beside the kernel they replace, their bits checked against it.

    python3 scripts/bench/kernel_microbench.py [--baseline DIR] [--context 4096] [--json FILE]
"""

import argparse
import json
import os
import sys

import numpy as np

try:
    import cupy as cp
except ImportError:  # pragma: no cover - the GPU machine has it
    sys.exit("kernel_microbench needs CuPy (and a CUDA GPU)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def router_weight_copies(rng):
    """f32 router weights ([EXPERTS, HIDDEN]) and enough copies of them to rotate past L2."""
    host_w = rng.standard_normal((EXPERTS, HIDDEN), dtype=np.float32) * 0.02
    return host_w, [cp.asarray(host_w) for _ in range(copies_for(host_w.nbytes))]


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


class Bench:
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

    # -- dense projections -------------------------------------------------------------------

    def matmuls(self, kernel_dir, label, cols, unroll, baseline_outputs=None):
        """cols = 0: the baseline's kernels (one feature per warp, no `cols` argument)."""
        mod = module(kernel_dir, "matmul", [("UNROLL", unroll)] if cols else [])
        with open(os.path.join(kernel_dir, "matmul.cu")) as f:
            has_prefetch = "int cols, int prefetch" in f.read()
        warps, rows_per_warp = 8, 8
        outputs = {}
        shapes = [
            ("qkv matmul3_bf16", "matmul3_bf16", HIDDEN, [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], np.uint16),
            ("o_proj matmul_bf16", "matmul_bf16", HEADS * HEAD_DIM, [HIDDEN], np.uint16),
            ("router matmul f32", "matmul", HIDDEN, [EXPERTS], np.float32),
        ]
        for title, kernel, k, ms, dtype in shapes:
            function = mod.get_function(kernel)
            element = 2 if dtype == np.uint16 else 4
            total_bytes = sum(ms) * k * element
            copies = copies_for(total_bytes)
            rng = np.random.default_rng(11)
            host_weights = [rng.standard_normal((m, k), dtype=np.float32) * 0.02 for m in ms]
            if dtype == np.uint16:
                host_weights = [bf16(w) for w in host_weights]
            weights = [[cp.asarray(w) for w in host_weights] for _ in range(copies)]
            for n in (1, 2, 4, 8):
                x = cp.asarray(rng.standard_normal((n, k), dtype=np.float32))
                outs = [cp.zeros((n, m), dtype=cp.float32) for m in ms]
                per_warp = cols if cols else 1
                groups = -(-n // rows_per_warp)
                tasks = sum(-(-m // per_warp) for m in ms) * groups
                grid = (-(-tasks // warps),)
                block = (32 * warps,)

                extra = (np.int32(cols),) if cols else ()
                if cols and has_prefetch:
                    extra += (np.int32(0),)  # no L2 prefetch: CuPy launches have no PDL

                def launcher(ws, outs=outs, x=x, n=n):
                    if kernel == "matmul3_bf16":
                        args = (x, ws[0], ws[1], ws[2], outs[0], outs[1], outs[2], np.int32(n), np.int32(k),
                                np.int32(ms[0]), np.int32(ms[1]), np.int32(ms[2])) + extra
                    else:
                        args = (x, ws[0], outs[0], np.int32(n), np.int32(k), np.int32(ms[0])) + extra
                    return lambda: function(grid, block, args)

                us = timed([launcher(ws) for ws in weights])
                variant = label if not cols else "%s cols=%d unroll=%d" % (label, cols, unroll)
                self.record("%s n=%d" % (title, n), variant, us, total_bytes)
                launcher(weights[0])()
                cp.cuda.Device().synchronize()
                outputs[(title, n)] = [o.copy() for o in outs]
                if baseline_outputs is not None:
                    for o, b in zip(outputs[(title, n)], baseline_outputs[(title, n)]):
                        self.same_bits("%s n=%d (%s)" % (title, n, variant), o, b)
        return outputs

    # -- norms ---------------------------------------------------------------------------------

    def norms(self, kernel_dir, label, baseline=None):
        mod = module(kernel_dir, "norm")
        function = mod.get_function("add_rms_norm")
        rng = np.random.default_rng(3)
        outputs = {}
        for n in (1, 4):
            x0 = rng.standard_normal((n, HIDDEN), dtype=np.float32)
            delta = cp.asarray(rng.standard_normal((n, HIDDEN), dtype=np.float32))
            w = cp.asarray(rng.standard_normal(HIDDEN, dtype=np.float32))
            x = cp.asarray(x0)
            out = cp.zeros((n, HIDDEN), dtype=cp.float32)
            args = (x, delta, w, out, np.int64(n), np.int32(HIDDEN), np.float32(1e-6), np.float32(0.0))
            function((n,), (256,), args)
            cp.cuda.Device().synchronize()
            outputs[n] = (x.copy(), out.copy())
            us = timed([lambda: function((n,), (256,), args)] * 20)
            self.record("add_rms_norm n=%d" % n, label, us)
            if baseline is not None:
                self.same_bits("add_rms_norm x n=%d" % n, outputs[n][0], baseline[n][0])
                self.same_bits("add_rms_norm out n=%d" % n, outputs[n][1], baseline[n][1])
        return outputs

    def add_norm_matmul3_fused(self, kernel_dir):
        """One token after a feed-forward: `add_rms_norm` then `matmul3_bf16` (the next layer's
        q, k and v), against `add_norm_matmul3_bf16` (the add, the norm and the three projections
        in one launch); the residual and the projections must keep their bits, for both norm
        styles."""
        norm_mod = module(kernel_dir, "norm")
        matmul_mod = module(kernel_dir, "matmul")
        add_norm = norm_mod.get_function("add_rms_norm")
        matmul3 = matmul_mod.get_function("matmul3_bf16")
        together_kernel = matmul_mod.get_function("add_norm_matmul3_bf16")
        norm_threads = kernel_define(kernel_dir, "norm_common.cuh", "NORM_THREADS")
        ms = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]

        sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
        # The engine's grid: at most this many blocks an SM, warps striding over the tasks.
        engine_blocks = kernel_define(kernel_dir, "matmul.cu", "ADD_NORM_MATMUL_BLOCKS_PER_SM") * sms

        def launch_shape(cols, blocks=None):
            """Grid and size arguments at `cols` features a warp (the engine's is 1 at one row,
            matmul_columns_per_warp) and at most `blocks` blocks (None: one task a warp, as
            matmul3_bf16's grid)."""
            one_task_a_warp = -(-sum(-(-m // cols) for m in ms) // (norm_threads // 32))
            grid = (one_task_a_warp if blocks is None else min(blocks, one_task_a_warp),)
            dims = tuple(np.int32(v) for v in (HIDDEN, ms[0], ms[1], ms[2], cols, 0))
            return grid, dims

        grid, dims = launch_shape(1)
        rng = np.random.default_rng(13)
        host_w = [bf16(rng.standard_normal((m, HIDDEN), dtype=np.float32) * 0.02) for m in ms]
        weight_copies = [[cp.asarray(w) for w in host_w]
                         for _ in range(copies_for(sum(w.nbytes for w in host_w)))]
        eps = np.float32(1e-6)
        for trial, offset, delta, norm_w, residual, normed in residual_add_trials(rng):
            outs = [[cp.zeros((1, m), dtype=cp.float32) for m in ms] for _ in range(2)]
            counter = cp.zeros(1, dtype=cp.uint32)

            def separate(ws):
                def launch():
                    add_norm((1,), (norm_threads,), (residual[0], delta, norm_w, normed[0], np.int64(1),
                                                     np.int32(HIDDEN), eps, offset))
                    matmul3(grid, (norm_threads,), (normed[0], ws[0], ws[1], ws[2], outs[0][0], outs[0][1],
                                                    outs[0][2], np.int32(1)) + dims)
                return launch

            def together(ws, cols=1, blocks=engine_blocks):
                fused_grid, fused_dims = launch_shape(cols, blocks)

                def launch():
                    together_kernel(fused_grid, (norm_threads,),
                                    (residual[1], delta, norm_w, eps, offset, normed[1], ws[0], ws[1], ws[2],
                                     outs[1][0], outs[1][1], outs[1][2], counter) + fused_dims,
                                    shared_mem=4 * HIDDEN)
                return launch

            separate(weight_copies[0])()
            together(weight_copies[0])()
            cp.cuda.Device().synchronize()
            self.same_bits("add_norm_matmul3_bf16 residual (offset %g)" % offset, residual[1], residual[0])
            self.same_bits("add_norm_matmul3_bf16 normed (offset %g)" % offset, normed[1], normed[0])
            for name, a, b in zip("qkv", outs[1], outs[0]):
                self.same_bits("add_norm_matmul3_bf16 %s (offset %g)" % (name, offset), a, b)
            if int(counter.get()[0]) != 0:
                self.failures.append("add_norm_matmul3_bf16 left its counter at %d" % int(counter.get()[0]))
            if trial == 0:
                moved = sum(w.nbytes for w in host_w)
                us = timed([separate(ws) for ws in weight_copies])
                self.record("add_rms_norm + matmul3_bf16 n=1", "two launches", us, moved)
                # Fewer blocks form the norm fewer times; each warp then takes more tasks.
                for blocks in (None, sms, engine_blocks, 4 * sms):
                    us = timed([together(ws, blocks=blocks) for ws in weight_copies])
                    label = "one task a warp" if blocks is None else "%d blocks" % blocks
                    self.record("add_norm_matmul3_bf16 n=1", "one launch, " + label, us, moved)
                us = timed([together(ws, cols=2, blocks=None) for ws in weight_copies])
                self.record("add_norm_matmul3_bf16 n=1", "one launch, 2 features a warp", us, moved)

    # -- router --------------------------------------------------------------------------------

    def router(self, kernel_dir, label, warp_kernel, baseline=None):
        mod = module(kernel_dir, "router")
        function = mod.get_function("route_top_k")
        rng = np.random.default_rng(5)
        outputs = {}
        for n in (1, 5):
            logits = cp.asarray(rng.standard_normal((n, EXPERTS), dtype=np.float32))
            ids = cp.zeros((n, TOP_K), dtype=cp.uint32)
            weights = cp.zeros((n, TOP_K), dtype=cp.float32)
            null = np.uint64(0)
            if warp_kernel:
                grid, block = (-(-n // 4),), (128,)
                args = (logits, ids, weights, np.int32(n), np.int32(EXPERTS), np.int32(TOP_K), np.int32(1),
                        null, null, null, null, np.int32(0))
            else:
                grid, block = (n,), (256,)
                args = (logits, ids, weights, np.int32(EXPERTS), np.int32(TOP_K), np.int32(1),
                        null, null, null, null, np.int32(0))
            function(grid, block, args)
            cp.cuda.Device().synchronize()
            outputs[n] = (ids.copy(), weights.copy())
            us = timed([lambda: function(grid, block, args)] * 20)
            self.record("route_top_k n=%d" % n, label, us)
            if baseline is not None:
                self.same_bits("route_top_k ids n=%d" % n, outputs[n][0], baseline[n][0])
                self.same_bits("route_top_k weights n=%d" % n, outputs[n][1], baseline[n][1])
        return outputs

    def router_fused(self, kernel_dir):
        """One token's router: `matmul` (f32 router weights) then `route_top_k`, against
        `route_decode_fused` (both in one launch); the ids, weights and logits must keep their bits."""
        matmul_mod = module(kernel_dir, "matmul")
        router_mod = module(kernel_dir, "router")
        matmul = matmul_mod.get_function("matmul")
        route = router_mod.get_function("route_top_k")
        fused = router_mod.get_function("route_decode_fused")
        rng = np.random.default_rng(9)
        host_w, weights_copies = router_weight_copies(rng)
        null = np.uint64(0)
        # The kernel's block of ROUTER_FUSED_WARPS warps, one logit each.
        warps = kernel_define(kernel_dir, "router.cu", "ROUTER_FUSED_WARPS")
        fused_grid = (-(-EXPERTS // warps),)
        for trial in range(3):
            x = cp.asarray(rng.standard_normal((1, HIDDEN), dtype=np.float32))
            logits = [cp.zeros((1, EXPERTS), dtype=cp.float32) for _ in range(2)]
            ids = [cp.zeros((1, TOP_K), dtype=cp.uint32) for _ in range(2)]
            chosen = [cp.zeros((1, TOP_K), dtype=cp.float32) for _ in range(2)]
            counter = cp.zeros(1, dtype=cp.uint32)
            mapped = [cp.zeros(HIDDEN, dtype=cp.float32) for _ in range(2)]
            matmul_grid = (-(-EXPERTS // 8),)  # one logit per warp, 8 warps a block

            def separate(w):
                def launch():
                    matmul(matmul_grid, (256,), (x, w, logits[0], np.int32(1), np.int32(HIDDEN),
                                                 np.int32(EXPERTS), np.int32(1), np.int32(0)))
                    route((1,), (128,), (logits[0], ids[0], chosen[0], np.int32(1), np.int32(EXPERTS),
                                         np.int32(TOP_K), np.int32(1), null, null, x, mapped[0],
                                         np.int32(HIDDEN)))
                return launch


            def together(w):
                def launch():
                    fused(fused_grid, (32 * warps,), (x, w, logits[1], counter, ids[1], chosen[1],
                                                       np.int32(HIDDEN), np.int32(EXPERTS), np.int32(TOP_K),
                                                       np.int32(1), null, null, mapped[1], np.int32(0)))
                return launch

            separate(weights_copies[0])()
            together(weights_copies[0])()
            cp.cuda.Device().synchronize()
            for name, a, b in (("logits", logits[1], logits[0]), ("ids", ids[1], ids[0]),
                               ("weights", chosen[1], chosen[0]), ("mapped hidden", mapped[1], mapped[0])):
                self.same_bits("route_decode_fused %s (trial %d)" % (name, trial), a, b)
            if int(counter.get()[0]) != 0:
                self.failures.append("route_decode_fused left its counter at %d" % int(counter.get()[0]))
            if trial == 0:
                us = timed([separate(w) for w in weights_copies])
                self.record("router matmul + route_top_k n=1", "two launches", us, host_w.nbytes)
                us = timed([together(w) for w in weights_copies])
                self.record("route_decode_fused n=1", "one launch", us, host_w.nbytes)

    def router_add_norm_fused(self, kernel_dir):
        """One token after attention: `add_rms_norm` then `route_decode_fused`, against
        `route_decode_add_norm_fused` (the add, the norm and the router in one launch); the
        residual, the normed row, the logits, ids and weights must keep their bits, for both norm
        styles."""
        norm_mod = module(kernel_dir, "norm")
        router_mod = module(kernel_dir, "router")
        add_norm = norm_mod.get_function("add_rms_norm")
        fused = router_mod.get_function("route_decode_fused")
        together_kernel = router_mod.get_function("route_decode_add_norm_fused")
        rng = np.random.default_rng(11)
        host_w, weights_copies = router_weight_copies(rng)
        null = np.uint64(0)
        warps = kernel_define(kernel_dir, "router.cu", "ROUTER_FUSED_WARPS")
        # The fused kernel's block is the norm's, one logit per warp.
        norm_threads = kernel_define(kernel_dir, "norm_common.cuh", "NORM_THREADS")
        eps = np.float32(1e-6)
        for trial, offset, delta, norm_w, residual, normed in residual_add_trials(rng):
            logits = [cp.zeros((1, EXPERTS), dtype=cp.float32) for _ in range(2)]
            ids = [cp.zeros((1, TOP_K), dtype=cp.uint32) for _ in range(2)]
            chosen = [cp.zeros((1, TOP_K), dtype=cp.float32) for _ in range(2)]
            mapped = [cp.zeros(HIDDEN, dtype=cp.float32) for _ in range(2)]
            counters = [cp.zeros(1, dtype=cp.uint32) for _ in range(2)]

            def separate(w):
                def launch():
                    add_norm((1,), (norm_threads,), (residual[0], delta, norm_w, normed[0], np.int64(1),
                                            np.int32(HIDDEN), eps, offset))
                    fused((-(-EXPERTS // warps),), (32 * warps,),
                          (normed[0], w, logits[0], counters[0], ids[0], chosen[0], np.int32(HIDDEN),
                           np.int32(EXPERTS), np.int32(TOP_K), np.int32(1), null, null, mapped[0],
                           np.int32(0)))
                return launch

            def together(w):
                def launch():
                    together_kernel((-(-EXPERTS // (norm_threads // 32)),), (norm_threads,),
                                    (residual[1], delta, norm_w, eps, offset, normed[1], w, logits[1],
                                     counters[1], ids[1], chosen[1], np.int32(HIDDEN),
                                     np.int32(EXPERTS), np.int32(TOP_K), np.int32(1), null, null,
                                     mapped[1], np.int32(0)),
                                    shared_mem=4 * HIDDEN)
                return launch

            separate(weights_copies[0])()
            together(weights_copies[0])()
            cp.cuda.Device().synchronize()
            for name, a, b in (("residual", residual[1], residual[0]), ("normed", normed[1], normed[0]),
                               ("logits", logits[1], logits[0]), ("ids", ids[1], ids[0]),
                               ("weights", chosen[1], chosen[0]), ("mapped hidden", mapped[1], mapped[0])):
                self.same_bits("route_decode_add_norm_fused %s (offset %g)" % (name, offset), a, b)
            if int(counters[1].get()[0]) != 0:
                self.failures.append("route_decode_add_norm_fused left its counter at %d"
                                     % int(counters[1].get()[0]))
            if trial == 0:
                us = timed([separate(w) for w in weights_copies])
                self.record("add_rms_norm + route_decode_fused", "two launches", us, host_w.nbytes)
                us = timed([together(w) for w in weights_copies])
                self.record("route_decode_add_norm_fused n=1", "one launch", us, host_w.nbytes)

    # -- attention -----------------------------------------------------------------------------

    def attention(self, kernel_dir, label, parallel_combine, baseline=None, max_chunks=128):
        mod = module(kernel_dir, "attention")
        split = mod.get_function("attention_split_bf16")
        combine = mod.get_function("attention_combine")
        context = self.args.context
        rng = np.random.default_rng(9)
        width = KV_HEADS * HEAD_DIM
        caches = copies_for(2 * context * width * 2)
        keys = [cp.asarray(bf16(rng.standard_normal((context, width), dtype=np.float32))) for _ in range(caches)]
        values = [cp.asarray(bf16(rng.standard_normal((context, width), dtype=np.float32))) for _ in range(caches)]
        q = cp.asarray(rng.standard_normal((1, HEADS * HEAD_DIM), dtype=np.float32))
        position = context - 1
        tile = 32
        if max_chunks != 128:
            label = "%s chunks<=%d" % (label, max_chunks)
        tiles = -(-(position + 1) // tile)
        chunk = max(1, -(-tiles // max_chunks)) * tile
        chunks = position // chunk + 1
        part_o = cp.zeros(HEADS * chunks * HEAD_DIM, dtype=cp.float32)
        part_ml = cp.zeros(2 * HEADS * chunks, dtype=cp.float32)
        out = cp.zeros((1, HEADS * HEAD_DIM), dtype=cp.float32)
        words = HEAD_DIM // 2
        stride = words + 1 if words % 4 else words + 4
        smem = (8 * HEAD_DIM + 8 * 32 + 3 * 8 + 2 * 32 * stride) * 4
        null = np.uint64(0)
        scale = np.float32(HEAD_DIM ** -0.5)
        slices = -(-(HEADS // KV_HEADS) // 8)

        def split_launch(i):
            args = (q, keys[i], values[i], part_o, part_ml, np.int32(0), np.int32(position), np.int32(HEADS),
                    np.int32(KV_HEADS), np.int32(HEAD_DIM), np.int32(0), scale, np.int32(chunk), np.int32(chunks),
                    np.int32(0), null)
            return lambda: split((chunks, KV_HEADS * slices, 1), (128,), args, shared_mem=smem)

        combine_args = (part_o, part_ml, out, np.int32(0), np.int32(1), np.int32(position), np.int32(HEADS),
                        np.int32(HEAD_DIM), np.int32(0), np.int32(chunk), np.int32(chunks), np.int32(0), null)
        if parallel_combine:
            combine_grid, combine_block = (HEADS, -(-HEAD_DIM // 32)), (256,)
        else:
            combine_grid, combine_block = (HEADS,), (HEAD_DIM,)

        def combine_launch():
            combine(combine_grid, combine_block, combine_args)

        kv_bytes = 2 * context * width * 2
        us = timed([split_launch(i) for i in range(caches)])
        self.record("attention_split_bf16 %dK" % (context // 1024), label, us, kv_bytes)
        us = timed([combine_launch] * 20)
        self.record("attention_combine %dK" % (context // 1024), label, us)
        split_launch(0)()
        combine_launch()
        cp.cuda.Device().synchronize()
        result = out.copy()
        if baseline is not None:
            self.close("attention split+combine", result, baseline)
        return result

    # -- decode attention with the group's heads across lanes ---------------------------------

    def decode_attention(self, kernel_dir, heads, kv_heads, hd, context,
                         variants=((8192, 4), (8192, 8), (16384, 8)), chunk_factors=(1, 2, 4),
                         mma_variants=((16, 4), (16, 2), (32, 2)), mma_chunk_factors=(1,),
                         mma_merge_variants=((16, 4), (16, 2))):
        """`attention_decode_bf16_HD_DPL` (attention_decode.cu) against `attention_split_bf16` at
        its own chunking, each followed by `attention_combine`; outputs held within f32 rounding
        of the split kernel's. Shape: `heads` q heads, `kv_heads`, head dim `hd`; `variants`:
        (DECODE_TILE_BYTES, DECODE_WARPS); chunks of the split kernel's size times each of
        `chunk_factors`."""
        group = heads // kv_heads
        group_pow2 = 1 << (group - 1).bit_length()
        lanes = 32 // group_pow2
        dpl = hd // lanes
        shape = "%dq/%dkv/hd%d %dK" % (heads, kv_heads, hd, context // 1024)
        split_mod = module(kernel_dir, "attention")
        split = split_mod.get_function("attention_split_bf16")
        combine = split_mod.get_function("attention_combine")
        rng = np.random.default_rng(9)
        width = kv_heads * hd
        caches = copies_for(2 * context * width * 2)
        keys = [cp.asarray(bf16(rng.standard_normal((context, width), dtype=np.float32))) for _ in range(caches)]
        values = [cp.asarray(bf16(rng.standard_normal((context, width), dtype=np.float32))) for _ in range(caches)]
        q = cp.asarray(rng.standard_normal((1, heads * hd), dtype=np.float32))
        position = context - 1
        null = np.uint64(0)
        scale = np.float32(hd ** -0.5)
        kv_bytes = 2 * context * width * 2
        max_chunks = 128
        part_o = cp.zeros(heads * max_chunks * hd, dtype=cp.float32)
        part_ml = cp.zeros(2 * heads * max_chunks, dtype=cp.float32)

        def combine_launch(out, chunk, chunks):
            args = (part_o, part_ml, out, np.int32(0), np.int32(1), np.int32(position), np.int32(heads),
                    np.int32(hd), np.int32(0), np.int32(chunk), np.int32(chunks), np.int32(0), null)
            return lambda: combine((heads, -(-hd // 32)), (256,), args)

        # The split kernel at its chunking (split_chunk).
        tiles = -(-(position + 1) // 32)
        min_tiles = kernel_define(kernel_dir, "attention_common.cuh", "SPLIT_MIN_CHUNK_TILES")
        chunk = max(min_tiles, -(-tiles // max_chunks)) * 32
        chunks = position // chunk + 1
        words = hd // 2
        stride = words + 1 if words % 4 else words + 4
        smem = (8 * hd + 8 * 32 + 3 * 8 + 2 * 32 * stride) * 4
        slices = -(-group // 8)

        def split_launch(i):
            args = (q, keys[i], values[i], part_o, part_ml, np.int32(0), np.int32(position), np.int32(heads),
                    np.int32(kv_heads), np.int32(hd), np.int32(0), scale, np.int32(chunk), np.int32(chunks),
                    np.int32(0), null)
            return lambda: split((chunks, kv_heads * slices, 1), (128,), args, shared_mem=smem)

        reference = cp.zeros((1, heads * hd), dtype=cp.float32)
        split_us = timed([split_launch(i) for i in range(caches)])
        combine_us = timed([combine_launch(reference, chunk, chunks)] * 20)
        self.record("attention_split_bf16 " + shape, "chunk %d" % chunk, split_us, kv_bytes)
        self.record("  + combine", "%d chunks" % chunks, combine_us)
        self.record("  split + combine", "chunk %d" % chunk, split_us + combine_us, kv_bytes)
        split_launch(0)()
        combine_launch(reference, chunk, chunks)()
        cp.cuda.Device().synchronize()
        reference = reference.copy()

        def measure(kernel, smem, warps, d_chunk, blocks_per_chunk, name, pair, variant, rtol, atol):
            """One decode kernel at chunks of `d_chunk` keys (a block per `blocks_per_chunk`
            chunks), then the combine: timed, recorded, and held to the split kernel's output."""
            d_chunks = position // d_chunk + 1
            grid = (-(-d_chunks // blocks_per_chunk), kv_heads, 1)
            out = cp.zeros((1, heads * hd), dtype=cp.float32)

            def launch(i):
                args = (q, keys[i], values[i], part_o, part_ml, np.int32(0), np.int32(position),
                        np.int32(heads), np.int32(kv_heads), np.int32(hd), np.int32(0), scale,
                        np.int32(d_chunk), np.int32(d_chunks), np.int32(0), null)
                return lambda: kernel(grid, (32 * warps,), args, shared_mem=smem)

            variant = "%s chunk %d (%d)" % (variant, d_chunk, d_chunks)
            us = timed([launch(i) for i in range(caches)])
            c_us = timed([combine_launch(out, d_chunk, d_chunks)] * 20)
            self.record("%s %s" % (name, shape), variant, us, kv_bytes)
            self.record("  %s + combine" % pair, variant, us + c_us, kv_bytes)
            launch(0)()
            combine_launch(out, d_chunk, d_chunks)()
            cp.cuda.Device().synchronize()
            self.close("%s %s %s" % (pair, shape, variant), out, reference, rtol=rtol, atol=atol)

        def sized(kernel, smem):
            """`kernel` allowed `smem` bytes, or None where this GPU cannot give them."""
            if smem > cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]:
                return None
            if smem > 48 * 1024:
                kernel.max_dynamic_shared_size_bytes = smem
            return kernel

        for tile_bytes, warps in variants if "lanes" in self.args.decode_kernels.split(",") else ():
            if tile_bytes // (2 * hd) < warps:
                continue
            states = warps * group_pow2 * hd * 4 + 2 * warps * group_pow2 * 4
            smem = max(4 * tile_bytes, states)
            decode = sized(raw_kernel(kernel_dir, "attention_decode", "attention_decode_bf16_%d_%d" % (hd, dpl),
                                      [("DECODE_TILE_BYTES", tile_bytes), ("DECODE_WARPS", warps)]), smem)
            if decode is None:
                continue
            for factor in chunk_factors:
                measure(decode, smem, warps, chunk * factor, 1, "attention_decode_bf16_%d_%d" % (hd, dpl),
                        "decode", "tile %dB %d warps" % (tile_bytes, warps), 1e-4, 1e-5)

        # The tensor-core kernel (q heads as the rows of an mma tile): q and p rounded to bf16, so
        # held to the split kernel within bf16 tolerances. Variants (DM_KEYS, DM_WARPS): a warp
        # per chunk; merged (DM_MERGE=1): a block's warps split one chunk of `warps` times the
        # keys and merge in the block, so the combine reads `warps` times fewer partials.
        if group > 16 or "mma" not in self.args.decode_kernels.split(","):
            return
        mma_name = "attention_decode_mma_bf16_%d" % hd
        runs = [(keys_per_tile, warps, False, factor) for keys_per_tile, warps in mma_variants
                for factor in mma_chunk_factors]
        runs += [(keys_per_tile, warps, True, warps) for keys_per_tile, warps in mma_merge_variants]
        for keys_per_tile, warps, merged, factor in runs:
            defines = [("DM_KEYS", keys_per_tile), ("DM_WARPS", warps), ("DM_WARPS_256", warps),
                       ("DM_MERGE", int(merged))]
            smem = (16 + warps * 2 * 2 * keys_per_tile) * (hd + 8) * 2
            kernel = sized(raw_kernel(kernel_dir, "attention_decode", mma_name, defines), smem)
            if kernel is None:
                continue
            label = "%s%d keys %d warps" % ("merged " if merged else "", keys_per_tile, warps)
            measure(kernel, smem, warps, chunk * factor, 1 if merged else warps, mma_name, "mma", label,
                    1e-2, 5e-4)

    def expert_decode_fused(self, kernel_dir, v):
        """`expert_decode_fused` (kernels/experts.cu: one launch for a token's gate/up tasks,
        down and pair sum) against the three launches, bits held equal. `v`: the one-token
        locals of `experts` (buffers, launch builders, shapes)."""
        with open(os.path.join(kernel_dir, "experts.cu")) as f:
            if "expert_decode_fused" not in f.read():
                return  # a revision without it
        h, i, pairs, tokens = v["h"], v["i"], v["pairs"], v["tokens"]
        id_sets, suffix, blocks, span = v["id_sets"], v["suffix"], v["blocks"], v["span"]
        tasks_launch, down_launch, pair_sum = v["tasks_launch"], v["down_launch"], v["pair_sum"]
        tasks_out, out, sum_args = v["tasks_out"], v["out"], v["sum_args"]
        moved = pairs * (v["gate_up_bytes"] + v["gate_up_scales"] + v["down_bytes"] + v["down_scales"])

        def sum_launch():
            pair_sum((-(-(tokens * h) // 256),), (256,), sum_args)

        three = []
        for ids in id_sets:
            three += [tasks_launch(ids, blocks, span=span), down_launch(ids, activated=tasks_out), sum_launch]
        us = timed(three) * 3
        self.record("tasks + down + pair sum int8 " + suffix, "three launches", us, moved)
        tasks_launch(id_sets[5], blocks)()
        down_launch(id_sets[5], activated=tasks_out)()
        sum_launch()
        cp.cuda.Device().synchronize()
        reference_out, reference_activated = out.copy(), tasks_out.copy()
        counters = cp.zeros(2, dtype=cp.uint32)
        fused_out = cp.zeros((tokens, h), dtype=cp.float32)
        fused_activated = cp.zeros((pairs, i), dtype=cp.float32)
        smem = max(-(-h // 16), TOP_K * -(-i // 16)) * 20 * 4
        sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
        for min_blocks, loads in ((1, 8), (2, 8)):
            kernel = module(kernel_dir, "experts", [("FUSED_MIN_BLOCKS", min_blocks),
                                                    ("FUSED_DOWN_LOADS", loads)]).get_function("expert_decode_fused")

            def fused_launch(ids, kernel=kernel, grid=min_blocks * sms):
                args = (v["buffer"], v["slot_of_expert"], ids, v["x"], v["weights"], fused_activated, fused_out,
                        counters, np.int32(TOP_K), np.int32(EXPERTS), np.int32(h), np.int32(i), np.int64(v["stride"]),
                        v["dtype_int8"], np.int64(v["gate_up_bytes"]), np.int64(v["down_offset"]),
                        np.int64(v["down_bytes"]))
                return lambda: kernel((grid,), (256,), args, shared_mem=smem)

            variant = "%d blocks/SM loads=%d" % (min_blocks, loads)
            us = timed([fused_launch(ids) for ids in id_sets])
            self.record("expert_decode_fused int8 " + suffix, variant, us, moved)
            fused_launch(id_sets[5])()
            cp.cuda.Device().synchronize()
            self.same_bits("expert_decode_fused (%s) activations" % variant, fused_activated, reference_activated)
            self.same_bits("expert_decode_fused (%s) against tasks + down + pair sum" % variant, fused_out,
                           reference_out)

    def candidate_gate_up(self, kernel_dir):
        """`expert_gate_up_tasks` of kernel_dir's experts.cu (one token's gate/up from a grid
        that fits the GPU at once), or None for a revision without it or with --no-candidates."""
        if self.args.no_candidates:
            return None
        if not hasattr(self, "_candidate"):
            try:
                self._candidate = module(kernel_dir, "experts").get_function("expert_gate_up_tasks")
            except Exception:  # noqa: BLE001 - CuPy's error type for a missing function
                self._candidate = None
        return self._candidate

    def experts(self, kernel_dir, label, down_rows, baseline=None, gate_up_columns=1, min_blocks=0,
                down_sum_loads=0):
        """The per-pair decode kernels at one token (8 pairs) and at eight tokens (64 pairs, a
        decode batch of 8 under uniform routing: every pair a different expert). `min_blocks`:
        compile `expert_gate_up` for that many resident blocks per multiprocessor
        (`__launch_bounds__`; at one token its 768 blocks need 6 to fit one wave on an H200)."""
        defines = [("GATE_UP_COLUMNS", gate_up_columns)] if label != "baseline" else []
        if down_sum_loads:
            defines.append(("DOWN_SUM_LOADS", down_sum_loads))
        replacements = []
        if min_blocks:
            replacements = [('extern "C" __global__ void expert_gate_up(',
                             'extern "C" __global__ void __launch_bounds__(256, %d) expert_gate_up(' % min_blocks)]
        mod = module(kernel_dir, "experts", defines, replacements)
        if label != "baseline":
            label = "%s columns=%d" % (label, gate_up_columns)
            if min_blocks:
                label += " min_blocks=%d" % min_blocks
            if down_sum_loads:
                label += " loads=%d" % down_sum_loads
        gate_up = mod.get_function("expert_gate_up")
        down = mod.get_function("expert_down")
        h, i = HIDDEN, MOE_INTERMEDIATE
        gate_up_bytes = 2 * i * h
        gate_up_scales = 2 * i * (h // 32) * 2
        down_offset = -(-(gate_up_bytes + gate_up_scales) // 256) * 256
        down_bytes = h * i
        down_scales = h * (i // 32) * 2
        stride = -(-(down_offset + down_bytes + down_scales) // 256) * 256
        slots = EXPERTS
        rng = np.random.default_rng(13)
        raw = rng.integers(-100, 100, size=slots * stride, dtype=np.int8).view(np.uint8)
        buffer = cp.asarray(raw)
        # Scales: small f16 values, written over the random bytes.
        scale_bits = np.float16(0.01).view(np.uint16)
        view16 = buffer.view(cp.uint16)
        for s in range(slots):
            base = s * stride
            view16[(base + gate_up_bytes) // 2:(base + gate_up_bytes + gate_up_scales) // 2] = scale_bits
            view16[(base + down_offset + down_bytes) // 2:(base + down_offset + down_bytes + down_scales) // 2] = scale_bits
        slot_of_expert = cp.arange(EXPERTS, dtype=cp.int32)
        dtype_int8 = np.int32(2)
        result = None
        for tokens in (1, 8):
            pairs = tokens * TOP_K
            x = cp.asarray(rng.standard_normal((tokens, h), dtype=np.float32))
            activated = cp.zeros((pairs, i), dtype=cp.float32)
            pair_out = cp.zeros((pairs, h), dtype=cp.float32)
            # Not powers of two, so a product rounded in another place would show in the bits.
            weights = cp.asarray(rng.uniform(0.05, 0.3, pairs).astype(np.float32))
            # Different experts per launch (and per pair within one) so reads come from HBM.
            id_sets = [cp.asarray(((np.arange(pairs) + pairs * j) % EXPERTS).astype(np.uint32)) for j in range(16)]

            def gate_up_launch(ids, x=x, activated=activated, pairs=pairs):
                args = (buffer, slot_of_expert, ids, x, activated, np.int32(TOP_K), np.int32(EXPERTS), np.int32(h),
                        np.int32(i), np.int64(stride), dtype_int8, np.int64(gate_up_bytes))
                smem = -(-h // 16) * 20 * 4
                return lambda: gate_up((-(-i // (8 * gate_up_columns)), pairs), (256,), args, shared_mem=smem)

            def down_launch(ids, activated=activated, pair_out=pair_out, weights=weights, pairs=pairs):
                args = (buffer, slot_of_expert, ids, weights, activated, pair_out, np.int32(EXPERTS), np.int32(h),
                        np.int32(i), np.int64(stride), dtype_int8, np.int64(down_offset), np.int64(down_bytes))
                smem = -(-i // 16) * 20 * 4
                return lambda: down((-(-h // (8 * down_rows)), pairs), (256,), args, shared_mem=smem)

            suffix = "k=8" if tokens == 1 else "%d tokens, %d pairs" % (tokens, pairs)
            us = timed([gate_up_launch(ids) for ids in id_sets])
            self.record("expert_gate_up int8 " + suffix, label, us, pairs * (gate_up_bytes + gate_up_scales))
            us = timed([down_launch(ids) for ids in id_sets])
            self.record("expert_down int8 " + suffix, label, us, pairs * (down_bytes + down_scales))
            pair_sum = mod.get_function("expert_pair_sum")
            out = cp.zeros((tokens, h), dtype=cp.float32)
            sum_args = (pair_out, out, np.int32(tokens), np.int32(TOP_K), np.int32(h))
            us = timed([lambda: pair_sum((-(-(tokens * h) // 256),), (256,), sum_args)] * 16)
            self.record("expert_pair_sum " + suffix, label, us)
            try:
                down_sum = mod.get_function("expert_down_sum")
            except Exception:  # noqa: BLE001 - CuPy's error type for a missing function
                down_sum = None  # an older revision: no fused kernel
            fused = cp.zeros((tokens, h), dtype=cp.float32)

            def down_sum_launch(ids, activated=activated, weights=weights, tokens=tokens, fused=fused):
                args = (buffer, slot_of_expert, ids, weights, activated, fused, np.int32(TOP_K), np.int32(EXPERTS),
                        np.int32(h), np.int32(i), np.int64(stride), dtype_int8, np.int64(down_offset),
                        np.int64(down_bytes))
                smem = TOP_K * (-(-i // 16)) * 20 * 4
                return lambda: down_sum((-(-h // 8), tokens), (256,), args, shared_mem=smem)

            if down_sum is not None:
                us = timed([down_sum_launch(ids) for ids in id_sets])
                self.record("expert_down_sum int8 " + suffix, label, us, pairs * (down_bytes + down_scales))
            candidate = self.candidate_gate_up(kernel_dir) if tokens == 1 and label.startswith("current") else None
            if candidate is not None:
                tasks_out = cp.zeros((pairs, i), dtype=cp.float32)

                def tasks_launch(ids, blocks, x=x, pairs=pairs, tasks_out=tasks_out, span=0, kernel=candidate):
                    args = (buffer, slot_of_expert, ids, x, tasks_out, np.int32(TOP_K), np.int32(EXPERTS), np.int32(h),
                            np.int32(i), np.int64(stride), dtype_int8, np.int64(gate_up_bytes), np.int32(pairs),
                            np.int64(down_offset), np.int64(span))
                    smem = tokens * (-(-h // 16)) * 20 * 4
                    return lambda: kernel((blocks,), (256,), args, shared_mem=smem)

                sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
                for per_sm in (1, 2, 3, 4):
                    us = timed([tasks_launch(ids, per_sm * sms) for ids in id_sets])
                    self.record("expert_gate_up_tasks int8 " + suffix, "%d blocks/SM" % per_sm, us,
                                pairs * (gate_up_bytes + gate_up_scales))
                    gate_up_launch(id_sets[5])()
                    tasks_launch(id_sets[5], per_sm * sms)()
                    cp.cuda.Device().synchronize()
                    self.same_bits("expert_gate_up_tasks %d blocks/SM against expert_gate_up" % per_sm,
                                   tasks_out, activated)
                # The pair the engine launches at one token (task grid, then down), the task grid
                # asking L2 for the down matrices after its tasks (1) or before them (2), or not.
                blocks = 2 * sms
                span = stride - down_offset
                variants = [("no prefetch", candidate, 0)]
                for where in (1, 2):
                    try:
                        kernel = module(kernel_dir, "experts", [("DOWN_PREFETCH", where)]).get_function(
                            "expert_gate_up_tasks")
                        variants.append(("down prefetch %d" % where, kernel, span))
                    except Exception:  # noqa: BLE001 - a revision without the prefetch
                        pass
                for name, kernel, span_here in variants:
                    launches = []
                    for ids in id_sets:
                        launches.append(tasks_launch(ids, blocks, span=span_here, kernel=kernel))
                        launches.append(down_launch(ids))
                    us = timed(launches) * 2
                    self.record("gate_up_tasks + expert_down int8 " + suffix, name, us,
                                pairs * (gate_up_bytes + gate_up_scales + down_bytes + down_scales))
                    tasks_launch(id_sets[5], blocks, span=span_here, kernel=kernel)()
                    cp.cuda.Device().synchronize()
                    self.same_bits("expert_gate_up_tasks (%s) against expert_gate_up" % name, tasks_out,
                                   activated)
                self.expert_decode_fused(kernel_dir, locals())
            # One expert not resident: its pair's output rows are zeros (and its activated row is
            # not written, so it is left out of the comparison).
            missing = int(id_sets[3][2])
            slot_of_expert[missing] = -1
            gate_up_launch(id_sets[3])()
            down_launch(id_sets[3])()
            if down_sum is not None:
                pair_sum((-(-(tokens * h) // 256),), (256,), sum_args)
                down_sum_launch(id_sets[3])()
            cp.cuda.Device().synchronize()
            slot_of_expert[missing] = missing
            if down_sum is not None:
                self.same_bits("expert_down_sum against down + pair sum, %d tokens" % tokens, fused, out)
            resident = [p for p in range(pairs) if p != 2]
            result_here = (activated[resident].copy(), pair_out.copy())
            if baseline is not None:
                self.same_bits("expert_gate_up activated, %d tokens" % tokens, result_here[0], baseline[tokens][0])
                self.same_bits("expert_down pair_out, %d tokens" % tokens, result_here[1], baseline[tokens][1])
            result = result or {}
            result[tokens] = result_here
        return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", default=os.path.join(ROOT, "kernels"))
    parser.add_argument("--baseline", help="kernel files of another revision, compared against")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--json", help="write the table here")
    parser.add_argument("--decode-contexts", default="4096,16384,65536",
                        help="contexts of the decode attention section")
    parser.add_argument("--decode-kernels", default="lanes,mma",
                        help="decode attention kernels timed beside the split kernel: lanes (q heads across the lanes), mma (tensor cores)")
    parser.add_argument("--sweep", action="store_true", help="matmul features per warp × UNROLL, attention chunks, gate/up columns")
    parser.add_argument("--no-candidates", action="store_true",
                        help="skip the alternative kernels timed beside the ones they replace")
    parser.add_argument("--sections", default="matmul,norm,router,decode_attention,attention,experts",
                        help="comma-separated: which kernels to time")
    args = parser.parse_args()
    bench = Bench(args)
    props = cp.cuda.runtime.getDeviceProperties(0)
    print("device: %s, %d SMs" % (props["name"].decode(), props["multiProcessorCount"]), flush=True)

    sections = set(args.sections.split(","))
    bench.floor()
    if "matmul" in sections:
        base = bench.matmuls(args.baseline, "baseline", 2, 4) if args.baseline else None
        settings = [(c, u) for c in (1, 2) for u in (4, 8)] if args.sweep else [(1, 4), (2, 4)]
        for cols, unroll in settings:
            bench.matmuls(args.kernels, "current", cols, unroll, base)

    if "norm" in sections:
        base_norm = bench.norms(args.baseline, "baseline") if args.baseline else None
        bench.norms(args.kernels, "current", base_norm)

    if "router" in sections:
        base_router = bench.router(args.baseline, "baseline", True) if args.baseline else None
        bench.router(args.kernels, "current", True, base_router)
        bench.router_fused(args.kernels)
        bench.router_add_norm_fused(args.kernels)

    if "experts" in sections:
        base_experts = bench.experts(args.baseline, "baseline", 4) if args.baseline else None
        settings = ((1, 0, 0), (1, 0, 4), (1, 0, 16), (1, 6, 0), (2, 0, 0), (4, 0, 0)) if args.sweep else ((1, 0, 0),)
        for columns, min_blocks, down_sum_loads in settings:
            bench.experts(args.kernels, "current", 4, base_experts, columns, min_blocks, down_sum_loads)

    if "norm" in sections:  # after the sections above: a new kernel's fault ends the run
        bench.add_norm_matmul3_fused(args.kernels)

    # Last: a fault here takes the context (and every later section) down with it.
    if "attention" in sections:
        base_attention = bench.attention(args.baseline, "baseline", True) if args.baseline else None
        for max_chunks in (128, 64, 32) if args.sweep else (128,):
            bench.attention(args.kernels, "current", True, base_attention, max_chunks)

    if "decode_attention" in sections:
        for context in [int(c) for c in args.decode_contexts.split(",")]:
            for heads, kv_heads, hd in ((32, 4, 128), (16, 4, 256), (16, 2, 256)):
                bench.decode_attention(args.kernels, heads, kv_heads, hd, context)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": bench.results, "failures": bench.failures}, f, indent=1)
    if bench.failures:
        print("FAILURES:\n  " + "\n  ".join(bench.failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
