//! Activation forms the row kernels read, written once per layer (inputs) or per group of 32
//! intermediate features (SwiGLU outputs) and then reused by every weight row.
//!
//! Owns: the scratch arrays of one matrix input (`[slots, K]` in each form) and the rules that
//! fill them:
//! - f32 in natural order (scalar, f32 / bf16 / int8 weights on the float paths, tails);
//! - f32 in *nibble order* for int4 on the float paths: per group of 32, the even elements then
//!   the odd ones, because a byte holds element `2j` in its low nibble and `2j+1` in its high
//!   one, so the kernels split nibbles without shuffling them back;
//! - bf16 (AVX-512 BF16 dot products);
//! - int8 per group of 32 (scale = max|x| / 127, f32): as `x + 128` unsigned for int8 weights,
//!   in nibble order signed for int4 weights, with per-lane scales so VNNI `vpdpbusd` results
//!   need no horizontal work, and (int4) per-group offset terms;
//! - AMX B tiles: bf16 pairs `[K/2][16 tokens]` per block of 16 tokens.
//!
//! Must not touch: weights.

use half::bf16;

use crate::isa::KernelIsa;
use crate::layout::{WeightDType, GROUP};

/// Which forms a (path, weight dtype) pair reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct FormNeeds {
    pub f32_nibble_order: bool,
    pub bf16: bool,
    pub int8_offset: bool,
    pub int4_signed: bool,
    pub amx: bool,
}

impl FormNeeds {
    pub fn of(isa: KernelIsa, dtype: WeightDType) -> FormNeeds {
        match isa {
            KernelIsa::Scalar => FormNeeds::default(),
            KernelIsa::Avx2 | KernelIsa::Avx512 => FormNeeds {
                f32_nibble_order: dtype == WeightDType::Int4,
                ..FormNeeds::default()
            },
            KernelIsa::Avx512Vnni | KernelIsa::Amx => FormNeeds {
                f32_nibble_order: false,
                bf16: dtype == WeightDType::Bf16,
                int8_offset: dtype == WeightDType::Int8,
                int4_signed: dtype == WeightDType::Int4,
                amx: isa == KernelIsa::Amx,
            },
        }
    }

    pub fn quantized(&self) -> bool {
        self.int8_offset || self.int4_signed
    }
}

/// Position inside a group of 32 in nibble order: element `e` sits at this index.
#[inline]
pub(crate) fn nibble_position(element: usize) -> usize {
    if element.is_multiple_of(2) {
        element / 2
    } else {
        16 + element / 2
    }
}

/// Owned arrays of one matrix input (`K` features, up to `slots` token rows).
pub(crate) struct Forms {
    pub needs: FormNeeds,
    /// Row stride of every per-feature form: `K` rounded up to one VNNI block (64, or 128 for
    /// int4), zero-padded.
    pub padded: usize,
    /// `K` rounded up to 32: the AMX tile depth.
    pub amx_padded: usize,
    pub f32: Vec<f32>,
    pub f32_nibble: Vec<f32>,
    pub bf16: Vec<u16>,
    pub int8: Vec<u8>,
    pub lane_scale: Vec<f32>,
    /// Int4: per group, `−8 · scale · Σcodes` (the nibbles' +8 offset, folded into one FMA
    /// per 16 groups against the weight scales).
    pub group_offset: Vec<f32>,
    /// Int4: per group, the activations' scale (compact: 16 groups per zmm, where
    /// `lane_scale` repeats each four times), so the one-token kernel multiplies it with the
    /// weights' scales once per 16 groups instead of once per 4.
    pub group_scale: Vec<f32>,
    pub amx: Vec<u32>,
}

impl Forms {
    pub fn new(needs: FormNeeds, features: usize, slots: usize, amx_slots: usize) -> Forms {
        // Int4 VNNI blocks hold four groups (128 activations); everything else two.
        let padded = features.next_multiple_of(if needs.int4_signed { 128 } else { 64 });
        let amx_padded = features.next_multiple_of(32);
        let lanes = padded / 4;
        let sized = |flag: bool, len: usize| if flag { len } else { 0 };
        Forms {
            needs,
            padded,
            amx_padded,
            f32: vec![0.0; slots * padded],
            f32_nibble: vec![0.0; sized(needs.f32_nibble_order, slots * padded)],
            bf16: vec![0; sized(needs.bf16, slots * padded)],
            int8: vec![0; sized(needs.quantized(), slots * padded)],
            lane_scale: vec![0.0; sized(needs.quantized(), slots * lanes)],
            group_offset: vec![0.0; sized(needs.int4_signed, slots * padded / GROUP)],
            group_scale: vec![0.0; sized(needs.int4_signed, slots * padded / GROUP)],
            amx: vec![0; sized(needs.amx, amx_slots * amx_padded / 2)],
        }
    }

    pub fn pointers(&mut self) -> FormsPtr {
        FormsPtr {
            needs: self.needs,
            padded: self.padded,
            amx_padded: self.amx_padded,
            f32: self.f32.as_mut_ptr(),
            f32_nibble: self.f32_nibble.as_mut_ptr(),
            bf16: self.bf16.as_mut_ptr(),
            int8: self.int8.as_mut_ptr(),
            lane_scale: self.lane_scale.as_mut_ptr(),
            group_offset: self.group_offset.as_mut_ptr(),
            group_scale: self.group_scale.as_mut_ptr(),
            amx: self.amx.as_mut_ptr(),
        }
    }
}

/// Raw view of [`Forms`] shared by the pool's threads. Each thread writes disjoint
/// (slot, group) cells during one phase and only reads after the next barrier.
#[derive(Clone, Copy)]
pub(crate) struct FormsPtr {
    pub needs: FormNeeds,
    pub padded: usize,
    pub amx_padded: usize,
    pub f32: *mut f32,
    pub f32_nibble: *mut f32,
    pub bf16: *mut u16,
    pub int8: *mut u8,
    pub lane_scale: *mut f32,
    pub group_offset: *mut f32,
    pub group_scale: *mut f32,
    pub amx: *mut u32,
}

// SAFETY: see the type's doc: threads write disjoint cells between barriers.
unsafe impl Send for FormsPtr {}
unsafe impl Sync for FormsPtr {}

impl FormsPtr {
    /// Writes group `group` (features `32·group ..`, `values.len()` ≤ 32 of them) of token row
    /// `slot` in every form this input needs (AMX tiles excepted: [`FormsPtr::write_amx`]).
    ///
    /// # Safety
    /// `slot` is inside the forms, `group` inside `K`, and no other thread touches this cell.
    pub unsafe fn write_group(&self, slot: usize, group: usize, values: &[f32]) {
        let start = slot * self.padded + group * GROUP;
        for (index, &value) in values.iter().enumerate() {
            *self.f32.add(start + index) = value;
        }
        if self.needs.f32_nibble_order {
            for (index, &value) in values.iter().enumerate() {
                *self.f32_nibble.add(start + nibble_position(index)) = value;
            }
        }
        if self.needs.bf16 {
            for (index, &value) in values.iter().enumerate() {
                *self.bf16.add(start + index) = bf16::from_f32(value).to_bits();
            }
        }
        if self.needs.quantized() {
            let max_abs = values.iter().fold(0.0f32, |acc, v| acc.max(v.abs()));
            let scale = max_abs / 127.0;
            let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            let lane_row = slot * (self.padded / 4);
            let mut codes = [0i8; GROUP];
            for (index, &value) in values.iter().enumerate() {
                // Round half away from zero without a libm call (`f32::round` is one on
                // baseline x86-64); `as` saturates, and |value · inverse| ≤ 127 anyway.
                let scaled = value * inverse;
                codes[index] = (scaled + 0.5f32.copysign(scaled)) as i8;
            }
            if self.needs.int8_offset {
                for (index, &code) in codes.iter().enumerate().take(values.len()) {
                    // vpdpbusd multiplies unsigned by signed bytes: store x + 128.
                    *self.int8.add(start + index) = (code as u8) ^ 0x80;
                }
                // Two groups per zmm: lanes 0–7 the even group, 8–15 the odd one.
                let lanes = lane_row + (group / 2) * 16 + (group % 2) * 8;
                for lane in 0..8 {
                    *self.lane_scale.add(lanes + lane) = scale;
                }
            } else {
                // Four groups per 128-byte block: bytes 16k..16k+16 the even elements of group
                // k, bytes 64+16k.. its odd ones (the low / high nibbles of its 16 weight bytes).
                let block = slot * self.padded + (group / 4) * 128 + (group % 4) * 16;
                for (index, &code) in codes.iter().enumerate() {
                    let position = if index.is_multiple_of(2) {
                        index / 2
                    } else {
                        64 + index / 2
                    };
                    *self.int8.add(block + position) = code as u8;
                }
                let sum: i32 = codes.iter().map(|&c| c as i32).sum();
                *self.group_offset.add(slot * (self.padded / GROUP) + group) =
                    -8.0 * scale * sum as f32;
                *self.group_scale.add(slot * (self.padded / GROUP) + group) = scale;
                // Lanes 4k..4k+4 of a block's dot products hold group k.
                let lanes = lane_row + (group / 4) * 16 + (group % 4) * 4;
                for lane in 0..4 {
                    *self.lane_scale.add(lanes + lane) = scale;
                }
            }
        }
    }

    /// Writes group `group` of local token `token` of an expert whose AMX tiles start at u32
    /// index `base`, as bf16 pairs in tile order (nibble order for int4 weights).
    ///
    /// # Safety
    /// The expert's tile region is inside the forms and this (token, group) is ours alone.
    pub unsafe fn write_amx(
        &self,
        base: usize,
        token: usize,
        group: usize,
        values: &[f32],
        nibble_order: bool,
    ) {
        let mut ordered = [0.0f32; GROUP];
        for (index, &value) in values.iter().enumerate() {
            let position = if nibble_order {
                nibble_position(index)
            } else {
                index
            };
            ordered[position] = value;
        }
        let pairs_per_block = self.amx_padded / 2;
        let block = base + (token / 16) * pairs_per_block * 16;
        for pair in 0..GROUP / 2 {
            let row = group * (GROUP / 2) + pair;
            let low = bf16::from_f32(ordered[2 * pair]).to_bits() as u32;
            let high = bf16::from_f32(ordered[2 * pair + 1]).to_bits() as u32;
            *self.amx.add(block + row * 16 + token % 16) = low | (high << 16);
        }
    }
}

/// Where one token row's forms are, for the row kernels. The accessors only compute addresses
/// (`wrapping_add`); the kernels that read them are `unsafe` and require `token < tokens`.
#[derive(Clone, Copy)]
pub(crate) struct InputRows {
    pub forms: FormsPtr,
    /// First slot of the expert's tokens.
    pub first_slot: usize,
    pub tokens: usize,
    /// AMX tiles of this expert (u32 index), when it runs on tiles.
    pub amx_base: Option<usize>,
}

// Some forms are read only by the x86-64 kernels.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
impl InputRows {
    #[inline]
    pub fn f32_row(&self, token: usize) -> *const f32 {
        self.forms
            .f32
            .wrapping_add((self.first_slot + token) * self.forms.padded)
    }
    #[inline]
    pub fn f32_nibble_row(&self, token: usize) -> *const f32 {
        self.forms
            .f32_nibble
            .wrapping_add((self.first_slot + token) * self.forms.padded)
    }
    #[inline]
    pub fn bf16_row(&self, token: usize) -> *const u16 {
        self.forms
            .bf16
            .wrapping_add((self.first_slot + token) * self.forms.padded)
    }
    #[inline]
    pub fn int8_row(&self, token: usize) -> *const u8 {
        self.forms
            .int8
            .wrapping_add((self.first_slot + token) * self.forms.padded)
    }
    #[inline]
    pub fn lane_scale_row(&self, token: usize) -> *const f32 {
        self.forms
            .lane_scale
            .wrapping_add((self.first_slot + token) * (self.forms.padded / 4))
    }
    #[inline]
    pub fn group_offset_row(&self, token: usize) -> *const f32 {
        self.forms
            .group_offset
            .wrapping_add((self.first_slot + token) * (self.forms.padded / GROUP))
    }
    #[inline]
    pub fn group_scale_row(&self, token: usize) -> *const f32 {
        self.forms
            .group_scale
            .wrapping_add((self.first_slot + token) * (self.forms.padded / GROUP))
    }
}
