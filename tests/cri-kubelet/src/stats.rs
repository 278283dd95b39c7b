//! Node and pod statistics from what the CRI and the host give: `/stats/summary` (the
//! kubelet's Summary API JSON), `/metrics/resource` (what metrics-server scrapes) and
//! `/metrics` (the kubelet's own gauges). Containers' CPU, memory and writable layer come
//! from CRI `ListContainerStats`, start times from `ListPodSandbox`/`ListContainers`, log
//! usage from the CRI log files, the node's CPU and memory from `/proc/stat` and
//! `/proc/meminfo`. Only this stand-in's own pods are reported (several stand-ins may
//! share one containerd). Collection ([`snapshot`]) is separate from rendering, which is
//! pure.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use k8s_cri::v1 as cri;
use serde_json::{json, Value};
use time::OffsetDateTime;

use crate::cri::{RunningPod, Runtime};

/// The node's own figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeSample {
    /// Boot time (`btime` of /proc/stat).
    pub boot: Option<OffsetDateTime>,
    /// CPU time spent not idle, all cores, in nanoseconds.
    pub cpu_core_ns: u64,
    pub mem_total: u64,
    pub mem_available: u64,
    pub mem_free: u64,
}

/// One container's figures (None where the runtime gave none).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ContainerSample {
    pub name: String,
    pub start: Option<OffsetDateTime>,
    pub running: bool,
    pub cpu_core_ns: Option<u64>,
    pub nano_cores: Option<u64>,
    pub working_set: Option<u64>,
    pub usage: Option<u64>,
    pub rss: Option<u64>,
    pub page_faults: Option<u64>,
    pub major_page_faults: Option<u64>,
    pub rootfs_used: Option<u64>,
    pub rootfs_inodes: Option<u64>,
    pub logs_used: u64,
}

/// One pod's figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PodSample {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub start: Option<OffsetDateTime>,
    pub ready: bool,
    pub containers: Vec<ContainerSample>,
}

/// Everything the three endpoints render, taken at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub node: String,
    pub at: OffsetDateTime,
    pub host: NodeSample,
    pub pods: Vec<PodSample>,
}

fn rfc3339(t: OffsetDateTime) -> String {
    // The kubelet's metav1.Time: seconds, UTC.
    let t = t.to_offset(time::UtcOffset::UTC);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

fn from_unix_nanos(ns: i64) -> Option<OffsetDateTime> {
    (ns > 0)
        .then(|| OffsetDateTime::from_unix_timestamp_nanos(i128::from(ns)).ok())
        .flatten()
}

fn value(v: &Option<cri::UInt64Value>) -> Option<u64> {
    v.as_ref().map(|v| v.value)
}

/// Parses /proc/stat and /proc/meminfo contents.
pub fn parse_host(stat: &str, meminfo: &str) -> NodeSample {
    let mut s = NodeSample::default();
    for line in stat.lines() {
        let mut f = line.split_whitespace();
        match f.next() {
            Some("cpu") => {
                let n: Vec<u64> = f.filter_map(|v| v.parse().ok()).collect();
                // user nice system idle iowait irq softirq steal (USER_HZ = 100).
                let busy: u64 = [0, 1, 2, 5, 6, 7].iter().filter_map(|i| n.get(*i)).sum();
                s.cpu_core_ns = busy.saturating_mul(10_000_000);
            }
            Some("btime") => {
                s.boot = f
                    .next()
                    .and_then(|v| v.parse::<i64>().ok())
                    .and_then(|v| OffsetDateTime::from_unix_timestamp(v).ok());
            }
            _ => {}
        }
    }
    for line in meminfo.lines() {
        let mut f = line.split_whitespace();
        let (Some(k), Some(v)) = (f.next(), f.next().and_then(|v| v.parse::<u64>().ok())) else {
            continue;
        };
        let bytes = v.saturating_mul(1024);
        match k {
            "MemTotal:" => s.mem_total = bytes,
            "MemAvailable:" => s.mem_available = bytes,
            "MemFree:" => s.mem_free = bytes,
            _ => {}
        }
    }
    s
}

fn dir_size(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Collects a [`Snapshot`] of `pods` (this stand-in's own) from the CRI and the host.
pub async fn snapshot(
    rt: &mut Runtime,
    node: &str,
    pods: &HashMap<(String, String), RunningPod>,
) -> Result<Snapshot> {
    let stats = rt.container_stats().await?;
    let (sandboxes, containers) = rt.list().await?;
    let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let meminfo = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    let by_id: HashMap<&str, &cri::ContainerStats> = stats
        .iter()
        .filter_map(|s| s.attributes.as_ref().map(|a| (a.id.as_str(), s)))
        .collect();
    let mut out: Vec<PodSample> = pods
        .values()
        .map(|p| {
            let sandbox = sandboxes.iter().find(|s| s.id == p.sandbox_id);
            let mut names: Vec<&String> = p.containers.keys().collect();
            names.sort();
            let containers = names
                .into_iter()
                .map(|name| {
                    let id = &p.containers[name];
                    let listed = containers.iter().find(|c| &c.id == id);
                    let st = by_id.get(id.as_str());
                    let cpu = st.and_then(|s| s.cpu.as_ref());
                    let mem = st.and_then(|s| s.memory.as_ref());
                    let fs = st.and_then(|s| s.writable_layer.as_ref());
                    ContainerSample {
                        name: name.clone(),
                        start: listed.and_then(|c| from_unix_nanos(c.created_at)),
                        running: listed.is_some_and(|c| {
                            c.state == cri::ContainerState::ContainerRunning as i32
                        }),
                        cpu_core_ns: cpu.and_then(|c| value(&c.usage_core_nano_seconds)),
                        nano_cores: cpu.and_then(|c| value(&c.usage_nano_cores)),
                        working_set: mem.and_then(|m| value(&m.working_set_bytes)),
                        usage: mem.and_then(|m| value(&m.usage_bytes)),
                        rss: mem.and_then(|m| value(&m.rss_bytes)),
                        page_faults: mem.and_then(|m| value(&m.page_faults)),
                        major_page_faults: mem.and_then(|m| value(&m.major_page_faults)),
                        rootfs_used: fs.and_then(|f| value(&f.used_bytes)),
                        rootfs_inodes: fs.and_then(|f| value(&f.inodes_used)),
                        logs_used: dir_size(&p.log_dir.join(name)),
                    }
                })
                .collect();
            PodSample {
                namespace: p.spec.namespace.clone(),
                name: p.spec.name.clone(),
                uid: p.spec.uid.clone(),
                start: sandbox.and_then(|s| from_unix_nanos(s.created_at)),
                ready: sandbox
                    .is_some_and(|s| s.state == cri::PodSandboxState::SandboxReady as i32),
                containers,
            }
        })
        .collect();
    out.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    Ok(Snapshot {
        node: node.to_string(),
        at: OffsetDateTime::now_utc(),
        host: parse_host(&stat, &meminfo),
        pods: out,
    })
}

fn sum(xs: impl Iterator<Item = Option<u64>>) -> Option<u64> {
    xs.fold(None, |acc, x| match (acc, x) {
        (None, x) => x,
        (Some(a), Some(b)) => Some(a.saturating_add(b)),
        (a, None) => a,
    })
}

/// Inserts `key: value` when the value is known.
fn put(obj: &mut Value, key: &str, v: Option<u64>) {
    if let (Some(v), Some(o)) = (v, obj.as_object_mut()) {
        o.insert(key.into(), json!(v));
    }
}

fn cpu_json(now: &str, core_ns: Option<u64>, nano_cores: Option<u64>) -> Value {
    let mut v = json!({ "time": now });
    put(&mut v, "usageNanoCores", nano_cores);
    put(&mut v, "usageCoreNanoSeconds", core_ns);
    v
}

fn mem_json(now: &str, c: &[&ContainerSample]) -> Value {
    let mut v = json!({ "time": now });
    put(&mut v, "usageBytes", sum(c.iter().map(|c| c.usage)));
    put(
        &mut v,
        "workingSetBytes",
        sum(c.iter().map(|c| c.working_set)),
    );
    put(&mut v, "rssBytes", sum(c.iter().map(|c| c.rss)));
    put(&mut v, "pageFaults", sum(c.iter().map(|c| c.page_faults)));
    put(
        &mut v,
        "majorPageFaults",
        sum(c.iter().map(|c| c.major_page_faults)),
    );
    v
}

fn fs_json(now: &str, used: Option<u64>, inodes: Option<u64>) -> Value {
    let mut v = json!({ "time": now });
    put(&mut v, "usedBytes", used);
    put(&mut v, "inodesUsed", inodes);
    v
}

/// `/stats/summary` (`only_cpu_and_memory` drops the filesystem parts, as the kubelet
/// does for `?only_cpu_and_memory=true`). Terminated containers are left out, as the
/// kubelet's CRI stats provider does.
pub fn summary(s: &Snapshot, only_cpu_and_memory: bool) -> Value {
    let now = rfc3339(s.at);
    let pods: Vec<Value> = s
        .pods
        .iter()
        .map(|p| {
            let live: Vec<&ContainerSample> = p.containers.iter().filter(|c| c.running).collect();
            let containers: Vec<Value> = live
                .iter()
                .map(|c| {
                    let mut v = json!({
                        "name": c.name,
                        "cpu": cpu_json(&now, c.cpu_core_ns, c.nano_cores),
                        "memory": mem_json(&now, &[c]),
                    });
                    if let Some(t) = c.start {
                        v["startTime"] = json!(rfc3339(t));
                    }
                    if !only_cpu_and_memory {
                        v["rootfs"] = fs_json(&now, c.rootfs_used, c.rootfs_inodes);
                        v["logs"] = fs_json(&now, Some(c.logs_used), None);
                    }
                    v
                })
                .collect();
            let mut v = json!({
                "podRef": {"name": p.name, "namespace": p.namespace, "uid": p.uid},
                "containers": containers,
                "cpu": cpu_json(
                    &now,
                    sum(live.iter().map(|c| c.cpu_core_ns)),
                    sum(live.iter().map(|c| c.nano_cores)),
                ),
                "memory": mem_json(&now, &live),
            });
            if let Some(t) = p.start {
                v["startTime"] = json!(rfc3339(t));
            }
            if !only_cpu_and_memory {
                v["volume"] = json!([]);
                v["ephemeral-storage"] = fs_json(
                    &now,
                    sum(live
                        .iter()
                        .map(|c| Some(c.rootfs_used.unwrap_or(0) + c.logs_used))),
                    None,
                );
            }
            v
        })
        .collect();
    let h = &s.host;
    let mut node = json!({
        "nodeName": s.node,
        "systemContainers": [],
        "cpu": cpu_json(&now, Some(h.cpu_core_ns), None),
        "memory": {
            "time": now,
            "availableBytes": h.mem_available,
            "usageBytes": h.mem_total.saturating_sub(h.mem_free),
            "workingSetBytes": h.mem_total.saturating_sub(h.mem_available),
        },
    });
    if let Some(b) = h.boot {
        node["startTime"] = json!(rfc3339(b));
    }
    json!({ "node": node, "pods": pods })
}

/// `/metrics/resource`, in the kubelet's format (samples carry a timestamp in ms).
pub fn resource_metrics(s: &Snapshot) -> String {
    let ts = s.at.unix_timestamp() * 1000 + i64::from(s.at.millisecond());
    let secs = |ns: u64| ns as f64 / 1e9;
    let mut o = String::new();
    let family = |o: &mut String, name: &str, kind: &str, help: &str| {
        let _ = writeln!(o, "# HELP {name} [STABLE] {help}");
        let _ = writeln!(o, "# TYPE {name} {kind}");
    };
    let live = || {
        s.pods.iter().flat_map(|p| {
            p.containers
                .iter()
                .filter(|c| c.running)
                .map(move |c| (p, c))
        })
    };
    let labels = |p: &PodSample, c: &ContainerSample| {
        format!(
            "container=\"{}\",namespace=\"{}\",pod=\"{}\"",
            c.name, p.namespace, p.name
        )
    };
    family(
        &mut o,
        "container_cpu_usage_seconds_total",
        "counter",
        "Cumulative cpu time consumed by the container in core-seconds",
    );
    for (p, c) in live() {
        if let Some(ns) = c.cpu_core_ns {
            let _ = writeln!(
                o,
                "container_cpu_usage_seconds_total{{{}}} {:.9} {ts}",
                labels(p, c),
                secs(ns)
            );
        }
    }
    family(
        &mut o,
        "container_memory_working_set_bytes",
        "gauge",
        "Current working set of the container in bytes",
    );
    for (p, c) in live() {
        if let Some(b) = c.working_set {
            let _ = writeln!(
                o,
                "container_memory_working_set_bytes{{{}}} {b} {ts}",
                labels(p, c)
            );
        }
    }
    family(
        &mut o,
        "container_start_time_seconds",
        "gauge",
        "Start time of the container since unix epoch in seconds",
    );
    for (p, c) in live() {
        if let Some(t) = c.start {
            let _ = writeln!(
                o,
                "container_start_time_seconds{{{}}} {} {ts}",
                labels(p, c),
                t.unix_timestamp()
            );
        }
    }
    family(
        &mut o,
        "node_cpu_usage_seconds_total",
        "counter",
        "Cumulative cpu time consumed by the node in core-seconds",
    );
    let _ = writeln!(
        o,
        "node_cpu_usage_seconds_total {:.9} {ts}",
        secs(s.host.cpu_core_ns)
    );
    family(
        &mut o,
        "node_memory_working_set_bytes",
        "gauge",
        "Current working set of the node in bytes",
    );
    let _ = writeln!(
        o,
        "node_memory_working_set_bytes {} {ts}",
        s.host.mem_total.saturating_sub(s.host.mem_available)
    );
    family(
        &mut o,
        "pod_cpu_usage_seconds_total",
        "counter",
        "Cumulative cpu time consumed by the pod in core-seconds",
    );
    for p in &s.pods {
        if let Some(ns) = sum(p
            .containers
            .iter()
            .filter(|c| c.running)
            .map(|c| c.cpu_core_ns))
        {
            let _ = writeln!(
                o,
                "pod_cpu_usage_seconds_total{{namespace=\"{}\",pod=\"{}\"}} {:.9} {ts}",
                p.namespace,
                p.name,
                secs(ns)
            );
        }
    }
    family(
        &mut o,
        "pod_memory_working_set_bytes",
        "gauge",
        "Current working set of the pod in bytes",
    );
    for p in &s.pods {
        if let Some(b) = sum(p
            .containers
            .iter()
            .filter(|c| c.running)
            .map(|c| c.working_set))
        {
            let _ = writeln!(
                o,
                "pod_memory_working_set_bytes{{namespace=\"{}\",pod=\"{}\"}} {b} {ts}",
                p.namespace, p.name
            );
        }
    }
    family(
        &mut o,
        "resource_scrape_error",
        "gauge",
        "1 if there was an error while getting container metrics, 0 otherwise",
    );
    let _ = writeln!(o, "resource_scrape_error 0");
    o
}

/// `/metrics`: the kubelet's own gauges that describe the node and its pods.
pub fn kubelet_metrics(s: &Snapshot, process_start: OffsetDateTime) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "# HELP kubelet_node_name [ALPHA] The node's name. The count is always 1."
    );
    let _ = writeln!(o, "# TYPE kubelet_node_name gauge");
    let _ = writeln!(o, "kubelet_node_name{{node=\"{}\"}} 1", s.node);
    let _ = writeln!(
        o,
        "# HELP kubelet_running_pods [ALPHA] Number of pods that have a running pod sandbox"
    );
    let _ = writeln!(o, "# TYPE kubelet_running_pods gauge");
    let _ = writeln!(
        o,
        "kubelet_running_pods {}",
        s.pods.iter().filter(|p| p.ready).count()
    );
    let (running, exited): (Vec<_>, Vec<_>) = s
        .pods
        .iter()
        .flat_map(|p| p.containers.iter())
        .partition(|c| c.running);
    let _ = writeln!(
        o,
        "# HELP kubelet_running_containers [ALPHA] Number of containers currently running"
    );
    let _ = writeln!(o, "# TYPE kubelet_running_containers gauge");
    let _ = writeln!(
        o,
        "kubelet_running_containers{{container_state=\"running\"}} {}",
        running.len()
    );
    let _ = writeln!(
        o,
        "kubelet_running_containers{{container_state=\"exited\"}} {}",
        exited.len()
    );
    let _ = writeln!(
        o,
        "# HELP process_start_time_seconds [ALPHA] Start time of the process since unix epoch in seconds."
    );
    let _ = writeln!(o, "# TYPE process_start_time_seconds gauge");
    let _ = writeln!(
        o,
        "process_start_time_seconds {}",
        process_start.unix_timestamp()
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap() -> Snapshot {
        let c = |name: &str, running: bool| ContainerSample {
            name: name.into(),
            start: OffsetDateTime::from_unix_timestamp(1_700_000_000).ok(),
            running,
            cpu_core_ns: Some(1_500_000_000),
            nano_cores: Some(2_000),
            working_set: Some(4096),
            usage: Some(8192),
            rss: None,
            page_faults: None,
            major_page_faults: None,
            rootfs_used: Some(100),
            rootfs_inodes: Some(3),
            logs_used: 20,
        };
        Snapshot {
            node: "n1".into(),
            at: OffsetDateTime::from_unix_timestamp(1_700_000_100).unwrap(),
            host: parse_host(
                "cpu  100 0 50 1000 7 0 0 0 0 0\ncpu0 1 2 3\nbtime 1699990000\n",
                "MemTotal: 1000 kB\nMemFree: 200 kB\nMemAvailable: 600 kB\n",
            ),
            pods: vec![PodSample {
                namespace: "default".into(),
                name: "p1".into(),
                uid: "u1".into(),
                start: OffsetDateTime::from_unix_timestamp(1_700_000_000).ok(),
                ready: true,
                containers: vec![c("a", true), c("b", true), c("gone", false)],
            }],
        }
    }

    #[test]
    fn host_figures() {
        let h = snap().host;
        assert_eq!(h.cpu_core_ns, 150 * 10_000_000);
        assert_eq!(h.mem_total, 1_024_000);
        assert_eq!(h.mem_available, 600 * 1024);
        assert_eq!(h.boot.unwrap().unix_timestamp(), 1_699_990_000);
    }

    #[test]
    fn summary_shape() {
        let v = summary(&snap(), false);
        assert_eq!(v["node"]["nodeName"], "n1");
        assert_eq!(v["node"]["memory"]["workingSetBytes"], 400 * 1024);
        let p = &v["pods"][0];
        assert_eq!(p["podRef"]["uid"], "u1");
        assert_eq!(p["startTime"], "2023-11-14T22:13:20Z");
        // The terminated container is left out; the pod sums the others.
        assert_eq!(p["containers"].as_array().unwrap().len(), 2);
        assert_eq!(p["cpu"]["usageCoreNanoSeconds"], 3_000_000_000u64);
        assert_eq!(p["memory"]["workingSetBytes"], 8192);
        assert_eq!(p["containers"][0]["rootfs"]["inodesUsed"], 3);
        assert!(p["containers"][0]["memory"].get("rssBytes").is_none());
        let lean = summary(&snap(), true);
        assert!(lean["pods"][0]["containers"][0].get("rootfs").is_none());
    }

    #[test]
    fn resource_metrics_text() {
        let t = resource_metrics(&snap());
        assert!(t.contains(
            "container_cpu_usage_seconds_total{container=\"a\",namespace=\"default\",pod=\"p1\"} 1.500000000 1700000100000\n"
        ));
        assert!(t.contains("pod_memory_working_set_bytes{namespace=\"default\",pod=\"p1\"} 8192 "));
        assert!(!t.contains("container=\"gone\""));
        let k = kubelet_metrics(&snap(), OffsetDateTime::UNIX_EPOCH);
        assert!(k.contains("kubelet_node_name{node=\"n1\"} 1\n"));
        assert!(k.contains("kubelet_running_containers{container_state=\"running\"} 2\n"));
    }
}
