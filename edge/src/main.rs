//! `tether-edge`: parses flags, serves the operations endpoints and runs the
//! dialer; on SIGTERM or Ctrl-C closes its connection cleanly (the cloud
//! then ends the session at once instead of waiting for a resume).

use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use tether_edge::config::EdgeArgs;
use tether_proto::handshake::close_code;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = EdgeArgs::parse();
    args.log.init().map_err(anyhow::Error::msg)?;
    let cfg = args
        .into_config()
        .map_err(anyhow::Error::msg)
        .context("invalid configuration")?;
    let mut prom = prometheus_client::registry::Registry::default();
    let metrics = tether_edge::metrics::EdgeMetrics::register(&mut prom);
    let ops_listener = tokio::net::TcpListener::bind(cfg.metrics_listen)
        .await
        .with_context(|| format!("binding the metrics listener {}", cfg.metrics_listen))?;
    let metrics_addr = ops_listener
        .local_addr()
        .context("reading the metrics listener's address")?;
    let connected = metrics.connected.clone();
    let ops = tether_proto::ops::Ops {
        registry: prom,
        ready: Box::new(move || {
            if connected.get() > 0 {
                Ok(())
            } else {
                Err("not connected to the cloud".into())
            }
        }),
        status: None,
    };
    tokio::spawn(tether_proto::ops::serve(ops_listener, Arc::new(ops)));
    let dialer = tether_edge::dial::Dialer::new(cfg, metrics)?;
    let endpoint = dialer.endpoint();
    tracing::info!(node = dialer.node(), metrics = %metrics_addr, "tether-edge starting");
    println!(
        "tether-edge started node={} metrics={}",
        dialer.node(),
        metrics_addr
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        r = dialer.run() => return r,
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupted"),
        _ = term.recv() => tracing::info!("SIGTERM"),
    }
    endpoint.close(close_code::SHUTDOWN.into(), b"edge shutting down");
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), endpoint.wait_idle()).await;
    Ok(())
}
