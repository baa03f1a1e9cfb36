//! gRPC messages and service stubs generated from `proto/` at build time.
//!
//! Owns: the wire types shared by the gateway, the engine and the expert workers.
//! Must not touch: any behaviour beyond the wire. This crate is generated code, the descriptor set
//! used for server reflection, how to dial and serve an address (`unix:PATH`, a socket only its
//! owner may use, or `HOST:PORT`), the shared secret that guards control APIs served on TCP
//! (`control_secret`), and the systemd `sd_notify` datagrams; every
//! other crate may depend on it, it depends on no crate of ours.

/// Version 1 of the NInfer control-plane API.
pub mod v1 {
    tonic::include_proto!("ninfer.v1");
}

/// Encoded `FileDescriptorSet` of every proto file, for `tonic-reflection`.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("ninfer_descriptor");

pub mod sd_notify;
pub mod token_socket;

/// The shared secret a control API (engine, expert worker) asks of its callers when it listens
/// on TCP, where any local user (or host) could reach it: `authorization: Bearer SECRET` on
/// every call. Unix sockets are guarded by their file mode instead.
pub mod control_secret {
    use tonic::metadata::MetadataValue;
    use tonic::{Request, Status};

    /// Where the secret comes from: a file named here (preferred: not visible in `ps`)...
    pub const SECRET_FILE_VARIABLE: &str = "NINFER_CONTROL_SECRET_FILE";
    /// ...or the value itself.
    pub const SECRET_VARIABLE: &str = "NINFER_CONTROL_SECRET";

    /// Why the secret could not be read.
    #[derive(Debug, thiserror::Error)]
    pub enum SecretError {
        #[error("reading the control secret from {path}: {source}")]
        Unreadable {
            path: String,
            source: std::io::Error,
        },
        #[error("the control secret is empty or not a valid header value")]
        Unusable,
    }

    /// The secret from `file` (a flag), else the environment; `None` when none is given.
    pub fn load(file: Option<&std::path::Path>) -> Result<Option<String>, SecretError> {
        let from_file = file
            .map(|path| path.to_path_buf())
            .or_else(|| std::env::var_os(SECRET_FILE_VARIABLE).map(Into::into));
        let secret =
            match from_file {
                Some(path) => Some(std::fs::read_to_string(&path).map_err(|source| {
                    SecretError::Unreadable {
                        path: path.display().to_string(),
                        source,
                    }
                })?),
                None => std::env::var(SECRET_VARIABLE).ok(),
            };
        match secret.map(|text| text.trim().to_string()) {
            None => Ok(None),
            Some(text) if text.is_empty() || bearer(&text).is_none() => Err(SecretError::Unusable),
            Some(text) => Ok(Some(text)),
        }
    }

    /// Why a control API refuses to listen where it was told to.
    #[derive(Debug, thiserror::Error)]
    #[error("--listen {listen} can be reached from other machines and no control secret is set: anyone reaching the port could {reach}; set --control-secret-file (or {SECRET_FILE_VARIABLE} / {SECRET_VARIABLE}), listen on unix:PATH or a loopback address, or pass --insecure-listen to accept this")]
    pub struct UnguardedListen {
        pub listen: String,
        /// What an unauthenticated caller could do there, in the service's words.
        pub reach: &'static str,
    }

    /// Whether `listen` (`unix:PATH` or `HOST:PORT`) is reachable from other machines: any TCP
    /// address that is not loopback, or one that is not an IP address at all.
    pub fn listens_beyond_this_machine(listen: &str) -> bool {
        if listen.starts_with("unix:") {
            return false;
        }
        match listen.parse::<std::net::SocketAddr>() {
            Ok(address) => !address.ip().is_loopback(),
            // A host name may resolve anywhere; the caller's own parse rejects it later anyway.
            Err(_) => true,
        }
    }

    /// A control API on a non-loopback TCP address serves only with a secret, unless the
    /// operator accepted the exposure (`insecure_listen`); loopback TCP and unix sockets pass
    /// (a warning for loopback TCP is the caller's).
    pub fn check_listen(
        listen: &str,
        has_secret: bool,
        insecure_listen: bool,
        reach: &'static str,
    ) -> Result<(), UnguardedListen> {
        if has_secret || insecure_listen || !listens_beyond_this_machine(listen) {
            return Ok(());
        }
        Err(UnguardedListen {
            listen: listen.to_string(),
            reach,
        })
    }

    fn bearer(secret: &str) -> Option<MetadataValue<tonic::metadata::Ascii>> {
        format!("Bearer {secret}").parse().ok()
    }

    #[cfg(test)]
    mod tests {
        use super::check_listen;

        #[test]
        fn only_a_public_address_without_a_secret_or_the_flag_is_refused() {
            let reach = "call it";
            for guarded in ["unix:/run/x.sock", "127.0.0.1:1", "[::1]:1"] {
                assert!(
                    check_listen(guarded, false, false, reach).is_ok(),
                    "{guarded}"
                );
            }
            for public in ["0.0.0.0:1", "10.1.2.3:1", "[::]:1", "example.org:1"] {
                let refusal = check_listen(public, false, false, reach)
                    .expect_err(public)
                    .to_string();
                assert!(refusal.contains("--insecure-listen"), "{refusal}");
                assert!(refusal.contains(public), "{refusal}");
                assert!(check_listen(public, true, false, reach).is_ok());
                assert!(check_listen(public, false, true, reach).is_ok());
            }
        }
    }

    /// Server side: refuses calls without the secret (when one is set).
    #[derive(Clone, Default)]
    pub struct RequireSecret {
        expected: Option<std::sync::Arc<str>>,
    }

    impl RequireSecret {
        pub fn new(secret: Option<String>) -> Self {
            RequireSecret {
                expected: secret.map(|secret| format!("Bearer {secret}").into()),
            }
        }
    }

    impl tonic::service::Interceptor for RequireSecret {
        fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
            let Some(expected) = &self.expected else {
                return Ok(request);
            };
            let presented = request
                .metadata()
                .get("authorization")
                .map(|value| value.as_bytes())
                .unwrap_or_default();
            // Constant time in the secret's bytes, so it cannot be guessed byte by byte.
            let matches = presented.len() == expected.len()
                && presented
                    .iter()
                    .zip(expected.as_bytes())
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0;
            if matches {
                Ok(request)
            } else {
                Err(Status::unauthenticated(
                    "this control API needs its shared secret (authorization: Bearer SECRET)",
                ))
            }
        }
    }

    /// Client side: sends the secret (when one is set) with every call.
    #[derive(Clone, Default)]
    pub struct SendSecret {
        header: Option<MetadataValue<tonic::metadata::Ascii>>,
    }

    impl SendSecret {
        pub fn new(secret: Option<&str>) -> Self {
            SendSecret {
                header: secret.and_then(bearer),
            }
        }
    }

    impl tonic::service::Interceptor for SendSecret {
        fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
            if let Some(header) = &self.header {
                request
                    .metadata_mut()
                    .insert("authorization", header.clone());
            }
            Ok(request)
        }
    }
}

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

    /// After a stop signal, how long calls in flight get before every connection is dropped
    /// (a client holding an idle HTTP/2 connection or an endless stream never lets a graceful
    /// stop finish by itself).
    pub const DRAIN_DEADLINE: std::time::Duration = std::time::Duration::from_millis(1200);

    /// Serves `router` on `incoming` until `shutdown`, then drains for at most
    /// [`DRAIN_DEADLINE`].
    async fn serve_with_drain_deadline<IO, IE>(
        router: Router,
        incoming: impl tokio_stream::Stream<Item = Result<IO, IE>> + Send + 'static,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), tonic::transport::Error>
    where
        IO: tokio::io::AsyncRead
            + tokio::io::AsyncWrite
            + tonic::transport::server::Connected
            + Unpin
            + Send
            + 'static,
        IE: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = router.serve_with_incoming_shutdown(incoming, async {
            let _ = stopped.await;
        });
        tokio::pin!(serving);
        tokio::pin!(shutdown);
        tokio::select! {
            result = &mut serving => return result,
            () = &mut shutdown => {}
        }
        let _ = stop.send(());
        match tokio::time::timeout(DRAIN_DEADLINE, &mut serving).await {
            Ok(result) => result,
            Err(_) => {
                tracing::info!(
                    "connections still open {DRAIN_DEADLINE:?} after the stop signal; closing them"
                );
                Ok(())
            }
        }
    }

    /// Whether `address` (`HOST:PORT`) can be reached from other machines.
    pub fn is_loopback(address: &std::net::SocketAddr) -> bool {
        address.ip().is_loopback()
    }

    /// Binds `listen`, reports readiness, serves until `shutdown` resolves. A unix socket is
    /// made usable by its owner only (mode 0600, before any client can connect); TCP is for
    /// deployments that ask for it and should carry a control secret.
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
            // Created with no access for anyone but the owner, so no other user can connect in
            // the moment between bind and chmod.
            let listener = {
                let previous =
                    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
                let bound = tokio::net::UnixListener::bind(path);
                nix::sys::stat::umask(previous);
                bound.map_err(|e| failed("listening on", &e))?
            };
            {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                    .map_err(|e| failed("restricting", &e))?;
            }
            announce_ready(listen);
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            let result = serve_with_drain_deadline(router, incoming, shutdown).await;
            let _ = std::fs::remove_file(path);
            result.map_err(|e| failed("serving", &e))?;
        } else {
            let address: std::net::SocketAddr = listen
                .parse()
                .map_err(|e| failed("expected unix:PATH or HOST:PORT, got", &e))?;
            if !is_loopback(&address) {
                tracing::warn!(
                    %address,
                    "listening beyond this machine: anyone who reaches this port can call this control API unless a control secret is set (prefer unix:PATH)"
                );
            }
            let listener = tokio::net::TcpListener::bind(address)
                .await
                .map_err(|e| failed("listening on", &e))?;
            announce_ready(listen);
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            serve_with_drain_deadline(router, incoming, shutdown)
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
