//! Handshake starvation (issue 14, item 3): a flood of QUIC Initials from
//! sources that never answer (as spoofed ones never do) must not keep a real
//! edge out.
//!
//! `tether-cloud` runs in the cloud namespace of an emulated link with few
//! handshake slots; a flooder inside that namespace sends freshly made
//! Initials (real ClientHellos, each a new connection) from 512 loopback
//! source addresses at ~300 a second and never reads an answer. A real edge
//! is then started across the link and must be connected and serving within
//! a bound. Without address validation the flood holds every slot for the
//! handshake timeout and the edge's Initials are dropped.
//!
//! Needs root, `ip` and the workspace binaries (`cargo build --workspace --bins`).

mod support;

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper::StatusCode;
use linkemu::{Link, LinkOptions};
use support::{client_in_cloud, kubelet_in_edge, spawn_cloud, spawn_edge};
use tether_tests::pki;

/// A client QUIC configuration good enough to produce an Initial.
fn client_config(pki: &pki::Pki) -> quinn_proto::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut pki.tether_ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let mut tls = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    tls.alpn_protocols = vec![tether_proto::handshake::ALPN_TUNNEL.to_vec()];
    quinn_proto::ClientConfig::new(Arc::new(
        quinn_proto::crypto::rustls::QuicClientConfig::try_from(tls).unwrap(),
    ))
}

/// Sends Initials to `target` from `sockets` round robin at `rate` a second
/// until `stop`; returns how many were sent.
fn flood(
    sockets: Vec<UdpSocket>,
    target: SocketAddr,
    cfg: quinn_proto::ClientConfig,
    rate: u32,
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
) {
    let mut ep = quinn_proto::Endpoint::new(
        Arc::new(quinn_proto::EndpointConfig::default()),
        None,
        false,
        None,
    );
    let gap = Duration::from_secs(1) / rate;
    let start = Instant::now();
    let mut buf = Vec::new();
    // Bounded: the test stops it, and it stops by itself after 2 minutes.
    while !stop.load(Ordering::Relaxed) && start.elapsed() < Duration::from_secs(120) {
        let n = sent.load(Ordering::Relaxed);
        let now = Instant::now();
        let (_h, mut conn) = ep
            .connect(now, cfg.clone(), target, pki::CLOUD_SERVER_NAME)
            .unwrap();
        buf.clear();
        if let Some(t) = conn.poll_transmit(now, 1, &mut buf) {
            let s = &sockets[n as usize % sockets.len()];
            let _ = s.send_to(&buf[..t.size], target);
            sent.fetch_add(1, Ordering::Relaxed);
        }
        // The connection (and its handle) is forgotten: this source never answers.
        let due = start + gap * (n as u32 + 1);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_unanswered_initials_does_not_keep_a_real_edge_out() {
    let link = Arc::new(
        Link::create(LinkOptions::new()).expect("creating the emulated link (needs root and `ip`)"),
    );
    let dir = tempfile::tempdir().unwrap();
    let pki = pki::mint(dir.path(), &["edge-1"]).unwrap();
    let cloud_args: Vec<String> = [
        "--max-pending-handshakes",
        "16",
        "--handshake-timeout",
        "10s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (cloud, _) = spawn_cloud("tether-cloud", &link, &pki, dir.path(), &cloud_args).await;

    // 512 sources (127.1.x.y) inside the cloud namespace.
    let sockets: Vec<UdpSocket> = link
        .in_cloud(|| {
            (0..512u32)
                .map(|i| {
                    let ip = Ipv4Addr::new(127, 1, (i / 250) as u8, (i % 250 + 1) as u8);
                    UdpSocket::bind((ip, 0)).unwrap()
                })
                .collect()
        })
        .unwrap();
    let target: SocketAddr = (Ipv4Addr::LOCALHOST, support::TUNNEL_PORT).into();
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let flooder = {
        let (cfg, stop, sent) = (client_config(&pki), stop.clone(), sent.clone());
        std::thread::spawn(move || flood(sockets, target, cfg, 300, stop, sent))
    };
    // Let the flood take whatever slots it can.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let (_kubelet, kubelet_port) = kubelet_in_edge(&link);
    let t = Instant::now();
    let edge = spawn_edge(&link, &pki, dir.path(), kubelet_port, &[]).await;
    let connected = t.elapsed();
    let client = client_in_cloud(&link, &pki);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = client
            .get("/containerLogs/default/p1/c", "10.96.0.1:6443", None, &[])
            .await;
        if matches!(&r, Ok(r) if r.status == StatusCode::OK) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "pod never routable under the flood"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let serving = t.elapsed();
    stop.store(true, Ordering::Relaxed);
    flooder.join().unwrap();
    let sent = sent.load(Ordering::Relaxed);
    println!(
        "FIGURE handshake flood: {sent} Initials at 300/s from 512 sources; edge connected after {:.1} s, serving after {:.1} s",
        connected.as_secs_f64(),
        serving.as_secs_f64()
    );
    assert!(sent > 800, "the flood sent only {sent} Initials");
    assert!(
        connected < Duration::from_secs(5),
        "the edge took {connected:?} to get in under the flood"
    );
    drop(edge);
    drop(cloud);
}
