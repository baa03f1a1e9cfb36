//! Which GPU the engine opens: `--gpus` among the cards CUDA makes visible (the first one by
//! default; `CUDA_VISIBLE_DEVICES` applies), `--gpu-split` checked against them. Several cards
//! named refuse to start: their layer split is planned (`ninfer run --dry-run`) but not
//! executed yet, and nothing should quietly run on one of them.
//!
//! Owns: counting the visible cards and the choice. Must not touch: opening the card (main.rs).

use anyhow::bail;
use ninfer_engine::moe::gpu_split::{
    parse_gpu_ordinals, parse_gpu_split, select_gpus, several_gpus_not_executable,
};

use crate::args::{Args, Device};

/// The ordinal of the card to open (0 when none is visible: opening it then says why).
pub(crate) fn chosen_gpu_ordinal(args: &Args) -> anyhow::Result<usize> {
    let requested = args.gpus.as_deref().map(parse_gpu_ordinals).transpose()?;
    let split = args.gpu_split.as_deref().map(parse_gpu_split).transpose()?;
    if let (Some(ordinals), Some(split)) = (&requested, &split) {
        // Checked against the cards named before the driver is asked anything.
        select_gpus(Some(ordinals), usize::MAX, Some(split))?;
    }
    if let Some(ordinals) = requested.as_deref().filter(|ordinals| ordinals.len() > 1) {
        bail!(several_gpus_not_executable(ordinals));
    }
    if args.device == Device::Cpu {
        return Ok(0);
    }
    let visible = visible_gpu_count();
    if requested.is_none() && visible > 1 {
        tracing::info!(
            "{visible} GPUs visible: the engine uses GPU 0 (--gpus names others; a split over several is planned by `ninfer run --dry-run --gpus 0,1` but not executed yet)"
        );
    }
    let chosen = select_gpus(requested.as_deref(), visible, split.as_deref())?;
    if chosen.len() > 1 {
        bail!(several_gpus_not_executable(&chosen));
    }
    Ok(chosen.first().copied().unwrap_or(0))
}

/// Cards the CUDA driver makes visible; 0 without a driver (cudarc panics when its loader
/// misses the library, hence the guard).
fn visible_gpu_count() -> usize {
    std::panic::catch_unwind(|| {
        cudarc::driver::result::init().ok()?;
        cudarc::driver::result::device::get_count().ok()
    })
    .ok()
    .flatten()
    .and_then(|count| usize::try_from(count).ok())
    .unwrap_or(0)
}
