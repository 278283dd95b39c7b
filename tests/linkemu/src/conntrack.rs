//! Flushing a namespace's connection-tracking table over ctnetlink, which is
//! what `conntrack -F` does, without needing the conntrack tool.
//!
//! NAT rebinding ([`crate::Link::rebind_nat`]) needs it. A NAT mapping is
//! stored in the flow's conntrack entry, so a new masquerade port range only
//! affects flows that have no entry yet. Flushing the table makes every flow
//! pick a new mapping with its next packet. The request is a single netlink
//! message (`IPCTNL_MSG_CT_DELETE` with no attributes, for IPv4) on a
//! `NETLINK_NETFILTER` socket, and the kernel acknowledges it. The socket
//! acts on the namespace of the thread that creates it, so call this through
//! [`crate::netns::run_in`].

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use anyhow::{bail, Context};

const NETLINK_NETFILTER: libc::c_int = 12;
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLMSG_ERROR: u16 = 0x2;

/// Delete every IPv4 conntrack entry of the calling thread's namespace.
pub fn flush_ipv4() -> anyhow::Result<()> {
    // SAFETY: socket(2) with constant arguments.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            NETLINK_NETFILTER,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("netlink socket (NETLINK_NETFILTER)");
    }
    // SAFETY: fd was just created and is owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let timeout = libc::timeval {
        tv_sec: 2,
        tv_usec: 0,
    };
    // SAFETY: setsockopt with a valid timeval.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &timeout as *const libc::timeval as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        );
    }

    // nlmsghdr (16 bytes, host order) + nfgenmsg (4 bytes).
    let mut msg = Vec::with_capacity(20);
    msg.extend_from_slice(&20u32.to_ne_bytes()); // nlmsg_len
    msg.extend_from_slice(&((NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE).to_ne_bytes());
    msg.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes()); // nlmsg_seq
    msg.extend_from_slice(&0u32.to_ne_bytes()); // nlmsg_pid: the kernel
    msg.push(libc::AF_INET as u8); // nfgen_family
    msg.push(0); // version: NFNETLINK_V0
    msg.extend_from_slice(&0u16.to_be_bytes()); // res_id

    // SAFETY: an all-zero sockaddr_nl addresses the kernel.
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: sendto with a valid buffer and address.
    let sent = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            msg.as_ptr() as *const libc::c_void,
            msg.len(),
            0,
            &kernel as *const libc::sockaddr_nl as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(std::io::Error::last_os_error()).context("sending conntrack flush");
    }

    let mut buf = [0u8; 1024];
    // SAFETY: recv into a valid buffer.
    let n = unsafe {
        libc::recv(
            sock.as_raw_fd(),
            buf.as_mut_ptr() as *mut libc::c_void,
            buf.len(),
            0,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error()).context("reading conntrack flush ack");
    }
    let n = n as usize;
    if n < 20 {
        bail!("short netlink answer ({n} bytes)");
    }
    let kind = u16::from_ne_bytes([buf[4], buf[5]]);
    if kind != NLMSG_ERROR {
        bail!("unexpected netlink answer type {kind}");
    }
    let errno = i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]);
    if errno != 0 {
        return Err(std::io::Error::from_raw_os_error(-errno)).context("conntrack flush");
    }
    Ok(())
}
