//! The architecture invariants of ARCHITECTURE.md about crates, checked against the workspace
//! as `cargo metadata` describes it (every member, its dependencies and its root sources).
//!
//! Owns: the allowed dependency map between workspace crates. Must not touch: the manifests
//! (it reads them through cargo, it never edits them).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One workspace crate as `cargo metadata` describes it.
struct WorkspaceCrate {
    name: String,
    /// The manifest's directory, relative to the workspace root (`services/lib/artifact`).
    directory: String,
    /// Names of its normal and build dependencies (dev-dependencies are tests' business).
    dependencies: Vec<String>,
    /// Source files of its library and binary targets (`src/lib.rs`, `src/main.rs`).
    root_sources: Vec<PathBuf>,
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The workspace's crates and dependencies, read from `cargo metadata --no-deps` (run with the
/// `cargo` that runs this test, `$CARGO`), so a crate added anywhere in the workspace is seen.
fn workspace_crates() -> Vec<WorkspaceCrate> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(&cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(workspace_root())
        .output()
        .unwrap_or_else(|error| panic!("running {cargo:?} metadata: {error}"));
    assert!(
        output.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("cargo metadata prints JSON");
    let root = PathBuf::from(
        metadata["workspace_root"]
            .as_str()
            .expect("metadata names the workspace root"),
    );
    let packages = metadata["packages"]
        .as_array()
        .expect("metadata lists packages");
    packages
        .iter()
        .map(|package| {
            let text = |value: &serde_json::Value| value.as_str().unwrap_or_default().to_string();
            let manifest = PathBuf::from(text(&package["manifest_path"]));
            let directory = manifest
                .parent()
                .and_then(|directory| directory.strip_prefix(&root).ok())
                .map(|directory| directory.to_string_lossy().to_string())
                .unwrap_or_default();
            let dependencies = package["dependencies"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|dependency| dependency["kind"].as_str() != Some("dev"))
                .map(|dependency| text(&dependency["name"]))
                .collect();
            let root_sources = package["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|target| {
                    target["kind"].as_array().is_some_and(|kinds| {
                        kinds
                            .iter()
                            .any(|kind| matches!(kind.as_str(), Some("lib" | "bin")))
                    })
                })
                .map(|target| PathBuf::from(text(&target["src_path"])))
                .collect();
            WorkspaceCrate {
                name: text(&package["name"]),
                directory,
                dependencies,
                root_sources,
            }
        })
        .collect()
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
        ("ninfer-vision-input", &[][..]),
        (
            "ninfer-engine",
            &[
                "ninfer-artifact",
                "ninfer-cpu-experts",
                "ninfer-protocol",
                "ninfer-channel",
                "ninfer-vision-input",
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
        (
            "ninfer-gateway",
            &["ninfer-protocol", "ninfer-vision-input"][..],
        ),
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
    let crates = workspace_crates();
    assert!(
        crates.len() >= allowed.len(),
        "cargo metadata found only {:?}",
        crates.iter().map(|c| &c.name).collect::<Vec<_>>()
    );
    for workspace_crate in &crates {
        let name = &workspace_crate.name;
        let permitted = allowed.get(name.as_str()).unwrap_or_else(|| {
            panic!(
                "{}: crate `{name}` is not in the dependency map of this test and ARCHITECTURE.md",
                workspace_crate.directory
            )
        });
        for dependency in workspace_crate
            .dependencies
            .iter()
            .filter(|d| d.starts_with("ninfer"))
        {
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
    for workspace_crate in workspace_crates() {
        if workspace_crate.name != "ninfer-engine" {
            assert!(
                !workspace_crate.dependencies.iter().any(|d| d == "cudarc"),
                "`{}` must not depend on cudarc",
                workspace_crate.name
            );
        }
    }
}

/// The gateway never touches weights: it does not depend on the artifact or engine crates.
#[test]
fn gateway_never_touches_weights() {
    let crates = workspace_crates();
    let gateway = crates
        .iter()
        .find(|c| c.name == "ninfer-gateway")
        .expect("the workspace has the ninfer-gateway crate");
    for forbidden in [
        "ninfer-artifact",
        "ninfer-engine",
        "ninfer-cpu-experts",
        "memmap2",
    ] {
        assert!(
            !gateway.dependencies.iter().any(|d| d == forbidden),
            "gateway depends on {forbidden}"
        );
    }
}

/// Every crate opens with a module doc saying what it owns and must not touch.
#[test]
fn every_crate_root_has_an_ownership_doc() {
    for workspace_crate in workspace_crates() {
        for root in &workspace_crate.root_sources {
            let shown = root.display();
            let text = std::fs::read_to_string(root)
                .unwrap_or_else(|error| panic!("reading {shown}: {error}"));
            assert!(
                text.trim_start().starts_with("//!"),
                "{shown} has no module doc"
            );
            if root.file_name().is_some_and(|name| name == "lib.rs") {
                let doc: String = text
                    .lines()
                    .take_while(|l| l.starts_with("//!"))
                    .collect::<Vec<_>>()
                    .join("\n");
                assert!(
                    doc.contains("Owns") && doc.contains("Must not"),
                    "{shown}: the module doc must say what it owns and what it must not touch"
                );
            }
        }
    }
}
