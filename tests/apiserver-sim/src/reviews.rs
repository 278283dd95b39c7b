//! Webhook authentication and authorisation as a kubelet uses them: `POST
//! /apis/authentication.k8s.io/v1/tokenreviews` (who holds this bearer token?)
//! and `POST /apis/authorization.k8s.io/v1/subjectaccessreviews` (may this user
//! do this verb on this resource?). Tokens and RBAC-like rules come from a JSON
//! file (`--auth-file`); `--review-delay` stalls every answer (a slow
//! apiserver); `GET /sim/reviews` counts the reviews served so tests can see a
//! caller's cache at work.
//!
//! Answers follow the real API: `201 Created` echoing the object with its
//! `status` filled in; an unknown token is `authenticated: false` with an
//! `error`; a request without a token is `400 BadRequest`; a review without
//! exactly one of resource/non-resource attributes, or without a user or
//! group, is `422 Invalid`.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use http::{Method, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::body::{self, Body};
use crate::status::ApiError;

/// Largest review body accepted.
const MAX_BODY: usize = 1 << 20;

/// A token and the user it authenticates as.
#[derive(Debug, Clone, Deserialize)]
pub struct TokenEntry {
    pub token: String,
    pub username: String,
    #[serde(default)]
    pub uid: String,
    #[serde(default)]
    pub groups: Vec<String>,
}

/// A rule in the manner of an RBAC ClusterRoleBinding: a subject (a user or
/// a group), verbs and resources (`nodes`, `nodes/metrics`, `*`).
#[derive(Debug, Clone, Deserialize)]
pub struct Rule {
    /// The binding's name, quoted in the `reason` of allowed reviews.
    pub name: String,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub group: Option<String>,
    pub verbs: Vec<String>,
    pub resources: Vec<String>,
}

/// The contents of `--auth-file`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct AuthConfig {
    #[serde(default)]
    pub tokens: Vec<TokenEntry>,
    #[serde(default)]
    pub rules: Vec<Rule>,
}

impl AuthConfig {
    pub fn read(path: &Path) -> Result<AuthConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading --auth-file {}", path.display()))?;
        let cfg: AuthConfig = serde_json::from_str(&text)
            .with_context(|| format!("parsing --auth-file {}", path.display()))?;
        for r in &cfg.rules {
            if r.user.is_some() == r.group.is_some() {
                anyhow::bail!("--auth-file rule {:?}: exactly one of user, group", r.name);
            }
        }
        Ok(cfg)
    }
}

/// The review endpoints' state.
#[derive(Debug, Default)]
pub struct Reviews {
    pub config: AuthConfig,
    pub delay: Duration,
    token_reviews: AtomicU64,
    access_reviews: AtomicU64,
}

impl Reviews {
    pub fn new(config: AuthConfig, delay: Duration) -> Reviews {
        Reviews {
            config,
            delay,
            ..Default::default()
        }
    }

    /// `GET /sim/reviews`.
    pub fn counts(&self) -> Value {
        json!({
            "tokenReviews": self.token_reviews.load(Ordering::Relaxed),
            "subjectAccessReviews": self.access_reviews.load(Ordering::Relaxed),
        })
    }

    /// `POST .../tokenreviews`.
    pub async fn token_review(
        &self,
        method: &Method,
        body: Incoming,
    ) -> Result<Response<Body>, ApiError> {
        let mut obj = self.read_object(method, body, "TokenReview").await?;
        self.token_reviews.fetch_add(1, Ordering::Relaxed);
        let spec = obj.get("spec").cloned().unwrap_or(Value::Null);
        let token = spec.get("token").and_then(Value::as_str).unwrap_or("");
        if token.is_empty() {
            return Err(ApiError::bad_request(
                "token is required for TokenReview in authentication",
            ));
        }
        let audiences = spec.get("audiences").cloned().unwrap_or(json!([]));
        let status = match self.config.tokens.iter().find(|t| t.token == token) {
            Some(t) => json!({
                "authenticated": true,
                "user": {"username": t.username, "uid": t.uid, "groups": t.groups},
                "audiences": audiences,
            }),
            None => json!({
                "user": {},
                "error": "[invalid bearer token, token lookup failed]",
            }),
        };
        self.stall().await;
        obj["status"] = status;
        Ok(body::json(StatusCode::CREATED, &obj))
    }

    /// `POST .../subjectaccessreviews`.
    pub async fn access_review(
        &self,
        method: &Method,
        body: Incoming,
    ) -> Result<Response<Body>, ApiError> {
        let mut obj = self
            .read_object(method, body, "SubjectAccessReview")
            .await?;
        self.access_reviews.fetch_add(1, Ordering::Relaxed);
        let spec = obj.get("spec").cloned().unwrap_or(Value::Null);
        let user = spec.get("user").and_then(Value::as_str).unwrap_or("");
        let groups: Vec<&str> = spec
            .get("groups")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let res = spec.get("resourceAttributes").filter(|v| v.is_object());
        let nonres = spec.get("nonResourceAttributes").filter(|v| v.is_object());
        if res.is_some() == nonres.is_some() {
            return Err(ApiError::invalid(
                "SubjectAccessReview.authorization.k8s.io \"\" is invalid: spec.resourceAttributes: Invalid value: exactly one of nonResourceAttributes or resourceAttributes must be specified",
            ));
        }
        if user.is_empty() && groups.is_empty() {
            return Err(ApiError::invalid(
                "SubjectAccessReview.authorization.k8s.io \"\" is invalid: spec.user: Invalid value: \"\": at least one of user or group must be specified",
            ));
        }
        let field = |v: Option<&Value>, k: &str| -> String {
            v.and_then(|v| v.get(k))
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        let (verb, resource) = match res {
            Some(_) => {
                let r = field(res, "resource");
                let sub = field(res, "subresource");
                let full = if sub.is_empty() {
                    r
                } else {
                    format!("{r}/{sub}")
                };
                (field(res, "verb"), full)
            }
            None => (field(nonres, "verb"), field(nonres, "path")),
        };
        let hit = self.config.rules.iter().find(|r| {
            let subject = match (&r.user, &r.group) {
                (Some(u), _) => u == user,
                (_, Some(g)) => groups.contains(&g.as_str()),
                _ => false,
            };
            subject
                && r.verbs.iter().any(|v| v == "*" || *v == verb)
                && r.resources.iter().any(|x| x == "*" || *x == resource)
        });
        let status = match hit {
            Some(r) => {
                let (kind, name) = match (&r.user, &r.group) {
                    (Some(u), _) => ("User", u.as_str()),
                    (_, Some(g)) => ("Group", g.as_str()),
                    _ => ("User", ""),
                };
                json!({"allowed": true, "reason": format!("RBAC: allowed by ClusterRoleBinding \"{}\" to {kind} \"{name}\"", r.name)})
            }
            None => json!({"allowed": false}),
        };
        self.stall().await;
        obj["status"] = status;
        Ok(body::json(StatusCode::CREATED, &obj))
    }

    async fn stall(&self) {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
    }

    async fn read_object(
        &self,
        method: &Method,
        body: Incoming,
        kind: &str,
    ) -> Result<Value, ApiError> {
        if method != Method::POST {
            return Err(ApiError::method_not_allowed());
        }
        let limited = http_body_util::Limited::new(body, MAX_BODY);
        let bytes = limited
            .collect()
            .await
            .map_err(|e| ApiError::bad_request(format!("reading the {kind}: {e}")))?
            .to_bytes();
        let obj: Value = serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::bad_request(format!("the {kind} is not valid JSON: {e}")))?;
        if obj.get("kind").and_then(Value::as_str) != Some(kind) {
            return Err(ApiError::bad_request(format!(
                "expected kind {kind}, got {}",
                obj.get("kind").unwrap_or(&Value::Null)
            )));
        }
        Ok(obj)
    }
}
