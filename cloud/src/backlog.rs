//! The waiting line for handshake slots: edge Initials that arrived while
//! every `--max-pending-handshakes` slot was busy, at most one per source
//! address (IP and UDP port).
//!
//! An edge that hears nothing back starts another connection attempt from
//! the same socket every second (and its QUIC retransmits each attempt's
//! Initial). After a cloud restart every edge does so at once, and a line
//! that queued every attempt served the same edge up to four times, each a
//! full TLS handshake, while the other edges' attempts timed out behind them.
//! Here a newer Initial from the same source takes the older one's place in
//! the line (the older is dropped: the edge waits for every attempt alike),
//! so the cloud's handshake capacity goes to distinct edges, and a waiting
//! entry is dropped only when its newest Initial has waited the whole wait.
//! The line holds at most `--max-waiting-handshakes` sources; an Initial
//! beyond that is dropped (its QUIC retransmits it later).
//!
//! It also knows which sources have a connection in handshake or
//! established. An edge dials every attempt of one round from one socket
//! and each new round from a new one, so an Initial that had to wait while
//! its source already has a connection here is another attempt of an edge
//! the cloud is already serving: it is dropped rather than handshaked (a
//! storm's other waste). Only waiting Initials are judged so: while a slot
//! is free every attempt starts at once, as an edge on a lossy link wants.
//!
//! Pure bookkeeping, generic over what waits (a `quinn::Incoming` in the
//! cloud); the tokio glue — one task per entry waiting on the slot
//! semaphore — is in [`crate::tunnel`].

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Instant;

/// What [`Backlog::offer`] did with an item.
#[derive(Debug)]
pub enum Offer<T> {
    /// A new entry: the caller starts its waiter.
    Queued,
    /// It took the place of this older item of the same source (drop it);
    /// the entry's waiter serves the new one.
    Replaced(T),
    /// The line is full: the item is handed back (drop it).
    Full(T),
}

struct Entry<T> {
    item: T,
    /// When `item` arrived.
    since: Instant,
}

/// The waiting items by source, at most one each, and the sources with a
/// connection.
pub struct Backlog<T> {
    limit: usize,
    entries: HashMap<SocketAddr, Entry<T>>,
    /// Connections (in handshake or established) by the source they came from.
    live: HashMap<SocketAddr, u32>,
}

impl<T> Backlog<T> {
    /// A line of at most `limit` sources (at least 1).
    pub fn new(limit: usize) -> Self {
        Backlog {
            limit: limit.max(1),
            entries: HashMap::new(),
            live: HashMap::new(),
        }
    }

    /// Queues `item` from `source` (arrived `now`), in place of an older one
    /// from the same source.
    pub fn offer(&mut self, source: SocketAddr, item: T, now: Instant) -> Offer<T> {
        if let Some(e) = self.entries.get_mut(&source) {
            let old = std::mem::replace(&mut e.item, item);
            e.since = now;
            return Offer::Replaced(old);
        }
        if self.entries.len() >= self.limit {
            return Offer::Full(item);
        }
        self.entries.insert(source, Entry { item, since: now });
        Offer::Queued
    }

    /// The waiter of `source` got a slot: its newest item.
    pub fn take(&mut self, source: SocketAddr) -> Option<T> {
        self.entries.remove(&source).map(|e| e.item)
    }

    /// When the waiting item of `source` arrived (the waiter's wait runs
    /// from then).
    pub fn since(&self, source: SocketAddr) -> Option<Instant> {
        self.entries.get(&source).map(|e| e.since)
    }

    /// A connection from `source` started its handshake.
    pub fn started(&mut self, source: SocketAddr) {
        *self.live.entry(source).or_insert(0) += 1;
    }

    /// A connection from `source` (counted by [`Backlog::started`]) ended.
    pub fn ended(&mut self, source: SocketAddr) {
        if let Some(n) = self.live.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                self.live.remove(&source);
            }
        }
    }

    /// Whether `source` has a connection in handshake or established: a
    /// waiting Initial of it is another attempt of an edge already served.
    pub fn is_served(&self, source: SocketAddr) -> bool {
        self.live.contains_key(&source)
    }

    /// Sources waiting.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no source waits.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn src(port: u16) -> SocketAddr {
        SocketAddr::from(([192, 0, 2, 1], port))
    }

    #[test]
    fn a_newer_initial_of_a_source_takes_the_older_ones_place() {
        let t0 = Instant::now();
        let mut b = Backlog::new(8);
        assert!(matches!(b.offer(src(1), "a1", t0), Offer::Queued));
        assert!(matches!(b.offer(src(2), "b1", t0), Offer::Queued));
        let t1 = t0 + Duration::from_secs(1);
        match b.offer(src(1), "a2", t1) {
            Offer::Replaced(old) => assert_eq!(old, "a1"),
            other => panic!("expected a replacement, got {other:?}"),
        }
        // One entry per source; the wait runs from the newest Initial.
        assert_eq!(b.len(), 2);
        assert_eq!(b.since(src(1)), Some(t1));
        assert_eq!(b.since(src(2)), Some(t0));
        assert_eq!(b.take(src(1)), Some("a2"));
        assert_eq!(b.take(src(1)), None);
        assert_eq!(b.since(src(1)), None);
        // Another port of the same IP is another source (another edge behind the NAT).
        assert!(matches!(b.offer(src(3), "c1", t1), Offer::Queued));
        assert_eq!(b.len(), 2);
    }

    #[test]
    fn a_source_is_served_while_any_of_its_connections_lives() {
        let mut b: Backlog<()> = Backlog::new(8);
        assert!(!b.is_served(src(1)));
        b.started(src(1));
        b.started(src(1));
        assert!(b.is_served(src(1)));
        assert!(!b.is_served(src(2)));
        b.ended(src(1));
        assert!(b.is_served(src(1)));
        b.ended(src(1));
        assert!(!b.is_served(src(1)));
        // An unmatched end is harmless.
        b.ended(src(1));
        assert!(!b.is_served(src(1)));
    }

    #[test]
    fn the_line_holds_at_most_its_limit_of_sources() {
        let t0 = Instant::now();
        let mut b = Backlog::new(2);
        assert!(matches!(b.offer(src(1), 1, t0), Offer::Queued));
        assert!(matches!(b.offer(src(2), 2, t0), Offer::Queued));
        match b.offer(src(3), 3, t0) {
            Offer::Full(item) => assert_eq!(item, 3),
            other => panic!("expected the line full, got {other:?}"),
        }
        // A source already waiting still replaces its own entry when full.
        assert!(matches!(b.offer(src(2), 22, t0), Offer::Replaced(2)));
        assert_eq!(b.take(src(1)), Some(1));
        assert!(matches!(b.offer(src(3), 3, t0), Offer::Queued));
        assert_eq!(b.len(), 2);
        assert!(!b.is_empty());
    }
}
