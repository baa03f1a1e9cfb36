//! `ninfer run MODEL`: plan, start expert workers + engine + gateway on a private runtime
//! directory, wait until they answer, then chat in the terminal (`--prompt` answers once,
//! `--serve` keeps the API up, `--dry-run` only prints the plan). A model with an MTP head
//! decodes with one speculative draft per step unless `--no-mtp` (or `--spec`/`--draft-tokens`
//! say otherwise). In the chat of a model with a vision tower, `/image PATH` attaches an image file
//! to the next message.

use std::io::{BufRead, IsTerminal, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use ninfer_protocol::v1::gateway_client::GatewayClient;
use ninfer_protocol::v1::{
    ChatImage, ChatMessage, ChatRequest, GatewaySamplingOptions, ListModelsRequest,
};

use crate::plan_print::print_plan;
use crate::serve::{artifact_of, has_mtp_head, plan_for, start_pipeline, EngineFlags};
use crate::supervisor::{
    install_stop_handler, sibling_binary, state_dir, stop_requested, ChildSpec, Supervisor,
};

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The `.ninfer` artifact, a directory holding exactly one, a checkpoint directory, or
    /// `ORG/NAME` in the models directory (`--models-dir`).
    pub model: std::path::PathBuf,
    /// Answer this prompt once and exit.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Keep the OpenAI/Anthropic/gRPC API up instead of chatting.
    #[arg(long)]
    pub serve: bool,
    /// API address (with --serve; otherwise a free loopback port).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Print the plan and exit (reads only headers: nothing is converted or started).
    #[arg(long)]
    pub dry_run: bool,
    /// With --dry-run: the plan as JSON.
    #[arg(long, alias = "plan-json")]
    pub json: bool,
    /// Most tokens per answer in the chat (default: 1024, or half the context when shorter).
    #[arg(long)]
    pub max_tokens: Option<u32>,
    /// Sampling temperature of the chat (default: the model's generation config).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Start with thinking enabled (toggle with /think).
    #[arg(long)]
    pub think: bool,
    /// Another name clients may use for the model, `NAME=MODEL` (repeat); a NAME ending in `*`
    /// matches every name with that prefix: `--model-alias 'claude-*=MODEL'` lets Claude Code
    /// ask for any Claude model (`claude --model claude-sonnet-4-5`).
    #[arg(long = "model-alias", value_name = "NAME=MODEL")]
    pub model_aliases: Vec<String>,
    /// Hosts whose `http(s)` image URLs the API fetches (comma separated or repeated): names or
    /// addresses exactly, or `*.example.com`. Default: none, and image URLs are refused; send
    /// images inline. Redirects are not followed; a name must resolve to public addresses.
    #[arg(long = "image-url-hosts", value_name = "HOST", value_delimiter = ',')]
    pub image_url_hosts: Vec<String>,
    /// Seconds one request's image URL fetches may take together (default 10).
    #[arg(long, value_name = "SECONDS")]
    pub image_url_timeout_seconds: Option<f64>,
    #[command(flatten)]
    pub engine: EngineFlags,
}

/// Answer length when `--max-tokens` is not given.
const DEFAULT_MAX_TOKENS: u32 = 1024;

/// The chat's own values, checked before anything starts; returns the answer length.
fn check_chat_values(args: &RunArgs, max_context: usize) -> anyhow::Result<u32> {
    let max_tokens = match args.max_tokens {
        Some(0) => bail!("--max-tokens 0: an answer needs at least 1 token"),
        Some(tokens) if tokens as usize >= max_context => bail!(
            "--max-tokens {tokens}: must be below the context of {max_context} tokens (--max-context)"
        ),
        Some(tokens) => tokens,
        None => DEFAULT_MAX_TOKENS.min(u32::try_from(max_context / 2).unwrap_or(u32::MAX).max(1)),
    };
    if let Some(temperature) = args.temperature {
        if !(temperature.is_finite() && temperature >= 0.0) {
            bail!("--temperature {temperature}: give 0 (greedy) or a positive number");
        }
    }
    if args.serve && !args.dry_run {
        if let Err(error) = TcpListener::bind(&args.listen) {
            bail!("--listen {}: cannot listen there: {error}", args.listen);
        }
    }
    Ok(max_tokens)
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

/// Whether `run` turns MTP speculative decoding on with one draft: the model has the head
/// and neither `--no-mtp` nor the user's own flags decide otherwise (a split over several
/// GPUs runs the head on the last card).
fn mtp_by_default(engine: &EngineFlags, model: &std::path::Path) -> anyhow::Result<bool> {
    let user_arguments = engine.user_engine_args();
    if engine.no_mtp
        || engine.speculates()
        || user_arguments
            .iter()
            .any(|a| a.starts_with("--spec") || a.starts_with("--draft-tokens"))
    {
        return Ok(false);
    }
    let artifact = ninfer_artifact::Artifact::open(model)
        .with_context(|| format!("opening {}", model.display()))?;
    Ok(has_mtp_head(&artifact))
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
        supervisor.poll()?;
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
                supervisor.log_dir().display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A conversation with the gateway: the history it sends and the settings of its turns.
struct Chat<'a> {
    client: GatewayClient<tonic::transport::Channel>,
    model_name: String,
    args: &'a RunArgs,
    max_tokens: u32,
    thinking: bool,
    history: Vec<ChatMessage>,
    /// Images `/image` attached to the next message.
    pending_images: Vec<ChatImage>,
}

impl Chat<'_> {
    /// One user turn: the answer is printed as it streams and kept in the history; a failed
    /// turn leaves the history as it was.
    async fn ask(&mut self, text: &str) -> anyhow::Result<()> {
        self.history.push(ChatMessage {
            role: "user".into(),
            content: text.to_string(),
            images: std::mem::take(&mut self.pending_images),
            ..Default::default()
        });
        let answered = answer(
            &mut self.client,
            &self.model_name,
            &self.history,
            self.args,
            self.max_tokens,
            self.thinking,
        )
        .await;
        match answered {
            Ok(reply) => {
                self.history.push(reply);
                Ok(())
            }
            Err(error) => {
                // The images wait for the next try.
                if let Some(turn) = self.history.pop() {
                    self.pending_images = turn.images;
                }
                Err(error)
            }
        }
    }
}

/// The image file a `/image PATH` line names (its type is read from its bytes by the
/// server, which refuses what is not an image it takes).
fn attach_image(command: &str) -> anyhow::Result<ChatImage> {
    let path = command.trim_start_matches("/image").trim();
    if path.is_empty() {
        bail!("usage: /image PATH");
    }
    let encoded = std::fs::read(path).with_context(|| format!("reading {path}"))?;
    Ok(ChatImage {
        encoded,
        media_type: String::new(),
    })
}

/// Streams one answer to stdout; returns the assistant message for the history.
async fn answer(
    client: &mut GatewayClient<tonic::transport::Channel>,
    model: &str,
    history: &[ChatMessage],
    args: &RunArgs,
    max_tokens: u32,
    thinking: bool,
) -> anyhow::Result<ChatMessage> {
    let request = ChatRequest {
        model: model.to_string(),
        messages: history.to_vec(),
        options: Some(GatewaySamplingOptions {
            temperature: args.temperature,
            max_tokens,
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
        images: Vec::new(),
    })
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let api_for_plan = args.serve.then(|| format!("http://{}", args.listen));
    let (location, plan) = plan_for(
        &args.model,
        &args.engine,
        &args.engine.request(api_for_plan),
        !args.dry_run,
    )?;
    let max_tokens = check_chat_values(&args, plan.max_context)?;
    if args.dry_run {
        if args.json {
            println!("{}", serde_json::to_string_pretty(&plan)?);
        } else {
            print_plan(&plan);
        }
        return Ok(());
    }
    let model = artifact_of(&location)?;
    install_stop_handler();
    let mut supervisor = Supervisor::new()?;
    // A socket in the private runtime directory: only this user can reach the engine.
    let engine_address = supervisor.socket("engine");
    let mut engine = args.engine.clone();
    let user_stats = engine.moe_expert_stats.is_some()
        || engine
            .user_engine_args()
            .iter()
            .any(|a| a.starts_with("--moe-expert-stats"));
    if !user_stats {
        engine
            .engine_args
            .extend(previous_routing_statistics(&model));
    }
    if mtp_by_default(&engine, &model)? {
        engine.spec = Some("mtp".into());
    }
    let api = if args.serve {
        args.listen.clone()
    } else {
        format!("127.0.0.1:{}", free_loopback_port()?)
    };
    let session = Session {
        args: &args,
        plan: &plan,
        model: &model,
        engine: &engine,
        engine_address: &engine_address,
        api: &api,
        max_tokens,
    };
    let result = start_and_chat(&session, &mut supervisor);
    supervisor.stop_all();
    result
}

/// What one `run` starts and how it chats.
struct Session<'a> {
    args: &'a RunArgs,
    plan: &'a crate::plan::Plan,
    model: &'a std::path::Path,
    engine: &'a EngineFlags,
    engine_address: &'a str,
    api: &'a str,
    max_tokens: u32,
}

/// The gateway's image URL flags, as `run` was given them.
fn image_url_flags(args: &RunArgs) -> Vec<String> {
    let mut flags = Vec::new();
    if !args.image_url_hosts.is_empty() {
        flags.push("--image-url-hosts".to_string());
        flags.push(args.image_url_hosts.join(","));
    }
    if let Some(seconds) = args.image_url_timeout_seconds {
        flags.push("--image-url-timeout-seconds".to_string());
        flags.push(seconds.to_string());
    }
    flags
}

fn start_and_chat(session: &Session<'_>, supervisor: &mut Supervisor) -> anyhow::Result<()> {
    let Session {
        args,
        plan,
        model,
        engine,
        engine_address,
        api,
        max_tokens,
    } = *session;
    start_pipeline(supervisor, model, engine_address, engine, plan)?;
    supervisor.add(ChildSpec {
        label: "gateway".into(),
        program: sibling_binary("ninfer-gateway"),
        args: vec![
            "--engine".into(),
            engine_address.to_string(),
            "--listen".into(),
            api.to_string(),
            "--state-dir".into(),
            state_dir().display().to_string(),
        ]
        .into_iter()
        .chain(
            args.model_aliases
                .iter()
                .flat_map(|alias| ["--model-alias".to_string(), alias.clone()]),
        )
        .chain(image_url_flags(args))
        .collect(),
    })?;
    if args.serve {
        eprintln!("starting; logs in {}", supervisor.log_dir().display());
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (client, model_name) = runtime.block_on(wait_until_ready(api, supervisor))?;
    supervisor.mark_healthy();
    if args.serve {
        print_plan(plan);
        println!(
            "ready: http://{api} — Ctrl-C stops everything (logs in {})",
            supervisor.log_dir().display()
        );
        supervisor.run_until_stopped()?;
        return Ok(());
    }
    let mut chat = Chat {
        client,
        model_name,
        args,
        max_tokens,
        thinking: args.think,
        history: Vec::new(),
        pending_images: Vec::new(),
    };
    if let Some(prompt) = &args.prompt {
        runtime.block_on(chat.ask(prompt))?;
        return Ok(());
    }
    let image_command = if plan.takes_images {
        "/image PATH attaches an image to the next message, "
    } else {
        ""
    };
    println!(
        "{} ready. {image_command}/think toggles thinking, /reset clears the conversation, /exit quits.",
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
                chat.history.clear();
                chat.pending_images.clear();
                println!("(conversation cleared)");
            }
            command if command.starts_with("/image") => match attach_image(command) {
                Ok(image) => {
                    println!(
                        "(image of {} bytes attached to the next message)",
                        image.encoded.len()
                    );
                    chat.pending_images.push(image);
                }
                Err(error) => eprintln!("error: {error:#}"),
            },
            "/think" => {
                chat.thinking = !chat.thinking;
                println!("(thinking {})", if chat.thinking { "on" } else { "off" });
            }
            text => {
                supervisor.poll()?;
                if let Err(error) = runtime.block_on(chat.ask(text)) {
                    eprintln!("error: {error:#}");
                }
            }
        }
    }
    Ok(())
}
