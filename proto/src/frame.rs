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

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

use crate::handshake::{Hello, PodReport, Refusal, Welcome};

/// A logical stream's id: assigned by the replica that owns the stream (the
/// one the apiserver's connection arrived on), unique across the replicas'
/// streams of one session (the high 32 bits name the owner, see
/// `tether-cloud`'s session), and independent of QUIC stream ids.
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
    /// Cloud → edge on the control stream: a fresh resume ticket (replaces
    /// the previous one; sent while the connection lives, so the ticket
    /// expires the grace period after the connection is lost).
    Ticket(crate::ticket::Ticket),
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
            Frame::Ticket(_) => "ticket",
            Frame::KeepAlive => "keep-alive",
        }
    }
}

/// How a [`Frame::RenewedCert`] refusal for a node renewed within the
/// cloud's `--renewal-min-interval` starts; the seconds left and `s` follow.
const RENEWAL_TOO_SOON: &str = "renewed too recently; try again in ";

/// The refusal of a renewal asked `wait` before the cloud allows the next:
/// `renewed too recently; try again in Ns`, N rounded up, so that an edge
/// asking again after N seconds is not refused for the fraction left.
pub fn renewal_too_soon(wait: Duration) -> String {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    format!("{RENEWAL_TOO_SOON}{secs}s")
}

/// The wait a refusal made by [`renewal_too_soon`] names; `None` for any
/// other text (or a number that does not fit).
pub fn renewal_retry_after(reason: &str) -> Option<Duration> {
    let secs = reason.strip_prefix(RENEWAL_TOO_SOON)?.strip_suffix('s')?;
    secs.parse().ok().map(Duration::from_secs)
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

/// Postcard's variant index of [`Frame::Data`] (its place in the enum). Data
/// frames are encoded and decoded by hand, byte for byte as postcard would
/// (the tests check it), so that their payload is never copied through
/// postcard: the sender writes the header and hands the payload on as it is,
/// the receiver splits the payload off the bytes it read.
const DATA_VARIANT: u8 = 6;
/// The longest postcard varint (a `u64`).
const VARINT_MAX: usize = 10;

fn put_varint(out: &mut BytesMut, mut v: u64) {
    while v >= 0x80 {
        out.put_u8((v as u8) | 0x80);
        v >>= 7;
    }
    out.put_u8(v as u8);
}

fn varint_len(mut v: u64) -> usize {
    let mut n = 1;
    while v >= 0x80 {
        v >>= 7;
        n += 1;
    }
    n
}

/// Reads a postcard `u64` varint at `*pos`, as postcard does (at most ten
/// bytes, the tenth at most 1).
fn take_varint(b: &[u8], pos: &mut usize) -> Result<u64, FrameError> {
    let mut out = 0u64;
    for i in 0..VARINT_MAX {
        let Some(&byte) = b.get(*pos) else {
            return Err(postcard::Error::DeserializeUnexpectedEnd.into());
        };
        *pos += 1;
        out |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            if i == VARINT_MAX - 1 && byte > 1 {
                break;
            }
            return Ok(out);
        }
    }
    Err(postcard::Error::DeserializeBadVarint.into())
}

/// Appends the length prefix and the header of a `Data` frame whose payload
/// of `payload_len` bytes the caller writes right after. Fails (writing
/// nothing) if the frame would be larger than `max`.
pub fn encode_data_header(
    stream: StreamId,
    offset: u64,
    payload_len: usize,
    out: &mut BytesMut,
    max: usize,
) -> Result<(), FrameError> {
    let len = payload_len as u64;
    let body = 1 + varint_len(stream) + varint_len(offset) + varint_len(len) + payload_len;
    if body > max {
        return Err(FrameError::TooLarge { len: body, max });
    }
    let prefix = u32::try_from(body).map_err(|_| FrameError::TooLarge { len: body, max })?;
    out.reserve(LENGTH_PREFIX + 1 + 3 * VARINT_MAX);
    out.put_u32(prefix);
    out.put_u8(DATA_VARIANT);
    put_varint(out, stream);
    put_varint(out, offset);
    put_varint(out, len);
    Ok(())
}

/// Appends `frame`, length-prefixed, to `out`. Fails only if the encoding is
/// larger than `max` (the sender's own limit), so a sender never emits a frame
/// its peer must reject.
pub fn encode(frame: &Frame, out: &mut BytesMut, max: usize) -> Result<(), FrameError> {
    if let Frame::Data {
        stream,
        offset,
        payload,
    } = frame
    {
        encode_data_header(*stream, *offset, payload.len(), out, max)?;
        out.extend_from_slice(payload);
        return Ok(());
    }
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
    if body.first() == Some(&DATA_VARIANT) {
        return decode_data(body).map(Some);
    }
    decode_body(&body).map(Some)
}

/// The `Data` frame at the front of `buf`, once its length prefix and header
/// have arrived: `(stream, offset, bytes before the payload, payload
/// length)`. `Ok(None)` if the front frame is something else or its header is
/// still incomplete; the errors are those [`decode`] gives for the whole frame.
/// Lets a reader read a large payload straight into a buffer of its own.
pub fn peek_data_header(
    buf: &[u8],
    max: usize,
) -> Result<Option<(StreamId, u64, usize, usize)>, FrameError> {
    if buf.len() <= LENGTH_PREFIX || buf[LENGTH_PREFIX] != DATA_VARIANT {
        return Ok(None);
    }
    let mut prefix = [0u8; LENGTH_PREFIX];
    prefix.copy_from_slice(&buf[..LENGTH_PREFIX]);
    let len = body_len(prefix, max)?;
    let body = &buf[LENGTH_PREFIX..buf.len().min(LENGTH_PREFIX + len)];
    let complete = body.len() == len;
    let mut pos = 1;
    let mut field = || match take_varint(body, &mut pos) {
        Err(FrameError::Malformed(postcard::Error::DeserializeUnexpectedEnd)) if !complete => {
            Ok(None)
        }
        Err(e) => Err(e),
        Ok(v) => Ok(Some(v)),
    };
    let (Some(stream), Some(offset), Some(payload)) = (field()?, field()?, field()?) else {
        return Ok(None);
    };
    let rest = (len - pos) as u64;
    if payload > rest {
        return Err(postcard::Error::DeserializeUnexpectedEnd.into());
    }
    if payload < rest {
        return Err(postcard::Error::DeserializeBadEncoding.into());
    }
    Ok(Some((
        stream,
        offset,
        LENGTH_PREFIX + pos,
        payload as usize,
    )))
}

/// Decodes a `Data` frame's body (variant byte included); the payload is the
/// tail of `body`, not a copy.
fn decode_data(mut body: BytesMut) -> Result<Frame, FrameError> {
    let mut pos = 1;
    let stream = take_varint(&body, &mut pos)?;
    let offset = take_varint(&body, &mut pos)?;
    let len = take_varint(&body, &mut pos)?;
    let rest = body.len() - pos;
    if len > rest as u64 {
        return Err(postcard::Error::DeserializeUnexpectedEnd.into());
    }
    if len < rest as u64 {
        // Bytes after the frame's end, as `decode_body` refuses them.
        return Err(postcard::Error::DeserializeBadEncoding.into());
    }
    body.advance(pos);
    Ok(Frame::Data {
        stream,
        offset,
        payload: body.freeze(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handshake::{PodRef, PROTOCOL_VERSION};
    use proptest::prelude::*;

    /// The cloud's refusal text and the edge's reading of it are one
    /// contract: what one writes the other reads back, whole seconds
    /// rounded up; any other text names no wait.
    #[test]
    fn a_too_soon_refusal_names_its_wait_rounded_up() {
        let text = renewal_too_soon(Duration::from_secs(60));
        assert_eq!(text, "renewed too recently; try again in 60s");
        assert_eq!(renewal_retry_after(&text), Some(Duration::from_secs(60)));
        let text = renewal_too_soon(Duration::from_millis(500));
        assert_eq!(text, "renewed too recently; try again in 1s");
        assert_eq!(renewal_retry_after(&text), Some(Duration::from_secs(1)));
        assert_eq!(
            renewal_retry_after(&renewal_too_soon(Duration::from_secs(u64::MAX / 2))),
            Some(Duration::from_secs(u64::MAX / 2))
        );
        for other in [
            "certificate renewal is not enabled on this cloud (--join-ca-cert/--join-ca-key)",
            "renewed too recently; try again in soon",
            "renewed too recently; try again in 18446744073709551616s",
            "",
        ] {
            assert_eq!(renewal_retry_after(other), None, "{other:?}");
        }
    }

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
                ticket: Some(crate::ticket::Ticket {
                    node: "edge-1".into(),
                    session: crate::token::SessionId(9),
                    gen: 1_700_000_000_000,
                    expires_ms: 1_700_000_060_000,
                    mac: [3; 32],
                }),
            }),
            Frame::Ticket(crate::ticket::Ticket {
                node: "edge-1".into(),
                session: crate::token::SessionId(9),
                gen: 2,
                expires_ms: 3,
                mac: [4; 32],
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

    /// Data frames are encoded by hand; the bytes must be postcard's, and
    /// postcard's must decode the same way by both paths.
    #[test]
    fn data_frames_are_encoded_exactly_as_postcard_does() {
        for (stream, offset, len) in [
            (0u64, 0u64, 0usize),
            (7, 1 << 40, 5),
            (u64::MAX, u64::MAX, 300),
            (127, 128, 16384),
            (1 << 35, 3, 32 * 1024),
        ] {
            let f = Frame::Data {
                stream,
                offset,
                payload: Bytes::from(vec![0xa5u8; len]),
            };
            let mut ours = BytesMut::new();
            encode(&f, &mut ours, 1 << 20).unwrap();
            let theirs = postcard::to_stdvec(&f).unwrap();
            assert_eq!(
                &ours[LENGTH_PREFIX..],
                &theirs[..],
                "{stream} {offset} {len}"
            );
            assert_eq!(
                u32::from_be_bytes(ours[..4].try_into().unwrap()) as usize,
                theirs.len()
            );
            assert_eq!(decode_body(&theirs).unwrap(), f);
            assert_eq!(decode(&mut ours, 1 << 20).unwrap().unwrap(), f);
        }
    }

    /// A `Data` body with its payload cut short or followed by stray bytes,
    /// or with an overlong varint, is refused by the hand decoder as by
    /// postcard.
    #[test]
    fn malformed_data_frames_are_refused_like_postcard_refuses_them() {
        let f = Frame::Data {
            stream: 300,
            offset: 70_000,
            payload: Bytes::from_static(b"abcdef"),
        };
        let good = postcard::to_stdvec(&f).unwrap();
        let mut bad: Vec<Vec<u8>> = vec![
            good[..good.len() - 1].to_vec(),
            [&good[..], b"x"].concat(),
            good[..3].to_vec(),
            vec![DATA_VARIANT],
        ];
        // An 11-byte varint for the stream id.
        let mut long = vec![DATA_VARIANT];
        long.extend([0xff; 10]);
        long.extend([1, 1, 0]);
        bad.push(long);
        // A tenth varint byte above 1 (overflows a u64).
        let mut over = vec![DATA_VARIANT];
        over.extend([0xff; 9]);
        over.extend([2, 1, 0]);
        bad.push(over);
        for body in bad {
            assert!(decode_body(&body).is_err(), "postcard accepts {body:?}");
            let mut framed = BytesMut::new();
            framed.put_u32(body.len() as u32);
            framed.extend_from_slice(&body);
            assert!(decode(&mut framed, 1 << 20).is_err(), "we accept {body:?}");
        }
        // A non-canonical (but accepted) varint decodes the same both ways.
        let mut lax = vec![DATA_VARIANT, 0x87, 0x00, 0x01, 0x02];
        lax.extend(b"hi");
        let mut framed = BytesMut::new();
        framed.put_u32(lax.len() as u32);
        framed.extend_from_slice(&lax);
        assert_eq!(
            decode(&mut framed, 1 << 20).unwrap().unwrap(),
            decode_body(&lax).unwrap()
        );
    }

    /// The decoded payload is the received buffer itself, not a copy.
    #[test]
    fn decoded_payload_shares_the_read_buffer() {
        let f = Frame::Data {
            stream: 1,
            offset: 0,
            payload: Bytes::from(vec![3u8; 4096]),
        };
        let mut b = BytesMut::new();
        encode(&f, &mut b, 1 << 20).unwrap();
        let start = b.as_ptr() as usize;
        let end = start + b.len();
        let Frame::Data { payload, .. } = decode(&mut b, 1 << 20).unwrap().unwrap() else {
            panic!("not data")
        };
        let p = payload.as_ptr() as usize;
        assert!(p >= start && p + payload.len() <= end);
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
