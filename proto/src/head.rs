//! The HTTP heads at the start of a logical stream.
//!
//! A logical stream is a bidirectional byte pipe. The cloud's direction starts
//! with a length-prefixed [`RequestHead`] followed by the request body (or,
//! after a `101`, the upgraded bytes); the edge's direction starts with a
//! [`ResponseHead`] followed by the response body (or the upgraded bytes).
//! Because the heads live *inside* the resumable byte pipe, a resume re-sends
//! them like any other unacknowledged bytes: nothing special is needed.

use serde::{de::DeserializeOwned, Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt};

/// One header: lowercase name, raw value.
pub type Header = (String, Vec<u8>);

/// The request the cloud asks the edge to replay against its kubelet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestHead {
    /// HTTP method, e.g. `POST`.
    pub method: String,
    /// Path and query as the apiserver sent them, e.g. `/exec/ns/pod/c?command=sh`.
    pub path_and_query: String,
    /// End-to-end headers, plus `connection`/`upgrade` for upgrade requests.
    pub headers: Vec<Header>,
    /// Whether a request body follows the head (else the cloud's direction
    /// ends right after it, or carries upgraded bytes after a `101`).
    pub has_body: bool,
}

/// The kubelet's answer, passed back unchanged (hop-by-hop headers aside).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResponseHead {
    pub status: u16,
    pub headers: Vec<Header>,
}

/// Headers that belong to one hop and are never forwarded as they are.
/// `connection` and `upgrade` are re-added explicitly for upgrades.
pub fn is_hop_by_hop(name: &str) -> bool {
    matches!(
        name.to_ascii_lowercase().as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
    )
}

impl RequestHead {
    /// The first value of a header, by lowercase name.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    /// Whether this request asks for a protocol upgrade.
    pub fn is_upgrade(&self) -> bool {
        self.header("upgrade").is_some()
    }

    /// The path without the query.
    pub fn path(&self) -> &str {
        self.path_and_query.split('?').next().unwrap_or("")
    }
}

/// Errors reading or writing a head.
#[derive(Debug, thiserror::Error)]
pub enum HeadError {
    #[error("head of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("malformed head: {0}")]
    Malformed(#[from] postcard::Error),
    #[error("stream ended before the head: {0}")]
    Io(#[from] std::io::Error),
}

/// Bytes of the length prefix before an encoded head's body: a head's size
/// against a bound is its encoded length less this.
pub const HEAD_LENGTH_PREFIX: usize = 4;

/// Encodes a head as `u32 big-endian length ‖ postcard`.
pub fn encode_head<T: Serialize>(head: &T, max: usize) -> Result<Vec<u8>, HeadError> {
    let body = postcard::to_allocvec(head)?;
    if body.len() > max {
        return Err(HeadError::TooLarge {
            len: body.len(),
            max,
        });
    }
    let mut out = Vec::with_capacity(HEAD_LENGTH_PREFIX + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Reads one length-prefixed head, refusing anything over `max` bytes before
/// allocating for it.
pub async fn read_head<T: DeserializeOwned, R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
) -> Result<T, HeadError> {
    let mut prefix = [0u8; HEAD_LENGTH_PREFIX];
    r.read_exact(&mut prefix).await?;
    let len = u32::from_be_bytes(prefix) as usize;
    if len > max {
        return Err(HeadError::TooLarge { len, max });
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    let (head, rest) = postcard::take_from_bytes::<T>(&body)?;
    if !rest.is_empty() {
        return Err(HeadError::Malformed(
            postcard::Error::DeserializeBadEncoding,
        ));
    }
    Ok(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn head_round_trip_and_limit() {
        let h = RequestHead {
            method: "POST".into(),
            path_and_query: "/exec/ns/p/c?command=sh".into(),
            headers: vec![("upgrade".into(), b"SPDY/3.1".to_vec())],
            has_body: false,
        };
        let b = encode_head(&h, 1024).unwrap();
        let got: RequestHead = read_head(&mut &b[..], 1024).await.unwrap();
        assert_eq!(got, h);
        assert!(got.is_upgrade());
        assert_eq!(got.path(), "/exec/ns/p/c");
        assert!(matches!(
            read_head::<RequestHead, _>(&mut &b[..], 8).await,
            Err(HeadError::TooLarge { .. })
        ));
        assert!(matches!(
            encode_head(&h, 8),
            Err(HeadError::TooLarge { .. })
        ));
        assert!(read_head::<RequestHead, _>(&mut &b[..b.len() - 1], 1024)
            .await
            .is_err());
    }

    #[test]
    fn hop_by_hop() {
        assert!(is_hop_by_hop("Transfer-Encoding"));
        assert!(!is_hop_by_hop("x-stream-protocol-version"));
    }
}
