//! The measurements, each bounded in time: interactive echo, bulk download, and a
//! session watched across a link event (outage, address change).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use http_body_util::{BodyExt, Empty};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::bed::Dial;
use crate::kubelet::{pattern, Body};

fn empty() -> Body {
    Empty::new()
        .map_err(|n: std::convert::Infallible| match n {})
        .boxed()
}

async fn http(dial: &Dial) -> Result<hyper::client::conn::http1::SendRequest<Body>> {
    let io = dial().await?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(conn.with_upgrades());
    Ok(sender)
}

/// `GET path`, body drained; the status.
pub async fn get(dial: &Dial, path: &str) -> Result<u16> {
    let mut s = http(dial).await?;
    let resp = s
        .send_request(Request::get(path).header("host", "edge-1").body(empty())?)
        .await?;
    let status = resp.status().as_u16();
    resp.into_body().collect().await?;
    Ok(status)
}

/// An upgraded exec session (`Upgrade: SPDY/3.1`).
pub async fn exec(dial: &Dial) -> Result<TokioIo<hyper::upgrade::Upgraded>> {
    let mut sender = http(dial).await?;
    let req = Request::post("/exec/default/p1/c?command=sh&stdin=1&stdout=1&tty=1")
        .header("host", "edge-1")
        .header("connection", "Upgrade")
        .header("upgrade", "SPDY/3.1")
        .header("x-stream-protocol-version", "v4.channel.k8s.io")
        .body(empty())?;
    let mut resp = sender.send_request(req).await?;
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        bail!("upgrade answered {}", resp.status());
    }
    Ok(TokioIo::new(hyper::upgrade::on(&mut resp).await?))
}

/// Keystroke-like echo: one byte out, wait for it back, `gap` between rounds;
/// latencies in ms. Each round is bounded by `limit`.
pub async fn interactive(
    dial: &Dial,
    rounds: usize,
    gap: Duration,
    limit: Duration,
) -> Result<Vec<f64>> {
    let mut io = exec(dial).await?;
    let mut out = Vec::with_capacity(rounds);
    let mut b = [0u8; 1];
    for i in 0..rounds {
        let t = Instant::now();
        let sent = b'a' + (i % 26) as u8;
        io.write_all(&[sent]).await?;
        tokio::time::timeout(limit, io.read_exact(&mut b)).await??;
        if b[0] != sent {
            bail!("echo: sent {sent} got {}", b[0]);
        }
        out.push(t.elapsed().as_secs_f64() * 1e3);
        tokio::time::sleep(gap).await;
    }
    Ok(out)
}

/// Downloads `bytes` through the peer, bounded by `limit`; returns MB/s.
pub async fn bulk(dial: &Dial, bytes: u64, limit: Duration) -> Result<f64> {
    let t = Instant::now();
    let got = tokio::time::timeout(limit, async {
        let mut sender = http(dial).await?;
        let req = Request::get(format!("/containerLogs/default/bulk/c?limitBytes={bytes}"))
            .header("host", "edge-1")
            .body(empty())?;
        let resp = sender.send_request(req).await?;
        if resp.status() != StatusCode::OK {
            bail!("bulk answered {}", resp.status());
        }
        let mut body = resp.into_body();
        let mut got = 0u64;
        while let Some(f) = body.frame().await {
            if let Ok(d) = f?.into_data() {
                got += d.len() as u64;
            }
        }
        Ok(got)
    })
    .await;
    let got = match got {
        Ok(r) => r?,
        Err(_) => bail!("bulk of {bytes} bytes not done within {limit:?}"),
    };
    if got != bytes {
        bail!("bulk: got {got} of {bytes} bytes");
    }
    Ok(bytes as f64 / t.elapsed().as_secs_f64() / 1e6)
}

/// `n` downloads of `bytes` each at once; the summed MB/s.
pub async fn parallel(dial: &Dial, n: usize, bytes: u64, limit: Duration) -> Result<f64> {
    let t = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..n {
        let dial = dial.clone();
        tasks.push(tokio::spawn(async move { bulk(&dial, bytes, limit).await }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(n as f64 * bytes as f64 / t.elapsed().as_secs_f64() / 1e6)
}

/// Bulk downloads in a loop until dropped (load for "under bulk").
pub struct Load {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Load {
    /// Starts looping downloads of `bytes` through `dial`.
    pub fn start(dial: Dial, bytes: u64) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let task = tokio::spawn(async move {
            while !s.load(Ordering::Relaxed) {
                if bulk(&dial, bytes, Duration::from_secs(300)).await.is_err() {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        });
        Load { stop, task }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.abort();
    }
}

/// The Prometheus text of a cloud's `/metrics` (its operations listener), within 5 s;
/// `None` if it cannot be had.
pub async fn metrics_text(addr: std::net::SocketAddr) -> Option<String> {
    let fetch = async {
        let mut tcp = tokio::net::TcpStream::connect(addr).await?;
        tcp.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            .await?;
        let mut text = String::new();
        tcp.read_to_string(&mut text).await?;
        Ok::<_, std::io::Error>(text)
    };
    tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .ok()?
        .ok()
}

/// Percentile `p` (0..=1) of `v`.
pub fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let i = ((s.len() as f64 - 1.0) * p).round() as usize;
    s[i.min(s.len() - 1)]
}

/// What happened to one stream across a link event.
#[derive(Debug, Clone, Default)]
pub struct StreamFate {
    /// Bytes sent into the stream (typed, or handed out by the kubelet).
    pub sent: u64,
    /// Bytes received intact, in order.
    pub received: u64,
    /// The stream ended with an error or EOF (`why`).
    pub died: Option<String>,
    /// A byte out of order / missing / duplicated was seen at this offset.
    pub corrupt_at: Option<u64>,
    /// Arrival times of data.
    pub arrivals: Vec<Instant>,
}

impl StreamFate {
    /// First arrival at or after `t`.
    pub fn first_after(&self, t: Instant) -> Option<Duration> {
        self.arrivals.iter().find(|a| **a >= t).map(|a| *a - t)
    }

    /// Longest gap between arrivals within `[from, to]` (including the edges).
    pub fn longest_gap(&self, from: Instant, to: Instant) -> Duration {
        let mut last = from;
        let mut best = Duration::ZERO;
        for a in self.arrivals.iter().filter(|a| **a >= from && **a <= to) {
            best = best.max(*a - last);
            last = *a;
        }
        best.max(to.saturating_duration_since(last))
    }
}

/// An interactive session and a chatty log stream through one peer, watched until
/// [`Watch::finish`].
pub struct Watch {
    stop: Arc<AtomicBool>,
    typed: Arc<Mutex<StreamFate>>,
    log: Arc<Mutex<StreamFate>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    log_id: String,
}

fn lock(m: &Mutex<StreamFate>) -> std::sync::MutexGuard<'_, StreamFate> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Watch {
    /// Opens both streams: a keystroke every `every`; a log at `rate` bytes/s.
    pub async fn start(dial: &Dial, log_id: &str, every: Duration, rate: u64) -> Result<Watch> {
        let io = exec(dial).await?;
        let (mut r, mut w) = tokio::io::split(io);
        let mut sender = http(dial).await?;
        let req = Request::get(format!(
            "/containerLogs/default/chatty/c?follow=true&id={log_id}&rate={rate}"
        ))
        .header("host", "edge-1")
        .body(empty())?;
        let resp = sender.send_request(req).await?;
        if resp.status() != StatusCode::OK {
            bail!("log answered {}", resp.status());
        }
        let mut body = resp.into_body();
        let stop = Arc::new(AtomicBool::new(false));
        let typed = Arc::new(Mutex::new(StreamFate::default()));
        let log = Arc::new(Mutex::new(StreamFate::default()));
        let mut tasks = Vec::new();
        // Typist: stops on a failed write or when told.
        let (s, f) = (stop.clone(), typed.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !s.load(Ordering::Relaxed) {
                let wrote =
                    tokio::time::timeout(Duration::from_secs(2), w.write_all(&[pattern(i)])).await;
                match wrote {
                    Ok(Ok(())) => {
                        i += 1;
                        lock(&f).sent = i;
                    }
                    Ok(Err(e)) => {
                        let mut f = lock(&f);
                        f.died.get_or_insert(format!("write: {e}"));
                        return;
                    }
                    Err(_) => {} // blocked: the tunnel holds back
                }
                tokio::time::sleep(every).await;
            }
        }));
        // Echo reader.
        let f = typed.clone();
        tasks.push(tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            loop {
                match r.read(&mut buf).await {
                    Ok(0) => {
                        lock(&f).died.get_or_insert("EOF".into());
                        return;
                    }
                    Ok(n) => {
                        let mut f = lock(&f);
                        let now = Instant::now();
                        for b in &buf[..n] {
                            if f.corrupt_at.is_none() && *b != pattern(f.received) {
                                f.corrupt_at = Some(f.received);
                            }
                            f.received += 1;
                        }
                        f.arrivals.push(now);
                    }
                    Err(e) => {
                        lock(&f).died.get_or_insert(format!("read: {e}"));
                        return;
                    }
                }
            }
        }));
        // Log reader.
        let f = log.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                match body.frame().await {
                    None => {
                        lock(&f)
                            .died
                            .get_or_insert("clean end (a cut log looked complete)".into());
                        return;
                    }
                    Some(Err(e)) => {
                        lock(&f).died.get_or_insert(format!("body: {e}"));
                        return;
                    }
                    Some(Ok(fr)) => {
                        if let Ok(d) = fr.into_data() {
                            let mut f = lock(&f);
                            for b in d.iter() {
                                if f.corrupt_at.is_none() && *b != pattern(f.received) {
                                    f.corrupt_at = Some(f.received);
                                }
                                f.received += 1;
                            }
                            f.arrivals.push(Instant::now());
                        }
                    }
                }
            }
        }));
        Ok(Watch {
            stop,
            typed,
            log,
            tasks,
            log_id: log_id.to_string(),
        })
    }

    /// Stops typing, lets late echoes arrive for `drain`, and returns
    /// (interactive, log); the log's `sent` is what the kubelet handed out.
    pub async fn finish(
        self,
        drain: Duration,
        kubelet: &crate::kubelet::Kubelet,
    ) -> (StreamFate, StreamFate) {
        self.stop.store(true, Ordering::Relaxed);
        let deadline = Instant::now() + drain;
        while Instant::now() < deadline {
            {
                let t = lock(&self.typed);
                if t.died.is_some() || t.received >= t.sent {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let sent = kubelet.sent(&self.log_id);
        for t in &self.tasks {
            t.abort();
        }
        let typed = lock(&self.typed).clone();
        let mut log = lock(&self.log).clone();
        log.sent = sent;
        (typed, log)
    }
}
