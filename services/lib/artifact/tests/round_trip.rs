//! Writer → reader round trips: single and split artifacts, expert banks, and every kind of
//! damaged file the reader must refuse with an error that names the file.

use std::path::{Path, PathBuf};

use ninfer_artifact::quant::{f32_to_bf16_bytes, f32_to_bytes, quantize_matrix, QuantizedLayout};
use ninfer_artifact::{
    part_path, Artifact, ArtifactError, ArtifactWriter, CommonConfig, DType, GenerationDefaults,
    ModelConfig, Qwen3MoeConfig, SourceInfo, TensorClass, TensorSpec, WriterOptions,
};
use rand::{Rng, SeedableRng};

fn tiny_config() -> ModelConfig {
    ModelConfig::Qwen3Moe(Qwen3MoeConfig {
        common: CommonConfig {
            vocab_size: 64,
            hidden_size: 64,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 32,
            rotary_dim: 32,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-6,
            intermediate_size: 0,
            num_experts: 3,
            num_experts_per_tok: 2,
            moe_intermediate_size: 32,
            norm_topk_prob: false,
            moe_layers: vec![true],
            tie_word_embeddings: false,
            max_position_embeddings: 128,
        },
        sliding_window: None,
    })
}

fn random_values(count: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..count).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Writes an artifact with tensors of every dtype (some large enough to cross 64 KiB parts)
/// and one expert bank. Returns the written files.
/// Steps of the sample artifact (`sample_step`).
const SAMPLE_STEPS: usize = 7;

fn write_sample(path: &Path, options: WriterOptions) -> Vec<PathBuf> {
    let mut writer = ArtifactWriter::create(path, options).unwrap();
    for step in 0..SAMPLE_STEPS {
        sample_step(&mut writer, step);
    }
    finish_sample(writer)
}

fn finish_sample(writer: ArtifactWriter) -> Vec<PathBuf> {
    writer
        .finish(
            tiny_config(),
            GenerationDefaults::default(),
            SourceInfo::default(),
        )
        .unwrap()
}

/// One step of the sample artifact: a file, two tensors, an expert bank of three experts (one
/// step each, the bank opened with the first and closed with the last), a quantized tensor.
/// What a resumed writer holds already is skipped.
fn sample_step(writer: &mut ArtifactWriter, step: usize) {
    let gate_up = QuantizedLayout::new(DType::Int4, 64, 64).unwrap();
    let down = QuantizedLayout::new(DType::Int4, 64, 32).unwrap();
    let bank = "layers.0.moe.experts";
    match step {
        0 if !writer.has_file("tokenizer.json") => writer
            .add_file("tokenizer.json", br#"{"model":"sample"}"#)
            .unwrap(),
        // 76.8 KB as f32: crosses a 64 KiB boundary.
        1 if !writer.has_tensor("embed_tokens") => writer
            .add_tensor(
                TensorSpec {
                    name: "embed_tokens".into(),
                    class: TensorClass::Embedding,
                    dtype: DType::F32,
                    shape: vec![300, 64],
                    quantization: None,
                },
                &f32_to_bytes(&random_values(300 * 64, 1)),
            )
            .unwrap(),
        2 if !writer.has_tensor("lm_head") => writer
            .add_tensor(
                TensorSpec {
                    name: "lm_head".into(),
                    class: TensorClass::Embedding,
                    dtype: DType::Bf16,
                    shape: vec![200, 64],
                    quantization: None,
                },
                &f32_to_bf16_bytes(&random_values(200 * 64, 2)),
            )
            .unwrap(),
        3..=5 if !writer.has_bank(bank) => {
            let expert = (step - 3) as u64;
            match writer.open_bank_experts(bank) {
                Some(written) if written > expert => return,
                Some(_) => {}
                None => writer
                    .begin_expert_bank(
                        bank,
                        TensorClass::RoutedExpert,
                        DType::Int4,
                        3,
                        gate_up.total_bytes as u64,
                        down.total_bytes as u64,
                    )
                    .unwrap(),
            }
            writer
                .add_expert(
                    TensorSpec {
                        name: format!("{bank}.{expert}.gate_up"),
                        class: TensorClass::RoutedExpert,
                        dtype: DType::Int4,
                        shape: vec![64, 64],
                        quantization: Some(gate_up.params()),
                    },
                    &quantize_matrix(&random_values(64 * 64, 10 + expert), &gate_up),
                    TensorSpec {
                        name: format!("{bank}.{expert}.down"),
                        class: TensorClass::RoutedExpert,
                        dtype: DType::Int4,
                        shape: vec![64, 32],
                        quantization: Some(down.params()),
                    },
                    &quantize_matrix(&random_values(64 * 32, 20 + expert), &down),
                )
                .unwrap();
            if expert == 2 {
                writer.end_expert_bank().unwrap();
            }
        }
        6 if !writer.has_tensor("layers.0.attn.q_proj") => {
            let layout = QuantizedLayout::new(DType::Int8, 64, 32).unwrap();
            writer
                .add_tensor(
                    TensorSpec {
                        name: "layers.0.attn.q_proj".into(),
                        class: TensorClass::Dense,
                        dtype: DType::Int8,
                        shape: vec![64, 32],
                        quantization: Some(layout.params()),
                    },
                    &quantize_matrix(&random_values(64 * 32, 3), &layout),
                )
                .unwrap();
        }
        _ => {}
    }
}

#[test]
fn a_resumed_writer_writes_the_artifact_an_uninterrupted_one_writes() {
    let directory = tempfile::tempdir().unwrap();
    let options = WriterOptions {
        max_part_bytes: Some(64 * 1024),
    };
    let direct = directory.path().join("direct.ninfer");
    let direct_files = write_sample(&direct, options);
    // Interrupted inside the bank (checkpoint after its first expert) and again before the
    // bank, each time with work after the checkpoint that is cut off on resuming.
    for (checkpoint_after, dropped_after) in [(3, 5), (1, 2), (0, 6)] {
        let path = directory
            .path()
            .join(format!("resumed-{checkpoint_after}.ninfer"));
        {
            let mut writer = ArtifactWriter::create_resumable(&path, options, "sample").unwrap();
            for step in 0..=dropped_after {
                sample_step(&mut writer, step);
                if step == checkpoint_after {
                    writer.checkpoint().unwrap();
                }
            }
            writer.keep_for_resume(true);
        }
        assert!(
            !path.exists(),
            "an unfinished artifact carries the final name"
        );
        let mut writer = ArtifactWriter::create_resumable(&path, options, "sample").unwrap();
        assert!(writer.resumed());
        for step in 0..SAMPLE_STEPS {
            sample_step(&mut writer, step);
        }
        let files = finish_sample(writer);
        assert_eq!(files.len(), direct_files.len());
        for (resumed, direct) in files.iter().zip(&direct_files) {
            assert!(
                std::fs::read(resumed).unwrap() == std::fs::read(direct).unwrap(),
                "{} differs from {}",
                resumed.display(),
                direct.display()
            );
        }
        let left: Vec<String> = std::fs::read_dir(directory.path())
            .unwrap()
            .flatten()
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .filter(|name| name.contains(".partial"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
    // A journal of another conversion is not continued.
    let path = directory.path().join("other.ninfer");
    {
        let mut writer = ArtifactWriter::create_resumable(&path, options, "one").unwrap();
        sample_step(&mut writer, 0);
        writer.checkpoint().unwrap();
        writer.keep_for_resume(true);
    }
    let writer = ArtifactWriter::create_resumable(&path, options, "another").unwrap();
    assert!(!writer.resumed());
}

#[test]
fn single_file_round_trip_is_bit_exact() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("sample.ninfer");
    let files = write_sample(&path, WriterOptions::default());
    assert_eq!(files, vec![path.clone()]);
    let artifact = Artifact::open(&path).unwrap();
    assert_eq!(artifact.config(), &tiny_config());
    assert_eq!(
        artifact.file("tokenizer.json").unwrap(),
        br#"{"model":"sample"}"#
    );
    let embed = artifact.tensor("embed_tokens").unwrap();
    assert_eq!(embed.as_f32().unwrap(), &random_values(300 * 64, 1)[..]);
    let head = artifact.tensor("lm_head").unwrap();
    assert_eq!(head.as_bf16().unwrap().len(), 200 * 64);
    assert_eq!(
        head.bytes,
        &f32_to_bf16_bytes(&random_values(200 * 64, 2))[..]
    );
    artifact.verify(|_| {}).unwrap();

    let bank = artifact.expert_bank("layers.0.moe.experts").unwrap();
    assert_eq!(bank.offset % 4096, 0);
    assert_eq!(bank.expert_stride % 4096, 0);
    for expert in 0..3 {
        let tensor = artifact
            .tensor(&format!("layers.0.moe.experts.{expert}.gate_up"))
            .unwrap();
        assert_eq!(
            tensor.entry.offset,
            bank.offset + expert * bank.expert_stride
        );
        let down = artifact
            .tensor(&format!("layers.0.moe.experts.{expert}.down"))
            .unwrap();
        assert!(
            down.entry.offset + down.entry.length
                <= bank.offset + (expert + 1) * bank.expert_stride
        );
    }
}

#[test]
fn split_artifact_reads_identical_tensors_across_part_boundaries() {
    let directory = tempfile::tempdir().unwrap();
    let single = directory.path().join("single.ninfer");
    let split = directory.path().join("split.ninfer");
    write_sample(&single, WriterOptions::default());
    let files = write_sample(
        &split,
        WriterOptions {
            max_part_bytes: Some(64 * 1024),
        },
    );
    assert!(files.len() >= 2, "expected several parts, got {files:?}");
    assert_eq!(files[1], part_path(&split, 1));
    for file in &files[..files.len() - 1] {
        assert_eq!(std::fs::metadata(file).unwrap().len(), 64 * 1024);
    }
    let single = Artifact::open(&single).unwrap();
    let split = Artifact::open(&split).unwrap();
    split.verify(|_| {}).unwrap();
    let mut crossing = 0;
    for tensor in single.tensors() {
        let other = split.tensor(tensor.name()).unwrap();
        assert_eq!(tensor.bytes, other.bytes, "{}", tensor.name());
        let (start, end) = (
            other.entry.offset,
            other.entry.offset + other.entry.length - 1,
        );
        if start / (64 * 1024) != end / (64 * 1024) {
            crossing += 1;
        }
    }
    assert!(
        crossing >= 1,
        "no tensor crossed a part boundary; the test proves nothing"
    );
}

#[test]
fn resharding_keeps_every_byte_and_changes_only_the_split() {
    let directory = tempfile::tempdir().unwrap();
    let single_path = directory.path().join("single.ninfer");
    let split_path = directory.path().join("split.ninfer");
    let joined_path = directory.path().join("joined.ninfer");
    write_sample(&single_path, WriterOptions::default());
    let single = Artifact::open(&single_path).unwrap();

    // One file → parts of 64 KiB, then back to one file: byte-identical to the original.
    let split_files = ArtifactWriter::reshard(&single, &split_path, Some(64 * 1024)).unwrap();
    assert!(
        split_files.len() >= 2,
        "expected several parts, got {split_files:?}"
    );
    for file in &split_files[..split_files.len() - 1] {
        assert_eq!(std::fs::metadata(file).unwrap().len(), 64 * 1024);
    }
    let split = Artifact::open(&split_path).unwrap();
    split.verify(|_| {}).unwrap();
    assert_eq!(split.header(), single.header());
    assert_eq!(split.preamble().part_count as usize, split_files.len());
    for tensor in single.tensors() {
        assert_eq!(tensor.bytes, split.tensor(tensor.name()).unwrap().bytes);
    }
    let joined_files = ArtifactWriter::reshard(&split, &joined_path, None).unwrap();
    assert_eq!(joined_files, vec![joined_path.clone()]);
    assert_eq!(
        std::fs::read(&joined_path).unwrap(),
        std::fs::read(&single_path).unwrap(),
        "split then joined must give the original file back"
    );

    // Fewer parts than an earlier artifact at the same path: its extra parts are removed.
    ArtifactWriter::reshard(&single, &split_path, Some(256 * 1024)).unwrap();
    let fewer = Artifact::open(&split_path).unwrap();
    let count = fewer.preamble().part_count;
    assert!(count < split_files.len() as u32);
    assert!(!part_path(&split_path, count).exists());

    // Writing over one of the input's own files is refused, and leaves it intact.
    let error = ArtifactWriter::reshard(&single, &single_path, Some(64 * 1024)).unwrap_err();
    assert!(error.to_string().contains("single.ninfer"), "{error}");
    Artifact::open(&single_path)
        .unwrap()
        .verify(|_| {})
        .unwrap();
}

fn expect_error(path: &Path) -> ArtifactError {
    match Artifact::open(path) {
        Ok(_) => panic!("{} opened although it is damaged", path.display()),
        Err(error) => {
            let text = error.to_string();
            assert!(
                text.contains(&path.file_name().unwrap().to_string_lossy().to_string()),
                "error does not name the file: {text}"
            );
            error
        }
    }
}

#[test]
fn damaged_artifacts_are_refused_with_the_file_named() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("damaged.ninfer");
    write_sample(&path, WriterOptions::default());
    let good = std::fs::read(&path).unwrap();

    // Truncated.
    std::fs::write(&path, &good[..good.len() - 100]).unwrap();
    assert!(matches!(
        expect_error(&path),
        ArtifactError::PartSize { .. }
    ));
    // Shorter than the preamble.
    std::fs::write(&path, &good[..10]).unwrap();
    assert!(matches!(expect_error(&path), ArtifactError::Corrupt { .. }));
    // Not an artifact at all.
    std::fs::write(&path, b"hello world, this is not a model").unwrap();
    assert!(matches!(
        expect_error(&path),
        ArtifactError::NotAnArtifact { .. }
    ));
    // Header damaged.
    let mut damaged = good.clone();
    let last = damaged.len() - 2;
    damaged[last] ^= 0x55;
    std::fs::write(&path, &damaged).unwrap();
    assert!(matches!(
        expect_error(&path),
        ArtifactError::ChecksumMismatch { .. }
    ));
    // Preamble damaged.
    let mut damaged = good.clone();
    damaged[20] ^= 1;
    std::fs::write(&path, &damaged).unwrap();
    assert!(matches!(expect_error(&path), ArtifactError::Corrupt { .. }));
    // Tensor data damaged: opens, but `verify` names the tensor.
    std::fs::write(&path, &good).unwrap();
    let offset = Artifact::open(&path)
        .unwrap()
        .tensor("embed_tokens")
        .unwrap()
        .entry
        .offset as usize;
    let mut damaged = good.clone();
    damaged[offset + 7] ^= 0x80;
    std::fs::write(&path, &damaged).unwrap();
    let artifact = Artifact::open(&path).unwrap();
    let error = artifact.verify(|_| {}).unwrap_err().to_string();
    assert!(
        error.contains("embed_tokens") && error.contains("checksum"),
        "{error}"
    );
}

#[test]
fn missing_part_is_named() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("parts.ninfer");
    let files = write_sample(
        &path,
        WriterOptions {
            max_part_bytes: Some(64 * 1024),
        },
    );
    std::fs::remove_file(&files[1]).unwrap();
    let error = expect_error(&path);
    assert!(matches!(error, ArtifactError::MissingPart { .. }));
    assert!(
        error.to_string().contains("parts.ninfer.part-0001"),
        "{error}"
    );
}

#[test]
fn unfinished_writer_leaves_no_files() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("unfinished.ninfer");
    {
        let mut writer = ArtifactWriter::create(
            &path,
            WriterOptions {
                max_part_bytes: Some(64 * 1024),
            },
        )
        .unwrap();
        writer
            .add_tensor(
                TensorSpec {
                    name: "embed_tokens".into(),
                    class: TensorClass::Embedding,
                    dtype: DType::F32,
                    shape: vec![300, 64],
                    quantization: None,
                },
                &f32_to_bytes(&random_values(300 * 64, 1)),
            )
            .unwrap();
        // Dropped here, as on an error or Ctrl-C.
    }
    let left: Vec<_> = std::fs::read_dir(directory.path()).unwrap().collect();
    assert!(left.is_empty(), "files left behind: {left:?}");
}

#[test]
fn writer_rejects_inconsistent_tensors() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("bad.ninfer");
    let mut writer = ArtifactWriter::create(&path, WriterOptions::default()).unwrap();
    let spec = TensorSpec {
        name: "x".into(),
        class: TensorClass::Dense,
        dtype: DType::F32,
        shape: vec![4, 4],
        quantization: None,
    };
    let error = writer
        .add_tensor(spec.clone(), &[0u8; 12])
        .unwrap_err()
        .to_string();
    assert!(error.contains("`x`") && error.contains("64"), "{error}");
    writer.add_tensor(spec.clone(), &[0u8; 64]).unwrap();
    assert!(writer
        .add_tensor(spec, &[0u8; 64])
        .unwrap_err()
        .to_string()
        .contains("twice"));
}
