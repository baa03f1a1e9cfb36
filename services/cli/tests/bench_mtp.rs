//! `ninfer bench mtp`: on the trained fixture (which has an MTP head) every draft count gives the
//! tokens of MTP off; a model without a head is refused by name.

mod common;

use std::process::Command;

#[test]
fn bench_mtp_reports_each_draft_count_with_the_same_tokens_as_off() {
    let scratch = tempfile::tempdir().unwrap();
    let model = scratch.path().join("trained.ninfer");
    common::convert_fixture_f32("qwen3_5_moe_trained", &model);
    let output = Command::new(env!("CARGO_BIN_EXE_ninfer"))
        .args(["bench", "mtp"])
        .arg(&model)
        .args([
            "--tokens",
            "12",
            "--repeats",
            "1",
            "--draft-tokens",
            "0,1,3",
        ])
        .args(["--moe-threads", "1"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|line| line.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .collect();
    assert_eq!(rows.len(), 3, "{stdout}");
    for row in &rows[1..] {
        assert!(
            row.trim_end().ends_with("yes"),
            "drafting changed the tokens: {row}"
        );
    }
}

#[test]
fn bench_mtp_refuses_a_model_without_a_head() {
    let scratch = tempfile::tempdir().unwrap();
    let model = scratch.path().join("moe.ninfer");
    common::convert_fixture_f32("qwen3_moe", &model);
    let output = Command::new(env!("CARGO_BIN_EXE_ninfer"))
        .args(["bench", "mtp"])
        .arg(&model)
        .args(["--tokens", "4", "--repeats", "1"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let message = String::from_utf8_lossy(&output.stderr);
    assert!(message.contains("no MTP head"), "{message}");
}
