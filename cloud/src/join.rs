//! The cloud's side of edge bootstrap: one join connection (ALPN
//! `tether-join/1`, no client certificate) from a new edge that holds a join
//! token.
//!
//! The edge opens one bidirectional stream and sends a `JoinRequest` (token,
//! node name, CSR); the cloud answers one `JoinResponse` and the connection
//! ends. The decision — token unexpired, not revoked, uses left, node name
//! allowed; CSR within policy; the use spent and the issue recorded in the
//! store in one write — is `tether_certs::join::decide`; this module only
//! moves the two messages and logs the outcome with the node's name.
//!
//! A join connection never reaches the tunnel: whatever it sends, it gets at
//! most one answer and is closed. A slow or silent edge is cut off after
//! `JOIN_REQUEST_TIMEOUT`; an oversized or undecodable request closes that
//! connection only.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use tether_certs::join::{self, JoinRequest, JoinResponse, JOIN_REQUEST_TIMEOUT};
use tether_certs::{Ca, JoinStore};
use tracing::{info, warn};

/// How long the cloud waits for the edge to read the answer before closing.
const ANSWER_LINGER: Duration = Duration::from_secs(5);

/// QUIC close code of a finished join connection.
const JOIN_DONE: u32 = 0;

/// Handles one established join connection: read the request, decide,
/// answer, close. `validity` is the lifetime of the certificates issued.
pub async fn serve_join(
    conn: quinn::Connection,
    store: Arc<JoinStore>,
    ca: Arc<Ca>,
    validity: Duration,
) -> anyhow::Result<()> {
    let remote = conn.remote_address();
    let read = async {
        let (send, mut recv) = conn
            .accept_bi()
            .await
            .context("waiting for the join stream")?;
        let mut prefix = [0u8; 4];
        recv.read_exact(&mut prefix)
            .await
            .context("reading the join request's length")?;
        let len = join::decode_len(prefix)?;
        let mut body = vec![0u8; len];
        recv.read_exact(&mut body)
            .await
            .context("reading the join request")?;
        let req: JoinRequest = join::decode(&body)?;
        Ok::<_, anyhow::Error>((send, req))
    };
    let (mut send, req) = match tokio::time::timeout(JOIN_REQUEST_TIMEOUT, read).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            conn.close(JOIN_DONE.into(), b"bad join request");
            return Err(e.context(format!("join from {remote}")));
        }
        Err(_) => {
            conn.close(JOIN_DONE.into(), b"no join request in time");
            anyhow::bail!("join from {remote}: no request within {JOIN_REQUEST_TIMEOUT:?}");
        }
    };
    let claimed = req.node.clone();
    // The store does blocking file I/O under a lock: keep it off the runtime.
    let (outcome, answer) = tokio::task::spawn_blocking({
        let store = store.clone();
        let ca = ca.clone();
        move || {
            let outcome = join::decide(&store, &ca, &req, validity, SystemTime::now());
            let answer = join::response_for(&outcome, &ca);
            (outcome, answer)
        }
    })
    .await
    .context("the join decision task failed")?;
    match &outcome {
        Ok((grant, cert)) => info!(
            node = %grant.node,
            token = %grant.token_id,
            serial = %cert.serial,
            uses_left = grant.uses_left,
            %remote,
            "edge joined: certificate issued"
        ),
        Err(e) if e.is_internal() => warn!(
            node = %claimed,
            %remote,
            error = %e,
            "join failed on the cloud's side"
        ),
        Err(e) => warn!(node = %claimed, %remote, error = %e, "join refused"),
    }
    let bytes = join::encode(&answer)?;
    send.write_all(&bytes)
        .await
        .with_context(|| format!("sending the join answer to node {claimed} at {remote}"))?;
    let _ = send.finish();
    // Let the answer arrive before the connection goes away.
    let _ = tokio::time::timeout(ANSWER_LINGER, send.stopped()).await;
    let reason: &[u8] = match answer {
        JoinResponse::Granted { .. } => b"joined",
        JoinResponse::Refused { .. } => b"join refused",
    };
    conn.close(JOIN_DONE.into(), reason);
    Ok(())
}
