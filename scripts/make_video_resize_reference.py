#!/usr/bin/env python3
"""Reference pre-processing of videos given as frames whose size the video processor changes, with video
processor settings of their own (as a checkpoint's video_preprocessor_config.json carries them).

`Qwen3VLVideoProcessor` resizes every frame with torchvision's anti-aliased bicubic on uint8 (PyTorch's
`_upsample_bicubic2d_aa` on the CPU) and normalises in torchvision's fused form; the image processor's PIL
form does neither. Four clips exercise it: frames cut from png_rgb_wide_support.png that shrink on both
axes, noise frames whose sides move in opposite directions (an odd count), noise frames with a side under
the grid unit (scaled up first), and a clip under `cap_pixels_per_frame`. Frame sizes and settings are
small (patch 4, merge 2) so the files stay small; the arithmetic is the released settings'.

Writes tests/fixtures/vision_input/video_resize_*.png (the frames), video_resize_reference.json (per clip:
the settings as a video_preprocessor_config.json, its frame files, `video_grid_thw`, where its values
start) and video_resize_reference.pixel_values.f32 (little-endian f32 `pixel_values_videos`, the clips one
after another).

Needs transformers 5.17, torch, torchvision, Pillow, numpy. Deterministic (fixed seed).
Usage (repo root):
    python3 scripts/make_video_resize_reference.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torchvision
import transformers
from PIL import Image
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

IMAGES = Path("tests/fixtures/vision_input")
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
SMALL = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2}
SETTINGS = {
    "own_bounds": {"size": {"shortest_edge": 512, "longest_edge": 8192}, **SMALL,
                   "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "fps": 3.0},
    "capped": {"size": {"shortest_edge": 256, "longest_edge": 65536}, **SMALL,
               "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
               "cap_pixels_per_frame": True, "max_video_tokens": 12},
}


def pan(count: int, width: int, height: int, dx: int, dy: int) -> list[np.ndarray]:
    image = np.asarray(Image.open(IMAGES / "png_rgb_wide_support.png").convert("RGB"))
    return [image[k * dy:k * dy + height, k * dx:k * dx + width] for k in range(count)]


def noise(rng: np.random.Generator, count: int, width: int, height: int) -> list[np.ndarray]:
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(count)]


def main() -> None:
    torch.set_num_threads(1)
    rng = np.random.default_rng(7)
    clips = [
        ("shrink", "own_bounds", pan(4, 70, 50, 5, 7)),
        ("mixed_axes", "own_bounds", noise(rng, 3, 13, 9)),
        ("short_side", "own_bounds", noise(rng, 5, 30, 5)),
        ("capped", "capped", pan(6, 64, 48, 4, 3)),
    ]
    cases = []
    values = []
    offset = 0
    for name, settings_name, frames in clips:
        settings = SETTINGS[settings_name]
        files = []
        for index, frame in enumerate(frames):
            file = f"video_resize_{name}_{index}.png"
            Image.fromarray(frame).save(IMAGES / file)
            files.append(file)
        processor = Qwen3VLVideoProcessor(**settings, do_sample_frames=False)
        # Read back from the files, as the test reads them.
        video = np.stack([np.asarray(Image.open(IMAGES / file).convert("RGB")) for file in files])
        out = processor(videos=[video], return_tensors="pt")
        pixels = out["pixel_values_videos"].to(torch.float32).numpy()
        cases.append({
            "name": name,
            "video_preprocessor_config": settings,
            "frame_files": files,
            "frame_size": [int(video.shape[2]), int(video.shape[1])],
            "video_grid_thw": out["video_grid_thw"][0].tolist(),
            "values_offset": offset,
            "values_count": int(pixels.size),
        })
        values.append(pixels.astype("<f4").ravel())
        offset += int(pixels.size)
    (IMAGES / "video_resize_reference.pixel_values.f32").write_bytes(np.concatenate(values).tobytes())
    reference = {
        "generator": "scripts/make_video_resize_reference.py",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "torchvision": torchvision.__version__},
        "cases": cases,
    }
    (IMAGES / "video_resize_reference.json").write_text(json.dumps(reference, indent=1) + "\n")


if __name__ == "__main__":
    main()
