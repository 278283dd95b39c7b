//! The addresses an edge announces when none are configured: every
//! non-loopback IP of the host, as the kubelet would report them.

/// The host's non-loopback, non-link-local IP addresses.
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
