//! AFL++ target: see `tether_fuzz::head_decode`.
fn main() {
    afl::fuzz!(|data: &[u8]| tether_fuzz::head_decode(data));
}
