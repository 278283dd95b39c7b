//! Test support for the apiserver-sim integration tests: a tiny fake kubelet (TLS server
//! recording request heads, SNI and client certificates; 101 + echo for upgrades, a chunked
//! body for `/containerLogs`, text for `/metrics`), certificates, the apiserver-sim process
//! and a kubectl runner. Every wait is bounded.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;

pub const KUBECTL_128: &str = "/usr/lib/google-cloud-sdk/bin/kubectl.1.28";
pub const KUBECTL_133: &str = "/usr/lib/google-cloud-sdk/bin/kubectl.1.33";
pub const LOG_LINES: &str = "line one\nline two\nline three\n";
pub const METRICS: &str = "# TYPE fake_kubelet_up gauge\nfake_kubelet_up 1\n";

/// One request head the fake kubelet received.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    pub target: String,
    /// (lower-case name, value), in order.
    pub headers: Vec<(String, String)>,
    pub sni: Option<String>,
    pub client_cert: bool,
    pub alpn: Option<String>,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("")
    }
    pub fn query(&self) -> &str {
        self.target.split_once('?').map(|x| x.1).unwrap_or("")
    }
}

/// PEM texts of a test PKI.
pub struct Pki {
    pub dir: tempfile::TempDir,
    pub client_ca_pem: String,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    pub kubelet_cert_pem: String,
    pub kubelet_key_pem: String,
    /// The kubelet's self-signed serving certificate as a file (usable as `--kubelet-ca`).
    pub kubelet_cert: PathBuf,
    /// The client CA as a file (a wrong `--kubelet-ca`).
    pub client_ca: PathBuf,
}

pub fn pki() -> Pki {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "test-ca");
    let ca_key = KeyPair::generate().unwrap();
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);

    let mut cp = CertificateParams::new(Vec::<String>::new()).unwrap();
    cp.distinguished_name
        .push(DnType::CommonName, "kube-apiserver-kubelet-client");
    cp.distinguished_name
        .push(DnType::OrganizationName, "system:masters");
    let ck = KeyPair::generate().unwrap();
    let cc = cp.signed_by(&ck, &issuer).unwrap();
    let client_cert = dir.path().join("client.crt");
    let client_key = dir.path().join("client.key");
    std::fs::write(&client_cert, cc.pem()).unwrap();
    std::fs::write(&client_key, ck.serialize_pem()).unwrap();

    let kp = CertificateParams::new(vec!["127.0.0.1".to_string(), "edge-2.example".to_string()])
        .unwrap();
    let kk = KeyPair::generate().unwrap();
    let kc = kp.self_signed(&kk).unwrap();
    let kubelet_cert = dir.path().join("kubelet.crt");
    std::fs::write(&kubelet_cert, kc.pem()).unwrap();
    let client_ca = dir.path().join("client-ca.crt");
    std::fs::write(&client_ca, ca.pem()).unwrap();
    Pki {
        kubelet_cert,
        client_ca,
        client_ca_pem: ca.pem(),
        client_cert,
        client_key,
        kubelet_cert_pem: kc.pem(),
        kubelet_key_pem: kk.serialize_pem(),
        dir,
    }
}

/// The fake kubelet.
pub struct FakeKubelet {
    pub port: u16,
    pub seen: Arc<Mutex<Vec<Recorded>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeKubelet {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeKubelet {
    pub async fn start(pki: &Pki) -> FakeKubelet {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_pemfile::certs(&mut pki.client_ca_pem.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .allow_unauthenticated()
        .build()
        .unwrap();
        let certs: Vec<CertificateDer<'static>> =
            rustls_pemfile::certs(&mut pki.kubelet_cert_pem.as_bytes())
                .collect::<Result<_, _>>()
                .unwrap();
        let key: PrivateKeyDer<'static> =
            rustls_pemfile::private_key(&mut pki.kubelet_key_pem.as_bytes())
                .unwrap()
                .unwrap();
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs, key)
            .unwrap();
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        let acceptor = TlsAcceptor::from(Arc::new(cfg));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let seen2 = seen.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let acceptor = acceptor.clone();
                let seen = seen2.clone();
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(
                        Duration::from_secs(60),
                        serve_one(acceptor, tcp, seen),
                    )
                    .await;
                });
            }
        });
        FakeKubelet { port, seen, task }
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.seen.lock().unwrap().clone()
    }

    /// Waits (≤ `limit`) for a request whose path starts with `prefix`.
    pub async fn wait_for(&self, prefix: &str, limit: Duration) -> Option<Recorded> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Some(r) = self
                .requests()
                .into_iter()
                .find(|r| r.path().starts_with(prefix))
            {
                return Some(r);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }
}

async fn serve_one(
    acceptor: TlsAcceptor,
    tcp: tokio::net::TcpStream,
    seen: Arc<Mutex<Vec<Recorded>>>,
) -> std::io::Result<()> {
    let mut tls = acceptor.accept(tcp).await?;
    let (sni, client_cert, alpn) = {
        let (_, conn) = tls.get_ref();
        (
            conn.server_name().map(str::to_string),
            conn.peer_certificates().is_some_and(|c| !c.is_empty()),
            conn.alpn_protocol()
                .map(|a| String::from_utf8_lossy(a).into_owned()),
        )
    };
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p;
        }
        if buf.len() > 64 * 1024 {
            return Ok(());
        }
        let n = tls.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let rest = buf[head_end + 4..].to_vec();
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or("").split(' ');
    let method = first.next().unwrap_or("").to_string();
    let target = first.next().unwrap_or("").to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let rec = Recorded {
        method,
        target,
        headers,
        sni,
        client_cert,
        alpn,
    };
    seen.lock().unwrap().push(rec.clone());

    if rec.header("upgrade").is_some() && rec.path().starts_with("/exec/default/gone/") {
        let body = "forbidden: exec denied by the fake kubelet";
        let resp = format!(
            "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        tls.write_all(resp.as_bytes()).await?;
        tls.shutdown().await?;
        return Ok(());
    }
    if rec.header("upgrade").is_some() && rec.path().starts_with("/attach/") {
        tls.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            .await?;
        tls.shutdown().await?;
        return Ok(());
    }
    if let Some(upgrade) = rec.header("upgrade") {
        if upgrade.eq_ignore_ascii_case("websocket") {
            let key = rec.header("sec-websocket-key").unwrap_or("");
            let proto = rec
                .header("sec-websocket-protocol")
                .and_then(|p| p.split(',').next())
                .unwrap_or("")
                .trim()
                .to_string();
            let resp = format!(
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {}\r\nSec-WebSocket-Protocol: {proto}\r\n\r\n",
                derive_accept_key(key.as_bytes())
            );
            tls.write_all(resp.as_bytes()).await?;
            if rec.path().starts_with("/exec/") && proto == "v5.channel.k8s.io" {
                // stdout "hi\n", then a Success status on the error channel, then close.
                let mut out = Vec::new();
                ws_frame(&mut out, 0x2, &[&[1u8][..], b"hi\n"].concat());
                ws_frame(
                    &mut out,
                    0x2,
                    &[&[3u8][..], br#"{"metadata":{},"status":"Success"}"#].concat(),
                );
                ws_frame(&mut out, 0x8, &[0x03, 0xe8]);
                tls.write_all(&out).await?;
                tls.flush().await?;
                // Drain until the client goes away.
                let _ = tokio::time::timeout(Duration::from_secs(5), async {
                    while tls.read(&mut chunk).await.map(|n| n > 0).unwrap_or(false) {}
                })
                .await;
                return Ok(());
            }
        } else {
            let version = rec
                .header("x-stream-protocol-version")
                .and_then(|p| p.split(',').next())
                .unwrap_or("")
                .trim()
                .to_string();
            let resp = format!(
                "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: {upgrade}\r\nX-Stream-Protocol-Version: {version}\r\n\r\n"
            );
            tls.write_all(resp.as_bytes()).await?;
        }
        tls.write_all(&rest).await?;
        tls.flush().await?;
        // Echo until EOF, then close our side.
        loop {
            let n = tls.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            tls.write_all(&chunk[..n]).await?;
            tls.flush().await?;
        }
        tls.shutdown().await?;
        return Ok(());
    }

    let path = rec.path().to_string();
    if path.starts_with("/containerLogs/default/gone/") {
        let body = "container \"c1\" in pod \"gone\" is not available";
        let resp = format!(
            "HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        tls.write_all(resp.as_bytes()).await?;
    } else if path.starts_with("/containerLogs/") {
        tls.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
            .await?;
        for line in LOG_LINES.split_inclusive('\n') {
            tls.write_all(format!("{:x}\r\n{line}\r\n", line.len()).as_bytes())
                .await?;
            tls.flush().await?;
        }
        tls.write_all(b"0\r\n\r\n").await?;
    } else if path == "/metrics" {
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{METRICS}",
            METRICS.len()
        );
        tls.write_all(resp.as_bytes()).await?;
    } else {
        tls.write_all(
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot found",
        )
        .await?;
    }
    tls.flush().await?;
    tls.shutdown().await?;
    Ok(())
}

/// An unmasked (server → client) WebSocket frame.
fn ws_frame(out: &mut Vec<u8>, opcode: u8, payload: &[u8]) {
    out.push(0x80 | opcode);
    if payload.len() < 126 {
        out.push(payload.len() as u8);
    } else {
        out.push(126);
        out.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    }
    out.extend_from_slice(payload);
}

/// A running apiserver-sim.
pub struct Apiserver {
    pub child: tokio::process::Child,
    pub kubeconfig: PathBuf,
    pub port: u16,
    pub ca_pem: String,
    pub home: tempfile::TempDir,
}

impl Apiserver {
    /// Starts the binary with `args` (plus listen/kubeconfig/client cert) and waits ≤ 15 s
    /// for its kubeconfig.
    pub async fn start(pki: &Pki, args: &[String]) -> Apiserver {
        let home = tempfile::tempdir().expect("tempdir");
        let kubeconfig = home.path().join("kubeconfig");
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_apiserver-sim"));
        cmd.arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--write-kubeconfig")
            .arg(&kubeconfig)
            .arg("--kubelet-client-cert")
            .arg(&pki.client_cert)
            .arg("--kubelet-client-key")
            .arg(&pki.client_key)
            .args(args)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("spawning apiserver-sim");
        let start = Instant::now();
        loop {
            if let Ok(text) = std::fs::read_to_string(&kubeconfig) {
                let server = yaml_value(&text, "server:");
                let port: u16 = server
                    .rsplit(':')
                    .next()
                    .and_then(|p| p.parse().ok())
                    .expect("port in kubeconfig server");
                let ca = base64::engine::general_purpose::STANDARD
                    .decode(yaml_value(&text, "certificate-authority-data:"))
                    .expect("CA data");
                return Apiserver {
                    child,
                    kubeconfig,
                    port,
                    ca_pem: String::from_utf8(ca).expect("CA PEM"),
                    home,
                };
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("apiserver-sim exited early: {status}");
            }
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "no kubeconfig after 15 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Runs kubectl (which must exist) with this kubeconfig; bounded by `limit`, killed on
    /// timeout. Returns (exit success, stdout, stderr, timed out).
    pub async fn kubectl(&self, kubectl: &str, args: &[&str], limit: Duration) -> KubectlRun {
        assert!(
            Path::new(kubectl).exists(),
            "{kubectl} is missing: these tests need real kubectl binaries"
        );
        let mut cmd = tokio::process::Command::new(kubectl);
        cmd.arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .env("HOME", self.home.path())
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("spawning kubectl");
        let mut out = child.stdout.take().expect("stdout pipe");
        let mut err = child.stderr.take().expect("stderr pipe");
        let out_task = tokio::spawn(async move {
            let mut v = Vec::new();
            let _ = out.read_to_end(&mut v).await;
            v
        });
        let err_task = tokio::spawn(async move {
            let mut v = Vec::new();
            let _ = err.read_to_end(&mut v).await;
            v
        });
        let (success, timed_out) = match tokio::time::timeout(limit, child.wait()).await {
            Ok(status) => (status.map(|s| s.success()).unwrap_or(false), false),
            Err(_) => {
                let _ = child.kill().await;
                (false, true)
            }
        };
        let stdout = out_task.await.unwrap_or_default();
        let stderr = err_task.await.unwrap_or_default();
        KubectlRun {
            success,
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
            timed_out,
        }
    }
}

#[derive(Debug)]
pub struct KubectlRun {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
    pub timed_out: bool,
}

fn yaml_value(text: &str, key: &str) -> String {
    text.lines()
        .find_map(|l| l.trim().strip_prefix(key))
        .map(|v| v.trim().trim_matches('"').to_string())
        .unwrap_or_else(|| panic!("{key} missing in kubeconfig:\n{text}"))
}

/// A rustls client config trusting `ca_pem`, ALPN http/1.1.
pub fn client_config(ca_pem: &str) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(cfg)
}
