//! `ninfer reshard IN OUT --max-file-gb G`: an artifact split into files of another size, without
//! its checkpoint (for a file system with a size limit, or to join parts into one file).
//!
//! Owns: the command's arguments and report. Must not touch: the artifact's byte layout (the
//! artifact crate copies the logical byte space; only the split changes).

use std::path::PathBuf;

use anyhow::Context;
use ninfer_artifact::{Artifact, ArtifactWriter};

#[derive(Debug, clap::Args)]
pub struct ReshardArgs {
    /// The `.ninfer` artifact to re-split (its first file).
    pub input: PathBuf,
    /// Where the re-split artifact goes (parts are `OUT.part-0001`, …).
    pub output: PathBuf,
    /// Split into files of at most this many GB (10^9 bytes); without it, one file.
    #[arg(long)]
    pub max_file_gb: Option<f64>,
}

pub fn run(args: ReshardArgs) -> anyhow::Result<()> {
    let max_file_bytes = crate::convert::max_file_bytes(args.max_file_gb)?;
    let input =
        Artifact::open(&args.input).with_context(|| format!("opening {}", args.input.display()))?;
    let started = std::time::Instant::now();
    let files =
        ArtifactWriter::reshard(&input, &args.output, max_file_bytes).with_context(|| {
            format!(
                "resharding {} into {}",
                args.input.display(),
                args.output.display()
            )
        })?;
    // Reopening checks the new preamble, header and every part's length.
    Artifact::open(&args.output)
        .with_context(|| format!("reopening the new artifact {}", args.output.display()))?;
    println!(
        "{}: {:.2} GB in {} file(s) (was {}), {:.1}s",
        args.output.display(),
        input.total_length() as f64 / 1e9,
        files.len(),
        input.part_paths().len(),
        started.elapsed().as_secs_f64()
    );
    for file in &files {
        println!("  {}", file.display());
    }
    Ok(())
}
