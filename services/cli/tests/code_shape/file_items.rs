//! What one file says about modules and imports: its `mod` declarations, the paths its code
//! names (`use` trees and paths in code) and its named re-exports; `#[cfg(test)]` items left out.

use crate::tokens::{tokenize, Token};

/// What one file says about modules and imports.
#[derive(Debug, Default)]
pub struct FileItems {
    /// `mod name;` declarations, with whether they are `#[cfg(test)]`.
    pub child_modules: Vec<(String, bool)>,
    /// Paths the file's code names, each with the inline (non-test) modules it sits in.
    pub paths: Vec<(Vec<String>, Vec<String>)>,
    /// Named re-exports (`pub use path as name`) at the file's top level: (name, path).
    pub reexports: Vec<(String, Vec<String>)>,
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
pub fn file_items(source: &str) -> FileItems {
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
