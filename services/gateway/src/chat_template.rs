//! Chat templates rendered the way `transformers.apply_chat_template` renders them.
//!
//! Owns: the minijinja environment that mirrors transformers' jinja2 sandbox (`trim_blocks`,
//! `lstrip_blocks`, loop controls, Python string/dict/list methods, `raise_exception`,
//! `strftime_now`, and a `tojson` that is Python's `json.dumps(ensure_ascii=False)`), plus Python
//! `str()` semantics for `{{ value }}` and `|string`. The acceptance test compares renders byte for
//! byte with transformers (tests/chat_templates.rs).
//! Must not touch: tokenization or API request shapes; callers build the messages as plain values.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error as JinjaError, ErrorKind as JinjaErrorKind, Value};

use crate::error::GatewayError;

/// Name under which the one template of an environment is stored.
const TEMPLATE_NAME: &str = "chat_template";

/// One compiled chat template.
pub struct ChatTemplate {
    environment: Environment<'static>,
}

/// Everything a render takes: the same arguments as `apply_chat_template`.
#[derive(Debug, Clone, Default)]
pub struct ChatTemplateInput {
    /// Messages as template values (maps with `role`, `content`, maybe `reasoning_content`,
    /// `tool_calls`, ...), insertion order preserved.
    pub messages: Vec<Value>,
    /// Tool definitions (OpenAI `{"type":"function","function":{...}}` shape), if any.
    pub tools: Option<Vec<Value>>,
    pub add_generation_prompt: bool,
    /// Extra template variables (`chat_template_kwargs`: `enable_thinking`, `preserve_thinking`).
    pub extra_variables: Vec<(String, Value)>,
    /// Special-token strings transformers passes as variables (`bos_token`, `eos_token`, ...).
    pub special_tokens: Vec<(String, String)>,
}

impl ChatTemplate {
    /// Compiles `source`; a template with a syntax error is refused here, not per request.
    pub fn compile(source: &str) -> Result<Self, GatewayError> {
        let mut environment = Environment::new();
        // transformers: ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
        // extensions=[AssistantTracker, loopcontrols]); keep_trailing_newline is jinja2's False.
        environment.set_trim_blocks(true);
        environment.set_lstrip_blocks(true);
        environment.set_keep_trailing_newline(false);
        environment
            .set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        environment.set_formatter(python_formatter);
        environment.add_filter("tojson", tojson_filter);
        environment.add_filter("string", python_string_filter);
        environment.add_function("raise_exception", raise_exception);
        environment.add_function("strftime_now", strftime_now);
        environment
            .add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(source))
            .map_err(|error| {
                GatewayError::ChatTemplate(format!(
                    "the model's chat template does not compile: {error:#}"
                ))
            })?;
        Ok(ChatTemplate { environment })
    }

    /// Renders one conversation; a `raise_exception` in the template becomes a 400 with its text.
    pub fn render(&self, input: &ChatTemplateInput) -> Result<String, GatewayError> {
        let template = self
            .environment
            .get_template(TEMPLATE_NAME)
            .map_err(|error| GatewayError::Internal(format!("chat template missing: {error}")))?;
        let mut context: Vec<(String, Value)> = Vec::new();
        for (name, value) in &input.special_tokens {
            context.push((name.clone(), Value::from(value.clone())));
        }
        context.push(("messages".to_string(), Value::from(input.messages.clone())));
        // transformers passes tools=None when there are none.
        context.push((
            "tools".to_string(),
            input
                .tools
                .clone()
                .map(Value::from)
                .unwrap_or(Value::from(())),
        ));
        context.push((
            "add_generation_prompt".to_string(),
            Value::from(input.add_generation_prompt),
        ));
        // Later entries win, as with Python **kwargs after the fixed arguments.
        for (name, value) in &input.extra_variables {
            context.retain(|(existing, _)| existing != name);
            context.push((name.clone(), value.clone()));
        }
        let context_value: Value = context.into_iter().collect();
        template
            .render(context_value)
            .map_err(|error| GatewayError::ChatTemplate(describe_render_error(&error)))
    }
}

/// transformers' `AssistantTracker` extension adds `{% generation %}…{% endgeneration %}` (it
/// marks assistant tokens for training masks and renders its body unchanged). minijinja has no
/// such tag, so it becomes `{% if true %}…{% endif %}`, keeping the whitespace-control marks.
pub fn rewrite_generation_tags(source: &str) -> String {
    let mut output = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let Some(length) = rest[start..].find("%}") else {
            break;
        };
        let tag = &rest[start..start + length + 2];
        let inner = &tag[2..tag.len() - 2];
        let open_mark = inner.chars().next().filter(|c| *c == '-' || *c == '+');
        let close_mark = inner.chars().last().filter(|c| *c == '-' || *c == '+');
        let keyword = inner.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let replacement = match keyword {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        output.push_str(&rest[..start]);
        match replacement {
            Some(body) => {
                output.push_str("{%");
                output.extend(open_mark);
                output.push(' ');
                output.push_str(body);
                output.push(' ');
                output.extend(close_mark);
                output.push_str("%}");
            }
            None => output.push_str(tag),
        }
        rest = &rest[start + length + 2..];
    }
    output.push_str(rest);
    output
}

/// Error text for a failed render: the `raise_exception` message alone, otherwise the jinja error.
fn describe_render_error(error: &JinjaError) -> String {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(inner) = current {
        if let Some(jinja_error) = inner.downcast_ref::<JinjaError>() {
            if jinja_error.kind() == JinjaErrorKind::InvalidOperation {
                if let Some(detail) = jinja_error.detail() {
                    if let Some(message) = detail.strip_prefix(RAISED_PREFIX) {
                        return message.to_string();
                    }
                }
            }
        }
        current = inner.source();
    }
    format!("{error:#}")
}

const RAISED_PREFIX: &str = "raise_exception: ";

fn raise_exception(message: String) -> Result<Value, JinjaError> {
    Err(JinjaError::new(
        JinjaErrorKind::InvalidOperation,
        format!("{RAISED_PREFIX}{message}"),
    ))
}

/// `strftime_now(format)`: transformers formats `datetime.now()`; the gateway runs in UTC.
fn strftime_now(format: String) -> Result<Value, JinjaError> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|duration| duration.as_secs() as i64)
        .unwrap_or(0);
    Ok(Value::from(python_strftime(&format, now)))
}

/// Python's `strftime` for the directives chat templates use, on a UTC timestamp.
pub fn python_strftime(format: &str, unix_seconds: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const WEEKDAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_seconds.div_euclid(86_400);
    let seconds_of_day = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (
        seconds_of_day / 3600,
        (seconds_of_day / 60) % 60,
        seconds_of_day % 60,
    );
    let month_name = MONTHS[(month - 1) as usize];
    let weekday_name = WEEKDAYS[weekday];
    let mut output = String::new();
    let mut characters = format.chars();
    while let Some(character) = characters.next() {
        if character != '%' {
            output.push(character);
            continue;
        }
        let Some(directive) = characters.next() else {
            output.push('%');
            break;
        };
        let _ = match directive {
            'Y' => write!(output, "{year}"),
            'y' => write!(output, "{:02}", year.rem_euclid(100)),
            'm' => write!(output, "{month:02}"),
            'd' => write!(output, "{day:02}"),
            '-' => match characters.next() {
                Some('d') => write!(output, "{day}"),
                Some('m') => write!(output, "{month}"),
                Some('H') => write!(output, "{hour}"),
                Some(other) => write!(output, "%-{other}"),
                None => write!(output, "%-"),
            },
            'e' => write!(output, "{day:>2}"),
            'B' => write!(output, "{month_name}"),
            'b' | 'h' => write!(output, "{}", &month_name[..3]),
            'A' => write!(output, "{weekday_name}"),
            'a' => write!(output, "{}", &weekday_name[..3]),
            'H' => write!(output, "{hour:02}"),
            'I' => write!(output, "{:02}", if hour % 12 == 0 { 12 } else { hour % 12 }),
            'p' => write!(output, "{}", if hour < 12 { "AM" } else { "PM" }),
            'M' => write!(output, "{minute:02}"),
            'S' => write!(output, "{second:02}"),
            'j' => write!(output, "{day_of_year:03}"),
            'F' => write!(output, "{year}-{month:02}-{day:02}"),
            'T' => write!(output, "{hour:02}:{minute:02}:{second:02}"),
            'Z' => write!(output, "UTC"),
            'z' => write!(output, "+0000"),
            '%' => write!(output, "%"),
            other => write!(output, "%{other}"),
        };
    }
    output
}

/// Days since 1970-01-01 → (year, month, day) in the proleptic Gregorian calendar (Howard
/// Hinnant's algorithm).
pub(crate) fn civil_from_days(days_since_epoch: i64) -> (i64, i64, i64) {
    let shifted = days_since_epoch + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year.rem_euclid(400);
    let month_index = if month > 2 { month - 3 } else { month + 9 };
    let day_of_year = (153 * month_index + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

/// `{{ value }}` prints what Python's `str(value)` prints (jinja2 calls `str`), e.g. `True`, `None`.
fn python_formatter(
    output: &mut minijinja::Output,
    _state: &minijinja::State,
    value: &Value,
) -> Result<(), JinjaError> {
    if value.is_undefined() {
        return Ok(());
    }
    let text = python_str(value);
    output
        .write_str(&text)
        .map_err(|error| JinjaError::new(JinjaErrorKind::WriteFailure, error.to_string()))
}

/// `|string`: Python `str()`, keeping a safe string safe.
fn python_string_filter(value: Value) -> Value {
    if value.kind() == ValueKind::String {
        return value;
    }
    Value::from(python_str(&value))
}

/// Python `str(value)` for the JSON-like values templates see.
pub fn python_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::String => value.as_str().unwrap_or_default().to_string(),
        ValueKind::Undefined => String::new(),
        _ => python_repr(value),
    }
}

/// Python `repr(value)`: `{'a': 1, 'b': [True, None]}`.
pub fn python_repr(value: &Value) -> String {
    let mut output = String::new();
    write_python_repr(&mut output, value);
    output
}

fn write_python_repr(output: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => output.push_str("None"),
        ValueKind::Bool => output.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => write_python_number(output, value),
        ValueKind::String => {
            write_python_string_literal(output, value.as_str().unwrap_or_default())
        }
        ValueKind::Seq | ValueKind::Iterable => {
            output.push('[');
            if let Ok(items) = value.try_iter() {
                for (index, item) in items.enumerate() {
                    if index > 0 {
                        output.push_str(", ");
                    }
                    write_python_repr(output, &item);
                }
            }
            output.push(']');
        }
        ValueKind::Map => {
            output.push('{');
            if let Ok(keys) = value.try_iter() {
                for (index, key) in keys.enumerate() {
                    if index > 0 {
                        output.push_str(", ");
                    }
                    write_python_repr(output, &key);
                    output.push_str(": ");
                    write_python_repr(output, &value.get_item(&key).unwrap_or_default());
                }
            }
            output.push('}');
        }
        _ => output.push_str(&value.to_string()),
    }
}

/// Python string repr: single quotes unless the text has a `'` and no `"`.
fn write_python_string_literal(output: &mut String, text: &str) {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    output.push(quote);
    for character in text.chars() {
        match character {
            '\\' => output.push_str("\\\\"),
            '\n' => output.push_str("\\n"),
            '\r' => output.push_str("\\r"),
            '\t' => output.push_str("\\t"),
            c if c == quote => {
                output.push('\\');
                output.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(output, "\\x{:02x}", c as u32);
            }
            c => output.push(c),
        }
    }
    output.push(quote);
}

fn write_python_number(output: &mut String, value: &Value) {
    if value.is_integer() {
        output.push_str(&value.to_string());
        return;
    }
    match f64::try_from(value.clone()) {
        Ok(number) => output.push_str(&python_float_repr(number)),
        Err(_) => output.push_str(&value.to_string()),
    }
}

/// Python `repr(float)`: shortest round-trip digits, scientific below 1e-4 and from 1e16.
pub fn python_float_repr(number: f64) -> String {
    if number.is_nan() {
        return "nan".to_string();
    }
    if number.is_infinite() {
        return if number > 0.0 {
            "inf".to_string()
        } else {
            "-inf".to_string()
        };
    }
    if number == 0.0 {
        return if number.is_sign_negative() {
            "-0.0".to_string()
        } else {
            "0.0".to_string()
        };
    }
    // `{:e}` gives the shortest round-trip digits as d.ddddde±x.
    let scientific = format!("{number:e}");
    let (mantissa, exponent_text) = scientific
        .split_once('e')
        .unwrap_or((scientific.as_str(), "0"));
    let exponent: i32 = exponent_text.parse().unwrap_or(0);
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let mut output = String::new();
    if negative {
        output.push('-');
    }
    if (-4..16).contains(&exponent) {
        if exponent >= 0 {
            let integer_length = exponent as usize + 1;
            if digits.len() <= integer_length {
                output.push_str(&digits);
                output.push_str(&"0".repeat(integer_length - digits.len()));
                output.push_str(".0");
            } else {
                output.push_str(&digits[..integer_length]);
                output.push('.');
                output.push_str(&digits[integer_length..]);
            }
        } else {
            output.push_str("0.");
            output.push_str(&"0".repeat((-exponent - 1) as usize));
            output.push_str(&digits);
        }
    } else {
        output.push_str(&digits[..1]);
        if digits.len() > 1 {
            output.push('.');
            output.push_str(&digits[1..]);
        }
        let _ = write!(
            output,
            "e{}{:02}",
            if exponent < 0 { '-' } else { '+' },
            exponent.abs()
        );
    }
    output
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
/// sort_keys=sort_keys)`. Unlike minijinja's own it escapes no HTML characters.
fn tojson_filter(value: Value, kwargs: Kwargs) -> Result<Value, JinjaError> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent_text = match indent {
        None => None,
        Some(value) if value.is_none() => None,
        Some(value) if value.kind() == ValueKind::String => {
            Some(value.as_str().unwrap_or_default().to_string())
        }
        Some(value) => Some(" ".repeat(i64::try_from(value).unwrap_or(0).max(0) as usize)),
    };
    // Python's defaults: (', ', ': ') without indent, (',', ': ') with one.
    let (item_separator, key_separator) = match separators.as_ref().filter(|value| !value.is_none())
    {
        Some(pair) => {
            let item = pair
                .get_item(&Value::from(0))
                .ok()
                .map(|v| v.to_string())
                .unwrap_or_else(|| ", ".to_string());
            let key = pair
                .get_item(&Value::from(1))
                .ok()
                .map(|v| v.to_string())
                .unwrap_or_else(|| ": ".to_string());
            (item, key)
        }
        None if indent_text.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let options = PythonJsonOptions {
        indent: indent_text,
        item_separator,
        key_separator,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut output = String::new();
    write_python_json(&mut output, &value, &options, 0)?;
    Ok(Value::from_safe_string(output))
}

struct PythonJsonOptions {
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// Python `json.dumps` of one value, recursively.
pub fn python_json_dumps(value: &Value) -> String {
    let options = PythonJsonOptions {
        indent: None,
        item_separator: ", ".to_string(),
        key_separator: ": ".to_string(),
        sort_keys: false,
        ensure_ascii: false,
    };
    let mut output = String::new();
    let _ = write_python_json(&mut output, value, &options, 0);
    output
}

fn write_newline_and_indent(output: &mut String, options: &PythonJsonOptions, depth: usize) {
    if let Some(indent) = &options.indent {
        output.push('\n');
        for _ in 0..depth {
            output.push_str(indent);
        }
    }
}

fn write_python_json(
    output: &mut String,
    value: &Value,
    options: &PythonJsonOptions,
    depth: usize,
) -> Result<(), JinjaError> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => output.push_str("null"),
        ValueKind::Bool => output.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                output.push_str(&value.to_string());
            } else {
                let number = f64::try_from(value.clone()).unwrap_or(f64::NAN);
                // json.dumps writes float.__repr__, with NaN/Infinity spelled the JavaScript way.
                if number.is_nan() {
                    output.push_str("NaN");
                } else if number.is_infinite() {
                    output.push_str(if number > 0.0 {
                        "Infinity"
                    } else {
                        "-Infinity"
                    });
                } else {
                    output.push_str(&python_float_repr(number));
                }
            }
        }
        ValueKind::String => write_json_string(
            output,
            value.as_str().unwrap_or_default(),
            options.ensure_ascii,
        ),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                output.push_str("[]");
                return Ok(());
            }
            output.push('[');
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    output.push_str(&options.item_separator);
                }
                write_newline_and_indent(output, options, depth + 1);
                write_python_json(output, item, options, depth + 1)?;
            }
            write_newline_and_indent(output, options, depth);
            output.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if keys.is_empty() {
                output.push_str("{}");
                return Ok(());
            }
            if options.sort_keys {
                keys.sort_by_key(|key| key.to_string());
            }
            output.push('{');
            for (index, key) in keys.iter().enumerate() {
                if index > 0 {
                    output.push_str(&options.item_separator);
                }
                write_newline_and_indent(output, options, depth + 1);
                // json.dumps turns non-string keys into strings (True -> "true", 1 -> "1").
                let key_text = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                    ValueKind::Bool => if key.is_true() { "true" } else { "false" }.to_string(),
                    ValueKind::None => "null".to_string(),
                    _ => key.to_string(),
                };
                write_json_string(output, &key_text, options.ensure_ascii);
                output.push_str(&options.key_separator);
                write_python_json(output, &value.get_item(key)?, options, depth + 1)?;
            }
            write_newline_and_indent(output, options, depth);
            output.push('}');
        }
        other => {
            return Err(JinjaError::new(
                JinjaErrorKind::InvalidOperation,
                format!("Object of type {other} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// A JSON string literal as Python's encoder writes it.
fn write_json_string(output: &mut String, text: &str, ensure_ascii: bool) {
    output.push('"');
    for character in text.chars() {
        match character {
            '"' => output.push_str("\\\""),
            '\\' => output.push_str("\\\\"),
            '\n' => output.push_str("\\n"),
            '\r' => output.push_str("\\r"),
            '\t' => output.push_str("\\t"),
            '\u{08}' => output.push_str("\\b"),
            '\u{0c}' => output.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(output, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(output, "\\u{unit:04x}");
                }
            }
            c => output.push(c),
        }
    }
    output.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_render_their_body() {
        let source =
            "{%- for m in messages %}{% generation -%} {{ m }} {%- endgeneration %}|{% endfor %}";
        assert_eq!(
            rewrite_generation_tags(source),
            "{%- for m in messages %}{% if true -%} {{ m }} {%- endif %}|{% endfor %}"
        );
        let template = ChatTemplate::compile(source).unwrap_or_else(|e| panic!("{e}"));
        let input = ChatTemplateInput {
            messages: vec![Value::from("a"), Value::from("b")],
            ..Default::default()
        };
        assert_eq!(template.render(&input).unwrap_or_default(), "a|b|");
    }

    #[test]
    fn float_repr_matches_python() {
        assert_eq!(python_float_repr(1.0), "1.0");
        assert_eq!(python_float_repr(0.1), "0.1");
        assert_eq!(python_float_repr(1e16), "1e+16");
        assert_eq!(python_float_repr(1.5e-5), "1.5e-05");
        assert_eq!(python_float_repr(123456.789), "123456.789");
        assert_eq!(python_float_repr(0.0001), "0.0001");
        assert_eq!(python_float_repr(-2.5), "-2.5");
    }

    #[test]
    fn strftime_formats_a_known_date() {
        // 2024-03-05 14:07:09 UTC, a Tuesday.
        assert_eq!(
            python_strftime("%d %b %Y %A %H:%M:%S %j", 1_709_647_629),
            "05 Mar 2024 Tuesday 14:07:09 065"
        );
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let value: Value =
            serde_json::from_str(r#"{"b": "é<tag>", "a": [1, 2.5, true, null], "c": {}}"#)
                .unwrap_or_default();
        assert_eq!(
            python_json_dumps(&value),
            r#"{"b": "é<tag>", "a": [1, 2.5, true, null], "c": {}}"#
        );
    }

    #[test]
    fn python_str_of_structures() {
        let value: Value =
            serde_json::from_str(r#"{"k": [true, null, "it's"], "n": 1.0}"#).unwrap_or_default();
        assert_eq!(
            python_str(&value),
            r#"{'k': [True, None, "it's"], 'n': 1.0}"#
        );
    }
}
