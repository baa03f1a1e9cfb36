//! Every engine test that can run on a GPU is run by `scripts/gpu_tests.sh`, the only place the
//! CUDA cases run (CI has no GPU): each test target with a CUDA case (a `test_device!` suite, or
//! a test that opens a CUDA backend itself) is one of its suites, every suite names a test
//! target that exists, and where a suite's filter picks the `::cuda` cases of the
//! device-parametrized tests, each CUDA-only test of the target is named in the filter too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What marks a test target, or one test, as one with a CUDA case.
const CUDA_MARKS: [&str; 3] = ["test_device!", "CudaBackend", "cuda_with_options_or_skip"];

fn engine_tests() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests")
}

/// `scripts/gpu_tests.sh`'s suites: test target → its filter words.
fn suites() -> BTreeMap<String, Vec<String>> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gpu_tests.sh");
    let text = std::fs::read_to_string(&script).expect("scripts/gpu_tests.sh");
    let start = text.find("SUITES=(").expect("the SUITES list");
    let end = start
        + text[start..]
            .find("\n)")
            .expect("the end of the SUITES list");
    text[start..end]
        .lines()
        .skip(1)
        .filter_map(|line| line.trim().strip_prefix('"')?.strip_suffix('"'))
        .map(|entry| {
            let (name, filter) = entry.split_once(':').unwrap_or((entry, ""));
            let words = filter.split_whitespace().map(str::to_string).collect();
            (name.to_string(), words)
        })
        .collect()
}

/// The engine's test targets and their source text (a folder target's files together).
fn test_targets() -> BTreeMap<String, String> {
    let mut targets = BTreeMap::new();
    for entry in std::fs::read_dir(engine_tests()).expect("tests/").flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().to_string();
        if let Some(stem) = name.strip_suffix(".rs") {
            let text = std::fs::read_to_string(&path).expect("a test file");
            targets.insert(stem.to_string(), text);
        } else if path.join("main.rs").exists() {
            let mut text = String::new();
            for file in std::fs::read_dir(&path).expect("a test folder").flatten() {
                if file.path().extension().is_some_and(|e| e == "rs") {
                    text += &std::fs::read_to_string(file.path()).expect("a test file");
                }
            }
            targets.insert(name, text);
        }
    }
    targets
}

/// The plain `#[test]` functions of `text` whose bodies carry a CUDA mark.
fn cuda_only_tests(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (at, _) in text.match_indices("#[test]") {
        let rest = &text[at..];
        let Some(fn_at) = rest.find("fn ") else {
            continue;
        };
        let name: String = rest[fn_at + 3..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // The body: up to the next item at the start of a line.
        let body_end = rest[fn_at..]
            .find("\n}\n")
            .map_or(rest.len(), |end| fn_at + end);
        if CUDA_MARKS
            .iter()
            .any(|mark| rest[fn_at..body_end].contains(mark))
        {
            found.push(name);
        }
    }
    found
}

#[test]
fn every_test_with_a_cuda_case_runs_in_the_gpu_suites() {
    let suites = suites();
    let targets = test_targets();
    assert!(suites.len() > 20, "found only {} suites", suites.len());
    let mut problems = Vec::new();
    for name in suites.keys() {
        if !targets.contains_key(name) {
            problems.push(format!(
                "the suite {name} names no test target of the engine"
            ));
        }
    }
    for (name, text) in &targets {
        let has_cuda = CUDA_MARKS.iter().any(|mark| text.contains(mark));
        let Some(filter) = suites.get(name) else {
            if has_cuda && name != "gpu_suites_list" {
                problems.push(format!("{name} has CUDA cases but is not a GPU suite"));
            }
            continue;
        };
        // An empty filter runs every test of the target.
        if filter.is_empty() {
            continue;
        }
        for test in cuda_only_tests(text) {
            if !filter.iter().any(|word| test.contains(word.as_str())) {
                problems.push(format!(
                    "{name}::{test} opens a CUDA backend, but the suite's filter {filter:?} leaves it out"
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "scripts/gpu_tests.sh misses GPU tests:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_list_check_finds_what_it_should() {
    let text = "#[test]\nfn on_the_gpu() {\n    let Some(b) = cuda_with_options_or_skip(\"x\", o) else { return };\n}\n\n#[test]\nfn on_the_host() {\n    let b = CpuBackend::new();\n}\n";
    assert_eq!(cuda_only_tests(text), vec!["on_the_gpu".to_string()]);
}
