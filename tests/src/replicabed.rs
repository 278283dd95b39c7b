//! A replica test bed shaped like a Kubernetes cluster's, in network namespaces of its
//! own, every part a real process:
//!
//! ```text
//!  <p>-api: apiserver-sim, kubectl ──TCP VIP:10250──┐
//!                                                    ▼
//!                      <p>-svc (router): nftables DNAT, `numgen random mod N`
//!                      like kube-proxy; masquerade for the edge site
//!                        │            │            │
//!                   <p>-r0        <p>-r1        <p>-r2     one tether-cloud each ("pods"),
//!                   10.244.0.2    10.244.1.2    10.244.2.2  peers by static list
//!                                                    ▲
//!  <p>-edges: kubelet-sims, tether-edges ──UDP VIP:4433──┘  (behind NAT)
//! ```
//!
//! The service address [`VIP`] exists nowhere: the router DNATs UDP `VIP:4433` (the
//! edges' way in) to the replicas' tunnel listeners and TCP `VIP:10250` (the
//! apiserver's way in) to their kubelet APIs, each over the replicas named by
//! [`Bed::set_udp_backends`] / [`Bed::set_tcp_backends`] (all three at start).
//! Conntrack pins a flow to the replica it first reached, as on a node. The router
//! can also cut the peer link between two replicas ([`Bed::cut_peer`]).
//!
//! The test reaches a replica's operations listener (`127.0.0.1:9090` in its pod)
//! and the service from inside the namespaces, never through the host's network.
//! Processes are killed (by pid) when the bed drops; then its namespaces are deleted.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use linkemu::netns;
use tokio::process::Command;

use crate::bins;
use crate::cluster::{wait_kubeconfig, PodSpec, KUBELET_PORT};
use crate::pki::{self, PeerPki, Pki};
use crate::probe::{KubeletClient, Reply};
use crate::process::{Proc, SpawnOptions};

/// The service address (UDP for edges, TCP for the apiserver).
pub const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// The tunnel port, on the service and on every replica.
pub const TUNNEL_PORT: u16 = 4433;
/// The kubelet-API port, on the service and on every replica.
pub const API_PORT: u16 = 10250;
/// Every replica's peer listener port.
pub const PEER_PORT: u16 = 7000;
/// Every replica's operations listener, on its pod's loopback.
pub const OPS: &str = "127.0.0.1:9090";
/// Replicas in the bed.
pub const REPLICAS: usize = 3;
/// apiserver-sim's address (in the apiserver's namespace).
pub const API_SERVER_IP: Ipv4Addr = Ipv4Addr::new(10, 245, 0, 2);
/// The edge site's subnet (masqueraded by the router).
const EDGE_NET: &str = "10.250.0.0/24";

/// Bound on a process printing its ready line.
const READY: Duration = Duration::from_secs(30);

static NEXT_BED: AtomicU32 = AtomicU32::new(0);

/// A replica's pod address.
pub fn replica_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, i as u8, 2)
}

/// A replica's kubelet-API address (in its pod).
pub fn replica_api(i: usize) -> SocketAddr {
    SocketAddr::from((replica_ip(i), API_PORT))
}

/// The TCP service the apiserver dials.
pub fn api_service() -> SocketAddr {
    SocketAddr::from((VIP, API_PORT))
}

/// An edge node and its pods.
#[derive(Debug, Clone)]
pub struct EdgeSpec {
    pub name: String,
    pub pods: Vec<PodSpec>,
}

/// What to start.
#[derive(Debug, Clone)]
pub struct BedSpec {
    pub edges: Vec<EdgeSpec>,
    /// Pods the apiserver believes run on a node, `(node, pod)`, whatever the edges say.
    pub api_pods: Vec<(String, PodSpec)>,
    /// Extra `tether-cloud` flags (after the bed's own).
    pub cloud_extra: Vec<String>,
    /// Extra `tether-edge` flags.
    pub edge_extra: Vec<String>,
    /// Edge *i* is started while only replica `pin[i]` is behind the UDP service (so it
    /// is held there); `None`: whichever the DNAT picks.
    pub pin: Vec<Option<usize>>,
    /// The replicas watch apiserver-sim's pods and nodes (`--apiserver-kubeconfig`, as
    /// deployed) instead of trusting the edges' reports.
    pub authority: bool,
}

/// Sends kubelet-API requests as the apiserver would, from the apiserver's namespace;
/// independent of the [`Bed`] (cheap to clone).
#[derive(Clone)]
pub struct Prober {
    client: KubeletClient,
    api_ns: String,
}

impl Prober {
    /// A TLS connection for `node` (SNI names it) to the kubelet API at `addr`, as
    /// the apiserver makes one (from its namespace, with its client certificate);
    /// bounded by 5 s.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        node: &str,
    ) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        tokio::time::timeout(
            Duration::from_secs(5),
            self.client.connect_from(Some(&self.api_ns), addr, node),
        )
        .await
        .with_context(|| format!("connecting to {addr} for {node}: no TLS connection in 5 s"))?
    }

    /// `GET path` for `node` (SNI and `Host` name it) on the kubelet API at `addr`;
    /// bounded by 5 s.
    pub async fn kubelet_get(&self, addr: SocketAddr, node: &str, path: &str) -> Result<Reply> {
        self.client
            .get_from(
                Some(&self.api_ns),
                addr,
                node,
                &format!("{node}:{KUBELET_PORT}"),
                path,
            )
            .await
    }
}

/// One edge site entry: its kubelet-sim and its edge.
pub struct BedEdge {
    pub name: String,
    pub pods: Vec<PodSpec>,
    /// Its kubelet-sim's container log directory.
    pub log_dir: PathBuf,
    kubelet_url: String,
    kubelet: Proc,
    edge: Option<Proc>,
}

/// The namespaces of a bed; deleted on drop (the processes go first: see [`Bed`]).
struct Namespaces(Vec<String>);

impl Drop for Namespaces {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = netns::delete(ns);
        }
    }
}

/// The running bed. Field order matters: processes drop (are killed) before the
/// namespaces are deleted.
pub struct Bed {
    pub dir: PathBuf,
    pub pki: Pki,
    peers: PeerPki,
    reset_key: PathBuf,
    spec: BedSpec,
    /// The kubeconfig kubectl uses (inside the api namespace).
    pub kubeconfig: PathBuf,
    apiserver: Option<Proc>,
    pub edges: Vec<BedEdge>,
    replicas: Vec<Option<Proc>>,
    client: KubeletClient,
    udp: Vec<usize>,
    tcp: Vec<usize>,
    cuts: Vec<(usize, usize)>,
    /// The edge site's link is down (every packet to or from it dropped).
    edge_site_cut: bool,
    /// Percent of the edge site's packets dropped each way ([`Bed::set_edge_site_loss`]).
    edge_site_loss: u32,
    prefix: String,
    _ns: Namespaces,
}

fn run_ok(mut cmd: std::process::Command, what: &str) -> Result<()> {
    let out = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// `nft -f -` with `rules` inside namespace `ns`.
fn nft(ns: &str, rules: &str) -> Result<()> {
    use std::io::Write;
    let mut cmd = netns::command_in(ns, "nft");
    cmd.args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd
        .spawn()
        .context("running nft (scripts/setup.sh installs nftables)")?;
    child
        .stdin
        .take()
        .context("nft stdin")?
        .write_all(rules.as_bytes())
        .context("writing the ruleset to nft")?;
    let out = child.wait_with_output().context("waiting for nft")?;
    if !out.status.success() {
        bail!(
            "nft failed: {}\nruleset:\n{rules}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// A veth pair from the router (`outer` there, address `.1`) to `ns` (`eth0`, `.2`,
/// default route via the router), on the /24 `10.<a>.<b>.0`.
fn wire(router: &str, outer: &str, ns: &str, a: u8, b: u8) -> Result<()> {
    netns::ip(&[
        "-n", router, "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns,
    ])?;
    netns::ip(&[
        "-n",
        router,
        "addr",
        "add",
        &format!("10.{a}.{b}.1/24"),
        "dev",
        outer,
    ])?;
    netns::ip(&["-n", router, "link", "set", outer, "up"])?;
    netns::ip(&[
        "-n",
        ns,
        "addr",
        "add",
        &format!("10.{a}.{b}.2/24"),
        "dev",
        "eth0",
    ])?;
    netns::ip(&["-n", ns, "link", "set", "eth0", "up"])?;
    netns::ip(&[
        "-n",
        ns,
        "route",
        "add",
        "default",
        "via",
        &format!("10.{a}.{b}.1"),
    ])
}

/// A command for `program` inside namespace `ns`, plain-text logs.
fn command_in(ns: &str, program: &Path) -> Command {
    let mut cmd = Command::from(netns::command_in(ns, program));
    cmd.env("NO_COLOR", "1").env("RUST_BACKTRACE", "0");
    cmd
}

/// The DNAT rules of a service (`matcher`, e.g. `ip daddr V tcp dport P`) over
/// `backends`, one per backend: the k-th (from 0) is taken when `numgen random mod
/// (n-k)` draws 0 of what the rules before it left, the last takes the rest, so each
/// gets 1/n. Not one rule with a `numgen ... map { ... }`: an anonymous map is
/// replaced with its rule and looked up under the ruleset generation of the moment,
/// so a new flow that met the change could find the old map emptied and pass
/// untranslated (see deploy/dnat/tether-dnat.sh, `nft_rules`).
fn dnat_rules(matcher: &str, backends: &[usize]) -> String {
    let n = backends.len();
    backends
        .iter()
        .enumerate()
        .map(|(k, i)| {
            let pick = if k + 1 < n {
                format!("numgen random mod {} 0 ", n - k)
            } else {
                String::new()
            };
            format!("    {matcher} {pick}dnat to {}\n", replica_ip(*i))
        })
        .collect()
}

impl Bed {
    /// Builds the namespaces and the router, then starts the replicas, the kubelet-sims
    /// and edges (pinned as `spec.pin` says) and apiserver-sim; returns once every pod
    /// answers through every replica.
    pub async fn start(spec: BedSpec, dir: &Path) -> Result<Bed> {
        if !netns::is_root() {
            bail!("the replica bed needs root (network namespaces, nftables)");
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let prefix = format!(
            "rb{}{}",
            std::process::id() % 10_000,
            NEXT_BED.fetch_add(1, Ordering::Relaxed)
        );
        let mut names = vec![format!("{prefix}-svc")];
        names.extend((0..REPLICAS).map(|i| format!("{prefix}-r{i}")));
        names.push(format!("{prefix}-edges"));
        names.push(format!("{prefix}-api"));
        let mut created = Namespaces(Vec::new());
        for n in &names {
            netns::add(n)?;
            created.0.push(n.clone());
        }
        let router = &names[0];
        for i in 0..REPLICAS {
            wire(router, &format!("r{i}"), &names[1 + i], 244, i as u8)?;
        }
        wire(router, "edges", &names[1 + REPLICAS], 250, 0)?;
        wire(router, "api", &names[2 + REPLICAS], 245, 0)?;
        let mut sysctl = netns::command_in(router, "sysctl");
        sysctl.args(["-qw", "net.ipv4.ip_forward=1"]);
        run_ok(sysctl, "sysctl net.ipv4.ip_forward=1 in the router")?;

        let names_vec: Vec<&str> = spec.edges.iter().map(|e| e.name.as_str()).collect();
        let pki = pki::mint(&dir.join("pki"), &names_vec)?;
        let peers = pki::mint_peers(&dir.join("pki").join("peers"))?;
        let reset_key = dir.join("pki").join("reset.key");
        let mut certs = std::process::Command::new(bins::binary("tether-certs")?);
        certs.args(["reset-key", "--out"]).arg(&reset_key);
        run_ok(certs, "tether-certs reset-key")?;
        let client = KubeletClient::new(
            &pki.tether_ca_pem,
            &pki.apiserver_client.cert_pem,
            &pki.apiserver_client.key_pem,
        )?;
        let mut bed = Bed {
            dir: dir.to_path_buf(),
            pki,
            peers,
            reset_key,
            kubeconfig: dir.join("kubeconfig"),
            apiserver: None,
            edges: Vec::new(),
            replicas: (0..REPLICAS).map(|_| None).collect(),
            client,
            udp: (0..REPLICAS).collect(),
            tcp: (0..REPLICAS).collect(),
            cuts: Vec::new(),
            edge_site_cut: false,
            edge_site_loss: 0,
            prefix,
            spec,
            _ns: created,
        };
        bed.program()?;
        std::fs::create_dir_all(bed.logs())?;
        // The kubelets, then apiserver-sim with their nodes and pods, so that the
        // replicas can watch it.
        bed.start_kubelets().await?;
        bed.start_apiserver().await?;
        for i in 0..REPLICAS {
            bed.spawn_replica(i)?;
        }
        for i in 0..REPLICAS {
            bed.wait_replica_ready(i).await?;
        }
        for j in 0..bed.edges.len() {
            let pin = bed.spec.pin.get(j).copied().flatten();
            if let Some(r) = pin {
                bed.set_udp_backends(&[r])?;
            }
            bed.spawn_edge(j)?;
            bed.wait_edge_connected(j, READY).await?;
        }
        bed.set_udp_backends(&(0..REPLICAS).collect::<Vec<_>>())?;
        bed.wait_routable(Duration::from_secs(30)).await?;
        Ok(bed)
    }

    /// The router's namespace.
    pub fn router_ns(&self) -> String {
        format!("{}-svc", self.prefix)
    }

    /// Replica `i`'s pod namespace.
    pub fn replica_ns(&self, i: usize) -> String {
        format!("{}-r{i}", self.prefix)
    }

    /// The edge site's namespace (kubelet-sims and edges).
    pub fn edges_ns(&self) -> String {
        format!("{}-edges", self.prefix)
    }

    /// The apiserver's namespace (apiserver-sim; run kubectl there).
    pub fn api_ns(&self) -> String {
        format!("{}-api", self.prefix)
    }

    fn logs(&self) -> PathBuf {
        self.dir.join("process-logs")
    }

    /// Rewrites the router's whole ruleset (one transaction): the two services over
    /// their backends, the edge site's masquerade, the peer-link cuts.
    fn program(&self) -> Result<()> {
        let mut pre = dnat_rules(
            &format!("ip daddr {VIP} udp dport {TUNNEL_PORT}"),
            &self.udp,
        );
        pre.push_str(&dnat_rules(
            &format!("ip daddr {VIP} tcp dport {API_PORT}"),
            &self.tcp,
        ));
        let mut fwd = String::new();
        if self.edge_site_cut {
            fwd.push_str(&format!(
                "    ip saddr {EDGE_NET} drop\n\
                 \x20   ip daddr {EDGE_NET} drop\n"
            ));
        }
        if self.edge_site_loss > 0 {
            let p = self.edge_site_loss;
            fwd.push_str(&format!(
                "    ip saddr {EDGE_NET} numgen random mod 100 < {p} drop\n\
                 \x20   ip daddr {EDGE_NET} numgen random mod 100 < {p} drop\n"
            ));
        }
        for (a, b) in &self.cuts {
            for (x, y) in [(a, b), (b, a)] {
                let (x, y) = (replica_ip(*x), replica_ip(*y));
                fwd.push_str(&format!(
                    "    ip saddr {x} ip daddr {y} udp dport {PEER_PORT} drop\n\
                     \x20   ip saddr {x} ip daddr {y} udp sport {PEER_PORT} drop\n"
                ));
            }
        }
        // Declared (a no-op when they exist), then each chain flushed and refilled in
        // the same transaction: a packet walks a chain under one ruleset generation,
        // so it meets the old rules or the new ones. Deleting and re-creating the
        // table instead could let a new flow walk the new chain before the commit
        // and the old one after it, and pass untranslated.
        let rules = format!(
            "table ip bed {{\n\
             \x20 chain svc_pre {{\n\
             \x20   type nat hook prerouting priority dstnat; policy accept;\n\
             \x20 }}\n\
             \x20 chain svc_post {{\n\
             \x20   type nat hook postrouting priority srcnat; policy accept;\n\
             \x20 }}\n\
             \x20 chain peer_cuts {{\n\
             \x20   type filter hook forward priority filter; policy accept;\n\
             \x20 }}\n\
             }}\n\
             flush chain ip bed svc_pre\n\
             flush chain ip bed svc_post\n\
             flush chain ip bed peer_cuts\n\
             table ip bed {{\n\
             \x20 chain svc_pre {{\n\
             {pre}\
             \x20 }}\n\
             \x20 chain svc_post {{\n\
             \x20   ip saddr {EDGE_NET} masquerade\n\
             \x20 }}\n\
             \x20 chain peer_cuts {{\n\
             {fwd}\
             \x20 }}\n\
             }}\n"
        );
        nft(&self.router_ns(), &rules)
    }

    /// Points the UDP service (the edges' way in) at `replicas`. Existing flows stay
    /// where conntrack pinned them.
    pub fn set_udp_backends(&mut self, replicas: &[usize]) -> Result<()> {
        self.udp = replicas.to_vec();
        self.program()
    }

    /// Points the TCP service (the apiserver's way in) at `replicas`.
    pub fn set_tcp_backends(&mut self, replicas: &[usize]) -> Result<()> {
        self.tcp = replicas.to_vec();
        self.program()
    }

    /// Drops the peer traffic between replicas `a` and `b` (both stay alive).
    pub fn cut_peer(&mut self, a: usize, b: usize) -> Result<()> {
        self.cuts.push((a, b));
        self.program()
    }

    /// Takes the edge site's link down (`true`: a total outage, every packet to or
    /// from the edges dropped at the router) or brings it back.
    pub fn cut_edge_site(&mut self, cut: bool) -> Result<()> {
        self.edge_site_cut = cut;
        self.program()
    }

    /// Drops `percent` % of the packets to and from the edge site at the router, at
    /// random and each way on its own (nftables `numgen random`: a lossy link
    /// without netem); 0 lifts it.
    ///
    /// While it is on, the edges' and the replicas' interfaces send no segmentation
    /// offload batches (`gso_max_segs 1`): the router forwards a GSO batch as one
    /// packet, so one drop would take every datagram of a `sendmsg` at once, where a
    /// wire loses packets one by one.
    pub fn set_edge_site_loss(&mut self, percent: u32) -> Result<()> {
        if percent > 100 {
            bail!("a loss of {percent} %");
        }
        let segs = if percent > 0 { "1" } else { "65535" };
        let namespaces = [self.edges_ns()]
            .into_iter()
            .chain((0..REPLICAS).map(|i| self.replica_ns(i)));
        for ns in namespaces {
            netns::ip(&["-n", &ns, "link", "set", "eth0", "gso_max_segs", segs])?;
        }
        self.edge_site_loss = percent;
        self.program()
    }

    /// Lifts every peer-link cut.
    pub fn heal_peers(&mut self) -> Result<()> {
        self.cuts.clear();
        self.program()
    }

    /// Deletes the router's conntrack entries (what kube-proxy does for the UDP flows
    /// of an endpoint that went away).
    pub fn flush_conntrack(&self) -> Result<()> {
        netns::run_in(&self.router_ns(), linkemu::conntrack::flush_ipv4)?
    }

    /// Starts replica `i` (again) in its pod; see [`Bed::wait_replica_ready`].
    pub fn spawn_replica(&mut self, i: usize) -> Result<()> {
        let peers = (0..REPLICAS)
            .map(|k| SocketAddr::from((replica_ip(k), PEER_PORT)).to_string())
            .collect::<Vec<_>>()
            .join(",");
        let mut cmd = command_in(&self.replica_ns(i), &bins::binary(bins::CLOUD)?);
        cmd.args([
            "--tunnel-listen",
            &format!("0.0.0.0:{TUNNEL_PORT}"),
            "--kubelet-listen",
            &format!("0.0.0.0:{API_PORT}"),
            "--metrics-listen",
            OPS,
            "--replica-name",
            &format!("replica-{i}"),
            "--peer-listen",
            &SocketAddr::from((replica_ip(i), PEER_PORT)).to_string(),
            "--peers",
            &peers,
            "--peer-resolve-interval",
            "1s",
        ])
        .args(
            self.pki.cloud_flags().into_iter().filter(|f| {
                !(self.spec.authority && f.as_os_str() == "--insecure-trust-edge-reports")
            }),
        )
        .args(self.peers.flags())
        .arg("--reset-key-file")
        .arg(&self.reset_key)
        .args(&self.spec.cloud_extra);
        if self.spec.authority {
            cmd.arg("--apiserver-kubeconfig").arg(&self.kubeconfig);
        }
        cmd.env(
            "TETHER_LOG",
            std::env::var("TETHER_E2E_LOG").unwrap_or_else(|_| "info".into()),
        );
        std::fs::create_dir_all(self.logs())?;
        // A restarted replica's log goes to a new file, the old one is kept.
        let mut name = format!("replica-{i}");
        let mut n = 1;
        while self.logs().join(format!("{name}.log")).exists() {
            n += 1;
            name = format!("replica-{i}.{n}");
        }
        self.replicas[i] = Some(Proc::spawn(
            &name,
            cmd,
            &self.logs(),
            SpawnOptions::default(),
        )?);
        Ok(())
    }

    /// Waits for replica `i`'s ready line.
    pub async fn wait_replica_ready(&mut self, i: usize) -> Result<()> {
        let p = self.replicas[i]
            .as_mut()
            .with_context(|| format!("replica {i} is not running"))?;
        p.wait_line("`tether-cloud ready …`", READY, |l| {
            l.starts_with("tether-cloud ready")
        })
        .await?;
        Ok(())
    }

    /// The process of replica `i`, if running.
    pub fn replica(&mut self, i: usize) -> Option<&mut Proc> {
        self.replicas[i].as_mut()
    }

    /// `kill -9` of replica `i`.
    pub async fn kill_replica(&mut self, i: usize) {
        if let Some(mut p) = self.replicas[i].take() {
            p.kill().await;
        }
    }

    /// SIGTERM to replica `i`; waits at most `limit` for it to exit (then kills it).
    /// Returns its exit status (`None`: it had to be killed).
    pub async fn terminate_replica(
        &mut self,
        i: usize,
        limit: Duration,
    ) -> Option<std::process::ExitStatus> {
        let mut p = self.replicas[i].take()?;
        p.terminate(limit).await
    }

    /// Sends SIGTERM to replica `i` without waiting (see [`Bed::wait_replica_exit`]).
    pub fn sigterm_replica(&self, i: usize) -> Result<()> {
        let pid = self.replicas[i]
            .as_ref()
            .and_then(|p| p.pid())
            .with_context(|| format!("replica {i} is not running"))?;
        let pid = i32::try_from(pid).context("pid")?;
        // SAFETY: a signal to our own child, not yet reaped (its pid is still ours).
        if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
            bail!(
                "SIGTERM to replica {i}: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(())
    }

    /// Waits at most `limit` for replica `i` to exit by itself; its status.
    pub async fn wait_replica_exit(
        &mut self,
        i: usize,
        limit: Duration,
    ) -> Result<std::process::ExitStatus> {
        let p = self.replicas[i]
            .as_mut()
            .with_context(|| format!("replica {i} is not running"))?;
        let status = p.wait_exit(limit).await?;
        self.replicas[i] = None;
        Ok(status)
    }

    /// Whether replica `i`'s `/readyz` answers 200.
    pub async fn is_ready(&self, i: usize) -> bool {
        matches!(self.ops_get(i, "/readyz").await, Ok((200, _)))
    }

    /// Where replica `i` routes `node` by its `/status`: `replica-k` (its own name when
    /// it holds the edge), or `None` when it knows no connected holder.
    pub async fn route_view(&self, i: usize, node: &str) -> Result<Option<String>> {
        let st = self.status(i).await?;
        let local = st["nodes"].as_array().is_some_and(|nodes| {
            nodes
                .iter()
                .any(|n| n["node"] == node && n["connected"] == true)
        });
        if local {
            return Ok(Some(format!("replica-{i}")));
        }
        Ok(st["remote_nodes"].as_array().and_then(|r| {
            r.iter()
                .find(|n| n["node"] == node && n["connected"] == true)
                .and_then(|n| n["replica"].as_str().map(str::to_string))
        }))
    }

    async fn start_kubelets(&mut self) -> Result<()> {
        let bin = bins::binary(bins::KUBELET_SIM)?;
        let ns = self.edges_ns();
        let mut starting = Vec::new();
        for e in &self.spec.edges {
            let node_dir = self.dir.join("nodes").join(&e.name);
            let log_dir = node_dir.join("logs");
            let tmp = node_dir.join("tmp");
            for d in [&log_dir, &tmp] {
                std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            }
            for p in &e.pods {
                for c in &p.containers {
                    std::fs::write(
                        log_dir.join(format!("{}_{}_{c}.log", p.namespace, p.name)),
                        b"",
                    )?;
                }
            }
            let mut cmd = command_in(&ns, &bin);
            cmd.args(["--listen", "127.0.0.1:0", "--node-name", &e.name])
                .arg("--log-dir")
                .arg(&log_dir)
                .env("TMPDIR", &tmp);
            for p in &e.pods {
                cmd.arg("--pod").arg(format!(
                    "{}/{}={}",
                    p.namespace,
                    p.name,
                    p.containers.join(",")
                ));
            }
            let proc = Proc::spawn(
                &format!("kubelet-sim-{}", e.name),
                cmd,
                &self.logs(),
                SpawnOptions::default(),
            )?;
            starting.push((e.clone(), log_dir, proc));
        }
        for (e, log_dir, mut proc) in starting {
            let line = proc
                .wait_line("its listening line", READY, |l| {
                    l.starts_with("kubelet-sim listening on ")
                })
                .await?;
            let url = line
                .split_whitespace()
                .nth(3)
                .with_context(|| format!("no address in {line:?}"))?
                .to_string();
            self.edges.push(BedEdge {
                name: e.name,
                pods: e.pods,
                log_dir,
                kubelet_url: url,
                kubelet: proc,
                edge: None,
            });
        }
        Ok(())
    }

    /// Starts edge `j` (again, from a new UDP source port), dialling the UDP service.
    pub fn spawn_edge(&mut self, j: usize) -> Result<()> {
        let e = &self.edges[j];
        let tls = &self.pki.edges[&e.name];
        let mut cmd = command_in(&self.edges_ns(), &bins::binary(bins::EDGE)?);
        cmd.arg("--cloud")
            .arg(SocketAddr::from((VIP, TUNNEL_PORT)).to_string())
            .arg("--server-name")
            .arg(pki::CLOUD_SERVER_NAME)
            .arg("--ca")
            .arg(&self.pki.tether_ca)
            .arg("--cert")
            .arg(&tls.cert)
            .arg("--key")
            .arg(&tls.key)
            .arg("--kubelet-url")
            .arg(&e.kubelet_url)
            .args(["--pods-refresh", "1s", "--metrics-listen", "127.0.0.1:0"])
            .args(&self.spec.edge_extra)
            .env(
                "TETHER_LOG",
                std::env::var("TETHER_E2E_LOG").unwrap_or_else(|_| "info".into()),
            );
        let mut name = format!("tether-edge-{}", e.name);
        let mut n = 1;
        while self.logs().join(format!("{name}.log")).exists() {
            n += 1;
            name = format!("tether-edge-{}.{n}", e.name);
        }
        let proc = Proc::spawn(&name, cmd, &self.logs(), SpawnOptions::default())?;
        self.edges[j].edge = Some(proc);
        Ok(())
    }

    /// Waits for edge `j`'s next "connected" line, then until a replica's
    /// `/status` shows the edge attached: the edge prints the line once it
    /// sent its commit, and the replica attaches it when the commit arrives
    /// (a few ms later, or more on a loaded machine).
    pub async fn wait_edge_connected(&mut self, j: usize, limit: Duration) -> Result<()> {
        let start = Instant::now();
        let name = self.edges[j].name.clone();
        let p = self.edges[j]
            .edge
            .as_mut()
            .with_context(|| format!("edge {name} is not running"))?;
        let prefix = format!("tether-edge connected node={name} ");
        p.wait_line(&format!("`{prefix}…`"), limit, |l| l.starts_with(&prefix))
            .await?;
        while self.holder_of(&name).await?.is_none() {
            if start.elapsed() > limit {
                bail!("edge {name} connected, but no replica showed it attached within {limit:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// SIGTERM to edge `j` (SIGKILL after `grace`), and waits for it to exit.
    pub async fn terminate_edge(&mut self, j: usize, grace: Duration) {
        if let Some(mut p) = self.edges[j].edge.take() {
            p.terminate(grace).await;
        }
    }

    /// `kill -9` of edge `j`.
    pub async fn kill_edge(&mut self, j: usize) {
        if let Some(mut p) = self.edges[j].edge.take() {
            p.kill().await;
        }
    }

    async fn start_apiserver(&mut self) -> Result<()> {
        let mut cmd = command_in(&self.api_ns(), &bins::binary(bins::APISERVER_SIM)?);
        // On its pod address, so that the replicas can reach it through the router.
        cmd.args([
            "--listen",
            &format!("{API_SERVER_IP}:6443"),
            "--write-kubeconfig",
        ])
        .arg(&self.kubeconfig)
        .arg("--kubelet-client-cert")
        .arg(&self.pki.apiserver_client.cert)
        .arg("--kubelet-client-key")
        .arg(&self.pki.apiserver_client.key)
        .arg("--kubelet-ca")
        .arg(&self.pki.tether_ca)
        .arg("--kubelet-dial")
        .arg(api_service().to_string());
        let mut seen = std::collections::HashSet::new();
        for e in &self.edges {
            cmd.arg("--node")
                .arg(format!("{}={}:{KUBELET_PORT}", e.name, e.name));
            // A pod two kubelets run (a conflict test) is the first one's for the
            // apiserver.
            for p in e
                .pods
                .iter()
                .filter(|p| seen.insert((&p.namespace, &p.name)))
            {
                cmd.arg("--pod").arg(format!(
                    "{}/{}={}:{}",
                    p.namespace,
                    p.name,
                    e.name,
                    p.containers.join(",")
                ));
            }
        }
        for (node, p) in &self.spec.api_pods {
            cmd.arg("--pod").arg(format!(
                "{}/{}={node}:{}",
                p.namespace,
                p.name,
                p.containers.join(",")
            ));
        }
        let mut proc = Proc::spawn("apiserver-sim", cmd, &self.logs(), SpawnOptions::default())?;
        wait_kubeconfig(&self.kubeconfig, &mut proc).await?;
        self.apiserver = Some(proc);
        Ok(())
    }

    /// `GET path` for `node` (SNI and `Host` name it, as the apiserver sends them) on
    /// the kubelet API at `addr` (a replica's, or [`api_service`]), dialled from the
    /// apiserver's namespace; bounded by 5 s.
    pub async fn kubelet_get(&self, addr: SocketAddr, node: &str, path: &str) -> Result<Reply> {
        self.prober().kubelet_get(addr, node, path).await
    }

    /// A [`Prober`] of this bed, for requests that run while the bed changes.
    pub fn prober(&self) -> Prober {
        Prober {
            client: self.client.clone(),
            api_ns: self.api_ns(),
        }
    }

    /// `GET path` on replica `i`'s operations listener: status code and body.
    pub async fn ops_get(&self, i: usize, path: &str) -> Result<(u16, String)> {
        plain_get(
            self.replica_ns(i),
            OPS.parse()?,
            path,
            &format!("replica {i}"),
        )
        .await
    }

    /// A Prometheus sample of edge `j`'s `tether-edge` (0 when absent).
    pub async fn edge_metric(&self, j: usize, series: &str) -> Result<f64> {
        let e = &self.edges[j];
        let edge = e
            .edge
            .as_ref()
            .with_context(|| format!("edge {} is not running", e.name))?;
        let addr: SocketAddr = edge
            .lines()
            .iter()
            .find_map(|l| {
                l.strip_prefix("tether-edge started ")
                    .and_then(|r| r.split("metrics=").nth(1))
                    .map(|a| a.trim().to_string())
            })
            .with_context(|| format!("edge {} printed no metrics address", e.name))?
            .parse()?;
        let (_, text) = plain_get(self.edges_ns(), addr, "/metrics", &e.name).await?;
        Ok(crate::cluster::sample(&text, series).unwrap_or(0.0))
    }

    /// A Prometheus sample of replica `i` (0 when absent).
    pub async fn metric(&self, i: usize, series: &str) -> Result<f64> {
        let (_, text) = self.ops_get(i, "/metrics").await?;
        Ok(crate::cluster::sample(&text, series).unwrap_or(0.0))
    }

    /// Replica `i`'s `/status`.
    pub async fn status(&self, i: usize) -> Result<serde_json::Value> {
        let (_, body) = self.ops_get(i, "/status").await?;
        serde_json::from_str(&body).with_context(|| format!("replica {i}'s /status: {body}"))
    }

    /// Which replica holds `node` by its own `/status` (connected there), if one does.
    pub async fn holder_of(&self, node: &str) -> Result<Option<usize>> {
        for i in 0..REPLICAS {
            if self.replicas[i].is_none() {
                continue;
            }
            let Ok(st) = self.status(i).await else {
                continue;
            };
            let held = st["nodes"].as_array().is_some_and(|nodes| {
                nodes
                    .iter()
                    .any(|n| n["node"] == node && n["connected"] == true)
            });
            if held {
                return Ok(Some(i));
            }
        }
        Ok(None)
    }

    /// What edge `j`'s process has logged so far (stderr).
    pub fn edge_log(&self, j: usize) -> String {
        self.edges[j]
            .edge
            .as_ref()
            .map(|p| std::fs::read_to_string(p.log_path()).unwrap_or_default())
            .unwrap_or_default()
    }

    /// The container log file kubelet-sim serves for `ns/pod/container` on edge `j`.
    pub fn log_path(&self, j: usize, ns: &str, pod: &str, container: &str) -> PathBuf {
        self.edges[j]
            .log_dir
            .join(format!("{ns}_{pod}_{container}.log"))
    }

    /// Waits until every pod's first container answers a log request through every
    /// running replica, from its own node (pods two edges claim excepted).
    pub async fn wait_routable(&self, limit: Duration) -> Result<()> {
        let start = Instant::now();
        let claims = |p: &PodSpec| {
            self.edges
                .iter()
                .filter(|e| {
                    e.pods
                        .iter()
                        .any(|q| q.namespace == p.namespace && q.name == p.name)
                })
                .count()
        };
        for e in &self.edges {
            for p in e.pods.iter().filter(|p| claims(p) == 1) {
                let Some(c) = p.containers.first() else {
                    continue;
                };
                let path = format!("/containerLogs/{}/{}/{c}?limitBytes=1", p.namespace, p.name);
                for i in 0..REPLICAS {
                    if self.replicas[i].is_none() {
                        continue;
                    }
                    loop {
                        let last = match self.kubelet_get(replica_api(i), &e.name, &path).await {
                            Ok(r) if r.status.is_success() && r.node() == Some(&e.name) => break,
                            Ok(r) => format!(
                                "{} from {:?}: {}",
                                r.status,
                                r.node(),
                                String::from_utf8_lossy(&r.body).trim()
                            ),
                            Err(e) => format!("{e:#}"),
                        };
                        if start.elapsed() > limit {
                            bail!(
                                "{}/{} on {} not routable through replica {i} within \
                                 {limit:?}: {last}\n{}",
                                p.namespace,
                                p.name,
                                e.name,
                                self.diagnostics(15)
                            );
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
        Ok(())
    }

    fn procs(&self) -> Vec<&Proc> {
        let mut v: Vec<&Proc> = self.apiserver.iter().collect();
        v.extend(self.replicas.iter().flatten());
        for e in &self.edges {
            v.extend(e.edge.iter());
            v.push(&e.kubelet);
        }
        v
    }

    /// The last `lines` lines of every process's stderr log, for failure reports.
    pub fn diagnostics(&self, lines: usize) -> String {
        let mut s = String::new();
        for p in self.procs() {
            s.push_str(&format!(
                "--- {} ({}) ---\n{}\n",
                p.name(),
                p.log_path().display(),
                p.stderr_tail(lines)
            ));
        }
        s
    }
}

/// `GET path` (HTTP/1.0) on `addr` from inside network namespace `ns`: status code
/// and body; bounded by 5 s. `what` names the listener in errors.
async fn plain_get(ns: String, addr: SocketAddr, path: &str, what: &str) -> Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fetch = async {
        let tcp = tokio::task::spawn_blocking(move || {
            netns::run_in(&ns, || std::net::TcpStream::connect(addr))
        })
        .await???;
        tcp.set_nonblocking(true)?;
        let mut tcp = tokio::net::TcpStream::from_std(tcp)?;
        tcp.write_all(format!("GET {path} HTTP/1.0\r\nHost: ops\r\n\r\n").as_bytes())
            .await?;
        let mut text = String::new();
        tcp.read_to_string(&mut text).await?;
        Ok::<_, anyhow::Error>(text)
    };
    let text = tokio::time::timeout(Duration::from_secs(5), fetch)
        .await
        .with_context(|| format!("GET {path} of {what}: no answer in 5 s"))?
        .with_context(|| format!("GET {path} of {what}"))?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no status in {head:?}"))?;
    Ok((code, body.to_string()))
}
