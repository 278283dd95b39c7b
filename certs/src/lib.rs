//! # tether-certs — certificates for Tether
//!
//! - [`mint`]: a CA and the certificates signed by it (cloud server, edge
//!   client naming its node, apiserver-style client, replica peer), made with rcgen.
//! - [`identity`]: reading the node name out of an edge certificate, and
//!   recognising a cloud replica's peer certificate.
//! - [`pem`]: loading PEM files into rustls types, with errors naming the file.
//! - [`files`]: atomic writes, keys 0600.
//! - [`pin`]: the CA pin (`sha256:` of its public key) and the TLS verifier
//!   a joining edge trusts the cloud with.
//! - [`token`]: join tokens and the hashed token store.
//! - [`csr`]: the edge's key and CSR, and the cloud's CSR signing policy.
//! - [`join`]: the join exchange — messages, the cloud's decision, the
//!   edge's checks — without I/O.
//! - [`inspect`]: a readable summary of a certificate.
//! - [`rotation`]: when an edge certificate is due for renewal.
//!
//! The `tether-certs` binary (`main.rs`, `cli.rs`) is a thin CLI over these.

pub mod csr;
pub mod files;
pub mod identity;
pub mod inspect;
pub mod join;
pub mod mint;
pub mod pem;
pub mod pin;
pub mod rotation;
pub mod token;

pub use csr::{csr_public_key, make_edge_csr, sign_edge_csr};
pub use identity::{certifies_key, node_name_from_cert};
pub use join::{JoinError, JoinRequest, JoinResponse, ALPN_JOIN};
pub use mint::{Ca, CertKey, KeyAlgorithm};
pub use pin::{ca_pin, CaPin, PinnedCaVerifier};
pub use token::{Grant, IssuedCert, JoinStore, JoinToken};

/// What can go wrong with certificates.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("generating or signing a certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("{path}: {source}")]
    File {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {what}")]
    Content { path: String, what: String },
    #[error("certificate does not parse: {0}")]
    Parse(String),
    #[error("certificate names no node: {0}")]
    NoNode(String),
    #[error("not a peer certificate: {0}")]
    NotPeer(String),
    #[error("a validity of {0:?} is longer than the {max} years a certificate may be given", max = mint::MAX_VALIDITY_YEARS)]
    ValidityTooLong(std::time::Duration),
}
