//! The real-kubectl end-to-end suite.
//!
//! For each kubectl under test (`kubectl.1.28`, which speaks SPDY, and `kubectl.1.33`,
//! which speaks WebSocket; or the one binary named by `KUBECTL`) this starts a cluster of
//! real processes — kubelet simulators for two edge nodes, `tether-cloud`, one
//! `tether-edge` per node and the apiserver stand-in — and drives it with kubectl: exec
//! (exit codes, stdout/stderr apart, 10 MiB of stdin, a terminal with a resize), logs
//! (all, `--tail`, `--timestamps`, `-f` while lines are appended), attach, port-forward,
//! cp both ways, `get --raw` of a node's metrics and stats, and each pod reached only
//! through its own edge. Cases run concurrently; the versions run side by side, each on
//! its own cluster.
//!
//! This is a plain program (`harness = false`) that understands the usual test
//! arguments: substrings selecting cases by name, `--skip`, `--list`. It prints a line per case and, at the end,
//! `kubectl 1.28: N passed, M failed` per version, and exits non-zero if anything
//! failed. `TETHER_E2E_MODE=direct` runs the same cases without the tunnel (the apiserver
//! dials the kubelet simulators itself), to tell fixture problems from tunnel problems;
//! `TETHER_E2E_REPLICAS=3` runs the cloud as three replicas, the edges held by different
//! ones and apiserver-sim dialling each replica in turn, so every case runs both served
//! locally and relayed over the peer link;
//! `TETHER_E2E_KUBELET=cri` runs every case against real containers: a private containerd
//! (one for the run, shared by both nodes of both versions' clusters, whose pods have
//! distinct uids) runs the pods as CRI sandboxes with host networking, and each node's
//! kubelet is `cri-kubelet`, which proxies exec/attach/port-forward to containerd's
//! streaming server and reads the CRI's logs and statistics; the containers' logs are
//! fed through FIFOs their main processes copy to stdout, the upgrade protocols
//! containerd negotiated are printed, and nothing may be left in containerd at the end;
//! `TETHER_E2E_KEEP=1` keeps the run directory (process logs, certificates) after a pass.
//! The binaries must have been built first: `cargo build --workspace --bins`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use bytes::Bytes;
use http::Method;
use tether_tests::bins;
use tether_tests::cluster::{Cluster, ClusterSpec, Mode, NodeSpec, PodSpec};
use tether_tests::containerd::Containerd;
use tether_tests::kubectl::{self, clip, Kubectl, KubectlBin};
use tether_tests::podhttp::{HttpClient, PodHttpServer};
use tether_tests::pty::PtySession;
use tether_tests::report::{self, Case, CaseResult};
use tether_tests::{numbered_lines, random_bytes, sha256_hex};

/// Bound on an ordinary kubectl run.
const T: Duration = Duration::from_secs(30);
/// Bound on a whole case.
const CASE_LIMIT: Duration = Duration::from_secs(120);
/// Cases of one version running at the same time.
const PARALLEL: usize = 8;
/// Size of the stdin pushed through `exec -i … cat`.
const BIG_STDIN: usize = 10 << 20;

const NODE1: &str = "edge-1";
const NODE2: &str = "edge-2";
const NS: &str = "default";

fn main() -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kubectl e2e: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let selection = Selection::from_args();
    if selection.list {
        for (name, _) in cases().into_iter().filter(|(n, _)| selection.selects(n)) {
            println!("{name}: test");
        }
        return ExitCode::SUCCESS;
    }
    if selection.ignored_only {
        println!("test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out");
        return ExitCode::SUCCESS;
    }
    match runtime.block_on(suite(selection)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            println!("kubectl e2e: FAILED before any case ran: {e:#}");
            println!(
                "test result: FAILED. 0 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out"
            );
            ExitCode::FAILURE
        }
    }
}

/// What every container runs under cri-kubelet: `attach` a shell on its stdin (like
/// kubelet-sim's main process), the others copy their FIFO (`Cluster::append_log`) to
/// their stdout, which containerd logs.
const CRI_SCRIPT: &str = "case $CONTAINER in attach) exec sh ;; \
     *) exec cat 0<>\"/share/${POD_NAMESPACE}_${POD_NAME}_$CONTAINER\" ;; esac";

fn spec(mode: Mode, replicas: usize, cri_runtime: Option<PathBuf>) -> ClusterSpec {
    ClusterSpec {
        mode,
        nodes: vec![
            NodeSpec {
                name: NODE1.into(),
                pods: vec![PodSpec::new(NS, "p1", &["c1", "follow", "attach"])],
            },
            NodeSpec {
                name: NODE2.into(),
                pods: vec![PodSpec::new(NS, "p2", &["c1"])],
            },
        ],
        phantom_pods: vec![(NODE2.into(), PodSpec::new(NS, "ghost", &["c1"]))],
        // edge-2's kubelet also runs a `p1`, which edge-2 reports: the apiserver places
        // p1 on edge-1, so every request for it must go there (two-edges-own-routes).
        impostor_pods: vec![(NODE2.into(), PodSpec::new(NS, "p1", &["c1"]))],
        own_process_groups: false,
        certs_via_cli: false,
        cri_script: cri_runtime.as_ref().map(|_| CRI_SCRIPT.to_string()),
        cri_runtime,
        replicas,
        cloud_args: Vec::new(),
        edge_args: Vec::new(),
    }
}

/// Which cases to run, from libtest-style arguments: substrings selecting case names,
/// `--skip SUBSTRING`, `--list` (print the names), `--ignored` (there are none: run
/// nothing); other options are accepted and ignored, with their values.
#[derive(Debug, Clone, Default)]
struct Selection {
    include: Vec<String>,
    skip: Vec<String>,
    list: bool,
    ignored_only: bool,
}

impl Selection {
    fn from_args() -> Selection {
        let mut sel = Selection::default();
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            match a.as_str() {
                "--list" => sel.list = true,
                "--ignored" => sel.ignored_only = true,
                "--skip" => sel.skip.extend(args.next()),
                "--test-threads" | "--color" | "--format" | "--logfile" | "-Z" => {
                    let _ = args.next();
                }
                _ if a.starts_with('-') => {}
                _ => sel.include.push(a),
            }
        }
        sel
    }

    fn selects(&self, name: &str) -> bool {
        (self.include.is_empty() || self.include.iter().any(|f| name.contains(f.as_str())))
            && !self.skip.iter().any(|f| name.contains(f.as_str()))
    }
}

async fn suite(selection: Selection) -> Result<bool> {
    let started = std::time::Instant::now();
    let mode = Mode::from_env()?;
    let replicas = tether_tests::cluster::replicas_from_env()?;
    if replicas > 1 && mode != Mode::Tunnel {
        bail!("TETHER_E2E_REPLICAS={replicas} needs the tunnel mode");
    }
    let cri = tether_tests::cluster::cri_from_env()?;
    if cri && mode != Mode::Tunnel {
        bail!("TETHER_E2E_KUBELET=cri needs the tunnel mode (cri-kubelet serves plain HTTP)");
    }
    // Every binary first, so that a missing one is reported once, with how to build it.
    let kubelet = if cri {
        bins::CRI_KUBELET
    } else {
        bins::KUBELET_SIM
    };
    let mut needed = vec![kubelet, bins::APISERVER_SIM];
    if mode == Mode::Tunnel {
        needed.extend([bins::CLOUD, bins::EDGE]);
    }
    for name in needed {
        bins::binary(name)?;
    }
    let bins = kubectl::under_test().await?;
    let root = tempfile::Builder::new()
        .prefix("tether-e2e-")
        .tempdir()
        .context("creating the run directory")?;
    let containerd = if cri {
        let logs = root.path().join("process-logs-containerd");
        std::fs::create_dir_all(&logs).context("creating containerd's log directory")?;
        Some(
            Containerd::start(&root.path().join("containerd"), &logs)
                .await
                .context("a private containerd must run here (scripts/setup.sh installs it)")?,
        )
    } else {
        None
    };
    println!(
        "kubectl e2e: {mode}; kubelet: {}; {replicas} cloud replica(s); apiserver-sim exec/attach over WebSocket: {}; kubectl {}; run directory {}",
        if cri {
            "cri-kubelet, pods in a private containerd"
        } else {
            "kubelet-sim"
        },
        tether_tests::cluster::apiserver_streams_from_env()?,
        bins.iter()
            .map(|b| format!("{} ({})", b.version, b.path.display()))
            .collect::<Vec<_>>()
            .join(", "),
        root.path().display()
    );
    let runs = bins.iter().enumerate().map(|(i, bin)| {
        let dir = root.path().join(format!("{i}-kubectl-{}", bin.version));
        let spec = spec(
            mode,
            replicas,
            containerd.as_ref().map(|c| c.socket.clone()),
        );
        run_version(bin.clone(), spec, dir, selection.clone())
    });
    let results: Vec<Vec<CaseResult>> = futures_util::future::join_all(runs).await;
    let mut all: Vec<CaseResult> = results.into_iter().flatten().collect();
    if let Some(ctd) = containerd {
        // cri-kubelet removes its pods at SIGTERM: nothing may be left for the safety net.
        let started = std::time::Instant::now();
        let error = match ctd.stop().await {
            Ok(left) if left.is_empty() => None,
            Ok(left) => Some(format!("left behind in containerd: {left:?}")),
            Err(e) => Some(format!("stopping containerd: {e:#}")),
        };
        all.push(CaseResult {
            group: "containerd".into(),
            name: "containerd-left-clean",
            elapsed: started.elapsed(),
            error,
        });
    }
    let ok = all.iter().all(CaseResult::passed);
    println!();
    for r in all.iter().filter(|r| !r.passed()) {
        println!(
            "FAILED [kubectl {}] {}: {}",
            r.group,
            r.name,
            r.error.as_deref().unwrap_or("")
        );
    }
    let mut seen = Vec::new();
    for b in &bins {
        if !seen.contains(&b.version) {
            println!("{}", report::summary_line(&b.version, &all));
            seen.push(b.version.clone());
        }
    }
    if ok {
        println!("kubectl e2e: all {} cases passed", all.len());
    }
    // The line libtest prints, so that tools totalling `test result:` lines count these.
    let passed = all.iter().filter(|r| r.passed()).count();
    println!(
        "test result: {}. {passed} passed; {} failed; 0 ignored; 0 measured; 0 filtered out; \
         finished in {:.2}s",
        if ok { "ok" } else { "FAILED" },
        all.len() - passed,
        started.elapsed().as_secs_f64()
    );
    if ok && std::env::var_os("TETHER_E2E_KEEP").is_none() {
        drop(root);
    } else {
        let kept = root.keep();
        println!(
            "kubectl e2e: logs and certificates kept in {}",
            kept.display()
        );
    }
    Ok(ok)
}

/// Everything a case needs.
struct Ctx {
    cluster: Cluster,
    k: Kubectl,
    /// A scratch directory of this version's run.
    scratch: PathBuf,
    /// The pods are containerd's (cri-kubelet), not kubelet-sim's.
    cri: bool,
}

type CaseFn = fn(Arc<Ctx>) -> report::CaseFuture;

fn cases() -> Vec<(&'static str, CaseFn)> {
    vec![
        ("exec-exit-code-stdout-stderr", |c| {
            Box::pin(exec_exit_code(c))
        }),
        ("exec-stdin-10MiB-cat", |c| Box::pin(exec_big_stdin(c))),
        ("exec-tty-resize", |c| Box::pin(exec_tty(c))),
        ("logs", |c| Box::pin(logs_all(c))),
        ("logs-tail-5", |c| Box::pin(logs_tail(c))),
        ("logs-timestamps", |c| Box::pin(logs_timestamps(c))),
        ("logs-limit-bytes-previous", |c| {
            Box::pin(logs_limit_previous(c))
        }),
        ("logs-follow-appended", |c| Box::pin(logs_follow(c))),
        ("attach", |c| Box::pin(attach(c))),
        ("port-forward-http", |c| Box::pin(port_forward(c))),
        ("cp-to-pod", |c| Box::pin(cp_to_pod(c))),
        ("cp-from-pod", |c| Box::pin(cp_from_pod(c))),
        ("get-raw-node-metrics", |c| Box::pin(node_metrics(c))),
        ("get-raw-node-stats-summary", |c| Box::pin(node_stats(c))),
        ("two-edges-own-routes", |c| Box::pin(two_edges(c))),
        ("unknown-pod-refused", |c| Box::pin(unknown_pod(c))),
    ]
}

async fn run_version(
    bin: KubectlBin,
    spec: ClusterSpec,
    dir: PathBuf,
    selection: Selection,
) -> Vec<CaseResult> {
    let replicas = spec.replicas;
    let selected: Vec<(&'static str, CaseFn)> = cases()
        .into_iter()
        .filter(|(name, _)| selection.selects(name))
        .collect();
    let version = bin.version.clone();
    let fail_all = |why: String| -> Vec<CaseResult> {
        println!("[kubectl {version}] cluster did not start: {why}");
        selected
            .iter()
            .map(|(name, _)| CaseResult {
                group: version.clone(),
                name,
                elapsed: Duration::ZERO,
                error: Some(format!("cluster did not start: {why}")),
            })
            .collect()
    };
    let started = std::time::Instant::now();
    let cluster = match Cluster::start(&spec, &dir).await {
        Ok(c) => c,
        Err(e) => return fail_all(format!("{e:#}")),
    };
    println!(
        "[kubectl {version}] cluster up in {:.1}s ({})",
        started.elapsed().as_secs_f64(),
        cluster.apiserver_url
    );
    let ctx = match prepare(cluster, bin, &dir).await {
        Ok(c) => Arc::new(c),
        Err(e) => return fail_all(format!("{e:#}")),
    };
    let cases: Vec<Case> = selected
        .iter()
        .map(|(name, f)| Case::new(name, f(ctx.clone())))
        .collect();
    let mut results = report::run_cases(&version, cases, PARALLEL, CASE_LIMIT).await;
    if replicas > 1 && !results.is_empty() {
        let started = std::time::Instant::now();
        let error = relayed_everywhere(&ctx.cluster)
            .await
            .err()
            .map(|e| format!("{e:#}"));
        results.push(CaseResult {
            group: version.clone(),
            name: "replicas-local-and-relayed",
            elapsed: started.elapsed(),
            error,
        });
    }
    if selected
        .iter()
        .any(|(name, _)| name.starts_with("exec") || *name == "attach")
    {
        let started = std::time::Instant::now();
        let error = stream_protocols(&ctx.cluster, &version)
            .err()
            .map(|e| format!("{e:#}"));
        results.push(CaseResult {
            group: version.clone(),
            name: "apiserver-kubelet-stream-protocols",
            elapsed: started.elapsed(),
            error,
        });
    }
    if ctx.cri {
        // What containerd's streaming server answered each upgrade, for the record.
        match ctx.cluster.cri_negotiated() {
            Ok(all) => {
                let mut counts = std::collections::BTreeMap::<String, usize>::new();
                for l in all {
                    *counts.entry(l).or_default() += 1;
                }
                for (l, n) in counts {
                    println!("FIGURE [kubectl {version}] containerd negotiated: {n}x {l}");
                }
            }
            Err(e) => println!("[kubectl {version}] containerd's upgrades unknown: {e:#}"),
        }
    }
    let Ok(mut ctx) = Arc::try_unwrap(ctx) else {
        println!("[kubectl {version}] a case still holds the cluster; it is killed on exit");
        return results;
    };
    let dead = ctx.cluster.exited();
    if !dead.is_empty() {
        println!("[kubectl {version}] processes died during the run: {dead:?}");
    }
    if results.iter().any(|r| !r.passed()) || !dead.is_empty() {
        println!(
            "[kubectl {version}] process logs (tails):\n{}",
            ctx.cluster.diagnostics(25)
        );
    }
    for line in ctx.cluster.shutdown().await {
        if !line.contains("stopped") {
            println!("[kubectl {version}] {line}");
        }
    }
    results
}

/// What apiserver-sim's exec/attach upgrades negotiated with the kubelet side, printed,
/// and checked against the mode: with `translate` (kube-apiserver's default) kubectl
/// ≥1.30's WebSocket exec/attach reach the kubelet as SPDY v4.channel.k8s.io, never as a
/// WebSocket; with `passthrough` nothing is translated; kubectl <1.30 (SPDY) passes
/// through either way.
fn stream_protocols(cluster: &Cluster, version: &str) -> Result<()> {
    let mode = cluster.apiserver_streams;
    let seen = cluster.kubelet_stream_protocols()?;
    for (what, n) in &seen {
        println!(
            "FIGURE [kubectl {version}] apiserver-sim --stream-translation {mode}: {n}x {what}"
        );
    }
    let minor = minor(version);
    let translated = seen
        .iter()
        .filter(|(w, _)| w.starts_with("translated"))
        .count();
    let ws_through = seen
        .iter()
        .filter(|(w, _)| {
            w.starts_with("passed through") && w.to_ascii_lowercase().contains("websocket")
        })
        .count();
    ensure!(
        !seen.is_empty(),
        "apiserver-sim logged no exec/attach upgrade"
    );
    if minor >= 30 && mode == "translate" {
        ensure!(
            seen.iter().any(|(w, _)| w
                == "translated: client WebSocket v5.channel.k8s.io, kubelet SPDY/3.1 v4.channel.k8s.io"),
            "no exec/attach was translated from WebSocket v5 to SPDY v4: {seen:?}"
        );
        ensure!(
            ws_through == 0,
            "a WebSocket exec/attach passed through untranslated: {seen:?}"
        );
    } else {
        ensure!(
            translated == 0,
            "translated although mode {mode}, kubectl {version}: {seen:?}"
        );
        let cri = cluster.nodes.iter().any(|n| n.cri.is_some());
        if minor >= 30 && cri {
            // containerd 1.6's streaming server answers a WebSocket exec/attach with 403;
            // kubectl then falls back to SPDY, which is what got through.
            let refused = cluster
                .cri_negotiated()?
                .iter()
                .filter(|l| {
                    l.starts_with("GET /exec -> 403") || l.starts_with("GET /attach -> 403")
                })
                .count();
            ensure!(
                refused > 0 && ws_through == 0,
                "want containerd to refuse the passed-through WebSockets (403) and kubectl to \
                 fall back to SPDY: {refused} refused, {seen:?}"
            );
        } else if minor >= 30 {
            ensure!(
                ws_through > 0,
                "no WebSocket exec/attach passed through: {seen:?}"
            );
        }
    }
    Ok(())
}

/// With several replicas: every replica took requests, some were served where they
/// landed and some relayed, and every relay a replica opened as entry was served by
/// another as holder (one hop: no replica relays what it was relayed).
async fn relayed_everywhere(cluster: &Cluster) -> Result<()> {
    use tether_tests::cluster::sample;
    let mut entry = 0.0;
    let mut holder = 0.0;
    let mut local = 0.0;
    for c in cluster.cloud.iter().chain(cluster.more_clouds.iter()) {
        let text = c.ops_get("/metrics").await?;
        let get = |s: &str| sample(&text, s).unwrap_or(0.0);
        let (e, h) = (
            get("tether_cloud_relayed_streams_total{role=\"entry\"}"),
            get("tether_cloud_relayed_streams_total{role=\"holder\"}"),
        );
        let (l, r) = (
            get("tether_cloud_route_lookups_total{result=\"local\"}"),
            get("tether_cloud_route_lookups_total{result=\"relayed\"}"),
        );
        println!(
            "FIGURE replica {}: {l} requests served locally, {r} relayed out ({e} relays opened), {h} relays served as holder",
            c.name()
        );
        ensure!(l + r > 0.0, "replica {} took no request", c.name());
        entry += e;
        holder += h;
        local += l;
    }
    ensure!(
        entry > 0.0 && local > 0.0,
        "{entry} relayed, {local} local: both kinds must occur"
    );
    ensure!(
        entry == holder,
        "{entry} relays opened but {holder} served as holder"
    );
    Ok(())
}

/// Log contents and scratch space the cases rely on.
async fn prepare(cluster: Cluster, bin: KubectlBin, dir: &Path) -> Result<Ctx> {
    for (node, pod, container, text) in [
        (NODE1, "p1", "c1", numbered_lines("edge-1 p1/c1", 1..=20)),
        (NODE2, "p2", "c1", numbered_lines("edge-2 p2/c1", 1..=20)),
        (NODE1, "p1", "follow", numbered_lines("follow", 1..=3)),
    ] {
        cluster
            .append_log(node, NS, pod, container, &text)
            .await
            .with_context(|| format!("writing {pod}/{container}'s log"))?;
    }
    let cri = cluster.node(NODE1)?.cri.is_some();
    let scratch = dir.join("scratch");
    std::fs::create_dir_all(&scratch).context("creating the scratch directory")?;
    let k = Kubectl::new(bin, &cluster.kubeconfig, &dir.join("kubectl-home"))?;
    Ok(Ctx {
        cluster,
        k,
        scratch,
        cri,
    })
}

/// Which method the apiserver stand-in used towards the kubelet for a request whose
/// kubelet URL contains `needle` (POST = SPDY, GET = WebSocket for exec).
fn proxied_method(ctx: &Ctx, needle: &str) -> Option<String> {
    let log = ctx
        .cluster
        .dir
        .join("process-logs")
        .join("apiserver-sim.log");
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .rev()
        .find(|l| l.contains("apiserver-sim: proxy ") && l.contains(needle))
        .and_then(|l| l.split_whitespace().nth(2).map(str::to_string))
}

fn minor(version: &str) -> u32 {
    version
        .split('.')
        .nth(1)
        .and_then(|m| m.parse().ok())
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------
// exec

async fn exec_exit_code(ctx: Arc<Ctx>) -> Result<()> {
    let out = ctx
        .k
        .run(
            &[
                "exec",
                "p1",
                "-c",
                "c1",
                "--",
                "sh",
                "-c",
                "echo to-stdout; echo to-stderr >&2; exit 3",
            ],
            None,
            T,
        )
        .await?;
    ensure!(
        out.code == Some(3),
        "exit code {:?}, want 3; stderr: {}",
        out.code,
        out.stderr
    );
    ensure!(
        out.stdout == b"to-stdout\n",
        "stdout {:?}, want \"to-stdout\\n\"",
        out.stdout_text()
    );
    ensure!(
        out.stderr.contains("to-stderr\n"),
        "stderr lacks the command's stderr: {:?}",
        out.stderr
    );
    // Which upgrade reached the kubelet side: kubectl's SPDY (POST) before 1.30;
    // kubectl's WebSocket (GET) after, when apiserver-sim passes it through; SPDY (POST)
    // again when apiserver-sim translates it, as kube-apiserver does by default.
    // containerd's streaming server refuses a WebSocket exec (403) and kubectl falls back
    // to SPDY: with cri-kubelet the last attempt is a POST either way.
    let method = proxied_method(&ctx, "/exec/default/p1/c1?command=sh");
    let want = if minor(&ctx.k.bin.version) >= 30
        && ctx.cluster.apiserver_streams == "passthrough"
        && !ctx.cri
    {
        "GET"
    } else {
        "POST"
    };
    ensure!(
        method.as_deref() == Some(want),
        "the exec reached the kubelet side as {method:?}, want {want} for kubectl {}",
        ctx.k.bin.version
    );
    Ok(())
}

async fn exec_big_stdin(ctx: Arc<Ctx>) -> Result<()> {
    let data = random_bytes(BIG_STDIN);
    let out = ctx
        .k
        .run(
            &["exec", "-i", "p1", "-c", "c1", "--", "cat"],
            Some(data.clone()),
            Duration::from_secs(100),
        )
        .await?
        .ok("exec -i cat")?;
    ensure!(
        out.stdout.len() == data.len(),
        "cat returned {} bytes of {}",
        out.stdout.len(),
        data.len()
    );
    ensure!(
        sha256_hex(&out.stdout) == sha256_hex(&data),
        "cat returned different bytes (same length)"
    );
    Ok(())
}

/// Types `stty size` until the terminal shows `want` (the resize travels
/// asynchronously), bounded.
async fn stty_size_shows(pty: &mut PtySession, want: &str) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mark = pty.mark();
        pty.send("stty size\r")?;
        if pty
            .expect_after(mark, &format!("{want}\r\n"), Duration::from_millis(1500))
            .await
            .is_ok()
        {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "`stty size` never showed {want:?}; terminal: {:?}",
                clip(&pty.output())
            );
        }
    }
}

async fn exec_tty(ctx: Arc<Ctx>) -> Result<()> {
    let cmd = ctx.k.std_command(&[
        "exec",
        "-it",
        "p1",
        "-c",
        "c1",
        "--",
        "env",
        "PS1=tether-pty$ ",
        "sh",
    ]);
    let mut pty = PtySession::spawn(cmd, 31, 97)?;
    pty.expect("tether-pty$ ", Duration::from_secs(20)).await?;
    let mark = pty.mark();
    pty.send("echo pty-$((6*7))\r")?;
    pty.expect_after(mark, "pty-42\r\n", Duration::from_secs(10))
        .await?;
    let mark = pty.mark();
    pty.send("test -t 0 && echo stdin-is-a-tty; tty\r")?;
    pty.expect_after(mark, "stdin-is-a-tty\r\n", Duration::from_secs(10))
        .await?;
    pty.expect_after(mark, "\r\n/dev/pts/", Duration::from_secs(10))
        .await?;
    stty_size_shows(&mut pty, "31 97").await?;
    pty.resize(42, 123)?;
    stty_size_shows(&mut pty, "42 123").await?;
    pty.send("exit 0\r")?;
    let code = pty.wait(Duration::from_secs(15)).await?;
    ensure!(
        code == Some(0),
        "kubectl exec -it exited {code:?}; terminal: {:?}",
        clip(&pty.output())
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// logs

async fn logs_all(ctx: Arc<Ctx>) -> Result<()> {
    let out = ctx
        .k
        .run(&["logs", "p1", "-c", "c1"], None, T)
        .await?
        .ok("logs")?;
    let want = numbered_lines("edge-1 p1/c1", 1..=20);
    ensure!(
        out.stdout_text() == want,
        "logs: got {:?}, want {want:?}",
        out.stdout_text()
    );
    Ok(())
}

async fn logs_tail(ctx: Arc<Ctx>) -> Result<()> {
    let out = ctx
        .k
        .run(&["logs", "p1", "-c", "c1", "--tail=5"], None, T)
        .await?
        .ok("logs --tail=5")?;
    let want = numbered_lines("edge-1 p1/c1", 16..=20);
    ensure!(
        out.stdout_text() == want,
        "logs --tail=5: got {:?}, want {want:?}",
        out.stdout_text()
    );
    Ok(())
}

async fn logs_limit_previous(ctx: Arc<Ctx>) -> Result<()> {
    let out = ctx
        .k
        .run(&["logs", "p1", "-c", "c1", "--limit-bytes=9"], None, T)
        .await?
        .ok("logs --limit-bytes=9")?;
    ensure!(
        out.stdout == b"edge-1 p1",
        "logs --limit-bytes=9: {:?}",
        out.stdout_text()
    );
    // c1 never restarted: there is no previous container, and kubectl says so.
    let out = ctx
        .k
        .run(&["logs", "p1", "-c", "c1", "--previous"], None, T)
        .await?;
    ensure!(
        out.code != Some(0)
            && out.stdout.is_empty()
            && out.stderr.contains("previous terminated container")
            && out.stderr.contains("c1"),
        "logs --previous: exit {:?}, stdout {:?}, stderr {:?}",
        out.code,
        out.stdout_text(),
        out.stderr
    );
    Ok(())
}

async fn logs_timestamps(ctx: Arc<Ctx>) -> Result<()> {
    let out = ctx
        .k
        .run(&["logs", "p1", "-c", "c1", "--timestamps"], None, T)
        .await?
        .ok("logs --timestamps")?;
    let text = out.stdout_text();
    let want: Vec<String> = (1..=20)
        .map(|i| format!("edge-1 p1/c1 line {i:03}"))
        .collect();
    let lines: Vec<&str> = text.lines().collect();
    ensure!(
        lines.len() == want.len(),
        "{} lines, want {}: {text:?}",
        lines.len(),
        want.len()
    );
    let now = time::OffsetDateTime::now_utc();
    for (line, want) in lines.iter().zip(&want) {
        let (ts, rest) = line
            .split_once(' ')
            .with_context(|| format!("no timestamp in {line:?}"))?;
        let t = time::OffsetDateTime::parse(ts, &time::format_description::well_known::Rfc3339)
            .with_context(|| format!("bad timestamp {ts:?} in {line:?}"))?;
        ensure!(
            (now - t).whole_hours().abs() < 24,
            "implausible timestamp {ts}"
        );
        // The kubelet's RFC3339NanoFixed: always nine fractional digits.
        ensure!(
            ts.len() == "2006-01-02T15:04:05.000000000Z".len(),
            "timestamp {ts:?} is not fixed-width nanoseconds"
        );
        ensure!(rest == want, "line {rest:?}, want {want:?}");
    }
    Ok(())
}

async fn logs_follow(ctx: Arc<Ctx>) -> Result<()> {
    let append = |text: String| {
        let ctx = ctx.clone();
        async move {
            ctx.cluster
                .append_log(NODE1, NS, "p1", "follow", &text)
                .await
        }
    };
    let mut proc = ctx
        .k
        .spawn("logs-follow", &["logs", "-f", "p1", "-c", "follow"], false)?;
    let mut want: Vec<String> = (1..=3).map(|i| format!("follow line {i:03}")).collect();
    let got = proc.wait_lines(want.len(), Duration::from_secs(20)).await?;
    ensure!(got == want, "before appending: got {got:?}, want {want:?}");
    let mut next = 4u32;
    for batch in 0..6 {
        let size = if batch % 2 == 0 { 1 } else { 40 };
        let text = numbered_lines("follow", next..=next + size - 1);
        want.extend(text.lines().map(str::to_string));
        next += size;
        append(text).await?;
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // A line written in two pieces is printed once, whole.
    append("follow line split-".into()).await?;
    tokio::time::sleep(Duration::from_millis(350)).await;
    append("in-two\n".into()).await?;
    want.push("follow line split-in-two".into());
    let got = proc.wait_lines(want.len(), Duration::from_secs(20)).await?;
    // Anything doubled would show up a little later: give it the chance.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let got_after = proc.lines();
    proc.kill().await;
    ensure!(
        got_after.len() == got.len(),
        "extra lines after the expected {}: {:?}",
        want.len(),
        &got_after[got.len().min(got_after.len())..]
    );
    if got != want {
        let first_diff = got.iter().zip(&want).position(|(a, b)| a != b);
        bail!(
            "logs -f: {} lines, want {}; first difference at {first_diff:?}: got {:?}",
            got.len(),
            want.len(),
            first_diff.map(|i| (&got[i], &want[i]))
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// attach

async fn attach(ctx: Arc<Ctx>) -> Result<()> {
    let mut proc = ctx
        .k
        .spawn("attach", &["attach", "-i", "p1", "-c", "attach"], true)?;
    // The container's main process (/bin/sh) starts with the first attach.
    let mut seen = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !seen {
        proc.write_stdin(b"echo attached-$((2+3))\n").await?;
        seen = proc
            .wait_line("attached-5", Duration::from_secs(2), |l| l == "attached-5")
            .await
            .is_ok();
        if !seen && tokio::time::Instant::now() >= deadline {
            bail!(
                "attach: no output; stdout {:?}; stderr {}",
                proc.lines(),
                proc.stderr_tail(10)
            );
        }
    }
    proc.write_stdin(b"echo to-stderr >&2; echo second-$((3*3))\n")
        .await?;
    proc.wait_line("second-9", Duration::from_secs(10), |l| l == "second-9")
        .await?;
    proc.write_stdin(b"exit 0\n").await?;
    let status = proc.wait_exit(Duration::from_secs(15)).await?;
    ensure!(
        status.success(),
        "kubectl attach ended with {status}; stderr: {}",
        proc.stderr_tail(10)
    );
    let err = std::fs::read_to_string(proc.log_path()).unwrap_or_default();
    ensure!(
        err.contains("to-stderr"),
        "the attached process's stderr did not reach kubectl's stderr: {err:?}"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// port-forward

async fn port_forward(ctx: Arc<Ctx>) -> Result<()> {
    let server = PodHttpServer::start().await?;
    let mut proc = ctx.k.spawn(
        "port-forward",
        &["port-forward", "p1", &format!(":{}", server.port)],
        false,
    )?;
    let local = kubectl::forwarded_port(&mut proc, Duration::from_secs(20)).await?;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], local));

    // Several requests on one kept-alive connection.
    let mut c = HttpClient::connect(addr).await?;
    for i in 0..3 {
        let body = c
            .request(Method::GET, &format!("/hello/a{i}"), Bytes::new())
            .await?;
        ensure!(
            body == format!("hello a{i} from behind the pod").as_bytes(),
            "GET /hello/a{i}: {:?}",
            String::from_utf8_lossy(&body)
        );
    }
    // A 1 MiB body there and back.
    let big = Bytes::from(random_bytes(1 << 20));
    let echoed = c.request(Method::POST, "/echo", big.clone()).await?;
    ensure!(
        sha256_hex(&echoed) == sha256_hex(&big),
        "POST /echo of 1 MiB came back different ({} bytes)",
        echoed.len()
    );
    // Several connections at once.
    let mut handles = Vec::new();
    for i in 0..4 {
        handles.push(tokio::spawn(async move {
            let mut c = HttpClient::connect(addr).await?;
            let body = c
                .request(Method::GET, &format!("/hello/b{i}"), Bytes::new())
                .await?;
            ensure!(
                body == format!("hello b{i} from behind the pod").as_bytes(),
                "GET /hello/b{i}: {:?}",
                String::from_utf8_lossy(&body)
            );
            Ok::<_, anyhow::Error>(())
        }));
    }
    for h in handles {
        h.await.context("request task")??;
    }
    ensure!(
        server.served() == 8,
        "the pod's server answered {} requests, want 8",
        server.served()
    );
    proc.kill().await;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// cp

/// A directory that only this case uses, as the pod sees it (the simulator's containers
/// share this machine's filesystem; a containerd container has its own).
fn pod_dir(ctx: &Ctx, name: &str) -> Result<String> {
    if ctx.cri {
        return Ok(format!("/tmp/{name}"));
    }
    let d = ctx.scratch.join(name).join("in-pod");
    d.to_str()
        .map(str::to_string)
        .context("scratch path is not UTF-8")
}

/// `sha256sum path` run in the pod.
async fn pod_sha256(ctx: &Ctx, path: &str) -> Result<String> {
    let out = ctx
        .k
        .run(
            &["exec", "p1", "-c", "c1", "--", "sha256sum", path],
            None,
            T,
        )
        .await?
        .ok("exec sha256sum")?;
    out.stdout_text()
        .split_whitespace()
        .next()
        .map(str::to_string)
        .context("no digest from sha256sum")
}

async fn cp_to_pod(ctx: Arc<Ctx>) -> Result<()> {
    let dir = pod_dir(&ctx, "cp-to-pod")?;
    ctx.k
        .run(
            &["exec", "p1", "-c", "c1", "--", "mkdir", "-p", &dir],
            None,
            T,
        )
        .await?
        .ok("exec mkdir")?;
    let local = ctx.scratch.join("cp-to-pod").join("upload.bin");
    std::fs::create_dir_all(ctx.scratch.join("cp-to-pod")).context("creating the local dir")?;
    let data = random_bytes(3 << 20);
    std::fs::write(&local, &data).with_context(|| format!("writing {}", local.display()))?;
    let local_s = local.to_str().context("scratch path is not UTF-8")?;
    let remote = format!("{dir}/upload.bin");
    ctx.k
        .run(
            &["cp", local_s, &format!("p1:{remote}"), "-c", "c1"],
            None,
            Duration::from_secs(60),
        )
        .await?
        .ok("cp to pod")?;
    let in_pod = pod_sha256(&ctx, &remote).await?;
    ensure!(
        in_pod == sha256_hex(&data),
        "the copy in the pod differs: sha256 {in_pod}, want {}",
        sha256_hex(&data)
    );
    Ok(())
}

async fn cp_from_pod(ctx: Arc<Ctx>) -> Result<()> {
    let dir = pod_dir(&ctx, "cp-from-pod")?;
    let remote = format!("{dir}/made-in-pod.bin");
    let script = format!("mkdir -p {dir} && head -c 3000001 /dev/urandom > {remote}");
    ctx.k
        .run(
            &["exec", "p1", "-c", "c1", "--", "sh", "-c", &script],
            None,
            T,
        )
        .await?
        .ok("exec head /dev/urandom")?;
    let in_pod = pod_sha256(&ctx, &remote).await?;
    let local = ctx.scratch.join("cp-from-pod").join("download.bin");
    let local_s = local.to_str().context("scratch path is not UTF-8")?;
    ctx.k
        .run(
            &["cp", &format!("p1:{remote}"), local_s, "-c", "c1"],
            None,
            Duration::from_secs(60),
        )
        .await?
        .ok("cp from pod")?;
    let data = std::fs::read(&local).with_context(|| format!("reading {}", local.display()))?;
    ensure!(
        data.len() == 3_000_001,
        "copied {} bytes, want 3000001",
        data.len()
    );
    ensure!(
        sha256_hex(&data) == in_pod,
        "the copy differs from the pod's file"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// nodes/proxy

async fn get_raw(ctx: &Ctx, path: &str) -> Result<String> {
    Ok(ctx
        .k
        .run(&["get", "--raw", path], None, T)
        .await?
        .ok(&format!("get --raw {path}"))?
        .stdout_text())
}

async fn node_metrics(ctx: Arc<Ctx>) -> Result<()> {
    let text = get_raw(&ctx, "/api/v1/nodes/edge-1/proxy/metrics").await?;
    ensure!(
        text.contains("kubelet_node_name{node=\"edge-1\"} 1"),
        "metrics lack kubelet_node_name for edge-1: {}",
        clip(&text)
    );
    let text = get_raw(&ctx, "/api/v1/nodes/edge-1/proxy/metrics/resource").await?;
    for series in [
        "container_cpu_usage_seconds_total{container=\"c1\",namespace=\"default\",pod=\"p1\"} ",
        "container_memory_working_set_bytes{container=\"c1\",namespace=\"default\",pod=\"p1\"} ",
        "node_cpu_usage_seconds_total ",
    ] {
        ensure!(
            text.lines().any(|l| l.starts_with(series)),
            "resource metrics lack {series}: {}",
            clip(&text)
        );
    }
    ensure!(
        !text.contains("pod=\"p2\""),
        "edge-1's resource metrics show edge-2's pod: {}",
        clip(&text)
    );
    Ok(())
}

async fn stats_of(ctx: &Ctx, node: &str) -> Result<serde_json::Value> {
    let text = get_raw(ctx, &format!("/api/v1/nodes/{node}/proxy/stats/summary")).await?;
    serde_json::from_str(&text)
        .with_context(|| format!("stats/summary is not JSON: {}", clip(&text)))
}

fn pod_names(stats: &serde_json::Value) -> Vec<String> {
    stats["pods"]
        .as_array()
        .map(|pods| {
            pods.iter()
                .filter_map(|p| p["podRef"]["name"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

async fn node_stats(ctx: Arc<Ctx>) -> Result<()> {
    let s = stats_of(&ctx, NODE1).await?;
    ensure!(
        s["node"]["nodeName"] == NODE1,
        "stats/summary names node {}",
        s["node"]["nodeName"]
    );
    ensure!(
        pod_names(&s) == vec!["p1".to_string()],
        "stats/summary pods {:?}",
        pod_names(&s)
    );
    // p1's c1 (running since the start) has used CPU and memory.
    let c1 = s["pods"][0]["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "c1"))
        .with_context(|| format!("no container c1 in p1's stats: {}", s["pods"][0]))?;
    ensure!(
        c1["cpu"]["usageCoreNanoSeconds"].as_u64().unwrap_or(0) > 0
            && c1["memory"]["workingSetBytes"].as_u64().unwrap_or(0) > 0,
        "p1/c1's stats show no CPU or memory use: {c1}"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// two edges

/// Where an exec in `pod`'s c1 ran: kubelet-sim's working directory, named after the
/// node and container; in a containerd container, the node, pod and container its
/// cri-kubelet gave it in its environment (as the downward API would).
async fn whereabouts(ctx: &Ctx, pod: &str) -> Result<String> {
    let probe: &[&str] = if ctx.cri {
        &[
            "sh",
            "-c",
            "echo $NODE_NAME $POD_NAMESPACE/$POD_NAME/$CONTAINER",
        ]
    } else {
        &["pwd"]
    };
    let mut args = vec!["exec", pod, "-c", "c1", "--"];
    args.extend(probe);
    Ok(ctx
        .k
        .run(&args, None, T)
        .await?
        .ok(&format!("exec {pod} {probe:?}"))?
        .stdout_text())
}

async fn two_edges(ctx: Arc<Ctx>) -> Result<()> {
    // Both at once: each container runs in its own node's kubelet.
    let (at1, at2) = tokio::join!(whereabouts(&ctx, "p1"), whereabouts(&ctx, "p2"));
    let (at1, at2) = (at1?, at2?);
    for (at, node, pod) in [(&at1, NODE1, "p1"), (&at2, NODE2, "p2")] {
        let right = if ctx.cri {
            *at == format!("{node} {NS}/{pod}/c1\n")
        } else {
            at.contains(&format!("/kubelet-sim-{node}/{NS}_{pod}_c1"))
        };
        ensure!(right, "{pod}'s exec ran at {at:?}");
    }
    let (l1, l2) = tokio::join!(
        ctx.k.run(&["logs", "p1", "-c", "c1", "--tail=1"], None, T),
        ctx.k.run(&["logs", "p2", "--tail=1"], None, T)
    );
    let (l1, l2) = (l1?.ok("logs p1")?, l2?.ok("logs p2")?);
    ensure!(
        l1.stdout_text() == "edge-1 p1/c1 line 020\n",
        "p1's log: {:?}",
        l1.stdout_text()
    );
    ensure!(
        l2.stdout_text() == "edge-2 p2/c1 line 020\n",
        "p2's log: {:?}",
        l2.stdout_text()
    );
    let s2 = stats_of(&ctx, NODE2).await?;
    ensure!(
        // edge-2's kubelet also runs the impostor p1 (it reports what it runs).
        s2["node"]["nodeName"] == NODE2 && {
            let mut names = pod_names(&s2);
            names.sort();
            names == ["p1", "p2"]
        },
        "edge-2's stats/summary: node {} pods {:?}",
        s2["node"]["nodeName"],
        pod_names(&s2)
    );
    let m2 = get_raw(&ctx, "/api/v1/nodes/edge-2/proxy/metrics").await?;
    ensure!(
        m2.contains("kubelet_node_name{node=\"edge-2\"} 1"),
        "edge-2's metrics: {}",
        clip(&m2)
    );
    // What answered, straight from the response header, as the apiserver dials it.
    for (node, pod) in [(NODE1, "p1"), (NODE2, "p2")] {
        let r = ctx
            .cluster
            .kubelet_get(node, &format!("/containerLogs/{NS}/{pod}/c1?tailLines=1"))
            .await?;
        ensure!(
            r.status.is_success() && r.node() == Some(node),
            "logs of {pod}: {} from node {:?}",
            r.status,
            r.node()
        );
        let r = ctx.cluster.kubelet_get(node, "/stats/summary").await?;
        ensure!(
            r.status.is_success() && r.node() == Some(node),
            "stats/summary with SNI/Host {node}: {} from node {:?}",
            r.status,
            r.node()
        );
    }
    // edge-2 claims p1, which the apiserver places on edge-1: the cloud refused the
    // claim and counted it (above, p1 was reached on edge-1 only).
    if ctx.cluster.cloud.is_some() {
        let mut refused = 0.0;
        for c in ctx
            .cluster
            .cloud
            .iter()
            .chain(ctx.cluster.more_clouds.iter())
        {
            let text = c.ops_get("/metrics").await?;
            refused += tether_tests::cluster::sample(
                &text,
                "tether_cloud_claims_refused_total{kind=\"pod\"}",
            )
            .unwrap_or(0.0);
        }
        ensure!(
            refused > 0.0,
            "edge-2's claim of p1 was not refused by any cloud replica"
        );
    }
    Ok(())
}

async fn unknown_pod(ctx: Arc<Ctx>) -> Result<()> {
    // The apiserver believes `ghost` runs on edge-2; no kubelet runs it.
    let out = ctx.k.run(&["logs", "ghost"], None, T).await?;
    ensure!(
        out.code != Some(0) && out.stdout.is_empty(),
        "logs ghost: exit {:?}, stdout {:?}",
        out.code,
        out.stdout_text()
    );
    let out = ctx
        .k
        .run(&["exec", "ghost", "--", "echo", "reached"], None, T)
        .await?;
    ensure!(
        out.code != Some(0) && !out.stdout_text().contains("reached"),
        "exec ghost: exit {:?}, stdout {:?}",
        out.code,
        out.stdout_text()
    );
    let r = ctx
        .cluster
        .kubelet_get(NODE2, "/containerLogs/default/ghost/c1")
        .await?;
    ensure!(
        !r.status.is_success(),
        "logs of ghost answered {}",
        r.status
    );
    ensure!(
        r.node().is_none() || r.node() == Some(NODE2),
        "a request for edge-2's pod was answered by {:?}",
        r.node()
    );
    Ok(())
}
