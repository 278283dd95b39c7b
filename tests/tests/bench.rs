//! Benchmarks against real peers on the same emulated link (issue
//! "Benchmarks against real peers"). Measures and prints; asserts nothing
//! about speed — it fails only if the harness itself breaks.
//!
//! The edge side (kubelet stand-in, `tether-edge`, the `ssh -R` client) runs
//! in the link emulator's edge namespace; the cloud side (`tether-cloud`,
//! `sshd`, the client playing the apiserver) in its cloud namespace. Peers:
//! - **direct**: the client talks to the kubelet stand-in across the link —
//!   the limit;
//! - **ssh -R**: an OpenSSH reverse tunnel, every session multiplexed over one
//!   TCP connection (the architecture of KubeEdge's and Konnectivity's tunnels);
//! - **tether**: `tether-cloud` + `tether-edge`, a QUIC stream per session.
//!
//! Run: `scripts/bench.sh` (release build, all links, longer runs; writes
//! `target/bench/results.md`). Under `cargo test` it runs the quick variant
//! (clean link, small sizes) so CI keeps the harness from rotting.

mod support;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use http_body_util::BodyExt;
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use linkemu::{Impairment, Link, LinkOptions};
use support::{cloud_cmd, empty, spawn_edge, Client, Io, Kubelet, API};
use tether_tests::process::{Proc, SpawnOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type Conn = Box<dyn Io>;
type Dial = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<Conn>> + Send>> + Send + Sync>;

/// Sizes and durations of one run.
#[derive(Clone, Copy)]
struct Plan {
    full: bool,
    echo_rounds: usize,
    bulk_bytes: u64,
    parallel_bytes: u64,
    idle_window: Duration,
}

impl Plan {
    fn from_env() -> Plan {
        if std::env::var("TETHER_BENCH")
            .map(|v| v == "full")
            .unwrap_or(false)
        {
            Plan {
                full: true,
                echo_rounds: 300,
                bulk_bytes: 64 << 20,
                parallel_bytes: 8 << 20,
                idle_window: Duration::from_secs(60),
            }
        } else {
            Plan {
                full: false,
                echo_rounds: 60,
                bulk_bytes: 4 << 20,
                parallel_bytes: 1 << 20,
                idle_window: Duration::from_secs(10),
            }
        }
    }
}

/// One tunnel (or none) between the client and the kubelet stand-in.
struct Peer {
    name: &'static str,
    dial: Dial,
    host: &'static str,
}

/// A connection from inside the cloud namespace.
fn ns_tcp(link: &Arc<Link>, addr: std::net::SocketAddr) -> Dial {
    let link = link.clone();
    Arc::new(move || {
        let link = link.clone();
        Box::pin(async move {
            let std = tokio::task::spawn_blocking(move || {
                link.in_cloud(move || std::net::TcpStream::connect(addr))
            })
            .await??
            .with_context(|| format!("connecting to {addr}"))?;
            std.set_nodelay(true)?;
            std.set_nonblocking(true)?;
            Ok(Box::new(tokio::net::TcpStream::from_std(std)?) as Conn)
        })
    })
}

async fn http(dial: &Dial) -> Result<hyper::client::conn::http1::SendRequest<support::Body>> {
    let io = dial().await?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(conn.with_upgrades());
    Ok(sender)
}

/// Keystroke-like echo: one byte out, wait for it back; latencies in ms.
async fn interactive(peer: &Peer, rounds: usize) -> Result<Vec<f64>> {
    let mut sender = http(&peer.dial).await?;
    let req = Request::post("/exec/default/p1/c?command=sh&stdin=1&tty=1")
        .header("host", peer.host)
        .header("connection", "Upgrade")
        .header("upgrade", "SPDY/3.1")
        .body(empty())?;
    let mut resp = sender.send_request(req).await?;
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        bail!("{}: upgrade answered {}", peer.name, resp.status());
    }
    let mut io = TokioIo::new(hyper::upgrade::on(&mut resp).await?);
    let mut out = Vec::with_capacity(rounds);
    let mut b = [0u8; 1];
    for i in 0..rounds {
        let t = Instant::now();
        io.write_all(&[b'a' + (i % 26) as u8]).await?;
        tokio::time::timeout(Duration::from_secs(30), io.read_exact(&mut b)).await??;
        out.push(t.elapsed().as_secs_f64() * 1e3);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(out)
}

/// Downloads `bytes` through the peer; returns MB/s.
async fn bulk(dial: &Dial, host: &str, bytes: u64) -> Result<f64> {
    let mut sender = http(dial).await?;
    let req = Request::get(format!("/containerLogs/default/bulk/c?limitBytes={bytes}"))
        .header("host", host)
        .body(empty())?;
    let t = Instant::now();
    let resp = sender.send_request(req).await?;
    let mut body = resp.into_body();
    let mut got = 0u64;
    while let Some(f) = tokio::time::timeout(Duration::from_secs(120), body.frame()).await? {
        if let Ok(d) = f?.into_data() {
            got += d.len() as u64;
        }
    }
    if got != bytes {
        bail!("bulk: got {got} of {bytes} bytes");
    }
    Ok(bytes as f64 / t.elapsed().as_secs_f64() / 1e6)
}

fn pct(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let i = ((s.len() as f64 - 1.0) * p).round() as usize;
    s[i.min(s.len() - 1)]
}

/// Everything of one link profile.
struct Bed {
    link: Arc<Link>,
    _dir: tempfile::TempDir,
    _kubelet: Kubelet,
    _cloud: Proc,
    edge: Proc,
    _sshd: Proc,
    _ssh: Proc,
    peers: Vec<Peer>,
}

async fn bed(imp: Impairment, edge_args: &[&str]) -> Result<Bed> {
    let link = Arc::new(Link::create(LinkOptions::new().with_impairment(imp))?);
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    let pki = tether_tests::pki::mint(d, &["edge-1"])?;
    let listener = link.in_edge(|| std::net::TcpListener::bind("0.0.0.0:0"))??;
    let kport = listener.local_addr()?.port();
    let kubelet = Kubelet::start_on(listener, "edge-1", &["default/p1", "default/bulk"])?;
    let mut cloud = Proc::spawn(
        "tether-cloud",
        cloud_cmd(&link, &pki, &[]),
        d,
        SpawnOptions::default(),
    )?;
    cloud
        .wait_line("cloud ready", Duration::from_secs(20), |l| {
            l.starts_with("tether-cloud ready")
        })
        .await?;
    let edge = spawn_edge(&link, &pki, d, kport, edge_args).await;

    // sshd in the cloud namespace, ssh -R from the edge namespace.
    std::fs::create_dir_all("/run/sshd")?;
    let keygen = |path: &std::path::Path| -> Result<()> {
        let ok = std::process::Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-f"])
            .arg(path)
            .status()?
            .success();
        if !ok {
            bail!("ssh-keygen failed");
        }
        Ok(())
    };
    keygen(&d.join("host_key"))?;
    keygen(&d.join("client_key"))?;
    std::fs::copy(d.join("client_key.pub"), d.join("authorized_keys"))?;
    let cloud_ip = link.cloud_ip();
    std::fs::write(
        d.join("sshd_config"),
        format!(
            "Port 2222\nListenAddress {cloud_ip}\nHostKey {}\nAuthorizedKeysFile {}\nPermitRootLogin prohibit-password\n\
             StrictModes no\nUsePAM no\nAllowTcpForwarding yes\nPidFile {}\nLogLevel ERROR\n",
            d.join("host_key").display(),
            d.join("authorized_keys").display(),
            d.join("sshd.pid").display()
        ),
    )?;
    let sshd_bin = ["/usr/sbin/sshd", "/usr/bin/sshd"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .context("sshd not installed (scripts/setup.sh installs openssh-server)")?;
    let mut cmd = link.exec_in_cloud(sshd_bin);
    cmd.args(["-D", "-e", "-f"]).arg(d.join("sshd_config"));
    let sshd = Proc::spawn(
        "sshd",
        tokio::process::Command::from(cmd),
        d,
        SpawnOptions::default(),
    )?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut cmd = link.exec_in_edge("ssh");
    cmd.args([
        "-N",
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "ExitOnForwardFailure=yes",
    ])
    .args([
        "-o",
        "ServerAliveInterval=5",
        "-o",
        "BatchMode=yes",
        "-p",
        "2222",
        "-i",
    ])
    .arg(d.join("client_key"))
    .args([
        "-R",
        &format!("127.0.0.1:18080:127.0.0.1:{kport}"),
        &format!("root@{cloud_ip}"),
    ]);
    let ssh = Proc::spawn(
        "ssh-R",
        tokio::process::Command::from(cmd),
        d,
        SpawnOptions::default(),
    )?;
    let ssh_dial = ns_tcp(&link, "127.0.0.1:18080".parse()?);
    let deadline = Instant::now() + Duration::from_secs(20);
    while ssh_dial().await.is_err() {
        if Instant::now() > deadline {
            bail!(
                "ssh -R never came up: {}",
                std::fs::read_to_string(d.join("ssh-R.log")).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let l2 = link.clone();
    let client = Client::new(&pki, API.parse()?)?.with_dial(Arc::new(move |a| {
        l2.in_cloud(|| std::net::TcpStream::connect(a))
            .map_err(std::io::Error::other)?
    }));
    let tether: Dial = Arc::new(move || {
        let c = client.clone();
        Box::pin(async move { Ok(Box::new(c.connect(None, false).await?) as Conn) })
    });
    let direct = ns_tcp(&link, std::net::SocketAddr::from((link.edge_ip(), kport)));
    // Wait until the edge reported its pods.
    let deadline = Instant::now() + Duration::from_secs(20);
    while bulk(&tether, "edge-1", 1).await.is_err() {
        if Instant::now() > deadline {
            bail!("tether never routable");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let peers = vec![
        Peer {
            name: "direct",
            dial: direct,
            host: "edge-1",
        },
        Peer {
            name: "ssh -R",
            dial: ssh_dial,
            host: "edge-1",
        },
        Peer {
            name: "tether",
            dial: tether,
            host: "edge-1",
        },
    ];
    Ok(Bed {
        link,
        _dir: dir,
        _kubelet: kubelet,
        _cloud: cloud,
        edge,
        _sshd: sshd,
        _ssh: ssh,
        peers,
    })
}

fn ratio(tether: f64, other: f64) -> String {
    if other > 0.0 {
        format!("{:.2}", tether / other)
    } else {
        "-".into()
    }
}

async fn run_link(name: &str, imp: Impairment, plan: Plan, out: &mut String) -> Result<()> {
    let b = bed(imp, &[]).await?;
    out.push_str(&format!("\n### Link: {name}\n\n"));
    // 1. Interactive, idle and under a bulk stream through the same tunnel.
    out.push_str("| peer | echo p50 ms | p99 ms | max ms | under bulk p50 | p99 | max |\n|---|---|---|---|---|---|---|\n");
    let mut rows = Vec::new();
    for p in &b.peers {
        let idle = interactive(p, plan.echo_rounds)
            .await
            .with_context(|| format!("{} interactive", p.name))?;
        let (dial, host) = (p.dial.clone(), p.host);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s2 = stop.clone();
        let load = tokio::spawn(async move {
            while !s2.load(std::sync::atomic::Ordering::Relaxed) {
                if bulk(&dial, host, 8 << 20).await.is_err() {
                    break;
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let loaded = interactive(p, plan.echo_rounds)
            .await
            .with_context(|| format!("{} interactive under load", p.name))?;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        load.abort();
        rows.push((
            p.name,
            [
                pct(&idle, 0.5),
                pct(&idle, 0.99),
                pct(&idle, 1.0),
                pct(&loaded, 0.5),
                pct(&loaded, 0.99),
                pct(&loaded, 1.0),
            ],
        ));
    }
    for (n, v) in &rows {
        out.push_str(&format!(
            "| {n} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |\n",
            v[0], v[1], v[2], v[3], v[4], v[5]
        ));
    }
    let t = rows
        .iter()
        .find(|r| r.0 == "tether")
        .map(|r| r.1)
        .unwrap_or_default();
    for (n, v) in rows.iter().filter(|r| r.0 != "tether") {
        out.push_str(&format!(
            "| tether ÷ {n} | {} | {} | {} | {} | {} | {} |\n",
            ratio(t[0], v[0]),
            ratio(t[1], v[1]),
            ratio(t[2], v[2]),
            ratio(t[3], v[3]),
            ratio(t[4], v[4]),
            ratio(t[5], v[5])
        ));
    }
    // 2. Bulk: one stream, ten in parallel.
    out.push_str(&format!(
        "\n| peer | 1 stream MB/s ({} MiB) | 10 streams MB/s (sum, {} KiB each) |\n|---|---|---|\n",
        plan.bulk_bytes >> 20,
        plan.parallel_bytes >> 10
    ));
    let mut bulk_rows = Vec::new();
    for p in &b.peers {
        let one = bulk(&p.dial, p.host, plan.bulk_bytes)
            .await
            .with_context(|| format!("{} bulk", p.name))?;
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..10 {
            let (dial, host) = (p.dial.clone(), p.host);
            let n = plan.parallel_bytes;
            tasks.push(tokio::spawn(async move { bulk(&dial, host, n).await }));
        }
        for t in tasks {
            t.await??;
        }
        let ten = 10.0 * plan.parallel_bytes as f64 / t0.elapsed().as_secs_f64() / 1e6;
        bulk_rows.push((p.name, one, ten));
    }
    for (n, one, ten) in &bulk_rows {
        out.push_str(&format!("| {n} | {one:.1} | {ten:.1} |\n"));
    }
    let t = bulk_rows
        .iter()
        .find(|r| r.0 == "tether")
        .map(|r| (r.1, r.2))
        .unwrap_or_default();
    for (n, one, ten) in bulk_rows.iter().filter(|r| r.0 != "tether") {
        out.push_str(&format!(
            "| tether ÷ {n} | {} | {} |\n",
            ratio(t.0, *one),
            ratio(t.1, *ten)
        ));
    }
    let _ = &b.link;
    Ok(())
}

/// Edge footprint: stripped size, idle RSS, wake-ups per minute.
async fn footprint(plan: Plan, out: &mut String) -> Result<()> {
    let b = bed(Impairment::clean(), &["--pods-refresh", "5s"]).await?;
    let pid = b.edge.pid().context("edge pid")?;
    let bin = tether_tests::bins::binary("tether-edge")?;
    let stripped =
        std::env::temp_dir().join(format!("tether-edge-stripped-{}", std::process::id()));
    std::fs::copy(&bin, &stripped)?;
    let strip_ok = std::process::Command::new("strip")
        .arg(&stripped)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    let size = std::fs::metadata(&stripped)?.len();
    let _ = std::fs::remove_file(&stripped);
    let switches = || -> Result<u64> {
        let mut n = 0;
        for t in std::fs::read_dir(format!("/proc/{pid}/task"))? {
            let s = std::fs::read_to_string(t?.path().join("status"))?;
            for l in s.lines() {
                if let Some(v) = l
                    .strip_prefix("voluntary_ctxt_switches:")
                    .or_else(|| l.strip_prefix("nonvoluntary_ctxt_switches:"))
                {
                    n += v.trim().parse::<u64>().unwrap_or(0);
                }
            }
        }
        Ok(n)
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = switches()?;
    tokio::time::sleep(plan.idle_window).await;
    let wakeups = (switches()? - before) as f64 * 60.0 / plan.idle_window.as_secs_f64();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .unwrap_or("?")
        .trim()
        .to_string();
    out.push_str(&format!(
        "\n### Edge footprint ({} build)\n\n| figure | value |\n|---|---|\n| tether-edge binary{} | {:.1} MiB |\n| idle RSS (connected, keep-alive 10 s, pods read every 5 s) | {rss} |\n| wake-ups per minute when idle (context switches, all threads) | {wakeups:.0} |\n",
        if cfg!(debug_assertions) { "debug" } else { "release" },
        if strip_ok { ", stripped" } else { " (strip failed: unstripped)" },
        size as f64 / 1048576.0
    ));
    Ok(())
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
            })
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let date = std::process::Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    format!(
        "{cores} cores, {cpu}, {date}, {} build",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    )
}

fn main() -> Result<()> {
    let plan = Plan::from_env();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut out = format!(
        "## Tether benchmarks ({})\n\nMachine: {}. Peers on the same emulated link (userspace TUN router between two network namespaces).\nInteractive: 1-byte writes through an upgraded exec stream, echoed; under bulk: while 8 MiB downloads loop through the same tunnel.\n",
        if plan.full { "full" } else { "quick" },
        machine()
    );
    let mut links = vec![("clean", Impairment::clean(), plan)];
    if plan.full {
        // Sizes shrink with the link so every peer finishes in bounded time
        // (TCP with 3 % loss at 200 ms RTT moves tens of KB/s).
        let lossy = Plan {
            echo_rounds: 100,
            bulk_bytes: 16 << 20,
            parallel_bytes: 2 << 20,
            ..plan
        };
        let bad = Plan {
            echo_rounds: 40,
            bulk_bytes: 2 << 20,
            parallel_bytes: 256 << 10,
            ..plan
        };
        links.push((
            "50 ms RTT, 1 % loss",
            Impairment::clean()
                .with_delay(Duration::from_millis(25))
                .with_loss(1.0),
            lossy,
        ));
        links.push((
            "200 ms RTT, 3 % loss, 10 Mbit/s",
            Impairment::clean()
                .with_delay(Duration::from_millis(100))
                .with_loss(3.0)
                .with_rate(10_000_000 / 8),
            bad,
        ));
    }
    // TETHER_BENCH_ONLY=<text>: only the links whose name contains it.
    if let Ok(only) = std::env::var("TETHER_BENCH_ONLY") {
        links.retain(|l| l.0.contains(only.as_str()));
    }
    let result: Result<()> = rt.block_on(async {
        for (name, imp, plan) in links {
            run_link(name, imp, plan, &mut out)
                .await
                .with_context(|| format!("link {name}"))?;
        }
        footprint(plan, &mut out).await
    });
    println!("{out}");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(
        dir.join(if plan.full {
            "results.md"
        } else {
            "results-quick.md"
        }),
        &out,
    )?;
    match result {
        Ok(()) => {
            println!("bench: 1 passed, 0 failed");
            Ok(())
        }
        Err(e) => {
            println!("bench: 0 passed, 1 failed");
            Err(e)
        }
    }
}
