//! Tokenizer, chat template, generation defaults and the vision tower's settings of a
//! checkpoint directory.

use std::path::Path;

use ninfer_artifact::GenerationDefaults;
use serde_json::Value;

use crate::error::ConvertError;
use crate::ConvertProgress;

pub struct SideFiles {
    pub tokenizer_json: Option<Vec<u8>>,
    /// `tokenizer_config.json` as is (special-token strings the chat template reads).
    pub tokenizer_config_json: Option<Vec<u8>>,
    pub chat_template: Option<String>,
    pub generation: GenerationDefaults,
    /// The vision tower's settings: `config.json`'s `vision_config` with the image and video
    /// token ids and the decoder's `mrope_section` beside it (the engine's vision path reads
    /// them).
    pub vision_config_json: Option<Vec<u8>>,
    /// `preprocessor_config.json` as is (the image processor's settings).
    pub preprocessor_config_json: Option<Vec<u8>>,
    /// The video processor's settings as `transformers` finds them: `processor_config.json`'s
    /// `video_processor` object, else `video_preprocessor_config.json` as is (a checkpoint with
    /// neither has its videos read with `preprocessor_config.json`, which is kept anyway).
    pub video_preprocessor_config_json: Option<Vec<u8>>,
}

/// The keys of a multimodal `config.json` the vision path needs, in one small document.
fn vision_config_document(model_config: &Value) -> Option<Vec<u8>> {
    let vision_config = model_config.get("vision_config")?;
    let mut document = serde_json::Map::new();
    document.insert("vision_config".into(), vision_config.clone());
    for key in [
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
    ] {
        if let Some(value) = model_config.get(key) {
            document.insert(key.into(), value.clone());
        }
    }
    // The decoder's M-RoPE layout, which only image prompts exercise.
    let text_config = model_config.get("text_config").unwrap_or(model_config);
    let mrope_section = ["rope_parameters", "rope_scaling"]
        .iter()
        .find_map(|key| text_config.get(key)?.get("mrope_section"));
    if let Some(section) = mrope_section {
        document.insert("mrope_section".into(), section.clone());
    }
    serde_json::to_vec(&Value::Object(document)).ok()
}

fn read_json(path: &Path) -> Result<Option<Value>, ConvertError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| ConvertError::Input {
                file: path.to_path_buf(),
                problem: format!("not valid JSON: {e}"),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ConvertError::io(path, "reading", e)),
    }
}

fn token_ids(value: Option<&Value>) -> Vec<u32> {
    match value {
        Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(|v| v.as_u64())
            .map(|v| v as u32)
            .collect(),
        _ => Vec::new(),
    }
}

pub fn read_side_files(
    directory: &Path,
    progress: &dyn ConvertProgress,
) -> Result<SideFiles, ConvertError> {
    let tokenizer_path = directory.join("tokenizer.json");
    let tokenizer_json = match std::fs::read(&tokenizer_path) {
        Ok(bytes) => {
            serde_json::from_slice::<Value>(&bytes).map_err(|e| ConvertError::Input {
                file: tokenizer_path.clone(),
                problem: format!("not valid JSON: {e}"),
            })?;
            Some(bytes)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            progress.note(&format!(
                "{}: no tokenizer.json; the artifact will need token ids, not text",
                directory.display()
            ));
            None
        }
        Err(e) => return Err(ConvertError::io(&tokenizer_path, "reading", e)),
    };

    let tokenizer_config = read_json(&directory.join("tokenizer_config.json"))?;
    let template_path = directory.join("chat_template.jinja");
    let chat_template = match std::fs::read_to_string(&template_path) {
        Ok(text) => Some(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            match tokenizer_config
                .as_ref()
                .and_then(|c| c.get("chat_template"))
            {
                Some(Value::String(text)) => Some(text.clone()),
                // A list of named templates: take the default one.
                Some(Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(str::to_string),
                _ => None,
            }
        }
        Err(e) => return Err(ConvertError::io(&template_path, "reading", e)),
    };
    if chat_template.is_none() {
        progress.note(&format!("{}: no chat template found", directory.display()));
    }

    let generation_config =
        read_json(&directory.join("generation_config.json"))?.unwrap_or(Value::Null);
    let model_config = read_json(&directory.join("config.json"))?.unwrap_or(Value::Null);
    let get = |key: &str| generation_config.get(key).or_else(|| model_config.get(key));
    let float = |key: &str| {
        generation_config
            .get(key)
            .and_then(|v| v.as_f64())
            .map(|v| v as f32)
    };
    let mut eos_token_ids = token_ids(get("eos_token_id"));
    if eos_token_ids.is_empty() {
        eos_token_ids = token_ids(
            model_config
                .get("text_config")
                .and_then(|t| t.get("eos_token_id")),
        );
    }
    let generation = GenerationDefaults {
        bos_token_id: token_ids(get("bos_token_id")).first().copied(),
        eos_token_ids,
        pad_token_id: token_ids(get("pad_token_id")).first().copied(),
        temperature: float("temperature"),
        top_p: float("top_p"),
        top_k: generation_config
            .get("top_k")
            .and_then(|v| v.as_u64())
            .map(|v| v as u32),
        min_p: float("min_p"),
        repetition_penalty: float("repetition_penalty"),
        do_sample: generation_config.get("do_sample").and_then(|v| v.as_bool()),
    };
    let tokenizer_config_json = tokenizer_config
        .as_ref()
        .and_then(|c| serde_json::to_vec(c).ok());
    let preprocessor_config_json = read_json(&directory.join("preprocessor_config.json"))?
        .and_then(|c| serde_json::to_vec(&c).ok());
    let nested_video_processor = read_json(&directory.join("processor_config.json"))?
        .and_then(|processor| processor.get("video_processor").cloned());
    let video_preprocessor_config_json = match nested_video_processor {
        Some(video_processor) => Some(video_processor),
        None => read_json(&directory.join("video_preprocessor_config.json"))?,
    }
    .and_then(|c| serde_json::to_vec(&c).ok());
    Ok(SideFiles {
        tokenizer_json,
        tokenizer_config_json,
        chat_template,
        generation,
        vision_config_json: vision_config_document(&model_config),
        preprocessor_config_json,
        video_preprocessor_config_json,
    })
}
