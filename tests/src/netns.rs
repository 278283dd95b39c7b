//! Tether inside a [`linkemu`] link's network namespaces, shared by the fault tests
//! and the benchmark: where the cloud listens there, and its command line; what a
//! kubelet stand-in answers (the pod list, an echoing upgraded session).

use anyhow::Result;

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
