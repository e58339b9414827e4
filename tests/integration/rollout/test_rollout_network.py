"""The Ray attack: a sandbox with network cannot reach the Ray cluster the rollouts run on (its GCS, raylets, object
managers, metrics), on any address of the host, though the host itself can. Ray's job API runs code it is sent
without credentials, so one open port would be code execution on the host."""

from __future__ import annotations

import socket

import agentenv

from ..netprobe import host_addresses, probe, reached


def _ray_ports(cluster) -> list[int]:
    import ray

    ports = {int(cluster.address.rsplit(":", 1)[1])}
    for node in ray.nodes():
        for key in ("NodeManagerPort", "ObjectManagerPort", "MetricsExportPort"):
            if node.get(key):
                ports.add(int(node[key]))
    return sorted(ports)


def _listening(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=3):
            return True
    except OSError:
        return False


def test_a_networked_sandbox_reaches_no_port_of_the_ray_cluster(ray_cluster):
    ports = _ray_ports(ray_cluster)
    targets = [(a, p) for a in host_addresses() for p in ports]
    open_to_host = [f"{a}:{p}" for a, p in targets if _listening(a, p)]
    assert len(open_to_host) >= 3, f"the cluster's ports should answer the host: {ports}"
    with agentenv.Sandbox.create(network=True) as sb:
        r = probe(sb, open_to_host)
    assert reached(r) == [], r
    assert set(r.values()) == {"ConnectionRefusedError"}, r
