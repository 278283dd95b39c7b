//! Writes the seed inputs of every target to `corpus/<target>/seed-<n>`
//! (run from `fuzz/`: `cargo run --bin seed`).
fn main() -> std::io::Result<()> {
    let mut n = std::collections::HashMap::new();
    for (target, data) in tether_fuzz::seeds() {
        let dir = std::path::Path::new("corpus").join(target);
        std::fs::create_dir_all(&dir)?;
        let i = n.entry(target).or_insert(0);
        std::fs::write(dir.join(format!("seed-{i}")), data)?;
        *i += 1;
    }
    Ok(())
}
