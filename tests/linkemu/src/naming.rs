//! Names and addresses of one emulated link, derived from its tag.
//!
//! A tag (`te1234-0` by default: `te`, the creating process id modulo 10000,
//! a per-process counter) prefixes everything a link creates, so parallel runs
//! never collide and `linkemu cleanup` can find leftovers:
//!
//! - network namespaces `<tag>-cloud` and `<tag>-edge`, each holding one TUN
//!   device named [`TUN_NAME`];
//! - a state directory `/run/linkemu/<tag>/` (or `$LINKEMU_STATE_DIR/<tag>/`)
//!   with the router's pid, its control socket and a JSON description. It is
//!   created before the namespaces and removed after them, so a namespace of a
//!   live link always has a state directory.
//!
//! Addresses are fixed per link ([`CLOUD_IP`], [`EDGE_IP`]): the namespaces of
//! different links are isolated from each other and from the host, so they
//! never need to differ, and nothing is ever routed outside them.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::bail;

/// The TUN device inside each namespace.
pub const TUN_NAME: &str = "tl0";

/// The cloud's address (a /32 on its TUN).
pub const CLOUD_IP: Ipv4Addr = Ipv4Addr::new(10, 231, 1, 1);

/// The edge's first address (a /32 on its TUN); address changes move it to
/// `10.231.2.3`, `.4`, … and wrap around after `.254`.
pub const EDGE_IP: Ipv4Addr = Ipv4Addr::new(10, 231, 2, 2);

/// Longest tag accepted (keeps socket paths far below the 108-byte limit).
pub const MAX_TAG_LEN: usize = 32;

/// Suffix of the cloud namespace.
pub const CLOUD_SUFFIX: &str = "-cloud";

/// Suffix of the edge namespace.
pub const EDGE_SUFFIX: &str = "-edge";

static NEXT_TAG: AtomicU32 = AtomicU32::new(0);

/// A fresh default tag for this process: `te<pid % 10000>-<n>`.
pub fn default_tag() -> String {
    let n = NEXT_TAG.fetch_add(1, Ordering::Relaxed);
    format!("te{}-{}", std::process::id() % 10_000, n)
}

/// Whether `tag` has the shape of a default tag (`te<digits>-<digits>`).
pub fn is_default_tag(tag: &str) -> bool {
    let Some(rest) = tag.strip_prefix("te") else {
        return false;
    };
    let Some((a, b)) = rest.split_once('-') else {
        return false;
    };
    !a.is_empty()
        && !b.is_empty()
        && a.bytes().all(|c| c.is_ascii_digit())
        && b.bytes().all(|c| c.is_ascii_digit())
}

/// Check that a tag is safe to put in namespace names and paths.
pub fn validate_tag(tag: &str) -> anyhow::Result<()> {
    if tag.is_empty() || tag.len() > MAX_TAG_LEN {
        bail!("tag {tag:?} must be 1..={MAX_TAG_LEN} characters");
    }
    if !tag
        .bytes()
        .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
    {
        bail!("tag {tag:?} may only contain letters, digits, '-' and '_'");
    }
    if tag.starts_with('-') {
        bail!("tag {tag:?} must not start with '-'");
    }
    Ok(())
}

/// The cloud namespace of a tag.
pub fn cloud_ns(tag: &str) -> String {
    format!("{tag}{CLOUD_SUFFIX}")
}

/// The edge namespace of a tag.
pub fn edge_ns(tag: &str) -> String {
    format!("{tag}{EDGE_SUFFIX}")
}

/// The tag a namespace name belongs to, if it has a link's suffix.
pub fn tag_of_ns(ns: &str) -> Option<&str> {
    ns.strip_suffix(CLOUD_SUFFIX)
        .or_else(|| ns.strip_suffix(EDGE_SUFFIX))
}

/// Where state directories live: `$LINKEMU_STATE_DIR` or `/run/linkemu`.
pub fn state_root() -> PathBuf {
    std::env::var_os("LINKEMU_STATE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/linkemu"))
}

/// The state directory of a tag.
pub fn state_dir(tag: &str) -> PathBuf {
    state_root().join(tag)
}

/// The router's control socket.
pub fn ctl_path(tag: &str) -> PathBuf {
    state_dir(tag).join("ctl.sock")
}

/// The router's pid file.
pub fn pid_path(tag: &str) -> PathBuf {
    state_dir(tag).join("router.pid")
}

/// The JSON description of the link ([`crate::control::Info`]).
pub fn info_path(tag: &str) -> PathBuf {
    state_dir(tag).join("info.json")
}

/// The edge address that follows `cur` in an address change.
pub fn next_edge_ip(cur: Ipv4Addr) -> Ipv4Addr {
    let [a, b, c, d] = cur.octets();
    let next = if d >= 254 { 2 } else { d + 1 };
    Ipv4Addr::new(a, b, c, next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_and_names() {
        let t = default_tag();
        assert!(is_default_tag(&t), "{t}");
        validate_tag(&t).expect("valid");
        assert!(validate_tag("a/b").is_err());
        assert!(validate_tag("").is_err());
        assert!(!is_default_tag("tether-1"));
        assert_eq!(tag_of_ns(&cloud_ns(&t)), Some(t.as_str()));
        assert_eq!(tag_of_ns(&edge_ns("x")), Some("x"));
        assert_eq!(next_edge_ip(EDGE_IP), Ipv4Addr::new(10, 231, 2, 3));
        assert_eq!(
            next_edge_ip(Ipv4Addr::new(10, 231, 2, 254)),
            Ipv4Addr::new(10, 231, 2, 2)
        );
    }
}
