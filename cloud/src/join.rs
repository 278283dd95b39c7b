//! The cloud's side of edge bootstrap: one join connection (ALPN
//! `tether-join/1`, no client certificate) from a new edge that holds a join
//! token.
//!
//! The edge opens one bidirectional stream and sends a `JoinRequest` (token,
//! node name, CSR); the cloud answers one `JoinResponse` and the connection
//! ends. The decision — token unexpired, not revoked, uses left, node name
//! allowed; CSR within policy; the use spent and the issue recorded in the
//! store in one write — is `tether_certs::join::decide`; this module only
//! moves the two messages and logs the outcome with the node's name.
//!
//! A join connection never reaches the tunnel: whatever it sends, it gets at
//! most one answer and is closed. A slow or silent edge is cut off after
//! `JOIN_REQUEST_TIMEOUT`; an oversized or undecodable request closes that
//! connection only.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use tether_certs::join::{self, JoinRequest, JoinResponse, JOIN_REQUEST_TIMEOUT};
use tether_certs::{Ca, JoinStore};
use tracing::{info, warn};

/// How long the cloud waits for the edge to read the answer before closing.
const ANSWER_LINGER: Duration = Duration::from_secs(5);
/// How long the answer may take to be accepted by the edge's QUIC (a client
/// that never grants stream credit must not hold its edge slot forever).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// QUIC close code of a finished join connection.
const JOIN_DONE: u32 = 0;

/// Handles one established join connection: read the request, decide,
/// answer, close. `validity` is the lifetime of the certificates issued.
pub async fn serve_join(
    conn: quinn::Connection,
    store: Arc<JoinStore>,
    ca: Arc<Ca>,
    validity: Duration,
) -> anyhow::Result<()> {
    serve_join_within(
        conn,
        store,
        ca,
        validity,
        JOIN_REQUEST_TIMEOUT,
        ANSWER_TIMEOUT,
    )
    .await
}

/// [`serve_join`] with its time limits given: every step of a join
/// connection is bounded, so it holds its edge slot for at most
/// `request_timeout` + the decision + `answer_timeout` + `ANSWER_LINGER`.
async fn serve_join_within(
    conn: quinn::Connection,
    store: Arc<JoinStore>,
    ca: Arc<Ca>,
    validity: Duration,
    request_timeout: Duration,
    answer_timeout: Duration,
) -> anyhow::Result<()> {
    let remote = conn.remote_address();
    let read = async {
        let (send, mut recv) = conn
            .accept_bi()
            .await
            .context("waiting for the join stream")?;
        let mut prefix = [0u8; 4];
        recv.read_exact(&mut prefix)
            .await
            .context("reading the join request's length")?;
        let len = join::decode_len(prefix)?;
        let mut body = vec![0u8; len];
        recv.read_exact(&mut body)
            .await
            .context("reading the join request")?;
        let req: JoinRequest = join::decode(&body)?;
        Ok::<_, anyhow::Error>((send, req))
    };
    let (mut send, req) = match tokio::time::timeout(request_timeout, read).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            conn.close(JOIN_DONE.into(), b"bad join request");
            return Err(e.context(format!("join from {remote}")));
        }
        Err(_) => {
            conn.close(JOIN_DONE.into(), b"no join request in time");
            anyhow::bail!("join from {remote}: no request within {request_timeout:?}");
        }
    };
    let claimed = req.node.clone();
    // The store does blocking file I/O under a lock: keep it off the runtime.
    let (outcome, answer) = tokio::task::spawn_blocking({
        let store = store.clone();
        let ca = ca.clone();
        move || {
            let outcome = join::decide(&store, &ca, &req, validity, SystemTime::now());
            let answer = join::response_for(&outcome, &ca);
            (outcome, answer)
        }
    })
    .await
    .context("the join decision task failed")?;
    match &outcome {
        Ok((grant, cert)) => info!(
            node = %grant.node,
            token = %grant.token_id,
            serial = %cert.serial,
            uses_left = grant.uses_left,
            %remote,
            "edge joined: certificate issued"
        ),
        Err(e) if e.is_internal() => warn!(
            node = ?claimed,
            %remote,
            error = %e,
            "join failed on the cloud's side"
        ),
        Err(e) => warn!(node = ?claimed, %remote, error = %e, "join refused"),
    }
    let bytes = join::encode(&answer)?;
    match tokio::time::timeout(answer_timeout, send.write_all(&bytes)).await {
        Ok(r) => {
            r.with_context(|| format!("sending the join answer to node {claimed} at {remote}"))?
        }
        Err(_) => {
            conn.close(JOIN_DONE.into(), b"join answer not accepted in time");
            anyhow::bail!(
                "join from node {claimed} at {remote}: the answer was not accepted within {answer_timeout:?}"
            );
        }
    }
    let _ = send.finish();
    // Let the answer arrive before the connection goes away.
    let _ = tokio::time::timeout(ANSWER_LINGER, send.stopped()).await;
    let reason: &[u8] = match answer {
        JoinResponse::Granted { .. } => b"joined",
        JoinResponse::Refused { .. } => b"join refused",
    };
    conn.close(JOIN_DONE.into(), reason);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;
    use std::time::Instant;

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        // Joins are one-off bootstrap handshakes (this file is also built
        // into tether-certs' tests, which do not link tether-proto).
        Arc::new(rustls::crypto::ring::default_provider())
    }

    /// A join listener and a client whose stream receive window is 1 byte:
    /// it sends a request and never lets the answer through.
    #[tokio::test]
    async fn a_client_that_grants_no_credit_is_cut_off() {
        let dir = tempfile::tempdir().unwrap();
        let day = Duration::from_secs(86_400);
        let ca = Ca::new("test-ca", day).unwrap();
        let server = ca
            .issue_server(&["tether-cloud"], &[Ipv4Addr::LOCALHOST.into()], day)
            .unwrap();
        let mut tls = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                tether_certs::pem::certs_from_pem(&server.cert_pem, "server").unwrap(),
                tether_certs::pem::key_from_pem(&server.key_pem, "server").unwrap(),
            )
            .unwrap();
        tls.alpn_protocols = vec![tether_certs::ALPN_JOIN.to_vec()];
        let sc = quinn::ServerConfig::with_crypto(Arc::new(
            quinn::crypto::rustls::QuicServerConfig::try_from(tls).unwrap(),
        ));
        let server_ep = quinn::Endpoint::server(sc, (Ipv4Addr::LOCALHOST, 0).into()).unwrap();
        let addr = server_ep.local_addr().unwrap();

        let mut roots = rustls::RootCertStore::empty();
        for c in tether_certs::pem::certs_from_pem(&ca.cert_pem, "ca").unwrap() {
            roots.add(c).unwrap();
        }
        let mut ctls = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        ctls.alpn_protocols = vec![tether_certs::ALPN_JOIN.to_vec()];
        let mut cc = quinn::ClientConfig::new(Arc::new(
            quinn::crypto::rustls::QuicClientConfig::try_from(ctls).unwrap(),
        ));
        let mut tc = quinn::TransportConfig::default();
        tc.stream_receive_window(1u32.into());
        cc.transport_config(Arc::new(tc));
        let mut client_ep = quinn::Endpoint::client((Ipv4Addr::LOCALHOST, 0).into()).unwrap();
        client_ep.set_default_client_config(cc);

        let store = Arc::new(JoinStore::open(dir.path().join("store.json")).unwrap());
        let ca = Arc::new(ca);
        let served = tokio::spawn(async move {
            let conn = server_ep.accept().await.unwrap().await.unwrap();
            let t = Instant::now();
            let r = serve_join_within(
                conn,
                store,
                ca,
                day,
                Duration::from_secs(2),
                Duration::from_secs(1),
            )
            .await;
            (r, t.elapsed())
        });
        let conn = client_ep
            .connect(addr, "tether-cloud")
            .unwrap()
            .await
            .unwrap();
        let (mut send, _recv) = conn.open_bi().await.unwrap();
        let req = JoinRequest {
            token: "abcdef.0123456789abcdef".into(),
            node: "edge-1".into(),
            csr_pem: "not a csr".into(),
        };
        send.write_all(&join::encode(&req).unwrap()).await.unwrap();
        let (r, took) = tokio::time::timeout(Duration::from_secs(20), served)
            .await
            .expect("the join connection is still held after 20 s")
            .unwrap();
        assert!(
            r.is_err(),
            "a join whose answer never left counts as failed"
        );
        assert!(took < Duration::from_secs(10), "held for {took:?}");
        drop(conn);
    }
}
