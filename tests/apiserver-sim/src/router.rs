//! Request routing: maps each kubectl request path to discovery, pod/node reads, the
//! connect subresources, logs, nodes/proxy, or the TokenReview/SubjectAccessReview
//! endpoints ([`crate::reviews`]); everything else is a 404 Status.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;

use crate::body::{self, Body};
use crate::cluster::Cluster;
use crate::connect::{self, ConnectKind};
use crate::kubelet::Kubelets;
use crate::query::Query;
use crate::status::ApiError;
use crate::{
    discovery, headers, logs, nodeproxy, pods, reverse, table, translate, upgrade, watch,
    wsportforward,
};

/// Everything a request handler needs.
pub struct State {
    pub cluster: Cluster,
    pub kubelets: Kubelets,
    /// `host:port` clients use to reach us.
    pub server_address: String,
    /// TokenReview and SubjectAccessReview.
    pub reviews: crate::reviews::Reviews,
    /// The cluster's resourceVersion and watch limits.
    pub versions: watch::Versions,
    /// Whether exec/attach over WebSocket is translated to SPDY towards the kubelet.
    pub stream_translation: translate::StreamTranslation,
}

/// Entry point for every request.
pub async fn handle(
    req: Request<Incoming>,
    state: Arc<State>,
    peer: SocketAddr,
) -> Result<Response<Body>, Infallible> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let resp = route(req, &state, peer).await;
    let resp = resp.unwrap_or_else(ApiError::into_response);
    if resp.status().is_client_error() || resp.status().is_server_error() {
        eprintln!(
            "apiserver-sim: {method} {path} -> {}",
            resp.status().as_u16()
        );
    }
    Ok(resp)
}

fn get_only(method: &Method) -> Result<(), ApiError> {
    if method == Method::GET || method == Method::HEAD {
        Ok(())
    } else {
        Err(ApiError::method_not_allowed())
    }
}

fn ok_json(v: &serde_json::Value) -> Result<Response<Body>, ApiError> {
    Ok(body::json(StatusCode::OK, v))
}

async fn route(
    req: Request<Incoming>,
    state: &State,
    peer: SocketAddr,
) -> Result<Response<Body>, ApiError> {
    let path = req.uri().path().to_string();
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let method = req.method().clone();
    let c = &state.cluster;
    let as_table = table::wants_table(req.headers());
    let q = Query::parse(req.uri().query());
    let watching = q.flag("watch");
    match segs.as_slice() {
        ["api", "v1", "pods"] if watching => {
            get_only(&method)?;
            let objects = c
                .pods_in(None)
                .map(|p| pods::pod_json(p, c.node(&p.node)))
                .collect();
            watch::serve("Pod", objects, &q, &state.versions)
        }
        ["api", "v1", "namespaces", ns, "pods"] if watching => {
            get_only(&method)?;
            let objects = c
                .pods_in(Some(ns))
                .map(|p| pods::pod_json(p, c.node(&p.node)))
                .collect();
            watch::serve("Pod", objects, &q, &state.versions)
        }
        ["api", "v1", "nodes"] if watching => {
            get_only(&method)?;
            let objects = c.nodes.values().map(pods::node_json).collect();
            watch::serve("Node", objects, &q, &state.versions)
        }
        ["api"] | ["api", ""] => {
            get_only(&method)?;
            ok_json(&discovery::api_versions(&state.server_address))
        }
        ["apis"] | ["apis", ""] => {
            get_only(&method)?;
            ok_json(&discovery::api_group_list())
        }
        ["api", "v1"] | ["api", "v1", ""] => {
            get_only(&method)?;
            ok_json(&discovery::core_v1_resources())
        }
        ["version"] | ["version", ""] => {
            get_only(&method)?;
            ok_json(&discovery::version())
        }
        ["healthz"] | ["livez"] | ["readyz"] => {
            get_only(&method)?;
            let mut r = Response::new(body::full("ok"));
            r.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("text/plain; charset=utf-8"),
            );
            Ok(r)
        }
        ["api", "v1", "pods"] => {
            get_only(&method)?;
            if as_table {
                return ok_json(&table::pods(c.pods_in(None)));
            }
            ok_json(&watch::stamp_list(
                pods::pod_list_json(c, None),
                &state.versions,
            ))
        }
        ["api", "v1", "namespaces", ns, "pods"] => {
            get_only(&method)?;
            if as_table {
                return ok_json(&table::pods(c.pods_in(Some(ns))));
            }
            ok_json(&watch::stamp_list(
                pods::pod_list_json(c, Some(ns)),
                &state.versions,
            ))
        }
        ["api", "v1", "namespaces", ns, "pods", name] => {
            get_only(&method)?;
            let pod = c
                .pod(ns, name)
                .ok_or_else(|| ApiError::not_found("pods", name))?;
            if as_table {
                return ok_json(&table::pods([pod]));
            }
            ok_json(&pods::pod_json(pod, c.node(&pod.node)))
        }
        ["api", "v1", "namespaces", ns, "pods", name, sub] => {
            let pod = c
                .pod(ns, name)
                .ok_or_else(|| ApiError::not_found("pods", name))?;
            let node = c
                .node(&pod.node)
                .ok_or_else(|| ApiError::bad_request(format!("pod {name} has no node")))?;
            if *sub == "log" {
                get_only(&method)?;
                let loc = logs::location(pod, node, &q)?;
                return Ok(logs::serve(loc, &state.kubelets).await);
            }
            let kind = ConnectKind::from_subresource(sub).ok_or_else(ApiError::no_route)?;
            if method != Method::GET && method != Method::POST {
                return Err(ApiError::method_not_allowed());
            }
            let loc = connect::location(kind, pod, node, &q)?;
            let hdrs = req.headers();
            if kind == ConnectKind::PortForward && wsportforward::is_tunnel_request(hdrs) {
                Ok(wsportforward::serve(req, loc, &state.kubelets).await)
            } else if kind != ConnectKind::PortForward
                && state.stream_translation == translate::StreamTranslation::Translate
                && translate::wants_translation(hdrs)
            {
                let streams = translate::Streams::from_query(&q);
                Ok(translate::serve(req, loc, streams, &state.kubelets).await)
            } else if headers::is_upgrade(hdrs) {
                Ok(upgrade::proxy(req, loc, peer, Default::default(), &state.kubelets).await)
            } else {
                Ok(reverse::forward(req, loc, peer, Default::default(), &state.kubelets).await)
            }
        }
        ["api", "v1", "nodes"] => {
            get_only(&method)?;
            if as_table {
                return ok_json(&table::nodes(c.nodes.values()));
            }
            ok_json(&watch::stamp_list(pods::node_list_json(c), &state.versions))
        }
        ["api", "v1", "nodes", name] => {
            get_only(&method)?;
            let node = c
                .node(name)
                .ok_or_else(|| ApiError::not_found("nodes", name))?;
            if as_table {
                return ok_json(&table::nodes([node]));
            }
            ok_json(&pods::node_json(node))
        }
        ["api", "v1", "nodes", name, "proxy", rest @ ..] => {
            let node = c
                .node(name)
                .ok_or_else(|| ApiError::not_found("nodes", name))?;
            let rest = rest.join("/");
            Ok(nodeproxy::serve(req, node, &rest, peer, &state.kubelets).await)
        }
        ["apis", "authentication.k8s.io", "v1", "tokenreviews"] => {
            let (parts, body) = req.into_parts();
            state.reviews.token_review(&parts.method, body).await
        }
        ["apis", "authorization.k8s.io", "v1", "subjectaccessreviews"] => {
            let (parts, body) = req.into_parts();
            state.reviews.access_review(&parts.method, body).await
        }
        ["sim", "reviews"] => {
            get_only(&method)?;
            ok_json(&state.reviews.counts())
        }
        _ => Err(ApiError::no_route()),
    }
}
