//! QUIC settings both binaries share: transport tuning and the UDP socket.
//!
//! Values are chosen for edge devices on cellular links (see README,
//! "QUIC tuning"): keep-alives below common carrier NAT timeouts (often
//! 30–60 s for UDP), an idle timeout long enough to ride out seconds of loss,
//! and large UDP socket buffers so bursts are not dropped by the kernel.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

/// Transport tuning, from configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuicSettings {
    /// Interval of QUIC keep-alive pings when the connection is idle.
    pub keep_alive: Duration,
    /// A connection with no traffic for this long is dead.
    pub idle_timeout: Duration,
    /// RTT assumed before the first measurement.
    pub initial_rtt: Duration,
    /// Concurrent bidirectional streams the peer may open to us.
    pub max_bidi_streams: u32,
    /// Per-stream receive window, bytes.
    pub stream_window: u32,
    /// Whole-connection receive window, bytes.
    pub conn_window: u32,
    /// UDP socket send and receive buffer, bytes.
    pub udp_buffer: usize,
    /// Congestion controller.
    pub congestion: Congestion,
}

/// Which congestion controller QUIC uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Congestion {
    Cubic,
    Bbr,
    NewReno,
}

impl Default for QuicSettings {
    fn default() -> Self {
        QuicSettings {
            keep_alive: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
            initial_rtt: Duration::from_millis(300),
            max_bidi_streams: 1024,
            stream_window: 4 * 1024 * 1024,
            conn_window: 32 * 1024 * 1024,
            udp_buffer: 4 * 1024 * 1024,
            congestion: Congestion::Bbr,
        }
    }
}

impl QuicSettings {
    /// The quinn transport configuration for these settings.
    pub fn transport(&self) -> Result<quinn::TransportConfig, String> {
        let mut t = quinn::TransportConfig::default();
        let idle = quinn::IdleTimeout::try_from(self.idle_timeout)
            .map_err(|e| format!("idle timeout: {e}"))?;
        t.max_idle_timeout(Some(idle));
        if self.keep_alive >= self.idle_timeout {
            return Err(format!(
                "keep-alive ({:?}) must be shorter than the idle timeout ({:?})",
                self.keep_alive, self.idle_timeout
            ));
        }
        t.keep_alive_interval(Some(self.keep_alive));
        t.initial_rtt(self.initial_rtt);
        t.max_concurrent_bidi_streams(self.max_bidi_streams.into());
        t.max_concurrent_uni_streams(0u32.into());
        if self.stream_window == 0 || self.stream_window > self.conn_window {
            return Err(format!(
                "stream window ({}) must be positive and at most the connection window ({})",
                self.stream_window, self.conn_window
            ));
        }
        t.stream_receive_window(self.stream_window.into());
        t.receive_window(self.conn_window.into());
        t.send_window(u64::from(self.conn_window));
        match self.congestion {
            Congestion::Cubic => {
                t.congestion_controller_factory(Arc::new(quinn::congestion::CubicConfig::default()))
            }
            Congestion::Bbr => {
                t.congestion_controller_factory(Arc::new(quinn::congestion::BbrConfig::default()))
            }
            Congestion::NewReno => t.congestion_controller_factory(Arc::new(
                quinn::congestion::NewRenoConfig::default(),
            )),
        };
        Ok(t)
    }

    /// Shared transport config.
    pub fn transport_arc(&self) -> Result<Arc<quinn::TransportConfig>, String> {
        self.transport().map(Arc::new)
    }
}

/// A UDP socket bound to `addr` with enlarged kernel buffers (the kernel may
/// clamp them to `net.core.{r,w}mem_max`; that is logged by the caller, not an
/// error).
pub fn bind_udp(addr: SocketAddr, buffer: usize) -> std::io::Result<UdpSocket> {
    let sock = UdpSocket::bind(addr)?;
    set_buffers(&sock, buffer);
    Ok(sock)
}

fn set_buffers(sock: &UdpSocket, buffer: usize) {
    use std::os::fd::AsRawFd;
    let fd = sock.as_raw_fd();
    let size = buffer.min(i32::MAX as usize) as i32;
    for opt in [SO_RCVBUF, SO_SNDBUF] {
        // SAFETY: fd is a valid socket for the lifetime of `sock`; the option
        // value is a plain int of the size passed.
        unsafe {
            setsockopt(
                fd,
                SOL_SOCKET,
                opt,
                &size as *const i32 as *const _,
                std::mem::size_of::<i32>() as u32,
            );
        }
    }
}

const SOL_SOCKET: i32 = 1;
const SO_SNDBUF: i32 = 7;
const SO_RCVBUF: i32 = 8;

extern "C" {
    fn setsockopt(fd: i32, level: i32, name: i32, value: *const std::ffi::c_void, len: u32) -> i32;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_alive_must_be_below_idle() {
        let s = QuicSettings {
            keep_alive: Duration::from_secs(40),
            ..QuicSettings::default()
        };
        assert!(s.transport().is_err());
        QuicSettings::default().transport().unwrap();
    }

    #[test]
    fn stream_window_must_fit_the_connection_window() {
        for bad in [0, 33 * 1024 * 1024] {
            let s = QuicSettings {
                stream_window: bad,
                ..QuicSettings::default()
            };
            assert!(s.transport().unwrap_err().contains("stream window"));
        }
    }

    #[test]
    fn binds_with_buffers() {
        let s = bind_udp("127.0.0.1:0".parse().unwrap(), 1 << 20).unwrap();
        assert!(s.local_addr().unwrap().port() != 0);
    }
}
