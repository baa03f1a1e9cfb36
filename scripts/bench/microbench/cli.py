"""Decode kernels one at a time, at the shapes of one Qwen3-30B-A3B decode layer.

The command line of `scripts/bench/kernel_microbench.py` (whose docstring tells its use): the
bench the sections form, and `main`, which runs the sections asked for in their order and writes
the table. The line above is also the entry point's first: `--help` prints it as the description.
"""

import argparse
import json
import os
import sys

import cupy as cp

from .attention import AttentionSection
from .decode_attention import DecodeAttentionSection
from .experts import ExpertsSection
from .matmul import MatmulSection
from .norm import NormSection
from .router import RouterSection

# The repository root: this file is scripts/bench/microbench/cli.py.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class Bench(MatmulSection, NormSection, RouterSection, AttentionSection, DecodeAttentionSection,
            ExpertsSection):
    """Every section's rows on one table."""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", default=os.path.join(ROOT, "kernels"))
    parser.add_argument("--baseline", help="kernel files of another revision, compared against")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--json", help="write the table here")
    parser.add_argument("--decode-contexts", default="4096,16384,65536",
                        help="contexts of the decode attention section")
    parser.add_argument("--decode-kernels", default="lanes,mma",
                        help="decode attention kernels timed beside the split kernel: lanes (q heads across the lanes), mma (tensor cores)")
    parser.add_argument("--sweep", action="store_true", help="matmul features per warp × UNROLL, attention chunks, gate/up columns")
    parser.add_argument("--no-candidates", action="store_true",
                        help="skip the alternative kernels timed beside the ones they replace")
    parser.add_argument("--sections", default="matmul,norm,router,decode_attention,attention,experts",
                        help="comma-separated: which kernels to time")
    args = parser.parse_args()
    bench = Bench(args)
    props = cp.cuda.runtime.getDeviceProperties(0)
    print("device: %s, %d SMs" % (props["name"].decode(), props["multiProcessorCount"]), flush=True)

    sections = set(args.sections.split(","))
    bench.floor()
    if "matmul" in sections:
        base = bench.matmuls(args.baseline, "baseline", 2, 4) if args.baseline else None
        settings = [(c, u) for c in (1, 2) for u in (4, 8)] if args.sweep else [(1, 4), (2, 4)]
        for cols, unroll in settings:
            bench.matmuls(args.kernels, "current", cols, unroll, base)

    if "norm" in sections:
        base_norm = bench.norms(args.baseline, "baseline") if args.baseline else None
        bench.norms(args.kernels, "current", base_norm)

    if "router" in sections:
        base_router = bench.router(args.baseline, "baseline", True) if args.baseline else None
        bench.router(args.kernels, "current", True, base_router)
        bench.router_fused(args.kernels)
        bench.router_add_norm_fused(args.kernels)

    if "experts" in sections:
        base_experts = bench.experts(args.baseline, "baseline", 4) if args.baseline else None
        settings = ((1, 0, 0), (1, 0, 4), (1, 0, 16), (1, 6, 0), (2, 0, 0), (4, 0, 0)) if args.sweep else ((1, 0, 0),)
        for columns, min_blocks, down_sum_loads in settings:
            bench.experts(args.kernels, "current", 4, base_experts, columns, min_blocks, down_sum_loads)

    if "norm" in sections:  # after the sections above: a new kernel's fault ends the run
        bench.add_norm_matmul3_fused(args.kernels)

    # Last: a fault here takes the context (and every later section) down with it.
    if "attention" in sections:
        base_attention = bench.attention(args.baseline, "baseline", True) if args.baseline else None
        for max_chunks in (128, 64, 32) if args.sweep else (128,):
            bench.attention(args.kernels, "current", True, base_attention, max_chunks)

    if "decode_attention" in sections:
        for context in [int(c) for c in args.decode_contexts.split(",")]:
            for heads, kv_heads, hd in ((32, 4, 128), (16, 4, 256), (16, 2, 256)):
                bench.decode_attention(args.kernels, heads, kv_heads, hd, context)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": bench.results, "failures": bench.failures}, f, indent=1)
    if bench.failures:
        print("FAILURES:\n  " + "\n  ".join(bench.failures))
        sys.exit(1)
