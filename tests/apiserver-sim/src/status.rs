//! metav1 `Status` errors: the JSON failure objects the apiserver returns, and the
//! [`ApiError`] type handlers use to produce them.

use http::{Response, StatusCode};
use serde_json::json;

use crate::body::{self, Body};

/// An error destined for the client as a metav1 `Status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub code: StatusCode,
    pub reason: &'static str,
    pub message: String,
    /// `details` object (name/kind/causes), if any.
    pub details: Option<serde_json::Value>,
}

impl ApiError {
    pub fn new(code: StatusCode, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }

    /// `<kind> "<name>" not found` as the apiserver words it.
    pub fn not_found(kind: &str, name: &str) -> Self {
        ApiError {
            details: Some(json!({"name": name, "kind": kind})),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("{kind} \"{name}\" not found"),
            )
        }
    }

    /// The generic 404 for paths nothing serves.
    pub fn no_route() -> Self {
        ApiError {
            details: Some(json!({})),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "NotFound",
                "the server could not find the requested resource",
            )
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "BadRequest", message)
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", message)
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )
    }

    /// A failure talking to the kubelet (dial, TLS, protocol).
    pub fn backend(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "ServiceUnavailable", message)
    }

    /// A non-2xx answer of the kubelet to a request the apiserver built itself (logs),
    /// like client-go's generic server response error carrying the body text.
    pub fn from_backend_response(code: StatusCode, body_text: &str) -> Self {
        let reason = match code.as_u16() {
            400 => "BadRequest",
            401 => "Unauthorized",
            403 => "Forbidden",
            404 => "NotFound",
            409 => "Conflict",
            422 => "Invalid",
            429 => "TooManyRequests",
            500 => "InternalError",
            503 => "ServiceUnavailable",
            504 => "Timeout",
            _ => "InternalError",
        };
        let code = if code.is_client_error() || code.is_server_error() {
            code
        } else {
            StatusCode::INTERNAL_SERVER_ERROR
        };
        ApiError {
            details: Some(
                json!({"causes": [{"reason": "UnexpectedServerResponse", "message": body_text}]}),
            ),
            ..Self::new(code, reason, body_text.to_string())
        }
    }

    /// The Status JSON object.
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code.as_u16(),
        });
        if let (Some(d), Some(obj)) = (&self.details, v.as_object_mut()) {
            obj.insert("details".into(), d.clone());
        }
        v
    }

    /// The HTTP response carrying the Status.
    pub fn into_response(self) -> Response<Body> {
        body::json(self.code, &self.to_json())
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.code.as_u16(),
            self.reason,
            self.message
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_found_shape() {
        let v = ApiError::not_found("pods", "p9").to_json();
        assert_eq!(v["kind"], "Status");
        assert_eq!(v["code"], 404);
        assert_eq!(v["reason"], "NotFound");
        assert_eq!(v["message"], "pods \"p9\" not found");
        assert_eq!(v["details"]["name"], "p9");
    }

    #[test]
    fn backend_response_keeps_code_and_body() {
        let e = ApiError::from_backend_response(StatusCode::NOT_FOUND, "no such container");
        assert_eq!(e.code, StatusCode::NOT_FOUND);
        assert_eq!(e.to_json()["message"], "no such container");
        let e = ApiError::from_backend_response(StatusCode::FOUND, "x");
        assert_eq!(e.code, StatusCode::INTERNAL_SERVER_ERROR);
    }
}
