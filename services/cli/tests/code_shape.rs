//! The shape of the code, checked on every `cargo test`: no source file grows past
//! [`MAX_SOURCE_LINES`] lines (one job per file), and no two files of one crate import each other,
//! directly or around a longer circle (the modules of a crate form layers, each using only what
//! is below it), and no file of one gateway API dialect imports another dialect's files (a
//! request flows one way: dialect → neutral conversation → generation plan → engine → dialect).
//!
//! Imports are read from the source text: every `use` tree and every path in code that starts
//! with `crate::`, `super::`, `self::` or a child module's name, resolved to the file of the
//! longest module prefix it names. A re-export (`pub use`) is a module's face, not a use by its
//! code: it is no import of its own, and a path through it leads on to the file that defines the
//! item (a crate root or a `mod.rs` that re-exports its children's items makes no circle with
//! them; one whose own code uses them while they use it does; any other file that re-exports an
//! item of a file importing it points back up and is reported). Comments, strings, visibilities
//! (`pub(in crate::a)`) and `#[cfg(test)]` items do not count (a test module may use anything of
//! its file's parents). Files reached only through a `#[cfg(test)] mod` are test files and have
//! no line limit.
//!
//! Owns: the line limit, the circle finder, the dialect check and their allowlists (each entry
//! a known debt that its owner removes). Must not touch: the sources it reads.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Most lines of a non-test source file (a file near 1,000 lines is due for a split).
const MAX_SOURCE_LINES: usize = 1200;

/// Source files allowed past [`MAX_SOURCE_LINES`] for now, to be split by their owner (remove the
/// entry with the split).
const OVERSIZED_FILES_TO_SPLIT: &[&str] = &[];

/// Import circles allowed for now, to be removed by their owner (remove the entry with the
/// fix). A circle passes when its files are all in one entry.
const IMPORT_CIRCLES_TO_REMOVE: &[&[&str]] = &[];

/// The gateway's API dialects. A file of a dialect is named by it or starts with it and `_`
/// (`openai_chunks.rs`); it parses and renders that API only, so a request flows one way
/// (dialect → neutral conversation → generation plan → engine → the same dialect) and no
/// dialect file imports another dialect's files.
const GATEWAY_DIALECTS: &[&str] = &["openai", "anthropic", "responses", "grpc_api"];

/// The gateway's source folder (relative to the workspace).
const GATEWAY_SOURCES: &str = "services/gateway/src";

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

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the workspace root exists")
}

/// A token of Rust source; comments, strings, characters and numbers are dropped.
#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    PathSeparator,
    Punct(char),
}

fn is_ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

fn is_ident_continue(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Skips a string whose opening `"` is at `at` (escapes honoured); returns the index after it.
fn skip_string(chars: &[char], mut at: usize) -> usize {
    at += 1;
    while at < chars.len() {
        match chars[at] {
            '\\' => at += 2,
            '"' => return at + 1,
            _ => at += 1,
        }
    }
    at
}

/// Skips a raw string `r#*"…"#*` whose `#`s or `"` start at `at`; `None` when no `"` follows
/// the `#`s (a raw identifier).
fn skip_raw_string(chars: &[char], at: usize) -> Option<usize> {
    let hashes = chars[at..].iter().take_while(|&&c| c == '#').count();
    if chars.get(at + hashes) != Some(&'"') {
        return None;
    }
    let mut index = at + hashes + 1;
    while index < chars.len() {
        if chars[index] == '"'
            && chars[index + 1..]
                .iter()
                .take(hashes)
                .filter(|&&c| c == '#')
                .count()
                == hashes
        {
            return Some(index + 1 + hashes);
        }
        index += 1;
    }
    Some(index)
}

/// The tokens of `source`.
fn tokenize(source: &str) -> Vec<Token> {
    let chars: Vec<char> = source.chars().collect();
    let mut tokens = Vec::new();
    let mut at = 0;
    while at < chars.len() {
        let c = chars[at];
        let next = chars.get(at + 1).copied();
        if c.is_whitespace() {
            at += 1;
        } else if c == '/' && next == Some('/') {
            while at < chars.len() && chars[at] != '\n' {
                at += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while at < chars.len() {
                if chars[at] == '/' && chars.get(at + 1) == Some(&'*') {
                    depth += 1;
                    at += 2;
                } else if chars[at] == '*' && chars.get(at + 1) == Some(&'/') {
                    depth -= 1;
                    at += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    at += 1;
                }
            }
        } else if c == '"' {
            at = skip_string(&chars, at);
        } else if c == '\'' {
            // A character (`'x'`, `'\n'`) or a lifetime (`'a`: only the quote is dropped).
            if next == Some('\\') {
                at += 2;
                while at < chars.len() && chars[at] != '\'' {
                    at += 1;
                }
                at += 1;
            } else if chars.get(at + 2) == Some(&'\'') {
                at += 3;
            } else {
                at += 1;
            }
        } else if c.is_ascii_digit() {
            while at < chars.len() && is_ident_continue(chars[at]) {
                at += 1;
            }
        } else if is_ident_start(c) {
            let start = at;
            while at < chars.len() && is_ident_continue(chars[at]) {
                at += 1;
            }
            let word: String = chars[start..at].iter().collect();
            let prefix_of_literal = matches!(word.as_str(), "r" | "br" | "b" | "c" | "cr");
            match chars.get(at) {
                Some('"') if prefix_of_literal => at = skip_string(&chars, at),
                Some('#') if word == "r" || word == "br" || word == "cr" => {
                    match skip_raw_string(&chars, at) {
                        Some(end) => at = end,
                        // `r#name`: the identifier after the `#`.
                        None => at += 1,
                    }
                }
                Some('\'') if word == "b" => {
                    tokens.push(Token::Punct(' '));
                    at = if chars.get(at + 1) == Some(&'\\') {
                        let mut end = at + 2;
                        while end < chars.len() && chars[end] != '\'' {
                            end += 1;
                        }
                        end + 1
                    } else {
                        at + 3
                    };
                }
                _ => tokens.push(Token::Ident(word)),
            }
        } else if c == ':' && next == Some(':') {
            tokens.push(Token::PathSeparator);
            at += 2;
        } else {
            tokens.push(Token::Punct(c));
            at += 1;
        }
    }
    tokens
}

/// What one file says about modules and imports.
#[derive(Debug, Default)]
struct FileItems {
    /// `mod name;` declarations, with whether they are `#[cfg(test)]`.
    child_modules: Vec<(String, bool)>,
    /// Paths the file's code names, each with the inline (non-test) modules it sits in.
    paths: Vec<(Vec<String>, Vec<String>)>,
    /// Named re-exports (`pub use path as name`) at the file's top level: (name, path).
    reexports: Vec<(String, Vec<String>)>,
}

fn ident(tokens: &[Token], at: usize) -> Option<&str> {
    match tokens.get(at) {
        Some(Token::Ident(word)) => Some(word),
        _ => None,
    }
}

/// Index after the bracket group opened at `at` (`open` … `close`, nested).
fn skip_group(tokens: &[Token], at: usize, open: char, close: char) -> usize {
    let mut depth = 0usize;
    let mut index = at;
    while index < tokens.len() {
        if tokens[index] == Token::Punct(open) {
            depth += 1;
        } else if tokens[index] == Token::Punct(close) {
            depth = depth.saturating_sub(1);
            if depth == 0 {
                return index + 1;
            }
        }
        index += 1;
    }
    index
}

/// Whether the attribute starting at `at` (`#`) is exactly `#[cfg(test)]`.
fn is_cfg_test(tokens: &[Token], at: usize) -> bool {
    let expected = [
        Token::Punct('#'),
        Token::Punct('['),
        Token::Ident("cfg".into()),
        Token::Punct('('),
        Token::Ident("test".into()),
        Token::Punct(')'),
        Token::Punct(']'),
    ];
    tokens.get(at..at + expected.len()) == Some(&expected[..])
}

/// Whether the item whose keyword is at `at` is `pub` (`pub`, `pub(crate)`, `pub(super)`, …).
fn is_public(tokens: &[Token], at: usize) -> bool {
    match at.checked_sub(1).map(|i| &tokens[i]) {
        Some(Token::Ident(word)) => word == "pub",
        Some(Token::Punct(')')) => {
            let open = (0..at - 1).rev().find(|&i| tokens[i] == Token::Punct('('));
            open.and_then(|i| i.checked_sub(1))
                .is_some_and(|i| ident(tokens, i) == Some("pub"))
        }
        _ => false,
    }
}

/// Reads one use tree at `at` under `prefix`, pushing each full path with the name it binds
/// (`None` for a glob); returns the index after it.
fn read_use_tree(
    tokens: &[Token],
    mut at: usize,
    prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, Option<String>)>,
) -> usize {
    let mut path = prefix;
    loop {
        match tokens.get(at) {
            Some(Token::PathSeparator) => at += 1,
            Some(Token::Ident(word)) => {
                if word != "self" || path.is_empty() {
                    path.push(word.clone());
                }
                at += 1;
                if tokens.get(at) == Some(&Token::PathSeparator) {
                    at += 1;
                    continue;
                }
                let mut name = path.last().cloned();
                if ident(tokens, at) == Some("as") {
                    name = ident(tokens, at + 1).map(str::to_string);
                    at += 2;
                }
                out.push((path, name));
                return at;
            }
            Some(Token::Punct('*')) => {
                out.push((path, None));
                return at + 1;
            }
            Some(Token::Punct('{')) => {
                at += 1;
                while at < tokens.len() && tokens[at] != Token::Punct('}') {
                    let before = at;
                    at = read_use_tree(tokens, at, path.clone(), out);
                    if tokens.get(at) == Some(&Token::Punct(',')) {
                        at += 1;
                    }
                    if at == before {
                        at += 1;
                    }
                }
                return at + 1;
            }
            _ => return at,
        }
    }
}

/// The module declarations and paths of one file's tokens.
fn file_items(source: &str) -> FileItems {
    let tokens = tokenize(source);
    let mut items = FileItems::default();
    // Inline modules open around the current token, with the brace depth inside each.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut at = 0;
    while at < tokens.len() {
        if is_cfg_test(&tokens, at) {
            // The item after the attribute (and any further attributes) is test code.
            at += 7;
            while tokens.get(at) == Some(&Token::Punct('#')) {
                at = skip_group(&tokens, at + 1, '[', ']');
            }
            let start = at;
            while at < tokens.len()
                && tokens[at] != Token::Punct(';')
                && tokens[at] != Token::Punct('{')
            {
                at += 1;
            }
            if tokens.get(at) == Some(&Token::Punct(';')) {
                let words: Vec<&str> = (start..at).filter_map(|i| ident(&tokens, i)).collect();
                if let [.., "mod", name] = words.as_slice() {
                    items.child_modules.push((name.to_string(), true));
                }
                at += 1;
            } else {
                at = skip_group(&tokens, at, '{', '}');
            }
            continue;
        }
        let modules: Vec<String> = inline.iter().map(|(name, _)| name.clone()).collect();
        match &tokens[at] {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => {
                if inline.last().is_some_and(|(_, inside)| *inside == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            Token::Ident(word) if word == "mod" => {
                if let Some(name) = ident(&tokens, at + 1) {
                    match tokens.get(at + 2) {
                        Some(Token::Punct(';')) if inline.is_empty() => {
                            items.child_modules.push((name.to_string(), false));
                        }
                        Some(Token::Punct('{')) => {
                            inline.push((name.to_string(), depth + 1));
                            depth += 1;
                            at += 3;
                            continue;
                        }
                        _ => {}
                    }
                }
            }
            // A visibility (`pub(in crate::a)`) names a module, it imports nothing.
            Token::Ident(word)
                if word == "pub" && tokens.get(at + 1) == Some(&Token::Punct('(')) =>
            {
                at = skip_group(&tokens, at + 1, '(', ')');
                continue;
            }
            Token::Ident(word) if word == "use" => {
                let reexport = is_public(&tokens, at) && inline.is_empty();
                let mut paths = Vec::new();
                at = read_use_tree(&tokens, at + 1, Vec::new(), &mut paths);
                for (path, name) in paths {
                    match name {
                        Some(name) if reexport => items.reexports.push((name, path)),
                        _ => items.paths.push((modules.clone(), path)),
                    }
                }
                continue;
            }
            Token::Ident(word) => {
                let starts_a_path = tokens.get(at + 1) == Some(&Token::PathSeparator)
                    && !matches!(
                        at.checked_sub(1).map(|i| &tokens[i]),
                        Some(Token::PathSeparator)
                    )
                    && !matches!(
                        at.checked_sub(1).map(|i| &tokens[i]),
                        Some(Token::Punct('$'))
                    );
                if starts_a_path {
                    let mut path = vec![word.clone()];
                    let mut end = at + 1;
                    while tokens.get(end) == Some(&Token::PathSeparator) {
                        match ident(&tokens, end + 1) {
                            Some(next) => path.push(next.to_string()),
                            None => break,
                        }
                        end += 2;
                    }
                    // A macro's path leads to the crate root, wherever the macro is written.
                    if tokens.get(end) != Some(&Token::Punct('!')) {
                        items.paths.push((modules, path));
                    }
                    at = end;
                    continue;
                }
            }
            _ => {}
        }
        at += 1;
    }
    items
}

/// One crate's files as modules: module path → file, and the import edges between files.
#[derive(Debug, Default)]
struct CrateGraph {
    /// Module path (`a::b`, `` for the root) → file.
    files_by_module: BTreeMap<Vec<String>, String>,
    /// Files reached only through `#[cfg(test)] mod`.
    test_files: BTreeSet<String>,
    /// File → (name it re-exports → the absolute path it re-exports).
    reexports: BTreeMap<String, BTreeMap<String, Vec<String>>>,
    /// File → (imported file, an example path that imports it).
    edges: BTreeMap<String, BTreeMap<String, String>>,
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
fn crate_graph(files: &BTreeMap<String, String>, root: &str) -> CrateGraph {
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
    fn defining_file(&self, mut absolute: Vec<String>) -> Option<String> {
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

/// Each crate under services/ (a library and a program of one folder apart) as (its source
/// folder relative to the workspace, its root file, the graph).
fn workspace_crate_graphs() -> Vec<(String, String, CrateGraph)> {
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

fn synthetic_crate(files: &[(&str, &str)]) -> BTreeMap<String, String> {
    files
        .iter()
        .map(|(path, text)| (path.to_string(), text.to_string()))
        .collect()
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
