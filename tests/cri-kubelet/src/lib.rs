//! A kubelet stand-in backed by a real container runtime: containerd's CRI.
//!
//! Pods are CRI pod sandboxes with host networking, containers come from a locally
//! imported image. The kubelet API paths the edge uses are served like the kubelet does:
//! `/exec`, `/attach` and `/portForward` ask the CRI for a streaming URL and proxy the
//! upgraded connection to containerd's streaming server with its bytes untouched;
//! `/containerLogs` reads the CRI log files; `/pods` lists the CRI's sandboxes;
//! `/stats/summary`, `/metrics` and `/metrics/resource` come from the CRI's statistics.

pub mod config;
pub mod cri;
pub mod logs;
pub mod proxy;
pub mod server;
pub mod stats;
