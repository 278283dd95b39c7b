//! `tether-certs` end to end: the real binary creates a CA, issues every
//! kind of certificate, inspects them and manages join tokens; `openssl
//! x509 -text` checks the fields of each kind (the test fails if openssl is
//! missing); rustls checks that each certificate is accepted where it must
//! be and refused where it must not.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;

use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::ClientCertVerifier;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_tether-certs")
}

fn run(dir: &Path, args: &[&str]) -> Output {
    let out = Command::new(bin())
        .arg("--dir")
        .arg(dir)
        .args(args)
        .env_remove("TETHER_PKI_DIR")
        .env_remove("TETHER_JOIN_STORE")
        .env_remove("TETHER_JOIN_STORE_LOCK_WAIT")
        .output()
        .expect("running tether-certs");
    out
}

/// `--store-lock-wait` (was a fixed 5 s): `token revoke` while another
/// process holds the store's lock gives up after the wait, naming the store
/// and the wait, and changes nothing; once the lock is free it goes through.
#[test]
fn a_held_store_lock_fails_a_change_after_store_lock_wait() {
    use std::os::fd::AsRawFd;
    use std::time::{Duration, Instant, SystemTime};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let store = d.join("join-tokens.json");
    let lib = tether_certs::JoinStore::open(&store).unwrap();
    let (t, _) = lib
        .create(
            Duration::from_secs(3600),
            "edge-1",
            1,
            "",
            SystemTime::now(),
        )
        .unwrap();
    let held = std::fs::File::create(d.join("join-tokens.json.lock")).unwrap();
    // SAFETY: flock on a descriptor this test owns.
    assert_eq!(
        unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
        0
    );
    let started = Instant::now();
    let mut child = Command::new(bin())
        .arg("--dir")
        .arg(d)
        .args(["token", "revoke", &t.id, "--store-lock-wait", "200ms"])
        .env_remove("TETHER_PKI_DIR")
        .env_remove("TETHER_JOIN_STORE")
        .env_remove("TETHER_JOIN_STORE_LOCK_WAIT")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("tether-certs still waits for the lock after 20 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = started.elapsed();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!status.success(), "revoked under a held lock: {err}");
    assert!(err.contains(&store.display().to_string()), "{err}");
    assert!(
        err.contains("locked by another process for over 200ms"),
        "{err}"
    );
    assert!(took >= Duration::from_millis(200), "{took:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert!(!lib.list().unwrap()[0].revoked);
    drop(held);
    ok(d, &["token", "revoke", &t.id, "--store-lock-wait", "200ms"]);
    assert!(lib.list().unwrap()[0].revoked);
}

fn ok(dir: &Path, args: &[&str]) -> String {
    let out = run(dir, args);
    assert!(
        out.status.success(),
        "tether-certs {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn openssl(args: &[&str]) -> String {
    let out = Command::new("openssl")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("openssl is required by this test and could not be run: {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn text(p: &Path) -> String {
    openssl(&["x509", "-text", "-noout", "-in", &p.display().to_string()])
}

fn first_cert(p: &Path) -> CertificateDer<'static> {
    tether_certs::pem::load_certs(p).unwrap().remove(0)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn client_verifier(ca: &Path) -> Arc<dyn ClientCertVerifier> {
    let roots = tether_certs::pem::load_roots(ca).unwrap();
    rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .unwrap()
}

fn server_verifier(ca: &Path) -> Arc<rustls::client::WebPkiServerVerifier> {
    let roots = tether_certs::pem::load_roots(ca).unwrap();
    rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .unwrap()
}

fn mode(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

fn has_subject(openssl_text: &str, want: &str) -> bool {
    openssl_text
        .lines()
        .any(|l| l.trim_start().starts_with("Subject:") && l.contains(want))
}

#[test]
fn ca_and_every_certificate_kind() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pki");
    let p = |name: &str| -> PathBuf { dir.join(name) };

    let out = ok(&dir, &["ca", "create", "--validity", "5y"]);
    // The printed pin is the kubeadm-style hash of the CA's public key.
    let pin = out
        .lines()
        .find_map(|l| l.strip_prefix("CA pin for joining edges: "))
        .expect("ca create prints the pin")
        .to_string();
    let spki = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "openssl x509 -in {} -pubkey -noout | openssl pkey -pubin -outform der | openssl dgst -sha256 -r",
            p("ca.crt").display()
        ))
        .output()
        .expect("sh");
    let digest = String::from_utf8_lossy(&spki.stdout);
    assert_eq!(pin, format!("sha256:{}", &digest[..64]));
    assert_eq!(mode(&p("ca.key")), 0o600);
    let ca_text = text(&p("ca.crt"));
    assert!(ca_text.contains("CA:TRUE"), "{ca_text}");
    assert!(ca_text.contains("Certificate Sign"), "{ca_text}");

    // A second CA never overwrites the first without --force.
    let again = run(&dir, &["ca", "create"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--force"));

    ok(
        &dir,
        &[
            "issue",
            "cloud-tunnel",
            "--dns",
            "tether-cloud.example",
            "--ip",
            "192.0.2.10",
        ],
    );
    ok(
        &dir,
        &[
            "issue",
            "cloud-kubelet",
            "--dns",
            "tether-cloud",
            "--ip",
            "10.96.0.50",
        ],
    );
    ok(
        &dir,
        &["issue", "edge", "--node", "edge-1", "--validity", "30d"],
    );
    ok(&dir, &["issue", "apiserver-client"]);
    for key in [
        "tunnel.key",
        "kubelet.key",
        "edge-1.key",
        "apiserver-client.key",
    ] {
        assert_eq!(mode(&p(key)), 0o600, "{key}");
    }
    // Every leaf chains to the CA for openssl too.
    for c in [
        "tunnel.crt",
        "kubelet.crt",
        "edge-1.crt",
        "apiserver-client.crt",
    ] {
        let v = openssl(&[
            "verify",
            "-CAfile",
            &p("ca.crt").display().to_string(),
            &p(c).display().to_string(),
        ]);
        assert!(v.contains(": OK"), "{c}: {v}");
    }

    let tunnel = text(&p("tunnel.crt"));
    assert!(
        has_subject(&tunnel, "CN = tether-cloud.example"),
        "{tunnel}"
    );
    assert!(
        tunnel.contains("DNS:tether-cloud.example, IP Address:192.0.2.10"),
        "{tunnel}"
    );
    assert!(tunnel.contains("TLS Web Server Authentication"), "{tunnel}");
    assert!(
        !tunnel.contains("TLS Web Client Authentication"),
        "{tunnel}"
    );
    // The tunnel certificate file carries the CA after the leaf.
    assert_eq!(
        tether_certs::pem::load_certs(&p("tunnel.crt"))
            .unwrap()
            .len(),
        2
    );

    let kubelet = text(&p("kubelet.crt"));
    assert!(
        kubelet.contains("DNS:tether-cloud, IP Address:10.96.0.50"),
        "{kubelet}"
    );
    assert!(
        kubelet.contains("TLS Web Server Authentication"),
        "{kubelet}"
    );

    let edge = text(&p("edge-1.crt"));
    assert!(
        has_subject(&edge, "CN = system:node:edge-1, O = system:nodes"),
        "{edge}"
    );
    assert!(edge.contains("DNS:edge-1"), "{edge}");
    assert!(edge.contains("TLS Web Client Authentication"), "{edge}");
    assert!(!edge.contains("TLS Web Server Authentication"), "{edge}");

    let api = text(&p("apiserver-client.crt"));
    assert!(
        has_subject(
            &api,
            "CN = kube-apiserver-kubelet-client, O = system:masters"
        ),
        "{api}"
    );
    assert!(api.contains("TLS Web Client Authentication"), "{api}");

    // inspect, without openssl.
    let shown = ok(&dir, &["inspect", &p("edge-1.crt").display().to_string()]);
    // A reader that stops early (`inspect … | head -c 1`) is no error: no panic on the
    // broken pipe. 400 certificates print far more than a pipe buffer holds.
    let many: Vec<String> = (0..400)
        .map(|_| p("edge-1.crt").display().to_string())
        .collect();
    let piped = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "'{}' inspect {} | head -c 1 >/dev/null",
            bin(),
            many.iter()
                .map(|m| format!("'{m}'"))
                .collect::<Vec<_>>()
                .join(" ")
        ))
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&piped.stderr).contains("panicked"),
        "{}",
        String::from_utf8_lossy(&piped.stderr)
    );
    assert!(shown.contains("CN=system:node:edge-1"), "{shown}");
    assert!(shown.contains("DNS:edge-1"), "{shown}");
    assert!(shown.contains("clientAuth"), "{shown}");
    assert!(
        shown.contains("expires in 29 days") || shown.contains("expires in 30 days"),
        "{shown}"
    );
    assert!(shown.contains("SHA-256 fingerprint"), "{shown}");
    let fp = openssl(&[
        "x509",
        "-noout",
        "-fingerprint",
        "-sha256",
        "-in",
        &p("edge-1.crt").display().to_string(),
    ]);
    let fp = fp.trim().rsplit('=').next().unwrap().to_string();
    assert!(shown.contains(&fp), "{shown} lacks {fp}");
    let shown = ok(&dir, &["inspect", &p("tunnel.crt").display().to_string()]);
    assert!(
        shown.contains("DNS:tether-cloud.example, IP:192.0.2.10"),
        "{shown}"
    );
    assert!(
        shown.contains(&pin),
        "the CA in the chain shows its pin: {shown}"
    );

    // rustls, both directions: clients as clients, servers as servers.
    let now = UnixTime::now();
    let clients = client_verifier(&p("ca.crt"));
    let servers = server_verifier(&p("ca.crt"));
    clients
        .verify_client_cert(&first_cert(&p("edge-1.crt")), &[], now)
        .unwrap();
    clients
        .verify_client_cert(&first_cert(&p("apiserver-client.crt")), &[], now)
        .unwrap();
    assert!(clients
        .verify_client_cert(&first_cert(&p("tunnel.crt")), &[], now)
        .is_err());
    let name = ServerName::try_from("tether-cloud.example").unwrap();
    servers
        .verify_server_cert(&first_cert(&p("tunnel.crt")), &[], &name, &[], now)
        .unwrap();
    let ip = ServerName::try_from("192.0.2.10").unwrap();
    servers
        .verify_server_cert(&first_cert(&p("tunnel.crt")), &[], &ip, &[], now)
        .unwrap();
    let edge_name = ServerName::try_from("edge-1").unwrap();
    assert!(servers
        .verify_server_cert(&first_cert(&p("edge-1.crt")), &[], &edge_name, &[], now)
        .is_err());
    // Expired: the edge certificate a year on.
    let later =
        UnixTime::since_unix_epoch(std::time::Duration::from_secs(now.as_secs() + 365 * 86400));
    assert!(clients
        .verify_client_cert(&first_cert(&p("edge-1.crt")), &[], later)
        .is_err());

    // Another CA (Ed25519 this time) trusts none of them, and its own
    // certificates verify with rustls and openssl.
    let other = tmp.path().join("other");
    ok(&other, &["ca", "create", "--algorithm", "ed25519"]);
    assert!(text(&other.join("ca.crt")).contains("ED25519"));
    let foreign = client_verifier(&other.join("ca.crt"));
    assert!(foreign
        .verify_client_cert(&first_cert(&p("edge-1.crt")), &[], now)
        .is_err());
    ok(&other, &["issue", "edge", "--node", "edge-2"]);
    foreign
        .verify_client_cert(&first_cert(&other.join("edge-2.crt")), &[], now)
        .unwrap();
    assert!(clients
        .verify_client_cert(&first_cert(&other.join("edge-2.crt")), &[], now)
        .is_err());

    // Bad input is refused with a message.
    let bad = run(&dir, &["issue", "edge", "--node", "Edge_1"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a valid node name"));
    let bad = run(&dir, &["issue", "cloud-tunnel", "--cert", "/dev/null/x"]);
    assert!(!bad.status.success());
}

/// An edge certificate made with `issue edge` is recorded in the join-token store, so a
/// token whose pattern matches the node (without `--allow-reissue`) cannot replace it;
/// `--store` names another store, `--no-record` skips it, and a store that cannot be
/// written stops the issue before any file is written.
#[test]
fn an_edge_issued_by_hand_is_recorded_so_a_token_cannot_replace_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pki");
    ok(&dir, &["ca", "create"]);
    let out = ok(&dir, &["issue", "edge", "--node", "edge-7"]);
    assert!(out.contains("recorded in"), "{out}");
    let store = tether_certs::JoinStore::open(dir.join("join-tokens.json")).unwrap();
    let serial = tether_certs::inspect::summarize(first_cert(&dir.join("edge-7.crt")).as_ref())
        .unwrap()
        .serial;
    let issued = store.issued().unwrap();
    assert_eq!(issued.len(), 1, "{issued:?}");
    assert_eq!(issued[0].node, "edge-7");
    assert_eq!(
        issued[0].serial,
        tether_certs::token::normalize_serial(&serial)
    );
    let listed = ok(&dir, &["token", "list"]);
    assert!(
        listed.contains("by-hand") && listed.contains("edge-7"),
        "{listed}"
    );
    // A token for edge-* is refused edge-7 and still joins edge-8.
    let (token, _) = store
        .create(
            std::time::Duration::from_secs(3600),
            "edge-*",
            2,
            "",
            std::time::SystemTime::now(),
        )
        .unwrap();
    let issue = |_: &tether_certs::Grant| {
        Ok(tether_certs::IssuedCert {
            cert_pem: String::new(),
            serial: "01".into(),
            expires_unix: i64::MAX,
        })
    };
    let now = std::time::SystemTime::now();
    let e = store
        .redeem_and_issue(&token.reveal(), "edge-7", now, issue)
        .unwrap_err();
    assert!(
        matches!(e, tether_certs::JoinError::NodeTaken { .. }),
        "{e}"
    );
    store
        .redeem_and_issue(&token.reveal(), "edge-8", now, issue)
        .unwrap();

    // --store and --no-record.
    let other = tmp.path().join("elsewhere.json");
    ok(
        &dir,
        &[
            "issue",
            "edge",
            "--node",
            "edge-9",
            "--store",
            other.to_str().unwrap(),
        ],
    );
    let elsewhere = tether_certs::JoinStore::open(&other)
        .unwrap()
        .issued()
        .unwrap();
    assert_eq!(elsewhere.len(), 1);
    assert_eq!(elsewhere[0].node, "edge-9");
    let out = ok(&dir, &["issue", "edge", "--node", "edge-10", "--no-record"]);
    assert!(!out.contains("recorded in"), "{out}");
    assert!(!store.issued().unwrap().iter().any(|i| i.node == "edge-10"));

    // A store that cannot be written: refused, nothing written.
    let bad = run(
        &dir,
        &[
            "issue",
            "edge",
            "--node",
            "edge-11",
            "--store",
            "/dev/null/x.json",
        ],
    );
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("--no-record"), "{err}");
    assert!(!dir.join("edge-11.crt").exists() && !dir.join("edge-11.key").exists());
}

#[test]
fn every_subcommand_has_help() {
    let tmp = tempfile::tempdir().unwrap();
    for args in [
        vec!["--help"],
        vec!["ca", "create", "--help"],
        vec!["issue", "cloud-tunnel", "--help"],
        vec!["issue", "cloud-kubelet", "--help"],
        vec!["issue", "edge", "--help"],
        vec!["issue", "apiserver-client", "--help"],
        vec!["inspect", "--help"],
        vec!["token", "create", "--help"],
        vec!["token", "list", "--help"],
        vec!["token", "revoke", "--help"],
    ] {
        let out = ok(tmp.path(), &args);
        assert!(out.contains("Usage:"), "{args:?}: {out}");
    }
    let kubelet = ok(tmp.path(), &["issue", "cloud-kubelet", "--help"]);
    assert!(kubelet.contains("--apiserver-client-ca"), "{kubelet}");
}

#[test]
fn tokens_create_list_revoke() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("pki");
    let store = tmp.path().join("state/join-tokens.json");
    let store_arg = store.display().to_string();
    let out = ok(&dir, &["ca", "create"]);
    let pin = out
        .lines()
        .find_map(|l| l.strip_prefix("CA pin for joining edges: "))
        .unwrap()
        .to_string();

    let out = ok(
        &dir,
        &[
            "token",
            "create",
            "--ttl",
            "2h",
            "--node-pattern",
            "edge-7",
            "--uses",
            "1",
            "--cloud",
            "tunnel.example:10004",
            "--store",
            &store_arg,
        ],
    );
    let cmd = out
        .lines()
        .find(|l| l.starts_with("tether-edge join "))
        .expect("the join command is printed");
    let words: Vec<&str> = cmd.split_whitespace().collect();
    let arg = |flag: &str| {
        let i = words.iter().position(|w| *w == flag).unwrap();
        words[i + 1].to_string()
    };
    assert_eq!(arg("--cloud"), "tunnel.example:10004");
    assert_eq!(arg("--ca-pin"), pin);
    assert_eq!(arg("--node"), "edge-7");
    let token = arg("--token");
    let (id, secret) = token.split_once('.').unwrap();
    assert_eq!(id.len(), 6);
    assert_eq!(secret.len(), 16);

    // Stored hashed, 0600.
    let stored = std::fs::read_to_string(&store).unwrap();
    assert!(!stored.contains(secret));
    assert!(stored.contains(id));
    assert_eq!(mode(&store), 0o600);

    // The store works from the library too: the cloud sees the same token.
    let lib = tether_certs::JoinStore::open(&store).unwrap();
    lib.check(&token, "edge-7", std::time::SystemTime::now())
        .unwrap();

    let list = ok(&dir, &["token", "list", "--store", &store_arg]);
    let row = list
        .lines()
        .find(|l| l.starts_with(id))
        .expect("token listed");
    assert!(row.contains("valid") && row.contains("edge-7"), "{list}");
    assert!(!list.contains(secret));

    let out = ok(&dir, &["token", "revoke", id, "--store", &store_arg]);
    assert!(out.contains("revoked"));
    let list = ok(&dir, &["token", "list", "--store", &store_arg]);
    assert!(
        list.lines()
            .any(|l| l.starts_with(id) && l.contains("revoked")),
        "{list}"
    );
    assert!(lib
        .check(&token, "edge-7", std::time::SystemTime::now())
        .is_err());

    // Unknown ids and bad flags are errors with a message.
    let bad = run(&dir, &["token", "revoke", "nosuch", "--store", &store_arg]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not known"));
    let bad = run(
        &dir,
        &[
            "token", "create", "--ttl", "10", "--node", "edge-1", "--store", &store_arg,
        ],
    );
    assert!(!bad.status.success());
    let bad = run(
        &dir,
        &[
            "token", "create", "--uses", "0", "--node", "edge-1", "--store", &store_arg,
        ],
    );
    assert!(!bad.status.success());
    // A token names its node (or a pattern, explicitly): no silent `*`.
    let bad = run(&dir, &["token", "create", "--store", &store_arg]);
    assert!(!bad.status.success());
    let bad = run(
        &dir,
        &["token", "create", "--node", "edge-*", "--store", &store_arg],
    );
    assert!(!bad.status.success());

    // Default store under --dir; a glob pattern leaves the node to fill in.
    let out = ok(
        &dir,
        &["token", "create", "--node-pattern", "edge-*", "--uses", "3"],
    );
    assert!(out.contains("--node <node name matching"), "{out}");
    assert!(dir.join("join-tokens.json").exists());
}
