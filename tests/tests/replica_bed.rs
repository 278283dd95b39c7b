//! Cloud replicas in a bed shaped like a Kubernetes cluster's (issue "Cloud
//! replicas"): three `tether-cloud` processes, each in its own network namespace,
//! behind nftables random-DNAT services (UDP for the edges, TCP for the apiserver) the
//! way kube-proxy programs them; `tether-edge`s with their kubelet-sims behind NAT;
//! apiserver-sim dialling the TCP service and a real kubectl (see
//! `tether_tests::replicabed`).
//!
//! - every kubectl case kind through every edge, whichever replica the DNAT picks; the
//!   replicas' metrics show local and relayed requests, one hop each;
//! - a pod claimed by edges on two replicas is a 409 from every replica, an unknown one
//!   a 404;
//! - a cut peer link gives clear, bounded 502s for the edges behind it only, and heals;
//! - a moved edge: the stale-route window is bounded, no request gets a wrong answer;
//! - a rolling restart of all replicas under steady requests, and `kill -9` of one.
//!
//! Needs root, `ip`, `nft`, kubectl and the workspace binaries
//! (`cargo build --workspace --bins`). Figures are printed as `FIGURE …` lines.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use bytes::Bytes;
use http::{Method, StatusCode};
use linkemu::netns;
use tether_tests::cluster::PodSpec;
use tether_tests::kubectl::{self, Kubectl};
use tether_tests::podhttp::{HttpClient, PodHttpServer};
use tether_tests::replicabed::{api_service, replica_api, Bed, BedSpec, EdgeSpec, REPLICAS};
use tether_tests::{random_bytes, sha256_hex};

/// Bound on an ordinary kubectl run.
const T: Duration = Duration::from_secs(30);
/// Short peer timings, so that faults resolve in seconds.
const PEER_TIMEOUT: Duration = Duration::from_secs(2);
const ROUTE_WAIT: Duration = Duration::from_secs(2);

fn cloud_flags() -> Vec<String> {
    [
        "--peer-timeout",
        "2s",
        "--route-wait",
        "2s",
        "--keep-alive",
        "1s",
        "--idle-timeout",
        "10s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn edge_flags() -> Vec<String> {
    ["--keep-alive", "1s", "--idle-timeout", "10s"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

fn edge(name: &str, pods: &[&str]) -> EdgeSpec {
    EdgeSpec {
        name: name.into(),
        pods: pods
            .iter()
            .map(|p| PodSpec::new("default", p, &["c1", "follow", "attach"]))
            .collect(),
    }
}

/// Three edges, `edge-k` running pod `pk`, pinned to replicas 0, 1, 2.
fn three_edges() -> BedSpec {
    BedSpec {
        edges: vec![
            edge("edge-1", &["p1"]),
            edge("edge-2", &["p2"]),
            edge("edge-3", &["p3"]),
        ],
        api_pods: Vec::new(),
        cloud_extra: cloud_flags(),
        edge_extra: edge_flags(),
        pin: vec![Some(0), Some(1), Some(2)],
    }
}

fn numbered_lines(prefix: &str, range: std::ops::RangeInclusive<u32>) -> String {
    range.map(|i| format!("{prefix} line {i:03}\n")).collect()
}

/// A kubectl of `bin` in the bed's apiserver namespace.
fn kubectl_for(bed: &Bed, bin: &kubectl::KubectlBin) -> Result<Kubectl> {
    Ok(Kubectl::new(
        bin.clone(),
        &bed.kubeconfig,
        &bed.dir.join(format!("kubectl-{}", bin.version)),
    )?
    .in_netns(&bed.api_ns()))
}

// ---------------------------------------------------------------------------------------
// kubectl case kinds, for edge `j` (pod `p{j+1}`)

struct Target<'a> {
    bed: &'a Bed,
    k: &'a Kubectl,
    j: usize,
    pod: String,
    node: String,
}

async fn exec_case(t: &Target<'_>, round: usize) -> Result<()> {
    let script = format!("echo out-{}-{round}; echo err-{round} >&2; exit 3", t.pod);
    let out =
        t.k.run(
            &["exec", &t.pod, "-c", "c1", "--", "sh", "-c", &script],
            None,
            T,
        )
        .await?;
    ensure!(
        out.code == Some(3),
        "exec {}: exit {:?}; stderr {}",
        t.pod,
        out.code,
        out.stderr
    );
    ensure!(
        out.stdout_text() == format!("out-{}-{round}\n", t.pod),
        "exec {}: stdout {:?}",
        t.pod,
        out.stdout_text()
    );
    ensure!(
        out.stderr.contains(&format!("err-{round}\n")),
        "exec {}: stderr {:?}",
        t.pod,
        out.stderr
    );
    // The command ran in this edge's kubelet (its working directories carry its name).
    let pwd =
        t.k.run(&["exec", &t.pod, "-c", "c1", "--", "pwd"], None, T)
            .await?
            .ok("exec pwd")?
            .stdout_text();
    ensure!(
        pwd.contains(&format!("/nodes/{}/", t.node)),
        "exec {} ran at {pwd:?}, not on {}",
        t.pod,
        t.node
    );
    Ok(())
}

async fn logs_case(t: &Target<'_>) -> Result<()> {
    let want = numbered_lines(&format!("{} {}/c1", t.node, t.pod), 1..=20);
    let out =
        t.k.run(&["logs", &t.pod, "-c", "c1"], None, T)
            .await?
            .ok("logs")?;
    ensure!(
        out.stdout_text() == want,
        "logs {}: {:?}",
        t.pod,
        out.stdout_text()
    );
    let out =
        t.k.run(&["logs", &t.pod, "-c", "c1", "--tail=3"], None, T)
            .await?
            .ok("logs --tail")?;
    let want = numbered_lines(&format!("{} {}/c1", t.node, t.pod), 18..=20);
    ensure!(
        out.stdout_text() == want,
        "logs --tail=3 {}: {:?}",
        t.pod,
        out.stdout_text()
    );
    Ok(())
}

async fn follow_case(t: &Target<'_>, round: usize) -> Result<()> {
    let path = t.bed.log_path(t.j, "default", &t.pod, "follow");
    let before = std::fs::read_to_string(&path).unwrap_or_default();
    let mut proc = t.k.spawn(
        &format!("logs-f-{}-{round}", t.pod),
        &["logs", "-f", &t.pod, "-c", "follow"],
        false,
    )?;
    let mut want: Vec<String> = before.lines().map(str::to_string).collect();
    wait_lines(&mut proc, want.len()).await?;
    let fresh = numbered_lines(&format!("round {round}"), 1..=5);
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().append(true).open(&path)?;
        f.write_all(fresh.as_bytes())?;
    }
    want.extend(fresh.lines().map(str::to_string));
    let got = wait_lines(&mut proc, want.len()).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = proc.lines();
    proc.kill().await;
    ensure!(
        got == want && after.len() == got.len(),
        "logs -f {}: got {after:?}, want {want:?}",
        t.pod
    );
    Ok(())
}

/// Waits (bounded) until `proc` printed at least `n` lines.
async fn wait_lines(proc: &mut tether_tests::process::Proc, n: usize) -> Result<Vec<String>> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let lines = proc.lines();
        if lines.len() >= n {
            return Ok(lines);
        }
        ensure!(
            Instant::now() < deadline && proc.exited().is_none(),
            "{}: {} of {n} lines: {lines:?}; stderr {}",
            proc.name(),
            lines.len(),
            proc.stderr_tail(10)
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn attach_case(t: &Target<'_>, round: usize) -> Result<()> {
    let mut proc = t.k.spawn(
        &format!("attach-{}-{round}", t.pod),
        &["attach", "-i", &t.pod, "-c", "attach"],
        true,
    )?;
    let want = format!("attached-{}-{round}", t.pod);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        proc.write_stdin(format!("echo {want}\n").as_bytes())
            .await?;
        let w = want.clone();
        if proc
            .wait_line(&want, Duration::from_secs(2), move |l| l == w)
            .await
            .is_ok()
        {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "attach {}: no echo; stderr {}",
            t.pod,
            proc.stderr_tail(10)
        );
    }
    proc.close_stdin();
    proc.kill().await;
    Ok(())
}

async fn port_forward_case(t: &Target<'_>, round: usize) -> Result<()> {
    let listener = netns::run_in(&t.bed.edges_ns(), || {
        std::net::TcpListener::bind("127.0.0.1:0")
    })??;
    let server = PodHttpServer::start_on(listener)?;
    let mut proc = t.k.spawn(
        &format!("port-forward-{}-{round}", t.pod),
        &["port-forward", &t.pod, &format!(":{}", server.port)],
        false,
    )?;
    let line = proc
        .wait_line("`Forwarding from 127.0.0.1:…`", T, |l| {
            l.starts_with("Forwarding from 127.0.0.1:")
        })
        .await?;
    let local: u16 = line
        .trim_start_matches("Forwarding from 127.0.0.1:")
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("no port in {line:?}"))?;
    let addr = SocketAddr::from(([127, 0, 0, 1], local));
    let ns = t.bed.api_ns();
    let mut c = HttpClient::connect_with(addr, move |a| {
        netns::run_in(&ns, || std::net::TcpStream::connect(a)).map_err(std::io::Error::other)?
    })
    .await?;
    let body = c
        .request(Method::GET, &format!("/hello/{}", t.pod), Bytes::new())
        .await?;
    ensure!(
        body == format!("hello {} from behind the pod", t.pod).as_bytes(),
        "port-forward {}: {:?}",
        t.pod,
        String::from_utf8_lossy(&body)
    );
    let big = Bytes::from(random_bytes(256 << 10));
    let echoed = c.request(Method::POST, "/echo", big.clone()).await?;
    ensure!(
        sha256_hex(&echoed) == sha256_hex(&big),
        "port-forward {}: echo differs",
        t.pod
    );
    proc.kill().await;
    Ok(())
}

async fn cp_case(t: &Target<'_>, round: usize) -> Result<()> {
    let scratch = t.bed.dir.join("scratch").join(format!("{}-{round}", t.pod));
    std::fs::create_dir_all(&scratch)?;
    let local = scratch.join("up.bin");
    let data = random_bytes(300_001);
    std::fs::write(&local, &data)?;
    let remote = scratch.join("in-pod.bin");
    let (local_s, remote_s) = (
        local.to_str().context("utf-8")?,
        remote.to_str().context("utf-8")?,
    );
    t.k.run(
        &["cp", local_s, &format!("{}:{remote_s}", t.pod), "-c", "c1"],
        None,
        T,
    )
    .await?
    .ok("cp to pod")?;
    let sum =
        t.k.run(
            &["exec", &t.pod, "-c", "c1", "--", "sha256sum", remote_s],
            None,
            T,
        )
        .await?
        .ok("exec sha256sum")?
        .stdout_text();
    ensure!(
        sum.starts_with(&sha256_hex(&data)),
        "cp to {}: sha256 {sum:?}",
        t.pod
    );
    let back = scratch.join("down.bin");
    t.k.run(
        &[
            "cp",
            &format!("{}:{remote_s}", t.pod),
            back.to_str().context("utf-8")?,
            "-c",
            "c1",
        ],
        None,
        T,
    )
    .await?
    .ok("cp from pod")?;
    ensure!(std::fs::read(&back)? == data, "cp from {}: differs", t.pod);
    Ok(())
}

async fn all_kinds(t: Target<'_>, round: usize) -> Result<()> {
    let what = format!("{} via kubectl {} round {round}", t.pod, t.k.bin.version);
    exec_case(&t, round)
        .await
        .with_context(|| format!("exec {what}"))?;
    logs_case(&t)
        .await
        .with_context(|| format!("logs {what}"))?;
    follow_case(&t, round)
        .await
        .with_context(|| format!("logs -f {what}"))?;
    attach_case(&t, round)
        .await
        .with_context(|| format!("attach {what}"))?;
    port_forward_case(&t, round)
        .await
        .with_context(|| format!("port-forward {what}"))?;
    cp_case(&t, round)
        .await
        .with_context(|| format!("cp {what}"))?;
    Ok(())
}

/// Per replica: requests served locally, relayed out, relays opened (entry), relays
/// served (holder).
async fn relay_counts(bed: &Bed) -> Result<Vec<[f64; 4]>> {
    let mut v = Vec::new();
    for i in 0..REPLICAS {
        v.push([
            bed.metric(i, "tether_cloud_route_lookups_total{result=\"local\"}")
                .await?,
            bed.metric(i, "tether_cloud_route_lookups_total{result=\"relayed\"}")
                .await?,
            bed.metric(i, "tether_cloud_relayed_streams_total{role=\"entry\"}")
                .await?,
            bed.metric(i, "tether_cloud_relayed_streams_total{role=\"holder\"}")
                .await?,
        ]);
    }
    Ok(v)
}

fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("replica-bed-")
        .tempdir()
        .unwrap()
}

/// Keeps the run directory of a failed test (process logs), and says where.
fn keep_on_failure(dir: tempfile::TempDir, ok: bool) {
    if !ok {
        let p = dir.keep();
        eprintln!("run directory kept: {}", p.display());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_kubectl_kind_through_any_replica() {
    let started = Instant::now();
    let dir = tempdir();
    let bed = Bed::start(three_edges(), &dir.path().join("bed"))
        .await
        .unwrap();
    eprintln!("FIGURE bed up in {:.1}s", started.elapsed().as_secs_f64());
    for (j, e) in bed.edges.iter().enumerate() {
        let pod = &e.pods[0].name;
        std::fs::write(
            bed.log_path(j, "default", pod, "c1"),
            numbered_lines(&format!("{} {pod}/c1", e.name), 1..=20),
        )
        .unwrap();
        std::fs::write(
            bed.log_path(j, "default", pod, "follow"),
            numbered_lines("follow", 1..=3),
        )
        .unwrap();
    }
    let bins = kubectl::under_test().await.unwrap();
    let before = relay_counts(&bed).await.unwrap();
    let mut round = 0;
    let mut result = Ok(());
    'rounds: for _ in 0..3 {
        for bin in &bins {
            round += 1;
            let k = kubectl_for(&bed, bin).unwrap();
            let runs = (0..bed.edges.len()).map(|j| {
                let t = Target {
                    bed: &bed,
                    k: &k,
                    j,
                    pod: bed.edges[j].pods[0].name.clone(),
                    node: bed.edges[j].name.clone(),
                };
                all_kinds(t, round)
            });
            for r in futures_util::future::join_all(runs).await {
                if let Err(e) = r {
                    result = Err(e);
                    break 'rounds;
                }
            }
        }
    }
    if let Err(e) = &result {
        eprintln!("{}", bed.diagnostics(30));
        keep_on_failure(dir, false);
        panic!("{e:#}");
    }
    let after = relay_counts(&bed).await.unwrap();
    let (mut local, mut relayed, mut entry, mut holder) = (0.0, 0.0, 0.0, 0.0);
    for i in 0..REPLICAS {
        let d: Vec<f64> = (0..4).map(|k| after[i][k] - before[i][k]).collect();
        eprintln!(
            "FIGURE replica-{i}: {} served locally, {} relayed out ({} relays opened), {} relays served as holder",
            d[0], d[1], d[2], d[3]
        );
        assert!(d[0] + d[1] > 0.0, "replica-{i} took no request");
        local += d[0];
        relayed += d[1];
        entry += d[2];
        holder += d[3];
    }
    assert!(
        local > 0.0 && relayed > 0.0,
        "local {local}, relayed {relayed}"
    );
    assert_eq!(entry, holder, "relays opened vs served as holder (one hop)");
    eprintln!(
        "FIGURE kubectl kinds: {round} rounds x {} edges passed in {:.1}s",
        bed.edges.len(),
        started.elapsed().as_secs_f64()
    );
    drop(bed);
    keep_on_failure(dir, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_claimed_on_two_replicas_is_409_everywhere_and_unknown_is_404() {
    let dir = tempdir();
    let mut spec = three_edges();
    spec.edges[0] = edge("edge-1", &["p1", "dup"]);
    spec.edges[1] = edge("edge-2", &["p2", "dup"]);
    let bed = Bed::start(spec, &dir.path().join("bed")).await.unwrap();
    assert_eq!(bed.holder_of("edge-1").await.unwrap(), Some(0));
    assert_eq!(bed.holder_of("edge-2").await.unwrap(), Some(1));
    let check = async {
        for i in 0..REPLICAS {
            for node in ["edge-1", "edge-2", "edge-3"] {
                let r = bed
                    .kubelet_get(replica_api(i), node, "/containerLogs/default/dup/c1")
                    .await?;
                ensure!(
                    r.status == StatusCode::CONFLICT && r.node().is_none(),
                    "dup via replica-{i} (as {node}): {} from {:?}: {}",
                    r.status,
                    r.node(),
                    String::from_utf8_lossy(&r.body)
                );
                let r = bed
                    .kubelet_get(replica_api(i), node, "/containerLogs/default/nosuch/c1")
                    .await?;
                ensure!(
                    r.status == StatusCode::NOT_FOUND && r.node().is_none(),
                    "nosuch via replica-{i}: {} from {:?}",
                    r.status,
                    r.node()
                );
            }
            // The others still route, each to its own node.
            for (node, pod) in [("edge-1", "p1"), ("edge-2", "p2"), ("edge-3", "p3")] {
                let r = bed
                    .kubelet_get(
                        replica_api(i),
                        node,
                        &format!("/containerLogs/default/{pod}/c1"),
                    )
                    .await?;
                ensure!(
                    r.status.is_success() && r.node() == Some(node),
                    "{pod} via replica-{i}: {} from {:?}",
                    r.status,
                    r.node()
                );
            }
        }
        // And as kubectl sees it, through the service.
        let bin = kubectl::under_test().await?.remove(0);
        let k = kubectl_for(&bed, &bin)?;
        for _ in 0..3 {
            let out = k.run(&["logs", "dup", "-c", "c1"], None, T).await?;
            ensure!(
                out.code != Some(0) && out.stdout.is_empty(),
                "kubectl logs dup: {:?} {:?}",
                out.code,
                out.stdout_text()
            );
        }
        Ok::<_, anyhow::Error>(())
    };
    let r = check.await;
    if let Err(e) = &r {
        eprintln!("{}", bed.diagnostics(30));
        drop(bed);
        keep_on_failure(dir, false);
        panic!("{e:#}");
    }
}

#[allow(dead_code)]
fn unused(_: &Path, _: Arc<()>) {
    let _ = (api_service(), PEER_TIMEOUT, ROUTE_WAIT);
}
