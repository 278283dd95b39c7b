//! The remotecommand protocol behind `/exec` and `/attach`: request options,
//! protocol versions, the transport adapters (SPDY streams or WebSocket
//! channels) that turn a connection into a transport-neutral [`ClientIo`],
//! the exec runner (a real child process per request), and the exit Status
//! written on the error stream/channel.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::protocol::{frame::coding::CloseCode, CloseFrame, Role};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::attach::MainProcess;
use crate::http_util::{self, query_all, query_flag, query_pairs, Body};
use crate::process::{self, ResizeDecoder, SpawnOptions, TermSize};
use crate::server::AppState;
use crate::spdy::{Session, Stream};
use crate::upgrade::{self, UpgradedIo};
use crate::websocket::{self, ChannelMessage, Encoding};

/// How long the server waits for the client to create its streams.
const STREAM_CREATION_TIMEOUT: Duration = Duration::from_secs(30);
/// How long to keep draining output after the process exited.
const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(2);

/// exec or attach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Exec,
    Attach,
}

/// Which pod/container a request addresses.
#[derive(Debug, Clone)]
pub struct Target {
    pub namespace: String,
    pub pod: String,
    pub uid: Option<String>,
    pub container: String,
}

/// The query options of exec/attach.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Options {
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
    pub tty: bool,
    pub command: Vec<String>,
}

impl Options {
    /// Parse `input`/`output`/`error`/`tty` (`1` or `true`) and `command`.
    pub fn from_query(query: Option<&str>) -> Self {
        let q = query_pairs(query);
        let tty = query_flag(&q, "tty");
        Options {
            stdin: query_flag(&q, "input") || query_flag(&q, "stdin"),
            stdout: query_flag(&q, "output") || query_flag(&q, "stdout"),
            // A terminal merges stderr into stdout.
            stderr: (query_flag(&q, "error") || query_flag(&q, "stderr")) && !tty,
            tty,
            command: query_all(&q, "command")
                .into_iter()
                .map(str::to_string)
                .collect(),
        }
    }
}

/// The negotiated remotecommand protocol version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Version {
    V1,
    V2,
    V3,
    V4,
    V5,
}

impl Version {
    pub fn from_spdy(name: &str) -> Self {
        match name {
            "v4.channel.k8s.io" => Version::V4,
            "v3.channel.k8s.io" => Version::V3,
            "v2.channel.k8s.io" => Version::V2,
            _ => Version::V1,
        }
    }
    pub fn from_websocket(name: Option<&str>) -> Self {
        match name {
            Some(websocket::V5_CHANNEL) => Version::V5,
            Some(websocket::V4_CHANNEL) | Some(websocket::V4_BASE64_CHANNEL) => Version::V4,
            _ => Version::V1,
        }
    }
    fn json_status(self) -> bool {
        self >= Version::V4
    }
}

/// How the process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Success,
    ExitCode { code: i32, command: String },
    Error(String),
}

impl Outcome {
    fn message(&self) -> Option<String> {
        match self {
            Outcome::Success => None,
            Outcome::ExitCode { code, command } => Some(format!(
                "command terminated with non-zero exit code: error executing command [{command}], exit code {code}"
            )),
            Outcome::Error(m) => Some(m.clone()),
        }
    }

    /// The v4/v5 `metav1.Status` written on the error stream.
    pub fn status_json(&self) -> Value {
        match self {
            Outcome::Success => json!({"metadata": {}, "status": "Success"}),
            Outcome::ExitCode { code, .. } => json!({
                "metadata": {},
                "status": "Failure",
                "message": self.message(),
                "reason": "NonZeroExitCode",
                "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]}
            }),
            Outcome::Error(m) => json!({
                "metadata": {},
                "status": "Failure",
                "message": m,
                "reason": "InternalError",
                "details": {"causes": [{"message": m}]},
                "code": 500
            }),
        }
    }

    /// Bytes for the error stream under `version` (v1–v3: text, only on failure).
    pub fn error_stream_bytes(&self, version: Version) -> Option<Vec<u8>> {
        if version.json_status() {
            Some(self.status_json().to_string().into_bytes())
        } else {
            self.message().map(String::into_bytes)
        }
    }
}

/// Output from the job to the client.
#[derive(Debug)]
pub enum Out {
    Stdout(Bytes),
    Stderr(Bytes),
    Finish(Outcome),
}

/// The transport-neutral view of a connected client.
pub struct ClientIo {
    /// Client stdin; closes at stdin EOF.
    pub stdin: Option<mpsc::UnboundedReceiver<Bytes>>,
    /// Terminal resizes.
    pub resize: Option<mpsc::UnboundedReceiver<TermSize>>,
    /// Output towards the client; ends with [`Out::Finish`].
    pub out: mpsc::Sender<Out>,
    /// Becomes true when the connection is gone.
    pub gone: watch::Receiver<bool>,
}

/// What to run for a connected client.
pub enum Job {
    Exec {
        command: Vec<String>,
        cwd: PathBuf,
        hostname: String,
    },
    Attach(Arc<MainProcess>),
}

impl Job {
    async fn run(self, opts: Options, io: ClientIo) {
        match self {
            Job::Exec {
                command,
                cwd,
                hostname,
            } => run_exec(command, cwd, hostname, opts, io).await,
            Job::Attach(p) => crate::attach::run_attach(p, opts, io).await,
        }
    }
}

/// Entry point of `/exec/…` and `/attach/…`.
pub async fn handle(
    state: Arc<AppState>,
    mut req: Request<Incoming>,
    kind: Kind,
    target: Target,
) -> Response<Body> {
    if state
        .pods
        .find_container(
            &target.namespace,
            &target.pod,
            target.uid.as_deref(),
            &target.container,
        )
        .is_none()
    {
        return http_util::not_found(&format!(
            "container {:?} in pod {}/{}",
            target.container, target.namespace, target.pod
        ));
    }
    let opts = Options::from_query(req.uri().query());
    if !opts.stdin && !opts.stdout && !opts.stderr {
        return http_util::text(
            StatusCode::BAD_REQUEST,
            "you must specify at least 1 of stdin, stdout, stderr\n",
        );
    }
    let ws = websocket::is_websocket_upgrade(req.headers());
    let spdy = upgrade::is_spdy_upgrade(req.headers());
    if !ws && !spdy {
        return http_util::text(StatusCode::BAD_REQUEST, "Upgrade request required\n");
    }
    let job = match kind {
        Kind::Exec => {
            if opts.command.is_empty() {
                return http_util::text(
                    StatusCode::BAD_REQUEST,
                    "you must specify at least one command for the container\n",
                );
            }
            Job::Exec {
                command: opts.command.clone(),
                cwd: state.container_cwd(&target.namespace, &target.pod, &target.container),
                hostname: target.pod.clone(),
            }
        }
        Kind::Attach => match state.attach.get_or_start(&state, &target, opts.tty) {
            Ok(p) => Job::Attach(p),
            Err(e) => {
                return http_util::text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("cannot start container process: {e:#}\n"),
                )
            }
        },
    };
    if ws {
        let protocol = match websocket::negotiate(req.headers(), websocket::REMOTECOMMAND_PROTOCOLS)
        {
            Ok(p) => p,
            Err(m) => return http_util::text(StatusCode::BAD_REQUEST, m + "\n"),
        };
        let resp = match websocket::accept_response(req.headers(), protocol) {
            Ok(r) => r,
            Err(r) => return r,
        };
        upgrade::on_upgrade(&mut req, move |io| serve_websocket(io, protocol, opts, job));
        resp
    } else {
        let version =
            match upgrade::negotiate_spdy(req.headers(), upgrade::REMOTECOMMAND_SPDY_VERSIONS) {
                Ok(v) => v,
                Err(r) => return r,
            };
        upgrade::on_upgrade(&mut req, move |io| async move {
            match Session::new(io, crate::spdy::Role::Server) {
                Ok(s) => serve_spdy(s, Version::from_spdy(version), opts, job).await,
                Err(e) => tracing::warn!("spdy session: {e:#}"),
            }
        });
        upgrade::spdy_switching(version)
    }
}

/// Resolves once the client connection is gone (or its watcher vanished).
pub async fn wait_gone(gone: &mut watch::Receiver<bool>) {
    let _ = gone.wait_for(|g| *g).await.map(|_| ());
}

fn resize_channel() -> (
    mpsc::UnboundedSender<TermSize>,
    mpsc::UnboundedReceiver<TermSize>,
) {
    mpsc::unbounded_channel()
}

/// Serve one remotecommand over a SPDY session.
pub async fn serve_spdy(mut session: Session, version: Version, opts: Options, job: Job) {
    let mut want: Vec<&str> = vec!["error"];
    if opts.stdin {
        want.push("stdin");
    }
    if opts.stdout {
        want.push("stdout");
    }
    if opts.stderr {
        want.push("stderr");
    }
    if opts.tty && version >= Version::V3 {
        want.push("resize");
    }
    let mut got: std::collections::HashMap<String, Stream> = Default::default();
    let deadline = Instant::now() + STREAM_CREATION_TIMEOUT;
    while !want.iter().all(|w| got.contains_key(*w)) {
        match tokio::time::timeout_at(deadline, session.accept()).await {
            Ok(Some(s)) => {
                let t = s.header("streamtype").unwrap_or("").to_ascii_lowercase();
                if want.contains(&t.as_str()) && !got.contains_key(&t) {
                    got.insert(t, s);
                } else {
                    tracing::debug!("unexpected stream type {t:?}; resetting");
                    s.writer().reset();
                }
            }
            Ok(None) => return,
            Err(_) => {
                if let Some(e) = got.get("error") {
                    let _ = e
                        .writer()
                        .write(b"timed out waiting for client to create streams");
                    e.writer().close();
                }
                session.close().await;
                return;
            }
        }
    }
    let handle = session.handle();
    let (done_tx, mut done_rx) = oneshot::channel::<()>();
    // Refuse further streams; close the session once the job is done.
    tokio::spawn(async move {
        loop {
            tokio::select! {
                s = session.accept() => match s {
                    Some(s) => s.writer().reset(),
                    None => {
                        let _ = (&mut done_rx).await;
                        break;
                    }
                },
                _ = &mut done_rx => break,
            }
        }
        session.close().await;
    });
    let (gone_tx, gone) = watch::channel(false);
    {
        let handle = handle.clone();
        tokio::spawn(async move {
            handle.closed().await;
            let _ = gone_tx.send(true);
        });
    }
    let take = |got: &mut std::collections::HashMap<String, Stream>, k: &str| got.remove(k);
    let error_w = take(&mut got, "error").map(|s| s.writer());
    let stdout_w = take(&mut got, "stdout").map(|s| s.writer());
    let stderr_w = take(&mut got, "stderr").map(|s| s.writer());
    let mut other_writers = Vec::new();
    let stdin = take(&mut got, "stdin").map(|s| {
        let (rx, w) = s.split();
        other_writers.push(w);
        rx
    });
    let resize = take(&mut got, "resize").map(|s| {
        let (mut rx, w) = s.split();
        other_writers.push(w);
        let (tx, out) = resize_channel();
        tokio::spawn(async move {
            let mut dec = ResizeDecoder::default();
            while let Some(b) = rx.recv().await {
                for sz in dec.push(&b) {
                    if tx.send(sz).is_err() {
                        return;
                    }
                }
            }
        });
        out
    });
    let (out_tx, mut out_rx) = mpsc::channel(64);
    let io = ClientIo {
        stdin,
        resize,
        out: out_tx,
        gone,
    };
    let job_task = tokio::spawn(job.run(opts, io));
    while let Some(o) = out_rx.recv().await {
        let r = match o {
            Out::Stdout(b) => stdout_w.as_ref().map(|w| w.write(&b)),
            Out::Stderr(b) => stderr_w.as_ref().map(|w| w.write(&b)),
            Out::Finish(outcome) => {
                if let (Some(w), Some(bytes)) = (&error_w, outcome.error_stream_bytes(version)) {
                    let _ = w.write(&bytes);
                }
                break;
            }
        };
        if let Some(Err(e)) = r {
            tracing::debug!("spdy write: {e:#}");
            break;
        }
    }
    drop(out_rx);
    for w in error_w
        .iter()
        .chain(stdout_w.iter())
        .chain(stderr_w.iter())
        .chain(other_writers.iter())
    {
        w.close();
    }
    let _ = done_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), job_task).await;
}

/// Serve one remotecommand over a WebSocket connection.
pub async fn serve_websocket(
    io: UpgradedIo,
    protocol: Option<&'static str>,
    opts: Options,
    job: Job,
) {
    let ws = WebSocketStream::from_raw_socket(io, Role::Server, None).await;
    let version = Version::from_websocket(protocol);
    let enc = Encoding::for_protocol(protocol);
    let v5 = version == Version::V5;
    let (mut sink, mut stream) = ws.split();

    // Tell the client the connection is established: an empty message on the
    // lowest writable channel, as the kubelet does.
    let first = if opts.stdout {
        websocket::STDOUT
    } else if opts.stderr {
        websocket::STDERR
    } else {
        websocket::ERROR
    };
    if sink.send(websocket::encode(enc, first, b"")).await.is_err() {
        return;
    }

    let (stdin_tx, stdin_rx) = mpsc::unbounded_channel();
    let (resize_tx, resize_rx) = resize_channel();
    let (gone_tx, gone) = watch::channel(false);
    let want_stdin = opts.stdin;
    let reader = tokio::spawn(async move {
        let mut stdin_tx = want_stdin.then_some(stdin_tx);
        let mut dec = ResizeDecoder::default();
        while let Some(msg) = stream.next().await {
            let msg = match msg {
                Ok(Message::Close(_)) | Err(_) => break,
                Ok(m) => m,
            };
            match websocket::decode(enc, v5, &msg) {
                Ok(Some(ChannelMessage::Data(websocket::STDIN, b))) => {
                    if let Some(tx) = &stdin_tx {
                        if !b.is_empty() {
                            let _ = tx.send(b);
                        }
                    }
                }
                Ok(Some(ChannelMessage::Data(websocket::RESIZE, b))) => {
                    for sz in dec.push(&b) {
                        let _ = resize_tx.send(sz);
                    }
                }
                Ok(Some(ChannelMessage::CloseChannel(websocket::STDIN))) => stdin_tx = None,
                Ok(_) => {}
                Err(e) => tracing::debug!("websocket: bad message: {e}"),
            }
        }
        let _ = gone_tx.send(true);
    });

    let (out_tx, mut out_rx) = mpsc::channel(64);
    let io = ClientIo {
        stdin: opts.stdin.then_some(stdin_rx),
        resize: opts.tty.then_some(resize_rx),
        out: out_tx,
        gone,
    };
    let job_task = tokio::spawn(job.run(opts, io));
    while let Some(o) = out_rx.recv().await {
        let r = match o {
            Out::Stdout(b) => {
                sink.send(websocket::encode(enc, websocket::STDOUT, &b))
                    .await
            }
            Out::Stderr(b) => {
                sink.send(websocket::encode(enc, websocket::STDERR, &b))
                    .await
            }
            Out::Finish(outcome) => {
                if let Some(bytes) = outcome.error_stream_bytes(version) {
                    let _ = sink
                        .send(websocket::encode(enc, websocket::ERROR, &bytes))
                        .await;
                }
                let _ = sink
                    .send(Message::Close(Some(CloseFrame {
                        code: CloseCode::Normal,
                        reason: "".into(),
                    })))
                    .await;
                break;
            }
        };
        if r.is_err() {
            break;
        }
    }
    drop(out_rx);
    let _ = tokio::time::timeout(Duration::from_secs(5), job_task).await;
    // Give the client a moment to answer our close frame.
    let mut reader = reader;
    if tokio::time::timeout(Duration::from_secs(5), &mut reader)
        .await
        .is_err()
    {
        reader.abort();
    }
    let _ = sink.close().await;
}

/// Run `command` as a real process for one exec request.
async fn run_exec(
    command: Vec<String>,
    cwd: PathBuf,
    hostname: String,
    opts: Options,
    mut io: ClientIo,
) {
    let mut initial_size = None;
    if opts.tty {
        if let Some(r) = io.resize.as_mut() {
            // kubectl sends the initial size right after creating the streams;
            // waiting briefly makes `stty size` deterministic.
            initial_size = tokio::time::timeout(Duration::from_secs(1), r.recv())
                .await
                .ok()
                .flatten();
        }
    }
    let command_str = command.join(" ");
    let spawned = process::spawn(&SpawnOptions {
        command: &command,
        cwd: &cwd,
        tty: opts.tty,
        stdin: opts.stdin,
        initial_size,
        hostname: &hostname,
    });
    let sp = match spawned {
        Ok(s) => s,
        Err(e) => {
            // Like a container runtime: the error on stderr, exit 126/127.
            let not_found = e
                .chain()
                .filter_map(|c| c.downcast_ref::<std::io::Error>())
                .any(|io| io.kind() == std::io::ErrorKind::NotFound);
            let msg = format!("exec failed: {e:#}\n");
            let line = Bytes::from(msg.into_bytes());
            let _ = io
                .out
                .send(if opts.stderr {
                    Out::Stderr(line)
                } else {
                    Out::Stdout(line)
                })
                .await;
            let _ = io
                .out
                .send(Out::Finish(Outcome::ExitCode {
                    code: if not_found { 127 } else { 126 },
                    command: command_str,
                }))
                .await;
            return;
        }
    };
    let process::Spawned {
        mut child,
        pgid,
        stdin,
        mut stdout,
        mut stderr,
        pty,
    } = sp;
    if let Some(mut rx) = io.stdin.take() {
        tokio::spawn(async move {
            let mut w = stdin;
            while let Some(b) = rx.recv().await {
                if let Some(wr) = w.as_mut() {
                    if wr.write(&b).await.is_err() {
                        w = None;
                    }
                }
            }
            // Dropping the writer closes the pipe: the child sees EOF.
        });
    }
    if let (Some(mut rx), Some(master)) = (io.resize.take(), pty.clone()) {
        if let Some(sz) = initial_size {
            let _ = process::resize(&master, sz);
        }
        tokio::spawn(async move {
            while let Some(sz) = rx.recv().await {
                if let Err(e) = process::resize(&master, sz) {
                    tracing::debug!("resize: {e:#}");
                }
            }
        });
    }
    let mut out_open = true;
    let mut err_open = stderr.is_some();
    let mut exit = None;
    let mut drain_deadline = Instant::now() + Duration::from_secs(3600 * 24 * 365);
    let mut gone = io.gone.clone();
    loop {
        if exit.is_some() && !out_open && !err_open {
            break;
        }
        tokio::select! {
            b = stdout.recv(), if out_open => match b {
                Some(b) => {
                    if opts.stdout && io.out.send(Out::Stdout(b)).await.is_err() {
                        process::kill_group(pgid);
                        return;
                    }
                }
                None => out_open = false,
            },
            b = async { match stderr.as_mut() { Some(r) => r.recv().await, None => None } }, if err_open => match b {
                Some(b) => {
                    if opts.stderr && io.out.send(Out::Stderr(b)).await.is_err() {
                        process::kill_group(pgid);
                        return;
                    }
                }
                None => err_open = false,
            },
            st = child.wait(), if exit.is_none() => {
                exit = Some(st);
                drain_deadline = Instant::now() + DRAIN_AFTER_EXIT;
            },
            _ = tokio::time::sleep_until(drain_deadline), if exit.is_some() => break,
            _ = wait_gone(&mut gone) => {
                tracing::debug!("client went away; killing process group {pgid}");
                process::kill_group(pgid);
                let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
                return;
            }
        }
    }
    let outcome = match exit {
        Some(Ok(st)) if st.success() => Outcome::Success,
        Some(Ok(st)) => Outcome::ExitCode {
            code: process::exit_code(&st),
            command: command_str,
        },
        Some(Err(e)) => Outcome::Error(format!("waiting for process: {e}")),
        None => Outcome::Error("process state unknown".into()),
    };
    let _ = io.out.send(Out::Finish(outcome)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_parse() {
        let o = Options::from_query(Some(
            "command=sh&command=-c&command=echo%20hi&input=1&output=true&error=1",
        ));
        assert_eq!(o.command, vec!["sh", "-c", "echo hi"]);
        assert!(o.stdin && o.stdout && o.stderr && !o.tty);
        let o = Options::from_query(Some("output=1&error=1&tty=1"));
        assert!(o.tty && o.stdout && !o.stderr);
    }

    #[test]
    fn status_documents() {
        assert_eq!(
            Outcome::Success.status_json(),
            json!({"metadata": {}, "status": "Success"})
        );
        let f = Outcome::ExitCode {
            code: 3,
            command: "sh -c exit 3".into(),
        };
        let s = f.status_json();
        assert_eq!(s["reason"], "NonZeroExitCode");
        assert_eq!(s["details"]["causes"][0]["reason"], "ExitCode");
        assert_eq!(s["details"]["causes"][0]["message"], "3");
        assert!(s["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("command terminated with non-zero exit code")));
        assert_eq!(Outcome::Success.error_stream_bytes(Version::V3), None);
        assert!(f.error_stream_bytes(Version::V2).is_some());
    }
}
