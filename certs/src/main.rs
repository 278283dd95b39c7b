//! `tether-certs`: the operator's certificate tool. Parses flags and calls
//! into [`cli`]; all behaviour lives in the library.

mod cli;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tether-certs: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
