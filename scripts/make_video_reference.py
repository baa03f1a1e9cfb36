#!/usr/bin/env python3
"""Reference pre-processing and logits of a chat prompt with two videos given as frames, through the
qwen3_5_moe golden fixture.

Two videos: four 32x32 frames cut from tests/fixtures/vision_input/png_rgb_wide_support.png at moving
offsets (a pan), and three 32x16 frames cut from png_rgb_downscale.png (an odd count: the processor
repeats the last frame). The frame sizes are multiples of the fixture's 16-pixel grid unit within the
pixel bounds, so the resize is the identity in every backend and the pixel values are exact (the video
processor resizes with torchvision, the image path with Pillow's bicubic: MODELS.md §10.7). The frames
are written to tests/fixtures/vision_input/video_*.png; `Qwen3VLProcessor` (the video processor with the
image processor's settings, fps 2) gives `pixel_values_videos`, `video_grid_thw` and the expanded prompt
(a `<t seconds>` stamp and a vision run per frame pair); the fixture's whole model in transformers,
float32, eager, CPU, gives the logits. Writes tests/fixtures/qwen3_5_moe/video_prompt_reference.json and
tests/fixtures/vision_input/video_reference.pixel_values.f32 (little-endian f32, the rows of both videos).

Needs transformers 5.17, torch, torchvision, Pillow. Usage (repo root):
    CUDA_VISIBLE_DEVICES= python3 scripts/make_video_reference.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

FIXTURE = Path("tests/fixtures/qwen3_5_moe")
IMAGES = Path("tests/fixtures/vision_input")
FPS = 2.0
# (source, frame width, frame height, frame count, horizontal step, vertical step)
VIDEOS = [
    ("png_rgb_wide_support.png", 32, 32, 4, 9, 7),
    ("png_rgb_downscale.png", 32, 16, 3, 7, 9),
]


def cut_frames() -> list[list[str]]:
    names = []
    for video, (source, width, height, count, dx, dy) in enumerate(VIDEOS):
        image = Image.open(IMAGES / source).convert("RGB")
        files = []
        for frame in range(count):
            left, top = frame * dx, frame * dy
            name = f"video_{video}_frame_{frame}.png"
            image.crop((left, top, left + width, top + height)).save(IMAGES / name)
            files.append(name)
        names.append(files)
    return names


def main() -> None:
    torch.set_num_threads(1)
    settings = json.loads((FIXTURE / "preprocessor_config.json").read_text())
    size = settings["size"]
    frame_files = cut_frames()
    model = AutoModelForImageTextToText.from_pretrained(FIXTURE, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE)
    common = dict(
        patch_size=settings["patch_size"],
        temporal_patch_size=settings["temporal_patch_size"],
        merge_size=settings["merge_size"],
        image_mean=settings["image_mean"],
        image_std=settings["image_std"],
    )
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"], **common),
        video_processor=Qwen3VLVideoProcessor(
            size={"shortest_edge": size["shortest_edge"], "longest_edge": size["longest_edge"]},
            do_sample_frames=False,
            cap_pixels_per_frame=False,
            **common,
        ),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
    videos = [np.stack([np.asarray(Image.open(IMAGES / name).convert("RGB")) for name in files]) for files in frame_files]
    metadata = [
        VideoMetadata(total_num_frames=len(files), fps=FPS, frames_indices=list(range(len(files))))
        for files in frame_files
    ]
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": "Watch this."},
            {"type": "video"},
            {"type": "text", "text": "and then"},
            {"type": "video"},
            {"type": "text", "text": "What happens?"},
        ]},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], videos=videos, video_metadata=metadata, return_tensors="pt")
    input_ids = inputs["input_ids"]
    with torch.no_grad():
        logits = model(
            input_ids=input_ids,
            pixel_values_videos=inputs["pixel_values_videos"],
            video_grid_thw=inputs["video_grid_thw"],
            mm_token_type_ids=inputs["mm_token_type_ids"],
        ).logits[0].double()
    log_probabilities = torch.log_softmax(logits, dim=-1)
    targets = input_ids[0, 1:]
    token_nll = -log_probabilities[:-1].gather(1, targets[:, None])[:, 0]
    pixels = inputs["pixel_values_videos"].to(torch.float32).numpy()
    (IMAGES / "video_reference.pixel_values.f32").write_bytes(pixels.astype("<f4").tobytes())
    reference = {
        "generator": "scripts/make_video_reference.py",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "fps": FPS,
        "frame_files": frame_files,
        "rendered_template": text,
        "video_grid_thw": inputs["video_grid_thw"].tolist(),
        "pixel_values_shape": list(pixels.shape),
        "prompt_text": tokenizer.decode(input_ids[0]),
        "token_ids": input_ids[0].tolist(),
        "token_nll": [float(f"{v:.9g}") for v in token_nll.tolist()],
        "mean_nll": float(token_nll.mean()),
        "last_logits": [float(f"{v:.9g}") for v in logits[-1].tolist()],
    }
    (FIXTURE / "video_prompt_reference.json").write_text(json.dumps(reference) + "\n")


if __name__ == "__main__":
    main()
