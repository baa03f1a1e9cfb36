"""The kernel bench behind `scripts/bench/kernel_microbench.py` (its entry point and command
line), one module per job: `common` (the layer's shapes, NVRTC loading, kernel defines, bf16, the
graph-replay timer, copies sizing, the results table and the device floor), one module per
`--sections` name (`matmul`, `norm`, `router`, `experts`, `attention`, `decode_attention`) and
`cli` (the bench the sections form, and `main`)."""

import sys

try:
    import cupy  # noqa: F401 - every module here launches its kernels through CuPy
except ImportError:  # pragma: no cover - the GPU machine has it
    sys.exit("kernel_microbench needs CuPy (and a CUDA GPU)")
