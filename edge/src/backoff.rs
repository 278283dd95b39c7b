//! The edge's reconnect schedule: how long to wait before the next round of
//! connection attempts, given how the last round ended.
//!
//! Sans-IO, like [`crate::keepalive`]: no clock, no sleep and no random
//! source of its own. [`Backoff::after`] takes how the round ended and a
//! random draw, and returns the [`Wait`]; [`crate::dial`] sleeps it. The
//! schedule:
//! - after a round that got no welcome, the wait is drawn from `[d/2, d]`,
//!   where `d` starts at `--reconnect-min` and doubles after each such round,
//!   up to `--reconnect-max`: never more than `--reconnect-max`, and never
//!   so little that a fleet of edges hammers a cloud that is down;
//! - a connection that got its welcome starts the schedule over at
//!   `--reconnect-min` (the edge is back about a second after its link is);
//! - after the cloud shut down (a restart closes every edge at once), the
//!   wait is drawn from `[0, --reconnect-spread]` instead, so the fleet's
//!   handshakes are spread out rather than one storm (with a spread of 0,
//!   the backoff from `--reconnect-min`);
//! - after a replica told the edge to move, or a stateless reset (another
//!   replica awaits it), no wait at all;
//! - once the cloud has not answered for `--reconnect-patient-after` (the
//!   session's grace period by default, at least 5 minutes: its streams are
//!   lost by then), the wait is drawn from `[i/2, i]` of
//!   `--reconnect-patient-interval` `i`, so an edge whose link is up but
//!   whose cloud is down for hours does not spend its metered data probing
//!   every second (with an interval of 0, the backoff as before).

use std::ops::RangeInclusive;
use std::time::Duration;

/// How a round of connection attempts ended, as far as the schedule cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundEnd {
    /// No welcome: no answer, a refusal, a TLS failure.
    Failed,
    /// No welcome, and none for longer than `--reconnect-patient-after`.
    FailedLong,
    /// A connection that got its welcome ended (the link died).
    Lost,
    /// The cloud shut down (closed the connection with its shutdown code).
    CloudShutdown,
    /// The replica told this edge to move, or answered with a stateless
    /// reset: another replica awaits it.
    Redirected,
}

/// What to wait before the next round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Reconnect at once.
    Now,
    /// The backoff, drawn from `[d/2, d]` of the current delay `d`.
    Backoff(Duration),
    /// After a cloud shutdown, drawn from `[0, --reconnect-spread]`.
    Spread(Duration),
    /// The cloud has not answered for long: drawn from `[i/2, i]` of
    /// `--reconnect-patient-interval` `i`.
    Patient(Duration),
}

impl Wait {
    /// How long this is.
    pub fn duration(self) -> Duration {
        match self {
            Wait::Now => Duration::ZERO,
            Wait::Backoff(d) | Wait::Spread(d) | Wait::Patient(d) => d,
        }
    }
}

/// The reconnect schedule (`--reconnect-min`, `--reconnect-max`,
/// `--reconnect-spread`, `--reconnect-patient-interval`) and where in it
/// the edge is.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    spread: Duration,
    /// The patient wait's nominal length; zero: none.
    patient: Duration,
    /// The delay the next failed round draws its wait under.
    delay: Duration,
}

impl Backoff {
    /// A schedule at its start. `min` is at most `max` (checked with the
    /// configuration); a `patient` interval of zero has failed rounds back
    /// off as usual however long the cloud has not answered.
    pub fn new(min: Duration, max: Duration, spread: Duration, patient: Duration) -> Backoff {
        Backoff {
            min,
            max,
            spread,
            patient,
            delay: min,
        }
    }

    /// The wait before the next round, after one that ended `end`. `draw`
    /// picks a duration in the range it is given: uniformly
    /// ([`uniform`]) but for tests.
    pub fn after(
        &mut self,
        end: RoundEnd,
        draw: impl FnOnce(RangeInclusive<Duration>) -> Duration,
    ) -> Wait {
        if !matches!(end, RoundEnd::Failed | RoundEnd::FailedLong) {
            self.delay = self.min;
        }
        match end {
            RoundEnd::Redirected => Wait::Now,
            RoundEnd::FailedLong if !self.patient.is_zero() => {
                Wait::Patient(draw(self.patient / 2..=self.patient))
            }
            RoundEnd::CloudShutdown if !self.spread.is_zero() => {
                Wait::Spread(draw(Duration::ZERO..=self.spread))
            }
            _ => {
                let d = self.delay;
                self.delay = d.saturating_mul(2).min(self.max);
                Wait::Backoff(draw(d / 2..=d))
            }
        }
    }
}

/// A uniform draw from `range`: the production random source.
pub fn uniform(range: RangeInclusive<Duration>) -> Duration {
    use rand::Rng;
    rand::rng().random_range(range)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_millis(1000);
    const SPREAD: Duration = Duration::from_secs(5);

    const PATIENT: Duration = Duration::from_secs(30);

    fn schedule() -> Backoff {
        Backoff::new(MIN, MAX, SPREAD, PATIENT)
    }

    /// The nominal delays of failed rounds: 100, 200, 400, 800 ms, then
    /// 1 s (the maximum, not 1.6) for good.
    const DELAYS: [u64; 7] = [100, 200, 400, 800, 1000, 1000, 1000];

    /// Waits of `n` failed rounds in a row, each drawing with `draw`.
    fn failed_rounds(
        b: &mut Backoff,
        n: usize,
        draw: fn(RangeInclusive<Duration>) -> Duration,
    ) -> Vec<Duration> {
        (0..n)
            .map(|_| match b.after(RoundEnd::Failed, draw) {
                Wait::Backoff(w) => w,
                other => panic!("a failed round gave {other:?}"),
            })
            .collect()
    }

    fn ms(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&m| Duration::from_millis(m)).collect()
    }

    /// The delay starts at the minimum, doubles after each failed round and
    /// stops at the maximum; the wait is between half and all of it (the
    /// draw's two ends here).
    #[test]
    fn delays_start_at_the_minimum_double_and_stop_at_the_maximum() {
        let top = failed_rounds(&mut schedule(), DELAYS.len(), |r| *r.end());
        assert_eq!(top, ms(&DELAYS));
        let bottom = failed_rounds(&mut schedule(), DELAYS.len(), |r| *r.start());
        assert_eq!(bottom, ms(&DELAYS.map(|d| d / 2)));
        // A maximum that is no power-of-two multiple of the minimum.
        let mut odd = Backoff::new(Duration::from_millis(300), MAX, SPREAD, PATIENT);
        assert_eq!(
            failed_rounds(&mut odd, 4, |r| *r.end()),
            ms(&[300, 600, 1000, 1000])
        );
    }

    /// With the production random source, every wait stays within half and
    /// all of its round's delay, and the waits do vary (jitter).
    #[test]
    fn jittered_waits_stay_between_half_and_all_of_the_delay() {
        let mut b = schedule();
        let waits = failed_rounds(&mut b, 2000, uniform);
        for (i, w) in waits.iter().enumerate() {
            let d = Duration::from_millis(DELAYS[i.min(DELAYS.len() - 1)]);
            assert!(
                d / 2 <= *w && *w <= d,
                "round {i}: {w:?} outside [{:?}, {d:?}]",
                d / 2
            );
        }
        let capped: std::collections::HashSet<_> = waits[DELAYS.len()..].iter().collect();
        assert!(
            capped.len() > 100,
            "no jitter: {} distinct waits",
            capped.len()
        );
    }

    /// A connection that worked (welcomed, then lost) starts the schedule
    /// over at the minimum; so do a move and a stateless reset, which wait
    /// for nothing.
    #[test]
    fn the_schedule_starts_over_after_a_connection_that_worked() {
        for (end, wait) in [
            (RoundEnd::Lost, Wait::Backoff(MIN)),
            (RoundEnd::Redirected, Wait::Now),
        ] {
            let mut b = schedule();
            failed_rounds(&mut b, 6, |r| *r.end());
            assert_eq!(b.after(end, |r| *r.end()), wait, "{end:?}");
            // The next failures climb from the minimum again.
            let next = failed_rounds(&mut b, 2, |r| *r.end());
            let expect = if end == RoundEnd::Lost {
                [200, 400]
            } else {
                [100, 200]
            };
            assert_eq!(next, ms(&expect), "after {end:?}");
        }
    }

    /// After a cloud shutdown the wait is a random part of
    /// `--reconnect-spread`, never more (it added the backoff on top, up to
    /// `--reconnect-min` more), and the schedule starts over; with a spread
    /// of 0 it is the backoff from the minimum.
    #[test]
    fn the_wait_after_a_cloud_shutdown_stays_within_the_spread() {
        let mut b = schedule();
        let mut waits = Vec::new();
        for _ in 0..2000 {
            failed_rounds(&mut b, 3, uniform);
            match b.after(RoundEnd::CloudShutdown, uniform) {
                Wait::Spread(w) => waits.push(w),
                other => panic!("a cloud shutdown gave {other:?}"),
            }
            assert_eq!(failed_rounds(&mut b, 1, |r| *r.end()), [MIN]);
        }
        assert!(
            waits.iter().all(|w| *w <= SPREAD),
            "{:?}",
            waits.iter().max()
        );
        // Spread over the whole range, not bunched at one end.
        assert!(waits.iter().any(|w| *w < SPREAD / 10));
        assert!(waits.iter().any(|w| *w > SPREAD * 9 / 10));
        let mut none = Backoff::new(MIN, MAX, Duration::ZERO, PATIENT);
        failed_rounds(&mut none, 3, |r| *r.end());
        assert_eq!(
            none.after(RoundEnd::CloudShutdown, |r| *r.end()),
            Wait::Backoff(MIN)
        );
    }

    /// Once the cloud has not answered for long, each wait is drawn from
    /// half to all of `--reconnect-patient-interval`, with jitter; the
    /// backoff's own delay is kept (a short failure after a connection that
    /// worked climbs from the minimum again). With an interval of 0 a long
    /// failure backs off like any other.
    #[test]
    fn a_cloud_silent_for_long_is_probed_at_the_patient_interval() {
        let mut b = schedule();
        failed_rounds(&mut b, 2, |r| *r.end());
        let mut waits = Vec::new();
        for _ in 0..2000 {
            match b.after(RoundEnd::FailedLong, uniform) {
                Wait::Patient(w) => waits.push(w),
                other => panic!("a long failure gave {other:?}"),
            }
        }
        assert!(
            waits.iter().all(|w| PATIENT / 2 <= *w && *w <= PATIENT),
            "{:?} .. {:?}",
            waits.iter().min(),
            waits.iter().max()
        );
        assert!(waits.iter().any(|w| *w < PATIENT * 11 / 20));
        assert!(waits.iter().any(|w| *w > PATIENT * 19 / 20));
        // The backoff's place is where the short failures left it.
        assert_eq!(failed_rounds(&mut b, 1, |r| *r.end()), ms(&[400]));
        assert_eq!(b.after(RoundEnd::Lost, |r| *r.end()), Wait::Backoff(MIN));
        let mut off = Backoff::new(MIN, MAX, SPREAD, Duration::ZERO);
        let long: Vec<_> = (0..6)
            .map(|_| off.after(RoundEnd::FailedLong, |r| *r.end()))
            .collect();
        assert_eq!(
            long,
            ms(&[100, 200, 400, 800, 1000, 1000])
                .into_iter()
                .map(Wait::Backoff)
                .collect::<Vec<_>>()
        );
    }
}
