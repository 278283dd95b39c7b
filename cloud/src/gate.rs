//! Who may start an edge handshake: the decisions the QUIC accept loop makes
//! about an Initial before it costs the cloud a handshake slot.
//!
//! Two defences against handshake starvation (a flood of Initials, spoofed or
//! not, that would hold every `--max-pending-handshakes` slot for the
//! handshake timeout and keep real edges out):
//! - **address validation under load**: once a quarter of the handshake slots
//!   are in use, an Initial from an address QUIC has not validated is answered
//!   with a stateless Retry. A spoofed source never sees the Retry and never
//!   comes back; a real edge returns with the token one round trip later and
//!   is validated. The Retry holds no state, but it is not free: the cloud
//!   decrypts the Initial (deriving its keys) and seals a token, and the edge
//!   pays a round trip and a second Initial; in a restart storm of 10,000
//!   edges there are 20,000–30,000 of them (`tether-bench --only edges`).
//! - **a per-source rate**: each source IP may start at most
//!   `--handshakes-per-source` handshakes per second (a burst of that many),
//!   so one validated address cannot take every slot either. Its surplus
//!   Initials are dropped (its QUIC retransmits them later).
//!
//! Pure logic over time and addresses; the tokio glue is in [`crate::tunnel`].

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Instant;

/// Default of `--handshake-rate-sources`: the most sources remembered;
/// beyond it, full (idle) buckets are forgotten first, then the whole table
/// (a forgotten source starts full).
pub const DEFAULT_MAX_SOURCES: usize = 65_536;

/// What to do with one Initial.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Take a handshake slot.
    Admit,
    /// Answer with a QUIC Retry (address not yet validated, cloud under load).
    Retry,
    /// Drop it: this source started too many handshakes lately.
    SourceLimited,
}

/// The per-source token buckets and the load threshold for Retry.
#[derive(Debug)]
pub struct Gate {
    per_source: f64,
    retry_above: usize,
    /// Most sources remembered (`--handshake-rate-sources`).
    max_sources: usize,
    buckets: HashMap<IpAddr, Bucket>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Gate {
    /// `per_source`: handshakes a second (and burst) per source IP, at least 1;
    /// `max_pending`: the handshake slots; Retry starts at a quarter of them;
    /// `max_sources`: the sources whose bucket is remembered, at least 1.
    pub fn new(per_source: u32, max_pending: usize, max_sources: usize) -> Gate {
        Gate {
            per_source: f64::from(per_source.max(1)),
            retry_above: max_pending / 4,
            max_sources: max_sources.max(1),
            buckets: HashMap::new(),
        }
    }

    /// Decides for an Initial from `source` while `pending` handshakes are in
    /// progress; `validated` is whether QUIC validated the address (the
    /// Initial carried a Retry token).
    pub fn check(
        &mut self,
        source: IpAddr,
        validated: bool,
        pending: usize,
        now: Instant,
    ) -> Verdict {
        if !validated && pending >= self.retry_above {
            return Verdict::Retry;
        }
        if self.buckets.len() >= self.max_sources && !self.buckets.contains_key(&source) {
            self.prune(now);
        }
        let rate = self.per_source;
        let b = self.buckets.entry(source).or_insert(Bucket {
            tokens: rate,
            at: now,
        });
        let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
        b.tokens = (b.tokens + elapsed * rate).min(rate);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Verdict::Admit
        } else {
            Verdict::SourceLimited
        }
    }

    /// Sources remembered (for tests).
    pub fn sources(&self) -> usize {
        self.buckets.len()
    }

    fn prune(&mut self, now: Instant) {
        let rate = self.per_source;
        self.buckets.retain(|_, b| {
            b.tokens + now.saturating_duration_since(b.at).as_secs_f64() * rate < rate
        });
        if self.buckets.len() >= self.max_sources {
            self.buckets.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ip(n: u32) -> IpAddr {
        IpAddr::from(std::net::Ipv4Addr::from(0x0a00_0000 + n))
    }

    #[test]
    fn unvalidated_sources_get_a_retry_only_under_load() {
        let mut g = Gate::new(10, 16, DEFAULT_MAX_SOURCES);
        let t = Instant::now();
        assert_eq!(g.check(ip(1), false, 0, t), Verdict::Admit);
        assert_eq!(g.check(ip(2), false, 3, t), Verdict::Admit);
        assert_eq!(g.check(ip(3), false, 4, t), Verdict::Retry);
        assert_eq!(g.check(ip(3), true, 15, t), Verdict::Admit);
    }

    #[test]
    fn one_source_is_held_to_its_rate_and_refills() {
        let mut g = Gate::new(5, 512, DEFAULT_MAX_SOURCES);
        let t = Instant::now();
        for _ in 0..5 {
            assert_eq!(g.check(ip(1), true, 0, t), Verdict::Admit);
        }
        assert_eq!(g.check(ip(1), true, 0, t), Verdict::SourceLimited);
        // Another source is not affected.
        assert_eq!(g.check(ip(2), true, 0, t), Verdict::Admit);
        // 200 ms later one token (5/s) is back, not two.
        let t2 = t + Duration::from_millis(200);
        assert_eq!(g.check(ip(1), true, 0, t2), Verdict::Admit);
        assert_eq!(g.check(ip(1), true, 0, t2), Verdict::SourceLimited);
    }

    /// `--handshake-rate-sources` bounds the table: with 16, a seventeenth
    /// source sweeps it. Sources whose bucket refilled (idle) are forgotten
    /// first; a forgotten source starts with a full bucket again.
    #[test]
    fn the_source_table_holds_at_most_its_configured_sources() {
        let mut g = Gate::new(1, 512, 16);
        let t = Instant::now();
        for n in 0..1000 {
            assert_eq!(g.check(ip(n), true, 0, t), Verdict::Admit);
            assert!(
                g.sources() <= 16,
                "{} sources with a bound of 16",
                g.sources()
            );
        }
        // Sixteen sources that just spent their token; one second later
        // fifteen of them have refilled (idle) and one is spent again.
        let mut g = Gate::new(1, 512, 16);
        for n in 0..16 {
            assert_eq!(g.check(ip(n), true, 0, t), Verdict::Admit);
        }
        assert_eq!(g.sources(), 16);
        let t1 = t + Duration::from_secs(1);
        assert_eq!(g.check(ip(0), true, 0, t1), Verdict::Admit);
        // A new source: the idle fifteen are swept, the spent one is kept
        // and still limited.
        assert_eq!(g.check(ip(100), true, 0, t1), Verdict::Admit);
        assert_eq!(g.sources(), 2);
        assert_eq!(g.check(ip(0), true, 0, t1), Verdict::SourceLimited);
    }
}
