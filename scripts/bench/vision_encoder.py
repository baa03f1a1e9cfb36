#!/usr/bin/env python3
"""The Qwen3.5/3.6 vision tower on one square image: `transformers` against `ninfer bench vision`.

Both run a tower of the released Qwen3.6-35B-A3B vision widths (depth 27, width 1152, 16 heads,
MLP 4304, patch 16, merge 2, merged tokens of width 2048) with random weights on the same
image size (1024×1024 by default: 4,096 patches, 1,024 image tokens). transformers runs
`Qwen3_5MoeVisionModel` on the GPU (bf16 and f32, sdpa attention, timed with CUDA events after a
warm-up); ours is `ninfer bench vision --device cuda` (the engine's GPU tower, timed inside the
process after a warm-up from patch rows on the GPU to outputs on the GPU, as transformers is;
its time with the host copies is printed beside it), or `--ours-device cpu` for the host
forward. Prints one table and, with --json, one JSON object with every figure.

Needs Python with torch and transformers 5.17 (no network: the tower is built from its config)
and our `ninfer` binary. On the GPU machine, from the repository root:

    python3 scripts/bench/vision_encoder.py --ninfer target/release/ninfer [--image-size 1024]
        [--repeat 5] [--ours-device cuda|cpu] [--json]

`--ours-depth N` runs ours with N blocks and scales its time to the full depth (every block
costs the same at a fixed image size), for a forward too slow to run whole.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

WIDTHS = {"depth": 27, "hidden_size": 1152, "num_heads": 16, "intermediate_size": 4304,
          "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
          "out_hidden_size": 2048, "num_position_embeddings": 2304, "in_channels": 3}


def transformers_ms(image_size: int, repeat: int, dtype_name: str) -> float:
    import torch
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[dtype_name]
    config = Qwen3_5MoeVisionConfig(**WIDTHS)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3_5MoeVisionModel._from_config(config, dtype=dtype).cuda().eval()
    side = image_size // WIDTHS["patch_size"]
    patch_len = WIDTHS["in_channels"] * WIDTHS["temporal_patch_size"] * WIDTHS["patch_size"] ** 2
    pixels = torch.randn(side * side, patch_len, device="cuda", dtype=dtype)
    grid = torch.tensor([[1, side, side]], device="cuda")
    times = []
    with torch.no_grad():
        model(pixels, grid_thw=grid)
        torch.cuda.synchronize()
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(pixels, grid_thw=grid)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return sorted(times)[0]


def ours(ninfer: str, image_size: int, repeat: int, depth: int, device: str) -> dict:
    command = [ninfer, "bench", "vision", "--device", device,
               "--image-size", str(image_size), "--repeat", str(repeat),
               "--depth", str(depth), "--hidden", str(WIDTHS["hidden_size"]),
               "--heads", str(WIDTHS["num_heads"]), "--intermediate", str(WIDTHS["intermediate_size"]),
               "--out-hidden", str(WIDTHS["out_hidden_size"]), "--json"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    figures["full_depth_best_ms"] = figures["best_ms"] * WIDTHS["depth"] / depth
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ninfer", required=True, help="our ninfer binary")
    parser.add_argument("--image-size", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--ours-depth", type=int, default=WIDTHS["depth"])
    parser.add_argument("--ours-device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures = {"image_size": args.image_size, "widths": WIDTHS}
    for dtype in ("bf16", "f32"):
        figures[f"transformers_{dtype}_ms"] = transformers_ms(args.image_size, args.repeat, dtype)
    figures["ours"] = ours(args.ninfer, args.image_size, args.repeat, args.ours_depth,
                           args.ours_device)
    if args.json:
        print(json.dumps(figures))
        return
    print(f"vision tower, {args.image_size}x{args.image_size} image, Qwen3.6-35B-A3B widths, best of {args.repeat}")
    print(f"  transformers bf16 (GPU, sdpa): {figures['transformers_bf16_ms']:9.1f} ms")
    print(f"  transformers f32  (GPU, sdpa): {figures['transformers_f32_ms']:9.1f} ms")
    depth_note = "" if args.ours_depth == WIDTHS["depth"] else f" (from {args.ours_depth} blocks)"
    print(f"  ours ({figures['ours']['device']}): {figures['ours']['full_depth_best_ms']:9.1f} ms{depth_note}")
    with_copies = figures["ours"].get("with_copies_best_ms")
    if with_copies is not None and args.ours_depth == WIDTHS["depth"]:
        print(f"  ours with the host copies: {with_copies:9.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
