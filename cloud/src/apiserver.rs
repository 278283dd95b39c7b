//! The cloud's client of the kube-apiserver (`kube` + `k8s-openapi`, rustls with
//! ring): built once from `--apiserver-kubeconfig`, or in-cluster from the
//! pod's service account when none is given.

use anyhow::Context;
use kube::config::{KubeConfigOptions, Kubeconfig};

/// A client for the apiserver the cloud's configuration names.
pub async fn client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("reading --apiserver-kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("loading --apiserver-kubeconfig {}", path.display()))?
        }
        None => kube::Config::incluster()
            .context("no --apiserver-kubeconfig and not running in a pod (in-cluster config)")?,
    };
    kube::Client::try_from(config).context("building the apiserver client")
}
