//! API discovery kubectl needs before anything else: `/api` (APIVersions), `/apis`
//! (an empty legacy APIGroupList, even when aggregated discovery is asked for), `/api/v1`
//! (APIResourceList with pods, their connect subresources, nodes, nodes/proxy) and
//! `/version`. Always `application/json`.

use serde_json::{json, Value};

/// The version this stand-in claims to be.
pub const MAJOR: &str = "1";
pub const MINOR: &str = "30";
pub const GIT_VERSION: &str = "v1.30.0-apiserver-sim";

/// `GET /api`.
pub fn api_versions(server_address: &str) -> Value {
    json!({
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [
            {"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}
        ]
    })
}

/// `GET /apis`.
pub fn api_group_list() -> Value {
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": []})
}

fn resource(name: &str, singular: &str, namespaced: bool, kind: &str, verbs: &[&str]) -> Value {
    json!({
        "name": name,
        "singularName": singular,
        "namespaced": namespaced,
        "kind": kind,
        "verbs": verbs,
    })
}

/// `GET /api/v1`.
pub fn core_v1_resources() -> Value {
    let crud = [
        "create",
        "delete",
        "deletecollection",
        "get",
        "list",
        "patch",
        "update",
        "watch",
    ];
    let mut pods = resource("pods", "pod", true, "Pod", &crud);
    pods["shortNames"] = json!(["po"]);
    pods["categories"] = json!(["all"]);
    let mut nodes = resource("nodes", "node", false, "Node", &crud);
    nodes["shortNames"] = json!(["no"]);
    json!({
        "kind": "APIResourceList",
        "groupVersion": "v1",
        "resources": [
            nodes,
            resource("nodes/proxy", "", false, "NodeProxyOptions", &["create", "delete", "get", "patch", "update"]),
            resource("nodes/status", "", false, "Node", &["get", "patch", "update"]),
            pods,
            resource("pods/attach", "", true, "PodAttachOptions", &["create", "get"]),
            resource("pods/exec", "", true, "PodExecOptions", &["create", "get"]),
            resource("pods/log", "", true, "Pod", &["get"]),
            resource("pods/portforward", "", true, "PodPortForwardOptions", &["create", "get"]),
            resource("pods/status", "", true, "Pod", &["get", "patch", "update"]),
        ]
    })
}

/// `GET /version`.
pub fn version() -> Value {
    json!({
        "major": MAJOR,
        "minor": MINOR,
        "gitVersion": GIT_VERSION,
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2024-01-01T00:00:00Z",
        "goVersion": "go1.22.0",
        "compiler": "gc",
        "platform": "linux/amd64"
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resources_named() {
        let v = core_v1_resources();
        let names: Vec<&str> = v["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["name"].as_str().unwrap())
            .collect();
        for n in [
            "pods",
            "pods/exec",
            "pods/log",
            "pods/attach",
            "pods/portforward",
            "nodes",
            "nodes/proxy",
        ] {
            assert!(names.contains(&n), "{n}");
        }
        assert_eq!(api_versions("127.0.0.1:6443")["versions"][0], "v1");
        assert_eq!(version()["major"], "1");
    }
}
