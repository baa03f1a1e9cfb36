//! `ninfer reshard`: a converted artifact re-split into other file sizes is the same artifact,
//! and bad input is refused by name. Also: `convert` splits at 32 GB unless told otherwise.

mod common;

use std::process::{Command, Output};

fn ninfer(arguments: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ninfer"))
        .args(arguments)
        .output()
        .expect("running ninfer")
}

#[test]
fn a_resharded_artifact_is_byte_identical_to_a_direct_conversion() {
    let scratch = tempfile::tempdir().unwrap();
    let whole = scratch.path().join("whole.ninfer");
    let parts = scratch.path().join("parts.ninfer");
    let joined = scratch.path().join("joined.ninfer");
    common::convert_fixture_f32("qwen3_moe", &whole);
    assert!(
        !ninfer_artifact::part_path(&whole, 1).exists(),
        "a small model under the default 32 GB must be one file"
    );

    let output = ninfer(&[
        "reshard".as_ref(),
        whole.as_os_str(),
        parts.as_os_str(),
        "--max-file-gb".as_ref(),
        "0.0002".as_ref(),
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        ninfer_artifact::part_path(&parts, 2).exists(),
        "expected 3+ files"
    );

    let output = ninfer(&["reshard".as_ref(), parts.as_os_str(), joined.as_os_str()]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(
        std::fs::read(&joined).unwrap(),
        std::fs::read(&whole).unwrap(),
        "split and joined again must be the original bytes"
    );
}

#[test]
fn reshard_refuses_bad_input_by_name() {
    let scratch = tempfile::tempdir().unwrap();
    let not_an_artifact = scratch.path().join("notes.txt");
    std::fs::write(&not_an_artifact, "hello").unwrap();
    let out = scratch.path().join("out.ninfer");
    let output = ninfer(&[
        "reshard".as_ref(),
        not_an_artifact.as_os_str(),
        out.as_os_str(),
    ]);
    assert!(!output.status.success());
    let message = String::from_utf8_lossy(&output.stderr);
    assert!(message.contains("notes.txt"), "{message}");
    assert!(!out.exists(), "nothing may be written for a refused input");

    let artifact = scratch.path().join("model.ninfer");
    common::convert_fixture_f32("qwen3_moe", &artifact);
    let output = ninfer(&[
        "reshard".as_ref(),
        artifact.as_os_str(),
        out.as_os_str(),
        "--max-file-gb".as_ref(),
        "0".as_ref(),
    ]);
    assert!(!output.status.success());
    let message = String::from_utf8_lossy(&output.stderr);
    assert!(message.contains("--max-file-gb"), "{message}");
    let output = ninfer(&[
        "reshard".as_ref(),
        artifact.as_os_str(),
        artifact.as_os_str(),
    ]);
    assert!(
        !output.status.success(),
        "writing over the input must be refused"
    );
    Command::new(env!("CARGO_BIN_EXE_ninfer"))
        .args(["inspect".as_ref(), artifact.as_os_str()])
        .output()
        .map(|o| assert!(o.status.success(), "the input must survive"))
        .unwrap();
}
