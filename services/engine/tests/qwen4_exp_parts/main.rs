//! The Qwen4-Exp pieces and ops, checked on their own:
//! * QSA token selection against a deliberately naive oracle written here (everything recomputed
//!   from the raw keys for every query, full sort, no dense shortcut) over random keys, and
//!   against the selections transformers' own indexer made (`tests/fixtures/qwen4_exp_parts/`,
//!   `scripts/make_qwen4_exp_part_references.py`);
//! * PLE hashed n-gram row ids against transformers' values from the same script;
//! * on every backend (`test_device!`): the hyper-connection ops and the PLE gate against host
//!   loops, and the sigmoid-gated Gated DeltaNet output norm as a device backend computes it
//!   (backend ops) against the host function, and the QSA ops (append and block pooling,
//!   indexer queries, block selection, sparse attention) against the host reference.

#[path = "../support/mod.rs"]
mod support;

mod helpers;

mod model_ops;
mod ngram;
mod qsa_ops;
mod qsa_selection;
