//! The addresses an edge announces when none are configured: every
//! non-loopback IP of the host, as the kubelet would report them.

/// The host's non-loopback, non-link-local IP addresses, sorted (all of
/// them: [`announceable`] picks those a hello carries).
pub fn host_addresses() -> Vec<String> {
    let mut out = Vec::new();
    match if_addrs::get_if_addrs() {
        Ok(ifs) => {
            for i in ifs {
                let ip = i.ip();
                let link_local = match ip {
                    std::net::IpAddr::V4(v4) => v4.is_link_local(),
                    std::net::IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
                };
                if !ip.is_loopback() && !link_local {
                    out.push(ip.to_string());
                }
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot list the host's addresses; announcing none"),
    }
    out.sort();
    out.dedup();
    out
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

    /// A new address in a private network namespace is reported as an event.
    /// Needs root (unshare(CLONE_NEWNET)); the thread's namespace dies with it.
    #[test]
    fn an_added_address_is_an_event() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            panic!("this test needs root (network namespaces), as the whole suite does");
        }
        let t = std::thread::spawn(|| -> Result<(), String> {
            // SAFETY: unshare affects only this thread, which exits at the end.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return Err(format!("unshare: {}", std::io::Error::last_os_error()));
            }
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                let mut ev = AddressEvents::subscribe().map_err(|e| e.to_string())?;
                // Nothing changed yet.
                if drain(ev.fd.get_ref()).map_err(|e| e.to_string())? {
                    return Err("an event before any change".into());
                }
                // A child forked from this thread starts in its namespace.
                let ip = |args: &[&str]| {
                    std::process::Command::new("ip")
                        .args(args)
                        .status()
                        .map_err(|e| e.to_string())
                        .and_then(|s| {
                            if s.success() {
                                Ok(())
                            } else {
                                Err(format!("ip {args:?}: {s}"))
                            }
                        })
                };
                ip(&["addr", "add", "192.0.2.7/32", "dev", "lo"])?;
                tokio::time::timeout(std::time::Duration::from_secs(5), ev.changed())
                    .await
                    .map_err(|_| "no event within 5 s".to_string())?
                    .map_err(|e| e.to_string())?;
                if !host_addresses().contains(&"192.0.2.7".to_string()) {
                    return Err(format!("192.0.2.7 not in {:?}", host_addresses()));
                }
                Ok(())
            })
        });
        t.join().expect("test thread").expect("address event");
    }
}
