"""The `decode_attention` section: the kernels of attention_decode.cu (the group's q heads across
the lanes, and on tensor cores) against the split kernel at its own chunking, each with the
combine, per shape and context."""

import numpy as np
import cupy as cp

from .common import BenchCore, bf16, copies_for, kernel_define, module, raw_kernel, timed


class DecodeAttentionSection(BenchCore):
    """The decode attention kernels' rows."""

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
