//! `ninfer-gateway`: the HTTP/gRPC front door.
fn main() -> anyhow::Result<()> {
    anyhow::bail!("ninfer-gateway: the gateway is not built yet (issue: the gateway)")
}
