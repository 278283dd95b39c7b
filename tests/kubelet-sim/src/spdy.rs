//! SPDY/3.1 as spoken by moby/spdystream (and therefore by kubectl, the
//! kube-apiserver and the kubelet): frame encoding/decoding, the zlib header
//! block codec with the SPDY/3 preset dictionary, and an async [`Session`] that
//! multiplexes streams over one connection for either role.
//!
//! Only what Kubernetes uses is implemented: no flow control (SETTINGS and
//! WINDOW_UPDATE are parsed and ignored), no priorities, no server push.
//! Every peer-initiated stream gets an empty SYN_REPLY when we are the server,
//! PINGs from the peer are echoed, RST_STREAM ends a stream's inbound data,
//! GOAWAY stops the session from accepting new streams.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, watch};

/// SPDY protocol version carried in every control frame.
pub const VERSION: u16 = 3;
/// FLAG_FIN: the sender half-closes the stream with this frame.
pub const FLAG_FIN: u8 = 0x01;
/// FLAG_UNIDIRECTIONAL (SYN_STREAM only).
pub const FLAG_UNIDIRECTIONAL: u8 = 0x02;
/// RST_STREAM status PROTOCOL_ERROR.
pub const RST_PROTOCOL_ERROR: u32 = 1;
/// RST_STREAM status CANCEL.
pub const RST_CANCEL: u32 = 5;
/// Largest DATA payload we put in one frame.
pub const MAX_DATA_CHUNK: usize = 32 * 1024;
/// Largest decompressed header block we accept.
const MAX_HEADER_BLOCK: usize = 1 << 20;

const TYPE_SYN_STREAM: u16 = 1;
const TYPE_SYN_REPLY: u16 = 2;
const TYPE_RST_STREAM: u16 = 3;
const TYPE_SETTINGS: u16 = 4;
const TYPE_PING: u16 = 6;
const TYPE_GOAWAY: u16 = 7;
const TYPE_HEADERS: u16 = 8;
const TYPE_WINDOW_UPDATE: u16 = 9;

/// Length-prefixed words that open the SPDY/3 dictionary (draft 3, 2.6.10.1).
const DICT_WORDS: &[&str] = &[
    "options",
    "head",
    "post",
    "put",
    "delete",
    "trace",
    "accept",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "age",
    "allow",
    "authorization",
    "cache-control",
    "connection",
    "content-base",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-md5",
    "content-range",
    "content-type",
    "date",
    "etag",
    "expect",
    "expires",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "location",
    "max-forwards",
    "pragma",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "referer",
    "retry-after",
    "server",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "user-agent",
    "vary",
    "via",
    "warning",
    "www-authenticate",
    "method",
    "get",
    "status",
    "200 OK",
    "version",
    "HTTP/1.1",
    "url",
    "public",
    "set-cookie",
    "keep-alive",
    "origin",
];

/// Raw tail of the SPDY/3 dictionary (no length prefixes, no trailing NUL).
const DICT_TAIL: &str = concat!(
    "100101201202205206300302303304305306307402405406407408409410411412413414415416417",
    "502504505203 Non-Authoritative Information204 No Content301 Moved Permanently",
    "400 Bad Request401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error",
    "501 Not Implemented503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept Oct ",
    "Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,image/png,",
    "image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,text/javascript,",
    "publicprivatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0.",
);

/// The SPDY/3 zlib preset dictionary (1423 bytes, byte-identical to spdystream's).
pub fn dictionary() -> &'static [u8] {
    static DICT: OnceLock<Vec<u8>> = OnceLock::new();
    DICT.get_or_init(|| {
        let mut d = Vec::with_capacity(1423);
        for w in DICT_WORDS {
            d.extend_from_slice(&(w.len() as u32).to_be_bytes());
            d.extend_from_slice(w.as_bytes());
        }
        d.extend_from_slice(DICT_TAIL.as_bytes());
        d
    })
}

/// Header name/value pairs of a header block. Names are lowercase on the wire;
/// multiple values of one name are NUL-joined in one value.
pub type Headers = Vec<(String, String)>;

/// Case-insensitive header lookup.
pub fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// One SPDY/3.1 frame with its header block (if any) already decompressed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    SynStream {
        stream_id: u32,
        assoc_id: u32,
        priority: u8,
        flags: u8,
        headers: Headers,
    },
    SynReply {
        stream_id: u32,
        flags: u8,
        headers: Headers,
    },
    RstStream {
        stream_id: u32,
        status: u32,
    },
    /// Entries are (flags, id, value).
    Settings {
        flags: u8,
        entries: Vec<(u8, u32, u32)>,
    },
    Ping {
        id: u32,
    },
    GoAway {
        last_stream_id: u32,
        status: u32,
    },
    Headers {
        stream_id: u32,
        flags: u8,
        headers: Headers,
    },
    WindowUpdate {
        stream_id: u32,
        delta: u32,
    },
    Data {
        stream_id: u32,
        flags: u8,
        data: Bytes,
    },
    /// A control frame of a type we do not know; skipped.
    Unknown {
        frame_type: u16,
        flags: u8,
    },
}

/// Compressing side of the header codec: one per direction per connection.
pub struct HeaderEncoder {
    z: Compress,
}

impl HeaderEncoder {
    pub fn new() -> Result<Self> {
        let mut z = Compress::new(Compression::default(), true);
        z.set_dictionary(dictionary())
            .map_err(|e| anyhow!("zlib set_dictionary: {e}"))?;
        Ok(Self { z })
    }

    /// Serialise and compress (sync flush) one header block.
    pub fn encode(&mut self, headers: &Headers) -> Result<Vec<u8>> {
        let raw = encode_header_block(headers)?;
        let mut out = Vec::with_capacity(raw.len() + 64);
        let start = self.z.total_in();
        loop {
            let consumed = (self.z.total_in() - start) as usize;
            out.reserve(256);
            self.z
                .compress_vec(&raw[consumed..], &mut out, FlushCompress::Sync)
                .map_err(|e| anyhow!("zlib compress: {e}"))?;
            let consumed = (self.z.total_in() - start) as usize;
            if consumed == raw.len() && out.len() < out.capacity() {
                return Ok(out);
            }
        }
    }
}

/// Decompressing side of the header codec: one per direction per connection.
pub struct HeaderDecoder {
    z: Decompress,
}

impl Default for HeaderDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl HeaderDecoder {
    pub fn new() -> Self {
        Self {
            z: Decompress::new(true),
        }
    }

    /// Decompress one header block and parse it.
    pub fn decode(&mut self, compressed: &[u8]) -> Result<Headers> {
        let mut out: Vec<u8> = Vec::with_capacity(compressed.len() * 4 + 256);
        let start = self.z.total_in();
        loop {
            let consumed = (self.z.total_in() - start) as usize;
            if out.len() == out.capacity() {
                if out.len() >= MAX_HEADER_BLOCK {
                    bail!("header block larger than {MAX_HEADER_BLOCK} bytes");
                }
                out.reserve(out.capacity().max(256));
            }
            let before_out = out.len();
            match self
                .z
                .decompress_vec(&compressed[consumed..], &mut out, FlushDecompress::Sync)
            {
                Ok(_) => {}
                Err(e) if e.needs_dictionary().is_some() => {
                    self.z
                        .set_dictionary(dictionary())
                        .map_err(|e| anyhow!("zlib set_dictionary: {e}"))?;
                    continue;
                }
                Err(e) => bail!("zlib decompress header block: {e}"),
            }
            let now_consumed = (self.z.total_in() - start) as usize;
            if now_consumed == compressed.len() && out.len() < out.capacity() {
                break;
            }
            if now_consumed == consumed && out.len() == before_out && out.len() < out.capacity() {
                bail!("zlib made no progress on header block");
            }
        }
        decode_header_block(&out)
    }
}

/// Serialise a header block (uncompressed): u32 count, then length-prefixed
/// lowercase names and values.
pub fn encode_header_block(headers: &Headers) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    out.extend_from_slice(&u32::try_from(headers.len())?.to_be_bytes());
    for (k, v) in headers {
        let k = k.to_ascii_lowercase();
        out.extend_from_slice(&u32::try_from(k.len())?.to_be_bytes());
        out.extend_from_slice(k.as_bytes());
        out.extend_from_slice(&u32::try_from(v.len())?.to_be_bytes());
        out.extend_from_slice(v.as_bytes());
    }
    Ok(out)
}

/// Parse an uncompressed header block.
pub fn decode_header_block(buf: &[u8]) -> Result<Headers> {
    let mut r = Cursor { buf, pos: 0 };
    let count = r.u32()? as usize;
    if count > buf.len() / 8 + 1 {
        bail!("header block claims {count} headers in {} bytes", buf.len());
    }
    let mut headers = Vec::with_capacity(count);
    for _ in 0..count {
        let klen = r.u32()? as usize;
        let k = r.take(klen)?;
        let vlen = r.u32()? as usize;
        let v = r.take(vlen)?;
        headers.push((
            String::from_utf8_lossy(k).to_ascii_lowercase(),
            String::from_utf8_lossy(v).into_owned(),
        ));
    }
    Ok(headers)
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(|| anyhow!("truncated SPDY frame/header block"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn rest(&mut self) -> &'a [u8] {
        let s = &self.buf[self.pos..];
        self.pos = self.buf.len();
        s
    }
}

fn control_header(frame_type: u16, flags: u8, len: usize) -> Result<[u8; 8]> {
    if len > 0x00ff_ffff {
        bail!("SPDY frame payload too large: {len}");
    }
    let mut h = [0u8; 8];
    h[0..2].copy_from_slice(&(0x8000 | VERSION).to_be_bytes());
    h[2..4].copy_from_slice(&frame_type.to_be_bytes());
    h[4] = flags;
    h[5..8].copy_from_slice(&(len as u32).to_be_bytes()[1..]);
    Ok(h)
}

/// Encode one frame, compressing any header block with `enc`.
pub fn encode_frame(frame: &Frame, enc: &mut HeaderEncoder) -> Result<Vec<u8>> {
    let (frame_type, flags, payload): (u16, u8, Vec<u8>) = match frame {
        Frame::Data {
            stream_id,
            flags,
            data,
        } => {
            if data.len() > 0x00ff_ffff {
                bail!("SPDY data frame too large");
            }
            let mut out = Vec::with_capacity(8 + data.len());
            out.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
            out.push(*flags);
            out.extend_from_slice(&(data.len() as u32).to_be_bytes()[1..]);
            out.extend_from_slice(data);
            return Ok(out);
        }
        Frame::SynStream {
            stream_id,
            assoc_id,
            priority,
            flags,
            headers,
        } => {
            let mut p = Vec::new();
            p.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
            p.extend_from_slice(&(assoc_id & 0x7fff_ffff).to_be_bytes());
            p.push((priority & 0x07) << 5);
            p.push(0); // slot
            p.extend_from_slice(&enc.encode(headers)?);
            (TYPE_SYN_STREAM, *flags, p)
        }
        Frame::SynReply {
            stream_id,
            flags,
            headers,
        } => {
            let mut p = Vec::new();
            p.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
            p.extend_from_slice(&enc.encode(headers)?);
            (TYPE_SYN_REPLY, *flags, p)
        }
        Frame::Headers {
            stream_id,
            flags,
            headers,
        } => {
            let mut p = Vec::new();
            p.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
            p.extend_from_slice(&enc.encode(headers)?);
            (TYPE_HEADERS, *flags, p)
        }
        Frame::RstStream { stream_id, status } => {
            let mut p = Vec::new();
            p.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
            p.extend_from_slice(&status.to_be_bytes());
            (TYPE_RST_STREAM, 0, p)
        }
        Frame::Settings { flags, entries } => {
            let mut p = Vec::new();
            p.extend_from_slice(&u32::try_from(entries.len())?.to_be_bytes());
            for (f, id, v) in entries {
                p.push(*f);
                p.extend_from_slice(&id.to_be_bytes()[1..]);
                p.extend_from_slice(&v.to_be_bytes());
            }
            (TYPE_SETTINGS, *flags, p)
        }
        Frame::Ping { id } => (TYPE_PING, 0, id.to_be_bytes().to_vec()),
        Frame::GoAway {
            last_stream_id,
            status,
        } => {
            let mut p = Vec::new();
            p.extend_from_slice(&(last_stream_id & 0x7fff_ffff).to_be_bytes());
            p.extend_from_slice(&status.to_be_bytes());
            (TYPE_GOAWAY, 0, p)
        }
        Frame::WindowUpdate { stream_id, delta } => {
            let mut p = Vec::new();
            p.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
            p.extend_from_slice(&(delta & 0x7fff_ffff).to_be_bytes());
            (TYPE_WINDOW_UPDATE, 0, p)
        }
        Frame::Unknown { .. } => bail!("cannot encode an unknown frame"),
    };
    let mut out = Vec::with_capacity(8 + payload.len());
    out.extend_from_slice(&control_header(frame_type, flags, payload.len())?);
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Payload length announced by an 8-byte frame header.
pub fn frame_len(head: &[u8; 8]) -> usize {
    u32::from_be_bytes([0, head[5], head[6], head[7]]) as usize
}

/// Decode one frame from its 8-byte header and its payload.
pub fn decode_frame(head: &[u8; 8], payload: Bytes, dec: &mut HeaderDecoder) -> Result<Frame> {
    let flags = head[4];
    if head[0] & 0x80 == 0 {
        let stream_id = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) & 0x7fff_ffff;
        return Ok(Frame::Data {
            stream_id,
            flags,
            data: payload,
        });
    }
    let version = u16::from_be_bytes([head[0], head[1]]) & 0x7fff;
    if version != VERSION {
        bail!("unsupported SPDY version {version}");
    }
    let frame_type = u16::from_be_bytes([head[2], head[3]]);
    let mut r = Cursor {
        buf: &payload,
        pos: 0,
    };
    let frame = match frame_type {
        TYPE_SYN_STREAM => {
            let stream_id = r.u32()? & 0x7fff_ffff;
            let assoc_id = r.u32()? & 0x7fff_ffff;
            let priority = r.u8()? >> 5;
            let _slot = r.u8()?;
            let headers = dec.decode(r.rest())?;
            Frame::SynStream {
                stream_id,
                assoc_id,
                priority,
                flags,
                headers,
            }
        }
        TYPE_SYN_REPLY => {
            let stream_id = r.u32()? & 0x7fff_ffff;
            let headers = dec.decode(r.rest())?;
            Frame::SynReply {
                stream_id,
                flags,
                headers,
            }
        }
        TYPE_HEADERS => {
            let stream_id = r.u32()? & 0x7fff_ffff;
            let headers = dec.decode(r.rest())?;
            Frame::Headers {
                stream_id,
                flags,
                headers,
            }
        }
        TYPE_RST_STREAM => Frame::RstStream {
            stream_id: r.u32()? & 0x7fff_ffff,
            status: r.u32()?,
        },
        TYPE_SETTINGS => {
            let n = r.u32()? as usize;
            let mut entries = Vec::new();
            for _ in 0..n {
                let b = r.take(8)?;
                entries.push((
                    b[0],
                    u32::from_be_bytes([0, b[1], b[2], b[3]]),
                    u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
                ));
            }
            Frame::Settings { flags, entries }
        }
        TYPE_PING => Frame::Ping { id: r.u32()? },
        TYPE_GOAWAY => {
            let last_stream_id = r.u32()? & 0x7fff_ffff;
            // SPDY/3 adds a status code; tolerate its absence.
            let status = r.u32().unwrap_or(0);
            Frame::GoAway {
                last_stream_id,
                status,
            }
        }
        TYPE_WINDOW_UPDATE => Frame::WindowUpdate {
            stream_id: r.u32()? & 0x7fff_ffff,
            delta: r.u32()? & 0x7fff_ffff,
        },
        other => Frame::Unknown {
            frame_type: other,
            flags,
        },
    };
    Ok(frame)
}

/// Read one frame; `Ok(None)` on a clean EOF between frames.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    dec: &mut HeaderDecoder,
) -> Result<Option<Frame>> {
    let mut head = [0u8; 8];
    let mut got = 0;
    while got < 8 {
        let n = r
            .read(&mut head[got..])
            .await
            .context("read SPDY frame header")?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            bail!("connection closed inside a SPDY frame header");
        }
        got += n;
    }
    let len = frame_len(&head);
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)
        .await
        .context("read SPDY frame payload")?;
    decode_frame(&head, Bytes::from(payload), dec).map(Some)
}

/// Which side of the connection we are: decides stream-id parity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Client,
    Server,
}

enum WriterCmd {
    Frame(Frame),
    /// Send GOAWAY, flush, shut the write half down, then ack.
    Close(oneshot::Sender<()>),
}

struct StreamEntry {
    data_tx: Option<mpsc::UnboundedSender<Bytes>>,
    reply_tx: Option<oneshot::Sender<Headers>>,
}

struct Shared {
    streams: Mutex<HashMap<u32, StreamEntry>>,
    next_id: AtomicU32,
    next_ping: AtomicU32,
    last_peer_stream: AtomicU32,
    pongs: Mutex<HashMap<u32, oneshot::Sender<()>>>,
}

/// A SPDY/3.1 connection with background reader and writer tasks.
pub struct Session {
    role: Role,
    tx: mpsc::UnboundedSender<WriterCmd>,
    incoming: mpsc::Receiver<Stream>,
    shared: Arc<Shared>,
    closed: watch::Receiver<bool>,
    reader: tokio::task::JoinHandle<()>,
}

/// A handle to a session that can open streams and close it, without owning
/// the incoming-stream queue.
#[derive(Clone)]
pub struct SessionHandle {
    tx: mpsc::UnboundedSender<WriterCmd>,
    closed: watch::Receiver<bool>,
}

impl SessionHandle {
    /// Resolves when the connection's read side has ended.
    pub async fn closed(&self) {
        let mut c = self.closed.clone();
        let _ = c.wait_for(|v| *v).await;
    }

    /// Send GOAWAY, flush and shut down our write side.
    pub async fn close(&self) {
        let (ack_tx, ack_rx) = oneshot::channel();
        if self.tx.send(WriterCmd::Close(ack_tx)).is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(10), ack_rx).await;
        }
    }
}

/// One SPDY stream: its SYN_STREAM headers, its inbound data, and a writer.
pub struct Stream {
    pub id: u32,
    pub headers: Headers,
    rx: mpsc::UnboundedReceiver<Bytes>,
    writer: StreamWriter,
}

impl Stream {
    /// Case-insensitive lookup of a SYN_STREAM header.
    pub fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }
    /// Next inbound chunk; `None` once the peer half-closed or reset the stream.
    pub async fn read(&mut self) -> Option<Bytes> {
        self.rx.recv().await
    }
    pub fn writer(&self) -> StreamWriter {
        self.writer.clone()
    }
    /// Split into the inbound receiver and the outbound writer.
    pub fn split(self) -> (mpsc::UnboundedReceiver<Bytes>, StreamWriter) {
        (self.rx, self.writer)
    }
}

/// Outbound half of a stream; cheap to clone.
#[derive(Clone)]
pub struct StreamWriter {
    pub id: u32,
    tx: mpsc::UnboundedSender<WriterCmd>,
}

impl StreamWriter {
    /// Send data, split into frames of at most [`MAX_DATA_CHUNK`].
    pub fn write(&self, data: &[u8]) -> Result<()> {
        for chunk in data.chunks(MAX_DATA_CHUNK) {
            self.tx
                .send(WriterCmd::Frame(Frame::Data {
                    stream_id: self.id,
                    flags: 0,
                    data: Bytes::copy_from_slice(chunk),
                }))
                .map_err(|_| anyhow!("SPDY connection closed"))?;
        }
        Ok(())
    }
    /// Half-close: an empty DATA frame with FIN.
    pub fn close(&self) {
        let _ = self.tx.send(WriterCmd::Frame(Frame::Data {
            stream_id: self.id,
            flags: FLAG_FIN,
            data: Bytes::new(),
        }));
    }
    /// Reset with RST_STREAM CANCEL.
    pub fn reset(&self) {
        let _ = self.tx.send(WriterCmd::Frame(Frame::RstStream {
            stream_id: self.id,
            status: RST_CANCEL,
        }));
    }
}

impl Session {
    /// Start a session over `io`; spawns the reader and writer tasks.
    pub fn new<IO>(io: IO, role: Role) -> Result<Self>
    where
        IO: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (rd, wr) = tokio::io::split(io);
        let (tx, rx) = mpsc::unbounded_channel();
        let enc = HeaderEncoder::new()?;
        tokio::spawn(writer_task(wr, rx, enc));
        let shared = Arc::new(Shared {
            streams: Mutex::new(HashMap::new()),
            next_id: AtomicU32::new(if role == Role::Client { 1 } else { 2 }),
            next_ping: AtomicU32::new(if role == Role::Client { 1 } else { 2 }),
            last_peer_stream: AtomicU32::new(0),
            pongs: Mutex::new(HashMap::new()),
        });
        let (in_tx, incoming) = mpsc::channel(64);
        let (closed_tx, closed) = watch::channel(false);
        let reader = tokio::spawn(reader_task(
            rd,
            role,
            tx.clone(),
            shared.clone(),
            in_tx,
            closed_tx,
        ));
        Ok(Self {
            role,
            tx,
            incoming,
            shared,
            closed,
            reader,
        })
    }

    pub fn handle(&self) -> SessionHandle {
        SessionHandle {
            tx: self.tx.clone(),
            closed: self.closed.clone(),
        }
    }

    /// Next stream opened by the peer; `None` once the connection ended or
    /// the peer sent GOAWAY.
    pub async fn accept(&mut self) -> Option<Stream> {
        self.incoming.recv().await
    }

    /// Open a stream (client side) and wait up to 30 s for its SYN_REPLY.
    pub async fn open_stream(&self, headers: Headers, fin: bool) -> Result<Stream> {
        let id = self.shared.next_id.fetch_add(2, Ordering::SeqCst);
        let (data_tx, rx) = mpsc::unbounded_channel();
        let (reply_tx, reply_rx) = oneshot::channel();
        lock(&self.shared.streams).insert(
            id,
            StreamEntry {
                data_tx: Some(data_tx),
                reply_tx: Some(reply_tx),
            },
        );
        self.tx
            .send(WriterCmd::Frame(Frame::SynStream {
                stream_id: id,
                assoc_id: 0,
                priority: 0,
                flags: if fin { FLAG_FIN } else { 0 },
                headers: headers.clone(),
            }))
            .map_err(|_| anyhow!("SPDY connection closed"))?;
        tokio::time::timeout(Duration::from_secs(30), reply_rx)
            .await
            .context("timed out waiting for SYN_REPLY")?
            .map_err(|_| anyhow!("stream {id} reset or connection closed before SYN_REPLY"))?;
        Ok(Stream {
            id,
            headers,
            rx,
            writer: StreamWriter {
                id,
                tx: self.tx.clone(),
            },
        })
    }

    /// Send a PING and wait (up to `timeout`) for its echo.
    pub async fn ping(&self, timeout: Duration) -> Result<Duration> {
        let id = self.shared.next_ping.fetch_add(2, Ordering::SeqCst);
        let (tx, rx) = oneshot::channel();
        lock(&self.shared.pongs).insert(id, tx);
        let start = std::time::Instant::now();
        self.tx
            .send(WriterCmd::Frame(Frame::Ping { id }))
            .map_err(|_| anyhow!("SPDY connection closed"))?;
        tokio::time::timeout(timeout, rx)
            .await
            .context("ping timed out")?
            .map_err(|_| anyhow!("connection closed before pong"))?;
        Ok(start.elapsed())
    }

    pub fn role(&self) -> Role {
        self.role
    }

    /// Resolves when the connection's read side has ended.
    pub async fn closed(&self) {
        self.handle().closed().await
    }

    /// GOAWAY + shut down our write side, then give the peer a moment to close
    /// its side before dropping the connection.
    pub async fn close(self) {
        self.handle().close().await;
        let mut reader = self.reader;
        if tokio::time::timeout(Duration::from_secs(5), &mut reader)
            .await
            .is_err()
        {
            reader.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn writer_task<W: AsyncWrite + Unpin>(
    mut wr: W,
    mut rx: mpsc::UnboundedReceiver<WriterCmd>,
    mut enc: HeaderEncoder,
) {
    while let Some(cmd) = rx.recv().await {
        match cmd {
            WriterCmd::Frame(frame) => {
                let bytes = match encode_frame(&frame, &mut enc) {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::warn!("spdy: cannot encode frame: {e:#}");
                        continue;
                    }
                };
                if let Err(e) = wr.write_all(&bytes).await {
                    tracing::debug!("spdy: write failed: {e}");
                    break;
                }
                // Flush only when nothing else is queued, to batch small frames.
                if rx.is_empty() && wr.flush().await.is_err() {
                    break;
                }
            }
            WriterCmd::Close(ack) => {
                if let Ok(b) = encode_frame(
                    &Frame::GoAway {
                        last_stream_id: 0,
                        status: 0,
                    },
                    &mut enc,
                ) {
                    let _ = wr.write_all(&b).await;
                }
                let _ = wr.flush().await;
                let _ = wr.shutdown().await;
                let _ = ack.send(());
                break;
            }
        }
    }
    let _ = wr.shutdown().await;
}

async fn reader_task<R: AsyncRead + Unpin>(
    rd: R,
    role: Role,
    tx: mpsc::UnboundedSender<WriterCmd>,
    shared: Arc<Shared>,
    in_tx: mpsc::Sender<Stream>,
    closed_tx: watch::Sender<bool>,
) {
    let mut rd = tokio::io::BufReader::with_capacity(64 * 1024, rd);
    let mut dec = HeaderDecoder::new();
    let mut in_tx = Some(in_tx);
    let peer_parity = if role == Role::Server { 1 } else { 0 };
    loop {
        let frame = match read_frame(&mut rd, &mut dec).await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                tracing::debug!("spdy: read ended: {e:#}");
                break;
            }
        };
        match frame {
            Frame::SynStream {
                stream_id,
                flags,
                headers,
                ..
            } => {
                if stream_id % 2 != peer_parity || stream_id == 0 {
                    let _ = tx.send(WriterCmd::Frame(Frame::RstStream {
                        stream_id,
                        status: RST_PROTOCOL_ERROR,
                    }));
                    continue;
                }
                let Some(sender) = in_tx.as_ref() else {
                    // After GOAWAY we accept no new streams.
                    let _ = tx.send(WriterCmd::Frame(Frame::RstStream {
                        stream_id,
                        status: RST_CANCEL,
                    }));
                    continue;
                };
                shared.last_peer_stream.store(stream_id, Ordering::SeqCst);
                let (data_tx, rx) = mpsc::unbounded_channel();
                lock(&shared.streams).insert(
                    stream_id,
                    StreamEntry {
                        data_tx: if flags & FLAG_FIN != 0 {
                            None
                        } else {
                            Some(data_tx)
                        },
                        reply_tx: None,
                    },
                );
                let _ = tx.send(WriterCmd::Frame(Frame::SynReply {
                    stream_id,
                    flags: 0,
                    headers: Vec::new(),
                }));
                let stream = Stream {
                    id: stream_id,
                    headers,
                    rx,
                    writer: StreamWriter {
                        id: stream_id,
                        tx: tx.clone(),
                    },
                };
                if sender.send(stream).await.is_err() {
                    // Nobody accepts streams any more.
                    in_tx = None;
                }
            }
            Frame::SynReply {
                stream_id,
                flags,
                headers,
                ..
            } => {
                let mut streams = lock(&shared.streams);
                if let Some(e) = streams.get_mut(&stream_id) {
                    if let Some(r) = e.reply_tx.take() {
                        let _ = r.send(headers);
                    }
                    if flags & FLAG_FIN != 0 {
                        e.data_tx = None;
                    }
                }
            }
            Frame::Data {
                stream_id,
                flags,
                data,
            } => {
                let mut streams = lock(&shared.streams);
                if let Some(e) = streams.get_mut(&stream_id) {
                    if !data.is_empty() {
                        if let Some(d) = &e.data_tx {
                            let _ = d.send(data);
                        }
                    }
                    if flags & FLAG_FIN != 0 {
                        e.data_tx = None;
                    }
                }
            }
            Frame::RstStream { stream_id, .. } => {
                lock(&shared.streams).remove(&stream_id);
            }
            Frame::Ping { id } => {
                if id % 2 == peer_parity {
                    let _ = tx.send(WriterCmd::Frame(Frame::Ping { id }));
                } else if let Some(p) = lock(&shared.pongs).remove(&id) {
                    let _ = p.send(());
                }
            }
            Frame::GoAway { .. } => {
                in_tx = None;
            }
            Frame::Headers {
                stream_id, flags, ..
            } => {
                if flags & FLAG_FIN != 0 {
                    if let Some(e) = lock(&shared.streams).get_mut(&stream_id) {
                        e.data_tx = None;
                    }
                }
            }
            Frame::Settings { .. } | Frame::WindowUpdate { .. } | Frame::Unknown { .. } => {}
        }
    }
    lock(&shared.streams).clear();
    lock(&shared.pongs).clear();
    drop(in_tx);
    let _ = closed_tx.send(true);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(frames: &[Frame]) {
        let mut enc = HeaderEncoder::new().expect("encoder");
        let mut dec = HeaderDecoder::new();
        for f in frames {
            let bytes = encode_frame(f, &mut enc).expect("encode");
            let head: [u8; 8] = bytes[..8].try_into().expect("head");
            assert_eq!(frame_len(&head), bytes.len() - 8);
            let back =
                decode_frame(&head, Bytes::copy_from_slice(&bytes[8..]), &mut dec).expect("decode");
            assert_eq!(&back, f);
        }
    }

    #[test]
    fn dictionary_is_canonical() {
        let d = dictionary();
        assert_eq!(d.len(), 1423);
        assert!(d.starts_with(b"\x00\x00\x00\x07options\x00\x00\x00\x04head"));
        assert!(d.ends_with(b"enq=0."));
        // Adler-32 of the canonical dictionary is the DICTID peers expect.
        let mut z = Compress::new(Compression::default(), true);
        assert_eq!(z.set_dictionary(d).expect("dict"), 0xe3c6_a7c2);
    }

    #[test]
    fn frames_round_trip_with_shared_zlib_context() {
        let hdrs = |t: &str| vec![("streamtype".to_string(), t.to_string())];
        roundtrip(&[
            Frame::SynStream {
                stream_id: 1,
                assoc_id: 0,
                priority: 3,
                flags: 0,
                headers: hdrs("error"),
            },
            Frame::SynReply {
                stream_id: 1,
                flags: 0,
                headers: vec![],
            },
            Frame::SynStream {
                stream_id: 3,
                assoc_id: 0,
                priority: 0,
                flags: FLAG_FIN,
                headers: vec![
                    ("streamtype".into(), "data".into()),
                    ("port".into(), "8080".into()),
                    ("requestid".into(), "0".into()),
                ],
            },
            Frame::Headers {
                stream_id: 3,
                flags: 0,
                headers: hdrs("x"),
            },
            Frame::Data {
                stream_id: 3,
                flags: FLAG_FIN,
                data: Bytes::from_static(b"hello"),
            },
            Frame::RstStream {
                stream_id: 5,
                status: RST_CANCEL,
            },
            Frame::Settings {
                flags: 0,
                entries: vec![(0, 7, 65536)],
            },
            Frame::Ping { id: 7 },
            Frame::GoAway {
                last_stream_id: 3,
                status: 0,
            },
            Frame::WindowUpdate {
                stream_id: 1,
                delta: 1000,
            },
        ]);
    }

    #[test]
    fn header_block_uses_dictionary() {
        let mut enc = HeaderEncoder::new().expect("encoder");
        let block = enc
            .encode(&vec![("streamtype".into(), "stdout".into())])
            .expect("encode");
        // zlib header with FDICT set, followed by the dictionary's Adler-32.
        assert_eq!(block[1] & 0x20, 0x20);
        assert_eq!(&block[2..6], &0xe3c6_a7c2u32.to_be_bytes());
        let mut dec = HeaderDecoder::new();
        assert_eq!(
            dec.decode(&block).expect("decode"),
            vec![("streamtype".to_string(), "stdout".to_string())]
        );
    }

    #[test]
    fn truncated_input_is_an_error_not_a_panic() {
        let mut dec = HeaderDecoder::new();
        assert!(decode_header_block(&[0, 0, 0, 5, 0, 0]).is_err());
        let head = control_header(TYPE_SYN_STREAM, 0, 3).expect("head");
        assert!(decode_frame(&head, Bytes::from_static(&[1, 2, 3]), &mut dec).is_err());
        let head = control_header(TYPE_PING, 0, 0).expect("head");
        assert!(decode_frame(&head, Bytes::new(), &mut dec).is_err());
    }

    #[tokio::test]
    async fn session_client_server_exchange() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let mut server = Session::new(a, Role::Server).expect("server");
        let client = Session::new(b, Role::Client).expect("client");
        let srv = tokio::spawn(async move {
            let mut s = server.accept().await.expect("stream");
            assert_eq!(s.header("streamType"), Some("stdin"));
            let mut got = Vec::new();
            while let Some(d) = s.read().await {
                got.extend_from_slice(&d);
            }
            s.writer().write(&got).expect("write");
            s.writer().close();
            server
        });
        let mut st = client
            .open_stream(vec![("streamType".into(), "stdin".into())], false)
            .await
            .expect("open");
        st.writer().write(b"ping-pong").expect("write");
        st.writer().close();
        client.ping(Duration::from_secs(5)).await.expect("ping");
        let mut echoed = Vec::new();
        while let Some(d) = tokio::time::timeout(Duration::from_secs(5), st.read())
            .await
            .expect("timeout")
        {
            echoed.extend_from_slice(&d);
        }
        assert_eq!(echoed, b"ping-pong");
        let server = srv.await.expect("join");
        drop(st);
        drop(client);
        tokio::time::timeout(Duration::from_secs(10), server.close())
            .await
            .expect("close");
    }
}
