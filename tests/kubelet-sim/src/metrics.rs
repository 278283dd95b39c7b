//! Node-level read-only endpoints with plausible content: `/metrics`,
//! `/metrics/cadvisor`, `/metrics/resource`, `/metrics/probes`,
//! `/metrics/slis` (Prometheus text), `/stats/summary` (JSON), `/configz`
//! and `/healthz`. Values grow with uptime so scrapes differ over time.

use std::fmt::Write as _;
use std::time::Instant;

use serde_json::{json, Value};

use crate::config::PodSpec;

/// Seconds since `start`, as a float.
fn uptime(start: Instant) -> f64 {
    start.elapsed().as_secs_f64()
}

fn now_ms() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp() * 1000
}

fn rfc3339_now() -> String {
    crate::logs::format_timestamp(time::OffsetDateTime::now_utc())
}

/// `/metrics`: kubelet's own metrics.
pub fn kubelet_metrics(node: &str, pods: &[PodSpec], start: Instant) -> String {
    let containers: usize = pods.iter().map(|p| p.containers.len()).sum();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# HELP kubelet_node_name [ALPHA] The node's name. The count is always 1."
    );
    let _ = writeln!(s, "# TYPE kubelet_node_name gauge");
    let _ = writeln!(s, "kubelet_node_name{{node=\"{node}\"}} 1");
    let _ = writeln!(
        s,
        "# HELP kubelet_running_pods [ALPHA] Number of pods that have a running pod sandbox"
    );
    let _ = writeln!(s, "# TYPE kubelet_running_pods gauge");
    let _ = writeln!(s, "kubelet_running_pods {}", pods.len());
    let _ = writeln!(
        s,
        "# HELP kubelet_running_containers [ALPHA] Number of containers currently running"
    );
    let _ = writeln!(s, "# TYPE kubelet_running_containers gauge");
    let _ = writeln!(
        s,
        "kubelet_running_containers{{container_state=\"running\"}} {containers}"
    );
    let _ = writeln!(
        s,
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds."
    );
    let _ = writeln!(s, "# TYPE process_start_time_seconds gauge");
    let _ = writeln!(
        s,
        "process_start_time_seconds {:.2}",
        (now_ms() as f64 / 1000.0) - uptime(start)
    );
    s
}

/// `/metrics/cadvisor`: per-container usage.
pub fn cadvisor_metrics(pods: &[PodSpec], start: Instant) -> String {
    let up = uptime(start);
    let ts = now_ms();
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# HELP container_cpu_usage_seconds_total Cumulative cpu time consumed in seconds."
    );
    let _ = writeln!(s, "# TYPE container_cpu_usage_seconds_total counter");
    for p in pods {
        for c in &p.containers {
            let _ = writeln!(
                s,
                "container_cpu_usage_seconds_total{{container=\"{c}\",cpu=\"total\",id=\"/kubepods/pod{}/{c}\",image=\"registry.k8s.io/pause:3.9\",name=\"{c}\",namespace=\"{}\",pod=\"{}\"}} {:.6} {ts}",
                p.uid, p.namespace, p.name, up * 0.01
            );
        }
    }
    let _ = writeln!(
        s,
        "# HELP container_memory_working_set_bytes Current working set in bytes."
    );
    let _ = writeln!(s, "# TYPE container_memory_working_set_bytes gauge");
    for p in pods {
        for c in &p.containers {
            let _ = writeln!(
                s,
                "container_memory_working_set_bytes{{container=\"{c}\",id=\"/kubepods/pod{}/{c}\",image=\"registry.k8s.io/pause:3.9\",name=\"{c}\",namespace=\"{}\",pod=\"{}\"}} 8388608 {ts}",
                p.uid, p.namespace, p.name
            );
        }
    }
    s
}

/// `/metrics/resource`: what metrics-server scrapes.
pub fn resource_metrics(pods: &[PodSpec], start: Instant) -> String {
    let up = uptime(start);
    let ts = now_ms();
    let mut s = String::new();
    let _ = writeln!(s, "# HELP node_cpu_usage_seconds_total [STABLE] Cumulative cpu time consumed by the node in core-seconds");
    let _ = writeln!(s, "# TYPE node_cpu_usage_seconds_total counter");
    let _ = writeln!(s, "node_cpu_usage_seconds_total {:.6} {ts}", up * 0.05);
    let _ = writeln!(
        s,
        "# HELP node_memory_working_set_bytes [STABLE] Current working set of the node in bytes"
    );
    let _ = writeln!(s, "# TYPE node_memory_working_set_bytes gauge");
    let _ = writeln!(s, "node_memory_working_set_bytes 536870912 {ts}");
    let _ = writeln!(s, "# HELP container_cpu_usage_seconds_total [STABLE] Cumulative cpu time consumed by the container in core-seconds");
    let _ = writeln!(s, "# TYPE container_cpu_usage_seconds_total counter");
    for p in pods {
        for c in &p.containers {
            let _ = writeln!(
                s,
                "container_cpu_usage_seconds_total{{container=\"{c}\",namespace=\"{}\",pod=\"{}\"}} {:.6} {ts}",
                p.namespace, p.name, up * 0.01
            );
        }
    }
    let _ = writeln!(s, "# HELP container_memory_working_set_bytes [STABLE] Current working set of the container in bytes");
    let _ = writeln!(s, "# TYPE container_memory_working_set_bytes gauge");
    for p in pods {
        for c in &p.containers {
            let _ = writeln!(
                s,
                "container_memory_working_set_bytes{{container=\"{c}\",namespace=\"{}\",pod=\"{}\"}} 8388608 {ts}",
                p.namespace, p.name
            );
        }
    }
    let _ = writeln!(s, "# HELP scrape_error [ALPHA] 1 if there was an error while getting container metrics, 0 otherwise");
    let _ = writeln!(s, "# TYPE scrape_error gauge");
    let _ = writeln!(s, "scrape_error 0");
    s
}

/// `/metrics/probes`.
pub fn probe_metrics(pods: &[PodSpec]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# HELP prober_probe_total [BETA] Cumulative number of a liveness, readiness or startup probe for a container by result.");
    let _ = writeln!(s, "# TYPE prober_probe_total counter");
    for p in pods {
        for c in &p.containers {
            let _ = writeln!(
                s,
                "prober_probe_total{{container=\"{c}\",namespace=\"{}\",pod=\"{}\",pod_uid=\"{}\",probe_type=\"Readiness\",result=\"successful\"}} 1",
                p.namespace, p.name, p.uid
            );
        }
    }
    s
}

/// `/metrics/slis`.
pub fn sli_metrics() -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# HELP kubernetes_healthcheck [STABLE] This metric records the result of a single healthcheck.");
    let _ = writeln!(s, "# TYPE kubernetes_healthcheck gauge");
    let _ = writeln!(
        s,
        "kubernetes_healthcheck{{name=\"ping\",type=\"healthz\"}} 1"
    );
    let _ = writeln!(
        s,
        "kubernetes_healthcheck{{name=\"syncloop\",type=\"healthz\"}} 1"
    );
    s
}

/// `/stats/summary`.
pub fn stats_summary(
    node: &str,
    pods: &[PodSpec],
    start: Instant,
    only_cpu_and_memory: bool,
) -> Value {
    let up = uptime(start);
    let now = rfc3339_now();
    let cpu = |scale: f64| json!({"time": now, "usageNanoCores": 1_000_000u64, "usageCoreNanoSeconds": (up * scale * 1e9) as u64});
    let mem = |ws: u64| {
        json!({"time": now, "usageBytes": ws + 4096, "workingSetBytes": ws, "rssBytes": ws / 2,
               "pageFaults": 100, "majorPageFaults": 0, "availableBytes": 1u64 << 30})
    };
    let pod_stats: Vec<Value> = pods
        .iter()
        .map(|p| {
            let containers: Vec<Value> = p
                .containers
                .iter()
                .map(|c| {
                    let mut v = json!({"name": c, "startTime": "2024-01-01T00:00:00Z",
                                       "cpu": cpu(0.01), "memory": mem(8 << 20)});
                    if !only_cpu_and_memory {
                        v["rootfs"] = json!({"time": now, "availableBytes": 1u64 << 33, "capacityBytes": 1u64 << 34, "usedBytes": 4096});
                        v["logs"] = json!({"time": now, "availableBytes": 1u64 << 33, "capacityBytes": 1u64 << 34, "usedBytes": 4096});
                    }
                    v
                })
                .collect();
            let mut v = json!({
                "podRef": {"name": p.name, "namespace": p.namespace, "uid": p.uid},
                "startTime": "2024-01-01T00:00:00Z",
                "containers": containers,
                "cpu": cpu(0.01 * p.containers.len() as f64),
                "memory": mem((8u64 << 20) * p.containers.len() as u64),
            });
            if !only_cpu_and_memory {
                v["network"] = json!({"time": now, "name": "eth0", "rxBytes": 1024, "txBytes": 2048});
                v["volume"] = json!([]);
            }
            v
        })
        .collect();
    let mut node_v = json!({
        "nodeName": node,
        "startTime": "2024-01-01T00:00:00Z",
        "cpu": cpu(0.05),
        "memory": mem(512 << 20),
        "systemContainers": [{"name": "kubelet", "startTime": "2024-01-01T00:00:00Z",
                              "cpu": cpu(0.01), "memory": mem(64 << 20)}],
    });
    if !only_cpu_and_memory {
        node_v["fs"] = json!({"time": now, "availableBytes": 1u64 << 33, "capacityBytes": 1u64 << 34, "usedBytes": 1u64 << 30});
        node_v["network"] = json!({"time": now, "name": "eth0", "rxBytes": 4096, "txBytes": 8192, "interfaces": []});
        node_v["rlimit"] = json!({"time": now, "maxpid": 4_194_304, "curproc": 200});
    }
    json!({"node": node_v, "pods": pod_stats})
}

/// `/configz`.
pub fn configz(node: &str, listen_port: u16) -> Value {
    json!({
        "kubeletconfig": {
            "enableServer": true,
            "port": listen_port,
            "nodeName": node,
            "streamingConnectionIdleTimeout": "4h0m0s",
            "authentication": {"x509": {}, "webhook": {"enabled": false}, "anonymous": {"enabled": true}},
            "authorization": {"mode": "AlwaysAllow"},
            "featureGates": {}
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_pod_spec;

    #[test]
    fn metrics_mention_pods() {
        let pods = vec![parse_pod_spec("ns/p=c").expect("spec")];
        let start = Instant::now();
        let r = resource_metrics(&pods, start);
        assert!(r.contains("node_cpu_usage_seconds_total"));
        assert!(r.contains(
            "container_memory_working_set_bytes{container=\"c\",namespace=\"ns\",pod=\"p\"}"
        ));
        let s = stats_summary("n1", &pods, start, true);
        assert_eq!(s["node"]["nodeName"], "n1");
        assert_eq!(s["pods"][0]["podRef"]["name"], "p");
        assert!(s["pods"][0].get("network").is_none());
    }
}
