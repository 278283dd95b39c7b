//! `tether-cloud`: parses flags, starts the cloud, prints a ready line, and
//! shuts down gracefully on SIGTERM or Ctrl-C.

use anyhow::Context;
use clap::Parser;
use tether_cloud::config::CloudArgs;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = CloudArgs::parse();
    args.log.init().map_err(anyhow::Error::msg)?;
    let cfg = args
        .into_config()
        .map_err(anyhow::Error::msg)
        .context("invalid configuration")?;
    let mut cloud = tether_cloud::Cloud::start(cfg).await?;
    println!(
        "tether-cloud ready tunnel={} kubelet-api={} metrics={}",
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
