#!/usr/bin/env python3
"""Reference logits of a chat prompt with three images through the qwen3_5_moe golden fixture.

The fixture's whole multimodal model (its random vision tower and decoder) in transformers, float32, eager,
CPU. The images are three PNGs of tests/fixtures/vision_input (37x53 RGB, 120x90 RGB, 50x9 grey: three grid
sizes and aspect ratios), pre-processed by `Qwen2VLImageProcessorPil` with the fixture's patch and merge sizes
and the settings below; the chat template renders one `<|vision_start|><|image_pad|><|vision_end|>` per image
and the `<|image_pad|>` is repeated per image token, as `Qwen3VLProcessor` does. Writes
tests/fixtures/qwen3_5_moe/image_prompt_reference.json: the processor settings, the image files, grids, the
prompt's token ids, teacher-forced `token_nll` (position i predicts token i+1), the last position's logits
and the vision tower's output for the three images (`image_features`: the merger's rows, the image tokens'
embeddings, in prompt order); tests/fixtures/qwen3_5_moe/image_prompt_pixel_values.f32 with the processor's
`pixel_values` of the three images (little-endian f32, the patch rows of each image in turn); and
tests/fixtures/qwen3_5_moe/preprocessor_config.json with the same processor settings.

Needs transformers 5.17, torch, Pillow. Usage (repo root):
    CUDA_VISIBLE_DEVICES= python3 scripts/make_image_prompt_reference.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer
from transformers.image_utils import load_image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

FIXTURE = Path("tests/fixtures/qwen3_5_moe")
IMAGES = Path("tests/fixtures/vision_input")
FILES = ["png_rgb_downscale.png", "png_rgb_wide_support.png", "png_grey_upscale.png"]
PIXEL_VALUES = "image_prompt_pixel_values.f32"
SETTINGS = {"min_pixels": 1024, "max_pixels": 4096, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def main() -> None:
    torch.set_num_threads(1)
    model = AutoModelForImageTextToText.from_pretrained(FIXTURE, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE)
    vision = model.config.vision_config
    processor = Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size,
        **SETTINGS,
    )
    images = [load_image(Image.open(IMAGES / name)) for name in FILES]
    processed = processor(images=images, return_tensors="pt")
    grids = processed["image_grid_thw"]
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": "Look at these."},
            {"type": "image"},
            {"type": "text", "text": "The second one"},
            {"type": "image"},
            {"type": "image"},
            {"type": "text", "text": "What do they show?"},
        ]},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    merge = vision.spatial_merge_size
    pieces = text.split("<|image_pad|>")
    assert len(pieces) == len(FILES) + 1
    expanded = pieces[0]
    for grid, piece in zip(grids, pieces[1:]):
        expanded += "<|image_pad|>" * int(grid.prod() // merge**2) + piece
    input_ids = tokenizer(expanded, return_tensors="pt", add_special_tokens=False)["input_ids"]
    mm_token_type_ids = (input_ids == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(
            input_ids=input_ids,
            pixel_values=processed["pixel_values"],
            image_grid_thw=grids,
            mm_token_type_ids=mm_token_type_ids,
        ).logits[0].double()
        features = model.model.visual(processed["pixel_values"], grid_thw=grids, return_dict=True).pooler_output
    log_probabilities = torch.log_softmax(logits, dim=-1)
    targets = input_ids[0, 1:]
    token_nll = -log_probabilities[:-1].gather(1, targets[:, None])[:, 0]
    reference = {
        "generator": "scripts/make_image_prompt_reference.py",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "processor_settings": {
            **SETTINGS,
            "patch_size": vision.patch_size,
            "temporal_patch_size": vision.temporal_patch_size,
            "merge_size": merge,
        },
        "image_files": FILES,
        "grids": grids.tolist(),
        "prompt_text": expanded,
        "token_ids": input_ids[0].tolist(),
        "token_nll": [float(f"{v:.9g}") for v in token_nll.tolist()],
        "mean_nll": float(token_nll.mean()),
        "last_logits": [float(f"{v:.9g}") for v in logits[-1].tolist()],
        "pixel_values_file": PIXEL_VALUES,
        "pixel_values_shape": list(processed["pixel_values"].shape),
        "image_features_shape": list(features.shape),
        "image_features": [float(f"{v:.9g}") for v in features.double().flatten().tolist()],
    }
    processed["pixel_values"].to(torch.float32).contiguous().numpy().astype("<f4").tofile(FIXTURE / PIXEL_VALUES)
    (FIXTURE / "image_prompt_reference.json").write_text(json.dumps(reference) + "\n")
    # The same settings as the fixture's own preprocessor_config.json, which the converter embeds and
    # the engine and gateway read.
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "size": {"shortest_edge": SETTINGS["min_pixels"], "longest_edge": SETTINGS["max_pixels"]},
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": merge,
        "image_mean": SETTINGS["image_mean"],
        "image_std": SETTINGS["image_std"],
    }
    (FIXTURE / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")


if __name__ == "__main__":
    main()
