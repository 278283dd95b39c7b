//! Locating the workspace binaries the harness runs.
//!
//! Cargo puts integration-test executables in `target/<profile>/deps/` and binaries in
//! `target/<profile>/`, so the binaries are found next to the running executable: its
//! directory, or that directory's parent when it is `deps`. `TETHER_BIN_DIR` overrides
//! the directory (handy when fixtures and Tether were built into different target
//! directories). A missing binary is an error that says how to build it; the suite never
//! skips because of one.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The cloud binary.
pub const CLOUD: &str = "tether-cloud";
/// The edge binary.
pub const EDGE: &str = "tether-edge";
/// The kubelet simulator.
pub const KUBELET_SIM: &str = "kubelet-sim";
/// The CRI-backed kubelet stand-in (containerd).
pub const CRI_KUBELET: &str = "cri-kubelet";
/// The apiserver stand-in.
pub const APISERVER_SIM: &str = "apiserver-sim";

/// What to do when a binary is missing.
pub const BUILD_HINT: &str = "run `cargo build --workspace --bins` first";

/// The directory the binaries are expected in.
pub fn bin_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("TETHER_BIN_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let exe = std::env::current_exe().context("locating the running executable")?;
    let mut dir = exe
        .parent()
        .with_context(|| format!("{} has no parent directory", exe.display()))?
        .to_path_buf();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    Ok(dir)
}

/// The path of binary `name`, which must exist.
pub fn binary(name: &str) -> Result<PathBuf> {
    let dir = bin_dir()?;
    let path = dir.join(name);
    check(&path, name)?;
    Ok(path)
}

fn check(path: &Path, name: &str) -> Result<()> {
    if !path.is_file() {
        bail!(
            "binary `{name}` not found at {}: {BUILD_HINT} (the harness runs the workspace's \
             binaries from the target directory next to the running executable; \
             TETHER_BIN_DIR overrides that directory)",
            path.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_binary_says_how_to_build() {
        let err = check(Path::new("/nonexistent/tether-cloud"), "tether-cloud")
            .expect_err("must fail")
            .to_string();
        assert!(err.contains("cargo build --workspace --bins"), "{err}");
        assert!(err.contains("/nonexistent/tether-cloud"), "{err}");
    }
}
