"""The memory plan of the MiniMax H3 DiT under Ulysses sequence parallelism (`minimax_h3.memory` at sp=2), against
what an SP=2 rank really keeps: 2 CPU ranks over gloo, each measuring its own forward with `CPUAllocationTracker`
as test_plan_h3.py does at SP 1 (whose `_measure` / `_plan` these are).

The layout: 7 text rows, 2 x 5 audio rows, 3 x 1 x 3 = 9 video rows: 26 packed rows, reordered to 4 + 5 + 5 = 14
per rank (`packing.rank_order`; not ceil(26 / 2) = 13: rank 1's text and video chunks each hold a padded row, a
masked key), so rank 0's rows make 3 runs of AdaLN entries (text, audio, video) and rank 1's 4 (its padded text
row takes video's entry). Full fine-tuning and LoRA, fp32 and bf16, no / the first / every block checkpointed
(every block: the seam exchanges without its recompute), padded and unpadded text, batches of 1 and 2; and one
layout with no padding at all (6 text, 10 audio, 6 video rows: no key mask reaches the seam). What each
rank's forward leaves equals the plan of that rank (`rank=`) to the byte, and the plan's default (the rank with
the most runs) is rank 1's; the step's peak within 10%. ~14 s (a launch of 2 ranks costs ~7 s of it): `-m slow`;
the SP 1 cases and the SP layout's rows and runs against `packing.rank_order` run in CI (test_plan_h3.py).
Run this file as a script (`--worker OUT`) to be one rank of a launch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import ranks
import torch

# (checkpointed blocks of 3, LoRA rank, dtype, batch, text padded), as test_plan_h3.CASES
CASES = {"full_f32": (0, None, "float32", 1, False), "full_bf16_one_ckpt_masked": (1, None, "bfloat16", 1, True),
         "full_f32_all_ckpt_b2_masked": (3, None, "float32", 2, True), "lora_f32_b2_masked": (0, 4, "float32", 2, True),
         "lora_bf16_one_ckpt": (1, 4, "bfloat16", 1, False), "lora_bf16_all_ckpt_masked": (3, 4, "bfloat16", 1, True),
         "lora_f32_unpadded": (1, 4, "float32", 1, False)}
GRID, TEXT = (3, 2, 6), 7  # 9 video rows, 7 text rows: rank 1 pads one of each
# the unpadded case: 6 text, 10 audio, 3 x 1 x 2 = 6 video rows, 11 a rank, no key mask at all
UNPADDED = "lora_f32_unpadded", (3, 2, 4), 6


# ~14 s, ~7 s of it the 2-rank launch (imports, gloo); in CI: test_plan_h3.py (docs/tests.md, "Kept out of CI")
@pytest.mark.slow
@pytest.mark.multirank

def test_h3_plan_at_sp2_to_the_byte(tmp_path):
    procs = ranks.start([__file__, "--worker", str(tmp_path)], cwd=tmp_path, log_prefix=tmp_path / "h3sp", world=2)
    ranks.wait(procs, tmp_path / "h3sp", timeout=300)
    for rank in range(2):
        res = json.loads((tmp_path / f"h3sp_rank{rank}.json").read_text())
        assert sorted(res) == sorted(CASES), res
        for name, m in res.items():
            print(f"rank {rank} {name}: saved {m['saved']} (planned {m['planned']}), rows {m['rows']}, runs "
                  f"{m['runs']}, peak {m['peak']} (planned {m['planned_peak'] / m['peak']:.3f} x)")
        for name, m in res.items():
            if name == UNPADDED[0]:
                assert (m["rows"], m["runs"]) == (11, 3), (rank, m)
            else:
                assert (m["rows"], m["runs"]) == (14, 3 + rank), (rank, name, m)  # 4 + 5 + 5 rows; text | pad: 2 runs
            assert m["saved"] == m["planned"], (rank, name, m)
            assert m["peak"] * 0.9 <= m["planned_peak"] <= m["peak"] * 1.1, (rank, name, m)
            if rank == 1 or name == UNPADDED[0]:  # the plan's default: the rank with the most runs
                assert m["planned_default"] == m["saved"], (name, m)
            else:  # ... which keeps 2 modulations a block and the final layer's of D float32 more than rank 0
                assert m["planned_default"] > m["saved"], (name, m)


def _worker(out: Path) -> None:
    import deepspeed  # the ranks only: a slow import the test process does not need
    import torch.distributed as dist

    from test_plan_h3 import _measure, _plan
    from video_dit.parallel.sequence import init_sequence_parallel

    deepspeed.init_distributed("gloo")
    info = init_sequence_parallel(2)
    results = {}
    for name, (ckpt, lora, dtype, batch, masked) in CASES.items():
        dtype = getattr(torch, dtype)
        grid, text = UNPADDED[1:] if name == UNPADDED[0] else (GRID, TEXT)
        saved, peak = _measure(lora, dtype, ckpt, batch, masked, grid=grid, sp_info=info, text_len=text)
        planned = _plan(lora, dtype, ckpt, batch, masked, grid=grid, sp=2, text_len=text, rank=info.sp_rank)
        default = _plan(lora, dtype, ckpt, batch, masked, grid=grid, sp=2, text_len=text)
        results[name] = {"saved": saved, "planned": planned.saved, "peak": peak, "planned_peak": planned.peak,
                         "rows": planned.parts["rows_per_rank"], "runs": planned.parts["runs"],
                         "planned_default": default.saved}
    (out / f"h3sp_rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--worker":
    torch.set_num_threads(1)
    _worker(Path(sys.argv[2]))
