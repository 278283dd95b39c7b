//! Revoked edge certificates, refused at the handshake.
//!
//! The revocations live in the join store (`--join-store`), written by
//! `tether-certs cert revoke`: one certificate by serial, or every certificate
//! of a node issued before a time (a stolen key). A replica re-reads them when
//! the file's modification time changes, at most once per [`RECHECK`], so a
//! revocation takes effect at the next handshake without a restart and a
//! handshake flood never turns into a file-read flood. A store that cannot be
//! read keeps the last list (logged): an operator's mistake never un-revokes.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rustls::pki_types::CertificateDer;
use tether_certs::token::Revocation;
use tether_certs::JoinStore;
use tracing::warn;

/// Least time between two looks at the store's modification time.
pub const RECHECK: Duration = Duration::from_secs(1);

#[derive(Default)]
struct Cache {
    checked: Option<Instant>,
    mtime: Option<SystemTime>,
    list: Arc<Vec<Revocation>>,
}

/// The revocations of one join store.
pub struct Revocations {
    store: Arc<JoinStore>,
    cache: Mutex<Cache>,
}

impl Revocations {
    pub fn new(store: Arc<JoinStore>) -> Revocations {
        Revocations {
            store,
            cache: Mutex::new(Cache::default()),
        }
    }

    fn current(&self) -> Arc<Vec<Revocation>> {
        let mut c = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if c.checked.is_some_and(|t| now.duration_since(t) < RECHECK) {
            return c.list.clone();
        }
        c.checked = Some(now);
        let mtime = std::fs::metadata(self.store.path())
            .and_then(|m| m.modified())
            .ok();
        if mtime.is_some() && mtime == c.mtime {
            return c.list.clone();
        }
        match self.store.revocations() {
            Ok(list) => {
                c.mtime = mtime;
                c.list = Arc::new(list);
            }
            Err(e) => warn!(error = %e, "cannot read the revocations; keeping the last list"),
        }
        c.list.clone()
    }

    /// `Err(why)` if `leaf` (an edge certificate of `node`) is revoked.
    pub fn check(&self, leaf: &CertificateDer<'_>, node: &str) -> Result<(), String> {
        let list = self.current();
        if list.is_empty() {
            return Ok(());
        }
        let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref())
            .map_err(|e| format!("unreadable certificate: {e}"))?;
        let serial: String = cert
            .raw_serial()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let not_before = cert.validity().not_before.timestamp();
        match list.iter().find(|r| r.matches(&serial, node, not_before)) {
            None => Ok(()),
            Some(r) => Err(format!(
                "certificate {} of node {node} is revoked ({})",
                tether_certs::token::normalize_serial(&serial),
                if r.reason.is_empty() {
                    "no reason given"
                } else {
                    r.reason.as_str()
                }
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revoked_certificates_are_refused_and_a_new_revocation_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(JoinStore::open(dir.path().join("store.json")).unwrap());
        let ca = tether_certs::Ca::new("test-ca", Duration::from_secs(3600)).unwrap();
        let a = ca.issue_edge("edge-a", Duration::from_secs(3600)).unwrap();
        let b = ca.issue_edge("edge-b", Duration::from_secs(3600)).unwrap();
        let der = |pem: &str| {
            tether_certs::pem::certs_from_pem(pem, "cert")
                .unwrap()
                .remove(0)
        };
        let (a, b) = (der(&a.cert_pem), der(&b.cert_pem));
        let r = Revocations::new(store.clone());
        assert!(r.check(&a, "edge-a").is_ok());
        // By node: every certificate issued until now.
        store
            .revoke_node(
                "edge-a",
                "stolen",
                SystemTime::now() + Duration::from_secs(5),
            )
            .unwrap();
        // Seen after the recheck interval (the file's mtime changed).
        std::thread::sleep(RECHECK + Duration::from_millis(50));
        let e = r.check(&a, "edge-a").unwrap_err();
        assert!(e.contains("edge-a") && e.contains("stolen"), "{e}");
        assert!(r.check(&b, "edge-b").is_ok());
        // By serial.
        let (_, cert) = x509_parser::parse_x509_certificate(b.as_ref()).unwrap();
        let serial: String = cert
            .raw_serial()
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect();
        store.revoke_serial(&serial, "", SystemTime::now()).unwrap();
        std::thread::sleep(RECHECK + Duration::from_millis(50));
        assert!(r
            .check(&b, "edge-b")
            .unwrap_err()
            .contains("no reason given"));
        // An unreadable store keeps the last list.
        std::fs::write(store.path(), b"garbage").unwrap();
        std::thread::sleep(RECHECK + Duration::from_millis(50));
        assert!(r.check(&b, "edge-b").is_err());
    }
}
