//! No non-test source file is over the line limit, but for the listed ones.

use std::collections::BTreeSet;

use crate::helpers::{workspace_crate_graphs, workspace_root};

/// Most lines of a non-test source file (a file near 1,000 lines is due for a split).
const MAX_SOURCE_LINES: usize = 1200;

/// Source files allowed past [`MAX_SOURCE_LINES`] for now, to be split by their owner (remove the
/// entry with the split).
const OVERSIZED_FILES_TO_SPLIT: &[&str] = &[];

/// No non-test source file (Rust under `services/*/src`, CUDA under `kernels/`) is longer than
/// [`MAX_SOURCE_LINES`] lines, but for the listed ones.
#[test]
fn no_source_file_is_over_the_line_limit() {
    let root = workspace_root();
    let mut sources: BTreeSet<String> = BTreeSet::new();
    for (folder, _, graph) in workspace_crate_graphs() {
        for file in graph.files_by_module.values() {
            sources.insert(format!("{folder}/{file}"));
        }
    }
    let kernels = std::fs::read_dir(root.join("kernels")).expect("kernels/ exists");
    for entry in kernels.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if name.ends_with(".cu") || name.ends_with(".cuh") {
            sources.insert(format!("kernels/{name}"));
        }
    }
    assert!(
        sources.len() > 50,
        "found only {} source files",
        sources.len()
    );
    let mut offenders = Vec::new();
    for source in &sources {
        let text = std::fs::read_to_string(root.join(source))
            .unwrap_or_else(|error| panic!("reading {source}: {error}"));
        let lines = text.lines().count();
        let listed = OVERSIZED_FILES_TO_SPLIT.contains(&source.as_str());
        if lines > MAX_SOURCE_LINES && !listed {
            offenders.push(format!("{source}: {lines} lines"));
        }
        if lines <= MAX_SOURCE_LINES && listed {
            offenders.push(format!(
                "{source}: {lines} lines, remove it from OVERSIZED_FILES_TO_SPLIT"
            ));
        }
    }
    for listed in OVERSIZED_FILES_TO_SPLIT {
        if !sources.contains(*listed) {
            offenders.push(format!(
                "{listed} is no source file, remove it from OVERSIZED_FILES_TO_SPLIT"
            ));
        }
    }
    assert!(
        offenders.is_empty(),
        "source files over {MAX_SOURCE_LINES} lines (split them along their jobs):\n{}",
        offenders.join("\n")
    );
}
