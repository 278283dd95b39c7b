//! Loading PEM files into rustls types; every error names the file.

use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::CertError;

/// All certificates in a PEM text; `what` names the source in errors.
pub fn certs_from_pem(pem: &str, what: &str) -> Result<Vec<CertificateDer<'static>>, CertError> {
    let certs: Result<Vec<_>, _> = rustls_pemfile::certs(&mut pem.as_bytes()).collect();
    let certs = certs.map_err(|e| CertError::Content {
        path: what.into(),
        what: e.to_string(),
    })?;
    if certs.is_empty() {
        return Err(CertError::Content {
            path: what.into(),
            what: "no CERTIFICATE block".into(),
        });
    }
    Ok(certs)
}

/// The first private key in a PEM text.
pub fn key_from_pem(pem: &str, what: &str) -> Result<PrivateKeyDer<'static>, CertError> {
    rustls_pemfile::private_key(&mut pem.as_bytes())
        .map_err(|e| CertError::Content {
            path: what.into(),
            what: e.to_string(),
        })?
        .ok_or_else(|| CertError::Content {
            path: what.into(),
            what: "no PRIVATE KEY block".into(),
        })
}

fn read(path: &std::path::Path) -> Result<String, CertError> {
    std::fs::read_to_string(path).map_err(|source| CertError::File {
        path: path.display().to_string(),
        source,
    })
}

/// Certificates from a PEM file.
pub fn load_certs(path: &std::path::Path) -> Result<Vec<CertificateDer<'static>>, CertError> {
    certs_from_pem(&read(path)?, &path.display().to_string())
}

/// A private key from a PEM file.
pub fn load_key(path: &std::path::Path) -> Result<PrivateKeyDer<'static>, CertError> {
    key_from_pem(&read(path)?, &path.display().to_string())
}

/// A root store holding every certificate of a PEM file.
pub fn load_roots(path: &std::path::Path) -> Result<rustls::RootCertStore, CertError> {
    roots_from(&load_certs(path)?, path)
}

/// A root store of `certs`, read from `path` (which errors name).
pub fn roots_from(
    certs: &[CertificateDer<'static>],
    path: &std::path::Path,
) -> Result<rustls::RootCertStore, CertError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs {
        roots.add(c.clone()).map_err(|e| CertError::Content {
            path: path.display().to_string(),
            what: e.to_string(),
        })?;
    }
    Ok(roots)
}
