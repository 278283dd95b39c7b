//! Path-MTU searches across a path that drops larger packets without a word
//! (issue 15, item 4: what an idle edge costs on a metered SIM).
//!
//! The edge's link drops every IP packet over 1,400 bytes and sends no ICMP,
//! as a tunnel inside a carrier's network may ([`BlackHole`]). Both ends
//! search the path's MTU after the handshake; each probe above the hole is
//! lost, and quinn searches the same path again after
//! `--mtu-research-interval`. The tunnel must work across the hole (a bulk
//! echo in both directions), and the drops must come in searches at the
//! interval given, from both ends: more than one search within a few
//! intervals (the flag reaches quinn on both ends), no more than one per
//! interval (it is not searching all the time). The default (6 h) is checked
//! where the flags are parsed (`tether_proto::cli`).
//!
//! And the hard case: the path shrinks under a bulk stream, silently. Only
//! quinn's black-hole detection can bring the packets down to fit; the
//! stream must finish byte-exact on the same connection.
//!
//! Needs root, `ip`, `nft` and the workspace binaries (`cargo build --workspace --bins`).

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use linkemu::{Link, LinkOptions};
use support::{client_in_cloud, echo, get_ok, kubelet_in_edge, spawn_cloud, spawn_edge};
use tether_tests::netns::{BlackHole, Dropped};
use tether_tests::pki;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PATH_MTU: u32 = 1400;
const INTERVAL: Duration = Duration::from_secs(4);

/// The drops once they have stopped growing for `quiet` (bounded by `limit`).
async fn drops_settled(hole: &BlackHole, quiet: Duration, limit: Duration) -> Dropped {
    let deadline = Instant::now() + limit;
    let mut last = hole.dropped().unwrap();
    let mut since = Instant::now();
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = hole.dropped().unwrap();
        if now != last {
            last = now;
            since = Instant::now();
        } else if since.elapsed() >= quiet {
            return last;
        }
    }
    panic!("the drops never stopped growing for {quiet:?} within {limit:?}: {last:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_path_is_searched_again_at_the_interval_and_the_tunnel_works_across_it() {
    let link = Arc::new(
        Link::create(LinkOptions::new())
            .expect("creating the emulated link (needs root, `ip` and `nft`)"),
    );
    let hole = BlackHole::install(&link, PATH_MTU).expect("the black hole (nft)");
    let dir = tempfile::tempdir().unwrap();
    let pki = pki::mint(dir.path(), &["edge-1"]).unwrap();
    let interval = format!("{}s", INTERVAL.as_secs());
    let (_cloud, _) = spawn_cloud(
        "tether-cloud",
        &link,
        &pki,
        dir.path(),
        &["--mtu-research-interval".to_string(), interval.clone()],
    )
    .await;
    let (_kubelet, kubelet_port) = kubelet_in_edge(&link);
    let _edge = spawn_edge(
        &link,
        &pki,
        dir.path(),
        kubelet_port,
        // quinn starts a due search when the connection next sends: a
        // keep-alive every second makes that at most a second late.
        &[
            "--mtu-research-interval",
            &interval,
            "--keep-alive",
            "1s",
            "--keep-alive-min",
            "1s",
            "--keep-alive-max",
            "1s",
        ],
    )
    .await;
    let client = client_in_cloud(&link, &pki);
    get_ok(&client, Duration::from_secs(30))
        .await
        .expect("the pod is routable across the black hole");

    // Full-size packets both ways: they must fit the hole.
    let data: Vec<u8> = (0..2 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    let (_, up) = client
        .upgrade(
            "/exec/default/p1/c?command=cat&input=1&output=1",
            "10.96.0.1:6443",
        )
        .await
        .expect("an exec session across the black hole");
    let back = tokio::time::timeout(
        Duration::from_secs(60),
        echo(TokioIo::new(up), data.clone()),
    )
    .await
    .expect("2 MiB echoed within 60 s across the black hole")
    .expect("the echo");
    assert!(
        back == data,
        "the echo came back different ({} bytes)",
        back.len()
    );

    // The first search (or more of them, by now) is over when the drops
    // stop for most of an interval; then count whole intervals.
    let first = drops_settled(&hole, INTERVAL * 3 / 4, Duration::from_secs(60)).await;
    assert!(
        first.up.0 > 0 && first.down.0 > 0,
        "both ends' probes above {PATH_MTU} bytes must have been dropped: {first:?}"
    );
    let window = INTERVAL * 4;
    let started = Instant::now();
    tokio::time::sleep(window).await;
    let after = hole.dropped().unwrap();
    let took = started.elapsed();
    let probes = |d: Dropped| (d.up.0, d.down.0);
    let (up, down) = (after.up.0 - first.up.0, after.down.0 - first.down.0);
    eprintln!("dropped after the first search {first:?}, {took:?} later {after:?}");
    // A search ends with its probes above the hole lost (quinn tries each
    // size three times): every search drops at least 3 and at most 12
    // packets from each end (1,452- and 1,388-byte probes here, bisecting
    // from 1,326). The intervals fitting the window bound the searches.
    let most = (took.as_secs_f64() / INTERVAL.as_secs_f64()).ceil() as u64 + 1;
    for (end, n) in [("edge", up), ("cloud", down)] {
        assert!(
            n >= 2 * 3,
            "the {end} searched the path less than twice in {took:?} at a {INTERVAL:?} \
             interval: {n} probes dropped (before {:?}, after {:?})",
            probes(first),
            probes(after)
        );
        assert!(
            n <= most * 12,
            "the {end} searched more often than every {INTERVAL:?}: {n} probes dropped in \
             {took:?} (before {:?}, after {:?})",
            probes(first),
            probes(after)
        );
    }
    get_ok(&client, Duration::from_secs(10))
        .await
        .expect("still routable after the searches");
}

/// The hard case: the path shrinks under a bulk stream (a route change into a
/// carrier's tunnel, say), silently. Full-size packets (1,452 bytes, found on
/// the 1,500-byte path) vanish while small ones (acknowledgements,
/// keep-alives) still pass, so the connection stays up and only quinn's
/// black-hole detection (a run of lost full-size packets) can bring the
/// packets down to a size that fits. The stream must finish byte-exact in
/// both directions, on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_that_shrinks_under_a_bulk_stream_is_caught_and_the_stream_finishes() {
    let link = Arc::new(
        Link::create(LinkOptions::new())
            .expect("creating the emulated link (needs root, `ip` and `nft`)"),
    );
    let dir = tempfile::tempdir().unwrap();
    let pki = pki::mint(dir.path(), &["edge-1"]).unwrap();
    let (_cloud, _) = spawn_cloud("tether-cloud", &link, &pki, dir.path(), &[]).await;
    let (_kubelet, kubelet_port) = kubelet_in_edge(&link);
    let edge = spawn_edge(&link, &pki, dir.path(), kubelet_port, &[]).await;
    let client = client_in_cloud(&link, &pki);
    get_ok(&client, Duration::from_secs(30))
        .await
        .expect("the pod is routable");
    // Let the first search reach 1,452 bytes.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let data: Vec<u8> = (0..32 * 1024 * 1024u32).map(|i| (i % 253) as u8).collect();
    let (_, up) = client
        .upgrade(
            "/exec/default/p1/c?command=cat&input=1&output=1",
            "10.96.0.1:6443",
        )
        .await
        .expect("an exec session");
    // The first quarter crosses the full path; the rest is written only
    // once the path has shrunk.
    let (mut r, mut w) = tokio::io::split(TokioIo::new(up));
    let (shrunk_tx, shrunk) = tokio::sync::oneshot::channel::<()>();
    let want = data.clone();
    let writer = tokio::spawn(async move {
        let (first, rest) = data.split_at(data.len() / 4);
        w.write_all(first).await?;
        w.flush().await?;
        let _ = shrunk.await;
        w.write_all(rest).await?;
        w.shutdown().await?;
        Ok::<_, std::io::Error>(w)
    });
    let reader = tokio::spawn(async move {
        let mut back = Vec::new();
        let res = tokio::time::timeout(Duration::from_secs(120), r.read_to_end(&mut back)).await;
        (res, back)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let hole = BlackHole::install(&link, PATH_MTU).expect("the black hole (nft)");
    let shrank = Instant::now();
    shrunk_tx.send(()).expect("the writer is waiting");
    let (res, back) = reader.await.unwrap();
    res.expect("32 MiB echoed within 120 s although the path shrank to 1,400 bytes under it")
        .expect("the echo");
    let _w = writer.await.unwrap().expect("the writer");
    assert!(
        back == want,
        "the echo came back different ({} bytes)",
        back.len()
    );
    let dropped = hole.dropped().unwrap();
    assert!(
        dropped.up.0 > 0 && dropped.down.0 > 0,
        "full-size packets must have met the hole both ways (else this proved nothing): {dropped:?}"
    );
    let connects = edge.connects();
    assert_eq!(connects, 1, "the edge had to reconnect");
    eprintln!(
        "dropped while the path shrank: {dropped:?}; the last 24 MiB took {:?}",
        shrank.elapsed()
    );
    get_ok(&client, Duration::from_secs(10))
        .await
        .expect("still routable");
}
