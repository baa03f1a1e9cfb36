//! The block hash chain: a prompt cut into blocks of a fixed number of tokens, each block named
//! by a hash of the name of the block before it and its own tokens, the first one's "before"
//! being the model's identity. Equal names mean equal prefixes (up to a hash collision, which
//! the store rules out by comparing tokens), so a prompt's longest cached prefix is found by
//! walking its names from the first block.
//!
//! Owns: the names. Must not touch: what is stored under them.

use std::hash::{Hash, Hasher};

/// The name of a block in its chain.
pub type BlockName = u64;

/// The names of the full blocks of `tokens` (a last partial block has none), chained from
/// `root`.
pub fn block_names(root: BlockName, tokens: &[u32], block_tokens: usize) -> Vec<BlockName> {
    let mut names = Vec::with_capacity(tokens.len() / block_tokens.max(1));
    let mut previous = root;
    for block in tokens.chunks_exact(block_tokens.max(1)) {
        previous = chained(previous, block);
        names.push(previous);
    }
    names
}

/// The chain's root for a model: its identity, so no name is shared between models.
pub fn root_name(model_identity: &str) -> BlockName {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    "ninfer prefix chain".hash(&mut hasher);
    model_identity.hash(&mut hasher);
    hasher.finish()
}

fn chained(previous: BlockName, block: &[u32]) -> BlockName {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    previous.hash(&mut hasher);
    block.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_depends_on_every_token_before_it_and_on_the_model() {
        let tokens: Vec<u32> = (0..40).collect();
        let names = block_names(root_name("a"), &tokens, 8);
        assert_eq!(names.len(), 5);
        let mut changed = tokens.clone();
        changed[3] = 99;
        let other = block_names(root_name("a"), &changed, 8);
        assert!(names.iter().zip(&other).all(|(a, b)| a != b));
        let mut late = tokens.clone();
        late[20] = 99;
        let late = block_names(root_name("a"), &late, 8);
        assert_eq!(names[..2], late[..2]);
        assert!(names[2..].iter().zip(&late[2..]).all(|(a, b)| a != b));
        let model_b = block_names(root_name("b"), &tokens, 8);
        assert!(names.iter().zip(&model_b).all(|(a, b)| a != b));
    }
}
