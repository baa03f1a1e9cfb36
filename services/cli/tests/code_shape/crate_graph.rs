//! One crate's files as modules, and the import edges between its files: each path leads to
//! the file of the longest module prefix it names, through re-exports to the file that defines
//! the item.

use std::collections::{BTreeMap, BTreeSet};

use crate::file_items::{file_items, FileItems};

/// One crate's files as modules: module path → file, and the import edges between files.
#[derive(Debug, Default)]
pub struct CrateGraph {
    /// Module path (`a::b`, `` for the root) → file.
    pub files_by_module: BTreeMap<Vec<String>, String>,
    /// Files reached only through `#[cfg(test)] mod`.
    pub test_files: BTreeSet<String>,
    /// File → (name it re-exports → the absolute path it re-exports).
    pub reexports: BTreeMap<String, BTreeMap<String, Vec<String>>>,
    /// File → (imported file, an example path that imports it).
    pub edges: BTreeMap<String, BTreeMap<String, String>>,
}

/// The file of module `name` declared in `file` (`a/b.rs` declares `a/b/name.rs`).
fn child_file(files: &BTreeMap<String, String>, file: &str, name: &str) -> Option<String> {
    let folder = match file.rsplit_once('/') {
        Some((folder, leaf)) => (folder, leaf),
        None => ("", file),
    };
    let base = match folder.1 {
        "mod.rs" | "lib.rs" | "main.rs" => folder.0.to_string(),
        leaf => {
            let stem = leaf.trim_end_matches(".rs");
            if folder.0.is_empty() {
                stem.to_string()
            } else {
                format!("{}/{stem}", folder.0)
            }
        }
    };
    let join = |rest: &str| {
        if base.is_empty() {
            rest.to_string()
        } else {
            format!("{base}/{rest}")
        }
    };
    [join(&format!("{name}.rs")), join(&format!("{name}/mod.rs"))]
        .into_iter()
        .find(|candidate| files.contains_key(candidate))
}

/// The import graph of the crate whose root file is `root` among `files` (relative paths).
pub fn crate_graph(files: &BTreeMap<String, String>, root: &str) -> CrateGraph {
    let mut graph = CrateGraph::default();
    let mut parsed: BTreeMap<String, (Vec<String>, FileItems)> = BTreeMap::new();
    let mut pending = vec![(root.to_string(), Vec::<String>::new(), false)];
    while let Some((file, module, test)) = pending.pop() {
        let Some(text) = files.get(&file) else {
            continue;
        };
        if test {
            graph.test_files.insert(file.clone());
            continue;
        }
        let items = file_items(text);
        for (name, is_test) in &items.child_modules {
            if let Some(child) = child_file(files, &file, name) {
                let mut child_module = module.clone();
                child_module.push(name.clone());
                pending.push((child, child_module, *is_test));
            }
        }
        graph.files_by_module.insert(module.clone(), file.clone());
        parsed.insert(file, (module, items));
    }
    for (file, (module, items)) in &parsed {
        for (name, path) in &items.reexports {
            if let Some(absolute) = absolute_path(&graph, module, path) {
                graph
                    .reexports
                    .entry(file.clone())
                    .or_default()
                    .insert(name.clone(), absolute);
            }
        }
    }
    for (file, (module, items)) in &parsed {
        for (inline, path) in &items.paths {
            let mut current = module.clone();
            current.extend(inline.iter().cloned());
            let Some(absolute) = absolute_path(&graph, &current, path) else {
                continue;
            };
            if let Some(target) = graph
                .defining_file(absolute)
                .filter(|target| target != file)
            {
                graph
                    .edges
                    .entry(file.clone())
                    .or_default()
                    .entry(target.clone())
                    .or_insert_with(|| path.join("::"));
            }
        }
    }
    graph
}

impl CrateGraph {
    /// The file that defines what `absolute` names: the file of its longest module prefix, or,
    /// when that file re-exports the next name, the file the re-export leads to.
    pub fn defining_file(&self, mut absolute: Vec<String>) -> Option<String> {
        // A bound on re-exports of re-exports (a re-export of itself would loop).
        for _ in 0..16 {
            let (length, file) = (0..=absolute.len()).rev().find_map(|length| {
                self.files_by_module
                    .get(&absolute[..length])
                    .map(|file| (length, file))
            })?;
            let onward = absolute
                .get(length)
                .and_then(|name| self.reexports.get(file).and_then(|names| names.get(name)));
            match onward {
                Some(target) => absolute = [&target[..], &absolute[length + 1..]].concat(),
                None => return Some(file.clone()),
            }
        }
        None
    }
}

/// `path` (as written in module `current`) from the crate root; `None` for another crate's.
fn absolute_path(graph: &CrateGraph, current: &[String], path: &[String]) -> Option<Vec<String>> {
    let first = path.first()?;
    match first.as_str() {
        "crate" => Some(path[1..].to_vec()),
        "super" => {
            let supers = path.iter().take_while(|s| *s == "super").count();
            let base = current.get(..current.len().checked_sub(supers)?)?;
            Some([base, &path[supers..]].concat())
        }
        "self" => Some([current, &path[1..]].concat()),
        _ => {
            let relative = [current, path].concat();
            graph
                .files_by_module
                .contains_key(&relative[..current.len() + 1])
                .then_some(relative)
        }
    }
}
