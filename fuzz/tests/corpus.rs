//! Replays every corpus and crash-regression input through its target
//! (`corpus/<target>/*`, `regressions/<target>/*`): a plain `cargo test`
//! that fails if any of them panics again.

use std::path::Path;

#[test]
fn every_saved_input_passes_its_target() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut ran = 0;
    for (name, target) in tether_fuzz::TARGETS {
        for dir in ["corpus", "regressions"] {
            let Ok(entries) = std::fs::read_dir(root.join(dir).join(name)) else {
                continue;
            };
            for e in entries {
                let path = e.unwrap().path();
                let data = std::fs::read(&path).unwrap();
                if std::panic::catch_unwind(|| target(&data)).is_err() {
                    panic!("{} panics in target {name}", path.display());
                }
                ran += 1;
            }
        }
        assert!(
            root.join("corpus").join(name).is_dir(),
            "target {name} has no corpus"
        );
    }
    println!("{ran} inputs replayed");
    assert!(ran >= tether_fuzz::TARGETS.len());
}

#[test]
fn seeds_pass_their_targets() {
    for (name, data) in tether_fuzz::seeds() {
        let target = tether_fuzz::TARGETS
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap()
            .1;
        target(&data);
    }
}
