//! `ninfer run MODEL`: plan, start expert workers + engine + gateway on a private runtime
//! directory, wait until they answer, then chat in the terminal (`--prompt` answers once,
//! `--serve` keeps the API up, `--dry-run` only prints the plan).

use std::io::{BufRead, IsTerminal, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ninfer_artifact::{Artifact, TensorClass};
use ninfer_engine::moe::placement::GpuExpertCount;
use ninfer_protocol::v1::gateway_client::GatewayClient;
use ninfer_protocol::v1::{ChatMessage, ChatRequest, GatewaySamplingOptions, ListModelsRequest};

use crate::serve::{resolve_model, start_pipeline, ServeArgs};
use crate::supervisor::{
    install_stop_handler, numa_nodes, sibling_binary, stop_requested, ChildSpec, Supervisor,
};

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The `.ninfer` artifact, or a directory holding exactly one.
    pub model: PathBuf,
    /// Answer this prompt once and exit.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Keep the OpenAI/Anthropic/gRPC API up instead of chatting.
    #[arg(long)]
    pub serve: bool,
    /// API address (with --serve; otherwise a free loopback port).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Print the plan and exit.
    #[arg(long)]
    pub dry_run: bool,
    /// With --dry-run: the plan as JSON.
    #[arg(long)]
    pub json: bool,
    /// Longest prompt + completion per sequence, in tokens.
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Compute threads per expert worker (default: every core of its node).
    #[arg(long)]
    pub moe_threads: Option<usize>,
    /// Most tokens per answer in the chat.
    #[arg(long, default_value_t = 1024)]
    pub max_tokens: u32,
    /// Sampling temperature of the chat (default: the model's generation config).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Start with thinking enabled (toggle with /think).
    #[arg(long)]
    pub think: bool,
    /// Routed experts per MoE layer on the GPU: N, `half`, `all` or `auto` (as many as fit).
    #[arg(long, value_name = "N|half|all|auto")]
    pub moe_gpu_experts: Option<String>,
    /// Behave as if the GPU had this many GiB (stand in for a smaller card).
    #[arg(long, value_name = "GiB")]
    pub gpu_mem_budget: Option<f64>,
}

/// What `run` will start, for `--dry-run` and the start-up banner.
#[derive(Debug, serde::Serialize)]
struct Plan {
    model: String,
    architecture: String,
    parameters: u64,
    device: String,
    /// What `--moe-gpu-experts` asked for (`0` when not given).
    gpu_experts: String,
    /// Experts per MoE layer in GPU slots; `None` for `auto` (the engine fits them at start).
    gpu_experts_per_layer: Option<usize>,
    gpu_mem_budget_gib: Option<f64>,
    numa_nodes: Vec<usize>,
    expert_workers: Vec<WorkerPlan>,
    max_context: usize,
    expert_bank_bytes: u64,
    dense_bytes: u64,
    api: Option<String>,
}

#[derive(Debug, serde::Serialize)]
struct WorkerPlan {
    numa_node: usize,
    experts: String,
    threads: usize,
}

fn plan(args: &RunArgs, model: &std::path::Path) -> anyhow::Result<Plan> {
    let artifact = Artifact::open(model).with_context(|| format!("opening {}", model.display()))?;
    let common = artifact.config().common();
    let nodes = numa_nodes();
    let mut expert_bank_bytes = 0;
    let mut dense_bytes = 0;
    let mut parameters = 0;
    for tensor in &artifact.header().tensors {
        parameters += tensor.element_count();
        match tensor.class {
            TensorClass::RoutedExpert => expert_bank_bytes += tensor.length,
            TensorClass::Embedding | TensorClass::Dense => dense_bytes += tensor.length,
            TensorClass::Mtp | TensorClass::Vision => {}
        }
    }
    let gpu_request: GpuExpertCount = args
        .moe_gpu_experts
        .as_deref()
        .unwrap_or("0")
        .parse()
        .map_err(|problem| anyhow::anyhow!("--moe-gpu-experts: {problem}"))?;
    let gpu_experts_per_layer = match gpu_request {
        GpuExpertCount::Count(count) if count > common.num_experts => bail!(
            "--moe-gpu-experts: {count} experts per layer asked for, the model has {}",
            common.num_experts
        ),
        GpuExpertCount::Count(count) => Some(count),
        GpuExpertCount::Half => Some(common.num_experts / 2),
        GpuExpertCount::All => Some(common.num_experts),
        GpuExpertCount::Auto => None,
    };
    let expert_workers = nodes
        .iter()
        .enumerate()
        .map(|(index, &node)| WorkerPlan {
            numa_node: node,
            experts: if nodes.len() == 1 {
                "all".into()
            } else {
                format!("shard={index}/{}", nodes.len())
            },
            threads: args.moe_threads.unwrap_or_else(|| {
                ninfer_cpu_experts::cpus_of_numa_node(node)
                    .map(|c| c.len())
                    .unwrap_or(1)
                    .max(1)
            }),
        })
        .collect();
    Ok(Plan {
        model: model.display().to_string(),
        architecture: artifact.config().architecture().to_string(),
        parameters,
        device: planned_device(),
        gpu_experts: gpu_request.to_string(),
        gpu_experts_per_layer,
        gpu_mem_budget_gib: args.gpu_mem_budget,
        numa_nodes: nodes,
        expert_workers,
        max_context: args
            .max_context
            .unwrap_or(common.max_position_embeddings.min(8192)),
        expert_bank_bytes,
        dense_bytes,
        api: args.serve.then(|| format!("http://{}", args.listen)),
    })
}

/// The engine runs with `--device auto`: the GPU when one opens, else the CPU. Without a CUDA
/// driver library it is the CPU for certain; with one, the engine decides at start.
fn planned_device() -> String {
    use ninfer_engine::backend::cuda::loader;
    match loader::open(&loader::DRIVER) {
        Ok(driver) => format!(
            "auto: the GPU when one opens, else the CPU (CUDA driver {})",
            driver.opened_as
        ),
        Err(_) => "cpu (no CUDA driver library found)".into(),
    }
}

fn print_plan(plan: &Plan) {
    let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
    println!(
        "model         {} ({}, {:.2}B parameters)",
        plan.model,
        plan.architecture,
        plan.parameters as f64 / 1e9
    );
    println!("device        {}", plan.device);
    match plan.gpu_experts_per_layer {
        Some(count) => println!("gpu experts   {count} per MoE layer"),
        None => println!("gpu experts   auto (as many per MoE layer as fit; the engine decides)"),
    }
    if let Some(gib) = plan.gpu_mem_budget_gib {
        println!("gpu memory    budget {gib} GiB");
    }
    for worker in &plan.expert_workers {
        println!(
            "expert worker NUMA node {}: experts {}, {} threads",
            worker.numa_node, worker.experts, worker.threads
        );
    }
    println!(
        "memory        expert banks {:.2} GiB (locked by the workers), dense {:.2} GiB (engine)",
        gib(plan.expert_bank_bytes),
        gib(plan.dense_bytes)
    );
    println!("context       {} tokens per sequence", plan.max_context);
    if let Some(api) = &plan.api {
        println!("api           {api} (OpenAI /v1/chat/completions, Anthropic /v1/messages, gRPC)");
    }
}

/// Where the gateway keeps routing statistics across runs (`$XDG_STATE_HOME/ninfer`).
fn state_dir() -> PathBuf {
    std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".local/state")))
        .unwrap_or_else(std::env::temp_dir)
        .join("ninfer")
}

/// `--moe-expert-stats` for the engine when the gateway recorded routing for this model before
/// (the engine's model name is the artifact's file stem).
fn previous_routing_statistics(model: &std::path::Path) -> Vec<String> {
    let Some(name) = model.file_stem().map(|s| s.to_string_lossy().into_owned()) else {
        return Vec::new();
    };
    let file = state_dir()
        .join("expert-stats")
        .join(format!("{name}.json"));
    if file.is_file() {
        vec!["--moe-expert-stats".into(), file.display().to_string()]
    } else {
        Vec::new()
    }
}

fn free_loopback_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

async fn wait_until_ready(
    address: &str,
    supervisor: &mut Supervisor,
) -> anyhow::Result<(GatewayClient<tonic::transport::Channel>, String)> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if stop_requested() {
            bail!("interrupted while starting");
        }
        supervisor.poll();
        if let Ok(channel) =
            ninfer_protocol::transport::connect(address, Duration::from_millis(300)).await
        {
            let mut client = GatewayClient::new(channel);
            if let Ok(models) = client.list_models(ListModelsRequest {}).await {
                if let Some(model) = models.get_ref().models.iter().find(|m| m.ready_engines > 0) {
                    let name = model.name.clone();
                    return Ok((client, name));
                }
            }
        }
        if Instant::now() > deadline {
            bail!(
                "the services did not become ready within 5 minutes; logs are in {}",
                supervisor.runtime_dir().display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Streams one answer to stdout; returns the assistant message for the history.
async fn answer(
    client: &mut GatewayClient<tonic::transport::Channel>,
    model: &str,
    history: &[ChatMessage],
    args: &RunArgs,
    thinking: bool,
) -> anyhow::Result<ChatMessage> {
    let request = ChatRequest {
        model: model.to_string(),
        messages: history.to_vec(),
        options: Some(GatewaySamplingOptions {
            temperature: args.temperature,
            max_tokens: args.max_tokens,
            ..Default::default()
        }),
        enable_thinking: Some(thinking),
        ..Default::default()
    };
    let mut stream = client
        .chat_stream(request)
        .await
        .map_err(|s| anyhow::anyhow!("{}", s.message()))?
        .into_inner();
    let mut content = String::new();
    let mut reasoning = String::new();
    let mut stdout = std::io::stdout();
    let dim = stdout.is_terminal();
    while let Some(chunk) = stream
        .message()
        .await
        .map_err(|s| anyhow::anyhow!("{}", s.message()))?
    {
        if !chunk.reasoning_content.is_empty() {
            if dim {
                write!(stdout, "\x1b[2m{}\x1b[0m", chunk.reasoning_content)?;
            } else {
                write!(stdout, "{}", chunk.reasoning_content)?;
            }
            reasoning.push_str(&chunk.reasoning_content);
        }
        if !chunk.content.is_empty() {
            write!(stdout, "{}", chunk.content)?;
            content.push_str(&chunk.content);
        }
        stdout.flush()?;
    }
    writeln!(stdout)?;
    Ok(ChatMessage {
        role: "assistant".into(),
        content,
        reasoning_content: reasoning,
    })
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let model = resolve_model(&args.model)?;
    let plan = plan(&args, &model)?;
    if args.dry_run {
        if args.json {
            println!("{}", serde_json::to_string_pretty(&plan)?);
        } else {
            print_plan(&plan);
        }
        return Ok(());
    }
    install_stop_handler();
    let mut supervisor = Supervisor::new()?;
    let engine_address = format!("127.0.0.1:{}", free_loopback_port()?);
    let serve_args = ServeArgs {
        model: model.clone(),
        listen: engine_address.clone(),
        moe_threads: args.moe_threads,
        max_context: args.max_context,
        no_workers: false,
        moe_gpu_experts: args.moe_gpu_experts.clone(),
        gpu_mem_budget: args.gpu_mem_budget,
        engine_args: previous_routing_statistics(&model),
    };
    start_pipeline(&mut supervisor, &serve_args)?;
    let api = if args.serve {
        args.listen.clone()
    } else {
        format!("127.0.0.1:{}", free_loopback_port()?)
    };
    supervisor.add(ChildSpec {
        label: "gateway".into(),
        program: sibling_binary("ninfer-gateway"),
        args: vec![
            "--engine".into(),
            engine_address,
            "--listen".into(),
            api.clone(),
            "--state-dir".into(),
            state_dir().display().to_string(),
        ],
    })?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (mut client, model_name) = runtime.block_on(wait_until_ready(&api, &mut supervisor))?;
    if args.serve {
        print_plan(&plan);
        println!(
            "ready: http://{api} — Ctrl-C stops everything (logs in {})",
            supervisor.runtime_dir().display()
        );
        supervisor.run_until_stopped();
        supervisor.stop_all(Duration::from_secs(10));
        return Ok(());
    }
    let mut thinking = args.think;
    let mut history: Vec<ChatMessage> = Vec::new();
    if let Some(prompt) = &args.prompt {
        history.push(ChatMessage {
            role: "user".into(),
            content: prompt.clone(),
            ..Default::default()
        });
        runtime.block_on(answer(&mut client, &model_name, &history, &args, thinking))?;
        return Ok(());
    }
    println!(
        "{} ready. /think toggles thinking, /reset clears the conversation, /exit quits.",
        plan.architecture
    );
    let stdin = std::io::stdin();
    loop {
        print!("> ");
        std::io::stdout().flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || stop_requested() {
            break;
        }
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                history.clear();
                println!("(conversation cleared)");
            }
            "/think" => {
                thinking = !thinking;
                println!("(thinking {})", if thinking { "on" } else { "off" });
            }
            text => {
                history.push(ChatMessage {
                    role: "user".into(),
                    content: text.to_string(),
                    ..Default::default()
                });
                supervisor.poll();
                match runtime.block_on(answer(&mut client, &model_name, &history, &args, thinking))
                {
                    Ok(reply) => history.push(reply),
                    Err(error) => {
                        history.pop();
                        eprintln!("error: {error:#}");
                    }
                }
            }
        }
    }
    Ok(())
}
