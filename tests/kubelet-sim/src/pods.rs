//! The fake pods this kubelet runs: lookup by namespace/name(/uid)/container
//! and the `/pods` and `/runningpods/` PodList documents.

use serde_json::{json, Value};

use crate::config::PodSpec;

/// The registry of configured pods.
#[derive(Debug, Clone)]
pub struct Pods {
    node: String,
    pods: Vec<PodSpec>,
}

impl Pods {
    pub fn new(node: String, pods: Vec<PodSpec>) -> Self {
        Self { node, pods }
    }

    pub fn all(&self) -> &[PodSpec] {
        &self.pods
    }

    /// Find a pod; when `uid` is given it must match too.
    pub fn find(&self, namespace: &str, name: &str, uid: Option<&str>) -> Option<&PodSpec> {
        self.pods.iter().find(|p| {
            p.namespace == namespace
                && p.name == name
                && match uid {
                    None => true,
                    Some(u) => u == p.uid,
                }
        })
    }

    /// Find a pod's container.
    pub fn find_container(
        &self,
        namespace: &str,
        name: &str,
        uid: Option<&str>,
        container: &str,
    ) -> Option<&PodSpec> {
        self.find(namespace, name, uid)
            .filter(|p| p.containers.iter().any(|c| c == container))
    }

    fn pod_json(&self, p: &PodSpec, running: bool) -> Value {
        let containers: Vec<Value> = p
            .containers
            .iter()
            .map(|c| json!({"name": c, "image": "registry.k8s.io/pause:3.9"}))
            .collect();
        let statuses: Vec<Value> = p
            .containers
            .iter()
            .map(|c| {
                json!({
                    "name": c,
                    "ready": true,
                    "restartCount": 0,
                    "image": "registry.k8s.io/pause:3.9",
                    "imageID": "",
                    "containerID": format!("sim://{}-{}", p.uid, c),
                    "started": true,
                    "state": {"running": {"startedAt": "2024-01-01T00:00:00Z"}}
                })
            })
            .collect();
        if running {
            return json!({
                "metadata": {"name": p.name, "namespace": p.namespace, "uid": p.uid,
                              "creationTimestamp": null},
                "spec": {"containers": containers},
                "status": {}
            });
        }
        json!({
            "metadata": {
                "name": p.name,
                "namespace": p.namespace,
                "uid": p.uid,
                "creationTimestamp": "2024-01-01T00:00:00Z",
                "annotations": {"kubernetes.io/config.source": "api"}
            },
            "spec": {"nodeName": self.node, "containers": containers},
            "status": {
                "phase": "Running",
                "hostIP": "127.0.0.1",
                "podIP": "127.0.0.1",
                "startTime": "2024-01-01T00:00:00Z",
                "containerStatuses": statuses
            }
        })
    }

    /// The `/pods` answer: a v1 PodList.
    pub fn pod_list(&self) -> Value {
        json!({
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {},
            "items": self.pods.iter().map(|p| self.pod_json(p, false)).collect::<Vec<_>>()
        })
    }

    /// The `/runningpods/` answer: a PodList as the container runtime sees it.
    pub fn running_pods(&self) -> Value {
        json!({
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {},
            "items": self.pods.iter().map(|p| self.pod_json(p, true)).collect::<Vec<_>>()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_pod_spec;

    #[test]
    fn lookup_and_list() {
        let pods = Pods::new(
            "edge-1".into(),
            vec![parse_pod_spec("ns/p/u1=a,b").expect("spec")],
        );
        assert!(pods.find_container("ns", "p", None, "a").is_some());
        assert!(pods.find_container("ns", "p", Some("u1"), "b").is_some());
        assert!(pods.find_container("ns", "p", Some("u2"), "b").is_none());
        assert!(pods.find_container("ns", "p", None, "c").is_none());
        let list = pods.pod_list();
        assert_eq!(list["kind"], "PodList");
        assert_eq!(list["items"][0]["metadata"]["uid"], "u1");
        assert_eq!(list["items"][0]["spec"]["nodeName"], "edge-1");
        assert_eq!(list["items"][0]["spec"]["containers"][1]["name"], "b");
        assert_eq!(list["items"][0]["status"]["phase"], "Running");
    }
}
