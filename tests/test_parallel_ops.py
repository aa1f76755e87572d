"""video_dit.parallel.ops: the op DeepSpeed's ranks compile at start is built ahead, and the ranks'
own loader (deepspeed.comm.torch.build_shm_op) then finds it instead of compiling again."""

from __future__ import annotations

import os
import subprocess
import sys


def test_comm_op_built_ahead_is_the_one_the_ranks_load(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    built = subprocess.run([sys.executable, "-m", "video_dit.parallel.ops"], env=env, capture_output=True,
                           text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        assert "none to build" in built.stdout
        return
    libs = sorted(tmp_path.rglob("*.so"))
    assert [p.name for p in libs] == [f"{builder.NAME}.so"], libs
    stamp = libs[0].stat().st_mtime_ns
    load = ("import importlib; op = importlib.import_module('deepspeed.comm.torch').build_shm_op(); "
            "print(op.__file__)")
    ranks = subprocess.run([sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=600)
    assert ranks.returncode == 0, ranks.stderr[-2000:]
    assert ranks.stdout.strip().splitlines()[-1] == str(libs[0])  # the library built ahead ...
    assert libs[0].stat().st_mtime_ns == stamp                     # ... loaded, not rebuilt
