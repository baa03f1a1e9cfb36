#!/usr/bin/env python3
"""Write a synthetic GGUF (version 3) of Qwen3-30B-A3B's shapes for llama.cpp's `llama-bench`.

The file has llama.cpp's `qwen3moe` architecture: its metadata keys, tensor names, shapes and
tensor types, so that llama.cpp runs the same model as a `ninfer convert --synthetic qwen3-30b-a3b`
artifact and reads the same bytes per parameter:

  * routed experts (`blk.N.ffn_{gate,up,down}_exps`, stacked 3-D) in Q8_0: groups of 32 values,
    one f16 scale and 32 int8 each, 34 bytes per 32 parameters, the bytes of the artifact's
    `--experts-dtype int8` (int8 values plus an f16 scale per group of 32); Q4_0 (18 bytes per 32)
    matches `--experts-dtype int4`;
  * embeddings, attention projections, the router (`ffn_gate_inp`) and the output head in bf16, the
    artifact's default dense dtype (`--dense-dtype f16` writes f16 instead);
  * norms in f32, as in the artifact.

Values are deterministic pseudo-random and cheap: a pool of valid blocks is drawn once from a seeded
generator and every tensor is written as windows of that pool starting at a tensor-dependent block,
so writing is bound by the disk, not by the generator. Only speed is measured with such a model: the
weights are small (|w| about 0.01), norms are 1, so activations stay finite; the text it produces
is meaningless. The tokenizer is llama.cpp's `none` model with `qwen3moe.vocab_size` dummy tokens
(enough for `llama-bench`, which feeds random token ids; not for tools that tokenize text).

Usage:

  write_gguf.py OUT.gguf [--layers N] [--experts E] [--experts-used K]
                [--experts-dtype q8_0|q4_0] [--dense-dtype bf16|f16]
                [--vocab V] [--context-length C] [--seed S] [--verify]
  write_gguf.py --read-only FILE.gguf

Options:

  --layers N          decoder layers (default 48, the real model; the benchmark suite uses the
                      `--layers` of its ninfer artifact)
  --experts E         routed experts per layer (default 128)
  --experts-used K    experts per token (default 8)
  --experts-dtype     q8_0 (default, = ninfer int8) or q4_0 (= ninfer int4)
  --dense-dtype       bf16 (default, = ninfer's default) or f16
  --vocab V           vocabulary size (default 151936)
  --context-length C  `qwen3moe.context_length` (default 40960)
  --seed S            pseudo-random seed (default 0)
  --verify            read the written file back: header, metadata, tensor table, offsets, sizes,
                      block scales finite; cross-checked with the `gguf` Python package when that
                      package happens to be installed (this script never needs it)
  --read-only         only verify FILE.gguf (no writing)

Only numpy is needed. Sizes: 0.68 GB per layer (0.64 GB of Q8_0 experts) plus 1.24 GB of embeddings
and head: 12.1 GB at 16 layers, 33.9 GB at 48.
"""

import argparse
import os
import re
import struct
import sys
import time

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32
ARCH = "qwen3moe"

# GGUF metadata value types.
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY = range(10)
T_UINT64, T_INT64, T_FLOAT64 = 10, 11, 12
SCALAR_FORMATS = {
    T_UINT8: "<B",
    T_INT8: "<b",
    T_UINT16: "<H",
    T_INT16: "<h",
    T_UINT32: "<I",
    T_INT32: "<i",
    T_FLOAT32: "<f",
    T_BOOL: "<?",
    T_UINT64: "<Q",
    T_INT64: "<q",
    T_FLOAT64: "<d",
}

# ggml tensor types: (id, values per block, bytes per block).
GGML_TYPES = {
    "f32": (0, 1, 4),
    "f16": (1, 1, 2),
    "q4_0": (2, 32, 18),
    "q8_0": (8, 32, 34),
    "bf16": (30, 1, 2),
}
GGML_TYPE_NAMES = {type_id: name for name, (type_id, _, _) in GGML_TYPES.items()}
# llama_ftype of a file whose matrices are mostly of this type.
FILE_TYPES = {"q8_0": 7, "q4_0": 2}

POOL_UNITS = 1 << 20  # blocks (or elements) in the pool of pseudo-random data
POOL_STRIDE = 7919  # blocks the pool window moves by between chunks and tensors


def tensor_bytes(dtype, shape):
    """Bytes of a tensor of ggml shape `shape` (ne0 first, the contiguous dimension)."""
    _, block_values, block_bytes = GGML_TYPES[dtype]
    if shape[0] % block_values:
        raise ValueError(f"{dtype} rows of {shape[0]} values are not whole blocks of {block_values}")
    count = 1
    for dim in shape:
        count *= dim
    return count // block_values * block_bytes


def model_tensors(args):
    """(name, dtype, ggml shape) in file order; shapes as llama.cpp's qwen3moe loader creates them."""
    hidden, heads, kv_heads, head_dim = 2048, 32, 4, 128
    expert_width, dense, experts = 768, args.dense_dtype, args.experts_dtype
    tensors = [("token_embd.weight", dense, (hidden, args.vocab))]
    for layer in range(args.layers):
        block = f"blk.{layer}."
        tensors += [
            (block + "attn_norm.weight", "f32", (hidden,)),
            (block + "attn_q.weight", dense, (hidden, heads * head_dim)),
            (block + "attn_k.weight", dense, (hidden, kv_heads * head_dim)),
            (block + "attn_v.weight", dense, (hidden, kv_heads * head_dim)),
            (block + "attn_output.weight", dense, (heads * head_dim, hidden)),
            (block + "attn_q_norm.weight", "f32", (head_dim,)),
            (block + "attn_k_norm.weight", "f32", (head_dim,)),
            (block + "ffn_norm.weight", "f32", (hidden,)),
            (block + "ffn_gate_inp.weight", dense, (hidden, args.experts)),
            (block + "ffn_gate_exps.weight", experts, (hidden, expert_width, args.experts)),
            (block + "ffn_down_exps.weight", experts, (expert_width, hidden, args.experts)),
            (block + "ffn_up_exps.weight", experts, (hidden, expert_width, args.experts)),
        ]
    tensors += [
        ("output_norm.weight", "f32", (hidden,)),
        ("output.weight", dense, (hidden, args.vocab)),
    ]
    return tensors


def model_metadata(args):
    """(key, type, value) of the qwen3moe hyper-parameters and a tokenizer-free vocabulary."""
    return [
        ("general.architecture", T_STRING, ARCH),
        ("general.name", T_STRING, f"synthetic qwen3-30b-a3b {args.layers} layers"),
        ("general.file_type", T_UINT32, FILE_TYPES[args.experts_dtype]),
        ("general.quantization_version", T_UINT32, 2),
        ("general.alignment", T_UINT32, ALIGNMENT),
        (f"{ARCH}.block_count", T_UINT32, args.layers),
        (f"{ARCH}.context_length", T_UINT32, args.context_length),
        (f"{ARCH}.embedding_length", T_UINT32, 2048),
        (f"{ARCH}.feed_forward_length", T_UINT32, 6144),
        (f"{ARCH}.attention.head_count", T_UINT32, 32),
        (f"{ARCH}.attention.head_count_kv", T_UINT32, 4),
        (f"{ARCH}.attention.key_length", T_UINT32, 128),
        (f"{ARCH}.attention.value_length", T_UINT32, 128),
        (f"{ARCH}.rope.dimension_count", T_UINT32, 128),
        (f"{ARCH}.rope.freq_base", T_FLOAT32, 1e6),
        (f"{ARCH}.attention.layer_norm_rms_epsilon", T_FLOAT32, 1e-6),
        (f"{ARCH}.expert_count", T_UINT32, args.experts),
        (f"{ARCH}.expert_used_count", T_UINT32, args.experts_used),
        (f"{ARCH}.expert_feed_forward_length", T_UINT32, 768),
        (f"{ARCH}.vocab_size", T_UINT32, args.vocab),
        ("tokenizer.ggml.model", T_STRING, "none"),
    ]


def pack_string(text):
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def pack_value(value_type, value):
    if value_type == T_STRING:
        return pack_string(value)
    return struct.pack(SCALAR_FORMATS[value_type], value)


def align(offset):
    return (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def header_bytes(metadata, tensors):
    """Header, metadata and tensor table, padded to the alignment; tensor data offsets."""
    parts = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(metadata))]
    for key, value_type, value in metadata:
        parts += [pack_string(key), struct.pack("<I", value_type), pack_value(value_type, value)]
    offsets, offset = [], 0
    for name, dtype, shape in tensors:
        offsets.append(offset)
        parts += [pack_string(name), struct.pack("<I", len(shape))]
        parts += [struct.pack("<Q", dim) for dim in shape]
        parts.append(struct.pack("<IQ", GGML_TYPES[dtype][0], offset))
        offset = align(offset + tensor_bytes(dtype, shape))
    header = b"".join(parts)
    return header + b"\0" * (align(len(header)) - len(header)), offsets, offset


def data_pool(dtype, rng):
    """POOL_UNITS valid blocks (elements) of `dtype`, twice over so any window of the pool's
    length is contiguous."""
    if dtype == "q8_0":
        scales = rng.uniform(0.5e-4, 1.0e-4, POOL_UNITS).astype("<f2")
        values = rng.integers(-127, 128, (POOL_UNITS, 32), dtype=np.int8)
        blocks = np.empty((POOL_UNITS, 34), dtype=np.uint8)
        blocks[:, :2] = scales.view(np.uint8).reshape(POOL_UNITS, 2)
        blocks[:, 2:] = values.view(np.uint8)
    elif dtype == "q4_0":
        scales = rng.uniform(0.5e-3, 1.5e-3, POOL_UNITS).astype("<f2")
        blocks = np.empty((POOL_UNITS, 18), dtype=np.uint8)
        blocks[:, :2] = scales.view(np.uint8).reshape(POOL_UNITS, 2)
        blocks[:, 2:] = rng.integers(0, 256, (POOL_UNITS, 16), dtype=np.uint8)
    elif dtype in ("bf16", "f16"):
        values = (rng.standard_normal(POOL_UNITS) * 0.01).astype(np.float32)
        if dtype == "f16":
            blocks = values.astype("<f2").view(np.uint8)
        else:
            blocks = (values.view(np.uint32) >> 16).astype("<u2").view(np.uint8)
    elif dtype == "f32":
        blocks = np.ones(POOL_UNITS, dtype="<f4").view(np.uint8)  # norm weights: 1
    else:
        raise ValueError(dtype)
    flat = np.ascontiguousarray(blocks).reshape(-1)
    return memoryview(np.concatenate([flat, flat]))


def write_tensor(out, pool, dtype, size, start):
    """`size` bytes of `dtype` from the pool, windows moving by POOL_STRIDE blocks."""
    unit = GGML_TYPES[dtype][2]
    pool_bytes = POOL_UNITS * unit
    block = start % POOL_UNITS
    while size:
        count = min(size, pool_bytes)
        out.write(pool[block * unit : block * unit + count])
        size -= count
        block = (block + count // unit + POOL_STRIDE) % POOL_UNITS


def write_model(path, args):
    tensors = model_tensors(args)
    metadata = model_metadata(args)
    header, offsets, data_size = header_bytes(metadata, tensors)
    rng = np.random.default_rng(args.seed)
    pools = {dtype: data_pool(dtype, rng) for dtype in sorted({dtype for _, dtype, _ in tensors})}
    total = len(header) + data_size
    print(f"writing {path}: {len(tensors)} tensors, {total / 1e9:.2f} GB", flush=True)
    started = time.monotonic()
    with open(path, "wb", buffering=0) as out:
        out.write(header)
        written = 0
        for index, ((name, dtype, shape), offset) in enumerate(zip(tensors, offsets)):
            assert written == offset, (name, written, offset)
            size = tensor_bytes(dtype, shape)
            write_tensor(out, pools[dtype], dtype, size, index * POOL_STRIDE * 31)
            padding = align(size) - size
            out.write(b"\0" * padding)
            written += size + padding
            if name.endswith("ffn_up_exps.weight"):
                seconds = time.monotonic() - started
                print(f"  {name}: {(len(header) + written) / 1e9:.2f} GB in {seconds:.0f} s", flush=True)
    seconds = time.monotonic() - started
    print(f"wrote {total / 1e9:.2f} GB in {seconds:.1f} s ({total / 1e9 / max(seconds, 1e-9):.2f} GB/s)")


class Reader:
    """A minimal GGUF v3 reader: enough to check what write_model wrote."""

    def __init__(self, file):
        self.file = file

    def take(self, fmt):
        size = struct.calcsize(fmt)
        data = self.file.read(size)
        if len(data) != size:
            raise ValueError("file ends inside the header")
        return struct.unpack(fmt, data)[0]

    def string(self):
        length = self.take("<Q")
        if length > 1 << 20:
            raise ValueError(f"string of {length} bytes")
        return self.file.read(length).decode("utf-8")

    def value(self, value_type):
        if value_type == T_STRING:
            return self.string()
        if value_type == T_ARRAY:
            element_type, count = self.take("<I"), self.take("<Q")
            return [self.value(element_type) for _ in range(count)]
        return self.take(SCALAR_FORMATS[value_type])

    def read(self):
        if self.file.read(4) != GGUF_MAGIC:
            raise ValueError("not a GGUF file")
        version, tensor_count, kv_count = self.take("<I"), self.take("<Q"), self.take("<Q")
        metadata = {}
        for _ in range(kv_count):
            key = self.string()
            metadata[key] = self.value(self.take("<I"))
        tensors = []
        for _ in range(tensor_count):
            name = self.string()
            dims = self.take("<I")
            shape = tuple(self.take("<Q") for _ in range(dims))
            type_id, offset = self.take("<I"), self.take("<Q")
            tensors.append((name, GGML_TYPE_NAMES.get(type_id, f"type {type_id}"), shape, offset))
        data_start = align(self.file.tell())
        return version, metadata, tensors, data_start


def verify(path, args=None):
    """Read `path` back; when `args` is given, compare with what those options write."""
    with open(path, "rb") as file:
        version, metadata, tensors, data_start = Reader(file).read()
    problems = []
    if version != GGUF_VERSION:
        problems.append(f"version {version}")
    if args is not None:
        expected_metadata = {key: value for key, _, value in model_metadata(args)}
        for key, value in expected_metadata.items():
            read = metadata.get(key)
            if not (read == value or (isinstance(value, float) and abs(read - value) <= 1e-6 * abs(value))):
                problems.append(f"metadata {key}: {read!r}, expected {value!r}")
        expected_tensors = [(name, dtype, shape) for name, dtype, shape in model_tensors(args)]
        if [(name, dtype, shape) for name, dtype, shape, _ in tensors] != expected_tensors:
            problems.append("tensor table differs from the model's")
    next_offset = 0
    with open(path, "rb") as file:
        for name, dtype, shape, offset in tensors:
            if offset != next_offset:
                problems.append(f"{name}: at offset {offset}, expected {next_offset}")
            size = tensor_bytes(dtype, shape)
            next_offset = align(offset + size)
            file.seek(data_start + offset)
            sample = np.frombuffer(file.read(min(size, 34 * 4096)), dtype=np.uint8)
            if dtype in ("q8_0", "q4_0"):
                unit = GGML_TYPES[dtype][2]
                values = sample[: sample.size // unit * unit].reshape(-1, unit)[:, :2].copy().view("<f2")
            elif dtype == "bf16":
                values = (sample.view("<u2").astype(np.uint32) << 16).view(np.float32)
            else:
                values = sample.view("<f2" if dtype == "f16" else "<f4")
            if not np.all(np.isfinite(values.astype(np.float32))):
                problems.append(f"{name}: non-finite values")
    file_size = os.path.getsize(path)
    if file_size not in (data_start + next_offset, data_start + tensors[-1][3] + size):
        problems.append(f"data ends at {data_start + next_offset}, file has {file_size} bytes")
    if not problems:
        cross_check(path, tensors, metadata, problems)
    print(
        f"{path}: GGUF v{version}, {len(metadata)} keys, {len(tensors)} tensors, "
        f"{file_size / 1e9:.3f} GB, architecture {metadata.get('general.architecture')}"
    )
    for problem in problems:
        print(f"  PROBLEM: {problem}")
    return not problems


def cross_check(path, tensors, metadata, problems):
    """The same file through the `gguf` package, when it is installed."""
    try:
        import gguf
    except ImportError:
        return
    try:
        reader = gguf.GGUFReader(path)
    except ValueError as error:
        problems.append(f"the gguf package cannot read it: {error}")
        return
    theirs = [(t.name, t.tensor_type.name.lower(), tuple(int(d) for d in t.shape)) for t in reader.tensors]
    ours = [(name, dtype, shape) for name, dtype, shape, _ in tensors]
    if theirs != ours:
        problems.append("the gguf package reads another tensor table")
    if {key for key in reader.fields if not key.startswith("GGUF.")} != set(metadata):
        problems.append("the gguf package reads other metadata keys")
    arch = getattr(gguf.MODEL_ARCH, "QWEN3MOE", None)
    if arch is not None:
        known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
        ours_generic = {
            re.sub(r"^blk\.\d+\.", "blk.{bid}.", name).removesuffix(".weight") for name, _, _ in ours
        }
        if ours_generic - known:
            problems.append(f"not qwen3moe tensor names to the gguf package: {sorted(ours_generic - known)}")
    print("  cross-checked with the gguf package")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("path", help="the GGUF file to write (or, with --read-only, to check)")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--experts-used", type=int, default=8)
    parser.add_argument("--experts-dtype", choices=["q8_0", "q4_0"], default="q8_0")
    parser.add_argument("--dense-dtype", choices=["bf16", "f16"], default="bf16")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--context-length", type=int, default=40960)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verify", action="store_true", help="read the written file back")
    parser.add_argument("--read-only", action="store_true", help="only check an existing file")
    args = parser.parse_args()
    if not 1 <= args.experts_used <= args.experts or args.layers < 1:
        parser.error("need --layers >= 1 and 1 <= --experts-used <= --experts")
    if args.read_only:
        return 0 if verify(args.path) else 1
    write_model(args.path, args)
    if args.verify and not verify(args.path, args):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
