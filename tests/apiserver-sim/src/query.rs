//! URL query strings: decoding what clients send (form encoding, repeated keys) and
//! encoding what the apiserver sends to the kubelet the way Go's `url.Values.Encode` does
//! (keys sorted, values in insertion order, `QueryEscape` escaping).

/// A decoded query: ordered `(key, value)` pairs, repeated keys kept.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Query {
    pairs: Vec<(String, String)>,
}

impl Query {
    /// Decodes a raw query (without the leading `?`). Undecodable escapes are kept verbatim,
    /// invalid UTF-8 is replaced, so this never fails.
    pub fn parse(raw: Option<&str>) -> Self {
        let mut pairs = Vec::new();
        for part in raw.unwrap_or("").split(['&', ';']) {
            if part.is_empty() {
                continue;
            }
            let (k, v) = part.split_once('=').unwrap_or((part, ""));
            pairs.push((unescape(k), unescape(v)));
        }
        Query { pairs }
    }

    /// The first value of `key`, if present.
    pub fn first(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// All values of `key`, in order.
    pub fn all(&self, key: &str) -> Vec<&str> {
        self.pairs
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// A boolean parameter as the apiserver's query conversion reads it: absent → false;
    /// present → true unless the (first) value is `false` or `0` (case-insensitive).
    pub fn flag(&self, key: &str) -> bool {
        match self.first(key) {
            None => false,
            Some(v) => {
                let v = v.to_ascii_lowercase();
                v != "false" && v != "0"
            }
        }
    }
}

/// Builds a query string like Go's `url.Values.Encode`: keys sorted (stable, so values of
/// one key keep their order), `key=value` joined by `&`.
pub fn encode(pairs: &[(&str, String)]) -> String {
    let mut sorted: Vec<&(&str, String)> = pairs.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let mut out = String::new();
    for (k, v) in sorted {
        if !out.is_empty() {
            out.push('&');
        }
        out.push_str(&escape(k));
        out.push('=');
        out.push_str(&escape(v));
    }
    out
}

/// Go's `url.QueryEscape`: unreserved characters kept, space as `+`, the rest `%XX`.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(char::from(b))
            }
            b' ' => out.push('+'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// Form decoding: `+` is a space, `%XX` a byte; a malformed escape is kept as is.
pub fn unescape(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b'%' if i + 2 < bytes.len() => match (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 3;
                }
                _ => {
                    out.push(b'%');
                    i += 1;
                }
            },
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_repeated_keys_and_escapes() {
        let q = Query::parse(Some(
            "command=sh&command=-c&command=echo+hi%21&stdin=true&x",
        ));
        assert_eq!(q.all("command"), vec!["sh", "-c", "echo hi!"]);
        assert!(q.flag("stdin"));
        assert!(q.flag("x"));
        assert!(!q.flag("tty"));
        assert_eq!(q.first("missing"), None);
    }

    #[test]
    fn flag_false_values() {
        let q = Query::parse(Some("a=false&b=0&c=FALSE&d=1&e=True"));
        assert!(!q.flag("a"));
        assert!(!q.flag("b"));
        assert!(!q.flag("c"));
        assert!(q.flag("d"));
        assert!(q.flag("e"));
    }

    #[test]
    fn malformed_escapes_do_not_panic() {
        assert_eq!(unescape("%"), "%");
        assert_eq!(unescape("a%2"), "a%2");
        assert_eq!(unescape("%zz"), "%zz");
        assert_eq!(unescape("%41"), "A");
        assert_eq!(unescape("%ff"), "\u{fffd}");
    }

    #[test]
    fn encodes_like_go() {
        let q = encode(&[
            ("output", "1".into()),
            ("command", "echo".into()),
            ("command", "a b/c&d".into()),
            ("error", "1".into()),
        ]);
        assert_eq!(q, "command=echo&command=a+b%2Fc%26d&error=1&output=1");
    }
}
