//! Running `tether-bench` from a test: spawned with its output shown, bounded in time.

use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Runs `tether-bench` with `args`, killing it (and failing the test) past `limit`.
pub fn run_bench(args: &[&str], out: &std::path::Path, limit: Duration) -> ExitStatus {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tether-bench"))
        .args(args)
        .arg("--out")
        .arg(out)
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawning tether-bench");
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().expect("waiting for tether-bench") {
            return s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("tether-bench {args:?} ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
