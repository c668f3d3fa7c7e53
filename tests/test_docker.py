"""docker/: the compose file, the entrypoint and the Dockerfile, checked without a Docker engine.

The compose file is validated by ``docker compose config`` where a Compose CLI works, and always
against the Compose Specification's JSON schema (the copy check-jsonschema ships), both as written
and after interpolating docker/.env.example the way Compose does. The entrypoint is run for real
on CPU ranks and serves; the Dockerfile's install step is run against an environment that already
has torch, as the PyTorch base image does.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import site
import subprocess
import sys
import textwrap

import pytest
import yaml

from tests.checkpoints import PROMPTS, reference_generate, write_checkpoint
from tests.server_process import REPO, ServerProcess, free_port, wait_session_gone

DOCKER = os.path.join(REPO, "docker")
COMPOSE = os.path.join(DOCKER, "docker-compose.yml")
ENV_EXAMPLE = os.path.join(DOCKER, ".env.example")
ENTRYPOINT = os.path.join(DOCKER, "entrypoint.sh")
DOCKERFILE = os.path.join(DOCKER, "Dockerfile")

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def env_example() -> dict[str, str]:
    """docker/.env.example's assignments, commented-out ones included (documented, not set)."""
    values = {}
    for line in read(ENV_EXAMPLE).splitlines():
        m = re.match(r"#?([A-Z][A-Z0-9_]*)=(.*)$", line.strip())
        if m:
            values[m.group(1)] = m.group(2)
    return values


def set_in_env_example() -> dict[str, str]:
    return {k: v for k, v in env_example().items() if f"\n{k}=" in "\n" + read(ENV_EXAMPLE)}


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution, ${V}, ${V:-default}, ${V-default}, ${V:?err}, ${V?err}, applied
    as Compose applies it: to the string values of the parsed file. Returns the file as YAML again."""

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        value = env.get(name)
        empty = value is None or (op is not None and op.startswith(":") and value == "")
        if op is None:
            return value or ""
        if op.endswith("-"):
            return arg if empty else value
        if empty:
            raise ValueError(f"required variable {name}: {arg}")
        return value

    def walk(node):
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return _VAR.sub(sub, node) if isinstance(node, str) else node

    return yaml.safe_dump(walk(yaml.safe_load(text)), sort_keys=False)


def compose_variables(text: str) -> set[str]:
    return {m.group(1) for m in _VAR.finditer(text)}


def validate_against_compose_spec(path) -> None:
    r = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                        str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def compose_cli() -> list[str] | None:
    """A Compose CLI that runs here (`config` needs no engine), or None."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) and subprocess.run([*cmd, "version"], capture_output=True).returncode == 0:
            return cmd
    return None


def two_node_example() -> str:
    """The commented two-node service at the end of the compose file, uncommented."""
    text = read(COMPOSE)
    block = text[text.index("#  hsdp-serve-node:"):]
    return "\n".join(line[1:] if line.startswith("#") else line for line in block.splitlines())


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(interpolate(read(COMPOSE), set_in_env_example()))


# --- docker-compose.yml ---------------------------------------------------------------------------


def test_compose_file_is_valid_as_written_and_interpolated(tmp_path):
    validate_against_compose_spec(COMPOSE)
    interpolated = tmp_path / "compose.yml"
    interpolated.write_text(interpolate(read(COMPOSE), set_in_env_example()))
    validate_against_compose_spec(interpolated)
    cli = compose_cli()
    if cli is not None:  # the real parser too, where one is installed
        shutil.copy(ENV_EXAMPLE, tmp_path / ".env")
        r = subprocess.run([*cli, "-f", COMPOSE, "--env-file", str(tmp_path / ".env"), "--profile", "cpu",
                            "config", "-q"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr


def test_the_commented_two_node_example_is_a_valid_service(tmp_path):
    text = read(COMPOSE)
    services_end = text.index("\nvolumes:")
    with_example = text[:services_end] + "\n" + two_node_example() + text[services_end:]
    env = dict(set_in_env_example(), HSDP_NODE_RANK="0", HSDP_MASTER_ADDR="10.0.0.1")
    (tmp_path / "compose.yml").write_text(interpolate(with_example, env))
    validate_against_compose_spec(tmp_path / "compose.yml")
    node = yaml.safe_load((tmp_path / "compose.yml").read_text())["services"]["hsdp-serve-node"]
    assert node["network_mode"] == "host" and "ports" not in node
    assert str(node["environment"]["HSDP_NNODES"]) == "2" and str(node["environment"]["HSDP_NODE_RANK"]) == "0"


def test_gpu_service_reserves_gpus_and_sets_nccl_limits(compose):
    gpu = compose["services"]["hsdp-serve"]
    assert "profiles" not in gpu  # the default service
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "${HSDP_GPU_COUNT" in read(COMPOSE) and str(device["count"]) == env_example()["HSDP_GPU_COUNT"]
    assert gpu["ipc"] == "host"
    assert gpu["ulimits"]["memlock"] == -1
    assert gpu["environment"]["HSDP_DEVICE"] == "cuda"
    assert {"NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE"} <= set(gpu["environment"])


def test_model_is_mounted_read_only_and_never_created(compose):
    for name in ("hsdp-serve", "hsdp-serve-cpu"):
        (mount,) = [v for v in compose["services"][name]["volumes"] if isinstance(v, dict)]
        assert mount["target"] == "/models" and mount["read_only"] is True
        assert mount["bind"]["create_host_path"] is False
    # the default source exists, so the cpu profile works with no checkpoint at all
    assert os.path.isdir(os.path.join(DOCKER, "models"))


def test_healthcheck_restart_and_grace_period(compose):
    shutdown_s = float(env_example().get("HSDP_SHUTDOWN_TIMEOUT") or 30)
    for service in compose["services"].values():
        check = service["healthcheck"]
        assert check["test"][:2] == ["CMD", "python"] and check["test"][-1] == "/health"
        assert seconds(check["start_period"]) >= 300  # loading a large checkpoint takes minutes
        assert service["restart"] == "unless-stopped"
        # the drain (--shutdown-timeout) plus the launcher's 15 s for its ranks must fit
        assert seconds(service["stop_grace_period"]) > shutdown_s + 15
        assert service["init"] is True and service["stop_signal"] == "SIGTERM"


def test_cpu_profile_runs_the_same_image_on_cpu(compose):
    gpu, cpu = compose["services"]["hsdp-serve"], compose["services"]["hsdp-serve-cpu"]
    assert cpu["profiles"] == ["cpu"] and cpu["image"] == gpu["image"] and cpu["build"] == gpu["build"]
    assert cpu["environment"]["HSDP_DEVICE"] == "cpu" and "deploy" not in cpu
    assert cpu["environment"]["HSDP_MODEL"] == ""  # the demo checkpoint by default


def env_example_paragraphs() -> dict[str, str]:
    """{variable: the paragraph of docker/.env.example that documents it}."""
    out = {}
    for paragraph in read(ENV_EXAMPLE).split("\n\n"):
        for m in re.finditer(r"^#?([A-Z][A-Z0-9_]*)=", paragraph, re.M):
            out[m.group(1)] = paragraph
    return out


def test_every_option_is_documented_and_passed_through():
    """docker/.env.example and the compose file, checked against the one declaration of the options."""
    from server.config import ENVIRONMENT, OPTIONS, env_of, flag_of

    paragraphs = env_example_paragraphs()
    compose_text = read(COMPOSE)
    for f in OPTIONS:
        assert env_of(f) in paragraphs, f"{env_of(f)} is not in docker/.env.example"
        assert f"[{flag_of(f)}]" in paragraphs[env_of(f)], f"{env_of(f)}'s paragraph does not name {flag_of(f)}"
    hsdp_documented = {name for name in paragraphs if name.startswith("HSDP_")}
    known = {env_of(f) for f in OPTIONS} | set(ENVIRONMENT) | compose_variables(compose_text)
    assert hsdp_documented <= known, hsdp_documented - known  # nothing documented that nothing reads
    assert compose_variables(compose_text) <= set(paragraphs)
    environment = yaml.safe_load(compose_text)["x-hsdp-environment"]
    set_by_services = {"HSDP_MODEL", "HSDP_DEVICE", "HSDP_HOST"}  # per service, or by the image
    assert {env_of(f) for f in OPTIONS} - set_by_services <= set(environment)
    for paragraph in read(ENV_EXAMPLE).split("\n\n"):  # each variable in a paragraph with prose in it
        lines = paragraph.strip().splitlines()
        prose = [line for line in lines if line.startswith("# ")]
        assert prose or not lines, paragraph


def test_the_docs_document_every_option():
    from server.config import OPTIONS, env_of, flag_of, render_options_markdown

    options = read(os.path.join(REPO, "docs", "options.md"))
    assert render_options_markdown() in options  # regenerate with `python -m server.config`
    for f in OPTIONS:
        assert flag_of(f) in options and env_of(f) in options


# --- the server's variables and docker/entrypoint.sh ------------------------------------------------


def test_every_variable_sets_its_flag_and_flags_win(tmp_path):
    from server.config import parse_serve_config

    values = {
        "HSDP_MODEL": str(tmp_path), "HSDP_REVISION": "v1", "HSDP_SERVED_MODEL_NAME": "mine",
        "HSDP_NPROC_PER_NODE": "4", "HSDP_REPLICATE_SIZE": "2",
        "HSDP_SHARD_SIZE": "2", "HSDP_DEVICE": "cpu", "HSDP_DTYPE": "bfloat16", "HSDP_READ_MODE": "full",
        "HSDP_HOST": "0.0.0.0", "HSDP_PORT": "9001", "HSDP_LOG_LEVEL": "debug",
        "HSDP_MAX_CONCURRENT_REQUESTS": "7", "HSDP_MAX_QUEUED_REQUESTS": "8", "HSDP_MAX_INPUT_TOKENS": "100",
        "HSDP_MAX_TOTAL_TOKENS": "200", "HSDP_MAX_BODY_BYTES": "4096", "HSDP_STEP_TIMEOUT": "11",
        "HSDP_SHUTDOWN_TIMEOUT": "12", "HSDP_COLLECTIVE_TIMEOUT": "13", "HSDP_API_KEY": "s3cret",
        "HSDP_PREFETCH_DEPTH": "3", "HSDP_RESIDENT_UNITS": "all", "HSDP_ALL_GATHER": "group",
    }
    cfg = parse_serve_config(["--max-queued-requests", "9"], environ=values)  # a flag beats its variable
    assert (cfg.model, cfg.revision, cfg.served_model_name) == (str(tmp_path), "v1", "mine")
    assert (cfg.nproc_per_node, cfg.replicate_size, cfg.shard_size) == (4, 2, 2)
    assert (cfg.device, cfg.dtype, cfg.read_mode, cfg.host, cfg.port, cfg.log_level) == (
        "cpu", "bfloat16", "full", "0.0.0.0", 9001, "debug")
    assert (cfg.max_concurrent_requests, cfg.max_queued_requests, cfg.max_input_tokens, cfg.max_total_tokens,
            cfg.max_body_bytes) == (7, 9, 100, 200, 4096)
    assert (cfg.step_timeout_s, cfg.shutdown_timeout_s, cfg.collective_timeout_s) == (11, 12, 13)
    assert (cfg.prefetch_depth, cfg.resident_units, cfg.all_gather, cfg.api_key) == (3, -1, "group", "s3cret")
    assert parse_serve_config([], environ={"HSDP_PORT": ""}).port == 8000  # empty: the default


def test_a_bad_variable_is_a_usage_error_naming_it(capsys):
    from server.config import parse_serve_config

    for name, value in (("HSDP_DTYPE", "fp8"), ("HSDP_PORT", "eighty"), ("HSDP_RESIDENT_UNITS", "some")):
        with pytest.raises(SystemExit) as e:
            parse_serve_config([], environ={name: value})
        assert e.value.code == 2 and f"{name}={value!r}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_serve_config([], environ={"HSDP_API_KEY": "s3cr3t-key", "HSDP_MAX_BODY_BYTES": "0"})
    assert "s3cr3t-key" not in capsys.readouterr().err


def test_the_key_comes_from_a_file(tmp_path, capsys):
    from server.config import parse_serve_config

    (tmp_path / "key").write_text("from-file\n")
    cfg = parse_serve_config([], environ={"HSDP_API_KEY": "env", "HSDP_API_KEY_FILE": str(tmp_path / "key")})
    assert cfg.api_key == "from-file"
    with pytest.raises(SystemExit):
        parse_serve_config(["--api-key-file", str(tmp_path / "missing")], environ={})
    assert "--api-key-file" in capsys.readouterr().err


def test_unknown_variables_are_named():
    from server.config import unknown_variables

    env = {"HSDP_MODLE": "/models", "HSDP_MODEL": "/models", "HSDP_CACHE_DIR": "/c", "HSDP_NNODES": "1", "HOME": "/"}
    assert unknown_variables(env) == ["HSDP_MODLE"]


def run_entrypoint(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HSDP_")}
    return subprocess.run(["bash", ENTRYPOINT, *args], env={**clean, "HSDP_DRY_RUN": "1", **env},
                          capture_output=True, text=True, timeout=30)


def test_entrypoint_passes_arguments_and_nothing_else():
    r = run_entrypoint({"HSDP_PORT": "9001", "HSDP_API_KEY": "s3cret"}, "--max-queued-requests", "9")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert shlex.split(r.stdout) == ["hsdp-serve", "--max-queued-requests", "9"]  # the server reads HSDP_*


def test_entrypoint_starts_torchrun_on_several_nodes():
    from torch.distributed.run import get_args_parser

    r = run_entrypoint({"HSDP_NNODES": "2", "HSDP_NODE_RANK": "1", "HSDP_MASTER_ADDR": "10.0.0.1",
                        "HSDP_DEVICE": "cpu", "HSDP_REPLICATE_SIZE": "2"}, "--port", "9000")
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout)
    assert argv[0] == "torchrun"
    args = get_args_parser().parse_args(argv[1:])
    assert (args.nnodes, args.nproc_per_node, args.node_rank, args.master_addr, args.master_port) == (
        "2", "2", 1, "10.0.0.1", 29500)
    assert args.module and args.training_script == "server"
    assert args.training_script_args == ["--port", "9000"]
    for missing in ("HSDP_NODE_RANK", "HSDP_MASTER_ADDR"):
        env = {"HSDP_NNODES": "2", "HSDP_NODE_RANK": "0", "HSDP_MASTER_ADDR": "h"}
        del env[missing]
        r = run_entrypoint(env)
        assert r.returncode == 2 and missing in r.stderr


@pytest.mark.timeout(300)
def test_entrypoint_serves_on_cpu_ranks(tmp_path):
    """The container's command, run here with the cpu profile's settings: it reaches /ready, the
    compose healthcheck passes, it answers with transformers' tokens, and SIGTERM ends it cleanly."""
    model_dir = write_checkpoint(tmp_path / "llama", "llama")
    compose = yaml.safe_load(interpolate(read(COMPOSE), set_in_env_example()))
    cpu_env = {k: str(v) for k, v in compose["services"]["hsdp-serve-cpu"]["environment"].items()
               if v not in (None, "")}
    (tmp_path / "key").write_text("k3y\n")
    port = free_port()
    env = {
        **cpu_env, "HSDP_MODEL": model_dir, "HSDP_HOST": "127.0.0.1", "HSDP_PORT": str(port),
        "HSDP_API_KEY_FILE": str(tmp_path / "key"), "HSDP_CACHE_DIR": str(tmp_path / "cache"),
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        "PYTHONPATH": REPO,  # hsdp-serve runs this checkout, whatever an installed copy points at
    }
    assert env["HSDP_DEVICE"] == "cpu" and env["HSDP_NPROC_PER_NODE"] == "auto"
    healthcheck = compose["services"]["hsdp-serve-cpu"]["healthcheck"]["test"][1:]
    server = ServerProcess(None, argv=["bash", ENTRYPOINT], port=port, env=env, log_path=tmp_path / "log")
    try:
        server.poll_ready()
        probe = subprocess.run([sys.executable if a == "python" else a for a in healthcheck],
                               env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
        assert probe.returncode == 0, probe.stderr
        request = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 8, "details": True}}
        assert server.client.post("/generate", json=request).status_code == 401  # the key from the file
        auth = {"Authorization": "Bearer k3y"}
        assert server.client.get("/info", headers=auth).json()["world_size"] == 2  # auto: 2 ranks on CPU
        r = server.client.post("/generate", headers=auth, json=request)
        assert r.status_code == 200, r.text
        assert [t["id"] for t in r.json()["details"]["tokens"]] == reference_generate(model_dir, PROMPTS[:1], 8)[0]
        assert "k3y" not in read(f"/proc/{server.proc.pid}/cmdline")
    finally:
        code = server.stop()
    assert code == 0, server.log_tail()
    assert wait_session_gone(server.proc.pid) == []
    probe = subprocess.run([sys.executable, "-m", "server.probe", "--port", str(port)], capture_output=True)
    assert probe.returncode == 1  # and the probe notices it is gone


# --- docker/Dockerfile ----------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", read(DOCKERFILE))
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def torch_range() -> tuple[str, str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    (spec,) = [d for d in deps if d.startswith("torch")]
    return re.fullmatch(r"torch>=([\d.]+),<([\d.]+)", spec).groups()


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def test_dockerfile_installs_the_way_the_readme_does():
    instructions = dockerfile_instructions()
    runs = [arg for op, arg in instructions if op == "RUN"]
    assert any("scripts/install.sh ." in arg for arg in runs)  # the package alone: no test extras
    readme, makefile = read(os.path.join(REPO, "README.md")), read(os.path.join(REPO, "Makefile"))
    assert "scripts/install.sh" in readme and "scripts/install.sh" in makefile
    # scripts/install.sh keeps an installed torch inside pyproject's range, and pins the CPU build
    # to the same torch as the base image
    low, below = torch_range()
    install = read(os.path.join(REPO, "scripts", "install.sh"))
    assert f"TORCH_MIN={low}\n" in install and f"TORCH_BELOW={below}\n" in install
    base = dict(arg.split("=", 1) for op, arg in instructions if op == "ARG" and "=" in arg)["BASE_IMAGE"]
    m = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", base)
    assert m, base  # the official PyTorch CUDA runtime image
    assert version_tuple(low) <= version_tuple(m.group(1))[:2] < version_tuple(below)
    assert f"TORCH_CPU_PIN={m.group(1)}\n" in install
    # every package pyproject installs is copied in, and nothing in .dockerignore hides it
    copied = " ".join(arg for op, arg in instructions if op == "COPY")
    ignored = read(os.path.join(REPO, ".dockerignore")).split()
    for needed in ("pyproject.toml", "README.md", "scripts/install.sh", "server", "shard_engine", "loaders",
                   "docker/entrypoint.sh"):
        assert needed in copied and needed not in ignored


def test_dockerfile_runs_as_non_root_through_the_entrypoint():
    instructions = dockerfile_instructions()
    users = [arg for op, arg in instructions if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert ("EXPOSE", "8000") in instructions
    entrypoint = [arg for op, arg in instructions if op == "ENTRYPOINT"][-1]
    assert entrypoint == '["hsdp-entrypoint"]'
    assert any(op == "COPY" and arg.endswith("/usr/local/bin/hsdp-entrypoint") for op, arg in instructions)
    env = " ".join(arg for op, arg in instructions if op == "ENV")
    assert "HSDP_HOST=0.0.0.0" in env  # reachable from outside the container
    healthcheck = [arg for op, arg in instructions if op == "HEALTHCHECK"][-1]
    assert '"server.probe", "/health"' in healthcheck


@pytest.mark.timeout(600)
def test_dockerfile_install_step_keeps_the_images_torch(tmp_path):
    """`scripts/install.sh .` in an environment that already has torch (the base image's) installs
    the package and its dependencies and leaves torch as it was."""
    import torch

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    # This environment's packages (torch among them) visible in the new one, as the image's are.
    # Not --system-site-packages: from inside a venv that shows the base interpreter's packages.
    new_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    ours = sorted({p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)})
    with open(os.path.join(new_site, "outer-environment.pth"), "w") as f:
        f.write("\n".join(ours) + "\n")
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", "tests", "benchmarks", "*.egg-info",
                                                             "__pycache__", ".install-stamp*", ".venv*"))
    r = subprocess.run(["bash", str(src / "scripts" / "install.sh"), "."], env={**os.environ, "PYTHON": python},
                       capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert not re.search(r"Installing collected packages:.*\btorch\b", r.stdout)
    check = textwrap.dedent("""
        import importlib.metadata as md, sys, torch, server
        assert server.__file__.startswith(sys.prefix), server.__file__   # installed, not the checkout
        print(torch.__version__, md.version("hsdp-serve"))
    """)
    out = subprocess.run([python, "-c", check], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == torch.__version__


def seconds(duration) -> float:
    """A Compose duration ('75s', '1m30s', '10m') in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", str(duration))
    assert parts and "".join(n + u for n, u in parts) == str(duration), duration
    return sum(float(n) * units[u] for n, u in parts)


def test_probe_fails_on_non_200(tmp_path):
    """The health probe exits non-zero on a 503 (a fault, or loading for /ready), not only on refusal."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()
            self.wfile.write(b'{"status": "x"}')

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        port = str(httpd.server_address[1])
        ok = subprocess.run([sys.executable, "-m", "server.probe", "/health", "--port", port], cwd=REPO)
        bad = subprocess.run([sys.executable, "-m", "server.probe", "/ready", "--port", port], cwd=REPO,
                             capture_output=True, text=True)
    finally:
        httpd.shutdown()
    assert ok.returncode == 0 and bad.returncode == 1 and "503" in bad.stderr

