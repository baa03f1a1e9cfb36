//! The Qwen3.5 vision tower (docs/MODELS.md §10.5): image patch rows in, the image tokens'
//! embeddings out, for the `<|image_pad|>` positions of a prompt.
//!
//! Owns: the vision settings the artifact carries (`config.rs`), the tower's weights by
//! checkpoint name (`weights.rs`), the index math of an image grid that every backend shares —
//! patch order, position-embedding taps, rotary positions, attention segments (`grid.rs`) —,
//! the f32 host forward that is the reference for the device paths (`encoder.rs`), the
//! [`VisionTower`] trait a device tower implements and its host form (`tower.rs`), and the
//! decoder's three position streams of a prompt with images (`positions.rs`).
//! Must not touch: image decoding and resizing (`ninfer-vision-input`, called by the service's
//! `images.rs`), the rotation itself (the backends' `rope` with `MultimodalRotation`), the
//! scheduler.

pub mod config;
pub mod encoder;
pub mod grid;
pub mod positions;
pub mod tower;
pub mod weights;

pub use config::{ImagePlacement, VisionConfig};
pub use encoder::{encode_images, VisionOutput};
pub use grid::{patch_tables, ImageGrid, PatchTables};
pub use positions::{multimodal_positions, multimodal_positions_of, MultimodalPositions};
pub use tower::{HostVisionTower, VisionTower};
pub use weights::VisionWeights;
