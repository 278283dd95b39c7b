//! `/logs/` and `/logs/{path}`: the node log directory (here the simulator's
//! `--log-dir`) served read-only, directories as a Go FileServer-style listing.

use std::path::{Component, Path, PathBuf};

use http::{Response, StatusCode};

use crate::http_util::{self, Body};

fn safe_join(root: &Path, rel: &str) -> Option<PathBuf> {
    let mut out = root.to_path_buf();
    for c in Path::new(rel).components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Serve `rel` (already percent-decoded, without the `/logs/` prefix).
pub async fn serve(root: &Path, rel: &str) -> Response<Body> {
    let Some(path) = safe_join(root, rel) else {
        return http_util::text(StatusCode::BAD_REQUEST, "invalid path\n");
    };
    let meta = match tokio::fs::metadata(&path).await {
        Ok(m) => m,
        Err(_) => return http_util::text(StatusCode::NOT_FOUND, "404 page not found\n"),
    };
    if meta.is_dir() {
        let mut names = Vec::new();
        match tokio::fs::read_dir(&path).await {
            Ok(mut rd) => {
                while let Ok(Some(e)) = rd.next_entry().await {
                    let mut n = e.file_name().to_string_lossy().into_owned();
                    if n.starts_with('.') {
                        continue;
                    }
                    if e.file_type().await.map(|t| t.is_dir()).unwrap_or(false) {
                        n.push('/');
                    }
                    names.push(n);
                }
            }
            Err(e) => {
                return http_util::text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("cannot list directory: {e}\n"),
                )
            }
        }
        names.sort();
        let mut body = String::from("<pre>\n");
        for n in names {
            let e = html_escape(&n);
            body.push_str(&format!("<a href=\"{e}\">{e}</a>\n"));
        }
        body.push_str("</pre>\n");
        let mut r = http_util::text(StatusCode::OK, body);
        if let Ok(v) = "text/html; charset=utf-8".parse() {
            r.headers_mut().insert(http::header::CONTENT_TYPE, v);
        }
        return r;
    }
    match tokio::fs::read(&path).await {
        Ok(data) => http_util::text(StatusCode::OK, String::from_utf8_lossy(&data).into_owned()),
        Err(e) => http_util::text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot read file: {e}\n"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_traversal() {
        let root = Path::new("/var/log");
        assert_eq!(
            safe_join(root, "a/b.log"),
            Some(PathBuf::from("/var/log/a/b.log"))
        );
        assert_eq!(safe_join(root, "/abs"), Some(PathBuf::from("/var/log/abs")));
        assert_eq!(safe_join(root, "../etc/passwd"), None);
    }
}
