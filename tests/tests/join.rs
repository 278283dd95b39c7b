//! Edge bootstrap with the real binaries: `tether-certs` makes the CA, the
//! cloud's certificates and a join token; `tether-cloud` serves joins;
//! `tether-edge join` obtains a certificate (its key never leaves the edge)
//! and the edge then connects with it and serves requests. Also: a wrong CA
//! pin is refused before the token is sent, and a used token is refused; a node
//! revoked with `tether-certs cert revoke` is refused by the running cloud.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use hyper::StatusCode;
use support::{Client, Kubelet};
use tether_tests::bins::binary;
use tether_tests::process::{Proc, SpawnOptions};

fn certs(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(binary("tether-certs").unwrap())
        .arg("--dir")
        .arg(dir.join("pki"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tether-certs {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

fn edge_join(cloud: &str, token: &str, pin: &str, node: &str, out: &Path) -> (bool, String) {
    let o = Command::new(binary("tether-edge").unwrap())
        .args([
            "join",
            "--cloud",
            cloud,
            "--server-name",
            "tether-cloud",
            "--token",
            token,
            "--ca-pin",
            pin,
            "--node",
            node,
        ])
        .arg("--out-dir")
        .arg(out)
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_joins_with_a_token_then_serves() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let pki = d.join("pki");
    let ca_out = certs(d, &["ca", "create"]);
    let pin = ca_out
        .split_whitespace()
        .find(|w| w.starts_with("sha256:"))
        .expect("ca create prints the pin")
        .to_string();
    certs(
        d,
        &[
            "issue",
            "cloud-tunnel",
            "--dns",
            "tether-cloud",
            "--ip",
            "127.0.0.1",
        ],
    );
    certs(
        d,
        &[
            "issue",
            "cloud-kubelet",
            "--dns",
            "localhost",
            "--ip",
            "127.0.0.1",
        ],
    );
    certs(d, &["issue", "apiserver-client"]);
    let tok_out = certs(
        d,
        &["token", "create", "--node-pattern", "edge-*", "--uses", "1"],
    );
    let token = tok_out
        .split_whitespace()
        .skip_while(|w| *w != "--token")
        .nth(1)
        .expect("token create prints the join command")
        .to_string();

    let mut cmd = tokio::process::Command::new(binary("tether-cloud").unwrap());
    cmd.args(tether_tests::LOOPBACK_LISTENS)
        .arg("--tunnel-cert")
        .arg(pki.join("tunnel.crt"))
        .arg("--tunnel-key")
        .arg(pki.join("tunnel.key"))
        .arg("--edge-ca")
        .arg(pki.join("ca.crt"))
        .arg("--kubelet-cert")
        .arg(pki.join("kubelet.crt"))
        .arg("--kubelet-key")
        .arg(pki.join("kubelet.key"))
        .arg("--apiserver-client-ca")
        .arg(pki.join("ca.crt"))
        .arg("--insecure-trust-edge-reports")
        .arg("--join-store")
        .arg(pki.join("join-tokens.json"))
        .arg("--join-ca-cert")
        .arg(pki.join("ca.crt"))
        .arg("--join-ca-key")
        .arg(pki.join("ca.key"))
        // Short-lived certificates, so the renewal at two thirds happens in the test.
        .args(["--join-cert-validity", "18s"])
        .env("RUST_BACKTRACE", "0");
    let mut cloud = Proc::spawn("tether-cloud", cmd, d, SpawnOptions::default()).unwrap();
    let ready = cloud
        .wait_line("cloud ready", Duration::from_secs(20), |l| {
            l.starts_with("tether-cloud ready")
        })
        .await
        .unwrap();
    let addr = |k: &str| {
        ready
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .unwrap()
            .to_string()
    };
    let tunnel = addr("tunnel");

    // A wrong pin: refused before the token is sent, so the token stays usable.
    let wrong = format!("sha256:{}", "00".repeat(32));
    let (ok, out) = edge_join(&tunnel, &token, &wrong, "edge-7", &d.join("wrong"));
    assert!(!ok, "a wrong pin must fail: {out}");
    assert!(!d.join("wrong/node.crt").exists());

    // The real join.
    let (ok, out) = edge_join(&tunnel, &token, &pin, "edge-7", &d.join("edge"));
    assert!(ok, "join failed: {out}");
    let key_mode = std::fs::metadata(d.join("edge/node.key"))
        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777)
        .unwrap();
    assert_eq!(key_mode, 0o600);
    let inspect = certs(d, &["inspect", d.join("edge/node.crt").to_str().unwrap()]);
    assert!(inspect.contains("system:node:edge-7"), "{inspect}");
    let first = std::fs::read_to_string(d.join("edge/node.crt")).unwrap();

    // The same token again: exhausted.
    let (ok, out) = edge_join(&tunnel, &token, &pin, "edge-8", &d.join("again"));
    assert!(
        !ok && out.contains("exhausted"),
        "a used token must be refused: {out}"
    );

    // The joined edge connects with its new certificate and serves requests.
    let kubelet = Kubelet::start("edge-7", &["default/p7"]).await.unwrap();
    let mut edge = spawn_edge(
        d,
        &tunnel,
        kubelet.addr,
        "tether-edge",
        &[
            "--pods-refresh",
            "200ms",
            "--announce-address",
            "edge-7.invalid",
        ],
    );
    let line = edge
        .wait_connected("edge connected", Duration::from_secs(20))
        .await
        .unwrap();
    assert!(line.contains("node=edge-7"), "{line}");

    // An apiserver-style client certificate issued by the CLI reaches the edge's kubelet.
    let read = |p: &str| std::fs::read_to_string(pki.join(p)).unwrap();
    let pki_for_client = tether_tests::pki::Pki {
        tether_ca: pki.join("ca.crt"),
        tether_ca_pem: read("ca.crt"),
        apiserver_client_ca: pki.join("ca.crt"),
        cloud_tunnel: pair(&pki, "tunnel"),
        cloud_kubelet: pair(&pki, "kubelet"),
        apiserver_client: pair(&pki, "apiserver-client"),
        edges: Default::default(),
        kubelets: Default::default(),
    };
    let client = Client::new(&pki_for_client, addr("kubelet-api").parse().unwrap()).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let r = client
            .get("/metrics", "edge-7", Some("localhost"), &[])
            .await
            .unwrap();
        if r.status == StatusCode::OK {
            assert_eq!(r.node(), Some("edge-7"));
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} {}",
            r.status,
            r.body
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Two thirds into its 18 s lifetime the edge renews its certificate over
    // the session; the file changes, the connection is untouched.
    let renewed_deadline = std::time::Instant::now() + Duration::from_secs(40);
    loop {
        let now = std::fs::read_to_string(d.join("edge/node.crt")).unwrap();
        if now != first {
            break;
        }
        assert!(
            std::time::Instant::now() < renewed_deadline,
            "certificate not renewed: {}",
            edge.stderr_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let inspect = certs(d, &["inspect", d.join("edge/node.crt").to_str().unwrap()]);
    assert!(inspect.contains("system:node:edge-7"), "{inspect}");
    assert_eq!(edge.connects(), 1, "renewal must not reconnect");
    let r = client
        .get("/metrics", "edge-7", Some("localhost"), &[])
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::OK);
    // The renewed key and certificate form a working pair: a restarted edge connects with them.
    edge.kill().await;
    let mut edge = spawn_edge(
        d,
        &tunnel,
        kubelet.addr,
        "tether-edge-2",
        &["--announce-address", "edge-7.invalid"],
    );
    edge.wait_connected(
        "edge reconnected with the renewed certificate",
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    assert!(std::fs::read_to_string(d.join("tether-cloud.log"))
        .unwrap()
        .contains("renewed the edge's certificate"));

    // An edge connected before the revocation below (hand-driven, with edge-7's current
    // certificate), to ask for a renewal after it.
    edge.kill().await;
    let mut raw = support::RawEdge::connect(
        tunnel.parse().unwrap(),
        &std::fs::read_to_string(d.join("edge/ca.crt")).unwrap(),
        &std::fs::read_to_string(d.join("edge/node.crt")).unwrap(),
        &std::fs::read_to_string(d.join("edge/node.key")).unwrap(),
        "edge-7",
    )
    .await
    .unwrap();

    // A stolen key: the operator revokes every certificate of edge-7 issued so far.
    // The running cloud refuses the edge at its next handshake, no restart needed.
    let out = certs(
        d,
        &[
            "cert",
            "revoke",
            "--node",
            "edge-7",
            "--reason",
            "stolen laptop",
        ],
    );
    assert!(out.contains("edge-7"), "{out}");
    assert!(certs(d, &["cert", "revoked"]).contains("stolen laptop"));
    // The cloud looks at the store at most once a second.
    tokio::time::sleep(Duration::from_millis(1100)).await;

    // The edge still connected with its now-revoked certificate asks for a renewal: no
    // certificate; the cloud logs it with the node and closes the connection.
    let csr = tether_certs::csr::make_edge_csr("edge-7").unwrap().csr_pem;
    tether_proto::io::write_frame(
        &mut raw.send,
        &tether_proto::Frame::RenewCert { csr_pem: csr },
        1 << 20,
    )
    .await
    .unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(10), raw.conn.closed())
        .await
        .expect("the cloud closes a revoked edge's connection when it asks for a renewal");
    assert_closed_revoked(&closed);
    let log = std::fs::read_to_string(d.join("tether-cloud.log")).unwrap();
    assert!(
        log.lines().any(|l| l
            .contains("refusing certificate renewal: the presented certificate is revoked")
            && l.contains("node=edge-7")
            && l.contains("stolen laptop")),
        "the refused renewal is not logged with the node and the reason: {}",
        cloud.stderr_tail(10)
    );
    // The same edge dials again with a TLS session ticket it got before the
    // revocation: the handshake resumes (its certificate is neither sent nor
    // verified), and the cloud still refuses the revoked certificate.
    let metrics: std::net::SocketAddr = addr("metrics").parse().unwrap();
    let resumed = || async move {
        let (_, text) = support::plain_get(metrics, "/metrics").await.unwrap();
        support::sample(
            &text,
            "tether_cloud_edge_tls_handshakes_total{kind=\"resumed\"}",
        )
        .unwrap_or(0.0)
    };
    let before = resumed().await;
    let again = tokio::time::timeout(
        Duration::from_secs(10),
        raw.endpoint
            .connect(
                tunnel.parse().unwrap(),
                tether_tests::pki::CLOUD_SERVER_NAME,
            )
            .unwrap(),
    )
    .await
    .expect("a handshake within 10 s")
    .expect("the resumed handshake completes");
    let closed = tokio::time::timeout(Duration::from_secs(10), again.closed())
        .await
        .expect("the cloud closes a resumed connection of a revoked certificate");
    assert_closed_revoked(&closed);
    assert_eq!(
        resumed().await,
        before + 1.0,
        "the handshake did not resume"
    );

    let edge = spawn_edge(d, &tunnel, kubelet.addr, "tether-edge-3", &[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let log = std::fs::read_to_string(d.join("tether-cloud.log")).unwrap();
        if log.contains("refusing node edge-7") && log.contains("stolen laptop") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the revoked certificate was not refused: {}\ncloud: {}",
            edge.stderr_tail(20),
            cloud.stderr_tail(15)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(edge.connects(), 0, "a revoked certificate must not connect");
    drop(kubelet);
}

/// The cloud closed the connection because its certificate is revoked.
fn assert_closed_revoked(closed: &quinn::ConnectionError) {
    match closed {
        quinn::ConnectionError::ApplicationClosed(c) => {
            assert_eq!(&c.reason[..], b"certificate revoked", "{closed}")
        }
        other => panic!("closed for another reason: {other}"),
    }
}

/// `tether-edge` with the joined certificate, dialling `tunnel`, for `kubelet`.
fn spawn_edge(
    d: &Path,
    tunnel: &str,
    kubelet: std::net::SocketAddr,
    name: &str,
    extra: &[&str],
) -> Proc {
    let mut cmd = tokio::process::Command::new(binary("tether-edge").unwrap());
    cmd.args(["--cloud", tunnel, "--server-name", "tether-cloud"])
        .arg("--ca")
        .arg(d.join("edge/ca.crt"))
        .arg("--cert")
        .arg(d.join("edge/node.crt"))
        .arg("--key")
        .arg(d.join("edge/node.key"))
        .args([
            "--kubelet-url",
            &format!("http://{kubelet}"),
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .args(extra)
        .env("RUST_BACKTRACE", "0");
    Proc::spawn(name, cmd, d, SpawnOptions::default()).unwrap()
}

fn pair(pki: &Path, name: &str) -> tether_tests::pki::Pair {
    let cert = pki.join(format!("{name}.crt"));
    let key = pki.join(format!("{name}.key"));
    tether_tests::pki::Pair {
        cert_pem: std::fs::read_to_string(&cert).unwrap(),
        key_pem: std::fs::read_to_string(&key).unwrap(),
        cert,
        key,
    }
}
