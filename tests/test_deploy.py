"""The Kubernetes manifests under service/deploy/kubernetes/: valid against Kubernetes' schemas (offline:
kubernetes-validate bundles them; strict, so a misspelled field fails), and consistent with `tts serve`."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tts.cli.main import build_parser

MANIFESTS = sorted(
    (Path(__file__).resolve().parent.parent / "service" / "deploy" / "kubernetes").glob("*.yaml")
)
KUBERNETES = "1.30.0"  # gRPC probes are GA since 1.27


def documents() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_there_are_manifests():
    kinds = sorted(doc["kind"] for doc in documents())
    assert kinds == ["Deployment", "PodDisruptionBudget", "Service", "Service"]


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_is_valid(doc):
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # raises ValidationError


def test_a_misspelled_field_is_caught():
    doc = next(d for d in documents() if d["kind"] == "Deployment")
    doc["spec"]["replicaz"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_deployment_fits_tts_serve():
    deployment = next(d for d in documents() if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["tts"]
    args = build_parser().parse_args(container["args"])  # the arguments are `tts serve` options
    assert args.command == "serve" and args.host == "0.0.0.0" and args.devices is None
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": args.port, "http": args.http_port, "metrics": args.metrics_port}
    # Readiness: the standard health service (NOT_SERVING while warming up or draining); liveness and
    # start-up: the `liveness` service, SERVING while the process and its engine live.
    assert container["readinessProbe"]["grpc"] == {"port": args.port}
    assert container["livenessProbe"]["grpc"] == {"port": args.port, "service": "liveness"}
    assert container["startupProbe"]["grpc"] == {"port": args.port, "service": "liveness"}
    # preStop starts the drain; the pod's grace period outlasts drain delay + grace + stopping.
    assert "kill -TERM 1" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
    assert pod["terminationGracePeriodSeconds"] > args.drain_delay + args.grace + 5
    assert args.max_connection_age > 0  # clients of the headless Service reconnect and find new pods


def test_grpc_is_spread_per_call():
    services = {d["metadata"]["name"]: d for d in documents() if d["kind"] == "Service"}
    grpc_service = services["tts-grpc"]["spec"]
    assert grpc_service["clusterIP"] == "None"  # headless: DNS names every ready pod (client-side balancing)
    assert [p["targetPort"] for p in grpc_service["ports"]] == ["grpc"]
    assert {p["targetPort"] for p in services["tts"]["spec"]["ports"]} == {"http", "metrics"}
