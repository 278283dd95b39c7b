//! Noticing that an edge's address changed under a live connection (QUIC
//! migration, often a NAT rebinding), for every edge with one timer.
//!
//! quinn migrates a connection by itself but tells nobody, so the address has
//! to be looked at. One sweep task looks at every watched connection every
//! [`SWEEP`] and wakes only the connection whose address changed; an idle
//! edge costs the cloud no timer of its own (before: one task waking every
//! 500 ms per edge, 20,000 wake-ups a second with 10,000 edges).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::latest::Latest;

/// How often the sweep looks at every connection's address.
pub const SWEEP: Duration = Duration::from_millis(500);

struct Entry {
    conn: quinn::Connection,
    /// The address the last sweep saw (a [`Latest`], not a `watch` channel:
    /// one per connected edge).
    addr: Arc<Latest<SocketAddr>>,
}

/// The connections watched, swept by [`Watcher::run`].
#[derive(Default)]
pub struct Watcher {
    next: AtomicU64,
    watched: Mutex<HashMap<u64, Entry>>,
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
        let addr = Arc::new(Latest::new(conn.remote_address()));
        self.lock().insert(
            id,
            Entry {
                conn: conn.clone(),
                addr: addr.clone(),
            },
        );
        Watch {
            id,
            watcher: Arc::downgrade(self),
            seen: addr.version(),
            addr,
        }
    }

    /// Connections watched now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Looks at every watched connection once; wakes those that moved.
    pub fn sweep(&self) {
        for e in self.lock().values() {
            let now = e.conn.remote_address();
            e.addr.send_if_modified(|a| {
                let moved = *a != now;
                *a = now;
                moved
            });
        }
    }

    /// Sweeps every `every`, for as long as the process runs.
    pub async fn run(self: Arc<Self>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.sweep();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Entry>> {
        self.watched.lock().unwrap_or_else(|p| p.into_inner())
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let sweeps = tokio::spawn(watcher.clone().run(Duration::from_millis(20)));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let moved = loop {
            // Traffic from the new address makes the server migrate.
            c.send_datagram(bytes::Bytes::from_static(b"x")).ok();
            if let Ok(a) = tokio::time::timeout(Duration::from_millis(200), w.moved()).await {
                break a;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no migration noticed in 10 s"
            );
        };
        assert_eq!(moved, new);
        drop(w);
        assert!(watcher.is_empty());
        sweeps.abort();
    }
}
