"""The `matmul` section: the dense projections of a decode layer (`matmul3_bf16` for q/k/v,
`matmul_bf16` for the output projection, the f32 router `matmul`) at 1 to 8 rows, at each
features-per-warp and UNROLL setting, bits held to a baseline's."""

import os

import numpy as np
import cupy as cp

from .common import EXPERTS, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, BenchCore, bf16, copies_for, module, timed


class MatmulSection(BenchCore):
    """The dense projections' rows."""

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
