//! Which kubelet API paths Tether forwards, and what each names.
//!
//! Both ends use [`classify`]: the cloud to route (pod-scoped paths by the pod,
//! node-scoped paths by node name, SNI or `Host`) and to answer everything else
//! with 404 itself; the edge to refuse any path the cloud should never have
//! sent, so a compromised or buggy cloud cannot reach other kubelet endpoints
//! (`/run`, `/checkpoint`, `/debug/pprof`, `/configz`…).

/// What kind of kubelet call a stream carries (a bounded label for metrics and
/// logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamKind {
    Exec,
    Attach,
    PortForward,
    Logs,
    Metrics,
    Other,
}

impl StreamKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StreamKind::Exec => "exec",
            StreamKind::Attach => "attach",
            StreamKind::PortForward => "portforward",
            StreamKind::Logs => "logs",
            StreamKind::Metrics => "metrics",
            StreamKind::Other => "other",
        }
    }
}

/// A forwarded kubelet path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route<'a> {
    /// `/exec|attach|portForward|containerLogs/{ns}/{pod}/…`: routed by the pod.
    Pod {
        kind: StreamKind,
        namespace: &'a str,
        pod: &'a str,
    },
    /// Node-wide paths: routed by node name, SNI or `Host`.
    Node { kind: StreamKind },
}

impl Route<'_> {
    pub fn kind(&self) -> StreamKind {
        match self {
            Route::Pod { kind, .. } | Route::Node { kind } => *kind,
        }
    }
}

fn valid_segment(s: &str) -> bool {
    // Judged as the kubelet will see it: percent-escapes decoded, so `%2e%2e`
    // is `..` and `%2f` a separator. A malformed escape is refused too.
    let Some(decoded) = percent_decode(s) else {
        return false;
    };
    !decoded.is_empty()
        && decoded != b"."
        && decoded != b".."
        && !decoded.iter().any(|&b| b == b'/' || b == b'\\' || b == 0)
}

/// A segment under `/logs/`: may be empty (`/logs/`, `a//b`), never `..`
/// or a hidden separator, decoded or not.
fn log_segment(s: &str) -> bool {
    s.is_empty() || (valid_segment(s) || percent_decode(s).is_some_and(|d| d == b"."))
}

/// `%XX`-decodes `s`; `None` if an escape is malformed.
fn percent_decode(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Some(out)
}

/// Classifies a request path (without query). `None`: not forwarded.
pub fn classify(path: &str) -> Option<Route<'_>> {
    let rest = path.strip_prefix('/')?;
    let segs: Vec<&str> = rest.split('/').collect();
    let pod_scoped = |kind, min: usize, max: usize| {
        let n = segs.len() - 1;
        if n < min || n > max || !segs[1..].iter().all(|s| valid_segment(s)) {
            return None;
        }
        Some(Route::Pod {
            kind,
            namespace: segs[1],
            pod: segs[2],
        })
    };
    match segs[0] {
        // {ns}/{pod}/{container} or {ns}/{pod}/{uid}/{container}
        "exec" => pod_scoped(StreamKind::Exec, 3, 4),
        "attach" => pod_scoped(StreamKind::Attach, 3, 4),
        // {ns}/{pod} or {ns}/{pod}/{uid}
        "portForward" => pod_scoped(StreamKind::PortForward, 2, 3),
        // {ns}/{pod}/{container}
        "containerLogs" => pod_scoped(StreamKind::Logs, 3, 3),
        // /logs/ and /logs/{path}
        "logs" if segs.len() >= 2 && segs[1..].iter().all(|s| log_segment(s)) => {
            Some(Route::Node {
                kind: StreamKind::Logs,
            })
        }
        "metrics" => match &segs[1..] {
            [] | ["cadvisor"] | ["resource"] | ["probes"] | ["slis"] => Some(Route::Node {
                kind: StreamKind::Metrics,
            }),
            _ => None,
        },
        "stats" => match &segs[1..] {
            ["summary"] => Some(Route::Node {
                kind: StreamKind::Metrics,
            }),
            _ => None,
        },
        "pods" if segs.len() == 1 => Some(Route::Node {
            kind: StreamKind::Other,
        }),
        "runningpods" if segs.len() == 2 && segs[1].is_empty() => Some(Route::Node {
            kind: StreamKind::Other,
        }),
        "healthz" => match &segs[1..] {
            [] | ["ping"] | ["log"] | ["syncloop"] => Some(Route::Node {
                kind: StreamKind::Other,
            }),
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_scoped_paths() {
        assert_eq!(
            classify("/exec/default/p1/c1"),
            Some(Route::Pod {
                kind: StreamKind::Exec,
                namespace: "default",
                pod: "p1"
            })
        );
        assert_eq!(
            classify("/attach/ns/p/uid-1/c"),
            Some(Route::Pod {
                kind: StreamKind::Attach,
                namespace: "ns",
                pod: "p"
            })
        );
        assert_eq!(
            classify("/portForward/ns/p").map(|r| r.kind()),
            Some(StreamKind::PortForward)
        );
        assert_eq!(
            classify("/portForward/ns/p/uid").map(|r| r.kind()),
            Some(StreamKind::PortForward)
        );
        assert_eq!(
            classify("/containerLogs/ns/p/c").map(|r| r.kind()),
            Some(StreamKind::Logs)
        );
        assert_eq!(classify("/exec/ns/p"), None);
        assert_eq!(classify("/exec/ns/p/u/c/x"), None);
        assert_eq!(classify("/exec/ns//c"), None);
        assert_eq!(classify("/exec/ns/../c"), None);
        // Escapes are judged decoded, as the kubelet sees them.
        assert_eq!(classify("/exec/ns/%2e%2e/c"), None);
        assert_eq!(classify("/exec/ns/%2E./c"), None);
        assert_eq!(classify("/containerLogs/ns/p%2fq/c"), None);
        assert_eq!(classify("/containerLogs/ns/p%5cq/c"), None);
        assert_eq!(classify("/containerLogs/ns/p%zz/c"), None);
        assert_eq!(classify("/logs/%2e%2e/%2e%2e/etc/passwd"), None);
        assert_eq!(classify("/logs/a%2f..%2f..%2fetc"), None);
        assert_eq!(
            classify("/containerLogs/ns/p%2dq/c").map(|r| r.kind()),
            Some(StreamKind::Logs)
        );
        assert_eq!(classify("/containerLogs/ns/p/uid/c"), None);
    }

    #[test]
    fn node_scoped_paths() {
        for p in [
            "/logs/",
            "/logs/syslog",
            "/metrics",
            "/metrics/cadvisor",
            "/metrics/resource",
            "/metrics/probes",
            "/stats/summary",
            "/pods",
            "/runningpods/",
            "/healthz",
        ] {
            assert!(matches!(classify(p), Some(Route::Node { .. })), "{p}");
        }
    }

    #[test]
    fn everything_else_is_not_forwarded() {
        for p in [
            "/",
            "",
            "/run/ns/p/c",
            "/configz",
            "/debug/pprof/heap",
            "/checkpoint/ns/p/c",
            "/metrics/x",
            "/logs/../etc",
            "/logs",
            "/pods/x",
            "exec/ns/p/c",
        ] {
            assert_eq!(classify(p), None, "{p}");
        }
    }
}
