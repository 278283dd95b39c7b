//! End-to-end tests of the link emulator: real namespaces, real TUN devices,
//! real UDP, TCP and ICMP across the router.
//!
//! They need root, iproute2 (`ip`), `/dev/net/tun`, and for NAT rebinding
//! `nft` (nftables). Without those they FAIL with a message saying what is
//! missing; they never skip.
//! Each test builds its own link under a unique tag, so they run in
//! parallel; together they take well under a minute.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use linkemu::{naming, netns, Direction, Impairment, Link, LinkOptions, Stats};

const BIN: &str = env!("CARGO_BIN_EXE_linkemu");

fn opts() -> LinkOptions {
    LinkOptions::new().with_router_bin(BIN)
}

fn create(o: LinkOptions) -> Link {
    Link::create(o).unwrap_or_else(|e| {
        panic!(
            "cannot create an emulated link: {e:#}\n\
             linkemu tests need root, iproute2 (`ip`) and /dev/net/tun; run them as root"
        )
    })
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn require_tool(tool: &str, package: &str) {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(found, "this test needs `{tool}`: apt-get install {package}");
}

/// A UDP echo server in the cloud namespace that records every source
/// address it sees. Stops when dropped (and after 30 s regardless).
struct UdpEcho {
    addr: SocketAddr,
    sources: Arc<Mutex<Vec<SocketAddr>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl UdpEcho {
    fn start(link: &Link, port: u16, echo: bool) -> UdpEcho {
        let sock = link
            .in_cloud(|| UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port)))
            .expect("enter cloud ns")
            .expect("bind echo socket");
        sock.set_read_timeout(Some(ms(20))).expect("timeout");
        big_receive_buffer(&sock);
        let sources = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (sources, stop) = (Arc::clone(&sources), Arc::clone(&stop));
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(30);
                let mut buf = [0u8; 2048];
                while !stop.load(Ordering::SeqCst) && Instant::now() < deadline {
                    if let Ok((n, from)) = sock.recv_from(&mut buf) {
                        sources.lock().expect("lock").push(from);
                        if echo {
                            let _ = sock.send_to(&buf[..n], from);
                        }
                    }
                }
            })
        };
        UdpEcho {
            addr: SocketAddr::from((link.cloud_ip(), port)),
            sources,
            stop,
            thread: Some(thread),
        }
    }

    fn received(&self) -> usize {
        self.sources.lock().expect("lock").len()
    }

    fn last_source(&self) -> Option<SocketAddr> {
        self.sources.lock().expect("lock").last().copied()
    }
}

impl Drop for UdpEcho {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// 4 MiB receive buffer, so that a burst is never dropped by the socket
/// (losses must all be the emulator's).
fn big_receive_buffer(sock: &UdpSocket) {
    use std::os::fd::AsRawFd;
    let size: libc::c_int = 4 << 20;
    // SAFETY: setsockopt with a valid int option value.
    let rc = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            &size as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_RCVBUFFORCE");
}

/// A UDP socket in the edge namespace bound to 0.0.0.0.
fn edge_socket(link: &Link) -> UdpSocket {
    let sock = link
        .in_edge(|| UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)))
        .expect("enter edge ns")
        .expect("bind edge socket");
    sock.set_read_timeout(Some(ms(500))).expect("timeout");
    sock
}

/// Send `payload` and wait for its echo; returns the round-trip time.
fn round_trip(sock: &UdpSocket, to: SocketAddr, payload: &[u8]) -> Option<Duration> {
    let t0 = Instant::now();
    sock.send_to(payload, to).expect("send");
    let mut buf = [0u8; 2048];
    let deadline = t0 + Duration::from_secs(2);
    while Instant::now() < deadline {
        match sock.recv_from(&mut buf) {
            Ok((n, _)) if &buf[..n] == payload => return Some(t0.elapsed()),
            Ok(_) => continue,
            Err(_) => continue,
        }
    }
    None
}

/// ICMP echo edge → cloud over a raw socket (we are root); returns how many
/// of `count` requests got their reply. The cloud's kernel answers.
fn icmp_ping(link: &Link, count: u16) -> u16 {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let fd = link
        .in_edge(|| {
            // SAFETY: socket(2) with constant arguments.
            unsafe {
                libc::socket(
                    libc::AF_INET,
                    libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                    libc::IPPROTO_ICMP,
                )
            }
        })
        .expect("enter edge ns");
    assert!(fd >= 0, "raw ICMP socket");
    // SAFETY: fd was just created and is owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let timeout = libc::timeval {
        tv_sec: 0,
        tv_usec: 200_000,
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
    // SAFETY: all-zero is a valid sockaddr_in.
    let mut dst: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    dst.sin_family = libc::AF_INET as libc::sa_family_t;
    dst.sin_addr.s_addr = u32::from(link.cloud_ip()).to_be();
    let id = (std::process::id() & 0xffff) as u16;
    let mut replies = 0;
    for seq in 0..count {
        let mut pkt = vec![8u8, 0, 0, 0];
        pkt.extend_from_slice(&id.to_be_bytes());
        pkt.extend_from_slice(&seq.to_be_bytes());
        pkt.extend_from_slice(&[0x42; 32]);
        let mut sum: u32 = pkt
            .chunks(2)
            .map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)])))
            .sum();
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        pkt[2..4].copy_from_slice(&(!(sum as u16)).to_be_bytes());
        // SAFETY: sendto with a valid buffer and address.
        let sent = unsafe {
            libc::sendto(
                sock.as_raw_fd(),
                pkt.as_ptr() as *const libc::c_void,
                pkt.len(),
                0,
                &dst as *const libc::sockaddr_in as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        assert_eq!(sent, pkt.len() as isize, "send ICMP echo");
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut buf = [0u8; 1500];
        while Instant::now() < deadline {
            // SAFETY: recv into a valid buffer.
            let n = unsafe {
                libc::recv(
                    sock.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    0,
                )
            };
            if n <= 0 {
                continue;
            }
            let ihl = usize::from(buf[0] & 0x0f) * 4;
            let icmp = &buf[ihl..n as usize];
            if icmp.len() >= 8
                && icmp[0] == 0
                && icmp[4..6] == id.to_be_bytes()
                && icmp[6..8] == seq.to_be_bytes()
            {
                replies += 1;
                break;
            }
        }
    }
    replies
}

/// Poll the router until `f(stats)` holds (bounded).
fn wait_stats(link: &Link, what: &str, f: impl Fn(&Stats) -> bool) -> Stats {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = link.stats().expect("stats");
        if f(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {s:?}"
        );
        std::thread::sleep(ms(20));
    }
}

#[test]
fn preflight_passes() {
    linkemu::preflight().unwrap_or_else(|e| {
        panic!("{e:#}\nlinkemu tests must run as root with iproute2 installed")
    });
}

#[test]
fn udp_and_ping_cross_the_link() {
    let link = create(opts());
    let echo = UdpEcho::start(&link, 7001, true);
    let sock = edge_socket(&link);
    for i in 0..5u8 {
        let rtt = round_trip(&sock, echo.addr, &[i; 32]).expect("UDP echo across the link");
        assert!(rtt < ms(100), "clean link RTT {rtt:?}");
    }
    assert_eq!(
        echo.last_source().map(|a| a.ip()),
        Some(link.edge_ip().into())
    );
    assert_eq!(icmp_ping(&link, 2), 2, "ICMP echo edge → cloud");
    let s = link.stats().expect("stats");
    assert!(s.up.tx_packets >= 7 && s.down.tx_packets >= 7, "{s:?}");
    assert_eq!(s.up.dropped(), 0);
}

#[test]
fn rtt_matches_configured_delay() {
    let delay = ms(40);
    let link = create(opts().with_impairment(Impairment::clean().with_delay(delay)));
    let echo = UdpEcho::start(&link, 7002, true);
    let sock = edge_socket(&link);
    let mut rtts: Vec<Duration> = (0..15u8)
        .map(|i| round_trip(&sock, echo.addr, &[i; 64]).expect("echo"))
        .collect();
    rtts.sort();
    let (min, median, p80, max) = (
        rtts[0],
        rtts[rtts.len() / 2],
        rtts[rtts.len() * 8 / 10],
        rtts[rtts.len() - 1],
    );
    println!(
        "configured one-way delay {delay:?}: RTT min {min:?} median {median:?} p80 {p80:?} max {max:?}"
    );
    assert!(min >= 2 * delay, "RTT {min:?} below 2 × delay");
    // The router runs at real-time priority, but this test's own threads do
    // not: on a loaded machine a few samples can be late for reasons that
    // are not the link's, hence a percentile rather than the maximum.
    assert!(median < 2 * delay + ms(20), "median RTT {median:?}");
    assert!(
        p80 < 2 * delay + ms(50),
        "p80 RTT {p80:?} above 2 × delay + 50 ms"
    );
}

#[test]
fn jitter_keeps_packet_order() {
    let link =
        create(opts().with_impairment(Impairment::clean().with_delay(ms(20)).with_jitter(ms(15))));
    let recv = link
        .in_cloud(|| UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 7004)))
        .expect("ns")
        .expect("bind");
    recv.set_read_timeout(Some(ms(300))).expect("timeout");
    big_receive_buffer(&recv);
    let sock = edge_socket(&link);
    let to = SocketAddr::from((link.cloud_ip(), 7004));
    let t0 = Instant::now();
    for i in 0..200u16 {
        sock.send_to(&i.to_be_bytes(), to).expect("send");
        std::thread::sleep(Duration::from_micros(500));
    }
    let mut got = Vec::new();
    let mut buf = [0u8; 16];
    while got.len() < 200 {
        match recv.recv_from(&mut buf) {
            Ok((2, _)) => got.push(u16::from_be_bytes([buf[0], buf[1]])),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    println!(
        "200 packets with 20 ms ± 15 ms jitter arrived in {:?}",
        t0.elapsed()
    );
    assert_eq!(got.len(), 200, "all arrive");
    assert!(got.windows(2).all(|w| w[0] < w[1]), "in order: {got:?}");

    // With reordering allowed, the same stream is shuffled.
    link.set(
        Impairment::clean()
            .with_delay(ms(20))
            .with_jitter(ms(15))
            .with_reorder(true),
    )
    .expect("set");
    for i in 0..200u16 {
        sock.send_to(&i.to_be_bytes(), to).expect("send");
        std::thread::sleep(Duration::from_micros(500));
    }
    let mut got = Vec::new();
    while got.len() < 200 {
        match recv.recv_from(&mut buf) {
            Ok((2, _)) => got.push(u16::from_be_bytes([buf[0], buf[1]])),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    assert_eq!(got.len(), 200);
    assert!(got.windows(2).any(|w| w[0] > w[1]), "reorder=true reorders");
}

#[test]
fn loss_close_to_configured() {
    let loss = 10.0;
    let link = create(opts().with_seed(42));
    link.set_dir(Direction::Up, Impairment::clean().with_loss(loss))
        .expect("set loss");
    let sink = UdpEcho::start(&link, 7005, false);
    let sock = edge_socket(&link);
    let n = 2000u32;
    for i in 0..n {
        sock.send_to(&i.to_be_bytes(), sink.addr).expect("send");
        if i % 20 == 19 {
            std::thread::sleep(ms(1));
        }
    }
    let s = wait_stats(&link, "all packets through the router", |s| {
        s.up.rx_packets >= u64::from(n) && s.up.in_flight_packets == 0
    });
    std::thread::sleep(ms(100));
    let received = sink.received() as u64;
    let lost = u64::from(n) - received;
    println!(
        "loss {loss}% over {n} UDP packets: {lost} lost ({:.1}%), router counted {} dropped",
        lost as f64 * 100.0 / f64::from(n),
        s.up.dropped_loss
    );
    assert_eq!(s.up.rx_packets, u64::from(n), "router saw every packet");
    assert_eq!(lost, s.up.dropped_loss, "every loss is the router's");
    // Binomial(2000, 0.1): mean 200, sd 13.4; bounds are ±4.5 sd.
    assert!((140..=260).contains(&lost), "lost {lost} of {n}");
}

#[test]
fn rate_limit_caps_tcp_throughput() {
    let rate = 1_000_000u64; // bytes/s of IP packets (8 Mbit/s)
    let link = create(opts());
    link.set_dir(
        Direction::Up,
        Impairment::clean().with_delay(ms(5)).with_rate(rate),
    )
    .expect("set rate");
    link.set_dir(Direction::Down, Impairment::clean().with_delay(ms(5)))
        .expect("set down");
    let listener = link
        .in_cloud(|| TcpListener::bind((Ipv4Addr::UNSPECIFIED, 7006)))
        .expect("ns")
        .expect("bind");
    let run_for = Duration::from_secs(3);
    let server = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().expect("accept");
        conn.set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        let mut buf = vec![0u8; 65536];
        let mut samples = Vec::new();
        let mut total = 0u64;
        while let Ok(n) = conn.read(&mut buf) {
            if n == 0 {
                break;
            }
            total += n as u64;
            samples.push((Instant::now(), total));
        }
        samples
    });
    let mut client = link
        .in_edge(|| TcpStream::connect((naming::CLOUD_IP, 7006)))
        .expect("ns")
        .expect("connect");
    client
        .set_write_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let chunk = vec![0x5au8; 16 * 1024];
    let t0 = Instant::now();
    while t0.elapsed() < run_for {
        if client.write_all(&chunk).is_err() {
            break;
        }
    }
    drop(client);
    let samples = server.join().expect("server");
    assert!(!samples.is_empty(), "no data crossed the link");
    // Skip the first second (slow start, filling the queue).
    let first = samples[0].0;
    let start = samples
        .iter()
        .find(|(t, _)| t.duration_since(first) >= Duration::from_secs(1))
        .copied()
        .expect("a sample after 1 s");
    let end = *samples.last().expect("samples");
    let secs = end.0.duration_since(start.0).as_secs_f64();
    let goodput = (end.1 - start.1) as f64 / secs;
    let s = link.stats().expect("stats");
    println!(
        "rate {rate} B/s: TCP goodput {goodput:.0} B/s ({:.0}% of rate) over {secs:.2} s; \
         queue tail drops {}",
        goodput * 100.0 / rate as f64,
        s.up.dropped_queue
    );
    assert!(
        goodput > 0.7 * rate as f64 && goodput < 1.02 * rate as f64,
        "goodput {goodput:.0} B/s for rate {rate} B/s"
    );
}

#[test]
fn outage_drops_everything_then_recovers() {
    let link = create(opts());
    let echo = UdpEcho::start(&link, 7007, true);
    let sock = edge_socket(&link);
    sock.set_read_timeout(Some(ms(10))).expect("timeout");
    // Send every 10 ms for `dur`; count echoes received.
    let pump = |dur: Duration| -> usize {
        let t0 = Instant::now();
        let mut got = 0;
        let mut buf = [0u8; 64];
        while t0.elapsed() < dur {
            sock.send_to(b"ping", echo.addr).expect("send");
            while let Ok((n, _)) = sock.recv_from(&mut buf) {
                if n == 4 {
                    got += 1;
                }
            }
        }
        got
    };
    let before = pump(ms(300));
    link.outage(true).expect("outage on");
    let during = pump(ms(600));
    let s = link.stats().expect("stats");
    link.outage(false).expect("outage off");
    let after = pump(ms(300));
    println!("echoes: before {before}, during outage {during}, after {after}");
    assert!(before >= 10, "before outage: {before}");
    assert_eq!(during, 0, "nothing crosses during the outage");
    assert!(s.up.dropped_outage >= 20, "{s:?}");
    assert!(after >= 10, "after outage: {after}");
    let cfg = link.stats().expect("stats").up_config;
    assert!(!cfg.outage);
}

#[test]
fn edge_address_change_keeps_unbound_udp_working() {
    let link = create(opts().with_impairment(Impairment::clean().with_delay(ms(2))));
    let echo = UdpEcho::start(&link, 7008, true);
    let sock = edge_socket(&link);
    let old = link.edge_ip();
    assert!(round_trip(&sock, echo.addr, b"before").is_some());
    assert_eq!(echo.last_source().map(|a| a.ip()), Some(old.into()));
    let new = link.change_edge_address().expect("change address");
    assert_ne!(new, old);
    assert_eq!(link.edge_ip(), new);
    let rtt = round_trip(&sock, echo.addr, b"after").expect("echo from the new address");
    let seen = echo.last_source().expect("source");
    println!("edge address {old} → {new}; server saw {seen}, echo RTT {rtt:?}");
    assert_eq!(
        seen.ip(),
        std::net::IpAddr::from(new),
        "server sees the new source"
    );
    let s = link.stats().expect("stats");
    assert_eq!(s.edge_ip, Some(new));
    assert_eq!(s.address_changes, 1);
    // And again, to the address of our choosing.
    let chosen = Ipv4Addr::new(10, 231, 2, 77);
    assert_eq!(
        link.change_edge_address_to(Some(chosen)).expect("change"),
        chosen
    );
    assert!(round_trip(&sock, echo.addr, b"again").is_some());
    assert_eq!(
        echo.last_source().map(|a| a.ip()),
        Some(std::net::IpAddr::from(chosen))
    );
    assert!(link
        .change_edge_address_to(Some(Ipv4Addr::new(192, 168, 1, 1)))
        .is_err());
}

#[test]
fn edge_link_down_is_seen_by_the_edge_and_up_restores_it() {
    let link = create(opts());
    let echo = UdpEcho::start(&link, 7010, true);
    let sock = edge_socket(&link);
    assert!(round_trip(&sock, echo.addr, b"up").is_some());
    link.edge_link(false).expect("link down");
    let err = sock
        .send_to(b"down", echo.addr)
        .expect_err("no route while the edge's interface is down");
    assert_eq!(err.raw_os_error(), Some(libc::ENETUNREACH), "{err}");
    assert!(!link.stats().expect("stats").edge_link_up);
    link.edge_link(true).expect("link up");
    assert!(
        round_trip(&sock, echo.addr, b"up again").is_some(),
        "default route restored"
    );
}

#[test]
fn nat_rebinding_changes_source_port() {
    require_tool("nft", "nftables");
    let link = create(opts().with_nat(true));
    let echo = UdpEcho::start(&link, 7009, true);
    let sock = edge_socket(&link);
    let local = sock.local_addr().expect("local").port();
    assert!(round_trip(&sock, echo.addr, b"one").is_some());
    let p1 = echo.last_source().expect("source").port();
    let (lo, hi) = link.rebind_nat().expect("rebind");
    assert!(
        round_trip(&sock, echo.addr, b"two").is_some(),
        "reply reaches the rebound flow"
    );
    let p2 = echo.last_source().expect("source").port();
    println!("edge socket port {local}; cloud saw {p1}, then {p2} after rebinding to {lo}-{hi}");
    assert_ne!(p1, p2, "new mapping after rebinding");
    assert!((lo..=hi).contains(&p2));
    assert_eq!(link.stats().expect("stats").nat_rebinds, 2);
}

#[test]
fn drop_removes_namespaces_and_processes() {
    let link = create(opts());
    let (cloud, edge, tag) = (
        link.cloud_ns().to_string(),
        link.edge_ns().to_string(),
        link.tag().to_string(),
    );
    let listed = String::from_utf8(
        Command::new("ip")
            .args(["netns", "list"])
            .output()
            .expect("ip netns list")
            .stdout,
    )
    .expect("utf8");
    assert!(
        listed.contains(&cloud) && listed.contains(&edge),
        "{listed}"
    );
    let mut sleeper = link
        .exec_in_edge("sleep")
        .arg("30")
        .spawn()
        .expect("spawn in edge ns");
    // Wait until it is inside the namespace (ip netns exec has exec'd).
    let deadline = Instant::now() + Duration::from_secs(5);
    while netns::pids_in(&edge).is_empty() {
        assert!(Instant::now() < deadline, "sleep never entered {edge}");
        std::thread::sleep(ms(10));
    }
    drop(link);
    let listed = String::from_utf8(
        Command::new("ip")
            .args(["netns", "list"])
            .output()
            .expect("ip netns list")
            .stdout,
    )
    .expect("utf8");
    assert!(
        !listed.contains(&cloud) && !listed.contains(&edge),
        "namespaces left after drop: {listed}"
    );
    assert!(!naming::state_dir(&tag).exists(), "state dir left");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(status) = sleeper.try_wait().expect("try_wait") {
            assert!(!status.success(), "sleep was killed, not finished");
            break;
        }
        assert!(Instant::now() < deadline, "process in the edge ns survived");
        std::thread::sleep(ms(10));
    }
}

#[test]
fn router_cleans_up_when_its_parent_dies() {
    let tag = format!("lp{}", std::process::id() % 10_000);
    let mut shell = Command::new("sh")
        .arg("-c")
        .arg(r#""$0" route --tag "$1" --parent-pid $$ --ttl 60s & wait"#)
        .arg(BIN)
        .arg(&tag)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn shell");
    let line = linkemu::link::read_line_bounded(
        shell.stdout.as_mut().expect("stdout"),
        Duration::from_secs(15),
    )
    .expect("ready line");
    assert!(line.starts_with("ready "), "router said {line:?}");
    assert!(netns::exists(&naming::edge_ns(&tag)));
    shell.kill().expect("kill the parent");
    let _ = shell.wait();
    let t0 = Instant::now();
    while netns::exists(&naming::edge_ns(&tag))
        || netns::exists(&naming::cloud_ns(&tag))
        || naming::state_dir(&tag).exists()
    {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "router did not clean up after its parent died"
        );
        std::thread::sleep(ms(20));
    }
    println!(
        "router cleaned up {:?} after its parent was killed",
        t0.elapsed()
    );
}

fn cli(args: &[&str]) -> (bool, String) {
    let out = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run linkemu");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn cli_up_set_exec_stats_down_and_cleanup() {
    let tag = format!("lc{}", std::process::id() % 10_000);
    let (ok, out) = cli(&["up", "--tag", &tag, "--delay", "10ms", "--ttl", "120s"]);
    assert!(ok, "up: {out}");
    let (ok, out) = cli(&["set", "--tag", &tag, "--dir", "up", "--delay", "15ms"]);
    assert!(ok, "set: {out}");
    assert!(out.contains("up:   delay=15ms"), "{out}");
    let (ok, out) = cli(&[
        "exec",
        "--tag",
        &tag,
        "edge",
        "--",
        "ip",
        "route",
        "get",
        "10.231.1.1",
    ]);
    assert!(
        ok && out.contains("dev tl0 src 10.231.2.2"),
        "exec runs in the edge namespace: {out}"
    );
    let sock = netns::run_in(&naming::edge_ns(&tag), || {
        UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
    })
    .expect("enter edge ns")
    .expect("bind");
    for _ in 0..3 {
        sock.send_to(b"x", (naming::CLOUD_IP, 9)).expect("send");
    }
    std::thread::sleep(ms(50));
    let (ok, out) = cli(&["stats", "--tag", &tag]);
    assert!(ok, "stats: {out}");
    let stats: Stats = serde_json::from_str(&out).expect("stats JSON");
    assert_eq!(stats.up_config.delay, ms(15));
    assert_eq!(stats.down_config.delay, ms(10));
    assert!(stats.up.tx_packets >= 3, "{stats:?}");
    let (ok, out) = cli(&["change-address", "--tag", &tag]);
    assert!(ok && out.trim() == "10.231.2.3", "change-address: {out}");
    let (ok, out) = cli(&["down", "--tag", &tag]);
    assert!(ok, "down: {out}");
    assert!(!netns::exists(&naming::edge_ns(&tag)));
    assert!(!naming::state_dir(&tag).exists());

    // A router killed with SIGKILL leaves its link behind; cleanup removes it.
    let tag2 = format!("lk{}", std::process::id() % 10_000);
    let (ok, out) = cli(&["up", "--tag", &tag2]);
    assert!(ok, "up: {out}");
    let pid = linkemu::link::router_pid_of(&tag2).expect("router pid");
    // SAFETY: kill(2) on the router we just started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let t0 = Instant::now();
    while linkemu::cleanup::router_alive(pid) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "router survived SIGKILL"
        );
        std::thread::sleep(ms(10));
    }
    assert!(netns::exists(&naming::edge_ns(&tag2)), "leftover expected");
    let (ok, out) = cli(&["cleanup"]);
    assert!(ok, "cleanup: {out}");
    assert!(out.contains(&format!("removed {tag2}")), "{out}");
    assert!(!netns::exists(&naming::edge_ns(&tag2)));
    assert!(!netns::exists(&naming::cloud_ns(&tag2)));
    assert!(!naming::state_dir(&tag2).exists());
}
