"""Run on a third host: `python tests/multihost/probe_ports.py JSON` with a list of {"ip", "port", "process",
"every_interface"}. Calls each listening port the way a stranger on the LAN would, without any token: gRPC
methods of the service that process serves there (Ray's gRPC servers are the ones on every interface; the
agents' HTTP servers are on the node's address), then a plain HTTP GET. Prints one JSON object per port."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

import grpc

METHODS = {
    "gcs_server": ["/ray.rpc.InternalKVGcsService/InternalKVGet"],
    "raylet": ["/ray.rpc.NodeManagerService/GetResourceLoad", "/ray.rpc.ObjectManagerService/Pull"],
    "ray::DashboardA": ["/ray.rpc.ReporterService/HealthCheck"],
}


def grpc_answers(target: str, methods: list[str]) -> list[str]:
    out = []
    with grpc.insecure_channel(target) as channel:
        for method in methods:
            call = channel.unary_unary(method, request_serializer=bytes, response_deserializer=bytes)
            try:
                call(b"", timeout=5)
                out.append("ACCEPTED")
            except grpc.RpcError as exc:
                out.append(exc.code().name)
    return out


def http_answer(target: str) -> str:
    try:
        with urllib.request.urlopen(f"http://{target}/", timeout=5) as r:
            return str(r.status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)
    except Exception as exc:  # a gRPC port answers HTTP/1.1 with a protocol error
        return type(exc).__name__


def main(sockets: list[dict]) -> None:
    for s in sockets:
        target = f"{s['ip']}:{s['port']}"
        methods = METHODS.get(s["process"], []) if s["every_interface"] else []
        print(json.dumps({**s, "grpc": grpc_answers(target, methods), "http": http_answer(target)}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
