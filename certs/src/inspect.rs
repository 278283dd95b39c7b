//! A readable summary of a certificate — subject, issuer, names, usages,
//! validity, fingerprints — parsed with x509-parser, so operators need no
//! openssl to check what `tether-certs` made.

use std::fmt;

use sha2::{Digest, Sha256};
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::prelude::*;

use crate::CertError;

/// What `tether-certs inspect` shows for one certificate.
#[derive(Debug, Clone)]
pub struct CertSummary {
    pub subject: String,
    pub issuer: String,
    pub serial: String,
    pub not_before: String,
    pub not_after: String,
    /// Seconds from now until expiry; negative once expired.
    pub expires_in_secs: i64,
    pub is_ca: bool,
    pub key: String,
    pub sans: Vec<String>,
    pub key_usage: Vec<String>,
    pub ext_key_usage: Vec<String>,
    /// SHA-256 of the whole certificate, hex with colons.
    pub sha256_fingerprint: String,
    /// `sha256:` of the public key: the join pin, if this is a CA.
    pub spki_pin: String,
}

fn key_name(spki: &SubjectPublicKeyInfo<'_>) -> String {
    use x509_parser::oid_registry::*;
    let alg = &spki.algorithm.algorithm;
    if *alg == OID_KEY_TYPE_EC_PUBLIC_KEY {
        let curve = spki
            .algorithm
            .parameters
            .as_ref()
            .and_then(|p| p.as_oid().ok());
        match curve {
            Some(c) if c == OID_EC_P256 => "ECDSA P-256".into(),
            Some(c) if c == OID_NIST_EC_P384 => "ECDSA P-384".into(),
            Some(c) => format!("ECDSA curve {c}"),
            None => "ECDSA (no named curve)".into(),
        }
    } else if *alg == OID_SIG_ED25519 {
        "Ed25519".into()
    } else if *alg == OID_PKCS1_RSAENCRYPTION {
        let bits = spki.parsed().map(|k| k.key_size()).unwrap_or(0);
        format!("RSA {bits} bits")
    } else {
        format!("algorithm {alg}")
    }
}

fn general_name(g: &GeneralName<'_>) -> String {
    match g {
        GeneralName::DNSName(d) => format!("DNS:{d}"),
        GeneralName::IPAddress(b) => match b.len() {
            4 => format!(
                "IP:{}",
                std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*b).unwrap_or_default())
            ),
            16 => format!(
                "IP:{}",
                std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*b).unwrap_or_default())
            ),
            _ => format!("IP:<{} bytes>", b.len()),
        },
        GeneralName::URI(u) => format!("URI:{u}"),
        GeneralName::RFC822Name(e) => format!("email:{e}"),
        other => other.to_string(),
    }
}

/// Summarises a DER certificate.
pub fn summarize(der: &[u8]) -> Result<CertSummary, CertError> {
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| CertError::Parse(e.to_string()))?;
    let validity = cert.validity();
    let mut s = CertSummary {
        subject: cert.subject().to_string(),
        issuer: cert.issuer().to_string(),
        serial: cert.raw_serial_as_string(),
        not_before: crate::token::format_unix(validity.not_before.timestamp()),
        not_after: crate::token::format_unix(validity.not_after.timestamp()),
        expires_in_secs: validity.not_after.timestamp()
            - ::time::OffsetDateTime::now_utc().unix_timestamp(),
        is_ca: cert.is_ca(),
        key: key_name(cert.public_key()),
        sans: Vec::new(),
        key_usage: Vec::new(),
        ext_key_usage: Vec::new(),
        sha256_fingerprint: Sha256::digest(der)
            .iter()
            .map(|b| format!("{b:02X}"))
            .collect::<Vec<_>>()
            .join(":"),
        spki_pin: format!(
            "{}{}",
            crate::pin::PIN_PREFIX,
            hex::encode(Sha256::digest(cert.public_key().raw))
        ),
    };
    for ext in cert.extensions() {
        match ext.parsed_extension() {
            ParsedExtension::SubjectAlternativeName(san) => {
                s.sans = san.general_names.iter().map(general_name).collect();
            }
            ParsedExtension::KeyUsage(ku) => {
                s.key_usage = ku.to_string().split(", ").map(str::to_string).collect();
            }
            ParsedExtension::ExtendedKeyUsage(eku) => {
                let mut v = Vec::new();
                if eku.server_auth {
                    v.push("serverAuth".to_string());
                }
                if eku.client_auth {
                    v.push("clientAuth".to_string());
                }
                if eku.any {
                    v.push("any".to_string());
                }
                if eku.code_signing {
                    v.push("codeSigning".to_string());
                }
                if eku.email_protection {
                    v.push("emailProtection".to_string());
                }
                if eku.time_stamping {
                    v.push("timeStamping".to_string());
                }
                if eku.ocsp_signing {
                    v.push("OCSPSigning".to_string());
                }
                v.extend(eku.other.iter().map(|o| o.to_string()));
                s.ext_key_usage = v;
            }
            _ => {}
        }
    }
    Ok(s)
}

fn list(v: &[String]) -> String {
    if v.is_empty() {
        "(none)".into()
    } else {
        v.join(", ")
    }
}

impl fmt::Display for CertSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let days = self.expires_in_secs / 86400;
        let state = if self.expires_in_secs < 0 {
            format!("EXPIRED {} days ago", -days)
        } else {
            format!("expires in {days} days")
        };
        writeln!(f, "Subject:            {}", self.subject)?;
        writeln!(f, "Issuer:             {}", self.issuer)?;
        writeln!(f, "Serial:             {}", self.serial)?;
        writeln!(f, "Not before:         {}", self.not_before)?;
        writeln!(f, "Not after:          {} ({state})", self.not_after)?;
        writeln!(
            f,
            "CA:                 {}",
            if self.is_ca { "yes" } else { "no" }
        )?;
        writeln!(f, "Key:                {}", self.key)?;
        writeln!(f, "SANs:               {}", list(&self.sans))?;
        writeln!(f, "Key usage:          {}", list(&self.key_usage))?;
        writeln!(f, "Extended key usage: {}", list(&self.ext_key_usage))?;
        writeln!(f, "SHA-256 fingerprint: {}", self.sha256_fingerprint)?;
        write!(f, "Public key pin:     {}", self.spki_pin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn summary_of_each_kind() {
        let ca = crate::Ca::new("Tether CA", Duration::from_secs(86400)).unwrap();
        let der = |pem: &str| crate::pem::certs_from_pem(pem, "t").unwrap().remove(0);
        let s = summarize(der(&ca.cert_pem).as_ref()).unwrap();
        assert!(s.is_ca);
        assert_eq!(s.spki_pin, crate::ca_pin(&ca.cert_pem).unwrap());
        let edge = ca.issue_edge("edge-1", Duration::from_secs(86400)).unwrap();
        let s = summarize(der(&edge.cert_pem).as_ref()).unwrap();
        assert!(s.subject.contains("system:node:edge-1"), "{}", s.subject);
        assert_eq!(s.sans, vec!["DNS:edge-1"]);
        assert_eq!(s.ext_key_usage, vec!["clientAuth"]);
        assert_eq!(s.key, "ECDSA P-256");
        let server = ca
            .issue_server(
                &["cloud"],
                &["10.0.0.1".parse().unwrap()],
                Duration::from_secs(60),
            )
            .unwrap();
        let s = summarize(der(&server.cert_pem).as_ref()).unwrap();
        assert_eq!(s.sans, vec!["DNS:cloud", "IP:10.0.0.1"]);
        assert_eq!(s.ext_key_usage, vec!["serverAuth"]);
        let text = s.to_string();
        assert!(text.contains("SHA-256 fingerprint"));
    }
}
