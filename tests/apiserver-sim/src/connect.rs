//! The pod connect subresources (`exec`, `attach`, `portforward`) turned into kubelet
//! locations exactly like kube-apiserver's `ExecLocation` / `AttachLocation` /
//! `PortForwardLocation`: container defaulting, `stdin/stdout/stderr/tty` →
//! `input/output/error/tty=1`, repeated `command`, `ports` → `port`.

use crate::cluster::{Node, Pod};
use crate::kubelet::Location;
use crate::query::{self, Query};
use crate::status::ApiError;

/// Which connect subresource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectKind {
    Exec,
    Attach,
    PortForward,
}

impl ConnectKind {
    /// From the subresource segment of `/api/v1/namespaces/{ns}/pods/{name}/{sub}`.
    pub fn from_subresource(sub: &str) -> Option<Self> {
        match sub {
            "exec" => Some(ConnectKind::Exec),
            "attach" => Some(ConnectKind::Attach),
            "portforward" => Some(ConnectKind::PortForward),
            _ => None,
        }
    }
}

/// The kubelet location for a connect request on `pod` (running on `node`).
pub fn location(
    kind: ConnectKind,
    pod: &Pod,
    node: &Node,
    q: &Query,
) -> Result<Location, ApiError> {
    match kind {
        ConnectKind::Exec | ConnectKind::Attach => stream_location(kind, pod, node, q),
        ConnectKind::PortForward => {
            let mut params: Vec<(&str, String)> = Vec::new();
            for raw in q.all("ports") {
                for p in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                    let port: u16 = p
                        .parse()
                        .ok()
                        .filter(|p| *p != 0)
                        .ok_or_else(|| ApiError::bad_request(format!("invalid port {p:?}")))?;
                    params.push(("port", port.to_string()));
                }
            }
            Ok(Location::new(
                node,
                format!("/portForward/{}/{}", pod.namespace, pod.name),
                query::encode(&params),
            ))
        }
    }
}

fn stream_location(
    kind: ConnectKind,
    pod: &Pod,
    node: &Node,
    q: &Query,
) -> Result<Location, ApiError> {
    let container = pod
        .pick_container(q.first("container"))
        .map_err(ApiError::bad_request)?;
    let (stdin, stdout, stderr, tty) = (
        q.flag("stdin"),
        q.flag("stdout"),
        q.flag("stderr"),
        q.flag("tty"),
    );
    if !(stdin || stdout || stderr) {
        return Err(ApiError::bad_request(
            "you must specify at least one of stdin, stdout, stderr",
        ));
    }
    let mut params: Vec<(&str, String)> = Vec::new();
    if stdin {
        params.push(("input", "1".into()));
    }
    if stdout {
        params.push(("output", "1".into()));
    }
    if stderr {
        params.push(("error", "1".into()));
    }
    if tty {
        params.push(("tty", "1".into()));
    }
    let verb = match kind {
        ConnectKind::Exec => {
            let commands = q.all("command");
            if commands.is_empty() {
                return Err(ApiError::bad_request("you must specify at least 1 command"));
            }
            for c in commands {
                params.push(("command", c.to_string()));
            }
            "exec"
        }
        _ => "attach",
    };
    Ok(Location::new(
        node,
        format!("/{verb}/{}/{}/{}", pod.namespace, pod.name, container.name),
        query::encode(&params),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> (Pod, Pod, Node) {
        (
            Pod::parse("default/p1=edge-1:c1").unwrap(),
            Pod::parse("ns2/multi=edge-1:a,b").unwrap(),
            Node::parse("edge-1=192.0.2.10:10350").unwrap(),
        )
    }

    fn loc(kind: ConnectKind, pod: &Pod, node: &Node, q: &str) -> Result<Location, ApiError> {
        location(kind, pod, node, &Query::parse(Some(q)))
    }

    #[test]
    fn exec_kubectl_128_query() {
        let (p1, _, n) = fixture();
        let l = loc(
            ConnectKind::Exec,
            &p1,
            &n,
            "command=echo&command=hi&container=c1&stderr=true&stdout=true",
        )
        .unwrap();
        assert_eq!(l.path, "/exec/default/p1/c1");
        assert_eq!(l.query, "command=echo&command=hi&error=1&output=1");
        assert_eq!(
            l.url(),
            "https://192.0.2.10:10350/exec/default/p1/c1?command=echo&command=hi&error=1&output=1"
        );
    }

    #[test]
    fn exec_all_flags_and_escaping() {
        let (p1, _, n) = fixture();
        let l = loc(
            ConnectKind::Exec,
            &p1,
            &n,
            "command=sh&command=-c&command=echo+a%26b&stdin=true&stdout=true&stderr=false&tty=true",
        )
        .unwrap();
        assert_eq!(
            l.query,
            "command=sh&command=-c&command=echo+a%26b&input=1&output=1&tty=1"
        );
    }

    #[test]
    fn exec_errors() {
        let (p1, multi, n) = fixture();
        let e = loc(ConnectKind::Exec, &multi, &n, "command=ls&stdout=true").unwrap_err();
        assert_eq!(e.code.as_u16(), 400);
        assert!(e.message.contains("choose one of: [a b]"));
        let l = loc(
            ConnectKind::Exec,
            &multi,
            &n,
            "command=ls&stdout=true&container=b",
        )
        .unwrap();
        assert_eq!(l.path, "/exec/ns2/multi/b");
        assert!(loc(ConnectKind::Exec, &p1, &n, "stdout=true").is_err());
        assert!(loc(ConnectKind::Exec, &p1, &n, "command=ls").is_err());
        assert!(loc(
            ConnectKind::Exec,
            &p1,
            &n,
            "command=ls&stdout=1&container=zz"
        )
        .is_err());
    }

    #[test]
    fn attach_has_no_command() {
        let (p1, _, n) = fixture();
        let l = loc(
            ConnectKind::Attach,
            &p1,
            &n,
            "command=ignored&stdin=true&stdout=true&tty=true",
        )
        .unwrap();
        assert_eq!(l.path, "/attach/default/p1/c1");
        assert_eq!(l.query, "input=1&output=1&tty=1");
    }

    #[test]
    fn portforward_paths() {
        let (p1, _, n) = fixture();
        let l = loc(ConnectKind::PortForward, &p1, &n, "").unwrap();
        assert_eq!(l.path, "/portForward/default/p1");
        assert_eq!(l.query, "");
        let l = loc(
            ConnectKind::PortForward,
            &p1,
            &n,
            "ports=80&ports=8080,9090",
        )
        .unwrap();
        assert_eq!(l.query, "port=80&port=8080&port=9090");
        assert!(loc(ConnectKind::PortForward, &p1, &n, "ports=0").is_err());
        assert!(loc(ConnectKind::PortForward, &p1, &n, "ports=x").is_err());
    }

    #[test]
    fn subresource_names() {
        assert_eq!(
            ConnectKind::from_subresource("exec"),
            Some(ConnectKind::Exec)
        );
        assert_eq!(
            ConnectKind::from_subresource("portforward"),
            Some(ConnectKind::PortForward)
        );
        assert_eq!(ConnectKind::from_subresource("log"), None);
    }
}
