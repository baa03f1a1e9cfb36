//! Half of every MoE layer's routed experts resident under the expert cache: the setting the
//! split suites compare a split model with the unsplit one in.
//!
//! Owns: [`place_half_under_the_cache`]. Must not touch: what a suite checks.

use ninfer_engine::moe::expert_cache::ExpertCacheOptions;
use ninfer_engine::{Backend, Model};

/// Puts every other expert of each MoE layer (the MTP layer's too) in its stage's slots and
/// lets the expert cache move them (2 fills per layer); returns the placement.
pub fn place_half_under_the_cache<B: Backend>(model: &mut Model<B>) -> Vec<Vec<u32>> {
    let experts = model.spec().common.num_experts as u32;
    let placement: Vec<Vec<u32>> = model
        .placement_layers()
        .iter()
        .map(|&moe| match moe {
            true => (0..experts).step_by(2).collect(),
            false => Vec::new(),
        })
        .collect();
    model.place_resident_experts(&placement).unwrap();
    model
        .enable_expert_cache(
            ExpertCacheOptions {
                fills_per_layer: 2,
                ..ExpertCacheOptions::default()
            },
            None,
        )
        .unwrap();
    placement
}
