//! When an edge should renew its certificate: once two thirds of its
//! lifetime have passed (the kubelet's rule of thumb), leaving a third of the
//! lifetime to retry through outages. The renewal itself is a CSR for the
//! same node signed by [`crate::csr::sign_edge_csr`], sent over the edge's
//! authenticated session, with the node taken from the session's
//! certificate, never from the request.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use x509_parser::prelude::*;

use crate::CertError;

/// The moment a certificate is due for renewal: `not_before` plus two
/// thirds of its lifetime.
pub fn renewal_time(cert_der: &[u8]) -> Result<SystemTime, CertError> {
    let (_, cert) =
        X509Certificate::from_der(cert_der).map_err(|e| CertError::Parse(e.to_string()))?;
    let from = cert.validity().not_before.timestamp();
    let to = cert.validity().not_after.timestamp();
    if to <= from || from < 0 {
        return Err(CertError::Parse(format!(
            "certificate validity {from}..{to} is not a forward interval after 1970"
        )));
    }
    let due = from as u64 + (to - from) as u64 * 2 / 3;
    Ok(UNIX_EPOCH + Duration::from_secs(due))
}

/// How long after it is issued a certificate valid for `valid_for` (as
/// [`crate::mint`] makes it: back-dated by
/// [`NOT_BEFORE_BACKDATE`](crate::mint::NOT_BEFORE_BACKDATE)) is due for
/// renewal: [`renewal_time`] less the issue time, zero if due at once.
pub fn due_after_issue(valid_for: Duration) -> Duration {
    let back = crate::mint::NOT_BEFORE_BACKDATE;
    let life = valid_for.saturating_add(back);
    (life - life / 3).saturating_sub(back)
}

/// Whether the certificate is due for renewal at `now`.
pub fn renewal_due(cert_der: &[u8], now: SystemTime) -> Result<bool, CertError> {
    Ok(now >= renewal_time(cert_der)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Ca;

    #[test]
    fn due_after_two_thirds_of_the_lifetime() {
        let ca = Ca::new("r", Duration::from_secs(86400 * 10)).unwrap();
        // Valid 3 h (plus the 5 min back-dating): due after about 2 h.
        let edge = ca
            .issue_edge("edge-1", Duration::from_secs(3 * 3600))
            .unwrap();
        let der = crate::pem::certs_from_pem(&edge.cert_pem, "t")
            .unwrap()
            .remove(0);
        let now = SystemTime::now();
        assert!(!renewal_due(der.as_ref(), now).unwrap());
        assert!(!renewal_due(der.as_ref(), now + Duration::from_secs(3600)).unwrap());
        assert!(renewal_due(der.as_ref(), now + Duration::from_secs(2 * 3600)).unwrap());
        let at = renewal_time(der.as_ref()).unwrap();
        let secs = at.duration_since(now).unwrap().as_secs();
        assert!((7000..7300).contains(&secs), "{secs}");
        assert!(renewal_time(b"junk").is_err());
        // The same from the validity alone: 2/3 of 3 h 5 min, less 5 min.
        let after = due_after_issue(Duration::from_secs(3 * 3600));
        assert_eq!(after, Duration::from_secs(7100));
        assert!(secs.abs_diff(after.as_secs()) <= 2, "{secs} {after:?}");
    }

    /// A certificate valid for less than half its back-dating is due at
    /// once; the largest validity does not overflow.
    #[test]
    fn due_after_issue_is_exact_and_bounded() {
        assert_eq!(due_after_issue(Duration::ZERO), Duration::ZERO);
        assert_eq!(due_after_issue(Duration::from_secs(150)), Duration::ZERO);
        assert_eq!(
            due_after_issue(Duration::from_secs(1050)),
            Duration::from_secs(600)
        );
        assert!(due_after_issue(Duration::MAX) > Duration::from_secs(u64::MAX / 2));
    }
}
