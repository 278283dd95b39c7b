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
    /// QUIC datagrams buffered each way (bytes): what datagram copies of
    /// interactive writes may hold in memory per connection.
    pub datagram_buffer: usize,
    /// Datagram copies of small interactive writes ([`crate::copies`]).
    pub copies: crate::copies::CopySettings,
    /// The path-MTU search's step, bytes ([`DEFAULT_MTU_PROBE_STEP`]); 0: no
    /// search (1,200-byte packets).
    pub mtu_probe_step: u16,
    /// How long a finished path-MTU search stands before the next
    /// ([`DEFAULT_MTU_RESEARCH`]).
    pub mtu_research: Duration,
    /// Ack-eliciting packets the peer may receive from us before it must
    /// acknowledge them (QUIC's acknowledgement-frequency extension, which
    /// both ends speak); `None`: QUIC's own cadence, an acknowledgement for
    /// every second packet. See [`DEFAULT_ACK_THRESHOLD`].
    pub ack_threshold: Option<u32>,
}

/// The default of [`QuicSettings::ack_threshold`]: an acknowledgement for
/// every 11th packet instead of every 2nd. In alternating bench runs (28 Nov,
/// 2 vCPUs, `tether-bench --only LINK`, two runs each way) it cut the CPU
/// each end spent per GiB moved by 11–12 % on the clean link (one stream)
/// and 15–27 % at 200 ms / 3 % loss / 10 Mbit/s, where packets otherwise
/// leave one or two per system call, with the same throughput and echo
/// latency; 3–5 % at 50 ms / 1 %.
/// A lone packet is acknowledged after the peer's delay (25 ms) as before,
/// and a hole in the packet numbers still brings an acknowledgement at once
/// when it would let the sender declare a loss (the extension's reordering
/// threshold, 2, matching quinn's loss detection at 3 packets).
pub const DEFAULT_ACK_THRESHOLD: u32 = 10;

/// Bounds of [`QuicSettings::ack_threshold`]. A threshold above the packets
/// a congestion window holds leaves the sender waiting for the peer's
/// delayed-acknowledgement timer (25 ms) instead of acknowledgements; 100
/// packets is about 145 KB, a window a slow link fills.
pub const ACK_THRESHOLD_BOUNDS: (u32, u32) = (1, 100);

/// The path-MTU search's default step. quinn searches from 1,200 bytes up to
/// 1,452 (a 1,500-byte path) by bisection, one padded probe and its
/// acknowledgement at a time, and probes the upper bound last once the next
/// bisection would move less than the step. With its own step, 20 bytes, a
/// 1,500-byte path takes four probes (1,326, 1,389, 1,420, 1,452); with 64,
/// two (1,326, 1,452), to the same 1,452. A path in between ends further
/// below its size: a 1,400-byte path at 1,326 instead of 1,357 (2 % less
/// payload a packet). Both ends of every connection run the search after
/// each handshake: after a cloud restart the probes and their
/// acknowledgements were a third of the datagrams of a 10,000-edge reconnect
/// storm (`tether-bench --only edges`).
pub const DEFAULT_MTU_PROBE_STEP: u16 = 64;

/// The widest search quinn makes: 1,200 to 1,452 bytes. A larger step would
/// never probe.
pub const MAX_MTU_PROBE_STEP: u16 = 1452 - 1200;

/// How long a finished path-MTU search stands before the same path is
/// searched again. quinn's default, RFC 8899's 600 s, costs an edge behind a
/// path that silently drops packets above its MTU (a carrier tunnel sending
/// no ICMP) six lost probes of up to 1,452 bytes from each end at every
/// search: on a 1,400-byte path about 17 KB, 2.4 MiB a day at 600 s, where
/// an idle edge behind a 30 s NAT binding costs 0.65 MiB a day in all. Six
/// hours makes it 68 KiB a day. A search also runs with every new
/// connection at both ends, and at the cloud's when the edge's address
/// changes (quinn keeps a path's result on the side whose own address
/// changed); a path whose MTU shrinks is caught by quinn's black-hole
/// detection whatever the interval. What waits longer: a path whose MTU
/// grew, and a search whose probes an outage took (the packets then stay
/// smaller until the next search).
pub const DEFAULT_MTU_RESEARCH: Duration = Duration::from_secs(6 * 3600);

/// Bounds of [`QuicSettings::mtu_research`]: quinn schedules the next
/// search at now + interval, which must stay a representable instant.
pub const MTU_RESEARCH_BOUNDS: (Duration, Duration) =
    (Duration::from_secs(1), Duration::from_secs(30 * 86_400));

/// The smallest datagram buffer: one full-size datagram.
pub const MIN_DATAGRAM_BUFFER: usize = 2048;

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
            udp_buffer: crate::cli::EDGE_UDP_BUFFER as usize,
            congestion: Congestion::Bbr,
            datagram_buffer: 64 * 1024,
            copies: crate::copies::CopySettings::default(),
            mtu_probe_step: DEFAULT_MTU_PROBE_STEP,
            mtu_research: DEFAULT_MTU_RESEARCH,
            ack_threshold: Some(DEFAULT_ACK_THRESHOLD),
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
        if self.datagram_buffer < MIN_DATAGRAM_BUFFER {
            return Err(format!(
                "datagram buffer ({}) must be at least {MIN_DATAGRAM_BUFFER} bytes",
                self.datagram_buffer
            ));
        }
        if self.mtu_probe_step > MAX_MTU_PROBE_STEP {
            return Err(format!(
                "MTU probe step ({}) must be at most {MAX_MTU_PROBE_STEP} bytes (0: no search)",
                self.mtu_probe_step
            ));
        }
        let (lo, hi) = MTU_RESEARCH_BOUNDS;
        if !(lo..=hi).contains(&self.mtu_research) {
            return Err(format!(
                "MTU search interval ({:?}) must be between {lo:?} and {hi:?}",
                self.mtu_research
            ));
        }
        t.mtu_discovery_config((self.mtu_probe_step > 0).then(|| {
            let mut m = quinn::MtuDiscoveryConfig::default();
            m.minimum_change(self.mtu_probe_step);
            m.interval(self.mtu_research);
            m
        }));
        if let Some(n) = self.ack_threshold {
            let (lo, hi) = ACK_THRESHOLD_BOUNDS;
            if !(lo..=hi).contains(&n) {
                return Err(format!(
                    "ACK-eliciting threshold ({n}) must be between {lo} and {hi} packets"
                ));
            }
            let mut a = quinn::AckFrequencyConfig::default();
            a.ack_eliciting_threshold(n.into());
            t.ack_frequency_config(Some(a));
        }
        t.datagram_receive_buffer_size(Some(self.datagram_buffer));
        t.datagram_send_buffer_size(self.datagram_buffer);
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

/// The kernel buffers a UDP socket got, bytes (as asked for: Linux reports
/// twice the size it was given, for its bookkeeping; that is halved here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpBuffers {
    pub receive: usize,
    pub send: usize,
}

impl UdpBuffers {
    /// What to tell an operator when the buffers are smaller than `wanted`.
    pub fn shortfall(&self, wanted: usize) -> Option<String> {
        (self.receive < wanted || self.send < wanted).then(|| {
            format!(
                "UDP socket buffers are {} KiB receive / {} KiB send, not the {} KiB asked for \
                 (--udp-buffer): the kernel caps them at net.core.rmem_max / wmem_max unless \
                 the process has CAP_NET_ADMIN; raise those sysctls",
                self.receive / 1024,
                self.send / 1024,
                wanted / 1024
            )
        })
    }
}

/// A UDP socket bound to `addr` with kernel buffers of `buffer` bytes, and the
/// buffers it really got. The kernel caps a plain request at
/// `net.core.{r,w}mem_max`; where that falls short, the privileged request
/// (`SO_RCVBUFFORCE`, which needs `CAP_NET_ADMIN`) is tried as well. Getting
/// less is not an error: the caller logs [`UdpBuffers::shortfall`].
pub fn bind_udp(addr: SocketAddr, buffer: usize) -> std::io::Result<(UdpSocket, UdpBuffers)> {
    let sock = UdpSocket::bind(addr)?;
    let got = set_buffers(&sock, buffer);
    Ok((sock, got))
}

fn set_buffers(sock: &UdpSocket, buffer: usize) -> UdpBuffers {
    use std::os::fd::AsRawFd;
    let fd = sock.as_raw_fd();
    // The kernel doubles what it is given; ask for no more than it can hold.
    let size = buffer.min(i32::MAX as usize / 2) as i32;
    let mut got = [0usize; 2];
    for (i, (opt, force)) in [(SO_RCVBUF, SO_RCVBUFFORCE), (SO_SNDBUF, SO_SNDBUFFORCE)]
        .into_iter()
        .enumerate()
    {
        set_int(fd, opt, size);
        got[i] = get_int(fd, opt) / 2;
        if got[i] < buffer {
            // Fails with EPERM without CAP_NET_ADMIN, leaving the capped size.
            set_int(fd, force, size);
            got[i] = get_int(fd, opt) / 2;
        }
    }
    UdpBuffers {
        receive: got[0],
        send: got[1],
    }
}

fn set_int(fd: i32, opt: i32, value: i32) {
    // SAFETY: fd is a valid socket for the lifetime of the caller's socket;
    // the option value is a plain int of the size passed.
    unsafe {
        setsockopt(
            fd,
            SOL_SOCKET,
            opt,
            &value as *const i32 as *const _,
            std::mem::size_of::<i32>() as u32,
        );
    }
}

/// The option's value, or 0 if it cannot be read.
fn get_int(fd: i32, opt: i32) -> usize {
    let mut value: i32 = 0;
    let mut len = std::mem::size_of::<i32>() as u32;
    // SAFETY: as in `set_int`; `value` and `len` are valid for writes of an int.
    let rc = unsafe {
        getsockopt(
            fd,
            SOL_SOCKET,
            opt,
            &mut value as *mut i32 as *mut _,
            &mut len,
        )
    };
    if rc != 0 {
        return 0;
    }
    usize::try_from(value).unwrap_or(0)
}

const SOL_SOCKET: i32 = 1;
const SO_SNDBUF: i32 = 7;
const SO_RCVBUF: i32 = 8;
const SO_SNDBUFFORCE: i32 = 32;
const SO_RCVBUFFORCE: i32 = 33;

extern "C" {
    fn setsockopt(fd: i32, level: i32, name: i32, value: *const std::ffi::c_void, len: u32) -> i32;
    fn getsockopt(
        fd: i32,
        level: i32,
        name: i32,
        value: *mut std::ffi::c_void,
        len: *mut u32,
    ) -> i32;
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
    fn datagram_buffer_below_one_datagram_is_refused() {
        let s = |datagram_buffer| QuicSettings {
            datagram_buffer,
            ..QuicSettings::default()
        };
        assert!(s(MIN_DATAGRAM_BUFFER - 1).transport().is_err());
        s(MIN_DATAGRAM_BUFFER).transport().unwrap();
    }

    /// A loopback pair with `settings` on both ends.
    async fn pair(
        settings: QuicSettings,
    ) -> (quinn::Connection, quinn::Connection, Vec<quinn::Endpoint>) {
        let t = settings.transport_arc().unwrap();
        crate::testing::quic_pair_with(t).await.unwrap()
    }

    /// The search on loopback (no path limit below quinn's 1,452 bytes): how
    /// many probes each end sent and the packet size each reached.
    async fn search(step: u16) -> [(u64, u16); 2] {
        let (a, b, _endpoints) = pair(QuicSettings {
            mtu_probe_step: step,
            ..QuicSettings::default()
        })
        .await;
        let done = |c: &quinn::Connection| {
            let p = c.stats().path;
            (p.sent_plpmtud_probes, p.current_mtu)
        };
        // Each probe waits for the last one's acknowledgement.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while tokio::time::Instant::now() < deadline
            && [done(&a).1, done(&b).1] != [1452, 1452]
            && step > 0
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        [done(&a), done(&b)]
    }

    #[tokio::test]
    async fn the_mtu_search_takes_two_probes_to_a_full_size_path() {
        assert_eq!(search(DEFAULT_MTU_PROBE_STEP).await, [(2, 1452); 2]);
        // quinn's own step: four probes to the same size.
        assert_eq!(search(20).await, [(4, 1452); 2]);
        assert_eq!(search(0).await, [(0, 1200); 2]);
        let s = QuicSettings {
            mtu_probe_step: MAX_MTU_PROBE_STEP + 1,
            ..QuicSettings::default()
        };
        assert!(s.transport().unwrap_err().contains("MTU probe step"));
    }

    #[test]
    fn ack_threshold_outside_its_bounds_is_refused() {
        let s = |n| QuicSettings {
            ack_threshold: Some(n),
            ..QuicSettings::default()
        };
        let (lo, hi) = ACK_THRESHOLD_BOUNDS;
        for bad in [lo - 1, hi + 1] {
            assert!(s(bad)
                .transport()
                .unwrap_err()
                .contains("ACK-eliciting threshold"));
        }
        s(lo).transport().unwrap();
        s(hi).transport().unwrap();
    }

    /// ACK frames the receiver of 4 MiB on one stream sent, and
    /// ACK_FREQUENCY frames the sender sent, with `threshold`.
    async fn acks_for_4_mib(threshold: Option<u32>) -> (u64, u64) {
        let (sender, receiver, _endpoints) = pair(QuicSettings {
            ack_threshold: threshold,
            ..QuicSettings::default()
        })
        .await;
        let transfer = async {
            let (mut tx, _rx) = sender.open_bi().await.unwrap();
            let write = async {
                tx.write_all(&vec![7u8; 4 << 20]).await.unwrap();
                tx.finish().unwrap();
            };
            let read = async {
                let (_tx, mut rx) = receiver.accept_bi().await.unwrap();
                rx.read_to_end(8 << 20).await.unwrap().len()
            };
            tokio::join!(write, read).1
        };
        let got = tokio::time::timeout(Duration::from_secs(20), transfer)
            .await
            .unwrap();
        assert_eq!(got, 4 << 20);
        (
            receiver.stats().frame_tx.acks,
            sender.stats().frame_tx.ack_frequency,
        )
    }

    #[tokio::test]
    async fn ack_threshold_makes_the_receiver_acknowledge_less() {
        let (acks_quic, freq_quic) = acks_for_4_mib(None).await;
        let (acks_10, freq_10) = acks_for_4_mib(Some(10)).await;
        // Unset: no extension frame, QUIC's cadence. Set: the sender asks,
        // and the receiver's acknowledgements for ~2,900 packets fall.
        assert_eq!(freq_quic, 0);
        assert!(freq_10 >= 1, "no ACK_FREQUENCY frame sent");
        assert!(
            acks_10 * 3 < acks_quic,
            "threshold 10: {acks_10} acknowledgements, QUIC's cadence {acks_quic}"
        );
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

    fn sysctl(name: &str) -> usize {
        std::fs::read_to_string(format!("/proc/sys/net/core/{name}"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }

    #[test]
    fn binds_with_the_buffers_asked_for() {
        let (s, got) = bind_udp("127.0.0.1:0".parse().unwrap(), 160 * 1024).unwrap();
        assert!(s.local_addr().unwrap().port() != 0);
        assert_eq!(
            got,
            UdpBuffers {
                receive: 160 * 1024,
                send: 160 * 1024
            }
        );
        assert_eq!(got.shortfall(160 * 1024), None);
    }

    #[test]
    fn buffers_beyond_the_sysctl_cap_are_forced_or_reported() {
        // Four times the cap: granted only to a process with CAP_NET_ADMIN.
        let (rmax, wmax) = (sysctl("rmem_max"), sysctl("wmem_max"));
        let want = 4 * rmax.max(wmax);
        let (_s, got) = bind_udp("127.0.0.1:0".parse().unwrap(), want).unwrap();
        if has_net_admin() {
            assert_eq!(
                got,
                UdpBuffers {
                    receive: want,
                    send: want
                }
            );
            assert_eq!(got.shortfall(want), None);
        } else {
            assert_eq!(
                got,
                UdpBuffers {
                    receive: rmax,
                    send: wmax
                }
            );
            let why = got.shortfall(want).unwrap();
            assert!(why.contains("net.core.rmem_max"), "{why}");
        }
        // What an unprivileged process gets is reported, not hidden.
        let capped = UdpBuffers {
            receive: rmax,
            send: wmax,
        };
        let why = capped.shortfall(want).unwrap();
        assert!(
            why.contains(&format!("{} KiB receive", rmax / 1024)),
            "{why}"
        );
    }

    /// Whether this process may exceed the sysctl caps (`CAP_NET_ADMIN`, bit
    /// 12 of the effective set in /proc/self/status).
    fn has_net_admin() -> bool {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let hex = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .unwrap()
            .trim();
        u64::from_str_radix(hex, 16).unwrap() & (1 << 12) != 0
    }
}
