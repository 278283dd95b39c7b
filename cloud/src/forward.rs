//! One apiserver request → one logical stream → the edge's kubelet.
//!
//! 1. Classify the path ([`tether_proto::route`]); anything not forwarded is
//!    answered here with 404.
//! 2. Pick the node: pod-scoped paths by the pod, node-scoped paths by
//!    `X-Forwarded-Uri`, SNI or `Host` ([`crate::registry`]). Failures name
//!    what was looked up (404 unknown, 409 ambiguous, 502 edge not connected).
//!    With peer replicas, an edge that is known but connected nowhere (it is
//!    moving between replicas) is waited for up to `--route-wait` first.
//! 3. Decide **local or relayed** ([`Forwarder::open`], the one place that
//!    does): a session held here opens a logical stream; an edge a peer
//!    holds is reached with one relay over the peer link ([`crate::relay`]);
//!    a holder that answers "not here" (a stale route) sends the request back
//!    to step 2 within the same `--route-wait`. Then write the
//!    [`RequestHead`] and stream the request body after it (none for upgrades).
//! 4. Wait for the [`ResponseHead`] (504 after `--response-timeout`; 502 if
//!    the edge cannot reach its kubelet or goes away).
//! 5. `101`: answer 101 with the kubelet's headers and pipe the upgraded
//!    connection through the stream, bytes untouched. Otherwise pass status
//!    and headers through and stream the body; if the stream breaks, the
//!    body ends with an error, so hyper aborts the response (no terminating
//!    chunk on HTTP/1.1, RST_STREAM on HTTP/2) — a cut log never looks
//!    complete.
//!
//! **Heads go within the bound agreed with the edge.** Each session holds the
//! wire bounds agreed with its edge ([`crate::session::Session::limits`]: the smaller
//! `--max-head-bytes` of the two, [`tether_proto::Limits::agree`]; for an
//! edge a peer holds, also within the bound that peer agreed with it, which
//! its route record carries). A request head larger than the cloud's own
//! bound is refused with 431 before it is routed; one that fits that but not
//! the bound of the session that would carry it is refused with 431 naming
//! that bound, the node and the flag, before a stream is opened (the edge
//! would reset the stream: a 502). The response head is read within the same
//! agreed bound. A session keeps the bounds it agreed first: should the edge
//! move to a replica configured with a smaller bound, the edge's reset names
//! the bound it applies (a 502 `LimitExceeded`).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use tether_proto::frame::ResetCode;
use tether_proto::head::{
    encode_head, is_hop_by_hop, read_head, RequestHead, ResponseHead, HEAD_LENGTH_PREFIX,
};
use tether_proto::io::StreamReset;
use tether_proto::route::{classify, Route};
use tokio::io::{AsyncWriteExt, ReadHalf};
use tracing::{debug, info, warn, Instrument};

use crate::metrics::{ResultLabel, RoleLabel};
use crate::registry::{Holder, Target};
use tether_proto::io::{ResumableIo, SharedStream};

/// The stream the forwarder talks to: always this replica's own logical
/// stream (it owns the stream wherever the edge is held).
type EdgeIo = ResumableIo;
/// What resets that stream from anywhere.
type Resetter = std::sync::Arc<SharedStream>;

use crate::authz::{attributes, bearer_token, Refusal, Reviewer, User};
use crate::config::CloudConfig;
use crate::identity::{is_allowed, ClientIdentity};
use crate::metrics::{CloudMetrics, OpenStream};
use crate::registry::{node_from_forwarded_uri, Registry, RouteError};
use crate::session::OpenError;

/// What the front knows about the apiserver connection a request came on.
#[derive(Debug)]
pub struct ConnInfo {
    pub peer: SocketAddr,
    pub sni: Option<String>,
    /// The verified client certificate's identity, if one was presented.
    pub identity: Option<ClientIdentity>,
}

/// The response body type of the front.
pub type ResBody = BoxBody<Bytes, std::io::Error>;

/// Forwards requests; shared by all apiserver connections.
pub struct Forwarder {
    cfg: Arc<CloudConfig>,
    registry: Arc<Registry>,
    metrics: CloudMetrics,
    reviewer: Option<Arc<Reviewer>>,
}

/// Who is calling, once authenticated.
enum Caller {
    /// The apiserver (an allowed identity) or the insecure opt-out: no review.
    Trusted,
    /// Anyone else: each request is authorised with a SubjectAccessReview.
    Reviewed(User),
}

/// The refusal-metric reason of an authentication/authorisation refusal.
#[derive(Clone, Copy)]
struct AuthReason(&'static str);

fn auth_refusal(e: Refusal) -> Response<ResBody> {
    let (status, reason) = match &e {
        Refusal::Unauthenticated(_) => (StatusCode::UNAUTHORIZED, "unauthenticated"),
        Refusal::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
        Refusal::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "review_unavailable"),
    };
    let mut r = error_response(status, e);
    r.extensions_mut().insert(AuthReason(reason));
    r
}

/// Marks a response the cloud answered itself (for the refusal metric).
#[derive(Clone, Copy)]
struct CloudAnswered;

fn refusal_reason(status: StatusCode) -> &'static str {
    match status {
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::CONFLICT => "ambiguous",
        StatusCode::BAD_GATEWAY => "edge_unavailable",
        StatusCode::GATEWAY_TIMEOUT => "edge_timeout",
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => "head_too_large",
        StatusCode::SERVICE_UNAVAILABLE => "too_many_streams",
        _ => "other",
    }
}

fn error_response(status: StatusCode, message: impl std::fmt::Display) -> Response<ResBody> {
    let body = format!("tether-cloud: {message}\n");
    let mut r = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed(),
    );
    r.extensions_mut().insert(CloudAnswered);
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn route_status(e: &RouteError) -> StatusCode {
    match e {
        RouteError::UnknownPod { .. }
        | RouteError::UnknownNode { .. }
        | RouteError::NoHint
        | RouteError::PodUnscheduled { .. } => StatusCode::NOT_FOUND,
        RouteError::AmbiguousPod { .. } | RouteError::AmbiguousAddress { .. } => {
            StatusCode::CONFLICT
        }
        RouteError::PodNodeGone { .. } => StatusCode::BAD_GATEWAY,
        RouteError::ForwardedUriUntrusted { .. } => StatusCode::MISDIRECTED_REQUEST,
    }
}

/// Whether the request asks for a connection upgrade (HTTP/1.1 only).
fn upgrade_of(req: &Request<Incoming>) -> Option<HeaderValue> {
    if req.version() != http::Version::HTTP_11 {
        return None;
    }
    let wants = req
        .headers()
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    if wants {
        req.headers().get(http::header::UPGRADE).cloned()
    } else {
        None
    }
}

impl Forwarder {
    pub fn new(
        cfg: Arc<CloudConfig>,
        registry: Arc<Registry>,
        metrics: CloudMetrics,
        reviewer: Option<Arc<Reviewer>>,
    ) -> Self {
        Forwarder {
            cfg,
            registry,
            metrics,
            reviewer,
        }
    }

    /// Who is calling: the apiserver (a client certificate with one of
    /// `--apiserver-allowed-identity`, or the insecure opt-out), or, with
    /// `--authorization-webhook`, another certificate's user, a bearer token's
    /// user (TokenReview) or `system:anonymous`. Otherwise 401/403.
    async fn authenticate(
        &self,
        conn: &ConnInfo,
        req: &Request<Incoming>,
    ) -> Result<Caller, Refusal> {
        if self.cfg.apiserver_client_ca.is_none() {
            return Ok(Caller::Trusted);
        }
        let webhook = self.cfg.webhook.as_ref();
        if let Some(who) = &conn.identity {
            if is_allowed(&self.cfg.apiserver_allowed_identities, who) {
                return Ok(Caller::Trusted);
            }
            if self.reviewer.is_some() {
                return Ok(Caller::Reviewed(User {
                    name: who.user.clone().unwrap_or_default(),
                    uid: String::new(),
                    groups: who.groups.clone(),
                }));
            }
            let allowed: Vec<String> = self
                .cfg
                .apiserver_allowed_identities
                .iter()
                .map(|a| a.to_string())
                .collect();
            return Err(Refusal::Forbidden(format!(
                "client certificate {who} is not allowed to use the kubelet API (--apiserver-allowed-identity: {})",
                allowed.join(",")
            )));
        }
        if let Some(h) = req.headers().get(http::header::AUTHORIZATION) {
            let token = bearer_token(h)?;
            return match (&self.reviewer, webhook.is_some_and(|w| w.tokens)) {
                (Some(r), true) => r.authenticate(token).await.map(Caller::Reviewed),
                _ => Err(Refusal::Unauthenticated(
                    "bearer tokens are not accepted (--authentication-token-webhook is off)".into(),
                )),
            };
        }
        if webhook.is_some_and(|w| w.anonymous) {
            return Ok(Caller::Reviewed(User {
                name: "system:anonymous".into(),
                uid: String::new(),
                groups: vec!["system:unauthenticated".into()],
            }));
        }
        Err(Refusal::Unauthenticated(
            "no client certificate and no bearer token".into(),
        ))
    }

    /// Handles one request; always produces a response.
    pub async fn handle(&self, req: Request<Incoming>, conn: Arc<ConnInfo>) -> Response<ResBody> {
        let started = std::time::Instant::now();
        let resp = self.forward(req, conn).await;
        if let Some(AuthReason(reason)) = resp.extensions().get::<AuthReason>() {
            self.metrics.refuse(reason);
        } else if resp.extensions().get::<CloudAnswered>().is_some() {
            self.metrics.refuse(refusal_reason(resp.status()));
        } else {
            self.metrics
                .stream_open_seconds
                .observe(started.elapsed().as_secs_f64());
        }
        resp
    }

    /// The steps of the module doc, in order.
    async fn forward(&self, mut req: Request<Incoming>, conn: Arc<ConnInfo>) -> Response<ResBody> {
        // Until this returns, a draining replica waits for this request.
        let _pending = self.metrics.request_pending();
        let path = req.uri().path().to_string();
        let caller = match self.authenticate(&conn, &req).await {
            Ok(c) => c,
            Err(e) => {
                warn!(peer = %conn.peer, %path, error = %e, "request refused");
                return auth_refusal(e);
            }
        };
        let Some(route) = classify(&path) else {
            return error_response(
                StatusCode::NOT_FOUND,
                format_args!("{path} is not a kubelet API path Tether forwards"),
            );
        };
        // A caller's bearer token is for the cloud, never for an edge.
        req.headers_mut().remove(http::header::AUTHORIZATION);
        let kind = route.kind();
        let upgrade = upgrade_of(&req);
        let head = request_head(&req, upgrade.as_ref());
        // Within the cloud's own bound first, before routing: a head over it
        // fits no edge. The edge's agreed bound is checked once it is known.
        let head_bytes = match encode_head(&head, self.cfg.limits.max_head_bytes as usize) {
            Ok(b) => b,
            Err(e) => {
                return error_response(
                    StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                    format_args!("request head: {e}"),
                )
            }
        };
        let sending = Sending {
            kind,
            head_len: head_bytes.len().saturating_sub(HEAD_LENGTH_PREFIX),
        };
        let (target, io, max_head) = match self
            .reach(&route, &req, &conn, &caller, &path, sending)
            .await
        {
            Ok(x) => x,
            Err(resp) => return resp,
        };
        let open_guard = self.metrics.stream_opened(kind);
        let via = match &target.holder {
            Holder::Local(_) => "local".to_string(),
            Holder::Remote { replica, .. } => replica.name.clone(),
        };
        let span =
            tracing::info_span!("request", node = %target.node, via = %via, kind = kind.as_str());
        let sent = Sent {
            head,
            head_bytes,
            max_head,
        };
        self.exchange(req, target.node, io, sent, upgrade, open_guard)
            .instrument(span)
            .await
    }

    /// Steps 2 and 3: routes the request (waiting, with peers, a bounded
    /// `--route-wait` for an edge that is between replicas), authorises it
    /// for the node, and opens the stream — local, or relayed once to the
    /// replica that holds the edge. A relay the holder answers "not here" (a
    /// stale route) is routed again from this replica's table, never passed on.
    /// Returns the stream and the head bound agreed with its edge.
    async fn reach(
        &self,
        route: &Route<'_>,
        req: &Request<Incoming>,
        conn: &ConnInfo,
        caller: &Caller,
        path: &str,
        sending: Sending,
    ) -> Result<(Target, EdgeIo, usize), Response<ResBody>> {
        let deadline = tokio::time::Instant::now() + self.cfg.route_wait;
        let mut changes = self.registry.any_changes();
        let mut authorised: Option<String> = None;
        loop {
            let target = match self.pick(route, req, conn, deadline, &mut changes).await {
                Ok(t) => t,
                Err(e) => {
                    self.metrics.lookup("unroutable");
                    info!(peer = %conn.peer, %path, error = %e, "request not routed");
                    return Err(error_response(route_status(&e), e));
                }
            };
            if authorised.as_deref() != Some(target.node.as_str()) {
                self.authorise(caller, req, conn, path, &target.node)
                    .await?;
                authorised = Some(target.node.clone());
            }
            match self.open(&target, sending).await {
                Ok((io, max_head)) => return Ok((target, io, max_head)),
                Err(Opened::Refused(resp)) => return Err(resp),
                Err(Opened::Stale(msg)) => {
                    self.metrics.stale_routes.inc();
                    info!(node = %target.node, %msg, "stale route: the replica no longer holds the edge; routing again");
                    changes.borrow_and_update();
                    if tokio::time::timeout_at(deadline, changes.changed())
                        .await
                        .is_err()
                    {
                        return Err(error_response(
                            StatusCode::BAD_GATEWAY,
                            format_args!(
                                "edge {} is between replicas: {msg}; not back within {:?} (--route-wait)",
                                target.node, self.cfg.route_wait
                            ),
                        ));
                    }
                }
            }
        }
    }

    /// Routes once; with peers, an edge that is known but has no live
    /// connection anywhere is waited for until `deadline`.
    async fn pick(
        &self,
        route: &Route<'_>,
        req: &Request<Incoming>,
        conn: &ConnInfo,
        deadline: tokio::time::Instant,
        changes: &mut tokio::sync::watch::Receiver<u64>,
    ) -> Result<Target, RouteError> {
        let mut waited = false;
        loop {
            changes.borrow_and_update();
            let r = self.lookup(route, req, conn);
            let between = self.cfg.peer.is_some()
                && match &r {
                    Ok(t) => !t.attached(),
                    Err(e) => matches!(e, RouteError::PodNodeGone { .. }),
                };
            if !between || tokio::time::Instant::now() >= deadline {
                if waited {
                    let outcome = if r.as_ref().is_ok_and(Target::attached) {
                        "found"
                    } else {
                        "timed_out"
                    };
                    self.metrics
                        .route_waits
                        .get_or_create(&ResultLabel { result: outcome })
                        .inc();
                }
                return r;
            }
            waited = true;
            let _ = tokio::time::timeout_at(deadline, changes.changed()).await;
        }
    }

    /// Step 2: the node of a request, from the registry.
    fn lookup(
        &self,
        route: &Route<'_>,
        req: &Request<Incoming>,
        conn: &ConnInfo,
    ) -> Result<Target, RouteError> {
        match route {
            Route::Pod { namespace, pod, .. } => self.registry.route_pod(namespace, pod),
            Route::Node { .. } => {
                let fwd = req
                    .headers()
                    .get("x-forwarded-uri")
                    .and_then(|v| v.to_str().ok())
                    .and_then(node_from_forwarded_uri);
                let host = req
                    .headers()
                    .get(http::header::HOST)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string)
                    .or_else(|| req.uri().authority().map(|a| a.to_string()));
                if upgrade_of(req).is_some() {
                    self.registry
                        .route_node(fwd, conn.sni.as_deref(), host.as_deref())
                } else {
                    self.registry
                        .route_node_proxied(fwd, conn.sni.as_deref(), host.as_deref())
                }
            }
        }
    }

    /// A reviewed caller must be allowed this request on `node` (SubjectAccessReview).
    async fn authorise(
        &self,
        caller: &Caller,
        req: &Request<Incoming>,
        conn: &ConnInfo,
        path: &str,
        node: &str,
    ) -> Result<(), Response<ResBody>> {
        let (Caller::Reviewed(user), Some(reviewer)) = (caller, &self.reviewer) else {
            return Ok(());
        };
        let attrs = attributes(req.method(), path);
        match reviewer.authorize(user, &attrs, node).await {
            Ok(reason) => {
                debug!(user = %user.name, %node, verb = attrs.verb, subresource = attrs.subresource, %reason, "request authorised");
                Ok(())
            }
            Err(e) => {
                warn!(peer = %conn.peer, %path, error = %e, "request refused");
                Err(auth_refusal(e))
            }
        }
    }

    /// Step 3: "local or relayed" — the one place that decides. A local
    /// session opens a logical stream; a peer's edge is reached over the
    /// peer link ([`crate::relay`]), one hop. A request head over the bound
    /// agreed with the edge is refused (431) before a stream is opened.
    /// Returns the stream and that bound.
    async fn open(&self, target: &Target, sending: Sending) -> Result<(EdgeIo, usize), Opened> {
        let refused = |status, msg: String| Opened::Refused(error_response(status, msg));
        // This replica owns the stream: its state lives here whether the edge
        // is connected here or to a peer (then the peer only splices).
        let session = match &target.holder {
            Holder::Local(session) => {
                self.metrics.lookup("local");
                session.clone()
            }
            Holder::Remote { replica, .. } => {
                self.metrics.lookup("relayed");
                match self.registry.owner_session(&target.node, self.cfg.limits) {
                    Some(s) => {
                        self.metrics
                            .relayed_streams
                            .get_or_create(&RoleLabel { role: "entry" })
                            .inc();
                        s
                    }
                    None => {
                        return Err(Opened::Stale(format!(
                            "replica {} no longer has the edge attached",
                            replica.name
                        )))
                    }
                }
            }
        };
        let max_head = session.limits().max_head_bytes as usize;
        if let Err(why) = head_fits(&session.node, sending.head_len, max_head) {
            info!(node = %session.node, head_bytes = sending.head_len, max_head_bytes = max_head, "request refused: {why}");
            return Err(refused(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, why));
        }
        match session.open_stream(sending.kind) {
            Ok((_, io)) => Ok((io.with_counters(self.metrics.bytes.clone()), max_head)),
            Err(e @ OpenError::TooManyStreams { .. }) => {
                Err(refused(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))
            }
            Err(e @ OpenError::Ended { .. }) => {
                Err(refused(StatusCode::BAD_GATEWAY, e.to_string()))
            }
        }
    }

    /// Steps 3–5 on an open stream: send the head and body, wait for the
    /// response head, then pipe an upgrade or stream the body.
    async fn exchange(
        &self,
        mut req: Request<Incoming>,
        node: String,
        io: EdgeIo,
        sent: Sent,
        upgrade: Option<HeaderValue>,
        open_guard: OpenStream,
    ) -> Response<ResBody> {
        debug!(method = %req.method(), path = %sent.head.path_and_query, upgrade = upgrade.is_some(), "forwarding");
        let shared = io.shared().clone();
        let (mut rd, mut wr) = tokio::io::split(io);
        if let Err(e) = wr.write_all(&sent.head_bytes).await {
            return error_response(StatusCode::BAD_GATEWAY, format_args!("edge {node}: {e}"));
        }
        let on_upgrade = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut req));
        let mut wr = Some(wr);
        if upgrade.is_none() {
            // Stream the request body after the head, then end our direction.
            if let Some(wr) = wr.take() {
                tokio::spawn(
                    pump_request_body(req.into_body(), wr, shared.clone()).in_current_span(),
                );
            }
        }
        let resp = match self
            .response_head(&mut rd, &shared, &node, sent.max_head)
            .await
        {
            Ok(h) => h,
            Err(r) => return r,
        };
        let status = match StatusCode::from_u16(resp.status) {
            Ok(s) => s,
            Err(_) => {
                shared.reset(ResetCode::ProtocolError, "bad status");
                return error_response(
                    StatusCode::BAD_GATEWAY,
                    format_args!("edge {node} sent status {}", resp.status),
                );
            }
        };
        let builder = response_builder(status, &resp);
        if status == StatusCode::SWITCHING_PROTOCOLS {
            let (Some(on_upgrade), Some(wr)) = (on_upgrade, wr) else {
                shared.reset(
                    ResetCode::ProtocolError,
                    "101 to a request that did not ask to upgrade",
                );
                return error_response(
                    StatusCode::BAD_GATEWAY,
                    format_args!("edge {node} answered 101 to a plain request"),
                );
            };
            // exec, attach, port-forward: someone may be typing.
            shared.mark_interactive();
            tokio::spawn(
                pipe_upgraded(on_upgrade, rd.unsplit(wr), shared, open_guard).in_current_span(),
            );
            return builder
                .body(
                    Full::new(Bytes::new())
                        .map_err(|never| match never {})
                        .boxed(),
                )
                .unwrap_or_else(|e| error_response(StatusCode::BAD_GATEWAY, e));
        }
        drop(wr);
        let body = StreamBody {
            _rd: rd,
            shared,
            counters: self.metrics.bytes.clone(),
            done: false,
            node,
            _open: open_guard,
        };
        builder
            .body(body.boxed())
            .unwrap_or_else(|e| error_response(StatusCode::BAD_GATEWAY, e))
    }

    /// Step 4: the kubelet's response head, within `--response-timeout` and
    /// `max_head`, the head bound agreed with the edge.
    async fn response_head(
        &self,
        rd: &mut ReadHalf<EdgeIo>,
        shared: &Resetter,
        node: &str,
        max_head: usize,
    ) -> Result<ResponseHead, Response<ResBody>> {
        let resp = tokio::time::timeout(
            self.cfg.response_timeout,
            read_head::<ResponseHead, _>(rd, max_head),
        )
        .await;
        match resp {
            Err(_) => {
                shared.reset(ResetCode::Cancelled, "no response head in time");
                warn!(timeout = ?self.cfg.response_timeout, "edge silent: no response head");
                Err(error_response(
                    StatusCode::GATEWAY_TIMEOUT,
                    format_args!(
                        "edge {node} sent no response within {:?} (--response-timeout)",
                        self.cfg.response_timeout
                    ),
                ))
            }
            Ok(Err(e)) => {
                let msg = match &e {
                    tether_proto::head::HeadError::Io(io) => match StreamReset::from_io(io) {
                        Some(r) => reset_message(node, r),
                        None => format!("edge {node}: {e}"),
                    },
                    other => format!("edge {node} sent a bad response head: {other}"),
                };
                shared.reset(ResetCode::ProtocolError, "bad response head");
                info!(error = %msg, "no response from the edge");
                Err(error_response(StatusCode::BAD_GATEWAY, msg))
            }
            Ok(Ok(h)) => Ok(h),
        }
    }
}

/// What [`Forwarder::open`] needs of the request: the stream's kind and
/// the size of its encoded head as the head bound counts it.
#[derive(Clone, Copy)]
struct Sending {
    kind: tether_proto::route::StreamKind,
    head_len: usize,
}

/// What is sent on an open stream: the head, encoded, and the head bound
/// agreed with the edge, within which its response head is read.
struct Sent {
    head: RequestHead,
    head_bytes: Vec<u8>,
    max_head: usize,
}

/// Whether an encoded request head of `len` bytes (prefix excluded) fits
/// `max`, the head bound agreed with edge `node`; if not, why, naming the
/// node, the bound and the flag (the 431's body).
fn head_fits(node: &str, len: usize, max: usize) -> Result<(), String> {
    if len <= max {
        return Ok(());
    }
    Err(format!(
        "request head: head of {len} bytes exceeds the head bound agreed with edge {node} \
         (--max-head-bytes, the smaller of the edge's and the cloud's: {max} bytes)"
    ))
}

/// Why [`Forwarder::open`] opened no stream.
enum Opened {
    /// Answer the apiserver with this.
    Refused(Response<ResBody>),
    /// The replica the route named does not hold the edge (any more).
    Stale(String),
}

/// Status and headers of the kubelet's response: end-to-end headers, plus
/// `connection`/`upgrade` on a 101.
fn response_builder(status: StatusCode, resp: &ResponseHead) -> http::response::Builder {
    let mut builder = Response::builder().status(status);
    for (name, value) in &resp.headers {
        let keep = !is_hop_by_hop(name)
            || (status == StatusCode::SWITCHING_PROTOCOLS
                && (name == "connection" || name == "upgrade"));
        if !keep {
            continue;
        }
        match (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) {
            (Ok(n), Ok(v)) => {
                builder = builder.header(n, v);
            }
            _ => warn!(header = %name, "dropping an invalid response header from the edge"),
        }
    }
    builder
}

/// Step 5 for a `101`: once hyper hands over the apiserver's connection,
/// copy bytes both ways until either side ends.
async fn pipe_upgraded(
    on_upgrade: hyper::upgrade::OnUpgrade,
    mut io: EdgeIo,
    shared: Resetter,
    _open: OpenStream,
) {
    let upgraded = match on_upgrade.await {
        Ok(u) => u,
        Err(e) => {
            shared.reset(
                ResetCode::Cancelled,
                format!("apiserver upgrade failed: {e}"),
            );
            return;
        }
    };
    let mut client = hyper_util::rt::TokioIo::new(upgraded);
    match tether_proto::pump::copy_both(&mut client, &mut io).await {
        Ok((up, down)) => debug!(
            bytes_to_edge = up,
            bytes_to_apiserver = down,
            "upgraded stream ended"
        ),
        Err(e) => {
            debug!(error = %e, "upgraded stream failed");
            shared.reset(ResetCode::Cancelled, format!("apiserver side: {e}"));
        }
    }
}

fn reset_message(node: &str, r: &StreamReset) -> String {
    match r.code {
        ResetCode::KubeletUnreachable => {
            format!("edge {node} could not reach its kubelet: {}", r.message)
        }
        ResetCode::Refused => format!("edge {node} refused the request: {}", r.message),
        ResetCode::SessionLost => format!("edge {node} is gone: {}", r.message),
        _ => format!("edge {node} ended the stream ({:?}): {}", r.code, r.message),
    }
}

/// The head to replay: method, path and query, end-to-end headers; plus
/// `connection`/`upgrade` for upgrades.
fn request_head(req: &Request<Incoming>, upgrade: Option<&HeaderValue>) -> RequestHead {
    let mut headers: Vec<(String, Vec<u8>)> = req
        .headers()
        .iter()
        .filter(|(n, _)| !is_hop_by_hop(n.as_str()))
        .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
        .collect();
    if let Some(u) = upgrade {
        headers.push(("connection".into(), b"Upgrade".to_vec()));
        headers.push(("upgrade".into(), u.as_bytes().to_vec()));
    }
    RequestHead {
        method: req.method().as_str().to_string(),
        path_and_query: req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into()),
        headers,
        has_body: upgrade.is_none() && !req.body().is_end_stream(),
    }
}

async fn pump_request_body(
    mut body: Incoming,
    mut wr: tokio::io::WriteHalf<EdgeIo>,
    shared: Resetter,
) {
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(f) => {
                if let Ok(data) = f.into_data() {
                    if let Err(e) = wr.write_all(&data).await {
                        debug!(error = %e, "request body: stream closed");
                        return;
                    }
                }
            }
            Err(e) => {
                shared.reset(ResetCode::Cancelled, format!("apiserver request body: {e}"));
                return;
            }
        }
    }
    let _ = wr.shutdown().await;
}

/// The most a response body frame carries: what one read takes from the
/// stream at most.
const BODY_CHUNK: usize = 64 * 1024;

/// The response body, read from the stream. Ends cleanly only at the edge's
/// clean end; a reset becomes a body error (aborted response). Dropped early
/// (the apiserver went away), it resets the stream so the edge stops too.
///
/// It reads the stream's chunks as they arrived rather than into a buffer of
/// its own, so a held `logs -f` or watch that is quiet holds no buffer.
struct StreamBody {
    /// The stream's handle (dropped with the body); the body itself reads
    /// through `shared`.
    _rd: ReadHalf<EdgeIo>,
    shared: Resetter,
    /// Where the bytes read are counted (the handle's counters).
    counters: tether_proto::ops::ByteCounters,
    done: bool,
    node: String,
    /// Keeps the stream counted as open while the body streams.
    _open: OpenStream,
}

impl Body for StreamBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        match this.shared.poll_read_chunk(cx, BODY_CHUNK) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(None)) => {
                this.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Ok(Some(chunk))) => {
                this.counters.received.inc_by(chunk.len() as u64);
                Poll::Ready(Some(Ok(Frame::data(chunk))))
            }
            Poll::Ready(Err(e)) => {
                this.done = true;
                info!(node = %this.node, error = %e, "response body cut short; aborting the apiserver's response");
                Poll::Ready(Some(Err(e)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

impl Drop for StreamBody {
    fn drop(&mut self) {
        if !self.done {
            self.shared
                .reset(ResetCode::Cancelled, "the apiserver closed the response");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer::PeerLink;
    use crate::routes::{EdgeRecord, Update};
    use crate::session::testing::claim;
    use crate::session::Session;
    use std::time::Duration;
    use tether_proto::route::StreamKind;
    use tether_proto::Limits;

    /// A forwarder with the default limits (a 256 KiB head bound).
    fn forwarder(registry: Arc<Registry>) -> Forwarder {
        let cfg = crate::config::test_config(&[]).expect("a configuration");
        assert_eq!(cfg.limits.max_head_bytes, 256 * 1024);
        let metrics = CloudMetrics::register(&mut prometheus_client::registry::Registry::default());
        Forwarder::new(Arc::new(cfg), registry, metrics, None)
    }

    /// An edge's limits with a 4 KiB head bound.
    fn small_heads() -> Limits {
        Limits {
            max_head_bytes: 4096,
            ..Limits::default()
        }
    }

    fn sending(head_len: usize) -> Sending {
        Sending {
            kind: StreamKind::Logs,
            head_len,
        }
    }

    /// The status and body of a refusal; panics if a stream was opened.
    async fn refusal(opened: Result<(EdgeIo, usize), Opened>) -> (StatusCode, String) {
        match opened {
            Ok(_) => panic!("a stream was opened"),
            Err(Opened::Stale(m)) => panic!("stale: {m}"),
            Err(Opened::Refused(r)) => {
                let status = r.status();
                let body = r.into_body().collect().await.expect("a body").to_bytes();
                (status, String::from_utf8_lossy(&body).into_owned())
            }
        }
    }

    const NAMES_THE_BOUND: &str =
        "(--max-head-bytes, the smaller of the edge's and the cloud's: 4096 bytes)";

    /// A session held here that agreed a 4 KiB head bound with its edge (the
    /// cloud's own is 256 KiB): a head of 4,097 bytes is refused with 431
    /// naming the node and the bound, and no stream is opened; one of 4,096
    /// opens a stream, whose response head is read within 4,096 bytes.
    #[tokio::test]
    async fn a_request_head_over_the_bound_agreed_with_a_local_edge_is_431_naming_it() {
        let f = forwarder(Arc::new(Registry::new(Duration::from_secs(60))));
        let session = Session::new(
            "n".into(),
            vec![],
            f.cfg.limits.agree(&small_heads()),
            &claim(),
        )
        .expect("a session");
        let target = Target {
            node: "n".into(),
            holder: Holder::Local(session.clone()),
        };
        let (status, body) = refusal(f.open(&target, sending(4097)).await).await;
        assert_eq!(
            status,
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "{body}"
        );
        assert!(body.contains("head of 4097 bytes"), "{body}");
        assert!(body.contains("agreed with edge n"), "{body}");
        assert!(body.contains(NAMES_THE_BOUND), "{body}");
        assert_eq!(session.open_streams(), 0, "no stream for a refused head");
        let Ok((_io, max_head)) = f.open(&target, sending(4096)).await else {
            panic!("a head at the bound opens a stream")
        };
        assert_eq!(max_head, 4096);
        assert_eq!(session.open_streams(), 1);
    }

    /// An edge a peer holds, having agreed a 4 KiB head bound with it (its
    /// route record says so): the replica that owns the relayed stream
    /// refuses a 6,000-byte head with 431 naming the bound, before anything
    /// crosses the peer link.
    #[tokio::test]
    async fn a_request_head_over_the_bound_a_peer_agreed_with_its_edge_is_431_naming_it() {
        let (c1, _c2, _endpoints) = tether_proto::testing::quic_pair().await.expect("a link");
        let peer = PeerLink::for_test("b", c1);
        let registry = Arc::new(Registry::new(Duration::from_secs(60)));
        registry.apply_remote(
            &peer,
            Update::Upsert(vec![EdgeRecord {
                node: "n".into(),
                session: format!("{:016x}", 7),
                attached: true,
                since_ms: 1,
                sid: 7,
                gen: 1,
                limits: Limits::default().agree(&small_heads()),
                pods: vec![],
                addresses: vec![],
            }]),
        );
        let f = forwarder(registry.clone());
        let target = Target {
            node: "n".into(),
            holder: Holder::Remote {
                replica: peer.replica.clone(),
                conn: peer.conn.clone(),
                attached: true,
            },
        };
        let (status, body) = refusal(f.open(&target, sending(6000)).await).await;
        assert_eq!(
            status,
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "{body}"
        );
        assert!(body.contains("head of 6000 bytes"), "{body}");
        assert!(body.contains(NAMES_THE_BOUND), "{body}");
        let owned = registry
            .owner_session("n", f.cfg.limits)
            .expect("the owned session");
        assert_eq!(owned.open_streams(), 0, "no stream for a refused head");
    }
}
