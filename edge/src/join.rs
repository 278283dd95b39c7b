//! The edge's side of bootstrap: `tether-edge join` — obtain this node's
//! certificate from the cloud with a join token, trusting the cloud only
//! through the CA pin.
//!
//! 1. Check the token's form and the pin locally; make a P-256 key and a CSR
//!    naming the node. The key never leaves the device.
//! 2. Dial the cloud over QUIC with ALPN `tether-join/1`, no client
//!    certificate, and a verifier that accepts the cloud only if its chain
//!    holds a CA whose public key hashes to the pin and its leaf chains to
//!    that CA for the name dialled (`tether_certs::PinnedCaVerifier`). A wrong
//!    pin fails the TLS handshake, so the token is never sent.
//! 3. Send the `JoinRequest`, read the `JoinResponse` — refused, nothing
//!    read, when it announces more than `--join-max-message-bytes`; check a
//!    grant (pinned CA, the very CA the handshake verified; a client
//!    certificate for this node and this key) before writing anything.
//! 4. Write `node.key` (0600), `node.crt` and `ca.crt` into the output
//!    directory, each atomically; the edge then starts with
//!    `--cert node.crt --key node.key --ca ca.crt`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tether_certs::files::{write_public, write_secret};
use tether_certs::join::{self, JoinRequest, JoinResponse};
use tether_certs::{CaPin, JoinToken};
use tracing::info;

/// The files a join writes, by name inside the output directory.
pub const NODE_KEY_FILE: &str = "node.key";
pub const NODE_CERT_FILE: &str = "node.crt";
pub const CA_CERT_FILE: &str = "ca.crt";

/// How long the whole join may take unless told (`--join-timeout`'s default).
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Where a successful join put its files.
#[derive(Debug, Clone)]
pub struct JoinedFiles {
    pub key: PathBuf,
    pub cert: PathBuf,
    pub ca: PathBuf,
}

/// Joins `cloud` (`host:port`) as `node`; the TLS server name is the host;
/// the exchange may take [`DEFAULT_JOIN_TIMEOUT`], the answer
/// [`join::DEFAULT_MAX_JOIN_MESSAGE`] bytes.
pub async fn join(
    cloud: &str,
    token: &str,
    ca_pin: &str,
    node: &str,
    out_dir: &Path,
) -> anyhow::Result<JoinedFiles> {
    join_with_server_name(
        cloud,
        None,
        token,
        ca_pin,
        node,
        out_dir,
        DEFAULT_JOIN_TIMEOUT,
        join::DEFAULT_MAX_JOIN_MESSAGE,
    )
    .await
}

/// The host part of `host:port`, `[v6]:port` or a bare host.
fn host_of(cloud: &str) -> &str {
    if let Some(rest) = cloud.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match cloud.rsplit_once(':') {
        Some((host, _)) if !host.contains(':') => host,
        _ => cloud,
    }
}

/// As [`join`], verifying the cloud's certificate for `server_name` when the
/// address dialled is not a name in it. Everything from resolving `cloud`
/// to writing the files must be done within `timeout` (`--join-timeout`): a
/// cloud that accepts and never answers is given up on. An answer of more
/// than `max_answer` bytes (`--join-max-message-bytes`) is refused unread.
#[allow(clippy::too_many_arguments)]
pub async fn join_with_server_name(
    cloud: &str,
    server_name: Option<&str>,
    token: &str,
    ca_pin: &str,
    node: &str,
    out_dir: &Path,
    timeout: Duration,
    max_answer: usize,
) -> anyhow::Result<JoinedFiles> {
    // Everything that can be checked locally is, before any packet leaves.
    let pin = CaPin::parse(ca_pin).context("--ca-pin")?;
    JoinToken::parse(token).context("--token")?;
    let request = tether_certs::make_edge_csr(node).context("--node")?;
    let server_name = server_name.unwrap_or_else(|| host_of(cloud)).to_string();
    let deadline = tokio::time::Instant::now() + timeout;
    let (files, endpoint) = tokio::time::timeout_at(deadline, async {
        let addr: SocketAddr = tokio::net::lookup_host(cloud)
            .await
            .with_context(|| format!("resolving --cloud {cloud}"))?
            .next()
            .with_context(|| format!("--cloud {cloud} resolves to no address"))?;
        let (tls, verifier) = join::join_client_config(pin)?;
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls)
            .context("QUIC TLS configuration")?;
        let bind: SocketAddr = if addr.is_ipv6() {
            "[::]:0".parse()?
        } else {
            "0.0.0.0:0".parse()?
        };
        let mut endpoint = quinn::Endpoint::client(bind).context("binding a UDP socket")?;
        endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
        let conn = endpoint
            .connect(addr, &server_name)
            .with_context(|| format!("dialling {cloud} as {server_name:?}"))?
            .await
            .with_context(|| {
                format!(
                    "the cloud at {cloud} did not prove it holds the CA pinned by {pin} \
                     for the name {server_name:?}; nothing was sent"
                )
            })?;
        let (mut send, mut recv) = conn.open_bi().await.context("opening the join stream")?;
        let req = JoinRequest {
            token: token.trim().to_string(),
            node: node.to_string(),
            csr_pem: request.csr_pem.clone(),
        };
        send.write_all(&join::encode(&req)?)
            .await
            .context("sending the join request")?;
        let _ = send.finish();
        let mut prefix = [0u8; 4];
        recv.read_exact(&mut prefix)
            .await
            .context("reading the cloud's answer")?;
        let len = join::decode_len(prefix, max_answer)
            .context("the cloud's answer is refused (this edge's --join-max-message-bytes)")?;
        let mut body = vec![0u8; len];
        recv.read_exact(&mut body)
            .await
            .context("reading the cloud's answer")?;
        let answer: JoinResponse = join::decode(&body)?;
        conn.close(0u32.into(), b"done");
        let accepted = join::accept_grant(
            node,
            &request.key_pem,
            &pin,
            verifier.matched_ca().as_ref(),
            answer,
        )?;
        std::fs::create_dir_all(out_dir)
            .with_context(|| format!("creating {}", out_dir.display()))?;
        let files = JoinedFiles {
            key: out_dir.join(NODE_KEY_FILE),
            cert: out_dir.join(NODE_CERT_FILE),
            ca: out_dir.join(CA_CERT_FILE),
        };
        write_public(&files.ca, &accepted.ca_pem)?;
        write_secret(&files.key, &request.key_pem)?;
        write_public(&files.cert, &accepted.cert_pem)?;
        anyhow::Ok((files, endpoint))
    })
    .await
    .map_err(|_| anyhow::anyhow!("no answer from {cloud} within --join-timeout ({timeout:?})"))??;
    info!(node, cloud, cert = %files.cert.display(), "joined: certificate written");
    // The files are written: the join succeeded whatever happens next. The
    // close is given what is left of --join-timeout, at most a second, to
    // reach the cloud (so it does not hold the connection until its idle
    // timeout), and is never reported as a failure.
    let close_by = deadline.min(tokio::time::Instant::now() + Duration::from_secs(1));
    let _ = tokio::time::timeout_at(close_by, endpoint.wait_idle()).await;
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts() {
        assert_eq!(host_of("cloud.example:10004"), "cloud.example");
        assert_eq!(host_of("10.0.0.1:10004"), "10.0.0.1");
        assert_eq!(host_of("[::1]:10004"), "::1");
        assert_eq!(host_of("cloud.example"), "cloud.example");
        assert_eq!(host_of("::1"), "::1");
    }

    /// A cloud that completes the pinned TLS handshake, takes the join
    /// request and never answers: the join gives up after `--join-timeout`
    /// (was a fixed 30 s), saying which setting ran out. Returns the cloud's
    /// address and a receiver told when a request arrived.
    async fn silent_join_cloud() -> (SocketAddr, String, tokio::sync::oneshot::Receiver<()>) {
        fake_join_cloud(None).await
    }

    /// A cloud as [`silent_join_cloud`] that, given `answer`, sends those
    /// bytes once the request's length has arrived.
    async fn fake_join_cloud(
        answer: Option<Vec<u8>>,
    ) -> (SocketAddr, String, tokio::sync::oneshot::Receiver<()>) {
        const DAY: Duration = Duration::from_secs(86400);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let ca = tether_certs::Ca::new("silent CA", DAY).unwrap();
        let leaf = ca
            .issue_server(&["cloud.test"], &["127.0.0.1".parse().unwrap()], DAY)
            .unwrap();
        // Leaf, then the CA: the edge verifies the cloud through the pin.
        let mut chain = tether_certs::pem::certs_from_pem(&leaf.cert_pem, "leaf").unwrap();
        chain.extend(tether_certs::pem::certs_from_pem(&ca.cert_pem, "ca").unwrap());
        let key = tether_certs::pem::key_from_pem(&leaf.key_pem, "key").unwrap();
        let mut tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap();
        tls.alpn_protocols = vec![tether_certs::ALPN_JOIN.to_vec()];
        let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls).unwrap();
        let endpoint = quinn::Endpoint::server(
            quinn::ServerConfig::with_crypto(Arc::new(crypto)),
            "127.0.0.1:0".parse().unwrap(),
        )
        .unwrap();
        let addr = endpoint.local_addr().unwrap();
        let (got_tx, got) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let Some(incoming) = endpoint.accept().await else {
                return;
            };
            let Ok(conn) = incoming.await else { return };
            let Ok((mut send, mut recv)) = conn.accept_bi().await else {
                return;
            };
            let mut prefix = [0u8; 4];
            if recv.read_exact(&mut prefix).await.is_ok() {
                let _ = got_tx.send(());
                if let Some(answer) = answer {
                    let _ = send.write_all(&answer).await;
                    let _ = send.finish();
                }
            }
            // Holds the connection open (answering nothing when silent).
            conn.closed().await;
            drop(endpoint);
        });
        (addr, tether_certs::ca_pin(&ca.cert_pem).unwrap(), got)
    }

    #[tokio::test]
    async fn a_cloud_that_never_answers_fails_the_join_after_the_join_timeout() {
        const TIMEOUT: Duration = Duration::from_millis(500);
        let (addr, pin, mut got) = silent_join_cloud().await;
        let out =
            std::env::temp_dir().join(format!("tether-join-unwritten-{}", std::process::id()));
        let started = tokio::time::Instant::now();
        let joined = tokio::time::timeout(
            TIMEOUT * 10,
            join_with_server_name(
                &addr.to_string(),
                Some("cloud.test"),
                "abc123.0123456789abcdef",
                &pin,
                "edge-1",
                &out,
                TIMEOUT,
                join::DEFAULT_MAX_JOIN_MESSAGE,
            ),
        )
        .await
        .expect("the join did not end within 10x --join-timeout");
        let e = format!("{:#}", joined.expect_err("a silent cloud granted a join"));
        assert!(e.contains("--join-timeout (500ms)"), "{e}");
        assert!(started.elapsed() >= TIMEOUT, "{:?}", started.elapsed());
        // The handshake worked and the request arrived: the wait for the
        // answer is what ran out.
        assert!(
            got.try_recv().is_ok(),
            "the request never reached the cloud"
        );
        assert!(!out.exists(), "files written for a join that failed");
    }

    /// An answer announced over `--join-max-message-bytes` (was the fixed
    /// 64 KiB) is refused unread, with an error naming its size, the bound
    /// and the flag, and nothing is written; the same answer under a bound
    /// that takes it is read (here: a refusal, so the join fails for that).
    /// The bound is the least the edge accepts.
    #[tokio::test]
    async fn an_answer_over_the_bound_is_refused_naming_the_flag() {
        let least = join::LEAST_ANSWER_BYTES;
        let answer = join::encode(&JoinResponse::Refused {
            reason: "x".repeat(least),
        })
        .unwrap();
        let said = format!("{} bytes is over the {least}-byte limit", answer.len() - 4);
        for (bound, refused_unread) in [(least, true), (answer.len(), false)] {
            let (addr, pin, _got) = fake_join_cloud(Some(answer.clone())).await;
            let out = std::env::temp_dir()
                .join(format!("tether-join-over-{}-{bound}", std::process::id()));
            let joined = tokio::time::timeout(
                Duration::from_secs(20),
                join_with_server_name(
                    &addr.to_string(),
                    Some("cloud.test"),
                    "abc123.0123456789abcdef",
                    &pin,
                    "edge-1",
                    &out,
                    Duration::from_secs(10),
                    bound,
                ),
            )
            .await
            .expect("the join did not end within 20 s");
            let e = format!("{:#}", joined.expect_err("no grant was sent"));
            if refused_unread {
                assert!(
                    e.contains(&said) && e.contains("--join-max-message-bytes"),
                    "{e}"
                );
            } else {
                assert!(e.contains("the cloud refused the join: xxx"), "{e}");
            }
            assert!(!out.exists(), "files written for a join that failed");
        }
    }
}
