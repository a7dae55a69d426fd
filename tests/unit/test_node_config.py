"""hack/node.py's pure parts: the node's configuration files and the guard's rules, checked for
the settings that keep every packet on the cluster's own addresses."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from support import hack_module

node = hack_module("cluster").node  # the one copy hack/cluster.py imports

PRIVATE = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")]


def test_cluster_addresses_are_outside_every_private_block():
    for net in (node.POD_CIDR, node.SERVICE_CIDR, f"{node.NODE_IP}/32", node.NODE_NET):
        assert not any(ipaddress.ip_network(net).overlaps(p) for p in PRIVATE), net
        assert ipaddress.ip_network(net).subnet_of(ipaddress.ip_network(node.CLUSTER_NET)), net


def test_pods_get_no_gateway_no_masquerade_and_no_default_route():
    bridge = node.cni_config()["plugins"][0]
    assert bridge["isGateway"] is False and bridge["ipMasq"] is False and bridge["isDefaultGateway"] is False
    routes = bridge["ipam"]["routes"]
    assert routes == [{"dst": node.NODE_NET, "gw": node.BRIDGE_IP}]
    assert all(r["dst"] not in ("0.0.0.0/0", "default") for r in routes)


def test_guard_admits_only_cluster_destinations_then_drops():
    pre = [rule for table, chain, rule in node.guard_rules() if chain == node.GUARD]
    returns = [rule[rule.index("-d") + 1] for rule in pre if rule[-1] == "RETURN"]
    assert sorted(returns) == sorted([node.POD_CIDR, f"{node.NODE_IP}/32", node.SERVICE_CIDR])
    assert pre[len(returns)] == ["-s", node.POD_CIDR, "-j", "DROP"]  # everything else from a pod
    fwd = [rule for _, chain, rule in node.guard_rules() if chain == node.GUARD_FWD]
    assert fwd[0] == ["-i", node.BRIDGE, "-o", node.BRIDGE, "-j", "RETURN"] and fwd[1][-1] == "DROP"


def test_corefile_answers_cluster_names_only():
    text = node.corefile(Path("/k"), 1, 2)
    assert "forward" not in text and "proxy" not in text
    assert text.startswith(f"{node.CLUSTER_DOMAIN}:53 ") and f"bind {node.DNS_IP}" in text


def test_kubelet_and_containerd_settings_this_machine_needs():
    cfg = node.kubelet_config(Path("/pki"), Path("/resolv.conf"))
    assert cfg["failCgroupV1"] is False and cfg["cgroupDriver"] == "cgroupfs"
    assert cfg["clusterDNS"] == [node.DNS_IP] and cfg["readOnlyPort"] == 0
    assert cfg["authentication"]["anonymous"]["enabled"] is False and cfg["authorization"]["mode"] == "Webhook"
    toml = node.containerd_config("tfps.local/pause:x")
    assert "restrict_oom_score_adj = true" in toml and 'sandbox_image = "tfps.local/pause:x"' in toml
    assert "SystemdCgroup = false" in toml and 'stream_server_address = "127.0.0.1"' in toml


def test_teardown_removes_the_node_chains_and_keeps_other_rules():
    dump = "\n".join(
        [
            "*filter",
            ":INPUT ACCEPT [0:0]",
            ":FORWARD ACCEPT [0:0]",
            ":KUBE-FIREWALL - [0:0]",
            ":TFPS-GUARD-FWD - [0:0]",
            ":MINE - [0:0]",
            "-A INPUT -j KUBE-FIREWALL",
            "-A FORWARD -j TFPS-GUARD-FWD",
            "-A FORWARD -j MINE",
            "-A KUBE-FIREWALL -j DROP",
            "-A MINE -s 192.0.2.9/32 -j ACCEPT",
            "COMMIT",
        ]
    )
    rest = node.without_node_chains(dump)
    assert rest.splitlines() == [
        "*filter",
        ":INPUT ACCEPT [0:0]",
        ":FORWARD ACCEPT [0:0]",
        ":MINE - [0:0]",
        "-A FORWARD -j MINE",
        "-A MINE -s 192.0.2.9/32 -j ACCEPT",
        "COMMIT",
    ]
    assert node.without_node_chains("*filter\n:INPUT ACCEPT [0:0]\nCOMMIT") is None
