//! Authentication and authorisation of kubelet-API requests other than the
//! apiserver's own, the way a kubelet does it (`--authentication-token-webhook`,
//! `--authorization-mode=Webhook`): a bearer token is checked with a
//! TokenReview, and every request of a caller that is not one of
//! `--apiserver-allowed-identity` is checked with a SubjectAccessReview using
//! the kubelet's attribute mapping (resource `nodes`, subresource from the
//! path, verb from the method, the node's name). Both answers are cached for a
//! short, configurable time; a review that fails or outlasts
//! `--review-timeout` fails that request only.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use sha2::{Digest, Sha256};

/// Longest bearer token accepted (service-account JWTs are ~1 KiB).
pub const MAX_TOKEN_BYTES: usize = 8192;
/// Default of `--review-cache-entries`: entries per cache before expired
/// ones are swept (and, if still full, all).
pub const DEFAULT_CACHE_ENTRIES: usize = 10_000;

/// Who made a request.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct User {
    pub name: String,
    pub uid: String,
    pub groups: Vec<String>,
}

/// What the kubelet would authorise: verb and `nodes` subresource.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Attributes {
    pub verb: &'static str,
    pub subresource: &'static str,
}

/// The kubelet's mapping of a request to authorisation attributes
/// (`pkg/kubelet/server/auth.go`): `/stats*` → `stats`, `/metrics*` →
/// `metrics`, `/logs*` → `log`, `/spec*` → `spec`, everything else (exec,
/// attach, port-forward, container logs, pods, …) → `proxy`; GET/HEAD → get,
/// POST → create, PUT → update, PATCH → patch, DELETE → delete.
pub fn attributes(method: &http::Method, path: &str) -> Attributes {
    let under = |p: &str| path == p || path.starts_with(&format!("{p}/"));
    let subresource = if under("/stats") {
        "stats"
    } else if under("/metrics") {
        "metrics"
    } else if under("/logs") {
        "log"
    } else if under("/spec") {
        "spec"
    } else {
        "proxy"
    };
    let verb = match *method {
        http::Method::GET | http::Method::HEAD => "get",
        http::Method::POST => "create",
        http::Method::PUT => "update",
        http::Method::PATCH => "patch",
        http::Method::DELETE => "delete",
        _ => "",
    };
    Attributes { verb, subresource }
}

/// Why a request was not let through.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// 401: no usable credentials.
    #[error("{0}")]
    Unauthenticated(String),
    /// 403: authenticated, but the SubjectAccessReview said no.
    #[error("{0}")]
    Forbidden(String),
    /// 503: the apiserver could not answer a review in time.
    #[error("{0}")]
    Unavailable(String),
}

/// Extracts the token of `Authorization: Bearer <token>`.
pub fn bearer_token(value: &http::HeaderValue) -> Result<&str, Refusal> {
    if value.len() > MAX_TOKEN_BYTES + 7 {
        return Err(Refusal::Unauthenticated(format!(
            "Authorization header longer than {MAX_TOKEN_BYTES} bytes"
        )));
    }
    let text = value.to_str().map_err(|_| {
        Refusal::Unauthenticated("Authorization header is not printable ASCII".into())
    })?;
    let (scheme, token) = text.split_once(' ').ok_or_else(|| {
        Refusal::Unauthenticated(
            "malformed Authorization header (expected \"Bearer <token>\")".into(),
        )
    })?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() || token.contains(' ') {
        return Err(Refusal::Unauthenticated(
            "malformed Authorization header (expected \"Bearer <token>\")".into(),
        ));
    }
    Ok(token)
}

/// Settings of the reviews.
#[derive(Debug, Clone)]
pub struct ReviewSettings {
    pub authn_ttl: Duration,
    pub allowed_ttl: Duration,
    pub denied_ttl: Duration,
    pub timeout: Duration,
    /// Entries per cache (`--review-cache-entries`) before expired ones are
    /// swept and, if it is still full, all of them: a bound on the memory
    /// many tokens or callers can take.
    pub cache_entries: usize,
}

struct Cache<K, V> {
    /// Most entries (and turns) kept; see [`ReviewSettings::cache_entries`].
    max_entries: usize,
    entries: Mutex<HashMap<K, (Instant, V)>>,
    /// One review per key at a time ([`Cache::turn`]).
    turns: Mutex<HashMap<K, Arc<tokio::sync::Mutex<()>>>>,
}

impl<K: std::hash::Hash + Eq + Clone, V: Clone> Cache<K, V> {
    fn new(max_entries: usize) -> Self {
        Cache {
            max_entries,
            entries: Mutex::new(HashMap::new()),
            turns: Mutex::new(HashMap::new()),
        }
    }
    /// The cached answer for `k`, or on a miss the turn to review it
    /// ([`Cache::turn`], waited for at most `bound`, like the review it waits
    /// for; past that the caller reviews without it). Looked up again once
    /// the turn came: another task may have put the answer meanwhile.
    async fn get_or_turn(
        &self,
        k: &K,
        bound: Duration,
    ) -> Result<V, Option<tokio::sync::OwnedMutexGuard<()>>> {
        if let Some(v) = self.get(k) {
            return Ok(v);
        }
        let turn = tokio::time::timeout(bound, self.turn(k)).await.ok();
        self.get(k).ok_or(turn)
    }
    /// Waits until no other task reviews `k`: requests that miss the cache
    /// together (a scraper's first round, every target with one token) make
    /// one review, not one each; the others find its answer cached. Keys
    /// nobody waits on are swept once there are as many as cache entries.
    async fn turn(&self, k: &K) -> tokio::sync::OwnedMutexGuard<()> {
        let gate = {
            let mut turns = self.turns.lock().unwrap_or_else(|p| p.into_inner());
            if turns.len() >= self.max_entries {
                turns.retain(|_, g| Arc::strong_count(g) > 1);
            }
            turns.entry(k.clone()).or_default().clone()
        };
        gate.lock_owned().await
    }
    fn get(&self, k: &K) -> Option<V> {
        let map = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        map.get(k)
            .filter(|(until, _)| *until > Instant::now())
            .map(|(_, v)| v.clone())
    }
    fn put(&self, k: K, v: V, ttl: Duration) {
        if ttl.is_zero() {
            return;
        }
        let mut map = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= self.max_entries {
            let now = Instant::now();
            map.retain(|_, (until, _)| *until > now);
            if map.len() >= self.max_entries {
                map.clear();
            }
        }
        map.insert(k, (Instant::now() + ttl, v));
    }
}

/// TokenReview and SubjectAccessReview with their caches.
pub struct Reviewer {
    client: kube::Client,
    settings: ReviewSettings,
    tokens: Cache<[u8; 32], Option<User>>,
    decisions: Cache<(User, Attributes, String), Result<String, String>>,
}

impl Reviewer {
    /// Creates one review object (`what` names it in errors), bounded by
    /// `--review-timeout`.
    async fn create<K>(&self, what: &str, review: &K) -> Result<K, Refusal>
    where
        K: kube::Resource<Scope = k8s_openapi::ClusterResourceScope>
            + Clone
            + std::fmt::Debug
            + k8s_openapi::serde::de::DeserializeOwned
            + k8s_openapi::serde::Serialize,
        K::DynamicType: Default,
    {
        let api: Api<K> = Api::all(self.client.clone());
        tokio::time::timeout(
            self.settings.timeout,
            api.create(&PostParams::default(), review),
        )
        .await
        .map_err(|_| {
            Refusal::Unavailable(format!(
                "{what}: no answer from the apiserver within {:?} (--review-timeout)",
                self.settings.timeout
            ))
        })?
        .map_err(|e| Refusal::Unavailable(format!("{what} failed: {e}")))
    }

    pub fn new(client: kube::Client, settings: ReviewSettings) -> Reviewer {
        Reviewer {
            client,
            tokens: Cache::new(settings.cache_entries),
            decisions: Cache::new(settings.cache_entries),
            settings,
        }
    }

    /// The user a bearer token belongs to (TokenReview, cached by the
    /// token's SHA-256 for the authentication TTL).
    pub async fn authenticate(&self, token: &str) -> Result<User, Refusal> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let known = match self.tokens.get_or_turn(&key, self.settings.timeout).await {
            Ok(v) => v,
            Err(_turn) => {
                let review = TokenReview {
                    spec: TokenReviewSpec {
                        token: Some(token.to_string()),
                        audiences: None,
                    },
                    ..Default::default()
                };
                let answer = self.create("TokenReview", &review).await?;
                let status = answer.status.unwrap_or_default();
                let user = match (status.authenticated, status.user) {
                    (Some(true), Some(u)) => Some(User {
                        name: u.username.unwrap_or_default(),
                        uid: u.uid.unwrap_or_default(),
                        groups: u.groups.unwrap_or_default(),
                    }),
                    _ => None,
                };
                self.tokens.put(key, user.clone(), self.settings.authn_ttl);
                user
            }
        };
        known.ok_or_else(|| Refusal::Unauthenticated("invalid bearer token".into()))
    }

    /// Whether `user` may do `attrs` on node `node` (SubjectAccessReview,
    /// cached for the allowed or denied TTL). `Ok` carries the reason.
    pub async fn authorize(
        &self,
        user: &User,
        attrs: &Attributes,
        node: &str,
    ) -> Result<String, Refusal> {
        let key = (user.clone(), attrs.clone(), node.to_string());
        let decision = match self
            .decisions
            .get_or_turn(&key, self.settings.timeout)
            .await
        {
            Ok(v) => v,
            Err(_turn) => {
                let review = SubjectAccessReview {
                    spec: SubjectAccessReviewSpec {
                        user: Some(user.name.clone()),
                        uid: (!user.uid.is_empty()).then(|| user.uid.clone()),
                        groups: Some(user.groups.clone()),
                        resource_attributes: Some(ResourceAttributes {
                            verb: Some(attrs.verb.to_string()),
                            group: Some(String::new()),
                            version: Some("v1".into()),
                            resource: Some("nodes".into()),
                            subresource: Some(attrs.subresource.to_string()),
                            name: Some(node.to_string()),
                            ..Default::default()
                        }),
                        ..Default::default()
                    },
                    ..Default::default()
                };
                let answer = self.create("SubjectAccessReview", &review).await?;
                let status = answer.status.unwrap_or_default();
                let d = if status.allowed {
                    Ok(status.reason.unwrap_or_default())
                } else {
                    Err(status.reason.unwrap_or_default())
                };
                let ttl = if d.is_ok() {
                    self.settings.allowed_ttl
                } else {
                    self.settings.denied_ttl
                };
                self.decisions.put(key, d.clone(), ttl);
                d
            }
        };
        decision.map_err(|reason| {
            Refusal::Forbidden(format!(
                "Forbidden (user={}, verb={}, resource=nodes, subresource={}, node={}){}",
                user.name,
                attrs.verb,
                attrs.subresource,
                node,
                if reason.is_empty() {
                    String::new()
                } else {
                    format!(": {reason}")
                }
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderValue, Method};

    #[test]
    fn kubelet_attribute_mapping() {
        let a = |m: Method, p: &str| {
            let x = attributes(&m, p);
            (x.verb, x.subresource)
        };
        assert_eq!(a(Method::GET, "/metrics"), ("get", "metrics"));
        assert_eq!(a(Method::GET, "/metrics/resource"), ("get", "metrics"));
        assert_eq!(a(Method::GET, "/metrics/cadvisor"), ("get", "metrics"));
        assert_eq!(a(Method::GET, "/stats/summary"), ("get", "stats"));
        assert_eq!(a(Method::GET, "/logs/syslog"), ("get", "log"));
        assert_eq!(a(Method::GET, "/spec/"), ("get", "spec"));
        assert_eq!(a(Method::POST, "/exec/ns/p/c"), ("create", "proxy"));
        assert_eq!(a(Method::GET, "/exec/ns/p/c"), ("get", "proxy"));
        assert_eq!(a(Method::GET, "/containerLogs/ns/p/c"), ("get", "proxy"));
        assert_eq!(a(Method::GET, "/metricsfoo"), ("get", "proxy"));
        assert_eq!(a(Method::DELETE, "/pods"), ("delete", "proxy"));
        assert_eq!(a(Method::PUT, "/stats"), ("update", "stats"));
    }

    #[test]
    fn bearer_header_parsing() {
        let h = |s: &str| HeaderValue::from_str(s).unwrap();
        assert_eq!(bearer_token(&h("Bearer abc.def")).unwrap(), "abc.def");
        assert_eq!(bearer_token(&h("bearer abc")).unwrap(), "abc");
        for bad in ["Basic dXNlcjpw", "Bearer", "Bearer ", "abc", "Bearer a b"] {
            let e = bearer_token(&h(bad)).unwrap_err();
            assert!(matches!(e, Refusal::Unauthenticated(_)), "{bad}");
        }
        let long = format!("Bearer {}", "a".repeat(MAX_TOKEN_BYTES + 1));
        assert!(bearer_token(&h(&long))
            .unwrap_err()
            .to_string()
            .contains("longer than"));
        let bin = HeaderValue::from_bytes(b"Bearer \xff\xfe").unwrap();
        assert!(bearer_token(&bin).is_err());
    }

    #[tokio::test]
    async fn reviews_of_one_key_take_turns_and_other_keys_do_not_wait() {
        let c: Cache<u32, u32> = Cache::new(DEFAULT_CACHE_ENTRIES);
        let held = c.turn(&1).await;
        let t0 = Instant::now();
        // Another key: no wait.
        drop(c.turn(&2).await);
        assert!(t0.elapsed() < Duration::from_millis(50));
        // The same key waits for the turn to end; the answer put meanwhile
        // is what it then finds.
        let waiting = tokio::time::timeout(Duration::from_millis(100), c.turn(&1)).await;
        assert!(waiting.is_err(), "the same key did not wait");
        c.put(1, 7, Duration::from_secs(60));
        drop(held);
        let _t = tokio::time::timeout(Duration::from_secs(1), c.turn(&1))
            .await
            .expect("the turn came");
        assert_eq!(c.get(&1), Some(7));
        // A hit does not wait for the turn (still held here); a miss gets one.
        assert!(matches!(
            c.get_or_turn(&1, Duration::from_secs(1)).await,
            Ok(7)
        ));
        assert!(matches!(
            c.get_or_turn(&3, Duration::from_secs(1)).await,
            Err(Some(_))
        ));
    }

    #[test]
    fn cache_expires() {
        let c: Cache<u32, u32> = Cache::new(DEFAULT_CACHE_ENTRIES);
        c.put(1, 10, Duration::from_millis(30));
        assert_eq!(c.get(&1), Some(10));
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(c.get(&1), None);
        c.put(2, 20, Duration::ZERO);
        assert_eq!(c.get(&2), None);
    }

    /// `--review-cache-entries` bounds the answers kept: at 8, the ninth
    /// live answer sweeps the table (none expired: all go), and no more than
    /// 8 are ever held; expired ones are what a sweep drops first.
    #[test]
    fn the_cache_holds_at_most_its_configured_entries() {
        let c: Cache<u32, u32> = Cache::new(8);
        for i in 0..8 {
            c.put(i, i, Duration::from_secs(60));
        }
        assert_eq!(c.entries.lock().unwrap().len(), 8);
        assert_eq!(c.get(&0), Some(0));
        c.put(8, 8, Duration::from_secs(60));
        assert_eq!(
            c.entries.lock().unwrap().len(),
            1,
            "a full table of live answers is cleared"
        );
        assert_eq!(c.get(&0), None);
        assert_eq!(c.get(&8), Some(8));
        for i in 0..100 {
            c.put(i, i, Duration::from_secs(60));
            assert!(c.entries.lock().unwrap().len() <= 8);
        }
        // Expired answers go first; the live ones stay.
        let c: Cache<u32, u32> = Cache::new(4);
        c.put(1, 1, Duration::from_secs(60));
        for i in 2..5 {
            c.put(i, i, Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(20));
        c.put(5, 5, Duration::from_secs(60));
        assert_eq!(c.entries.lock().unwrap().len(), 2);
        assert_eq!((c.get(&1), c.get(&5)), (Some(1), Some(5)));
    }

    /// The turns of keys nobody waits on are swept at the same bound.
    #[tokio::test]
    async fn idle_turns_are_swept_at_the_configured_entries() {
        let c: Cache<u32, u32> = Cache::new(4);
        let held = c.turn(&0).await;
        for i in 1..20 {
            drop(c.turn(&i).await);
            let n = c.turns.lock().unwrap().len();
            assert!(n <= 4, "{n} turns kept with a bound of 4");
        }
        assert!(
            c.turns.lock().unwrap().contains_key(&0),
            "a held turn is kept"
        );
        drop(held);
    }
}
