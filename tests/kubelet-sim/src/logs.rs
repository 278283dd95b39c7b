//! `/containerLogs/{ns}/{pod}/{container}`: query parsing and validation,
//! selection (sinceSeconds/sinceTime, tailLines, limitBytes, stream), the
//! optional timestamp prefix, and following a growing file.
//!
//! Log files are plain text, `<log-dir>/<ns>_<pod>_<container>.log` (and
//! `.previous.log` for `previous=true`); every line is treated as stdout.
//! Timestamps: each complete line is stamped with the time the simulator
//! first saw it — lines already present when a file is first read get the
//! file's mtime, lines appended later get the time they were first read (by
//! any request; a shared index keeps answers consistent). Printed in the
//! kubelet's fixed-width RFC 3339 nano form `2006-01-02T15:04:05.000000000Z`.
//! A truncated file (shorter than what was indexed) starts a fresh index.
//! When following, only complete lines are sent; otherwise a trailing
//! partial line is sent last.

use std::collections::HashMap;
use std::io::SeekFrom;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

use crate::http_util::{self, parse_bool, query_get, query_pairs, Body};
use crate::server::AppState;

/// How often a followed file is polled.
const POLL: Duration = Duration::from_millis(100);

/// Which stream's lines to return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamSel {
    All,
    Stdout,
    Stderr,
}

/// Decoded `containerLogs` query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogQuery {
    pub follow: bool,
    pub previous: bool,
    pub timestamps: bool,
    pub since: Option<OffsetDateTime>,
    pub tail_lines: Option<usize>,
    pub limit_bytes: Option<u64>,
    pub stream: StreamSel,
}

/// Why a query was refused: 400 (undecodable) or 422 (invalid).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueryError {
    BadRequest(String),
    Invalid(String),
}

fn bool_param(q: &[(String, String)], name: &str) -> Result<bool, QueryError> {
    match query_get(q, name) {
        None => Ok(false),
        Some(v) => parse_bool(v)
            .ok_or_else(|| QueryError::BadRequest(format!("invalid value {v:?} for {name}"))),
    }
}

fn int_param(q: &[(String, String)], name: &str) -> Result<Option<i64>, QueryError> {
    match query_get(q, name) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<i64>()
            .map(Some)
            .map_err(|_| QueryError::BadRequest(format!("invalid value {v:?} for {name}"))),
    }
}

/// Parse and validate the query as the kubelet does.
pub fn parse_query(query: Option<&str>, now: OffsetDateTime) -> Result<LogQuery, QueryError> {
    let q = query_pairs(query);
    let follow = bool_param(&q, "follow")?;
    let previous = bool_param(&q, "previous")?;
    let timestamps = bool_param(&q, "timestamps")?;
    let since_seconds = int_param(&q, "sinceSeconds")?;
    let since_time = match query_get(&q, "sinceTime") {
        None | Some("") => None,
        Some(v) => Some(
            OffsetDateTime::parse(v, &Rfc3339)
                .map_err(|e| QueryError::BadRequest(format!("invalid sinceTime {v:?}: {e}")))?,
        ),
    };
    let tail = match int_param(&q, "tailLines")? {
        Some(t) => Some(t),
        // Legacy `tail`, where a negative value means "all".
        None => int_param(&q, "tail")?.filter(|t| *t >= 0),
    };
    let limit = int_param(&q, "limitBytes")?;
    let stream = match query_get(&q, "stream") {
        None | Some("") | Some("All") => StreamSel::All,
        Some("Stdout") => StreamSel::Stdout,
        Some("Stderr") => StreamSel::Stderr,
        Some(v) => return Err(QueryError::Invalid(format!("invalid stream {v:?}"))),
    };
    if since_seconds.is_some() && since_time.is_some() {
        return Err(QueryError::Invalid(
            "at most one of sinceTime or sinceSeconds may be specified".into(),
        ));
    }
    let since = match since_seconds {
        Some(s) if s < 1 => {
            return Err(QueryError::Invalid(
                "sinceSeconds must be greater than 0".into(),
            ))
        }
        Some(s) => Some(now - time::Duration::seconds(s)),
        None => since_time,
    };
    let tail_lines = match tail {
        Some(t) if t < 0 => {
            return Err(QueryError::Invalid(
                "tailLines must be greater than or equal to 0".into(),
            ))
        }
        Some(t) => Some(usize::try_from(t).unwrap_or(usize::MAX)),
        None => None,
    };
    let limit_bytes = match limit {
        Some(l) if l < 1 => {
            return Err(QueryError::Invalid(
                "limitBytes must be greater than 0".into(),
            ))
        }
        Some(l) => Some(l as u64),
        None => None,
    };
    Ok(LogQuery {
        follow,
        previous,
        timestamps,
        since,
        tail_lines,
        limit_bytes,
        stream,
    })
}

/// Fixed-width RFC 3339 with nanoseconds, in UTC.
pub fn format_timestamp(t: OffsetDateTime) -> String {
    let t = t.to_offset(time::UtcOffset::UTC);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:09}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
        t.nanosecond()
    )
}

#[derive(Debug)]
struct FileIndex {
    /// File length when first indexed: complete lines inside get the mtime.
    initial_len: u64,
    mtime: OffsetDateTime,
    /// (end offset of line, first-seen time), ascending.
    lines: Vec<(u64, OffsetDateTime)>,
    scanned: u64,
}

/// First-seen times of log lines, shared by all requests.
#[derive(Debug, Default)]
pub struct LogIndex {
    files: Mutex<HashMap<PathBuf, FileIndex>>,
}

impl LogIndex {
    /// Timestamps of the complete lines of `chunk`, which starts at byte
    /// `start` of the file at `path` (current length `len`, mtime `mtime`).
    fn stamp(
        &self,
        path: &Path,
        len: u64,
        mtime: OffsetDateTime,
        start: u64,
        lines: &[&[u8]],
    ) -> Vec<OffsetDateTime> {
        let now = OffsetDateTime::now_utc();
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        let fresh = || FileIndex {
            initial_len: len,
            mtime,
            lines: Vec::new(),
            scanned: 0,
        };
        let fi = files.entry(path.to_path_buf()).or_insert_with(fresh);
        if len < fi.scanned {
            *fi = FileIndex {
                initial_len: 0,
                ..fresh()
            };
        }
        let mut pos = start;
        let mut out = Vec::with_capacity(lines.len());
        for line in lines {
            let end = pos + line.len() as u64;
            let ts = if end <= fi.scanned {
                match fi.lines.binary_search_by_key(&end, |(e, _)| *e) {
                    Ok(i) => fi.lines[i].1,
                    Err(_) => now,
                }
            } else {
                let t = if end <= fi.initial_len { fi.mtime } else { now };
                fi.lines.push((end, t));
                fi.scanned = end;
                t
            };
            out.push(ts);
            pos = end;
        }
        out
    }
}

/// Split into complete lines (with their `\n`) and a trailing partial line.
pub fn split_lines(data: &[u8]) -> (Vec<&[u8]>, &[u8]) {
    let mut lines = Vec::new();
    let mut start = 0;
    for (i, b) in data.iter().enumerate() {
        if *b == b'\n' {
            lines.push(&data[start..=i]);
            start = i + 1;
        }
    }
    (lines, &data[start..])
}

/// Pick lines per since/tail (input: lines with their timestamps).
pub fn select<'a>(
    lines: &[(&'a [u8], OffsetDateTime)],
    q: &LogQuery,
) -> Vec<(&'a [u8], OffsetDateTime)> {
    if q.stream == StreamSel::Stderr {
        return Vec::new();
    }
    let filtered: Vec<(&[u8], OffsetDateTime)> = lines
        .iter()
        .filter(|(_, t)| q.since.is_none_or_ts(*t))
        .copied()
        .collect();
    match q.tail_lines {
        Some(n) if n < filtered.len() => filtered[filtered.len() - n..].to_vec(),
        _ => filtered,
    }
}

trait SinceExt {
    fn is_none_or_ts(&self, t: OffsetDateTime) -> bool;
}

impl SinceExt for Option<OffsetDateTime> {
    fn is_none_or_ts(&self, t: OffsetDateTime) -> bool {
        match self {
            None => true,
            Some(s) => t >= *s,
        }
    }
}

/// Formats lines and enforces limitBytes across the whole response.
pub struct Emitter {
    timestamps: bool,
    remaining: Option<u64>,
}

impl Emitter {
    pub fn new(q: &LogQuery) -> Self {
        Self {
            timestamps: q.timestamps,
            remaining: q.limit_bytes,
        }
    }
    /// Whether limitBytes has been reached.
    pub fn exhausted(&self) -> bool {
        self.remaining == Some(0)
    }
    /// Append one line (timestamp-prefixed if asked), truncated to the limit.
    pub fn push(&mut self, out: &mut Vec<u8>, line: &[u8], ts: OffsetDateTime) {
        let mut buf = Vec::with_capacity(line.len() + 32);
        if self.timestamps {
            buf.extend_from_slice(format_timestamp(ts).as_bytes());
            buf.push(b' ');
        }
        buf.extend_from_slice(line);
        if let Some(rem) = self.remaining.as_mut() {
            let take = (buf.len() as u64).min(*rem) as usize;
            buf.truncate(take);
            *rem -= take as u64;
        }
        out.extend_from_slice(&buf);
    }
}

/// Path of a container's log file.
pub fn log_path(log_dir: &Path, ns: &str, pod: &str, container: &str, previous: bool) -> PathBuf {
    let suffix = if previous { ".previous.log" } else { ".log" };
    log_dir.join(format!("{ns}_{pod}_{container}{suffix}"))
}

fn mtime_of(meta: &std::fs::Metadata) -> OffsetDateTime {
    meta.modified()
        .map(OffsetDateTime::from)
        .unwrap_or_else(|_| OffsetDateTime::now_utc())
}

/// Entry point of `GET /containerLogs/{ns}/{pod}/{container}`.
pub async fn handle(
    state: Arc<AppState>,
    query: Option<&str>,
    ns: &str,
    pod: &str,
    container: &str,
) -> Response<Body> {
    let Some(spec) = state.pods.find(ns, pod, None) else {
        return http_util::not_found(&format!("pod {ns}/{pod}"));
    };
    if !spec.containers.iter().any(|c| c == container) {
        return http_util::text(
            StatusCode::NOT_FOUND,
            format!("container {container:?} in pod {pod:?} is not available\n"),
        );
    }
    let q = match parse_query(query, OffsetDateTime::now_utc()) {
        Ok(q) => q,
        Err(QueryError::BadRequest(m)) => {
            return http_util::text(StatusCode::BAD_REQUEST, m + "\n")
        }
        Err(QueryError::Invalid(m)) => {
            return http_util::text(StatusCode::UNPROCESSABLE_ENTITY, m + "\n")
        }
    };
    let path = log_path(&state.log_dir, ns, pod, container, q.previous);
    if q.previous && tokio::fs::metadata(&path).await.is_err() {
        return http_util::text(
            StatusCode::BAD_REQUEST,
            format!("previous terminated container {container:?} in pod {pod:?} not found\n"),
        );
    }
    // The file as it is now, before the response head goes out: a line
    // appended after the client has its head is followed, never taken for
    // an existing one (which `tailLines=0` would skip), however late the
    // task below runs.
    let first = read_from(&path, 0).await;
    let (tx, body) = http_util::channel_body(16);
    tokio::spawn(async move {
        if let Err(e) = stream_log(&state.logs, &path, &q, first, tx).await {
            tracing::debug!("log stream {}: {e:#}", path.display());
        }
    });
    let mut r = Response::new(body);
    if let Ok(v) = "text/plain".parse() {
        r.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    r
}

async fn read_from(path: &Path, offset: u64) -> std::io::Result<(Vec<u8>, u64, OffsetDateTime)> {
    let mut f = tokio::fs::File::open(path).await?;
    let meta = f.metadata().await?;
    let len = meta.len();
    let mut data = Vec::new();
    if len > offset {
        f.seek(SeekFrom::Start(offset)).await?;
        (&mut f).take(len - offset).read_to_end(&mut data).await?;
    }
    Ok((data, len, mtime_of(&meta)))
}

/// Produce the response body: the selected existing lines (`first`: the
/// file as read when the request came), then (follow) lines as they are
/// appended, until the client goes away or the limit hits.
pub async fn stream_log(
    index: &LogIndex,
    path: &Path,
    q: &LogQuery,
    first: std::io::Result<(Vec<u8>, u64, OffsetDateTime)>,
    tx: tokio::sync::mpsc::Sender<Bytes>,
) -> anyhow::Result<()> {
    let mut emitter = Emitter::new(q);
    let follow = q.follow && !q.previous;
    let mut offset: u64 = 0;
    match first {
        Ok((data, len, mtime)) => {
            let (lines, partial) = split_lines(&data);
            let stamps = index.stamp(path, len, mtime, 0, &lines);
            let stamped: Vec<(&[u8], OffsetDateTime)> = lines.iter().copied().zip(stamps).collect();
            let mut out = Vec::new();
            for (line, ts) in select(&stamped, q) {
                emitter.push(&mut out, line, ts);
            }
            offset = (data.len() - partial.len()) as u64;
            if !follow && !partial.is_empty() && q.stream != StreamSel::Stderr {
                emitter.push(&mut out, partial, OffsetDateTime::now_utc());
            }
            if !out.is_empty() && tx.send(Bytes::from(out)).await.is_err() {
                return Ok(());
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => anyhow::bail!("read {}: {e}", path.display()),
    }
    if !follow || emitter.exhausted() {
        return Ok(());
    }
    loop {
        tokio::select! {
            _ = tokio::time::sleep(POLL) => {}
            _ = tx.closed() => return Ok(()),
        }
        let (data, len, mtime) = match read_from(path, offset).await {
            Ok(v) => v,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => anyhow::bail!("read {}: {e}", path.display()),
        };
        if len < offset {
            // Truncated or replaced: start over from the beginning.
            offset = 0;
            continue;
        }
        let (lines, _partial) = split_lines(&data);
        if lines.is_empty() {
            continue;
        }
        let stamps = index.stamp(path, len, mtime, offset, &lines);
        let mut out = Vec::new();
        for (line, ts) in lines.iter().zip(stamps) {
            offset += line.len() as u64;
            if q.stream != StreamSel::Stderr && q.since.is_none_or_ts(ts) {
                emitter.push(&mut out, line, ts);
            }
        }
        if !out.is_empty() && tx.send(Bytes::from(out)).await.is_err() {
            return Ok(());
        }
        if emitter.exhausted() {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line appended once the client has the response head is followed,
    /// not taken for an existing line (which `tailLines=0` skips), however
    /// late the streaming task first runs: here it has not run at all when
    /// the line is appended (one thread, nothing awaited in between).
    #[tokio::test(flavor = "current_thread")]
    async fn a_line_appended_after_the_head_is_followed_with_tail_zero() {
        use http_body_util::BodyExt;
        let dir = std::env::temp_dir().join(format!("kubelet-sim-tail0-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let spec = crate::config::parse_pod_spec("default/p=c").expect("pod");
        let state = Arc::new(crate::server::AppState {
            node: "n".into(),
            pods: crate::pods::Pods::new("n".into(), vec![spec]),
            log_dir: dir.clone(),
            work_dir: None,
            attach: crate::attach::Registry::default(),
            logs: LogIndex::default(),
            started: std::time::Instant::now(),
            port: 0,
        });
        let file = log_path(&dir, "default", "p", "c", false);
        std::fs::write(&file, "old line\n").expect("write");
        let resp = handle(state, Some("follow=true&tailLines=0"), "default", "p", "c").await;
        assert_eq!(resp.status(), StatusCode::OK);
        {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(&file)
                .expect("open");
            f.write_all(b"new line\n").expect("append");
        }
        let mut body = resp.into_body();
        let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .expect("the appended line within 10 s")
            .expect("a frame")
            .expect("data");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(frame.into_data().ok().as_deref(), Some(&b"new line\n"[..]));
    }

    fn now() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_700_000_000).expect("ts")
    }

    #[test]
    fn query_parsing() {
        let q = parse_query(
            Some("follow=true&tailLines=3&timestamps=1&limitBytes=10&sinceSeconds=5"),
            now(),
        )
        .expect("parse");
        assert!(q.follow && q.timestamps && !q.previous);
        assert_eq!(q.tail_lines, Some(3));
        assert_eq!(q.limit_bytes, Some(10));
        assert_eq!(q.since, Some(now() - time::Duration::seconds(5)));
        let q = parse_query(Some("tail=2"), now()).expect("legacy tail");
        assert_eq!(q.tail_lines, Some(2));
        let q = parse_query(Some("tail=-1"), now()).expect("legacy tail all");
        assert_eq!(q.tail_lines, None);
        let q = parse_query(Some("sinceTime=2024-01-02T03:04:05Z&stream=Stderr"), now())
            .expect("sinceTime");
        assert_eq!(q.since.map(|t| t.unix_timestamp()), Some(1_704_164_645));
        assert_eq!(q.stream, StreamSel::Stderr);
        assert!(matches!(
            parse_query(Some("follow=maybe"), now()),
            Err(QueryError::BadRequest(_))
        ));
        assert!(matches!(
            parse_query(Some("tailLines=x"), now()),
            Err(QueryError::BadRequest(_))
        ));
        assert!(matches!(
            parse_query(Some("sinceTime=yesterday"), now()),
            Err(QueryError::BadRequest(_))
        ));
        assert!(matches!(
            parse_query(Some("tailLines=-2"), now()),
            Err(QueryError::Invalid(_))
        ));
        assert!(matches!(
            parse_query(Some("limitBytes=0"), now()),
            Err(QueryError::Invalid(_))
        ));
        assert!(matches!(
            parse_query(Some("sinceSeconds=1&sinceTime=2024-01-02T03:04:05Z"), now()),
            Err(QueryError::Invalid(_))
        ));
    }

    #[test]
    fn tail_since_and_limit() {
        let data = b"a\nbb\nccc\ndddd\npartial";
        let (lines, partial) = split_lines(data);
        assert_eq!(lines.len(), 4);
        assert_eq!(partial, b"partial");
        let stamped: Vec<(&[u8], OffsetDateTime)> = lines
            .iter()
            .enumerate()
            .map(|(i, l)| (*l, now() + time::Duration::seconds(i as i64)))
            .collect();
        let mut q = parse_query(Some("tailLines=2"), now()).expect("q");
        let sel = select(&stamped, &q);
        assert_eq!(
            sel.iter().map(|(l, _)| *l).collect::<Vec<_>>(),
            vec![&b"ccc\n"[..], b"dddd\n"]
        );
        q.tail_lines = Some(0);
        assert!(select(&stamped, &q).is_empty());
        q.tail_lines = None;
        q.since = Some(now() + time::Duration::seconds(1));
        assert_eq!(select(&stamped, &q).len(), 3);

        let q = parse_query(Some("limitBytes=6"), now()).expect("q");
        let mut e = Emitter::new(&q);
        let mut out = Vec::new();
        for (l, t) in &stamped {
            e.push(&mut out, l, *t);
        }
        assert_eq!(out, b"a\nbb\nc");
        assert!(e.exhausted());

        let q = parse_query(Some("timestamps=true"), now()).expect("q");
        let mut e = Emitter::new(&q);
        let mut out = Vec::new();
        e.push(&mut out, b"x\n", now());
        assert_eq!(out, b"2023-11-14T22:13:20.000000000Z x\n");
    }

    #[test]
    fn index_keeps_first_seen_times() {
        let idx = LogIndex::default();
        let p = Path::new("/nonexistent/x.log");
        let mtime = now();
        let t1 = idx.stamp(p, 4, mtime, 0, &[b"a\n", b"b\n"]);
        assert_eq!(t1, vec![mtime, mtime]);
        // A later read sees the same times for old lines and "now" for new ones.
        let t2 = idx.stamp(
            p,
            6,
            now() + time::Duration::hours(1),
            0,
            &[b"a\n", b"b\n", b"c\n"],
        );
        assert_eq!(&t2[..2], &t1[..]);
        assert!(t2[2] > mtime);
        // Truncation resets the index.
        let t3 = idx.stamp(p, 2, mtime, 0, &[b"z\n"]);
        assert!(t3[0] > mtime);
    }
}
