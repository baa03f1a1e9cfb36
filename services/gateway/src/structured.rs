//! Structured output: what a request demands of the answer's shape, as a grammar the engine
//! enforces token by token.
//!
//! Owns: checking a JSON schema against the keywords the engine enforces (a 400 naming the
//! others), and writing the answer grammar (llguidance's Lark dialect) for JSON answers and for
//! forced tool calls in the model's own tool-call syntax (Qwen3 JSON or Qwen3.5 XML).
//! Must not touch: API JSON shapes (each dialect reads its own `response_format` or
//! `text.format` into a [`ResponseFormat`]), tokens (the engine compiles the grammar against its
//! vocabulary).

use serde_json::{json, Map, Value as JsonValue};

/// The answer shapes this module reads and writes grammars for belong to the chat model.
pub use crate::chat::ResponseFormat;
use crate::chat::ToolChoice;
use crate::error::GatewayError;

/// How the model writes a tool call, read from its chat template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolCallSyntax {
    /// Qwen3: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
    Json,
    /// Qwen3.5/3.6: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...`.
    Xml,
}

impl ToolCallSyntax {
    /// The syntax a chat template teaches the model.
    pub fn of_template(source: &str) -> Self {
        if source.contains("<function=") {
            ToolCallSyntax::Xml
        } else {
            ToolCallSyntax::Json
        }
    }
}

/// JSON-schema keywords the engine's grammar enforces, and annotations it may ignore.
const ENFORCED_KEYWORDS: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "$defs",
    "definitions",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minProperties",
    "maxProperties",
    "patternProperties",
];
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "readOnly",
    "writeOnly",
    "deprecated",
    "strict",
];

/// A JSON schema `response_format`, checked ([`check_schema`]) at `parameter`.
pub fn json_schema_format(
    schema: &JsonValue,
    parameter: &str,
) -> Result<ResponseFormat, GatewayError> {
    check_schema(schema, parameter)?;
    Ok(ResponseFormat::JsonSchema(schema.clone()))
}

/// Refuses a schema that uses keywords the grammar would not enforce, naming each with its
/// place in the schema, so a client never gets output that only looks schema-valid.
pub fn check_schema(schema: &JsonValue, parameter: &str) -> Result<(), GatewayError> {
    let mut unsupported = Vec::new();
    collect_unsupported(schema, "#", &mut unsupported);
    if !schema.is_object() && !schema.is_boolean() {
        return Err(GatewayError::invalid_parameter(
            parameter,
            format!("`{parameter}` must be a JSON schema object"),
        ));
    }
    if unsupported.is_empty() {
        return Ok(());
    }
    unsupported.truncate(20);
    Err(GatewayError::invalid_parameter(
        parameter,
        format!(
            "`{parameter}` uses JSON-schema keywords that constrained decoding does not support: {}; supported: {}",
            unsupported.join(", "),
            ENFORCED_KEYWORDS.join(", ")
        ),
    ))
}

fn collect_unsupported(schema: &JsonValue, path: &str, out: &mut Vec<String>) {
    let Some(object) = schema.as_object() else {
        return;
    };
    for (key, value) in object {
        if !ENFORCED_KEYWORDS.contains(&key.as_str()) && !ANNOTATIONS.contains(&key.as_str()) {
            out.push(format!("`{key}` at {path}"));
            continue;
        }
        match key.as_str() {
            "properties" | "$defs" | "definitions" | "patternProperties" => {
                for (name, sub) in value.as_object().into_iter().flatten() {
                    collect_unsupported(sub, &format!("{path}/{key}/{name}"), out);
                }
            }
            "items" | "additionalProperties" => {
                collect_unsupported(value, &format!("{path}/{key}"), out)
            }
            "anyOf" | "oneOf" | "allOf" | "prefixItems" => {
                for (index, sub) in value.as_array().into_iter().flatten().enumerate() {
                    collect_unsupported(sub, &format!("{path}/{key}/{index}"), out);
                }
            }
            _ => {}
        }
    }
}

/// Compact JSON (no free whitespace): a model cannot stall in whitespace, and the output
/// parses the same.
fn guidance_options() -> JsonValue {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// `schema` with `additionalProperties: false` on every object schema that does not say
/// otherwise: strict structured output (OpenAI's `strict`) and tool arguments allow only the
/// declared properties.
fn strict(schema: &JsonValue) -> JsonValue {
    match schema {
        JsonValue::Object(object) => {
            let mut out = Map::new();
            for (key, value) in object {
                // Annotations the grammar compiler does not know: they constrain nothing.
                if matches!(key.as_str(), "deprecated" | "strict") {
                    continue;
                }
                let value = match key.as_str() {
                    "properties" | "$defs" | "definitions" => JsonValue::Object(
                        value
                            .as_object()
                            .into_iter()
                            .flatten()
                            .map(|(name, sub)| (name.clone(), strict(sub)))
                            .collect(),
                    ),
                    "items" | "additionalProperties" => strict(value),
                    "anyOf" | "oneOf" | "allOf" | "prefixItems" => JsonValue::Array(
                        value.as_array().into_iter().flatten().map(strict).collect(),
                    ),
                    _ => value.clone(),
                };
                out.insert(key.clone(), value);
            }
            let is_object = object.get("type").and_then(JsonValue::as_str) == Some("object")
                || object.contains_key("properties");
            if is_object && !object.contains_key("additionalProperties") {
                out.insert("additionalProperties".into(), JsonValue::Bool(false));
            }
            JsonValue::Object(out)
        }
        other => other.clone(),
    }
}

/// A schema ready to embed at the root of a grammar: strict, compact, with the options.
fn root_schema(schema: &JsonValue) -> JsonValue {
    let mut schema = match strict(schema) {
        JsonValue::Bool(true) => json!({}),
        other => other,
    };
    if let Some(object) = schema.as_object_mut() {
        object.insert("x-guidance".into(), guidance_options());
    }
    schema
}

/// A Lark string literal (JSON's escapes are Lark's).
fn literal(text: &str) -> String {
    JsonValue::from(text).to_string()
}

/// The grammar of a JSON answer (`None` for free text).
pub fn response_format_grammar(format: &ResponseFormat) -> Option<String> {
    let schema = match format {
        ResponseFormat::Text => return None,
        ResponseFormat::JsonObject => json!({"type": "object"}),
        ResponseFormat::JsonSchema(schema) => schema.clone(),
    };
    Some(format!(
        "start: /[ \\n]{{0,2}}/ %json {}\n",
        root_schema(&schema)
    ))
}

/// One declared tool: its name and parameters schema.
#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub name: String,
    pub parameters: JsonValue,
}

/// The tools of OpenAI-shaped definitions (`{"type": "function", "function": {...}}`).
pub fn tool_specs(definitions: &[minijinja::Value]) -> Result<Vec<ToolSpec>, GatewayError> {
    let mut specs = Vec::new();
    for definition in definitions {
        let value = serde_json::to_value(definition)
            .map_err(|error| GatewayError::invalid_parameter("tools", error.to_string()))?;
        let function = value.get("function").unwrap_or(&value);
        let Some(name) = function.get("name").and_then(JsonValue::as_str) else {
            continue;
        };
        let parameters = function
            .get("parameters")
            .filter(|p| !p.is_null())
            .cloned()
            .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
        check_schema(&parameters, &format!("tools[{name}].parameters"))?;
        specs.push(ToolSpec {
            name: name.to_string(),
            parameters,
        });
    }
    Ok(specs)
}

/// The grammar of an answer that must be tool calls (`tool_choice` required or named): one
/// call, or with `parallel` one or more, each in the model's syntax with arguments valid for
/// that tool's schema. `None` when the choice forces nothing.
pub fn forced_tool_grammar(
    choice: &ToolChoice,
    tools: &[ToolSpec],
    syntax: ToolCallSyntax,
    parallel: bool,
) -> Result<Option<String>, GatewayError> {
    let chosen: Vec<&ToolSpec> = match choice {
        ToolChoice::Auto | ToolChoice::None => return Ok(None),
        ToolChoice::Required => tools.iter().collect(),
        ToolChoice::Function(name) => tools.iter().filter(|t| &t.name == name).collect(),
    };
    if chosen.is_empty() {
        return Err(GatewayError::invalid_parameter(
            "tool_choice",
            "`tool_choice` forces a tool call but no matching tool is declared",
        ));
    }
    let mut rules = Vec::new();
    let mut alternatives = Vec::new();
    for (index, tool) in chosen.iter().enumerate() {
        let rule = format!("call_{index}");
        alternatives.push(rule.clone());
        let body = match syntax {
            ToolCallSyntax::Json => json_call_body(tool),
            ToolCallSyntax::Xml => xml_call_body(tool, index, &mut rules)?,
        };
        rules.push(format!(
            "{rule}: \"<tool_call>\\n\" {body} \"\\n</tool_call>\""
        ));
    }
    let calls = if parallel {
        "call (\"\\n\" call)*"
    } else {
        "call"
    };
    let mut grammar = format!(
        "start: /[ \\n]{{0,2}}/ {calls}\ncall: {}\n",
        alternatives.join(" | ")
    );
    for rule in rules {
        grammar.push_str(&rule);
        grammar.push('\n');
    }
    Ok(Some(grammar))
}

/// `{"name": "NAME", "arguments": {...}}` as one JSON value.
fn json_call_body(tool: &ToolSpec) -> String {
    let mut parameters = bounded_numbers(&tool.parameters);
    // References inside the parameters point at the parameters' root: lift its definitions.
    let mut wrapper = json!({
        "type": "object",
        "properties": {"name": {"const": tool.name}},
        "required": ["name", "arguments"],
    });
    for key in ["$defs", "definitions"] {
        if let Some(defs) = parameters.as_object_mut().and_then(|p| p.remove(key)) {
            wrapper[key] = defs;
        }
    }
    wrapper["properties"]["arguments"] = parameters;
    format!("%json {}", root_schema(&wrapper))
}

/// `<function=NAME>\n` then each parameter as `<parameter=KEY>\nVALUE\n</parameter>\n`
/// (required ones always, others optionally, in declaration order), then `</function>`.
/// String values are raw text without `<` (so the block's tags stay unambiguous); others are
/// compact JSON for their schema.
fn xml_call_body(
    tool: &ToolSpec,
    index: usize,
    rules: &mut Vec<String>,
) -> Result<String, GatewayError> {
    let strict_parameters = strict(&tool.parameters);
    let definitions: Map<String, JsonValue> = ["$defs", "definitions"]
        .iter()
        .filter_map(|key| Some((key.to_string(), strict_parameters.get(*key)?.clone())))
        .collect();
    let required: Vec<&str> = strict_parameters
        .get("required")
        .and_then(JsonValue::as_array)
        .into_iter()
        .flatten()
        .filter_map(JsonValue::as_str)
        .collect();
    let mut parts = vec![literal(&format!("<function={}>\n", tool.name))];
    let properties = strict_parameters
        .get("properties")
        .and_then(JsonValue::as_object)
        .cloned()
        .unwrap_or_default();
    for (position, (key, schema)) in properties.iter().enumerate() {
        let rule = format!("param_{index}_{position}");
        let is_string = schema.get("type").and_then(JsonValue::as_str) == Some("string")
            && schema.get("enum").is_none();
        if is_string && schema.get("format").is_some() {
            // The value is raw text here, not a JSON string the format's grammar describes.
            return Err(GatewayError::invalid_parameter(
                "tool_choice",
                format!(
                    "tool `{}`: `format` on the string parameter `{key}` cannot be enforced in this model's tool-call syntax",
                    tool.name
                ),
            ));
        }
        let pattern = schema
            .get("pattern")
            .and_then(JsonValue::as_str)
            .filter(|_| is_string);
        let value = if let Some(pattern) = pattern {
            // A whole-value match also matches the (unanchored) JSON-schema pattern.
            let body = pattern.strip_prefix('^').unwrap_or(pattern);
            let body = body.strip_suffix('$').unwrap_or(body);
            format!("/{}/", body.replace('/', "\\/"))
        } else if is_string && schema.get("pattern").is_none() {
            let max = schema
                .get("maxLength")
                .and_then(JsonValue::as_u64)
                .map(|m| m.to_string())
                .unwrap_or_default();
            let min = schema
                .get("minLength")
                .and_then(JsonValue::as_u64)
                .unwrap_or(0);
            format!("/[^<]{{{min},{max}}}/")
        } else if let Some(number) = plain_number(schema) {
            number.to_string()
        } else if let Some(values) = schema
            .get("enum")
            .and_then(JsonValue::as_array)
            .filter(|values| values.iter().all(JsonValue::is_string))
        {
            let alternatives: Vec<String> = values
                .iter()
                .filter_map(JsonValue::as_str)
                .map(literal)
                .collect();
            format!("({})", alternatives.join(" | "))
        } else {
            let mut schema = schema.clone();
            if let Some(object) = schema.as_object_mut() {
                for (key, defs) in &definitions {
                    object.insert(key.clone(), defs.clone());
                }
            }
            format!("%json {}", root_schema(&schema))
        };
        rules.push(format!(
            "{rule}: {} {value} \"\\n</parameter>\\n\"",
            literal(&format!("<parameter={key}>\n"))
        ));
        if required.contains(&key.as_str()) {
            parts.push(rule);
        } else {
            parts.push(format!("{rule}?"));
        }
    }
    parts.push(literal("</function>"));
    Ok(parts.join(" "))
}

/// `schema` with every unbounded `number` / `integer` limited to ±10^15: the arguments parser
/// reads f64, and JSON's exponent form would otherwise let `1e99999` through.
fn bounded_numbers(schema: &JsonValue) -> JsonValue {
    match schema {
        JsonValue::Object(object) => {
            let mut out: Map<String, JsonValue> = object
                .iter()
                .map(|(key, value)| (key.clone(), bounded_numbers(value)))
                .collect();
            let numeric = matches!(
                object.get("type").and_then(JsonValue::as_str),
                Some("number" | "integer")
            );
            if numeric {
                for (key, limit) in [("minimum", -1e15), ("maximum", 1e15)] {
                    let exclusive = if key == "minimum" {
                        "exclusiveMinimum"
                    } else {
                        "exclusiveMaximum"
                    };
                    if !out.contains_key(key) && !out.contains_key(exclusive) {
                        out.insert(key.into(), json!(limit));
                    }
                }
            }
            JsonValue::Object(out)
        }
        JsonValue::Array(items) => JsonValue::Array(items.iter().map(bounded_numbers).collect()),
        other => other.clone(),
    }
}

/// A value regex for an unbounded `number` or `integer` parameter: plain decimals of at most
/// 15 significant digits, which the parameter typing reads back as the same number (JSON's
/// exponent form would let `1e999999` through, which no f64 holds).
fn plain_number(schema: &JsonValue) -> Option<&'static str> {
    let object = schema.as_object()?;
    let only_type = object.keys().all(|key| {
        key == "type" || ANNOTATIONS.contains(&key.as_str()) || key == "additionalProperties"
    });
    if !only_type {
        return None;
    }
    match object.get("type")?.as_str()? {
        "integer" => Some("/-?(0|[1-9][0-9]{0,14})/"),
        "number" => Some("/-?(0|[1-9][0-9]{0,14})(\\.[0-9]{1,6})?/"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_keywords_are_named_with_their_place() {
        let schema = json!({
            "type": "object",
            "properties": {
                "a": {"type": "string", "not": {"const": "x"}},
                "b": {"type": "array", "items": {"type": "integer"}, "uniqueItems": true}
            },
            "if": {"properties": {}}
        });
        let error = check_schema(&schema, "response_format")
            .unwrap_err()
            .to_string();
        for part in [
            "`not` at #/properties/a",
            "`uniqueItems` at #/properties/b",
            "`if` at #",
        ] {
            assert!(error.contains(part), "{error}");
        }
        let fine = json!({"type": "object", "title": "T", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]});
        check_schema(&fine, "response_format").unwrap();
    }

    #[test]
    fn strict_closes_objects_that_do_not_say_otherwise() {
        let schema = json!({"type": "object", "properties": {"inner": {"type": "object", "properties": {}}, "open": {"type": "object", "additionalProperties": true}}});
        let strict = strict(&schema);
        assert_eq!(strict["additionalProperties"], false);
        assert_eq!(strict["properties"]["inner"]["additionalProperties"], false);
        assert_eq!(strict["properties"]["open"]["additionalProperties"], true);
    }
}
