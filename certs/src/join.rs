//! The join exchange: how a new edge obtains its certificate with a token.
//!
//! On the wire (ALPN [`ALPN_JOIN`], on the cloud's QUIC listener): the edge
//! opens one bidirectional stream and sends a [`JoinRequest`]; the cloud
//! answers with a [`JoinResponse`] and both sides close. Each message is a
//! 4-byte big-endian length followed by the postcard encoding — the same
//! framing idea as the tunnel's frames, with its own small limit because a
//! join carries only a CSR. The reader bounds what it takes
//! ([`decode_len`]): the cloud a request by its `--join-max-message-bytes`,
//! the edge an answer by its own, both [`DEFAULT_MAX_JOIN_MESSAGE`] unless
//! told. Neither may be below what one real message needs:
//! [`least_request_bytes`] and [`least_answer_bytes`] compute it
//! ([`LEAST_REQUEST_BYTES`], [`LEAST_ANSWER_BYTES`]).
//!
//! Everything here is sans-IO, so the whole decision is tested without
//! sockets:
//! - the cloud calls [`decide`] (token checked and used once, CSR checked
//!   and signed, issue recorded — all or nothing) and sends
//!   [`response_for`] of the outcome;
//! - the edge builds its TLS configuration with [`join_client_config`]
//!   (the CA pinned by hash: see [`crate::pin`]) and checks the answer with
//!   [`accept_grant`] before writing anything.
//!
//! Replay: a token's use is spent when a certificate is issued, so a replayed
//! exchange with a single-use token is refused as exhausted; and the exchange
//! runs inside TLS 1.3 to a pinned server, so an observer sees no token.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls::pki_types::CertificateDer;
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::prelude::FromDer;

use crate::mint::Ca;
use crate::pin::{CaPin, PinnedCaVerifier};
use crate::token::{Grant, IssuedCert, JoinStore};

/// ALPN of the join connection.
pub const ALPN_JOIN: &[u8] = b"tether-join/1";
/// Largest join message a side reads unless told: the default of the
/// cloud's `--join-max-message-bytes` (requests) and of `tether-edge join
/// --join-max-message-bytes` (answers).
pub const DEFAULT_MAX_JOIN_MESSAGE: usize = 64 * 1024;
/// How long the cloud waits for a joining edge's request: the default of
/// its `--join-request-timeout`.
pub const JOIN_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Edge → cloud: "I am `node`, here is my token and my CSR."
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinRequest {
    /// `<id>.<secret>`.
    pub token: String,
    pub node: String,
    /// PKCS#10, PEM. The key stays on the edge.
    pub csr_pem: String,
}

/// Cloud → edge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum JoinResponse {
    /// The node's certificate and the CA that signed it.
    Granted { cert_pem: String, ca_pem: String },
    /// Why not; meant for the operator.
    Refused { reason: String },
}

/// Why a join failed, on either side. Every message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("malformed join token: {0}")]
    MalformedToken(String),
    #[error(
        "join token {0} is not known to this cloud (mistyped, or made for another cloud's store)"
    )]
    UnknownToken(String),
    #[error("join token {0}: the secret does not match")]
    WrongSecret(String),
    #[error("join token {id} expired at {at}; create a new one with `tether-certs token create`")]
    Expired { id: String, at: String },
    #[error("join token {0} was revoked; create a new one with `tether-certs token create`")]
    Revoked(String),
    #[error("join token {0} is exhausted: all its uses are spent (a replayed join is refused the same way)")]
    Exhausted(String),
    #[error("join token {id} does not allow node {node:?} (its node pattern is {pattern:?})")]
    NodeNotAllowed {
        id: String,
        node: String,
        pattern: String,
    },
    #[error("node {node:?} already has a certificate (serial {serial}); join token {id} may not replace it (create one with `tether-certs token create --allow-reissue` to re-bootstrap that node)")]
    NodeTaken {
        id: String,
        node: String,
        serial: String,
    },
    #[error("{0:?} is not a valid node name (a lowercase DNS-1123 subdomain)")]
    InvalidNodeName(String),
    #[error("the CSR for node {node:?} names another node: {asked}")]
    OtherNode { node: String, asked: String },
    #[error("the CSR for node {node:?} asks for a name beyond the node's own: {san}")]
    ExtraSans { node: String, san: String },
    #[error("the CSR's key is refused: {0}")]
    WeakKey(String),
    #[error("bad CSR: {0}")]
    Csr(String),
    #[error("making or signing a certificate: {0}")]
    Sign(rcgen::Error),
    #[error("join-token store {0}")]
    Store(String),
    #[error("{0}")]
    Invalid(String),
    #[error("join protocol: {0}")]
    Protocol(String),
    #[error("a join message of {len} bytes is over the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("the cloud refused the join: {0}")]
    Refused(String),
    #[error("the cloud's answer is not usable: {0}")]
    BadGrant(String),
}

impl JoinError {
    /// Whether this is the cloud's own trouble rather than the request's:
    /// the edge gets a generic message, the cloud's log the detail.
    pub fn is_internal(&self) -> bool {
        matches!(
            self,
            JoinError::Sign(_) | JoinError::Store(_) | JoinError::Invalid(_)
        )
    }
}

/// Encodes a message: 4-byte big-endian length, then postcard. The reader
/// bounds what it takes ([`decode_len`]); the writer only needs the length
/// to fit the prefix.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, JoinError> {
    let body = postcard::to_stdvec(msg).map_err(|e| JoinError::Protocol(e.to_string()))?;
    let len = u32::try_from(body.len()).map_err(|_| {
        JoinError::Protocol(format!(
            "message of {} bytes does not fit a 4-byte length",
            body.len()
        ))
    })?;
    let mut out = len.to_be_bytes().to_vec();
    out.extend_from_slice(&body);
    Ok(out)
}

/// The body length announced by a 4-byte prefix, refused over `max` (the
/// reader's `--join-max-message-bytes`) before anything is read or kept.
pub fn decode_len(prefix: [u8; 4], max: usize) -> Result<usize, JoinError> {
    let len = u32::from_be_bytes(prefix) as usize;
    if len > max {
        return Err(JoinError::TooLarge { len, max });
    }
    Ok(len)
}

/// Decodes a message body (without its prefix).
pub fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, JoinError> {
    postcard::from_bytes(body).map_err(|e| JoinError::Protocol(format!("undecodable message: {e}")))
}

/// [`least_request_bytes`]: the least `--join-max-message-bytes` a cloud
/// takes (a test recomputes it, so it cannot drift from the messages).
pub const LEAST_REQUEST_BYTES: usize = 1432;

/// [`least_answer_bytes`]: the least `--join-max-message-bytes` `tether-edge
/// join` takes (a test recomputes it; a constant, so the edge binary does
/// not carry the CA code that measures it).
pub const LEAST_ANSWER_BYTES: usize = 1950;

/// Longest ECDSA P-256 signature in DER: a SEQUENCE of two INTEGERs of 32
/// bytes, each with a leading zero byte when its top bit is set. The keys a
/// `tether-edge` makes are P-256, and so is the key of a CA made by
/// `tether-certs ca create` unless told otherwise; a signature is the only
/// part of such a CSR or certificate whose length changes from one signing
/// to the next (serials are of fixed length, see `mint::random_serial`).
const P256_SIGNATURE_MAX: usize = 2 + 2 * (2 + 33);

/// The common name `tether-certs ca create` gives a CA unless told.
const DEFAULT_CA_CN: &str = "Tether CA";

/// Validity of the certificates [`least_answer_bytes`] measures: past 2049,
/// so both notAfter times take the longer GeneralizedTime form.
const LONGEST_TIME_FORM: Duration = Duration::from_secs(100 * 365 * 86_400);

/// Length of the PEM text rcgen writes for `der_len` bytes of DER under
/// `label`: base64 in lines of 64 characters, each line ended by a newline.
fn pem_len(label: &str, der_len: usize) -> usize {
    let b64 = der_len.div_ceil(3) * 4;
    format!("-----BEGIN {label}-----\n").len()
        + b64
        + b64.div_ceil(64)
        + format!("-----END {label}-----\n").len()
}

/// The length `pem` (`der_len` bytes of DER, signed with a signature of
/// `sig_len` bytes) would have with the longest P-256 signature.
fn with_longest_signature(pem: &str, label: &str, der_len: usize, sig_len: usize) -> usize {
    let longest = der_len + P256_SIGNATURE_MAX.saturating_sub(sig_len);
    pem.len() + pem_len(label, longest) - pem_len(label, der_len)
}

/// The longest node name: 253 characters, in labels of at most 63.
pub fn longest_node_name() -> String {
    let label = "a".repeat(63);
    let last = "a".repeat(crate::identity::MAX_NODE_NAME_LEN - 3 * 64);
    format!("{label}.{label}.{label}.{last}")
}

/// Encoded length of a message, without its 4-byte prefix.
fn body_len<T: Serialize>(msg: &T) -> Result<usize, JoinError> {
    Ok(encode(msg)?.len() - 4)
}

/// The largest request `tether-edge join` sends (its body, as
/// [`decode_len`] counts it): a token of 6 + 1 + 16 characters, a node
/// name of 253 and the CSR the edge makes for it (P-256) with the longest
/// signature. The least `--join-max-message-bytes` a cloud takes: below it
/// some edge's request would be refused.
pub fn least_request_bytes() -> Result<usize, JoinError> {
    let node = longest_node_name();
    let req = crate::csr::make_edge_csr(&node)?;
    let (_, pem) = x509_parser::pem::parse_x509_pem(req.csr_pem.as_bytes())
        .map_err(|e| JoinError::Invalid(format!("the edge's own CSR is not PEM: {e}")))?;
    let (_, csr) = X509CertificationRequest::from_der(&pem.contents)
        .map_err(|e| JoinError::Invalid(format!("the edge's own CSR does not parse: {e}")))?;
    let csr_len = with_longest_signature(
        &req.csr_pem,
        "CERTIFICATE REQUEST",
        pem.contents.len(),
        csr.signature_value.data.len(),
    );
    let token_len = crate::token::TOKEN_ID_LEN + 1 + crate::token::TOKEN_SECRET_LEN;
    body_len(&JoinRequest {
        token: "x".repeat(token_len),
        node,
        csr_pem: "x".repeat(csr_len),
    })
}

/// The largest grant a cloud sends (its body) for a node name of 253
/// characters when its CA was made by `tether-certs ca create` with its
/// defaults (ECDSA P-256, CN `Tether CA`): the node's certificate and the
/// CA's, each with the longest signature and the longer time form. The
/// least `--join-max-message-bytes` `tether-edge join` takes: below it no
/// such grant could be read. (A CA with a longer name makes a longer grant:
/// the edge then refuses it, naming the flag.)
pub fn least_answer_bytes() -> Result<usize, JoinError> {
    let ca = Ca::new(DEFAULT_CA_CN, LONGEST_TIME_FORM)
        .map_err(|e| JoinError::Invalid(format!("making a CA to measure a grant: {e}")))?;
    let node = longest_node_name();
    let req = crate::csr::make_edge_csr(&node)?;
    let cert = crate::csr::sign_edge_csr(&ca, &req.csr_pem, &node, LONGEST_TIME_FORM)?;
    let longest = |pem: &str| -> Result<usize, JoinError> {
        let der = crate::pem::certs_from_pem(pem, "a certificate measured")
            .map_err(|e| JoinError::Invalid(e.to_string()))?
            .into_iter()
            .next()
            .ok_or_else(|| JoinError::Invalid("a certificate measured is empty".into()))?;
        let (_, x) = x509_parser::parse_x509_certificate(der.as_ref())
            .map_err(|e| JoinError::Invalid(format!("a certificate measured: {e}")))?;
        Ok(with_longest_signature(
            pem,
            "CERTIFICATE",
            der.as_ref().len(),
            x.signature_value.data.len(),
        ))
    };
    body_len(&JoinResponse::Granted {
        cert_pem: "x".repeat(longest(&cert.cert_pem)?),
        ca_pem: "x".repeat(longest(&ca.cert_pem)?),
    })
}

/// The cloud's decision on one request: check and use the token, check and
/// sign the CSR, record the issue — or nothing at all.
pub fn decide(
    store: &JoinStore,
    ca: &Ca,
    req: &JoinRequest,
    valid_for: Duration,
    now: SystemTime,
) -> Result<(Grant, IssuedCert), JoinError> {
    store.redeem_and_issue(&req.token, &req.node, now, |grant| {
        crate::csr::sign_edge_csr(ca, &req.csr_pem, &grant.node, valid_for)
    })
}

/// What to send the edge for an outcome of [`decide`].
pub fn response_for(outcome: &Result<(Grant, IssuedCert), JoinError>, ca: &Ca) -> JoinResponse {
    match outcome {
        Ok((_, cert)) => JoinResponse::Granted {
            cert_pem: cert.cert_pem.clone(),
            ca_pem: ca.cert_pem.clone(),
        },
        Err(e) if e.is_internal() => JoinResponse::Refused {
            reason: "the cloud could not issue the certificate (internal error: see the cloud's log); try again later".into(),
        },
        // Whether an id exists is not told to whoever lacks its secret.
        Err(JoinError::UnknownToken(id) | JoinError::WrongSecret(id)) => JoinResponse::Refused {
            reason: bounded_reason(format!(
                "join token {id} is not valid on this cloud (unknown, or a wrong secret)"
            )),
        },
        Err(e) => JoinResponse::Refused {
            reason: bounded_reason(e.to_string()),
        },
    }
}

/// The longest refusal reason a cloud sends, bytes. A reason may echo what
/// the edge sent (a token id, a node name) up to the cloud's
/// `--join-max-message-bytes`; the answer must still fit the least bound an
/// edge reads answers with ([`LEAST_ANSWER_BYTES`]), or the edge would be
/// told its answer is too large instead of why it was refused.
pub const MAX_REFUSAL_REASON: usize = 1024;

/// `reason` cut to at most [`MAX_REFUSAL_REASON`] bytes, on a character
/// boundary, saying that it was cut.
fn bounded_reason(reason: String) -> String {
    const CUT: &str = " … (cut short; the cloud's log has it whole)";
    if reason.len() <= MAX_REFUSAL_REASON {
        return reason;
    }
    let mut end = MAX_REFUSAL_REASON - CUT.len();
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{CUT}", &reason[..end])
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The edge's TLS configuration for joining: TLS 1.3, ALPN [`ALPN_JOIN`],
/// no client certificate, the server trusted only through `pin`. The
/// returned verifier tells, after the handshake, which CA matched.
pub fn join_client_config(
    pin: CaPin,
) -> Result<(rustls::ClientConfig, Arc<PinnedCaVerifier>), JoinError> {
    let verifier = Arc::new(PinnedCaVerifier::new(pin, provider()));
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| JoinError::Invalid(format!("TLS 1.3 with ring: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(verifier.clone())
        .with_no_client_auth();
    tls.alpn_protocols = vec![ALPN_JOIN.to_vec()];
    Ok((tls, verifier))
}

/// A certificate the edge has checked and may write.
#[derive(Debug, Clone)]
pub struct AcceptedGrant {
    pub cert_pem: String,
    pub ca_pem: String,
}

/// The edge's checks on the cloud's answer: a refusal becomes an error; a
/// grant must carry the pinned CA (the very one the TLS handshake verified,
/// when given), and a client certificate for `node`, for the edge's own key,
/// that this CA signed.
pub fn accept_grant(
    node: &str,
    key_pem: &str,
    pin: &CaPin,
    verified_ca: Option<&CertificateDer<'_>>,
    response: JoinResponse,
) -> Result<AcceptedGrant, JoinError> {
    let (cert_pem, ca_pem) = match response {
        JoinResponse::Refused { reason } => return Err(JoinError::Refused(reason)),
        JoinResponse::Granted { cert_pem, ca_pem } => (cert_pem, ca_pem),
    };
    let bad = |what: String| JoinError::BadGrant(what);
    let ca_chain =
        crate::pem::certs_from_pem(&ca_pem, "CA from the cloud").map_err(|e| bad(e.to_string()))?;
    let ca = &ca_chain[0];
    if !pin.matches(ca.as_ref()) {
        return Err(bad(format!("its CA does not match {pin}")));
    }
    if let Some(v) = verified_ca {
        if v.as_ref() != ca.as_ref() {
            return Err(bad(
                "its CA is not the one the TLS handshake verified".into()
            ));
        }
    }
    let cert = crate::pem::certs_from_pem(&cert_pem, "certificate from the cloud")
        .map_err(|e| bad(e.to_string()))?
        .remove(0);
    let named = crate::node_name_from_cert(&cert).map_err(|e| bad(e.to_string()))?;
    if named != node {
        return Err(bad(format!(
            "the certificate names node {named:?}, not {node:?}"
        )));
    }
    let key = rcgen::KeyPair::from_pem(key_pem).map_err(JoinError::Sign)?;
    let (_, x) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| bad(format!("certificate does not parse: {e}")))?;
    if x.tbs_certificate
        .subject_pki
        .subject_public_key
        .data
        .as_ref()
        != key.public_key_raw()
    {
        return Err(bad("the certificate is not for this edge's key".into()));
    }
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(ca.clone())
        .map_err(|e| bad(format!("CA not usable: {e}")))?;
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .map_err(|e| bad(e.to_string()))?;
    verifier
        .verify_client_cert(&cert, &[], rustls::pki_types::UnixTime::now())
        .map_err(|e| {
            bad(format!(
                "the certificate does not verify as a client of the CA: {e}"
            ))
        })?;
    Ok(AcceptedGrant { cert_pem, ca_pem })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csr::make_edge_csr;
    use crate::token::JoinToken;

    const HOUR: Duration = Duration::from_secs(3600);

    #[test]
    fn a_refusal_echoing_long_input_fits_the_least_answer_bound() {
        let ca = Ca::new("Tether CA", HOUR).unwrap();
        for e in [
            JoinError::InvalidNodeName("é".repeat(DEFAULT_MAX_JOIN_MESSAGE / 2)),
            JoinError::UnknownToken("x".repeat(DEFAULT_MAX_JOIN_MESSAGE)),
        ] {
            let JoinResponse::Refused { reason } = response_for(&Err(e), &ca) else {
                panic!("a refusal expected");
            };
            assert!(reason.len() <= MAX_REFUSAL_REASON, "{}", reason.len());
            assert!(
                reason.ends_with("the cloud's log has it whole)"),
                "{reason}"
            );
            let body = encode(&JoinResponse::Refused { reason }).unwrap().len() - 4;
            assert!(body <= LEAST_ANSWER_BYTES, "{body}");
        }
        // A short reason is sent whole.
        let short = JoinError::InvalidNodeName("Edge_1".into());
        let want = short.to_string();
        let JoinResponse::Refused { reason } = response_for(&Err(short), &ca) else {
            panic!("a refusal expected");
        };
        assert_eq!(reason, want);
    }

    struct Cloud {
        _dir: tempfile::TempDir,
        store: JoinStore,
        ca: Ca,
    }

    fn cloud() -> Cloud {
        let dir = tempfile::tempdir().unwrap();
        let store = JoinStore::open(dir.path().join("t.json")).unwrap();
        Cloud {
            _dir: dir,
            store,
            ca: Ca::new("join ca", HOUR * 24).unwrap(),
        }
    }

    fn roundtrip<T: Serialize + DeserializeOwned>(m: &T) -> T {
        let bytes = encode(m).unwrap();
        let len = decode_len(bytes[..4].try_into().unwrap(), DEFAULT_MAX_JOIN_MESSAGE).unwrap();
        assert_eq!(len, bytes.len() - 4);
        decode(&bytes[4..]).unwrap()
    }

    #[test]
    fn messages_round_trip_and_sizes_are_bounded() {
        let r = JoinRequest {
            token: "abcdef.0123456789abcdef".into(),
            node: "edge-1".into(),
            csr_pem: "x".into(),
        };
        assert_eq!(roundtrip(&r), r);
        let g = JoinResponse::Refused {
            reason: "no".into(),
        };
        assert_eq!(roundtrip(&g), g);
        assert!(decode::<JoinRequest>(&[0xff, 0xff]).is_err());
    }

    /// `decode_len` refuses a length over the bound it is given (the
    /// reader's `--join-max-message-bytes`; was the fixed 64 KiB), naming
    /// both, and takes one at the bound.
    #[test]
    fn the_reader_bounds_a_message_by_the_limit_it_is_given() {
        let r = JoinRequest {
            token: "abcdef.0123456789abcdef".into(),
            node: "edge-1".into(),
            csr_pem: "x".repeat(1000),
        };
        let bytes = encode(&r).unwrap();
        let prefix: [u8; 4] = bytes[..4].try_into().unwrap();
        let len = bytes.len() - 4;
        assert_eq!(decode_len(prefix, len).unwrap(), len);
        let e = decode_len(prefix, len - 1).unwrap_err();
        assert!(matches!(e, JoinError::TooLarge { .. }), "{e}");
        assert!(
            e.to_string()
                .contains(&format!("{len} bytes is over the {}-byte limit", len - 1)),
            "{e}"
        );
        // Over the default, under a raised bound.
        let big = (DEFAULT_MAX_JOIN_MESSAGE as u32 + 1).to_be_bytes();
        assert!(decode_len(big, DEFAULT_MAX_JOIN_MESSAGE).is_err());
        assert_eq!(
            decode_len(big, 2 * DEFAULT_MAX_JOIN_MESSAGE).unwrap(),
            DEFAULT_MAX_JOIN_MESSAGE + 1
        );
    }

    /// The least bounds are what the largest real messages take: a request
    /// of `tether-edge join` for a 253-character node name, and a grant for
    /// it from a CA of `tether-certs ca create`. Each real one fits (the
    /// signature's length varies, so several are made) and the longest
    /// signature's would take exactly the least: the PEM arithmetic is
    /// checked against rcgen's own PEM.
    #[test]
    fn the_least_bounds_fit_the_largest_real_messages() {
        let least_req = least_request_bytes().unwrap();
        let least_ans = least_answer_bytes().unwrap();
        assert_eq!(least_req, LEAST_REQUEST_BYTES);
        assert_eq!(least_ans, LEAST_ANSWER_BYTES);
        let node = longest_node_name();
        assert!(crate::identity::valid_node_name(&node));
        assert!(!crate::identity::valid_node_name(&format!("a{node}")));
        let ca = Ca::new(DEFAULT_CA_CN, LONGEST_TIME_FORM).unwrap();
        for _ in 0..8 {
            let edge = make_edge_csr(&node).unwrap();
            let (_, pem) = x509_parser::pem::parse_x509_pem(edge.csr_pem.as_bytes()).unwrap();
            assert_eq!(
                pem_len("CERTIFICATE REQUEST", pem.contents.len()),
                edge.csr_pem.len()
            );
            let req = JoinRequest {
                token: JoinToken::generate().reveal(),
                node: node.clone(),
                csr_pem: edge.csr_pem.clone(),
            };
            let bytes = encode(&req).unwrap();
            let len = decode_len(bytes[..4].try_into().unwrap(), least_req).unwrap();
            assert!(
                len <= least_req && len + 16 >= least_req,
                "{len} {least_req}"
            );
            let cert =
                crate::csr::sign_edge_csr(&ca, &edge.csr_pem, &node, LONGEST_TIME_FORM).unwrap();
            let der = crate::pem::certs_from_pem(&cert.cert_pem, "t").unwrap();
            assert_eq!(pem_len("CERTIFICATE", der[0].len()), cert.cert_pem.len());
            let answer = encode(&JoinResponse::Granted {
                cert_pem: cert.cert_pem,
                ca_pem: ca.cert_pem.clone(),
            })
            .unwrap();
            let len = decode_len(answer[..4].try_into().unwrap(), least_ans).unwrap();
            assert!(
                len <= least_ans && len + 32 >= least_ans,
                "{len} {least_ans}"
            );
        }
    }

    #[test]
    fn a_join_is_granted_once_and_the_grant_checks_out_on_the_edge() {
        let c = cloud();
        let now = SystemTime::now();
        let (token, _) = c.store.create(HOUR, "edge-*", 1, "", now).unwrap();
        let edge = make_edge_csr("edge-7").unwrap();
        let req = JoinRequest {
            token: token.reveal(),
            node: "edge-7".into(),
            csr_pem: edge.csr_pem.clone(),
        };
        let outcome = decide(&c.store, &c.ca, &req, HOUR, now);
        let resp = response_for(&outcome, &c.ca);
        let pin = CaPin::parse(&crate::pin::ca_pin(&c.ca.cert_pem).unwrap()).unwrap();
        let accepted = accept_grant("edge-7", &edge.key_pem, &pin, None, resp.clone()).unwrap();
        assert_eq!(accepted.ca_pem, c.ca.cert_pem);
        assert_eq!(c.store.issued().unwrap()[0].node, "edge-7");

        // The same exchange replayed: refused, nothing issued.
        let again = decide(&c.store, &c.ca, &req, HOUR, now);
        match response_for(&again, &c.ca) {
            JoinResponse::Refused { reason } => assert!(reason.contains("exhausted"), "{reason}"),
            other => panic!("replay granted: {other:?}"),
        }
        assert_eq!(c.store.issued().unwrap().len(), 1);

        // The edge refuses a grant for another key, another node or another CA.
        let other_key = make_edge_csr("edge-7").unwrap().key_pem;
        assert!(accept_grant("edge-7", &other_key, &pin, None, resp.clone()).is_err());
        assert!(accept_grant("edge-8", &edge.key_pem, &pin, None, resp.clone()).is_err());
        let other_ca = Ca::new("other", HOUR).unwrap();
        let other_pin = CaPin::parse(&crate::pin::ca_pin(&other_ca.cert_pem).unwrap()).unwrap();
        assert!(accept_grant("edge-7", &edge.key_pem, &other_pin, None, resp).is_err());
    }

    #[test]
    fn a_bad_csr_is_refused_without_spending_the_token() {
        let c = cloud();
        let now = SystemTime::now();
        let (token, _) = c.store.create(HOUR, "edge-*", 1, "", now).unwrap();
        let req = JoinRequest {
            token: token.reveal(),
            node: "edge-1".into(),
            csr_pem: make_edge_csr("edge-2").unwrap().csr_pem,
        };
        let outcome = decide(&c.store, &c.ca, &req, HOUR, now);
        assert!(matches!(outcome, Err(JoinError::OtherNode { .. })));
        match response_for(&outcome, &c.ca) {
            JoinResponse::Refused { reason } => assert!(reason.contains("edge-2"), "{reason}"),
            other => panic!("granted: {other:?}"),
        }
        assert_eq!(c.store.list().unwrap()[0].uses_left, 1);
        assert!(c.store.issued().unwrap().is_empty());
    }

    #[test]
    fn an_unknown_id_and_a_wrong_secret_get_the_same_answer() {
        let ca = Ca::new("t", Duration::from_secs(3600)).unwrap();
        let answer = |e: JoinError| match response_for(&Err(e), &ca) {
            JoinResponse::Refused { reason } => reason,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            answer(JoinError::UnknownToken("abcdef".into())),
            answer(JoinError::WrongSecret("abcdef".into()))
        );
    }

    #[test]
    fn refusals_reach_the_edge_as_errors() {
        let e = accept_grant(
            "edge-1",
            "",
            &CaPin::parse(&format!("sha256:{}", "00".repeat(32))).unwrap(),
            None,
            JoinResponse::Refused {
                reason: "join token abc is exhausted".into(),
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("exhausted"));
    }
}
