//! No file of one gateway API dialect imports another dialect's files; the check on a small
//! crate.

use std::collections::BTreeMap;

use crate::crate_graph::crate_graph;
use crate::helpers::{synthetic_crate, workspace_crate_graphs};

/// The gateway's API dialects. A file of a dialect is named by it or starts with it and `_`
/// (`openai_chunks.rs`); it parses and renders that API only, so a request flows one way
/// (dialect → neutral conversation → generation plan → engine → the same dialect) and no
/// dialect file imports another dialect's files.
const GATEWAY_DIALECTS: &[&str] = &["openai", "anthropic", "responses", "grpc_api"];

/// The gateway's source folder (relative to the workspace).
const GATEWAY_SOURCES: &str = "services/gateway/src";

/// The dialect of a gateway file (see [`GATEWAY_DIALECTS`]); `None` for shared files.
fn gateway_dialect(file: &str) -> Option<&'static str> {
    let stem = file.strip_suffix(".rs")?;
    GATEWAY_DIALECTS.iter().copied().find(|dialect| {
        stem.strip_prefix(dialect)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('_'))
    })
}

/// Every import from a file of one dialect into a file of another, described.
fn cross_dialect_imports(edges: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<String> {
    let mut found = Vec::new();
    for (from, targets) in edges {
        let Some(from_dialect) = gateway_dialect(from) else {
            continue;
        };
        for (to, path) in targets {
            if let Some(to_dialect) = gateway_dialect(to).filter(|d| *d != from_dialect) {
                found.push(format!(
                    "{from} ({from_dialect}) → {to} ({to_dialect}) (`{path}`)"
                ));
            }
        }
    }
    found
}

/// The gateway's request path is one pass per dialect: no dialect file imports a file of
/// another dialect (shared pieces live in the neutral modules: `chat`, `generation_plan`,
/// `generation`, `structured`, `tool_calls`).
#[test]
fn no_gateway_dialect_file_imports_another_dialect() {
    let graphs = workspace_crate_graphs();
    let (_, _, gateway) = graphs
        .iter()
        .find(|(folder, root, _)| folder == GATEWAY_SOURCES && root == "lib.rs")
        .expect("the gateway library is among the crates");
    for dialect in GATEWAY_DIALECTS {
        assert!(
            gateway
                .files_by_module
                .values()
                .any(|file| gateway_dialect(file) == Some(dialect)),
            "no file of the `{dialect}` dialect in {GATEWAY_SOURCES}: update GATEWAY_DIALECTS"
        );
    }
    let offenders = cross_dialect_imports(&gateway.edges);
    assert!(
        offenders.is_empty(),
        "gateway dialect files importing another dialect (move the shared piece to a neutral module):\n{}",
        offenders.join("\n")
    );
}

/// The dialect check on a small crate: an import between two dialects is found, imports within
/// one dialect and into shared modules are not.
#[test]
fn the_dialect_check_finds_an_import_between_dialects() {
    let files = synthetic_crate(&[
        (
            "lib.rs",
            "mod chat;\nmod openai;\nmod openai_chunks;\nmod responses;\nmod anthropic;\n",
        ),
        ("chat.rs", "pub fn neutral() {}\n"),
        (
            "openai.rs",
            "use crate::chat::neutral;\npub fn parse() { crate::openai_chunks::chunk(); neutral() }\n",
        ),
        ("openai_chunks.rs", "pub fn chunk() {}\n"),
        (
            "responses.rs",
            "pub fn parse() { crate::openai::parse(); crate::chat::neutral() }\n",
        ),
        ("anthropic.rs", "use crate::chat::neutral;\npub fn parse() { neutral() }\n"),
    ]);
    let graph = crate_graph(&files, "lib.rs");
    assert_eq!(gateway_dialect("openai_chunks.rs"), Some("openai"));
    assert_eq!(gateway_dialect("openai2.rs"), None);
    assert_eq!(gateway_dialect("chat.rs"), None);
    let found = cross_dialect_imports(&graph.edges);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("responses.rs (responses) → openai.rs (openai)"));
}
