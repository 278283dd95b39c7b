//! Ports chosen before the process that binds them starts (the cloud's kubelet API, which
//! apiserver-sim must be told before the cloud can start; a replica's peer listener,
//! which every replica's `--peers` names).
//!
//! A port that was merely free a moment ago can be taken before its process binds it.
//! Asking the kernel for port 0 and releasing it makes that likely: the answer comes from
//! the ephemeral range, the same range every outgoing connection and every other
//! `bind(0)` on the machine draws from, so with many clusters starting at once one of
//! them sooner or later takes the port first (`Address already in use`). Ports here are
//! drawn instead from below the ephemeral range (`net.ipv4.ip_local_port_range`), which
//! the kernel never hands out on its own, at random, checked free with a bind, and never
//! twice in one test process.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::sync::Mutex;

use anyhow::{bail, Result};
use rand::Rng;

/// The lowest port handed out: above the well-known and most fixed service ports.
const LOWEST: u16 = 20_000;
/// Candidates tried before giving up.
const ATTEMPTS: usize = 500;
/// Where the kernel keeps its ephemeral range.
const RANGE_FILE: &str = "/proc/sys/net/ipv4/ip_local_port_range";

/// Ports this process has handed out already.
static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// Which protocol the port must be free for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Tcp,
    Udp,
}

/// The first port of the kernel's ephemeral range (Linux's default 32768 if unreadable).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string(RANGE_FILE)
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

fn is_free(port: u16, proto: Proto) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    match proto {
        Proto::Tcp => TcpListener::bind(addr).is_ok(),
        Proto::Udp => UdpSocket::bind(addr).is_ok(),
    }
}

/// A loopback address whose port is free for `proto` now, lies below the ephemeral
/// range, and was not handed out before by this process.
pub fn free_loopback(proto: Proto) -> Result<SocketAddr> {
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let start = rand::rng().random_range(LOWEST..u16::MAX);
    pick(proto, LOWEST..ephemeral_start(), start, &mut given)
}

/// The first port of `range`, scanning from `from` and wrapping around, that is free
/// for `proto` and not in `given` (which it joins); at most [`ATTEMPTS`] tried.
fn pick(
    proto: Proto,
    range: std::ops::Range<u16>,
    from: u16,
    given: &mut BTreeSet<u16>,
) -> Result<SocketAddr> {
    let len = range.end.saturating_sub(range.start);
    if len < 100 {
        bail!(
            "ports {range:?}: the ephemeral port range ({RANGE_FILE}) leaves too little room \
             below it for ports chosen ahead of time"
        );
    }
    let first = from.wrapping_sub(range.start) % len;
    for i in 0..ATTEMPTS.min(usize::from(len)) {
        // `i < len`, so the sum stays below 2 * len, and the port inside the range.
        let offset = (usize::from(first) + i) % usize::from(len);
        let port = range.start + offset as u16;
        if !given.contains(&port) && is_free(port, proto) {
            given.insert(port);
            return Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, port)));
        }
    }
    bail!("no free {proto:?} port in {range:?} after {ATTEMPTS} tries")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_below_the_ephemeral_range_free_and_never_repeated() {
        let end = ephemeral_start();
        let mut seen = BTreeSet::new();
        for proto in [Proto::Tcp, Proto::Udp, Proto::Tcp] {
            for _ in 0..20 {
                let addr = free_loopback(proto).unwrap();
                assert!(addr.port() >= LOWEST && addr.port() < end, "{addr}");
                assert!(seen.insert(addr.port()), "{addr} handed out twice");
                // Free right now: binding it succeeds.
                assert!(is_free(addr.port(), proto), "{addr}");
            }
        }
    }

    #[test]
    fn taken_and_given_ports_are_skipped_and_the_scan_wraps_around() {
        // Hold every port of a small range but two; scanning from the top must wrap
        // around to find them, each once.
        let range = 29_000..29_100;
        let mut held = Vec::new();
        let mut open = Vec::new();
        for port in range.clone() {
            match TcpListener::bind((Ipv4Addr::LOCALHOST, port)) {
                Ok(l) if open.len() < 2 => {
                    drop(l);
                    open.push(port);
                }
                Ok(l) => held.push(l),
                Err(_) => {}
            }
        }
        assert_eq!(
            open.len(),
            2,
            "too few free ports in {range:?} on this machine"
        );
        let mut given = BTreeSet::new();
        let a = pick(Proto::Tcp, range.clone(), range.end - 1, &mut given).unwrap();
        let b = pick(Proto::Tcp, range.clone(), range.end - 1, &mut given).unwrap();
        assert_eq!([a.port(), b.port()], [open[0], open[1]]);
        let err = pick(Proto::Tcp, range.clone(), range.start, &mut given).unwrap_err();
        assert!(err.to_string().contains("no free Tcp port"), "{err}");
        drop(held);
    }

    #[test]
    fn a_range_too_small_is_refused() {
        let err = pick(Proto::Udp, 30_000..30_010, 30_000, &mut BTreeSet::new()).unwrap_err();
        assert!(err.to_string().contains("too little room"), "{err}");
    }
}
