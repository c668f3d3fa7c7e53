"""docker/k8s/leaderworkerset.yaml: the LeaderWorkerSet for several nodes, checked without a cluster.

The manifest is parsed as Kubernetes parses it (YAML aliases resolved) and checked against what
the image needs: the variables docker/entrypoint.sh reads, set on the leader and the workers from
the variables LWS injects; the leader's HTTP port and probes; group restart; grace periods that
fit the drain; and only HSDP_* names the server declares. The NetworkPolicy is evaluated as a
network plugin would, for connections from the group's pods and from any other pod, and the
group's secret must come from a Secret. The entrypoint is then run in dry-run
mode with the environment Kubernetes would give each pod, and its torchrun command parsed by
torchrun's own parser.
"""

from __future__ import annotations

import os
import re
import shlex

import pytest
import yaml

from tests.server_process import REPO
from tests.test_docker import COMPOSE, ENV_EXAMPLE, env_example_paragraphs, read, run_entrypoint

MANIFEST = os.path.join(REPO, "docker", "k8s", "leaderworkerset.yaml")

# What LWS puts at the front of every container's env (sigs.k8s.io/lws, pkg/utils/pod: AddLWSVariables;
# LWS_WORKER_INDEX since v0.6.0), with example values: group 0 of LeaderWorkerSet hsdp-serve in
# namespace default.
LWS_VARIABLES = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")
LEADER_ADDRESS = "hsdp-serve-0.hsdp-serve.default"

# Read by docker/entrypoint.sh itself, not by the server.
ENTRYPOINT_VARIABLES = {"HSDP_NNODES", "HSDP_NODE_RANK", "HSDP_MASTER_ADDR", "HSDP_MASTER_PORT"}
# docker/entrypoint.sh: HSDP_NNODES, HSDP_NODE_RANK, HSDP_MASTER_ADDR from the LWS variables.
FROM_LWS = {"HSDP_NNODES": "LWS_GROUP_SIZE", "HSDP_NODE_RANK": "LWS_WORKER_INDEX",
            "HSDP_MASTER_ADDR": "LWS_LEADER_ADDRESS"}
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
# Read by the server's ranks (server/group/launch.py), not options: the control plane's shared secret.
GROUP_SECRET_VARIABLES = {"HSDP_GROUP_SECRET", "HSDP_GROUP_SECRET_FILE"}
NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"


@pytest.fixture(scope="module")
def manifest() -> dict[str, dict]:
    """{kind: object} for the file's documents."""
    docs = [d for d in yaml.safe_load_all(read(MANIFEST)) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs) and set(by_kind) == {"LeaderWorkerSet", "Service", "NetworkPolicy"}, \
        [d["kind"] for d in docs]
    return by_kind


@pytest.fixture(scope="module")
def lws(manifest) -> dict:
    lws = manifest["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    return lws


def template(lws: dict, role: str) -> dict:
    return lws["spec"]["leaderWorkerTemplate"][f"{role}Template"]


def container(lws: dict, role: str) -> dict:
    (c,) = template(lws, role)["spec"]["containers"]  # one container: the server
    return c


def env_list(lws: dict, role: str) -> list[dict]:
    return container(lws, role)["env"]


def env_values(lws: dict, role: str) -> dict[str, str]:
    return {e["name"]: e["value"] for e in env_list(lws, role) if "value" in e}


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubernetes_env(lws: dict, role: str, lws_values: dict[str, str]) -> dict[str, str]:
    """The environment Kubernetes starts the container with: LWS's variables first (LWS prepends
    them), then the template's, each $(NAME) expanded from those defined before it ($$ is a $,
    an undefined reference stays as written)."""
    env: dict[str, str] = {}
    for name, value in [*lws_values.items(), *((e["name"], e.get("value")) for e in env_list(lws, role))]:
        if value is None:  # valueFrom: a Secret or the downward API, nothing the entrypoint reads
            continue
        env[name] = _REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)
    return env


def lws_values(worker_index: int, size: int) -> dict[str, str]:
    return {"LWS_LEADER_ADDRESS": LEADER_ADDRESS, "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(worker_index)}


def named_port(c: dict, port) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in c["ports"] if p.get("name") == port]
    return number


# --- the LeaderWorkerSet ------------------------------------------------------------------------


def test_group_restarts_as_one_and_workers_start_with_the_leader(lws):
    spec = lws["spec"]
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["leaderWorkerTemplate"]["size"] >= 2  # a leader and at least one worker
    assert spec.get("replicas", 1) >= 1
    # LeaderReady would create the workers only once the leader is ready, which it never is
    # without them
    assert spec.get("startupPolicy", "LeaderCreated") == "LeaderCreated"


@pytest.mark.parametrize("role", ["leader", "worker"])
def test_each_pod_gets_its_node_rank_from_lws(lws, role):
    env = env_values(lws, role)
    for ours, theirs in FROM_LWS.items():
        assert env.get(ours) == f"$({theirs})", (role, ours, env.get(ours))
    assert env.get("HSDP_MASTER_PORT", "29500").isdigit()
    assert env.get("HSDP_DEVICE") == "cuda" and env.get("HSDP_MODEL")
    # every value a string (the API refuses numbers), every name once
    assert all(isinstance(e.get("value", ""), str) for e in env_list(lws, role)), env_list(lws, role)
    names = [e["name"] for e in env_list(lws, role)]
    assert len(names) == len(set(names)), names
    assert not set(names) & set(LWS_VARIABLES)  # LWS sets those; ours would replace nothing, confuse much


def test_leader_and_workers_run_the_same_server(lws):
    leader, worker = container(lws, "leader"), container(lws, "worker")
    assert leader["env"] == worker["env"]  # every rank reads the same settings
    assert leader["image"] == worker["image"]
    for c in (leader, worker):
        assert "command" not in c and "args" not in c  # the image's entrypoint, docker/entrypoint.sh
    assert leader["resources"] == worker["resources"]
    assert leader["volumeMounts"] == worker["volumeMounts"]
    assert template(lws, "leader")["spec"]["volumes"] == template(lws, "worker")["spec"]["volumes"]


def test_leader_serves_http_with_the_three_probes(lws):
    c = container(lws, "leader")
    port = int(env_values(lws, "leader").get("HSDP_PORT") or 8000)
    assert port in [p["containerPort"] for p in c["ports"]]
    paths = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert named_port(c, get["port"]) == port, probe
        paths[probe] = get["path"]
    assert paths == {"startupProbe": "/ready", "livenessProbe": "/health", "readinessProbe": "/ready"}
    startup = c["startupProbe"]
    # a large checkpoint takes minutes to load: at least the compose healthcheck's 600 s
    assert startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3) >= 600
    # the probe answers in a few seconds under load; the Kubernetes default timeout is 1 s
    assert c["livenessProbe"].get("timeoutSeconds", 1) >= 4


def test_workers_have_no_http_probes(lws):
    c = container(lws, "worker")  # only node rank 0 listens
    assert not {"startupProbe", "livenessProbe", "readinessProbe"} & set(c)
    assert not any(p.get("containerPort") == 8000 for p in c.get("ports", []))


@pytest.mark.parametrize("role", ["leader", "worker"])
def test_grace_period_fits_the_drain(lws, role):
    spec = template(lws, role)["spec"]
    env = env_values(lws, role)
    shutdown_s = float(env.get("HSDP_SHUTDOWN_TIMEOUT") or 30)
    # torchrun waits this long for its ranks after SIGTERM, then kills them (default 30 s): the
    # drain plus 15 s, as hsdp-serve's own launcher waits
    torchrun_s = float(env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or 30)
    assert torchrun_s >= shutdown_s + 15
    pre_stop = container(lws, role).get("lifecycle", {}).get("preStop", {})
    pre_stop_s = pre_stop.get("sleep", {}).get("seconds", 0)
    grace = spec["terminationGracePeriodSeconds"]
    assert grace > shutdown_s + 15  # as the compose file's stop_grace_period
    assert grace > pre_stop_s + torchrun_s  # the grace period counts from the preStop hook


@pytest.mark.parametrize("role", ["leader", "worker"])
def test_gpus_shared_memory_model_and_key(lws, role):
    c, spec = container(lws, role), template(lws, role)["spec"]
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]["name"]]
    assert shm["emptyDir"]["medium"] == "Memory"
    env = env_values(lws, role)
    model = mounts[env["HSDP_MODEL"]]
    assert model.get("readOnly") is True
    key_file = env["HSDP_API_KEY_FILE"]
    (key_mount,) = [m for path, m in mounts.items() if key_file.startswith(path.rstrip("/") + "/")]
    secret = volumes[key_mount["name"]]["secret"]
    assert secret["secretName"] and key_mount.get("readOnly") is True
    assert [i["path"] for i in secret["items"]] == [os.path.relpath(key_file, key_mount["mountPath"])]
    assert "HSDP_API_KEY" not in env  # a key is never written into the manifest itself


def test_service_selects_the_leaders_http_port(manifest, lws):
    service = manifest["Service"]
    assert service["apiVersion"] == "v1" and service["spec"].get("type", "ClusterIP") == "ClusterIP"
    # LWS creates a headless Service named after the LeaderWorkerSet: this one must not collide
    assert service["metadata"]["name"] != lws["metadata"]["name"]
    assert service["spec"]["selector"] == {NAME_LABEL: lws["metadata"]["name"], WORKER_INDEX_LABEL: "0"}
    (port,) = service["spec"]["ports"]
    leader = container(lws, "leader")
    assert named_port(leader, port["targetPort"]) == int(env_values(lws, "leader").get("HSDP_PORT") or 8000)


def test_every_hsdp_name_is_one_the_server_or_entrypoint_reads():
    """Commented lines included: an operator uncomments them."""
    from server.config import ENVIRONMENT, OPTIONS, env_of

    assert ENTRYPOINT_VARIABLES | GROUP_SECRET_VARIABLES <= set(ENVIRONMENT)
    known = {env_of(f) for f in OPTIONS} | ENTRYPOINT_VARIABLES | GROUP_SECRET_VARIABLES
    used = set(re.findall(r"\bHSDP_[A-Z0-9_]+", read(MANIFEST)))
    assert ENTRYPOINT_VARIABLES - {"HSDP_MASTER_PORT"} <= used
    assert used <= known, used - known


def test_interface_variables_are_shown_and_passed_through():
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: in the manifest, documented in docker/.env.example,
    passed through by both compose services (empty when unset, which gloo and NCCL read as unset)."""
    from tests.test_docker import interpolate, set_in_env_example

    text = read(MANIFEST)
    compose = yaml.safe_load(interpolate(read(COMPOSE), set_in_env_example()))
    paragraphs = env_example_paragraphs()
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        assert re.search(rf"name: {name}\b", text), name
        assert name in paragraphs and f"#{name}=" in read(ENV_EXAMPLE)
        for service in ("hsdp-serve", "hsdp-serve-cpu"):
            assert compose["services"][service]["environment"][name] == "", (service, name)
        assert "${" + name + ":-}" in read(COMPOSE)


# --- the control plane: the NetworkPolicy and the group's secret --------------------------------


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # matchExpressions: not evaluated here
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _port_matches(rule_port: dict, port: int, name: str | None) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP":
        return False
    wanted = rule_port.get("port")
    end = rule_port.get("endPort")
    if wanted is None:
        return True
    if isinstance(wanted, str):
        return wanted == name
    return wanted <= port <= (end or wanted)


def admits(policy: dict, pod: dict[str, str], port: int, port_name: str | None, source: dict[str, str]) -> bool:
    """Whether ``policy`` lets a TCP connection from a pod labelled ``source`` (same namespace)
    reach ``port`` of a pod labelled ``pod``, as the NetworkPolicy API defines it: a pod no policy
    selects takes everything; a selected one only what some rule admits (no ``ports``: every port;
    no ``from``: every source)."""
    spec = policy["spec"]
    if not _selects(spec["podSelector"], pod) or "Ingress" not in spec.get("policyTypes", ["Ingress"]):
        return True
    for rule in spec.get("ingress", []):
        ports = rule.get("ports")
        if ports is not None and not any(_port_matches(p, port, port_name) for p in ports):
            continue
        peers = rule.get("from")
        if peers is None:
            return True
        for peer in peers:
            assert set(peer) == {"podSelector"}, peer  # no namespaceSelector, no ipBlock: this namespace's pods
            if _selects(peer["podSelector"], source):
                return True
    return False


def test_network_policy_keeps_the_group_ports_to_the_groups_pods(manifest, lws):
    policy = manifest["NetworkPolicy"]
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    name = lws["metadata"]["name"]
    leader, worker = container(lws, "leader"), container(lws, "worker")
    # what LWS labels each pod with (the role's own labels, and the LeaderWorkerSet's name)
    pods = {role: {**template(lws, role)["metadata"]["labels"], NAME_LABEL: name} for role in ("leader", "worker")}
    http = int(env_values(lws, "leader").get("HSDP_PORT") or 8000)
    store = int(env_values(lws, "leader").get("HSDP_MASTER_PORT") or 29500)
    assert named_port(leader, "rendezvous") == store
    stranger = {"app": "anything-else"}
    other_lws = {NAME_LABEL: name + "-other", "app.kubernetes.io/name": "hsdp-serve"}
    # gloo and NCCL listen on ports they pick: any port but the API's is the group's
    group_ports = [store, 1024, 29501, 45678, 65535]
    for role, pod in pods.items():
        c = leader if role == "leader" else worker
        for port in group_ports:
            assert admits(policy, pod, port, None, pods["leader"]), (role, port)
            assert admits(policy, pod, port, None, pods["worker"]), (role, port)
            assert not admits(policy, pod, port, None, stranger), (role, port)
            assert not admits(policy, pod, port, None, other_lws), (role, port)
        http_name = next((p["name"] for p in c.get("ports", []) if p["containerPort"] == http), None)
        assert admits(policy, pod, http, http_name, stranger) == (role == "leader"), role  # the API, as today
    # the Service's clients reach the leader's API through the policy
    assert admits(policy, pods["leader"], http, "http", {})


def test_the_group_secret_comes_from_a_secret(lws):
    for role in ("leader", "worker"):
        (entry,) = [e for e in env_list(lws, role) if e["name"] == "HSDP_GROUP_SECRET"]
        assert "value" not in entry  # never written into the manifest itself
        ref = entry["valueFrom"]["secretKeyRef"]
        assert ref["name"] and ref["key"] and not ref.get("optional", False)
    # the top of the file says how to create it
    text = read(MANIFEST)
    assert f"kubectl create secret generic {ref['name']} --from-literal={ref['key']}=" in text


# --- the entrypoint with the environment each pod gets ----------------------------------------


@pytest.mark.parametrize("role,worker_index", [("leader", 0), ("worker", 1)])
def test_entrypoint_starts_torchrun_with_the_pods_node_rank(lws, role, worker_index):
    from torch.distributed.run import get_args_parser

    from server.config import unknown_variables

    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    if role == "worker":
        worker_index = size - 1  # the last worker
    env = kubernetes_env(lws, role, lws_values(worker_index, size))
    assert unknown_variables(env) == []  # the server would warn about nothing
    r = run_entrypoint({k: v for k, v in env.items() if k not in LWS_VARIABLES})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    argv = shlex.split(r.stdout)
    assert argv[0] == "torchrun", argv
    args = get_args_parser().parse_args(argv[1:])
    assert (args.nnodes, args.node_rank, args.master_addr) == (str(size), worker_index, LEADER_ADDRESS)
    assert args.master_port == int(env.get("HSDP_MASTER_PORT", 29500))
    assert args.nproc_per_node == "gpu"  # HSDP_NPROC_PER_NODE auto on cuda: one rank per GPU of the pod
    assert args.module and args.training_script == "server" and args.training_script_args == []


def test_the_settings_parse(lws, tmp_path):
    """The server's variables as a pod gets them, through the server's own parser."""
    from server.config import parse_serve_config

    env = kubernetes_env(lws, "worker", lws_values(1, 2))
    key = tmp_path / "api-key"
    key.write_text("k3y\n")
    env["HSDP_API_KEY_FILE"] = str(key)  # the Secret's file, here
    cfg = parse_serve_config([], environ=env)
    assert cfg.api_key == "k3y" and cfg.device == "cuda" and cfg.model == env["HSDP_MODEL"]
    assert cfg.shutdown_timeout_s == float(env.get("HSDP_SHUTDOWN_TIMEOUT") or 30)


def test_kubernetes_env_expansion_is_kubernetes():
    """The helper above: $(NAME) from earlier variables only, $$ escapes, unknown names stay."""
    lws = {"spec": {"leaderWorkerTemplate": {"workerTemplate": {"spec": {"containers": [{"env": [
        {"name": "A", "value": "$(LWS_GROUP_SIZE)-$(B)"}, {"name": "B", "value": "b"},
        {"name": "C", "value": "$$(B)$(B)"}, {"name": "D", "valueFrom": {"secretKeyRef": {}}},
    ]}]}}}}}
    env = kubernetes_env(lws, "worker", {"LWS_GROUP_SIZE": "3"})
    assert env == {"LWS_GROUP_SIZE": "3", "A": "3-$(B)", "B": "b", "C": "$(B)b"}
