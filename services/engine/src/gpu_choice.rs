//! Which GPUs the engine opens: `--gpus` among the cards CUDA makes visible (the first one by
//! default; `CUDA_VISIBLE_DEVICES` applies), `--gpu-split` checked against them, and
//! `--pipeline-stages-on-one-device`. Several cards, or several stages on one device, split the
//! decoder layers as a pipeline (`pipeline_start.rs`); wrong choices are refused here, before
//! anything is opened.
//!
//! Owns: counting the visible cards and the choice. Must not touch: opening the cards (main.rs,
//! `pipeline_start.rs`).

use anyhow::bail;
use ninfer_engine::moe::gpu_split::{parse_gpu_ordinals, parse_gpu_split, select_gpus};

use crate::args::{Args, Device};

/// The cards and pipeline stages a run uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GpuChoice {
    /// CUDA ordinals of the cards, in layer order (the first is opened first; one card for the
    /// CPU backend, where it is not used).
    pub(crate) ordinals: Vec<usize>,
    /// `--gpu-split`: one share per stage.
    pub(crate) split: Option<Vec<u64>>,
    /// `--pipeline-stages-on-one-device` (1: one stage per card).
    pub(crate) stages_on_one_device: usize,
}

impl GpuChoice {
    pub(crate) fn first_ordinal(&self) -> usize {
        self.ordinals.first().copied().unwrap_or(0)
    }

    /// The flag that splits the run, as error messages name it.
    pub(crate) fn split_flag(&self) -> String {
        match self.stages_on_one_device {
            1 => format!("--gpus {}", join(&self.ordinals)),
            stages => format!("--pipeline-stages-on-one-device {stages}"),
        }
    }
}

fn join(ordinals: &[usize]) -> String {
    ordinals
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The cards and stages to run on (the card 0 when none is visible: opening it then says why).
pub(crate) fn chosen_gpus(args: &Args) -> anyhow::Result<GpuChoice> {
    let requested = args.gpus.as_deref().map(parse_gpu_ordinals).transpose()?;
    let split = args.gpu_split.as_deref().map(parse_gpu_split).transpose()?;
    let stages_on_one_device = args.pipeline_stages_on_one_device;
    if stages_on_one_device == 0 {
        bail!("--pipeline-stages-on-one-device 0: give 1 or more stages");
    }
    let several_cards = requested
        .as_ref()
        .is_some_and(|ordinals| ordinals.len() > 1);
    if stages_on_one_device > 1 {
        if several_cards {
            bail!(
                "--pipeline-stages-on-one-device {stages_on_one_device} with --gpus {}: the stages share one device; name one card",
                args.gpus.as_deref().unwrap_or_default()
            );
        }
        if let Some(split) = &split {
            if split.len() != stages_on_one_device {
                bail!(
                    "--gpu-split {}: {} shares for {stages_on_one_device} stages (--pipeline-stages-on-one-device): give one share per stage",
                    args.gpu_split.as_deref().unwrap_or_default(),
                    split.len()
                );
            }
        }
    } else if let (Some(ordinals), Some(split)) = (&requested, &split) {
        // Checked against the cards named before the driver is asked anything.
        select_gpus(Some(ordinals), usize::MAX, Some(split))?;
    }
    let choice = |ordinals: Vec<usize>| GpuChoice {
        ordinals,
        split: split.clone(),
        stages_on_one_device,
    };
    if args.device == Device::Cpu {
        if several_cards {
            bail!(
                "--gpus {} with --device cpu: the CPU is one device (--pipeline-stages-on-one-device N splits the layers on it)",
                args.gpus.as_deref().unwrap_or_default()
            );
        }
        return Ok(choice(vec![0]));
    }
    let visible = visible_gpu_count();
    if requested.is_none() && visible > 1 {
        tracing::info!(
            "{visible} GPUs visible: the engine uses GPU 0 (--gpus 0,1 splits the layers over several)"
        );
    }
    // The shares of stages on one device were checked above; a split over cards is checked
    // against the cards.
    let card_split = (stages_on_one_device == 1)
        .then_some(split.as_deref())
        .flatten();
    let chosen = select_gpus(requested.as_deref(), visible, card_split)?;
    Ok(choice(match chosen.is_empty() {
        true => vec![0],
        false => chosen,
    }))
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
