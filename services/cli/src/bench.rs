//! `ninfer bench`: filled in by the CPU-kernel work.

#[derive(Debug, clap::Args)]
pub struct BenchArgs {}

pub fn run(_args: BenchArgs) -> anyhow::Result<()> {
    anyhow::bail!("ninfer bench is not available yet")
}
