#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
#
# Attach test for the XDP steering program (run as root):
#
#   xdp-prog/test-attach.sh
#
# Builds both objects with build.sh into a temporary directory, then in two
# network namespaces it creates (xroce-xdptest-<pid>-a / -b) joined by veth
# pairs:
#
#   1. MTU 1500 pair veth-a (10.99.0.1/25, fd00:99:0:1::1) <-> veth-b
#      (10.99.0.2/25, fd00:99:0:1::2); the plain build is attached in driver
#      mode to veth-b (the receiver):
#      - ICMP (v4, v6) and TCP (v4, v6) keep working while it is attached;
#      - UDP to port 4791 with no AF_XDP socket bound: counted as
#        roce_no_socket (not redirected) and still delivered to a kernel UDP
#        socket in the namespace; UDP to 4792 is counted as passed;
#      - hand-made frames (VLAN / QinQ / IPv4 options / IPv6 / fragments /
#        extension headers / truncated headers) land in the expected counter;
#      - the drop_config knob: N=1 drops every RoCEv2 frame and nothing else,
#        N=4 drops about a quarter, N=0 none;
#      - the peer cannot raise its MTU above 3506 while the plain build is
#        attached;
#      - detaching leaves no program and the kernel path still works.
#   2. MTU 9000 pair veth9-a (10.99.0.129/25, fd00:99:0:2::1) <-> veth9-b
#      (10.99.0.130/25, fd00:99:0:2::2):
#      - the plain build attaches at MTU 3506 (the veth limit) but is refused
#        at 3507 and 9000 (ERANGE, "Peer MTU is too large to set XDP");
#      - the frags build attaches at 9000, passes 8000-byte ICMP and TCP,
#        counts 8000-byte RoCEv2 datagrams (multi-buffer frames) and the
#        hand-made frames as expected; then it is detached.
#
# Everything is bounded: each command has its own timeout and the whole run
# is limited to XROCE_XDPTEST_TIMEOUT seconds (default 300). An EXIT trap
# kills the background processes it started (by PID), unmounts its private
# bpffs and deletes its two namespaces (by name). Exit status 0 = all checks
# passed.
set -euo pipefail

if [[ -z ${XROCE_XDPTEST_INNER:-} ]]; then
	export XROCE_XDPTEST_INNER=1
	# --foreground: only this script gets the timeout's TERM, and its trap
	# cleans up; Ctrl-C still reaches everything.
	exec timeout --foreground --kill-after=20 "${XROCE_XDPTEST_TIMEOUT:-300}" \
		bash "${BASH_SOURCE[0]}" "$@"
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
helper=$here/xdptest.py

NS_A=xroce-xdptest-$$-a
NS_B=xroce-xdptest-$$-b
work=
bpffs=
bg_pids=()
failures=0

log() { printf '%s\n' "$*"; }
ok() { printf '  ok    %s\n' "$*"; }
bad() {
	printf '  FAIL  %s\n' "$*"
	failures=$((failures + 1))
}
die() {
	printf 'FATAL: %s\n' "$*" >&2
	exit 1
}

cleanup() {
	local rc=$?
	set +e
	for pid in "${bg_pids[@]}"; do
		kill "$pid" 2>/dev/null
		wait "$pid" 2>/dev/null
	done
	if [[ -n $bpffs ]] && mountpoint -q "$bpffs"; then
		umount "$bpffs"
	fi
	for ns in "$NS_A" "$NS_B"; do
		if [[ -e /run/netns/$ns ]]; then
			ip netns del "$ns"
		fi
	done
	if [[ -n $work && -d $work ]]; then
		rm -rf "$work"
	fi
	if ((rc == 0)); then
		log "PASS: all checks passed"
	else
		log "FAILED (exit $rc)"
	fi
	exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted (SIGINT)"; exit 130' INT
trap 'log "timed out or terminated (SIGTERM)"; exit 143' TERM

# ---------------------------------------------------------------- prerequisites

[[ $EUID -eq 0 ]] || die "must run as root (network namespaces, XDP, bpftool)"
missing=()
for cmd in ip bpftool python3 ping timeout mountpoint; do
	command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
if ((${#missing[@]})); then
	log "missing commands: ${missing[*]}"
	log "install with: apt-get install -y --no-install-recommends iproute2 bpftool python3 iputils-ping coreutils util-linux clang libbpf-dev"
	exit 1
fi

# ---------------------------------------------------------------- helpers

nsx() { # nsx NS CMD... : run in a namespace, bounded
	local ns=$1
	shift
	timeout 20 ip netns exec "$ns" "$@"
}

json() { # json EXPR : evaluate a Python expression on JSON from stdin (bound to j)
	python3 -c 'import json, sys; j = json.load(sys.stdin); v = eval(sys.argv[1]); print("" if v is None else v)' "$1"
}

make_pair() { # make_pair IF_A IF_B MTU ADDR_A ADDR_B ADDR6_A ADDR6_B
	local if_a=$1 if_b=$2 mtu=$3
	ip -n "$NS_A" link add "$if_a" type veth peer name "$if_b" netns "$NS_B"
	ip -n "$NS_A" link set dev "$if_a" mtu "$mtu"
	ip -n "$NS_B" link set dev "$if_b" mtu "$mtu"
	ip -n "$NS_A" addr add "$4" dev "$if_a"
	ip -n "$NS_B" addr add "$5" dev "$if_b"
	ip -n "$NS_A" addr add "$6" dev "$if_a" nodad
	ip -n "$NS_B" addr add "$7" dev "$if_b" nodad
	ip -n "$NS_A" link set dev "$if_a" up
	ip -n "$NS_B" link set dev "$if_b" up
}

attach() { # attach IF OBJ SEC : driver-mode attach on NS_B's IF; prints ip's stderr
	timeout 20 ip -n "$NS_B" link set dev "$1" xdpdrv obj "$2" sec "$3" 2>&1
}

detach() { # detach IF
	timeout 20 ip -n "$NS_B" link set dev "$1" xdpdrv off
}

xdp_prog() { # xdp_prog IF : "ID NAME MODE" of the attached XDP program, or empty
	ip -j -n "$NS_B" link show dev "$1" |
		json '"%d %s %d" % (j[0]["xdp"]["prog"]["id"], j[0]["xdp"]["prog"]["name"], j[0]["xdp"]["mode"]) if "prog" in j[0].get("xdp", {}) else None'
}

map_id() { # map_id PROG_ID MAP_NAME
	local m
	for m in $(timeout 10 bpftool -j prog show id "$1" | json '" ".join(str(i) for i in j["map_ids"])'); do
		if [[ $(timeout 10 bpftool -j map show id "$m" | json 'j["name"]') == "$2" ]]; then
			echo "$m"
			return
		fi
	done
	die "program $1 has no map named $2"
}

snapshot() { # snapshot ARRAY_NAME COUNTERS_MAP_ID : fill an associative array
	local -n _snap=$1
	local kv
	_snap=()
	for kv in $(timeout 10 python3 "$helper" counters "$2"); do
		_snap[${kv%%=*}]=${kv#*=}
	done
}

show() { # show ARRAY_NAME
	local -n _arr=$1
	printf 'redirected=%s passed=%s malformed=%s dropped_by_knob=%s roce_no_socket=%s' \
		"${_arr[redirected]}" "${_arr[passed]}" "${_arr[malformed]}" \
		"${_arr[dropped_by_knob]}" "${_arr[roce_no_socket]}"
}

delta() { # delta BEFORE AFTER NAME
	local -n _b=$1 _a=$2
	echo $((_a[$3] - _b[$3]))
}

expect() { # expect DESC ACTUAL OP EXPECTED   (OP: eq | ge)
	local desc=$1 actual=$2 op=$3 want=$4
	if [[ $op == eq && $actual -eq $want ]] || [[ $op == ge && $actual -ge $want ]]; then
		ok "$desc: $actual ($op $want)"
	else
		bad "$desc: got $actual, want $op $want"
	fi
}

expect_counters() { # expect_counters BEFORE AFTER redirected=EQ passed=>=GE ...
	local before=$1 after=$2 spec name val d
	shift 2
	for spec in "$@"; do
		name=${spec%%=*}
		val=${spec#*=}
		d=$(delta "$before" "$after" "$name")
		if [[ $val == ">="* ]]; then
			expect "counter $name delta" "$d" ge "${val#>=}"
		else
			expect "counter $name delta" "$d" eq "$val"
		fi
	done
}

udp_count() { cat "$work/udp.count" 2>/dev/null || echo 0; }

wait_udp_count() { # wait_udp_count TARGET : up to 5 s for the listener to reach TARGET
	local i
	for ((i = 0; i < 50; i++)); do
		(($(udp_count) >= $1)) && break
		sleep 0.1
	done
	sleep 0.3 # let stragglers (which would be a failure) arrive too
	udp_count
}

udp_send() { # udp_send ADDR PORT COUNT SIZE (from NS_A)
	nsx "$NS_A" python3 "$helper" udp-send "$@"
}

check_ping() { # check_ping DESC ADDR [ping options]
	local desc=$1 addr=$2
	shift 2
	if nsx "$NS_A" ping -q -c 3 -i 0.2 -W 2 "$@" "$addr" >/dev/null; then
		ok "$desc"
	else
		bad "$desc"
	fi
}

check_tcp() { # check_tcp DESC ADDR PORT
	local desc=$1 addr=$2 port=$3 pid reply i
	timeout 15 ip netns exec "$NS_B" python3 "$helper" tcp-echo "$addr" "$port" &
	pid=$!
	bg_pids+=("$pid")
	for ((i = 0; i < 50; i++)); do
		ip netns exec "$NS_B" ss -Hltn "sport = :$port" | grep -q LISTEN && break
		sleep 0.1
	done
	reply=$(nsx "$NS_A" bash -c 'exec 3<>"/dev/tcp/$1/$2" && echo "hello xroce" >&3 && read -r -t 5 line <&3 && echo "$line"' _ "$addr" "$port" 2>&1) || true
	wait "$pid" 2>/dev/null || true
	if [[ $reply == "echo: hello xroce" ]]; then
		ok "$desc"
	else
		bad "$desc (reply: '$reply')"
	fi
}

set_knob() { # set_knob DROP_CONFIG_MAP_ID N
	local n=$2
	timeout 10 bpftool map update id "$1" key 0 0 0 0 value \
		$((n & 255)) $(((n >> 8) & 255)) $(((n >> 16) & 255)) $(((n >> 24) & 255))
}

send_frames() { # send_frames IF_A IF_B REPEAT : prints "roce=N passed=N malformed=N"
	local mac
	mac=$(ip netns exec "$NS_B" cat "/sys/class/net/$2/address")
	nsx "$NS_A" python3 "$helper" frames "$1" "$mac" "$3"
}

# ---------------------------------------------------------------- setup

work=$(mktemp -d /tmp/xroce-xdptest.XXXXXX)
log "== build (build.sh into $work/build)"
"$here/build.sh" "$work/build" | sed 's/^/  /'
plain=$work/build/xroce_xdp.o
frags=$work/build/xroce_xdp_frags.o

log "== namespaces $NS_A, $NS_B"
ip netns add "$NS_A"
ip netns add "$NS_B"
ip -n "$NS_A" link set dev lo up
ip -n "$NS_B" link set dev lo up
make_pair veth-a veth-b 1500 10.99.0.1/25 10.99.0.2/25 fd00:99:0:1::1/64 fd00:99:0:1::2/64

# A kernel UDP socket on 4791 in NS_B counts what reaches the kernel. Bounded by
# the run's time limit; killed by PID in cleanup.
timeout "${XROCE_XDPTEST_TIMEOUT:-300}" ip netns exec "$NS_B" python3 "$helper" udp-listen 4791 "$work/udp.count" &
bg_pids+=("$!")
for ((i = 0; i < 50; i++)); do
	ip netns exec "$NS_B" ss -Hlun "sport = :4791" | grep -q . && break
	sleep 0.1
done
ip netns exec "$NS_B" ss -Hlun "sport = :4791" | grep -q . || die "UDP listener on 4791 did not start"

log "== 1. before attaching: kernel path works"
check_ping "ping 10.99.0.2" 10.99.0.2
check_ping "ping fd00:99:0:1::2" fd00:99:0:1::2
check_tcp "tcp 10.99.0.2:5001 round trip" 10.99.0.2 5001

log "== 2. attach the plain build (xdpdrv, sec xdp) on $NS_B/veth-b"
if ! out=$(attach veth-b "$plain" xdp); then
	die "attach failed: $out"
fi
read -r prog_id prog_name prog_mode <<<"$(xdp_prog veth-b)"
[[ -n ${prog_id:-} ]] || die "no XDP program on veth-b after attach"
expect "attached program is xroce_xdp in driver mode (mode 1)" "$([[ $prog_name == xroce_xdp && $prog_mode == 1 ]] && echo 1 || echo 0)" eq 1
counters_map=$(map_id "$prog_id" counters)
drop_map=$(map_id "$prog_id" drop_config)
xsks_map=$(map_id "$prog_id" xsks_map)
log "  prog id $prog_id, maps: counters=$counters_map drop_config=$drop_map xsks_map=$xsks_map"
knob=$(timeout 10 bpftool -j map lookup id "$drop_map" key 0 0 0 0 | json 'int.from_bytes(bytes(int(b, 16) for b in j["value"]), "little")')
expect "drop_config after load" "$knob" eq 0

declare -A c0 c1 c2 c3 c4 c5 c6
snapshot c0 "$counters_map"
log "  counters: $(show c0)"

log "== 3. ICMP and TCP while attached"
check_ping "ping 10.99.0.2 (attached)" 10.99.0.2
check_ping "ping fd00:99:0:1::2 (attached)" fd00:99:0:1::2
check_tcp "tcp 10.99.0.2:5002 round trip (attached)" 10.99.0.2 5002
check_tcp "tcp [fd00:99:0:1::2]:5003 round trip (attached)" fd00:99:0:1::2 5003
snapshot c1 "$counters_map"
log "  counters: $(show c1)"
expect_counters c0 c1 redirected=0 passed=">=12" malformed=0 dropped_by_knob=0 roce_no_socket=0

log "== 4. UDP to 4791 with no AF_XDP socket bound (40 datagrams) and to 4792 (10)"
u0=$(udp_count)
udp_send 10.99.0.2 4791 20 64
udp_send fd00:99:0:1::2 4791 20 64
udp_send 10.99.0.2 4792 10 64
u1=$(wait_udp_count $((u0 + 40)))
snapshot c2 "$counters_map"
log "  counters: $(show c2)"
expect_counters c1 c2 redirected=0 roce_no_socket=40 passed=">=10" malformed=0 dropped_by_knob=0
expect "datagrams the kernel UDP socket on 4791 received (XDP_PASS fallback)" $((u1 - u0)) eq 40

log "== 5. hand-made frames (VLAN, QinQ, options, IPv6, fragments, truncated)"
sent=$(send_frames veth-a veth-b 5)
log "  sent: $sent"
declare -A s
for kv in $sent; do s[${kv%%=*}]=${kv#*=}; done
sleep 0.3
snapshot c3 "$counters_map"
log "  counters: $(show c3)"
expect_counters c2 c3 redirected=0 roce_no_socket="${s[roce]}" malformed="${s[malformed]}" \
	passed=">=${s[passed]}" dropped_by_knob=0
expect "hand-made frames reaching the UDP socket (addressed to nobody)" $(($(udp_count) - u1)) eq 0

log "== 6. drop_config knob"
set_knob "$drop_map" 1
u2=$(udp_count)
udp_send 10.99.0.2 4791 20 64
udp_send fd00:99:0:1::2 4791 20 64
check_ping "ping 10.99.0.2 with knob N=1 (non-RoCE unaffected)" 10.99.0.2
sleep 0.5
u3=$(udp_count)
snapshot c4 "$counters_map"
log "  N=1, 40 datagrams: $(show c4)"
expect_counters c3 c4 dropped_by_knob=40 roce_no_socket=0 redirected=0 malformed=0
expect "datagrams received with N=1" $((u3 - u2)) eq 0

set_knob "$drop_map" 4
udp_send 10.99.0.2 4791 400 64
snapshot c5 "$counters_map"
dropped=$(delta c4 c5 dropped_by_knob)
passed_roce=$(delta c4 c5 roce_no_socket)
u4=$(wait_udp_count $((u3 + passed_roce)))
log "  N=4, 400 datagrams: dropped_by_knob +$dropped, roce_no_socket +$passed_roce, received +$((u4 - u3))"
expect "dropped + fallen back with N=4" $((dropped + passed_roce)) eq 400
expect "dropped with N=4 (expect ~100, sd 8.7)" "$dropped" ge 50
expect "not dropped with N=4" "$passed_roce" ge 230
expect "datagrams received with N=4 = not dropped" $((u4 - u3)) eq "$passed_roce"

set_knob "$drop_map" 0
udp_send 10.99.0.2 4791 10 64
u5=$(wait_udp_count $((u4 + 10)))
snapshot c6 "$counters_map"
log "  N=0, 10 datagrams: $(show c6)"
expect_counters c5 c6 dropped_by_knob=0 roce_no_socket=10
expect "datagrams received with N=0" $((u5 - u4)) eq 10

log "== 7. peer MTU is capped while the plain build is attached"
if err=$(timeout 10 ip -n "$NS_A" link set dev veth-a mtu 9000 2>&1); then
	bad "veth-a accepted MTU 9000 while a plain XDP program is attached to its peer"
	ip -n "$NS_A" link set dev veth-a mtu 1500
else
	ok "veth-a refuses MTU 9000 while attached: $err"
fi

log "== 8. detach"
detach veth-b
expect "XDP programs on veth-b after detach" "$([[ -z $(xdp_prog veth-b) ]] && echo 0 || echo 1)" eq 0
if timeout 10 bpftool prog show id "$prog_id" >/dev/null 2>&1; then
	bad "program $prog_id still loaded after detach"
else
	ok "program $prog_id unloaded after detach"
fi
check_ping "ping 10.99.0.2 (detached)" 10.99.0.2
check_tcp "tcp 10.99.0.2:5004 round trip (detached)" 10.99.0.2 5004
u6=$(udp_count)
udp_send 10.99.0.2 4791 10 64
expect "datagrams to 4791 received (detached)" $(($(wait_udp_count $((u6 + 10))) - u6)) eq 10

log "== 9. MTU: plain vs frags build"
make_pair veth9-a veth9-b 3506 10.99.0.129/25 10.99.0.130/25 fd00:99:0:2::1/64 fd00:99:0:2::2/64
if out=$(attach veth9-b "$plain" xdp); then
	ok "plain build attaches at MTU 3506"
	detach veth9-b
else
	bad "plain build refused at MTU 3506: $out"
fi
ip -n "$NS_A" link set dev veth9-a mtu 3507
ip -n "$NS_B" link set dev veth9-b mtu 3507
if out=$(attach veth9-b "$plain" xdp); then
	bad "plain build attached at MTU 3507"
	detach veth9-b
else
	ok "plain build refused at MTU 3507: $out"
fi
ip -n "$NS_A" link set dev veth9-a mtu 9000
ip -n "$NS_B" link set dev veth9-b mtu 9000
if out=$(attach veth9-b "$plain" xdp); then
	bad "plain build attached at MTU 9000"
	detach veth9-b
else
	ok "plain build refused at MTU 9000 (ip): $out"
fi
# The errno behind the message, through bpftool and a private bpffs.
bpffs=$work/bpffs
mkdir -p "$bpffs"
mount -t bpf bpf "$bpffs"
timeout 20 bpftool prog load "$plain" "$bpffs/plain" type xdp
if out=$(nsx "$NS_B" bpftool net attach xdpdrv pinned "$bpffs/plain" dev veth9-b 2>&1); then
	bad "bpftool attached the plain build at MTU 9000"
	nsx "$NS_B" bpftool net detach xdpdrv dev veth9-b
else
	out=$(printf '%s' "$out" | tr '\n' ' ')
	if [[ $out == *"Numerical result out of range"* ]]; then
		ok "plain build refused at MTU 9000 with ERANGE (bpftool): $out"
	else
		bad "plain build refused at MTU 9000 but not with ERANGE: $out"
	fi
fi
umount "$bpffs"

if out=$(attach veth9-b "$frags" xdp.frags); then
	ok "frags build attaches at MTU 9000"
else
	die "frags build refused at MTU 9000: $out"
fi
read -r prog_id prog_name prog_mode <<<"$(xdp_prog veth9-b)"
expect "attached program is xroce_xdp_frags in driver mode" "$([[ $prog_name == xroce_xdp_frags && $prog_mode == 1 ]] && echo 1 || echo 0)" eq 1
counters_map=$(map_id "$prog_id" counters)
declare -A f0 f1 f2
snapshot f0 "$counters_map"
check_ping "ping -s 8000 10.99.0.130 (frags)" 10.99.0.130 -s 8000 -M do
check_ping "ping -s 8000 fd00:99:0:2::2 (frags)" fd00:99:0:2::2 -s 8000 -M do
check_tcp "tcp 10.99.0.130:5005 round trip (frags)" 10.99.0.130 5005
u7=$(udp_count)
udp_send 10.99.0.130 4791 5 8000
udp_send fd00:99:0:2::2 4791 5 8000
u8=$(wait_udp_count $((u7 + 10)))
snapshot f1 "$counters_map"
log "  counters: $(show f1)"
expect_counters f0 f1 roce_no_socket=10 redirected=0 malformed=0 dropped_by_knob=0 passed=">=6"
expect "8000-byte datagrams received through the frags build" $((u8 - u7)) eq 10
sent=$(send_frames veth9-a veth9-b 2)
log "  hand-made frames sent: $sent"
for kv in $sent; do s[${kv%%=*}]=${kv#*=}; done
sleep 0.3
snapshot f2 "$counters_map"
log "  counters: $(show f2)"
expect_counters f1 f2 redirected=0 roce_no_socket="${s[roce]}" malformed="${s[malformed]}" \
	passed=">=${s[passed]}" dropped_by_knob=0
detach veth9-b
expect "XDP programs on veth9-b after detach" "$([[ -z $(xdp_prog veth9-b) ]] && echo 0 || echo 1)" eq 0

log "== summary"
if ((failures)); then
	log "$failures check(s) failed"
	exit 1
fi
