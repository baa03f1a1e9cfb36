//! Engine + workers compute what the in-process engine computes: greedy generations through
//! workers, concurrent requests against their solo results, and on a GPU the GPU's hand-off to
//! the workers against the host's.

use crate::helpers::{client, generate, gpu_present, greedy, prompts, reference, runtime, Stack};

#[test]
fn greedy_through_workers_equals_in_process() {
    let rt = runtime();
    for name in ["qwen3_moe", "qwen3_next", "qwen3_5_moe"] {
        let mut stack = Stack::new();
        let model = stack.convert(name);
        let in_process = stack.engine("engine-local", &model, &[], &[]);
        let one = stack.worker("worker-all", &model, "all", &[]);
        let engine_one = stack.engine("engine-one", &model, &[one], &[]);
        let half0 = stack.worker("worker-half0", &model, "shard=0/2", &[]);
        let half1 = stack.worker("worker-half1", &model, "shard=1/2", &[]);
        let engine_two = stack.engine("engine-two", &model, &[half0, half1], &[]);
        // Half the experts of every layer resident in the backend's slots, the rest on two
        // workers of its own: the split must not change the tokens.
        let split0 = stack.worker("worker-split0", &model, "shard=0/2", &[]);
        let split1 = stack.worker("worker-split1", &model, "shard=1/2", &[]);
        let engine_split = stack.engine(
            "engine-split",
            &model,
            &[split0, split1],
            &["--moe-gpu-experts", "half"],
        );
        let expected = reference(name);
        for (index, prompt) in prompts(name).iter().enumerate() {
            let local = rt.block_on(async {
                generate(&mut client(&in_process).await, greedy(prompt, 24)).await
            });
            let through_one = rt.block_on(async {
                generate(&mut client(&engine_one).await, greedy(prompt, 24)).await
            });
            let through_two = rt.block_on(async {
                generate(&mut client(&engine_two).await, greedy(prompt, 24)).await
            });
            let through_split = rt.block_on(async {
                generate(&mut client(&engine_split).await, greedy(prompt, 24)).await
            });
            assert_eq!(local.len(), 24);
            assert_eq!(
                through_split, local,
                "{name} prompt {index}: half the experts in slots differs from in-process"
            );
            assert_eq!(
                through_one, local,
                "{name} prompt {index}: one worker differs from in-process"
            );
            assert_eq!(
                through_two, local,
                "{name} prompt {index}: two workers differ from in-process"
            );
            let transformers: Vec<u32> = expected["prompts"][index]["greedy_token_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(
                local, transformers,
                "{name} prompt {index}: differs from the transformers greedy tokens"
            );
        }
        assert!(stack.log("engine-two").contains("expert worker registered"));
        assert!(stack
            .log("engine-split")
            .contains("GPU expert slots filled"));
    }
}

#[test]
fn concurrent_requests_equal_their_solo_results() {
    let rt = runtime();
    let mut stack = Stack::new();
    let model = stack.convert("qwen3_next");
    let worker = stack.worker("worker", &model, "all", &[]);
    let engine = stack.engine("engine", &model, &[worker], &[]);
    let base = prompts("qwen3_next");
    // Eight different prompts: the fixture's two, and prefixes of them.
    let requests: Vec<Vec<u32>> = (0..8)
        .map(|i| base[i % 2][..base[i % 2].len() - i / 2].to_vec())
        .collect();
    rt.block_on(async {
        let mut solo = Vec::new();
        for prompt in &requests {
            solo.push(generate(&mut client(&engine).await, greedy(prompt, 16)).await);
        }
        let connected = client(&engine).await;
        let handles: Vec<_> = requests
            .iter()
            .map(|prompt| {
                let mut client = connected.clone();
                let request = greedy(prompt, 16);
                tokio::spawn(async move { generate(&mut client, request).await })
            })
            .collect();
        for (index, handle) in handles.into_iter().enumerate() {
            assert_eq!(
                handle.await.unwrap(),
                solo[index],
                "request {index} differs when batched"
            );
        }

        // A request that arrives while another decodes joins the running batch: the late, short
        // one finishes while the long one is still streaming, and neither changes.
        let long_solo = generate(&mut connected.clone(), greedy(&requests[0], 48)).await;
        let short_solo = solo[3][..8].to_vec();
        let mut stream = connected
            .clone()
            .generate(greedy(&requests[0], 48))
            .await
            .unwrap()
            .into_inner();
        let mut long = Vec::new();
        let mut late = None;
        let mut long_tokens_when_late_finished = None;
        while let Some(message) = stream.message().await.unwrap() {
            if message.no_token {
                continue;
            }
            long.push(message.token_id);
            if long.len() == 4 {
                let mut client = connected.clone();
                let request = greedy(&requests[3], 8);
                late = Some(tokio::spawn(
                    async move { generate(&mut client, request).await },
                ));
            }
            if long_tokens_when_late_finished.is_none()
                && late.as_ref().is_some_and(|handle| handle.is_finished())
            {
                long_tokens_when_late_finished = Some(long.len());
            }
        }
        assert_eq!(
            long, long_solo,
            "the running request changed when one joined"
        );
        assert_eq!(
            late.unwrap().await.unwrap(),
            short_solo,
            "the late request differs"
        );
        let at = long_tokens_when_late_finished
            .unwrap_or_else(|| panic!("the late request finished only after the long one"));
        assert!(
            at < 48,
            "the late request waited for the long one ({at} tokens)"
        );
        println!("late 8-token request finished while the long one was at token {at} of 48");
    });
}

/// On a GPU: with half of every layer's experts resident and the rest on two workers, the GPU
/// hands each MoE layer's CPU experts to the workers itself (the default) and gives the tokens
/// of the host's hand-off (`--cuda-worker-handoff off`), with decode steps as graphs and op by
/// op, alone and batched, also split over two stages (each stage handing its own layers off),
/// and with the answers read wide and the expert cache's fills copied by a kernel; and its
/// steps do run as graphs with the hand-off inside.
#[test]
fn gpu_worker_handoff_gives_the_host_handoffs_tokens() {
    if !gpu_present("gpu_worker_handoff_gives_the_host_handoffs_tokens") {
        return;
    }
    let rt = runtime();
    for name in ["qwen3_moe", "qwen3_next", "qwen3_5_moe"] {
        let mut stack = Stack::new();
        let model = stack.convert(name);
        let mut engines = Vec::new();
        for (label, flags) in [
            ("host", &["--cuda-worker-handoff", "off"][..]),
            ("device", &[][..]),
            ("device-ops", &["--cuda-graphs", "off"][..]),
            // Split over two stages of the GPU, each handing its own layers off.
            (
                "device-split",
                &["--pipeline-stages-on-one-device", "2"][..],
            ),
            // The answers read wide and the cache's fills copied by a kernel: the same bits.
            (
                "device-wide-paced",
                &[
                    "--cuda-handoff-wide-reads",
                    "on",
                    "--moe-cache-fill-copy-blocks",
                    "4",
                ][..],
            ),
        ] {
            let workers: Vec<String> = (0..2)
                .map(|shard| {
                    stack.worker(
                        &format!("worker-{label}-{shard}"),
                        &model,
                        &format!("shard={shard}/2"),
                        &[],
                    )
                })
                .collect();
            let mut extra = vec!["--device", "cuda", "--moe-gpu-experts", "half"];
            extra.extend_from_slice(flags);
            engines.push((label, stack.engine(label, &model, &workers, &extra)));
        }
        let requests = prompts(name);
        rt.block_on(async {
            let mut expected = Vec::new();
            for prompt in &requests {
                expected.push(generate(&mut client(&engines[0].1).await, greedy(prompt, 32)).await);
            }
            for (label, engine) in &engines[1..] {
                for (index, prompt) in requests.iter().enumerate() {
                    let alone = generate(&mut client(engine).await, greedy(prompt, 32)).await;
                    assert_eq!(
                        alone, expected[index],
                        "{name} {label}: prompt {index} alone"
                    );
                }
                let connected = client(engine).await;
                let handles: Vec<_> = requests
                    .iter()
                    .map(|prompt| {
                        let mut client = connected.clone();
                        let request = greedy(prompt, 32);
                        tokio::spawn(async move { generate(&mut client, request).await })
                    })
                    .collect();
                for (index, handle) in handles.into_iter().enumerate() {
                    assert_eq!(
                        handle.await.unwrap(),
                        expected[index],
                        "{name} {label}: prompt {index} batched"
                    );
                }
            }
        });
        for (label, _) in &engines[1..] {
            let log = stack.log(label);
            assert!(
                log.contains("hand their CPU experts to the workers from the cuda"),
                "{name} {label}: the GPU did not hand off:\n{log}"
            );
            assert!(
                !log.contains("could not be recorded"),
                "{name} {label}: a step graph failed:\n{log}"
            );
        }
        for label in ["device", "device-split"] {
            let log = stack.log(label);
            assert!(
                log.contains("recorded as a graph, MoE layers handed to the workers by the device"),
                "{name} {label}: no step graph with the hand-off inside:\n{log}"
            );
        }
        assert!(!stack.log("host").contains("from the cuda"));
    }
}
