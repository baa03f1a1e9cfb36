//! The model hubs: Hugging Face and ModelScope, their endpoints and tokens, their file listings,
//! and choosing between them (`--source auto` asks Hugging Face first and falls back to
//! ModelScope when it does not answer in a few seconds or does not have the model).
//!
//! Owns: the HTTP client of the hubs (whole files and byte ranges), listing parsing, the
//! messages that name a hub's refusal (404, 401/403).
//! Must not touch: what is downloaded or converted (`download`, `stream`), files on disk.

use std::time::Duration;

use anyhow::{bail, Context};

/// Environment variable choosing the hub (`auto`, `huggingface` or `modelscope`).
pub const SOURCE_VARIABLE: &str = "NINFER_SOURCE";

/// How long the first hub of `--source auto` may take to answer before the next is tried.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Which hub `--source` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SourceChoice {
    /// Hugging Face, then ModelScope when Hugging Face does not answer or has no such model.
    Auto,
    /// Hugging Face only (`HF_ENDPOINT` names a mirror; `HF_TOKEN` for gated models).
    Huggingface,
    /// ModelScope only (`MODELSCOPE_ENDPOINT` names another site).
    Modelscope,
}

impl SourceChoice {
    /// `--source`, else `NINFER_SOURCE`, else auto.
    pub fn chosen(flag: Option<SourceChoice>) -> anyhow::Result<SourceChoice> {
        if let Some(choice) = flag {
            return Ok(choice);
        }
        match std::env::var(SOURCE_VARIABLE) {
            Err(_) => Ok(SourceChoice::Auto),
            Ok(text) => match text.trim().to_ascii_lowercase().as_str() {
                "" | "auto" => Ok(SourceChoice::Auto),
                "huggingface" | "hf" => Ok(SourceChoice::Huggingface),
                "modelscope" | "ms" => Ok(SourceChoice::Modelscope),
                other => {
                    bail!("{SOURCE_VARIABLE}={other}: give auto, huggingface or modelscope")
                }
            },
        }
    }

    fn hubs(self) -> &'static [ModelSource] {
        match self {
            SourceChoice::Auto => &[ModelSource::Huggingface, ModelSource::Modelscope],
            SourceChoice::Huggingface => &[ModelSource::Huggingface],
            SourceChoice::Modelscope => &[ModelSource::Modelscope],
        }
    }
}

/// One hub.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelSource {
    Huggingface,
    Modelscope,
}

impl ModelSource {
    pub fn name(self) -> &'static str {
        match self {
            ModelSource::Huggingface => "Hugging Face",
            ModelSource::Modelscope => "ModelScope",
        }
    }

    fn endpoint(self) -> String {
        let (variable, default) = match self {
            ModelSource::Huggingface => ("HF_ENDPOINT", "https://huggingface.co"),
            ModelSource::Modelscope => ("MODELSCOPE_ENDPOINT", "https://www.modelscope.cn"),
        };
        std::env::var(variable)
            .ok()
            .filter(|value| !value.trim().is_empty())
            .unwrap_or_else(|| default.to_string())
            .trim_end_matches('/')
            .to_string()
    }

    fn listing_url(self, endpoint: &str, repository: &str) -> String {
        match self {
            ModelSource::Huggingface => {
                format!("{endpoint}/api/models/{repository}/tree/main?recursive=true")
            }
            ModelSource::Modelscope => format!(
                "{endpoint}/api/v1/models/{repository}/repo/files?Revision=master&Recursive=true"
            ),
        }
    }

    fn file_url(self, endpoint: &str, repository: &str, path: &str) -> String {
        match self {
            ModelSource::Huggingface => format!("{endpoint}/{repository}/resolve/main/{path}"),
            ModelSource::Modelscope => format!(
                "{endpoint}/api/v1/models/{repository}/repo?Revision=master&FilePath={path}"
            ),
        }
    }
}

/// One file of a repository as the hub lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepositoryFile {
    pub path: String,
    pub size: u64,
    /// Lower-case hex SHA-256 when the hub gives one (large files).
    pub sha256: Option<String>,
}

/// The files of a Hugging Face tree listing (`[{"type":"file","path","size","lfs":{"oid"}}]`)
/// or a ModelScope one (`{"Data":{"Files":[{"Type":"blob","Path","Size","Sha256"}]}}`).
pub fn parse_listing(source: ModelSource, text: &str) -> anyhow::Result<Vec<RepositoryFile>> {
    let json: serde_json::Value =
        serde_json::from_str(text).context("the hub's file list is not JSON")?;
    let entries = match source {
        ModelSource::Huggingface => json.as_array().cloned(),
        ModelSource::Modelscope => json
            .pointer("/Data/Files")
            .and_then(|files| files.as_array())
            .cloned(),
    }
    .context("the hub's file list has no files array")?;
    let mut files = Vec::new();
    for entry in entries {
        let text_field = |names: &[&str]| {
            names
                .iter()
                .find_map(|name| entry.get(*name).and_then(|v| v.as_str()))
                .map(str::to_string)
        };
        let kind = text_field(&["type", "Type"]).unwrap_or_default();
        if kind != "file" && kind != "blob" {
            continue;
        }
        let Some(path) = text_field(&["path", "Path"]) else {
            continue;
        };
        let size = ["size", "Size"]
            .iter()
            .find_map(|name| entry.get(*name).and_then(|v| v.as_u64()))
            .unwrap_or(0);
        let sha256 = entry
            .pointer("/lfs/oid")
            .and_then(|v| v.as_str())
            .map(str::to_string)
            .or_else(|| text_field(&["Sha256"]))
            .map(|hash| hash.trim_start_matches("sha256:").to_ascii_lowercase())
            .filter(|hash| hash.len() == 64 && hash.chars().all(|c| c.is_ascii_hexdigit()));
        files.push(RepositoryFile { path, size, sha256 });
    }
    Ok(files)
}

/// What a run needs of a repository: its `.ninfer` conversion when it publishes one, else the
/// checkpoint (safetensors, configs, tokenizer and chat template files).
pub fn files_to_download(files: &[RepositoryFile]) -> Vec<RepositoryFile> {
    let safe = |path: &str| !path.split('/').any(|part| part.is_empty() || part == "..");
    let conversion: Vec<RepositoryFile> = files
        .iter()
        .filter(|file| {
            safe(&file.path)
                && (file.path.ends_with(".ninfer") || file.path.contains(".ninfer.part-"))
        })
        .cloned()
        .collect();
    if !conversion.is_empty() {
        return conversion;
    }
    files
        .iter()
        .filter(|file| safe(&file.path) && !file.path.contains('/'))
        .filter(|file| {
            [
                ".safetensors",
                ".json",
                ".jinja",
                ".txt",
                ".model",
                ".tiktoken",
            ]
            .iter()
            .any(|suffix| file.path.ends_with(suffix))
        })
        .cloned()
        .collect()
}

/// A client for one hub.
pub struct Hub {
    pub source: ModelSource,
    endpoint: String,
    token: Option<String>,
    agent: ureq::Agent,
}

/// The hub that answered for a repository, and the repository's files there.
pub struct Connected {
    pub hub: Hub,
    pub repository: String,
    pub files: Vec<RepositoryFile>,
}

/// Lists `repository` on the hubs `choice` names, in order, until one has it.
pub fn connect(repository: &str, choice: SourceChoice) -> anyhow::Result<Connected> {
    let hubs = choice.hubs();
    let mut failures = Vec::new();
    for (index, &source) in hubs.iter().enumerate() {
        // Only a hub with another after it is given a short time to answer.
        let probe = (index + 1 < hubs.len()).then_some(PROBE_TIMEOUT);
        let hub = Hub::new(source, probe);
        match hub.list(repository) {
            Ok(files) => {
                if index > 0 {
                    eprintln!(
                        "{repository}: using {} ({} did not serve it)",
                        source.name(),
                        hubs[0].name()
                    );
                }
                return Ok(Connected {
                    hub: Hub::new(source, None),
                    repository: repository.to_string(),
                    files,
                });
            }
            Err(error) => failures.push(format!("{error:#}")),
        }
    }
    match failures.as_slice() {
        [one] => bail!("{one}"),
        _ => bail!(
            "{repository}: tried {}; none served it: {}",
            hubs.iter()
                .map(|hub| hub.name())
                .collect::<Vec<_>>()
                .join(", then "),
            failures.join("; ")
        ),
    }
}

impl Hub {
    /// A client of `source`; `probe` bounds the time to connect and to each answer.
    pub fn new(source: ModelSource, probe: Option<Duration>) -> Self {
        let endpoint = source.endpoint();
        let token = match source {
            ModelSource::Huggingface => std::env::var("HF_TOKEN").ok(),
            ModelSource::Modelscope => std::env::var("MODELSCOPE_API_TOKEN").ok(),
        }
        .filter(|token| !token.trim().is_empty());
        let local = ["://127.0.0.1", "://localhost", "://[::1]"]
            .iter()
            .any(|host| endpoint.contains(host));
        let mut config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(probe.unwrap_or(Duration::from_secs(30))))
            .timeout_recv_response(probe)
            .timeout_per_read(Some(probe.unwrap_or(Duration::from_secs(60))))
            .user_agent(concat!("ninfer/", env!("CARGO_PKG_VERSION")));
        if local {
            // A mirror on this machine is reached directly, whatever proxy the environment sets.
            config = config.proxy(None);
        }
        Hub {
            source,
            endpoint,
            token,
            agent: config.build().into(),
        }
    }

    /// GET `url` from byte `from_byte` to the end.
    pub fn get(
        &self,
        url: &str,
        from_byte: u64,
    ) -> Result<ureq::http::Response<ureq::Body>, ureq::Error> {
        let range = (from_byte > 0).then(|| format!("bytes={from_byte}-"));
        self.request(url, range)
    }

    /// GET bytes `start..end` of `url`.
    pub fn get_range(
        &self,
        url: &str,
        start: u64,
        end: u64,
    ) -> Result<ureq::http::Response<ureq::Body>, ureq::Error> {
        self.request(
            url,
            Some(format!("bytes={start}-{}", end.saturating_sub(1))),
        )
    }

    fn request(
        &self,
        url: &str,
        range: Option<String>,
    ) -> Result<ureq::http::Response<ureq::Body>, ureq::Error> {
        let mut request = self.agent.get(url);
        if let Some(token) = &self.token {
            request = request.header("Authorization", &format!("Bearer {token}"));
        }
        if let Some(range) = range {
            request = request.header("Range", &range);
        }
        request.call()
    }

    /// The URL of `path` in `repository` on this hub.
    pub fn file_url(&self, repository: &str, path: &str) -> String {
        self.source.file_url(&self.endpoint, repository, path)
    }

    /// The variable holding this hub's token.
    pub fn token_variable(&self) -> &'static str {
        match self.source {
            ModelSource::Huggingface => "HF_TOKEN",
            ModelSource::Modelscope => "MODELSCOPE_API_TOKEN",
        }
    }

    fn list(&self, repository: &str) -> anyhow::Result<Vec<RepositoryFile>> {
        let url = self.source.listing_url(&self.endpoint, repository);
        let mut response = self
            .get(&url, 0)
            .with_context(|| format!("{repository}: asking {} ({url})", self.source.name()))?;
        let status = response.status().as_u16();
        match status {
            200 => {}
            401 | 403 => bail!(
                "{repository}: {} refuses access ({status} from {url}); for a gated or private model \
                 set {}",
                self.source.name(),
                self.token_variable()
            ),
            404 => bail!(
                "{repository}: no such model on {} (404 from {url}); check the name, or choose \
                 another hub with --source / {SOURCE_VARIABLE}",
                self.source.name()
            ),
            _ => bail!(
                "{repository}: {} answered {status} listing the model's files ({url})",
                self.source.name()
            ),
        }
        let text = response
            .body_mut()
            .with_config()
            .limit(64 << 20)
            .read_to_string()
            .with_context(|| format!("{repository}: reading the file list from {url}"))?;
        parse_listing(self.source, &text).with_context(|| format!("{repository}: {url}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_hubs_listings_parse() {
        let huggingface = r#"[{"type":"directory","path":"original"},
            {"type":"file","path":"config.json","size":10},
            {"type":"file","path":"model.safetensors","size":20,"lfs":{"oid":"AB00000000000000000000000000000000000000000000000000000000000000","size":20}}]"#;
        let files = parse_listing(ModelSource::Huggingface, huggingface).unwrap();
        assert_eq!(files.len(), 2);
        assert_eq!(files[1].sha256.as_deref().map(|h| &h[..4]), Some("ab00"));
        let modelscope = r#"{"Code":200,"Data":{"Files":[{"Type":"tree","Path":"x"},{"Type":"blob","Path":"config.json","Size":10,"Sha256":""}]}}"#;
        let files = parse_listing(ModelSource::Modelscope, modelscope).unwrap();
        assert_eq!(
            files,
            vec![RepositoryFile {
                path: "config.json".into(),
                size: 10,
                sha256: None
            }]
        );
    }

    #[test]
    fn a_published_conversion_wins_over_the_checkpoint() {
        let file = |path: &str| RepositoryFile {
            path: path.into(),
            size: 1,
            sha256: None,
        };
        let checkpoint = [
            file("config.json"),
            file("model.safetensors"),
            file("README.md"),
            file("pytorch_model.bin"),
            file("original/consolidated.safetensors"),
            file("../escape.json"),
        ];
        let chosen: Vec<String> = files_to_download(&checkpoint)
            .into_iter()
            .map(|f| f.path)
            .collect();
        assert_eq!(chosen, ["config.json", "model.safetensors"]);
        let mut with_conversion = checkpoint.to_vec();
        with_conversion.push(file("model.ninfer"));
        let chosen: Vec<String> = files_to_download(&with_conversion)
            .into_iter()
            .map(|f| f.path)
            .collect();
        assert_eq!(chosen, ["model.ninfer"]);
    }
}
