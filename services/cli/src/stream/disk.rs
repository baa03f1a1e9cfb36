//! Free space up front: what a streaming conversion will write (the artifact, the cache bound)
//! against the free space of the filesystems it writes to, before any weight is fetched.
//!
//! Owns: finding a path's filesystem (its nearest existing ancestor) and summing the needs of
//! each filesystem.
//! Must not touch: the files themselves.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::bail;

/// Something to be written: what it is, where, and how many bytes at most.
pub struct Need {
    pub what: String,
    pub path: PathBuf,
    pub bytes: u64,
}

/// The nearest existing ancestor of `path` (the filesystem it will be written to).
fn existing_ancestor(path: &Path) -> PathBuf {
    let mut current = path.to_path_buf();
    loop {
        if current.exists() {
            return current;
        }
        match current.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => current = parent.to_path_buf(),
            _ => return PathBuf::from("."),
        }
    }
}

/// Bytes an unprivileged user may still write on the filesystem of `path` (or of its nearest
/// existing ancestor).
pub fn available_bytes(path: &Path) -> Option<u64> {
    let stats = nix::sys::statvfs::statvfs(&existing_ancestor(path)).ok()?;
    Some((stats.blocks_available() as u64).saturating_mul(stats.fragment_size() as u64))
}

/// Fails, naming every need of a filesystem and its free space, when the needs of one
/// filesystem exceed what it has free.
pub fn check_space(needs: &[Need]) -> anyhow::Result<()> {
    let mut by_device: Vec<(u64, PathBuf, Vec<&Need>)> = Vec::new();
    for need in needs {
        let anchor = existing_ancestor(&need.path);
        let device = std::fs::metadata(&anchor).map_or(0, |m| m.dev());
        match by_device.iter_mut().find(|(d, _, _)| *d == device) {
            Some((_, _, list)) => list.push(need),
            None => by_device.push((device, anchor, vec![need])),
        }
    }
    for (_, anchor, list) in by_device {
        let Some(free) = available_bytes(&anchor) else {
            continue;
        };
        let total: u64 = list.iter().map(|need| need.bytes).sum();
        if total > free {
            let parts: Vec<String> = list
                .iter()
                .map(|need| {
                    format!(
                        "{} ({:.2} GB at {})",
                        need.what,
                        need.bytes as f64 / 1e9,
                        need.path.display()
                    )
                })
                .collect();
            bail!(
                "not enough disk space: {} need {:.2} GB on the filesystem of {}, which has \
                 {:.2} GB free; free some space, lower --cache-gb, or choose other directories",
                parts.join(" and "),
                total as f64 / 1e9,
                anchor.display(),
                free as f64 / 1e9
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn needs_beyond_the_free_space_are_refused_naming_each() {
        let directory = tempfile::tempdir().unwrap();
        let small = Need {
            what: "the artifact".into(),
            path: directory.path().join("not/yet/model.ninfer"),
            bytes: 1 << 20,
        };
        assert!(check_space(std::slice::from_ref(&small)).is_ok());
        let huge = Need {
            what: "the range cache".into(),
            path: directory.path().join("ranges"),
            bytes: u64::MAX / 4,
        };
        let message = check_space(&[small, huge]).unwrap_err().to_string();
        assert!(
            message.contains("not enough disk space")
                && message.contains("the artifact")
                && message.contains("the range cache")
                && message.contains("GB free"),
            "{message}"
        );
    }
}
