//! CPU compute kernels for routed experts (SwiGLU over bf16 / int8 / int4 weights).
//!
//! Owns: the SIMD/AMX kernels, their scalar reference and run-time ISA dispatch.
//! Must not touch: processes, channels, model graphs. Reads weights in the packed layout that
//! `ninfer-artifact` defines.
