//! AFL++ target: see `tether_fuzz::route`.
fn main() {
    afl::fuzz!(|data: &[u8]| tether_fuzz::route(data));
}
