#!/usr/bin/env python3
"""Reference multimodal positions and rotary tables of the qwen3_5_moe golden fixture, for the engine.

For a few prompts of text and image placeholders (the fixture's token ids: `<|vision_start|>`,
`<|image_pad|>` repeated t·h·w/merge² times, `<|vision_end|>`), writes what transformers computes:
`Qwen3_5MoeModel.get_rope_index` (the three position rows and the delta later tokens add) and the text
rotary embedding's cos / sin tables (float32, before the model-dtype cast) at those positions. Output:
tests/fixtures/qwen3_5_moe/multimodal_positions_reference.json.

Needs transformers 5.17, torch. Usage (repo root):
    CUDA_VISIBLE_DEVICES= python3 scripts/make_multimodal_position_reference.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeModel,
    Qwen3_5MoeTextRotaryEmbedding,
)

FIXTURE = Path("tests/fixtures/qwen3_5_moe")


def prompt(parts: list, config) -> tuple[list[int], list[list[int]]]:
    """Token ids and image grids of a prompt given as text lengths and (t, h, w) image grids."""
    merge = config.vision_config.spatial_merge_size
    ids, grids, next_text = [], [], 10
    for part in parts:
        if isinstance(part, int):
            ids.extend(range(next_text, next_text + part))
            next_text += part
        else:
            t, h, w = part
            grids.append([t, h, w])
            ids.append(config.vision_start_token_id)
            ids.extend([config.image_token_id] * (t * h * w // merge**2))
            ids.append(config.vision_end_token_id)
    return ids, grids


def main() -> None:
    torch.set_num_threads(1)
    config = AutoConfig.from_pretrained(FIXTURE)
    model = Qwen3_5MoeModel(config).eval()
    rotary = Qwen3_5MoeTextRotaryEmbedding(config.text_config)
    cases = {
        "text_only": [7],
        "one_image_between_text": [3, (1, 4, 6), 4],
        "two_images_tall_and_tiny": [(1, 8, 4), 2, (1, 2, 2), 3],
        "wide_image_first": [(1, 2, 12), 5],
    }
    out = {
        "generator": "scripts/make_multimodal_position_reference.py",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "image_token_id": config.image_token_id,
        "spatial_merge_size": config.vision_config.spatial_merge_size,
        "mrope_section": config.text_config.rope_parameters["mrope_section"],
        "rope_theta": config.text_config.rope_parameters["rope_theta"],
        "rotary_dim": int(config.text_config.head_dim * config.text_config.rope_parameters["partial_rotary_factor"]),
        "cases": [],
    }
    for name, parts in cases.items():
        ids, grids = prompt(parts, config)
        input_ids = torch.tensor([ids])
        mm_types = (input_ids == config.image_token_id).int()
        image_grid = torch.tensor(grids) if grids else None
        if grids:
            positions, delta = model.get_rope_index(input_ids, mm_types, image_grid_thw=image_grid)
            delta = int(delta.item())
        else:
            positions = torch.arange(len(ids)).view(1, 1, -1).expand(3, 1, -1)
            delta = 0
        x = torch.zeros(1, len(ids), 4)
        cos, sin = rotary(x, positions)
        out["cases"].append({
            "name": name,
            "token_ids": ids,
            "grids": grids,
            "positions": positions[:, 0, :].tolist(),
            "delta": delta,
            "cos": [float(f"{v:.9g}") for v in cos[0].flatten().tolist()],
            "sin": [float(f"{v:.9g}") for v in sin[0].flatten().tolist()],
        })
    (FIXTURE / "multimodal_positions_reference.json").write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
