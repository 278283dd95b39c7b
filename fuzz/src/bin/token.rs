//! AFL++ target: see `tether_fuzz::token`.
fn main() {
    afl::fuzz!(|data: &[u8]| tether_fuzz::token(data));
}
