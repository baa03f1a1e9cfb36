//! A small tokenizer of Rust source: identifiers, path separators and punctuation; comments,
//! strings, characters and numbers dropped.

/// A token of Rust source; comments, strings, characters and numbers are dropped.
#[derive(Debug, Clone, PartialEq)]
pub enum Token {
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
pub fn tokenize(source: &str) -> Vec<Token> {
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
