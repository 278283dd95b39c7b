//! `tether-edge`: parses flags, serves the operations endpoints and runs the
//! dialer; on SIGTERM or Ctrl-C closes its connection cleanly (the cloud
//! then ends the session at once instead of waiting for a resume), waiting
//! at most `--shutdown-drain` for the close to complete.
//! `tether-edge join …` obtains the edge's certificate and exits.

use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use tether_edge::config::{EdgeArgs, JoinArgs};
use tether_proto::handshake::close_code;

fn main() -> anyhow::Result<()> {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // One worker by default (`--worker-threads`): an idle edge then wakes one
    // thread per timer or packet instead of handing work between workers.
    let runtime = |workers: usize| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
            .context("starting the async runtime")
    };
    if argv.get(1).map(|a| a == "join").unwrap_or(false) {
        argv.remove(1);
        let args = JoinArgs::parse_from(argv);
        args.validate().map_err(anyhow::Error::msg)?;
        return runtime(1)?.block_on(join(args));
    }
    // The configuration file is applied before any thread exists.
    let Some(cfg) = tether_proto::cli::start::<EdgeArgs>(&argv).map_err(anyhow::Error::msg)? else {
        return Ok(());
    };
    // Spawned, not run on the main thread by `block_on`: every timer and I/O
    // event is then handled on the runtime's worker, not handed over to the
    // main thread and back (half of the idle edge's wake-ups).
    runtime(cfg.worker_threads)?.block_on(async {
        tokio::spawn(run(cfg))
            .await
            .context("the edge's main task failed")?
    })
}

async fn run(cfg: tether_edge::config::EdgeConfig) -> anyhow::Result<()> {
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
    let drain = cfg.shutdown_drain;
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
    // The dialer (and the connection it holds) must outlive the close below:
    // dropping it first would close the connection implicitly with code 0,
    // which the cloud takes for a lost link rather than a shutdown.
    let run = dialer.run();
    tokio::pin!(run);
    tokio::select! {
        r = &mut run => return r,
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupted"),
        _ = term.recv() => tracing::info!("SIGTERM"),
    }
    endpoint.close(close_code::SHUTDOWN.into(), b"edge shutting down");
    // The close is resent for three probe timeouts in answer to the cloud's
    // packets; a slow or silent cloud is not waited on past the drain.
    let _ = tokio::time::timeout(drain, endpoint.wait_idle()).await;
    Ok(())
}

async fn join(a: JoinArgs) -> anyhow::Result<()> {
    let files = tether_edge::join::join_with_server_name(
        &a.cloud,
        a.server_name.as_deref(),
        &a.token,
        &a.ca_pin,
        &a.node,
        &a.out_dir,
        a.join_timeout,
        a.max_answer_bytes(),
    )
    .await
    .context("joining the cloud")?;
    println!(
        "tether-edge joined node={} cert={} key={} ca={}",
        a.node,
        files.cert.display(),
        files.key.display(),
        files.ca.display()
    );
    println!(
        "start with: tether-edge --cloud {} --cert {} --key {} --ca {}",
        a.cloud,
        files.cert.display(),
        files.key.display(),
        files.ca.display()
    );
    Ok(())
}
