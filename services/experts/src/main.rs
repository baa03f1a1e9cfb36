//! `ninfer-experts`: a CPU expert worker process.
fn main() -> anyhow::Result<()> {
    anyhow::bail!("ninfer-experts: the expert worker is not built yet (issue: expert workers and the engine service)")
}
