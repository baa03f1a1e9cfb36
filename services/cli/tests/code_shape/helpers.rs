//! What the checks share: the crates' source folders and their `.rs` files, each crate's
//! import graph, and small crates written in a test.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::crate_graph::{crate_graph, CrateGraph};

/// Crate source folders: every `src/` under `services/`.
fn crate_source_folders(root: &Path) -> Vec<PathBuf> {
    let mut folders = Vec::new();
    let mut pending = vec![root.join("services")];
    while let Some(folder) = pending.pop() {
        if folder.join("Cargo.toml").is_file() && folder.join("src").is_dir() {
            folders.push(folder.join("src"));
            continue;
        }
        let Ok(entries) = std::fs::read_dir(&folder) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            if path.is_dir() && name != "target" && !name.to_string_lossy().starts_with('.') {
                pending.push(path);
            }
        }
    }
    folders.sort();
    folders
}

/// Every `.rs` file under `folder`, as (path relative to `folder` with `/` separators, text).
fn rust_files(folder: &Path) -> BTreeMap<String, String> {
    let mut files = BTreeMap::new();
    let mut pending = vec![folder.to_path_buf()];
    while let Some(current) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&current) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let relative = path
                    .strip_prefix(folder)
                    .expect("a file under its folder")
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().to_string())
                    .collect::<Vec<_>>()
                    .join("/");
                let text = std::fs::read_to_string(&path)
                    .unwrap_or_else(|error| panic!("reading {}: {error}", path.display()));
                files.insert(relative, text);
            }
        }
    }
    files
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the workspace root exists")
}

/// Each crate under services/ (a library and a program of one folder apart) as (its source
/// folder relative to the workspace, its root file, the graph).
pub fn workspace_crate_graphs() -> Vec<(String, String, CrateGraph)> {
    let root = workspace_root();
    let mut graphs = Vec::new();
    for folder in crate_source_folders(&root) {
        let files = rust_files(&folder);
        let relative = folder
            .strip_prefix(&root)
            .expect("a crate under the workspace")
            .to_string_lossy()
            .replace('\\', "/");
        for crate_root in ["lib.rs", "main.rs"] {
            if files.contains_key(crate_root) {
                let graph = crate_graph(&files, crate_root);
                graphs.push((relative.clone(), crate_root.to_string(), graph));
            }
        }
    }
    graphs
}

pub fn synthetic_crate(files: &[(&str, &str)]) -> BTreeMap<String, String> {
    files
        .iter()
        .map(|(path, text)| (path.to_string(), text.to_string()))
        .collect()
}
