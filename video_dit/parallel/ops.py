"""DeepSpeed's compiled communication op, built once ahead of the ranks.

When a DeepSpeed process group starts, `deepspeed.comm.torch.build_shm_op` compiles (JIT, ninja)
and loads the accelerator's shared-memory collective op (`ShareMemCommBuilder`; on CPU ranks
`deepspeed_shm_comm`, the intra-node all-reduce). On 2 CPU cores that build takes 15-45 s, inside
the first `./launch/train.sh` of every new `.venv`: torch keys the build by its source paths, so a
second checkout's `.venv` rebuilds it, and two checkouts sharing `~/.cache/torch_extensions` would
rebuild it in turn. `launch/_env.sh` therefore builds it while it sets up `.venv`, into
`TORCH_EXTENSIONS_DIR=.venv/torch_extensions` (which train.sh and test.sh export for that
Python), and the ranks load the built op. `python -m video_dit.parallel.ops` does the same.
"""

from __future__ import annotations

from pathlib import Path


def build_comm_op(verbose: bool = False) -> Path | None:
    """Build (or find already built) the op DeepSpeed's ranks would build at start, exactly as
    `build_shm_op` chooses it; returns the loaded library's path, or None when this accelerator
    has no such op (or DeepSpeed marks it incompatible here)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return Path(builder.load(verbose=verbose).__file__)


if __name__ == "__main__":
    path = build_comm_op()
    print(f"[video_dit] DeepSpeed communication op: {path if path else 'none to build on this accelerator'}")
