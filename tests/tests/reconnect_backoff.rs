//! The edge's reconnect backoff on the wire. A real `tether-edge` dials a
//! UDP port where nothing answers (a socket this test owns, which reads and
//! timestamps every datagram), with `--reconnect-min 50ms`,
//! `--reconnect-max 1200ms`, `--handshake-timeout 50ms` and
//! `--handshake-timeout-max 200ms`. Each round of attempts is one QUIC
//! connection (told apart by its Initial's destination connection ID and
//! source port) that times out unanswered; the quiet time between one
//! attempt's last datagram and the next one's first is the backoff. It must
//! grow from the minimum (each wait at least half of its round's delay,
//! which doubles) and stay within the maximum (the schedule itself is
//! unit-tested in `edge/src/backoff.rs`). Each round's attempt may take
//! twice as long as the last one's, up to `--handshake-timeout-max`: the
//! edge's log names each round's limit (`no answer from the cloud within`:
//! below `--unanswered-attempt-max`, an unanswered attempt gets it all).
//!
//! The binaries must be built first (`cargo build --workspace --bins`).

mod support;

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use support::Env;

/// The one node: the certificate every [`Env`] mints besides its specs'.
const NODE: &str = "edge-intruder";

const MIN: Duration = Duration::from_millis(50);
const MAX: Duration = Duration::from_millis(1200);
/// Rounds watched: the delays 50, 100, 200, 400, 800 ms, then 1.2 s
/// (not 1.6, 3.2, 6.4 s) three times.
const ROUNDS: usize = 9;
/// Allowance for timestamps taken on a loaded machine (this test reads the
/// datagrams on a thread of its own).
const SLACK: Duration = Duration::from_millis(60);
/// Generous bound on one wait above the maximum: a loaded machine, and an
/// attempt's unanswered handshake (up to `--handshake-timeout-max`) if its
/// end sends nothing.
const OVER_MAX: Duration = Duration::from_millis(800);
/// Each round's limit on its attempt, as the edge logs it: 50 ms doubled
/// after each round that timed out, up to `--handshake-timeout-max 200ms`
/// (the default, 8 ×, would go on to 400 ms).
const LIMITS: [&str; ROUNDS] = [
    "50ms", "100ms", "200ms", "200ms", "200ms", "200ms", "200ms", "200ms", "200ms",
];

/// One connection attempt as the test's socket saw it.
#[derive(Debug)]
struct Attempt {
    port: u16,
    /// The Initial's destination connection ID.
    dcid: Vec<u8>,
    first: Instant,
    last: Instant,
    datagrams: usize,
}

/// The destination connection ID of a QUIC long-header packet.
fn dcid(datagram: &[u8]) -> Option<&[u8]> {
    if datagram.first()? & 0x80 == 0 {
        return None;
    }
    let len = usize::from(*datagram.get(5)?);
    datagram.get(6..6 + len)
}

/// Reads `sock` until `n` attempts have been seen and a further one has
/// begun (so the `n`th is over), or for at most `limit`.
fn watch(sock: UdpSocket, n: usize, limit: Duration) -> Vec<Attempt> {
    let deadline = Instant::now() + limit;
    let mut seen: Vec<Attempt> = Vec::new();
    let mut buf = [0u8; 2048];
    sock.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    while seen.len() <= n && Instant::now() < deadline {
        let Ok((len, from)) = sock.recv_from(&mut buf) else {
            continue;
        };
        let at = Instant::now();
        let id = dcid(&buf[..len]).unwrap_or_default().to_vec();
        match seen
            .iter_mut()
            .find(|a| a.port == from.port() && a.dcid == id)
        {
            Some(a) => {
                a.last = at;
                a.datagrams += 1;
            }
            None => seen.push(Attempt {
                port: from.port(),
                dcid: id,
                first: at,
                last: at,
                datagrams: 1,
            }),
        }
    }
    seen.truncate(n);
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_waits_grow_from_the_minimum_and_stay_within_the_maximum() {
    // The environment's cloud is never dialled: it gives the edge its
    // certificates and command line.
    let env = Env::start(&[], &[]).await.unwrap();
    let nothing = UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = nothing.local_addr().unwrap().to_string();
    let watcher = std::thread::spawn(move || watch(nothing, ROUNDS, Duration::from_secs(60)));
    let pair = &env.pki.edges[NODE];
    let edge = env
        .edge_process(
            NODE,
            &pair.cert,
            &pair.key,
            "http://127.0.0.1:9",
            &[],
            &[
                "--cloud",
                &addr,
                "--reconnect-min",
                "50ms",
                "--reconnect-max",
                "1200ms",
                "--handshake-timeout",
                "50ms",
                "--handshake-timeout-max",
                "200ms",
            ],
        )
        .unwrap();
    let attempts = tokio::task::spawn_blocking(move || watcher.join().unwrap())
        .await
        .unwrap();
    // Each round that got no welcome is logged with its limit; the
    // round's line may trail its last datagram a little.
    let mut limits = Vec::new();
    for _ in 0..40 {
        let full = std::fs::read_to_string(edge.log_path()).unwrap_or_default();
        limits = full
            .lines()
            .filter(|l| l.contains("cannot reach the cloud"))
            .filter_map(|l| l.split("no answer from the cloud within ").nth(1))
            .map(|rest| {
                rest.split(|c: char| !c.is_ascii_alphanumeric() && c != '.')
                    .next()
                    .unwrap_or_default()
                    .to_string()
            })
            .collect::<Vec<_>>();
        if limits.len() >= ROUNDS {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = edge.stderr_tail(20);
    drop(edge);
    assert!(
        limits.len() >= ROUNDS && limits[..ROUNDS] == LIMITS,
        "each round's limit: {limits:?}, expected {LIMITS:?}\nthe edge's log:\n{log}"
    );
    assert_eq!(
        attempts.len(),
        ROUNDS,
        "{attempts:#?}\nthe edge's log:\n{log}"
    );
    let waits: Vec<Duration> = attempts
        .windows(2)
        .map(|w| w[1].first.duration_since(w[0].last))
        .collect();
    let report = format!(
        "waits {waits:?}; attempts (port, datagrams) {:?}",
        attempts
            .iter()
            .map(|a| (a.port, a.datagrams))
            .collect::<Vec<_>>()
    );
    eprintln!("{report}");
    for (k, wait) in waits.iter().enumerate() {
        let delay = MIN.saturating_mul(1 << k).min(MAX);
        assert!(
            *wait + SLACK >= delay / 2,
            "wait {k} shorter than half its delay {delay:?}: {report}"
        );
        assert!(
            *wait <= MAX + OVER_MAX,
            "wait {k} beyond --reconnect-max {MAX:?}: {report}"
        );
    }
    // Growing: the first wait is shorter than a wait at the maximum can be.
    assert!(
        waits[0] + SLACK < MAX / 2,
        "the first wait is not short: {report}"
    );
}
