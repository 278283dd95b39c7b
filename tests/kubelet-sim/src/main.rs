//! Binary entry point: parse the CLI, set up logging (RUST_LOG, default
//! `info`, to stderr), and run the server.

use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = kubelet_sim::Cli::parse();
    kubelet_sim::run(cli).await
}
