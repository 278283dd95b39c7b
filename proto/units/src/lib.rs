//! # tether-units — the units Tether's configuration values are written in
//!
//! Parsing durations (`250ms`, `10s`, `5m`, `1h`) and byte sizes (`64KiB`,
//! `1MiB`, `4096`). One crate with no dependencies, so that every binary
//! parses a value alike: `tether-proto` re-exports it (`tether_proto::units`)
//! for the cloud and the edge, and `tether-certs`, which does not depend on
//! `tether-proto`, uses it directly. Bounds of one flag (more than 0, at
//! most some value) are its binary's.

use std::time::Duration;

/// Parses `<number><unit>` with unit `ms`, `s`, `m` or `h` (a bare number is
/// seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (e.g. 500ms, 10s, 5m)"))?;
    let secs = match unit.trim() {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        u => {
            return Err(format!(
                "{s:?}: unknown duration unit {u:?} (use ms, s, m or h)"
            ))
        }
    };
    if !secs.is_finite() || !(0.0..=1e9).contains(&secs) {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Parses a byte size: a number with an optional `B`, `KiB`, `MiB` or `GiB`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 65536, 64KiB, 1MiB)"))?;
    let mult = match unit.trim() {
        "" | "B" => 1,
        "KiB" | "K" | "k" => 1024,
        "MiB" | "M" => 1024 * 1024,
        "GiB" | "G" => 1024 * 1024 * 1024,
        u => {
            return Err(format!(
                "{s:?}: unknown size unit {u:?} (use B, KiB, MiB or GiB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// Parses a byte size that must fit in `u32`.
pub fn parse_bytes_u32(s: &str) -> Result<u32, String> {
    let n = parse_bytes(s)?;
    u32::try_from(n).map_err(|_| format!("{s:?} is too large (at most 4GiB)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("2").unwrap(), Duration::from_secs(2));
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("5d").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("64KiB").unwrap(), 65536);
        assert_eq!(parse_bytes("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_bytes("100").unwrap(), 100);
        assert!(parse_bytes("1TiB").is_err());
        assert!(parse_bytes_u32("8GiB").is_err());
    }
}
