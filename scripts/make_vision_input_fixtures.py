#!/usr/bin/env python3
"""Build tests/fixtures/vision_input/: small images and the Qwen image processor's outputs for them.

The Rust image pre-processing (`ninfer-vision-input`) is held to these files. Each case is one encoded
image (PNG, JPEG, WebP, GIF; a few KB each), the processor settings it runs with, and what
transformers' `Qwen2VLImageProcessorPil` makes of it after `transformers.image_utils.load_image`
(EXIF transpose, RGB conversion): `image_grid_thw`, and `pixel_values` as little-endian float32 in
`<case>.pixel_values.f32`. The processor settings are small (patch 4, merge 2) so that the outputs stay
small; the resampling, rounding and layout are the same code as with the released settings.
`smart_resize.json` holds the target sizes of many (height, width) pairs under the released Qwen3.5
settings and under the small ones, including the aspect-ratio refusals.

Needs transformers 5.17, torch, Pillow, numpy. Deterministic (fixed seeds).

Usage (repo root):
    python3 scripts/make_vision_input_fixtures.py --out tests/fixtures/vision_input
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import numpy as np
import PIL
from PIL import Image

import transformers
from transformers.image_utils import load_image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

# The settings of the cases: Qwen3.5's mean/std, a small patch so the references stay small.
SMALL_SETTINGS = {
    "min_pixels": 256,
    "max_pixels": 1024,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
# The released Qwen3.5 / Qwen3.6 preprocessor_config.json values.
RELEASED_SETTINGS = {
    "min_pixels": 65536,
    "max_pixels": 16777216,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def smooth_rgb(height: int, width: int, seed: int, channels: int = 3) -> np.ndarray:
    """A gradient with edges and a little noise: realistic enough, and it compresses."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    planes = []
    for c in range(channels):
        phase = rng.uniform(0, 6.28)
        plane = 127 + 100 * np.sin(x / (3 + 2 * c) + phase) * np.cos(y / (4 + c))
        plane += np.where((x // 7 + y // 5) % 2 == 0, 25, -25)
        plane += rng.normal(0, 6, size=(height, width))
        planes.append(plane)
    return np.clip(np.stack(planes, axis=-1), 0, 255).astype(np.uint8)


def encode(image: Image.Image, format_name: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format_name, **options)
    return buffer.getvalue()


def cases() -> list[dict]:
    """(name, file name, encoded bytes, media type, exact?) for every case."""
    out = []
    # Both axes shrink (scale ≈ 1.4), plain RGB PNG.
    out.append(("png_rgb_downscale", "png", encode(Image.fromarray(smooth_rgb(37, 53, 1)), "PNG"), "image/png"))
    # Height 20 → 16 shrinks while width 12 → 16 grows; 20/8 = 2.5 rounds to 2 (half to even);
    # RGBA: the alpha channel is dropped, not composited.
    rgba = smooth_rgb(20, 12, 2, channels=4)
    rgba[..., 3] = np.linspace(0, 255, 12, dtype=np.uint8)[None, :]
    out.append(("png_rgba_mixed_axes", "png", encode(Image.fromarray(rgba, "RGBA"), "PNG"), "image/png"))
    # Grey, tall and thin: upscaled to min_pixels (ceil branch).
    grey = smooth_rgb(50, 9, 3)[..., 0]
    out.append(("png_grey_upscale", "png", encode(Image.fromarray(grey, "L"), "PNG"), "image/png"))
    # A large reduction (scale ≈ 4): wide filter support.
    out.append(("png_rgb_wide_support", "png", encode(Image.fromarray(smooth_rgb(120, 90, 4)), "PNG"), "image/png"))
    # Palette PNG with a transparency entry.
    palette = Image.fromarray(smooth_rgb(30, 26, 5)).quantize(colors=32, method=Image.Quantize.MEDIANCUT)
    palette.info["transparency"] = 3
    out.append(("png_palette", "png", encode(palette, "PNG", transparency=3), "image/png"))
    # Lossless WebP.
    out.append(("webp_lossless", "webp", encode(Image.fromarray(smooth_rgb(21, 33, 6)), "WEBP", lossless=True), "image/webp"))
    # GIF, two frames: the first one counts.
    frames = [Image.fromarray(smooth_rgb(18, 24, seed)).quantize(colors=64) for seed in (7, 8)]
    gif = io.BytesIO()
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    out.append(("gif_first_frame", "gif", gif.getvalue(), "image/gif"))
    # Baseline JPEG with 4:2:0 chroma: decoders may differ by a level (IDCT, chroma upsampling).
    out.append(("jpeg_420", "jpg", encode(Image.fromarray(smooth_rgb(40, 30, 9)), "JPEG", quality=90), "image/jpeg"))
    # JPEG without chroma subsampling: only the IDCT and colour conversion can differ.
    out.append(("jpeg_444", "jpg", encode(Image.fromarray(smooth_rgb(40, 30, 12)), "JPEG", quality=90, subsampling=0), "image/jpeg"))
    # Lossy WebP: decoders may differ (YUV conversion).
    out.append(("webp_lossy", "webp", encode(Image.fromarray(smooth_rgb(28, 36, 10)), "WEBP", quality=80), "image/webp"))
    # JPEG with EXIF orientation 6 (rotate 90° clockwise to view): load_image transposes it.
    exif = Image.Exif()
    exif[0x0112] = 6
    out.append(("jpeg_exif_rotated", "jpg", encode(Image.fromarray(smooth_rgb(24, 40, 11)), "JPEG", quality=95, exif=exif), "image/jpeg"))
    return out


def smart_resize_table() -> list[dict]:
    rng = np.random.default_rng(12)
    sizes = [(1, 1), (32, 32), (48, 80), (80, 48), (16, 16), (256, 256), (255, 257), (4096, 4096),
             (4097, 4095), (10000, 10000), (1, 200), (1, 201), (3000, 15), (768, 1366), (1080, 1920),
             (112, 112), (240, 400), (1, 4), (7, 1300), (8192, 6144)]
    sizes += [(int(h), int(w)) for h, w in rng.integers(1, 5000, size=(40, 2))]
    table = []
    for label, settings in (("released", RELEASED_SETTINGS), ("small", SMALL_SETTINGS)):
        factor = settings["patch_size"] * settings["merge_size"]
        for height, width in sizes:
            row = {"settings": label, "height": height, "width": width}
            try:
                row["resized"] = list(smart_resize(height, width, factor, settings["min_pixels"], settings["max_pixels"]))
            except ValueError:
                row["resized"] = None
            table.append(row)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/vision_input"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    processor = Qwen2VLImageProcessorPil(
        min_pixels=SMALL_SETTINGS["min_pixels"],
        max_pixels=SMALL_SETTINGS["max_pixels"],
        patch_size=SMALL_SETTINGS["patch_size"],
        temporal_patch_size=SMALL_SETTINGS["temporal_patch_size"],
        merge_size=SMALL_SETTINGS["merge_size"],
        image_mean=SMALL_SETTINGS["image_mean"],
        image_std=SMALL_SETTINGS["image_std"],
    )
    reference = {
        "generator": "scripts/make_vision_input_fixtures.py",
        "versions": {"transformers": transformers.__version__, "pillow": PIL.__version__, "numpy": np.__version__},
        "processor": "Qwen2VLImageProcessorPil after transformers.image_utils.load_image",
        "settings": SMALL_SETTINGS,
        "cases": [],
    }
    for name, extension, data, media_type in cases():
        file_name = f"{name}.{extension}"
        (args.out / file_name).write_bytes(data)
        image = load_image(Image.open(io.BytesIO(data)))
        output = processor(images=[image], return_tensors="np")
        pixel_values = np.asarray(output["pixel_values"], dtype="<f4")
        (args.out / f"{name}.pixel_values.f32").write_bytes(pixel_values.tobytes())
        reference["cases"].append({
            "name": name,
            "file": file_name,
            "media_type": media_type,
            "decoded_size": [image.height, image.width],
            "grid_thw": [int(v) for v in output["image_grid_thw"][0]],
            "pixel_values_shape": list(pixel_values.shape),
            "pixel_values_file": f"{name}.pixel_values.f32",
        })
    (args.out / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
    (args.out / "smart_resize.json").write_text(json.dumps(
        {"settings": {"released": RELEASED_SETTINGS, "small": SMALL_SETTINGS}, "rows": smart_resize_table()}) + "\n")


if __name__ == "__main__":
    main()
