//! `ninfer bench mtp`: on the trained fixture (which has an MTP head) every draft count gives the
//! tokens of MTP off; a model without a head is refused by name.

mod common;

use std::process::Command;

#[test]
fn bench_mtp_reports_each_draft_count_with_the_same_tokens_as_off() {
    let scratch = tempfile::tempdir().unwrap();
    let model = scratch.path().join("trained.ninfer");
    common::convert_fixture_f32("qwen3_5_moe_trained", &model);
    let stdout = bench_mtp(&model, &["--tokens", "12", "--draft-tokens", "0,1,3"]);
    let rows = common::table_rows(&stdout);
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
    let model = model.to_str().expect("a temporary path in UTF-8");
    let message = common::ninfer_stderr_of_failure([
        "bench",
        "mtp",
        model,
        "--tokens",
        "4",
        "--repeats",
        "1",
    ]);
    assert!(message.contains("no MTP head"), "{message}");
}

/// `ninfer bench mtp` on the trained fixture with `args`; its stdout (the command must succeed).
fn bench_mtp(model: &std::path::Path, args: &[&str]) -> String {
    let model = model.to_str().expect("a temporary path in UTF-8");
    let mut all = vec![
        "bench",
        "mtp",
        model,
        "--repeats",
        "1",
        "--moe-threads",
        "1",
    ];
    all.extend_from_slice(args);
    common::ninfer_stdout(all)
}

/// The table's rows (they start with the draft count), split into columns at runs of spaces.
fn table_rows(stdout: &str) -> Vec<Vec<String>> {
    common::table_rows(stdout)
        .into_iter()
        .map(|line| {
            line.split("  ")
                .map(str::trim)
                .filter(|cell| !cell.is_empty())
                .map(str::to_string)
                .collect()
        })
        .collect()
}

#[test]
fn bench_mtp_forced_acceptance_is_marked_and_sets_the_tokens_per_step() {
    let scratch = tempfile::tempdir().unwrap();
    let model = scratch.path().join("trained.ninfer");
    common::convert_fixture_f32("qwen3_5_moe_trained", &model);
    // 12 tokens after the first: 4 steps of 3 at rate 1, 12 steps of 1 at rate 0.
    for (rate, tokens_per_step) in [("1", "3.00"), ("0", "1.00")] {
        let stdout = bench_mtp(
            &model,
            &[
                "--tokens",
                "13",
                "--draft-tokens",
                "0,2",
                "--force-acceptance",
                rate,
            ],
        );
        assert!(stdout.contains("TEST ONLY"), "{stdout}");
        let rows = table_rows(&stdout);
        assert_eq!(rows.len(), 2, "{stdout}");
        // drafts, adaptive, decision, tok/s, vs off, tokens/step, rows/verify, by depth,
        // experts/verify, ÷ top-k, cache hits, MTP hits, same tokens.
        let (off, drafted) = (&rows[0], &rows[1]);
        assert_eq!(off[2], "model", "MTP off is never forced: {stdout}");
        assert_eq!(off[5], "1.00", "{stdout}");
        assert_eq!(drafted[2], "forced", "{stdout}");
        assert_eq!(drafted[5], tokens_per_step, "rate {rate}: {stdout}");
        // Two drafts per step while the room allows (at rate 0 the last steps have less).
        let rows_per_verification: f64 = drafted[6].parse().unwrap();
        if rate == "1" {
            assert_eq!(rows_per_verification, 3.0, "{stdout}");
        } else {
            assert!(rows_per_verification > 2.5, "{stdout}");
        }
        assert_eq!(drafted.last().unwrap(), "forced", "{stdout}");
        // One row reads top-k (4) experts per layer; three rows read their union, more.
        assert_eq!(off[9], "1.00", "{stdout}");
        let union: f64 = drafted[9].parse().unwrap();
        assert!(union > 1.0 && union <= 3.0, "{stdout}");
    }
}

#[test]
fn bench_mtp_takes_the_engine_placement_options_and_adaptive_drafts() {
    let scratch = tempfile::tempdir().unwrap();
    let model = scratch.path().join("trained.ninfer");
    common::convert_fixture_f32("qwen3_5_moe_trained", &model);
    // On the CPU backend the slots are host copies: the cache still moves and counts.
    for extra in [&[][..], &["--moe-static-experts"][..]] {
        let mut args = vec![
            "--tokens",
            "24",
            "--draft-tokens",
            "0,3",
            "--adaptive-drafts",
            "--force-acceptance",
            "0",
            "--moe-gpu-experts",
            "half",
        ];
        args.extend_from_slice(extra);
        let stdout = bench_mtp(&model, &args);
        let static_placement = !extra.is_empty();
        assert!(
            stdout.contains(if static_placement {
                "expert cache static"
            } else {
                "expert cache dynamic"
            }),
            "{stdout}"
        );
        let rows = table_rows(&stdout);
        assert_eq!(rows.len(), 2, "{stdout}");
        assert_eq!(rows[1][1], "on", "adaptive drafting not shown: {stdout}");
        assert_eq!(rows[1][5], "1.00", "{stdout}");
        assert!(rows[1][10].ends_with('%'), "no cache hit rate: {stdout}");
        // The MTP layer is placed like the main layers (half its experts in slots) and the
        // cache counts it.
        assert!(
            stdout.contains("the MTP layer's routed experts: 16 of 32 in expert slots"),
            "{stdout}"
        );
        assert!(rows[1][11].ends_with('%'), "no MTP hit rate: {stdout}");
    }
}

#[test]
fn forced_acceptance_is_refused_outside_bench_mtp_and_checked_there() {
    let scratch = tempfile::tempdir().unwrap();
    let model = scratch.path().join("trained.ninfer");
    common::convert_fixture_f32("qwen3_5_moe_trained", &model);
    let model_arg = model.to_str().unwrap();
    for command in [
        vec!["run", model_arg, "--force-acceptance", "0.8"],
        vec!["serve", model_arg, "--force-acceptance", "0.8"],
        vec!["bench", model_arg, "--force-acceptance", "0.8"],
    ] {
        let output = Command::new(env!("CARGO_BIN_EXE_ninfer"))
            .args(&command)
            .output()
            .unwrap();
        assert!(!output.status.success(), "{command:?} accepted it");
        let message = String::from_utf8_lossy(&output.stderr);
        assert!(
            message.contains("unexpected argument '--force-acceptance'"),
            "{command:?}: {message}"
        );
    }
    // Rates that cannot be are refused by name, before the model loads.
    for rates in ["0.5,0.9", "1.2", "high"] {
        let output = Command::new(env!("CARGO_BIN_EXE_ninfer"))
            .args(["bench", "mtp", model_arg, "--force-acceptance", rates])
            .output()
            .unwrap();
        assert!(!output.status.success(), "{rates} accepted");
        let message = String::from_utf8_lossy(&output.stderr);
        assert!(message.contains("--force-acceptance"), "{rates}: {message}");
    }
    // `--help` says what it is.
    let help = Command::new(env!("CARGO_BIN_EXE_ninfer"))
        .args(["bench", "mtp", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("TEST ONLY"), "{help}");
}
