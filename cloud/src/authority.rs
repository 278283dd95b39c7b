//! The apiserver as the routing authority: which node runs each pod and which
//! addresses each node has, as the kube-apiserver says — never as an edge says.
//!
//! [`Authority`] is the table routing consults: namespace/pod → `spec.nodeName`
//! and node → `status.addresses` (and the reverse, address → nodes). It is fed
//! by [`watch`], which lists and watches pods and nodes with `kube`'s watcher
//! (a list, then a watch from its `resourceVersion`; on `410 Gone` or any
//! failure it backs off and lists again, and the new list replaces the table
//! atomically). Every list must be done within `--apiserver-sync-timeout`,
//! every read on the connection within `--apiserver-read-timeout` (300 s by
//! default, above the [`WATCH_SILENCE`] of an idle watch): an apiserver that
//! stops answering is logged, naming the flag, and asked again, never waited
//! for forever. Edge pod reports and hello addresses are only hints checked
//! against this table by the [`crate::registry`]: a hint naming another node's
//! pod or address is refused, logged with both nodes and counted.
//!
//! Running without an apiserver (routing by what edges report) needs
//! `--insecure-trust-edge-reports`; without it, a cloud that cannot reach the
//! apiserver and finish its first list does not start.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, ResourceExt};
use tokio::sync::watch as tokio_watch;
use tracing::{info, warn};

use crate::registry::host_only;

#[derive(Default)]
struct Tables {
    /// (namespace, pod) → the node it is bound to (`None`: not scheduled yet).
    pods: HashMap<(String, String), Option<String>>,
    /// node → its status addresses (normalized as [`host_only`]).
    node_addresses: HashMap<String, Vec<String>>,
    /// address → nodes that have it.
    addresses: HashMap<String, BTreeSet<String>>,
}

/// What the apiserver says about pods and nodes (see the module doc).
#[derive(Default)]
pub struct Authority {
    tables: Mutex<Tables>,
}

/// What the authority knows about a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodPlacement {
    /// The apiserver has no such pod.
    Unknown,
    /// The pod exists but is not bound to a node.
    Unscheduled,
    /// The pod is bound to this node.
    On(String),
}

impl Authority {
    pub fn new() -> Self {
        Self::default()
    }

    fn tables(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the apiserver says `namespace/pod` runs.
    pub fn pod(&self, namespace: &str, pod: &str) -> PodPlacement {
        match self
            .tables()
            .pods
            .get(&(namespace.to_string(), pod.to_string()))
        {
            None => PodPlacement::Unknown,
            Some(None) => PodPlacement::Unscheduled,
            Some(Some(n)) => PodPlacement::On(n.clone()),
        }
    }

    /// The nodes whose status lists `address` (a host, normalized).
    pub fn address_nodes(&self, address: &str) -> BTreeSet<String> {
        self.tables()
            .addresses
            .get(&host_only(address))
            .cloned()
            .unwrap_or_default()
    }

    /// Sets (or, with `node: None` after a delete, removes) a pod.
    pub fn set_pod(&self, namespace: &str, name: &str, node: Option<Option<String>>) {
        let key = (namespace.to_string(), name.to_string());
        let mut t = self.tables();
        match node {
            Some(n) => t.pods.insert(key, n),
            None => t.pods.remove(&key),
        };
    }

    /// Replaces every pod (after a list).
    pub fn replace_pods(&self, pods: impl IntoIterator<Item = ((String, String), Option<String>)>) {
        let pods = pods.into_iter().collect();
        self.tables().pods = pods;
    }

    /// Sets a node's addresses (`None`: the node was deleted).
    pub fn set_node(&self, node: &str, addresses: Option<Vec<String>>) {
        let mut t = self.tables();
        Self::unindex_node(&mut t, node);
        if let Some(addrs) = addresses {
            Self::index_node(&mut t, node, addrs);
        }
    }

    /// Replaces every node (after a list).
    pub fn replace_nodes(&self, nodes: impl IntoIterator<Item = (String, Vec<String>)>) {
        let mut t = self.tables();
        t.node_addresses.clear();
        t.addresses.clear();
        for (n, a) in nodes {
            Self::index_node(&mut t, &n, a);
        }
    }

    fn unindex_node(t: &mut Tables, node: &str) {
        for a in t.node_addresses.remove(node).unwrap_or_default() {
            if let Some(nodes) = t.addresses.get_mut(&a) {
                nodes.remove(node);
                if nodes.is_empty() {
                    t.addresses.remove(&a);
                }
            }
        }
    }

    fn index_node(t: &mut Tables, node: &str, addresses: Vec<String>) {
        let addrs: Vec<String> = addresses
            .iter()
            .map(|a| host_only(a))
            .filter(|a| !a.is_empty())
            .collect();
        for a in &addrs {
            t.addresses
                .entry(a.clone())
                .or_default()
                .insert(node.to_string());
        }
        t.node_addresses.insert(node.to_string(), addrs);
    }
}

/// A pod's key and placement as the apiserver reports it.
fn pod_entry(p: &Pod) -> ((String, String), Option<String>) {
    (
        (p.namespace().unwrap_or_default(), p.name_any()),
        p.spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .filter(|n| !n.is_empty()),
    )
}

/// A node's name and status addresses.
fn node_entry(n: &Node) -> (String, Vec<String>) {
    (
        n.name_any(),
        n.status
            .as_ref()
            .and_then(|s| s.addresses.as_ref())
            .map(|a| a.iter().map(|a| a.address.clone()).collect())
            .unwrap_or_default(),
    )
}

/// A client for the apiserver: from `kubeconfig` if given, else the in-cluster
/// service account (never a guess from `~/.kube/config`).
pub async fn client(kubeconfig: Option<&Path>, read_timeout: Duration) -> anyhow::Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading the kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("using the kubeconfig {}", path.display()))?
        }
        None => kube::Config::incluster().context(
            "no apiserver: not running in a pod (no in-cluster service account) and no \
             --apiserver-kubeconfig; the cloud routes by what the apiserver says. To route \
             by what edges report instead (unsafe: an edge can claim another node's pods), \
             pass --insecure-trust-edge-reports",
        )?,
    };
    client_of(config, read_timeout)
}

/// The client of `config`, every read bounded by `read_timeout`
/// (`--apiserver-read-timeout`; kube's default is none), counted from each
/// request sent rather than from when its pooled connection went idle.
fn client_of(mut config: kube::Config, read_timeout: Duration) -> anyhow::Result<Client> {
    config.read_timeout = Some(read_timeout);
    config.reset_reader_on_write = true;
    Client::try_from(config).context("building the apiserver client")
}

/// Longest an idle watch is silent: kube-runtime asks the apiserver to end
/// a watch after 290 s and gives up on a silent one 5 s later. The default
/// `--apiserver-read-timeout` (300 s) is above it, so an idle watch is never
/// cut, but no request (a list, a watch being opened) waits for an apiserver
/// that stopped answering forever. A shorter one is accepted (a test, or an
/// operator who wants a hung apiserver noticed sooner) and warned about: an
/// idle watch is then cut after it and opened again from its
/// `resourceVersion` (no new list), with a warning each time.
pub const WATCH_SILENCE: Duration = Duration::from_secs(295);

/// Whether `e` (or an error under it) is a read that timed out: the
/// apiserver was silent for `--apiserver-read-timeout`.
fn is_read_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        next = e.source();
    }
    false
}

/// A watcher of pods or nodes whose every list is bounded.
///
/// kube-runtime bounds an idle watch but not the list it starts with (again
/// after `410 Gone` or an error): an apiserver that takes a list and never
/// answers it would stall the watch for good, and routing would go on with
/// the table of the last list without a word. A list not done within
/// `list_timeout` (`--apiserver-sync-timeout`, the first list's own bound)
/// is logged as stalled and the watcher started anew; the table keeps the
/// last complete list meanwhile.
struct BoundedWatch<K> {
    api: Api<K>,
    /// What is watched, for the logs: "pods", "nodes".
    what: &'static str,
    list_timeout: Duration,
    /// The client's `--apiserver-read-timeout`, for the logs.
    read_timeout: Duration,
    events: futures_util::stream::BoxStream<'static, Result<Event<K>, watcher::Error>>,
    /// While a list is under way: when it must be done.
    list_deadline: Option<tokio::time::Instant>,
}

impl<K> BoundedWatch<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    fn new(
        api: Api<K>,
        what: &'static str,
        list_timeout: Duration,
        read_timeout: Duration,
    ) -> Self {
        let events = Self::start(&api);
        BoundedWatch {
            api,
            what,
            list_timeout,
            read_timeout,
            events,
            list_deadline: None,
        }
    }

    fn start(
        api: &Api<K>,
    ) -> futures_util::stream::BoxStream<'static, Result<Event<K>, watcher::Error>> {
        watcher::watcher(api.clone(), watcher::Config::default())
            .default_backoff()
            .boxed()
    }

    /// The next event; errors are logged (and the watcher recovers by
    /// itself), a stalled list restarts it.
    async fn next(&mut self) -> Event<K> {
        let what = self.what;
        loop {
            let next = match self.list_deadline {
                None => self.events.next().await,
                Some(deadline) => match tokio::time::timeout_at(deadline, self.events.next()).await
                {
                    Ok(next) => next,
                    Err(_) => {
                        warn!(
                            timeout = ?self.list_timeout,
                            "listing {what} from the apiserver stalled: no complete list within \
                             --apiserver-sync-timeout; routing keeps the last list of {what}; \
                             listing again"
                        );
                        self.list_deadline = None;
                        self.events = Self::start(&self.api);
                        continue;
                    }
                },
            };
            match next {
                Some(Ok(ev)) => {
                    match ev {
                        Event::Init => {
                            self.list_deadline =
                                Some(tokio::time::Instant::now() + self.list_timeout)
                        }
                        Event::InitDone => self.list_deadline = None,
                        _ => {}
                    }
                    return ev;
                }
                Some(Err(e)) => {
                    // The backoff before the next attempt is not the list's.
                    self.list_deadline = None;
                    if is_read_timeout(&e) {
                        warn!(
                            error = %e,
                            "watching {what}: no answer from the apiserver within {:?} \
                             (--apiserver-read-timeout); asking again",
                            self.read_timeout
                        );
                    } else {
                        warn!(error = %e, "watching {what} on the apiserver failed; trying again");
                    }
                }
                // The watcher's stream does not end; should it, start anew.
                None => self.events = Self::start(&self.api),
            }
        }
    }
}

/// Starts watching pods and nodes into a new [`Authority`]; returns once both
/// first lists are in, or fails after `sync_timeout`. The watches run (and
/// re-list after errors, `410 Gone` included, each list again within
/// `sync_timeout`: see [`BoundedWatch`]) until the process ends.
/// `read_timeout` is the one `client` was built with (for the logs).
pub async fn watch(
    client: Client,
    sync_timeout: Duration,
    read_timeout: Duration,
) -> anyhow::Result<Arc<Authority>> {
    let authority = Arc::new(Authority::new());
    let (pods_tx, mut pods_rx) = tokio_watch::channel(false);
    let (nodes_tx, mut nodes_rx) = tokio_watch::channel(false);
    let a = authority.clone();
    let mut pods = BoundedWatch::new(
        Api::<Pod>::all(client.clone()),
        "pods",
        sync_timeout,
        read_timeout,
    );
    tokio::spawn(async move {
        let mut buffer = Vec::new();
        loop {
            match pods.next().await {
                Event::Init => buffer.clear(),
                Event::InitApply(p) => buffer.push(pod_entry(&p)),
                Event::InitDone => {
                    info!(pods = buffer.len(), "listed pods from the apiserver");
                    a.replace_pods(std::mem::take(&mut buffer));
                    let _ = pods_tx.send(true);
                }
                Event::Apply(p) => {
                    let (k, n) = pod_entry(&p);
                    a.set_pod(&k.0, &k.1, Some(n));
                }
                Event::Delete(p) => {
                    let (k, _) = pod_entry(&p);
                    a.set_pod(&k.0, &k.1, None);
                }
            }
        }
    });
    let a = authority.clone();
    let mut nodes = BoundedWatch::new(
        Api::<Node>::all(client),
        "nodes",
        sync_timeout,
        read_timeout,
    );
    tokio::spawn(async move {
        let mut buffer = Vec::new();
        loop {
            match nodes.next().await {
                Event::Init => buffer.clear(),
                Event::InitApply(n) => buffer.push(node_entry(&n)),
                Event::InitDone => {
                    info!(nodes = buffer.len(), "listed nodes from the apiserver");
                    a.replace_nodes(std::mem::take(&mut buffer));
                    let _ = nodes_tx.send(true);
                }
                Event::Apply(n) => {
                    let (name, addrs) = node_entry(&n);
                    a.set_node(&name, Some(addrs));
                }
                Event::Delete(n) => a.set_node(&n.name_any(), None),
            }
        }
    });
    let synced = async {
        pods_rx.wait_for(|s| *s).await.ok();
        nodes_rx.wait_for(|s| *s).await.ok();
    };
    tokio::time::timeout(sync_timeout, synced)
        .await
        .map_err(|_| {
            anyhow::anyhow!(
                "no complete list of pods and nodes from the apiserver within {sync_timeout:?} \
                 (see the warnings above); the cloud routes by what the apiserver says"
            )
        })?;
    Ok(authority)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_and_addresses_follow_updates_and_lists() {
        let a = Authority::new();
        a.set_pod("default", "p1", Some(Some("edge-a".into())));
        a.set_pod("default", "p2", Some(None));
        assert_eq!(a.pod("default", "p1"), PodPlacement::On("edge-a".into()));
        assert_eq!(a.pod("default", "p2"), PodPlacement::Unscheduled);
        assert_eq!(a.pod("default", "p3"), PodPlacement::Unknown);
        a.set_pod("default", "p1", None);
        assert_eq!(a.pod("default", "p1"), PodPlacement::Unknown);
        a.replace_pods([(("ns".to_string(), "x".to_string()), Some("edge-b".into()))]);
        assert_eq!(a.pod("default", "p2"), PodPlacement::Unknown);
        assert_eq!(a.pod("ns", "x"), PodPlacement::On("edge-b".into()));

        a.set_node("edge-a", Some(vec!["10.0.0.1".into(), "Edge-A.".into()]));
        a.set_node("edge-b", Some(vec!["10.0.0.1".into()]));
        assert_eq!(a.address_nodes("10.0.0.1").len(), 2);
        assert_eq!(
            a.address_nodes("edge-a:10250")
                .into_iter()
                .collect::<Vec<_>>(),
            vec!["edge-a"]
        );
        a.set_node("edge-a", Some(vec!["10.0.0.2".into()]));
        assert_eq!(
            a.address_nodes("10.0.0.1").into_iter().collect::<Vec<_>>(),
            vec!["edge-b"]
        );
        a.set_node("edge-b", None);
        assert!(a.address_nodes("10.0.0.1").is_empty());
        a.replace_nodes([("edge-c".to_string(), vec!["10.0.0.3".to_string()])]);
        assert!(a.address_nodes("10.0.0.2").is_empty());
        assert_eq!(a.address_nodes("10.0.0.3").len(), 1);
    }

    /// An apiserver stand-in (plain HTTP) for pods and nodes: the first pod
    /// list puts `default/p1` on `edge-a`; the first pod watch ends with
    /// `410 Gone`, so the watcher lists again, and that second list is
    /// taken and never answered; later lists put `p1` on `edge-b`. Node
    /// lists are empty; every other watch stays open and silent. Returns
    /// its URL and the count of pod lists asked for.
    async fn stalling_apiserver() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let pod_lists = Arc::new(AtomicUsize::new(0));
        let pod_watches = Arc::new(AtomicUsize::new(0));
        let counted = pod_lists.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (lists, watches) = (pod_lists.clone(), pod_watches.clone());
                let service = hyper::service::service_fn(move |req: hyper::Request<_>| {
                    let (lists, watches) = (lists.clone(), watches.clone());
                    async move {
                        let watch = req.uri().query().unwrap_or("").contains("watch=true");
                        let pods = req.uri().path() == "/api/v1/pods";
                        let body = match (pods, watch) {
                            (true, false) => match lists.fetch_add(1, Ordering::SeqCst) {
                                0 => pod_list("1", "edge-a"),
                                1 => std::future::pending().await,
                                _ => pod_list("3", "edge-b"),
                            },
                            (true, true) if watches.fetch_add(1, Ordering::SeqCst) == 0 => {
                                serde_json::json!({"type": "ERROR", "object": {
                                    "kind": "Status", "apiVersion": "v1", "metadata": {},
                                    "status": "Failure", "reason": "Expired", "code": 410,
                                    "message": "too old resource version"}})
                                .to_string()
                                    + "\n"
                            }
                            (false, false) => serde_json::json!({
                                "apiVersion": "v1", "kind": "NodeList",
                                "metadata": {"resourceVersion": "1"}, "items": []})
                            .to_string(),
                            (_, true) => std::future::pending().await,
                        };
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(
                            http_body_util::Full::new(bytes::Bytes::from(body)),
                        ))
                    }
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tcp), service),
                );
            }
        });
        (url, counted)
    }

    fn pod_list(version: &str, node: &str) -> String {
        serde_json::json!({
            "apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": version},
            "items": [{"metadata": {"name": "p1", "namespace": "default"},
                       "spec": {"nodeName": node, "containers": []}}]
        })
        .to_string()
    }

    /// A re-list the apiserver takes and never answers is given up after
    /// `--apiserver-sync-timeout` (1 s here) and asked again, and the next
    /// list's answer is used; before, the watcher waited on it for good and
    /// routing kept `edge-a`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_relist_is_abandoned_and_asked_again() {
        let (url, pod_lists) = stalling_apiserver().await;
        let read = Duration::from_secs(300);
        let client = client_of(kube::Config::new(url.parse().unwrap()), read).unwrap();
        let authority = watch(client, Duration::from_secs(1), read).await.unwrap();
        assert_eq!(
            authority.pod("default", "p1"),
            PodPlacement::On("edge-a".into())
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while authority.pod("default", "p1") != PodPlacement::On("edge-b".into()) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the stalled re-list was never asked again ({} pod lists)",
                pod_lists.load(std::sync::atomic::Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(pod_lists.load(std::sync::atomic::Ordering::SeqCst) >= 3);
    }
}
