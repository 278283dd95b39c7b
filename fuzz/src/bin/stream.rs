//! AFL++ target: see `tether_fuzz::stream`.
fn main() {
    afl::fuzz!(|data: &[u8]| tether_fuzz::stream(data));
}
