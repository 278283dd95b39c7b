//! Writing the kubeconfig kubectl uses to reach the simulator: server URL, the serving
//! CA as `certificate-authority-data`, and a dummy bearer-token user. Written atomically
//! (temp file + rename) so a watcher never reads half a file.

use std::path::Path;

use anyhow::{Context, Result};
use base64::Engine as _;

/// The kubeconfig YAML.
pub fn render(server_url: &str, ca_pem: &str, token: &str) -> String {
    let ca = base64::engine::general_purpose::STANDARD.encode(ca_pem.as_bytes());
    // Values are quoted JSON strings, which YAML accepts verbatim.
    let q = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    format!(
        "apiVersion: v1\n\
         kind: Config\n\
         clusters:\n\
         - name: apiserver-sim\n  \
           cluster:\n    \
             server: {server}\n    \
             certificate-authority-data: {ca}\n\
         users:\n\
         - name: apiserver-sim\n  \
           user:\n    \
             token: {token}\n\
         contexts:\n\
         - name: apiserver-sim\n  \
           context:\n    \
             cluster: apiserver-sim\n    \
             user: apiserver-sim\n    \
             namespace: default\n\
         current-context: apiserver-sim\n",
        server = q(server_url),
        ca = q(&ca),
        token = q(token),
    )
}

/// Writes the kubeconfig to `path` atomically.
pub fn write(path: &Path, server_url: &str, ca_pem: &str, token: &str) -> Result<()> {
    let text = render(server_url, ca_pem, token);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_fields() {
        let k = render("https://127.0.0.1:6443", "PEM", "tok");
        assert!(k.contains("    server: \"https://127.0.0.1:6443\"\n"));
        assert!(k.contains("    certificate-authority-data: \"UEVN\"\n"));
        assert!(k.contains("    token: \"tok\"\n"));
        assert!(k.contains("current-context: apiserver-sim\n"));
        assert!(k.contains("\n  cluster:\n"));
    }
}
