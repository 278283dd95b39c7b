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
//! most one answer and is closed. Every wait on the joining edge is bounded
//! ([`JoinWaits`]): a slow or silent edge is cut off after
//! `--join-request-timeout`, one that does not take the answer after
//! `--join-answer-timeout`, and the wait for the answer to arrive before the
//! close is at most `--join-linger`. A request whose announced length is over
//! `--join-max-message-bytes` is not read: the edge is answered a refusal
//! naming its size and the bound, the cloud logs it (with the edge's
//! address), and that connection closes; an undecodable request closes that
//! connection only. Other joins go on either way.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use tether_certs::join::{self, JoinRequest, JoinResponse, JOIN_REQUEST_TIMEOUT};
use tether_certs::{Ca, JoinStore};
use tracing::{info, warn};

/// The waits on a joining edge, from configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JoinWaits {
    /// How long the edge may take to send its request, from the end of the
    /// handshake (`--join-request-timeout`).
    pub request: Duration,
    /// How long the answer may take to be accepted by the edge's QUIC: a
    /// client that never grants stream credit must not hold its edge slot
    /// forever (`--join-answer-timeout`).
    pub answer: Duration,
    /// How long the cloud waits for the edge to acknowledge the answer
    /// before closing; the join has succeeded either way (`--join-linger`).
    pub linger: Duration,
}

impl Default for JoinWaits {
    fn default() -> Self {
        JoinWaits {
            request: JOIN_REQUEST_TIMEOUT,
            answer: Duration::from_secs(10),
            linger: Duration::from_secs(5),
        }
    }
}

/// QUIC close code of a finished join connection.
const JOIN_DONE: u32 = 0;

/// What the cloud read on a join stream.
enum Received {
    Request(quinn::SendStream, JoinRequest),
    /// A request announced over `--join-max-message-bytes`, left unread:
    /// the stream to answer on, the receiving side (kept until the close,
    /// so the edge's write is not stopped before it reads the answer) and
    /// why.
    TooLarge(quinn::SendStream, quinn::RecvStream, join::JoinError),
}

/// Handles one established join connection: read the request, decide,
/// answer, close. `validity` is the lifetime of the certificates issued;
/// `max_request` (`--join-max-message-bytes`) the largest request read.
/// Every step is bounded by `waits`, so a join connection holds its edge
/// slot for at most the request timeout + the decision + the answer timeout
/// + the linger.
pub async fn serve_join(
    conn: quinn::Connection,
    store: Arc<JoinStore>,
    ca: Arc<Ca>,
    validity: Duration,
    waits: JoinWaits,
    max_request: usize,
) -> anyhow::Result<()> {
    let request_timeout = waits.request;
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
        let len = match join::decode_len(prefix, max_request) {
            Ok(len) => len,
            Err(e) => return Ok(Received::TooLarge(send, recv, e)),
        };
        let mut body = vec![0u8; len];
        recv.read_exact(&mut body)
            .await
            .context("reading the join request")?;
        let req: JoinRequest = join::decode(&body)?;
        Ok::<_, anyhow::Error>(Received::Request(send, req))
    };
    let (send, req) = match tokio::time::timeout(request_timeout, read).await {
        Ok(Ok(Received::Request(send, req))) => (send, req),
        Ok(Ok(Received::TooLarge(send, recv, e))) => {
            // Logged by the caller (`edge connection failed`, with the
            // edge's address), as every other join that fails on the wire.
            let reason = format!(
                "the join request is too large: {e} (the cloud's --join-max-message-bytes)"
            );
            let answer = JoinResponse::Refused {
                reason: reason.clone(),
            };
            let sent = answer_and_close(&conn, send, &answer, waits, "the edge", remote).await;
            drop(recv);
            sent?;
            anyhow::bail!("join from {remote}: {reason}");
        }
        Ok(Err(e)) => {
            conn.close(JOIN_DONE.into(), b"bad join request");
            return Err(e.context(format!("join from {remote}")));
        }
        Err(_) => {
            conn.close(JOIN_DONE.into(), b"no join request in time");
            anyhow::bail!(
                "join from {remote}: no request within {request_timeout:?} (--join-request-timeout)"
            );
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
    answer_and_close(
        &conn,
        send,
        &answer,
        waits,
        &format!("node {claimed}"),
        remote,
    )
    .await
}

/// Sends `answer` on `send` within `--join-answer-timeout`, lets it arrive
/// for at most `--join-linger` and closes the connection. `who` names the
/// joining edge in errors.
async fn answer_and_close(
    conn: &quinn::Connection,
    mut send: quinn::SendStream,
    answer: &JoinResponse,
    waits: JoinWaits,
    who: &str,
    remote: std::net::SocketAddr,
) -> anyhow::Result<()> {
    let JoinWaits {
        answer: answer_timeout,
        linger,
        ..
    } = waits;
    let bytes = join::encode(answer)?;
    match tokio::time::timeout(answer_timeout, send.write_all(&bytes)).await {
        Ok(r) => r.with_context(|| format!("sending the join answer to {who} at {remote}"))?,
        Err(_) => {
            conn.close(JOIN_DONE.into(), b"join answer not accepted in time");
            anyhow::bail!(
                "join from {who} at {remote}: the answer was not accepted within \
                 {answer_timeout:?} (--join-answer-timeout)"
            );
        }
    }
    let _ = send.finish();
    // Let the answer arrive before the connection goes away.
    let _ = tokio::time::timeout(linger, send.stopped()).await;
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
    use std::net::{Ipv4Addr, SocketAddr};
    use std::time::Instant;

    const DAY: Duration = Duration::from_secs(86_400);

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        // Joins are one-off bootstrap handshakes (this file is also built
        // into tether-certs' tests, which do not link tether-proto).
        Arc::new(rustls::crypto::ring::default_provider())
    }

    /// A join listener, its CA and store (in `dir`).
    fn listener(dir: &std::path::Path) -> (quinn::Endpoint, Arc<Ca>, Arc<JoinStore>) {
        let ca = Ca::new("test-ca", DAY).unwrap();
        let server = ca
            .issue_server(&["tether-cloud"], &[Ipv4Addr::LOCALHOST.into()], DAY)
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
        let store = Arc::new(JoinStore::open(dir.join("store.json")).unwrap());
        (server_ep, Arc::new(ca), store)
    }

    /// A join client of `ca`'s listener at `addr` with the transport `tc`.
    async fn client(ca: &Ca, addr: SocketAddr, tc: quinn::TransportConfig) -> quinn::Connection {
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
        cc.transport_config(Arc::new(tc));
        let mut client_ep = quinn::Endpoint::client((Ipv4Addr::LOCALHOST, 0).into()).unwrap();
        client_ep.set_default_client_config(cc);
        client_ep
            .connect(addr, "tether-cloud")
            .unwrap()
            .await
            .unwrap()
    }

    /// Serves the next join connection on `server_ep` with `waits`: its
    /// result and how long it took from the end of the handshake.
    fn serve_next(
        server_ep: quinn::Endpoint,
        ca: Arc<Ca>,
        store: Arc<JoinStore>,
        waits: JoinWaits,
    ) -> tokio::task::JoinHandle<(anyhow::Result<()>, Duration)> {
        serve_next_within(server_ep, ca, store, waits, join::DEFAULT_MAX_JOIN_MESSAGE)
    }

    /// [`serve_next`] reading requests of at most `max_request` bytes.
    fn serve_next_within(
        server_ep: quinn::Endpoint,
        ca: Arc<Ca>,
        store: Arc<JoinStore>,
        waits: JoinWaits,
        max_request: usize,
    ) -> tokio::task::JoinHandle<(anyhow::Result<()>, Duration)> {
        tokio::spawn(async move {
            let conn = server_ep.accept().await.unwrap().await.unwrap();
            let t = Instant::now();
            let r = serve_join(conn, store, ca, DAY, waits, max_request).await;
            (r, t.elapsed())
        })
    }

    /// Sends `bytes` as a join request on a new connection to `addr` and
    /// reads the answer (within 20 s).
    async fn exchange(ca: &Ca, addr: SocketAddr, bytes: &[u8]) -> JoinResponse {
        let conn = client(ca, addr, quinn::TransportConfig::default()).await;
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        let answer = async {
            send.write_all(bytes).await.unwrap();
            let _ = send.finish();
            let mut prefix = [0u8; 4];
            recv.read_exact(&mut prefix)
                .await
                .expect("an answer from the cloud");
            let len = join::decode_len(prefix, join::DEFAULT_MAX_JOIN_MESSAGE).unwrap();
            let mut body = vec![0u8; len];
            recv.read_exact(&mut body).await.unwrap();
            join::decode::<JoinResponse>(&body).unwrap()
        };
        tokio::time::timeout(Duration::from_secs(20), answer)
            .await
            .expect("no answer within 20 s")
    }

    /// A request over `--join-max-message-bytes` (was a fixed 64 KiB) is
    /// not read: the edge is answered a refusal naming its size and the
    /// bound, the join fails with that (what the caller logs, with the
    /// edge's address) and spends nothing; the next join on the same
    /// listener is served. The bound here is the least the cloud accepts,
    /// and the largest real request (a 253-character node name) is granted
    /// within it.
    #[tokio::test]
    async fn a_request_over_the_bound_is_refused_with_a_reason_and_other_joins_go_on() {
        let dir = tempfile::tempdir().unwrap();
        let (server_ep, ca, store) = listener(dir.path());
        let addr = server_ep.local_addr().unwrap();
        let least = join::LEAST_REQUEST_BYTES;
        let (token, _) = store.create(DAY, "*", 1, "", SystemTime::now()).unwrap();
        let waits = JoinWaits::default();
        let h = serve_next_within(server_ep.clone(), ca.clone(), store.clone(), waits, least);
        let over = join::encode(&JoinRequest {
            token: token.reveal(),
            node: "edge-1".into(),
            csr_pem: "x".repeat(least),
        })
        .unwrap();
        let reason = match exchange(&ca, addr, &over).await {
            JoinResponse::Refused { reason } => reason,
            other => panic!("an oversized request was answered {other:?}"),
        };
        let said = format!("{} bytes is over the {least}-byte limit", over.len() - 4);
        assert!(
            reason.contains(&said) && reason.contains("--join-max-message-bytes"),
            "{reason}"
        );
        let (r, _) = served(h).await;
        let e = format!(
            "{:#}",
            r.expect_err("an oversized request is a failed join")
        );
        assert!(
            e.contains(&said) && e.contains("--join-max-message-bytes") && e.contains("127.0.0.1"),
            "{e}"
        );
        assert_eq!(store.list().unwrap()[0].uses_left, 1, "nothing spent");

        let h = serve_next_within(server_ep, ca.clone(), store.clone(), waits, least);
        let node = join::longest_node_name();
        let edge = tether_certs::make_edge_csr(&node).unwrap();
        let real = join::encode(&JoinRequest {
            token: token.reveal(),
            node: node.clone(),
            csr_pem: edge.csr_pem,
        })
        .unwrap();
        assert!(real.len() - 4 <= least);
        match exchange(&ca, addr, &real).await {
            JoinResponse::Granted { .. } => {}
            other => panic!("the real request was answered {other:?}"),
        }
        let (r, _) = served(h).await;
        r.expect("the real request is served");
        assert_eq!(store.issued().unwrap()[0].node, node);
    }

    fn request() -> Vec<u8> {
        join::encode(&JoinRequest {
            token: "abcdef.0123456789abcdef".into(),
            node: "edge-1".into(),
            csr_pem: "not a csr".into(),
        })
        .unwrap()
    }

    /// Waits for the served join: it must end within 20 s.
    async fn served(
        h: tokio::task::JoinHandle<(anyhow::Result<()>, Duration)>,
    ) -> (anyhow::Result<()>, Duration) {
        tokio::time::timeout(Duration::from_secs(20), h)
            .await
            .expect("the join connection is still held after 20 s")
            .unwrap()
    }

    /// A client whose stream receive window is 1 byte sends a request and
    /// never lets the answer through: cut off after `--join-answer-timeout`.
    #[tokio::test]
    async fn a_client_that_grants_no_credit_is_cut_off_after_the_answer_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let (server_ep, ca, store) = listener(dir.path());
        let addr = server_ep.local_addr().unwrap();
        let waits = JoinWaits {
            answer: Duration::from_millis(300),
            ..JoinWaits::default()
        };
        let h = serve_next(server_ep, ca.clone(), store, waits);
        let mut tc = quinn::TransportConfig::default();
        tc.stream_receive_window(1u32.into());
        let conn = client(&ca, addr, tc).await;
        let (mut send, _recv) = conn.open_bi().await.unwrap();
        send.write_all(&request()).await.unwrap();
        let (r, took) = served(h).await;
        let e = r.expect_err("a join whose answer never left counts as failed");
        assert!(format!("{e:#}").contains("--join-answer-timeout"), "{e:#}");
        // 10 s was the fixed bound.
        assert!(took < Duration::from_secs(3), "held for {took:?}");
        drop(conn);
    }

    /// A client that sends nothing is cut off after `--join-request-timeout`.
    #[tokio::test]
    async fn a_silent_client_is_cut_off_after_the_request_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let (server_ep, ca, store) = listener(dir.path());
        let addr = server_ep.local_addr().unwrap();
        let waits = JoinWaits {
            request: Duration::from_millis(300),
            ..JoinWaits::default()
        };
        let h = serve_next(server_ep, ca.clone(), store, waits);
        let conn = client(&ca, addr, quinn::TransportConfig::default()).await;
        let (r, took) = served(h).await;
        let e = r.expect_err("no request is a failed join");
        assert!(format!("{e:#}").contains("--join-request-timeout"), "{e:#}");
        assert!(
            (Duration::from_millis(300)..Duration::from_secs(3)).contains(&took),
            "held for {took:?}"
        );
        drop(conn);
    }

    /// A client that stops acknowledging once its request is in (its
    /// runtime frozen): the answer is written, and the wait for its
    /// acknowledgement ends after `--join-linger`; the join itself is done.
    #[tokio::test]
    async fn the_wait_for_the_answer_to_arrive_ends_after_the_linger() {
        let dir = tempfile::tempdir().unwrap();
        let (server_ep, ca, store) = listener(dir.path());
        let addr = server_ep.local_addr().unwrap();
        let waits = JoinWaits {
            linger: Duration::from_millis(300),
            ..JoinWaits::default()
        };
        let h = serve_next(server_ep, ca.clone(), store, waits);
        // The client on a runtime of its own, so that blocking its only
        // thread stops its QUIC (no acknowledgement goes out).
        let frozen = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let conn = client(&ca, addr, quinn::TransportConfig::default()).await;
                let (mut send, _recv) = conn.open_bi().await.unwrap();
                send.write_all(&request()).await.unwrap();
                send.finish().unwrap();
                // The cloud acknowledged the whole request.
                let _ = tokio::time::timeout(Duration::from_secs(5), send.stopped()).await;
                std::thread::sleep(Duration::from_secs(8));
                drop(conn);
            })
        });
        let (r, took) = served(h).await;
        r.expect("the answer was written: the join is served");
        // 5 s was the fixed linger. No lower bound: should the answer ride
        // in the packet that acknowledged the request, the client's QUIC may
        // acknowledge it before its runtime is frozen, and the wait ends early.
        assert!(took < Duration::from_secs(3), "held for {took:?}");
        frozen.join().unwrap();
    }
}
