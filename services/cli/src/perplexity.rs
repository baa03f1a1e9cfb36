//! `ninfer perplexity`: filled in by the reference-forward work.

#[derive(Debug, clap::Args)]
pub struct PerplexityArgs {}

pub fn run(_args: PerplexityArgs) -> anyhow::Result<()> {
    anyhow::bail!("ninfer perplexity is not available yet")
}
