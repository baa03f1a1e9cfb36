//! Helpers shared by the CLI's integration tests: the repository's fixtures, converted with the
//! `ninfer` binary under test.
// Each test binary uses a different part of this module.
#![allow(dead_code)]

pub mod fake_hub;
pub mod serve;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ninfer_protocol::v1::engine_client::EngineClient;
use ninfer_protocol::v1::EngineStatusRequest;

/// A workspace binary next to this test's executable (target/<profile>/).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join(name);
    assert!(
        path.exists(),
        "{} is not built; run the tests with `scripts/test.sh` (cargo test --workspace)",
        path.display()
    );
    path
}

/// A gRPC client of the engine at `address`, once it answers ready (panics after `ready_within`).
pub async fn ready_engine_client(
    address: &str,
    ready_within: Duration,
) -> EngineClient<tonic::transport::Channel> {
    let deadline = Instant::now() + ready_within;
    loop {
        if let Ok(channel) =
            ninfer_protocol::transport::connect(address, Duration::from_millis(200)).await
        {
            let mut client = EngineClient::new(channel);
            if let Ok(status) = client.get_status(EngineStatusRequest {}).await {
                if status.get_ref().ready {
                    return client;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "engine at {address} not ready within {ready_within:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The prompts (token ids) of the fixture `name`'s reference.json.
pub fn reference_prompts(name: &str) -> Vec<Vec<u32>> {
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture(name).join("reference.json")).unwrap())
            .unwrap();
    reference["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            p["prompt_token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect()
        })
        .collect()
}

/// `tests/fixtures/<name>` of this checkout.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// Converts the fixture `name` to `output` with f32 weights (exact comparisons), by `ninfer convert`.
pub fn convert_fixture_f32(name: &str, output: &Path) {
    let result = Command::new(env!("CARGO_BIN_EXE_ninfer"))
        .args(["convert", "--experts-dtype", "f32", "--dense-dtype", "f32"])
        .arg(fixture(name))
        .arg(output)
        .output()
        .expect("running ninfer convert");
    assert!(
        result.status.success(),
        "ninfer convert {name} failed: {}",
        String::from_utf8_lossy(&result.stderr)
    );
}

/// `ninfer ARGS`, run to its end.
fn run_ninfer<I, S>(args: I) -> std::process::Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    Command::new(env!("CARGO_BIN_EXE_ninfer"))
        .args(args)
        .output()
        .expect("running ninfer")
}

/// The standard output of `ninfer ARGS`, once it exited with success (its output and errors
/// otherwise fail the test).
pub fn ninfer_stdout<I, S>(args: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let output = run_ninfer(args);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

/// The rows of a printed table: the lines that start with a number.
pub fn table_rows(stdout: &str) -> Vec<&str> {
    stdout
        .lines()
        .filter(|line| line.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .collect()
}

/// The standard error of `ninfer ARGS`, once it failed (a success fails the test).
pub fn ninfer_stderr_of_failure<I, S>(args: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let output = run_ninfer(args);
    assert!(
        !output.status.success(),
        "ninfer succeeded: {}",
        String::from_utf8_lossy(&output.stdout)
    );
    String::from_utf8_lossy(&output.stderr).into_owned()
}
