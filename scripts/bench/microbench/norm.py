"""The `norm` section: `add_rms_norm` at one and four rows (bits held to a baseline's), and the
one-launch `add_norm_matmul3_bf16` against `add_rms_norm` then `matmul3_bf16`."""

import numpy as np
import cupy as cp

from .common import (HEAD_DIM, HEADS, HIDDEN, KV_HEADS, BenchCore, bf16, copies_for, kernel_define, module,
                     residual_add_trials, timed)


class NormSection(BenchCore):
    """The norms' rows, and the norm folded into the next layer's q/k/v."""

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
