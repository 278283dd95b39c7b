//! The logical streams of the edge's session, which survive reconnections.
//!
//! The cloud opens a QUIC stream per logical stream and sends `Attach` first.
//! [`EdgeStreams::accept`] reads it and either re-attaches a stream this edge
//! already holds (a resume: both ends replay from each other's delivered
//! offset), starts a new one (a new id, nothing delivered yet), or answers
//! with a reset when the stream is unknown (this edge restarted, or the stream
//! already ended).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tether_proto::frame::ResetCode;
use tether_proto::io::{drive, write_frame, FrameReader, PeerAttach, ResumableIo, SharedStream};
use tether_proto::stream::{StreamLimits, StreamState};
use tether_proto::{Frame, Limits, StreamId};
use tracing::{debug, info, warn, Instrument};

use crate::forward::Forward;

/// The streams of the current session.
pub struct EdgeStreams {
    streams: Mutex<HashMap<StreamId, Arc<SharedStream>>>,
    /// Highest stream id seen in this session (ids only grow).
    max_seen: AtomicU64,
    limits: Limits,
    forward: Arc<Forward>,
    node: String,
}

impl EdgeStreams {
    pub fn new(node: String, limits: Limits, forward: Arc<Forward>) -> Arc<Self> {
        Arc::new(EdgeStreams { streams: Mutex::new(HashMap::new()), max_seen: AtomicU64::new(0), limits, forward, node })
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<StreamId, Arc<SharedStream>>> {
        self.streams.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn len(&self) -> usize {
        self.map().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Ends every stream (the session is gone): resets them with `reason`.
    pub fn end_all(&self, reason: &str) {
        let all: Vec<_> = self.map().drain().map(|(_, s)| s).collect();
        if !all.is_empty() {
            warn!(node = %self.node, streams = all.len(), %reason, "ending streams");
        }
        for s in all {
            s.reset(ResetCode::SessionLost, reason);
        }
        self.max_seen.store(0, Ordering::Relaxed);
    }

    /// Handles one QUIC stream the cloud opened.
    pub async fn accept(self: Arc<Self>, mut send: quinn::SendStream, mut recv: quinn::RecvStream) {
        let max = self.limits.max_frame_bytes as usize;
        let mut reader = FrameReader::new(max);
        let first = tokio::time::timeout(Duration::from_secs(30), reader.next(&mut recv)).await;
        let (id, delivered, fin_received) = match first {
            Ok(Ok(Some(Frame::Attach { stream, delivered, fin_received }))) => (stream, delivered, fin_received),
            Ok(Ok(Some(other))) => {
                warn!(node = %self.node, frame = other.kind(), "stream did not start with attach; dropping it");
                return;
            }
            Ok(Ok(None)) => return,
            Ok(Err(e)) => {
                warn!(node = %self.node, error = %e, "bad first frame on a stream");
                return;
            }
            Err(_) => {
                warn!(node = %self.node, "no attach within 30s; dropping the stream");
                return;
            }
        };
        let existing = self.map().get(&id).cloned();
        let shared = match existing {
            Some(s) => {
                debug!(node = %self.node, stream = id, delivered, "re-attaching stream");
                s
            }
            None if delivered == 0 && !fin_received && id > self.max_seen.load(Ordering::Relaxed) => {
                self.max_seen.fetch_max(id, Ordering::Relaxed);
                let shared = SharedStream::new(StreamState::new(id, StreamLimits::from(&self.limits)));
                self.map().insert(id, shared.clone());
                let io = ResumableIo::new(shared.clone());
                let span = tracing::info_span!("stream", node = %self.node, stream = id);
                tokio::spawn(self.forward.clone().run(io).instrument(span));
                shared
            }
            None => {
                info!(node = %self.node, stream = id, "cloud re-attached a stream this edge does not hold; resetting it");
                let _ = write_frame(&mut send, &Frame::Attach { stream: id, delivered: 0, fin_received: false }, max).await;
                let reset = Frame::Reset {
                    stream: id,
                    code: ResetCode::UnknownStream,
                    message: format!("edge {} does not hold stream {id} (it restarted or the stream ended)", self.node),
                };
                let _ = write_frame(&mut send, &reset, max).await;
                let _ = send.finish();
                return;
            }
        };
        let peer = PeerAttach::Known { delivered, fin_received };
        // Frames the reader already buffered past the attach are replayed by
        // chaining its buffer in front of the QUIC stream.
        let recv = reader.into_prefixed(recv);
        match drive(shared.clone(), recv, send, peer, max).await {
            Ok(()) => {
                self.map().remove(&id);
                debug!(node = %self.node, stream = id, "stream done");
            }
            Err(e) => debug!(node = %self.node, stream = id, error = %e, "stream detached; waiting for a resume"),
        }
    }
}
