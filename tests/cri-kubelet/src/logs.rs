//! `/containerLogs` from CRI log files: each line is `<RFC3339Nano time> <stream> <P|F>
//! <content>`, `P` marking a partial line continued by the next. Supports tail,
//! timestamps, sinceSeconds/sinceTime, limitBytes, follow and previous like the kubelet.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use tokio::sync::mpsc;

/// One parsed log record (partial lines already joined).
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub time: OffsetDateTime,
    pub content: Vec<u8>,
}

/// Query options of `/containerLogs`.
#[derive(Debug, Clone, Default)]
pub struct Options {
    pub follow: bool,
    pub tail: Option<usize>,
    pub timestamps: bool,
    pub since: Option<OffsetDateTime>,
    pub limit_bytes: Option<usize>,
    pub previous: bool,
}

/// Parse CRI log bytes into records; `pending` carries an unfinished `P` line across
/// calls. Malformed lines are skipped with a log line.
pub fn parse(data: &[u8], pending: &mut Option<Record>) -> Vec<Record> {
    let mut out = Vec::new();
    for line in data.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        let mut it = line.splitn(4, |b| *b == b' ');
        let (Some(ts), Some(_stream), Some(tag)) = (it.next(), it.next(), it.next()) else {
            tracing::warn!("malformed CRI log line");
            continue;
        };
        let content = it.next().unwrap_or_default();
        let Some(time) = std::str::from_utf8(ts)
            .ok()
            .and_then(|t| OffsetDateTime::parse(t, &Rfc3339).ok())
        else {
            tracing::warn!("bad timestamp in CRI log line");
            continue;
        };
        let rec = pending.get_or_insert_with(|| Record {
            time,
            content: Vec::new(),
        });
        rec.content.extend_from_slice(content);
        if tag == b"F" {
            let mut r = pending.take().unwrap_or_else(|| Record {
                time,
                content: Vec::new(),
            });
            r.content.push(b'\n');
            out.push(r);
        }
    }
    out
}

/// Render one record as the kubelet does (fixed-width nanosecond timestamps).
pub fn render(r: &Record, timestamps: bool) -> Vec<u8> {
    let mut v = Vec::with_capacity(r.content.len() + 32);
    if timestamps {
        let t = r.time.to_offset(time::UtcOffset::UTC);
        v.extend_from_slice(
            format!(
                "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:09}Z ",
                t.year(),
                u8::from(t.month()),
                t.day(),
                t.hour(),
                t.minute(),
                t.second(),
                t.nanosecond()
            )
            .as_bytes(),
        );
    }
    v.extend_from_slice(&r.content);
    v
}

/// The log file of a container attempt (`<pod log dir>/<container>/<attempt>.log`).
pub fn log_file(pod_log_dir: &Path, container: &str, previous: bool) -> PathBuf {
    pod_log_dir
        .join(container)
        .join(if previous { "-1.log" } else { "0.log" })
}

/// Stream the log to `tx`: what is there now (since/tail/limit applied), then, with
/// follow, what is appended, until the receiver goes away.
pub async fn stream(path: PathBuf, opts: Options, tx: mpsc::Sender<Bytes>) -> Result<()> {
    let data = tokio::fs::read(&path)
        .await
        .with_context(|| format!("reading {}", path.display()))?;
    let mut offset = data.len() as u64;
    let mut pending = None;
    let mut recs: Vec<Record> = parse(&data, &mut pending)
        .into_iter()
        .filter(|r| opts.since.is_none_or(|s| r.time >= s))
        .collect();
    if let Some(n) = opts.tail {
        let skip = recs.len().saturating_sub(n);
        recs.drain(..skip);
    }
    let mut budget = opts.limit_bytes.unwrap_or(usize::MAX);
    let mut send = |r: &Record| -> Option<Bytes> {
        if budget == 0 {
            return None;
        }
        let mut b = render(r, opts.timestamps);
        b.truncate(budget);
        budget -= b.len();
        Some(Bytes::from(b))
    };
    for r in &recs {
        let Some(b) = send(r) else { return Ok(()) };
        if tx.send(b).await.is_err() {
            return Ok(());
        }
    }
    if !opts.follow {
        return Ok(());
    }
    use tokio::io::{AsyncReadExt, AsyncSeekExt};
    loop {
        tokio::select! {
            _ = tx.closed() => return Ok(()),
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
        let mut f = tokio::fs::File::open(&path)
            .await
            .with_context(|| format!("opening {}", path.display()))?;
        let len = f.metadata().await.map(|m| m.len()).unwrap_or(0);
        if len < offset {
            offset = 0; // rotated or truncated
        }
        if len == offset {
            continue;
        }
        f.seek(std::io::SeekFrom::Start(offset)).await?;
        let mut buf = Vec::new();
        f.read_to_end(&mut buf).await?;
        // Only whole lines; the rest is read again next time.
        let Some(end) = buf.iter().rposition(|b| *b == b'\n') else {
            continue;
        };
        offset += end as u64 + 1;
        for r in parse(&buf[..=end], &mut pending) {
            let Some(b) = send(&r) else { return Ok(()) };
            if tx.send(b).await.is_err() {
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_partial_and_full_lines() {
        let data = b"2026-01-02T03:04:05.5Z stdout P hel\n2026-01-02T03:04:06Z stdout F lo\n2026-01-02T03:04:07.000000001Z stderr F x y\n";
        let mut p = None;
        let r = parse(data, &mut p);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].content, b"hello\n");
        assert_eq!(r[1].content, b"x y\n");
        assert_eq!(
            render(&r[0], true),
            b"2026-01-02T03:04:05.500000000Z hello\n".to_vec()
        );
        let mut p = None;
        assert!(parse(b"2026-01-02T03:04:05Z stdout P a\n", &mut p).is_empty());
        assert_eq!(
            parse(b"2026-01-02T03:04:06Z stdout F b\n", &mut p)[0].content,
            b"ab\n"
        );
        assert!(parse(b"garbage\n", &mut None).is_empty());
    }
}
