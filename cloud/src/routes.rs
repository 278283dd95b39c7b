//! Routes shared between replicas: which edges each replica holds.
//!
//! **Push, not ask.** Every replica subscribes to each peer it has a link to
//! (one bidirectional stream on the link it dialled, opened with
//! [`SUBSCRIBE_MAGIC`]); the peer answers with its whole table of locally
//! held edges, then with every change, as length-prefixed postcard
//! [`Update`]s. A replica therefore routes every request from its own memory:
//! a relayed stream costs one stream open on the peer link and no lookup
//! round trip, and a pod or address claimed on two replicas is a 409 exactly
//! as on one, because both claims are in the same table. Asking on a miss
//! would add a round trip to every relayed request and leave "unknown" vs
//! "held elsewhere" to the slowest peer's answer; the price of pushing is a
//! few hundred bytes per edge per peer, and one update per change.
//!
//! **Stale-route window.** An update goes out at most [`COALESCE`] after the
//! change (bursts, such as a thousand edges reconnecting, coalesce into one
//! batch), so a peer learns an edge's move after that plus one peer-link
//! delivery. Until then it may relay to the replica the edge left; that
//! replica answers `NotHere` ([`crate::relay`]), the entry counts a stale
//! route and decides again when its table changes (bounded by
//! `--route-wait`). The window is measured by the replicas test.
//!
//! The publisher sends only the nodes changed since it last sent (the
//! registry keeps a bounded log of which nodes changed, one entry per node),
//! each as it is now, so a slow peer never receives a backlog, only the
//! latest state, and a burst costs work in the changed nodes, not in all. A subscription
//! that ends (the link closes, a bad message, a message over
//! `--peer-max-message-bytes`, one whose body stalls past `--peer-timeout`)
//! drops everything learnt from that peer; the
//! subscriber subscribes again while the link lives.
//!
//! **One edge's record never stops the others.** A record too large for one
//! message of `--peer-max-message-bytes` (a huge pod report) is sent without
//! its pods ([`encode`]); the registry warns once per such report, naming the
//! node and the flag. At start-up a `--peer-max-message-bytes` too small for a
//! record without pods is refused ([`largest_record_message`]); one too small
//! for a record with a full report is only warned about, and only without an
//! apiserver: with one, peers route pods by the apiserver, never by the pods
//! in these records.
//!
//! This module owns the wire format, the diff and both loops; the table of
//! remote edges itself is in [`crate::registry`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt};
use tracing::{debug, info, warn};

use crate::metrics::CloudMetrics;
use crate::peer::PeerLink;
use crate::registry::Registry;

/// First bytes of a route subscription stream.
pub const SUBSCRIBE_MAGIC: &[u8; 4] = b"TPS2";
/// How long the publisher gathers changes before sending them.
pub const COALESCE: Duration = Duration::from_millis(20);
/// How long a subscriber waits before subscribing again after a failure.
const RESUBSCRIBE: Duration = Duration::from_secs(1);

/// One edge a replica holds, as its peers see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EdgeRecord {
    pub node: String,
    /// The session's id (for `/status`).
    pub session: String,
    /// Whether the edge has a live connection to the holder (else it is
    /// within its grace period there).
    pub attached: bool,
    /// When the holder attached its current (or last) connection, Unix ms.
    pub since_ms: u64,
    /// The session's id.
    pub sid: u64,
    /// The generation of the holder's connection: the newest wins everywhere.
    pub gen: u64,
    /// The wire bounds the holder agreed with the edge (what a replica
    /// owning streams of it sends them with).
    pub limits: tether_proto::Limits,
    /// Pods the edge reported (namespace, name), as the holder accepted them.
    pub pods: Vec<(String, String)>,
    /// Addresses the edge announced, as the holder indexed them.
    pub addresses: Vec<String>,
}

/// One message of a subscription.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Update {
    /// These edges are held by the publisher now (new or changed).
    Upsert(Vec<EdgeRecord>),
    /// These nodes are no longer held by the publisher.
    Remove(Vec<String>),
}

/// Why a subscription ended.
#[derive(Debug, thiserror::Error)]
pub enum RoutesError {
    #[error("a message of {len} bytes (at most {max}, --peer-max-message-bytes)")]
    TooLarge { len: usize, max: usize },
    #[error("a bad message: {0}")]
    Decode(#[from] postcard::Error),
    #[error("peer link: {0}")]
    Io(#[from] std::io::Error),
    #[error("peer link: {0}")]
    Connection(#[from] quinn::ConnectionError),
    #[error("the peer did not read an update within {0:?} (--peer-timeout)")]
    Timeout(Duration),
    #[error(
        "no stream on the peer link within {0:?} (--peer-timeout): every stream the peer \
         allows is open (its --peer-max-streams)"
    )]
    NoStream(Duration),
    #[error("the peer sent a message's length, then not its body within {0:?} (--peer-timeout)")]
    Stalled(Duration),
}

/// The changes from `sent` to `now`: records to upsert, nodes to remove.
pub fn diff(
    sent: &HashMap<String, EdgeRecord>,
    now: &HashMap<String, EdgeRecord>,
) -> (Vec<EdgeRecord>, Vec<String>) {
    let mut up: Vec<EdgeRecord> = now
        .values()
        .filter(|r| sent.get(&r.node) != Some(*r))
        .cloned()
        .collect();
    up.sort_by(|a, b| a.node.cmp(&b.node));
    let mut gone: Vec<String> = sent
        .keys()
        .filter(|n| !now.contains_key(*n))
        .cloned()
        .collect();
    gone.sort();
    (up, gone)
}

/// Longest namespace a pod report may name (Kubernetes: a DNS-1123 label).
pub const MAX_NAMESPACE_LEN: usize = 63;
/// Longest pod name a pod report may name (Kubernetes: a DNS-1123 subdomain).
pub const MAX_POD_NAME_LEN: usize = 253;
/// Longest node name (a DNS-1123 subdomain; edge certificates are checked).
const MAX_NODE_LEN: usize = 253;
/// Longest announced address the cloud accepts in a hello.
const MAX_ADDRESS_LEN: usize = 253;

/// Bytes of postcard's varint encoding of `n`.
fn varint_len(n: usize) -> usize {
    let bits = usize::BITS - n.leading_zeros();
    (bits.max(1) as usize).div_ceil(7)
}

/// Bytes the pods `(namespace, name)` take in an [`EdgeRecord`] (the
/// list's length included).
pub fn pods_len<'a>(pods: impl ExactSizeIterator<Item = (&'a str, &'a str)>) -> usize {
    let count = varint_len(pods.len());
    count
        + pods
            .map(|(ns, name)| varint_len(ns.len()) + ns.len() + varint_len(name.len()) + name.len())
            .sum::<usize>()
}

/// The most bytes the pods of one edge's record can take when its reports
/// are frames of at most `max_frame_bytes` holding at most `max_pods` pods
/// of bounded names: the record's pods are some of one report's (each of
/// which also carried a uid there), so never more than the frame; and never
/// more than `max_pods` of the longest names.
pub fn largest_pods_len(max_frame_bytes: usize, max_pods: usize) -> usize {
    let longest = varint_len(MAX_NAMESPACE_LEN)
        + MAX_NAMESPACE_LEN
        + varint_len(MAX_POD_NAME_LEN)
        + MAX_POD_NAME_LEN;
    varint_len(max_pods) + max_frame_bytes.min(max_pods.saturating_mul(longest))
}

/// The largest message one edge's record can need on its own (an
/// [`Update::Upsert`] of it alone): a node name of 253 bytes, `addresses`
/// addresses of 253 bytes (`--max-announced-addresses`), every number at its
/// widest, and `pods_len` bytes of pods ([`pods_len`]; 1 for none).
pub fn largest_record_message(addresses: usize, pods_len: usize) -> usize {
    let widest = EdgeRecord {
        node: "n".repeat(MAX_NODE_LEN),
        session: tether_proto::token::SessionId(u64::MAX).to_string(),
        attached: true,
        since_ms: u64::MAX,
        sid: u64::MAX,
        gen: u64::MAX,
        limits: tether_proto::Limits {
            max_frame_bytes: u32::MAX,
            max_data_payload: u32::MAX,
            max_head_bytes: u32::MAX,
            replay_buffer_bytes: u32::MAX,
            recv_buffer_bytes: u32::MAX,
            max_streams_per_edge: u32::MAX,
        },
        pods: Vec::new(),
        addresses: vec!["a".repeat(MAX_ADDRESS_LEN); addresses],
    };
    // Serialising a record in memory cannot fail; an empty list takes 1 byte.
    let without_pods = postcard::to_allocvec(&Update::Upsert(vec![widest]))
        .map(|v| v.len())
        .unwrap_or(usize::MAX);
    without_pods.saturating_sub(1).saturating_add(pods_len)
}

/// Whether a record of `record_len` bytes fits alone in one message of
/// at most `max` bytes (the upsert's variant and list length take 2).
pub fn record_fits(record_len: usize, max: usize) -> bool {
    record_len.saturating_add(2) <= max
}

/// Messages for one round of a subscription ([`encode`]), and what had to
/// be left out of them.
#[derive(Debug, Default)]
pub struct Encoded {
    /// Length-prefixed messages, each of at most `max` bytes.
    pub messages: Vec<Vec<u8>>,
    /// Nodes sent without their pods: with them, the record alone exceeds
    /// the message bound.
    pub without_pods: Vec<String>,
    /// Nodes not sent: even without pods the record exceeds the bound (the
    /// start-up check on `--peer-max-message-bytes` rules this out).
    pub left_out: Vec<String>,
}

/// `items` (each with its encoded size) in batches cut at half of `max`,
/// leaving room for the envelope: sizes are per item, and an item over half
/// the limit goes alone.
fn batches<T>(items: impl IntoIterator<Item = (T, usize)>, max: usize) -> Vec<Vec<T>> {
    let mut out = Vec::new();
    let mut batch = Vec::new();
    let mut size = 0usize;
    for (item, s) in items {
        if !batch.is_empty() && size + s > max / 2 {
            out.push(std::mem::take(&mut batch));
            size = 0;
        }
        size += s;
        batch.push(item);
    }
    if !batch.is_empty() {
        out.push(batch);
    }
    out
}

/// Encodes `up` and `gone` as length-prefixed messages of at most `max`
/// bytes each. A record too large for one message is sent without its pods
/// (and left out if even that is too large): one edge never stops the
/// others from being published.
pub fn encode(up: Vec<EdgeRecord>, gone: Vec<String>, max: usize) -> Result<Encoded, RoutesError> {
    let mut out = Encoded::default();
    let framed = |u: &Update| -> Result<Vec<u8>, RoutesError> {
        let body = postcard::to_allocvec(u)?;
        if body.len() > max {
            return Err(RoutesError::TooLarge {
                len: body.len(),
                max,
            });
        }
        let mut v = Vec::with_capacity(4 + body.len());
        v.extend_from_slice(&(body.len() as u32).to_be_bytes());
        v.extend_from_slice(&body);
        Ok(v)
    };
    // Records that fit: a record too large alone goes without its pods, or
    // not at all (`record_fits`).
    let mut records = Vec::new();
    for mut r in up {
        let mut s = postcard::to_allocvec(&r)?.len();
        if !record_fits(s, max) && !r.pods.is_empty() {
            r.pods = Vec::new();
            s = postcard::to_allocvec(&r)?.len();
            out.without_pods.push(r.node.clone());
        }
        if !record_fits(s, max) {
            out.left_out.push(r.node);
            continue;
        }
        records.push((r, s));
    }
    for batch in batches(records, max) {
        out.messages.push(framed(&Update::Upsert(batch))?);
    }
    // Removals, cut the same way (a node name is at most 255 bytes here).
    let names = gone.into_iter().map(|n| {
        let s = varint_len(n.len()) + n.len();
        (n, s)
    });
    for batch in batches(names, max) {
        out.messages.push(framed(&Update::Remove(batch))?);
    }
    Ok(out)
}

/// Reads one length-prefixed update of at most `max` bytes; `None` at a clean
/// end. The length may be long in coming (nothing changed); the body must
/// follow it within `timeout` (`--peer-timeout`).
pub async fn read_update<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
    timeout: Duration,
) -> Result<Option<Update>, RoutesError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(RoutesError::TooLarge { len, max });
    }
    let mut body = vec![0u8; len];
    tokio::time::timeout(timeout, r.read_exact(&mut body))
        .await
        .map_err(|_| RoutesError::Stalled(timeout))??;
    Ok(Some(postcard::from_bytes(&body)?))
}

/// Publisher: serves one subscription (its magic already read) with this
/// replica's local edges until the subscriber goes away: the whole table,
/// then only the nodes that changed (from the registry's change log; a full
/// comparison if the log no longer reaches back to what was sent).
pub async fn publish(
    mut send: quinn::SendStream,
    registry: Arc<Registry>,
    max: usize,
    timeout: Duration,
    peer: String,
) -> Result<(), RoutesError> {
    let mut changes = registry.local_changes();
    let mut sent: HashMap<String, EdgeRecord> = HashMap::new();
    let mut seen: Option<u64> = None;
    debug!(%peer, "peer subscribed to this replica's routes");
    loop {
        changes.borrow_and_update();
        let delta = seen.map(|after| registry.changed_since(after));
        let (seq, up, gone) = match delta {
            Some((seq, Some(list))) => {
                let mut up = Vec::new();
                let mut gone = Vec::new();
                for (node, record) in list {
                    match record {
                        Some(r) if sent.get(&node) != Some(&r) => {
                            sent.insert(node, r.clone());
                            up.push(r);
                        }
                        Some(_) => {}
                        None => {
                            if sent.remove(&node).is_some() {
                                gone.push(node);
                            }
                        }
                    }
                }
                (seq, up, gone)
            }
            _ => {
                let (seq, now) = registry.local_records();
                let (up, gone) = diff(&sent, &now);
                sent = now;
                (seq, up, gone)
            }
        };
        seen = Some(seq);
        let encoded = encode(up, gone, max)?;
        if !encoded.without_pods.is_empty() {
            // The registry warned when the report came (once, not per peer).
            debug!(%peer, nodes = ?encoded.without_pods, "published without their pods: too large for --peer-max-message-bytes");
        }
        for node in &encoded.left_out {
            warn!(%peer, node = %node.escape_debug(), max_message_bytes = max, "an edge's route record does not fit in --peer-max-message-bytes even without its pods; this peer is not told of it");
        }
        for msg in encoded.messages {
            tokio::time::timeout(timeout, send.write_all(&msg))
                .await
                .map_err(|_| RoutesError::Timeout(timeout))?
                .map_err(std::io::Error::from)?;
        }
        tokio::select! {
            r = changes.changed() => if r.is_err() { return Ok(()) },
            _ = send.stopped() => return Ok(()),
        }
        tokio::time::sleep(COALESCE).await;
    }
}

/// Opens a subscription on `conn`, within `timeout` (`--peer-timeout`).
async fn open_subscription(
    conn: &quinn::Connection,
    timeout: Duration,
) -> Result<(quinn::SendStream, quinn::RecvStream), RoutesError> {
    let (mut send, recv) = tokio::time::timeout(timeout, conn.open_bi())
        .await
        .map_err(|_| RoutesError::NoStream(timeout))??;
    tokio::time::timeout(timeout, send.write_all(SUBSCRIBE_MAGIC))
        .await
        .map_err(|_| RoutesError::Timeout(timeout))?
        .map_err(std::io::Error::from)?;
    Ok((send, recv))
}

/// Subscriber: keeps this replica's table of `link`'s edges current while
/// the link lives; drops them when it closes. Every wait on the peer but the
/// one for its next change is bounded by `timeout` (`--peer-timeout`): a
/// subscription that stalls fails, drops the peer's edges and starts again.
pub async fn subscribe(
    link: PeerLink,
    registry: Arc<Registry>,
    metrics: CloudMetrics,
    max: usize,
    timeout: Duration,
) {
    let peer = link.replica.name.clone();
    while link.conn.close_reason().is_none() {
        let result = async {
            let (_send, mut recv) = open_subscription(&link.conn, timeout).await?;
            while let Some(update) = read_update(&mut recv, max, timeout).await? {
                registry.apply_remote(&link, update);
                metrics.remote_edges.set(registry.remote_len() as i64);
            }
            Ok::<(), RoutesError>(())
        }
        .await;
        registry.drop_remote(link.replica.instance);
        metrics.remote_edges.set(registry.remote_len() as i64);
        match result {
            Ok(()) => debug!(%peer, "route subscription ended"),
            Err(e) if link.conn.close_reason().is_some() => {
                debug!(%peer, error = %e, "route subscription ended with the link")
            }
            Err(e) => warn!(%peer, error = %e, "route subscription failed; subscribing again"),
        }
        tokio::time::sleep(RESUBSCRIBE).await;
    }
    info!(%peer, "peer link closed; its edges are no longer routed here");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(node: &str, pods: usize) -> EdgeRecord {
        EdgeRecord {
            node: node.into(),
            session: "s".into(),
            attached: true,
            since_ms: 1,
            sid: 1,
            gen: 1,
            limits: tether_proto::Limits::default(),
            pods: (0..pods)
                .map(|i| ("default".to_string(), format!("pod-{i}")))
                .collect(),
            addresses: vec!["10.0.0.1".into()],
        }
    }

    #[test]
    fn diff_sends_only_changes_and_removals() {
        let a: HashMap<_, _> = [
            ("a".to_string(), rec("a", 1)),
            ("b".to_string(), rec("b", 1)),
        ]
        .into_iter()
        .collect();
        let mut b = a.clone();
        b.remove("a");
        b.get_mut("b").unwrap().attached = false;
        b.insert("c".into(), rec("c", 0));
        let (up, gone) = diff(&a, &b);
        assert_eq!(
            up.iter().map(|r| r.node.as_str()).collect::<Vec<_>>(),
            ["b", "c"]
        );
        assert_eq!(gone, ["a"]);
        assert_eq!(diff(&b, &b), (vec![], vec![]));
    }

    /// A peer that sends a message's length and then stalls does not freeze
    /// the subscription: it fails after `--peer-timeout` and what was learnt
    /// from the peer is dropped (not kept, stale, for as long as the link
    /// lives); a peer that grants no stream for a subscription is told apart.
    #[tokio::test]
    async fn a_stalled_subscription_fails_within_the_peer_timeout() {
        let bound = Duration::from_millis(300);
        let (conn, publisher, _endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        let link = PeerLink::for_test("r1", conn);
        let registry = Arc::new(Registry::new(Duration::from_secs(60)));
        let metrics = CloudMetrics::register(&mut prometheus_client::registry::Registry::default());
        let subscribing =
            tokio::spawn(subscribe(link, registry.clone(), metrics, 16 * 1024, bound));
        let (mut send, mut recv) = publisher.accept_bi().await.unwrap();
        let mut magic = [0u8; 4];
        recv.read_exact(&mut magic).await.unwrap();
        assert_eq!(&magic, SUBSCRIBE_MAGIC);
        for m in encode(vec![rec("edge-1", 1)], vec![], 16 * 1024)
            .unwrap()
            .messages
        {
            send.write_all(&m).await.unwrap();
        }
        let wait = |want: usize| {
            let registry = registry.clone();
            async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                while registry.remote_len() != want {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "{} remote edges after 10 s, not {want}",
                        registry.remote_len()
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        wait(1).await;
        // A length, then two bytes of a ten-byte body, then nothing.
        send.write_all(&[0, 0, 0, 10, 1, 2]).await.unwrap();
        wait(0).await;
        subscribing.abort();

        let mut t = quinn::TransportConfig::default();
        t.max_concurrent_bidi_streams(0u32.into());
        let (conn, _peer, _endpoints) = tether_proto::testing::quic_pair_with(Arc::new(t))
            .await
            .unwrap();
        let opened = tokio::time::timeout(Duration::from_secs(10), open_subscription(&conn, bound))
            .await
            .expect("the open is bounded");
        assert!(
            matches!(opened, Err(RoutesError::NoStream(_))),
            "{:?}",
            opened.map(|_| ())
        );
    }

    #[tokio::test]
    async fn updates_are_batched_under_the_limit_and_read_back() {
        let up: Vec<_> = (0..300).map(|i| rec(&format!("edge-{i}"), 20)).collect();
        let msgs = encode(up.clone(), vec!["gone".into()], 16 * 1024)
            .unwrap()
            .messages;
        assert!(msgs.len() > 2, "{} messages", msgs.len());
        let mut all: Vec<u8> = msgs.concat();
        let mut got = Vec::new();
        let mut removed = Vec::new();
        let mut r = &all[..];
        while let Some(u) = read_update(&mut r, 16 * 1024, Duration::from_secs(5))
            .await
            .unwrap()
        {
            match u {
                Update::Upsert(v) => got.extend(v),
                Update::Remove(v) => removed.extend(v),
            }
        }
        assert_eq!(got, up);
        assert_eq!(removed, ["gone"]);
        // Over the reader's limit: refused, not allocated.
        all.truncate(4);
        all[..4].copy_from_slice(&(1u32 << 30).to_be_bytes());
        assert!(matches!(
            read_update(&mut &all[..], 16 * 1024, Duration::from_secs(5)).await,
            Err(RoutesError::TooLarge { .. })
        ));
        // A record larger than the limit is sent without its pods.
        let e = encode(vec![rec("huge", 5000), rec("small", 1)], vec![], 1024).unwrap();
        assert_eq!(
            (e.without_pods, e.left_out),
            (vec!["huge".to_string()], vec![])
        );
        let mut got = Vec::new();
        let all = e.messages.concat();
        let mut r = &all[..];
        while let Some(Update::Upsert(v)) = read_update(&mut r, 1024, Duration::from_secs(5))
            .await
            .unwrap()
        {
            got.extend(v);
        }
        assert_eq!(got, [rec("huge", 0), rec("small", 1)]);
        // Many removals of long names are cut to the limit too.
        let gone: Vec<String> = (0..100).map(|i| format!("{i:0>250}")).collect();
        let e = encode(vec![], gone.clone(), 4096).unwrap();
        assert!(e.messages.iter().all(|m| m.len() <= 4 + 4096));
        let all = e.messages.concat();
        let mut r = &all[..];
        let mut removed = Vec::new();
        while let Some(Update::Remove(v)) = read_update(&mut r, 4096, Duration::from_secs(5))
            .await
            .unwrap()
        {
            removed.extend(v);
        }
        assert_eq!(removed, gone);
        // Garbage is a decode error.
        let garbage = [0u8, 0, 0, 2, 0xff, 0xff];
        assert!(matches!(
            read_update(&mut &garbage[..], 1024, Duration::from_secs(5)).await,
            Err(RoutesError::Decode(_))
        ));
    }

    /// The bound the start-up check uses is the message a widest record
    /// needs: a record of a 253-byte node with 64 addresses of 253 bytes and
    /// pods of the longest names takes exactly that, and fits alone.
    #[test]
    fn the_largest_record_message_is_what_the_widest_record_takes() {
        let mut widest = rec(&"n".repeat(253), 0);
        widest.addresses = vec!["a".repeat(253); 64];
        widest.pods = vec![("n".repeat(MAX_NAMESPACE_LEN), "p".repeat(MAX_POD_NAME_LEN)); 3];
        (widest.since_ms, widest.sid, widest.gen) = (u64::MAX, u64::MAX, u64::MAX);
        widest.session = "f".repeat(16);
        widest.limits = tether_proto::Limits {
            max_frame_bytes: u32::MAX,
            max_data_payload: u32::MAX,
            max_head_bytes: u32::MAX,
            replay_buffer_bytes: u32::MAX,
            recv_buffer_bytes: u32::MAX,
            max_streams_per_edge: u32::MAX,
        };
        let pods = pods_len(widest.pods.iter().map(|(n, p)| (n.as_str(), p.as_str())));
        assert_eq!(pods, largest_pods_len(usize::MAX, 3));
        let need = largest_record_message(64, pods);
        let len = postcard::to_allocvec(&Update::Upsert(vec![widest.clone()]))
            .unwrap()
            .len();
        assert_eq!(len, need);
        let e = encode(vec![widest], vec![], need).unwrap();
        assert!(e.without_pods.is_empty() && e.messages.len() == 1);
        // The frame bounds the pods of a report of short names.
        assert_eq!(largest_pods_len(1 << 20, 100_000), 3 + (1 << 20));
        assert_eq!(varint_len(127), 1);
        assert_eq!(varint_len(128), 2);
        assert_eq!(varint_len(0), 1);
    }

    /// One edge whose record (a large pod report, 64 long addresses) is over
    /// `--peer-max-message-bytes` no longer ends every subscription to this
    /// replica before anything is sent: the publisher sends it without its
    /// pods, and every other edge as it is.
    #[tokio::test]
    async fn an_edge_too_large_for_a_message_does_not_stop_the_others_being_published() {
        use tether_proto::handshake::PodRef;
        let max = 64 * 1024;
        let registry = Arc::new(Registry::new(Duration::from_secs(60)));
        let long = |i: usize| format!("{i:0>253}");
        let addresses: Vec<String> = (0..64).map(long).collect();
        let claim = crate::admission::Claim {
            token: tether_proto::token::ResumeToken([1; 16]),
            instance: 1,
            attempt: 1,
        };
        let session = |node: &str, addresses: Vec<String>| {
            crate::session::Session::new(
                node.into(),
                addresses,
                tether_proto::Limits::default(),
                &claim,
            )
            .unwrap()
        };
        let pod = |name: String| PodRef {
            namespace: "default".into(),
            name,
            uid: String::new(),
        };
        let evil = session("evil", addresses);
        let good = session("good", vec!["10.0.0.2".into()]);
        registry.insert(evil.clone());
        registry.insert(good.clone());
        registry.report_pods(&evil, (0..300).map(|i| pod(long(i))).collect());
        registry.report_pods(&good, vec![pod("p".into())]);

        let (conn, far, _endpoints) = tether_proto::testing::quic_pair().await.unwrap();
        let (mut subscribe, mut recv) = conn.open_bi().await.unwrap();
        subscribe.write_all(SUBSCRIBE_MAGIC).await.unwrap();
        let (send, mut theirs) = far.accept_bi().await.unwrap();
        let mut magic = [0u8; 4];
        theirs.read_exact(&mut magic).await.unwrap();
        let publishing = tokio::spawn(publish(
            send,
            registry.clone(),
            max,
            Duration::from_secs(5),
            "peer".into(),
        ));
        let mut got: HashMap<String, EdgeRecord> = HashMap::new();
        while got.len() < 2 {
            let update = tokio::time::timeout(
                Duration::from_secs(10),
                read_update(&mut recv, max, Duration::from_secs(5)),
            )
            .await
            .expect("an update within 10 s")
            .unwrap_or_else(|e| panic!("the subscription failed: {e}"))
            .unwrap_or_else(|| {
                panic!(
                    "the publisher ended the subscription having sent {:?}: {:?}",
                    got.keys(),
                    publishing.is_finished()
                )
            });
            if let Update::Upsert(v) = update {
                got.extend(v.into_iter().map(|r| (r.node.clone(), r)));
            }
        }
        assert_eq!(got["good"].pods, [("default".to_string(), "p".to_string())]);
        assert!(got["evil"].pods.is_empty());
        assert_eq!(got["evil"].addresses.len(), 64);
        publishing.abort();
    }
}
