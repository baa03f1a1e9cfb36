//! Prompts that share prefixes as a chat's turns do, for the suites that check prefix reuse.
//!
//! Owns: [`turn_prompts`]. Must not touch: what a suite checks.

/// Lengths of [`turn_prompts`]'s parts.
pub struct TurnLengths {
    pub system: u32,
    pub first: u32,
    pub later: u32,
    pub other: u32,
}

/// A first prompt (a system part, then its own tokens), a later turn extending it, another
/// prompt sharing only the system part, and the first prompt again; token ids below `vocab`.
pub fn turn_prompts(vocab: u32, lengths: TurnLengths) -> Vec<Vec<u32>> {
    let tokens = |seed: u32, count: u32| -> Vec<u32> {
        (0..count)
            .map(|i| (i * 53 + 7 * seed + 1) % vocab)
            .collect()
    };
    let system = tokens(1, lengths.system);
    let first = [system.clone(), tokens(2, lengths.first)].concat();
    let later = [first.clone(), tokens(3, lengths.later)].concat();
    let other = [system, tokens(4, lengths.other)].concat();
    vec![first.clone(), later, other, first]
}
