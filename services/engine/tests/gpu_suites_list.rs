//! Every test that can run on a GPU is run by `scripts/gpu_tests.sh`, the only place the CUDA
//! cases run (CI has no GPU): each test target of the engine or the command-line crate with a
//! CUDA case (a `test_device!` suite, a test that opens a CUDA backend itself, or one that asks
//! whether a GPU is present) is one of its suites, every suite names a test target that exists
//! in its crate, and where a suite's filter picks some tests only, each CUDA-only test of the
//! target is named by the filter too.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What marks a test target, or one test, as one with a CUDA case.
const CUDA_MARKS: [&str; 4] = [
    "test_device!",
    "CudaBackend",
    "cuda_with_options_or_skip",
    "gpu_present(",
];

/// Test targets that name the marks without a CUDA case: this one, and the code-shape tests
/// that read sources.
const NOT_GPU_TESTS: [&str; 2] = ["gpu_suites_list", "code_shape"];

/// The test folder of the engine crate, or of the command-line crate.
fn tests_of(crate_folder: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(crate_folder)
        .join("tests")
}

fn gpu_tests_script() -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gpu_tests.sh");
    std::fs::read_to_string(script).expect("scripts/gpu_tests.sh")
}

/// The script's suites of the command-line crate (`CLI_SUITES`).
fn cli_suites(script: &str) -> Vec<String> {
    let line = script
        .lines()
        .find(|line| line.starts_with("CLI_SUITES="))
        .expect("the CLI_SUITES line");
    line.trim_start_matches("CLI_SUITES=")
        .trim_matches('"')
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// The script's suites: test target → its filter words.
fn suites(script: &str) -> BTreeMap<String, Vec<String>> {
    let start = script.find("SUITES=(").expect("the SUITES list");
    let end = start
        + script[start..]
            .find("\n)")
            .expect("the end of the SUITES list");
    script[start..end]
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

/// A crate's test targets and their source text (a folder target's files together).
fn test_targets(tests: &Path) -> BTreeMap<String, String> {
    let mut targets = BTreeMap::new();
    for entry in std::fs::read_dir(tests).expect("tests/").flatten() {
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

/// What is wrong with `targets` (one crate's) against the script's `suites`.
fn problems_of(
    targets: &BTreeMap<String, String>,
    suites: &BTreeMap<String, Vec<String>>,
    problems: &mut Vec<String>,
) {
    for (name, text) in targets {
        let has_cuda = CUDA_MARKS.iter().any(|mark| text.contains(mark));
        let Some(filter) = suites.get(name) else {
            if has_cuda && !NOT_GPU_TESTS.contains(&name.as_str()) {
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
                    "{name}::{test} has a CUDA case, but the suite's filter {filter:?} leaves it out"
                ));
            }
        }
    }
}

#[test]
fn every_test_with_a_cuda_case_runs_in_the_gpu_suites() {
    let script = gpu_tests_script();
    let suites = suites(&script);
    let cli = cli_suites(&script);
    assert!(suites.len() > 20, "found only {} suites", suites.len());
    let engine_targets = test_targets(&tests_of("engine"));
    let cli_targets = test_targets(&tests_of("cli"));
    let (cli_listed, engine_listed): (BTreeMap<_, _>, BTreeMap<_, _>) = suites
        .clone()
        .into_iter()
        .partition(|(name, _)| cli.contains(name));
    let mut problems = Vec::new();
    for (listed, targets, crate_name) in [
        (&engine_listed, &engine_targets, "the engine"),
        (&cli_listed, &cli_targets, "the command-line crate"),
    ] {
        for name in listed.keys() {
            if !targets.contains_key(name) {
                problems.push(format!(
                    "the suite {name} names no test target of {crate_name}"
                ));
            }
        }
        problems_of(targets, listed, &mut problems);
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
    let script = "CLI_SUITES=\" one two \"\nSUITES=(\n  \"a:\"\n  \"one:gpu_ x\"\n)\n";
    assert_eq!(cli_suites(script), vec!["one", "two"]);
    let listed = suites(script);
    assert_eq!(listed["a"], Vec::<String>::new());
    assert_eq!(listed["one"], vec!["gpu_", "x"]);
}
