//! `tether-edge`: parses flags and runs the dialer.

use anyhow::Context;
use clap::Parser;
use tether_edge::config::EdgeArgs;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = EdgeArgs::parse();
    args.log.init().map_err(anyhow::Error::msg)?;
    let cfg = args
        .into_config()
        .map_err(anyhow::Error::msg)
        .context("invalid configuration")?;
    let dialer = tether_edge::dial::Dialer::new(cfg)?;
    tracing::info!(node = dialer.node(), "tether-edge starting");
    tokio::select! {
        r = dialer.run() => r,
        _ = tokio::signal::ctrl_c() => {
            tracing::info!("interrupted; exiting");
            Ok(())
        }
    }
}
