"""Previews on several ranks without idle ranks (`train.preview.render`): under ZeRO 0-2 each rank
renders its share of the prompts (preview k on rank k % world) and rank 0 writes every file; the
files are the ones rank 0 renders alone, byte for byte, and the log says which rank rendered what.
Two real gloo ranks (tests/ranks.py), the tiny preset with its output layer randomised."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ranks

from video_dit.families.wan import FAMILY as WAN

PROMPTS = ["a red square moving right", "a blue circle moving left", "a green triangle moving up"]


def _worker(out: Path) -> None:
    import helpers
    import torch
    import torch.distributed as dist

    from video_dit.diffusion.sampling_settings import resolve_sampling
    from video_dit.families import get_preset
    from video_dit.families.wan.loading import load_dit, load_text_encoder, load_vae
    from video_dit.train.preview import PreviewJob, render

    dist.init_process_group("gloo")
    preset = get_preset("tiny")
    dit = helpers.randomize_head(load_dit("preset:tiny", seed=0)).eval()
    vae = load_vae("preset:tiny").eval()
    te = load_text_encoder("preset:tiny")
    settings = resolve_sampling(preset, None, {"steps": (3, "test"), "guidance": (1.0, "test")}, family=WAN)
    with torch.no_grad():
        embeds = te.encode(PROMPTS)
    jobs = [PreviewJob(index=i, prompt=p, embeds=e.float(), negative=None, ctrl_img=None, seed=7 + i,
                       settings=settings, num_frames=5, width=32, height=32, fps=8) for i, (p, e) in
            enumerate(zip(PROMPTS, embeds))]
    lines = []
    for name, share in (("shared", True), ("alone", False)):
        (out / name / "samples").mkdir(parents=True, exist_ok=True)
        render(dit, vae, jobs, out / name, 3, every_rank=False, i2v_mode="replace", log=lines.append, share=share,
               pipeline=WAN.pipeline)
    if dist.get_rank() == 0:
        (out / "log.txt").write_text("\n".join(lines))
    dist.barrier()  # both ranks leave together: a rank still in a gloo exchange at exit aborts
    dist.destroy_process_group()


@pytest.mark.multirank
def test_previews_are_shared_out_and_equal_rank_0_alone(tmp_path):
    procs = ranks.start([__file__, "--worker", str(tmp_path)], cwd=ranks.ROOT, log_prefix=tmp_path / "w", world=2)
    codes, logs = ranks.finish(procs, tmp_path / "w", timeout=240)
    assert codes == [0, 0], logs[-4000:]
    log = (tmp_path / "log.txt").read_text()
    assert "step 3: previews 0, 2 on rank 0; 1 on rank 1" in log, log
    for i in range(len(PROMPTS)):
        shared = tmp_path / "shared" / "samples" / f"{3:09d}_{i}.mp4"
        alone = tmp_path / "alone" / "samples" / f"{3:09d}_{i}.mp4"
        assert shared.read_bytes() == alone.read_bytes(), i  # preview 1 came from rank 1: the same frames
        assert shared.with_suffix(".png").is_file()
    # the previews differ from each other (a constant render would make the equality above trivial)
    assert len({(tmp_path / "shared" / "samples" / f"{3:09d}_{i}.mp4").read_bytes() for i in range(3)}) == 3


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(Path(sys.argv[2]))
