"""deploy/kubernetes/ against the Kubernetes schemas and against the real CLI (no cluster here).

Every manifest validates, strictly (no unknown field), against the Kubernetes JSON schemas that
the kubernetes-validate package ships (offline), with and without the GPU option (`#gpu ` marks
removed); the InferencePool validates against the openAPIV3Schema of the extension's CRD kept in
deploy/kubernetes/crds/. As tests/deploy/test_compose.py does for docker-compose.yml: each
container's command parses with folio.cli's own parser and uses only flags it has; ports agree
between the flags, the containers, the Services and the probes; probes hit real routes; the
grace periods outlast preStop plus the drain; the internal token comes from a Secret.
"""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from common import config
from folio.cli import build_parser
from gateway.front.app import ENDPOINTS

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
# What `kubectl apply -f deploy/kubernetes/` applies (not recursive), and the optional files.
MAIN_FILES = sorted(KUBE.glob("*.yaml"))
EXTENSION_FILES = sorted((KUBE / "inference-extension").glob("*.yaml"))
CRD = yaml.safe_load((KUBE / "crds" / "inferencepool.yaml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
CONTAINERS_DOC = (ROOT / "docs" / "containers.md").read_text()
# The oldest Kubernetes minor checked (gRPC probes are GA since 1.27) and the newest the pinned
# kubernetes-validate knows.
KUBERNETES_VERSIONS = ("1.29.0", latest_version())
GPU_MARK = re.compile(r"^(\s*)#gpu ", re.MULTILINE)
WORKLOAD_KINDS = ("Deployment", "StatefulSet")


def with_gpu(text: str) -> str:
    """The manifest with its GPU option on, as the comments tell users to do."""
    return GPU_MARK.sub(r"\1", text)


def documents(paths: list[Path], gpu: bool = False) -> list[dict]:
    docs = []
    for path in paths:
        text = path.read_text()
        docs += [d for d in yaml.safe_load_all(with_gpu(text) if gpu else text) if d]
    return docs


MAIN = documents(MAIN_FILES)
EXTENSION = documents(EXTENSION_FILES)


def one(docs: list[dict], kind: str, name: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def containers(docs: list[dict]) -> list[dict]:
    return [c for w in workloads(docs) for c in w["spec"]["template"]["spec"]["containers"]]


def argv(container: dict) -> list[str]:
    command = [*container["command"], *container.get("args", [])]
    assert command[0] == "folio", command
    return command[1:]


def parsed(container: dict):
    """The container's command as folio's parser reads it; every flag must be one it has
    (argparse alone would take an abbreviation of a flag)."""
    args = argv(container)
    subcommand = args[0]
    [subparsers] = [a for a in build_parser()._actions if a.dest == "command"]
    known = set(subparsers.choices[subcommand]._option_string_actions)
    flags = {a.split("=", 1)[0] for a in args if a.startswith("-")}
    assert flags <= known, (subcommand, flags - known)
    return build_parser().parse_args(args)


def named_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def by_component(docs: list[dict], component: str) -> dict:
    [workload] = [
        w
        for w in workloads(docs)
        if w["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    return workload


def container_of(workload: dict) -> dict:
    [container] = workload["spec"]["template"]["spec"]["containers"]
    return container


def selects(selector: dict[str, str], workload: dict) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return selector.items() <= labels.items()


def strict(schema):
    """The CRD's schema, refusing unknown fields as `kubectl apply` (strict field validation)
    does: objects that list their properties allow no others."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(item) for item in schema]
    return schema


def crd_validator(document: dict) -> jsonschema.Draft7Validator:
    group, version = document["apiVersion"].split("/")
    assert (group, document["kind"]) == (CRD["spec"]["group"], CRD["spec"]["names"]["kind"])
    [served] = [v for v in CRD["spec"]["versions"] if v["name"] == version and v["served"]]
    return jsonschema.Draft7Validator(strict(served["schema"]["openAPIV3Schema"]))


# -- schemas ------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_every_manifest_is_valid_kubernetes(version, gpu):
    docs = documents(MAIN_FILES + EXTENSION_FILES, gpu)
    builtin = [d for d in docs if d["kind"] != "InferencePool"]
    assert {d["kind"] for d in builtin} == {
        "Deployment",
        "StatefulSet",
        "Service",
        "PodDisruptionBudget",
    }
    for doc in builtin:
        kubernetes_validate.validate(doc, version, strict=True)


def test_inference_pool_is_valid_against_its_crd_schema():
    pools = [d for d in EXTENSION if d["kind"] == "InferencePool"]
    assert pools
    for pool in pools:
        crd_validator(pool).validate(pool)
    # Applied only on request: `kubectl apply -f deploy/kubernetes/` is not recursive.
    assert not [d for d in MAIN if d["kind"] == "InferencePool"]


def test_the_validators_refuse_broken_manifests():
    deployment = copy.deepcopy(one(MAIN, "Deployment", "folio-gateway"))
    deployment["spec"]["replica"] = 2  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, latest_version(), strict=True)
    deployment = copy.deepcopy(one(MAIN, "Deployment", "folio-gateway"))
    container_of(deployment)["ports"][0]["containerPort"] = "8000"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, latest_version(), strict=True)
    pool = one(EXTENSION, "InferencePool", "folio")
    for broken in ({"targetPorts": [{"number": 70000}]}, {"targetPort": 8000}):
        mutated = copy.deepcopy(pool)
        mutated["spec"].update(broken)
        with pytest.raises(jsonschema.ValidationError):
            crd_validator(mutated).validate(mutated)


# -- agreement with the CLI ---------------------------------------------------------------------


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_every_container_runs_a_folio_subcommand_that_parses(gpu):
    docs = documents(MAIN_FILES + EXTENSION_FILES, gpu)
    subcommands = []
    for container in containers(docs):
        args = parsed(container)
        subcommands.append(args.command)
        # Reachable from other pods, not just from inside its own.
        assert args.host == "0.0.0.0"
        if args.command in ("engine", "serve"):
            assert args.device == ("cuda" if gpu else "cpu")
            gpus = container["resources"]["limits"].get("nvidia.com/gpu")
            assert gpus == (1 if gpu else None)
    assert sorted(subcommands) == ["engine", "gateway", "serve", "tokenizer"]


def test_container_ports_are_the_flags_and_the_cli_defaults():
    for container in containers(MAIN + EXTENSION):
        args = parsed(container)
        ports = named_ports(container)
        if args.command in ("gateway", "serve"):
            assert ports == {"http": args.port, "grpc": args.grpc_port}
            assert (args.port, args.grpc_port) == (config.HTTP_PORT, config.GATEWAY_GRPC_PORT)
        elif args.command == "engine":
            assert ports == {"grpc": args.port, "generate": args.generate_socket_port}
            assert (args.port, args.generate_socket_port) == (
                config.ENGINE_PORT,
                config.GENERATE_SOCKET_PORT,
            )
        else:
            assert ports == {"grpc": args.port}
            assert args.port == config.TOKENIZER_PORT


def test_services_select_one_workload_and_expose_its_named_ports():
    for service in [d for d in MAIN if d["kind"] == "Service"]:
        selector = service["spec"]["selector"]
        [workload] = [w for w in workloads(MAIN) if selects(selector, w)]
        ports = named_ports(container_of(workload))
        for port in service["spec"]["ports"]:
            # A name the container declares, on the same number, so that addresses built from
            # the Service's port reach the flag's port.
            assert ports[port["targetPort"]] == port["port"], (service["metadata"], port)
        assert {p["name"] for p in service["spec"]["ports"]} == set(ports)


def test_gateway_addresses_each_engine_replica_and_the_tokenizer_service():
    engine = one(MAIN, "StatefulSet", "folio-engine")
    headless = one(MAIN, "Service", engine["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"  # one DNS name per replica
    engine_port = parsed(container_of(engine)).port
    gateway = parsed(container_of(by_component(MAIN, "gateway")))
    assert gateway.engine_address == [
        f"{engine['metadata']['name']}-{i}.{headless['metadata']['name']}:{engine_port}"
        for i in range(engine["spec"]["replicas"])
    ]
    tokenizer = by_component(MAIN, "tokenizer")
    [service] = [
        s for s in MAIN if s["kind"] == "Service" and selects(s["spec"]["selector"], tokenizer)
    ]
    tokenizer_port = parsed(container_of(tokenizer)).port
    assert gateway.tokenizer_address == f"{service['metadata']['name']}:{tokenizer_port}"


def test_probes_hit_real_routes_and_ports():
    routes = {endpoint.path for endpoint in ENDPOINTS if endpoint.method == "GET"}
    for container in containers(MAIN + EXTENSION):
        args = parsed(container)
        probes = [container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")]
        for probe in probes:
            if args.command in ("gateway", "serve"):
                assert probe["httpGet"]["path"] == "/health"
                assert probe["httpGet"]["path"] in routes
                assert named_ports(container)[probe["httpGet"]["port"]] == args.port
                # /health stays open to probes without an API key.
                assert not args.protect_health_metrics
            else:
                # grpc.health.v1 on the service's own port (gRPC probes take numbers only).
                assert probe["grpc"]["port"] == args.port


def prestop_seconds(container: dict) -> float:
    pre_stop = container.get("lifecycle", {}).get("preStop")
    if pre_stop is None:
        return 0.0
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return float(command[1])


def test_grace_period_outlasts_prestop_and_the_drain():
    for workload in workloads(MAIN + EXTENSION):
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"]:
            args = parsed(container)
            if args.command in ("gateway", "serve"):
                # Endpoints stop sending it traffic before SIGTERM starts the drain.
                assert prestop_seconds(container) > 0
            needed = prestop_seconds(container) + args.drain_seconds
            assert pod["terminationGracePeriodSeconds"] > needed, workload["metadata"]


def test_gateway_disruption_budget_keeps_one_serving():
    gateway = by_component(MAIN, "gateway")
    [budget] = [d for d in MAIN if d["kind"] == "PodDisruptionBudget"]
    assert selects(budget["spec"]["selector"]["matchLabels"], gateway)
    assert 1 <= budget["spec"]["minAvailable"] < gateway["spec"]["replicas"]


# -- secrets, volumes, image --------------------------------------------------------------------


def test_internal_token_comes_from_one_secret_never_a_literal():
    references = set()
    for container in containers(MAIN):
        env = {e["name"]: e for e in container["env"]}
        token = env[config.INTERNAL_TOKEN_ENV]
        assert "value" not in token
        ref = token["valueFrom"]["secretKeyRef"]
        assert not ref.get("optional", False)  # no pod runs without it
        references.add((ref["name"], ref["key"]))
    [(name, key)] = references
    for doc in MAIN + EXTENSION:
        assert doc["kind"] != "Secret"
    for container in containers(MAIN + EXTENSION):
        assert all("value" not in e for e in container.get("env", []))
        assert not {"--api-key", "--api-key-file"} & set(argv(container))
    # The containers page says how to create it.
    assert f"kubectl create secret generic {name} --from-literal={key}=" in CONTAINERS_DOC


def test_model_cache_is_a_volume_where_folio_cache_dir_points():
    cache_dir = re.search(r"FOLIO_CACHE_DIR=(\S+)", DOCKERFILE)[1]
    engine = one(MAIN, "StatefulSet", "folio-engine")
    [claim] = engine["spec"]["volumeClaimTemplates"]
    mounts = {m["mountPath"]: m["name"] for m in container_of(engine)["volumeMounts"]}
    assert mounts[cache_dir] == claim["metadata"]["name"]  # kept across restarts
    for workload in (by_component(MAIN, "tokenizer"), one(EXTENSION, "Deployment", "folio-serve")):
        mounts = {m["mountPath"]: m["name"] for m in container_of(workload)["volumeMounts"]}
        volumes = {v["name"] for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert mounts[cache_dir] in volumes


def test_pods_run_as_the_images_user_and_can_write_their_volumes():
    uid = int(re.search(r"useradd --uid (\d+)", DOCKERFILE)[1])
    for workload in workloads(MAIN + EXTENSION):
        security = workload["spec"]["template"]["spec"]["securityContext"]
        assert security["runAsNonRoot"] and security["runAsUser"] == uid
        if any("volumeMounts" in c for c in workload["spec"]["template"]["spec"]["containers"]):
            assert security["fsGroup"] == security["runAsGroup"]


def test_one_image_the_compose_image():
    images = {c["image"] for c in containers(MAIN + EXTENSION)}
    assert images == {service["image"] for service in COMPOSE["services"].values()}
    # ... the very image the compose smoke builds and runs: tagged with compose's image name,
    # from the repository's one Dockerfile (no second image definition anywhere).
    smoke = (ROOT / "deploy" / "compose-smoke.sh").read_text()
    assert re.search(r"^IMAGE=\$\(sed .*/docker-compose\.yml\"", smoke, re.MULTILINE)
    assert '-t "$IMAGE" "$ROOT"' in smoke  # the build's tag and context
    tracked = subprocess.run(
        ["git", "ls-files", "*Dockerfile*", "*Containerfile*"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert tracked == ["Dockerfile"]


def test_engine_startup_allows_the_first_starts_compile():
    """The engine's first start converts the model and compiles decode steps: its startup
    probe waits at least as long as the compose health check's start period, which the compose
    smoke sees met (liveness checks begin only after the startup probe passed)."""
    start_period = COMPOSE["services"]["engine"]["healthcheck"]["start_period"]
    minutes = re.fullmatch(r"(\d+)m", start_period)
    assert minutes, start_period
    [engine] = [c for c in containers(MAIN) if parsed(c).command == "engine"]
    probe = engine["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 60 * int(minutes[1])


def test_inference_pool_selects_whole_folio_serve_pods():
    pool = one(EXTENSION, "InferencePool", "folio")
    selector = pool["spec"]["selector"]["matchLabels"]
    [workload] = [w for w in workloads(EXTENSION) if selects(selector, w)]
    args = parsed(container_of(workload))
    # One engine per pod: the picker's vllm:* gauges read from /metrics are that engine's.
    assert args.command == "serve" and args.engine_replicas == 1
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [args.port]
    assert "/metrics" in {endpoint.path for endpoint in ENDPOINTS}
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] > 0


def test_the_docs_show_how_to_apply_them():
    assert "kubectl apply -f deploy/kubernetes/" in CONTAINERS_DOC
    assert "kubectl apply -f deploy/kubernetes/inference-extension/" in CONTAINERS_DOC
