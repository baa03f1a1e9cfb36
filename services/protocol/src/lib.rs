//! gRPC messages and service stubs generated from `proto/` at build time.
//!
//! Owns: the wire types shared by the gateway, the engine and the expert workers.
//! Must not touch: any behaviour beyond the wire. This crate is generated code, the descriptor set
//! used for server reflection, and how to dial an address (`unix:PATH` or `HOST:PORT`); every
//! other crate may depend on it, it depends on no crate of ours.

/// Version 1 of the NInfer control-plane API.
pub mod v1 {
    tonic::include_proto!("ninfer.v1");
}

/// Encoded `FileDescriptorSet` of every proto file, for `tonic-reflection`.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("ninfer_descriptor");

/// Dialing the addresses our services listen on.
pub mod transport {
    use std::time::Duration;

    use tonic::transport::{Channel, Endpoint, Uri};

    /// Connects to `unix:/path.sock` or `HOST:PORT` (optionally with an `http://` scheme).
    pub async fn connect(
        address: &str,
        timeout: Duration,
    ) -> Result<Channel, tonic::transport::Error> {
        if let Some(path) = address.strip_prefix("unix:") {
            let path = path.to_string();
            // The URI is ignored for unix sockets; the connector dials the path.
            Endpoint::from_static("http://localhost")
                .connect_timeout(timeout)
                .timeout(Duration::from_secs(3600))
                .connect_with_connector(tower::service_fn(move |_: Uri| {
                    let path = path.clone();
                    async move {
                        let stream = tokio::net::UnixStream::connect(path).await?;
                        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                    }
                }))
                .await
        } else {
            let uri = if address.contains("://") {
                address.to_string()
            } else {
                format!("http://{address}")
            };
            Endpoint::from_shared(uri)?
                .connect_timeout(timeout)
                .connect()
                .await
        }
    }
}
