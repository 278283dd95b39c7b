//! AFL++ target: see `tether_fuzz::config`.
fn main() {
    afl::fuzz!(|data: &[u8]| tether_fuzz::config(data));
}
