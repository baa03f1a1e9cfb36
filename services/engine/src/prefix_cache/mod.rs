//! Automatic prefix caching: what earlier sequences computed for their prompts, kept by blocks
//! of tokens so a later prompt that starts the same way skips that part of its prefill.
//!
//! Owns: the store of prefix blocks named by their hash chain ([`chain`]), the checkpoints of
//! recurrent states kept at some block ends, matching a prompt's longest reusable prefix,
//! least-recently-used eviction within a byte budget, and the counters `/metrics` shows.
//! Must not touch: how a block's rows are copied (`Model::prefix_block`,
//! `Model::restore_prefix`), when forwards run (the scheduler asks [`PrefixCache::next_checkpoint`]
//! where a prompt piece should end, and calls [`PrefixCache::record`] after it).
//!
//! Sequences that draft with the model's MTP head ([`PrefixCache::restore_speculating`],
//! [`PrefixCache::record_speculating`]) need the head's state at the reuse point too: each
//! block then also keeps the MTP layer's rows of its pairs and the main model's hidden row at
//! its last position ([`crate::model::MtpPrefixRows`]). The head consumes a prompt's pairs a
//! step after the forward that computed them, so a block's MTP share may arrive later than its
//! rows; until it has, the block serves sequences that do not draft only.
//!
//! A prompt with images is keyed by them too: the sequence's attached images
//! ([`SequenceState::image_keys`]) name each block their tokens fall in, and are compared with
//! the block's tokens, so a prefix is reused only for the same images at the same places.
//!
//! Invariants: a block is stored under the name of its whole prefix (the model's identity
//! first, and the images it holds), and its tokens and images are compared on every match, so
//! nothing is reused across models or for a different prefix; a reused prefix ends where a whole prompt's forward would have the
//! same state (a block end, and on models with recurrent layers a checkpoint), and leaves at
//! least [`Model::prefix_min_rest`] tokens to compute; only prompt positions are stored (the
//! rows a prompt's forward computed, never decode rows). Eviction takes leaves only, so every
//! stored block's prefix is stored too.

pub mod chain;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::backend::Backend;
use crate::error::EngineError;
use crate::model::ImageKey;
use crate::model::{
    Model, MtpPrefixRows, MtpState, PrefixBlock, SequenceCheckpoint, SequenceState,
};
use chain::{block_names, images_in, root_name, BlockName};

/// Tokens per block by default: large enough that a block's copy is one efficient transfer per
/// layer and the chain is short, small enough to keep most of a prompt that changed late.
pub const DEFAULT_BLOCK_TOKENS: usize = 256;

/// Recurrent states are kept every this many blocks of a long prompt (8192 tokens; besides
/// its last block end), so a prompt that shares only the start of a long one still finds a
/// checkpoint. Each costs the prompt one more forward (on a GPU that streams every layer's
/// experts, a fraction of a second), so they are sparse.
pub const DEFAULT_CHECKPOINT_INTERVAL_BLOCKS: usize = 32;

/// How the prefix cache is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixCacheSettings {
    /// Bytes the stored blocks and checkpoints may take; 0 turns the cache off.
    pub budget_bytes: u64,
    pub block_tokens: usize,
    pub checkpoint_interval_blocks: usize,
}

impl PrefixCacheSettings {
    /// No prefix cache.
    pub fn off() -> Self {
        Self::with_budget(0)
    }

    /// The default blocks and checkpoints within `budget_bytes`.
    pub fn with_budget(budget_bytes: u64) -> Self {
        PrefixCacheSettings {
            budget_bytes,
            block_tokens: DEFAULT_BLOCK_TOKENS,
            checkpoint_interval_blocks: DEFAULT_CHECKPOINT_INTERVAL_BLOCKS,
        }
    }
}

impl Default for PrefixCacheSettings {
    fn default() -> Self {
        Self::off()
    }
}

/// What the prefix cache did since start (read by the status RPC).
#[derive(Debug, Default)]
pub struct PrefixCacheCounters {
    /// Prompts looked up.
    pub lookups: AtomicU64,
    /// Lookups that reused a prefix.
    pub hits: AtomicU64,
    /// Prompt tokens taken from the cache instead of computed.
    pub hit_tokens: AtomicU64,
    /// Blocks evicted to stay within the budget.
    pub evictions: AtomicU64,
    /// Bytes the stored blocks and checkpoints take now.
    pub bytes: AtomicU64,
    /// The budget in bytes (0: the cache is off).
    pub budget_bytes: AtomicU64,
    /// Blocks stored now.
    pub blocks: AtomicU64,
}

struct Node<B: Backend> {
    parent: Option<BlockName>,
    tokens: Box<[u32]>,
    /// The keys of the images with tokens in the block.
    images: Box<[ImageKey]>,
    block: PrefixBlock<B>,
    checkpoint: Option<SequenceCheckpoint<B>>,
    /// The MTP head's rows of the block's pairs (speculating sequences only).
    mtp_rows: Option<MtpPrefixRows<B>>,
    /// The main model's final-normed hidden row at the block's last position: a speculating
    /// sequence restored to the block's end pairs it with its next token.
    mtp_hidden: Option<Box<[f32]>>,
    children: usize,
    last_used: u64,
    bytes: u64,
}

/// Where a speculating sequence's MTP head stands, for [`PrefixCache::record_speculating`].
pub struct MtpProgress<'a, B: Backend> {
    pub state: &'a MtpState<B>,
    /// The main model's final-normed hidden rows the head has not consumed yet (host,
    /// `[rows, hidden]`): those of positions `state.position()..`.
    pub pending_hidden: &'a [f32],
}

/// The store; owned by the scheduler thread, one per model.
pub struct PrefixCache<B: Backend> {
    settings: PrefixCacheSettings,
    /// The identity of the model the blocks were computed by (the artifact's header checksum).
    model_id: String,
    root: BlockName,
    nodes: HashMap<BlockName, Node<B>>,
    bytes: u64,
    clock: u64,
    needs_checkpoints: bool,
    min_rest: usize,
    counters: Arc<PrefixCacheCounters>,
}

impl<B: Backend> PrefixCache<B> {
    /// A cache for `model`, or `None` when `settings` turn it off or do not suit the model (a
    /// block length that is not a multiple of [`Model::prefix_alignment`]: logged).
    pub fn new(
        model: &Model<B>,
        settings: PrefixCacheSettings,
        counters: Arc<PrefixCacheCounters>,
    ) -> Option<Self> {
        if settings.budget_bytes == 0 || settings.block_tokens == 0 {
            return None;
        }
        let alignment = model.prefix_alignment();
        if settings.block_tokens % alignment != 0 {
            tracing::warn!(
                "prefix cache off: blocks of {} tokens are not a multiple of this model's {alignment}",
                settings.block_tokens
            );
            return None;
        }
        counters
            .budget_bytes
            .store(settings.budget_bytes, Ordering::Relaxed);
        let model_id = model.artifact().model_id();
        Some(PrefixCache {
            settings,
            root: root_name(&model_id),
            model_id,
            nodes: HashMap::new(),
            bytes: 0,
            clock: 0,
            needs_checkpoints: model.needs_prefix_checkpoints(),
            min_rest: model.prefix_min_rest(),
            counters,
        })
    }

    /// Puts the longest reusable stored prefix of `prompt` into the fresh `state` and returns
    /// its length in tokens (0: nothing reused, `state` untouched). The prompt's images are
    /// attached to `state` first. On an error `state` must be dropped.
    pub fn restore(
        &mut self,
        model: &Model<B>,
        state: &mut SequenceState<B>,
        prompt: &[u32],
    ) -> Result<usize, EngineError> {
        Ok(self.restore_prefix(model, state, None, prompt)?.0)
    }

    /// [`PrefixCache::restore`] for a sequence that drafts with the MTP head: only blocks with
    /// their MTP share are reused, and the fresh `mtp` gets the head's rows up to the reused
    /// prefix's last position. Returns the reused tokens and the main model's hidden row at
    /// that last position (empty when nothing was reused): the caller's next pair for the head,
    /// with the prompt's token after the prefix. On an error both states must be dropped.
    pub fn restore_speculating(
        &mut self,
        model: &Model<B>,
        state: &mut SequenceState<B>,
        mtp: &mut MtpState<B>,
        prompt: &[u32],
    ) -> Result<(usize, Vec<f32>), EngineError> {
        self.restore_prefix(model, state, Some(mtp), prompt)
    }

    fn restore_prefix(
        &mut self,
        model: &Model<B>,
        state: &mut SequenceState<B>,
        mtp: Option<&mut MtpState<B>>,
        prompt: &[u32],
    ) -> Result<(usize, Vec<f32>), EngineError> {
        self.counters.lookups.fetch_add(1, Ordering::Relaxed);
        if !self.computed_by(model) {
            return Ok((0, Vec::new()));
        }
        let block_tokens = self.settings.block_tokens;
        let limit = prompt.len().saturating_sub(self.min_rest);
        let images = state.image_keys().to_vec();
        let names = block_names(self.root, &prompt[..limit], block_tokens, &images);
        let mut chain = Vec::new();
        for (index, name) in names.iter().enumerate() {
            let positions = index * block_tokens..(index + 1) * block_tokens;
            let tokens = &prompt[positions.clone()];
            match self.nodes.get(name) {
                Some(node)
                    if node.parent == chain.last().copied()
                        && *node.tokens == *tokens
                        && *node.images == *images_in(&images, &positions)
                        && (mtp.is_none() || node.mtp_rows.is_some()) =>
                {
                    chain.push(*name)
                }
                _ => break,
            }
        }
        let usable = chain
            .iter()
            .rposition(|name| {
                let node = &self.nodes[name];
                (!self.needs_checkpoints || node.checkpoint.is_some())
                    && (mtp.is_none() || node.mtp_hidden.is_some())
            })
            .map_or(0, |index| index + 1);
        chain.truncate(usable);
        let Some(last) = chain.last() else {
            return Ok((0, Vec::new()));
        };
        self.clock += 1;
        for name in &chain {
            if let Some(node) = self.nodes.get_mut(name) {
                node.last_used = self.clock;
            }
        }
        let blocks: Vec<&PrefixBlock<B>> =
            chain.iter().map(|name| &self.nodes[name].block).collect();
        model.restore_prefix(state, &blocks, self.nodes[last].checkpoint.as_ref())?;
        let mut hidden = Vec::new();
        if let Some(mtp) = mtp {
            let rows: Vec<&MtpPrefixRows<B>> = chain
                .iter()
                .filter_map(|name| self.nodes[name].mtp_rows.as_ref())
                .collect();
            model.restore_mtp_prefix(mtp, &rows)?;
            hidden = self.nodes[last]
                .mtp_hidden
                .as_deref()
                .unwrap_or_default()
                .to_vec();
        }
        let tokens = usable * block_tokens;
        self.counters.hits.fetch_add(1, Ordering::Relaxed);
        self.counters
            .hit_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
        Ok((tokens, hidden))
    }

    /// Where a piece of `prompt_len`'s prompt fed from `position` should end so the recurrent
    /// states there are kept: the next block end after `position` that leaves the rest a reuse
    /// needs, every [`PrefixCacheSettings::checkpoint_interval_blocks`] blocks and at the last
    /// such block end. `None` on a model without recurrent layers (any block end is a reuse
    /// point there) or when no such end is left.
    pub fn next_checkpoint(&self, position: usize, prompt_len: usize) -> Option<usize> {
        if !self.needs_checkpoints {
            return None;
        }
        checkpoint_after(position, prompt_len, self.settings, self.min_rest)
    }

    /// Stores the full blocks of `prompt` that `state` holds and the store lacks (`state` has
    /// processed `prompt` up to its position, or all of it), and the recurrent states where
    /// `state` stands when that is a block end. Blocks are evicted, least recently used first,
    /// to stay within the budget; recording stops where its own block had to go.
    pub fn record(
        &mut self,
        model: &Model<B>,
        state: &SequenceState<B>,
        prompt: &[u32],
    ) -> Result<(), EngineError> {
        self.record_blocks(model, state, None, prompt, None)
    }

    /// [`PrefixCache::record`] for a sequence that drafts with the MTP head: besides, each
    /// block gets its MTP share once `mtp` holds it (the hidden row at the block's last
    /// position while the head has not consumed it, the head's rows of the block's pairs once
    /// it has). Call it whenever the sequence's prompt advanced and again once the head has
    /// consumed the prompt's pairs.
    pub fn record_speculating(
        &mut self,
        model: &Model<B>,
        state: &SequenceState<B>,
        mtp: MtpProgress<'_, B>,
        prompt: &[u32],
    ) -> Result<(), EngineError> {
        self.record_blocks(model, state, Some(mtp), prompt, None)
    }

    /// [`PrefixCache::record`] (with `mtp`: [`PrefixCache::record_speculating`]) after a
    /// forward that went on past a block end and took the checkpoint there
    /// ([`Model::forward_hidden_with_checkpoint`]): that block keeps `taken`.
    pub fn record_passed_checkpoint(
        &mut self,
        model: &Model<B>,
        state: &SequenceState<B>,
        mtp: Option<MtpProgress<'_, B>>,
        prompt: &[u32],
        taken: SequenceCheckpoint<B>,
    ) -> Result<(), EngineError> {
        self.record_blocks(model, state, mtp, prompt, Some(taken))
    }

    fn record_blocks(
        &mut self,
        model: &Model<B>,
        state: &SequenceState<B>,
        mtp: Option<MtpProgress<'_, B>>,
        prompt: &[u32],
        mut taken: Option<SequenceCheckpoint<B>>,
    ) -> Result<(), EngineError> {
        if !self.computed_by(model) {
            return Ok(());
        }
        let block_tokens = self.settings.block_tokens;
        let held = state.position().min(prompt.len());
        let images = state.image_keys();
        let names = block_names(self.root, &prompt[..held], block_tokens, images);
        self.clock += 1;
        let mut parent = None;
        for (index, name) in names.into_iter().enumerate() {
            let positions = index * block_tokens..(index + 1) * block_tokens;
            let tokens = &prompt[positions.clone()];
            let block_images = images_in(images, &positions);
            let taken_here = taken
                .as_ref()
                .is_some_and(|taken| taken.position() == positions.end);
            let checkpoint_here =
                self.needs_checkpoints && (taken_here || positions.end == state.position());
            // The checkpoint of this block end: the one taken mid-forward, else the state's own.
            let mut checkpoint_of_block = || match taken_here {
                true => taken.take().ok_or_else(|| EngineError::InvalidConfig {
                    problem: "a mid-forward checkpoint offered twice".into(),
                }),
                false => model.checkpoint(state),
            };
            match self.nodes.get_mut(&name) {
                Some(node)
                    if node.parent == parent
                        && *node.tokens == *tokens
                        && *node.images == *block_images =>
                {
                    node.last_used = self.clock;
                    if checkpoint_here && node.checkpoint.is_none() {
                        let checkpoint = checkpoint_of_block()?;
                        let bytes = model.checkpoint_bytes(&checkpoint) as u64;
                        node.checkpoint = Some(checkpoint);
                        node.bytes += bytes;
                        self.bytes += bytes;
                    }
                }
                // Another prefix under the same name (a hash collision): keep it.
                Some(_) => break,
                None => {
                    let block = model.prefix_block(state, positions.clone())?;
                    let checkpoint = match checkpoint_here {
                        true => Some(checkpoint_of_block()?),
                        false => None,
                    };
                    let bytes = block.bytes() as u64
                        + checkpoint
                            .as_ref()
                            .map_or(0, |checkpoint| model.checkpoint_bytes(checkpoint) as u64);
                    if let Some(parent) = parent.and_then(|parent| self.nodes.get_mut(&parent)) {
                        parent.children += 1;
                    }
                    self.nodes.insert(
                        name,
                        Node {
                            parent,
                            tokens: tokens.into(),
                            images: block_images.into(),
                            block,
                            checkpoint,
                            mtp_rows: None,
                            mtp_hidden: None,
                            children: 0,
                            last_used: self.clock,
                            bytes,
                        },
                    );
                    self.bytes += bytes;
                }
            }
            if let (Some(mtp), Some(node)) = (&mtp, self.nodes.get_mut(&name)) {
                let added = add_mtp_share(model, node, mtp, positions)?;
                self.bytes += added;
            }
            self.evict_to_budget();
            if !self.nodes.contains_key(&name) {
                break;
            }
            parent = Some(name);
        }
        self.publish();
        Ok(())
    }

    /// Bytes the stored blocks and checkpoints take.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Blocks stored.
    pub fn blocks(&self) -> usize {
        self.nodes.len()
    }

    /// Blocks stored with a checkpoint.
    pub fn checkpoints(&self) -> usize {
        self.nodes
            .values()
            .filter(|node| node.checkpoint.is_some())
            .count()
    }

    /// Whether `model` is the one this store's blocks come from (a store never serves or takes
    /// another model's blocks).
    fn computed_by(&self, model: &Model<B>) -> bool {
        model.artifact().model_id() == self.model_id
    }

    /// Blocks stored with their whole MTP share (what a speculating sequence can reuse).
    pub fn blocks_with_mtp(&self) -> usize {
        self.nodes
            .values()
            .filter(|node| node.mtp_rows.is_some() && node.mtp_hidden.is_some())
            .count()
    }

    fn evict_to_budget(&mut self) {
        while self.bytes > self.settings.budget_bytes {
            let victim = self
                .nodes
                .iter()
                .filter(|(_, node)| node.children == 0)
                .min_by_key(|(_, node)| node.last_used)
                .map(|(name, _)| *name);
            let Some(node) = victim.and_then(|victim| self.nodes.remove(&victim)) else {
                break;
            };
            if let Some(parent) = node.parent.and_then(|parent| self.nodes.get_mut(&parent)) {
                parent.children = parent.children.saturating_sub(1);
            }
            self.bytes = self.bytes.saturating_sub(node.bytes);
            self.counters.evictions.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn publish(&self) {
        self.counters.bytes.store(self.bytes, Ordering::Relaxed);
        self.counters
            .blocks
            .store(self.nodes.len() as u64, Ordering::Relaxed);
    }
}

/// Gives `node` (the block of `positions`) the parts of its MTP share it lacks and `mtp` holds;
/// returns the bytes they added.
fn add_mtp_share<B: Backend>(
    model: &Model<B>,
    node: &mut Node<B>,
    mtp: &MtpProgress<'_, B>,
    positions: std::ops::Range<usize>,
) -> Result<u64, EngineError> {
    let mut added = 0;
    if node.mtp_hidden.is_none() {
        let hidden_size = model.spec().common.hidden_size;
        let row = (positions.end - 1).checked_sub(mtp.state.position());
        let start = row.map(|row| row * hidden_size);
        if let Some(hidden) =
            start.and_then(|start| mtp.pending_hidden.get(start..start + hidden_size))
        {
            node.mtp_hidden = Some(hidden.into());
            added += (hidden_size * std::mem::size_of::<f32>()) as u64;
        }
    }
    if node.mtp_rows.is_none() {
        if let Some(rows) = model.mtp_prefix_rows(mtp.state, positions)? {
            added += rows.bytes() as u64;
            node.mtp_rows = Some(rows);
        }
    }
    node.bytes += added;
    Ok(added)
}

/// [`PrefixCache::next_checkpoint`] on a model with recurrent layers.
fn checkpoint_after(
    position: usize,
    prompt_len: usize,
    settings: PrefixCacheSettings,
    min_rest: usize,
) -> Option<usize> {
    let block_tokens = settings.block_tokens.max(1);
    let last = prompt_len.saturating_sub(min_rest) / block_tokens * block_tokens;
    if last <= position {
        return None;
    }
    let interval = block_tokens * settings.checkpoint_interval_blocks.max(1);
    Some(((position / interval + 1) * interval).min(last))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoints_fall_every_interval_and_at_the_last_block_end_that_leaves_a_rest() {
        let settings = PrefixCacheSettings::with_budget(1);
        let walk = |from: usize, prompt: usize| {
            let mut ends = Vec::new();
            let mut position = from;
            while let Some(end) = checkpoint_after(position, prompt, settings, 2) {
                assert!(end > position && end % 256 == 0 && end + 2 <= prompt);
                ends.push(end);
                position = end;
            }
            ends
        };
        // 19,000 tokens: every 8192, then the last block end with two tokens after it.
        assert_eq!(walk(0, 19_000), [8192, 16_384, 18_944]);
        // A prompt two tokens past a block end still checkpoints there; one token past does not.
        assert_eq!(walk(0, 514), [512]);
        assert_eq!(walk(0, 513), [256]);
        // Restored at a checkpoint, a prompt goes on from there.
        assert_eq!(walk(8192, 9000), [8960]);
        assert!(walk(0, 257).is_empty());
    }
}
