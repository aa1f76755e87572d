"""video_dit.parallel.ops: the op DeepSpeed's ranks compile at start is built ahead, and the ranks'
own loader (deepspeed.comm.torch.build_shm_op) then finds it instead of compiling again.

CI checks it in the test environment's TORCH_EXTENSIONS_DIR (`launch/test.sh` exports `.venv/torch_extensions`,
where `launch/_env.sh` built the op when it set up `.venv`): `python -m video_dit.parallel.ops` finds or builds
it there, and the loader loads that library unrebuilt. The build from an empty folder (15-45 s of C++ on 2
cores, what every fresh `.venv` pays once) runs with -m slow."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _built_ahead_is_loaded(env: dict) -> Path | None:
    """The library `python -m video_dit.parallel.ops` built or found, checked to be what the ranks' loader
    loads without rebuilding it (None where this accelerator has no such op)."""
    built = subprocess.run([sys.executable, "-m", "video_dit.parallel.ops"], env=env, capture_output=True,
                           text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        assert "none to build" in built.stdout
        return None
    lib = Path(built.stdout.strip().splitlines()[-1].split(": ", 1)[1])
    assert lib.name == f"{builder.NAME}.so" and lib.is_file(), built.stdout
    stamp = lib.stat().st_mtime_ns
    load = ("import importlib; op = importlib.import_module('deepspeed.comm.torch').build_shm_op(); "
            "print(op.__file__)")
    ranks = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=600)
    assert ranks.returncode == 0, ranks.stderr[-2000:]
    assert ranks.stdout.strip().splitlines()[-1] == str(lib)  # the library built ahead ...
    assert lib.stat().st_mtime_ns == stamp                     # ... loaded, not rebuilt
    return lib


def test_comm_op_built_ahead_is_the_one_the_ranks_load():
    _built_ahead_is_loaded(dict(os.environ))


@pytest.mark.slow  # a C++ build from nothing: 15-45 s on 2 cores
def test_comm_op_built_ahead_from_an_empty_folder_is_the_one_the_ranks_load(tmp_path):
    lib = _built_ahead_is_loaded({**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert lib is None or sorted(tmp_path.rglob("*.so")) == [lib]  # built here, once
