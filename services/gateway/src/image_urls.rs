//! Image URLs the gateway fetches: off unless the operator names the hosts
//! (`--image-url-hosts`), then `http(s)` URLs of those hosts only, each fetch bounded by a
//! timeout (connecting included) and a byte cap enforced while the body streams (a
//! `Content-Length` above it is refused before any byte is read). Redirects are not followed
//! (a redirect could leave the allowed hosts). A host name must resolve to public addresses
//! only, checked on the addresses actually connected to; a private or loopback address is
//! fetched only when the operator named that address itself. A client thus cannot reach the
//! gateway's own network through a name.
//!
//! The fetched file then goes through the same header probe and limits as an inline image.
//!
//! Owns: [`ImageUrlPolicy`] (which hosts, how long, how many bytes) and the fetch that fills in
//! an image part from its URL.
//! Must not touch: the APIs' JSON shapes, the header probe (`images`).

use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{DefaultConnector, NextTimeout};

use crate::images::{ChatImage, ChatImagePart};

/// One entry of the allowed hosts: a host exactly, or (`*.example.com`) every name under a
/// domain.
#[derive(Debug, Clone, PartialEq, Eq)]
enum AllowedHost {
    Exactly(String),
    /// The suffix with its leading dot (`.example.com`).
    Under(String),
}

/// Which image URLs the gateway fetches and within what bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageUrlPolicy {
    hosts: Vec<AllowedHost>,
    /// For one request's fetches together: resolving, connecting, the answers and their bodies.
    timeout: Duration,
    /// Most bytes one request's fetched images may take together.
    max_bytes: usize,
}

impl ImageUrlPolicy {
    /// The policy of `--image-url-hosts` (`None` when no host is named: nothing is fetched).
    /// Hosts are names or addresses (`images.example.com`, `127.0.0.1`, `[::1]`), or
    /// `*.example.com` for every name under a domain.
    pub fn from_hosts(
        hosts: &[String],
        timeout: Duration,
        max_bytes: usize,
    ) -> Result<Option<Arc<Self>>, String> {
        let mut allowed = Vec::new();
        for entry in hosts
            .iter()
            .map(|host| host.trim())
            .filter(|h| !h.is_empty())
        {
            let host = entry.to_ascii_lowercase();
            let parsed = match host.strip_prefix("*.") {
                Some(domain) => AllowedHost::Under(format!(".{domain}")),
                None => AllowedHost::Exactly(
                    host.trim_start_matches('[')
                        .trim_end_matches(']')
                        .to_string(),
                ),
            };
            let name = match &parsed {
                AllowedHost::Exactly(name) | AllowedHost::Under(name) => name,
            };
            if name.trim_start_matches('.').is_empty()
                || name.contains(['*', '/', '@', ' ', '?', '#'])
            {
                return Err(format!(
                    "`{entry}` is not a host name, an address or `*.domain`"
                ));
            }
            // A colon outside an IPv6 address is a port, which the allowance does not name.
            if name.contains(':') && name.parse::<Ipv6Addr>().is_err() {
                return Err(format!("`{entry}`: name the host without a port"));
            }
            allowed.push(parsed);
        }
        if allowed.is_empty() {
            return Ok(None);
        }
        if timeout.is_zero() || max_bytes == 0 {
            return Err("the image URL timeout and byte cap must be above zero".into());
        }
        Ok(Some(Arc::new(ImageUrlPolicy {
            hosts: allowed,
            timeout,
            max_bytes,
        })))
    }

    /// Whether `host` (lowercase, without brackets) is allowed, and whether it may then be a
    /// private or loopback address: only when the operator named that address itself (a name,
    /// `localhost` included, must resolve to public addresses).
    fn admits(&self, host: &str) -> Option<bool> {
        self.hosts.iter().find_map(|allowed| match allowed {
            AllowedHost::Exactly(name) if name == host => Some(name.parse::<IpAddr>().is_ok()),
            AllowedHost::Under(suffix)
                if host.len() > suffix.len() && host.ends_with(suffix.as_str()) =>
            {
                Some(false)
            }
            _ => None,
        })
    }

    /// The image file at `url` (`http` or `https`) and its declared media type, within
    /// `budget` bytes and `time_left`; the error names the problem.
    async fn fetch(
        &self,
        url: &str,
        budget: usize,
        time_left: Duration,
    ) -> Result<FetchedFile, String> {
        let uri: ureq::http::Uri = url
            .trim()
            .parse()
            .map_err(|_| "the image URL is not a valid URL".to_string())?;
        let scheme = uri.scheme_str().unwrap_or_default().to_ascii_lowercase();
        if scheme != "http" && scheme != "https" {
            return Err("only http and https image URLs are fetched".into());
        }
        let host = uri
            .host()
            .unwrap_or_default()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_ascii_lowercase();
        let private_allowed = self.admits(&host).ok_or_else(|| {
            format!("the host `{host}` is not one this server fetches images from")
        })?;
        let timeout = self.timeout;
        if time_left.is_zero() {
            return Err(timed_out(timeout));
        }
        let url = url.trim().to_string();
        let fetch = tokio::task::spawn_blocking(move || {
            fetch_blocking(&url, private_allowed, time_left, timeout, budget)
        });
        // The client's own timeout covers the fetch; this one also bounds a fetch stuck
        // somewhere the client does not time.
        match tokio::time::timeout(time_left + Duration::from_secs(1), fetch).await {
            Ok(Ok(fetched)) => fetched,
            Ok(Err(error)) => Err(format!("the fetch failed ({error})")),
            Err(_) => Err(timed_out(timeout)),
        }
    }
}

/// What is left of one request's fetches: bytes and time.
#[derive(Debug, Clone, Copy)]
pub struct FetchAllowance {
    bytes: usize,
    deadline: Instant,
}

/// A fetched file and the image media type its origin declared (none when it declared
/// something other than an image type: the header probe then tells the format).
struct FetchedFile {
    bytes: Vec<u8>,
    media_type: Option<String>,
}

/// The fetch itself, on a blocking thread, within `time_left`: one GET, no redirects, no
/// proxy, the body read up to `max_bytes` and refused past it. (`timeout` is the policy's, for
/// the refusal.)
fn fetch_blocking(
    url: &str,
    private_allowed: bool,
    time_left: Duration,
    timeout: Duration,
    max_bytes: usize,
) -> Result<FetchedFile, String> {
    let config = ureq::Agent::config_builder()
        .timeout_global(Some(time_left))
        .timeout_connect(Some(time_left))
        .max_redirects(0)
        .http_status_as_error(false)
        .proxy(None)
        .user_agent("ninfer-gateway")
        .build();
    let agent = ureq::Agent::with_parts(
        config,
        DefaultConnector::default(),
        PublicAddressesOnly {
            private_allowed,
            resolver: DefaultResolver::default(),
        },
    );
    let mut response = agent
        .get(url)
        .call()
        .map_err(|error| described(&error, timeout))?;
    let status = response.status();
    if status.is_redirection() {
        return Err(format!(
            "the image URL answered HTTP {status} (redirects are not followed)"
        ));
    }
    if !status.is_success() {
        return Err(format!("the image URL answered HTTP {status}"));
    }
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::to_string)
    };
    let too_large = |bytes: &dyn std::fmt::Display| {
        format!(
            "the image at the URL is too large ({bytes} bytes; at most {max_bytes} are fetched)"
        )
    };
    if let Some(length) = header("content-length").and_then(|v| v.trim().parse::<u64>().ok()) {
        if length > max_bytes as u64 {
            return Err(too_large(&length));
        }
    }
    let media_type = header("content-type")
        .map(|value| {
            value
                .split(';')
                .next()
                .unwrap_or_default()
                .trim()
                .to_ascii_lowercase()
        })
        .filter(|media| media.starts_with("image/"));
    let mut bytes = Vec::new();
    response
        .body_mut()
        .as_reader()
        .take(max_bytes as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|error| {
            if error.kind() == std::io::ErrorKind::TimedOut {
                timed_out(timeout)
            } else {
                format!("reading the image from the URL failed ({error})")
            }
        })?;
    if bytes.len() > max_bytes {
        return Err(too_large(&format!("more than {max_bytes}")));
    }
    Ok(FetchedFile { bytes, media_type })
}

fn timed_out(timeout: Duration) -> String {
    format!(
        "fetching the image URL timed out (the request's image fetches may take {} s)",
        timeout.as_secs_f64()
    )
}

/// A client error as the refusal says it.
fn described(error: &ureq::Error, timeout: Duration) -> String {
    match error {
        ureq::Error::Timeout(_) => timed_out(timeout),
        ureq::Error::HostNotFound => "the image URL's host was not found".into(),
        ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::PermissionDenied => io.to_string(),
        ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::TimedOut => timed_out(timeout),
        other => format!("fetching the image URL failed ({other})"),
    }
}

/// Resolves as usual, then keeps only public addresses unless private ones are allowed: the
/// check is on the addresses the client connects to, so a name cannot change its answer
/// between a check and the connection.
#[derive(Debug)]
struct PublicAddressesOnly {
    private_allowed: bool,
    resolver: DefaultResolver,
}

impl Resolver for PublicAddressesOnly {
    fn resolve(
        &self,
        uri: &ureq::http::Uri,
        config: &ureq::config::Config,
        timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        let resolved = self.resolver.resolve(uri, config, timeout)?;
        if self.private_allowed {
            return Ok(resolved);
        }
        let mut public = self.empty();
        for address in resolved.iter().filter(|a| is_public(a.ip())) {
            public.push(*address);
        }
        if public.is_empty() {
            return Err(ureq::Error::Io(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "the image URL's host resolves to a private, loopback or link-local address, which is not fetched",
            )));
        }
        Ok(public)
    }
}

/// Whether an address is on the public internet (not loopback, private, link-local, shared,
/// documentation or unspecified).
fn is_public(address: IpAddr) -> bool {
    match address {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => is_public_v4(v4),
            None => is_public_v6(v6),
        },
    }
}

fn is_public_v4(address: Ipv4Addr) -> bool {
    let [first, second, ..] = address.octets();
    !(address.is_loopback()
        || address.is_private()
        || address.is_link_local()
        || address.is_unspecified()
        || address.is_broadcast()
        || address.is_documentation()
        || address.is_multicast()
        || first == 0
        || (first == 100 && (64..128).contains(&second)))
}

fn is_public_v6(address: Ipv6Addr) -> bool {
    let first = address.segments()[0];
    !(address.is_loopback()
        || address.is_unspecified()
        || address.is_multicast()
        || (first & 0xfe00) == 0xfc00
        || (first & 0xffc0) == 0xfe80)
}

impl ImageUrlPolicy {
    /// What one request's fetches may take together: the byte cap and the timeout, from now.
    pub fn allowance(&self) -> FetchAllowance {
        FetchAllowance {
            bytes: self.max_bytes,
            deadline: Instant::now() + self.timeout,
        }
    }

    /// Fetches `part`'s URL, if it has one, into its image, taking the file's bytes and the
    /// time from `allowance`. A failed fetch becomes the part's refusal, raised as a 400 when
    /// the images are taken, like an inline image's; a fetched file is probed like an inline
    /// one.
    pub async fn fetch_into(&self, part: &mut ChatImagePart, allowance: &mut FetchAllowance) {
        let Some(url) = part.fetch_from.take() else {
            return;
        };
        let location = &part.location;
        let time_left = allowance.deadline.saturating_duration_since(Instant::now());
        part.image = match self.fetch(&url, allowance.bytes, time_left).await {
            Ok(file) => {
                allowance.bytes = allowance.bytes.saturating_sub(file.bytes.len());
                ChatImage::from_bytes(file.bytes, file.media_type.as_deref(), location)
                    .map_err(|error| error.to_string())
            }
            Err(problem) => Err(format!("{location}: {problem}")),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(hosts: &[&str]) -> Arc<ImageUrlPolicy> {
        let hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
        ImageUrlPolicy::from_hosts(&hosts, Duration::from_secs(1), 1024)
            .expect("valid hosts")
            .expect("some hosts")
    }

    #[test]
    fn hosts_match_exactly_or_under_a_domain() {
        let policy = policy(&[
            "images.example.com",
            "*.cdn.example.org",
            "127.0.0.1",
            "[::1]",
        ]);
        assert_eq!(policy.admits("images.example.com"), Some(false));
        assert_eq!(policy.admits("a.images.example.com"), None);
        assert_eq!(policy.admits("x.cdn.example.org"), Some(false));
        assert_eq!(policy.admits("a.b.cdn.example.org"), Some(false));
        assert_eq!(policy.admits("cdn.example.org"), None);
        assert_eq!(policy.admits("evilcdn.example.org"), None);
        assert_eq!(policy.admits("127.0.0.1"), Some(true));
        assert_eq!(policy.admits("::1"), Some(true));
        assert_eq!(policy.admits("127.0.0.2"), None);
        let none: Vec<String> = vec![" ".into()];
        assert_eq!(
            ImageUrlPolicy::from_hosts(&none, Duration::from_secs(1), 1),
            Ok(None)
        );
        for bad in [
            "*",
            "*.",
            "a/b",
            "user@host",
            "*.*.example.com",
            "example.com:8080",
            "127.0.0.1:80",
        ] {
            assert!(
                ImageUrlPolicy::from_hosts(&[bad.to_string()], Duration::from_secs(1), 1).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn private_addresses_are_not_public() {
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fd00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
        ] {
            assert!(!is_public(private.parse().expect("address")), "{private}");
        }
        for public in ["93.184.216.34", "8.8.8.8", "2606:4700::1111"] {
            assert!(is_public(public.parse().expect("address")), "{public}");
        }
    }

    #[tokio::test]
    async fn other_schemes_and_hosts_are_refused_before_any_connection() {
        let policy = policy(&["images.example.com"]);
        let refusal = |url: &'static str| {
            let policy = policy.clone();
            async move {
                let time = Duration::from_secs(1);
                policy.fetch(url, 1024, time).await.err().expect("refused")
            }
        };
        assert!(refusal("http://other.example.com/a.png")
            .await
            .contains("not one this server fetches images from"));
        assert!(refusal("ftp://images.example.com/a.png")
            .await
            .contains("only http and https"));
    }
}
