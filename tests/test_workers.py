"""TINYGW_WORKERS=auto, the default: the CPUs the process may run on (docs/configuration.md).
The cgroup's quota on fake cpu.max files in-process; the affinity mask black-box, through
`taskset`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from conftest import ROOT, free_port, gateway_command, run_tinygw, wait_until
from tinygw.config import cpus, environment
from tinygw.errors import ConfigError

CONFIG = {"TINYGW_CONFIG": json.dumps({})}
TASKSET = shutil.which("taskset")


def cgroup(tmp_path, path: str, quotas: dict[str, str]):
    """A fake cgroup v2 mount under tmp_path, with this process in `path` and `cpu.max`
    files (`quotas`: a cgroup's path to its file's text); (root, the /proc/self/cgroup file)."""
    root = tmp_path / "cgroup"
    for where, text in quotas.items():
        directory = root / where.strip("/")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "cpu.max").write_text(text)
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text(f"12:memory:/elsewhere\n0::{path}\n")
    return str(root), str(self_cgroup)


@pytest.mark.parametrize(
    "text,affinity,expected",
    [
        ("150000 100000\n", 8, cpus.Workers(2, "cgroup")),  # 1.5 CPUs: rounded up
        ("100000 100000\n", 8, cpus.Workers(1, "cgroup")),
        ("50000 100000\n", 8, cpus.Workers(1, "cgroup")),  # half a CPU: still one worker
        ("400000 100000\n", 2, cpus.Workers(2, "affinity")),  # the mask is the smaller
        ("200000 100000\n", 2, cpus.Workers(2, "affinity")),  # equal: the mask says it
        ("max 100000\n", 8, cpus.Workers(8, "affinity")),  # no quota
        ("garbage", 8, cpus.Workers(8, "affinity")),
        ("0 100000", 8, cpus.Workers(8, "affinity")),
        ("100000000 1000", 1000, cpus.Workers(256, "affinity")),
        ("300000 1000", 1000, cpus.Workers(256, "cgroup")),  # 300 CPUs of quota, 1000 in the mask
    ],
)
def test_the_cgroup_quota_bounds_the_affinity_mask(tmp_path, text, affinity, expected):
    root, self_cgroup = cgroup(tmp_path, "/kubepods/pod1/c1", {"/kubepods/pod1/c1": text})
    assert cpus.usable(affinity, root, self_cgroup) == expected


def test_a_quota_above_the_own_cgroup_bounds_it_too(tmp_path):
    root, self_cgroup = cgroup(
        tmp_path, "/slice/service", {"/slice": "300000 100000", "/slice/service": "max 100000", "/": "junk"}
    )
    assert cpus.usable(16, root, self_cgroup) == cpus.Workers(3, "cgroup")


def test_without_cgroup_v2_the_mask_alone_counts(tmp_path):
    root = tmp_path / "cgroup"
    root.mkdir()
    v1_only = tmp_path / "self-cgroup"
    v1_only.write_text("4:cpu:/docker/abc\n")
    assert cpus.usable(3, str(root), str(v1_only)) == cpus.Workers(3, "affinity")
    assert cpus.usable(0, str(root), str(tmp_path / "absent")) == cpus.Workers(1, "affinity")  # at least one


def test_auto_is_the_default_and_may_be_written():
    usable = cpus.usable()
    for given in ({}, {"TINYGW_WORKERS": "auto"}, {"TINYGW_WORKERS": " AUTO "}, {"TINYGW_WORKERS": ""}):
        settings = environment.from_environ({**CONFIG, **given})
        assert (settings.workers, settings.workers_from) == (usable.count, usable.source), given
    settings = environment.from_environ({**CONFIG, "TINYGW_WORKERS": "3"})
    assert (settings.workers, settings.workers_from) == (3, "TINYGW_WORKERS")


@pytest.mark.parametrize("value", ["0", "257", "many", "auto2", "1.5"])
def test_a_bad_count_names_the_variable(value):
    with pytest.raises(ConfigError) as info:
        environment.from_environ({**CONFIG, "TINYGW_WORKERS": value})
    assert info.value.where == "TINYGW_WORKERS"


# ---- black-box: the affinity mask of a real process ----------------------------------------

needs_taskset = pytest.mark.skipif(TASKSET is None, reason="taskset is not installed")


@needs_taskset
def test_check_under_taskset_names_one_worker_from_the_affinity_mask():
    done = run_tinygw(["check"], CONFIG, prefix=[TASKSET, "-c", "0"])
    assert done.returncode == 0, done.stderr
    assert "workers: 1 (affinity)\n" in done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith("config_sha256: ")  # still the last line


@needs_taskset
@pytest.mark.skipif(cpus.usable().count < 2, reason="one CPU here")
def test_check_on_two_cpus_names_two_workers():
    two = ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0))[:2])
    done = run_tinygw(["check"], CONFIG, prefix=[TASKSET, "-c", two])
    assert done.returncode == 0, done.stderr
    assert "workers: 2 (affinity)\n" in done.stdout
    done = run_tinygw(["check"], {**CONFIG, "TINYGW_WORKERS": "1"}, prefix=[TASKSET, "-c", two])
    assert "workers: 1 (TINYGW_WORKERS)\n" in done.stdout


@needs_taskset
def test_serve_under_taskset_starts_one_worker_and_says_why(tmp_path):
    log = tmp_path / "serve.log"
    port = free_port()
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), **CONFIG, "TINYGW_PORT": str(port)}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [TASKSET, "-c", "0", *gateway_command(), "serve"], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )
    try:

        def records():
            text = log.read_text(errors="replace")
            return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.startswith("{")]

        def started():
            assert process.poll() is None, log.read_text(errors="replace")
            return any(r.get("msg") == "worker started" for r in records())

        wait_until(started, 30, "a worker to start")
        starting = [r for r in records() if r.get("msg") == "gateway starting"]
        assert [(r["workers"], r["workers_from"]) for r in starting] == [(1, "affinity")], log.read_text()
        assert len([r for r in records() if r.get("msg") == "worker started"]) == 1, log.read_text()
    finally:
        process.terminate()
        process.wait(15)
