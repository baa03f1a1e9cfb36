//! A worker killed (`SIGKILL`) or stopped (`SIGSTOP`) mid-generation changes no token, with the
//! host's hand-off and on a GPU with the GPU's.

use std::time::{Duration, Instant};

use crate::helpers::{
    client, generate, generate_acting_after, gpu_present, greedy, prompts, runtime, Stack,
};

#[test]
fn killed_or_stopped_worker_does_not_change_the_generation() {
    let (killed, stopped, _) = worker_kill_and_stop_keep_the_tokens(&[], 64);
    println!("killed worker noticed after {killed:?}, stopped worker after {stopped:?}");
}

/// One engine on `qwen3_moe` with `engine_args` and one slowed worker: a greedy generation of
/// `tokens` tokens, then the same generation with the worker killed (`SIGKILL`) after 10
/// tokens and restarted on its socket, then again with it stopped (`SIGSTOP`) for 300 ms after
/// 5: the same tokens every time, the death and the hang each noticed within a second, the
/// interrupted layer replayed and the resumed worker reported. Returns how long the engine took
/// to notice the death and the hang, and its log.
fn worker_kill_and_stop_keep_the_tokens(
    engine_args: &[&str],
    tokens: u32,
) -> (Duration, Duration, String) {
    use nix::sys::signal::Signal;
    let rt = runtime();
    let mut stack = Stack::new();
    let model = stack.convert("qwen3_moe");
    let prompt = prompts("qwen3_moe")[0].clone();
    let worker = stack.worker("worker", &model, "all", &["--test-delay-ms", "20"]);
    let engine = stack.engine("engine", &model, std::slice::from_ref(&worker), engine_args);
    let uninterrupted =
        rt.block_on(async { generate(&mut client(&engine).await, greedy(&prompt, tokens)).await });
    assert_eq!(uninterrupted.len(), tokens as usize);

    let mut death_noticed_after = None;
    let interrupted = rt.block_on(async {
        let mut client = client(&engine).await;
        generate_acting_after(&mut client, greedy(&prompt, tokens), 10, || {
            let before = stack.log_count("engine", "expert worker died");
            let killed_at = Instant::now();
            stack.signal("worker", Signal::SIGKILL);
            let _ = stack.child("worker").wait();
            death_noticed_after =
                stack.wait_for_log("engine", "expert worker died", before, killed_at);
            stack.worker_on(
                "worker-restarted",
                "worker",
                &model,
                "all",
                &["--test-delay-ms", "20"],
            );
        })
        .await
    });
    let log = stack.log("engine");
    assert_eq!(
        interrupted, uninterrupted,
        "generation changed across a worker restart:\n{log}"
    );
    let death_noticed = death_noticed_after
        .unwrap_or_else(|| panic!("engine did not report the death within 5 s:\n{log}"));
    assert!(
        death_noticed < Duration::from_secs(1),
        "the dead worker was noticed after {death_noticed:?}, not within a second"
    );
    assert!(
        log.contains("replayed"),
        "engine did not replay the interrupted layer:\n{log}"
    );

    let mut hang_noticed_after = None;
    let resumed = rt.block_on(async {
        let mut client = client(&engine).await;
        generate_acting_after(&mut client, greedy(&prompt, tokens), 5, || {
            let before = stack.log_count("engine", "expert worker hung");
            let stopped_at = Instant::now();
            stack.signal("worker-restarted", Signal::SIGSTOP);
            hang_noticed_after =
                stack.wait_for_log("engine", "expert worker hung", before, stopped_at);
            std::thread::sleep(Duration::from_millis(300));
            stack.signal("worker-restarted", Signal::SIGCONT);
        })
        .await
    });
    let log = stack.log("engine");
    assert_eq!(
        resumed, uninterrupted,
        "a stopped worker changed the tokens"
    );
    let hang_noticed = hang_noticed_after
        .unwrap_or_else(|| panic!("engine did not report the hung worker within 5 s:\n{log}"));
    assert!(
        hang_noticed < Duration::from_secs(1),
        "the stopped worker was noticed after {hang_noticed:?}, not within a second"
    );
    assert!(
        log.contains("resumed"),
        "engine did not report the resumed worker:\n{log}"
    );
    (death_noticed, hang_noticed, log)
}

/// On a GPU, with the hand-off on the GPU and steps as graphs: a worker killed mid-generation
/// (its death noticed within a second, a new one started on its socket) and a worker stopped
/// (noticed as hung within a second, then continued) change no token.
#[test]
fn gpu_worker_handoff_rides_out_a_killed_or_stopped_worker() {
    if !gpu_present("gpu_worker_handoff_rides_out_a_killed_or_stopped_worker") {
        return;
    }
    let cuda = ["--device", "cuda", "--moe-gpu-experts", "half"];
    let (killed, stopped, log) = worker_kill_and_stop_keep_the_tokens(&cuda, 48);
    assert!(
        log.contains("from the cuda"),
        "the GPU did not hand off:\n{log}"
    );
    println!("device hand-off: killed worker noticed after {killed:?}, stopped after {stopped:?}");
}
