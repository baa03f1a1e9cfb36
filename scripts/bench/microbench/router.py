"""The `router` section: `route_top_k` (bits held to a baseline's), and the one-launch routers
(`route_decode_fused`, `route_decode_add_norm_fused`) against the launches they replace."""

import numpy as np
import cupy as cp

from .common import (EXPERTS, HIDDEN, TOP_K, BenchCore, copies_for, kernel_define, module,
                     residual_add_trials, timed)


def router_weight_copies(rng):
    """f32 router weights ([EXPERTS, HIDDEN]) and enough copies of them to rotate past L2."""
    host_w = rng.standard_normal((EXPERTS, HIDDEN), dtype=np.float32) * 0.02
    return host_w, [cp.asarray(host_w) for _ in range(copies_for(host_w.nbytes))]


class RouterSection(BenchCore):
    """The router's rows."""

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
