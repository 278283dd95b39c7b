//! The one response/request body type used everywhere in the simulator, and small
//! constructors for JSON and text responses.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Empty, Full};

/// Boxed error carried by bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A streaming body: either built here or relayed from the kubelet / client.
pub type Body = BoxBody<Bytes, BoxError>;

/// A body holding `bytes` entirely.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// An empty body.
pub fn empty() -> Body {
    Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed()
}

/// Boxes any body whose error converts into [`BoxError`] (e.g. hyper's `Incoming`).
pub fn boxed<B>(b: B) -> Body
where
    B: hyper::body::Body<Data = Bytes> + Send + Sync + 'static,
    B::Error: Into<BoxError>,
{
    b.map_err(Into::into).boxed()
}

/// A JSON response with `Content-Type: application/json`.
pub fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let text = serde_json::to_vec_pretty(value).unwrap_or_else(|_| b"{}".to_vec());
    let mut resp = Response::new(full(text));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}
