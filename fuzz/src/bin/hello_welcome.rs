//! AFL++ target: see `tether_fuzz::hello_welcome`.
fn main() {
    afl::fuzz!(|data: &[u8]| tether_fuzz::hello_welcome(data));
}
