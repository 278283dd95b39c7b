//! The `tether-certs` command line: one subcommand per operator task, each a
//! few lines over the library. Files go to one directory (`--dir`, default
//! `./pki`) under fixed names unless `--cert`/`--key` say otherwise;
//! existing files are never overwritten without `--force`; keys are written
//! 0600, atomically. Commands that change the join-token store wait at most
//! `--store-lock-wait` for another process holding its lock.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand, ValueEnum};
use tether_certs::files::{write_public, write_secret};
use tether_certs::token::parse_lock_wait;
use tether_certs::{ca_pin, Ca, CertKey, JoinStore, KeyAlgorithm};

/// Certificates and join tokens for Tether.
#[derive(Debug, Parser)]
#[command(name = "tether-certs", version, about, long_about = None)]
pub struct Cli {
    /// Directory holding the CA and the files issued from it.
    #[arg(long, global = true, env = "TETHER_PKI_DIR", default_value = "pki")]
    dir: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The Tether CA.
    #[command(subcommand)]
    Ca(CaCommand),
    /// Issue a certificate signed by the CA.
    #[command(subcommand)]
    Issue(IssueCommand),
    /// Show a certificate's subject, names, usages, expiry and fingerprints.
    Inspect {
        /// PEM files; every certificate in each is shown.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Join tokens that let new edges obtain their certificate.
    #[command(subcommand)]
    Token(TokenCommand),
    /// Make the stateless-reset key every cloud replica shares
    /// (`tether-cloud --reset-key-file`; in Kubernetes, a Secret): 64 random
    /// bytes, hex-encoded, written 0600.
    ResetKey {
        /// Where to write the key (default: <dir>/reset.key).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Replace an existing key file (replicas must all be restarted with the new one).
        #[arg(long)]
        force: bool,
    },
    /// Revoke edge certificates (the cloud refuses them at the handshake).
    #[command(subcommand)]
    Cert(CertCommand),
}

#[derive(Debug, Subcommand)]
enum CertCommand {
    /// Revoke one certificate by serial, or every certificate of a node issued
    /// until now (a stolen key: the edge must join again with a token that
    /// allows re-issue). tether-cloud with this --join-store refuses them.
    Revoke {
        /// The certificate's serial (hex, as `inspect` and `token list` show it).
        #[arg(long, conflicts_with = "node", required_unless_present = "node")]
        serial: Option<String>,
        /// The node whose certificates issued until now are revoked.
        #[arg(long)]
        node: Option<String>,
        /// Why (kept in the store, shown by `cert revoked`).
        #[arg(long, default_value = "")]
        reason: String,
        #[command(flatten)]
        store: StoreOpt,
    },
    /// List revocations.
    Revoked {
        #[command(flatten)]
        store: StoreOpt,
    },
}

#[derive(Debug, Subcommand)]
enum CaCommand {
    /// Create the CA: <dir>/ca.crt and <dir>/ca.key (0600).
    Create {
        /// The CA's common name.
        #[arg(long, default_value = "Tether CA")]
        cn: String,
        /// Key algorithm.
        #[arg(long, value_enum, default_value_t = Algorithm::EcdsaP256)]
        algorithm: Algorithm,
        /// How long the CA is valid (s, m, h, d or y; e.g. 10y).
        #[arg(long, default_value = "10y", value_parser = parse_duration)]
        validity: Duration,
        /// Replace an existing CA (every certificate it signed stops working).
        #[arg(long)]
        force: bool,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Algorithm {
    EcdsaP256,
    Ed25519,
}

/// Options every `issue` subcommand takes.
#[derive(Debug, Args)]
struct IssueOpts {
    /// The signing CA's certificate [default: <dir>/ca.crt].
    #[arg(long)]
    ca_cert: Option<PathBuf>,
    /// The signing CA's key [default: <dir>/ca.key].
    #[arg(long)]
    ca_key: Option<PathBuf>,
    /// Where to write the certificate [default: <dir>/<kind>.crt].
    #[arg(long)]
    cert: Option<PathBuf>,
    /// Where to write the key, 0600 [default: <dir>/<kind>.key].
    #[arg(long)]
    key: Option<PathBuf>,
    /// How long the certificate is valid (s, m, h, d or y).
    #[arg(long, default_value = "365d", value_parser = parse_duration)]
    validity: Duration,
    /// Overwrite existing files.
    #[arg(long)]
    force: bool,
}

/// Names a server certificate is valid for.
#[derive(Debug, Args)]
struct ServerNames {
    /// DNS name (repeatable).
    #[arg(long = "dns")]
    dns: Vec<String>,
    /// IP address (repeatable).
    #[arg(long = "ip")]
    ip: Vec<IpAddr>,
}

#[derive(Debug, Subcommand)]
enum IssueCommand {
    /// The cloud's QUIC tunnel certificate (tether-cloud --tunnel-cert/--tunnel-key).
    /// The certificate file holds the leaf and then the CA, so that joining
    /// edges, which only know the CA's pin, receive the CA in the handshake.
    CloudTunnel {
        #[command(flatten)]
        names: ServerNames,
        #[command(flatten)]
        opts: IssueOpts,
    },
    /// The cloud's kubelet-API serving certificate (tether-cloud --kubelet-cert/--kubelet-key).
    /// The apiserver's client certificate is checked against the cluster's
    /// own CA: pass the cluster's ca.crt (e.g. /etc/kubernetes/pki/ca.crt) as
    /// tether-cloud --apiserver-client-ca. To have the apiserver verify this
    /// certificate with --kubelet-certificate-authority, sign it with the
    /// cluster CA: --ca-cert /etc/kubernetes/pki/ca.crt --ca-key /etc/kubernetes/pki/ca.key.
    CloudKubelet {
        #[command(flatten)]
        names: ServerNames,
        #[command(flatten)]
        opts: IssueOpts,
    },
    /// An edge certificate for one node: CN system:node:<node>, O system:nodes,
    /// SAN DNS <node>, client-auth (tether-edge --cert/--key). Prefer `token
    /// create` and `tether-edge join`, which keep the key on the edge.
    Edge {
        /// The Kubernetes node name.
        #[arg(long)]
        node: String,
        #[command(flatten)]
        opts: IssueOpts,
        /// The certificate is recorded in this join-token store, so that a token
        /// without --allow-reissue cannot replace the node
        /// [default: <dir>/join-tokens.json].
        #[arg(long, env = "TETHER_JOIN_STORE", conflicts_with = "no_record")]
        store: Option<PathBuf>,
        /// How long recording waits for another process holding the store's
        /// lock (ms, s, m or h; e.g. 200ms), then fails.
        #[arg(long, env = "TETHER_JOIN_STORE_LOCK_WAIT", default_value = "5s", value_parser = parse_lock_wait)]
        store_lock_wait: Duration,
        /// Do not record the certificate in a join-token store (a token whose
        /// pattern matches the node may then replace it).
        #[arg(long)]
        no_record: bool,
    },
    /// The peer certificate cloud replicas present to each other (tether-cloud
    /// --peer-cert/--peer-key): CN tether-peer, O tether:peers, SAN DNS
    /// tether-peer, server- and client-auth. Sign it with a CA of its own
    /// (`--dir` of a separate `ca create`), given to tether-cloud as --peer-ca.
    Peer {
        #[command(flatten)]
        opts: IssueOpts,
    },
    /// An apiserver-style client certificate (client-auth), as the
    /// kube-apiserver's --kubelet-client-certificate; for tests and demos.
    ApiserverClient {
        /// Common name.
        #[arg(long, default_value = "kube-apiserver-kubelet-client")]
        cn: String,
        /// Organisation (repeatable).
        #[arg(long = "org", default_value = "system:masters")]
        orgs: Vec<String>,
        #[command(flatten)]
        opts: IssueOpts,
    },
}

#[derive(Debug, Args)]
struct StoreOpt {
    /// The join-token store (shared with tether-cloud) [default: <dir>/join-tokens.json].
    #[arg(long, env = "TETHER_JOIN_STORE")]
    store: Option<PathBuf>,
    /// How long a change waits for another process holding the store's lock
    /// (ms, s, m or h; e.g. 200ms), then fails.
    #[arg(long = "store-lock-wait", env = "TETHER_JOIN_STORE_LOCK_WAIT", default_value = "5s", value_parser = parse_lock_wait)]
    lock_wait: Duration,
}

#[derive(Debug, Subcommand)]
enum TokenCommand {
    /// Create a join token and print the `tether-edge join` command that uses it.
    Create {
        /// How long the token is valid (s, m, h, d or y).
        #[arg(long, default_value = "1h", value_parser = parse_duration)]
        ttl: Duration,
        /// The one node name the token may join.
        #[arg(
            long,
            conflicts_with = "node_pattern",
            required_unless_present = "node_pattern"
        )]
        node: Option<String>,
        /// Node names the token may join instead; `*` matches any run of characters.
        #[arg(long)]
        node_pattern: Option<String>,
        /// Allow joining a node name that already has a certificate (re-bootstrapping it).
        #[arg(long)]
        allow_reissue: bool,
        /// How many edges may join with it.
        #[arg(long, default_value_t = 1)]
        uses: u32,
        /// A note shown by `token list`.
        #[arg(long, default_value = "")]
        description: String,
        /// The cloud's tunnel address as edges reach it, for the printed command.
        #[arg(long, default_value = "<cloud-host>:10004")]
        cloud: String,
        /// The CA edges must pin [default: <dir>/ca.crt].
        #[arg(long)]
        ca_cert: Option<PathBuf>,
        #[command(flatten)]
        store: StoreOpt,
    },
    /// List tokens (never their secrets) and the certificates issued with them.
    List {
        #[command(flatten)]
        store: StoreOpt,
    },
    /// Revoke a token by id: joins with it are refused from now on.
    Revoke {
        /// The token id (the part before the dot).
        id: String,
        #[command(flatten)]
        store: StoreOpt,
    },
}

/// Parses `30s`, `15m`, `12h`, `90d`, `10y` (a year is 365 days), at most
/// [`MAX_VALIDITY_YEARS`](tether_certs::mint::MAX_VALIDITY_YEARS) years.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{s:?} has no unit: add s, m, h, d or y"))?;
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} does not start with a number"))?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        "y" => 365 * 86400,
        other => return Err(format!("unknown unit {other:?}: use s, m, h, d or y")),
    };
    if n == 0 {
        return Err("a duration must be positive".into());
    }
    n.checked_mul(secs)
        .map(Duration::from_secs)
        .filter(|d| *d <= tether_certs::mint::MAX_VALIDITY)
        .ok_or_else(|| {
            format!(
                "{s:?} is too long: at most {}y",
                tether_certs::mint::MAX_VALIDITY_YEARS
            )
        })
}

/// Runs one command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    let dir = cli.dir;
    match cli.command {
        Command::Ca(CaCommand::Create {
            cn,
            algorithm,
            validity,
            force,
        }) => ca_create(&dir, &cn, algorithm, validity, force),
        Command::Issue(cmd) => issue(&dir, cmd),
        Command::Inspect { files } => inspect(&files),
        Command::Token(cmd) => token(&dir, cmd),
        Command::ResetKey { out, force } => {
            reset_key(&out.unwrap_or_else(|| dir.join("reset.key")), force)
        }
        Command::Cert(cmd) => cert_command(&dir, cmd),
    }
}

/// Random bytes in a reset key (hex-encoded in the file: 128 characters).
const RESET_KEY_BYTES: usize = 64;

fn reset_key(out: &Path, force: bool) -> anyhow::Result<()> {
    use rand::TryRngCore;
    refuse_overwrite(&[out], force)?;
    ensure_dir(out)?;
    let mut key = [0u8; RESET_KEY_BYTES];
    rand::rngs::OsRng
        .try_fill_bytes(&mut key)
        .context("drawing the reset key from the OS")?;
    let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
    write_secret(out, &format!("{hex}\n"))?;
    println!(
        "stateless-reset key (keep it secret, give every cloud replica the same): {}",
        out.display()
    );
    Ok(())
}

fn refuse_overwrite(paths: &[&Path], force: bool) -> anyhow::Result<()> {
    if force {
        return Ok(());
    }
    for p in paths {
        if p.exists() {
            bail!("{} exists; pass --force to replace it", p.display());
        }
    }
    Ok(())
}

fn ensure_dir(path: &Path) -> anyhow::Result<()> {
    if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    Ok(())
}

fn ca_create(
    dir: &Path,
    cn: &str,
    algorithm: Algorithm,
    validity: Duration,
    force: bool,
) -> anyhow::Result<()> {
    let (cert, key) = (dir.join("ca.crt"), dir.join("ca.key"));
    refuse_overwrite(&[&cert, &key], force)?;
    ensure_dir(&cert)?;
    let alg = match algorithm {
        Algorithm::EcdsaP256 => KeyAlgorithm::EcdsaP256,
        Algorithm::Ed25519 => KeyAlgorithm::Ed25519,
    };
    let ca = Ca::new_with(cn, validity, alg).context("creating the CA")?;
    write_secret(&key, &ca.key_pem())?;
    write_public(&cert, &ca.cert_pem)?;
    println!("CA certificate: {}", cert.display());
    println!("CA key (keep it secret): {}", key.display());
    println!("CA pin for joining edges: {}", ca_pin(&ca.cert_pem)?);
    Ok(())
}

fn load_ca(dir: &Path, opts: &IssueOpts) -> anyhow::Result<Ca> {
    let cert = opts.ca_cert.clone().unwrap_or_else(|| dir.join("ca.crt"));
    let key = opts.ca_key.clone().unwrap_or_else(|| dir.join("ca.key"));
    let cert_pem = std::fs::read_to_string(&cert).with_context(|| {
        format!(
            "reading the CA certificate {} (run `tether-certs ca create` first)",
            cert.display()
        )
    })?;
    let key_pem = std::fs::read_to_string(&key)
        .with_context(|| format!("reading the CA key {}", key.display()))?;
    Ca::from_pem(&cert_pem, &key_pem)
        .with_context(|| format!("{} and {} are not a CA pair", cert.display(), key.display()))
}

fn server_names(names: &ServerNames) -> anyhow::Result<Vec<&str>> {
    if names.dns.is_empty() && names.ip.is_empty() {
        bail!("name the server with at least one --dns or --ip");
    }
    Ok(names.dns.iter().map(String::as_str).collect())
}

fn issue(dir: &Path, cmd: IssueCommand) -> anyhow::Result<()> {
    let (stem, opts) = match &cmd {
        IssueCommand::CloudTunnel { opts, .. } => ("tunnel".to_string(), opts),
        IssueCommand::CloudKubelet { opts, .. } => ("kubelet".to_string(), opts),
        IssueCommand::Edge { node, opts, .. } => (node.clone(), opts),
        IssueCommand::ApiserverClient { opts, .. } => ("apiserver-client".to_string(), opts),
        IssueCommand::Peer { opts } => ("peer".to_string(), opts),
    };
    let cert_path = opts
        .cert
        .clone()
        .unwrap_or_else(|| dir.join(format!("{stem}.crt")));
    let key_path = opts
        .key
        .clone()
        .unwrap_or_else(|| dir.join(format!("{stem}.key")));
    refuse_overwrite(&[&cert_path, &key_path], opts.force)?;
    let ca = load_ca(dir, opts)?;
    let (issued, chain): (CertKey, bool) = match &cmd {
        IssueCommand::CloudTunnel { names, opts } => {
            let dns = server_names(names)?;
            (ca.issue_server(&dns, &names.ip, opts.validity)?, true)
        }
        IssueCommand::CloudKubelet { names, opts } => {
            let dns = server_names(names)?;
            (ca.issue_server(&dns, &names.ip, opts.validity)?, false)
        }
        IssueCommand::Edge {
            node,
            opts,
            store,
            store_lock_wait,
            no_record,
        } => {
            if !tether_certs::identity::valid_node_name(node) {
                bail!("{node:?} is not a valid node name (a lowercase DNS-1123 subdomain)");
            }
            let issued = ca.issue_edge(node, opts.validity)?;
            if !no_record {
                // Before any file is written: a certificate the store does not
                // know about is one a join token could replace.
                let store = StoreOpt {
                    store: store.clone(),
                    lock_wait: *store_lock_wait,
                };
                record_edge(dir, &store, node, &issued)?;
            }
            (issued, false)
        }
        IssueCommand::ApiserverClient { cn, orgs, opts } => {
            let orgs: Vec<&str> = orgs.iter().map(String::as_str).collect();
            (ca.issue_client(cn, &orgs, opts.validity)?, false)
        }
        IssueCommand::Peer { opts } => (ca.issue_peer(opts.validity)?, false),
    };
    let cert_text = if chain {
        format!("{}{}", issued.cert_pem, ca.cert_pem)
    } else {
        issued.cert_pem.clone()
    };
    ensure_dir(&cert_path)?;
    ensure_dir(&key_path)?;
    write_secret(&key_path, &issued.key_pem)?;
    write_public(&cert_path, &cert_text)?;
    println!("certificate: {}", cert_path.display());
    println!("key (0600):  {}", key_path.display());
    if chain {
        println!("the certificate file holds the CA too: joining edges verify it by the CA pin");
    }
    if let IssueCommand::CloudKubelet { .. } = cmd {
        println!(
            "trust the apiserver's client certificate with the cluster's CA: \
             tether-cloud --apiserver-client-ca /etc/kubernetes/pki/ca.crt"
        );
    }
    Ok(())
}

/// Records an edge certificate made by hand in the join-token store.
fn record_edge(dir: &Path, store: &StoreOpt, node: &str, issued: &CertKey) -> anyhow::Result<()> {
    let path = store_path(dir, store);
    let der = tether_certs::pem::certs_from_pem(&issued.cert_pem, "the new certificate")?;
    let first = der
        .first()
        .context("the new certificate's PEM holds no certificate")?;
    let summary = tether_certs::inspect::summarize(first.as_ref())?;
    let now = SystemTime::now();
    let expires = tether_certs::token::unix(now).saturating_add(summary.expires_in_secs);
    JoinStore::open(&path)
        .and_then(|s| {
            s.with_lock_wait(store.lock_wait)
                .record_issue(node, &summary.serial, now, expires)
        })
        .with_context(|| {
            format!(
                "recording node {node:?} in the join-token store {} (--store names another, \
                 --no-record skips it: join tokens matching the node could then replace it)",
                path.display()
            )
        })?;
    println!(
        "recorded in {}: a join token replaces {node} only with --allow-reissue",
        path.display()
    );
    Ok(())
}

fn inspect(files: &[PathBuf]) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let mut first = true;
    let written = (|| -> anyhow::Result<std::io::Result<()>> {
        for f in files {
            let certs = tether_certs::pem::load_certs(f)?;
            for (i, c) in certs.iter().enumerate() {
                let s = tether_certs::inspect::summarize(c.as_ref())
                    .with_context(|| format!("{} certificate #{}", f.display(), i + 1))?;
                let sep = if first { "" } else { "\n" };
                first = false;
                let r = writeln!(
                    out,
                    "{sep}{} (certificate {} of {})\n{s}",
                    f.display(),
                    i + 1,
                    certs.len()
                );
                if r.is_err() {
                    return Ok(r);
                }
            }
        }
        Ok(out.flush())
    })()?;
    match written {
        // A reader that stopped early (`| head`) is not an error.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.context("writing to stdout"),
    }
}

fn store_path(dir: &Path, opt: &StoreOpt) -> PathBuf {
    opt.store
        .clone()
        .unwrap_or_else(|| dir.join("join-tokens.json"))
}

/// The store `opt` names, its changes waiting `--store-lock-wait`.
fn open_store(dir: &Path, opt: &StoreOpt) -> anyhow::Result<JoinStore> {
    Ok(JoinStore::open(store_path(dir, opt))?.with_lock_wait(opt.lock_wait))
}

fn token(dir: &Path, cmd: TokenCommand) -> anyhow::Result<()> {
    let now = SystemTime::now();
    match cmd {
        TokenCommand::Create {
            ttl,
            node,
            node_pattern,
            allow_reissue,
            uses,
            description,
            cloud,
            ca_cert,
            store,
        } => {
            let ca_path = ca_cert.unwrap_or_else(|| dir.join("ca.crt"));
            let ca_pem = std::fs::read_to_string(&ca_path).with_context(|| {
                format!("reading the CA certificate {} to pin it", ca_path.display())
            })?;
            let pin = ca_pin(&ca_pem)?;
            let store = open_store(dir, &store)?;
            let node_pattern = match (node, node_pattern) {
                (Some(n), _) if n.contains('*') => {
                    anyhow::bail!("--node takes one node name; use --node-pattern for a pattern")
                }
                (Some(n), _) => n,
                (None, Some(p)) => p,
                (None, None) => anyhow::bail!("give --node NAME or --node-pattern PATTERN"),
            };
            let (token, record) =
                store.create_with(ttl, &node_pattern, uses, &description, allow_reissue, now)?;
            let node = if node_pattern.contains('*') {
                format!("<node name matching {node_pattern:?}>")
            } else {
                node_pattern.clone()
            };
            println!(
                "token {} for nodes {:?}, {} use(s), expires {} (stored hashed in {})",
                record.id,
                record.node_pattern,
                record.uses_left,
                tether_certs::token::format_unix(record.expires_unix),
                store.path().display()
            );
            println!("on the edge, run:");
            println!(
                "tether-edge join --cloud {cloud} --token {} --ca-pin {pin} --node {node}",
                token.reveal()
            );
        }
        TokenCommand::List { store } => {
            let store = open_store(dir, &store)?;
            let tokens = store.list()?;
            if tokens.is_empty() {
                println!("no tokens in {}", store.path().display());
            } else {
                println!(
                    "{:<8} {:<10} {:<5} {:<26} {:<20} DESCRIPTION",
                    "ID", "STATUS", "USES", "EXPIRES", "NODES"
                );
                for t in tokens {
                    println!(
                        "{:<8} {:<10} {:<5} {:<26} {:<20} {}",
                        t.id,
                        t.status(now),
                        t.uses_left,
                        tether_certs::token::format_unix(t.expires_unix),
                        t.node_pattern,
                        t.description
                    );
                }
            }
            let issued = store.issued()?;
            if !issued.is_empty() {
                println!();
                println!("{:<8} {:<24} {:<26} SERIAL", "TOKEN", "NODE", "ISSUED");
                for i in issued {
                    println!(
                        "{:<8} {:<24} {:<26} {}",
                        i.token_id,
                        i.node,
                        tether_certs::token::format_unix(i.issued_unix),
                        i.serial
                    );
                }
            }
        }
        TokenCommand::Revoke { id, store } => {
            let store = open_store(dir, &store)?;
            let r = store.revoke(&id)?;
            println!("token {} revoked", r.id);
        }
    }
    Ok(())
}

fn cert_command(dir: &std::path::Path, cmd: CertCommand) -> anyhow::Result<()> {
    let now = std::time::SystemTime::now();
    match cmd {
        CertCommand::Revoke {
            serial,
            node,
            reason,
            store,
        } => {
            let store = open_store(dir, &store)?;
            let r = match (serial, node) {
                (Some(s), _) => store.revoke_serial(&s, &reason, now)?,
                (None, Some(n)) => store.revoke_node(&n, &reason, now)?,
                (None, None) => anyhow::bail!("--serial or --node is required"),
            };
            match (&r.serial, &r.node) {
                (Some(s), _) => println!("certificate {s} revoked"),
                (_, Some(n)) => println!(
                    "every certificate of node {n} issued before {} revoked",
                    tether_certs::token::format_unix(r.revoked_unix)
                ),
                _ => {}
            }
        }
        CertCommand::Revoked { store } => {
            let store = open_store(dir, &store)?;
            println!("{:<26} {:<42} REASON", "REVOKED", "WHAT");
            for r in store.revocations()? {
                let what = match (&r.serial, &r.node) {
                    (Some(s), _) => format!("serial {s}"),
                    (_, Some(n)) => format!("node {n}, issued before"),
                    _ => "?".into(),
                };
                println!(
                    "{:<26} {:<42} {}",
                    tether_certs::token::format_unix(r.revoked_unix),
                    what,
                    r.reason
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(
            parse_duration("10y").unwrap(),
            Duration::from_secs(3650 * 86400)
        );
        for bad in ["", "10", "h", "0h", "5w", "-1h", "99999999999999999999y"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_duration("1000y").unwrap(),
            tether_certs::mint::MAX_VALIDITY
        );
        for long in ["1001y", "8000y", "400000000000y"] {
            let e = parse_duration(long).unwrap_err();
            assert!(e.contains("at most 1000y"), "{long}: {e}");
        }
    }

    #[test]
    fn reset_key_is_random_secret_and_not_overwritten() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("k/reset.key");
        reset_key(&out, false).unwrap();
        let first = std::fs::read_to_string(&out).unwrap();
        assert_eq!(first.trim().len(), 2 * RESET_KEY_BYTES);
        assert!(first.trim().bytes().all(|b| b.is_ascii_hexdigit()));
        let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(
            reset_key(&out, false).is_err(),
            "never overwritten silently"
        );
        reset_key(&out, true).unwrap();
        assert_ne!(std::fs::read_to_string(&out).unwrap(), first);
    }

    /// `--store-lock-wait` (was the fixed 5 s) reaches the store of every
    /// command that changes it; nonsense is refused.
    #[test]
    fn the_store_lock_wait_is_parsed_and_reaches_the_store() {
        assert_eq!(
            parse_lock_wait("200ms").unwrap(),
            Duration::from_millis(200)
        );
        assert_eq!(parse_lock_wait("5s").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_lock_wait("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_lock_wait("1h").unwrap(), Duration::from_secs(3600));
        for bad in ["", "0s", "0ms", "0", "5d", "ms", "-1s", "99999999999h"] {
            assert!(parse_lock_wait(bad).is_err(), "{bad}");
        }
        assert!(parse_lock_wait("0s").unwrap_err().contains("more than 0"));
        let dir = tempfile::tempdir().unwrap();
        let parse = |args: &[&str]| Cli::try_parse_from(args).map_err(|e| e.to_string());
        let wait_of = |cli: Cli| match cli.command {
            Command::Token(TokenCommand::Revoke { store, .. }) => store.lock_wait,
            Command::Issue(IssueCommand::Edge {
                store_lock_wait, ..
            }) => store_lock_wait,
            other => panic!("{other:?}"),
        };
        let d = dir.path().to_str().unwrap();
        let cli = parse(&["tether-certs", "--dir", d, "token", "revoke", "abcdef"]).unwrap();
        assert_eq!(wait_of(cli), tether_certs::token::DEFAULT_STORE_LOCK_WAIT);
        let cli = parse(&[
            "tether-certs",
            "token",
            "revoke",
            "abcdef",
            "--store-lock-wait",
            "200ms",
        ])
        .unwrap();
        assert_eq!(wait_of(cli), Duration::from_millis(200));
        let cli = parse(&[
            "tether-certs",
            "issue",
            "edge",
            "--node",
            "edge-1",
            "--store-lock-wait",
            "300ms",
        ])
        .unwrap();
        assert_eq!(wait_of(cli), Duration::from_millis(300));
        let e = parse(&["tether-certs", "token", "list", "--store-lock-wait", "0s"]).unwrap_err();
        assert!(e.contains("--store-lock-wait"), "{e}");
        let store = StoreOpt {
            store: Some(dir.path().join("s.json")),
            lock_wait: Duration::from_millis(200),
        };
        assert_eq!(
            open_store(dir.path(), &store).unwrap().lock_wait(),
            Duration::from_millis(200)
        );
    }

    #[test]
    fn every_command_has_help() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
