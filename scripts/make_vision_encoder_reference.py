#!/usr/bin/env python3
"""Reference outputs of the Qwen3.5 vision tower of a golden fixture, for the engine's vision encoder.

Loads the fixture's checkpoint (default tests/fixtures/qwen3_5_moe: depth 1, width 32, 2 heads, patch 8,
a 4x4 learned position grid, merge 2, output width 64) with transformers in float32 (eager attention, CPU)
and runs its vision model on three images at once whose grids differ in size and aspect ratio, so the
position-embedding interpolation, the 2-D rotary positions, the per-image attention and the merger are all
exercised. The pixel values are a formula the Rust test repeats in f32:
    value(i) = f32((i · 37) mod 101) / 50 − 1     (i = the flat index over all patch rows)
Writes <fixture>/vision_reference.json: the grids, `last_hidden_state` (before the merger) and `merged`
(the merger's output, the image tokens' embeddings), floats with 9 significant digits.

Needs transformers 5.17, torch, safetensors. Usage (repo root):
    CUDA_VISIBLE_DEVICES= python3 scripts/make_vision_encoder_reference.py [--fixture tests/fixtures/qwen3_5_moe]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModel

GRIDS = [[1, 4, 4], [1, 6, 8], [1, 8, 2]]


def pixel_values(rows: int, row_len: int) -> np.ndarray:
    index = np.arange(rows * row_len, dtype=np.int64)
    values = ((index * 37) % 101).astype(np.float32) / np.float32(50.0) - np.float32(1.0)
    return values.reshape(rows, row_len)


def rounded(array: torch.Tensor) -> list[float]:
    return [float(f"{v:.9g}") for v in array.detach().double().flatten().tolist()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixture", type=Path, default=Path("tests/fixtures/qwen3_5_moe"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    config = AutoConfig.from_pretrained(args.fixture)
    vision_config = config.vision_config
    model = AutoModel.from_config(vision_config, attn_implementation="eager").float().eval()
    # The fixture's `model.visual.*` weights, as the engine reads them from the artifact.
    from safetensors.torch import load_file

    state = {}
    for path in sorted(args.fixture.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            if name.startswith("model.visual."):
                state[name[len("model.visual."):]] = tensor.float()
    model.load_state_dict(state, strict=True)

    row_len = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2
    rows = sum(t * h * w for t, h, w in GRIDS)
    pixels = torch.from_numpy(pixel_values(rows, row_len))
    grid = torch.tensor(GRIDS, dtype=torch.long)
    with torch.no_grad():
        output = model(pixels, grid_thw=grid, return_dict=True)
    reference = {
        "generator": "scripts/make_vision_encoder_reference.py",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "pixel_formula": "f32((i * 37) mod 101) / 50 - 1 over the flat index of all patch rows",
        "grids": GRIDS,
        "patch_row_len": row_len,
        "last_hidden_state_shape": list(output.last_hidden_state.shape),
        "last_hidden_state": rounded(output.last_hidden_state),
        "merged_shape": list(output.pooler_output.shape),
        "merged": rounded(output.pooler_output),
    }
    (args.fixture / "vision_reference.json").write_text(json.dumps(reference) + "\n")


if __name__ == "__main__":
    main()
