//! `tether-cloud`: parses flags, starts the cloud, prints a ready line.

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
    let cloud = tether_cloud::Cloud::start(cfg).await?;
    println!(
        "tether-cloud ready tunnel={} kubelet-api={}",
        cloud.tunnel_addr, cloud.kubelet_api_addr
    );
    tokio::select! {
        r = cloud.run() => r,
        _ = tokio::signal::ctrl_c() => {
            tracing::info!("interrupted; exiting");
            Ok(())
        }
    }
}
