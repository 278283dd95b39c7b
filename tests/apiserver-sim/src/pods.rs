//! The v1 `Pod` and `Node` objects (and their lists) the simulator serves, built from the
//! simulated cluster: enough for kubectl's get/logs/exec/port-forward flows.

use serde_json::{json, Value};

use crate::cluster::{Cluster, Node, Pod};

use crate::clock;

/// A v1 Pod, Running, every container ready.
pub fn pod_json(pod: &Pod, node: Option<&Node>) -> Value {
    let created = clock::created();
    let uid = pod.uid();
    let containers: Vec<Value> = pod
        .containers
        .iter()
        .map(|c| {
            json!({
                "name": c.name,
                "image": c.image,
                "imagePullPolicy": "IfNotPresent",
                "resources": {},
                "terminationMessagePath": "/dev/termination-log",
                "terminationMessagePolicy": "File"
            })
        })
        .collect();
    let statuses: Vec<Value> = pod
        .containers
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({
                "name": c.name,
                "image": c.image,
                "imageID": "",
                "containerID": format!("containerd://{}{:02x}", uid.replace('-', ""), i),
                "ready": true,
                "started": true,
                "restartCount": 0,
                "state": {"running": {"startedAt": created}},
                "lastState": {}
            })
        })
        .collect();
    let host_ip = node
        .filter(|n| n.address_is_ip())
        .map(|n| n.address.clone());
    let mut status = json!({
        "phase": "Running",
        "conditions": [
            {"type": "Initialized", "status": "True", "lastTransitionTime": created},
            {"type": "Ready", "status": "True", "lastTransitionTime": created},
            {"type": "ContainersReady", "status": "True", "lastTransitionTime": created},
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": created}
        ],
        "startTime": created,
        "qosClass": "BestEffort",
        "containerStatuses": statuses
    });
    if let Some(ip) = host_ip {
        status["hostIP"] = json!(ip);
    }
    json!({
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": pod.name,
            "namespace": pod.namespace,
            "uid": uid,
            "resourceVersion": "1",
            "creationTimestamp": created
        },
        "spec": {
            "nodeName": pod.node,
            "containers": containers,
            "restartPolicy": "Always",
            "dnsPolicy": "ClusterFirst",
            "schedulerName": "default-scheduler",
            "terminationGracePeriodSeconds": 30
        },
        "status": status
    })
}

/// A v1 PodList of the pods in `namespace` (all namespaces if `None`).
pub fn pod_list_json(cluster: &Cluster, namespace: Option<&str>) -> Value {
    let items: Vec<Value> = cluster
        .pods_in(namespace)
        .map(|p| pod_json(p, cluster.node(&p.node)))
        .collect();
    json!({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items})
}

/// A v1 Node, Ready, whose only status address is the configured one.
pub fn node_json(node: &Node) -> Value {
    let created = clock::created();
    let addr_type = if node.address_is_ip() {
        "InternalIP"
    } else {
        "Hostname"
    };
    json!({
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": node.name,
            "uid": format!("node-{}", node.name),
            "resourceVersion": "1",
            "creationTimestamp": created,
            "labels": {
                "kubernetes.io/hostname": node.name,
                "kubernetes.io/os": "linux",
                "node-role.kubernetes.io/edge": ""
            }
        },
        "spec": {},
        "status": {
            "addresses": [{"type": addr_type, "address": node.address}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": node.port}},
            "conditions": [{
                "type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "kubelet is posting ready status",
                "lastHeartbeatTime": created, "lastTransitionTime": created
            }],
            "nodeInfo": {
                "kubeletVersion": "v1.30.0",
                "containerRuntimeVersion": "containerd://1.7.0",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "osImage": "apiserver-sim",
                "kernelVersion": "", "kubeProxyVersion": "", "machineID": "", "systemUUID": "", "bootID": ""
            }
        }
    })
}

/// A v1 NodeList.
pub fn node_list_json(cluster: &Cluster) -> Value {
    let items: Vec<Value> = cluster.nodes.values().map(node_json).collect();
    json!({"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_and_node_shape() {
        let n = Node::parse("edge-1=192.0.2.1:10350").unwrap();
        let p = Pod::parse("default/p1=edge-1:c1,c2").unwrap();
        let c = Cluster::new(vec![n.clone()], vec![p.clone()]).unwrap();
        let v = pod_json(&p, Some(&n));
        assert_eq!(v["spec"]["nodeName"], "edge-1");
        assert_eq!(v["spec"]["containers"][1]["name"], "c2");
        assert_eq!(v["status"]["phase"], "Running");
        assert_eq!(v["status"]["containerStatuses"][0]["ready"], true);
        assert_eq!(v["metadata"]["uid"], p.uid());
        let nv = node_json(&n);
        assert_eq!(nv["status"]["addresses"][0]["type"], "InternalIP");
        assert_eq!(
            nv["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"],
            10350
        );
        assert_eq!(
            pod_list_json(&c, Some("default"))["items"]
                .as_array()
                .unwrap()
                .len(),
            1
        );
        assert_eq!(
            pod_list_json(&c, Some("x"))["items"]
                .as_array()
                .unwrap()
                .len(),
            0
        );
        assert_eq!(node_list_json(&c)["items"][0]["metadata"]["name"], "edge-1");
        let dns = Node::parse("edge-2=edge-2.example").unwrap();
        assert_eq!(
            node_json(&dns)["status"]["addresses"][0]["type"],
            "Hostname"
        );
    }
}
