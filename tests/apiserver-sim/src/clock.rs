//! Time for object metadata: the simulator's start time (every object's
//! `creationTimestamp`), RFC 3339 formatting, and the short human ages
//! (`k8s.io/apimachinery/pkg/util/duration.HumanDuration`) used in table output.

use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

static STARTED: OnceLock<SystemTime> = OnceLock::new();

/// When the simulator started (fixed on first use).
pub fn started() -> SystemTime {
    *STARTED.get_or_init(SystemTime::now)
}

/// `started()` as RFC 3339.
pub fn created() -> String {
    rfc3339(started())
}

/// UTC, whole seconds: `2024-05-01T10:00:00Z`.
pub fn rfc3339(t: SystemTime) -> String {
    let secs = t
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_secs();
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian (H. Hinnant).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Age since `started()`, as kubectl prints it.
pub fn age() -> String {
    human_duration(started().elapsed().unwrap_or(Duration::ZERO))
}

/// `duration.HumanDuration`.
pub fn human_duration(d: Duration) -> String {
    let s = d.as_secs();
    let (m, h, days) = (s / 60, s / 3600, s / 86_400);
    let years = days / 365;
    if s < 120 {
        format!("{s}s")
    } else if m < 10 {
        match s % 60 {
            0 => format!("{m}m"),
            r => format!("{m}m{r}s"),
        }
    } else if h < 3 {
        format!("{m}m")
    } else if h < 8 {
        match m % 60 {
            0 => format!("{h}h"),
            r => format!("{h}h{r}m"),
        }
    } else if h < 48 {
        format!("{h}h")
    } else if h < 192 {
        match h % 24 {
            0 => format!("{days}d"),
            r => format!("{days}d{r}h"),
        }
    } else if years < 2 {
        format!("{days}d")
    } else if years < 8 {
        match days % 365 {
            0 => format!("{years}y"),
            r => format!("{years}y{r}d"),
        }
    } else {
        format!("{years}y")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_rfc3339() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_714_557_600);
        assert_eq!(rfc3339(t), "2024-05-01T10:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(rfc3339(t), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn human_ages() {
        let h = |s| human_duration(Duration::from_secs(s));
        assert_eq!(h(5), "5s");
        assert_eq!(h(150), "2m30s");
        assert_eq!(h(180), "3m");
        assert_eq!(h(3600), "60m");
        assert_eq!(h(4 * 3600 + 60), "4h1m");
        assert_eq!(h(10 * 3600), "10h");
        assert_eq!(h(3 * 86_400 + 3600), "3d1h");
        assert_eq!(h(30 * 86_400), "30d");
        assert_eq!(h(3 * 365 * 86_400), "3y");
    }
}
