//! kubectl against real containers: a private containerd runs the pods as CRI sandboxes
//! (host network) with containers from a locally built busybox image; `cri-kubelet`
//! serves the kubelet API by calling the CRI and proxying the upgrades to containerd's
//! streaming server; the requests travel apiserver-sim → tether-cloud → tether-edge →
//! cri-kubelet. Each kubectl under test (1.28: SPDY; 1.33: WebSocket) runs exec (exit
//! code, stdout/stderr apart, stdin), `exec -it` with a real pty and a resize, attach,
//! logs (all, tail, timestamps, follow) and port-forward. The upgrade protocols that
//! containerd's streaming server negotiated are printed. containerd and everything it
//! made are removed at the end. The binaries must be built first
//! (`cargo build --workspace --bins`).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use bytes::Bytes;
use http::Method;
use tether_tests::cluster::{Cluster, ClusterSpec, Mode, NodeSpec, PodSpec};
use tether_tests::containerd::Containerd;
use tether_tests::kubectl::{self, clip, Kubectl};
use tether_tests::podhttp::{HttpClient, PodHttpServer};
use tether_tests::pty::PtySession;
use tether_tests::{random_bytes, sha256_hex};

const T: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kubectl_against_containerd() {
    let dir = tempfile::Builder::new()
        .prefix("tether-cri-e2e-")
        .tempdir()
        .unwrap();
    let logs = dir.path().join("process-logs-containerd");
    std::fs::create_dir_all(&logs).unwrap();
    let ctd = Containerd::start(&dir.path().join("containerd"), &logs)
        .await
        .expect("a private containerd must run here (scripts/setup.sh installs it)");
    let result = run_all(dir.path(), &ctd).await;
    let leftovers = ctd.stop().await;
    if let Err(e) = &result {
        eprintln!("keeping {} for inspection", dir.path().display());
        std::mem::forget(dir);
        panic!("{e:#}");
    }
    let leftovers = leftovers.expect("stopping containerd");
    // cri-kubelet removes its pods at SIGTERM: nothing may be left for the safety net.
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
}

async fn run_all(dir: &Path, ctd: &Containerd) -> Result<()> {
    let spec = ClusterSpec {
        mode: Mode::Tunnel,
        nodes: vec![NodeSpec {
            name: "edge-1".into(),
            pods: vec![PodSpec::new("default", "p1", &["c1", "c2"])],
        }],
        phantom_pods: Vec::new(),
        own_process_groups: false,
        certs_via_cli: false,
        cri_runtime: Some(ctd.socket.clone()),
        replicas: 1,
    };
    let cluster = Cluster::start(&spec, &dir.join("cluster")).await?;
    let result = cases(&cluster, dir).await;
    if result.is_err() {
        eprintln!("{}", cluster.diagnostics(30));
    }
    for line in cluster.shutdown().await {
        ensure!(line.contains("stopped"), "{line}");
    }
    result
}

async fn cases(cluster: &Cluster, dir: &Path) -> Result<()> {
    let mut earlier = 0;
    for bin in kubectl::under_test().await? {
        let version = bin.version.clone();
        let k = Kubectl::new(
            bin,
            &cluster.kubeconfig,
            &dir.join(format!("home-{version}")),
        )?;
        let steps: [(&str, Result<()>); 6] = [
            ("exec", exec(&k).await),
            ("exec -it", exec_tty(&k).await),
            ("attach", attach(&k, &version).await),
            ("logs", logs(&k, &version).await),
            ("logs -f", logs_follow(&k, &version).await),
            ("port-forward", port_forward(&k).await),
        ];
        for (name, r) in steps {
            r.with_context(|| format!("kubectl {version}: {name}"))?;
            println!("kubectl {version}: {name}: ok");
        }
        // Only this version's upgrades (the log holds every version's).
        let all = negotiated(cluster)?;
        let mut shown: Vec<&String> = Vec::new();
        for l in all.iter().skip(earlier) {
            if !shown.contains(&l) {
                println!("kubectl {version}: containerd negotiated: {l}");
                shown.push(l);
            }
        }
        earlier = all.len();
    }
    Ok(())
}

/// Every upgrade cri-kubelet logged (what containerd's streaming server answered), in
/// order, shortened to `METHOD /verb -> status headers`.
fn negotiated(cluster: &Cluster) -> Result<Vec<String>> {
    let log = cluster
        .dir
        .join("process-logs")
        .join("cri-kubelet-edge-1.log");
    let text =
        std::fs::read_to_string(&log).with_context(|| format!("reading {}", log.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| l.split("cri-kubelet: upgrade ").nth(1))
        .map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let verb = words
                .get(1)
                .and_then(|p| p.split('/').nth(1))
                .unwrap_or("?");
            let rest = words.get(2..).map(|w| w.join(" ")).unwrap_or_default();
            format!("{} /{verb} {rest}", words.first().unwrap_or(&"?"))
        })
        .collect())
}

async fn exec(k: &Kubectl) -> Result<()> {
    let sh = "echo to-stdout; echo to-stderr >&2; cat /etc/passwd; exit 3";
    let out = k
        .run(&["exec", "p1", "-c", "c1", "--", "sh", "-c", sh], None, T)
        .await?;
    ensure!(
        out.code == Some(3),
        "exit code {:?}, want 3; stderr: {}",
        out.code,
        out.stderr
    );
    // The image's /etc/passwd, not the host's: the command ran in the container.
    ensure!(
        out.stdout == b"to-stdout\nroot:x:0:0:root:/tmp:/bin/sh\n",
        "stdout {:?}",
        out.stdout_text()
    );
    ensure!(
        out.stderr.contains("to-stderr\n"),
        "stderr {:?}",
        out.stderr
    );
    let data = random_bytes(4 << 20);
    let out = k
        .run(
            &["exec", "-i", "p1", "-c", "c1", "--", "cat"],
            Some(data.clone()),
            Duration::from_secs(60),
        )
        .await?
        .ok("exec -i cat")?;
    ensure!(
        sha256_hex(&out.stdout) == sha256_hex(&data),
        "cat returned {} different bytes of {}",
        out.stdout.len(),
        data.len()
    );
    Ok(())
}

async fn stty_size_shows(pty: &mut PtySession, want: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
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
        if Instant::now() >= deadline {
            bail!(
                "`stty size` never showed {want:?}; terminal: {:?}",
                clip(&pty.output())
            );
        }
    }
}

async fn exec_tty(k: &Kubectl) -> Result<()> {
    let cmd = k.std_command(&[
        "exec",
        "-it",
        "p1",
        "-c",
        "c1",
        "--",
        "env",
        "PS1=cri-pty$ ",
        "sh",
    ]);
    let mut pty = PtySession::spawn(cmd, 31, 97)?;
    pty.expect("cri-pty$ ", Duration::from_secs(20)).await?;
    let mark = pty.mark();
    // A pty allocated by runc inside the container, and the container's filesystem.
    pty.send("tty; test -t 0 && echo stdin-is-a-tty; head -1 /etc/passwd\r")?;
    pty.expect_after(mark, "/dev/pts/", Duration::from_secs(10))
        .await?;
    pty.expect_after(mark, "stdin-is-a-tty\r\n", Duration::from_secs(10))
        .await?;
    pty.expect_after(
        mark,
        "root:x:0:0:root:/tmp:/bin/sh\r\n",
        Duration::from_secs(10),
    )
    .await?;
    stty_size_shows(&mut pty, "31 97").await?;
    pty.resize(42, 123)?;
    stty_size_shows(&mut pty, "42 123").await?;
    pty.send("exit 0\r")?;
    let code = pty.wait(Duration::from_secs(15)).await?;
    ensure!(
        code == Some(0),
        "exec -it exited {code:?}; terminal: {:?}",
        clip(&pty.output())
    );
    Ok(())
}

/// c2 runs `cat`: what is typed into an attach comes back and lands in its log.
async fn attach(k: &Kubectl, version: &str) -> Result<()> {
    let mut proc = k.spawn("attach", &["attach", "-i", "p1", "-c", "c2"], true)?;
    let want = format!("attached-{version}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        proc.write_stdin(format!("{want}\n").as_bytes()).await?;
        if proc
            .wait_line(&want, Duration::from_secs(2), |l| l == want)
            .await
            .is_ok()
        {
            break;
        }
        if Instant::now() >= deadline {
            bail!(
                "attach: no echo; stdout {:?}; stderr {}",
                proc.lines(),
                proc.stderr_tail(10)
            );
        }
    }
    proc.kill().await;
    Ok(())
}

async fn logs(k: &Kubectl, version: &str) -> Result<()> {
    let all = k
        .run(&["logs", "p1", "-c", "c2"], None, T)
        .await?
        .ok("logs")?
        .stdout_text();
    ensure!(all.starts_with("container c2 started\n"), "logs: {all:?}");
    ensure!(
        all.contains(&format!("attached-{version}\n")),
        "logs lack the attach: {all:?}"
    );
    let tail = k
        .run(&["logs", "p1", "-c", "c2", "--tail", "1"], None, T)
        .await?
        .ok("logs --tail")?
        .stdout_text();
    ensure!(
        tail.lines().count() == 1 && all.ends_with(&tail),
        "--tail 1: {tail:?} of {all:?}"
    );
    let ts = k
        .run(&["logs", "p1", "-c", "c1", "--timestamps"], None, T)
        .await?
        .ok("logs --timestamps")?
        .stdout_text();
    let first = ts.lines().next().unwrap_or_default();
    let (stamp, rest) = first.split_once(' ').context("no timestamp")?;
    ensure!(rest == "container c1 started", "--timestamps: {first:?}");
    time::OffsetDateTime::parse(stamp, &time::format_description::well_known::Rfc3339)
        .with_context(|| format!("timestamp {stamp:?}"))?;
    ensure!(
        stamp.len() == 30,
        "timestamp {stamp:?} is not fixed-width nanoseconds"
    );
    let limited = k
        .run(&["logs", "p1", "-c", "c2", "--limit-bytes", "9"], None, T)
        .await?
        .ok("logs --limit-bytes")?
        .stdout_text();
    ensure!(limited == "container", "--limit-bytes 9: {limited:?}");
    let prev = k
        .run(&["logs", "p1", "-c", "c2", "--previous"], None, T)
        .await?;
    ensure!(
        prev.code != Some(0) && prev.stderr.contains("previous terminated container"),
        "--previous: {prev:?}"
    );
    Ok(())
}

async fn logs_follow(k: &Kubectl, version: &str) -> Result<()> {
    let mut follow = k.spawn("logs-follow", &["logs", "-f", "p1", "-c", "c2"], false)?;
    follow
        .wait_line("the first line", Duration::from_secs(20), |l| {
            l == "container c2 started"
        })
        .await?;
    let mut attach = k.spawn("attach-follow", &["attach", "-i", "p1", "-c", "c2"], true)?;
    let want = format!("followed-{version}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        attach.write_stdin(format!("{want}\n").as_bytes()).await?;
        if follow
            .wait_line(&want, Duration::from_secs(2), |l| l == want)
            .await
            .is_ok()
        {
            break;
        }
        if Instant::now() >= deadline {
            bail!("logs -f never showed {want:?}: {:?}", follow.lines());
        }
    }
    attach.kill().await;
    follow.kill().await;
    Ok(())
}

/// Host-network pod: containerd's port-forward dials the port in the sandbox's network
/// namespace, which is the host's, where the test's server listens.
async fn port_forward(k: &Kubectl) -> Result<()> {
    let server = PodHttpServer::start().await?;
    let mut proc = k.spawn(
        "port-forward",
        &["port-forward", "p1", &format!(":{}", server.port)],
        false,
    )?;
    let local = tether_tests::kubectl::forwarded_port(&mut proc, Duration::from_secs(20)).await?;
    let mut c = HttpClient::connect(([127, 0, 0, 1], local).into()).await?;
    let body = c.request(Method::GET, "/hello/cri", Bytes::new()).await?;
    ensure!(
        body == "hello cri from behind the pod".as_bytes(),
        "GET: {:?}",
        String::from_utf8_lossy(&body)
    );
    let big = Bytes::from(random_bytes(1 << 20));
    let echoed = c.request(Method::POST, "/echo", big.clone()).await?;
    ensure!(
        sha256_hex(&echoed) == sha256_hex(&big),
        "POST /echo came back different"
    );
    proc.kill().await;
    Ok(())
}
