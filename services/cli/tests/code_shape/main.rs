//! The shape of the code, checked on every `cargo test`: no source file grows past
//! [`line_limit::MAX_SOURCE_LINES`] lines (one job per file), and no two files of one crate
//! import each other, directly or around a longer circle (the modules of a crate form layers,
//! each using only what is below it), and no file of one gateway API dialect imports another
//! dialect's files (a request flows one way: dialect → neutral conversation → generation plan →
//! engine → dialect).
//!
//! Imports are read from the source text: every `use` tree and every path in code that starts
//! with `crate::`, `super::`, `self::` or a child module's name, resolved to the file of the
//! longest module prefix it names. A re-export (`pub use`) is a module's face, not a use by its
//! code: it is no import of its own, and a path through it leads on to the file that defines the
//! item (a crate root or a `mod.rs` that re-exports its children's items makes no circle with
//! them; one whose own code uses them while they use it does; any other file that re-exports an
//! item of a file importing it points back up and is reported). Comments, strings, visibilities
//! (`pub(in crate::a)`) and `#[cfg(test)]` items do not count (a test module may use anything of
//! its file's parents). Files reached only through a `#[cfg(test)] mod` are test files and have
//! no line limit.
//!
//! Owns: the line limit, the circle finder, the dialect check and their allowlists (each entry
//! a known debt that its owner removes). Must not touch: the sources it reads.

mod crate_graph;
mod file_items;
mod helpers;
mod tokens;

mod circles;
mod dialects;
mod line_limit;
