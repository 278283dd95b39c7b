//! Each container's long-running "main process" for `/attach`: started lazily
//! at the first attach (`/bin/sh`, with a pty when that first attach asked for
//! a tty, else pipes), kept across attaches, its output broadcast to every
//! attached client, detaching never kills it. Once it exits, the next attach
//! starts a fresh one (a container restart).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use bytes::Bytes;
use tokio::sync::{broadcast, mpsc, watch};

use crate::process::{self, SpawnOptions};
use crate::remotecommand::{ClientIo, Options, Out, Outcome, Target};
use crate::server::AppState;

/// The command run as each container's main process.
pub const MAIN_COMMAND: &[&str] = &["/bin/sh"];

/// A container's main process.
pub struct MainProcess {
    pub tty: bool,
    stdin_tx: mpsc::UnboundedSender<Bytes>,
    /// (1 = stdout, 2 = stderr, payload)
    output: broadcast::Sender<(u8, Bytes)>,
    exit: watch::Receiver<Option<Outcome>>,
    pty: Option<Arc<OwnedFd>>,
}

/// All main processes, keyed by ns/pod/container.
#[derive(Default)]
pub struct Registry {
    procs: Mutex<HashMap<String, Arc<MainProcess>>>,
}

impl Registry {
    /// The running main process of the container, starting one if needed.
    pub fn get_or_start(
        &self,
        state: &AppState,
        t: &Target,
        tty: bool,
    ) -> Result<Arc<MainProcess>> {
        let key = format!("{}/{}/{}", t.namespace, t.pod, t.container);
        let mut procs = self.procs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = procs.get(&key) {
            if p.exit.borrow().is_none() {
                return Ok(p.clone());
            }
        }
        let command: Vec<String> = MAIN_COMMAND.iter().map(|s| s.to_string()).collect();
        let cwd = state.container_cwd(&t.namespace, &t.pod, &t.container);
        let sp = process::spawn(&SpawnOptions {
            command: &command,
            cwd: &cwd,
            tty,
            stdin: true,
            initial_size: None,
            hostname: &t.pod,
        })?;
        let (stdin_tx, mut stdin_rx) = mpsc::unbounded_channel::<Bytes>();
        let (output, _) = broadcast::channel(1024);
        let (exit_tx, exit) = watch::channel(None);
        let proc = Arc::new(MainProcess {
            tty,
            stdin_tx,
            output: output.clone(),
            exit,
            pty: sp.pty.clone(),
        });
        let process::Spawned {
            mut child,
            stdin,
            mut stdout,
            mut stderr,
            ..
        } = sp;
        tokio::spawn(async move {
            let mut w = stdin;
            while let Some(b) = stdin_rx.recv().await {
                if let Some(wr) = w.as_mut() {
                    if wr.write(&b).await.is_err() {
                        w = None;
                    }
                }
            }
        });
        tokio::spawn(async move {
            let mut out_open = true;
            let mut err_open = stderr.is_some();
            let mut status = None;
            let mut deadline = tokio::time::Instant::now() + Duration::from_secs(u32::MAX.into());
            loop {
                if status.is_some() && !out_open && !err_open {
                    break;
                }
                tokio::select! {
                    b = stdout.recv(), if out_open => match b {
                        Some(b) => { let _ = output.send((1, b)); }
                        None => out_open = false,
                    },
                    b = async { match stderr.as_mut() { Some(r) => r.recv().await, None => None } }, if err_open => match b {
                        Some(b) => { let _ = output.send((2, b)); }
                        None => err_open = false,
                    },
                    st = child.wait(), if status.is_none() => {
                        status = Some(st);
                        deadline = tokio::time::Instant::now() + Duration::from_secs(2);
                    },
                    _ = tokio::time::sleep_until(deadline), if status.is_some() => break,
                }
            }
            let outcome = match status {
                Some(Ok(st)) if st.success() => Outcome::Success,
                Some(Ok(st)) => Outcome::ExitCode {
                    code: process::exit_code(&st),
                    command: MAIN_COMMAND.join(" "),
                },
                _ => Outcome::Error("container process state unknown".into()),
            };
            let _ = exit_tx.send(Some(outcome));
        });
        procs.insert(key, proc.clone());
        Ok(proc)
    }
}

async fn wait_exit(exit: &mut watch::Receiver<Option<Outcome>>) {
    let _ = exit.wait_for(|e| e.is_some()).await.map(|_| ());
}

/// Serve one attached client until it detaches or the process exits.
pub async fn run_attach(p: Arc<MainProcess>, opts: Options, mut io: ClientIo) {
    let mut rx = p.output.subscribe();
    let mut exit = p.exit.clone();
    if let Some(mut stdin) = io.stdin.take() {
        let tx = p.stdin_tx.clone();
        // Stdin EOF from one client does not close the shared process' stdin.
        tokio::spawn(async move {
            while let Some(b) = stdin.recv().await {
                if tx.send(b).is_err() {
                    break;
                }
            }
        });
    }
    if let (Some(mut resize), Some(master)) = (io.resize.take(), p.pty.clone()) {
        tokio::spawn(async move {
            while let Some(sz) = resize.recv().await {
                let _ = process::resize(&master, sz);
            }
        });
    }
    let mut gone = io.gone.clone();
    let forward = |ch: u8, b: Bytes| -> Option<Out> {
        match ch {
            1 if opts.stdout => Some(Out::Stdout(b)),
            2 if opts.stderr => Some(Out::Stderr(b)),
            _ => None,
        }
    };
    loop {
        tokio::select! {
            m = rx.recv() => match m {
                Ok((ch, b)) => {
                    if let Some(o) = forward(ch, b) {
                        if io.out.send(o).await.is_err() {
                            return;
                        }
                    }
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    tracing::debug!("attach client lagged by {n} chunks");
                }
                Err(broadcast::error::RecvError::Closed) => break,
            },
            _ = wait_exit(&mut exit) => {
                while let Ok((ch, b)) = rx.try_recv() {
                    if let Some(o) = forward(ch, b) {
                        if io.out.send(o).await.is_err() {
                            return;
                        }
                    }
                }
                break;
            },
            _ = crate::remotecommand::wait_gone(&mut gone) => return,
        }
    }
    let outcome = exit.borrow().clone().unwrap_or(Outcome::Success);
    let _ = io.out.send(Out::Finish(outcome)).await;
}
