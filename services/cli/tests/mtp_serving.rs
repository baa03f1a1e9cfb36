//! MTP speculative decoding in the real processes: an engine started with `--spec mtp` whose
//! routed experts (the MTP layer's included) are computed by an expert worker gives the tokens
//! of an engine without drafts (also split over two stages of one device, the head on the
//! last), and counts its drafts in GetStatus; `--spec mtp` on a model
//! without the head fails at start with the file named. Dense MLPs offloaded to an expert
//! worker keep the greedy tokens too. Needs the workspace binaries built next
//! to this test (`scripts/test.sh` / `cargo test --workspace` builds them).

mod common;
use common::binary;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use ninfer_protocol::v1::engine_client::EngineClient;
use ninfer_protocol::v1::{EngineStatusRequest, GenerateRequest};

fn prompts(name: &str) -> Vec<Vec<u32>> {
    common::reference_prompts(name)
}

/// Child processes killed on drop, with their logs in the scratch directory.
struct Stack {
    directory: tempfile::TempDir,
    children: Vec<Child>,
}

impl Drop for Stack {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Stack {
    fn path(&self, name: &str) -> PathBuf {
        self.directory.path().join(name)
    }

    fn convert(&self, fixture_name: &str) -> PathBuf {
        let output = self.path(&format!("{fixture_name}.ninfer"));
        common::convert_fixture_f32(fixture_name, &output);
        output
    }

    /// Starts `program` with `args`, its stderr in `label.log`; returns the socket address.
    fn spawn(&mut self, label: &str, program: &str, args: &[String]) -> String {
        let socket = format!("unix:{}", self.path(&format!("{label}.sock")).display());
        let log = File::create(self.path(&format!("{label}.log"))).unwrap();
        let child = Command::new(binary(program))
            .args(args)
            .args([
                "--listen",
                &socket,
                "--moe-threads",
                "2",
                "--kernel-isa",
                "scalar",
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.children.push(child);
        socket
    }

    fn engine(&mut self, label: &str, model: &Path, extra: &[&str]) -> String {
        let mut args = vec![
            "--model".to_string(),
            model.display().to_string(),
            "--device".into(),
            "cpu".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        self.spawn(label, "ninfer-engine", &args)
    }

    fn log(&self, label: &str) -> String {
        std::fs::read_to_string(self.path(&format!("{label}.log"))).unwrap_or_default()
    }
}

async fn client(address: &str) -> EngineClient<tonic::transport::Channel> {
    common::ready_engine_client(address, Duration::from_secs(60)).await
}

async fn greedy(address: &str, prompt: &[u32], draft_tokens: Option<u32>) -> Vec<u32> {
    let mut stream = client(address)
        .await
        .generate(GenerateRequest {
            prompt_token_ids: prompt.to_vec(),
            max_new_tokens: 20,
            draft_tokens,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut tokens = Vec::new();
    while let Some(message) = stream.message().await.unwrap() {
        if !message.no_token {
            tokens.push(message.token_id);
        }
    }
    tokens
}

#[test]
fn drafts_through_an_expert_worker_keep_the_greedy_tokens() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for name in ["qwen3_5_moe_trained", "qwen3_5_moe"] {
        let mut stack = Stack {
            directory: tempfile::tempdir().unwrap(),
            children: Vec::new(),
        };
        let model = stack.convert(name);
        let plain = stack.engine("engine-plain", &model, &[]);
        // Every worker of this test serves every expert of the model.
        let worker_args = vec![
            "--model".to_string(),
            model.display().to_string(),
            "--experts".into(),
            "all".into(),
        ];
        let worker = stack.spawn("worker", "ninfer-expert-worker", &worker_args);
        let speculating = stack.engine(
            "engine-mtp",
            &model,
            &["--experts", &worker, "--spec", "mtp", "--draft-tokens", "2"],
        );
        for (index, prompt) in prompts(name).iter().take(3).enumerate() {
            let expected = runtime.block_on(greedy(&plain, prompt, None));
            assert_eq!(expected.len(), 20);
            for draft_tokens in [None, Some(1), Some(0)] {
                let got = runtime.block_on(greedy(&speculating, prompt, draft_tokens));
                assert_eq!(
                    got, expected,
                    "{name} prompt {index}, draft_tokens {draft_tokens:?}: differs from the engine without drafts"
                );
            }
        }
        // Half of every MoE layer's experts in slots (host copies on the CPU backend), the MTP
        // layer's included, the rest with a worker of its own; also split over two stages (one
        // layer, then the rest and the MTP head), each layer's half resident on its stage: the
        // tokens of the engine without drafts and without slots.
        let half = ["--moe-gpu-experts", "half"];
        let split = [
            "--pipeline-stages-on-one-device",
            "2",
            "--gpu-split",
            "25,75",
        ];
        for (label, placement, drafts) in [
            ("half", &half[..], "3"),
            ("split", &[&half[..], &split[..]].concat()[..], "2"),
        ] {
            let worker = stack.spawn(
                &format!("worker-{label}"),
                "ninfer-expert-worker",
                &worker_args,
            );
            let mut flags = vec!["--experts", &worker];
            flags.extend_from_slice(placement);
            flags.extend_from_slice(&["--spec", "mtp", "--draft-tokens", drafts]);
            let engine = stack.engine(&format!("engine-mtp-{label}"), &model, &flags);
            for (index, prompt) in prompts(name).iter().take(2).enumerate() {
                let expected = runtime.block_on(greedy(&plain, prompt, None));
                let got = runtime.block_on(greedy(&engine, prompt, None));
                assert_eq!(
                    got, expected,
                    "{name} prompt {index}, {label}, {drafts} drafts: differs from the engine without drafts"
                );
            }
        }
        // The MTP layer got its half of the slots like the main layers, split or not.
        let experts_per_layer = if name == "qwen3_5_moe_trained" { 32 } else { 8 } / 2;
        for label in ["engine-mtp-half", "engine-mtp-split"] {
            let log = stack.log(label);
            assert!(
                log.contains(&format!(
                    "mtp_layer_resident_experts\u{1b}[0m\u{1b}[2m=\u{1b}[0m{experts_per_layer}"
                )) || log.contains(&format!("mtp_layer_resident_experts={experts_per_layer}")),
                "{name} ({label}): the MTP layer's experts were not placed: {log}"
            );
        }
        let status = runtime.block_on(async {
            client(&speculating)
                .await
                .get_status(EngineStatusRequest {})
                .await
                .unwrap()
                .into_inner()
        });
        let drafted: u64 = status.drafted_tokens_by_depth.iter().sum();
        assert!(
            drafted > 0 && status.speculative_steps_total > 0,
            "{name}: no drafts counted: {status:?}\n{}",
            stack.log("engine-mtp")
        );
        if name == "qwen3_5_moe_trained" {
            assert!(
                status.accepted_tokens_by_depth.iter().sum::<u64>() > 0,
                "{name}: no draft accepted: {status:?}"
            );
        }
    }
}

#[test]
fn spec_mtp_without_the_head_names_the_file() {
    let stack = Stack {
        directory: tempfile::tempdir().unwrap(),
        children: Vec::new(),
    };
    let model = stack.convert("qwen3_moe");
    let output = Command::new(binary("ninfer-engine"))
        .args(["--model", &model.display().to_string(), "--device", "cpu"])
        .args([
            "--listen",
            &format!("unix:{}", stack.path("e.sock").display()),
        ])
        .args(["--spec", "mtp"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("has no MTP head") && stderr.contains(&model.display().to_string()),
        "{stderr}"
    );
}

/// Dense MLP offload in the real processes: an engine computing every dense MLP of the dense
/// qwen3_5 fixture through an expert worker (one expert per layer, routing weight 1) gives the
/// greedy tokens of an engine that computes them itself.
#[test]
fn offloaded_dense_mlps_through_an_expert_worker_keep_the_greedy_tokens() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut stack = Stack {
        directory: tempfile::tempdir().unwrap(),
        children: Vec::new(),
    };
    let model = stack.convert("qwen3_5");
    let plain = stack.engine("engine-plain", &model, &[]);
    let worker_args = vec![
        "--model".to_string(),
        model.display().to_string(),
        "--experts".into(),
        "all".into(),
    ];
    let worker = stack.spawn("worker", "ninfer-expert-worker", &worker_args);
    let offloading = stack.engine(
        "engine-offload",
        &model,
        &["--experts", &worker, "--dense-mlp-offload-layers", "4"],
    );
    for (index, prompt) in prompts("qwen3_5").iter().enumerate() {
        let expected = runtime.block_on(greedy(&plain, prompt, None));
        assert_eq!(expected.len(), 20);
        let got = runtime.block_on(greedy(&offloading, prompt, None));
        assert_eq!(
            got,
            expected,
            "prompt {index}: the offloading engine differs\n{}\n{}",
            stack.log("engine-offload"),
            stack.log("worker")
        );
    }
    let log = stack.log("engine-offload");
    assert!(
        log.contains("dense MLPs of these layers computed by the expert executor"),
        "{log}"
    );
}
