"""The `experts` section: the int8 expert kernels (gate/up, down, the pair sum and their fused
forms) at one token and at eight, bits held to a baseline's, with the alternative kernels
(`expert_gate_up_tasks`, `expert_decode_fused`) timed beside the ones they replace."""

import os

import numpy as np
import cupy as cp

from .common import EXPERTS, HIDDEN, MOE_INTERMEDIATE, TOP_K, BenchCore, module, timed


class ExpertsSection(BenchCore):
    """The experts' rows."""

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
