//! No two files of a crate import each other, directly or around a circle, and no file but a
//! crate root or a `mod.rs` re-exports an item of a file that imports it; the circle finder
//! checked on small crates.

use std::collections::{BTreeMap, BTreeSet};

use crate::crate_graph::{crate_graph, CrateGraph};
use crate::helpers::{synthetic_crate, workspace_crate_graphs};

/// Import circles allowed for now, to be removed by their owner (remove the entry with the
/// fix). A circle passes when its files are all in one entry.
const IMPORT_CIRCLES_TO_REMOVE: &[&[&str]] = &[];

/// The strongly connected components of more than one file (Tarjan's algorithm), each sorted.
fn import_circles(edges: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<Vec<String>> {
    struct Search<'a> {
        edges: &'a BTreeMap<String, BTreeMap<String, String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        circles: Vec<Vec<String>>,
    }
    impl<'a> Search<'a> {
        fn visit(&mut self, file: &'a str) {
            let number = self.index.len();
            self.index.insert(file, number);
            self.low.insert(file, number);
            self.stack.push(file);
            self.on_stack.insert(file);
            for next in self.edges.get(file).into_iter().flat_map(|e| e.keys()) {
                let next = next.as_str();
                if !self.index.contains_key(next) {
                    self.visit(next);
                    let low = self.low[file].min(self.low[next]);
                    self.low.insert(file, low);
                } else if self.on_stack.contains(next) {
                    let low = self.low[file].min(self.index[next]);
                    self.low.insert(file, low);
                }
            }
            if self.low[file] == self.index[file] {
                let mut component = Vec::new();
                while let Some(member) = self.stack.pop() {
                    self.on_stack.remove(member);
                    component.push(member.to_string());
                    if member == file {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.circles.push(component);
                }
            }
        }
    }
    let mut search = Search {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        circles: Vec::new(),
    };
    for file in edges.keys() {
        if !search.index.contains_key(file.as_str()) {
            search.visit(file);
        }
    }
    search.circles.sort();
    search.circles
}

/// No two files of one crate import each other, directly or around a circle, but for the
/// listed circles.
#[test]
fn no_import_circles_between_files_of_a_crate() {
    let mut offenders = Vec::new();
    let mut edges_seen = 0;
    let mut entries_used = BTreeSet::new();
    for (folder, crate_root, graph) in workspace_crate_graphs() {
        edges_seen += graph.edges.values().map(BTreeMap::len).sum::<usize>();
        for circle in import_circles(&graph.edges) {
            let files: Vec<String> = circle.iter().map(|f| format!("{folder}/{f}")).collect();
            let allowed = IMPORT_CIRCLES_TO_REMOVE
                .iter()
                .position(|entry| files.iter().all(|file| entry.contains(&file.as_str())));
            if let Some(entry) = allowed {
                entries_used.insert(entry);
                continue;
            }
            let mut described = format!("{folder} ({crate_root}): {}", circle.join(" ↔ "));
            for from in &circle {
                for (to, path) in graph.edges.get(from).into_iter().flatten() {
                    if circle.contains(to) {
                        described.push_str(&format!("\n    {from} → {to} (`{path}`)"));
                    }
                }
            }
            offenders.push(described);
        }
    }
    for (index, entry) in IMPORT_CIRCLES_TO_REMOVE.iter().enumerate() {
        if !entries_used.contains(&index) {
            offenders.push(format!(
                "no circle is left among {entry:?}: remove the entry from IMPORT_CIRCLES_TO_REMOVE"
            ));
        }
    }
    assert!(edges_seen > 100, "found only {edges_seen} imports");
    assert!(
        offenders.is_empty(),
        "import circles between files (move the shared piece down to a file both can use):\n{}",
        offenders.join("\n")
    );
}

/// Re-exports that point back up: a file other than a crate root or a `mod.rs` (a module's face)
/// re-exports an item of a file that imports it, so it names as its own an item of the layer
/// above it (the circle the re-export hides from [`import_circles`]).
fn reexports_pointing_back(graph: &CrateGraph) -> Vec<String> {
    let mut found = Vec::new();
    for (file, names) in &graph.reexports {
        let leaf = file.rsplit('/').next().unwrap_or(file);
        if matches!(leaf, "lib.rs" | "main.rs" | "mod.rs") {
            continue;
        }
        for (name, absolute) in names {
            let Some(target) = graph.defining_file(absolute.clone()) else {
                continue;
            };
            let imports_back = graph
                .edges
                .get(&target)
                .is_some_and(|imported| imported.contains_key(file));
            if target != *file && imports_back {
                found.push(format!(
                    "{file} re-exports `{name}` from {target}, which imports {file}"
                ));
            }
        }
    }
    found
}

/// No file but a crate root or a `mod.rs` re-exports an item of a file that imports it (take
/// the item from the file that defines it instead).
#[test]
fn no_file_reexports_an_item_of_a_file_that_imports_it() {
    let mut offenders = Vec::new();
    for (folder, crate_root, graph) in workspace_crate_graphs() {
        for found in reexports_pointing_back(&graph) {
            offenders.push(format!("{folder} ({crate_root}): {found}"));
        }
    }
    assert!(
        offenders.is_empty(),
        "re-exports pointing back up (import the item from the file that defines it):\n{}",
        offenders.join("\n")
    );
}

/// The circle finder on small crates: circles through `crate::`, `super::`, a child module's
/// bare name, a `use` group and a path in code are found; comments, strings, test modules and
/// other crates' paths make none; a chain without a way back is no circle.
#[test]
fn the_circle_finder_finds_circles() {
    let circles_of = |files: &[(&str, &str)]| {
        let files = synthetic_crate(files);
        import_circles(&crate_graph(&files, "lib.rs").edges)
    };
    let layered = [
        ("lib.rs", "mod a;\nmod b;\npub mod c;\npub use a::Top;\n"),
        ("a.rs", "use crate::b::Middle;\npub struct Top(Middle);\n"),
        (
            "b.rs",
            "use crate::c::{Bottom, more::Deep};\npub struct Middle(Bottom, Deep);\n",
        ),
        ("c/mod.rs", "pub mod more;\npub struct Bottom;\n"),
        ("c/more.rs", "pub struct Deep;\n"),
    ];
    assert_eq!(circles_of(&layered), Vec::<Vec<String>>::new());
    let graph = crate_graph(&synthetic_crate(&layered), "lib.rs");
    assert_eq!(
        graph.edges["b.rs"].keys().collect::<Vec<_>>(),
        ["c/mod.rs", "c/more.rs"]
    );

    // Two files through `crate::` and `super::`.
    let direct = [
        ("lib.rs", "mod a;\nmod b;\n"),
        ("a.rs", "use crate::b::B;\npub struct A;\n"),
        ("b.rs", "use super::a::A;\npub struct B;\n"),
    ];
    assert_eq!(circles_of(&direct), vec![vec!["a.rs", "b.rs"]]);

    // Three files around, one leg a path in code, one a `use` group.
    let around = [
        ("lib.rs", "mod x;\nmod y;\nmod z;\n"),
        ("x.rs", "pub fn f() { crate::y::g() }\n"),
        ("y.rs", "use crate::{z::h, other};\npub fn g() { h() }\n"),
        ("z.rs", "pub fn h() { super::x::f() }\n"),
    ];
    assert_eq!(circles_of(&around), vec![vec!["x.rs", "y.rs", "z.rs"]]);

    // A parent that uses its child by bare name and a child that uses the parent.
    let parent_child = [
        ("lib.rs", "mod p;\n"),
        ("p/mod.rs", "mod q;\nuse q::Q;\npub struct P;\n"),
        ("p/q.rs", "use super::P;\npub struct Q;\n"),
    ];
    assert_eq!(circles_of(&parent_child), vec![vec!["p/mod.rs", "p/q.rs"]]);

    // A root that re-exports its modules' items and defines what they use makes no circle; a
    // path through a re-export leads to the defining file; a root whose own code uses a module
    // that uses the root does.
    let facade = [
        (
            "lib.rs",
            "mod a;\npub mod p;\npub use a::Thing;\npub struct Error;\n",
        ),
        (
            "a.rs",
            "use crate::Error;\nuse crate::p::Q;\npub struct Thing(Error, Q);\n",
        ),
        ("p/mod.rs", "mod q;\npub use q::Q;\n"),
        ("p/q.rs", "pub struct Q;\n"),
    ];
    assert_eq!(circles_of(&facade), Vec::<Vec<String>>::new());
    let graph = crate_graph(&synthetic_crate(&facade), "lib.rs");
    assert_eq!(
        graph.edges["a.rs"].keys().collect::<Vec<_>>(),
        ["lib.rs", "p/q.rs"]
    );
    let mut tangled = facade;
    tangled[0].1 = "mod a;\npub mod p;\nuse a::Thing;\npub struct Error;\nfn f(_: Thing) {}\n";
    assert_eq!(circles_of(&tangled), vec![vec!["a.rs", "lib.rs"]]);

    // A file that re-exports an item of a file importing it points back up; a crate root or a
    // `mod.rs` doing so is a module's face, and a re-export of a lower file is no finding.
    let back = [
        (
            "lib.rs",
            "mod plan;\nmod build;\nmod low;\npub use build::build;\n",
        ),
        (
            "plan.rs",
            "pub use crate::build::build;\npub use crate::low::Low;\npub struct Plan;\n",
        ),
        (
            "build.rs",
            "use crate::plan::Plan;\npub fn build() -> Plan { Plan }\n",
        ),
        ("low.rs", "pub struct Low;\n"),
    ];
    let graph = crate_graph(&synthetic_crate(&back), "lib.rs");
    assert_eq!(circles_of(&back), Vec::<Vec<String>>::new());
    assert_eq!(
        reexports_pointing_back(&graph),
        ["plan.rs re-exports `build` from build.rs, which imports plan.rs"]
    );

    // Comments, strings, test modules and other crates do not count.
    let quiet = [
        ("lib.rs", "mod a;\nmod b;\n#[cfg(test)]\nmod tests;\n"),
        (
            "a.rs",
            "//! See [`crate::b`].\nuse crate::b::B;\n/* crate::b::B */\n\
             #[cfg(test)]\nmod tests {\n    use super::*;\n    use crate::b::B;\n}\n",
        ),
        (
            "b.rs",
            "// use crate::a::A;\nconst S: &str = \"crate::a::A\";\nconst R: &str = r#\"super::a\"#;\n\
             const C: char = '\"';\nuse other::a::A;\nuse std::fmt;\npub struct B<'a>(&'a str);\n\
             #[cfg(test)]\nuse crate::a::A;\n#[cfg(test)]\nfn t() { crate::a::A; }\n\
             pub(in crate::a) fn visible_in_a() {}\n",
        ),
        ("tests.rs", "use crate::a::A;\nuse crate::b::B;\n"),
    ];
    assert_eq!(circles_of(&quiet), Vec::<Vec<String>>::new());
    let graph = crate_graph(&synthetic_crate(&quiet), "lib.rs");
    assert!(graph.test_files.contains("tests.rs"));
    assert_eq!(graph.edges["a.rs"].keys().collect::<Vec<_>>(), ["b.rs"]);
    assert!(!graph.edges.contains_key("b.rs"), "{:?}", graph.edges);
}
