//! The cloud's limits and waits on an edge that misbehaves before or after
//! it is attached: `--max-edges`; `--handshake-timeout` for an edge that
//! sends no hello, never commits, or grants no stream credit for the cloud's
//! welcome or refusal; `--control-write-timeout` for an attached edge that
//! grants none for a resume ticket or the answer to a revoked certificate's
//! renewal; `--renewal-min-interval` for a renewal asked again, with the
//! same key after its answer was lost (the same certificate again) or with
//! another (refused). Each such edge is hand-driven over QUIC (and keeps its connection
//! alive with QUIC PINGs, so no idle timeout ends it first); each must be
//! closed within its bound, and give its `--max-edges` slot back, while an
//! edge beside it keeps serving. Also the cloud's warning about an edge
//! presenting a certificate too short-lived to renew within
//! `--renewal-min-interval`.
//!
//! Needs the binaries built first: `cargo build --workspace --bins`.

mod support;

use std::time::Duration;

use support::{Env, NodeSpec};
use tether_proto::handshake::{close_code, Hello, PROTOCOL_VERSION};
use tether_proto::io::{write_frame, FrameReader};
use tether_proto::Frame;

/// The node every hand-driven edge here has a certificate of.
const NODE: &str = "edge-intruder";

/// Generous bound on anything that should happen after a 2 s handshake timeout.
const BOUND: Duration = Duration::from_secs(20);

/// A cloud with no edges of its own, `--handshake-timeout 2s`,
/// `--control-write-timeout 2s`, and `extra` flags.
async fn cloud(extra: &[&str]) -> Env {
    cloud_with(&[], extra).await
}

/// [`cloud`] with well-behaved edges (real `tether-edge` processes) for `specs`.
async fn cloud_with(specs: &[NodeSpec<'_>], extra: &[&str]) -> Env {
    let mut flags = vec!["--handshake-timeout", "2s", "--control-write-timeout", "2s"];
    flags.extend_from_slice(extra);
    Env::start(specs, &flags).await.unwrap()
}

/// An endpoint with `NODE`'s certificate whose streams receive at most
/// `window` bytes unread (quinn's default when `None`). Its connections send
/// a QUIC PING every second: only the cloud's own bounds close them.
fn endpoint(env: &Env, window: Option<u32>) -> quinn::Endpoint {
    let pair = &env.pki.edges[NODE];
    let mut transport = quinn::TransportConfig::default();
    transport.keep_alive_interval(Some(Duration::from_secs(1)));
    if let Some(w) = window {
        transport.stream_receive_window(w.into());
    }
    support::RawEdge::endpoint_with(
        &env.pki.tether_ca_pem,
        &pair.cert_pem,
        &pair.key_pem,
        Some(transport),
    )
    .unwrap()
}

/// A QUIC connection to the cloud from `ep`, dialled again while the cloud
/// refuses it (the `--max-edges` slot of an edge it just closed is given back
/// as that edge's task ends, a moment after the close).
async fn dial(env: &Env, ep: &quinn::Endpoint) -> quinn::Connection {
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let attempt = tokio::time::timeout(
            Duration::from_secs(10),
            ep.connect(env.tunnel, tether_tests::pki::CLOUD_SERVER_NAME)
                .unwrap(),
        )
        .await;
        match attempt {
            Ok(Ok(conn)) => return conn,
            Ok(Err(e)) if tokio::time::Instant::now() < deadline => {
                eprintln!("dialling again: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!("no connection to the cloud within {BOUND:?}: {other:?}"),
        }
    }
}

/// Opens the control stream and says hello as `node`.
async fn hello(conn: &quinn::Connection, node: &str) -> (quinn::SendStream, quinn::RecvStream) {
    let (mut send, recv) = conn.open_bi().await.unwrap();
    let hello = Hello {
        versions: vec![PROTOCOL_VERSION],
        node: node.into(),
        addresses: vec![],
        resume: tether_proto::token::ResumeToken(rand::random()),
        // Another process of the edge each time: never superseded by
        // an attempt of an earlier one.
        instance: rand::random(),
        attempt: 1,
        limits: tether_proto::Limits::default(),
        ticket: None,
    };
    write_frame(&mut send, &Frame::Hello(hello), 1 << 20)
        .await
        .unwrap();
    (send, recv)
}

/// Waits for the cloud to close `conn`; returns how it was closed.
async fn closed(conn: &quinn::Connection, what: &str) -> quinn::ConnectionError {
    tokio::time::timeout(BOUND, conn.closed())
        .await
        .unwrap_or_else(|_| panic!("{what}: still connected after {BOUND:?}"))
}

/// The application close reason of `e`, or a panic naming `what`.
fn closed_by_cloud(e: &quinn::ConnectionError, what: &str) -> (u32, String) {
    match e {
        quinn::ConnectionError::ApplicationClosed(c) => (
            u32::try_from(c.error_code.into_inner()).unwrap(),
            String::from_utf8_lossy(&c.reason).into_owned(),
        ),
        other => panic!("{what}: closed otherwise: {other}"),
    }
}

/// An edge attached to a session of its own: its connection and control stream.
type Attached = (quinn::Connection, quinn::SendStream, quinn::RecvStream);

/// Hello, welcome and commit on `conn`.
async fn attach(conn: quinn::Connection) -> Attached {
    attach_reading(conn).await.0
}

/// [`attach`], with the reader of the control stream (to read on after the welcome).
async fn attach_reading(conn: quinn::Connection) -> (Attached, FrameReader) {
    let (mut send, mut recv) = hello(&conn, NODE).await;
    let mut reader = FrameReader::new(1 << 20);
    let welcome = tokio::time::timeout(BOUND, reader.next(&mut recv))
        .await
        .expect("a welcome");
    let Ok(Some(Frame::Welcome(w))) = welcome else {
        panic!("expected a welcome, got {welcome:?}");
    };
    write_frame(&mut send, &Frame::Commit { session: w.session }, 1 << 20)
        .await
        .unwrap();
    ((conn, send, recv), reader)
}

/// A well-behaved edge gets in (the `--max-edges` slot is free).
async fn a_good_edge_gets_in(env: &Env) -> Attached {
    attach(dial(env, &endpoint(env, None)).await).await
}

/// `--max-edges 1`: with one edge attached, the next is refused at its QUIC
/// handshake and counted (`max_edges`); once the first leaves, a new one gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_edge_past_max_edges_is_refused_and_counted() {
    let env = cloud(&["--max-edges", "1"]).await;
    let first = a_good_edge_gets_in(&env).await;
    let ep = endpoint(&env, None);
    let second = tokio::time::timeout(
        BOUND,
        ep.connect(env.tunnel, tether_tests::pki::CLOUD_SERVER_NAME)
            .unwrap(),
    )
    .await
    .expect("the cloud answers the edge past --max-edges");
    match second {
        Err(quinn::ConnectionError::ConnectionClosed(c)) => assert_eq!(
            c.error_code,
            quinn_proto::TransportErrorCode::CONNECTION_REFUSED,
            "{c}"
        ),
        other => panic!("the edge past --max-edges was not refused: {other:?}"),
    }
    let (_, m) = support::plain_get(env.metrics, "/metrics").await.unwrap();
    let refused = support::sample(&m, "tether_cloud_edges_refused_total{reason=\"max_edges\"}");
    assert_eq!(refused, Some(1.0), "{m}");
    assert!(
        env.cloud_log()
            .contains("refusing edge connection: --max-edges reached"),
        "the refusal is not logged"
    );
    first.0.close(0u32.into(), b"leaving");
    drop(first);
    let _next = a_good_edge_gets_in(&env).await;
}

/// `--handshake-timeout` (2 s) in its hello and commit phases: an edge that
/// finishes QUIC but says nothing, and one that takes the welcome but never
/// commits, are each closed after it, and free the only `--max-edges` slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_silent_before_its_hello_or_its_commit_is_closed_after_the_handshake_timeout() {
    let env = cloud(&["--max-edges", "1"]).await;
    let ep = endpoint(&env, None);

    let silent = dial(&env, &ep).await;
    closed(&silent, "an edge that sent no hello").await;
    assert!(
        env.cloud_log()
            .contains("no hello within --handshake-timeout"),
        "the missing hello is not logged"
    );

    let uncommitted = dial(&env, &ep).await;
    let (_send, mut recv) = hello(&uncommitted, NODE).await;
    let welcome = tokio::time::timeout(BOUND, FrameReader::new(1 << 20).next(&mut recv))
        .await
        .expect("a welcome");
    assert!(
        matches!(welcome, Ok(Some(Frame::Welcome(_)))),
        "{welcome:?}"
    );
    let e = closed(&uncommitted, "an edge that never committed").await;
    let (code, reason) = closed_by_cloud(&e, "an edge that never committed");
    assert_eq!(
        (code, reason.as_str()),
        (close_code::REPLACED, "no commit in time")
    );

    let _good = a_good_edge_gets_in(&env).await;
}

/// An edge that grants the cloud no stream credit on its control stream (a
/// receive window of 1 byte, never read) cannot hold its `--max-edges` slot
/// past `--handshake-timeout`: not with the welcome unsent, nor with a
/// refusal (here of a hello naming another node) unsent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_that_takes_no_welcome_or_refusal_is_closed_after_the_handshake_timeout() {
    let env = cloud(&["--max-edges", "1"]).await;
    let stingy = endpoint(&env, Some(1));

    let conn = dial(&env, &stingy).await;
    let _control = hello(&conn, NODE).await;
    let e = closed(&conn, "an edge that took no welcome").await;
    assert_eq!(
        closed_by_cloud(&e, "an edge that took no welcome"),
        (close_code::REPLACED, "welcome not taken in time".into())
    );
    assert!(
        env.cloud_log()
            .contains("took no welcome within --handshake-timeout"),
        "the untaken welcome is not logged"
    );

    let conn = dial(&env, &stingy).await;
    let _control = hello(&conn, "edge-someone-else").await;
    let e = closed(&conn, "an edge that took no refusal").await;
    let (code, reason) = closed_by_cloud(&e, "an edge that took no refusal");
    assert_eq!(code, close_code::REFUSED, "{reason}");
    assert!(reason.contains("edge-someone-else"), "{reason}");

    let _good = a_good_edge_gets_in(&env).await;
}

/// [`cloud`] with renewals enabled (`extra` flags too): a join CA and an
/// empty join-token store made in `dir`; the store's path (to revoke in).
async fn renewing_cloud(dir: &std::path::Path, extra: &[&str]) -> (Env, std::path::PathBuf) {
    let join_ca = tether_certs::Ca::new("join-ca", Duration::from_secs(3600)).unwrap();
    let (ca_cert, ca_key) = (dir.join("join-ca.crt"), dir.join("join-ca.key"));
    std::fs::write(&ca_cert, &join_ca.cert_pem).unwrap();
    std::fs::write(&ca_key, join_ca.key_pem()).unwrap();
    let store_path = dir.join("join-store.json");
    let path = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let (store_arg, cert_arg, key_arg) = (path(&store_path), path(&ca_cert), path(&ca_key));
    let mut flags = vec![
        "--join-store",
        &store_arg,
        "--join-ca-cert",
        &cert_arg,
        "--join-ca-key",
        &key_arg,
    ];
    flags.extend_from_slice(extra);
    (cloud(&flags).await, store_path)
}

/// An edge whose certificate is revoked while it is connected asks for a
/// renewal and reads nothing more (1 byte of receive window): the cloud's
/// refusal cannot leave, and the connection is closed all the same, after
/// `--control-write-timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_edge_that_takes_no_refusal_is_closed_all_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let (env, store_path) = renewing_cloud(dir.path(), &[]).await;

    // Connected and committed, reading the welcome a byte at a time.
    let (conn, mut send, _recv) = attach(dial(&env, &endpoint(&env, Some(1))).await).await;
    cloud_logged(&env, "edge connected").await;

    tether_certs::JoinStore::open(&store_path)
        .unwrap()
        .revoke_node(NODE, "stolen laptop", std::time::SystemTime::now())
        .unwrap();
    // The cloud looks at the store at most once a second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let csr = tether_certs::csr::make_edge_csr(NODE).unwrap().csr_pem;
    write_frame(&mut send, &Frame::RenewCert { csr_pem: csr }, 1 << 20)
        .await
        .unwrap();
    let e = closed(&conn, "a revoked edge that took no refusal").await;
    assert_eq!(
        closed_by_cloud(&e, "a revoked edge that took no refusal"),
        (close_code::REFUSED, "certificate revoked".into())
    );
    assert!(
        env.cloud_log()
            .contains("the revoked edge took no refusal within --control-write-timeout"),
        "the untaken refusal is not logged"
    );
}

/// A renewal whose answer is lost: the edge asks, the cloud signs, and the
/// connection is gone before the edge reads the answer. Reconnected, the
/// edge asks again with the same CSR (same key) and gets the certificate
/// already issued, not "renewed too recently" and ten more minutes; no
/// second certificate is minted. Another key within
/// `--renewal-min-interval` (1 h here) is refused with the time left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_whose_answer_was_lost_is_answered_again_with_the_same_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (env, _store) = renewing_cloud(dir.path(), &["--renewal-min-interval", "1h"]).await;
    let req = tether_certs::csr::make_edge_csr(NODE).unwrap();

    // Asked; the cloud signs; the connection ends before the answer is read.
    let (conn, mut send, _recv) = attach(dial(&env, &endpoint(&env, None)).await).await;
    let first = Frame::RenewCert {
        csr_pem: req.csr_pem.clone(),
    };
    write_frame(&mut send, &first, 1 << 20).await.unwrap();
    cloud_logged(&env, "renewed the edge's certificate").await;
    conn.close(0u32.into(), b"link lost");

    // Reconnected: the same request again gets the certificate issued.
    let ((_conn, mut send, mut recv), mut reader) =
        attach_reading(dial(&env, &endpoint(&env, None)).await).await;
    let mut control = (&mut send, &mut recv, &mut reader);
    let again = renewal_answer(&mut control, &req.csr_pem).await;
    let cert_pem = again.unwrap_or_else(|e| panic!("the repeated request was refused: {e}"));
    let leaf = tether_certs::pem::certs_from_pem(&cert_pem, "answer")
        .unwrap()
        .remove(0);
    assert!(tether_certs::certifies_key(&leaf, &req.public_key));
    let log = env.cloud_log();
    let serial_in = |what: &str| -> Vec<String> {
        log.lines()
            .filter(|l| l.contains(what) && l.contains(NODE))
            .filter_map(|l| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix("serial="))
                    .map(str::to_string)
            })
            .collect()
    };
    let (minted, repeated) = (
        serial_in("renewed the edge's certificate"),
        serial_in("answering a repeated renewal request with the certificate already issued"),
    );
    assert_eq!(minted.len(), 1, "one certificate minted: {log}");
    assert_eq!(repeated, minted, "the same certificate answered: {log}");

    // Another key within the interval: refused, with the time left of 1 h.
    let other = tether_certs::csr::make_edge_csr(NODE).unwrap();
    let refused = renewal_answer(&mut control, &other.csr_pem)
        .await
        .unwrap_err();
    let left = tether_proto::frame::renewal_retry_after(&refused)
        .unwrap_or_else(|| panic!("refused otherwise: {refused}"));
    assert!(left > Duration::from_secs(3000), "{refused}");
}

/// A certificate an operator issued with a shorter life than
/// `--join-cert-validity` is renewed for that life; so short that a renewal
/// is due again within `--renewal-min-interval` (a 1 h certificate, 1 h
/// here), the edge's renewals would be refused and the certificate would
/// expire. The cloud says so once per connection, naming the node, the
/// lifetime, the interval and the least validity that is renewable. Of a
/// one-day certificate it says nothing (checked after its renewal was
/// answered: the connection's warning comes before its control loop). Both
/// certificates are the join CA's, trusted as the edge CA here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_too_short_lived_to_renew_is_warned_about_naming_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let join_ca = dir.path().join("join-ca.crt");
    let edge_ca = join_ca.to_str().unwrap().to_string();
    let (env, _store) = renewing_cloud(
        dir.path(),
        &["--renewal-min-interval", "1h", "--edge-ca", &edge_ca],
    )
    .await;
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).unwrap();
    let join_ca =
        tether_certs::Ca::from_pem(&read(join_ca), &read(dir.path().join("join-ca.key"))).unwrap();
    let edge_for = |life: Duration| {
        let pair = join_ca.issue_edge(NODE, life).unwrap();
        support::RawEdge::endpoint(&env.pki.tether_ca_pem, &pair.cert_pem, &pair.key_pem).unwrap()
    };
    let warning = "the edge's certificate is too short-lived to renew";

    // A day: renewed, and no warning.
    let ((_conn, mut send, mut recv), mut reader) =
        attach_reading(dial(&env, &edge_for(Duration::from_secs(86400))).await).await;
    let req = tether_certs::csr::make_edge_csr(NODE).unwrap();
    renewal_answer(&mut (&mut send, &mut recv, &mut reader), &req.csr_pem)
        .await
        .unwrap_or_else(|e| panic!("a one-day certificate's renewal was refused: {e}"));
    assert!(
        !env.cloud_log().contains(warning),
        "a one-day certificate warned about: {}",
        env.cloud_log()
    );

    // An hour: warned about once, on connecting, with what to do.
    let _short = attach(dial(&env, &edge_for(Duration::from_secs(3600))).await).await;
    cloud_logged(&env, warning).await;
    let log = env.cloud_log();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains(warning)).collect();
    assert_eq!(lines.len(), 1, "{log}");
    for field in [
        format!("node={NODE}"),
        "lifetime=3600s".into(),
        "renewal_min_interval=3600s".into(),
        "least_validity=5550s".into(),
    ] {
        assert!(lines[0].contains(&field), "no {field} in {}", lines[0]);
    }
}

/// Waits (within [`BOUND`]) until the cloud's log has a line with `what`.
async fn cloud_logged(env: &Env, what: &str) {
    let deadline = tokio::time::Instant::now() + BOUND;
    while !env.cloud_log().contains(what) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {what:?} in the cloud's log within {BOUND:?}: {}",
            env.cloud_log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends a renewal request for `csr_pem` on an attached edge's control
/// stream and reads on to the answer (within [`BOUND`]).
async fn renewal_answer(
    (send, recv, reader): &mut (
        &mut quinn::SendStream,
        &mut quinn::RecvStream,
        &mut FrameReader,
    ),
    csr_pem: &str,
) -> Result<String, String> {
    let ask = Frame::RenewCert {
        csr_pem: csr_pem.to_string(),
    };
    write_frame(send, &ask, 1 << 20).await.unwrap();
    loop {
        match tokio::time::timeout(BOUND, reader.next(recv)).await {
            Ok(Ok(Some(Frame::RenewedCert { result }))) => return result,
            Ok(Ok(Some(_))) => {}
            other => panic!("no renewal answer within {BOUND:?}: {other:?}"),
        }
    }
}

/// The pod the well-behaved edge beside a misbehaving one serves.
const POD: &str = "default/p1";

/// The well-behaved edge `edge-good` answers a request for its pod [`POD`].
async fn good_edge_serves(env: &Env, when: &str) {
    let r = env
        .client
        .get(
            "/containerLogs/default/p1/c",
            "apiserver.example:6443",
            None,
            &[],
        )
        .await
        .unwrap_or_else(|e| panic!("{when}: {e:#}"));
    assert_eq!(r.status, 200, "{when}: {}", r.body);
    assert_eq!(r.node(), Some("edge-good"), "{when}");
}

/// `--control-write-timeout` (2 s) after the welcome: an attached edge that
/// stops granting stream credit on its control stream (1 byte of receive
/// window, never read again) while the cloud has resume tickets for it
/// (`--grace 2s`: a fresh one every second to an edge that sends no
/// keep-alive frames) is closed, with a log line naming the node and the
/// flag; a well-behaved edge on the same cloud serves before and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_that_takes_no_control_frame_is_closed_after_the_control_write_timeout() {
    let good = NodeSpec {
        name: "edge-good",
        pods: &[POD],
        announce: &[],
    };
    let env = cloud_with(&[good], &["--grace", "2s"]).await;
    // Attached, having read the welcome a byte at a time; nothing more.
    let (conn, _send, _recv) = attach(dial(&env, &endpoint(&env, Some(1))).await).await;
    good_edge_serves(&env, "while the stingy edge is attached").await;

    let e = closed(&conn, "an edge that took no resume ticket").await;
    assert_eq!(
        closed_by_cloud(&e, "an edge that took no resume ticket"),
        (
            close_code::PROTOCOL,
            "control frame not taken in time".into()
        )
    );
    let log = env.cloud_log();
    let line = log
        .lines()
        .find(|l| l.contains("the edge took no control frame within --control-write-timeout"))
        .unwrap_or_else(|| panic!("the stalled control stream is not logged:\n{log}"));
    assert!(line.contains(NODE), "the log line names no node: {line}");
    good_edge_serves(&env, "after the stingy edge was closed").await;
}
