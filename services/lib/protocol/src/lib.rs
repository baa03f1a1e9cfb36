//! gRPC messages and service stubs generated from `proto/` at build time.
//!
//! Owns: the wire types shared by the gateway, the engine and the expert workers.
//! Must not touch: any behaviour beyond the wire. This crate is generated code, the descriptor set
//! used for server reflection, and how to dial an address (`unix:PATH` or `HOST:PORT`), and the
//! systemd `sd_notify` datagrams; every
//! other crate may depend on it, it depends on no crate of ours.

/// Version 1 of the NInfer control-plane API.
pub mod v1 {
    tonic::include_proto!("ninfer.v1");
}

/// Encoded `FileDescriptorSet` of every proto file, for `tonic-reflection`.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("ninfer_descriptor");

pub mod sd_notify;

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

/// Serving a gRPC router on `unix:PATH` or `HOST:PORT`, with systemd readiness and watchdog.
pub mod listen {
    use std::future::Future;

    use tonic::transport::server::Router;

    use crate::sd_notify;

    /// Why a server could not run.
    #[derive(Debug)]
    pub struct ServeError(pub String);

    impl std::fmt::Display for ServeError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.0)
        }
    }

    impl std::error::Error for ServeError {}

    /// Tells systemd we are ready (after the socket is bound) and keeps its watchdog fed.
    fn announce_ready(listen: &str) {
        let _ = sd_notify::notify(&format!("READY=1\nSTATUS=serving on {listen}"));
        if let Some(interval) = sd_notify::watchdog_interval() {
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(interval).await;
                    let _ = sd_notify::notify("WATCHDOG=1");
                }
            });
        }
    }

    /// Binds `listen`, reports readiness, serves until `shutdown` resolves.
    pub async fn serve(
        router: Router,
        listen: &str,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        let failed = |what: &str, error: &dyn std::fmt::Display| {
            ServeError(format!("{what} {listen}: {error}"))
        };
        if let Some(path) = listen.strip_prefix("unix:") {
            // A socket file left by a killed predecessor would make bind fail.
            let _ = std::fs::remove_file(path);
            let listener =
                tokio::net::UnixListener::bind(path).map_err(|e| failed("listening on", &e))?;
            announce_ready(listen);
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            let result = router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await;
            let _ = std::fs::remove_file(path);
            result.map_err(|e| failed("serving", &e))?;
        } else {
            let address: std::net::SocketAddr = listen
                .parse()
                .map_err(|e| failed("expected unix:PATH or HOST:PORT, got", &e))?;
            let listener = tokio::net::TcpListener::bind(address)
                .await
                .map_err(|e| failed("listening on", &e))?;
            announce_ready(listen);
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
                .map_err(|e| failed("serving", &e))?;
        }
        let _ = sd_notify::notify("STOPPING=1");
        Ok(())
    }

    /// Resolves on SIGTERM or SIGINT.
    pub async fn shutdown_signal() {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut terminate), Ok(mut interrupt)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            std::future::pending::<()>().await;
            return;
        };
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
    }
}
