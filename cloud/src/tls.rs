//! rustls configurations of the cloud's two listeners. One crypto provider
//! (ring) for the whole process.

use std::sync::Arc;

use anyhow::Context;
use rustls::server::WebPkiClientVerifier;
use tether_certs::pem::{load_certs, load_key, load_roots, roots_from};
use tether_proto::handshake::ALPN_TUNNEL;
use tether_proto::quic::QuicSettings;

use crate::config::CloudConfig;
use crate::metrics::CloudMetrics;
use crate::session_tickets::SessionTickets;

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    tether_proto::tls::provider()
}

/// The QUIC listener's configuration: TLS 1.3, a client certificate signed by
/// the edge CA required, session tickets (see [`crate::session_tickets`];
/// `shared` is the key of `--reset-key-file`), migration allowed.
pub fn quic_server_config(
    cfg: &CloudConfig,
    settings: &QuicSettings,
    metrics: &CloudMetrics,
    shared: Option<&ring::hmac::Key>,
) -> anyhow::Result<quinn::ServerConfig> {
    let edge_cas = load_certs(&cfg.edge_ca).context("loading --edge-ca")?;
    let roots = roots_from(&edge_cas, &cfg.edge_ca).context("loading --edge-ca")?;
    let mut builder = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
    if cfg.join.is_some() {
        // Joining edges have no certificate yet; the tunnel ALPN still
        // requires one (checked per connection in `tunnel`).
        builder = builder.allow_unauthenticated();
    }
    let verifier = builder
        .build()
        .context("building the edge certificate verifier")?;
    let mut chain = load_certs(&cfg.tunnel_cert).context("loading --tunnel-cert")?;
    if let Some(join) = &cfg.join {
        // A joining edge pins the CA by hash and finds it in the chain the
        // cloud presents: make sure it is there.
        let ca = load_certs(&join.ca_cert).context("loading --join-ca-cert")?;
        for c in ca {
            if !chain.contains(&c) {
                chain.push(c);
            }
        }
    }
    let key = load_key(&cfg.tunnel_key).context("loading --tunnel-key")?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with ring")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .context("--tunnel-cert and --tunnel-key do not match")?;
    tls.alpn_protocols = vec![ALPN_TUNNEL.to_vec()];
    // No server-side session cache (rustls' holds 256 sessions, far fewer
    // than a fleet's edges, and a restart forgets them): stateless tickets,
    // one per handshake, that every replica opens.
    tls.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    tls.send_tls13_tickets = 0;
    if !cfg.tls_ticket_lifetime.is_zero() {
        let tickets = match shared {
            Some(key) => SessionTickets::shared(key, &edge_cas, cfg.tls_ticket_lifetime),
            None => SessionTickets::random(&edge_cas, cfg.tls_ticket_lifetime),
        }
        .context("setting up TLS session tickets")?;
        tls.ticketer = Arc::new(tickets);
        tls.send_tls13_tickets = cfg.tls_tickets_per_handshake;
    }
    if cfg.join.is_some() {
        tls.alpn_protocols.push(tether_certs::ALPN_JOIN.to_vec());
    }
    // Sessions that drop rustls once the handshake is over: an idle edge's
    // connection lives for days (see `slim_tls`).
    let crypto = crate::slim_tls::SlimServerConfig::new(tls)
        .context("QUIC TLS configuration")?
        .counting(metrics.edge_handshake_counter());
    let mut sc = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    let mut transport = settings.transport().map_err(anyhow::Error::msg)?;
    // Only the edge sends keep-alives: they hold its NAT binding and keep both
    // ends' idle timers alive; pings from the cloud would only double the
    // packets an idle edge wakes for (and pays for on a metered link).
    transport.keep_alive_interval(None);
    sc.transport_config(Arc::new(transport));
    sc.migration(true);
    Ok(sc)
}

/// The kubelet-API listener's configuration: HTTP/2 and HTTP/1.1 by ALPN, a
/// client certificate from the apiserver client CA required unless the
/// insecure opt-out is set.
pub fn front_server_config(cfg: &CloudConfig) -> anyhow::Result<rustls::ServerConfig> {
    let chain = load_certs(&cfg.kubelet_cert).context("loading --kubelet-cert")?;
    let key = load_key(&cfg.kubelet_key).context("loading --kubelet-key")?;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS versions with ring")?;
    let builder = match &cfg.apiserver_client_ca {
        Some(ca) => {
            let roots = load_roots(ca).context("loading --apiserver-client-ca")?;
            let mut verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
            if cfg
                .webhook
                .as_ref()
                .is_some_and(|w| w.tokens || w.anonymous)
            {
                // Bearer-token callers (metrics-server, Prometheus) have no
                // certificate; each of their requests is authenticated and
                // authorised by `authz`. A certificate, if sent, must verify.
                verifier = verifier.allow_unauthenticated();
            }
            let verifier = verifier
                .build()
                .context("building the apiserver certificate verifier")?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut tls = builder
        .with_single_cert(chain, key)
        .context("--kubelet-cert and --kubelet-key do not match")?;
    tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tls)
}
