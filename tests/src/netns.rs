//! Tether inside a [`linkemu`] link's network namespaces, shared by the fault tests
//! and the benchmark: where the cloud listens there, and its command line; what a
//! kubelet stand-in answers (the pod list, an echoing upgraded session); a
//! path MTU that drops larger packets without a word ([`BlackHole`]).

use anyhow::{bail, Context, Result};

use crate::pki::Pki;

/// The cloud's tunnel port inside a link's cloud namespace.
pub const TUNNEL_PORT: u16 = 10004;
/// The cloud's kubelet-API address inside a link's cloud namespace.
pub const API: &str = "127.0.0.1:10003";

/// `tether-cloud` in the cloud namespace of `link`, with `pki`'s certificates,
/// `extra` flags and `log` as its `TETHER_LOG`.
pub fn cloud_cmd(
    link: &linkemu::Link,
    pki: &Pki,
    extra: &[String],
    log: &str,
) -> Result<tokio::process::Command> {
    let mut cmd = link.exec_in_cloud(crate::bins::binary("tether-cloud")?);
    cmd.args([
        "--tunnel-listen",
        &format!("0.0.0.0:{TUNNEL_PORT}"),
        "--kubelet-listen",
        API,
        "--metrics-listen",
        "127.0.0.1:0",
    ])
    .args(pki.cloud_flags())
    .args(extra)
    .env("TETHER_LOG", log)
    .env("RUST_BACKTRACE", "0");
    Ok(tokio::process::Command::from(cmd))
}

/// Echoes every byte of an upgraded connection back until the client closes
/// (an `exec -it` whose shell echoes keystrokes), on its own task: what both
/// in-process kubelet stand-ins answer an `Upgrade:` request with.
pub fn spawn_echo(on: hyper::upgrade::OnUpgrade) {
    tokio::spawn(async move {
        if let Ok(up) = on.await {
            let mut io = hyper_util::rt::TokioIo::new(up);
            let (mut r, mut w) = tokio::io::split(&mut io);
            let _ = tokio::io::copy(&mut r, &mut w).await;
            let _ = tokio::io::AsyncWriteExt::shutdown(&mut w).await;
        }
    });
}

/// A kubelet's `/pods` body (a v1 `PodList`) for `pods` given as `namespace/name`.
pub fn pod_list_json(pods: &[impl AsRef<str>]) -> String {
    let items: Vec<String> = pods
        .iter()
        .map(|p| {
            let p = p.as_ref();
            let (ns, name) = p.split_once('/').unwrap_or(("default", p));
            format!(r#"{{"metadata":{{"name":"{name}","namespace":"{ns}","uid":"uid-{name}"}}}}"#)
        })
        .collect();
    format!(r#"{{"kind":"PodList","items":[{}]}}"#, items.join(","))
}

/// A smaller MTU inside the network that sends no ICMP, as a tunnel inside a
/// carrier's network may: nftables rules drop every IP packet over `mtu`
/// bytes that crossed the link, and count them. The drop happens where the
/// packet arrives (the cloud's namespace for the edge's packets, the edge's
/// for the cloud's): a sender's own hooks see a segmentation-offload batch as
/// one large packet before it is cut into datagrams. TCP's MSS is clamped to
/// fit, as carriers do (a TCP peer would otherwise stall). The namespaces'
/// removal takes the rules with them.
pub struct BlackHole {
    edge_ns: String,
    cloud_ns: String,
}

/// Packets and bytes a [`BlackHole`] dropped, each way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Dropped {
    /// Sent by the edge: (packets, bytes).
    pub up: (u64, u64),
    /// Sent towards the edge: (packets, bytes).
    pub down: (u64, u64),
}

const BLACK_HOLE_TABLE: &str = "tether_path_mtu";

impl BlackHole {
    /// Installs the rules on both ends of `link`.
    pub fn install(link: &linkemu::Link, mtu: u32) -> Result<BlackHole> {
        let tun = linkemu::naming::TUN_NAME;
        let mss = mtu.saturating_sub(40);
        let clamp = format!(
            "tcp flags syn tcp option maxseg size > {mss} tcp option maxseg size set {mss}"
        );
        for ns in [link.edge_ns(), link.cloud_ns()] {
            nft(
                ns,
                &["-f", "-"],
                Some(&format!(
                    "table inet {BLACK_HOLE_TABLE} {{\n\
                     \x20 counter dropped {{}}\n\
                     \x20 chain out {{\n\
                     \x20   type filter hook output priority -10; policy accept;\n\
                     \x20   oifname \"{tun}\" {clamp}\n\
                     \x20 }}\n\
                     \x20 chain in {{\n\
                     \x20   type filter hook input priority -10; policy accept;\n\
                     \x20   iifname \"{tun}\" {clamp}\n\
                     \x20   iifname \"{tun}\" ip length > {mtu} counter name dropped drop\n\
                     \x20 }}\n\
                     }}\n"
                )),
            )
            .with_context(|| format!("installing a {mtu}-byte black hole in {ns}"))?;
        }
        Ok(BlackHole {
            edge_ns: link.edge_ns().to_string(),
            cloud_ns: link.cloud_ns().to_string(),
        })
    }

    /// What was dropped so far.
    pub fn dropped(&self) -> Result<Dropped> {
        Ok(Dropped {
            up: counter(&self.cloud_ns)?,
            down: counter(&self.edge_ns)?,
        })
    }
}

/// (packets, bytes) of the black hole's counter in `ns`.
fn counter(ns: &str) -> Result<(u64, u64)> {
    let text = nft(
        ns,
        &["list", "counter", "inet", BLACK_HOLE_TABLE, "dropped"],
        None,
    )?;
    let field = |key: &str| -> Result<u64> {
        text.split(key)
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .with_context(|| format!("no {key:?} in nft's answer {text:?}"))?
            .parse()
            .with_context(|| format!("{key:?} in nft's answer {text:?}"))
    };
    Ok((field("packets ")?, field("bytes ")?))
}

/// Runs `nft args` in namespace `ns`, with `stdin` as its input; its stdout.
fn nft(ns: &str, args: &[&str], stdin: Option<&str>) -> Result<String> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, "nft"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running nft (scripts/setup.sh installs nftables)")?;
    let mut input = child.stdin.take().context("nft's stdin")?;
    if let Some(text) = stdin {
        input
            .write_all(text.as_bytes())
            .context("writing nft's input")?;
    }
    drop(input);
    let out = child.wait_with_output().context("waiting for nft")?;
    if !out.status.success() {
        bail!(
            "nft {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
