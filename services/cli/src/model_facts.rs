//! What the plan needs to know about a model — its config, parameter count and the bytes of its
//! routed-expert banks and dense weights — read from a `.ninfer` artifact's header or from a
//! checkpoint directory's `config.json` and safetensors headers, without converting or reading
//! any tensor data (so `--dry-run` on a 100 GB checkpoint reads a few kilobytes).
//!
//! Owns: locating the model a path names and summarising it.
//! Must not touch: tensor data, conversion (`serve::resolve_model` converts when a run needs it).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use ninfer_artifact::{Artifact, CommonConfig, TensorClass};

/// What a MODEL path names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelLocation {
    /// A `.ninfer` artifact (its first file).
    Artifact(PathBuf),
    /// A Hugging Face checkpoint directory (`config.json` + safetensors), not yet converted.
    Checkpoint(PathBuf),
}

/// Environment variable naming the models directory (`--models-dir` wins over it).
pub const MODELS_DIR_VARIABLE: &str = "NINFER_MODELS_DIR";

/// Where models named `ORG/NAME` live: `--models-dir`, else `$NINFER_MODELS_DIR`, else
/// `~/ninfer-models`.
pub fn models_dir(flag: Option<&Path>) -> PathBuf {
    flag.map(Path::to_path_buf)
        .or_else(|| std::env::var_os(MODELS_DIR_VARIABLE).map(PathBuf::from))
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join("ninfer-models")))
        .unwrap_or_else(|| PathBuf::from("ninfer-models"))
}

/// `ORG/NAME` as the hub spells a repository: relative, exactly two plain components.
pub fn repository_id(path: &Path) -> Option<(String, String)> {
    let text = path.to_str()?;
    let (organisation, name) = text.split_once('/')?;
    let plain = |part: &str| {
        !part.is_empty()
            && part != "."
            && part != ".."
            && part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    (plain(organisation) && plain(name)).then(|| (organisation.to_string(), name.to_string()))
}

/// MODEL may be the artifact, a directory holding exactly one `.ninfer`, a Hugging Face
/// checkpoint directory, or a repository id `ORG/NAME` found as `MODELS_DIR/ORG/NAME`.
pub fn locate_model_in(path: &Path, models_dir: &Path) -> anyhow::Result<ModelLocation> {
    if !path.exists() {
        if let Some((organisation, name)) = repository_id(path) {
            let local = models_dir.join(&organisation).join(&name);
            if local.exists() {
                return locate_model(&local);
            }
            bail!(
                "{organisation}/{name}: not in the models directory {} (a run without --dry-run \
                 downloads it into {}; or put the checkpoint or its .ninfer conversion there, or \
                 name another directory with --models-dir or {MODELS_DIR_VARIABLE})",
                models_dir.display(),
                local.display()
            );
        }
    }
    locate_model(path)
}

/// MODEL may be the artifact, a directory holding exactly one `.ninfer`, or a Hugging Face
/// checkpoint directory.
pub fn locate_model(path: &Path) -> anyhow::Result<ModelLocation> {
    if !path.is_dir() {
        if !path.exists() {
            bail!("{}: no such file or directory", path.display());
        }
        return Ok(ModelLocation::Artifact(path.to_path_buf()));
    }
    let found: Vec<PathBuf> = std::fs::read_dir(path)
        .with_context(|| format!("listing {}", path.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "ninfer"))
        .collect();
    match found.as_slice() {
        [one] => Ok(ModelLocation::Artifact(one.clone())),
        [] if ninfer_convert::is_checkpoint_dir(path) => {
            Ok(ModelLocation::Checkpoint(path.to_path_buf()))
        }
        [] => bail!(
            "{}: no .ninfer artifact in this directory (make one with `ninfer convert`)",
            path.display()
        ),
        many => bail!(
            "{}: {} .ninfer artifacts here; name one",
            path.display(),
            many.len()
        ),
    }
}

/// A model summarised for planning.
#[derive(Debug, Clone)]
pub struct ModelFacts {
    pub location: ModelLocation,
    pub architecture: String,
    pub common: CommonConfig,
    pub parameters: u64,
    /// Bytes of the routed experts (what the expert workers map and lock).
    pub expert_bank_bytes: u64,
    /// Bytes of the embeddings and dense weights (what the engine loads).
    pub dense_bytes: u64,
    /// The part of `dense_bytes` that is dense-MLP layers' matrices (class `dense_mlp`).
    pub dense_mlp_bytes: u64,
    /// Bytes of the PLE n-gram tables (qwen4_exp): read by the engine from host RAM, a few rows
    /// per token, never placed on a GPU.
    pub ngram_table_bytes: u64,
    /// Multi-token-prediction layers the model carries (0: none).
    pub mtp_layers: usize,
    /// Bytes of the MTP layer's routed experts: placed like one more MoE layer's (GPU slots,
    /// the rest with the expert workers).
    pub mtp_expert_bytes: u64,
    /// Bytes of the rest of the MTP head (norms, `fc`, attention, router, shared expert):
    /// loaded by the engine beside the dense weights.
    pub mtp_dense_bytes: u64,
    /// Bytes of the vision tower (0: the model reads text only).
    pub vision_bytes: u64,
}

/// Whether an MTP tensor belongs to its layer's routed experts (artifact banks are named
/// `….experts…`, checkpoint tensors `….experts.N.…`; the shared expert is `shared_expert`).
fn is_mtp_routed_expert(name: &str) -> bool {
    name.contains(".experts")
}

fn mtp_layers_of(config: &ninfer_artifact::ModelConfig) -> usize {
    config.hybrid().map_or(0, |hybrid| hybrid.mtp_num_layers)
}

impl ModelFacts {
    pub fn read(location: &ModelLocation) -> anyhow::Result<Self> {
        match location {
            ModelLocation::Artifact(path) => Self::of_artifact(path, location),
            ModelLocation::Checkpoint(directory) => Self::of_checkpoint(directory, location),
        }
    }

    fn of_artifact(path: &Path, location: &ModelLocation) -> anyhow::Result<Self> {
        let artifact =
            Artifact::open(path).with_context(|| format!("opening {}", path.display()))?;
        Ok(Self::of_artifact_header(artifact.header(), location))
    }

    /// An artifact summarised from its header alone (which may have come from a hub).
    pub fn of_artifact_header(header: &ninfer_artifact::Header, location: &ModelLocation) -> Self {
        let mut facts = ModelFacts {
            location: location.clone(),
            architecture: header.model.architecture().to_string(),
            common: header.model.common().clone(),
            parameters: 0,
            expert_bank_bytes: 0,
            dense_bytes: 0,
            dense_mlp_bytes: 0,
            ngram_table_bytes: 0,
            mtp_layers: mtp_layers_of(&header.model),
            mtp_expert_bytes: 0,
            mtp_dense_bytes: 0,
            vision_bytes: 0,
        };
        for tensor in &header.tensors {
            facts.parameters += tensor.element_count();
            match tensor.class {
                TensorClass::RoutedExpert => facts.expert_bank_bytes += tensor.length,
                TensorClass::Embedding | TensorClass::Dense => facts.dense_bytes += tensor.length,
                TensorClass::DenseMlp => {
                    facts.dense_bytes += tensor.length;
                    facts.dense_mlp_bytes += tensor.length;
                }
                TensorClass::NgramEmbedding => facts.ngram_table_bytes += tensor.length,
                // A second copy of the dense MLPs, mapped only for offloaded layers.
                TensorClass::DenseMlpExpert => {}
                TensorClass::Mtp if is_mtp_routed_expert(&tensor.name) => {
                    facts.mtp_expert_bytes += tensor.length
                }
                TensorClass::Mtp => facts.mtp_dense_bytes += tensor.length,
                TensorClass::Vision => facts.vision_bytes += tensor.length,
            }
        }
        facts
    }

    fn of_checkpoint(directory: &Path, location: &ModelLocation) -> anyhow::Result<Self> {
        let mut shards: Vec<PathBuf> = std::fs::read_dir(directory)
            .with_context(|| format!("listing {}", directory.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        shards.sort();
        if shards.is_empty() {
            bail!("{}: no .safetensors files", directory.display());
        }
        let headers = shards
            .iter()
            .map(|shard| Ok((shard.display().to_string(), safetensors_header_json(shard)?)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Self::of_checkpoint_headers(directory, location, &headers)
    }

    /// A checkpoint summarised from the `config.json` in `directory` and its shards' JSON
    /// headers (`(shard name, header JSON)`), which may have come from a hub.
    pub fn of_checkpoint_headers(
        directory: &Path,
        location: &ModelLocation,
        headers: &[(String, Vec<u8>)],
    ) -> anyhow::Result<Self> {
        let parsed = ninfer_convert::read_config(directory)
            .with_context(|| format!("reading the config of {}", directory.display()))?;
        let mut facts = ModelFacts {
            location: location.clone(),
            architecture: parsed.model.architecture().to_string(),
            common: parsed.model.common().clone(),
            parameters: 0,
            expert_bank_bytes: 0,
            dense_bytes: 0,
            dense_mlp_bytes: 0,
            ngram_table_bytes: 0,
            mtp_layers: mtp_layers_of(&parsed.model),
            mtp_expert_bytes: 0,
            mtp_dense_bytes: 0,
            vision_bytes: 0,
        };
        for (shard, json) in headers {
            for tensor in header_tensors(shard, json)? {
                facts.parameters += tensor.elements;
                match checkpoint_tensor_class(&tensor.name) {
                    TensorClass::RoutedExpert => facts.expert_bank_bytes += tensor.bytes,
                    TensorClass::Embedding | TensorClass::Dense => {
                        facts.dense_bytes += tensor.bytes
                    }
                    TensorClass::DenseMlp => {
                        facts.dense_bytes += tensor.bytes;
                        facts.dense_mlp_bytes += tensor.bytes;
                    }
                    TensorClass::NgramEmbedding => facts.ngram_table_bytes += tensor.bytes,
                    TensorClass::DenseMlpExpert => {}
                    TensorClass::Mtp if is_mtp_routed_expert(&tensor.name) => {
                        facts.mtp_expert_bytes += tensor.bytes
                    }
                    TensorClass::Mtp => facts.mtp_dense_bytes += tensor.bytes,
                    TensorClass::Vision => facts.vision_bytes += tensor.bytes,
                }
            }
        }
        Ok(facts)
    }
}

/// The class a checkpoint tensor takes in the artifact, from its Hugging Face name.
fn checkpoint_tensor_class(name: &str) -> TensorClass {
    if name.starts_with("mtp.") || name.contains(".mtp.") {
        TensorClass::Mtp
    } else if name.contains(".ple.ple_embedding.ngram_embedding.") {
        TensorClass::NgramEmbedding
    } else if name.contains("visual.") || name.contains("vision_tower") {
        TensorClass::Vision
    } else if name.contains(".experts.") && !name.contains("shared_expert") {
        TensorClass::RoutedExpert
    } else if [".mlp.gate_proj.", ".mlp.up_proj.", ".mlp.down_proj."]
        .iter()
        .any(|part| name.contains(part))
    {
        TensorClass::DenseMlp
    } else {
        TensorClass::Dense
    }
}

struct HeaderTensor {
    name: String,
    elements: u64,
    bytes: u64,
}

/// Largest safetensors header read (the format's own readers refuse bigger ones too).
const MAX_SAFETENSORS_HEADER: u64 = 100 << 20;

/// The JSON header of one safetensors file (an 8-byte little-endian length, then that many
/// bytes of JSON), read without the data.
fn safetensors_header_json(path: &Path) -> anyhow::Result<Vec<u8>> {
    use std::io::Read;
    let mut file =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut length = [0u8; 8];
    file.read_exact(&mut length)
        .with_context(|| format!("{}: shorter than a safetensors header", path.display()))?;
    let length = u64::from_le_bytes(length);
    if length > MAX_SAFETENSORS_HEADER {
        bail!(
            "{}: safetensors header of {length} bytes (more than {MAX_SAFETENSORS_HEADER})",
            path.display()
        );
    }
    let mut text = vec![0u8; length as usize];
    file.read_exact(&mut text)
        .with_context(|| format!("{}: safetensors header cut short", path.display()))?;
    Ok(text)
}

/// The tensor names, element counts and byte lengths of a safetensors header's JSON.
fn header_tensors(shard: &str, json: &[u8]) -> anyhow::Result<Vec<HeaderTensor>> {
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(json)
        .with_context(|| format!("{shard}: safetensors header is not JSON"))?;
    let mut tensors = Vec::new();
    for (name, entry) in header {
        if name == "__metadata__" {
            continue;
        }
        let elements = entry["shape"]
            .as_array()
            .map(|dims| dims.iter().filter_map(|d| d.as_u64()).product())
            .unwrap_or(0);
        let bytes = match entry["data_offsets"].as_array().map(|o| o.as_slice()) {
            Some([start, end]) => end
                .as_u64()
                .unwrap_or(0)
                .saturating_sub(start.as_u64().unwrap_or(0)),
            _ => bail!("{shard}: tensor {name} has no data_offsets in the header"),
        };
        tensors.push(HeaderTensor {
            name,
            elements,
            bytes,
        });
    }
    Ok(tensors)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(name)
    }

    #[test]
    fn a_checkpoint_is_summarised_from_its_headers() {
        let location = locate_model(&fixture("qwen3_moe")).unwrap();
        assert!(matches!(location, ModelLocation::Checkpoint(_)));
        let facts = ModelFacts::read(&location).unwrap();
        assert_eq!(facts.architecture, "qwen3_moe");
        assert!(facts.parameters > 0);
        assert!(facts.expert_bank_bytes > 0 && facts.dense_bytes > 0);
    }

    #[test]
    fn the_mtp_layers_experts_are_told_from_the_rest_of_its_block() {
        let location = locate_model(&fixture("qwen3_5_moe_trained")).unwrap();
        let facts = ModelFacts::read(&location).unwrap();
        assert!(facts.mtp_expert_bytes > 0, "{facts:?}");
        assert!(facts.mtp_dense_bytes > 0, "{facts:?}");
        // One layer's worth of routed experts: the main layers' bank over their MoE layers.
        let moe_layers = facts.common.moe_layers.iter().filter(|&&moe| moe).count() as u64;
        assert_eq!(facts.mtp_expert_bytes, facts.expert_bank_bytes / moe_layers);
        assert!(!is_mtp_routed_expert(
            "mtp.layers.0.mlp.shared_expert.up_proj.weight"
        ));
        assert!(is_mtp_routed_expert(
            "mtp.layers.0.mlp.experts.3.up_proj.weight"
        ));
    }

    #[test]
    fn tensor_classes_follow_the_hub_names() {
        for (name, class) in [
            (
                "model.layers.0.mlp.experts.3.up_proj.weight",
                TensorClass::RoutedExpert,
            ),
            (
                "model.layers.0.mlp.experts.gate_up_proj",
                TensorClass::RoutedExpert,
            ),
            (
                "model.layers.0.mlp.shared_expert.up_proj.weight",
                TensorClass::Dense,
            ),
            (
                "mtp.layers.0.mlp.experts.0.up_proj.weight",
                TensorClass::Mtp,
            ),
            ("model.visual.blocks.0.attn.qkv.weight", TensorClass::Vision),
            ("model.embed_tokens.weight", TensorClass::Dense),
            (
                "model.language_model.layers.3.mlp.down_proj.weight",
                TensorClass::DenseMlp,
            ),
            ("mtp.layers.0.mlp.gate_proj.weight", TensorClass::Mtp),
        ] {
            assert_eq!(checkpoint_tensor_class(name), class, "{name}");
        }
    }

    #[test]
    fn a_repository_id_is_found_in_the_models_directory() {
        let models = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(models.path().join("Qwen")).unwrap();
        std::os::unix::fs::symlink(fixture("qwen3_moe"), models.path().join("Qwen/Tiny-MoE"))
            .unwrap();
        let location = locate_model_in(Path::new("Qwen/Tiny-MoE"), models.path()).unwrap();
        assert_eq!(
            location,
            ModelLocation::Checkpoint(models.path().join("Qwen/Tiny-MoE"))
        );
        let error = locate_model_in(Path::new("Qwen/Absent-1B"), models.path())
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("Qwen/Absent-1B")
                && error.contains(&models.path().display().to_string()),
            "{error}"
        );
        assert_eq!(repository_id(Path::new("../x")), None);
        assert_eq!(repository_id(Path::new("/abs/x")), None);
        assert_eq!(repository_id(Path::new("a/b/c")), None);
    }

    #[test]
    fn a_missing_path_is_named() {
        let error = locate_model(Path::new("/no/such/model.ninfer")).unwrap_err();
        assert!(
            error.to_string().contains("/no/such/model.ninfer"),
            "{error}"
        );
    }
}
