//! The edge's adaptive keep-alive, free of I/O: learns how long the NAT on
//! the way to the cloud keeps an idle UDP binding and settles the keep-alive
//! interval just below it, within the operator's bounds
//! (`--keep-alive-min` … `--keep-alive-max`).
//!
//! What it learns from: the edge sends a keep-alive after an idle gap; if the
//! NAT had dropped the binding meanwhile, the keep-alive leaves from a new
//! public port and the cloud sees the connection arrive from a new address.
//! QUIC then makes the cloud validate the new path (RFC 9000 §9.3): it sends
//! a `PATH_CHALLENGE`, which the edge counts (`frame_rx.path_challenge`). So
//! the cloud tells the edge of every NAT rebinding, in band, without a byte
//! of Tether's own. The glue ([`crate::dial`]) reports each keep-alive's
//! fate as a [`Verdict`]: did a rebinding follow it, and was the gap before it
//! really idle (nothing else crossed the link, so the binding was idle for
//! the whole gap).
//!
//! How it settles: start at `--keep-alive` (clamped into the bounds); after
//! [`CONFIRM`] idle gaps in a row that kept the binding, double the interval
//! (up to the maximum). A gap that lost the binding is an upper bound; from
//! then on the interval bisects between the longest gap that held and the
//! shortest that did not, until they are within [`resolution`] of each
//! other, and settles a little ([`margin`]) below the longest gap that held.
//! Every [`REPROBE_AFTER`] keep-alives in the settled state it forgets the
//! upper bound and probes upwards again (the device may have moved to a
//! network with another NAT); a rebinding at the settled interval (the NAT
//! got stricter) restarts the search below it.
//!
//! The price of learning is one rebinding per failed probe: until the edge's
//! next keep-alive the cloud cannot reach it, so a request arriving then
//! waits for that keep-alive (at most the probe's interval, plus a QUIC
//! retransmission). Probes stop once settled.

use std::time::Duration;

/// Idle gaps in a row that must keep the binding before the interval grows.
pub const CONFIRM: u32 = 2;

/// Keep-alives at the settled interval before probing upwards again
/// (about an hour at 30 s, four at 110 s).
pub const REPROBE_AFTER: u32 = 120;

/// How long the cloud may hold back the acknowledgement of a lone packet:
/// QUIC's default `max_ack_delay` (RFC 9000 §18.2), which neither end
/// changes. A keep-alive is one packet, so its ACK comes this late.
pub const PEER_ACK_DELAY: Duration = Duration::from_millis(25);

/// How long after a probing keep-alive its verdict is read: four RTTs for
/// the cloud's path challenge after a rebinding, plus [`PEER_ACK_DELAY`] for
/// the keep-alive's own acknowledgement, plus 20 ms of timer slack; at most
/// half the gap. Read before that acknowledgement arrived, the verdict counts
/// it in the next gap, which then is never quiet: on a link with an RTT under
/// about 2 ms (four RTTs shorter than the delay) the learning stopped moving.
pub fn verdict_wait(rtt: Duration, gap: Duration) -> Duration {
    (rtt * 4 + PEER_ACK_DELAY + Duration::from_millis(20)).min(gap / 2)
}

/// The operator's bounds and starting point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub min: Duration,
    pub max: Duration,
    pub start: Duration,
}

impl Bounds {
    /// Checks `min ≤ max` and that `min` is not zero.
    pub fn new(min: Duration, max: Duration, start: Duration) -> Result<Bounds, String> {
        if min.is_zero() {
            return Err("--keep-alive-min must be above zero".into());
        }
        if min > max {
            return Err(format!(
                "--keep-alive-min ({min:?}) is above --keep-alive-max ({max:?})"
            ));
        }
        Ok(Bounds {
            min,
            max,
            start: start.clamp(min, max),
        })
    }

    /// Whether there is anything to learn (a fixed interval otherwise).
    pub fn adaptive(&self) -> bool {
        self.min < self.max
    }
}

/// What followed one keep-alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// The cloud saw the connection from a new address (it challenged the
    /// path) after this keep-alive: the binding had expired during the gap.
    pub rebound: bool,
    /// Nothing but this keep-alive exchange crossed the link during the gap
    /// before it, so the binding really was idle for the whole gap.
    pub quiet: bool,
}

/// Where the learning stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Trying longer intervals.
    Probing,
    /// Holding the interval just below the binding (or at a bound).
    Settled,
}

/// Closest that the longest gap that held and the shortest that failed must
/// be before the search stops: a tenth of the failing gap, at least 1 s.
pub fn resolution(bad: Duration) -> Duration {
    (bad / 10).max(Duration::from_secs(1))
}

/// How far below the longest gap that held the interval settles (timer and
/// RTT jitter): a twentieth of it, at least 500 ms.
pub fn margin(good: Duration) -> Duration {
    (good / 20).max(Duration::from_millis(500))
}

/// The learner.
#[derive(Debug, Clone)]
pub struct Learner {
    bounds: Bounds,
    current: Duration,
    /// The longest idle gap known to have kept the binding.
    good: Option<Duration>,
    /// The shortest gap known to have lost it.
    bad: Option<Duration>,
    /// Idle gaps at `current` in a row that kept the binding.
    confirmed: u32,
    phase: Phase,
    /// Keep-alives since settling.
    settled_for: u32,
    /// Rebindings seen (each one a failed probe or a NAT change).
    rebindings: u64,
}

impl Learner {
    pub fn new(bounds: Bounds) -> Learner {
        Learner {
            bounds,
            current: bounds.start,
            good: None,
            bad: None,
            confirmed: 0,
            phase: if bounds.adaptive() {
                Phase::Probing
            } else {
                Phase::Settled
            },
            settled_for: 0,
            rebindings: 0,
        }
    }

    /// The idle gap to leave before the next keep-alive.
    pub fn interval(&self) -> Duration {
        self.current
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The longest gap known to hold and the shortest known to fail.
    pub fn known(&self) -> (Option<Duration>, Option<Duration>) {
        (self.good, self.bad)
    }

    /// Rebindings seen so far.
    pub fn rebindings(&self) -> u64 {
        self.rebindings
    }

    /// The fate of a keep-alive sent after an idle gap of `gap`.
    pub fn on_verdict(&mut self, gap: Duration, v: Verdict) {
        if v.rebound {
            self.rebindings += 1;
            if !self.bounds.adaptive() {
                return;
            }
            let bad = self.bad.map_or(gap, |b| b.min(gap));
            self.bad = Some(bad);
            if self.good.is_some_and(|g| g >= bad) {
                // A gap that held before fails now: the NAT changed.
                self.good = None;
            }
            self.confirmed = 0;
            self.after_failure(bad);
            return;
        }
        if v.quiet {
            self.good = Some(self.good.map_or(gap, |g| g.max(gap)));
            if gap >= self.current {
                self.confirmed += 1;
            }
        }
        match self.phase {
            Phase::Settled => {
                self.settled_for = self.settled_for.saturating_add(1);
                if self.bounds.adaptive() && self.settled_for >= REPROBE_AFTER && self.bad.is_some()
                {
                    self.bad = None;
                    self.phase = Phase::Probing;
                    self.confirmed = 0;
                }
            }
            Phase::Probing => {
                if self.confirmed >= CONFIRM {
                    self.step_up();
                }
            }
        }
    }

    fn step_up(&mut self) {
        self.confirmed = 0;
        let good = self.good.unwrap_or(self.current);
        match self.bad {
            Some(bad) if bad <= good + resolution(bad) => self.settle(good),
            Some(bad) => self.current = ((good + bad) / 2).clamp(self.bounds.min, self.bounds.max),
            None if self.current >= self.bounds.max => self.settle_at(self.bounds.max),
            None => self.current = (self.current * 2).min(self.bounds.max),
        }
    }

    fn after_failure(&mut self, bad: Duration) {
        let low = self.good.unwrap_or(self.bounds.min);
        if self.good.is_none() && bad <= self.bounds.min + resolution(bad) {
            // As short as the operator allows, or shorter: hold the minimum.
            self.settle_at(self.bounds.min);
        } else if bad <= low + resolution(bad) {
            self.settle(low);
        } else {
            self.current = ((low + bad) / 2).clamp(self.bounds.min, self.bounds.max);
            self.phase = Phase::Probing;
        }
    }

    /// Settles a margin below `good`, a gap that held.
    fn settle(&mut self, good: Duration) {
        self.settle_at(good.saturating_sub(margin(good)));
    }

    fn settle_at(&mut self, interval: Duration) {
        self.current = interval.clamp(self.bounds.min, self.bounds.max);
        self.phase = Phase::Settled;
        self.settled_for = 0;
        self.confirmed = 0;
    }
}

/// The edge's dead-link detector. With an adaptive keep-alive QUIC's idle
/// timeout has to exceed the longest keep-alive interval, far longer than an
/// outage should take to notice; so the edge watches for silence itself:
/// once it has sent something (data, a keep-alive) and nothing came back for
/// `--silence-timeout`, the connection is dead and the edge reconnects (and
/// resumes the session). Fed with the connection's datagram counters at
/// every poll; polls are needed only while something is unanswered
/// ([`Silence::busy`]), so an idle edge is not woken for it.
#[derive(Debug, Clone)]
pub struct Silence {
    timeout: Duration,
    rx: u64,
    tx: u64,
    /// Since when something sent is unanswered (a poll at or after the send).
    unanswered_since: Option<Duration>,
}

impl Silence {
    /// `now` is any monotonic clock's reading (the time since some start).
    pub fn new(timeout: Duration, rx: u64, tx: u64) -> Silence {
        Silence {
            timeout,
            rx,
            tx,
            unanswered_since: None,
        }
    }

    /// The edge just sent something that the cloud must answer (a keep-alive).
    pub fn sent(&mut self, now: Duration) {
        self.unanswered_since.get_or_insert(now);
    }

    /// A poll of the datagram counters: whether the link is to be taken for dead.
    pub fn observe(&mut self, now: Duration, rx: u64, tx: u64) -> bool {
        if rx != self.rx {
            self.unanswered_since = None;
        } else if tx != self.tx {
            self.unanswered_since.get_or_insert(now);
        }
        self.rx = rx;
        self.tx = tx;
        self.unanswered_since
            .is_some_and(|t| now.saturating_sub(t) >= self.timeout)
    }

    /// Whether something sent is still unanswered (poll again within
    /// [`Silence::poll_every`], and at [`Silence::deadline`]).
    pub fn busy(&self) -> bool {
        self.unanswered_since.is_some()
    }

    /// When the link is dead if nothing arrives until then.
    pub fn deadline(&self) -> Option<Duration> {
        self.unanswered_since.map(|t| t + self.timeout)
    }

    /// How often to poll while busy.
    pub fn poll_every(&self) -> Duration {
        (self.timeout / 3).max(Duration::from_millis(100))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(secs: f64) -> Duration {
        Duration::from_secs_f64(secs)
    }

    const QUIET: Verdict = Verdict {
        rebound: false,
        quiet: true,
    };

    /// Runs the learner against a NAT that drops bindings idle longer than
    /// `binding`, every gap idle; returns the intervals used, in order.
    fn run(l: &mut Learner, binding: Duration, keepalives: usize) -> Vec<Duration> {
        let mut used = Vec::new();
        for _ in 0..keepalives {
            let gap = l.interval();
            used.push(gap);
            l.on_verdict(
                gap,
                Verdict {
                    rebound: gap > binding,
                    quiet: true,
                },
            );
        }
        used
    }

    #[test]
    fn the_verdict_waits_for_the_clouds_delayed_ack() {
        // On a LAN-like link (RTT 1.4 ms) four RTTs alone are 5.6 ms: the
        // ACK, held back 25 ms, came after the verdict and spoiled the next gap.
        let rtt = Duration::from_micros(1_400);
        let wait = verdict_wait(rtt, s(20.0));
        assert!(wait > rtt + PEER_ACK_DELAY, "{wait:?}");
        assert_eq!(wait, Duration::from_micros(50_600));
        // Far links: the RTTs dominate.
        assert_eq!(verdict_wait(s(0.3), s(60.0)), s(1.245));
        // Never more than half the gap.
        assert_eq!(verdict_wait(s(2.0), s(4.0)), s(2.0));
    }

    fn default_bounds() -> Bounds {
        Bounds::new(s(10.0), s(110.0), s(10.0)).unwrap()
    }

    #[test]
    fn settles_just_below_a_30s_binding() {
        let mut l = Learner::new(default_bounds());
        let used = run(&mut l, s(30.0), 40);
        assert_eq!(l.phase(), Phase::Settled);
        let k = l.interval();
        assert!(
            k < s(30.0) && k >= s(30.0) - resolution(s(30.0)) - margin(s(30.0)),
            "{k:?}"
        );
        // Learning cost: a few failed probes, then none.
        let failures = used.iter().filter(|g| **g > s(30.0)).count();
        assert!(failures <= 4, "{failures} failed probes: {used:?}");
        assert!(used[20..].iter().all(|g| *g == k), "{used:?}");
    }

    #[test]
    fn settles_just_below_a_120s_binding_or_at_the_maximum() {
        let mut l = Learner::new(Bounds::new(s(10.0), s(300.0), s(10.0)).unwrap());
        run(&mut l, s(120.0), 60);
        assert_eq!(l.phase(), Phase::Settled);
        let k = l.interval();
        assert!(k < s(120.0) && k >= s(100.0), "{k:?}");

        let mut l = Learner::new(default_bounds());
        let used = run(&mut l, s(120.0), 40);
        assert_eq!(l.interval(), s(110.0));
        assert_eq!(l.phase(), Phase::Settled);
        assert!(used.iter().all(|g| *g <= s(110.0)));
        assert_eq!(l.rebindings(), 0);
    }

    #[test]
    fn never_leaves_the_bounds() {
        for binding in [1.0, 5.0, 15.0, 45.0, 200.0, 1000.0] {
            let b = Bounds::new(s(15.0), s(60.0), s(25.0)).unwrap();
            let mut l = Learner::new(b);
            for g in run(&mut l, s(binding), 100) {
                assert!(g >= s(15.0) && g <= s(60.0), "{g:?} at binding {binding}");
            }
            assert_eq!(l.phase(), Phase::Settled, "binding {binding}");
        }
        // A binding below the minimum: hold the minimum (every keep-alive rebinds).
        let mut l = Learner::new(Bounds::new(s(15.0), s(60.0), s(25.0)).unwrap());
        run(&mut l, s(5.0), 10);
        assert_eq!(l.interval(), s(15.0));
    }

    #[test]
    fn a_fixed_interval_is_not_learned() {
        let mut l = Learner::new(Bounds::new(s(25.0), s(25.0), s(10.0)).unwrap());
        assert_eq!(l.interval(), s(25.0));
        run(&mut l, s(20.0), 10);
        assert_eq!(l.interval(), s(25.0));
        assert_eq!(l.rebindings(), 10);
    }

    #[test]
    fn busy_gaps_prove_nothing() {
        let mut l = Learner::new(default_bounds());
        for _ in 0..20 {
            l.on_verdict(
                l.interval(),
                Verdict {
                    rebound: false,
                    quiet: false,
                },
            );
        }
        assert_eq!(l.interval(), s(10.0));
        assert_eq!(l.known(), (None, None));
        // Two idle ones do.
        l.on_verdict(s(10.0), QUIET);
        l.on_verdict(s(10.0), QUIET);
        assert_eq!(l.interval(), s(20.0));
    }

    #[test]
    fn a_stricter_nat_restarts_the_search_below() {
        let mut l = Learner::new(default_bounds());
        run(&mut l, s(60.0), 40);
        assert_eq!(l.phase(), Phase::Settled);
        assert!(l.interval() > s(50.0));
        // The device moves behind a NAT with a 20 s binding.
        run(&mut l, s(20.0), 40);
        assert_eq!(l.phase(), Phase::Settled);
        let k = l.interval();
        assert!(k < s(20.0) && k >= s(15.0), "{k:?}");
    }

    #[test]
    fn reprobes_after_a_while_and_finds_a_laxer_nat() {
        let mut l = Learner::new(default_bounds());
        run(&mut l, s(30.0), 40);
        let k30 = l.interval();
        assert!(k30 < s(30.0));
        // The NAT now keeps bindings for 90 s: found after the reprobe.
        run(&mut l, s(90.0), REPROBE_AFTER as usize + 40);
        let k = l.interval();
        assert!(k > s(75.0) && k < s(90.0), "{k:?}");
    }

    #[test]
    fn silence_after_sending_is_death_and_idle_silence_is_not() {
        let mut w = Silence::new(s(30.0), 10, 10);
        // Idle: nothing sent, nothing received, for ages: alive, not polled.
        assert!(!w.observe(s(500.0), 10, 10));
        assert!(!w.busy());
        // A keep-alive goes out and is answered.
        w.sent(s(500.0));
        assert!(w.busy());
        assert!(!w.observe(s(510.0), 11, 11));
        assert!(!w.busy());
        // The next one is not: dead 30 s after it went out, not before.
        w.sent(s(600.0));
        assert!(!w.observe(s(610.0), 11, 12));
        assert!(!w.observe(s(629.0), 11, 14));
        assert!(w.observe(s(630.0), 11, 15));
        // Data sent without a keep-alive counts too.
        let mut w = Silence::new(s(30.0), 0, 0);
        assert!(!w.observe(s(5.0), 0, 3));
        assert!(w.busy());
        assert!(!w.observe(s(34.0), 0, 5));
        assert!(w.observe(s(35.0), 0, 5));
        // Data flowing both ways keeps it alive however long.
        let mut w = Silence::new(s(30.0), 0, 0);
        for i in 1..100u64 {
            assert!(!w.observe(s(i as f64 * 10.0), i, i));
        }
        assert_eq!(w.poll_every(), s(10.0));
    }

    #[test]
    fn bounds_are_checked() {
        assert!(Bounds::new(s(0.0), s(10.0), s(1.0)).is_err());
        assert!(Bounds::new(s(20.0), s(10.0), s(15.0)).is_err());
        let b = Bounds::new(s(10.0), s(20.0), s(30.0)).unwrap();
        assert_eq!(b.start, s(20.0));
    }
}
