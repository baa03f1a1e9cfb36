"""The `attention` section: the split decode attention (`attention_split_bf16`) and its combine
at `--context`, the output held to a baseline's within f32 rounding."""

import numpy as np
import cupy as cp

from .common import HEAD_DIM, HEADS, KV_HEADS, BenchCore, bf16, copies_for, module, timed


class AttentionSection(BenchCore):
    """The split attention's rows."""

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
