//! The simulated cluster: nodes (status address + kubelet port) and pods (node and
//! containers), parsed from `--node`, `--pod` and `--pods-file`, plus the kubelet
//! host/port formatting the apiserver derives from a node.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;

/// The kubelet port used when `--node` gives none.
pub const DEFAULT_KUBELET_PORT: u16 = 10250;
/// Bound on a `--pods-file`.
const MAX_PODS_FILE: u64 = 4 * 1024 * 1024;

/// A node: its first preferred status address and its kubelet port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub name: String,
    /// IP address or DNS name (no brackets).
    pub address: String,
    pub port: u16,
}

impl Node {
    /// Parses `NAME=ADDRESS[:PORT]`; IPv6 addresses as `[::1]:10250` or bare `::1`.
    pub fn parse(spec: &str) -> Result<Node> {
        let (name, addr) = spec
            .split_once('=')
            .ok_or_else(|| anyhow!("--node {spec:?}: expected NAME=ADDRESS[:PORT]"))?;
        let name = name.trim();
        validate_name(name).with_context(|| format!("--node {spec:?}: node name"))?;
        let (address, port) =
            split_host_port(addr.trim()).with_context(|| format!("--node {spec:?}: address"))?;
        Ok(Node {
            name: name.to_string(),
            address,
            port: port.unwrap_or(DEFAULT_KUBELET_PORT),
        })
    }

    /// Whether the status address is an IP (then Go sends no SNI and the node status
    /// address type is `InternalIP`; otherwise `Hostname`).
    pub fn address_is_ip(&self) -> bool {
        self.address.parse::<IpAddr>().is_ok()
    }

    /// `host:port` as the apiserver writes it in the kubelet URL (`net.JoinHostPort`).
    pub fn host_port(&self) -> String {
        join_host_port(&self.address, self.port)
    }
}

/// `net.JoinHostPort`: brackets around hosts containing a colon.
pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Splits `host[:port]`, `[v6][:port]` or a bare IPv6 address.
pub fn split_host_port(s: &str) -> Result<(String, Option<u16>)> {
    if s.is_empty() {
        bail!("empty address");
    }
    if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| anyhow!("missing ']' in {s:?}"))?;
        let port = match after {
            "" => None,
            p => Some(parse_port(
                p.strip_prefix(':')
                    .ok_or_else(|| anyhow!("garbage after ']' in {s:?}"))?,
            )?),
        };
        return Ok((host.to_string(), port));
    }
    match s.matches(':').count() {
        0 => Ok((s.to_string(), None)),
        1 => {
            let (h, p) = s.split_once(':').unwrap_or((s, ""));
            if h.is_empty() {
                bail!("empty host in {s:?}");
            }
            Ok((h.to_string(), Some(parse_port(p)?)))
        }
        _ => {
            s.parse::<IpAddr>()
                .with_context(|| format!("{s:?} is neither host:port nor an IPv6 address"))?;
            Ok((s.to_string(), None))
        }
    }
}

fn parse_port(p: &str) -> Result<u16> {
    let port: u16 = p.parse().with_context(|| format!("bad port {p:?}"))?;
    if port == 0 {
        bail!("port 0");
    }
    Ok(port)
}

/// A container of a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Container {
    pub name: String,
    pub image: String,
}

/// A pod bound to a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    pub namespace: String,
    pub name: String,
    pub node: String,
    pub containers: Vec<Container>,
}

const DEFAULT_IMAGE: &str = "registry.k8s.io/e2e-test-images/busybox:1.36.1-1";

impl Pod {
    /// Parses `ns/name=node:c1,c2` (namespace defaults to `default`; a container may be
    /// written `name@image`).
    pub fn parse(spec: &str) -> Result<Pod> {
        let (id, rest) = spec.split_once('=').ok_or_else(|| {
            anyhow!("--pod {spec:?}: expected ns/name=node:container[,container]")
        })?;
        let (namespace, name) = id.trim().split_once('/').unwrap_or(("default", id.trim()));
        let (node, containers) = rest
            .split_once(':')
            .ok_or_else(|| anyhow!("--pod {spec:?}: expected node:container[,container]"))?;
        let containers = containers
            .split(',')
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(|c| {
                let (name, image) = c.split_once('@').unwrap_or((c, DEFAULT_IMAGE));
                Container {
                    name: name.to_string(),
                    image: image.to_string(),
                }
            })
            .collect();
        let pod = Pod {
            namespace: namespace.to_string(),
            name: name.to_string(),
            node: node.trim().to_string(),
            containers,
        };
        pod.validate().with_context(|| format!("--pod {spec:?}"))?;
        Ok(pod)
    }

    fn validate(&self) -> Result<()> {
        validate_name(&self.namespace).context("namespace")?;
        validate_name(&self.name).context("pod name")?;
        validate_name(&self.node).context("node name")?;
        if self.containers.is_empty() {
            bail!("a pod needs at least one container");
        }
        for c in &self.containers {
            validate_name(&c.name).context("container name")?;
        }
        Ok(())
    }

    /// A stable pseudo-UID derived from namespace and name.
    pub fn uid(&self) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self
            .namespace
            .bytes()
            .chain([b'/'])
            .chain(self.name.bytes())
        {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        let h2 = h.rotate_left(17) ^ 0x9e37_79b9_7f4a_7c15;
        format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            h >> 32,
            (h >> 16) & 0xffff,
            h & 0xfff,
            h2 & 0xfff,
            h2 >> 16
        )
    }

    /// The container a connect/log request addresses, with the apiserver's defaulting:
    /// the only container when none is named.
    pub fn pick_container(&self, requested: Option<&str>) -> Result<&Container, String> {
        match requested.filter(|c| !c.is_empty()) {
            Some(name) => self
                .containers
                .iter()
                .find(|c| c.name == name)
                .ok_or_else(|| format!("container {name} is not valid for pod {}", self.name)),
            None => match self.containers.as_slice() {
                [only] => Ok(only),
                many => Err(format!(
                    "a container name must be specified for pod {}, choose one of: [{}]",
                    self.name,
                    many.iter()
                        .map(|c| c.name.as_str())
                        .collect::<Vec<_>>()
                        .join(" ")
                )),
            },
        }
    }
}

/// Names are restricted to DNS-label-ish characters so they are safe in paths and JSON.
fn validate_name(s: &str) -> Result<()> {
    if s.is_empty() || s.len() > 253 {
        bail!("{s:?}: must be 1..253 characters");
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
    {
        bail!("{s:?}: only letters, digits, '-', '.', '_' allowed");
    }
    Ok(())
}

/// A `--pods-file` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PodFileEntry {
    #[serde(default = "default_namespace")]
    namespace: String,
    name: String,
    node: String,
    containers: Vec<PodFileContainer>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum PodFileContainer {
    Name(String),
    Full { name: String, image: Option<String> },
}

fn default_namespace() -> String {
    "default".into()
}

/// Reads a JSON array of `{"namespace","name","node","containers":["c1" | {"name","image"}]}`.
pub fn read_pods_file(path: &Path) -> Result<Vec<Pod>> {
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if meta.len() > MAX_PODS_FILE {
        bail!("{} is larger than {MAX_PODS_FILE} bytes", path.display());
    }
    let text = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let entries: Vec<PodFileEntry> = serde_json::from_slice(&text)
        .with_context(|| format!("parsing {} as a JSON array of pods", path.display()))?;
    entries
        .into_iter()
        .map(|e| {
            let pod = Pod {
                namespace: e.namespace,
                name: e.name,
                node: e.node,
                containers: e
                    .containers
                    .into_iter()
                    .map(|c| match c {
                        PodFileContainer::Name(name) => Container {
                            name,
                            image: DEFAULT_IMAGE.into(),
                        },
                        PodFileContainer::Full { name, image } => Container {
                            name,
                            image: image.unwrap_or_else(|| DEFAULT_IMAGE.into()),
                        },
                    })
                    .collect(),
            };
            pod.validate().with_context(|| {
                format!("{}: pod {}/{}", path.display(), pod.namespace, pod.name)
            })?;
            Ok(pod)
        })
        .collect()
}

/// All nodes and pods, keyed for lookup.
#[derive(Debug, Default)]
pub struct Cluster {
    pub nodes: BTreeMap<String, Node>,
    /// Keyed by (namespace, name).
    pub pods: BTreeMap<(String, String), Pod>,
}

impl Cluster {
    /// Builds the cluster, rejecting duplicates and pods on undeclared nodes.
    pub fn new(nodes: Vec<Node>, pods: Vec<Pod>) -> Result<Cluster> {
        let mut c = Cluster::default();
        for n in nodes {
            if c.nodes.contains_key(&n.name) {
                bail!("node {} declared twice", n.name);
            }
            c.nodes.insert(n.name.clone(), n);
        }
        for p in pods {
            if !c.nodes.contains_key(&p.node) {
                bail!(
                    "pod {}/{} is on node {} which no --node declares",
                    p.namespace,
                    p.name,
                    p.node
                );
            }
            let key = (p.namespace.clone(), p.name.clone());
            if c.pods.contains_key(&key) {
                bail!("pod {}/{} declared twice", p.namespace, p.name);
            }
            c.pods.insert(key, p);
        }
        Ok(c)
    }

    pub fn pod(&self, namespace: &str, name: &str) -> Option<&Pod> {
        self.pods.get(&(namespace.to_string(), name.to_string()))
    }

    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.get(name)
    }

    pub fn pods_in<'a>(&'a self, namespace: Option<&'a str>) -> impl Iterator<Item = &'a Pod> + 'a {
        self.pods
            .values()
            .filter(move |p| namespace.is_none_or(|ns| p.namespace == ns))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_specs() {
        let n = Node::parse("edge-1=10.0.0.5").unwrap();
        assert_eq!((n.address.as_str(), n.port), ("10.0.0.5", 10250));
        assert!(n.address_is_ip());
        assert_eq!(n.host_port(), "10.0.0.5:10250");
        let n = Node::parse("edge-2=edge-2.example:10350").unwrap();
        assert_eq!((n.address.as_str(), n.port), ("edge-2.example", 10350));
        assert!(!n.address_is_ip());
        let n = Node::parse("e=[fd00::1]:10350").unwrap();
        assert_eq!((n.address.as_str(), n.port), ("fd00::1", 10350));
        assert_eq!(n.host_port(), "[fd00::1]:10350");
        let n = Node::parse("e=fd00::2").unwrap();
        assert_eq!((n.address.as_str(), n.port), ("fd00::2", 10250));
        for bad in [
            "noequals", "=1.2.3.4", "e=", "e=host:0", "e=host:x", "e=[::1", "e=a:b:c",
        ] {
            assert!(Node::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn pod_specs_and_container_defaulting() {
        let p = Pod::parse("kube-system/p1=edge-1:c1,c2@nginx").unwrap();
        assert_eq!(p.namespace, "kube-system");
        assert_eq!(p.containers[1].image, "nginx");
        assert!(p
            .pick_container(None)
            .unwrap_err()
            .contains("choose one of: [c1 c2]"));
        assert_eq!(p.pick_container(Some("c2")).unwrap().name, "c2");
        assert!(p.pick_container(Some("c3")).is_err());
        let p = Pod::parse("p1=edge-1:c1").unwrap();
        assert_eq!(p.namespace, "default");
        assert_eq!(p.pick_container(None).unwrap().name, "c1");
        assert_eq!(p.pick_container(Some("")).unwrap().name, "c1");
        for bad in ["p1", "p1=edge", "p1=edge:", "a/b/c=edge:c", "p 1=edge:c"] {
            assert!(Pod::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(p.uid().len(), 36);
    }

    #[test]
    fn cluster_checks_nodes() {
        let n = Node::parse("edge-1=127.0.0.1").unwrap();
        let p = Pod::parse("p1=edge-2:c1").unwrap();
        assert!(Cluster::new(vec![n.clone()], vec![p]).is_err());
        let p = Pod::parse("p1=edge-1:c1").unwrap();
        let c = Cluster::new(vec![n], vec![p]).unwrap();
        assert!(c.pod("default", "p1").is_some());
        assert_eq!(c.pods_in(Some("other")).count(), 0);
    }
}
