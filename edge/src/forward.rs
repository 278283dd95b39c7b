//! One logical stream → one request replayed against the kubelet.
//!
//! Reads the [`RequestHead`] the cloud wrote first, refuses paths Tether does
//! not forward (the same [`classify`] the cloud uses), connects to the one
//! configured kubelet, sends the request (streaming the body that follows the
//! head), and answers with a [`ResponseHead`]. After a `101` both ends become
//! a byte pipe; otherwise the response body streams back and our direction
//! ends cleanly only when the kubelet's body did. Every failure resets the
//! stream with a code the cloud turns into an HTTP status (kubelet
//! unreachable → 502).

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use tether_proto::frame::ResetCode;
use tether_proto::head::{encode_head, is_hop_by_hop, read_head, RequestHead, ResponseHead};
use tether_proto::io::ResumableIo;
use tether_proto::route::classify;
use tether_proto::Limits;
use tokio::io::AsyncWriteExt;
use tokio_util::io::ReaderStream;
use tracing::{debug, info, warn};

use crate::kubelet::KubeletTarget;

/// Replays streams against the kubelet.
pub struct Forward {
    pub target: Arc<KubeletTarget>,
    pub limits: Limits,
}

type ReqBody = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

impl Forward {
    /// Serves one stream to its end.
    pub async fn run(self: Arc<Self>, io: ResumableIo) {
        let shared = io.shared().clone();
        let (mut rd, mut wr) = tokio::io::split(io);
        let head: RequestHead = match read_head(&mut rd, self.limits.max_head_bytes as usize).await
        {
            Ok(h) => h,
            Err(e) => {
                warn!(error = %e, "bad request head from the cloud");
                shared.reset(ResetCode::ProtocolError, format!("bad request head: {e}"));
                return;
            }
        };
        let path = head.path().to_string();
        if classify(&path).is_none() {
            warn!(%path, "refusing a path Tether does not forward");
            shared.reset(
                ResetCode::Refused,
                format!("path {path} is not forwarded by this edge"),
            );
            return;
        }
        let Ok(method) = http::Method::from_bytes(head.method.as_bytes()) else {
            shared.reset(
                ResetCode::Refused,
                format!("invalid method {:?}", head.method),
            );
            return;
        };
        debug!(%method, path = %head.path_and_query, "replaying against the kubelet");
        let kubelet = match self.target.connect().await {
            Ok(k) => k,
            Err(e) => {
                info!(error = format!("{e:#}"), "kubelet unreachable");
                shared.reset(ResetCode::KubeletUnreachable, format!("{e:#}"));
                return;
            }
        };
        let (mut sender, conn) = match hyper::client::conn::http1::Builder::new()
            .max_buf_size((self.limits.max_head_bytes as usize).max(8192))
            .handshake(TokioIo::new(kubelet))
            .await
        {
            Ok(x) => x,
            Err(e) => {
                shared.reset(
                    ResetCode::KubeletUnreachable,
                    format!("HTTP handshake with the kubelet: {e}"),
                );
                return;
            }
        };
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                debug!(error = %e, "kubelet connection ended with an error");
            }
        });
        let upgrade = head.is_upgrade();
        let mut builder = http::Request::builder()
            .method(method)
            .uri(head.path_and_query.as_str());
        for (name, value) in &head.headers {
            if is_hop_by_hop(name) && !(upgrade && (name == "connection" || name == "upgrade")) {
                continue;
            }
            builder = builder.header(name.as_str(), value.as_slice());
        }
        builder = builder.header(http::header::HOST, self.target.authority.as_str());
        // The body: what follows the head in the cloud's direction (none for
        // upgrades: those bytes belong to the upgraded protocol).
        let (body, rd): (ReqBody, _) = if head.has_body {
            let stream = ReaderStream::new(rd);
            (
                StreamBody::new(futures_util::StreamExt::map(stream, |r| r.map(Frame::data)))
                    .boxed(),
                None,
            )
        } else {
            (
                Empty::new().map_err(|never| match never {}).boxed(),
                Some(rd),
            )
        };
        let req = match builder.body(body) {
            Ok(r) => r,
            Err(e) => {
                shared.reset(
                    ResetCode::Refused,
                    format!("request head does not make a valid request: {e}"),
                );
                return;
            }
        };
        let mut resp = match sender.send_request(req).await {
            Ok(r) => r,
            Err(e) => {
                shared.reset(
                    ResetCode::KubeletUnreachable,
                    format!("kubelet request failed: {e}"),
                );
                return;
            }
        };
        let status = resp.status();
        let switching = status == http::StatusCode::SWITCHING_PROTOCOLS;
        let headers = resp
            .headers()
            .iter()
            .filter(|(n, _)| {
                !is_hop_by_hop(n.as_str())
                    || (switching
                        && (*n == http::header::CONNECTION || *n == http::header::UPGRADE))
            })
            .map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec()))
            .collect();
        let rh = ResponseHead {
            status: status.as_u16(),
            headers,
        };
        let bytes = match encode_head(&rh, self.limits.max_head_bytes as usize) {
            Ok(b) => b,
            Err(e) => {
                shared.reset(
                    ResetCode::LimitExceeded,
                    format!("kubelet response head: {e}"),
                );
                return;
            }
        };
        if wr.write_all(&bytes).await.is_err() {
            return;
        }
        if switching {
            let Some(rd) = rd else {
                shared.reset(
                    ResetCode::ProtocolError,
                    "kubelet upgraded a request with a body",
                );
                return;
            };
            let upgraded = match hyper::upgrade::on(&mut resp).await {
                Ok(u) => u,
                Err(e) => {
                    shared.reset(
                        ResetCode::KubeletUnreachable,
                        format!("kubelet upgrade: {e}"),
                    );
                    return;
                }
            };
            let mut kubelet = TokioIo::new(upgraded);
            let mut io = rd.unsplit(wr);
            match tokio::io::copy_bidirectional(&mut kubelet, &mut io).await {
                Ok((to_kubelet, to_cloud)) => debug!(to_kubelet, to_cloud, "upgraded stream ended"),
                Err(e) => {
                    debug!(error = %e, "upgraded stream failed");
                    shared.reset(ResetCode::Cancelled, format!("kubelet side: {e}"));
                }
            }
            return;
        }
        let mut body = resp.into_body();
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => {
                    if let Ok(data) = f.into_data() {
                        if wr.write_all(&data).await.is_err() {
                            return;
                        }
                    }
                }
                Err(e) => {
                    info!(error = %e, "kubelet response body cut short");
                    shared.reset(ResetCode::Cancelled, format!("kubelet response body: {e}"));
                    return;
                }
            }
        }
        let _ = wr.shutdown().await;
    }
}
