//! AFL++ target: see `tether_fuzz::csr`.
fn main() {
    afl::fuzz!(|data: &[u8]| tether_fuzz::csr(data));
}
