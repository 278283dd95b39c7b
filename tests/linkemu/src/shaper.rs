//! One direction of the emulated link as a pure state machine.
//!
//! A [`Shaper`] takes packets in ([`Shaper::ingress`]) and hands them back when
//! they are due ([`Shaper::poll_release`]); it never touches a socket or a
//! clock: every call is given `now`, and [`Shaper::next_deadline`] says when
//! the caller should call again. The router's I/O loop drives two of them; the
//! unit tests below drive them with synthetic time, deterministically.
//!
//! Pipeline per packet: outage and random loss at ingress → bounded FIFO
//! drained by a token bucket (rate limit; tail drop when the FIFO is full) →
//! delay line (`delay ± jitter`, FIFO order kept unless reordering is allowed)
//! → released. An outage also drops packets that fall due while it lasts.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::impairment::Impairment;

/// The delay line holds at most this many packets; beyond, packets are
/// dropped and counted as `dropped_overflow` (memory stays bounded even with a
/// long delay on a fast sender).
pub const LINE_MAX_PACKETS: usize = 256 * 1024;

/// The delay line holds at most this many bytes.
pub const LINE_MAX_BYTES: u64 = 256 * 1024 * 1024;

/// Counters of one direction. All counts since start or the last reset.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DirStats {
    /// Packets read from the sending side's TUN.
    pub rx_packets: u64,
    /// Bytes read from the sending side's TUN.
    pub rx_bytes: u64,
    /// Packets written to the receiving side's TUN.
    pub tx_packets: u64,
    /// Bytes written to the receiving side's TUN.
    pub tx_bytes: u64,
    /// Dropped by random loss.
    pub dropped_loss: u64,
    /// Dropped because of an outage (at ingress or when due).
    pub dropped_outage: u64,
    /// Tail-dropped because the rate limiter's queue was full.
    pub dropped_queue: u64,
    /// Dropped because the delay line was full.
    pub dropped_overflow: u64,
    /// Writes to the receiving TUN that failed.
    pub write_errors: u64,
    /// Packets waiting in the rate limiter's queue now.
    pub queued_packets: u64,
    /// Bytes waiting in the rate limiter's queue now.
    pub queued_bytes: u64,
    /// Packets in the delay line now.
    pub in_flight_packets: u64,
}

impl DirStats {
    /// All packets dropped, whatever the reason.
    pub fn dropped(&self) -> u64 {
        self.dropped_loss + self.dropped_outage + self.dropped_queue + self.dropped_overflow
    }
}

/// A packet in the delay line, ordered by due time then by arrival.
struct Scheduled {
    at: Instant,
    seq: u64,
    packet: Vec<u8>,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at && self.seq == other.seq
    }
}

impl Eq for Scheduled {}

impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Scheduled {
    /// Reversed so that `BinaryHeap` (a max-heap) pops the earliest first.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .at
            .cmp(&self.at)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

/// One direction of the link. See the module documentation.
pub struct Shaper {
    imp: Impairment,
    rng: StdRng,
    /// Rate limiter FIFO and its size in bytes.
    queue: VecDeque<Vec<u8>>,
    queue_bytes: u64,
    /// Token bucket level in bytes; may go negative after a packet larger
    /// than the level was sent (the debt is repaid before the next one).
    tokens: f64,
    refilled_at: Instant,
    /// Delay line.
    line: BinaryHeap<Scheduled>,
    line_bytes: u64,
    /// Latest due time handed out, to keep FIFO order under jitter.
    last_due: Option<Instant>,
    seq: u64,
    stats: DirStats,
}

impl Shaper {
    /// A direction with the given impairment; `seed` makes loss and jitter
    /// reproducible.
    pub fn new(imp: Impairment, seed: u64, now: Instant) -> Self {
        let mut s = Shaper {
            imp,
            rng: StdRng::seed_from_u64(seed),
            queue: VecDeque::new(),
            queue_bytes: 0,
            tokens: 0.0,
            refilled_at: now,
            line: BinaryHeap::new(),
            line_bytes: 0,
            last_due: None,
            seq: 0,
            stats: DirStats::default(),
        };
        s.tokens = s.burst();
        s
    }

    /// The impairment in force.
    pub fn impairment(&self) -> &Impairment {
        &self.imp
    }

    /// Replace the impairment. Packets already in the delay line keep their
    /// due time; queued packets are drained at the new rate.
    pub fn configure(&mut self, imp: Impairment, now: Instant) {
        self.refill(now);
        let had_rate = self.imp.rate.is_some();
        self.imp = imp;
        if !had_rate {
            self.tokens = self.burst();
        }
        self.tokens = self.tokens.min(self.burst());
        self.drain_queue(now);
    }

    /// Bucket depth: 2 ms worth of the rate, at least two full-size packets.
    fn burst(&self) -> f64 {
        match self.imp.rate {
            Some(r) => (r as f64 * 0.002).max(3000.0),
            None => 0.0,
        }
    }

    /// A packet arrives from the sender at `now`.
    pub fn ingress(&mut self, packet: Vec<u8>, now: Instant) {
        let len = packet.len() as u64;
        self.stats.rx_packets += 1;
        self.stats.rx_bytes += len;
        if self.imp.outage {
            self.stats.dropped_outage += 1;
            return;
        }
        if self.imp.loss > 0.0 && self.rng.random::<f64>() * 100.0 < self.imp.loss {
            self.stats.dropped_loss += 1;
            return;
        }
        if self.imp.rate.is_some() {
            if self.queue_bytes + len > self.imp.queue_limit() {
                self.stats.dropped_queue += 1;
                return;
            }
            self.queue_bytes += len;
            self.queue.push_back(packet);
            self.drain_queue(now);
        } else {
            self.schedule(packet, now);
        }
    }

    fn refill(&mut self, now: Instant) {
        if let Some(rate) = self.imp.rate {
            let dt = now
                .saturating_duration_since(self.refilled_at)
                .as_secs_f64();
            self.tokens = (self.tokens + dt * rate as f64).min(self.burst());
        }
        self.refilled_at = now;
    }

    /// Move from the rate limiter's FIFO into the delay line what the bucket
    /// allows at `now` (everything when there is no rate limit).
    fn drain_queue(&mut self, now: Instant) {
        if self.queue.is_empty() {
            return;
        }
        self.refill(now);
        while let Some(front) = self.queue.front() {
            if self.imp.rate.is_some() && self.tokens < 0.0 {
                break;
            }
            let len = front.len() as u64;
            if self.imp.rate.is_some() {
                self.tokens -= len as f64;
            }
            self.queue_bytes -= len;
            if let Some(packet) = self.queue.pop_front() {
                self.schedule(packet, now);
            }
        }
    }

    /// Put a packet that left the rate limiter at `sent` into the delay line.
    fn schedule(&mut self, packet: Vec<u8>, sent: Instant) {
        let len = packet.len() as u64;
        if self.line.len() >= LINE_MAX_PACKETS || self.line_bytes + len > LINE_MAX_BYTES {
            self.stats.dropped_overflow += 1;
            return;
        }
        let mut delay_ns = self.imp.delay.as_nanos() as i128;
        if !self.imp.jitter.is_zero() {
            let j = self.imp.jitter.as_nanos() as i64;
            delay_ns += self.rng.random_range(-j..=j) as i128;
        }
        let delay = Duration::from_nanos(delay_ns.max(0) as u64);
        let mut at = sent + delay;
        if let Some(last) = self.last_due {
            if !self.imp.reorder {
                at = at.max(last);
            }
            self.last_due = Some(last.max(at));
        } else {
            self.last_due = Some(at);
        }
        self.seq += 1;
        self.line_bytes += len;
        self.line.push(Scheduled {
            at,
            seq: self.seq,
            packet,
        });
    }

    /// The next packet due at `now`, if any. Call until it returns `None`.
    pub fn poll_release(&mut self, now: Instant) -> Option<Vec<u8>> {
        self.drain_queue(now);
        loop {
            if self.line.peek()?.at > now {
                return None;
            }
            let item = self.line.pop()?;
            let len = item.packet.len() as u64;
            self.line_bytes -= len;
            if self.imp.outage {
                self.stats.dropped_outage += 1;
                continue;
            }
            self.stats.tx_packets += 1;
            self.stats.tx_bytes += len;
            return Some(item.packet);
        }
    }

    /// When the caller must next call [`Shaper::poll_release`], if anything
    /// is pending.
    pub fn next_deadline(&self) -> Option<Instant> {
        let line = self.line.peek().map(|s| s.at);
        let queue = match (self.queue.is_empty(), self.imp.rate) {
            (false, Some(rate)) => {
                let wait = if self.tokens >= 0.0 {
                    0.0
                } else {
                    -self.tokens / rate as f64
                };
                Some(self.refilled_at + Duration::from_secs_f64(wait))
            }
            (false, None) => Some(self.refilled_at),
            (true, _) => None,
        };
        match (line, queue) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Count a failed write of a released packet.
    pub fn note_write_error(&mut self) {
        self.stats.write_errors += 1;
    }

    /// Counters, with the current queue and delay-line occupancy.
    pub fn stats(&self) -> DirStats {
        DirStats {
            queued_packets: self.queue.len() as u64,
            queued_bytes: self.queue_bytes,
            in_flight_packets: self.line.len() as u64,
            ..self.stats
        }
    }

    /// Zero the counters (occupancy is not a counter and stays).
    pub fn reset_stats(&mut self) {
        self.stats = DirStats::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Run a shaper over synthetic time, feeding `arrivals` (time offset,
    /// packet) and collecting (time offset, packet) releases.
    fn simulate(
        imp: Impairment,
        arrivals: &[(Duration, Vec<u8>)],
        until: Duration,
    ) -> (Vec<(Duration, Vec<u8>)>, DirStats) {
        let t0 = Instant::now();
        let mut s = Shaper::new(imp, 7, t0);
        let mut out = Vec::new();
        let mut i = 0;
        let mut now = t0;
        while now <= t0 + until {
            while i < arrivals.len() && t0 + arrivals[i].0 <= now {
                s.ingress(arrivals[i].1.clone(), now);
                i += 1;
            }
            while let Some(p) = s.poll_release(now) {
                out.push((now - t0, p));
            }
            now += Duration::from_micros(100);
        }
        (out, s.stats())
    }

    #[test]
    fn fixed_delay_is_applied() {
        let imp = Impairment::clean().with_delay(ms(50));
        let (out, st) = simulate(imp, &[(ms(0), vec![1]), (ms(10), vec![2])], ms(100));
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].0, ms(50));
        assert_eq!(out[1].0, ms(60));
        assert_eq!(st.tx_packets, 2);
    }

    #[test]
    fn jitter_keeps_order_unless_reorder() {
        let arrivals: Vec<_> = (0..200u64)
            .map(|i| (Duration::from_micros(i * 200), vec![i as u8]))
            .collect();
        let imp = Impairment::clean().with_delay(ms(20)).with_jitter(ms(10));
        let (out, _) = simulate(imp, &arrivals, ms(200));
        assert_eq!(out.len(), 200);
        let order: Vec<u8> = out.iter().map(|(_, p)| p[0]).collect();
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(order, sorted, "FIFO kept without reorder");
        assert!(out.iter().all(|(t, _)| *t >= ms(10)));

        let (out, _) = simulate(imp.with_reorder(true), &arrivals, ms(200));
        let order: Vec<u8> = out.iter().map(|(_, p)| p[0]).collect();
        let mut sorted = order.clone();
        sorted.sort();
        assert_ne!(order, sorted, "jitter with reorder swaps packets");
    }

    #[test]
    fn loss_is_near_configured() {
        let arrivals: Vec<_> = (0..10_000u64).map(|_| (ms(0), vec![0u8; 10])).collect();
        let (out, st) = simulate(Impairment::clean().with_loss(10.0), &arrivals, ms(1));
        assert_eq!(out.len() as u64 + st.dropped_loss, 10_000);
        assert!((800..1200).contains(&st.dropped_loss), "{st:?}");
    }

    #[test]
    fn rate_limit_paces_and_tail_drops() {
        // 100 packets of 1000 bytes at once into a 10 kB/s link with a 20 kB queue.
        let arrivals: Vec<_> = (0..100u64).map(|_| (ms(0), vec![0u8; 1000])).collect();
        let imp = Impairment::clean().with_rate(10_000).with_queue(20_000);
        let (out, st) = simulate(imp, &arrivals, Duration::from_secs(3));
        // The bucket (3000 bytes, one packet of debt allowed) sends 4 at
        // once, the queue holds 20, the other 76 are tail-dropped.
        assert_eq!(st.dropped_queue, 76);
        assert_eq!(out.len(), 24);
        let last = out.last().map(|(t, _)| *t).unwrap_or_default();
        // The 20 queued packets leave one per 100 ms.
        assert!(last >= ms(1950) && last <= ms(2050), "last at {last:?}");
    }

    #[test]
    fn outage_drops_in_flight_and_new() {
        let t0 = Instant::now();
        let mut s = Shaper::new(Impairment::clean().with_delay(ms(10)), 1, t0);
        s.ingress(vec![1], t0);
        s.configure(Impairment::clean().with_delay(ms(10)).with_outage(true), t0);
        s.ingress(vec![2], t0);
        assert_eq!(s.poll_release(t0 + ms(20)), None);
        s.configure(Impairment::clean().with_delay(ms(10)), t0 + ms(20));
        s.ingress(vec![3], t0 + ms(20));
        assert_eq!(s.poll_release(t0 + ms(30)), Some(vec![3]));
        let st = s.stats();
        assert_eq!(st.dropped_outage, 2);
        assert_eq!(st.tx_packets, 1);
        assert_eq!(s.next_deadline(), None);
    }
}
