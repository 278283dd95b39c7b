#!/usr/bin/env bash
# tether-dnat.sh — the control-plane DNAT rule that sends the kube-apiserver's
# connections to edge kubelets (node address : kubelet port, 10350 by the
# edge convention) to tether-cloud's kubelet-API listeners (TCP 10003),
# spread at random over the ready replicas.
#
#   tether-dnat.sh apply  --kubelet-port PORT[,PORT...] --to CLOUD:10003[,CLOUD:10003...]
#                         [--backend auto|nft|iptables] [--dst CIDR[,CIDR...]] [--prerouting]
#                         [--max-targets N]
#   tether-dnat.sh watch  (the options of apply) [--interval SECONDS] [--keep-on-exit]
#                         [--conntrack-flush-after SECONDS]
#   tether-dnat.sh status [--backend auto|nft|iptables]
#   tether-dnat.sh remove [--backend auto|nft|iptables]
#
# The rule lives in Tether's own objects and nowhere else:
#   nft:      table `inet tether`, chain `output` (type nat hook output), and
#             chain `prerouting` with --prerouting; several targets are N
#             rules, the i-th (from 0) taken when `numgen random mod (N-i)`
#             draws 0 and the last without, so each gets 1/N (no map: see
#             nft_rules);
#   iptables: chain TETHER-DNAT in the nat table, referenced once from OUTPUT
#             (and once from PREROUTING with --prerouting); ip6tables for an
#             IPv6 target. Several targets are N rules, the i-th (from 0)
#             taken with `-m statistic --mode random --probability 1/(N-i)`
#             and the last without, so each gets 1/N of the connections.
# `apply` converges: when the rules in place already match what is asked, it
# changes nothing (no rule is added twice, no handle changes: the ruleset is
# byte-identical); otherwise it replaces Tether's rules in one transaction
# (nft -f / iptables-restore --noflush), so a connection never meets a
# half-written rule set. The targets are sorted and de-duplicated first: the
# same set in another order (DNS answers rotate) is the same rule. It also
# removes Tether rules left in the other backend, so there is only ever one.
# `remove` deletes everything Tether added and nothing else; running it again
# is a no-op. `status` exits 0 when a Tether DNAT is in place, 3 when none is.
#
# --kubelet-port is 10350 for edge nodes; a list (10350,10351,10352) also
# catches the per-cloudcore ports of a KubeEdge HA setup while migrating.
#
# Each CLOUD may be an IPv4 address, [IPv6] or a DNS name; a name stands for
# every address it resolves to (IPv4 if it has any, else IPv6), resolved
# once per apply and again every --interval by `watch`. So with the headless
# Service tether-cloud-kubelet-api, which answers the READY replicas' pod IPs
# only, the rule follows the ready set: a replica that turns ready joins the
# spread, a draining one (SIGTERM, /readyz 503) stops getting new
# connections, while its established ones keep their conntrack entry and run
# on. All targets are of one address family. At most --max-targets (64)
# addresses.
#
# Stale conntrack entries (watch): when an address has been out of the
# target set for --conntrack-flush-after seconds (60; 0: never), `watch`
# deletes the conntrack entries of connections translated to it (`conntrack
# -D --reply-src ADDR --reply-port-src PORT`). The delay is longer than the
# cloud's terminationGracePeriodSeconds (50), so a draining replica's open
# apiserver streams run to their end first; after it the replica has been
# killed, and the next packet of a connection it held meets this rule again,
# lands on a live replica, and is answered with a reset: the apiserver sees
# the failure at once instead of retransmitting into a dead pod IP until TCP
# gives up (minutes). Without the `conntrack` tool (package conntrack) this
# step is skipped with a warning, and such connections fail only that slowly.
# A replica that stays alive but not ready for longer than the delay loses
# its open streams the same way.
#
# The target must be an address that needs no further NAT on this host: a pod
# IP, a host-network address or an external load-balancer address. A Service
# ClusterIP does NOT work with kube-proxy in iptables/nftables mode: the
# kernel applies one destination NAT per connection and hook, so after this
# rule kube-proxy's own rule for the ClusterIP is never consulted.
#
# Environment: TETHER_DNAT_BACKEND (default auto: nft when `nft` exists, else
# iptables); TETHER_DNAT_IPTABLES / TETHER_DNAT_IP6TABLES (default iptables /
# ip6tables; e.g. iptables-legacy on hosts whose kube-proxy uses legacy);
# TETHER_DNAT_CONNTRACK (default conntrack).
set -euo pipefail

readonly PROG=tether-dnat
readonly NFT_TABLE=tether
readonly NFT_FAMILY=inet
readonly NFT_PRIORITY=-110 # before dstnat (-100): deterministic order vs. other nat chains
readonly IPT_CHAIN=TETHER-DNAT
readonly JUMP_COMMENT=tether-dnat
readonly EXIT_NOT_APPLIED=3

IPT=${TETHER_DNAT_IPTABLES:-iptables}
IP6T=${TETHER_DNAT_IP6TABLES:-ip6tables}
CONNTRACK=${TETHER_DNAT_CONNTRACK:-conntrack}

log() { printf '%s %s: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$PROG" "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

usage() {
	sed -n '2,/^set -euo pipefail/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
}

have() { command -v "$1" >/dev/null 2>&1; }

# ---------------------------------------------------------------------------
# Options

cmd=""
backend=${TETHER_DNAT_BACKEND:-auto}
kubelet_port=""
to=""
kubelet_ports=()
dst=""
prerouting=0
interval=10
keep_on_exit=0
max_targets=64
flush_after=60

parse_args() {
	[ $# -gt 0 ] || {
		usage >&2
		exit 2
	}
	cmd=$1
	shift
	while [ $# -gt 0 ]; do
		case $1 in
		--kubelet-port) kubelet_port=${2:?--kubelet-port needs a value}; shift 2 ;;
		--kubelet-port=*) kubelet_port=${1#*=}; shift ;;
		--to) to=${2:?--to needs a value}; shift 2 ;;
		--to=*) to=${1#*=}; shift ;;
		--backend) backend=${2:?--backend needs a value}; shift 2 ;;
		--backend=*) backend=${1#*=}; shift ;;
		--dst) dst=${2:?--dst needs a value}; shift 2 ;;
		--dst=*) dst=${1#*=}; shift ;;
		--prerouting) prerouting=1; shift ;;
		--interval) interval=${2:?--interval needs a value}; shift 2 ;;
		--interval=*) interval=${1#*=}; shift ;;
		--keep-on-exit) keep_on_exit=1; shift ;;
		--max-targets) max_targets=${2:?--max-targets needs a value}; shift 2 ;;
		--max-targets=*) max_targets=${1#*=}; shift ;;
		--conntrack-flush-after) flush_after=${2:?--conntrack-flush-after needs a value}; shift 2 ;;
		--conntrack-flush-after=*) flush_after=${1#*=}; shift ;;
		-h | --help) usage; exit 0 ;;
		*) die "unknown option $1 (see --help)" ;;
		esac
	done
	case $backend in auto | nft | iptables) ;; *) die "--backend must be auto, nft or iptables, not '$backend'" ;; esac
	if ! [[ $max_targets =~ ^[0-9]+$ ]] || [ "$max_targets" -lt 1 ] || [ "$max_targets" -gt 1024 ]; then
		die "--max-targets must be a whole number from 1 to 1024, not '$max_targets'"
	fi
	[[ $flush_after =~ ^[0-9]+$ ]] || die "--conntrack-flush-after must be a whole number of seconds (0: never), not '$flush_after'"
}

is_port() { [[ $1 =~ ^[0-9]{1,5}$ ]] && [ "$1" -ge 1 ] && [ "$1" -le 65535 ]; }

# --kubelet-port: one port or a comma-separated list of distinct ports.
check_kubelet_ports() {
	local p seen=","
	[ -n "$kubelet_port" ] || die "$cmd needs --kubelet-port (10350 for edge nodes)"
	IFS=, read -r -a kubelet_ports <<<"$kubelet_port"
	[ "${#kubelet_ports[@]}" -ge 1 ] || die "--kubelet-port is empty"
	for p in "${kubelet_ports[@]}"; do
		is_port "$p" || die "--kubelet-port: '$p' is not a port"
		case $seen in *",$p,"*) die "--kubelet-port: $p is listed twice" ;; esac
		seen="$seen$p,"
	done
}
is_ipv4() { [[ $1 =~ ^([0-9]{1,3}\.){3}[0-9]{1,3}$ ]]; }
is_ipv6() { [[ $1 =~ ^[0-9A-Fa-f:.]+$ ]] && [[ $1 == *:* ]]; }

# The resolved targets: "ADDR PORT" lines, sorted and unique, one family.
targets=()
resolved_family=""

# Splits one HOST:PORT of --to; prints "HOST PORT".
split_target() {
	local t=$1 host port
	case $t in
	\[*\]:*)
		host=${t%%]:*}
		host=${host#[}
		port=${t##*]:}
		;;
	*:*:*) die "--to $t: write an IPv6 address as [ADDR]:PORT" ;;
	*:*)
		host=${t%:*}
		port=${t##*:}
		;;
	*) die "--to $t: expected HOST:PORT" ;;
	esac
	is_port "$port" || die "--to $t: '$port' is not a port"
	[ -n "$host" ] || die "--to $t: empty host"
	printf '%s %s\n' "$host" "$port"
}

# Resolves every HOST:PORT of --to (a name to all its addresses) into
# `targets`. Returns 1 (after logging) when a name does not resolve, 2 when
# there are more addresses than --max-targets.
resolve_to() {
	local t host port addrs a fam lines=() families=""
	local -a items
	IFS=, read -r -a items <<<"$to"
	[ "${#items[@]}" -ge 1 ] || die "--to is empty"
	for t in "${items[@]}"; do
		read -r host port < <(split_target "$t") || die "--to $t: expected HOST:PORT"
		if is_ipv4 "$host"; then
			fam=4
			addrs=$host
		elif is_ipv6 "$host"; then
			fam=6
			addrs=$host
		else
			addrs=$(getent ahostsv4 "$host" 2>/dev/null | awk '{print $1}' | LC_ALL=C sort -u || true)
			fam=4
			if [ -z "$addrs" ]; then
				addrs=$(getent ahostsv6 "$host" 2>/dev/null | awk '{print $1}' | grep -v '^::ffff:' | LC_ALL=C sort -u || true)
				fam=6
			fi
			[ -n "$addrs" ] || {
				log "cannot resolve $host"
				return 1
			}
		fi
		case $families in *"$fam"*) ;; *) families="$families$fam" ;; esac
		while IFS= read -r a; do
			[ -n "$a" ] && lines+=("$a $port")
		done <<<"$addrs"
	done
	[ "${#families}" = 1 ] || die "--to $to: mixes IPv4 and IPv6 targets; one rule serves one family"
	resolved_family=$families
	mapfile -t targets < <(printf '%s\n' "${lines[@]}" | LC_ALL=C sort -u)
	if [ "${#targets[@]}" -gt "$max_targets" ]; then
		log "--to $to gives ${#targets[@]} addresses, more than --max-targets $max_targets"
		return 2
	fi
}

# A target as nft/iptables write a DNAT destination: ADDR:PORT or [ADDR]:PORT.
target_dest() {
	local addr=${1% *} port=${1#* }
	if [ "$resolved_family" = 6 ]; then printf '[%s]:%s' "$addr" "$port"; else printf '%s:%s' "$addr" "$port"; fi
}

targets_text() {
	local t out=""
	for t in "${targets[@]}"; do out="$out${out:+,}$(target_dest "$t")"; done
	printf '%s' "$out"
}

check_dst() {
	local c
	[ -n "$dst" ] || return 0
	IFS=, read -r -a cidrs <<<"$dst"
	for c in "${cidrs[@]}"; do
		if [ "$resolved_family" = 4 ]; then
			[[ $c =~ ^([0-9]{1,3}\.){3}[0-9]{1,3}(/[0-9]{1,2})?$ ]] || die "--dst $c is not an IPv4 address or CIDR (the target is IPv4)"
		else
			[[ $c =~ ^[0-9A-Fa-f:.]+(/[0-9]{1,3})?$ && $c == *:* ]] || die "--dst $c is not an IPv6 address or CIDR (the target is IPv6)"
		fi
	done
}

# A short, stable fingerprint of what is asked; stored in the rule comments
# so that `apply` can tell "already in place" from "different".
spec_id() {
	printf 'v2 port=%s to=%s family=%s dst=%s prerouting=%s' \
		"$kubelet_port" "$(targets_text)" "$resolved_family" "${dst:-any}" "$prerouting" |
		sha256sum | cut -c1-16
}

pick_backend() {
	case $backend in
	nft) have nft || die "nft not found (install nftables)" ;;
	iptables) have "$IPT" || die "$IPT not found (install iptables)" ;;
	auto)
		if have nft; then
			backend=nft
		elif have "$IPT"; then
			backend=iptables
		else
			die "neither nft nor $IPT found (install nftables or iptables)"
		fi
		;;
	esac
}

# ---------------------------------------------------------------------------
# nft backend

nft_present() { nft list table "$NFT_FAMILY" "$NFT_TABLE" >/dev/null 2>&1; }

# The DNAT rules of one chain, one per line: for each --dst CIDR and each
# kubelet port, one rule per target, the i-th (from 0) taken when `numgen
# random mod (N-i)` draws 0 of what the rules before it left and the last
# without: 1/N each, as the iptables backend does. A connection only draws in
# the rules whose address and port it matches. No set and no map in a rule
# (no `dnat to numgen ... map { ... }`, no `tcp dport { ... }`): a rule's
# anonymous set is replaced with the rule, and its elements are looked up
# under the ruleset generation of that moment, so a new connection that
# walked the chain under the old rules just as the new ones were committed
# found the old set already emptied and left untranslated, to the node
# itself (a few times in 1,000 changes under load, on kernel 6.18).
nft_rules() {
	local comment=$1 proto=ip i n=${#targets[@]} pick c p match
	[ "$resolved_family" = 6 ] && proto=ip6
	local cidrs=("")
	[ -n "$dst" ] && IFS=, read -r -a cidrs <<<"$dst"
	for c in "${cidrs[@]}"; do
		match="meta nfproto ipv$resolved_family"
		[ -n "$c" ] && match="$proto daddr $c"
		for p in "${kubelet_ports[@]}"; do
			for i in "${!targets[@]}"; do
				pick=""
				[ "$i" -lt $((n - 1)) ] && pick="numgen random mod $((n - i)) 0 "
				printf '%s tcp dport %s %scounter dnat %s to %s comment "%s"\n' \
					"$match" "$p" "$pick" "$proto" "$(target_dest "${targets[$i]}")" "$comment"
			done
		done
	done
}

# The base chains Tether's table has, one per line: output, and prerouting
# with --prerouting (in this order, which is also the order nft lists them).
nft_hooks() {
	echo output
	if [ "$prerouting" = 1 ]; then echo prerouting; fi
}

# The chain headers in a `nft list table` listing (stdin): each chain's name
# line and its type line, the priority as a number.
nft_headers() {
	sed -n 's/^[[:space:]]*//; /^chain /p; /^type /{s/priority dstnat - 10;/priority -110;/; p}'
}

# The chain headers Tether's table should have, in the form of nft_headers.
nft_want_headers() {
	local hook
	for hook in $(nft_hooks); do
		printf 'chain %s {\ntype nat hook %s priority %s; policy accept;\n' "$hook" "$hook" "$NFT_PRIORITY"
	done
}

nft_apply() {
	local id=$1 want have have_ids script hook rules
	rules=$(nft_rules "tether-dnat spec=$id")
	want=$(($(printf '%s\n' "$rules" | grep -c .) * $(nft_hooks | grep -c .)))
	if have=$(nft list table "$NFT_FAMILY" "$NFT_TABLE" 2>/dev/null) &&
		[ "$(printf '%s\n' "$have" | nft_headers)" = "$(nft_want_headers)" ]; then
		have_ids=$(printf '%s\n' "$have" | grep -o 'comment "tether-dnat spec=[0-9a-f]*"' || true)
		if [ "$(printf '%s\n' "$have_ids" | grep -c "spec=$id\"")" = "$want" ] &&
			[ "$(printf '%s\n' "$have_ids" | grep -c 'spec=')" = "$want" ]; then
			return 1 # unchanged
		fi
		# The chains are the ones wanted: swap the rules inside each, in one
		# transaction. A packet walks one chain under one ruleset generation,
		# so it meets the old rules or the new ones. Replacing the table
		# instead would not do: a new connection could walk the new chain
		# before the commit (no rule yet) and the old one after it (its rules
		# gone), and leave untranslated, to the node itself.
		script=""
		for hook in $(nft_hooks); do
			script="${script}flush chain $NFT_FAMILY $NFT_TABLE $hook
$(printf '%s\n' "$rules" | sed "s/^/add rule $NFT_FAMILY $NFT_TABLE $hook /")
"
		done
		printf '%s' "$script" | nft -f - || die "nft refused the ruleset:
$script"
		return 0
	fi
	# No table yet, or other chains than wanted (--prerouting changed): one
	# transaction builds the table afresh.
	script="add table $NFT_FAMILY $NFT_TABLE
delete table $NFT_FAMILY $NFT_TABLE
table $NFT_FAMILY $NFT_TABLE {"
	for hook in $(nft_hooks); do
		script="$script
	chain $hook {
		type nat hook $hook priority $NFT_PRIORITY; policy accept;
$(printf '%s\n' "$rules" | sed 's/^/\t\t/')
	}"
	done
	script="$script
}"
	printf '%s\n' "$script" | nft -f - || die "nft refused the ruleset:
$script"
	return 0
}

nft_remove() {
	have nft || return 0
	if nft_present; then
		nft delete table "$NFT_FAMILY" "$NFT_TABLE"
		log "removed nft table $NFT_FAMILY $NFT_TABLE"
	fi
}

nft_status() {
	if ! have nft; then
		echo "nft: not installed"
		return 1
	fi
	if nft_present; then
		echo "nft: applied (table $NFT_FAMILY $NFT_TABLE)"
		nft list table "$NFT_FAMILY" "$NFT_TABLE" | sed 's/^/  /'
		return 0
	fi
	echo "nft: not applied"
	return 1
}

# ---------------------------------------------------------------------------
# iptables backend

ipt_cmd_for() { if [ "$1" = 6 ]; then echo "$IP6T"; else echo "$IPT"; fi; }

ipt_chain_present() { "$1" -w 5 -t nat -S "$IPT_CHAIN" >/dev/null 2>&1; }

ipt_jump_args() { printf '%s\n' -m comment --comment "$JUMP_COMMENT" -j "$IPT_CHAIN"; }

# Number of jumps from a built-in chain to TETHER-DNAT.
ipt_jumps() {
	"$1" -w 5 -t nat -S "$2" 2>/dev/null | grep -c -- "-j $IPT_CHAIN\$" || true
}

ipt_remove_jumps() {
	local ipt=$1 hook=$2 args
	mapfile -t args < <(ipt_jump_args)
	while "$ipt" -w 5 -t nat -C "$hook" "${args[@]}" >/dev/null 2>&1; do
		"$ipt" -w 5 -t nat -D "$hook" "${args[@]}"
	done
}

ipt_ensure_one_jump() {
	local ipt=$1 hook=$2 args n
	mapfile -t args < <(ipt_jump_args)
	n=$(ipt_jumps "$ipt" "$hook")
	if [ "$n" -gt 1 ]; then
		ipt_remove_jumps "$ipt" "$hook"
		n=0
	fi
	if [ "$n" -eq 0 ]; then
		"$ipt" -w 5 -t nat -I "$hook" 1 "${args[@]}"
		return 0
	fi
	return 1
}

ipt_apply() {
	local id=$1 ipt changed=1 rules n_rules n_ids c restore hooks=OUTPUT
	ipt=$(ipt_cmd_for "$resolved_family")
	have "$ipt" || die "$ipt not found"
	have "$ipt-restore" || die "$ipt-restore not found"
	[ "$prerouting" = 1 ] && hooks="OUTPUT PREROUTING"
	rules=$("$ipt" -w 5 -t nat -S "$IPT_CHAIN" 2>/dev/null | grep -- "^-A $IPT_CHAIN " || true)
	n_rules=$(printf '%s' "$rules" | grep -c . || true)
	n_ids=$(printf '%s' "$rules" | grep -c -- "tether-dnat spec=$id" || true)
	local cidrs=("") n=${#targets[@]}
	[ -n "$dst" ] && IFS=, read -r -a cidrs <<<"$dst"
	local want=$((${#cidrs[@]} * n))
	if ! ipt_chain_present "$ipt" || [ "$n_rules" != "$want" ] || [ "$n_ids" != "$want" ]; then
		restore="*nat
:$IPT_CHAIN - [0:0]"
		local match_port="-m tcp --dport $kubelet_port" i stat match_dst
		[ "${#kubelet_ports[@]}" -gt 1 ] && match_port="-m multiport --dports $kubelet_port"
		for c in "${cidrs[@]}"; do
			match_dst=""
			[ -n "$c" ] && match_dst="-d $c "
			for i in "${!targets[@]}"; do
				# Rule i takes 1/(N-i) of what the rules before it left: 1/N each.
				stat=""
				if [ "$i" -lt $((n - 1)) ]; then
					stat="-m statistic --mode random --probability $(awk -v d=$((n - i)) 'BEGIN { printf "%.10f", 1 / d }') "
				fi
				restore="$restore
-A $IPT_CHAIN ${match_dst}-p tcp $match_port -m comment --comment \"tether-dnat spec=$id\" ${stat}-j DNAT --to-destination $(target_dest "${targets[$i]}")"
			done
		done
		restore="$restore
COMMIT"
		# --noflush: only TETHER-DNAT (declared above, so flushed and refilled) changes.
		printf '%s\n' "$restore" | "$ipt-restore" -w 5 --noflush || die "$ipt-restore refused:
$restore"
		changed=0
	fi
	local hook
	for hook in $hooks; do
		if ipt_ensure_one_jump "$ipt" "$hook"; then changed=0; fi
	done
	if [ "$prerouting" != 1 ] && [ "$(ipt_jumps "$ipt" PREROUTING)" -gt 0 ]; then
		ipt_remove_jumps "$ipt" PREROUTING
		changed=0
	fi
	# A Tether chain left in the other family's table (target changed family).
	local other=$IP6T
	[ "$resolved_family" = 6 ] && other=$IPT
	ipt_remove_family "$other"
	return "$changed"
}

ipt_remove_family() {
	local ipt=$1 hook
	have "$ipt" || return 0
	ipt_chain_present "$ipt" || return 0
	for hook in OUTPUT PREROUTING; do
		ipt_remove_jumps "$ipt" "$hook"
	done
	"$ipt" -w 5 -t nat -F "$IPT_CHAIN"
	"$ipt" -w 5 -t nat -X "$IPT_CHAIN"
	log "removed $ipt chain nat/$IPT_CHAIN and its jumps"
}

ipt_remove() {
	ipt_remove_family "$IPT"
	ipt_remove_family "$IP6T"
}

ipt_status() {
	local ipt rc=1 any_tool=0
	for ipt in "$IPT" "$IP6T"; do
		have "$ipt" || continue
		any_tool=1
		if ipt_chain_present "$ipt"; then
			echo "$ipt: applied (nat chain $IPT_CHAIN; jumps: OUTPUT=$(ipt_jumps "$ipt" OUTPUT) PREROUTING=$(ipt_jumps "$ipt" PREROUTING))"
			"$ipt" -w 5 -t nat -L "$IPT_CHAIN" -n -v -x | sed 's/^/  /'
			rc=0
		else
			echo "$ipt: not applied"
		fi
	done
	[ "$any_tool" = 1 ] || echo "iptables: not installed"
	return "$rc"
}

# ---------------------------------------------------------------------------
# Stale conntrack entries (watch)

# When each address that left the target set left it: "ADDR PORT" -> epoch s.
declare -A left_at=()
warned_no_conntrack=0

# Deletes the conntrack entries of connections translated to "ADDR PORT".
conntrack_flush() {
	local addr=${1% *} port=${1#* } fam=ipv4 out rc=0
	[ "$resolved_family" = 6 ] && fam=ipv6
	if ! have "$CONNTRACK"; then
		if [ "$warned_no_conntrack" = 0 ]; then
			log "warning: no conntrack tool: connections to replicas that left keep their stale entries" \
				"(they fail only when TCP gives up); install the conntrack package"
			warned_no_conntrack=1
		fi
		return 0
	fi
	# Exit 1 with "0 flow entries" is "nothing to delete".
	out=$("$CONNTRACK" -D -f "$fam" -p tcp --reply-src "$addr" --reply-port-src "$port" 2>&1) || rc=$?
	case $out in
	*"flow entries have been deleted"* | *"flow entry has been deleted"*)
		log "conntrack: $(printf '%s' "$out" | grep -o '[0-9]* flow entr[a-z]* ha[a-z]* been deleted' | head -n1) for $(target_dest "$1"), out of the targets for ${flush_after}s"
		;;
	*) [ "$rc" = 0 ] || log "warning: conntrack -D for $(target_dest "$1") failed: $out" ;;
	esac
}

# After a convergence step: note the addresses that left (prev -> targets),
# forget those that came back, and flush those gone for --conntrack-flush-after.
track_left() {
	local now t
	now=$(date +%s)
	declare -A cur=()
	for t in "${targets[@]}"; do cur[$t]=1; done
	for t in "$@"; do
		if [ -z "${cur[$t]:-}" ] && [ -z "${left_at[$t]:-}" ]; then left_at[$t]=$now; fi
	done
	for t in "${!left_at[@]}"; do
		if [ -n "${cur[$t]:-}" ]; then
			unset "left_at[$t]"
		elif [ $((now - left_at[$t])) -ge "$flush_after" ]; then
			conntrack_flush "$t"
			unset "left_at[$t]"
		fi
	done
}

# ---------------------------------------------------------------------------
# Commands

require_root() {
	[ "$(id -u)" = 0 ] || die "must run as root (or with CAP_NET_ADMIN)"
}

# One convergence step. Returns 0 when rules were changed, 1 when unchanged,
# 2 when --to does not resolve, 3 when it gives more than --max-targets.
converge() {
	local id
	local r=0
	resolve_to || r=$?
	[ "$r" = 0 ] || return $((r + 1)) # 2: does not resolve, 3: too many
	check_dst
	id=$(spec_id)
	local rc=1
	case $backend in
	nft)
		if nft_apply "$id"; then rc=0; fi
		# One Tether rule at a time: drop leftovers of the iptables backend.
		if have "$IPT" || have "$IP6T"; then ipt_remove; fi
		;;
	iptables)
		if ipt_apply "$id"; then rc=0; fi
		nft_remove
		;;
	esac
	return "$rc"
}

describe() {
	local spread=""
	[ "${#targets[@]}" -gt 1 ] && spread="random over ${#targets[@]}: "
	printf 'tcp dport %s%s -> %s%s (%s%s)' "$kubelet_port" "${dst:+ to $dst}" "$spread" "$(targets_text)" "$backend" \
		"$([ "$prerouting" = 1 ] && echo ', output+prerouting' || echo ', output')"
}

cmd_apply() {
	require_root
	check_kubelet_ports
	[ -n "$to" ] || die "apply needs --to CLOUD_ADDR:10003"
	pick_backend
	local rc=0
	converge || rc=$?
	case $rc in
	0) log "applied: $(describe)" ;;
	1) log "unchanged: $(describe)" ;;
	3) die "--to $to: more addresses than --max-targets $max_targets; nothing changed" ;;
	*) die "could not resolve --to $to" ;;
	esac
}

cmd_watch() {
	require_root
	check_kubelet_ports
	[ -n "$to" ] || die "watch needs --to"
	if ! [[ $interval =~ ^[0-9]+$ ]] || [ "$interval" -lt 1 ]; then
		die "--interval must be a whole number of seconds >= 1"
	fi
	pick_backend
	local sleeper=""
	on_exit() {
		if [ -n "$sleeper" ]; then kill "$sleeper" 2>/dev/null || true; fi
		if [ "$keep_on_exit" = 1 ]; then
			log "exiting; rules kept (--keep-on-exit)"
		else
			log "exiting; removing the rules"
			nft_remove
			ipt_remove
		fi
		exit 0
	}
	trap on_exit TERM INT
	log "watching: every ${interval}s, $to"
	local rc last="" prev=()
	while :; do
		rc=0
		converge || rc=$?
		case $rc in
		0) log "applied: $(describe)" ;;
		1) [ "$last" = ok ] || log "in place: $(describe)" ;;
		3) log "keeping the current rules: $to gives more addresses than --max-targets $max_targets" ;;
		*) log "keeping the current rules: $to does not resolve (is tether-cloud ready?)" ;;
		esac
		if [ "$rc" -le 1 ]; then
			last=ok
			if [ "$flush_after" -gt 0 ]; then track_left "${prev[@]}"; fi
			prev=("${targets[@]}")
		else
			last=err
		fi
		sleep "$interval" &
		sleeper=$!
		wait "$sleeper" || true
		sleeper=""
	done
}

cmd_status() {
	local rc=1
	case $backend in
	nft) nft_status && rc=0 ;;
	iptables) ipt_status && rc=0 ;;
	auto)
		if nft_status; then rc=0; fi
		if ipt_status; then rc=0; fi
		;;
	esac
	if [ "$rc" = 0 ]; then return 0; fi
	return "$EXIT_NOT_APPLIED"
}

cmd_remove() {
	require_root
	case $backend in
	nft) nft_remove ;;
	iptables) ipt_remove ;;
	auto)
		have nft || have "$IPT" || have "$IP6T" || die "neither nft nor iptables found"
		nft_remove
		ipt_remove
		;;
	esac
	log "removed: nothing of Tether's is left ($([ "$backend" = auto ] && echo "nft and iptables" || echo "$backend"))"
}

main() {
	parse_args "$@"
	case $cmd in
	apply) cmd_apply ;;
	watch) cmd_watch ;;
	status) cmd_status ;;
	remove) cmd_remove ;;
	help | -h | --help) usage ;;
	*) die "unknown command '$cmd' (apply, watch, status, remove, help)" ;;
	esac
}

main "$@"
