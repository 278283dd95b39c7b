//! The addresses an edge announces when none are configured: the IPs of
//! the host's interfaces that are up, not loopback or link-local, as the
//! kubelet would report them; and the kernel's address events that tell the
//! edge when they change.
//!
//! An interface that is down carries no traffic, so its addresses are never
//! the node's: kube-proxy in IPVS mode binds every Service ClusterIP on the
//! dummy interface `kube-ipvs0`, which it never brings up. Counted, they
//! would crowd the node's own address out of `--max-announced-addresses`
//! (ClusterIPs such as 10.96.* sort before a 192.168.* node IP), and every
//! Service created or deleted in the cluster would look like an address
//! change of the edge (a rebind and a connection migration, see
//! `dial::watch_addresses`).
//!
//! The choice ([`default_addresses`]) is pure, over a listing of
//! [`HostAddress`]es; [`host_addresses`] reads the listing from the OS
//! (`getifaddrs(3)`, which gives each address with its interface's flags).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// One address of the host as the OS lists it: the interface it is on,
/// whether that interface is up (`IFF_UP`), and the address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostAddress {
    pub interface: String,
    pub up: bool,
    pub ip: IpAddr,
}

/// The addresses to announce by default from a listing: those on
/// interfaces that are up, neither loopback nor link-local; sorted, each
/// once (all of them: [`announceable`] picks those a hello carries).
pub fn default_addresses(listed: &[HostAddress]) -> Vec<String> {
    let mut out: Vec<String> = listed
        .iter()
        .filter(|a| a.up)
        .map(|a| a.ip)
        .filter(|ip| {
            let link_local = match ip {
                IpAddr::V4(v4) => v4.is_link_local(),
                IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
            };
            !ip.is_loopback() && !link_local
        })
        .map(|ip| ip.to_string())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The host's addresses to announce by default ([`default_addresses`] of
/// the OS's listing); none, with a warning, if the listing fails.
pub fn host_addresses() -> Vec<String> {
    match list_host_addresses() {
        Ok(listed) => default_addresses(&listed),
        Err(e) => {
            tracing::warn!(error = %e, "cannot list the host's addresses; announcing none");
            Vec::new()
        }
    }
}

/// Every IPv4 and IPv6 address of the host with its interface's name and
/// whether that interface is up, from one `getifaddrs(3)` call.
pub fn list_host_addresses() -> std::io::Result<Vec<HostAddress>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes the head of a list it allocated, freed
    // below with freeifaddrs; on failure it writes nothing to free.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, which
        // stays allocated until freeifaddrs below.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: a non-null ifa_addr points to a sockaddr whose family
        // says which sockaddr it is; read unaligned, as plain data.
        let ip = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = std::ptr::read_unaligned(ifa.ifa_addr.cast::<libc::sockaddr_in>());
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
                }
                libc::AF_INET6 => {
                    let sin6 = std::ptr::read_unaligned(ifa.ifa_addr.cast::<libc::sockaddr_in6>());
                    IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
                }
                _ => continue,
            }
        };
        let interface = if ifa.ifa_name.is_null() {
            String::new()
        } else {
            // SAFETY: ifa_name is a NUL-terminated string in the list.
            unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
                .to_string_lossy()
                .into_owned()
        };
        out.push(HostAddress {
            interface,
            up: ifa.ifa_flags & libc::IFF_UP as libc::c_uint != 0,
            ip,
        });
    }
    // SAFETY: `head` came from getifaddrs and is freed once; no reference
    // into the list outlives this point.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The first `max` addresses (IPv4 first, then in order): a host with more
/// addresses than a hello may carry (`--max-announced-addresses`; the
/// cloud refuses a hello with more than its own) still connects,
/// announcing a stable subset.
pub fn announceable(mut addrs: Vec<String>, max: usize) -> Vec<String> {
    if addrs.len() > max {
        tracing::warn!(
            count = addrs.len(),
            "the host has more addresses than --max-announced-addresses; announcing the first {max}"
        );
        addrs.sort_by_key(|a| (a.contains(':'), a.clone()));
        addrs.truncate(max);
    }
    addrs
}

/// The kernel's address-change events (rtnetlink multicast groups for IPv4 and
/// IPv6 addresses and links), so the edge learns of a new address the moment it
/// appears instead of polling for it: an idle edge on a battery or a metered
/// link wakes up only when something changed.
pub struct AddressEvents {
    fd: tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>,
}

impl AddressEvents {
    /// Subscribes (Linux); fails where rtnetlink is unavailable, and the caller
    /// then falls back to polling.
    pub fn subscribe() -> std::io::Result<AddressEvents> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        // SAFETY: plain socket(2) call; the result is checked before use.
        let raw = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                libc::NETLINK_ROUTE,
            )
        };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_nl is plain data; all-zero is a valid value.
        let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        sa.nl_groups =
            (libc::RTMGRP_IPV4_IFADDR | libc::RTMGRP_IPV6_IFADDR | libc::RTMGRP_LINK) as u32;
        // SAFETY: `sa` is a valid sockaddr_nl and its size is passed with it.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sa as *const libc::sockaddr_nl).cast::<libc::sockaddr>(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the OwnedFd moves into the AsyncFd, which keeps it open (and
        // the same descriptor) for its whole life.
        let fd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
        }
        .map_err(|e| e.into_parts().1)?;
        Ok(AddressEvents { fd })
    }

    /// Waits for at least one event, lets the burst of one change settle
    /// (link, address and route events arrive together), then takes every
    /// event queued: their content does not matter, the caller re-reads the
    /// addresses once.
    pub async fn changed(&mut self) -> std::io::Result<()> {
        loop {
            let mut guard = self.fd.readable().await?;
            if drain(self.fd.get_ref())? {
                break;
            }
            guard.clear_ready();
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        drain(self.fd.get_ref())?;
        Ok(())
    }
}

/// Reads every queued event without waiting; whether there was any.
fn drain(fd: &std::os::fd::OwnedFd) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    let mut buf = [0u8; 8192];
    let mut any = false;
    loop {
        // SAFETY: `buf` is valid for writes of its length.
        let n = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast::<libc::c_void>(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n > 0 {
            any = true;
            continue;
        }
        if n == 0 {
            return Ok(any);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EAGAIN) => return Ok(any),
            Some(libc::EINTR) => continue,
            // The kernel dropped events for us: something changed.
            Some(libc::ENOBUFS) => any = true,
            _ => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// `--max-announced-addresses` (was a fixed 64): more addresses than
    /// it are cut to it, IPv4 first.
    #[test]
    fn more_addresses_than_a_hello_carries_are_truncated() {
        let many: Vec<String> = (0..100)
            .map(|i| format!("fd00::{i:x}"))
            .chain((0..100).map(|i| format!("10.0.{}.{}", i / 250, i % 250 + 1)))
            .collect();
        let out = announceable(many.clone(), 64);
        assert_eq!(out.len(), 64);
        assert!(out.iter().all(|a| !a.contains(':')), "IPv4 first: {out:?}");
        assert_eq!(
            announceable(many, 3),
            ["10.0.0.1", "10.0.0.10", "10.0.0.100"]
        );
        let few = vec!["10.0.0.1".to_string(), "fd00::1".to_string()];
        assert_eq!(announceable(few.clone(), 3), few);
        assert_eq!(announceable(few, 1), ["10.0.0.1"]);
    }

    /// kube-proxy in IPVS mode binds every Service ClusterIP on the dummy
    /// interface `kube-ipvs0`, which stays down: with 100 of them and the
    /// node's IP on an interface that is up, the node's IP is announced
    /// and no ClusterIP is (they sorted first and took every one of the 64
    /// places). Loopback and link-local addresses are left out as before.
    #[test]
    fn addresses_on_a_down_interface_are_not_announced() {
        let at = |interface: &str, up: bool, ip: &str| HostAddress {
            interface: interface.into(),
            up,
            ip: ip.parse().unwrap(),
        };
        let mut listed: Vec<HostAddress> = (0..100)
            .map(|i| at("kube-ipvs0", false, &format!("10.96.0.{}", i + 1)))
            .collect();
        listed.extend([
            at("lo", true, "127.0.0.1"),
            at("lo", true, "::1"),
            at("eth0", true, "192.168.1.10"),
            at("eth0", true, "fe80::1"),
            at("eth0", true, "169.254.3.4"),
            at("eth0", true, "fd00::10"),
            // An address listed twice (two interfaces) is announced once.
            at("eth1", true, "192.168.1.10"),
        ]);
        let announced = announceable(default_addresses(&listed), 64);
        assert_eq!(announced, ["192.168.1.10", "fd00::10"]);
        // The same interface brought up: its addresses count again.
        for a in &mut listed {
            a.up = true;
        }
        let all = default_addresses(&listed);
        assert_eq!(all.len(), 102, "{all:?}");
        assert!(!announceable(all, 64).contains(&"192.168.1.10".to_string()));
    }

    /// Runs `ip` with `args` (in the calling thread's network namespace).
    fn ip(args: &[&str]) -> Result<(), String> {
        let s = std::process::Command::new("ip")
            .args(args)
            .status()
            .map_err(|e| e.to_string())?;
        if s.success() {
            Ok(())
        } else {
            Err(format!("ip {args:?}: {s}"))
        }
    }

    /// Runs `body` on a thread of its own in a private network namespace
    /// (unshare(CLONE_NEWNET): needs root; the namespace dies with the
    /// thread), on a current-thread runtime.
    fn in_private_netns<F, Fut>(body: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<(), String>>,
    {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            panic!("this test needs root (network namespaces), as the whole suite does");
        }
        let t = std::thread::spawn(move || -> Result<(), String> {
            // SAFETY: unshare affects only this thread, which exits at the end.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return Err(format!("unshare: {}", std::io::Error::last_os_error()));
            }
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(body())
        });
        t.join()
            .expect("test thread")
            .expect("in the network namespace");
    }

    /// The kube-ipvs0 case read from the kernel: a down dummy interface
    /// with 100 addresses and the node's IP on an up one. The listing sees
    /// all of them, with the dummy down; the edge announces the node's IP
    /// and none of the dummy's. Then the address watch
    /// (`dial::watch_addresses`): more addresses on the down dummy (a
    /// Service created in the cluster) do not rebind the socket (no
    /// connection migration); an address on an up interface does, once.
    /// The events come in order on one socket, so when the up address's
    /// rebind is counted the dummy's events were handled before it.
    #[test]
    fn a_down_dummy_interfaces_addresses_are_neither_announced_nor_watched() {
        in_private_netns(|| async {
            // kube-proxy's is a dummy interface; a bridge where the kernel
            // has no dummy driver (this one's): both stay down until set up.
            ip(&["link", "add", "kube-ipvs0", "type", "dummy"])
                .or_else(|_| ip(&["link", "add", "kube-ipvs0", "type", "bridge"]))?;
            // Service ClusterIPs 10.96.0.first..=last, as kube-proxy binds them.
            let add_cluster_ips = |first: u32, last: u32| -> Result<(), String> {
                for i in first..=last {
                    ip(&[
                        "addr",
                        "add",
                        &format!("10.96.0.{i}/32"),
                        "dev",
                        "kube-ipvs0",
                    ])?;
                }
                Ok(())
            };
            add_cluster_ips(1, 100)?;
            ip(&[
                "link",
                "add",
                "node0",
                "type",
                "veth",
                "peer",
                "name",
                "node0-peer",
            ])?;
            ip(&["link", "set", "node0", "up"])?;
            ip(&["link", "set", "node0-peer", "up"])?;
            ip(&["addr", "add", "192.168.1.10/24", "dev", "node0"])?;
            let listed = list_host_addresses().map_err(|e| e.to_string())?;
            let on_dummy = listed
                .iter()
                .filter(|a| a.interface == "kube-ipvs0")
                .inspect(|a| assert!(!a.up, "kube-ipvs0 is listed up: {a:?}"))
                .count();
            assert_eq!(on_dummy, 100, "{listed:?}");
            assert!(listed
                .iter()
                .any(|a| a.interface == "node0" && a.up && a.ip.to_string() == "192.168.1.10"));
            assert_eq!(announceable(host_addresses(), 64), ["192.168.1.10"]);

            let mut registry = prometheus_client::registry::Registry::default();
            let metrics = crate::metrics::EdgeMetrics::register(&mut registry);
            let endpoint =
                quinn::Endpoint::client("0.0.0.0:0".parse().unwrap()).map_err(|e| e.to_string())?;
            let watcher = crate::dial::watch_addresses(&endpoint, 1 << 20, "edge-t", &metrics);
            let driver = async {
                // The watcher (polled first) has subscribed and read the
                // addresses once this yields.
                tokio::task::yield_now().await;
                add_cluster_ips(101, 150)?;
                ip(&["addr", "del", "10.96.0.1/32", "dev", "kube-ipvs0"])?;
                // 20 times the watch's 50 ms settling: a rebind for these
                // events would be counted by then.
                tokio::time::sleep(Duration::from_secs(1)).await;
                let for_the_dummy = metrics.migrations.get();
                ip(&["addr", "add", "192.168.1.11/24", "dev", "node0"])?;
                let deadline = std::time::Instant::now() + Duration::from_secs(10);
                while metrics.migrations.get() == for_the_dummy {
                    if std::time::Instant::now() > deadline {
                        return Err("no rebind within 10 s of a new address on node0".into());
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok::<_, String>((for_the_dummy, metrics.migrations.get()))
            };
            let rebinds = tokio::select! {
                biased;
                () = watcher => return Err("the address watch returned".into()),
                r = driver => r?,
            };
            assert_eq!(
                rebinds,
                (0, 1),
                "rebinds after the down dummy's new addresses, then after node0's"
            );
            Ok(())
        });
    }

    /// A new address in a private network namespace is reported as an event.
    /// Needs root (unshare(CLONE_NEWNET)); the thread's namespace dies with it.
    #[test]
    fn an_added_address_is_an_event() {
        in_private_netns(|| async {
            // A child forked from this thread starts in its namespace. lo
            // up, as in any namespace an edge runs in (the addresses of an
            // interface that is down are not the host's).
            ip(&["link", "set", "lo", "up"])?;
            let mut ev = AddressEvents::subscribe().map_err(|e| e.to_string())?;
            // Nothing changed yet.
            if drain(ev.fd.get_ref()).map_err(|e| e.to_string())? {
                return Err("an event before any change".into());
            }
            ip(&["addr", "add", "192.0.2.7/32", "dev", "lo"])?;
            tokio::time::timeout(Duration::from_secs(5), ev.changed())
                .await
                .map_err(|_| "no event within 5 s".to_string())?
                .map_err(|e| e.to_string())?;
            if !host_addresses().contains(&"192.0.2.7".to_string()) {
                return Err(format!("192.0.2.7 not in {:?}", host_addresses()));
            }
            Ok(())
        });
    }
}
