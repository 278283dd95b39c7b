//! Test-only debug endpoints: `GET /debug/echo-headers` (method, path, query
//! and every header as JSON) and `POST /debug/echo-body` (the request body
//! streamed back as the response body).

use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{json, Map, Value};

use crate::http_util::{self, Body};

/// Describe the request as JSON. Repeated headers become arrays.
pub fn echo_headers<B>(req: &Request<B>) -> Response<Body> {
    let mut headers = Map::new();
    for name in req.headers().keys() {
        let values: Vec<Value> = req
            .headers()
            .get_all(name)
            .iter()
            .map(|v| Value::String(String::from_utf8_lossy(v.as_bytes()).into_owned()))
            .collect();
        headers.insert(
            name.as_str().to_string(),
            if values.len() == 1 {
                values.into_iter().next().unwrap_or(Value::Null)
            } else {
                Value::Array(values)
            },
        );
    }
    let body = json!({
        "method": req.method().as_str(),
        "path": req.uri().path(),
        "query": req.uri().query().unwrap_or(""),
        "version": format!("{:?}", req.version()),
        "headers": headers,
    });
    http_util::json(http::StatusCode::OK, &body)
}

/// Stream the request body back.
pub fn echo_body(req: Request<Incoming>) -> Response<Body> {
    let content_type = req.headers().get(http::header::CONTENT_TYPE).cloned();
    let body = req.into_body().map_err(std::io::Error::other).boxed();
    let mut r = Response::new(body);
    if let Some(ct) = content_type {
        r.headers_mut().insert(http::header::CONTENT_TYPE, ct);
    }
    r
}
