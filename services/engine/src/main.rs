//! `ninfer-engine`: the engine process.
fn main() -> anyhow::Result<()> {
    anyhow::bail!("ninfer-engine: the engine service is not built yet (issue: expert workers and the engine service)")
}
