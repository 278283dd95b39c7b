//! Draining a replica on SIGTERM (a rolling upgrade, a scale-in): which edge
//! is told to move when.
//!
//! [`Cloud::shutdown`](crate::Cloud::shutdown) turns the replica not-ready
//! and makes the edge listener refuse new connections, then calls
//! [`move_edges`]: every connected edge gets a slot, spread evenly over
//! `--drain-spread` (so the other replicas take the fleet's handshakes a few
//! at a time, not as one storm). At its slot an edge with no open stream is
//! closed with [`close_code::MOVE`]; the edge reconnects at once from a new
//! UDP source port, which the load balancer sends to a ready replica. Its
//! open streams move with it: every replica that owns one (this one
//! included, for the apiserver connections that arrived here) re-attaches it
//! through the replica the edge reaches, and both ends replay what the other
//! missed. Streams this replica owns keep flowing that way until they end or
//! `--shutdown-grace` runs out.
//!
//! Only the timing rule ([`slot`]) is logic; the rest is thin tokio glue.

use std::sync::Arc;
use std::time::Duration;

use tether_proto::handshake::close_code;
use tokio::time::Instant;
use tracing::{debug, info};

use crate::metrics::CloudMetrics;
use crate::registry::Registry;
use crate::session::Session;

/// When the `i`-th of `n` edges is told to move, after the drain started:
/// evenly over `spread`, the first at once.
pub fn slot(i: usize, n: usize, spread: Duration) -> Duration {
    if n <= 1 || i == 0 {
        return Duration::ZERO;
    }
    let i = i.min(n - 1) as u32;
    spread.mul_f64(f64::from(i) / n as f64)
}

/// Tells every edge connected now to move, each at its [`slot`] (no later
/// than `deadline`); returns how many were told.
pub async fn move_edges(
    registry: &Registry,
    spread: Duration,
    deadline: Instant,
    metrics: &CloudMetrics,
) -> usize {
    let sessions: Vec<Arc<Session>> = registry
        .sessions()
        .into_iter()
        .filter(|s| s.connection().is_some())
        .collect();
    let n = sessions.len();
    info!(
        edges = n,
        ?spread,
        "draining: telling edges to move to another replica"
    );
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, s) in sessions.into_iter().enumerate() {
        let at = (start + slot(i, n, spread)).min(deadline);
        let metrics = metrics.clone();
        tasks.spawn(async move { move_one(&s, at, &metrics).await });
    }
    let mut moved = 0;
    while let Some(r) = tasks.join_next().await {
        if matches!(r, Ok(true)) {
            moved += 1;
        }
    }
    moved
}

/// Moves one edge at `at`; `false` if it had already gone.
async fn move_one(s: &Session, at: Instant, metrics: &CloudMetrics) -> bool {
    tokio::time::sleep_until(at).await;
    let Some(conn) = s.connection() else {
        debug!(node = %s.node, "draining: the edge had already gone");
        return false;
    };
    info!(node = %s.node, remote = %conn.remote_address(), streams = s.open_streams(), "draining: telling the edge to move");
    conn.close(
        close_code::MOVE.into(),
        b"this replica is draining: reconnect to another",
    );
    metrics.edges_moved.inc();
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_spread_evenly_and_start_at_once() {
        let spread = Duration::from_secs(10);
        assert_eq!(slot(0, 1, spread), Duration::ZERO);
        assert_eq!(slot(0, 4, spread), Duration::ZERO);
        assert_eq!(slot(1, 4, spread), Duration::from_millis(2500));
        assert_eq!(slot(3, 4, spread), Duration::from_millis(7500));
        // Never past the spread, whatever the index.
        assert!(slot(99, 4, spread) < spread);
        // A zero spread moves everyone at once.
        assert_eq!(slot(3, 4, Duration::ZERO), Duration::ZERO);
        // 1,000 edges over 10 s: one every 10 ms.
        assert_eq!(slot(1, 1000, spread), Duration::from_millis(10));
    }
}
