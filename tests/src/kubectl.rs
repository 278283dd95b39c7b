//! The kubectl binaries under test, and running them against a cluster.
//!
//! By default both `/usr/lib/google-cloud-sdk/bin/kubectl.1.28` (exec/attach over SPDY)
//! and `kubectl.1.33` (exec/attach over WebSocket) are used; `KUBECTL=/path/to/kubectl`
//! names one binary to use instead (for example Debian's `kubernetes-client`,
//! `/usr/bin/kubectl`). A missing binary is an error, never a reason to skip.
//!
//! Every run gets `--kubeconfig` and its own `HOME` (kubectl's discovery cache lives
//! there) and no inherited `KUBECONFIG`, and is bounded in time.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

use crate::process::{self, Proc, SpawnOptions};

/// The kubectl that drives SPDY end to end.
pub const KUBECTL_128: &str = "/usr/lib/google-cloud-sdk/bin/kubectl.1.28";
/// The kubectl that drives WebSocket end to end.
pub const KUBECTL_133: &str = "/usr/lib/google-cloud-sdk/bin/kubectl.1.33";
/// Debian's `kubernetes-client`, suggested when the SDK binaries are absent.
pub const KUBECTL_DEBIAN: &str = "/usr/bin/kubectl";

/// One kubectl binary and its client version.
#[derive(Debug, Clone)]
pub struct KubectlBin {
    pub path: PathBuf,
    /// `major.minor`, e.g. `1.28`.
    pub version: String,
}

/// The kubectl binaries to run the suite with: `$KUBECTL`, or both default versions.
pub async fn under_test() -> Result<Vec<KubectlBin>> {
    let paths: Vec<PathBuf> = match std::env::var_os("KUBECTL") {
        Some(p) if !p.is_empty() => vec![PathBuf::from(p)],
        _ => vec![PathBuf::from(KUBECTL_128), PathBuf::from(KUBECTL_133)],
    };
    let mut bins = Vec::new();
    for path in paths {
        if !path.is_file() {
            bail!(
                "kubectl binary {} is missing: the suite needs real kubectl and never skips; \
                 install it, or set KUBECTL to one kubectl binary to use instead of both \
                 {KUBECTL_128} and {KUBECTL_133} (e.g. KUBECTL={KUBECTL_DEBIAN} from Debian's \
                 kubernetes-client)",
                path.display()
            );
        }
        let version = client_version(&path).await?;
        bins.push(KubectlBin { path, version });
    }
    Ok(bins)
}

/// `major.minor` of a kubectl binary, from `kubectl version --client -o json`.
pub async fn client_version(path: &Path) -> Result<String> {
    let mut cmd = Command::new(path);
    cmd.args(["version", "--client", "-o", "json"])
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(20), cmd.output())
        .await
        .with_context(|| format!("{} version: timed out", path.display()))?
        .with_context(|| format!("running {} version", path.display()))?;
    if !out.status.success() {
        bail!(
            "{} version --client failed: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("parsing {} version output", path.display()))?;
    let major = v["clientVersion"]["major"].as_str().unwrap_or("?");
    let minor = v["clientVersion"]["minor"]
        .as_str()
        .unwrap_or("?")
        .trim_end_matches('+');
    Ok(format!("{major}.{minor}"))
}

/// The result of a finished kubectl run.
#[derive(Debug, Clone)]
pub struct Output {
    /// Exit code; `None` when killed by a signal.
    pub code: Option<i32>,
    pub stdout: Vec<u8>,
    pub stderr: String,
}

impl Output {
    /// Stdout as (lossy) text.
    pub fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// Fails unless kubectl exited 0; the error quotes stderr.
    pub fn ok(self, what: &str) -> Result<Output> {
        if self.code != Some(0) {
            bail!(
                "{what}: kubectl exited with {:?}; stderr: {}; stdout: {}",
                self.code,
                self.stderr.trim(),
                clip(&self.stdout_text())
            );
        }
        Ok(self)
    }
}

/// Shortens long outputs in messages.
pub fn clip(s: &str) -> String {
    const MAX: usize = 2000;
    if s.len() <= MAX {
        return s.to_string();
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…({} bytes)", &s[..end], s.len())
}

/// A kubectl bound to one cluster's kubeconfig.
#[derive(Debug, Clone)]
pub struct Kubectl {
    pub bin: KubectlBin,
    pub kubeconfig: PathBuf,
    /// `HOME` for its runs, and where streaming runs put their stderr logs.
    pub home: PathBuf,
    /// Run inside this network namespace (`ip netns exec`), e.g. next to an apiserver
    /// that listens only there; `None`: this process's namespace.
    pub netns: Option<String>,
}

impl Kubectl {
    /// A kubectl for `kubeconfig`, with `home` (created) as its home directory.
    pub fn new(bin: KubectlBin, kubeconfig: &Path, home: &Path) -> Result<Self> {
        std::fs::create_dir_all(home).with_context(|| format!("creating {}", home.display()))?;
        Ok(Kubectl {
            bin,
            kubeconfig: kubeconfig.to_path_buf(),
            home: home.to_path_buf(),
            netns: None,
        })
    }

    /// The same kubectl, run inside network namespace `ns`.
    pub fn in_netns(mut self, ns: &str) -> Self {
        self.netns = Some(ns.to_string());
        self
    }

    /// The program and leading arguments: kubectl itself, or `ip netns exec NS kubectl`
    /// (which execs kubectl, so the child's pid is kubectl's).
    fn program(&self) -> (std::ffi::OsString, Vec<std::ffi::OsString>) {
        match &self.netns {
            None => (self.bin.path.clone().into(), Vec::new()),
            Some(ns) => (
                "ip".into(),
                vec![
                    "netns".into(),
                    "exec".into(),
                    ns.into(),
                    self.bin.path.clone().into(),
                ],
            ),
        }
    }

    /// The command line `kubectl --kubeconfig K ARGS` with the environment set (inside
    /// [`Kubectl::netns`], if set).
    pub fn command(&self, args: &[&str]) -> Command {
        let (program, lead) = self.program();
        let mut cmd = Command::new(program);
        cmd.args(lead)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .env("HOME", &self.home)
            .env_remove("KUBECONFIG")
            .kill_on_drop(true);
        cmd
    }

    /// Same as [`Kubectl::command`], as a std command (for a pty).
    pub fn std_command(&self, args: &[&str]) -> std::process::Command {
        let (program, lead) = self.program();
        let mut cmd = std::process::Command::new(program);
        cmd.args(lead)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args)
            .env("HOME", &self.home)
            .env_remove("KUBECONFIG");
        cmd
    }

    /// Runs kubectl to completion with `stdin` (else /dev/null), killed after `limit`.
    pub async fn run(
        &self,
        args: &[&str],
        stdin: Option<Vec<u8>>,
        limit: Duration,
    ) -> Result<Output> {
        let mut cmd = self.command(args);
        cmd.stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        process::die_with_parent(&mut cmd);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("spawning {}", self.bin.path.display()))?;
        let writer = match (stdin, child.stdin.take()) {
            (Some(data), Some(mut pipe)) => Some(tokio::spawn(async move {
                let r = pipe.write_all(&data).await;
                drop(pipe);
                r
            })),
            _ => None,
        };
        let mut out = child.stdout.take().context("kubectl stdout pipe")?;
        let mut err = child.stderr.take().context("kubectl stderr pipe")?;
        let out_task = tokio::spawn(async move {
            let mut v = Vec::new();
            let _ = out.read_to_end(&mut v).await;
            v
        });
        let err_task = tokio::spawn(async move {
            let mut v = Vec::new();
            let _ = err.read_to_end(&mut v).await;
            v
        });
        let status = match tokio::time::timeout(limit, child.wait()).await {
            Ok(s) => s.context("waiting for kubectl")?,
            Err(_) => {
                let _ = child.kill().await;
                let stderr = tokio::time::timeout(Duration::from_secs(2), err_task)
                    .await
                    .ok()
                    .and_then(|r| r.ok())
                    .unwrap_or_default();
                bail!(
                    "kubectl {} did not finish within {limit:?}; stderr so far: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&stderr).trim()
                );
            }
        };
        if let Some(w) = writer {
            // kubectl may legitimately stop reading stdin early; only a hang matters.
            let _ = tokio::time::timeout(Duration::from_secs(5), w).await;
        }
        let collect = async {
            let stdout = out_task.await.unwrap_or_default();
            let stderr = err_task.await.unwrap_or_default();
            (stdout, stderr)
        };
        // Pipes stay open while a grandchild holds them; never wait on that forever.
        let (stdout, stderr) = tokio::time::timeout(Duration::from_secs(10), collect)
            .await
            .context("kubectl exited but its output pipes stayed open")?;
        Ok(Output {
            code: status.code(),
            stdout,
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
        })
    }

    /// Starts a long-running kubectl (logs -f, port-forward, attach) as a [`Proc`] named
    /// `name`, whose stderr goes to `<home>/<name>.log`.
    pub fn spawn(&self, name: &str, args: &[&str], stdin: bool) -> Result<Proc> {
        Proc::spawn(
            name,
            self.command(args),
            &self.home,
            SpawnOptions {
                stdin,
                own_process_group: false,
            },
        )
    }
}

/// Waits (bounded by `limit`) for a `kubectl port-forward` run to print
/// `Forwarding from 127.0.0.1:PORT -> …`, and returns that local port.
pub async fn forwarded_port(proc: &mut Proc, limit: Duration) -> Result<u16> {
    const PREFIX: &str = "Forwarding from 127.0.0.1:";
    let line = proc
        .wait_line(&format!("`{PREFIX}…`"), limit, |l| l.starts_with(PREFIX))
        .await?;
    line.trim_start_matches(PREFIX)
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("no local port in {line:?}"))
}
