//! # tether-certs — certificates for Tether
//!
//! - [`mint`]: a CA and the certificates signed by it (cloud server, edge
//!   client naming its node, apiserver-style client), made with rcgen.
//! - [`identity`]: reading the node name out of an edge certificate.
//! - [`pem`]: loading PEM files into rustls types, with errors naming the file.

pub mod identity;
pub mod mint;
pub mod pem;

pub use identity::node_name_from_cert;
pub use mint::{Ca, CertKey};

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
}
