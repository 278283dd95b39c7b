//! Who may use the kubelet-API front: the client-certificate identities
//! (`--apiserver-allowed-identity`) accepted without further checks.
//!
//! On kubeadm the apiserver client CA also signs every user's and node's
//! certificate, so a certificate from that CA proves only membership of the
//! cluster, not that the caller is the apiserver. A real kubelet authorises
//! each request (`--authorization-mode=Webhook`); Tether accepts only the
//! configured identities — by default kubeadm's `kube-apiserver-kubelet-client`
//! — and answers every other certificate with 403.

use std::fmt;

use x509_parser::prelude::{FromDer, X509Certificate};

/// One accepted identity: a certificate's common name (the Kubernetes user)
/// or one of its organisations (a Kubernetes group).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllowedIdentity {
    /// `CN=<user>`.
    User(String),
    /// `O=<group>`.
    Group(String),
}

impl AllowedIdentity {
    /// Parses `CN=<user>` or `O=<group>` (the prefix is case-insensitive).
    pub fn parse(s: &str) -> Result<AllowedIdentity, String> {
        let s = s.trim();
        let (kind, value) = s.split_once('=').ok_or_else(|| {
            format!("--apiserver-allowed-identity {s:?}: expected CN=<user> or O=<group>")
        })?;
        let value = value.trim();
        if value.is_empty() {
            return Err(format!(
                "--apiserver-allowed-identity {s:?}: the name after {kind}= is empty"
            ));
        }
        match kind.trim().to_ascii_uppercase().as_str() {
            "CN" => Ok(AllowedIdentity::User(value.to_string())),
            "O" => Ok(AllowedIdentity::Group(value.to_string())),
            _ => Err(format!(
                "--apiserver-allowed-identity {s:?}: expected CN=<user> or O=<group>, not {kind}="
            )),
        }
    }

    fn matches(&self, who: &ClientIdentity) -> bool {
        match self {
            AllowedIdentity::User(u) => who.user.as_deref() == Some(u.as_str()),
            AllowedIdentity::Group(g) => who.groups.iter().any(|x| x == g),
        }
    }
}

impl fmt::Display for AllowedIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllowedIdentity::User(u) => write!(f, "CN={u}"),
            AllowedIdentity::Group(g) => write!(f, "O={g}"),
        }
    }
}

/// The user and groups a verified client certificate names (CN and O, the
/// Kubernetes convention).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientIdentity {
    pub user: Option<String>,
    pub groups: Vec<String>,
}

impl ClientIdentity {
    /// Reads CN and O from a DER certificate; `None` if it does not parse
    /// (rustls has verified it, so that does not happen in practice).
    pub fn from_der(der: &[u8]) -> Option<ClientIdentity> {
        let (_, cert) = X509Certificate::from_der(der).ok()?;
        let subject = cert.subject();
        let user = subject
            .iter_common_name()
            .next()
            .and_then(|c| c.as_str().ok())
            .map(str::to_string);
        let groups = subject
            .iter_organization()
            .filter_map(|o| o.as_str().ok())
            .map(str::to_string)
            .collect();
        Some(ClientIdentity { user, groups })
    }
}

impl fmt::Display for ClientIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CN={:?}", self.user.as_deref().unwrap_or(""))?;
        for g in &self.groups {
            write!(f, " O={g:?}")?;
        }
        Ok(())
    }
}

/// Whether `who` is one of `allowed`.
pub fn is_allowed(allowed: &[AllowedIdentity], who: &ClientIdentity) -> bool {
    allowed.iter().any(|a| a.matches(who))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(cn: &str, orgs: &[&str]) -> Vec<u8> {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, cn.to_string());
        for o in orgs {
            p.distinguished_name
                .push(rcgen::DnType::OrganizationName, o.to_string());
        }
        let key = rcgen::KeyPair::generate().unwrap();
        p.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn parses_user_and_group_and_refuses_the_rest() {
        assert_eq!(
            AllowedIdentity::parse("CN=kube-apiserver-kubelet-client").unwrap(),
            AllowedIdentity::User("kube-apiserver-kubelet-client".into())
        );
        assert_eq!(
            AllowedIdentity::parse(" o = system:masters ").unwrap(),
            AllowedIdentity::Group("system:masters".into())
        );
        for bad in ["kube-apiserver", "OU=x", "CN=", "=x"] {
            assert!(AllowedIdentity::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_configured_identities_are_allowed() {
        let allowed = vec![
            AllowedIdentity::parse("CN=kube-apiserver-kubelet-client").unwrap(),
            AllowedIdentity::parse("O=tether:apiservers").unwrap(),
        ];
        let apiserver =
            ClientIdentity::from_der(&cert("kube-apiserver-kubelet-client", &["system:masters"]))
                .unwrap();
        assert!(is_allowed(&allowed, &apiserver));
        // kubeadm's admin.conf user, a node and a plain user: same CA, refused.
        for (cn, orgs) in [
            ("kubernetes-admin", &["kubeadm:cluster-admins"][..]),
            ("system:node:edge-1", &["system:nodes"][..]),
            ("alice", &[][..]),
        ] {
            let who = ClientIdentity::from_der(&cert(cn, orgs)).unwrap();
            assert!(!is_allowed(&allowed, &who), "{who}");
        }
        let by_group =
            ClientIdentity::from_der(&cert("proxy", &["x", "tether:apiservers"])).unwrap();
        assert!(is_allowed(&allowed, &by_group));
        assert!(!is_allowed(&[], &apiserver));
    }
}
