//! Server-side printing: the `meta.k8s.io/v1` `Table` kubectl asks for (`Accept: …;as=Table`)
//! when it prints pods or nodes without `-o`, with the columns kube-apiserver uses.

use http::{header, HeaderMap};
use serde_json::{json, Value};

use crate::clock;
use crate::cluster::{Node, Pod};

/// Whether the client asked for a Table.
pub fn wants_table(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|a| a.contains("as=Table"))
}

fn column(name: &str, ty: &str, format: &str, priority: u8) -> Value {
    json!({"name": name, "type": ty, "format": format, "description": name, "priority": priority})
}

fn meta_object(name: &str, namespace: Option<&str>, uid: &str) -> Value {
    let mut metadata = json!({
        "name": name,
        "uid": uid,
        "resourceVersion": "1",
        "creationTimestamp": clock::created(),
    });
    if let Some(ns) = namespace {
        metadata["namespace"] = json!(ns);
    }
    json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": metadata})
}

fn table(columns: Vec<Value>, rows: Vec<Value>) -> Value {
    json!({
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": "1"},
        "columnDefinitions": columns,
        "rows": rows,
    })
}

/// Pods as kubectl's default columns.
pub fn pods<'a>(pods: impl IntoIterator<Item = &'a Pod>) -> Value {
    let age = clock::age();
    let rows = pods
        .into_iter()
        .map(|p| {
            let n = p.containers.len();
            json!({
                "cells": [p.name, format!("{n}/{n}"), "Running", 0, age, "<none>", p.node, "<none>", "<none>"],
                "object": meta_object(&p.name, Some(&p.namespace), &p.uid()),
            })
        })
        .collect();
    table(
        vec![
            column("Name", "string", "name", 0),
            column("Ready", "string", "", 0),
            column("Status", "string", "", 0),
            column("Restarts", "string", "", 0),
            column("Age", "string", "", 0),
            column("IP", "string", "", 1),
            column("Node", "string", "", 1),
            column("Nominated Node", "string", "", 1),
            column("Readiness Gates", "string", "", 1),
        ],
        rows,
    )
}

/// Nodes as kubectl's default columns.
pub fn nodes<'a>(nodes: impl IntoIterator<Item = &'a Node>) -> Value {
    let age = clock::age();
    let rows = nodes
        .into_iter()
        .map(|n| {
            json!({
                "cells": [n.name, "Ready", "edge", age, "v1.30.0", n.address, "<none>", "apiserver-sim", "", "containerd://1.7.0"],
                "object": meta_object(&n.name, None, &format!("node-{}", n.name)),
            })
        })
        .collect();
    table(
        vec![
            column("Name", "string", "name", 0),
            column("Status", "string", "", 0),
            column("Roles", "string", "", 0),
            column("Age", "string", "", 0),
            column("Version", "string", "", 0),
            column("Internal-IP", "string", "", 1),
            column("External-IP", "string", "", 1),
            column("OS-Image", "string", "", 1),
            column("Kernel-Version", "string", "", 1),
            column("Container-Runtime", "string", "", 1),
        ],
        rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn table_shape() {
        let p = Pod::parse("p1=edge-1:c1,c2").unwrap();
        let t = pods([&p]);
        assert_eq!(t["kind"], "Table");
        assert_eq!(t["rows"][0]["cells"][1], "2/2");
        assert_eq!(t["rows"][0]["object"]["metadata"]["namespace"], "default");
        let n = Node::parse("edge-1=127.0.0.1").unwrap();
        assert_eq!(nodes([&n])["rows"][0]["cells"][0], "edge-1");
        let mut h = HeaderMap::new();
        h.insert(
            header::ACCEPT,
            HeaderValue::from_static(
                "application/json;as=Table;v=v1;g=meta.k8s.io,application/json",
            ),
        );
        assert!(wants_table(&h));
        assert!(!wants_table(&HeaderMap::new()));
    }
}
