//! Acceptance: the gateway renders the real Qwen3.5/3.6 chat templates byte for byte as
//! `transformers.apply_chat_template` does. Expected strings come from
//! `scripts/render_templates.py` (run with transformers 5.17) in
//! `tests/fixtures/chat_templates/expected_renders.json`; set `NINFER_TEMPLATE_RENDERS` to check
//! another file.

use std::path::PathBuf;

use minijinja::Value;
use ninfer_gateway::chat_template::{ChatTemplate, ChatTemplateInput};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/chat_templates")
}

fn item(value: &Value, key: &str) -> Value {
    value.get_item(&Value::from(key)).unwrap_or_default()
}

#[test]
fn renders_equal_transformers_byte_for_byte() {
    let path = std::env::var("NINFER_TEMPLATE_RENDERS")
        .map(PathBuf::from)
        .unwrap_or_else(|_| fixtures().join("expected_renders.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("read {}: {error}", path.display()));
    // minijinja values keep key order (feature preserve_order), which tojson output depends on.
    let expected: Value = serde_json::from_str(&text)
        .unwrap_or_else(|error| panic!("parse {}: {error}", path.display()));
    let cases: Vec<Value> = item(&expected, "cases")
        .try_iter()
        .map(|iter| iter.collect())
        .unwrap_or_default();
    let renders: Vec<Value> = item(&expected, "renders")
        .try_iter()
        .map(|iter| iter.collect())
        .unwrap_or_default();
    assert!(renders.len() >= 30, "too few renders in {}", path.display());
    let mut failures = Vec::new();
    for render in &renders {
        let template_name = item(render, "template").to_string();
        let case_name = item(render, "case").to_string();
        let case = cases
            .iter()
            .find(|case| item(case, "name").to_string() == case_name)
            .unwrap_or_else(|| panic!("case {case_name} missing"));
        let source = std::fs::read_to_string(fixtures().join(&template_name))
            .unwrap_or_else(|error| panic!("{template_name}: {error}"));
        let template = ChatTemplate::compile(&source)
            .unwrap_or_else(|error| panic!("{template_name}: {error}"));
        let tools = item(case, "tools");
        let kwargs = item(case, "kwargs");
        let add_generation_prompt = item(case, "add_generation_prompt");
        let input = ChatTemplateInput {
            messages: item(case, "messages")
                .try_iter()
                .map(|iter| iter.collect())
                .unwrap_or_default(),
            tools: if tools.is_undefined() || tools.is_none() {
                None
            } else {
                tools.try_iter().ok().map(|iter| iter.collect())
            },
            add_generation_prompt: if add_generation_prompt.is_undefined() {
                true
            } else {
                add_generation_prompt.is_true()
            },
            extra_variables: if kwargs.is_undefined() {
                Vec::new()
            } else {
                kwargs
                    .try_iter()
                    .map(|keys| {
                        keys.map(|key| (key.to_string(), kwargs.get_item(&key).unwrap_or_default()))
                            .collect()
                    })
                    .unwrap_or_default()
            },
            special_tokens: Vec::new(),
        };
        let result = template.render(&input);
        let expected_text = item(render, "expected");
        let expected_error = item(render, "error");
        match (result, expected_text.as_str(), expected_error.as_str()) {
            (Ok(got), Some(want), _) if got == want => {}
            (Ok(got), Some(want), _) => {
                let first_difference = got
                    .bytes()
                    .zip(want.bytes())
                    .position(|(a, b)| a != b)
                    .unwrap_or(got.len().min(want.len()));
                let from = first_difference.saturating_sub(60);
                failures.push(format!(
                    "{template_name} / {case_name}: differs at byte {first_difference}\n  got:  {:?}\n  want: {:?}",
                    got.get(from..(first_difference + 60).min(got.len())).unwrap_or(""),
                    want.get(from..(first_difference + 60).min(want.len())).unwrap_or(""),
                ));
            }
            (Err(error), _, Some(want_error)) if error.to_string().contains(want_error) => {}
            (Ok(got), None, Some(want_error)) => failures.push(format!(
                "{template_name} / {case_name}: rendered {got:?}, expected error {want_error}"
            )),
            (Err(error), _, _) => failures.push(format!(
                "{template_name} / {case_name}: unexpected error {error}"
            )),
            (Ok(_), None, None) => failures.push(format!(
                "{template_name} / {case_name}: fixture has neither expected nor error"
            )),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} renders differ:\n{}",
        failures.len(),
        renders.len(),
        failures.join("\n")
    );
    eprintln!("{} renders equal ({})", renders.len(), path.display());
}

/// FNV-1a (64-bit): enough to notice an edited byte, with no dependency.
fn fnv1a_64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[test]
fn fixture_templates_are_the_reference_files() {
    // The copies are the released checkpoints' templates byte for byte (lengths and hashes taken
    // from the released files): an edit, a re-encoding or an added trailing newline fails here.
    for (name, length, hash) in [
        ("qwen3_5_chat_template.jinja", 7756, 0xf07c510f47fbaca0_u64),
        (
            "qwen3_5_small_nothink_chat_template.jinja",
            7755,
            0x407bbcdeb62737b7_u64,
        ),
        ("qwen3_6_chat_template.jinja", 7764, 0x8ae3a8bc6e68f114_u64),
    ] {
        let text =
            std::fs::read(fixtures().join(name)).unwrap_or_else(|error| panic!("{name}: {error}"));
        assert_eq!(text.len(), length, "{name} has the wrong length");
        assert_eq!(
            fnv1a_64(&text),
            hash,
            "{name} differs from the released template"
        );
    }
}
