//! The fuzz targets, one function each, shared by the AFL++ binaries
//! (`src/bin/*.rs`, built with `cargo afl build`) and by the corpus replay
//! test (`tests/corpus.rs`, a plain `cargo test`). Each function must never
//! panic, whatever the input: a panic is a crash AFL++ records.
//!
//! See README.md for the commands.

use std::sync::OnceLock;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tether_proto::frame::{self, Frame, ResetCode};
use tether_proto::handshake::{Hello, Welcome};
use tether_proto::head::{encode_head, read_head, RequestHead, ResponseHead};
use tether_proto::stream::{ReadOutcome, StreamLimits, StreamState};

/// A fuzz target: any input, never a panic.
pub type Target = fn(&[u8]);

/// All targets by name, for the replay test and the runner script.
pub const TARGETS: &[(&str, Target)] = &[
    ("frame_decode", frame_decode),
    ("head_decode", head_decode),
    ("hello_welcome", hello_welcome),
    ("route", route),
    ("stream", stream),
    ("config", config),
    ("csr", csr),
    ("token", token),
];

const MAX_FRAME: usize = 1 << 20;

/// Frames off a byte stream, as `FrameReader` takes them: every decoded
/// frame re-encodes to a frame that decodes equal.
pub fn frame_decode(data: &[u8]) {
    let mut buf = BytesMut::from(data);
    for _ in 0..1024 {
        match frame::decode(&mut buf, MAX_FRAME) {
            Ok(Some(f)) => {
                let bytes =
                    frame::encode_to_bytes(&f, MAX_FRAME * 2).expect("a decoded frame re-encodes");
                let mut again = BytesMut::from(&bytes[..]);
                let back = frame::decode(&mut again, MAX_FRAME * 2)
                    .expect("a re-encoded frame decodes")
                    .expect("whole");
                assert_eq!(back, f);
            }
            Ok(None) | Err(_) => return,
        }
    }
}

/// Polls a future over an in-memory reader, which is always ready.
fn now<F: std::future::Future>(f: F) -> F::Output {
    let mut cx = Context::from_waker(Waker::noop());
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut cx) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("a read over a slice was pending"),
    }
}

/// Request and response heads as both ends read them.
pub fn head_decode(data: &[u8]) {
    const MAX: usize = 256 * 1024;
    if let Ok(h) = now(read_head::<RequestHead, _>(&mut &data[..], MAX)) {
        let _ = (h.path(), h.is_upgrade(), h.header("host"));
        let bytes = encode_head(&h, MAX).expect("a decoded head re-encodes");
        let back: RequestHead = now(read_head(&mut &bytes[..], MAX)).expect("round trip");
        assert_eq!(back, h);
    }
    if let Ok(h) = now(read_head::<ResponseHead, _>(&mut &data[..], MAX)) {
        let bytes = encode_head(&h, MAX).expect("a decoded head re-encodes");
        let back: ResponseHead = now(read_head(&mut &bytes[..], MAX)).expect("round trip");
        assert_eq!(back, h);
    }
}

/// Hello and Welcome bodies.
pub fn hello_welcome(data: &[u8]) {
    if let Ok(h) = postcard::from_bytes::<Hello>(data) {
        let _ = tether_proto::handshake::negotiate_version(&h.versions);
        let bytes = postcard::to_stdvec(&h).expect("re-encodes");
        assert_eq!(
            postcard::from_bytes::<Hello>(&bytes).expect("round trip"),
            h
        );
    }
    if let Ok(w) = postcard::from_bytes::<Welcome>(data) {
        let _ = w.limits.validate();
        let bytes = postcard::to_stdvec(&w).expect("re-encodes");
        assert_eq!(
            postcard::from_bytes::<Welcome>(&bytes).expect("round trip"),
            w
        );
    }
}

/// Route classification: whatever is forwarded has no traversal left in it.
pub fn route(data: &[u8]) {
    let Ok(path) = std::str::from_utf8(data) else {
        return;
    };
    if let Some(r) = tether_proto::route::classify(path) {
        let _ = r.kind().as_str();
        for seg in path.split('/').skip(1) {
            assert_ne!(seg, "..", "{path:?} forwarded with a .. segment");
        }
        let lower = path.to_ascii_lowercase();
        assert!(!lower.contains("%2f") && !lower.contains("%5c"), "{path:?}");
    }
}

/// A resumable stream driven by a random sequence of peer frames and local
/// operations: never a panic, and the receive queue stays within its bound.
pub fn stream(data: &[u8]) {
    let limits = StreamLimits {
        replay_bytes: 256,
        recv_bytes: 256,
        max_payload: 64,
    };
    let mut s = StreamState::new(1, limits);
    let mut d = data.iter().copied();
    let mut next = move || d.next();
    let num = |next: &mut dyn FnMut() -> Option<u8>| -> Option<u64> {
        let hi = next()?;
        let lo = next()?;
        // Mostly small offsets, sometimes huge ones.
        Some(if hi == 0xff {
            u64::MAX - u64::from(lo)
        } else {
            u64::from(hi) << 8 | u64::from(lo)
        })
    };
    for _ in 0..256 {
        let Some(op) = next() else { return };
        let r = match op % 11 {
            0 | 1 => {
                let Some(offset) = num(&mut next) else { return };
                let len = usize::from(next().unwrap_or(0) % 80);
                if !s.recv_has_room() {
                    continue;
                }
                s.on_frame(Frame::Data {
                    stream: 1,
                    offset,
                    payload: Bytes::from(vec![b'x'; len]),
                })
            }
            2 => {
                let Some(delivered) = num(&mut next) else {
                    return;
                };
                let fin = next().unwrap_or(0) & 1 == 1;
                s.on_frame(Frame::Ack {
                    stream: 1,
                    delivered,
                    fin_received: fin,
                })
            }
            3 => {
                let Some(offset) = num(&mut next) else { return };
                s.on_frame(Frame::End { stream: 1, offset })
            }
            4 => s.on_frame(Frame::Reset {
                stream: 1,
                code: ResetCode::Cancelled,
                message: String::new(),
            }),
            5 => {
                let n = usize::from(next().unwrap_or(1));
                s.write(&vec![b'y'; n]);
                Ok(())
            }
            6 => {
                s.finish();
                Ok(())
            }
            7 => {
                for _ in 0..64 {
                    if s.poll_transmit().is_none() {
                        break;
                    }
                }
                Ok(())
            }
            8 => {
                let max = usize::from(next().unwrap_or(1));
                if let ReadOutcome::Data(b) = s.read(max) {
                    assert!(b.len() <= max.max(1));
                }
                Ok(())
            }
            9 => {
                s.detach();
                let Some(delivered) = num(&mut next) else {
                    return;
                };
                let fin = next().unwrap_or(0) & 1 == 1;
                s.attach(delivered, fin).map(|_| ())
            }
            _ => {
                // Another stream's frame is refused, not mixed in.
                s.on_frame(Frame::Data {
                    stream: 2,
                    offset: 0,
                    payload: Bytes::new(),
                })
                .map(|_| panic!("a frame of stream 2 was accepted by stream 1"))
            }
        };
        // The receive bound: a frame is taken only when there is room, so
        // the queue exceeds the bound by at most one payload.
        assert!(s.recv_memory() <= limits.recv_bytes + 80 + 64);
        assert!(s.replay_buffered() <= limits.replay_bytes);
        if r.is_err() {
            // The driver resets the stream on a protocol error; go on like it.
            s.reset(ResetCode::ProtocolError, "fuzz");
        }
    }
}

/// Configuration values: durations and byte sizes as flags and config files
/// give them.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(d) = tether_proto::units::parse_duration(text) {
        let _ = d.as_nanos();
    }
    if let Ok(n) = tether_proto::units::parse_bytes(text) {
        let _ = n;
    }
    let _ = tether_proto::units::parse_bytes_u32(text);
}

fn ca() -> &'static tether_certs::Ca {
    static CA: OnceLock<tether_certs::Ca> = OnceLock::new();
    CA.get_or_init(|| tether_certs::Ca::new("fuzz-ca", Duration::from_secs(86_400)).expect("a CA"))
}

/// A CSR as the cloud's join and renewal read it: signed only for the node
/// it was asked for.
pub fn csr(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(issued) = tether_certs::sign_edge_csr(ca(), text, "edge-1", Duration::from_secs(3600))
    {
        let der = tether_certs::pem::certs_from_pem(&issued.cert_pem, "issued").expect("PEM");
        let node = tether_certs::node_name_from_cert(&der[0]).expect("a node name");
        assert_eq!(node, "edge-1");
    }
}

/// Join tokens as the edge's flag and the cloud's join read them.
pub fn token(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(t) = tether_certs::token::JoinToken::parse(text) {
        // Surrounding whitespace (a pasted token's newline) is ignored.
        assert_eq!(t.reveal(), text.trim());
    }
    let _ = tether_certs::token::glob_match(text, "edge-1");
}

/// Valid example inputs for each target, the start of its corpus
/// (`cargo run --bin seed` writes them to `corpus/<target>/`).
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    use tether_proto::handshake::{PodReport, PROTOCOL_VERSION};
    use tether_proto::token::{ResumeToken, SessionId};
    use tether_proto::Limits;
    let mut out = Vec::new();
    let hello = Hello {
        versions: vec![PROTOCOL_VERSION],
        node: "edge-1".into(),
        addresses: vec!["10.0.0.5".into(), "edge-1.example".into()],
        resume: ResumeToken([7; 16]),
        instance: 11,
        attempt: 3,
        limits: Limits::default(),
        ticket: Some(tether_proto::ticket::Ticket {
            node: "edge-1".into(),
            session: SessionId(42),
            gen: 1_700_000_000_000,
            expires_ms: 1_700_000_360_000,
            mac: [9; 32],
        }),
    };
    let welcome = Welcome {
        version: PROTOCOL_VERSION,
        session: SessionId(42),
        resumed: true,
        gen: 1_700_000_000_001,
        ticket: tether_proto::ticket::Ticket {
            node: "edge-1".into(),
            session: SessionId(42),
            gen: 1_700_000_000_001,
            expires_ms: 1_700_000_360_001,
            mac: [8; 32],
        },
        grace_ms: 300_000,
        limits: Limits::default(),
    };
    let frames = vec![
        Frame::Hello(hello.clone()),
        Frame::Welcome(welcome.clone()),
        Frame::Attach {
            stream: 1,
            delivered: 10,
            fin_received: false,
        },
        Frame::Data {
            stream: 1,
            offset: 0,
            payload: Bytes::from_static(b"hello"),
        },
        Frame::Ack {
            stream: 1,
            delivered: 5,
            fin_received: true,
        },
        Frame::End {
            stream: 1,
            offset: 5,
        },
        Frame::Reset {
            stream: 1,
            code: ResetCode::KubeletUnreachable,
            message: "no kubelet".into(),
        },
        Frame::PodReport(PodReport { pods: vec![] }),
    ];
    let mut all = Vec::new();
    for f in &frames {
        let b = frame::encode_to_bytes(f, MAX_FRAME).expect("encodes");
        out.push(("frame_decode", b.to_vec()));
        all.extend_from_slice(&b);
    }
    out.push(("frame_decode", all));
    let req = RequestHead {
        method: "POST".into(),
        path_and_query: "/exec/default/p1/c?command=sh&stdin=true&tty=true".into(),
        headers: vec![
            ("connection".into(), b"Upgrade".to_vec()),
            ("upgrade".into(), b"SPDY/3.1".to_vec()),
        ],
        has_body: false,
    };
    out.push(("head_decode", encode_head(&req, 1 << 16).expect("head")));
    let resp = ResponseHead {
        status: 101,
        headers: vec![("upgrade".into(), b"SPDY/3.1".to_vec())],
    };
    out.push(("head_decode", encode_head(&resp, 1 << 16).expect("head")));
    out.push(("hello_welcome", postcard::to_stdvec(&hello).expect("hello")));
    out.push((
        "hello_welcome",
        postcard::to_stdvec(&welcome).expect("welcome"),
    ));
    for p in [
        "/exec/default/p1/c1",
        "/attach/ns/p/uid-1/c",
        "/portForward/ns/p",
        "/containerLogs/ns/p/c",
        "/logs/",
        "/logs/syslog",
        "/metrics/cadvisor",
        "/stats/summary",
        "/pods",
        "/healthz/ping",
        "/exec/ns/%2e%2e/c",
    ] {
        out.push(("route", p.as_bytes().to_vec()));
    }
    // Stream programs: data, read, ack, end, write/transmit, re-attach.
    out.push((
        "stream",
        vec![0, 0, 0, 5, 8, 10, 5, 20, 7, 2, 0, 5, 0, 3, 0, 5, 8, 1],
    ));
    out.push(("stream", vec![5, 100, 6, 7, 9, 0, 0, 0, 7, 2, 0, 100, 1]));
    for c in [
        "10s", "250ms", "1h", "5m", "64KiB", "1MiB", "2GiB", "0", "1d",
    ] {
        out.push(("config", c.as_bytes().to_vec()));
    }
    let req = tether_certs::make_edge_csr("edge-1").expect("a CSR");
    out.push(("csr", req.csr_pem.into_bytes()));
    let other = tether_certs::make_edge_csr("edge-2").expect("a CSR");
    out.push(("csr", other.csr_pem.into_bytes()));
    out.push((
        "token",
        tether_certs::JoinToken::generate().reveal().into_bytes(),
    ));
    out.push(("token", b"abcdef.0123456789abcdef".to_vec()));
    out
}
