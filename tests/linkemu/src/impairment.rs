//! What a link does to the packets crossing it, one direction at a time.
//!
//! An [`Impairment`] is the full description of one direction (delay, jitter,
//! random loss, rate limit with a bounded queue, total outage, reordering); an
//! [`ImpairmentPatch`] changes only the fields it names, which is what the CLI's
//! `linkemu set --loss 5` sends so that it does not reset the delay. [`Direction`]
//! names the direction: `up` is edge → cloud, `down` is cloud → edge.
//!
//! The parsers here ([`parse_duration`], [`parse_rate`], [`parse_bytes`]) accept
//! the human forms used on the command line and in the JSON control protocol
//! (`"150ms"`, `"10mbit"`, `"64k"`), and the serde helpers keep the JSON readable.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

/// Largest delay or jitter accepted: the emulator models links, not mail.
pub const MAX_DELAY: Duration = Duration::from_secs(60);

/// Default bound of the rate limiter's queue, in bytes, when `queue` is 0.
pub const DEFAULT_QUEUE_BYTES: u64 = 64 * 1024;

/// One direction of the link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// Edge → cloud (packets read from the edge's TUN, written to the cloud's).
    Up,
    /// Cloud → edge.
    Down,
    /// Both directions (only meaningful when setting an impairment).
    Both,
}

impl Direction {
    /// Whether this selector includes `Up`.
    pub fn has_up(self) -> bool {
        matches!(self, Direction::Up | Direction::Both)
    }

    /// Whether this selector includes `Down`.
    pub fn has_down(self) -> bool {
        matches!(self, Direction::Down | Direction::Both)
    }
}

impl FromStr for Direction {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "up" | "uplink" | "edge-to-cloud" => Ok(Direction::Up),
            "down" | "downlink" | "cloud-to-edge" => Ok(Direction::Down),
            "both" | "all" => Ok(Direction::Both),
            other => bail!("unknown direction {other:?} (expected up, down or both)"),
        }
    }
}

/// Everything the emulator does to one direction of traffic.
///
/// Order of effects for a packet: outage and random loss at ingress, then the
/// rate limiter (token bucket feeding from a bounded FIFO, tail drop when the
/// FIFO is full), then the propagation delay `delay ± jitter`. Unless `reorder`
/// is set, a packet is never delivered before one that entered earlier, so
/// jitter stretches gaps instead of swapping packets (like a real serial link).
/// An outage also drops packets already in flight when they fall due.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Impairment {
    /// Fixed one-way delay.
    #[serde(with = "serde_duration")]
    pub delay: Duration,
    /// Uniform jitter: each packet's delay is drawn from `delay ± jitter`
    /// (clamped at zero).
    #[serde(with = "serde_duration")]
    pub jitter: Duration,
    /// Independent random loss, in percent (0–100).
    pub loss: f64,
    /// Rate limit in bytes per second; `None` means unlimited.
    pub rate: Option<u64>,
    /// Bound of the rate limiter's queue in bytes (0 = [`DEFAULT_QUEUE_BYTES`]).
    pub queue: u64,
    /// Total outage: every packet is dropped, including those in flight.
    pub outage: bool,
    /// Let jitter reorder packets (off by default).
    pub reorder: bool,
}

impl Impairment {
    /// A clean link: no delay, no loss, no limit.
    pub fn clean() -> Self {
        Self::default()
    }

    /// Set the fixed one-way delay.
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Set the jitter (delay varies uniformly within ± this).
    pub fn with_jitter(mut self, jitter: Duration) -> Self {
        self.jitter = jitter;
        self
    }

    /// Set the random loss in percent.
    pub fn with_loss(mut self, percent: f64) -> Self {
        self.loss = percent;
        self
    }

    /// Set the rate limit in bytes per second.
    pub fn with_rate(mut self, bytes_per_sec: u64) -> Self {
        self.rate = Some(bytes_per_sec);
        self
    }

    /// Set the rate limiter's queue bound in bytes.
    pub fn with_queue(mut self, bytes: u64) -> Self {
        self.queue = bytes;
        self
    }

    /// Set the outage flag.
    pub fn with_outage(mut self, outage: bool) -> Self {
        self.outage = outage;
        self
    }

    /// Allow or forbid reordering by jitter.
    pub fn with_reorder(mut self, reorder: bool) -> Self {
        self.reorder = reorder;
        self
    }

    /// The queue bound actually used by the rate limiter.
    pub fn queue_limit(&self) -> u64 {
        if self.queue == 0 {
            DEFAULT_QUEUE_BYTES
        } else {
            self.queue
        }
    }

    /// Check that every value is within the emulator's range.
    pub fn validate(&self) -> anyhow::Result<()> {
        if !(0.0..=100.0).contains(&self.loss) || self.loss.is_nan() {
            bail!("loss must be within 0..=100 percent, got {}", self.loss);
        }
        if self.delay > MAX_DELAY || self.jitter > MAX_DELAY {
            bail!("delay and jitter must not exceed {MAX_DELAY:?}");
        }
        if self.rate == Some(0) {
            bail!("rate must be positive (use no rate for unlimited)");
        }
        Ok(())
    }

    /// Apply a patch: fields the patch names replace ours.
    pub fn apply(&mut self, patch: &ImpairmentPatch) {
        if let Some(d) = patch.delay {
            self.delay = d;
        }
        if let Some(j) = patch.jitter {
            self.jitter = j;
        }
        if let Some(l) = patch.loss {
            self.loss = l;
        }
        if let Some(r) = patch.rate {
            self.rate = (r > 0).then_some(r);
        }
        if let Some(q) = patch.queue {
            self.queue = q;
        }
        if let Some(o) = patch.outage {
            self.outage = o;
        }
        if let Some(r) = patch.reorder {
            self.reorder = r;
        }
    }
}

impl fmt::Display for Impairment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "delay={} jitter={} loss={}% rate={} queue={} outage={} reorder={}",
            format_duration(self.delay),
            format_duration(self.jitter),
            self.loss,
            self.rate
                .map(|r| format!("{r}B/s"))
                .unwrap_or_else(|| "unlimited".into()),
            self.queue_limit(),
            self.outage,
            self.reorder
        )
    }
}

/// A partial [`Impairment`]: `None` fields are left as they are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ImpairmentPatch {
    /// New fixed delay.
    #[serde(with = "serde_opt_duration")]
    pub delay: Option<Duration>,
    /// New jitter.
    #[serde(with = "serde_opt_duration")]
    pub jitter: Option<Duration>,
    /// New loss percent.
    pub loss: Option<f64>,
    /// New rate in bytes per second: `Some(0)` removes the limit.
    pub rate: Option<u64>,
    /// New queue bound (0 = default).
    pub queue: Option<u64>,
    /// New outage flag.
    pub outage: Option<bool>,
    /// New reorder flag.
    pub reorder: Option<bool>,
}

impl From<Impairment> for ImpairmentPatch {
    /// A patch that replaces every field.
    fn from(i: Impairment) -> Self {
        ImpairmentPatch {
            delay: Some(i.delay),
            jitter: Some(i.jitter),
            loss: Some(i.loss),
            rate: Some(i.rate.unwrap_or(0)),
            queue: Some(i.queue),
            outage: Some(i.outage),
            reorder: Some(i.reorder),
        }
    }
}

/// Parse a duration: `150ms`, `1.5s`, `200us`, `2m`, `1h`, or a bare number of
/// milliseconds.
pub fn parse_duration(s: &str) -> anyhow::Result<Duration> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value: f64 = num
        .parse()
        .with_context(|| format!("bad duration {s:?} (expected e.g. 150ms, 1.5s)"))?;
    let nanos_per_unit = match unit.trim() {
        "" | "ms" => 1e6,
        "s" | "sec" => 1e9,
        "us" | "µs" => 1e3,
        "ns" => 1.0,
        "m" | "min" => 60e9,
        "h" => 3600e9,
        other => bail!("bad duration unit {other:?} in {s:?} (use ns, us, ms, s, m, h)"),
    };
    let nanos = (value * nanos_per_unit).round();
    if !nanos.is_finite() || !(0.0..=1e18).contains(&nanos) {
        bail!("duration {s:?} out of range");
    }
    Ok(Duration::from_nanos(nanos as u64))
}

/// Format a duration compactly in the largest of ms, us, ns that is exact
/// (`150ms`, `1500ms`, `250us`) so that [`parse_duration`] reads it back.
pub fn format_duration(d: Duration) -> String {
    let ns = d.as_nanos();
    let (ms, ms_rem) = (ns / 1_000_000, ns % 1_000_000);
    let (us, us_rem) = (ns / 1_000, ns % 1_000);
    if ms_rem == 0 {
        format!("{ms}ms")
    } else if us_rem == 0 {
        format!("{us}us")
    } else {
        format!("{ns}ns")
    }
}

/// Parse a rate into bytes per second. Units follow `tc`: `bit`, `kbit`,
/// `mbit`, `gbit` are bits per second; `bps`, `kbps`, `mbps`, `gbps` are bytes
/// per second (decimal multiples); a bare number is bytes per second.
/// `0`, `off`, `none` and `unlimited` mean no limit (`None`).
pub fn parse_rate(s: &str) -> anyhow::Result<Option<u64>> {
    let t = s.trim().to_ascii_lowercase();
    if matches!(t.as_str(), "0" | "off" | "none" | "unlimited") {
        return Ok(None);
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .with_context(|| format!("bad rate {s:?} (expected e.g. 10mbit, 500kbps, 125000)"))?;
    let bytes_per_sec = match unit.trim() {
        "" | "bps" | "b/s" => value,
        "kbps" => value * 1e3,
        "mbps" => value * 1e6,
        "gbps" => value * 1e9,
        "bit" => value / 8.0,
        "kbit" => value * 1e3 / 8.0,
        "mbit" => value * 1e6 / 8.0,
        "gbit" => value * 1e9 / 8.0,
        other => {
            bail!("bad rate unit {other:?} in {s:?} (use bit/kbit/mbit/gbit or bps/kbps/mbps/gbps)")
        }
    };
    if !bytes_per_sec.is_finite() || bytes_per_sec < 1.0 {
        bail!("rate {s:?} is below 1 byte/s");
    }
    Ok(Some(bytes_per_sec.round() as u64))
}

/// Parse a byte count: `65536`, `64k`, `1m` (binary multiples).
pub fn parse_bytes(s: &str) -> anyhow::Result<u64> {
    let t = s.trim().to_ascii_lowercase();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: u64 = num
        .parse()
        .with_context(|| format!("bad size {s:?} (expected e.g. 65536, 64k, 1m)"))?;
    let mult = match unit.trim() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1024,
        "m" | "mb" | "mib" => 1024 * 1024,
        other => bail!("bad size unit {other:?} in {s:?} (use k or m)"),
    };
    value
        .checked_mul(mult)
        .with_context(|| format!("size {s:?} overflows"))
}

/// Parse `on`/`off` (also `true`/`false`, `1`/`0`, `yes`/`no`).
pub fn parse_switch(s: &str) -> anyhow::Result<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "on" | "true" | "1" | "yes" => Ok(true),
        "off" | "false" | "0" | "no" => Ok(false),
        other => bail!("expected on or off, got {other:?}"),
    }
}

/// Serde for `Duration` as a human string (`"150ms"`); also reads a number of
/// milliseconds.
mod serde_duration {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    #[derive(Deserialize)]
    #[serde(untagged)]
    pub(super) enum Repr {
        Text(String),
        Millis(f64),
    }

    pub(super) fn from_repr(r: Repr) -> Result<Duration, String> {
        match r {
            Repr::Text(s) => super::parse_duration(&s).map_err(|e| e.to_string()),
            Repr::Millis(ms) if ms.is_finite() && ms >= 0.0 => {
                Ok(Duration::from_secs_f64(ms / 1e3))
            }
            Repr::Millis(ms) => Err(format!("bad duration {ms}")),
        }
    }

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_duration(*d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        from_repr(Repr::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

/// Serde for `Option<Duration>` in the same format as [`serde_duration`].
mod serde_opt_duration {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_str(&super::format_duration(*d)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        match Option::<super::serde_duration::Repr>::deserialize(d)? {
            None => Ok(None),
            Some(r) => super::serde_duration::from_repr(r)
                .map(Some)
                .map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_trip() {
        for s in ["0ms", "150ms", "1500ms", "250us", "7ns"] {
            let d = parse_duration(s).expect("parse");
            assert_eq!(format_duration(d), s);
        }
        assert_eq!(
            parse_duration("1.5s").expect("parse"),
            Duration::from_millis(1500)
        );
        assert_eq!(
            parse_duration("20").expect("parse"),
            Duration::from_millis(20)
        );
        assert!(parse_duration("abc").is_err());
        assert!(parse_duration("5d").is_err());
    }

    #[test]
    fn rates_follow_tc_units() {
        assert_eq!(parse_rate("10mbit").expect("rate"), Some(1_250_000));
        assert_eq!(parse_rate("500kbps").expect("rate"), Some(500_000));
        assert_eq!(parse_rate("125000").expect("rate"), Some(125_000));
        assert_eq!(parse_rate("off").expect("rate"), None);
        assert!(parse_rate("fast").is_err());
        assert_eq!(parse_bytes("64k").expect("size"), 65536);
    }

    #[test]
    fn patch_changes_only_named_fields() {
        let mut i = Impairment::clean()
            .with_delay(Duration::from_millis(100))
            .with_loss(1.0);
        i.apply(&ImpairmentPatch {
            loss: Some(5.0),
            ..Default::default()
        });
        assert_eq!(i.delay, Duration::from_millis(100));
        assert_eq!(i.loss, 5.0);
        let json = serde_json::to_string(&i).expect("json");
        let back: Impairment = serde_json::from_str(&json).expect("json");
        assert_eq!(back, i);
        let partial: ImpairmentPatch =
            serde_json::from_str(r#"{"delay":"20ms","rate":null}"#).expect("json");
        assert_eq!(partial.delay, Some(Duration::from_millis(20)));
        assert_eq!(partial.rate, None);
        assert!(Impairment::clean().with_loss(101.0).validate().is_err());
    }
}
