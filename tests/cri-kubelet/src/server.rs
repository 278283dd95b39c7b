//! The kubelet API over plain HTTP/1.1 with upgrades: start-up (connect to the CRI, run
//! the pods, print the listening line), routing, `/pods` (this stand-in's own pods only:
//! several may share one containerd), and removing the pods on SIGTERM/SIGINT.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::sync::Mutex;

use crate::config::Cli;
use crate::cri::{RunningPod, Runtime, StreamFlags};
use crate::{logs, stats};

/// Header naming the node that served a response (as kubelet-sim sends it).
pub const NODE_HEADER: &str = "x-kubelet-sim-node";

/// Response body type.
pub type Body = BoxBody<Bytes, Infallible>;

/// A complete body.
pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).boxed()
}

/// An empty body.
pub fn empty() -> Body {
    full(Bytes::new())
}

/// A plain-text answer.
pub fn text(status: StatusCode, msg: impl Into<String>) -> Response<Body> {
    let mut r = Response::new(full(msg.into()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

struct State {
    node: String,
    runtime: Mutex<Runtime>,
    pods: HashMap<(String, String), RunningPod>,
    started: time::OffsetDateTime,
}

/// Connect, run the pods, serve until SIGTERM/SIGINT, then remove the pods.
pub async fn run(cli: Cli) -> Result<()> {
    let mut runtime = Runtime::connect(
        &cli.runtime_endpoint,
        Duration::from_secs(cli.cri_timeout_secs),
    )
    .await?;
    std::fs::create_dir_all(&cli.log_root)
        .with_context(|| format!("creating {}", cli.log_root.display()))?;
    let mut pods = HashMap::new();
    for p in &cli.pods {
        match runtime
            .run_pod(
                p,
                &cli.node_name,
                &cli.log_root,
                &cli.image,
                &cli.script,
                cli.share_dir.as_deref(),
            )
            .await
        {
            Ok(running) => {
                pods.insert((p.namespace.clone(), p.name.clone()), running);
            }
            Err(e) => {
                for made in pods.values() {
                    let made: &RunningPod = made;
                    if let Err(e2) = runtime.remove_pod(&made.sandbox_id).await {
                        tracing::warn!("removing pod {}: {e2:#}", made.spec.name);
                    }
                }
                return Err(e);
            }
        }
    }
    let listener = tokio::net::TcpListener::bind(cli.listen)
        .await
        .with_context(|| format!("bind {}", cli.listen))?;
    let local = listener.local_addr().context("local address")?;
    let state = Arc::new(State {
        node: cli.node_name.clone(),
        runtime: Mutex::new(runtime),
        pods,
        started: time::OffsetDateTime::now_utc(),
    });
    println!(
        "cri-kubelet listening on http://{local} node={}",
        cli.node_name
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("SIGTERM handler")?;
    loop {
        let (tcp, peer) = tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => { tracing::warn!("accept: {e}"); continue; }
            },
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        };
        let state = state.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let state = state.clone();
                async move {
                    let node = http::HeaderValue::from_str(&state.node).ok();
                    let mut resp = route(req, state).await;
                    // The harness checks with this header which node answered.
                    if let Some(n) = node {
                        resp.headers_mut().insert(NODE_HEADER, n);
                    }
                    Ok::<_, Infallible>(resp)
                }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tcp), svc)
                .with_upgrades()
                .await
            {
                tracing::debug!("connection from {peer}: {e}");
            }
        });
    }
    if cli.cleanup {
        let mut rt = state.runtime.lock().await;
        for p in state.pods.values() {
            if let Err(e) = rt.remove_pod(&p.sandbox_id).await {
                tracing::warn!("removing pod {}: {e:#}", p.spec.name);
            }
        }
        println!("cri-kubelet: pods removed");
    }
    Ok(())
}

fn query(req: &Request<Incoming>) -> Vec<(String, String)> {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|s| !s.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() && s.is_char_boundary(i + 3) => {
                match u8::from_str_radix(&s[i + 1..i + 3], 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn flag(q: &[(String, String)], k: &str) -> bool {
    q.iter()
        .any(|(key, v)| key == k && matches!(v.as_str(), "1" | "true" | "True" | ""))
}

fn value<'a>(q: &'a [(String, String)], k: &str) -> Option<&'a str> {
    q.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str())
}

async fn route(req: Request<Incoming>, state: Arc<State>) -> Response<Body> {
    let path = req.uri().path().to_string();
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let q = query(&req);
    match parts.as_slice() {
        [verb @ ("exec" | "attach"), ns, pod, rest @ ..] if !rest.is_empty() && rest.len() <= 2 => {
            let container = rest[rest.len() - 1];
            let Some(p) = state.pods.get(&(ns.to_string(), pod.to_string())) else {
                return text(StatusCode::NOT_FOUND, format!("pod {ns}/{pod} not found\n"));
            };
            let Some(id) = p.containers.get(container) else {
                return text(
                    StatusCode::NOT_FOUND,
                    format!("container {container} is not valid for pod {pod}\n"),
                );
            };
            let io = StreamFlags {
                stdin: flag(&q, "input") || flag(&q, "stdin"),
                stdout: flag(&q, "output") || flag(&q, "stdout"),
                stderr: flag(&q, "error") || flag(&q, "stderr"),
                tty: flag(&q, "tty"),
            };
            let url = {
                let mut rt = state.runtime.lock().await;
                if *verb == "exec" {
                    let cmd: Vec<String> = q
                        .iter()
                        .filter(|(k, _)| k == "command")
                        .map(|(_, v)| v.clone())
                        .collect();
                    rt.exec_url(id, cmd, io).await
                } else {
                    rt.attach_url(id, io).await
                }
            };
            match url {
                Ok(u) => crate::proxy::proxy_upgrade(req, &u).await,
                Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}\n")),
            }
        }
        ["portForward", ns, pod, ..] => {
            let Some(p) = state.pods.get(&(ns.to_string(), pod.to_string())) else {
                return text(StatusCode::NOT_FOUND, format!("pod {ns}/{pod} not found\n"));
            };
            let url = state
                .runtime
                .lock()
                .await
                .port_forward_url(&p.sandbox_id)
                .await;
            match url {
                Ok(u) => crate::proxy::proxy_upgrade(req, &u).await,
                Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}\n")),
            }
        }
        ["containerLogs", ns, pod, container] => {
            let Some(p) = state.pods.get(&(ns.to_string(), pod.to_string())) else {
                return text(StatusCode::NOT_FOUND, format!("pod {ns}/{pod} not found\n"));
            };
            if !p.containers.contains_key(*container) {
                return text(
                    StatusCode::NOT_FOUND,
                    format!("container {container} is not valid for pod {pod}\n"),
                );
            }
            container_logs(p, container, &q).await
        }
        ["pods"] | ["pods", ""] => pods(&state).await,
        ["stats", "summary"] => match snapshot(&state).await {
            Ok(s) => json(&stats::summary(&s, flag(&q, "only_cpu_and_memory"))),
            Err(r) => r,
        },
        ["metrics", "resource"] => match snapshot(&state).await {
            Ok(s) => prometheus(stats::resource_metrics(&s)),
            Err(r) => r,
        },
        ["metrics"] => match snapshot(&state).await {
            Ok(s) => prometheus(stats::kubelet_metrics(&s, state.started)),
            Err(r) => r,
        },
        ["healthz"] => text(StatusCode::OK, "ok"),
        _ => text(StatusCode::NOT_FOUND, "404 page not found\n"),
    }
}

async fn snapshot(state: &State) -> Result<stats::Snapshot, Response<Body>> {
    let mut rt = state.runtime.lock().await;
    stats::snapshot(&mut rt, &state.node, &state.pods)
        .await
        .map_err(|e| text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}\n")))
}

fn json(v: &serde_json::Value) -> Response<Body> {
    let mut r = Response::new(full(v.to_string()));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

fn prometheus(body: String) -> Response<Body> {
    let mut r = Response::new(full(body));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}

async fn container_logs(p: &RunningPod, container: &str, q: &[(String, String)]) -> Response<Body> {
    let num = |k: &str| -> Result<Option<i64>, String> {
        match value(q, k) {
            None => Ok(None),
            Some(v) => v
                .parse::<i64>()
                .map(Some)
                .map_err(|_| format!("invalid {k} {v:?}\n")),
        }
    };
    let mut opts = logs::Options {
        follow: flag(q, "follow"),
        timestamps: flag(q, "timestamps"),
        previous: flag(q, "previous"),
        ..Default::default()
    };
    match (num("tailLines"), num("limitBytes"), num("sinceSeconds")) {
        (Ok(t), Ok(l), Ok(s)) => {
            opts.tail = t.map(|v| v.max(0) as usize);
            opts.limit_bytes = l.map(|v| v.max(0) as usize);
            opts.since =
                s.map(|v| time::OffsetDateTime::now_utc() - time::Duration::seconds(v.max(0)));
        }
        (Err(m), _, _) | (_, Err(m), _) | (_, _, Err(m)) => {
            return text(StatusCode::BAD_REQUEST, m)
        }
    }
    if let Some(v) = value(q, "sinceTime") {
        match time::OffsetDateTime::parse(v, &time::format_description::well_known::Rfc3339) {
            Ok(t) => opts.since = Some(t),
            Err(_) => {
                return text(
                    StatusCode::BAD_REQUEST,
                    format!("invalid sinceTime {v:?}\n"),
                )
            }
        }
    }
    let path = logs::log_file(&p.log_dir, container, opts.previous);
    if !path.exists() {
        return text(
            StatusCode::BAD_REQUEST,
            if opts.previous {
                format!(
                    "previous terminated container \"{container}\" in pod \"{}\" not found\n",
                    p.spec.name
                )
            } else {
                format!(
                    "container \"{container}\" in pod \"{}\" has no log\n",
                    p.spec.name
                )
            },
        );
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        if let Err(e) = logs::stream(path, opts, tx).await {
            tracing::warn!("logs: {e:#}");
        }
    });
    let body = StreamBody::new(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    }));
    let mut r = Response::new(BodyExt::boxed(body));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain"),
    );
    r
}

async fn pods(state: &State) -> Response<Body> {
    let listed = state.runtime.lock().await.list().await;
    let (sandboxes, containers) = match listed {
        Ok(l) => l,
        Err(e) => return text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}\n")),
    };
    let items: Vec<serde_json::Value> = sandboxes
        .iter()
        .filter(|s| state.pods.values().any(|p| p.sandbox_id == s.id))
        .filter_map(|s| {
            let m = s.metadata.as_ref()?;
            let cs: Vec<_> = containers
                .iter()
                .filter(|c| c.pod_sandbox_id == s.id)
                .filter_map(|c| {
                    let cm = c.metadata.as_ref()?;
                    Some(serde_json::json!({
                        "name": cm.name,
                        "image": c.image.as_ref().map(|i| i.image.clone()).unwrap_or_default(),
                    }))
                })
                .collect();
            let statuses: Vec<_> = containers
                .iter()
                .filter(|c| c.pod_sandbox_id == s.id)
                .filter_map(|c| {
                    let cm = c.metadata.as_ref()?;
                    Some(serde_json::json!({
                        "name": cm.name,
                        "containerID": format!("containerd://{}", c.id),
                        "ready": c.state == k8s_cri::v1::ContainerState::ContainerRunning as i32,
                        "restartCount": cm.attempt,
                    }))
                })
                .collect();
            Some(serde_json::json!({
                "metadata": {"name": m.name, "namespace": m.namespace, "uid": m.uid},
                "spec": {"nodeName": state.node, "hostNetwork": true, "containers": cs},
                "status": {
                    "phase": if s.state == k8s_cri::v1::PodSandboxState::SandboxReady as i32 { "Running" } else { "Succeeded" },
                    "containerStatuses": statuses,
                },
            }))
        })
        .collect();
    json(
        &serde_json::json!({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}),
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn decodes_queries() {
        assert_eq!(super::decode("a%20b+c%2F"), "a b c/");
        assert_eq!(super::decode("100%"), "100%");
        assert_eq!(super::decode("%zz"), "%zz");
    }
}
