//! Join tokens and the file that stores them.
//!
//! A join token lets one new edge (or a few, up to its usage limit) obtain a
//! certificate without an operator signing it by hand, the way `kubeadm join`
//! works. Its text form is `<id>.<secret>`: a 6-character id (`[a-z0-9]`),
//! public, used to find the token and in logs; and a 16-character secret
//! (`[a-z0-9]`, about 82 bits) that proves possession.
//!
//! [`JoinStore`] keeps tokens in a JSON file (mode 0600): for each, the id,
//! the SHA-256 of the secret — never the secret itself, so a leaked store
//! grants nothing — the expiry, the node-name pattern it may be used for
//! (`*` matches any run of characters), the uses left and whether it was
//! revoked; plus one record per certificate issued (token, node, serial,
//! time). Every change re-reads the file, applies the change and writes the
//! file atomically under a lock file, so the cloud and the `tether-certs`
//! CLI can share one store: a token revoked on the command line is refused
//! by the running cloud at its next join. A writer waits for another
//! process's lock at most its lock wait ([`JoinStore::with_lock_wait`]: the
//! cloud's `--join-store-lock-wait`, `tether-certs --store-lock-wait`, both
//! read from `TETHER_JOIN_STORE_LOCK_WAIT` and parsed alike ([`parse_lock_wait`];
//! [`DEFAULT_STORE_LOCK_WAIT`] unless told), then fails naming the store.
//!
//! Time is always passed in (`now`), so expiry is tested without clocks.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rand::Rng;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::identity::valid_node_name;
use crate::join::JoinError;

/// Length of a token id.
pub const TOKEN_ID_LEN: usize = 6;
/// Length of a token secret.
pub const TOKEN_SECRET_LEN: usize = 16;
/// How long a writer waits for another process holding the store's lock
/// unless told ([`JoinStore::with_lock_wait`]).
pub const DEFAULT_STORE_LOCK_WAIT: Duration = Duration::from_secs(5);

/// Parses a store lock wait (`tether-certs --store-lock-wait`, read from
/// `TETHER_JOIN_STORE_LOCK_WAIT` as `tether-cloud --join-store-lock-wait`
/// is): a duration as every Tether flag takes one
/// ([`tether_units::parse_duration`]: `200ms`, `5s`, `2m`, `1h`, a bare
/// number of seconds), more than 0 (a zero wait would fail a change
/// whenever another process holds the lock for an instant).
pub fn parse_lock_wait(s: &str) -> Result<Duration, String> {
    let wait = tether_units::parse_duration(s)?;
    if wait.is_zero() {
        return Err("the store lock wait must be more than 0".into());
    }
    Ok(wait)
}

/// How often a writer tries a held lock again.
const LOCK_POLL: Duration = Duration::from_millis(10);

const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";

/// A join token in clear, as the operator hands it to an edge.
#[derive(Clone, PartialEq, Eq)]
pub struct JoinToken {
    /// Public part: finds the token in the store.
    pub id: String,
    /// Secret part: only its hash is stored.
    secret: String,
}

impl std::fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JoinToken({}.<secret>)", self.id)
    }
}

fn is_token_char(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit()
}

impl JoinToken {
    /// A new random token.
    pub fn generate() -> JoinToken {
        let mut rng = rand::rng();
        let mut pick = |n: usize| -> String {
            (0..n)
                .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
                .collect()
        };
        JoinToken {
            id: pick(TOKEN_ID_LEN),
            secret: pick(TOKEN_SECRET_LEN),
        }
    }

    /// Parses `<id>.<secret>`.
    pub fn parse(s: &str) -> Result<JoinToken, JoinError> {
        let malformed = || {
            JoinError::MalformedToken(format!(
                "expected <{TOKEN_ID_LEN} chars [a-z0-9]>.<{TOKEN_SECRET_LEN} chars [a-z0-9]>"
            ))
        };
        let (id, secret) = s.trim().split_once('.').ok_or_else(malformed)?;
        if id.len() != TOKEN_ID_LEN
            || secret.len() != TOKEN_SECRET_LEN
            || !id.bytes().all(is_token_char)
            || !secret.bytes().all(is_token_char)
        {
            return Err(malformed());
        }
        Ok(JoinToken {
            id: id.to_string(),
            secret: secret.to_string(),
        })
    }

    /// The `<id>.<secret>` text. Only for showing the operator once.
    pub fn reveal(&self) -> String {
        format!("{}.{}", self.id, self.secret)
    }

    fn secret_sha256(&self) -> String {
        hex::encode(Sha256::digest(self.secret.as_bytes()))
    }
}

/// Whether `name` matches `pattern`, where `*` stands for any run of
/// characters (including none) and everything else matches itself.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n) = (pattern.as_bytes(), name.as_bytes());
    let (mut pi, mut ni) = (0, 0);
    // Position of the last `*` seen and the name position it resumes from.
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ni));
            pi += 1;
        } else if pi < p.len() && p[pi] == n[ni] {
            pi += 1;
            ni += 1;
        } else if let Some((sp, sn)) = star {
            pi = sp + 1;
            ni = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

/// Seconds since the Unix epoch (negative before it).
pub fn unix(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_secs() as i64,
        Err(e) => -(e.duration().as_secs() as i64),
    }
}

/// RFC 3339 text of a Unix time, for messages and listings.
pub fn format_unix(secs: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp(secs)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| format!("@{secs}"))
}

/// One token as stored.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct TokenRecord {
    pub id: String,
    /// Hex SHA-256 of the secret.
    pub secret_sha256: String,
    pub created_unix: i64,
    pub expires_unix: i64,
    /// Node names this token may join, `*` as wildcard.
    pub node_pattern: String,
    pub uses_left: u32,
    pub revoked: bool,
    /// Free text from the operator.
    #[serde(default)]
    pub description: String,
    /// May join a node name a certificate was already issued for (the
    /// operator re-bootstraps that node). Without it such a join is refused:
    /// a token cannot be used to displace an existing node.
    #[serde(default)]
    pub allow_reissue: bool,
}

impl TokenRecord {
    /// `valid`, `expired`, `revoked` or `exhausted`, as of `now`.
    pub fn status(&self, now: SystemTime) -> &'static str {
        if self.revoked {
            "revoked"
        } else if unix(now) >= self.expires_unix {
            "expired"
        } else if self.uses_left == 0 {
            "exhausted"
        } else {
            "valid"
        }
    }
}

/// One certificate issued through a token.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct IssueRecord {
    pub token_id: String,
    pub node: String,
    /// Hex serial number of the certificate.
    pub serial: String,
    pub issued_unix: i64,
    pub expires_unix: i64,
}

/// The token id of an [`IssueRecord`] made by [`JoinStore::record_issue`]:
/// not a possible token id (those are lowercase letters and digits only).
pub const ISSUED_BY_HAND: &str = "by-hand";

/// A revoked certificate, or every certificate of a node issued before a time.
/// The cloud refuses a matching edge certificate at the handshake.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Revocation {
    /// Hex serial of the one certificate revoked (without leading zeros).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// The node whose certificates issued before `issued_before_unix` are revoked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issued_before_unix: Option<i64>,
    pub revoked_unix: i64,
    pub reason: String,
}

impl Revocation {
    /// Whether a certificate with this serial (hex), node and notBefore is revoked.
    pub fn matches(&self, serial_hex: &str, node: &str, not_before_unix: i64) -> bool {
        if let Some(s) = &self.serial {
            return normalize_serial(s) == normalize_serial(serial_hex);
        }
        // Certificates are issued NOT_BEFORE_BACKDATE after their notBefore.
        let issued =
            not_before_unix.saturating_add(crate::mint::NOT_BEFORE_BACKDATE.as_secs() as i64);
        match (&self.node, self.issued_before_unix) {
            (Some(n), Some(before)) => n == node && issued < before,
            _ => false,
        }
    }
}

/// A hex serial in one form: lowercase, no separators, no leading zeros (DER
/// may add a zero byte that the issuer's hex did not have, or drop one).
pub fn normalize_serial(s: &str) -> String {
    let hex: String = s
        .chars()
        .filter(|c| c.is_ascii_hexdigit())
        .map(|c| c.to_ascii_lowercase())
        .collect();
    let t = hex.trim_start_matches('0');
    if t.is_empty() {
        "0".into()
    } else {
        t.to_string()
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct StoreFile {
    version: u32,
    tokens: Vec<TokenRecord>,
    issued: Vec<IssueRecord>,
    /// Revoked certificates (absent in stores written before revocation existed).
    #[serde(default)]
    revocations: Vec<Revocation>,
}

const STORE_VERSION: u32 = 1;

/// What a token allows: one certificate for `node`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub token_id: String,
    pub node: String,
    /// Uses left after this one.
    pub uses_left: u32,
}

/// A certificate signed for a grant.
#[derive(Debug, Clone)]
pub struct IssuedCert {
    pub cert_pem: String,
    /// Hex serial number.
    pub serial: String,
    pub expires_unix: i64,
}

/// The token store file. See the module docs.
pub struct JoinStore {
    path: PathBuf,
    /// How long a change waits for another process's lock.
    lock_wait: Duration,
    /// Serialises changes from tasks of this process; the lock file
    /// serialises them across processes.
    local: Mutex<()>,
}

/// An exclusive `flock(2)` on the store's lock file, released when the file
/// is closed — by this drop, or by the kernel when the process dies, so a
/// crashed holder leaves no stale lock and no process ever takes over a lock
/// another still holds. The file itself stays (removing it would let two
/// processes lock two different files of the same name).
struct LockFile(#[allow(dead_code)] std::fs::File);

impl JoinStore {
    /// A store at `path`. The file need not exist yet (no tokens); if it
    /// exists it must parse.
    pub fn open(path: impl Into<PathBuf>) -> Result<JoinStore, JoinError> {
        let store = JoinStore {
            path: path.into(),
            lock_wait: DEFAULT_STORE_LOCK_WAIT,
            local: Mutex::new(()),
        };
        store.load()?;
        Ok(store)
    }

    /// This store, whose changes wait at most `wait` for another process
    /// holding its lock (then fail, naming the store) instead of
    /// [`DEFAULT_STORE_LOCK_WAIT`].
    pub fn with_lock_wait(mut self, wait: Duration) -> JoinStore {
        self.lock_wait = wait;
        self
    }

    /// How long a change waits for another process's lock.
    pub fn lock_wait(&self) -> Duration {
        self.lock_wait
    }

    /// Where the store lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn store_err(&self, what: impl std::fmt::Display) -> JoinError {
        JoinError::Store(format!("{}: {what}", self.path.display()))
    }

    fn load(&self) -> Result<StoreFile, JoinError> {
        match std::fs::read(&self.path) {
            Ok(bytes) => {
                let f: StoreFile = serde_json::from_slice(&bytes)
                    .map_err(|e| self.store_err(format!("not a join-token store: {e}")))?;
                if f.version != STORE_VERSION {
                    return Err(self.store_err(format!(
                        "store version {} is not supported (expected {STORE_VERSION})",
                        f.version
                    )));
                }
                Ok(f)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(StoreFile {
                version: STORE_VERSION,
                ..StoreFile::default()
            }),
            Err(e) => Err(self.store_err(e)),
        }
    }

    fn save(&self, f: &StoreFile) -> Result<(), JoinError> {
        let json = serde_json::to_vec_pretty(f).map_err(|e| self.store_err(e))?;
        crate::files::write_atomic(&self.path, &json, crate::files::SECRET_MODE)
            .map_err(|e| JoinError::Store(e.to_string()))
    }

    fn lock_file(&self) -> Result<LockFile, JoinError> {
        use std::os::fd::AsRawFd;
        let mut name = self.path.as_os_str().to_owned();
        name.push(".lock");
        let lock = PathBuf::from(name);
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| self.store_err(e))?;
        }
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock)
            .map_err(|e| self.store_err(format!("lock {}: {e}", lock.display())))?;
        let start = std::time::Instant::now();
        loop {
            // SAFETY: flock on a file descriptor this function owns.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc == 0 {
                return Ok(LockFile(file));
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::WouldBlock {
                return Err(self.store_err(format!("lock {}: {e}", lock.display())));
            }
            let waited = start.elapsed();
            if waited >= self.lock_wait {
                return Err(self.store_err(format!(
                    "locked by another process for over {:?}, the store lock wait ({})",
                    self.lock_wait,
                    lock.display()
                )));
            }
            std::thread::sleep(LOCK_POLL.min(self.lock_wait - waited));
        }
    }

    /// Runs `change` on the current contents and writes the result, all
    /// under both locks. Nothing is written if `change` fails.
    fn update<T>(
        &self,
        change: impl FnOnce(&mut StoreFile) -> Result<T, JoinError>,
    ) -> Result<T, JoinError> {
        // A panic under this lock (a bug, e.g. in an `issue` callback) must
        // not make the store unusable: the file is the state, re-read below.
        let _local = self.local.lock().unwrap_or_else(|p| p.into_inner());
        let _file = self.lock_file()?;
        let mut f = self.load()?;
        let out = change(&mut f)?;
        self.save(&f)?;
        Ok(out)
    }

    /// Records a certificate for `node` made without a token (`tether-certs
    /// issue edge`), so that a token without `--allow-reissue` cannot replace
    /// that node any more than one it issued itself. Listed under the token
    /// id [`ISSUED_BY_HAND`].
    pub fn record_issue(
        &self,
        node: &str,
        serial: &str,
        now: SystemTime,
        expires_unix: i64,
    ) -> Result<(), JoinError> {
        self.update(|f| {
            f.issued.push(IssueRecord {
                token_id: ISSUED_BY_HAND.to_string(),
                node: node.to_string(),
                serial: normalize_serial(serial),
                issued_unix: unix(now),
                expires_unix,
            });
            Ok(())
        })
    }

    /// Creates a token valid for `ttl` from `now`, for nodes matching
    /// `node_pattern`, usable `uses` times. Returns it in clear: this is the
    /// only time the secret exists outside the edge.
    pub fn create(
        &self,
        ttl: Duration,
        node_pattern: &str,
        uses: u32,
        description: &str,
        now: SystemTime,
    ) -> Result<(JoinToken, TokenRecord), JoinError> {
        self.create_with(ttl, node_pattern, uses, description, false, now)
    }

    /// [`create`](JoinStore::create), and whether the token may join node
    /// names that already have a certificate (`allow_reissue`).
    pub fn create_with(
        &self,
        ttl: Duration,
        node_pattern: &str,
        uses: u32,
        description: &str,
        allow_reissue: bool,
        now: SystemTime,
    ) -> Result<(JoinToken, TokenRecord), JoinError> {
        if uses == 0 {
            return Err(JoinError::Invalid("a token needs at least one use".into()));
        }
        let expires_unix = i64::try_from(ttl.as_secs())
            .ok()
            .and_then(|ttl| unix(now).checked_add(ttl))
            .ok_or_else(|| {
                JoinError::Invalid(format!("a time to live of {ttl:?} is beyond any date"))
            })?;
        if node_pattern.is_empty()
            || !node_pattern
                .bytes()
                .all(|b| b == b'*' || b == b'.' || b == b'-' || is_token_char(b))
        {
            return Err(JoinError::Invalid(format!(
                "node pattern {node_pattern:?} may only hold [a-z0-9.-] and *"
            )));
        }
        self.update(|f| {
            // Ids are short: draw again on the rare collision.
            let token = loop {
                let t = JoinToken::generate();
                if f.tokens.iter().all(|r| r.id != t.id) {
                    break t;
                }
            };
            let record = TokenRecord {
                id: token.id.clone(),
                secret_sha256: token.secret_sha256(),
                created_unix: unix(now),
                expires_unix,
                node_pattern: node_pattern.to_string(),
                uses_left: uses,
                revoked: false,
                description: description.to_string(),
                allow_reissue,
            };
            f.tokens.push(record.clone());
            Ok((token, record))
        })
    }

    /// All tokens, oldest first.
    pub fn list(&self) -> Result<Vec<TokenRecord>, JoinError> {
        Ok(self.load()?.tokens)
    }

    /// Every certificate issued through tokens, oldest first.
    pub fn issued(&self) -> Result<Vec<IssueRecord>, JoinError> {
        Ok(self.load()?.issued)
    }

    /// Revokes the token with this id (the id alone, or a whole token).
    pub fn revoke(&self, id: &str) -> Result<TokenRecord, JoinError> {
        let id = id.split('.').next().unwrap_or(id).to_string();
        self.update(|f| {
            let r = f
                .tokens
                .iter_mut()
                .find(|r| r.id == id)
                .ok_or_else(|| JoinError::UnknownToken(id.clone()))?;
            r.revoked = true;
            Ok(r.clone())
        })
    }

    /// Revokes the certificate with this hex serial.
    pub fn revoke_serial(
        &self,
        serial: &str,
        reason: &str,
        now: SystemTime,
    ) -> Result<Revocation, JoinError> {
        let serial = normalize_serial(serial);
        if serial == "0" || serial.len() > 40 {
            return Err(JoinError::Store(format!(
                "{serial:?} is not a certificate serial (hex, at most 20 bytes)"
            )));
        }
        self.add_revocation(Revocation {
            serial: Some(serial),
            node: None,
            issued_before_unix: None,
            revoked_unix: unix(now),
            reason: reason.to_string(),
        })
    }

    /// Revokes every certificate of `node` issued before `now` (a stolen key:
    /// the edge must join again, with a token that allows re-issue).
    pub fn revoke_node(
        &self,
        node: &str,
        reason: &str,
        now: SystemTime,
    ) -> Result<Revocation, JoinError> {
        if !valid_node_name(node) {
            return Err(JoinError::Store(format!("{node:?} is not a node name")));
        }
        self.add_revocation(Revocation {
            serial: None,
            node: Some(node.to_string()),
            // Certificate times have whole seconds: one issued in this very
            // second counts as issued before (a re-join must come later).
            issued_before_unix: Some(unix(now) + 1),
            revoked_unix: unix(now),
            reason: reason.to_string(),
        })
    }

    fn add_revocation(&self, r: Revocation) -> Result<Revocation, JoinError> {
        self.update(|f| {
            f.revocations.push(r.clone());
            Ok(r)
        })
    }

    /// Every revocation, oldest first.
    pub fn revocations(&self) -> Result<Vec<Revocation>, JoinError> {
        Ok(self.load()?.revocations)
    }

    /// Whether `token` may join `node` at `now`, without using it.
    pub fn check(&self, token: &str, node: &str, now: SystemTime) -> Result<Grant, JoinError> {
        let token = JoinToken::parse(token)?;
        check_record(&self.load()?, &token, node, now).map(|r| Grant {
            token_id: r.id.clone(),
            node: node.to_string(),
            uses_left: r.uses_left.saturating_sub(1),
        })
    }

    /// Uses `token` once for `node`: checks it (unexpired, not revoked,
    /// uses left, node name valid and matching the pattern) and decrements
    /// its uses, durably, before returning.
    pub fn redeem(&self, token: &str, node: &str, now: SystemTime) -> Result<Grant, JoinError> {
        self.redeem_with(token, node, now, |_| Ok(None))
            .map(|(grant, _)| grant)
    }

    /// Uses `token` once for `node` and issues a certificate with `issue`,
    /// all under the store's lock: the use is consumed and the issue
    /// recorded in the same write, and only if `issue` succeeds — a bad
    /// CSR does not burn the token.
    pub fn redeem_and_issue(
        &self,
        token: &str,
        node: &str,
        now: SystemTime,
        issue: impl FnOnce(&Grant) -> Result<IssuedCert, JoinError>,
    ) -> Result<(Grant, IssuedCert), JoinError> {
        let (grant, cert) = self.redeem_with(token, node, now, |g| issue(g).map(Some))?;
        match cert {
            Some(c) => Ok((grant, c)),
            None => Err(JoinError::Invalid("no certificate issued".into())),
        }
    }

    fn redeem_with(
        &self,
        token: &str,
        node: &str,
        now: SystemTime,
        issue: impl FnOnce(&Grant) -> Result<Option<IssuedCert>, JoinError>,
    ) -> Result<(Grant, Option<IssuedCert>), JoinError> {
        let token = JoinToken::parse(token)?;
        self.update(|f| {
            let checked = check_record(f, &token, node, now)?;
            let id = checked.id.clone();
            if !checked.allow_reissue {
                if let Some(before) = f.issued.iter().find(|i| i.node == node) {
                    return Err(JoinError::NodeTaken {
                        id,
                        node: node.to_string(),
                        serial: before.serial.clone(),
                    });
                }
            }
            let record = f
                .tokens
                .iter_mut()
                .find(|r| r.id == id)
                .ok_or_else(|| JoinError::UnknownToken(id.clone()))?;
            let grant = Grant {
                token_id: id.clone(),
                node: node.to_string(),
                uses_left: record.uses_left.saturating_sub(1),
            };
            let cert = issue(&grant)?;
            record.uses_left = grant.uses_left;
            if let Some(c) = &cert {
                f.issued.push(IssueRecord {
                    token_id: id,
                    node: node.to_string(),
                    serial: c.serial.clone(),
                    issued_unix: unix(now),
                    expires_unix: c.expires_unix,
                });
            }
            Ok((grant, cert))
        })
    }
}

/// Equality of two hex digests without an early exit.
fn same_digest(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

fn check_record<'a>(
    f: &'a StoreFile,
    token: &JoinToken,
    node: &str,
    now: SystemTime,
) -> Result<&'a TokenRecord, JoinError> {
    let r = f
        .tokens
        .iter()
        .find(|r| r.id == token.id)
        .ok_or_else(|| JoinError::UnknownToken(token.id.clone()))?;
    if !same_digest(&r.secret_sha256, &token.secret_sha256()) {
        return Err(JoinError::WrongSecret(r.id.clone()));
    }
    if r.revoked {
        return Err(JoinError::Revoked(r.id.clone()));
    }
    if unix(now) >= r.expires_unix {
        return Err(JoinError::Expired {
            id: r.id.clone(),
            at: format_unix(r.expires_unix),
        });
    }
    if r.uses_left == 0 {
        return Err(JoinError::Exhausted(r.id.clone()));
    }
    if !valid_node_name(node) {
        return Err(JoinError::InvalidNodeName(node.to_string()));
    }
    if !glob_match(&r.node_pattern, node) {
        return Err(JoinError::NodeNotAllowed {
            id: r.id.clone(),
            node: node.to_string(),
            pattern: r.node_pattern.clone(),
        });
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Duration = Duration::from_secs(3600);

    fn store() -> (tempfile::TempDir, JoinStore) {
        let dir = tempfile::tempdir().unwrap();
        let s = JoinStore::open(dir.path().join("tokens.json")).unwrap();
        (dir, s)
    }

    #[test]
    fn token_text_form() {
        let t = JoinToken::generate();
        let text = t.reveal();
        assert_eq!(text.len(), 6 + 1 + 16);
        assert_eq!(JoinToken::parse(&text).unwrap(), t);
        assert!(!format!("{t:?}").contains(&t.secret));
        for bad in [
            "",
            "abcdef",
            "abcdef.",
            "abcde.0123456789abcdef",
            "abcdef.0123456789abcde",
            "ABCDEF.0123456789abcdef",
            "abcdef.0123456789abcdeF",
            "abc_ef.0123456789abcdef",
            "abcdef.0123456789abcdef.x",
        ] {
            assert!(
                matches!(JoinToken::parse(bad), Err(JoinError::MalformedToken(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_node_issued_by_hand_is_not_replaced_by_a_token_without_allow_reissue() {
        let (_d, s) = store();
        let now = SystemTime::now();
        s.record_issue("edge-7", "0A:BC", now, unix(now) + 3600)
            .unwrap();
        let (t, _) = s.create(HOUR, "edge-*", 2, "", now).unwrap();
        match issue_for(&s, &t.reveal(), "edge-7") {
            Err(JoinError::NodeTaken { node, serial, .. }) => {
                assert_eq!((node.as_str(), serial.as_str()), ("edge-7", "abc"));
            }
            other => panic!("a token displaced a node issued by hand: {other:?}"),
        }
        // Another node of the pattern joins, and a re-issue token may replace it.
        issue_for(&s, &t.reveal(), "edge-8").unwrap();
        let (r, _) = s.create_with(HOUR, "edge-7", 1, "", true, now).unwrap();
        issue_for(&s, &r.reveal(), "edge-7").unwrap();
        let by_hand: Vec<_> = s
            .issued()
            .unwrap()
            .into_iter()
            .filter(|i| i.token_id == ISSUED_BY_HAND)
            .collect();
        assert_eq!(by_hand.len(), 1, "{by_hand:?}");
        assert!(JoinToken::parse(&format!("{ISSUED_BY_HAND}.0123456789abcdef")).is_err());
    }

    #[test]
    fn a_time_to_live_beyond_any_date_is_refused_not_wrapped() {
        let (_d, s) = store();
        let now = SystemTime::now();
        for ttl in [Duration::MAX, Duration::from_secs(i64::MAX as u64)] {
            let e = s.create_with(ttl, "edge-*", 1, "", false, now).unwrap_err();
            assert!(e.to_string().contains("beyond any date"), "{e}");
        }
        assert!(s.list().unwrap().is_empty(), "nothing stored");
        let (_, r) = s
            .create_with(Duration::from_secs(3 << 40), "edge-*", 1, "", false, now)
            .unwrap();
        assert!(r.expires_unix > unix(now), "{r:?}");
    }

    #[test]
    fn globs() {
        assert!(glob_match("edge-*", "edge-1"));
        assert!(glob_match("edge-*", "edge-"));
        assert!(!glob_match("edge-*", "cloud-1"));
        assert!(glob_match("*", "anything"));
        assert!(glob_match("edge-1", "edge-1"));
        assert!(!glob_match("edge-1", "edge-10"));
        assert!(glob_match("*-site-*.example", "a-site-b.example"));
        assert!(!glob_match("*-site-*.example", "a-site-b.example.com"));
        assert!(glob_match("a*b*c", "aXXbYYbc"));
        assert!(!glob_match("a*b*c", "aXXbYYb"));
    }

    fn issue_for(s: &JoinStore, token: &str, node: &str) -> Result<Grant, JoinError> {
        s.redeem_and_issue(token, node, SystemTime::now(), |_| {
            Ok(IssuedCert {
                cert_pem: String::new(),
                serial: format!("serial-{node}"),
                expires_unix: unix(SystemTime::now()) + 3600,
            })
        })
        .map(|(g, _)| g)
    }

    #[test]
    fn a_panic_under_the_store_lock_does_not_poison_the_store() {
        let (_d, s) = store();
        let now = SystemTime::now();
        let (t, _) = s.create(HOUR, "edge-1", 1, "", now).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = s.redeem_and_issue(&t.reveal(), "edge-1", now, |_| panic!("bug"));
        }));
        assert!(r.is_err());
        // The token was not spent and the store still works.
        issue_for(&s, &t.reveal(), "edge-1").unwrap();
        s.create(HOUR, "edge-2", 1, "", now).unwrap();
    }

    #[test]
    fn an_old_lock_file_is_never_taken_from_a_live_holder() {
        use std::os::fd::AsRawFd;
        let (_d, s) = store();
        let mut name = s.path().as_os_str().to_owned();
        name.push(".lock");
        // Left over by a crashed process: not held, so no obstacle.
        let f = std::fs::File::create(&name).unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs(3600))
            .unwrap();
        s.create(HOUR, "edge-1", 1, "", SystemTime::now()).unwrap();
        // Held by another process (another open file description) for a
        // long time, its mtime old: still held, so the store waits and fails
        // instead of taking it over.
        let held = std::fs::OpenOptions::new().write(true).open(&name).unwrap();
        // SAFETY: flock on a descriptor this test owns.
        assert_eq!(
            unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
            0
        );
        held.set_modified(SystemTime::now() - Duration::from_secs(3600))
            .unwrap();
        let e = s
            .create(HOUR, "edge-2", 1, "", SystemTime::now())
            .unwrap_err();
        assert!(e.to_string().contains("locked by another process"), "{e}");
        drop(held);
        s.create(HOUR, "edge-2", 1, "", SystemTime::now()).unwrap();
    }

    /// A writer gives up on a lock another process holds after the store's
    /// lock wait (was the fixed 5 s), naming the store and the wait;
    /// reads do not lock; once the lock is free the change goes through.
    #[test]
    fn a_held_lock_fails_a_change_after_the_configured_wait_naming_the_store() {
        use std::os::fd::AsRawFd;
        const WAIT: Duration = Duration::from_millis(200);
        let (_d, s) = store();
        let s = s.with_lock_wait(WAIT);
        assert_eq!(s.lock_wait(), WAIT);
        let mut name = s.path().as_os_str().to_owned();
        name.push(".lock");
        let held = std::fs::File::create(&name).unwrap();
        // SAFETY: flock on a descriptor this test owns.
        assert_eq!(
            unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
            0
        );
        // The change runs on a thread of its own, so a wait that never ends
        // fails the test instead of hanging it.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let started = std::time::Instant::now();
            let r = s.create(HOUR, "edge-1", 1, "", SystemTime::now());
            let _ = tx.send((r.map(|_| ()), started.elapsed(), s));
        });
        let (r, took, s) = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the change still waits for the lock after 20 s");
        let e = r.expect_err("a change under a held lock");
        let text = e.to_string();
        assert!(text.contains(&s.path().display().to_string()), "{text}");
        assert!(
            text.contains("locked by another process for over 200ms"),
            "{text}"
        );
        assert!(took >= WAIT, "gave up after {took:?}");
        // The default wait was 5 s: this one ends well before.
        assert!(took < Duration::from_secs(3), "gave up after {took:?}");
        assert!(s.list().unwrap().is_empty(), "nothing written");
        drop(held);
        s.create(HOUR, "edge-1", 1, "", SystemTime::now()).unwrap();
    }

    #[test]
    fn a_token_cannot_join_a_node_that_already_has_a_certificate() {
        let (_d, s) = store();
        let now = SystemTime::now();
        let (first, _) = s.create(HOUR, "edge-1", 1, "", now).unwrap();
        issue_for(&s, &first.reveal(), "edge-1").unwrap();
        // A wildcard token (or a leaked one) may not displace edge-1.
        let (any, _) = s.create(HOUR, "*", 5, "", now).unwrap();
        let e = issue_for(&s, &any.reveal(), "edge-1").unwrap_err();
        assert!(matches!(e, JoinError::NodeTaken { .. }), "{e}");
        assert!(e.to_string().contains("--allow-reissue"), "{e}");
        // The refusal did not spend a use; other names still join.
        issue_for(&s, &any.reveal(), "edge-2").unwrap();
        // Re-bootstrapping edge-1 needs a token made for it.
        let (again, _) = s.create_with(HOUR, "edge-1", 1, "", true, now).unwrap();
        issue_for(&s, &again.reveal(), "edge-1").unwrap();
    }

    #[test]
    fn secret_is_stored_hashed_only() {
        let (_d, s) = store();
        let (t, _) = s.create(HOUR, "edge-*", 1, "", SystemTime::now()).unwrap();
        let text = std::fs::read_to_string(s.path()).unwrap();
        assert!(!text.contains(&t.secret));
        assert!(text.contains(&t.secret_sha256()));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(s.path()).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
        }
    }

    #[test]
    fn single_use_token_is_exhausted_after_one_join() {
        let (_d, s) = store();
        let now = SystemTime::now();
        let (t, _) = s.create(HOUR, "edge-*", 1, "", now).unwrap();
        let g = s.redeem(&t.reveal(), "edge-1", now).unwrap();
        assert_eq!(g.node, "edge-1");
        assert_eq!(g.uses_left, 0);
        // The same exchange again (a replay): refused.
        let e = s.redeem(&t.reveal(), "edge-1", now).unwrap_err();
        assert!(matches!(e, JoinError::Exhausted(_)), "{e}");
        assert!(e.to_string().contains("exhausted"));
        assert_eq!(s.list().unwrap()[0].status(now), "exhausted");
    }

    #[test]
    fn multi_use_token_counts_down() {
        let (_d, s) = store();
        let now = SystemTime::now();
        let (t, _) = s.create(HOUR, "*", 2, "", now).unwrap();
        s.redeem(&t.reveal(), "a", now).unwrap();
        s.redeem(&t.reveal(), "b", now).unwrap();
        assert!(matches!(
            s.redeem(&t.reveal(), "c", now),
            Err(JoinError::Exhausted(_))
        ));
    }

    #[test]
    fn expiry_revocation_secret_and_pattern_are_checked() {
        let (_d, s) = store();
        let now = SystemTime::now();
        let (t, _) = s.create(HOUR, "edge-*", 5, "", now).unwrap();
        let later = now + HOUR + Duration::from_secs(1);
        assert!(matches!(
            s.redeem(&t.reveal(), "edge-1", later),
            Err(JoinError::Expired { .. })
        ));
        assert!(matches!(
            s.redeem(&t.reveal(), "cloud-1", now),
            Err(JoinError::NodeNotAllowed { .. })
        ));
        assert!(matches!(
            s.redeem(&t.reveal(), "edge-UPPER", now),
            Err(JoinError::InvalidNodeName(_))
        ));
        let wrong = format!("{}.{}", t.id, "0000000000000000");
        assert!(matches!(
            s.redeem(&wrong, "edge-1", now),
            Err(JoinError::WrongSecret(_))
        ));
        assert!(matches!(
            s.redeem("zzzzzz.0000000000000000", "edge-1", now),
            Err(JoinError::UnknownToken(_))
        ));
        // None of the refusals used the token.
        assert_eq!(s.list().unwrap()[0].uses_left, 5);
        s.revoke(&t.id).unwrap();
        assert!(matches!(
            s.redeem(&t.reveal(), "edge-1", now),
            Err(JoinError::Revoked(_))
        ));
        assert!(matches!(
            s.revoke("nonexi"),
            Err(JoinError::UnknownToken(_))
        ));
    }

    #[test]
    fn failed_issue_does_not_use_the_token_and_success_is_recorded() {
        let (_d, s) = store();
        let now = SystemTime::now();
        let (t, _) = s.create(HOUR, "edge-*", 1, "", now).unwrap();
        let e = s
            .redeem_and_issue(&t.reveal(), "edge-1", now, |_| {
                Err(JoinError::Csr("bad".into()))
            })
            .unwrap_err();
        assert!(matches!(e, JoinError::Csr(_)));
        assert_eq!(s.list().unwrap()[0].uses_left, 1);
        s.redeem_and_issue(&t.reveal(), "edge-1", now, |g| {
            assert_eq!(g.node, "edge-1");
            Ok(IssuedCert {
                cert_pem: String::new(),
                serial: "0abc".into(),
                expires_unix: 42,
            })
        })
        .unwrap();
        let issued = s.issued().unwrap();
        assert_eq!(issued.len(), 1);
        assert_eq!(issued[0].node, "edge-1");
        assert_eq!(issued[0].serial, "0abc");
        assert_eq!(s.list().unwrap()[0].uses_left, 0);
    }

    #[test]
    fn a_change_from_another_handle_is_seen() {
        // The CLI and the cloud open the same file separately.
        let (_d, cloud) = store();
        let cli = JoinStore::open(cloud.path()).unwrap();
        let now = SystemTime::now();
        let (t, _) = cli.create(HOUR, "*", 3, "", now).unwrap();
        cloud.redeem(&t.reveal(), "n1", now).unwrap();
        cli.revoke(&t.id).unwrap();
        assert!(matches!(
            cloud.redeem(&t.reveal(), "n2", now),
            Err(JoinError::Revoked(_))
        ));
    }

    #[test]
    fn pattern_and_uses_are_validated_at_creation() {
        let (_d, s) = store();
        assert!(s.create(HOUR, "Edge-*", 1, "", SystemTime::now()).is_err());
        assert!(s.create(HOUR, "edge-*", 0, "", SystemTime::now()).is_err());
        assert!(s.create(HOUR, "", 1, "", SystemTime::now()).is_err());
    }

    #[test]
    fn a_corrupt_store_is_an_error_not_an_empty_store() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.json");
        std::fs::write(&p, "not json").unwrap();
        assert!(matches!(JoinStore::open(&p), Err(JoinError::Store(_))));
    }

    #[test]
    fn revocations_by_serial_and_by_node_match_what_they_should() {
        let (_d, store) = store();
        let t0 = UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert!(store.revocations().unwrap().is_empty());
        store.revoke_serial("00:AB:cd:01", "lost", t0).unwrap();
        store.revoke_node("edge-7", "stolen key", t0).unwrap();
        assert!(store.revoke_serial("00", "x", t0).is_err());
        assert!(store.revoke_node("Not A Node!", "x", t0).is_err());
        let revs = store.revocations().unwrap();
        assert_eq!(revs.len(), 2);
        let hit =
            |serial: &str, node: &str, nb: i64| revs.iter().any(|r| r.matches(serial, node, nb));
        // Serials compare in one form: case, separators and leading zeros aside.
        assert!(hit("abcd01", "edge-1", 0));
        assert!(hit("0000ABCD01", "edge-1", 0));
        assert!(!hit("abcd02", "edge-1", 0));
        // A node's certificates issued before the revocation, not after.
        // (issued = notBefore + the 5 min backdate)
        assert!(
            hit("ff", "edge-7", 999_700),
            "issued in the revocation's second"
        );
        assert!(!hit("ff", "edge-7", 999_701));
        assert!(!hit("ff", "edge-8", 0));
        // A store written before revocations existed still opens.
        let old = r#"{"version":1,"tokens":[],"issued":[]}"#;
        std::fs::write(store.path(), old).unwrap();
        assert!(store.revocations().unwrap().is_empty());
    }
}
