# SPDX-License-Identifier: MIT
# Two network namespaces joined by a veth pair, for the durability scripts that cut links
# between real processes; sourced, not run. Needs a `fail MESSAGE` of the caller's.
#   netns_pair A B NET   namespaces A and B (names of at most 15 characters less the
#                        veth's), the pair's ends addressed NET.1 (in A) and NET.2 (in B),
#                        loopback up in each, waiting until B reaches A. Sets netns_veth_a
#                        (A's end: `ip -n A link set $netns_veth_a down` cuts the link).
#                        Exits 77 with a line "SKIP: ..." without root, `ip netns` or veth.
#   netns_delete         deletes the namespaces made (their veth pair goes with them); call
#                        it once the processes started in them are ended.
netns_made=()
netns_pair() {
  local a=$1 b=$2 net=$3
  [ "$(id -u)" = 0 ] || { echo "SKIP: network namespaces need root"; exit 77; }
  command -v ip >/dev/null || { echo "SKIP: no ip command (iproute2)"; exit 77; }
  local error
  if ! error=$(ip netns add "$a" 2>&1); then echo "SKIP: ip netns unavailable: $error"; exit 77; fi
  netns_made+=("$a")
  if ! error=$(ip netns exec "$a" true 2>&1); then echo "SKIP: ip netns exec unavailable: $error"; exit 77; fi
  ip netns add "$b" || fail "could not add namespace $b"
  netns_made+=("$b")
  netns_veth_a=pla$$  # interface names: 15 characters at most
  local veth_b=plb$$
  if ! error=$(ip link add "$netns_veth_a" netns "$a" type veth peer name "$veth_b" netns "$b" 2>&1); then
    echo "SKIP: no veth pair: $error"
    exit 77
  fi
  ip -n "$a" addr add "$net.1/24" dev "$netns_veth_a" || fail "could not address $netns_veth_a"
  ip -n "$b" addr add "$net.2/24" dev "$veth_b" || fail "could not address $veth_b"
  local ns
  for ns in "$a" "$b"; do ip -n "$ns" link set lo up || fail "lo down in $ns"; done
  ip -n "$a" link set "$netns_veth_a" up || fail "could not bring $netns_veth_a up"
  ip -n "$b" link set "$veth_b" up || fail "could not bring $veth_b up"
  for _ in $(seq 1 50); do  # the veth pair takes a moment to carry traffic
    # A refused connection proves the address answers: nothing listens there yet.
    ip netns exec "$b" python3 - "$net.1" <<'PY' && return 0
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=1).close()
except ConnectionRefusedError:
    pass
except OSError:
    sys.exit(1)
PY
    sleep 0.1
  done
  fail "$net.1 unreachable from $b"
}
netns_delete() {
  local ns
  for ns in "${netns_made[@]}"; do ip netns delete "$ns" 2>/dev/null; done
}
