//! Noticing that an edge's address changed under a live connection (QUIC
//! migration, often a NAT rebinding), for every edge with one task.
//!
//! quinn migrates a connection by itself but tells nobody, so the address has
//! to be looked at. One sweep task looks at every watched connection and wakes
//! only the connection whose address changed; an idle edge costs the cloud no
//! timer of its own (before: one task waking every 500 ms per edge, 20,000
//! wake-ups a second with 10,000 edges).
//!
//! The sweep runs when the edge listener's socket ([`Observed`]) receives a
//! short-header packet (the only kind a migrating connection sends) from an
//! address no watched connection had at the last sweep: `--migration-settle`
//! later, so quinn has processed it, and at most once per
//! `--migration-sweep-min-gap` (a stream of packets from unknown sources,
//! spoofed ones included, costs at most that many sweeps). A sweep also runs
//! every `--migration-sweep-interval` whatever arrives, in case the packet
//! that moved a connection was processed only after its sweep. (Before: a
//! sweep every 500 ms, a fifth of the cloud's idle CPU with 10,000 edges,
//! each sweep locking every connection.)

use std::collections::HashMap;
use std::io::IoSliceMut;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::Notify;

use crate::latest::Latest;

/// After a packet from an unknown source, how long its sweep waits, so that
/// quinn has processed the packet (and moved the connection) first.
pub const SETTLE: Duration = Duration::from_millis(50);

/// When the sweep runs (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// A sweep at least this often, whatever arrives (`--migration-sweep-interval`).
    pub interval: Duration,
    /// The least time from one sweep to the next (`--migration-sweep-min-gap`).
    pub min_gap: Duration,
}

struct Entry {
    conn: quinn::Connection,
    /// The address the last sweep saw (a [`Latest`], not a `watch` channel:
    /// one per connected edge).
    addr: Arc<Latest<SocketAddr>>,
}

/// The sources the socket need not report: each with the number of the
/// sweep that last saw it on a watched connection (or when a handshake
/// from it started).
#[derive(Default)]
struct Known {
    sweeps: u64,
    addrs: HashMap<SocketAddr, u64>,
}

/// The connections watched, swept by [`Watcher::run`].
#[derive(Default)]
pub struct Watcher {
    next: AtomicU64,
    watched: Mutex<HashMap<u64, Entry>>,
    known: RwLock<Known>,
    /// Set by [`Watcher::saw`] for a packet from an unknown source.
    asked: Notify,
}

/// One watched connection; unwatched when dropped.
pub struct Watch {
    id: u64,
    watcher: Weak<Watcher>,
    addr: Arc<Latest<SocketAddr>>,
    /// The version of `addr` this watch has seen.
    seen: u64,
}

impl Watcher {
    pub fn new() -> Arc<Watcher> {
        Arc::new(Watcher::default())
    }

    /// Starts watching `conn`'s remote address.
    pub fn watch(self: &Arc<Self>, conn: &quinn::Connection) -> Watch {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let now = conn.remote_address();
        let addr = Arc::new(Latest::new(now));
        self.lock().insert(
            id,
            Entry {
                conn: conn.clone(),
                addr: addr.clone(),
            },
        );
        self.note_handshake(now);
        Watch {
            id,
            watcher: Arc::downgrade(self),
            seen: addr.version(),
            addr,
        }
    }

    /// Takes `source` as known until the sweep after next: a handshake from
    /// it started, so its first packets after the handshake, before the
    /// connection is watched, ask for no sweep.
    pub fn note_handshake(&self, source: SocketAddr) {
        let mut k = self.write_known();
        let n = k.sweeps;
        k.addrs.insert(source, n);
    }

    /// Whether `source` is a watched connection's address as of the last
    /// sweep (or expected).
    pub fn is_known(&self, source: &SocketAddr) -> bool {
        self.known
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .addrs
            .contains_key(source)
    }

    /// A short-header packet came from `source`: asks for a sweep if no
    /// watched connection had that address.
    pub fn saw(&self, source: &SocketAddr) -> bool {
        let known = self.is_known(source);
        if !known {
            self.asked.notify_one();
        }
        known
    }

    /// Connections watched now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sweeps done so far.
    pub fn sweeps(&self) -> u64 {
        self.known.read().unwrap_or_else(|p| p.into_inner()).sweeps
    }

    /// Looks at every watched connection once; wakes those that moved, and
    /// renews the known sources: every watched connection's address, and
    /// those expected since the sweep before.
    pub fn sweep(&self) {
        let seen: Vec<SocketAddr> = self
            .lock()
            .values()
            .map(|e| {
                let now = e.conn.remote_address();
                e.addr.send_if_modified(|a| {
                    let moved = *a != now;
                    *a = now;
                    moved
                });
                now
            })
            .collect();
        // (The socket's lookups wait only for these inserts, not for the
        // connections' locks above.)
        let mut k = self.write_known();
        k.sweeps += 1;
        let n = k.sweeps;
        for a in seen {
            k.addrs.insert(a, n);
        }
        k.addrs.retain(|_, at| *at + 1 >= n);
    }

    /// Sweeps as [`Schedule`] says, for as long as the process runs.
    pub async fn run(self: Arc<Self>, schedule: Schedule) {
        loop {
            let asked = tokio::select! {
                () = self.asked.notified() => true,
                () = tokio::time::sleep(schedule.interval) => false,
            };
            if asked {
                tokio::time::sleep(SETTLE).await;
            }
            self.sweep();
            tokio::time::sleep(schedule.min_gap).await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Entry>> {
        self.watched.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn write_known(&self) -> std::sync::RwLockWriteGuard<'_, Known> {
        self.known.write().unwrap_or_else(|p| p.into_inner())
    }
}

impl Watch {
    /// The connection's next new remote address (pending forever if it never moves).
    pub async fn moved(&mut self) -> SocketAddr {
        // (If the watcher is gone, nothing changes it again: pending forever.)
        self.addr.changed(self.seen).await;
        *self.addr.borrow_and_update(&mut self.seen)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(w) = self.watcher.upgrade() {
            w.lock().remove(&self.id);
        }
    }
}

/// The edge listener's UDP socket, telling the [`Watcher`] of short-header
/// packets from sources it does not know. Everything else is the wrapped
/// socket's.
pub struct Observed {
    inner: Arc<dyn quinn::AsyncUdpSocket>,
    watcher: Arc<Watcher>,
    /// The source last found known: a transfer's packets all come from one,
    /// looked up once.
    last: Mutex<Option<SocketAddr>>,
}

impl Observed {
    pub fn new(inner: Arc<dyn quinn::AsyncUdpSocket>, watcher: Arc<Watcher>) -> Observed {
        Observed {
            inner,
            watcher,
            last: Mutex::new(None),
        }
    }
}

impl std::fmt::Debug for Observed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observed")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// Whether a datagram starts with a short-header (1-RTT) packet: the only
/// kind a connection migrates with (RFC 9000, section 9).
fn short_header(datagram: &[u8]) -> bool {
    datagram.first().is_some_and(|b| b & 0x80 == 0)
}

impl quinn::AsyncUdpSocket for Observed {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn quinn::UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &quinn::udp::Transmit) -> std::io::Result<()> {
        self.inner.try_send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [quinn::udp::RecvMeta],
    ) -> Poll<std::io::Result<usize>> {
        let polled = self.inner.poll_recv(cx, bufs, meta);
        if let Poll::Ready(Ok(n)) = &polled {
            let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            for (m, buf) in meta.iter().zip(bufs.iter()).take(*n) {
                let datagram = buf.get(..m.len).unwrap_or(&[]);
                if !short_header(datagram) || *last == Some(m.addr) {
                    continue;
                }
                if self.watcher.saw(&m.addr) {
                    *last = Some(m.addr);
                }
            }
        }
        polled
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loopback pair whose listener's socket reports to `watcher`:
    /// (dialler's connection, listener's connection, the dialler's endpoint
    /// and the listener's).
    async fn observed_pair(
        watcher: &Arc<Watcher>,
    ) -> (quinn::Connection, quinn::Connection, Vec<quinn::Endpoint>) {
        let w = watcher.clone();
        tether_proto::testing::quic_pair_wrapped(Default::default(), move |s| {
            Arc::new(Observed::new(s, w))
        })
        .await
        .unwrap()
    }

    /// Sends a datagram from `c` every 20 ms until `w` reports a move (10 s
    /// at most): the address it moved to.
    async fn traffic_until_moved(c: &quinn::Connection, w: &mut Watch) -> SocketAddr {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            c.send_datagram(bytes::Bytes::from_static(b"x")).ok();
            if let Ok(a) = tokio::time::timeout(Duration::from_millis(20), w.moved()).await {
                return a;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no migration noticed in 10 s"
            );
        }
    }

    #[tokio::test]
    async fn one_sweep_notices_a_migration_and_a_dropped_watch_is_forgotten() {
        // (client's side, server's side; the client's endpoint first)
        let (c, s, endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        let client = &endpoints[0];
        let watcher = Watcher::new();
        let mut w = watcher.watch(&s);
        assert_eq!(watcher.len(), 1);
        let before = s.remote_address();
        // Nothing moved: a sweep wakes nobody.
        watcher.sweep();
        assert!(
            tokio::time::timeout(Duration::from_millis(100), w.moved())
                .await
                .is_err(),
            "woken without a migration"
        );
        // The client moves to a new socket (a NAT rebinding) and sends from it.
        client
            .rebind(std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
            .unwrap();
        let new = client.local_addr().unwrap();
        assert_ne!(new, before);
        // This listener's socket reports nothing: the interval's sweeps notice.
        let sweeps = tokio::spawn(watcher.clone().run(Schedule {
            interval: Duration::from_millis(20),
            min_gap: Duration::from_millis(1),
        }));
        assert_eq!(traffic_until_moved(&c, &mut w).await, new);
        drop(w);
        assert!(watcher.is_empty());
        sweeps.abort();
    }

    /// The first packets from a new address ask for the sweep that notices
    /// the move: with an interval of an hour, no timed sweep can have.
    #[tokio::test]
    async fn a_packet_from_a_new_address_asks_for_a_sweep() {
        let watcher = Watcher::new();
        let (c, s, endpoints) = observed_pair(&watcher).await;
        let mut w = watcher.watch(&s);
        let sweeps = tokio::spawn(watcher.clone().run(Schedule {
            interval: Duration::from_secs(3600),
            min_gap: Duration::from_millis(10),
        }));
        endpoints[0]
            .rebind(std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
            .unwrap();
        let new = endpoints[0].local_addr().unwrap();
        assert_eq!(traffic_until_moved(&c, &mut w).await, new);
        assert!(
            watcher.is_known(&new),
            "the new address is not known after its sweep"
        );
        sweeps.abort();
    }

    /// Traffic from the addresses of watched connections asks for no sweep:
    /// an idle fleet's keep-alives cost none.
    #[tokio::test]
    async fn packets_from_known_addresses_ask_for_no_sweep() {
        let watcher = Watcher::new();
        let (c, s, _endpoints) = observed_pair(&watcher).await;
        let _w = watcher.watch(&s);
        let sweeps = tokio::spawn(watcher.clone().run(Schedule {
            interval: Duration::from_secs(3600),
            min_gap: Duration::from_millis(1),
        }));
        // The handshake's last packets came before the watch (the pair has
        // no `expect`): the sweep they asked for runs first.
        tokio::time::sleep(SETTLE * 4).await;
        let base = watcher.sweeps();
        for _ in 0..50 {
            c.send_datagram(bytes::Bytes::from_static(b"x")).unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let got = tokio::time::timeout(Duration::from_secs(10), async {
            let mut n = 0;
            while n < 50 {
                s.read_datagram().await.unwrap();
                n += 1;
            }
            n
        })
        .await
        .expect("the listener did not take 50 datagrams in 10 s");
        assert_eq!(got, 50);
        tokio::time::sleep(SETTLE * 2).await;
        assert_eq!(
            watcher.sweeps(),
            base,
            "packets from a known address asked for sweeps"
        );
        sweeps.abort();
    }

    /// The socket's filter, datagram by datagram: short-header packets from
    /// known sources (two, alternating, so each is looked up) ask for
    /// nothing; one from an unknown source asks; a long-header one (a
    /// handshake's) from an unknown source does not.
    #[tokio::test]
    async fn the_socket_asks_only_for_short_header_packets_from_unknown_sources() {
        let watcher = Watcher::new();
        let runtime = quinn::default_runtime().unwrap();
        let listener = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = listener.local_addr().unwrap();
        let socket = Observed::new(runtime.wrap_udp_socket(listener).unwrap(), watcher.clone());
        let senders: Vec<std::net::UdpSocket> = (0..4)
            .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
            .collect();
        let (a, b) = (&senders[0], &senders[1]);
        watcher.note_handshake(a.local_addr().unwrap());
        watcher.note_handshake(b.local_addr().unwrap());
        let sweeps = tokio::spawn(watcher.clone().run(Schedule {
            interval: Duration::from_secs(3600),
            min_gap: Duration::from_millis(1),
        }));
        // Receives `n` datagrams through the socket (10 s at most).
        let receive = |n: usize| {
            let socket = &socket;
            async move {
                let mut got = 0;
                let mut storage = vec![[0u8; 2048]; 8];
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                while got < n {
                    let mut bufs: Vec<IoSliceMut<'_>> =
                        storage.iter_mut().map(|b| IoSliceMut::new(b)).collect();
                    let mut meta = vec![quinn::udp::RecvMeta::default(); bufs.len()];
                    let polled = tokio::time::timeout_at(
                        deadline,
                        std::future::poll_fn(|cx| {
                            quinn::AsyncUdpSocket::poll_recv(socket, cx, &mut bufs, &mut meta)
                        }),
                    )
                    .await
                    .expect("datagrams not received within 10 s")
                    .unwrap();
                    got += polled;
                }
            }
        };
        let short = [0x40u8, 1, 2, 3];
        let long = [0xc0u8, 1, 2, 3];
        for _ in 0..20 {
            a.send_to(&short, to).unwrap();
            b.send_to(&short, to).unwrap();
            receive(2).await;
        }
        senders[2].send_to(&long, to).unwrap();
        receive(1).await;
        tokio::time::sleep(SETTLE * 4).await;
        assert_eq!(
            watcher.sweeps(),
            0,
            "known sources or a handshake packet asked for a sweep"
        );
        senders[3].send_to(&short, to).unwrap();
        receive(1).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while watcher.sweeps() == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "an unknown source's short-header packet asked for no sweep in 10 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        sweeps.abort();
    }

    /// Unknown sources ask for at most one sweep per `min_gap` (+ the settle
    /// wait), however many packets they send; an expected source stays known
    /// until the sweep after next.
    #[tokio::test(start_paused = true)]
    async fn unknown_sources_cost_at_most_one_sweep_per_min_gap() {
        let watcher = Watcher::new();
        let min_gap = Duration::from_secs(1);
        let sweeps = tokio::spawn(watcher.clone().run(Schedule {
            interval: Duration::from_secs(3600),
            min_gap,
        }));
        let stranger = SocketAddr::from(([192, 0, 2, 1], 4433));
        // 10 s of a packet every 10 ms from a source nobody has.
        for _ in 0..1000 {
            assert!(!watcher.saw(&stranger));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let n = watcher.sweeps();
        let most = (Duration::from_secs(10).as_secs_f64() / (min_gap + SETTLE).as_secs_f64()).ceil()
            as u64;
        assert!(
            (most - 1..=most).contains(&n),
            "{n} sweeps in 10 s, expected about {most}"
        );
        // An expected source: known through the next sweep, gone after the one after.
        let edge = SocketAddr::from(([192, 0, 2, 2], 4433));
        watcher.note_handshake(edge);
        watcher.sweep();
        assert!(watcher.is_known(&edge));
        watcher.sweep();
        assert!(
            !watcher.is_known(&edge),
            "an unwatched expected source was kept"
        );
        sweeps.abort();
    }
}
