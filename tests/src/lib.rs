//! # tether-tests — the harness behind Tether's end-to-end suite and demo
//!
//! Everything here runs the workspace's real binaries as processes, on loopback:
//!
//! ```text
//! kubectl ──HTTPS──► apiserver-sim ──HTTPS (--kubelet-dial)──► tether-cloud
//!                                        ◄── QUIC, mTLS ── tether-edge ──HTTP──► kubelet-sim
//! ```
//!
//! - [`bins`]: finds the binaries in the target directory next to the running executable
//!   and fails with a clear message when one is missing.
//! - [`process`]: a child process killed on drop, its stdout read line by line (ready
//!   lines are awaited with a bound), its stderr written to a log file.
//! - [`pki`]: mints every certificate a cluster needs into its run directory.
//! - [`cluster`]: starts a whole cluster — kubelet simulators, cloud, edges and the
//!   apiserver stand-in — either through the tunnel or, behind one switch
//!   ([`cluster::Mode`]), with the apiserver dialling the kubelets directly.
//! - [`ports`]: ports chosen before the process that binds them starts, drawn from below
//!   the ephemeral range so that no other process's `bind(0)` or outgoing connection takes
//!   them first.
//! - [`probe`]: a small HTTPS client that talks to the cloud's kubelet API as the
//!   apiserver would, for readiness checks and routing assertions.
//! - [`kubectl`]: which kubectl binaries are under test, and running them.
//! - [`pty`]: running a program (kubectl exec -it) under a pseudo-terminal, typing into
//!   it, reading what it prints and resizing its window.
//! - [`podhttp`]: a tiny HTTP server "behind the pod" for port-forward, and a client.
//! - [`netns`]: `tether-cloud` inside a link emulator's namespaces (fault tests, bench).
//! - [`replicabed`]: three cloud replicas in network namespaces behind nftables
//!   random-DNAT services, edges behind NAT, apiserver-sim and kubectl (replica tests).
//! - [`report`]: running named cases concurrently under a time bound and summarising
//!   the results per kubectl version.
//!
//! Every wait in this crate is bounded in time; a bound that expires is an error that
//! says what was being waited for.

/// `tether-cloud`'s three listeners on loopback ports of the kernel's choosing, for tests
/// that read the addresses from its log or need none.
pub const LOOPBACK_LISTENS: [&str; 6] = [
    "--tunnel-listen",
    "127.0.0.1:0",
    "--kubelet-listen",
    "127.0.0.1:0",
    "--metrics-listen",
    "127.0.0.1:0",
];

pub mod bins;
pub mod cluster;
pub mod containerd;
pub mod kubectl;
pub mod netns;
pub mod pki;
pub mod podhttp;
pub mod ports;
pub mod probe;
pub mod process;
pub mod pty;
pub mod replicabed;
pub mod report;

/// SHA-256 of `data`, lower-case hex: how the suite compares large payloads.
pub fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(data))
}

/// `<prefix> line 001\n`, `<prefix> line 002\n`, … for `range`: the container logs the
/// suites write and expect back.
pub fn numbered_lines(prefix: &str, range: std::ops::RangeInclusive<u32>) -> String {
    range.map(|i| format!("{prefix} line {i:03}\n")).collect()
}

/// `n` random bytes.
pub fn random_bytes(n: usize) -> Vec<u8> {
    use rand::RngCore;
    let mut v = vec![0u8; n];
    rand::rng().fill_bytes(&mut v);
    v
}
