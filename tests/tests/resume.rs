//! Sessions survive the network (on loopback): an outage longer than the QUIC
//! idle timeout kills the connection on both sides; the edge reconnects with
//! its resume token and every open stream continues with no byte lost or
//! duplicated, while the client's HTTPS connection to the cloud stays open.
//! The network-namespace fault tests (link emulator) cover the same on real
//! links with delay, loss and address changes.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use hyper::StatusCode;
use hyper_util::rt::TokioIo;
use support::{Env, NodeSpec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ONE: &[NodeSpec<'static>] = &[NodeSpec {
    name: "edge-1",
    pods: &["default/p1"],
    announce: &["10.77.0.1"],
}];
const FAST: &[&str] = &["--idle-timeout", "2s", "--keep-alive", "500ms"];

fn pattern_byte(i: u64) -> u8 {
    (i.wrapping_mul(2654435761) >> 13) as u8
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_resume_after_the_connection_dies() {
    let cloud_args = [FAST, &["--grace", "60s"]].concat();
    let mut env = Env::start_with(ONE, &cloud_args, FAST, true).await.unwrap();

    // A follow log and an echo stream, both running through the outage.
    let resp = env.client.follow_log("default/p1").await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut log = resp.into_body();
    let log_text = Arc::new(std::sync::Mutex::new(String::new()));
    let lt = log_text.clone();
    let log_task = tokio::spawn(async move {
        while let Some(Ok(f)) = log.frame().await {
            if let Ok(d) = f.into_data() {
                lt.lock().unwrap().push_str(&String::from_utf8_lossy(&d));
            }
        }
    });

    let (_, up) = env
        .client
        .upgrade(
            "/exec/default/p1/c?command=cat&input=1&output=1",
            "10.96.0.1:6443",
        )
        .await
        .unwrap();
    let (mut r, mut w) = tokio::io::split(TokioIo::new(up));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    let (stop2, written2) = (stop.clone(), written.clone());
    let writer = tokio::spawn(async move {
        let mut off = 0u64;
        while !stop2.load(Ordering::Relaxed) {
            let chunk: Vec<u8> = (off..off + 4096).map(pattern_byte).collect();
            w.write_all(&chunk).await?;
            off += 4096;
            written2.store(off, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        w.shutdown().await?;
        Ok::<_, std::io::Error>(off)
    });
    let received = Arc::new(AtomicU64::new(0));
    let rcv = received.clone();
    let reader = tokio::spawn(async move {
        let mut off = 0u64;
        let mut buf = vec![0u8; 65536];
        loop {
            let n = r.read(&mut buf).await?;
            if n == 0 {
                return Ok::<_, anyhow::Error>(off);
            }
            for (i, b) in buf[..n].iter().enumerate() {
                anyhow::ensure!(
                    *b == pattern_byte(off + i as u64),
                    "echo byte {} wrong",
                    off + i as u64
                );
            }
            off += n as u64;
            rcv.store(off, Ordering::Relaxed);
        }
    });

    tokio::time::sleep(Duration::from_secs(1)).await;
    let relay = env.relay.as_ref().unwrap();
    relay.set_outage(true);
    let before = received.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        received.load(Ordering::Relaxed) - before < 2 << 20,
        "no traffic should pass during the outage"
    );
    relay.set_outage(false);
    let restored = Instant::now();
    let at_restore = received.load(Ordering::Relaxed);
    let edge = &mut env.nodes[0].edge;
    let line = edge
        .wait_connected("edge resumed", Duration::from_secs(20))
        .await
        .unwrap();
    assert!(
        line.contains("resumed=true"),
        "the edge must resume its session: {line}"
    );
    let resumed_after = restored.elapsed();
    while received.load(Ordering::Relaxed) == at_restore {
        assert!(
            restored.elapsed() < Duration::from_secs(20),
            "echo did not resume"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let first_byte_after = restored.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let total = writer.await.unwrap().unwrap();
    let got = tokio::time::timeout(Duration::from_secs(20), reader)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(got, total, "every echoed byte exactly once");

    // The log: consecutive lines, none lost or doubled, across the outage.
    let text = log_text.lock().unwrap().clone();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() > 100, "{} lines", lines.len());
    for (i, l) in lines.iter().enumerate() {
        if i + 1 < lines.len() {
            assert_eq!(*l, format!("edge-1 line {i}"), "log line {i}");
        }
    }
    log_task.abort();
    println!(
        "FIGURE resume after 5 s outage: session resumed {:.0} ms after restore, first echoed byte {:.0} ms after restore; {} echo bytes and {} log lines intact",
        resumed_after.as_secs_f64() * 1e3,
        first_byte_after.as_secs_f64() * 1e3,
        total,
        lines.len()
    );
    let cloud_log = env.cloud_log();
    assert!(
        cloud_log.contains("resumed=true") || cloud_log.contains("resumed: true"),
        "cloud must log the resume"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_longer_than_grace_ends_streams_with_an_error() {
    let cloud_args = [FAST, &["--grace", "2s"]].concat();
    let env = Env::start_with(ONE, &cloud_args, FAST, true).await.unwrap();
    let resp = env.client.follow_log("default/p1").await.unwrap();
    let mut body = resp.into_body();
    tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    env.relay.as_ref().unwrap().set_outage(true);
    let t = Instant::now();
    let outcome = support::body_end(&mut body, Duration::from_secs(30))
        .await
        .expect("must end within bounded time");
    assert!(outcome.is_err(), "must end as an error, not a clean end");
    let took = t.elapsed();
    assert!(took < Duration::from_secs(15), "{took:?}");
    println!(
        "FIGURE grace expiry: stream ended {:.1} s into the outage (idle 2 s + grace 2 s)",
        took.as_secs_f64()
    );
}
