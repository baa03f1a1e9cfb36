//! Op-level checks of the CUDA backend against the CPU backend (the reference) on random inputs:
//! every element-wise and norm op, matmul at several batch sizes, causal GQA attention over
//! lengths 1..4096 and GQA ratios 1..8 (prefill, decode, sliding window, two sequences in one
//! batch), the causal conv and the gated delta rule continuing from their states. These run on
//! the backend with `CudaOptions::exact` (f32 KV cache, matmul kernel only), held to f32
//! tolerances. The default options (bf16 KV cache, cuBLAS for bf16 prefill GEMMs) are checked
//! by `cublas_matmul_matches_a_host_reference` and
//! `bf16_kv_attention_matches_the_cpu_backend_over_lengths_and_gqa_ratios`.
//!
//! Without a GPU every test prints that it is skipped and passes (fails under
//! `NINFER_REQUIRE_GPU=1`). Run `cargo test -p ninfer-engine --test cuda_ops -- --nocapture` to
//! see the figures.

mod helpers;

mod attention;
mod delta_rule;
mod dense;
mod matmul;
