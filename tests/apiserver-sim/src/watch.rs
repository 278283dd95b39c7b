//! List/watch of pods and nodes as kube-apiserver serves them: lists carry the
//! cluster's `resourceVersion`; `?watch=true` answers a chunked stream of
//! newline-separated `{"type","object"}` events — `ADDED` for every object when
//! no (or `0`) resourceVersion is given, `BOOKMARK`s when asked
//! (`allowWatchBookmarks`), and an `ERROR` event with a `410 Expired` Status
//! when the client resumes from a resourceVersion the cluster has compacted
//! away. Watches end after `timeoutSeconds` (capped by `--watch-timeout`).
//!
//! The cluster's objects never change, but its resourceVersion can: with
//! `--compact-after`, the cluster moves from resourceVersion 1 to 2 at that
//! time (activity elsewhere, then a compaction), open watches end, and a client
//! resuming from 1 gets 410 Gone and must list again — the path a real client
//! has to handle.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde_json::{json, Value};

use crate::body::{Body, BoxError};
use crate::query::Query;
use crate::status::ApiError;

/// How often a watch that allows bookmarks gets one.
const BOOKMARK_INTERVAL: Duration = Duration::from_secs(5);

/// The cluster's resourceVersion over time.
#[derive(Debug, Clone)]
pub struct Versions {
    started: Instant,
    compact_after: Option<Duration>,
    /// Longest watch (the apiserver's `--min-request-timeout` role).
    pub watch_timeout: Duration,
}

impl Versions {
    pub fn new(compact_after: Option<Duration>, watch_timeout: Duration) -> Self {
        Versions {
            started: Instant::now(),
            compact_after,
            watch_timeout,
        }
    }

    /// The current resourceVersion: 1, or 2 once compacted.
    pub fn current(&self) -> u64 {
        match self.compact_after {
            Some(d) if self.started.elapsed() >= d => 2,
            _ => 1,
        }
    }

    /// When the version next changes, if it will.
    fn next_change(&self) -> Option<Instant> {
        match self.compact_after {
            Some(d) if self.started.elapsed() < d => Some(self.started + d),
            _ => None,
        }
    }
}

/// Sets a list's `metadata.resourceVersion` to the cluster's.
pub fn stamp_list(mut list: Value, versions: &Versions) -> Value {
    list["metadata"]["resourceVersion"] = json!(versions.current().to_string());
    list
}

fn event(kind: &str, object: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({"type": kind, "object": object}))
        .unwrap_or_else(|_| b"{}".to_vec());
    line.push(b'\n');
    Bytes::from(line)
}

/// A watch of `kind` (`Pod`, `Node`) over `objects`, for the query `q`.
pub fn serve(
    kind: &'static str,
    objects: Vec<Value>,
    q: &Query,
    versions: &Versions,
) -> Result<Response<Body>, ApiError> {
    let current = versions.current();
    let mut initial = Vec::new();
    let mut end_now = false;
    match q.first("resourceVersion").unwrap_or("") {
        "" | "0" => initial.extend(objects.iter().map(|o| event("ADDED", o))),
        rv => {
            let rv: u64 = rv.parse().map_err(|_| {
                ApiError::invalid(format!("resourceVersion {rv:?}: not a resource version"))
            })?;
            if rv < current {
                let status = json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {},
                    "status": "Failure",
                    "message": format!("too old resource version: {rv} ({current})"),
                    "reason": "Expired", "code": 410
                });
                initial.push(event("ERROR", &status));
                end_now = true;
            } else if rv > current {
                return Err(ApiError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "Timeout",
                    format!("Too large resource version: {rv}, current: {current}"),
                ));
            }
        }
    }
    let timeout = q
        .first("timeoutSeconds")
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(versions.watch_timeout)
        .min(versions.watch_timeout);
    let bookmarks = q.flag("allowWatchBookmarks");
    let deadline = tokio::time::Instant::now() + timeout;
    let change = versions.next_change().map(tokio::time::Instant::from_std);
    let versions = versions.clone();
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        for e in initial {
            if tx.send(e).await.is_err() {
                return;
            }
        }
        if end_now {
            return;
        }
        loop {
            let tick = tokio::time::Instant::now() + BOOKMARK_INTERVAL;
            let wake = [Some(deadline), change, Some(tick)]
                .into_iter()
                .flatten()
                .min()
                .unwrap_or(deadline);
            tokio::select! {
                _ = tokio::time::sleep_until(wake) => {}
                _ = tx.closed() => return,
            }
            let now = tokio::time::Instant::now();
            // The timeout, or the cluster moved on: the apiserver ends the watch.
            if now >= deadline || change.is_some_and(|c| now >= c) {
                return;
            }
            if bookmarks {
                let object = json!({"kind": kind, "apiVersion": "v1",
                    "metadata": {"resourceVersion": versions.current().to_string()}});
                if tx.send(event("BOOKMARK", &object)).await.is_err() {
                    return;
                }
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, BoxError>(Frame::data(b)), rx))
    });
    let mut resp = Response::new(StreamBody::new(stream).boxed());
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_compact() {
        let v = Versions::new(None, Duration::from_secs(1));
        assert_eq!(v.current(), 1);
        assert!(v.next_change().is_none());
        let v = Versions::new(Some(Duration::ZERO), Duration::from_secs(1));
        assert_eq!(v.current(), 2);
        let list = stamp_list(json!({"metadata": {"resourceVersion": "1"}}), &v);
        assert_eq!(list["metadata"]["resourceVersion"], "2");
    }

    #[tokio::test]
    async fn too_old_gets_410_and_current_gets_bookmarks() {
        let v = Versions::new(Some(Duration::ZERO), Duration::from_secs(30));
        let q = Query::parse(Some("watch=true&resourceVersion=1"));
        let body = serve("Pod", vec![], &q, &v).unwrap().into_body();
        let text = body.collect().await.unwrap().to_bytes();
        let e: Value = serde_json::from_slice(&text).unwrap();
        assert_eq!(e["type"], "ERROR");
        assert_eq!(e["object"]["code"], 410);
        assert_eq!(e["object"]["reason"], "Expired");

        let q = Query::parse(Some("watch=1&timeoutSeconds=1"));
        let body = serve("Pod", vec![json!({"kind": "Pod"})], &q, &v)
            .unwrap()
            .into_body();
        let text = body.collect().await.unwrap().to_bytes();
        let e: Value = serde_json::from_slice(&text).unwrap();
        assert_eq!(e["type"], "ADDED");
        assert!(serve("Pod", vec![], &Query::parse(Some("resourceVersion=9")), &v).is_err());
    }
}
