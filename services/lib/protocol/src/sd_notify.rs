//! systemd readiness and watchdog notifications without libsystemd.
//!
//! Owns: sending `READY=1`, `WATCHDOG=1`, `STATUS=...` and `STOPPING=1` datagrams to
//! `$NOTIFY_SOCKET` (a path or an abstract `@name` unix socket), and the watchdog interval from
//! `$WATCHDOG_USEC`. Everything is a no-op when not run by systemd.
//! Must not touch: anything else; failures are reported to the caller, never fatal here.

use std::os::unix::net::UnixDatagram;
use std::time::Duration;

/// Sends one notification (`READY=1` etc.). Returns `Ok(false)` when not under systemd.
pub fn notify(message: &str) -> std::io::Result<bool> {
    let Some(socket_path) = std::env::var_os("NOTIFY_SOCKET") else {
        return Ok(false);
    };
    let socket = UnixDatagram::unbound()?;
    let path_bytes = std::os::unix::ffi::OsStrExt::as_bytes(socket_path.as_os_str());
    if let Some(abstract_name) = path_bytes.strip_prefix(b"@") {
        connect_abstract(&socket, abstract_name)?;
        socket.send(message.as_bytes())?;
    } else {
        socket.send_to(message.as_bytes(), std::path::Path::new(&socket_path))?;
    }
    Ok(true)
}

#[cfg(target_os = "linux")]
fn connect_abstract(socket: &UnixDatagram, name: &[u8]) -> std::io::Result<()> {
    use std::os::linux::net::SocketAddrExt;
    let address = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
    socket.connect_addr(&address)
}

#[cfg(not(target_os = "linux"))]
fn connect_abstract(_socket: &UnixDatagram, _name: &[u8]) -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "abstract sockets need Linux",
    ))
}

/// Half the watchdog timeout systemd asked for (`WatchdogSec=`), if any.
pub fn watchdog_interval() -> Option<Duration> {
    let microseconds: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID") {
        if pid.parse::<u32>().ok() != Some(std::process::id()) {
            return None;
        }
    }
    (microseconds > 0).then(|| Duration::from_micros(microseconds / 2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_to_a_path_socket() {
        let directory = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let path = directory.path().join("notify.sock");
        let receiver = UnixDatagram::bind(&path).unwrap_or_else(|e| panic!("bind: {e}"));
        // Environment is process-wide; this is the only test that sets NOTIFY_SOCKET.
        std::env::set_var("NOTIFY_SOCKET", &path);
        assert!(notify("READY=1").unwrap_or(false));
        let mut buffer = [0u8; 64];
        let length = receiver.recv(&mut buffer).unwrap_or(0);
        assert_eq!(&buffer[..length], b"READY=1");
        std::env::remove_var("NOTIFY_SOCKET");
    }
}
