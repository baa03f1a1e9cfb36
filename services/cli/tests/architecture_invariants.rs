//! The architecture invariants of ARCHITECTURE.md, checked against the manifests and sources.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Crate directory → (package name, dependency names of `[dependencies]`).
fn manifests() -> BTreeMap<String, (String, Vec<String>)> {
    let mut crates = BTreeMap::new();
    let services = workspace_root().join("services");
    let programs = std::fs::read_dir(&services).unwrap();
    let libraries = std::fs::read_dir(services.join("lib")).unwrap();
    for entry in programs.chain(libraries) {
        let directory = entry.unwrap().path();
        let Ok(text) = std::fs::read_to_string(directory.join("Cargo.toml")) else {
            continue;
        };
        let mut section = String::new();
        let mut name = String::new();
        let mut dependencies = Vec::new();
        for line in text.lines().map(str::trim) {
            if line.starts_with('[') {
                section = line.to_string();
            } else if let Some((key, value)) = line.split_once('=') {
                let key = key.trim().to_string();
                if section == "[package]" && key == "name" {
                    name = value.trim().trim_matches('"').to_string();
                } else if section == "[dependencies]" {
                    dependencies.push(key);
                }
            }
        }
        crates.insert(
            directory
                .strip_prefix(&services)
                .unwrap()
                .to_string_lossy()
                .to_string(),
            (name, dependencies),
        );
    }
    crates
}

/// Dependencies point one way: each crate may use only the workspace crates listed here.
#[test]
fn workspace_dependencies_point_one_way() {
    let allowed: BTreeMap<&str, &[&str]> = BTreeMap::from([
        ("ninfer-artifact", &[][..]),
        ("ninfer-protocol", &[][..]),
        ("ninfer-channel", &[][..]),
        ("ninfer-convert", &["ninfer-artifact"][..]),
        ("ninfer-cpu-experts", &["ninfer-artifact"][..]),
        (
            "ninfer-engine",
            &[
                "ninfer-artifact",
                "ninfer-cpu-experts",
                "ninfer-protocol",
                "ninfer-channel",
            ][..],
        ),
        (
            "ninfer-expert-worker",
            &[
                "ninfer-artifact",
                "ninfer-cpu-experts",
                "ninfer-protocol",
                "ninfer-channel",
            ][..],
        ),
        ("ninfer-gateway", &["ninfer-protocol"][..]),
        (
            "ninfer",
            &[
                "ninfer-artifact",
                "ninfer-convert",
                "ninfer-engine",
                "ninfer-cpu-experts",
                "ninfer-protocol",
                "ninfer-channel",
            ][..],
        ),
    ]);
    let crates = manifests();
    assert!(crates.len() >= allowed.len(), "found only {crates:?}");
    for (directory, (name, dependencies)) in &crates {
        let permitted = allowed.get(name.as_str()).unwrap_or_else(|| panic!("services/{directory}: crate `{name}` is not in the dependency map of this test and ARCHITECTURE.md"));
        for dependency in dependencies.iter().filter(|d| d.starts_with("ninfer")) {
            assert!(
                permitted.contains(&dependency.as_str()),
                "`{name}` must not depend on `{dependency}` (see ARCHITECTURE.md)"
            );
        }
    }
}

/// Only the engine talks to the GPU; the gateway and the expert workers never link CUDA.
#[test]
fn only_the_engine_links_cuda() {
    for (name, dependencies) in manifests().values() {
        if name != "ninfer-engine" {
            assert!(
                !dependencies.iter().any(|d| d == "cudarc"),
                "`{name}` must not depend on cudarc"
            );
        }
    }
}

/// The gateway never touches weights: it does not depend on the artifact or engine crates.
#[test]
fn gateway_never_touches_weights() {
    let crates = manifests();
    let (_, dependencies) = crates
        .values()
        .find(|(name, _)| name == "ninfer-gateway")
        .unwrap();
    for forbidden in [
        "ninfer-artifact",
        "ninfer-engine",
        "ninfer-cpu-experts",
        "memmap2",
    ] {
        assert!(
            !dependencies.iter().any(|d| d == forbidden),
            "gateway depends on {forbidden}"
        );
    }
}

/// Every crate opens with a module doc saying what it owns and must not touch.
#[test]
fn every_crate_root_has_an_ownership_doc() {
    for directory in manifests().keys() {
        let source = workspace_root()
            .join("services")
            .join(directory)
            .join("src");
        for root in ["lib.rs", "main.rs"] {
            let Ok(text) = std::fs::read_to_string(source.join(root)) else {
                continue;
            };
            assert!(
                text.trim_start().starts_with("//!"),
                "services/{directory}/src/{root} has no module doc"
            );
        }
        if let Ok(text) = std::fs::read_to_string(source.join("lib.rs")) {
            let doc: String = text
                .lines()
                .take_while(|l| l.starts_with("//!"))
                .collect::<Vec<_>>()
                .join("\n");
            assert!(doc.contains("Owns") && doc.contains("Must not"), "services/{directory}/src/lib.rs: the module doc must say what it owns and what it must not touch");
        }
    }
}
