#!/usr/bin/env bash
# Multi-region emulation on one Linux host (root only): network namespaces joined by veth pairs
# whose egress is rate-limited with tbf. The kernel here has no netem, so there is no in-kernel
# delay: put deltarl.testing.wan.EmulatedLink (a rootless asyncio proxy) on the path for RTT and
# per-connection windows, or run it alone when root is not available.
#
#   sudo infra/netns-regions.sh up [RATE]     # default RATE=1gbit; creates ${PREFIX}-origin/-east/-west
#   sudo infra/netns-regions.sh status
#   sudo infra/netns-regions.sh down
#
# Topology (two WAN links, one per region; each end shapes its egress to RATE):
#
#   ${PREFIX}-east 10.77.1.2 <-veth-> 10.77.1.1 ${PREFIX}-origin 10.77.2.1 <-veth-> 10.77.2.2 ${PREFIX}-west
#
# Example: origin store + relay in the origin namespace, a relay per region, actors next to them:
#   ip netns exec ${PREFIX}-origin deltarl relay --upstream /data/runs --listen 10.77.1.1:8470 ...
#   ip netns exec ${PREFIX}-east   deltarl relay --upstream http://10.77.1.1:8470 --listen 127.0.0.1:8470 ...
set -euo pipefail

PREFIX=${PREFIX:-dr}
CMD=${1:-status}
RATE=${2:-${RATE:-1gbit}}
BURST=${BURST:-256kb}

ns() { echo "${PREFIX}-$1"; }

link_up() {  # link_up REGION SUBNET
    local region=$1 subnet=$2 a="${PREFIX}-o-$1" b="${PREFIX}-r-$1"
    ip link add "$a" type veth peer name "$b"
    ip link set "$a" netns "$(ns origin)"
    ip link set "$b" netns "$(ns "$region")"
    ip -n "$(ns origin)" addr add "10.77.${subnet}.1/24" dev "$a"
    ip -n "$(ns "$region")" addr add "10.77.${subnet}.2/24" dev "$b"
    ip -n "$(ns origin)" link set "$a" up
    ip -n "$(ns "$region")" link set "$b" up
    tc -n "$(ns origin)" qdisc add dev "$a" root tbf rate "$RATE" burst "$BURST" latency 100ms
    tc -n "$(ns "$region")" qdisc add dev "$b" root tbf rate "$RATE" burst "$BURST" latency 100ms
}

case "$CMD" in
up)
    for n in origin east west; do
        ip netns add "$(ns $n)"
        ip -n "$(ns $n)" link set lo up
    done
    link_up east 1
    link_up west 2
    echo "namespaces $(ns origin) $(ns east) $(ns west) up; WAN links shaped to $RATE"
    ;;
down)
    for n in origin east west; do
        ip netns del "$(ns $n)" 2>/dev/null || true
    done
    ;;
status)
    ip netns list | grep "^${PREFIX}-" || echo "no ${PREFIX}-* namespaces"
    for n in origin east west; do
        if ip netns list | grep -q "^$(ns $n)\b"; then
            tc -n "$(ns $n)" qdisc show | grep tbf || true
        fi
    done
    ;;
*)
    echo "usage: $0 up [RATE] | down | status" >&2
    exit 2
    ;;
esac
