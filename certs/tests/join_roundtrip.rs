//! The join exchange over a real QUIC connection on 127.0.0.1, in process:
//! the cloud's `serve_join` (cloud/src/join.rs) and the edge's `join`
//! (edge/src/join.rs), compiled into this test from their source files so
//! the exact code the binaries run is exercised — they depend only on
//! tether-certs, quinn, rustls, tokio, tracing and anyhow.
//!
//! The cloud side here mirrors how tether-cloud's listener should dispatch:
//! one endpoint, ALPNs `tether/1` and `tether-join/1`, client certificates
//! verified when presented and required for `tether/1` only.

#[path = "../../cloud/src/join.rs"]
mod cloud_join;
#[path = "../../edge/src/join.rs"]
mod edge_join;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls::pki_types::CertificateDer;
use tether_certs::{ca_pin, Ca, JoinStore, ALPN_JOIN};

const ALPN_TUNNEL: &[u8] = b"tether/1";
const DAY: Duration = Duration::from_secs(86400);

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

struct Cloud {
    addr: SocketAddr,
    store: Arc<JoinStore>,
    ca: Arc<Ca>,
    /// Join connections whose TLS handshake completed.
    joins: Arc<AtomicUsize>,
    /// Node names of tunnel connections, from their client certificates.
    tunnel_nodes: Arc<std::sync::Mutex<Vec<String>>>,
    _dir: tempfile::TempDir,
}

async fn start_cloud() -> Cloud {
    let dir = tempfile::tempdir().unwrap();
    let ca = Arc::new(Ca::new("join test CA", DAY).unwrap());
    let server = ca
        .issue_server(&["cloud.test"], &["127.0.0.1".parse().unwrap()], DAY)
        .unwrap();
    // Leaf, then the CA: what `tether-certs issue cloud-tunnel` writes.
    let mut chain = tether_certs::pem::certs_from_pem(&server.cert_pem, "leaf").unwrap();
    chain.extend(tether_certs::pem::certs_from_pem(&ca.cert_pem, "ca").unwrap());
    let key = tether_certs::pem::key_from_pem(&server.key_pem, "key").unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(
            tether_certs::pem::certs_from_pem(&ca.cert_pem, "ca")
                .unwrap()
                .remove(0),
        )
        .unwrap();
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .allow_unauthenticated()
            .build()
            .unwrap();
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .unwrap();
    tls.alpn_protocols = vec![ALPN_TUNNEL.to_vec(), ALPN_JOIN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls).unwrap();
    let endpoint = quinn::Endpoint::server(
        quinn::ServerConfig::with_crypto(Arc::new(crypto)),
        "127.0.0.1:0".parse().unwrap(),
    )
    .unwrap();
    let addr = endpoint.local_addr().unwrap();
    let store = Arc::new(JoinStore::open(dir.path().join("join-tokens.json")).unwrap());
    let joins = Arc::new(AtomicUsize::new(0));
    let tunnel_nodes = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (s, c, j, t) = (
        store.clone(),
        ca.clone(),
        joins.clone(),
        tunnel_nodes.clone(),
    );
    tokio::spawn(async move {
        while let Some(incoming) = endpoint.accept().await {
            let (s, c, j, t) = (s.clone(), c.clone(), j.clone(), t.clone());
            tokio::spawn(async move {
                let Ok(conn) = incoming.await else { return };
                let alpn = conn
                    .handshake_data()
                    .and_then(|h| h.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
                    .and_then(|h| h.protocol);
                match alpn.as_deref() {
                    Some(p) if p == ALPN_JOIN => {
                        j.fetch_add(1, Ordering::SeqCst);
                        if let Err(e) = cloud_join::serve_join(
                            conn,
                            s,
                            c,
                            DAY,
                            Default::default(),
                            tether_certs::join::DEFAULT_MAX_JOIN_MESSAGE,
                        )
                        .await
                        {
                            eprintln!("serve_join: {e:#}");
                        }
                    }
                    Some(p) if p == ALPN_TUNNEL => {
                        // The tunnel needs a client certificate.
                        let node = conn
                            .peer_identity()
                            .and_then(|i| i.downcast::<Vec<CertificateDer<'static>>>().ok())
                            .and_then(|chain| tether_certs::node_name_from_cert(&chain[0]).ok());
                        match node {
                            Some(n) => t.lock().unwrap().push(n),
                            None => conn.close(1u32.into(), b"client certificate required"),
                        }
                    }
                    _ => conn.close(1u32.into(), b"unknown ALPN"),
                }
            });
        }
    });
    Cloud {
        addr,
        store,
        ca,
        joins,
        tunnel_nodes,
        _dir: dir,
    }
}

fn token(cloud: &Cloud, pattern: &str, uses: u32, ttl: Duration) -> String {
    cloud
        .store
        .create(ttl, pattern, uses, "test", SystemTime::now())
        .unwrap()
        .0
        .reveal()
}

fn is_empty_dir(p: &Path) -> bool {
    !p.exists() || std::fs::read_dir(p).unwrap().next().is_none()
}

/// Dials the tunnel ALPN with the joined certificate, as the edge would next.
async fn dial_tunnel(addr: SocketAddr, files: &edge_join::JoinedFiles) -> anyhow::Result<()> {
    let chain = tether_certs::pem::load_certs(&files.cert)?;
    let key = tether_certs::pem::load_key(&files.key)?;
    let roots = tether_certs::pem::load_roots(&files.ca)?;
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)?;
    tls.alpn_protocols = vec![ALPN_TUNNEL.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls)?;
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
    ep.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    let conn = ep.connect(addr, "cloud.test")?.await?;
    // Give the server a moment to record the node.
    tokio::time::sleep(Duration::from_millis(100)).await;
    conn.close(0u32.into(), b"");
    Ok(())
}

#[tokio::test]
async fn an_edge_joins_then_connects_with_its_new_certificate() {
    let cloud = start_cloud().await;
    let pin = ca_pin(&cloud.ca.cert_pem).unwrap();
    let t = token(&cloud, "edge-*", 1, Duration::from_secs(3600));
    let out = tempfile::tempdir().unwrap();
    let files = edge_join::join(&cloud.addr.to_string(), &t, &pin, "edge-1", out.path())
        .await
        .unwrap();
    assert_eq!(files.key, out.path().join("node.key"));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&files.key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
    assert_eq!(
        std::fs::read_to_string(&files.ca).unwrap(),
        cloud.ca.cert_pem
    );
    let cert = tether_certs::pem::load_certs(&files.cert).unwrap();
    assert_eq!(
        tether_certs::node_name_from_cert(&cert[0]).unwrap(),
        "edge-1"
    );
    let issued = cloud.store.issued().unwrap();
    assert_eq!(issued.len(), 1);
    assert_eq!(issued[0].node, "edge-1");

    // The new certificate opens the tunnel ALPN, and names the node there.
    dial_tunnel(cloud.addr, &files).await.unwrap();
    assert_eq!(
        *cloud.tunnel_nodes.lock().unwrap(),
        vec!["edge-1".to_string()]
    );

    // The same exchange replayed with the single-use token: refused.
    let again = tempfile::tempdir().unwrap();
    let e = edge_join::join(&cloud.addr.to_string(), &t, &pin, "edge-1", again.path())
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains("exhausted"), "{e:#}");
    assert!(is_empty_dir(again.path()));
    assert_eq!(cloud.store.issued().unwrap().len(), 1);
}

#[tokio::test]
async fn a_wrong_pin_stops_the_edge_before_it_sends_the_token() {
    let cloud = start_cloud().await;
    let other = Ca::new("another CA", DAY).unwrap();
    let wrong_pin = ca_pin(&other.cert_pem).unwrap();
    let t = token(&cloud, "*", 1, Duration::from_secs(3600));
    let out = tempfile::tempdir().unwrap();
    let e = edge_join::join(
        &cloud.addr.to_string(),
        &t,
        &wrong_pin,
        "edge-1",
        out.path(),
    )
    .await
    .unwrap_err();
    let msg = format!("{e:#}");
    assert!(
        msg.contains("pinned") && msg.contains("nothing was sent"),
        "{msg}"
    );
    // The handshake never completed, so no join reached serve_join, and
    // the token is untouched.
    assert_eq!(cloud.joins.load(Ordering::SeqCst), 0);
    assert_eq!(cloud.store.list().unwrap()[0].uses_left, 1);
    assert!(is_empty_dir(out.path()));
    // The right pin, but a name the cloud's certificate lacks: refused too.
    let pin = ca_pin(&cloud.ca.cert_pem).unwrap();
    let e = edge_join::join_with_server_name(
        &cloud.addr.to_string(),
        Some("elsewhere.test"),
        &t,
        &pin,
        "edge-1",
        out.path(),
        edge_join::DEFAULT_JOIN_TIMEOUT,
        tether_certs::join::DEFAULT_MAX_JOIN_MESSAGE,
    )
    .await
    .unwrap_err();
    assert!(format!("{e:#}").contains("nothing was sent"));
    assert_eq!(cloud.joins.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn bad_tokens_are_refused_with_a_reason_and_issue_nothing() {
    let cloud = start_cloud().await;
    let pin = ca_pin(&cloud.ca.cert_pem).unwrap();
    let addr = cloud.addr.to_string();
    let out = tempfile::tempdir().unwrap();

    // Revoked.
    let t = token(&cloud, "*", 1, Duration::from_secs(3600));
    cloud.store.revoke(&t).unwrap();
    let e = edge_join::join(&addr, &t, &pin, "edge-1", out.path())
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains("revoked"), "{e:#}");

    // Expired (a one-second token, tried two seconds later).
    let t = token(&cloud, "*", 1, Duration::from_secs(1));
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let e = edge_join::join(&addr, &t, &pin, "edge-1", out.path())
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains("expired"), "{e:#}");

    // A node the token does not allow.
    let t = token(&cloud, "edge-*", 1, Duration::from_secs(3600));
    let e = edge_join::join(&addr, &t, &pin, "cloud-1", out.path())
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains("does not allow node"), "{e:#}");

    // Unknown token.
    let e = edge_join::join(&addr, "zzzzzz.0123456789abcdef", &pin, "edge-1", out.path())
        .await
        .unwrap_err();
    assert!(
        format!("{e:#}").contains("not valid on this cloud"),
        "{e:#}"
    );

    // Malformed token: refused locally, nothing dialled.
    let before = cloud.joins.load(Ordering::SeqCst);
    let e = edge_join::join(&addr, "not-a-token", &pin, "edge-1", out.path())
        .await
        .unwrap_err();
    assert!(format!("{e:#}").contains("malformed"), "{e:#}");
    assert_eq!(cloud.joins.load(Ordering::SeqCst), before);

    assert!(cloud.store.issued().unwrap().is_empty());
    assert!(is_empty_dir(out.path()));
}
