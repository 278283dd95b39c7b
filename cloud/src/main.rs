//! `tether-cloud`: parses flags, starts the cloud, prints a ready line, and
//! shuts down gracefully on SIGTERM or Ctrl-C.

use anyhow::Context;
use tether_cloud::config::CloudArgs;

fn main() -> anyhow::Result<()> {
    // The configuration file is applied before any thread exists.
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let Some(cfg) = tether_proto::cli::start::<CloudArgs>(&argv).map_err(anyhow::Error::msg)?
    else {
        return Ok(());
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = cfg.worker_threads {
        runtime.worker_threads(n);
    }
    runtime
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(run(cfg))
}

async fn run(cfg: tether_cloud::config::CloudConfig) -> anyhow::Result<()> {
    let mut cloud = tether_cloud::Cloud::start(cfg).await?;
    let peer = cloud
        .peer_addr
        .map(|a| format!(" peer={a}"))
        .unwrap_or_default();
    println!(
        "tether-cloud ready tunnel={} kubelet-api={} metrics={}{peer}",
        cloud.tunnel_addr, cloud.kubelet_api_addr, cloud.metrics_addr
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        r = cloud.run() => return r,
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupted"),
        _ = term.recv() => tracing::info!("SIGTERM"),
    }
    cloud.shutdown().await;
    Ok(())
}
