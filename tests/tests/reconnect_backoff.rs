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
//! Once the cloud has not answered for `--reconnect-patient-after`, the edge
//! probes patiently: one attempt at a time, rounds about every
//! `--reconnect-patient-interval` (the second test watches the switch on the
//! same kind of socket); and it is back soon after the cloud answers again,
//! resuming its session when the wait was shorter than the grace period (the
//! third, through a relay that drops every packet for a while).
//!
//! The binaries must be built first (`cargo build --workspace --bins`).

mod support;

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use support::{Env, NodeSpec};

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

/// A real edge with `flags` dialling a UDP port where nothing answers,
/// and the attempts [`watch`] saw there (`n`, within `limit`). The
/// environment's cloud is never dialled: it gives the edge its
/// certificates and command line.
async fn edge_against_silence(
    env: &Env,
    flags: &[&str],
    n: usize,
    limit: Duration,
) -> (tether_tests::process::Proc, Vec<Attempt>) {
    let nothing = UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = nothing.local_addr().unwrap().to_string();
    let watcher = std::thread::spawn(move || watch(nothing, n, limit));
    let pair = &env.pki.edges[NODE];
    let edge = env
        .edge_process(
            NODE,
            &pair.cert,
            &pair.key,
            "http://127.0.0.1:9",
            &[],
            &[&["--cloud", &addr][..], flags].concat(),
        )
        .unwrap();
    let attempts = tokio::task::spawn_blocking(move || watcher.join().unwrap())
        .await
        .unwrap();
    (edge, attempts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_waits_grow_from_the_minimum_and_stay_within_the_maximum() {
    let env = Env::start(&[], &[]).await.unwrap();
    let flags = [
        "--reconnect-min",
        "50ms",
        "--reconnect-max",
        "1200ms",
        "--handshake-timeout",
        "50ms",
        "--handshake-timeout-max",
        "200ms",
    ];
    let (edge, attempts) =
        edge_against_silence(&env, &flags, ROUNDS, Duration::from_secs(60)).await;
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

/// The patient probing's flags for the two tests below: patient after 2 s
/// of silence, rounds about every 1.6 s (drawn from 0.8 to 1.6 s); before
/// that, a second attempt 200 ms after the first.
const PATIENT: &[&str] = &[
    "--reconnect-min",
    "50ms",
    "--reconnect-max",
    "200ms",
    "--reconnect-patient-after",
    "2s",
    "--reconnect-patient-interval",
    "1600ms",
];
const PATIENT_AFTER: Duration = Duration::from_secs(2);
const PATIENT_INTERVAL: Duration = Duration::from_millis(1600);

/// Dense probing, then patient: with attempts of 300 ms, in the first 1.5 s
/// the silent socket sees attempts overlap and follow each other closely; once the edge has gone
/// 2 s without an answer (plus a round, and slack), one attempt at a time,
/// each starting between half and all of the patient interval (and its
/// 300 ms attempt) after the last one ended. The log says so, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cloud_silent_for_long_is_probed_patiently() {
    let env = Env::start(&[], &[]).await.unwrap();
    const WATCH: Duration = Duration::from_secs(10);
    let flags = [
        PATIENT,
        &[
            "--handshake-timeout",
            "300ms",
            "--handshake-timeout-max",
            "300ms",
        ],
    ]
    .concat();
    let (edge, attempts) = edge_against_silence(&env, &flags, 10_000, WATCH).await;
    let full = std::fs::read_to_string(edge.log_path()).unwrap_or_default();
    let log = edge.stderr_tail(30);
    drop(edge);
    let said = full
        .lines()
        .filter(|l| l.contains("probing it one attempt at a time"))
        .count();
    assert_eq!(said, 1, "the patience line, once:\n{log}");
    let t0 = attempts.first().expect("no attempt at all").first;
    let report = attempts
        .iter()
        .map(|a| {
            format!(
                "{:.2}-{:.2}s",
                a.first.duration_since(t0).as_secs_f64(),
                a.last.duration_since(t0).as_secs_f64()
            )
        })
        .collect::<Vec<_>>()
        .join(" ");
    eprintln!("attempts (first-last datagram from the first): {report}");
    let dense = attempts
        .iter()
        .filter(|a| a.first.duration_since(t0) < Duration::from_millis(1500))
        .count();
    assert!(dense >= 4, "{dense} attempts in the first 1.5 s: {report}");
    // Patient from the end of the first round after 2 s (a round lasts at
    // most 300 ms past its last start); the slack covers the edge's start.
    let patient: Vec<&Attempt> = attempts
        .iter()
        .filter(|a| a.first.duration_since(t0) > PATIENT_AFTER + Duration::from_millis(1000))
        .collect();
    assert!(
        patient.len() >= 3,
        "{} patient attempts in {WATCH:?}: {report}",
        patient.len()
    );
    for w in patient.windows(2) {
        let quiet = w[1].first.saturating_duration_since(w[0].last);
        let apart = w[1].first.duration_since(w[0].first);
        assert!(
            w[1].first > w[0].last && quiet + SLACK >= PATIENT_INTERVAL / 2,
            "patient attempts overlap or follow too soon: {report}"
        );
        assert!(
            apart <= PATIENT_INTERVAL + Duration::from_millis(300) + OVER_MAX,
            "patient attempts too far apart: {report}"
        );
    }
}

/// Back once the cloud answers: an edge with open-stream state (its
/// session) probing patiently after 2 s of outage (the grace period is
/// 60 s) resumes its session within a patient interval, an attempt (2 s
/// here, so a loaded machine's handshake fits) and slack of the relay
/// passing packets again, and the tunnel serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patient_edge_is_back_and_resumes_once_the_cloud_answers() {
    const ONE: &[NodeSpec<'static>] = &[NodeSpec {
        name: "edge-1",
        pods: &["default/p1"],
        announce: &["10.77.0.1"],
    }];
    let fast = ["--idle-timeout", "2s", "--keep-alive", "500ms"];
    let cloud_args = [&fast[..], &["--grace", "60s"]].concat();
    const ATTEMPT: Duration = Duration::from_secs(2);
    let edge_args = [
        &fast[..],
        PATIENT,
        &["--handshake-timeout", "2s", "--handshake-timeout-max", "2s"],
    ]
    .concat();
    let mut env = Env::start_with(ONE, &cloud_args, &edge_args, true)
        .await
        .unwrap();
    env.relay.as_ref().unwrap().set_outage(true);
    // The connection dies after the 2 s idle timeout; patient 2 s later
    // (the line is in the edge's log, on stderr).
    let outage = Instant::now();
    let log = env.nodes[0].edge.log_path().to_path_buf();
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("probing it one attempt at a time")
    {
        assert!(
            outage.elapsed() < Duration::from_secs(20),
            "no patience line\n{}",
            env.nodes[0].edge.stderr_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let waited = outage.elapsed();
    // Into the patient rounds, then the link back.
    tokio::time::sleep(PATIENT_INTERVAL).await;
    env.relay.as_ref().unwrap().set_outage(false);
    let back = Instant::now();
    let edge = &mut env.nodes[0].edge;
    let line = edge
        .wait_connected("edge resumed", Duration::from_secs(20))
        .await
        .unwrap();
    let took = back.elapsed();
    eprintln!("patient {waited:?} after the outage began; connected {took:?} after the relay passed packets again: {line}");
    assert!(line.contains("resumed=true"), "{line}");
    // At worst the link came back just after an attempt's Initial, which
    // then timed out; the next round starts within the interval and its
    // handshake goes through at once on loopback.
    assert!(
        took <= PATIENT_INTERVAL + ATTEMPT + OVER_MAX,
        "back {took:?} after the cloud answered again\n{}",
        edge.stderr_tail(30)
    );
    let reply = env
        .client
        .get("/containerLogs/default/p1/c", "edge-1", None, &[])
        .await
        .unwrap();
    assert_eq!(reply.status, hyper::StatusCode::OK, "{}", reply.body);
}
