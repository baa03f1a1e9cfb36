//! `ninfer convert`: Hugging Face checkpoint directory → `.ninfer` artifact.
//!
//! Owns: reading `config.json` / `*.safetensors` / tokenizer files, mapping checkpoint tensor
//! names onto the artifact's internal names, re-laying and quantizing weights while streaming.
//! Must not touch: the artifact's byte layout (it goes through `ninfer-artifact`'s writer).
