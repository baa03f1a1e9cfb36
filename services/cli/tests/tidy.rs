//! Repository hygiene, checked on every `cargo test` (the shape of rust-analyzer's `tidy.rs`):
//! the product speaks of itself only. Module docs describe what the code is and does (not the
//! tickets, meetings or plans behind it); no product file links or refers outside the repository;
//! every test that ARCHITECTURE.md names for an invariant exists; scripts are tools for a user
//! (no remote-execution tool syntax).
//!
//! Owns: these text checks over the working tree. Must not touch: anything it reads (it reports,
//! it never rewrites).

use std::path::{Path, PathBuf};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the workspace root exists")
}

/// Extensions of the product's text files (binary fixtures and JSON references are not prose).
const TEXT_EXTENSIONS: &[&str] = &[
    "rs", "md", "sh", "py", "toml", "cu", "cuh", "proto", "service", "target", "env", "txt",
    "jinja", "yml", "yaml",
];

/// Folders that are build outputs or tool state, never product.
const SKIPPED_DIRECTORIES: &[&str] = &["target", ".git", "__pycache__", "node_modules"];

/// The product's top-level entries: code, docs, scripts, deployment, fixtures.
const PRODUCT_ENTRIES: &[&str] = &[
    "services",
    "kernels",
    "proto",
    "deploy",
    "docs",
    "scripts",
    "tests",
    "README.md",
    "ARCHITECTURE.md",
    "Cargo.toml",
];

fn collect_text_files(path: &Path, files: &mut Vec<PathBuf>) {
    if path.is_dir() {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if SKIPPED_DIRECTORIES.contains(&name) || (name.starts_with('.') && name.len() > 1) {
            return;
        }
        let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
            .unwrap_or_else(|error| panic!("reading {}: {error}", path.display()))
            .map(|entry| entry.expect("a directory entry").path())
            .collect();
        entries.sort();
        for entry in entries {
            collect_text_files(&entry, files);
        }
    } else if path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| TEXT_EXTENSIONS.contains(&e))
    {
        files.push(path.to_path_buf());
    }
}

/// Every product text file, as (path relative to the root, contents).
fn product_text_files() -> Vec<(String, String)> {
    let root = workspace_root();
    let mut files = Vec::new();
    for entry in PRODUCT_ENTRIES {
        collect_text_files(&root.join(entry), &mut files);
    }
    files
        .into_iter()
        .filter_map(|path| {
            let text = std::fs::read_to_string(&path).ok()?;
            let relative = path.strip_prefix(&root).ok()?.to_string_lossy().to_string();
            Some((relative, text))
        })
        .collect()
}

fn is_word_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_'
}

/// Whether `word` occurs in `text` (ASCII case-insensitive) with no word character on either side.
fn contains_word(text: &str, word: &str) -> bool {
    let haystack = text.to_ascii_lowercase();
    let needle = word.to_ascii_lowercase();
    let bytes = haystack.as_bytes();
    haystack.match_indices(&needle).any(|(start, _)| {
        let end = start + needle.len();
        (start == 0 || !is_word_byte(bytes[start - 1]))
            && (end == bytes.len() || !is_word_byte(bytes[end]))
    })
}

/// A numbered ticket: the word "issue" or "issues" followed by a number, with or without `#`,
/// and a bare `#` followed by digits (not an HTML entity's `&#`, not an attribute's `#[`).
fn names_an_issue(text: &str) -> bool {
    let lower = text.to_ascii_lowercase();
    let bytes = lower.as_bytes();
    let issue_number = lower.match_indices("issue").any(|(start, _)| {
        if start > 0 && is_word_byte(bytes[start - 1]) {
            return false;
        }
        let rest = lower[start + "issue".len()..].trim_start_matches('s');
        let rest = rest.trim_start_matches(' ').trim_start_matches('#');
        rest.starts_with(|c: char| c.is_ascii_digit())
    });
    let hash_number = lower.match_indices('#').any(|(start, _)| {
        let before_ok = start == 0 || !(is_word_byte(bytes[start - 1]) || bytes[start - 1] == b'&');
        before_ok && bytes.get(start + 1).is_some_and(u8::is_ascii_digit)
    });
    issue_number || hash_number
}

/// Words of the work process or of plans rather than of the product, as (description, test).
fn process_words(text: &str) -> Vec<&'static str> {
    let mut found = Vec::new();
    if names_an_issue(text) {
        found.push("an issue number");
    }
    if contains_word(text, "session") || contains_word(text, "sessions") {
        found.push("a work session");
    }
    for future in ["(later)", "coming", "will be"] {
        if contains_word(text, future) {
            found.push(future);
        }
    }
    found
}

/// Module docs (`//!`) anywhere in services/ say what the code is and does now.
#[test]
fn module_docs_speak_of_the_product_only() {
    let mut offenders = Vec::new();
    for (path, text) in product_text_files() {
        if !(path.starts_with("services/") && path.ends_with(".rs")) {
            continue;
        }
        for (index, line) in text.lines().enumerate() {
            let Some(doc) = line.trim_start().strip_prefix("//!") else {
                continue;
            };
            let words = process_words(doc);
            if !words.is_empty() {
                offenders.push(format!(
                    "{path}:{}: {} in `{}`",
                    index + 1,
                    words.join(", "),
                    doc.trim()
                ));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "module docs must describe the product, not issues, work sessions or plans:\n{}",
        offenders.join("\n")
    );
}

/// No product file (code, comments, docs, scripts) names an issue number: the history of a
/// change lives in git, the product describes what is.
#[test]
fn no_product_file_names_an_issue() {
    let mut offenders = Vec::new();
    for (path, text) in product_text_files() {
        for (index, line) in text.lines().enumerate() {
            if names_an_issue(line) && !is_a_shebang_or_markdown_heading(&path, line) {
                offenders.push(format!("{path}:{}: {}", index + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "product files must not name issues (say what the code does instead):\n{}",
        offenders.join("\n")
    );
}

/// `#!/usr/bin/env` and `# 1. Heading` are not issue numbers.
fn is_a_shebang_or_markdown_heading(path: &str, line: &str) -> bool {
    let trimmed = line.trim_start();
    trimmed.starts_with("#!") || (path.ends_with(".md") && trimmed.starts_with("# "))
}

/// The repository stands alone: no product file links or refers to a path outside it.
#[test]
fn no_product_file_refers_outside_the_repository() {
    // Spelled in pieces so that this file does not match itself.
    let outside = [concat!("..", "/shared"), concat!("/wo", "rk/")];
    let mut offenders = Vec::new();
    for (path, text) in product_text_files() {
        for (index, line) in text.lines().enumerate() {
            for pattern in outside {
                if line.contains(pattern) {
                    offenders.push(format!(
                        "{path}:{}: `{pattern}` in {}",
                        index + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "product files must not refer outside the repository:\n{}",
        offenders.join("\n")
    );
}

/// The targets of a Markdown text's inline links (`[text](target)`), without `#anchor`s; web
/// addresses, mail addresses and in-page anchors left out.
fn markdown_link_targets(text: &str) -> Vec<String> {
    text.match_indices("](")
        .filter_map(|(start, _)| {
            let rest = &text[start + 2..];
            let target = &rest[..rest.find(')')?];
            let target = target.split('#').next().unwrap_or_default().trim();
            let external = target.is_empty()
                || target.contains("://")
                || target.starts_with("mailto:")
                || target.contains(' ');
            (!external).then(|| target.to_string())
        })
        .collect()
}

/// Every relative link of the Markdown documents leads to a file or folder of the repository.
#[test]
fn markdown_links_resolve_inside_the_repository() {
    let root = workspace_root();
    let mut offenders = Vec::new();
    for (path, text) in product_text_files() {
        if !path.ends_with(".md") {
            continue;
        }
        let directory = Path::new(&path).parent().unwrap_or(Path::new(""));
        for target in markdown_link_targets(&text) {
            let mut resolved = PathBuf::new();
            let mut escapes = false;
            for component in directory.join(&target).components() {
                match component {
                    std::path::Component::ParentDir => escapes |= !resolved.pop(),
                    std::path::Component::Normal(part) => resolved.push(part),
                    std::path::Component::CurDir => {}
                    std::path::Component::RootDir | std::path::Component::Prefix(_) => {
                        escapes = true
                    }
                }
            }
            if escapes {
                offenders.push(format!("{path}: `{target}` leads outside the repository"));
            } else if !root.join(&resolved).exists() {
                offenders.push(format!("{path}: `{target}` does not exist"));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "Markdown links must lead to files of the repository:\n{}",
        offenders.join("\n")
    );
}

/// Scripts are tools for a user with a GPU machine, not transcripts of a remote-execution tool.
#[test]
fn scripts_carry_no_device_tool_syntax() {
    let tool_syntax = [
        concat!("run(", "command="),
        concat!("carry", "="),
        concat!(".dev", "bin"),
        concat!("device ", "call"),
    ];
    let mut offenders = Vec::new();
    for (path, text) in product_text_files() {
        if !path.starts_with("scripts/") {
            continue;
        }
        for (index, line) in text.lines().enumerate() {
            for pattern in tool_syntax {
                if line.contains(pattern) {
                    offenders.push(format!(
                        "{path}:{}: `{pattern}` in {}",
                        index + 1,
                        line.trim()
                    ));
                }
            }
            if contains_word(line, "session") || contains_word(line, "sessions") {
                offenders.push(format!(
                    "{path}:{}: a work session in {}",
                    index + 1,
                    line.trim()
                ));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "scripts must not carry device-tool syntax or work-session words:\n{}",
        offenders.join("\n")
    );
}

/// The tests named for the invariants of ARCHITECTURE.md: the backticked names on the `Tests:`
/// line that ends each invariant bullet.
fn architecture_invariant_tests() -> Vec<(String, Vec<String>)> {
    let text = std::fs::read_to_string(workspace_root().join("ARCHITECTURE.md"))
        .expect("ARCHITECTURE.md exists");
    let section = text
        .split_once("## Architecture invariants")
        .map(|(_, rest)| rest)
        .expect("ARCHITECTURE.md has an `## Architecture invariants` section");
    let section = section.split("\n## ").next().unwrap_or(section);
    let mut invariants: Vec<(String, String)> = Vec::new();
    for line in section.lines() {
        if let Some(bullet) = line.strip_prefix("- ") {
            invariants.push((bullet.to_string(), String::new()));
        } else if let Some((_, body)) = invariants.last_mut() {
            if line.starts_with("  ") {
                body.push_str(line);
                body.push('\n');
            } else if !line.trim().is_empty() {
                invariants.push((line.to_string(), String::new()));
            }
        }
    }
    invariants
        .into_iter()
        .map(|(title, body)| {
            let whole = format!("{title}\n{body}");
            let tests_line = whole
                .split_once("Tests:")
                .map(|(_, tests)| tests.to_string())
                .unwrap_or_default();
            let names = tests_line
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_string)
                .collect();
            (title, names)
        })
        .collect()
}

/// Every invariant names its tests, and every test it names exists: `file.rs` (the file),
/// `file.rs::name` (a `fn name` in that file), or `name` (a `fn name` in the file named last
/// before it on the line, as `a.rs::x`, `y` reads; before any file, somewhere in services/).
#[test]
fn architecture_invariants_name_tests_that_exist() {
    let root = workspace_root();
    let rust_sources: Vec<(String, String)> = product_text_files()
        .into_iter()
        .filter(|(path, _)| path.starts_with("services/") && path.ends_with(".rs"))
        .collect();
    let defines = |text: &str, name: &str| {
        text.match_indices(&format!("fn {name}"))
            .any(|(start, matched)| {
                let end = start + matched.len();
                text.as_bytes()
                    .get(end)
                    .is_none_or(|byte| !is_word_byte(*byte))
            })
    };
    let invariants = architecture_invariant_tests();
    assert!(invariants.len() >= 5, "found only {invariants:?}");
    let mut offenders = Vec::new();
    for (title, names) in &invariants {
        let title: String = title.chars().take(70).collect();
        if names.is_empty() {
            offenders.push(format!(
                "`{title}…` names no test (end it with a `Tests:` line)"
            ));
        }
        let mut last_file: Option<String> = None;
        for name in names {
            let (file, function) = match name.split_once(".rs::") {
                Some((file, function)) => (Some(format!("{file}.rs")), Some(function)),
                None if name.ends_with(".rs") => (Some(name.clone()), None),
                None => (last_file.clone(), Some(name.as_str())),
            };
            last_file.clone_from(&file);
            let exists = match (&file, function) {
                (Some(file), None) => root.join(file).is_file(),
                (Some(file), Some(function)) => std::fs::read_to_string(root.join(file))
                    .is_ok_and(|text| defines(&text, function)),
                (None, Some(function)) => {
                    rust_sources.iter().any(|(_, text)| defines(text, function))
                }
                (None, None) => false,
            };
            if !exists {
                let place = file.map_or(String::new(), |file| format!(" in {file}"));
                offenders.push(format!(
                    "`{title}…` names `{name}`, which does not exist{place}"
                ));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "ARCHITECTURE.md invariants must name tests that exist:\n{}",
        offenders.join("\n")
    );
}

#[test]
fn the_word_checks_find_what_they_should() {
    // Spelled in pieces so that this file does not match itself.
    assert!(names_an_issue(concat!("issue", " 7")));
    assert!(names_an_issue(concat!("Issue", " 8's acceptance")));
    assert!(names_an_issue(concat!("issues", " 6 and 7")));
    assert!(names_an_issue(concat!("see #", "12")));
    assert!(names_an_issue(concat!("issue #", "3")));
    assert!(!names_an_issue("#[derive(Debug)]"));
    assert!(!names_an_issue("no issue here"));
    assert!(!names_an_issue(concat!("tissue", " 5")));
    assert!(contains_word("a coming backend", "coming"));
    assert!(!contains_word("incoming requests", "coming"));
    assert!(contains_word("it (later) serves", "(later)"));
    assert!(!contains_word("finished later", "(later)"));
    assert!(contains_word("this Backend's", "backend"));
}
