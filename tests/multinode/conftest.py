"""Fixtures of the multi-node tests: the two namespace hosts (`cluster.Cluster`) and the interpreter
`./launch/train.sh` runs, both once per session. Skipped, with the reason, where this machine cannot
make network namespaces (not root, no `ip`, no sshd)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import cluster as cl  # noqa: E402


@pytest.fixture(scope="session")
def launcher_python() -> str:
    """The interpreter `./launch/train.sh` picks here (launch/_env.sh's `vd_python`): the ranks run it on
    every node, the pre-flight looks for it, the test hides its .venv from one sshd."""
    done = subprocess.run(["bash", "-c", 'source launch/_env.sh && vd_python'], cwd=cl.ROOT, capture_output=True,
                          text=True, env=os.environ.copy(), timeout=1200)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, launcher_python):
    why = cl.unavailable()
    if why:
        pytest.skip(f"two namespace hosts cannot be made here: {why}")
    hosts = cl.Cluster(tmp_path_factory.mktemp("cluster"), launcher_python)
    try:
        yield hosts.up()
    finally:
        hosts.close()
