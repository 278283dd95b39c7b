//! The frame: the only unit that travels on Tether's QUIC streams.
//!
//! Every frame is `u32 big-endian length ‖ postcard(Frame)`. The length is
//! checked against [`Limits::max_frame_bytes`](crate::Limits) *before* any
//! allocation, so a peer cannot make us buffer more than that. Decoding never
//! panics on arbitrary input (see the property tests below); a frame that does
//! not decode is an error for the QUIC stream it came on and for nothing else.
//!
//! Two kinds of QUIC stream carry frames:
//! - the *control stream*, the first bidirectional stream the edge opens on a
//!   connection: [`Frame::Hello`], [`Frame::Welcome`], [`Frame::Refused`],
//!   [`Frame::Commit`], [`Frame::PodReport`], [`Frame::GoAway`];
//! - one QUIC stream per *logical stream* (one apiserver connection), opened by
//!   the cloud: [`Frame::Attach`] first in each direction, then
//!   [`Frame::Data`], [`Frame::Ack`], [`Frame::End`], [`Frame::Reset`]. These
//!   carry the logical [`StreamId`], which outlives any QUIC connection, so a
//!   stream can be re-attached to a new connection after a resume.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

use crate::handshake::{Hello, PodReport, Refusal, Welcome};

/// A logical stream's id: assigned by the cloud, unique within a session,
/// increasing, and independent of QUIC stream ids.
pub type StreamId = u64;

/// Bytes taken by the length prefix.
pub const LENGTH_PREFIX: usize = 4;

/// Why a logical stream was reset. Mapped to HTTP outcomes by the cloud.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ResetCode {
    /// The local side went away (apiserver closed, kubelet closed abruptly).
    Cancelled,
    /// The edge could not reach its kubelet (refused, TLS failure, timeout).
    KubeletUnreachable,
    /// The edge refuses the request (path not forwarded, malformed head).
    Refused,
    /// The peer broke the protocol on this stream.
    ProtocolError,
    /// The session's connection was lost and not resumed in time.
    SessionLost,
    /// The peer does not know this stream (it restarted, or the stream ended).
    UnknownStream,
    /// The peer is shutting down.
    Shutdown,
    /// A configured limit was exceeded.
    LimitExceeded,
    /// A local failure that is none of the above.
    Internal,
}

/// One frame. See the module docs for which stream carries which frame.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Frame {
    /// Edge → cloud, first frame on the control stream.
    Hello(Hello),
    /// Cloud → edge, answer to an accepted hello.
    Welcome(Welcome),
    /// Cloud → edge, answer to a refused hello; the connection closes after it.
    Refused(Refusal),
    /// Edge → cloud: the pods the edge's kubelet runs now (full list).
    PodReport(PodReport),
    /// Either way: the sender is going away; no new streams.
    GoAway { reason: String },
    /// First frame in each direction of a logical stream's QUIC stream:
    /// how much of the peer's data the sender has delivered so far (0 and
    /// false for a new stream). The peer replays from there.
    Attach {
        stream: StreamId,
        delivered: u64,
        fin_received: bool,
    },
    /// Stream bytes `[offset, offset + payload.len())`.
    Data {
        stream: StreamId,
        offset: u64,
        payload: Bytes,
    },
    /// Cumulative: the sender has delivered (handed to its local side) every
    /// byte below `delivered`, and the peer's end if `fin_received`.
    Ack {
        stream: StreamId,
        delivered: u64,
        fin_received: bool,
    },
    /// The sender's direction ends at `offset` (its total length).
    End { stream: StreamId, offset: u64 },
    /// The stream is aborted in both directions.
    Reset {
        stream: StreamId,
        code: ResetCode,
        message: String,
    },
    /// Edge → cloud on the control stream: renew my certificate (a CSR for a
    /// key the edge just made; the node is the one of the session).
    RenewCert { csr_pem: String },
    /// Cloud → edge: the renewed certificate (PEM), or why not.
    RenewedCert { result: Result<String, String> },
    /// Edge → cloud, right after the welcome on the connection whose welcome
    /// the edge took: attach session `session` to this connection. Until it
    /// arrives the cloud attaches nothing, so abandoned attempts are harmless.
    Commit { session: crate::token::SessionId },
    /// Edge → cloud on the control stream: a keep-alive (the edge's adaptive
    /// keep-alive holds its NAT binding with these; the cloud ignores them,
    /// QUIC acknowledges them). Added last: postcard numbers variants in order.
    KeepAlive,
}

impl Frame {
    /// The logical stream a stream frame belongs to; `None` for control frames.
    pub fn stream_id(&self) -> Option<StreamId> {
        match self {
            Frame::Attach { stream, .. }
            | Frame::Data { stream, .. }
            | Frame::Ack { stream, .. }
            | Frame::End { stream, .. }
            | Frame::Reset { stream, .. } => Some(*stream),
            _ => None,
        }
    }

    /// A short name for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Frame::Hello(_) => "hello",
            Frame::Welcome(_) => "welcome",
            Frame::Refused(_) => "refused",
            Frame::PodReport(_) => "pod-report",
            Frame::GoAway { .. } => "go-away",
            Frame::Attach { .. } => "attach",
            Frame::Data { .. } => "data",
            Frame::Ack { .. } => "ack",
            Frame::End { .. } => "end",
            Frame::Reset { .. } => "reset",
            Frame::RenewCert { .. } => "renew-cert",
            Frame::RenewedCert { .. } => "renewed-cert",
            Frame::Commit { .. } => "commit",
            Frame::KeepAlive => "keep-alive",
        }
    }
}

/// What can go wrong turning bytes into a frame.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("malformed frame: {0}")]
    Malformed(#[from] postcard::Error),
    #[error("stream ended inside a frame ({have} of {need} bytes)")]
    Truncated { have: usize, need: usize },
}

/// Appends `frame`, length-prefixed, to `out`. Fails only if the encoding is
/// larger than `max` (the sender's own limit), so a sender never emits a frame
/// its peer must reject.
pub fn encode(frame: &Frame, out: &mut BytesMut, max: usize) -> Result<(), FrameError> {
    let start = out.len();
    out.put_u32(0);
    let body = postcard::to_extend(frame, Vec::new())?;
    if body.len() > max {
        out.truncate(start);
        return Err(FrameError::TooLarge {
            len: body.len(),
            max,
        });
    }
    out.extend_from_slice(&body);
    let len = u32::try_from(body.len()).map_err(|_| FrameError::TooLarge {
        len: body.len(),
        max,
    })?;
    out[start..start + LENGTH_PREFIX].copy_from_slice(&len.to_be_bytes());
    Ok(())
}

/// Encodes one frame into a fresh buffer.
pub fn encode_to_bytes(frame: &Frame, max: usize) -> Result<Bytes, FrameError> {
    let mut out = BytesMut::new();
    encode(frame, &mut out, max)?;
    Ok(out.freeze())
}

/// Reads the length prefix; errors if it exceeds `max`.
pub fn body_len(prefix: [u8; LENGTH_PREFIX], max: usize) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(prefix) as usize;
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    Ok(len)
}

/// Decodes a frame body (without its length prefix).
pub fn decode_body(body: &[u8]) -> Result<Frame, FrameError> {
    let (frame, rest) = postcard::take_from_bytes::<Frame>(body)?;
    if !rest.is_empty() {
        return Err(FrameError::Malformed(
            postcard::Error::DeserializeBadEncoding,
        ));
    }
    Ok(frame)
}

/// Decodes the first complete frame at the front of `buf`, consuming it.
/// `Ok(None)` means more bytes are needed.
pub fn decode(buf: &mut BytesMut, max: usize) -> Result<Option<Frame>, FrameError> {
    if buf.len() < LENGTH_PREFIX {
        return Ok(None);
    }
    let mut prefix = [0u8; LENGTH_PREFIX];
    prefix.copy_from_slice(&buf[..LENGTH_PREFIX]);
    let len = body_len(prefix, max)?;
    if buf.len() < LENGTH_PREFIX + len {
        return Ok(None);
    }
    buf.advance(LENGTH_PREFIX);
    let body = buf.split_to(len);
    decode_body(&body).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handshake::{PodRef, PROTOCOL_VERSION};
    use proptest::prelude::*;

    fn samples() -> Vec<Frame> {
        vec![
            Frame::Hello(Hello {
                versions: vec![PROTOCOL_VERSION],
                node: "edge-1".into(),
                addresses: vec!["10.0.0.1".into()],
                resume: crate::token::ResumeToken([7; 16]),
                instance: 42,
                attempt: 3,
                limits: crate::Limits::default(),
            }),
            Frame::Commit {
                session: crate::token::SessionId(9),
            },
            Frame::KeepAlive,
            Frame::PodReport(PodReport {
                pods: vec![PodRef {
                    namespace: "default".into(),
                    name: "p1".into(),
                    uid: "u".into(),
                }],
            }),
            Frame::Attach {
                stream: 7,
                delivered: 0,
                fin_received: false,
            },
            Frame::Data {
                stream: 7,
                offset: 1 << 40,
                payload: Bytes::from_static(b"hello\x00\xff"),
            },
            Frame::Ack {
                stream: 7,
                delivered: 12,
                fin_received: true,
            },
            Frame::End {
                stream: 7,
                offset: 99,
            },
            Frame::Reset {
                stream: 7,
                code: ResetCode::KubeletUnreachable,
                message: "refused".into(),
            },
        ]
    }

    #[test]
    fn round_trip() {
        for f in samples() {
            let mut b = BytesMut::new();
            encode(&f, &mut b, 1 << 20).unwrap();
            let got = decode(&mut b, 1 << 20).unwrap().unwrap();
            assert_eq!(got, f);
            assert!(b.is_empty());
        }
    }

    #[test]
    fn data_payload_is_not_inflated() {
        let payload = Bytes::from(vec![0xffu8; 32 * 1024]);
        let f = Frame::Data {
            stream: 1,
            offset: 0,
            payload,
        };
        let b = encode_to_bytes(&f, 1 << 20).unwrap();
        assert!(b.len() < 32 * 1024 + 32, "encoded {} bytes", b.len());
    }

    #[test]
    fn oversized_length_is_rejected_before_reading_body() {
        let mut b = BytesMut::new();
        b.put_u32(10_000);
        assert!(matches!(
            decode(&mut b, 100),
            Err(FrameError::TooLarge {
                len: 10_000,
                max: 100
            })
        ));
    }

    #[test]
    fn encode_refuses_frames_over_the_limit() {
        let f = Frame::Data {
            stream: 1,
            offset: 0,
            payload: Bytes::from(vec![1u8; 200]),
        };
        let mut b = BytesMut::from(&b"xy"[..]);
        assert!(encode(&f, &mut b, 100).is_err());
        assert_eq!(&b[..], b"xy");
    }

    #[test]
    fn partial_input_waits_for_more() {
        let f = &samples()[3];
        let all = encode_to_bytes(f, 1 << 20).unwrap();
        for cut in 0..all.len() {
            let mut b = BytesMut::from(&all[..cut]);
            assert!(decode(&mut b, 1 << 20).unwrap().is_none());
        }
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let mut b = BytesMut::from(&data[..]);
            // Keep decoding until an error or a need for more input.
            for _ in 0..64 {
                match decode(&mut b, 4096) {
                    Ok(Some(_)) => continue,
                    _ => break,
                }
            }
            let _ = decode_body(&data);
        }

        #[test]
        fn truncated_and_mutated_frames_never_panic(idx in 0usize..7, cut in any::<prop::sample::Index>(), flip in any::<prop::sample::Index>(), bit in 0u8..8) {
            let f = &samples()[idx];
            let all = encode_to_bytes(f, 1 << 20).unwrap().to_vec();
            let mut m = all.clone();
            let i = flip.index(m.len());
            m[i] ^= 1 << bit;
            let _ = decode(&mut BytesMut::from(&m[..]), 1 << 20);
            let c = cut.index(all.len());
            let _ = decode_body(&all[LENGTH_PREFIX..c.max(LENGTH_PREFIX)]);
        }

        #[test]
        fn data_frames_round_trip(stream in any::<u64>(), offset in any::<u64>(), payload in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let f = Frame::Data { stream, offset, payload: Bytes::from(payload) };
            let mut b = BytesMut::new();
            encode(&f, &mut b, 1 << 20).unwrap();
            prop_assert_eq!(decode(&mut b, 1 << 20).unwrap().unwrap(), f);
        }
    }
}
