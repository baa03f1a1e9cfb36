//! The gateway's own chat model: the conversation every API converts its wire types into before
//! generation, and what the chat template receives from it.
//!
//! Owns: [`ChatConversation`] (messages, tools, template switches, the answer's
//! [`ResponseFormat`]), [`ChatMessage`], [`ChatContent`], [`ChatToolCall`], [`ChatTool`], and
//! their one rendering into
//! [`ChatTemplateInput`] (the transformers message/tool format chat templates are written for).
//! Must not touch: any API's JSON shapes (the `openai`, `anthropic`, `responses` and `grpc_api`
//! modules convert to and from this model; only the `tool_choice` keywords both OpenAI APIs share
//! are read here), sampling, or engines.

use minijinja::Value;
use serde_json::Value as JsonValue;

use crate::chat_template::ChatTemplateInput;
use crate::error::GatewayError;
use crate::images::{ChatImage, ChatImagePart};

/// Who speaks a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatRole {
    System,
    User,
    Assistant,
    /// The result of a tool call, sent back to the model.
    Tool,
}

impl ChatRole {
    /// The role a client names: `system` (or OpenAI's `developer`), `user`, `assistant`, `tool`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "system" | "developer" => Some(ChatRole::System),
            "user" => Some(ChatRole::User),
            "assistant" => Some(ChatRole::Assistant),
            "tool" => Some(ChatRole::Tool),
            _ => None,
        }
    }

    /// The refusal of a role no API accepts, naming the message.
    pub fn unknown_role_error(index: usize, name: &str) -> GatewayError {
        GatewayError::invalid_parameter(
            "messages",
            format!("messages[{index}].role `{name}` is not one of system, user, assistant, tool"),
        )
    }

    /// The role's name as chat templates compare it.
    pub fn template_name(self) -> &'static str {
        match self {
            ChatRole::System => "system",
            ChatRole::User => "user",
            ChatRole::Assistant => "assistant",
            ChatRole::Tool => "tool",
        }
    }
}

/// What a text-only model's gateway does with images and documents a client sends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum NonTextContent {
    /// Replace each with a short bracketed note the model reads, so a conversation that carries
    /// one (a screenshot a tool read, a PDF) still goes on.
    #[default]
    Placeholder,
    /// Refuse the request (400).
    Reject,
}

impl NonTextContent {
    /// The text standing for a `kind` (`image`, `document`) block, or the refusal.
    pub fn stand_in(self, kind: &str, where_: &str) -> Result<String, GatewayError> {
        match self {
            NonTextContent::Placeholder => {
                Ok(format!("[{kind} omitted: this model reads text only]"))
            }
            NonTextContent::Reject => Err(GatewayError::invalid(format!(
                "{where_}: this model reads text only and the gateway is set to refuse {kind} content"
            ))),
        }
    }
}

/// One part of a message's content.
#[derive(Debug, Clone, PartialEq)]
pub enum ChatContentPart {
    Text(String),
    /// An image: the template's image item for a model that sees images (the image goes to
    /// the engine), the text-only stand-in for one that does not.
    Image(ChatImagePart),
}

/// A message's content. Templates treat a plain string and a list of parts differently, so the
/// distinction a client made is kept.
#[derive(Debug, Clone, PartialEq)]
pub enum ChatContent {
    Text(String),
    Parts(Vec<ChatContentPart>),
}

/// Where a conversation's images go as it is rendered: collected for a model that sees them,
/// else each stood in for as `non_text` says.
pub enum ImageRendering<'a> {
    Seen(&'a mut Vec<ChatImage>),
    TextOnly(NonTextContent),
}

impl ChatContent {
    fn template_value(&self, images: &mut ImageRendering<'_>) -> Result<Value, GatewayError> {
        let text_item = |text: &str| {
            Value::from_iter([("type", Value::from("text")), ("text", Value::from(text))])
        };
        Ok(match self {
            ChatContent::Text(text) => Value::from(text.as_str()),
            // A text-only model gets a message with images as one text, the stand-ins in place.
            ChatContent::Parts(parts)
                if matches!(images, ImageRendering::TextOnly(_))
                    && parts.iter().any(|p| matches!(p, ChatContentPart::Image(_))) =>
            {
                let mut text = String::new();
                for part in parts {
                    match (part, &*images) {
                        (ChatContentPart::Text(piece), _) => text.push_str(piece),
                        (ChatContentPart::Image(image), ImageRendering::TextOnly(non_text)) => {
                            text.push_str(&non_text.stand_in(image.kind(), &image.location)?)
                        }
                        (ChatContentPart::Image(_), ImageRendering::Seen(_)) => {}
                    }
                }
                Value::from(text)
            }
            ChatContent::Parts(parts) => {
                let mut items = Vec::with_capacity(parts.len());
                for part in parts {
                    items.push(match (part, &mut *images) {
                        (ChatContentPart::Text(text), _) => text_item(text),
                        (ChatContentPart::Image(image), ImageRendering::Seen(seen)) => {
                            seen.push(image.image()?.clone());
                            Value::from_iter([("type", Value::from(image.kind()))])
                        }
                        (ChatContentPart::Image(image), ImageRendering::TextOnly(non_text)) => {
                            text_item(&non_text.stand_in(image.kind(), &image.location)?)
                        }
                    });
                }
                Value::from(items)
            }
        })
    }
}

/// A call the assistant made, as it appears in the conversation history.
#[derive(Debug, Clone)]
pub struct ChatToolCall {
    pub id: Option<String>,
    /// `function` for every API the gateway speaks.
    pub kind: String,
    pub name: String,
    /// The arguments as a mapping (templates iterate them).
    pub arguments: Value,
}

/// A tool the model may call: the function definition in the transformers tool format
/// (`{"type": "function", "function": {"name", "description", "parameters"}}`), the form chat
/// templates render and the tool-call parser reads parameter types from.
#[derive(Debug, Clone)]
pub struct ChatTool {
    pub definition: Value,
}

impl ChatTool {
    /// A tool from its parts (APIs whose tools are not already in the transformers format).
    pub fn function(name: &str, description: Option<&str>, parameters: Option<Value>) -> Self {
        let mut function = vec![("name", Value::from(name))];
        if let Some(description) = description {
            function.push(("description", Value::from(description)));
        }
        if let Some(parameters) = parameters {
            function.push(("parameters", parameters));
        }
        ChatTool {
            definition: Value::from_iter([
                ("type", Value::from("function")),
                ("function", Value::from_iter(function)),
            ]),
        }
    }

    /// The function's name (`None` for a definition without one).
    pub fn name(&self) -> Option<String> {
        let function = self.definition.get_attr("function").ok()?;
        let name = function.get_attr("name").ok()?;
        name.as_str().map(str::to_string)
    }
}

/// One message of a conversation.
#[derive(Debug, Clone)]
pub struct ChatMessage {
    pub role: ChatRole,
    /// `None`: no content at all (an assistant turn that only calls tools).
    pub content: Option<ChatContent>,
    pub reasoning: Option<String>,
    /// `Some` (even empty) when the client sent a list.
    pub tool_calls: Option<Vec<ChatToolCall>>,
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message with text content and nothing else.
    pub fn text(role: ChatRole, text: impl Into<String>) -> Self {
        ChatMessage {
            role,
            content: Some(ChatContent::Text(text.into())),
            reasoning: None,
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }

    fn template_value(&self, images: &mut ImageRendering<'_>) -> Result<Value, GatewayError> {
        let mut fields: Vec<(&str, Value)> = vec![("role", Value::from(self.role.template_name()))];
        fields.push((
            "content",
            match &self.content {
                Some(content) => content.template_value(images)?,
                None => Value::from(()),
            },
        ));
        if let Some(reasoning) = &self.reasoning {
            fields.push(("reasoning_content", Value::from(reasoning.as_str())));
        }
        if let Some(tool_calls) = &self.tool_calls {
            let calls: Vec<Value> = tool_calls
                .iter()
                .map(|call| {
                    let mut call_fields: Vec<(&str, Value)> = Vec::new();
                    if let Some(id) = &call.id {
                        call_fields.push(("id", Value::from(id.as_str())));
                    }
                    call_fields.push(("type", Value::from(call.kind.as_str())));
                    call_fields.push((
                        "function",
                        Value::from_iter([
                            ("name", Value::from(call.name.as_str())),
                            ("arguments", call.arguments.clone()),
                        ]),
                    ));
                    Value::from_iter(call_fields)
                })
                .collect();
            fields.push(("tool_calls", Value::from(calls)));
        }
        if let Some(id) = &self.tool_call_id {
            fields.push(("tool_call_id", Value::from(id.as_str())));
        }
        if let Some(name) = &self.name {
            fields.push(("name", Value::from(name.as_str())));
        }
        Ok(Value::from_iter(fields))
    }
}

/// The shape the answer must have (read from each API by `structured`, which also writes its
/// grammar).
#[derive(Debug, Clone, Default, PartialEq)]
pub enum ResponseFormat {
    /// Free text (the default).
    #[default]
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid for this schema.
    JsonSchema(serde_json::Value),
}

/// Whether and which tool the client asks the model to call. `None` is honoured (no call is
/// parsed); `Required` and `Function` are checked against the declared tools and forced on the
/// tokens (a grammar of the model's tool-call syntax, written by the `structured` module).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default).
    #[default]
    Auto,
    /// No tool calls: the answer stays text, `<tool_call>` blocks included.
    None,
    /// Some tool must be called (OpenAI `required`, Anthropic `any`).
    Required,
    /// This tool must be called.
    Function(String),
}

/// A whole chat request in the gateway's terms, ready for the template.
#[derive(Debug, Clone, Default)]
pub struct ChatConversation {
    pub messages: Vec<ChatMessage>,
    pub tools: Vec<ChatTool>,
    pub add_generation_prompt: bool,
    /// Extra template variables (`enable_thinking`, `preserve_thinking`, ...).
    pub template_variables: Vec<(String, Value)>,
    pub tool_choice: ToolChoice,
    /// The answer's required shape (OpenAI `response_format`).
    pub response_format: ResponseFormat,
    /// At most one tool call (`parallel_tool_calls: false`, Anthropic
    /// `disable_parallel_tool_use`).
    pub single_tool_call: bool,
    /// Most tokens of reasoning before the model is made to close its thinking block.
    pub reasoning_budget: Option<u32>,
    /// What a text-only model gets for the conversation's images.
    pub non_text_content: NonTextContent,
    /// The image URLs the gateway fetches (`None`: none; a URL image is then refused).
    pub image_urls: Option<std::sync::Arc<crate::image_urls::ImageUrlPolicy>>,
}

impl ChatConversation {
    /// The tool definitions as the template and the tool-call parser take them (`None`: no tools).
    pub fn tool_definitions(&self) -> Option<Vec<Value>> {
        if self.tools.is_empty() {
            None
        } else {
            Some(
                self.tools
                    .iter()
                    .map(|tool| tool.definition.clone())
                    .collect(),
            )
        }
    }

    /// The tools whose calls are parsed out of the answer: none when `tool_choice` is `none`.
    pub fn callable_tool_definitions(&self) -> Option<Vec<Value>> {
        match self.tool_choice {
            ToolChoice::None => None,
            _ => self.tool_definitions(),
        }
    }

    /// Refuses a tool choice that names no declared tool, or requires a call without tools.
    pub fn check_tool_choice(&self, parameter: &str) -> Result<(), GatewayError> {
        match &self.tool_choice {
            ToolChoice::Auto | ToolChoice::None => Ok(()),
            ToolChoice::Required if self.tools.is_empty() => Err(GatewayError::invalid_parameter(
                parameter,
                format!("`{parameter}` requires a tool call but no `tools` are given"),
            )),
            ToolChoice::Required => Ok(()),
            ToolChoice::Function(name) => {
                if self
                    .tools
                    .iter()
                    .any(|tool| tool.name().as_deref() == Some(name.as_str()))
                {
                    Ok(())
                } else {
                    Err(GatewayError::invalid_parameter(
                        parameter,
                        format!(
                            "`{parameter}` names the tool `{name}`, which is not among `tools`"
                        ),
                    ))
                }
            }
        }
    }

    /// The template's input (special tokens are filled in from the model at render time), for
    /// a model that reads text only: images are stood in for.
    pub fn template_input(&self) -> Result<ChatTemplateInput, GatewayError> {
        self.rendered(ImageRendering::TextOnly(self.non_text_content))
    }

    /// The template's input for a model that sees images, and the images in the order the
    /// template places them.
    pub fn template_input_with_images(
        &self,
    ) -> Result<(ChatTemplateInput, Vec<ChatImage>), GatewayError> {
        let mut images = Vec::new();
        let input = self.rendered(ImageRendering::Seen(&mut images))?;
        Ok((input, images))
    }

    fn rendered(&self, mut images: ImageRendering<'_>) -> Result<ChatTemplateInput, GatewayError> {
        if self.messages.is_empty() {
            return Err(GatewayError::invalid_parameter(
                "messages",
                "`messages` must not be empty",
            ));
        }
        Ok(ChatTemplateInput {
            messages: self
                .messages
                .iter()
                .map(|message| message.template_value(&mut images))
                .collect::<Result<Vec<_>, _>>()?,
            tools: self.tool_definitions(),
            add_generation_prompt: self.add_generation_prompt,
            extra_variables: self.template_variables.clone(),
            special_tokens: Vec::new(),
        })
    }
}

/// `tool_choice` as both OpenAI APIs spell it: `none` / `auto` / `required`, or an object that
/// `function_name` reads a function's name from (chat and Responses nest it differently, `shape`
/// says how).
pub fn tool_choice_naming(
    value: Option<&JsonValue>,
    function_name: impl Fn(&JsonValue) -> Option<&str>,
    shape: &str,
) -> Result<ToolChoice, GatewayError> {
    let invalid = || {
        GatewayError::invalid_parameter(
            "tool_choice",
            format!("`tool_choice` must be `none`, `auto`, `required` or {shape}"),
        )
    };
    match value {
        None | Some(JsonValue::Null) => Ok(ToolChoice::Auto),
        Some(JsonValue::String(text)) => match text.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            _ => Err(invalid()),
        },
        Some(object) => function_name(object)
            .map(|name| ToolChoice::Function(name.to_string()))
            .ok_or_else(invalid),
    }
}

/// Reads a JSON object of template variables (`chat_template_kwargs`) into name/value pairs.
/// A client's reasoning effort (`reasoning_effort`, Responses `reasoning.effort`) as template
/// variables: `none` turns thinking off (`enable_thinking = false`) unless the client set
/// `enable_thinking` itself; other efforts leave the template's default (thinking on). Unknown
/// values are refused by name.
pub fn apply_reasoning_effort(
    conversation: &mut ChatConversation,
    parameter: &str,
    effort: Option<&str>,
) -> Result<(), GatewayError> {
    match effort {
        None | Some("minimal") | Some("low") | Some("medium") | Some("high") => Ok(()),
        Some("none") => {
            if !conversation
                .template_variables
                .iter()
                .any(|(name, _)| name == "enable_thinking")
            {
                conversation
                    .template_variables
                    .push(("enable_thinking".to_string(), Value::from(false)));
            }
            Ok(())
        }
        Some(other) => Err(GatewayError::invalid_parameter(
            parameter,
            format!("`{parameter}` must be one of none, minimal, low, medium, high; got `{other}`"),
        )),
    }
}

pub fn template_variables_from_object(
    parameter: &str,
    object: &Value,
) -> Result<Vec<(String, Value)>, GatewayError> {
    if object.kind() != minijinja::value::ValueKind::Map {
        return Err(GatewayError::invalid_parameter(
            parameter,
            format!("`{parameter}` must be an object"),
        ));
    }
    let mut variables = Vec::new();
    for key in object
        .try_iter()
        .map_err(|error| GatewayError::invalid(error.to_string()))?
    {
        let value = object.get_item(&key).unwrap_or_default();
        variables.push((key.to_string(), value));
    }
    Ok(variables)
}
