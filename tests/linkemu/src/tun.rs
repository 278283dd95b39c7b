//! TUN devices: open `/dev/net/tun` and attach a layer-3 device by name.
//!
//! The device is created in the network namespace of the calling thread
//! (use [`crate::netns::run_in`]) and lives as long as the returned file: it
//! is not persistent, so closing the file (or the router dying) removes it.
//! Reads and writes carry one bare IP packet each (`IFF_NO_PI`); the file is
//! non-blocking, so a read with nothing pending returns `WouldBlock`.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};

use anyhow::{bail, Context};

/// Create (or attach to) the TUN device `name` in the calling thread's
/// namespace and return its non-blocking, close-on-exec file.
pub fn open(name: &str) -> anyhow::Result<File> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        bail!("bad interface name {name:?}");
    }
    let path = CString::new("/dev/net/tun").context("tun path")?;
    // SAFETY: open with a valid NUL-terminated path.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error())
            .context("opening /dev/net/tun (is the tun module available?)");
    }
    // SAFETY: fd was just returned by open and is owned by nobody else.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short;
    // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is.
    let rc = unsafe { libc::ioctl(fd, libc::TUNSETIFF, &mut req as *mut libc::ifreq) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("TUNSETIFF {name}"));
    }
    Ok(File::from(owned))
}
