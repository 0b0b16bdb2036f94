"""The deploy recipes (issue 13): deploy/systemd, deploy/kubernetes, deploy/Containerfile.

What these machines allow is run for real. systemd is not PID 1 here, so the unit is never
started by systemd: `systemd-analyze verify` and `security --offline` read it, and its
ExecStart runs by hand as systemd would run it (the unit's environment and credentials, an
unprivileged user with the unit's one capability, no new privileges, the unit's umask and
its seccomp filters: MemoryDenyWriteExecute=, SystemCallFilter=, RestrictAddressFamilies=).
The mount sandbox (ProtectSystem=, PrivateTmp=, ...) is not reproduced. kubernetes-validate
checks the manifests offline against a pinned Kubernetes release; no image is built (no
container daemon): the Containerfile's sources are checked. And the claim docs/deploy.md
makes of replicas: a provider outage costs at most PROVIDER_BREAKER_FAILURES attempts per
worker, shown with two workers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, START_SECONDS, call, free_port, gateway_command, metric_value, wait_until
from tinygw.fake.upstream import json_reply

sys.path.insert(0, str(ROOT / "attest"))
from fake_tdx import FakeTdx  # noqa: E402 (attest/ is not a package)

DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "tinygw.service"
UNIT_ENV = DEPLOY / "systemd" / "tinygw.env"
CONTAINERFILE = DEPLOY / "Containerfile"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
# The oldest of the three minor releases maintained upstream when kubernetes-validate 1.37
# (the locked one) came out: manifests valid there are valid on every maintained cluster.
KUBERNETES_VERSION = "1.35.0"
DYNAMIC_UID = 61234  # in systemd's range for DynamicUser= (61184-65519)
DAC_OVERRIDE = 1  # capability number
INSTALL_SECONDS = 600
IS_ROOT = os.geteuid() == 0


# ---- reading the recipes ---------------------------------------------------------------


def unit_settings(path: Path = UNIT) -> dict[str, list[str]]:
    """`Section.Key` -> every value given, in order (systemd's repeated settings add up)."""
    settings: dict[str, list[str]] = {}
    section = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        assert not line.endswith("\\"), "keep the unit free of continuation lines: this reader has none"
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        settings.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return settings


def one(settings: dict[str, list[str]], key: str) -> str:
    values = settings.get(f"Service.{key}", [])
    assert len(values) == 1, f"{key}: {values}"
    return values[0]


def assignments(lines: list[str]) -> dict[str, str]:
    return dict(line.split("=", 1) for line in lines)


def env_file(path: Path = UNIT_ENV) -> dict[str, str]:
    return assignments([line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")])


def manifests() -> dict[str, dict]:
    """Kind -> resource, over every document of deploy/kubernetes/*.yaml."""
    resources = {}
    for path in MANIFESTS:
        for document in yaml.safe_load_all(path.read_text()):
            resources[document["kind"]] = document
    return resources


def containerfile() -> list[tuple[str, list[str]]]:
    """(instruction, JSON or split arguments) per instruction, comments and continuations read."""
    text = re.sub(
        r"\\\n\s*",
        " ",
        "\n".join(line for line in CONTAINERFILE.read_text().splitlines() if not line.lstrip().startswith("#")),
    )
    instructions = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            rest = rest.strip()
            instructions.append((word.upper(), json.loads(rest) if rest.startswith("[") else rest.split()))
    return instructions


# ---- tools -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def systemd_analyze() -> str:
    """systemd-analyze, installed from Debian's systemd package where missing (root only)."""
    found = shutil.which("systemd-analyze")
    if found is None and IS_ROOT and shutil.which("apt-get"):
        subprocess.run(
            ["bash", "-c", "apt-get update -qq && apt-get install -y -qq systemd"],
            capture_output=True,
            text=True,
            timeout=INSTALL_SECONDS,
        )
        found = shutil.which("systemd-analyze")
    if found is None:
        pytest.skip("systemd-analyze is missing and could not be installed (`apt-get install systemd`, as root)")
    return found


def with_private_opt(command: list[str]) -> subprocess.CompletedProcess:
    """`command` in a mount namespace of its own whose /opt/tinygw holds attest/launch and a
    stand-in artifact, as the unit expects (verify checks that ExecStart's files exist);
    the machine's own /opt is untouched."""
    setup = (
        'mount -t tmpfs tmpfs /opt && mkdir /opt/tinygw && cp "$0" /opt/tinygw/launch'
        " && printf '#!/bin/sh\\n' >/opt/tinygw/tinygw && chmod 755 /opt/tinygw/* && exec \"$@\""
    )
    return subprocess.run(
        ["unshare", "--mount", "sh", "-c", setup, str(ROOT / "attest" / "launch"), *command],
        capture_output=True,
        text=True,
        timeout=60,
    )


needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root: a private mount namespace, another uid, capabilities")


# ---- the systemd unit ----------------------------------------------------------------------


@needs_root
def test_unit_passes_systemd_analyze_verify(systemd_analyze, tmp_path):
    done = with_private_opt([systemd_analyze, "verify", str(UNIT)])
    assert (done.returncode, done.stdout + done.stderr) == (0, "")
    # The check is not vacuous: verify names a misspelled setting (and still exits 0).
    typo = tmp_path / "tinygw.service"
    typo.write_text(UNIT.read_text().replace("\nProtectHome=yes", "\nProtectHom=yes"))
    done = with_private_opt([systemd_analyze, "verify", str(typo)])
    assert "Unknown key 'ProtectHom'" in done.stderr


@needs_root
def test_unit_sandbox_exposure_is_low(systemd_analyze):
    # systemd's own scoring of the sandbox, 0 (locked down) to 10; 2.0 and below is "OK".
    done = with_private_opt([systemd_analyze, "security", "--offline=yes", "--threshold=20", str(UNIT)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    exposure = float(re.search(r"Overall exposure level for tinygw.service: ([0-9.]+)", done.stdout).group(1))
    assert exposure <= 2.0


def test_unit_is_consistent_with_the_launcher_and_the_gateway():
    unit = unit_settings()
    env = assignments(unit["Service.Environment"])
    assert one(unit, "ExecStart").split() == ["/opt/tinygw/launch", "/opt/tinygw/tinygw", "serve"]
    assert "Service.ExecReload" not in unit  # the configuration is read at start only
    # Stop: SIGTERM to the main process (which drains), SIGKILL only after the drain time.
    assert (one(unit, "KillSignal"), one(unit, "KillMode")) == ("SIGTERM", "mixed")
    drain = int(env_file().get("TINYGW_DRAIN_SECONDS", "30"))
    assert int(one(unit, "TimeoutStopSec")) > drain
    # Keys: each credential named by exactly one NAME_FILE in %d, and no key elsewhere.
    credentials = [c.split(":", 1)[0] for c in unit["Service.LoadCredential"]]
    files = {k: v for k, v in env.items() if k.endswith("_FILE") and v.startswith("%d/")}
    assert sorted(v.removeprefix("%d/") for v in files.values()) == sorted(credentials)
    assert not [k for k in env_file() if "KEY" in k and k != "TINYGW_API_KEYS_FILE"]
    # Guest memory: the launch directory and the event log are in the runtime directory,
    # kept across restarts (RTMR3 is, until the next boot).
    runtime = "/run/" + one(unit, "RuntimeDirectory")
    assert env["TINYGW_LAUNCH_DIR"] == runtime
    assert env["TINYGW_EVENT_LOG"].startswith(runtime + "/")
    assert one(unit, "RuntimeDirectoryPreserve") == "yes"
    assert runtime + "/tinygw-launch." in one(unit, "ExecStopPost")
    for key, value in {
        "DynamicUser": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "NoNewPrivileges": "yes",
        "MemoryDenyWriteExecute": "yes",
    }.items():
        assert one(unit, key) == value, key


# The seccomp filters that systemd 252 loads for the unit's settings, one filter per setting
# as systemd does (the kernel applies the strictest answer of all): MemoryDenyWriteExecute=
# as in systemd's seccomp_memory_deny_write_execute(), RestrictAddressFamilies= on socket(),
# and the SystemCallFilter= allow list with SystemCallErrorNumber=. Then it sets the unit's
# umask and execs the command. Arguments: a JSON spec, then the command.
SECCOMP_EXEC = textwrap.dedent("""
    import ctypes, json, os, sys
    spec = json.loads(sys.argv[1])
    ALLOW, ERRNO, MASKED_EQ, EQ = 0x7FFF0000, 0x00050000, 7, 4
    class Cmp(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]
    lib = ctypes.CDLL("libseccomp.so.2")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_exact_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                                 ctypes.POINTER(Cmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    def filter(default, rules):
        context = lib.seccomp_init(default)
        for action, name, compare in rules:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:
                continue  # not a system call of this architecture
            compares = (Cmp * 1)(Cmp(*compare)) if compare else None
            assert lib.seccomp_rule_add_exact_array(context, action, number, 1 if compare else 0, compares) == 0, name
        assert lib.seccomp_load(context) == 0
    if spec["mdwe"]:
        PROT_WRITE, PROT_EXEC, SHM_EXEC = 2, 4, 0o100000
        filter(ALLOW, [(ERRNO | 1, "mmap", (2, MASKED_EQ, PROT_WRITE | PROT_EXEC, PROT_WRITE | PROT_EXEC)),
                       (ERRNO | 1, "mprotect", (2, MASKED_EQ, PROT_EXEC, PROT_EXEC)),
                       (ERRNO | 1, "pkey_mprotect", (2, MASKED_EQ, PROT_EXEC, PROT_EXEC)),
                       (ERRNO | 1, "shmat", (2, MASKED_EQ, SHM_EXEC, SHM_EXEC))])
    if spec["families"]:
        filter(ALLOW, [(ERRNO | 97, "socket", (0, EQ, family, 0))  # EAFNOSUPPORT
                       for family in range(64) if family not in spec["families"]])
    if spec["allow"]:  # last, as systemd does: it allows no seccomp() after it
        filter(ERRNO | spec["errno"], [(ALLOW, name, None) for name in spec["allow"]])
    os.umask(spec["umask"])
    os.execv(sys.argv[2], sys.argv[2:])
""")


def syscall_groups(systemd_analyze: str) -> dict[str, list[str]]:
    """systemd's named system call groups (`@system-service`, ...), as this systemd knows them."""
    listing = subprocess.run([systemd_analyze, "syscall-filter"], capture_output=True, text=True, check=True).stdout
    groups: dict[str, list[str]] = {}
    current = None
    for line in listing.splitlines():
        word = line.strip()
        if line.startswith("@"):
            current = groups.setdefault(word, [])
        elif not word:
            current = None
        elif current is not None and not word.startswith("#"):
            current.append(word)
    return groups


def seccomp_spec(unit: dict[str, list[str]], systemd_analyze: str) -> dict:
    groups = syscall_groups(systemd_analyze)

    def expand(name: str) -> set[str]:
        return set().union(*(expand(n) for n in groups[name])) if name.startswith("@") else {name}

    allowed: set[str] = set()
    for i, line in enumerate(unit.get("Service.SystemCallFilter", [])):
        if line.startswith("~"):
            assert i > 0, "an allow list first, then what it leaves out"
            allowed -= set().union(*(expand(n) for n in line[1:].split()))
        else:
            allowed |= expand("@default") | set().union(*(expand(n) for n in line.split()))  # as systemd
    families = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10}
    return {
        "mdwe": one(unit, "MemoryDenyWriteExecute") == "yes",
        "allow": sorted(allowed),
        "errno": {"EPERM": 1}[one(unit, "SystemCallErrorNumber")],
        "families": [families[f] for f in one(unit, "RestrictAddressFamilies").split()],
        "umask": int(one(unit, "UMask"), 8),
    }


def as_the_unit(unit: dict[str, list[str]], spec: dict, command: list[str], capabilities: bool = True) -> list[str]:
    """`command` as systemd starts the unit's: DynamicUser= (a fresh uid, no groups),
    AmbientCapabilities= and CapabilityBoundingSet=, NoNewPrivileges=, then the seccomp filters."""
    caps = ",".join(f"+{c.lower().removeprefix('cap_')}" for c in one(unit, "AmbientCapabilities").split())
    assert one(unit, "CapabilityBoundingSet") == one(unit, "AmbientCapabilities")
    setpriv = ["setpriv", f"--reuid={DYNAMIC_UID}", f"--regid={DYNAMIC_UID}", "--clear-groups", "--no-new-privs"]
    if capabilities:
        setpriv += [f"--inh-caps=-all,{caps}", f"--ambient-caps=-all,{caps}", f"--bounding-set=-all,{caps}"]
    else:
        setpriv += ["--inh-caps=-all", "--bounding-set=-all"]
    return [*setpriv, sys.executable, "-c", SECCOMP_EXEC, json.dumps(spec), *command]


def artifact(tmp_path: Path) -> str:
    """The frozen build under `make test-frozen` (TINYGW_BINARY), else a stand-in that runs
    the gateway from source: attest/launch measures and execs one file."""
    binary = os.environ.get("TINYGW_BINARY")
    if binary:
        return binary
    stand_in = tmp_path / "tinygw"
    stand_in.write_text(
        f'#!/bin/sh\n# a stand-in for build/dist/tinygw\nPYTHONPATH="{ROOT}" exec "{sys.executable}" -m tinygw "$@"\n'
    )
    stand_in.chmod(0o755)
    return str(stand_in)


def memory_file_system(path: Path) -> bool:
    mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    best = max((m for m in mounts if str(path).startswith(m[1].rstrip("/") + "/")), key=lambda m: len(m[1]))
    return best[2] in ("tmpfs", "ramfs")


@pytest.fixture
def tdx():
    """A simulated TDX platform where the kernel's would be: root's files in directories that
    any user may search, as /sys is (pytest's tmp_path is root's alone)."""
    root = Path(tempfile.mkdtemp(prefix="tinygw-unit-tdx-", dir="/dev/shm"))
    root.chmod(0o755)
    platform = FakeTdx(root / "tdx")
    yield platform
    platform.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def runtime_directory():
    """The unit's /run/tinygw: on a memory file system, owned by the service's user, 0700."""
    path = Path(tempfile.mkdtemp(prefix="tinygw-unit-run-", dir="/dev/shm"))
    os.chown(path, DYNAMIC_UID, DYNAMIC_UID)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@needs_root
def test_unit_exec_start_by_hand(systemd_analyze, fake, tdx, tmp_path, runtime_directory):
    """The unit's ExecStart as systemd would run it: the launcher measures the artifact and
    execs it as an unprivileged user under the unit's seccomp filters (MemoryDenyWriteExecute=
    among them), with keys from credentials, and the attested TLS key lands in guest memory."""
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is missing")
    unit = unit_settings()
    spec = seccomp_spec(unit, systemd_analyze)
    credentials = tmp_path / "credentials"  # systemd's %d: each file the service user's, 0400
    credentials.mkdir()
    keys = {"deepseek": "sk-deepseek-test", "gateway-keys": "gw-test-key"}
    for entry in unit["Service.LoadCredential"]:
        name = entry.split(":", 1)[0]
        (credentials / name).write_text(keys[name] + "\n")
        os.chown(credentials / name, DYNAMIC_UID, DYNAMIC_UID)
        (credentials / name).chmod(0o400)
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "providers": {
                    "deepseek": {"base_url": f"{fake.url}/v1", "api": "openai", "api_key_env": "DEEPSEEK_API_KEY"}
                },
                "models": {"deepseek-chat": {"targets": ["deepseek:deepseek-chat"]}},
            }
        )
    )
    places = {
        "/opt/tinygw/launch": str(ROOT / "attest" / "launch"),
        "/opt/tinygw/tinygw": artifact(tmp_path),
        "/run/tinygw": str(runtime_directory),
        "/etc/tinygw/config.json": str(config),
        "%d": str(credentials),
    }

    def here(value: str) -> str:
        for unit_path, path in places.items():
            value = value.replace(unit_path, path)
        return value

    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "CREDENTIALS_DIRECTORY": str(credentials),
        "RUNTIME_DIRECTORY": str(runtime_directory),
    }
    env |= {k: here(v) for k, v in assignments(unit["Service.Environment"]).items()}
    env |= {k: here(v) for k, v in env_file().items()}  # EnvironmentFile= overrides Environment=
    port = free_port()
    env |= {
        "TINYGW_HOST": "127.0.0.1",
        "TINYGW_PORT": str(port),  # loopback, in a test
        "TINYGW_RTMR_PATH": str(tdx.rtmr_path),
        "TINYGW_TSM_REPORT_DIR": str(tdx.report_dir),
    }
    command = as_the_unit(unit, spec, [here(w) for w in one(unit, "ExecStart").split()])
    log_path = tmp_path / "unit.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, cwd="/", stdout=log, stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}"

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            return call("GET", f"{url}/healthz", timeout=1)[0] == 200
        except OSError:
            return False

    try:
        wait_until(ready, START_SECONDS, "the unit's gateway to answer /healthz over TLS")
        status = Path(f"/proc/{process.pid}/status").read_text()  # the artifact, after the execs
        assert re.search(rf"^Uid:\s+{DYNAMIC_UID}\s", status, re.M)
        assert re.search(r"^NoNewPrivs:\s+1$", status, re.M) and re.search(r"^Seccomp:\s+2$", status, re.M)
        assert int(re.search(r"^CapAmb:\s+(\w+)$", status, re.M).group(1), 16) == 1 << DAC_OVERRIDE
        chat = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}]}
        assert call("POST", f"{url}/v1/chat/completions", chat)[0] == 401
        status_code, _, body = call(
            "POST", f"{url}/v1/chat/completions", chat, {"Authorization": f"Bearer {keys['gateway-keys']}"}
        )
        assert status_code == 200, body
        assert fake.requests[-1].headers.get("authorization") == f"Bearer {keys['deepseek']}"
        nonce = os.urandom(32).hex()
        status_code, _, body = call("GET", f"{url}/attestation?nonce={nonce}")
        evidence = json.loads(body)
        assert status_code == 200 and evidence["evidence"]["provider"] == "tdx_guest"  # a quote was made
        assert [e["digest_sha384"] for e in evidence["event_log"]] == [tdx.writes[0].hex()]
        assert evidence["tls_spki_sha256"]
        # Everything the launch wrote is in the runtime directory, in memory: the copy of
        # the artifact, its unpacked libraries (onefile), the attested TLS key, the event log.
        (launch,) = runtime_directory.glob("tinygw-launch.*")
        (key,) = launch.glob("tinygw-tls-*/key.pem")
        assert memory_file_system(key) and key.stat().st_uid == DYNAMIC_UID
        assert (runtime_directory / "event-log.jsonl").is_file()
    finally:
        process.send_signal(signal.SIGTERM)  # KillMode=mixed: the main process alone
        try:
            returncode = process.wait(int(one(unit, "TimeoutStopSec")))
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert returncode == 0, log_path.read_text()
    # ExecStopPost= removes the launch's copy; the event log stays for the next start.
    cleanup = one(unit, "ExecStopPost")
    assert cleanup.startswith("/bin/sh -c '") and cleanup.endswith("'")
    subprocess.run(
        as_the_unit(unit, spec, ["/bin/sh", "-c", here(cleanup[len("/bin/sh -c '") : -1])]),
        env=env,
        cwd="/",
        check=True,
        timeout=30,
    )
    assert sorted(p.name for p in runtime_directory.iterdir()) == ["event-log.jsonl"]


@needs_root
def test_without_its_capability_the_unit_cannot_measure(systemd_analyze, tdx, runtime_directory):
    """Why the unit keeps CAP_DAC_OVERRIDE: RTMR3's file is root's (0644), as are configfs-tsm's."""
    unit = unit_settings()
    env = {
        "PATH": "/usr/bin:/bin",
        "TINYGW_RTMR_PATH": str(tdx.rtmr_path),
        "TINYGW_LAUNCH_DIR": str(runtime_directory),
        "TINYGW_EVENT_LOG": str(runtime_directory / "log"),
    }
    command = [str(ROOT / "attest" / "launch"), artifact(runtime_directory), "version"]  # where it may look
    done = subprocess.run(
        as_the_unit(unit, seccomp_spec(unit, systemd_analyze), command, capabilities=False),
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode != 0 and "Permission denied" in done.stderr and tdx.writes == []


# ---- Kubernetes --------------------------------------------------------------------------


def test_manifests_are_valid_for_the_pinned_kubernetes_release():
    import kubernetes_validate

    resources = manifests()
    assert set(resources) == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}
    for resource in resources.values():
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    # Not vacuous: a misspelled field fails.
    broken = json.loads(json.dumps(resources["Deployment"]))
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_deployment_wires_the_gateway_as_documented():
    resources = manifests()
    deployment = resources["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    value = {name: e.get("value") for name, e in env.items()}
    assert deployment["spec"]["replicas"] >= 2 and pod["runtimeClassName"] == "kata-qemu-tdx"
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for kind in ("Service", "PodDisruptionBudget"):
        selector = resources[kind]["spec"]["selector"]
        assert selector.get("matchLabels", selector).items() <= labels.items(), kind
    # Probes on /healthz over HTTPS whenever TLS is on; the scrape on the same port.
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["https"]
    assert value["TINYGW_TLS"] != "off" and value["TINYGW_PORT"] == str(port)
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert (get["path"], get["scheme"], get["port"]) == ("/healthz", "HTTPS", "https")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/scheme"]) == (str(port), "https")
    assert resources["Service"]["spec"]["ports"][0]["targetPort"] == "https"
    # SIGTERM drains for TINYGW_DRAIN_SECONDS after preStop; the grace period covers both.
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre_stop + int(value["TINYGW_DRAIN_SECONDS"])
    # Keys: files of the Secret's volume, named by *_FILE; the configuration from the ConfigMap.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    (secret,) = [name for name, v in volumes.items() if "secret" in v]
    key_files = [v for name, v in value.items() if name.endswith("_FILE")]
    assert key_files and all(Path(f).parent == Path(mounts[secret]) for f in key_files)
    reference = env["TINYGW_CONFIG"]["valueFrom"]["configMapKeyRef"]
    assert reference["name"] == resources["ConfigMap"]["metadata"]["name"]
    # The launch directory, TMPDIR and the event log in a memory-backed emptyDir.
    (run,) = [name for name, v in volumes.items() if v.get("emptyDir", {}).get("medium") == "Memory"]
    for name in ("TINYGW_LAUNCH_DIR", "TMPDIR"):
        assert value[name] == mounts[run], name
    assert Path(value["TINYGW_EVENT_LOG"]).parent == Path(mounts[run])


def test_deployment_environment_is_a_valid_configuration(tmp_path):
    """`tinygw check` accepts the pod's environment, as Kubernetes would expand it."""
    resources = manifests()
    (container,) = resources["Deployment"]["spec"]["template"]["spec"]["containers"]
    fields = {"status.podIP": "10.244.1.7", "metadata.namespace": "gateways"}
    env: dict[str, str] = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT)}
    for entry in container["env"]:
        source = entry.get("valueFrom", {})
        if "configMapKeyRef" in source:
            value = resources["ConfigMap"]["data"][source["configMapKeyRef"]["key"]]
        elif "fieldRef" in source:
            value = fields[source["fieldRef"]["fieldPath"]]
        else:
            value = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], entry["value"])  # $(VAR)
        if entry["name"].endswith("_FILE"):
            value = str(tmp_path / Path(value).name)  # the Secret's files, here
            Path(value).write_text("test-key-long-enough-for-a-key-seed\n")
        env[entry["name"]] = value
    done = subprocess.run([*gateway_command(), "check"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "config_sha256" in done.stdout
    assert env["TINYGW_TLS_NAMES"] == "tinygw.gateways.svc,tinygw.gateways.svc.cluster.local,10.244.1.7"


# ---- the Containerfile ---------------------------------------------------------------------

# What `make build` makes (docs/design.md section 8); this test does not build.
BUILD_OUTPUTS = {"build/dist/tinygw", "build/dist/release.json"}


def test_containerfile_copies_what_exists_onto_a_pinned_base():
    instructions = containerfile()
    (base,) = [args for word, args in instructions if word == "FROM"]
    assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", base[0]), base
    copies = [args for word, args in instructions if word == "COPY"]
    tracked = subprocess.run(
        ["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    modes = {line.split("\t")[1]: line.split()[0] for line in tracked}
    destinations = {}
    for *sources, destination in copies:
        assert not [s for s in sources if s.startswith("--")], "plain COPY: modes come from the tree"
        for source in sources:
            if source.startswith("build/dist/"):
                assert source in BUILD_OUTPUTS, source
                built = ROOT / source
                if os.environ.get("TINYGW_BINARY") == str(ROOT / "build" / "dist" / "tinygw"):
                    assert built.is_file(), f"{source}: not made by make build"
            else:
                assert modes.get(source) in ("100644", "100755"), f"{source}: not a file git tracks"
            destinations[source] = destination
    # The image runs what it copied, through the launcher, at the unit's paths.
    (entrypoint,) = [args for word, args in instructions if word == "ENTRYPOINT"]
    assert entrypoint == [destinations["attest/launch"], destinations["build/dist/tinygw"]]
    assert modes["attest/launch"] == "100755"
    assert one(unit_settings(), "ExecStart").split()[:2] == entrypoint
    (env,) = [args for word, args in instructions if word == "ENV"]
    plumbing = dict(a.split("=", 1) for a in env)
    assert plumbing["TMPDIR"] == plumbing["TINYGW_LAUNCH_DIR"]


def test_the_image_runs_as_the_deployments_non_root_user():
    (user,) = [args for word, args in containerfile() if word == "USER"]
    uid, _, gid = user[0].partition(":")
    context = manifests()["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    assert int(uid) != 0 and (int(uid), int(gid or uid)) == (context["runAsUser"], context["runAsGroup"])


# What one run keeps in the memory volume: the launcher's copy of the artifact (when it
# measures) and the libraries the frozen binary unpacks, 51 MiB (measured: issue 20).
UNPACKED_MIB = 51


def test_the_memory_volume_holds_two_unclean_restarts_beside_the_running_one():
    # An emptyDir outlives a container's restart: what a killed run left stays there.
    release = json.loads((ROOT / "release" / "release.json").read_text())
    run_mib = release["artifact"]["size"] / 2**20 + UNPACKED_MIB
    pod = manifests()["Deployment"]["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    size = volume["emptyDir"]["sizeLimit"]
    assert size.endswith("Mi") and int(size[:-2]) >= 3 * run_mib
    (container,) = pod["containers"]
    limit = container["resources"]["limits"]["memory"]  # the tmpfs counts against it
    assert limit.endswith("Mi") and int(limit[:-2]) >= int(size[:-2]) + 2 * 54  # and two workers at their peak


# ---- replicas: a circuit is per replica, one for its workers -----------------------------


def test_an_outage_costs_at_most_the_breaker_threshold_per_replica(fake, start_gateway):
    """docs/deploy.md: a provider that is down is tried at most PROVIDER_BREAKER_FAILURES times
    by a replica, whatever its number of workers (plus what was in flight), before it skips it."""
    fake.script = lambda request: json_reply(503, {"error": {"message": "down", "type": "server_error"}})
    failures = 5
    gateway = start_gateway(
        {"providers": {"p": {"base_url": f"{fake.url}/v1", "api": "openai"}}, "models": {"m": {"targets": ["p:m"]}}},
        TINYGW_WORKERS="2",
        PROVIDER_BREAKER_FAILURES=str(failures),
        PROVIDER_BREAKER_OPEN_SECONDS="300",
        PROVIDER_HEALTH_CHECK_SECONDS="0",
        PROVIDER_LISTING_SECONDS="0",
        PROVIDER_RETRY_FAST_FAILURES="false",
    )
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def opened() -> bool:
        call("POST", f"{gateway.url}/v1/chat/completions", chat)  # a new connection each: either worker
        return metric_value(gateway, "tinygw_circuit_open") == 1

    wait_until(opened, 30, "the circuit to open")
    reached = len(fake.requests)
    for _ in range(20):
        assert call("POST", f"{gateway.url}/v1/chat/completions", chat)[0] == 503
    assert len(fake.requests) == reached == failures  # one request at a time: none was in flight
    assert metric_value(gateway, "tinygw_upstream_attempts_total", outcome="503") == reached
    per_worker: dict[int, int] = {}
    for record in gateway.log_records():
        if record.get("msg") == "request" and record.get("attempts"):
            per_worker[record["worker"]] = per_worker.get(record["worker"], 0) + record["attempts"].count(":")
    assert sum(per_worker.values()) == failures
