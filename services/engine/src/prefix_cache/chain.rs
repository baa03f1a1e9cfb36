//! The block hash chain: a prompt cut into blocks of a fixed number of tokens, each block named
//! by a hash of the name of the block before it and its own tokens, the first one's "before"
//! being the model's identity. Equal names mean equal prefixes (up to a hash collision, which
//! the store rules out by comparing tokens), so a prompt's longest cached prefix is found by
//! walking its names from the first block. A block with image tokens is named by those images'
//! keys too: the same placeholder tokens of different images name different blocks.
//!
//! Owns: the names. Must not touch: what is stored under them.

use std::hash::{Hash, Hasher};

use crate::model::ImageKey;

/// The name of a block in its chain.
pub type BlockName = u64;

/// The names of the full blocks of `tokens` (a last partial block has none), chained from
/// `root`; `images` are the keys of the prompt's images.
pub fn block_names(
    root: BlockName,
    tokens: &[u32],
    block_tokens: usize,
    images: &[ImageKey],
) -> Vec<BlockName> {
    let block_tokens = block_tokens.max(1);
    let mut names = Vec::with_capacity(tokens.len() / block_tokens);
    let mut previous = root;
    for (index, block) in tokens.chunks_exact(block_tokens).enumerate() {
        let positions = index * block_tokens..(index + 1) * block_tokens;
        previous = chained(previous, block, &images_in(images, &positions));
        names.push(previous);
    }
    names
}

/// The keys of the images with tokens in `positions`.
pub fn images_in(images: &[ImageKey], positions: &std::ops::Range<usize>) -> Vec<ImageKey> {
    images
        .iter()
        .filter(|key| key.overlaps(positions))
        .copied()
        .collect()
}

/// The chain's root for a model: its identity, so no name is shared between models.
pub fn root_name(model_identity: &str) -> BlockName {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    "ninfer prefix chain".hash(&mut hasher);
    model_identity.hash(&mut hasher);
    hasher.finish()
}

fn chained(previous: BlockName, block: &[u32], images: &[ImageKey]) -> BlockName {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    previous.hash(&mut hasher);
    block.hash(&mut hasher);
    // Text blocks hash as before: no image, nothing added.
    if !images.is_empty() {
        images.hash(&mut hasher);
    }
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_depends_on_every_token_before_it_and_on_the_model() {
        let tokens: Vec<u32> = (0..40).collect();
        let names = block_names(root_name("a"), &tokens, 8, &[]);
        assert_eq!(names.len(), 5);
        let mut changed = tokens.clone();
        changed[3] = 99;
        let other = block_names(root_name("a"), &changed, 8, &[]);
        assert!(names.iter().zip(&other).all(|(a, b)| a != b));
        let mut late = tokens.clone();
        late[20] = 99;
        let late = block_names(root_name("a"), &late, 8, &[]);
        assert_eq!(names[..2], late[..2]);
        assert!(names[2..].iter().zip(&late[2..]).all(|(a, b)| a != b));
        let model_b = block_names(root_name("b"), &tokens, 8, &[]);
        assert!(names.iter().zip(&model_b).all(|(a, b)| a != b));
    }

    #[test]
    fn an_image_names_the_blocks_from_its_first_token_on() {
        let tokens = vec![7u32; 40];
        let image = |content| ImageKey {
            first_token: 10,
            tokens: 12,
            content,
        };
        let text = block_names(root_name("a"), &tokens, 8, &[]);
        let first = block_names(root_name("a"), &tokens, 8, &[image(1)]);
        let second = block_names(root_name("a"), &tokens, 8, &[image(2)]);
        // The block before the image is text; from the image's first block on the names differ.
        assert_eq!(first[0], text[0]);
        assert_eq!(first[0], second[0]);
        assert!(first[1..].iter().zip(&second[1..]).all(|(a, b)| a != b));
        assert!(first[1..].iter().zip(&text[1..]).all(|(a, b)| a != b));
        assert_eq!(first, block_names(root_name("a"), &tokens, 8, &[image(1)]));
    }
}
