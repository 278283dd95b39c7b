//! TLS material and configurations: the serving certificate kubectl sees (loaded or
//! generated with rcgen), and the client configuration used to dial kubelets (client
//! certificate, ALPN `http/1.1`, server verification only with `--kubelet-ca`).
//! ring is the only crypto provider.

use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{ring, CryptoProvider};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};

/// Bound on any PEM file read.
const MAX_PEM: u64 = 1024 * 1024;

/// PEM texts of a serving identity plus the CA that clients should trust.
#[derive(Debug, Clone)]
pub struct ServingIdentity {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(ring::default_provider())
}

/// Reads a PEM file (bounded in size).
pub fn read_pem(path: &Path) -> Result<String> {
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if meta.len() > MAX_PEM {
        bail!("{} is larger than {MAX_PEM} bytes", path.display());
    }
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// All certificates in a PEM text.
pub fn parse_certs(pem: &str, what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = rustls_pemfile::certs(&mut pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parsing {what} certificates"))?;
    if certs.is_empty() {
        bail!("{what}: no CERTIFICATE block found");
    }
    Ok(certs)
}

/// The first private key in a PEM text.
pub fn parse_key(pem: &str, what: &str) -> Result<PrivateKeyDer<'static>> {
    rustls_pemfile::private_key(&mut pem.as_bytes())
        .with_context(|| format!("parsing {what} private key"))?
        .ok_or_else(|| anyhow!("{what}: no private key block found"))
}

/// Generates a throw-away CA and a serving certificate for `hosts` (DNS names or IPs).
pub fn generate_serving(hosts: &[String]) -> Result<ServingIdentity> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).context("CA params")?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "apiserver-sim-ca");
    ca_params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
    ];
    let ca_key = KeyPair::generate().context("generating CA key")?;
    let ca_cert = ca_params.self_signed(&ca_key).context("self-signing CA")?;
    let issuer = Issuer::new(ca_params, ca_key);

    let mut params = CertificateParams::new(hosts.to_vec()).context("serving cert names")?;
    params
        .distinguished_name
        .push(DnType::CommonName, "kube-apiserver");
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    let key = KeyPair::generate().context("generating serving key")?;
    let cert = params
        .signed_by(&key, &issuer)
        .context("signing serving cert")?;
    Ok(ServingIdentity {
        ca_pem: ca_cert.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// Server config for kubectl: ALPN h2 and http/1.1.
pub fn server_config(id: &ServingIdentity) -> Result<Arc<ServerConfig>> {
    let certs = parse_certs(&id.cert_pem, "serving")?;
    let key = parse_key(&id.key_pem, "serving")?;
    let mut cfg = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("serving certificate/key")?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// Client config for kubelet dials: the kubelet-client certificate, ALPN `http/1.1`,
/// and the kubelet's serving certificate checked against `ca_pem` only if given (the
/// apiserver's default is not to verify).
pub fn kubelet_client_config(
    cert_pem: &str,
    key_pem: &str,
    ca_pem: Option<&str>,
) -> Result<Arc<ClientConfig>> {
    let certs = parse_certs(cert_pem, "kubelet client")?;
    let key = parse_key(key_pem, "kubelet client")?;
    kubelet_config(Some((certs, key)), ca_pem)
}

/// Like [`kubelet_client_config`] but presenting no client certificate.
pub fn kubelet_client_config_anonymous(ca_pem: Option<&str>) -> Result<Arc<ClientConfig>> {
    kubelet_config(None, ca_pem)
}

fn kubelet_config(
    identity: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
    ca_pem: Option<&str>,
) -> Result<Arc<ClientConfig>> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS versions")?;
    let builder = match ca_pem {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in parse_certs(ca, "kubelet CA")? {
                roots.add(c).context("adding kubelet CA")?;
            }
            builder.with_root_certificates(roots)
        }
        None => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoServerVerification(provider()))),
    };
    let mut cfg = match identity {
        Some((certs, key)) => builder
            .with_client_auth_cert(certs, key)
            .context("kubelet client certificate/key")?,
        None => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// Accepts any server certificate (Go's `InsecureSkipVerify`) but still checks the
/// handshake signatures.
#[derive(Debug)]
struct NoServerVerification(Arc<CryptoProvider>);

impl ServerCertVerifier for NoServerVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_identity_loads() {
        let id = generate_serving(&["localhost".into(), "127.0.0.1".into()]).unwrap();
        assert!(id.ca_pem.contains("BEGIN CERTIFICATE"));
        server_config(&id).unwrap();
        kubelet_client_config(&id.cert_pem, &id.key_pem, None).unwrap();
        kubelet_client_config(&id.cert_pem, &id.key_pem, Some(&id.ca_pem)).unwrap();
        kubelet_client_config_anonymous(None).unwrap();
    }

    #[test]
    fn bad_pem_is_an_error() {
        assert!(parse_certs("nothing", "x").is_err());
        assert!(parse_key("nothing", "x").is_err());
    }
}
