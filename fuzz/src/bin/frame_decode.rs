//! AFL++ target: see `tether_fuzz::frame_decode`.
fn main() {
    afl::fuzz!(|data: &[u8]| tether_fuzz::frame_decode(data));
}
