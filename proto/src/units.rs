//! Parsing the units configuration values are written in: durations
//! (`250ms`, `10s`, `5m`, `1h`) and byte sizes (`64KiB`, `1MiB`, `4096`).
//! The parsers live in `tether-units`, which `tether-certs` (not depending
//! on this crate) uses too: a value both binaries read, such as
//! `TETHER_JOIN_STORE_LOCK_WAIT`, is parsed alike by both.

pub use tether_units::{parse_bytes, parse_bytes_u32, parse_duration};
