//! The generation plan: a request in the gateway's terms (a [`ChatGenerationRequest`], or a
//! text prompt) made into what the engine runs: the chat template rendered and tokenized, the
//! grammar of a forced tool call or response format, the sampling options checked, and the
//! whole checked against the model's context.
//!
//! Owns: [`SamplingOptions`] (what every API maps its parameters to) and their limits,
//! [`ChatGenerationRequest`] (what every API's chat parsing ends in), [`GenerationPlan`] (model +
//! prompt ids + options + guidance) and the engine request it makes, [`plan_chat`] and
//! [`plan_text`].
//! Must not touch: JSON shapes of any API (each dialect file reads its own), running the plan
//! (`generation`).

use std::sync::atomic::{AtomicU64, Ordering};

use ninfer_protocol::v1::{GenerateRequest, Reasoning, SamplingParameters};

use crate::backend::ServedModel;
use crate::chat::{ChatContent, ChatContentPart, ChatConversation, ToolChoice};
use crate::chat_template::ChatTemplateInput;
use crate::error::GatewayError;
use crate::reasoning::ReasoningStart;
use crate::structured::{forced_tool_grammar, response_format_grammar, tool_specs};

/// Longest completion when neither the request nor the model's context bounds it.
const FALLBACK_MAX_NEW_TOKENS: u32 = 4096;
/// Most stop strings per request (OpenAI allows 4; be generous but bounded).
pub const MAX_STOP_STRINGS: usize = 16;
/// Most choices per request.
pub const MAX_CHOICES: u32 = 16;
/// Most alternatives per position.
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// Sampling and stopping, validated, in the gateway's own terms.
#[derive(Debug, Clone, Default)]
pub struct SamplingOptions {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<u64>,
    /// `None`: as many as fit in the context.
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
    pub logprobs: bool,
    pub top_logprobs: u32,
    pub choices: u32,
    /// `(token, bias)` added to the logits; -100 bans, 100 selects exclusively.
    pub logit_bias: Vec<(u32, f32)>,
    /// Most MTP drafts per step (the engine caps it at its own; 0: no speculation); `None`:
    /// the engine's setting.
    pub draft_tokens: Option<u32>,
    /// Generate past end-of-sequence tokens until `max_tokens` (stop strings still apply).
    pub ignore_eos: bool,
}

impl SamplingOptions {
    /// Checks ranges; each message names the parameter.
    pub fn validate(&self) -> Result<(), GatewayError> {
        let check_range =
            |name: &str, value: Option<f32>, low: f32, high: f32| -> Result<(), GatewayError> {
                match value {
                    Some(v) if !v.is_finite() || v < low || v > high => {
                        Err(GatewayError::invalid_parameter(
                            name,
                            format!("`{name}` must be between {low} and {high}, got {v}"),
                        ))
                    }
                    _ => Ok(()),
                }
            };
        check_range("temperature", self.temperature, 0.0, 100.0)?;
        check_range("top_p", self.top_p, 0.0, 1.0)?;
        check_range("min_p", self.min_p, 0.0, 1.0)?;
        check_range("repetition_penalty", self.repetition_penalty, 0.0, 100.0)?;
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        if matches!(self.top_p, Some(p) if p == 0.0) {
            return Err(GatewayError::invalid_parameter(
                "top_p",
                "`top_p` must be greater than 0",
            ));
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return Err(GatewayError::invalid_parameter(
                "stop",
                format!("at most {MAX_STOP_STRINGS} stop strings are allowed"),
            ));
        }
        if self.choices == 0 || self.choices > MAX_CHOICES {
            return Err(GatewayError::invalid_parameter(
                "n",
                format!("`n` must be between 1 and {MAX_CHOICES}"),
            ));
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(GatewayError::invalid_parameter(
                "top_logprobs",
                format!("`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}"),
            ));
        }
        if let Some((token, bias)) = self
            .logit_bias
            .iter()
            .find(|(_, bias)| !bias.is_finite() || !(-100.0..=100.0).contains(bias))
        {
            return Err(GatewayError::invalid_parameter(
                "logit_bias",
                format!("`logit_bias` values must be between -100 and 100, got {bias} for token {token}"),
            ));
        }
        if matches!(self.max_tokens, Some(0)) {
            return Err(GatewayError::invalid_parameter(
                "max_tokens",
                "`max_tokens` must be at least 1",
            ));
        }
        Ok(())
    }
}

/// Refuses a temperature outside `0..=highest`, the range of the API a request came through
/// (OpenAI's is 0–2, Anthropic's 0–1), in the words those APIs use.
pub fn check_temperature(temperature: Option<f32>, highest: f32) -> Result<(), GatewayError> {
    match temperature {
        Some(t) if !t.is_finite() || t < 0.0 || t > highest => {
            Err(GatewayError::invalid_parameter(
                "temperature",
                format!("`temperature` must be between 0 and {highest}, got {t}"),
            ))
        }
        _ => Ok(()),
    }
}

/// Converts a client-given integer to a token count, refusing negatives and absurd values.
pub fn token_count_parameter(name: &str, value: Option<i64>) -> Result<Option<u32>, GatewayError> {
    match value {
        None => Ok(None),
        Some(v) if v < 1 => Err(GatewayError::invalid_parameter(
            name,
            format!("`{name}` must be at least 1, got {v}"),
        )),
        Some(v) => u32::try_from(v).map(Some).map_err(|_| {
            GatewayError::invalid_parameter(name, format!("`{name}` is too large: {v}"))
        }),
    }
}

/// A chat request in the gateway's terms, as each API dialect reads it from its wire shape: the
/// model it names, the neutral conversation and the sampling options.
#[derive(Clone)]
pub struct ChatGenerationRequest {
    pub model: ServedModel,
    pub conversation: ChatConversation,
    pub options: SamplingOptions,
}

/// Everything needed to run one request's generations.
#[derive(Clone)]
pub struct GenerationPlan {
    pub model: ServedModel,
    pub prompt_token_ids: Vec<u32>,
    pub max_new_tokens: u32,
    pub options: SamplingOptions,
    /// `Some` for chat: split `<think>` reasoning from the answer.
    pub reasoning: Option<ReasoningStart>,
    pub request_id: String,
    /// Choice `i` samples with `seed + i`: the client's seed (reproducible), or fresh entropy
    /// when it gave none, so unseeded retries and the `n` choices all differ.
    pub seed: u64,
    /// What the engine enforces on the tokens beyond sampling.
    pub guidance: Guidance,
    /// The prompt's images, in the order of their placeholder runs.
    pub images: Vec<crate::images::ChatImage>,
}

/// Constraints a chat request puts on the answer, enforced by the engine per token.
#[derive(Debug, Clone, Default)]
pub struct Guidance {
    /// The answer's grammar (llguidance Lark): a JSON format or forced tool calls.
    pub grammar: Option<String>,
    /// Most reasoning tokens before the engine closes the thinking block.
    pub reasoning_budget: Option<u32>,
    /// The prompt already closed the thinking block (thinking turned off): no block to skip.
    pub thinking_closed: bool,
    /// Stop after the first complete tool call.
    pub single_tool_call: bool,
}

impl GenerationPlan {
    /// Checks the prompt and completion against the context and fixes `max_new_tokens`.
    pub fn new(
        model: ServedModel,
        prompt_token_ids: Vec<u32>,
        options: SamplingOptions,
        reasoning: Option<ReasoningStart>,
    ) -> Result<Self, GatewayError> {
        options.validate()?;
        if prompt_token_ids.is_empty() {
            return Err(GatewayError::invalid_parameter(
                "prompt",
                "the prompt is empty",
            ));
        }
        let vocabulary = model.resources.tokenizer.vocabulary_size() as u32;
        if let Some((token, _)) = options
            .logit_bias
            .iter()
            .find(|(token, _)| *token >= vocabulary)
        {
            return Err(GatewayError::invalid_parameter(
                "logit_bias",
                format!("`logit_bias` names token {token}, outside the vocabulary of {vocabulary} tokens"),
            ));
        }
        let prompt_tokens = prompt_token_ids.len() as u64;
        let max_context = model.resources.max_context;
        let max_new_tokens = if max_context == 0 {
            options.max_tokens.unwrap_or(FALLBACK_MAX_NEW_TOKENS)
        } else {
            let requested_completion = options.max_tokens.map(u64::from).unwrap_or(1);
            if prompt_tokens + requested_completion > u64::from(max_context) {
                return Err(GatewayError::ContextLengthExceeded {
                    max_context,
                    prompt_tokens: prompt_tokens.min(u64::from(u32::MAX)) as u32,
                    completion_tokens: requested_completion as u32,
                    requested_total: prompt_tokens + requested_completion,
                });
            }
            options
                .max_tokens
                .unwrap_or((u64::from(max_context) - prompt_tokens) as u32)
        };
        Ok(GenerationPlan {
            model,
            prompt_token_ids,
            max_new_tokens,
            reasoning,
            request_id: new_request_id(),
            seed: options.seed.unwrap_or_else(fresh_seed),
            options,
            guidance: Guidance::default(),
            images: Vec::new(),
        })
    }

    /// The engine's reasoning-block settings: when a grammar must wait for the end of the
    /// thinking block, or a budget closes it. `None` for raw completions, models without
    /// `<think>` tokens, and prompts that closed the block already.
    fn engine_reasoning(&self) -> Option<Reasoning> {
        let start = self.reasoning?;
        let guidance = &self.guidance;
        if guidance.thinking_closed
            || (guidance.grammar.is_none() && guidance.reasoning_budget.is_none())
        {
            return None;
        }
        let tokenizer = &self.model.resources.tokenizer;
        let open = tokenizer.token_to_id("<think>")?;
        let end = tokenizer.token_to_id("</think>")?;
        // Closed the way the template writes a finished block, so the answer reads as usual.
        let close = tokenizer
            .encode("\n</think>\n\n", false)
            .ok()
            .filter(|ids| ids.contains(&end))
            .unwrap_or_else(|| vec![end]);
        Some(Reasoning {
            start_token_id: match start {
                ReasoningStart::InsideThinking => None,
                ReasoningStart::DetectOpeningTag => Some(open),
            },
            end_token_id: end,
            budget_tokens: guidance.reasoning_budget.unwrap_or(0),
            close_token_ids: close,
        })
    }

    /// The engine request of choice `choice_index` (seeds differ per choice).
    pub fn engine_request(&self, choice_index: u32) -> GenerateRequest {
        let defaults = &self.model.resources.generation_defaults;
        let options = &self.options;
        GenerateRequest {
            request_id: format!("{}-{choice_index}", self.request_id),
            prompt_token_ids: self.prompt_token_ids.clone(),
            max_new_tokens: self.max_new_tokens,
            sampling: Some(SamplingParameters {
                temperature: options.temperature.or(defaults.temperature).unwrap_or(1.0),
                top_p: options.top_p.or(defaults.top_p).unwrap_or(1.0),
                top_k: options.top_k.or(defaults.top_k).unwrap_or(0),
                min_p: options.min_p.or(defaults.min_p).unwrap_or(0.0),
                repetition_penalty: options
                    .repetition_penalty
                    .or(defaults.repetition_penalty)
                    .unwrap_or(1.0),
                presence_penalty: options.presence_penalty.unwrap_or(0.0),
                frequency_penalty: options.frequency_penalty.unwrap_or(0.0),
                seed: Some(self.seed.wrapping_add(u64::from(choice_index))),
                random_stream_position: 0,
            }),
            stop_token_ids: if options.ignore_eos {
                Vec::new()
            } else {
                self.model.resources.eos_token_ids.clone()
            },
            top_logprobs: if options.logprobs {
                options.top_logprobs
            } else {
                0
            },
            return_logprobs: options.logprobs,
            model_name: self.model.name.clone(),
            // Padded embedding rows past the tokenizer decode to nothing: never sample them.
            sampleable_vocabulary_size: self.model.resources.tokenizer.vocabulary_size() as u32,
            logit_bias: options.logit_bias.iter().copied().collect(),
            reasoning: self.engine_reasoning(),
            lark_grammar: self.guidance.grammar.clone().unwrap_or_default(),
            draft_tokens: options.draft_tokens,
            resumed_output_tokens: 0,
            images: self
                .images
                .iter()
                .map(crate::images::ChatImage::engine_input)
                .collect(),
        }
    }
}

static REQUEST_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Unique enough across gateway restarts: start time in nanoseconds plus a counter.
pub fn new_request_id() -> String {
    let sequence = REQUEST_COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{:x}{:06x}", nanos & 0xffff_ffff_ffff, sequence & 0xff_ffff)
}

/// A seed no earlier request had: the standard library's per-process random hash keys (drawn
/// from the operating system) over the clock and a counter.
fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static DRAWS: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(DRAWS.fetch_add(1, Ordering::Relaxed));
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    hasher.finish()
}

/// Renders a chat prompt with the model's template and tokenizes it, on the blocking pool: a
/// prompt of megabytes takes long enough to stall other requests on an async worker.
pub async fn build_chat_prompt(
    model: &ServedModel,
    input: &ChatTemplateInput,
) -> Result<(String, Vec<u32>), GatewayError> {
    let model = model.clone();
    let input = input.clone();
    tokio::task::spawn_blocking(move || render_and_encode(&model, input))
        .await
        .map_err(|error| GatewayError::Internal(format!("prompt rendering failed: {error}")))?
}

/// [`build_chat_prompt`] of a conversation, its images placed for a model that sees them
/// (each image's placeholder run sized from its header; stood in for on a text-only model):
/// the prompt text, its token ids and the images in the order of their runs.
pub async fn build_chat_prompt_with_images(
    model: &ServedModel,
    conversation: &ChatConversation,
) -> Result<(String, Vec<u32>, Vec<crate::images::ChatImage>), GatewayError> {
    let Some(vision) = model.resources.vision.clone() else {
        let (prompt, ids) = build_chat_prompt(model, &conversation.template_input()?).await?;
        return Ok((prompt, ids, Vec::new()));
    };
    let fetched = with_fetched_images(conversation).await;
    let conversation = fetched.as_ref().unwrap_or(conversation);
    let (input, images) = conversation.template_input_with_images()?;
    let (prompt, ids) = build_chat_prompt(model, &input).await?;
    if images.is_empty() {
        return Ok((prompt, ids, images));
    }
    // Sizing reads each image's header: off the async workers with the rendering.
    let resources = model.resources.clone();
    tokio::task::spawn_blocking(move || {
        let encode_text = |text: &str| resources.tokenizer.encode(text, false);
        let ids = vision.expand_placeholders(&ids, &images, &encode_text)?;
        Ok((prompt, ids, images))
    })
    .await
    .map_err(|error| GatewayError::Internal(format!("placing the images failed: {error}")))?
}

/// The conversation with its image URLs fetched (`None` when nothing is to be fetched: the
/// operator allows no URLs, or it has none). One request's fetches share one byte cap, as its
/// inline images share one body, and one timeout.
async fn with_fetched_images(conversation: &ChatConversation) -> Option<ChatConversation> {
    let policy = conversation.image_urls.clone()?;
    let has_url_image = |content: &Option<ChatContent>| match content {
        Some(ChatContent::Parts(parts)) => parts.iter().any(
            |part| matches!(part, ChatContentPart::Image(image) if image.fetch_from.is_some()),
        ),
        _ => false,
    };
    if !conversation
        .messages
        .iter()
        .any(|message| has_url_image(&message.content))
    {
        return None;
    }
    let mut fetched = conversation.clone();
    let mut allowance = policy.allowance();
    for message in &mut fetched.messages {
        let Some(ChatContent::Parts(parts)) = &mut message.content else {
            continue;
        };
        for part in parts {
            if let ChatContentPart::Image(image) = part {
                policy.fetch_into(image, &mut allowance).await;
            }
        }
    }
    Some(fetched)
}

/// Tokenizes raw text on the blocking pool (see [`build_chat_prompt`]).
pub async fn encode_text(
    model: &ServedModel,
    text: String,
    add_special_tokens: bool,
) -> Result<Vec<u32>, GatewayError> {
    let resources = model.resources.clone();
    tokio::task::spawn_blocking(move || resources.tokenizer.encode(&text, add_special_tokens))
        .await
        .map_err(|error| GatewayError::Internal(format!("tokenization failed: {error}")))?
}

fn render_and_encode(
    model: &ServedModel,
    mut input: ChatTemplateInput,
) -> Result<(String, Vec<u32>), GatewayError> {
    let template = model.resources.chat_template.as_ref().ok_or_else(|| {
        GatewayError::invalid(format!(
            "the model `{}` cannot render chats ({}); use /v1/completions",
            model.name,
            model
                .resources
                .chat_template_problem
                .as_deref()
                .unwrap_or("no chat template")
        ))
    })?;
    input.special_tokens = model.resources.special_tokens.clone();
    model
        .resources
        .tokenizer
        .render_and_encode_chat(template, input)
}

/// The grammar a conversation puts on the answer: forced tool calls (in the model's syntax)
/// before a JSON `response_format`; `None` for free text.
fn answer_grammar(
    model: &ServedModel,
    conversation: &ChatConversation,
) -> Result<Option<String>, GatewayError> {
    if matches!(
        conversation.tool_choice,
        ToolChoice::Required | ToolChoice::Function(_)
    ) {
        let definitions = conversation.tool_definitions().unwrap_or_default();
        return forced_tool_grammar(
            &conversation.tool_choice,
            &tool_specs(&definitions)?,
            model.resources.tool_call_syntax,
            !conversation.single_tool_call,
        );
    }
    Ok(response_format_grammar(&conversation.response_format))
}

/// Whether output starts inside a thinking block: the prompt ends with an open `<think>`.
pub fn reasoning_start_for_prompt(prompt: &str) -> ReasoningStart {
    let trimmed = prompt.trim_end();
    if trimmed.ends_with("<think>") {
        ReasoningStart::InsideThinking
    } else {
        ReasoningStart::DetectOpeningTag
    }
}

/// Renders and tokenizes a chat, writes the grammar its tool choice or response format puts on
/// the answer, and checks it against the model's context: the one plan of every API's chats.
pub async fn plan_chat(request: &ChatGenerationRequest) -> Result<GenerationPlan, GatewayError> {
    let ChatGenerationRequest {
        model,
        conversation,
        options,
    } = request;
    conversation.check_tool_choice("tool_choice")?;
    let (prompt, prompt_token_ids, images) =
        build_chat_prompt_with_images(model, conversation).await?;
    let grammar = answer_grammar(model, conversation)?;
    let mut plan = GenerationPlan::new(
        model.clone(),
        prompt_token_ids,
        options.clone(),
        Some(reasoning_start_for_prompt(&prompt)),
    )?;
    plan.images = images;
    plan.guidance = Guidance {
        grammar,
        reasoning_budget: conversation.reasoning_budget,
        thinking_closed: prompt.trim_end().ends_with("</think>"),
        single_tool_call: conversation.single_tool_call && !conversation.tools.is_empty(),
    };
    Ok(plan)
}

/// Tokenizes a raw prompt and checks it against the model's context.
pub async fn plan_text(
    model: ServedModel,
    prompt: String,
    options: SamplingOptions,
) -> Result<GenerationPlan, GatewayError> {
    let prompt_token_ids = encode_text(&model, prompt, true).await?;
    GenerationPlan::new(model, prompt_token_ids, options, None)
}
