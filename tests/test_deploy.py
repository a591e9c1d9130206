"""The deployment recipes (deploy/): Kubernetes manifests and the container recipe, checked without a cluster or
an image build (neither is available here; docs/deploy.md says what that leaves unchecked).

* Every manifest of both kustomizations (deploy/kubernetes: GPU workers; deploy/kubernetes/cpu: CPU ones), as
  kustomize would build them, validates against the Kubernetes schemas offline (kubernetes-validate, strict).
* Everything refers to something that exists: Service selectors and targetPorts, probe ports, the autoscaler's
  and disruption budget's targets, ConfigMap keys, volumes; the Secrets are the ones docs/deploy.md creates.
* Each container's command line (the image's ENTRYPOINT plus the container's args, after Kubernetes expands
  $(VAR) from the container's env) parses with the project's own click CLI, with the Secrets and volumes laid out
  as the kubelet would mount them.
* The CPU kustomization's pods, run for real (their command lines, their mounts, their Service names) on one
  network namespace standing in for a node: the probes answer on their paths and ports, the metric the
  autoscaler scales on is served where Prometheus is told to scrape, and a completion goes through.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import click
import jsonschema
import kubernetes_validate
import pytest
import yaml

from netlab import Lan
from scripts.cli import main as tinyloop_cli

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
KUSTOMIZATIONS = [DEPLOY / "kubernetes", DEPLOY / "kubernetes" / "cpu"]
POOL = DEPLOY / "kubernetes" / "inference-pool"  # replicas for a cluster scheduler (docs/deploy.md, "Routed by ...")
POOL_CRD = POOL / "crd" / "inference.networking.k8s.io_inferencepools.yaml"
KUBERNETES_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]  # the oldest still common, the newest
CLUSTER_SCOPED = {"Namespace"}
POD_NAME, NAMESPACE, POD_IP = "tinyloop-pod-0", "tinyloop", "10.1.2.3"
API_KEY = "test-key"


# ----------------------------------------------------------------------------- kustomize, the part used here


def json_patch(doc: dict, ops: list[dict]) -> None:
    """RFC 6902 `replace`, `remove` and `test` (the ops these kustomizations use) on `doc`."""
    for op in ops:
        assert op["op"] in ("replace", "remove", "test"), op
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        key = int(last) if isinstance(node, list) else last
        node[key]  # noqa: B018 - both need the target to exist (KeyError here, as kustomize fails)
        if op["op"] == "test":  # kustomize fails the build when the value is not the one named
            assert node[key] == op["value"], (op, node[key])
        elif op["op"] == "remove":
            del node[key]
        else:
            node[key] = op["value"]


def set_images(doc: dict, images: list[dict]) -> None:
    pod = pod_spec(doc)
    for c in [*pod.get("initContainers", []), *pod["containers"]] if pod else []:
        name, _, tag = c["image"].partition(":")
        for image in images:
            if image["name"] == name:
                c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


def kustomize(directory: Path) -> list[dict]:
    """What `kustomize build directory` gives for the fields these kustomizations use (and only those)."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(k) <= {"apiVersion", "kind", "namespace", "resources", "images", "patches"}, sorted(k)
    docs: list[dict] = []
    for resource in k["resources"]:
        path = directory / resource
        docs += kustomize(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in k.get("patches", []):
        targets = [d for d in docs if d["kind"] == patch["target"]["kind"]
                   and d["metadata"]["name"] == patch["target"]["name"]]
        assert len(targets) == 1, patch["target"]
        json_patch(targets[0], yaml.safe_load(patch["patch"]))
    for doc in docs:
        set_images(doc, k.get("images", []))
        if "namespace" in k and doc["kind"] not in CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = k["namespace"]
    return docs


def pod_spec(doc: dict) -> dict | None:
    return doc["spec"]["template"]["spec"] if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet") else None


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, (kind, name)
    return found[0]


@pytest.fixture(scope="module", params=KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DEPLOY)))
def docs(request) -> list[dict]:
    return kustomize(request.param)


# ----------------------------------------------------------------------------- the schemas


def test_every_manifest_validates_against_the_kubernetes_schemas(docs):
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Namespace", "PersistentVolumeClaim",
                     "PodDisruptionBudget", "Service"], kinds
    for doc in docs:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), names


def test_the_validator_would_catch_a_misspelt_field(docs):
    worker = copy.deepcopy(one(docs, "Deployment", "tinyloop-worker"))
    pod_spec(worker)["containers"][0]["argz"] = pod_spec(worker)["containers"][0].pop("args")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, KUBERNETES_VERSIONS[-1], strict=True)


# ----------------------------------------------------------------------------- references


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def selected_pods(docs: list[dict], selector: dict) -> list[dict]:
    return [d for d in docs if pod_spec(d) and labels_match(selector, d["spec"]["template"]["metadata"]["labels"])]


def container_port(pod: dict, name_or_number) -> int:
    ports = [p for c in pod_spec(pod)["containers"] for p in c.get("ports", [])]
    hits = [p["containerPort"] for p in ports if name_or_number in (p.get("name"), p["containerPort"])]
    assert len(hits) == 1, (pod["metadata"]["name"], name_or_number)
    return hits[0]


def test_services_select_pods_and_reach_their_ports(docs):
    for service in find(docs, "Service"):
        pods = selected_pods(docs, service["spec"]["selector"])
        assert len(pods) == 1, service["metadata"]["name"]
        for port in service["spec"]["ports"]:
            container_port(pods[0], port["targetPort"])
    for deployment in find(docs, "Deployment"):
        assert labels_match(deployment["spec"]["selector"]["matchLabels"],
                            deployment["spec"]["template"]["metadata"]["labels"])


def test_probes_ports_and_scrape_annotations_name_real_container_ports(docs):
    for deployment in find(docs, "Deployment"):
        annotations = deployment["spec"]["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            container_port(deployment, int(annotations["prometheus.io/port"]))
        for c in pod_spec(deployment)["containers"]:
            for probe in (c.get("livenessProbe"), c.get("readinessProbe")):
                if probe:
                    container_port(deployment, (probe.get("httpGet") or probe.get("tcpSocket"))["port"])
    broker = pod_spec(one(docs, "Deployment", "tinyloop-broker"))["containers"][0]
    assert broker["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert broker["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_autoscaler_and_disruption_budget_target_the_workers(docs):
    workers = one(docs, "Deployment", "tinyloop-worker")
    hpa = one(docs, "HorizontalPodAutoscaler", "tinyloop-worker")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tinyloop-worker"}
    assert "replicas" not in workers["spec"], "the autoscaler owns the workers' replica count"
    assert selected_pods(docs, one(docs, "PodDisruptionBudget", "tinyloop-worker")["spec"]["selector"]["matchLabels"]) \
        == [workers]
    assert one(docs, "Deployment", "tinyloop-broker")["spec"]["strategy"] == {"type": "Recreate"}  # never two brokers


def test_the_autoscaler_metric_is_the_one_the_prometheus_adapter_serves(docs):
    adapter = yaml.safe_load((DEPLOY / "prometheus-adapter-values.yaml").read_text())
    served = {rule["name"]["as"]: rule["seriesQuery"] for rule in adapter["rules"]["external"]}
    metrics = [m["external"]["metric"]["name"] for m in one(docs, "HorizontalPodAutoscaler", "tinyloop-worker")
               ["spec"]["metrics"]]
    assert metrics == ["tinyloop_queue_depth"]
    for name in metrics:
        assert served[name].startswith(name + "{"), served  # the series of that very name (served: test_pods_...)


def test_config_secrets_and_claims_exist_or_are_the_documented_ones(docs):
    guide = (REPO / "docs" / "deploy.md").read_text()
    for deployment in find(docs, "Deployment"):
        pod = pod_spec(deployment)
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert ref["key"] in one(docs, "ConfigMap", ref["name"])["data"], ref
            volumes = {v["name"] for v in pod.get("volumes", [])}
            assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes
        for volume in pod.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                one(docs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
            if "secret" in volume:
                assert f"create secret generic {volume['secret']['secretName']} " in guide, volume


# ----------------------------------------------------------------------------- command lines


def dockerfile() -> dict:
    """ENTRYPOINT, USER, ENV and ARG of deploy/Dockerfile, and its RUN lines and COPY sources."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    info: dict = {"run": [], "copy": [], "env": {}, "arg": {}}
    for line in lines:
        word, _, rest = line.partition(" ")
        if word == "ENTRYPOINT":
            info["entrypoint"] = json.loads(rest)
        elif word == "USER":
            info["user"] = rest
        elif word == "RUN":
            info["run"].append(rest)
        elif word == "COPY":
            info["copy"] += rest.split()[:-1]
        elif word == "ENV":
            info["env"].update(dict(pair.split("=", 1) for pair in rest.split()))
        elif word == "ARG":
            name, _, default = rest.partition("=")
            info["arg"][name] = default
    return info


def quantity(text: str) -> float:
    """A Kubernetes quantity: 16Gi, 512Mi, 500m, 4."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "m": 1e-3}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text)).groups()
    return float(number) * units.get(unit, 1)


def env_value(env: dict, container: dict, configmaps: dict) -> str:
    """What the kubelet puts in one env variable."""
    if "value" in env:
        return env["value"]
    source = env["valueFrom"]
    if "fieldRef" in source:
        return {"metadata.name": POD_NAME, "metadata.namespace": NAMESPACE,
                "status.podIP": POD_IP}[source["fieldRef"]["fieldPath"]]
    if "configMapKeyRef" in source:
        return configmaps[source["configMapKeyRef"]["name"]][source["configMapKeyRef"]["key"]]
    ref = source["resourceFieldRef"]
    assert ref.get("containerName", container["name"]) == container["name"]
    kind, resource = ref["resource"].split(".", 1)
    return str(math.ceil(quantity(container["resources"][kind][resource]) / quantity(ref.get("divisor", "1"))))


def expand(text: str, env: dict) -> str:
    """Kubernetes' $(VAR) expansion in command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), text)


class Mounts:
    """A container's volumes laid out under `root` as the kubelet mounts them; host paths for container paths."""

    def __init__(self, root: Path, pod: dict, container: dict, secrets: dict, claims: dict):
        self.paths: dict[str, Path] = {}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            volume, target = volumes[mount["name"]], root / mount["name"]
            if "persistentVolumeClaim" in volume:
                target = claims[volume["persistentVolumeClaim"]["claimName"]]
            elif "secret" in volume:
                data = secrets[volume["secret"]["secretName"]]
                for item in volume["secret"].get("items") or [{"key": k, "path": k} for k in data]:
                    (target / item["path"]).parent.mkdir(parents=True, exist_ok=True)
                    (target / item["path"]).write_bytes(data[item["key"]])
            target.mkdir(parents=True, exist_ok=True)
            self.paths[mount["mountPath"]] = target

    def host_path(self, text: str) -> str:
        for mount_path in sorted(self.paths, key=len, reverse=True):
            if text == mount_path or text.startswith(mount_path + "/"):
                return str(self.paths[mount_path]) + text[len(mount_path):]
        return text


class Pod:
    """One container of a manifest as the kubelet would start it: argv (tinyloop ...) and env, paths on this host."""

    def __init__(self, docs: list[dict], deployment: str, root: Path, secrets: dict, claims: dict):
        doc = one(docs, "Deployment", deployment)
        self.doc, self.spec = doc, pod_spec(doc)
        self.container = self.spec["containers"][0]
        self.mounts = Mounts(root / deployment, self.spec, self.container, secrets, claims)
        self.inits = [Mounts(root / deployment, self.spec, c, secrets, claims)
                      for c in self.spec.get("initContainers", [])]
        configmaps = {c["metadata"]["name"]: c["data"] for c in find(docs, "ConfigMap")}
        env: dict[str, str] = {}
        for item in self.container.get("env", []):
            env[item["name"]] = expand(env_value(item, self.container, configmaps), env)
        self.env = {k: self.mounts.host_path(v) for k, v in env.items()}
        argv = [*dockerfile()["entrypoint"], *self.container.get("args", [])]
        self.argv = [self.mounts.host_path(expand(a, env)) for a in argv]
        assert not [a for a in self.argv if "$(" in a], self.argv

    def run_inits(self, image_paths: dict[str, Path]) -> None:
        """Run the init containers' commands, their paths in the image mapped to `image_paths` on this host."""
        for c, mounts in zip(self.spec.get("initContainers", []), self.inits):
            argv = [mounts.host_path(a) for a in c["command"]]
            for image_path, here in image_paths.items():
                argv = [str(here) + a[len(image_path):] if a.startswith(image_path) else a for a in argv]
            subprocess.run(argv, check=True, capture_output=True, timeout=60)

    def parse(self) -> tuple[str, dict]:
        """(subcommand, its parsed options): the project's click CLI parses the line, callbacks and checks included."""
        assert self.argv[0] == "tinyloop"
        name, *rest = self.argv[1:]
        command = tinyloop_cli.get_command(click.Context(tinyloop_cli), name)
        assert command is not None, f"no tinyloop command {name!r}"
        return name, command.make_context(name, rest).params


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> dict:
    """The Secrets as docs/deploy.md creates them: `kubectl create secret generic tinyloop-curve --from-file=KEYS`
    (the key directory's files) and tinyloop-api-keys with one key per line under `keys`."""
    keys = tmp_path_factory.mktemp("keys") / "curve"
    subprocess.run([sys.executable, "-m", "scripts.cli", "keys", str(keys)], cwd=REPO, check=True, capture_output=True,
                   timeout=60)
    curve = {p.name: p.read_bytes() for p in keys.iterdir() if p.is_file()}
    return {"tinyloop-curve": curve, "tinyloop-api-keys": {"keys": f"{API_KEY}\n".encode()}}


@pytest.fixture(scope="module")
def claims(tmp_path_factory) -> dict:
    """The models volume, holding the bundled model under the name config.yaml gives."""
    models = tmp_path_factory.mktemp("models")
    bundled = sorted((REPO / "tinyloop" / "data").glob("*.tinyloop"))  # package data (pyproject.toml)
    shutil.copy(bundled[0], models / "default.tinyloop")
    return {"tinyloop-models": models}


def test_the_image_runs_the_project_cli_as_a_non_root_user(docs):
    image = dockerfile()
    script = re.search(r'^tinyloop = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert image["entrypoint"] == ["tinyloop"] and script == "scripts.cli:main"  # the CLI these tests parse with
    uid, _, gid = image["user"].partition(":")
    assert int(uid) != 0 and int(gid) != 0
    assert "${TORCH}" in " ".join(image["run"]) and image["arg"]["TORCH"] == "cpu"  # a build argument picks the wheel
    for source in image["copy"]:
        assert (REPO / source).exists(), source
    kept = [l[1:] for l in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines() if l.startswith("!")]
    assert sorted(kept) == sorted(image["copy"])  # the build context holds what COPY takes
    for deployment in find(docs, "Deployment"):
        pod = pod_spec(deployment)
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == int(uid)
        for init in pod.get("initContainers", []):  # the kernels built into the image, where the image put them
            assert init["command"][:3] == ["cp", "-a", image["env"]["TINYLOOP_CACHE_DIR"] + "/."], init


def test_the_image_build_commands_parse_with_the_cli():
    for run in dockerfile()["run"]:
        for line in re.split(r"&&", run):
            words = line.split(">")[0].split()
            if words and words[0] == "tinyloop":
                words = [w.strip('"') for w in re.findall(r'"[^"]*"|\S+', " ".join(words))]
                command = tinyloop_cli.get_command(click.Context(tinyloop_cli), words[1])
                command.make_context(words[1], words[2:])


def test_every_container_command_line_parses_with_the_project_cli(docs, secrets, claims, tmp_path):
    gpu = "nvidia.com/gpu" in json.dumps(docs)
    parsed = {name: Pod(docs, name, tmp_path, secrets, claims).parse()
              for name in ("tinyloop-broker", "tinyloop-worker", "tinyloop-gateway")}
    assert [command for command, _ in parsed.values()] == ["broker", "worker", "gateway"]
    worker = parsed["tinyloop-worker"][1]
    limits = pod_spec(one(docs, "Deployment", "tinyloop-worker"))["containers"][0]["resources"]["limits"]
    assert worker["threads"] == quantity(limits["cpu"])
    if gpu:  # the plan lives in VRAM: its budget is the card's (the ConfigMap's vram-budget), not the host RAM limit
        card = one(docs, "ConfigMap", "tinyloop-worker")["data"]["vram-budget"]
        assert worker["vram_budget"] == quantity(card.replace("iB", "i")) > quantity(limits["memory"])
    else:  # the plan lives in RAM: the pod's memory limit
        assert worker["vram_budget"] == quantity(limits["memory"])
    assert worker["device"] == ("cuda" if gpu else "cpu") and worker["name"] == POD_NAME
    assert Path(worker["model_path"]).is_file()
    # Each pod holds only its role's CURVE keys: a gateway's stolen key cannot serve as a worker, nor the reverse.
    def curve_keys(deployment: str) -> set[str]:
        return {item["key"] for volume in pod_spec(one(docs, "Deployment", deployment))["volumes"]
                if volume.get("secret", {}).get("secretName") == "tinyloop-curve" for item in volume["secret"]["items"]}

    assert curve_keys("tinyloop-worker") == {"broker.key", "worker.key_secret"}
    assert curve_keys("tinyloop-gateway") == {"broker.key", "client.key_secret"}
    assert curve_keys("tinyloop-broker") == {"broker.key", "broker.key_secret", "client.key", "worker.key"}
    # The gateway: /metrics on its own port, which the public Service does not carry; HTTP liveness; and a rollout
    # that stops sending it requests (preStop) before SIGTERM, with time to finish them.
    gateway, gateway_pod = parsed["tinyloop-gateway"][1], one(docs, "Deployment", "tinyloop-gateway")
    assert container_port(gateway_pod, "metrics") == gateway["metrics_port"] != gateway["port"]
    public = [p["targetPort"] for p in one(docs, "Service", "tinyloop-gateway")["spec"]["ports"]]
    assert public == ["http"]
    container = pod_spec(gateway_pod)["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod_spec(gateway_pod)["terminationGracePeriodSeconds"] >= pause + 30  # uvicorn's graceful 30 s


def service_endpoint(docs: list[dict], url: str) -> int:
    """The container port a tcp://SERVICE:PORT a command line connects to ends at (the Service's port number
    must be that port too: a Service name stands for the pod's address in test_pods_...)."""
    host, port = re.fullmatch(r"tcp://([\w.-]+):(\d+)", url).groups()
    service = one(docs, "Service", host)
    match = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    assert len(match) == 1, url
    pod = selected_pods(docs, service["spec"]["selector"])[0]
    target = container_port(pod, match[0]["targetPort"])
    assert target == int(port), url
    return target


def test_what_workers_and_the_gateway_connect_to_is_what_the_broker_binds(docs, secrets, claims, tmp_path):
    broker = Pod(docs, "tinyloop-broker", tmp_path, secrets, claims).parse()[1]
    worker = Pod(docs, "tinyloop-worker", tmp_path, secrets, claims).parse()[1]
    gateway = Pod(docs, "tinyloop-gateway", tmp_path, secrets, claims).parse()[1]
    bound = lambda url: int(url.rsplit(":", 1)[1])  # noqa: E731
    assert service_endpoint(docs, worker["connect"]) == bound(broker["backend"])
    assert service_endpoint(docs, gateway["connect"]) == bound(broker["frontend"])
    broker_pod = one(docs, "Deployment", "tinyloop-broker")
    assert container_port(broker_pod, "metrics") == broker["metrics_port"]
    assert container_port(one(docs, "Deployment", "tinyloop-gateway"), "http") == gateway["port"]


# ----------------------------------------------------------------------------- the CPU pods, run


def get(url: str, headers: dict | None = None, body: dict | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {}, data=json.dumps(body).encode() if body else None)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError as err:
        return 0, str(err)


def probe(pod: Pod, node_ip: str, kind: str) -> bool:
    spec = pod.container[kind]
    port = container_port(pod.doc, (spec.get("httpGet") or spec["tcpSocket"])["port"])
    if "tcpSocket" in spec:
        try:
            socket.create_connection((node_ip, port), timeout=2).close()
            return True
        except OSError:
            return False
    return get(f"http://{node_ip}:{port}{spec['httpGet']['path']}")[0] == 200


def scrape_url(pod: Pod, node_ip: str) -> str:
    """Where Prometheus scrapes the pod, by its prometheus.io/* annotations."""
    annotations = pod.doc["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    return f"http://{node_ip}:{annotations['prometheus.io/port']}{annotations['prometheus.io/path']}"


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.1)


def test_the_cpu_pods_serve_their_probes_metrics_and_a_completion(secrets, claims, tmp_path):
    docs = kustomize(DEPLOY / "kubernetes" / "cpu")
    pods = {name: Pod(docs, name, tmp_path, secrets, claims)
            for name in ("tinyloop-worker", "tinyloop-broker", "tinyloop-gateway")}  # the worker first: it waits
    # What the image holds at TINYLOOP_CACHE_DIR (the kernels its build compiled): here, this machine's build of them.
    built = Path(os.environ.get("TINYLOOP_CACHE_DIR")
                 or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tinyloop")
    built.mkdir(parents=True, exist_ok=True)
    pods["tinyloop-worker"].run_inits({dockerfile()["env"]["TINYLOOP_CACHE_DIR"]: built})
    lan, procs = Lan(), []  # one namespace as the node; the Services' names stand for its address
    try:
        node = lan.host(1)
        node.hosts({s["metadata"]["name"]: node.ip for s in find(docs, "Service")})
        for name, pod in pods.items():
            env = {**os.environ, **pod.env, "HOME": str(tmp_path), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
            with open(tmp_path / f"{name}.log", "ab") as log:
                procs.append(subprocess.Popen(node.run([sys.executable, "-m", "scripts.cli", *pod.argv[1:]]), env=env,
                                              cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        broker, gateway = pods["tinyloop-broker"], pods["tinyloop-gateway"]
        wait_for(lambda: probe(broker, node.ip, "livenessProbe"), 30, "broker /healthz")
        wait_for(lambda: probe(broker, node.ip, "readinessProbe"), 60, "broker /readyz (a worker registered)")
        wait_for(lambda: probe(gateway, node.ip, "livenessProbe") and probe(gateway, node.ip, "readinessProbe"), 30,
                 "gateway probes")
        status, metrics = get(scrape_url(broker, node.ip))
        scaled_on = one(docs, "HorizontalPodAutoscaler", "tinyloop-worker")["spec"]["metrics"][0]["external"]["metric"]
        assert status == 200 and re.search(rf"^{scaled_on['name']} 0\.0$", metrics, re.M), metrics[:2000]
        assert re.search(r"^tinyloop_ready_workers 1\.0$", metrics, re.M)
        status, metrics = get(scrape_url(gateway, node.ip))
        assert status == 200 and "tinyloop_gateway_ready_workers 1.0" in metrics
        assert get(f"http://{node.ip}:{container_port(gateway.doc, 'http')}/metrics")[0] == 404  # not on the API port
        base = f"http://{node.ip}:{container_port(gateway.doc, 'http')}/v1"
        auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        model = json.loads(get(f"{base}/models", auth)[1])["data"][0]["id"]
        status, body = get(f"{base}/completions", auth, {"model": model, "prompt": "def add(a, b):", "max_tokens": 8})
        assert status == 200 and json.loads(body)["choices"][0]["text"], body
        assert get(f"{base}/models")[0] == 401  # the API key Secret is in force
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        lan.close()


# ----------------------------------------------------------------------------- the InferencePool


def strict_schema(schema: dict) -> dict:
    """A CRD's structural schema, strict as kubernetes-validate's are: an object with listed properties takes no others
    (the API server would prune them silently, which hides a misspelt field)."""
    schema = dict(schema)
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema["additionalProperties"] = False
    for key in ("properties",):
        if key in schema:
            schema[key] = {k: strict_schema(v) for k, v in schema[key].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            schema[key] = strict_schema(schema[key])
    return schema


def inference_pool_schema() -> dict:
    crd = yaml.safe_load(POOL_CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strict_schema(v1["schema"]["openAPIV3Schema"])


def test_the_inference_pool_manifests_validate_against_kubernetes_and_the_vendored_crd():
    docs = kustomize(POOL)
    assert sorted({d["kind"] for d in docs}) == ["ConfigMap", "Deployment", "InferencePool", "Role", "RoleBinding",
                                                 "Service", "ServiceAccount"]
    crd = yaml.safe_load(POOL_CRD.read_text())
    pool_schema = jsonschema.Draft202012Validator(inference_pool_schema())
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(crd, version, strict=True)  # the CRD itself is a valid object
        for doc in docs:
            if doc["kind"] == "InferencePool":
                assert doc["apiVersion"] == f"{crd['spec']['group']}/v1"
                pool_schema.validate(doc)
            else:
                kubernetes_validate.validate(doc, version, strict=True)
    misspelt = copy.deepcopy(one(docs, "InferencePool", "tinyloop"))
    misspelt["spec"]["targetPort"] = misspelt["spec"].pop("targetPorts")
    with pytest.raises(jsonschema.ValidationError):
        pool_schema.validate(misspelt)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_pool_routes_to_replicas_that_feed_its_picker_events_and_gauges(secrets, claims, tmp_path):
    from broker.metrics import BrokerMetrics
    from tinyloop.cache import BLOCK_TOKENS
    from workers.startup import served_model_name

    docs = kustomize(POOL)
    pool = one(docs, "InferencePool", "tinyloop")["spec"]
    replica = one(docs, "Deployment", "tinyloop-replica")
    assert selected_pods(docs, pool["selector"]["matchLabels"]) == [replica]
    command, serve = Pod(docs, "tinyloop-replica", tmp_path, secrets, claims).parse()
    assert command == "serve" and serve["n_workers"] == 1  # one worker per pod: what the picker picks is a worker
    # the scheduler sends the OpenAI request to the target port: the replica's gateway, listening beyond the pod
    assert [p["number"] for p in pool["targetPorts"]] == [serve["http_port"]] == [container_port(replica, "http")]
    assert serve["http_host"] == "0.0.0.0" and serve["metrics_host"] == "0.0.0.0"
    # the Gateway asks the picker through the Service the pool names, on a port the picker's container serves
    epp = one(docs, "Deployment", "tinyloop-epp")
    epp_args = pod_spec(epp)["containers"][0]["args"]
    ref = pool["endpointPickerRef"]
    assert service_endpoint(docs, f"tcp://{ref['name']}:{ref['port']['number']}") == int(flag(epp_args, "--grpc-port"))
    assert flag(epp_args, "--pool-name") == one(docs, "InferencePool", "tinyloop")["metadata"]["name"]

    # KV-cache events: the replica connects to the picker's Service, which leads to the port its scorer binds
    config = yaml.safe_load(one(docs, "ConfigMap", "tinyloop-epp")["data"]["epp.yaml"])
    (scorer,) = [p["parameters"] for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    bound = scorer["kvEventsConfig"]["zmqEndpoint"]
    assert bound.startswith("tcp://*:") and service_endpoint(docs, serve["kv_events_endpoint"]) == int(bound[8:])
    model_name = served_model_name(serve["model_path"])
    assert serve["kv_events_topic"] == f"kv@{POD_IP}@{model_name}"
    assert serve["kv_events_topic"].startswith(scorer["kvEventsConfig"]["topicFilter"])
    # the picker hashes prompts as the workers hash their blocks: same block size, same seed
    assert scorer["tokenProcessorConfig"] == {"blockSize": BLOCK_TOKENS, "hashSeed": serve["kv_events_seed"]}
    assert scorer["indexerConfig"]["tokenizersPoolConfig"]["modelName"] == model_name
    guide = (REPO / "docs" / "deploy.md").read_text()
    tokenizers = [v for v in pod_spec(epp)["volumes"] if v["name"] == "tokenizers"][0]["configMap"]["name"]
    assert f"create configmap {tokenizers} " in guide  # made by hand, as the guide says

    # the gauges: scraped on the replicas' metrics port, under names the broker serves
    assert int(flag(epp_args, "--model-server-metrics-port")) == serve["metrics_port"] \
        == container_port(replica, "metrics")
    served = {m.name for m in BrokerMetrics().registry.collect()}
    for option in ("--total-queued-requests-metric", "--total-running-requests-metric",
                   "--kv-cache-usage-percentage-metric"):
        assert flag(epp_args, option) in served, option
    used = [p["pluginRef"] for p in config["schedulingProfiles"][0]["plugins"]]
    assert sorted(used) == sorted(p["type"] for p in config["plugins"] if p["type"] != "single-profile-handler")
