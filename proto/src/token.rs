//! Resume tokens and session ids: random values from the OS CSPRNG.
//!
//! A [`ResumeToken`] is 128 random bits that name one state of an edge (its
//! open streams). The edge draws it when it starts and again whenever it
//! discards its streams, and presents it in every hello; the cloud binds it
//! to the node of the certificate the first hello came with. It adds
//! freshness, not identity: it is only ever accepted on a connection
//! authenticated as that node (README, "Sessions and resume"). Its `Debug`
//! form never prints it.

use rand::TryRngCore;
use serde::{Deserialize, Serialize};

/// A session's resume secret (128 bits).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ResumeToken(pub [u8; 16]);

impl ResumeToken {
    /// A fresh token from the operating system's CSPRNG.
    pub fn generate() -> Result<Self, rand::rand_core::OsError> {
        let mut b = [0u8; 16];
        rand::rngs::OsRng.try_fill_bytes(&mut b)?;
        Ok(ResumeToken(b))
    }
}

impl std::fmt::Debug for ResumeToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ResumeToken(<redacted>)")
    }
}

/// A session's public id (for logs and metrics; not a secret).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SessionId(pub u64);

impl SessionId {
    pub fn generate() -> Result<Self, rand::rand_core::OsError> {
        Ok(SessionId(rand::rngs::OsRng.try_next_u64()?))
    }
}

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_differ_and_debug_is_redacted() {
        let a = ResumeToken::generate().unwrap();
        let b = ResumeToken::generate().unwrap();
        assert_ne!(a, b);
        assert_eq!(format!("{a:?}"), "ResumeToken(<redacted>)");
    }
}
