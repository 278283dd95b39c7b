//! linkemu: an emulated network link between a "cloud" and an "edge" network
//! namespace, for Tether's fault tests and benchmarks (this kernel has no
//! `netem`, so delay and jitter are done in userspace).
//!
//! ```text
//!  <tag>-cloud netns                                   <tag>-edge netns
//!  10.231.1.1/32 on tl0 (TUN)                          10.231.2.2/32 on tl0 (TUN)
//!  default dev tl0          ┌───── router process ─────┐  default dev tl0
//!        tl0 fd  ◄──────────┤ down shaper ◄────────────┤◄──  tl0 fd
//!                ──────────►│ up shaper   ────────────►├──►
//!                           └── control socket ────────┘
//! ```
//!
//! Each namespace has a single TUN device holding its address and default
//! route; the router holds both TUN files and moves every IP packet from one
//! to the other through a [`shaper::Shaper`] per direction (delay, jitter,
//! loss, rate limit with a bounded queue, outage). No bridge, no veth, no
//! forwarding in any kernel: the host's interfaces, routes and firewall are
//! never touched, and packets can only ever go between the two namespaces.
//!
//! Module map:
//! - [`link`]: the library API ([`Link::create`], [`Link::set`], …);
//! - [`router`]: the router process (setup, I/O loop, control, teardown);
//! - [`shaper`]: one direction's impairments as a pure state machine;
//! - [`impairment`]: the impairment types and their parsers;
//! - [`control`]: the control socket protocol and its client;
//! - [`naming`]: tags, namespace names, state paths, addresses;
//! - [`netns`]: namespace plumbing and the `ip` runner;
//! - [`tun`]: opening TUN devices;
//! - [`cleanup`]: listing links and removing leftovers;
//! - [`conntrack`]: flushing a namespace's conntrack table (NAT rebinding).

pub mod cleanup;
pub mod conntrack;
pub mod control;
pub mod impairment;
pub mod link;
pub mod naming;
pub mod netns;
pub mod router;
pub mod shaper;
pub mod tun;

pub use control::{Control, Info, Stats};
pub use impairment::{Direction, Impairment, ImpairmentPatch};
pub use link::{Link, LinkOptions};
pub use router::preflight;
pub use shaper::DirStats;
