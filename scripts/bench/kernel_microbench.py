#!/usr/bin/env python3
"""Decode kernels one at a time, at the shapes of one Qwen3-30B-A3B decode layer.

Runs on a CUDA machine with CuPy (no Rust needed): compiles `kernels/*.cu` with NVRTC as the
engine does, launches each decode kernel with the engine's launch geometry on random data, and
prints microseconds per launch. Launches are captured in a CUDA graph and replayed, as the
engine's step graphs do, and weights rotate through enough copies that every launch reads them
from HBM, not from the 60 MB L2.

With `--baseline DIR` (the kernel files of another revision with the same kernel signatures,
e.g. `git archive REV kernels`) it runs both and checks that kernels meant to keep their bits
do: the matmuls, the norms, the router and the experts; the attention combine is compared
within f32 rounding.

Each kernel's row gives its bandwidth and that as a share of the device copy rate measured at
the start (bytes read + written, as `ninfer bench` counts it); an empty kernel's row is the
floor a launch costs in a graph. Alternative kernels (e.g. `expert_gate_up_tasks`) are timed
beside the kernel they replace, their bits checked against it.

    python3 scripts/bench/kernel_microbench.py [--baseline DIR] [--context 4096] [--json FILE]
"""

import os
import sys

# The package beside this file, also when this file is imported from another directory.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The names this file offers scripts that `import kernel_microbench`.
from microbench.cli import ROOT, Bench, main  # noqa: E402
from microbench.common import (  # noqa: E402
    EXPERTS, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, MOE_INTERMEDIATE, TOP_K, bf16, copies_for, kernel_define,
    module, raw_kernel, residual_add_trials, timed)
from microbench.router import router_weight_copies  # noqa: E402

__all__ = ["ROOT", "HIDDEN", "HEADS", "KV_HEADS", "HEAD_DIM", "EXPERTS", "TOP_K", "MOE_INTERMEDIATE",
           "module", "kernel_define", "router_weight_copies", "residual_add_trials", "raw_kernel", "bf16",
           "timed", "copies_for", "Bench", "main"]


if __name__ == "__main__":
    main()
