"""The suite's shared builders: tiny DiTs, 'pretrained' base weights, trainer job files, metrics.

Launching ranks (and the worker that runs trainer jobs as one rank) lives in tests/ranks.py.
Every test file imports these instead of writing its own copy (tests/conftest.py puts tests/ on the path).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]

# the explicit widths of `tiny_dit` (far smaller than preset:tiny): 32 wide, 2 heads of 16, 2 blocks
TINY_DIT = dict(in_dim=4, out_dim=4, dim=32, ffn_dim=64, freq_dim=16, text_dim=24, num_heads=2, num_layers=2,
                text_len=10)


def tiny_dit(seed: int = 0, head_std: float = 0.1, **changes):
    """A small random VideoDiT (`TINY_DIT` with `changes`), every weight non-trivial: the zero-initialised
    output layer is drawn N(0, head_std) after the seeded init (torch's global RNG, seeded here)."""
    from video_dit.families.wan.config import DiTConfig
    from video_dit.families.wan.dit import VideoDiT

    torch.manual_seed(seed)
    model = VideoDiT(DiTConfig(**{**TINY_DIT, **changes}))
    with torch.no_grad():
        model.head.head.weight.normal_(std=head_std)
    return model


def randomize_head(dit, std: float = 0.05, seed: int = 1):
    """Give a fresh DiT's zeroed output layer weights (a zero head predicts 0 and passes no gradient
    back to a LoRA on the blocks), from its own generator so the result does not depend on global RNG."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        dit.head.head.weight.copy_(torch.randn(dit.head.head.weight.shape, generator=g) * std)
    return dit


def diffusers_wan(in_dim: int = 4, out_dim: int = 4, seed: int = 0, *, head_dim: int = 16, text_dim: int = 24,
                  image: str | None = None, image_dim: int = 20, image_tokens: int = 5):
    """A small random diffusers `WanTransformer3DModel` (2 heads of `head_dim`, 2 layers, ffn 64, freq 16),
    its norms (and FLF2V's pos_embed) perturbed so their weights matter too. image: None, "i2v" (Wan 2.1
    I2V: image_dim + added_kv_proj_dim) or "flf2v" (+ pos_embed_seq_len = 2 * image_tokens)."""
    import diffusers

    torch.manual_seed(seed)
    heads = 2
    extra = {} if image is None else dict(image_dim=image_dim, added_kv_proj_dim=heads * head_dim,
                                          pos_embed_seq_len=2 * image_tokens if image == "flf2v" else None)
    ref = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim, in_channels=in_dim,
        out_channels=out_dim, text_dim=text_dim, freq_dim=16, ffn_dim=64, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, **extra).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name or "pos_embed" in name:
                p.add_(0.2 * torch.randn_like(p))
    return ref


def preset_dit(preset: str = "tiny", seed: int = 0, **changes):
    """A preset-shaped VideoDiT (its DiT config changed by `changes`, e.g. in_dim=36), seeded init."""
    from video_dit.families import get_preset, with_dit
    from video_dit.families.wan.dit import VideoDiT

    torch.manual_seed(seed)
    return VideoDiT(with_dit(get_preset(preset), **changes).dit)


def register_preset(name: str, base: str = "tiny", i2v_mode: str | None = None, **dit_changes):
    """Add preset `name` (`base` with its DiT config changed, e.g. in_dim=36 for channel-concat i2v)
    to this process's preset registry; a job names it in `model.preset` (the ranks register it too:
    `ranks.run_jobs(..., presets=[...])`)."""
    from dataclasses import replace

    from video_dit.families import PRESETS, get_preset, with_dit

    PRESETS[name] = replace(with_dit(get_preset(base), **dit_changes), name=name, i2v_mode=i2v_mode)
    return PRESETS[name]


def write_base(path: Path, preset: str = "tiny", seed: int = 0, **dit_changes) -> Path:
    """'Pretrained' DiT weights for trainer jobs: the preset's seeded init (`load_dit("preset:NAME")`,
    or `preset_dit` when `dit_changes` are given) with a non-zero output layer, as one safetensors file."""
    from safetensors.torch import save_file

    from video_dit.families.wan.loading import load_dit

    dit = preset_dit(preset, seed, **dit_changes) if dit_changes else load_dit(f"preset:{preset}", seed=seed)
    randomize_head(dit)
    save_file({k: v.contiguous() for k, v in dit.state_dict().items()}, str(path))
    return Path(path)


def write_hy15_base(path: Path, preset: str = "tiny-hy15-t2v", seed: int = 0, std: float = 0.05) -> Path:
    """'Pretrained' HunyuanVideo 1.5 weights (Tencent's names, one safetensors file): the preset's seeded
    init with every parameter Tencent starts at zero (adaLN, gates, output Linear, condition channels,
    biases) drawn N(0, std) from its own generator; at zero the blocks are the identity and a LoRA on
    them gets no gradient."""
    from safetensors.torch import save_file

    from video_dit.families.hunyuan15.loading import load_hy15_dit

    dit = randomize_zeros(load_hy15_dit(f"preset:{preset}", seed=seed), seed + 1, std)
    save_file({k: v.contiguous() for k, v in dit.state_dict().items()}, str(path))
    return Path(path)


def hy15_no_gradient(preset: str, lora: bool = False) -> set[str]:
    """What gets no gradient by design in a HunyuanVideo 1.5 DiT: the last double block's text stream feeds
    nothing but its keys and values (its query, query norm, output projection and MLP), as full-model names
    or, with `lora`, as the LoRA file's module names (q, k, v fused into one qkv there: k and v train it)."""
    from video_dit.families import get_preset

    last = f"double_blocks.{get_preset(preset).dit.mm_double_blocks_depth - 1}.txt_"
    if lora:
        return {f"diffusion_model.{last}{m}" for m in ("attn_proj", "mlp.fc1", "mlp.fc2")}
    return {f"{last}{m}.{kind}" for m in ("attn_q", "attn_proj", "mlp.fc1", "mlp.fc2") for kind in ("weight", "bias")} \
        | {f"{last}attn_q_norm.weight"}


def write_ltx2_base(path: Path, preset: str = "tiny-ltx2-t2v", seed: int = 0, std: float = 0.05) -> Path:
    """'Pretrained' LTX-2 DiT weights (Lightricks' names, one safetensors file): the preset's seeded init with
    every parameter it starts at zero (gate logits, keyframe embedding, output Linears, biases) drawn N(0, std);
    at zero output Linears a LoRA on the blocks gets no gradient."""
    from safetensors.torch import save_file

    from video_dit.families.ltx2.loading import load_ltx2_dit

    dit = randomize_zeros(load_ltx2_dit(f"preset:{preset}", seed=seed), seed + 1, std)
    save_file({k: v.contiguous() for k, v in dit.state_dict().items()}, str(path))
    return Path(path)


def write_h3_base(path: Path, preset: str = "tiny-h3", seed: int = 0, std: float = 0.05) -> Path:
    """'Pretrained' MiniMax H3 DiT weights (MiniMax's original names, one safetensors file): the preset's seeded
    init with every parameter it starts at zero (the AdaLN projections, the output heads, biases) drawn
    N(0, std); at zero AdaLN gates every block is the identity and a LoRA on the blocks gets no gradient. With
    the computed `rope.inv_freq` buffer, as the original checkpoint ships it (its length the rotary width the
    loader reads)."""
    from safetensors.torch import save_file

    from video_dit.families.minimax_h3.convert import ROPE_BUFFER
    from video_dit.families.minimax_h3.loading import load_h3_dit

    dit = randomize_zeros(load_h3_dit(f"preset:{preset}", seed=seed), seed + 1, std)
    state = {k: v.contiguous() for k, v in dit.state_dict().items()}
    save_file({**state, ROPE_BUFFER: dit.rope_inv_freq("cpu")}, str(path))
    return Path(path)


def randomize_all(model, seed: int = 0, norm_std: float = 0.2, vector_std: float = 0.1):
    """Every parameter of `model` random and non-trivial, from one generator (the same on every rank):
    matrices N(0, 1/fan_in), norm scales 1 + N(0, norm_std), other vectors N(0, vector_std). Seeded inits
    zero the adaLN, output and gate layers, which would hide the blocks from a parity test."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() > 1:
                p.copy_(noise * p[0].numel() ** -0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + norm_std * noise)
            else:
                p.copy_(vector_std * noise)
    return model


def randomize_zeros(dit, seed: int = 1, std: float = 0.05):
    """Every zero entry of `dit`'s parameters drawn N(0, std) from its own generator (in their dtypes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(dit.named_parameters()):
            zero = p == 0
            if zero.any():
                p.copy_(torch.where(zero, (torch.randn(p.shape, generator=g) * std).to(p.dtype), p))
    return dit


def make_world(root: Path, count: int = 2, frames: int = 9, size: int = 32, holdout: int = 1) -> Path:
    """`root/data` (demo clips; `holdout` held-out clips and first frames beside it, in `root/data_holdout`)
    and `root/base.safetensors`."""
    from video_dit.data.demo import make_demo_data

    make_demo_data(root / "data", count=count, frames=frames, size=size, seed=0, holdout=holdout)
    write_base(root / "base.safetensors")
    return root


def holdout_sample(data: Path, index: int = 0) -> dict:
    """A preview prompt of a demo folder: a held-out first frame and its caption (`demo.holdout_dir`)."""
    from video_dit.data.demo import holdout_dir

    return {"prompt": (holdout_dir(data) / f"{index:03d}.txt").read_text().strip(),
            "ctrl_img": str(holdout_dir(data) / f"{index:03d}.png")}


def merge(base: dict, extra: dict) -> dict:
    """`base` with `extra` merged in (nested dicts merged key by key, everything else replaced)."""
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def train_process(root: Path, *, data: Path | str = "data", base: Path | str = "base.safetensors", zero: int = 2,
                  lora: bool = True, steps: int = 3, save_every: int = 3, keep: int = 3, lr: float = 3e-3,
                  frames: int = 9, size: int = 32, samples: list[dict] | None = None,
                  sample_every: int = 1000, sample_steps: int = 2, timeout_s: int = 120, **sections) -> dict:
    """`config.process[0]` of a deterministic fp32 CPU job on the tiny preset (i2v demo data under
    `root / data`, the weights `root / base`, outputs in `root/out/<name>`). `samples` turns previews
    on; each keyword section (train=, model=, save=, deepspeed=, network=, ...) is merged last, and
    `network=None` / `lora=False` makes it a full fine-tune."""
    root = Path(root)
    process = {
        "type": "sd_trainer", "training_folder": str(root / "out"), "device": "cpu",
        "save": {"dtype": "float32", "save_every": save_every, "max_step_saves_to_keep": keep, "resume": "none"},
        "datasets": [{"folder_path": str(root / data), "num_frames": frames, "resolution": [size], "do_i2v": True,
                      "caption_ext": "txt"}],
        "train": {"steps": steps, "lr": lr, "batch_size": 1, "dtype": "fp32", "seed": 7, "warmup_steps": 2,
                  "lr_scheduler": "cosine", "timestep_type": "shift", "noise_scheduler": "flowmatch",
                  "skip_first_sample": samples is None, "disable_sampling": samples is None},
        "model": {"arch": "video_dit", "name_or_path": str(root / base), "preset": "tiny"},
        "deepspeed": {"zero_stage": zero, "timeout_s": timeout_s},
    }
    if lora:
        process["network"] = {"type": "lora", "linear": 4, "linear_alpha": 4}
    if samples is not None:
        process["sample"] = {"sample_every": sample_every, "width": size, "height": size, "num_frames": 5, "fps": 8,
                             "sample_steps": sample_steps, "guidance_scale": 1.0, "samples": samples}
    network = sections.pop("network", "keep")
    process = merge(process, sections)
    if network is None:
        process.pop("network", None)
    elif network != "keep":
        process["network"] = network
    return process


def write_job(root: Path, name: str, process: dict | None = None, **kw) -> Path:
    """`root/<name>.yaml`: ai-toolkit's job layout around `process` (default: `train_process(root, **kw)`)."""
    process = train_process(root, **kw) if process is None else process
    path = Path(root) / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"job": "extension", "config": {"name": name, "process": [process]}}))
    return path


def validate(root: Path, job: dict, capsys) -> tuple[int, str]:
    """`video_dit.train.validate` (the checks before any rank starts) on `job`, written to root/job.yaml:
    (exit code, what it printed to stderr)."""
    from video_dit.train.validate import main

    path = Path(root) / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    rc = main([str(path)])
    return rc, capsys.readouterr().err


def metrics(out_dir: Path) -> list[dict]:
    from video_dit.train.metrics import read_metrics

    return read_metrics(Path(out_dir) / "metrics.jsonl")


def losses(out_dir: Path) -> dict[int, float]:
    """step -> training loss of `out_dir/metrics.jsonl` (the last row of a step wins: a relaunch appends;
    a validation-only row, such as step 0's, has no training loss)."""
    return {r["step"]: r["loss"] for r in metrics(out_dir) if r.get("loss") is not None}


def step_rows(root: Path, name: str) -> list[dict]:
    """The training rows (those with a loss) of job `name`'s metrics under `root/out/name`."""
    return [r for r in metrics(Path(root) / "out" / name) if r.get("loss") is not None]


def assert_same_training(a: list[dict], b: list[dict], what: str, *, steps: list[int], loss_rtol: float,
                         grad_rtol: float | None, keys=("loss", "loss_video", "loss_audio")) -> None:
    """Two runs' training rows at the same steps with the same losses (each of `keys`, relatively within
    `loss_rtol`) and gradient norms (within `grad_rtol`; None: not compared, e.g. ZeRO-0 reports none)."""
    assert [r["step"] for r in a] == [r["step"] for r in b] == steps, what
    for x, y in zip(a, b):
        for key in keys:
            assert x[key] == pytest.approx(y[key], rel=loss_rtol), (what, key, x["step"], x[key], y[key])
        if grad_rtol is not None:
            assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=grad_rtol), (what, x["step"])


def worst_relative(a: list[dict], b: list[dict], key: str) -> float:
    """The largest relative difference of `key` between two runs' rows, step by step."""
    return max(abs(x[key] - y[key]) / abs(y[key]) for x, y in zip(a, b))


def assert_trained_comfy_lora(path: Path, dit_class, preset: str, targets, prefix: str, key: str,
                              rank: int = 4, alpha: float = 4.0) -> dict:
    """A trainer's LoRA file in ComfyUI's keys: every key under `prefix` (`key` among them), `rank` / `alpha` read
    back, exactly the adapters `add_lora(targets)` puts on `dit_class` of `preset` (none other), each tensor the
    file's, every lora_B trained (it starts at zero). Returns the native adapters."""
    from safetensors.torch import load_file

    from video_dit.families import get_preset
    from video_dit.lora import add_lora, read_lora

    raw = load_file(str(path))
    assert raw and all(k.startswith(prefix) for k in raw) and key in raw, sorted(raw)[:4]
    native, file_alpha, file_rank, _ = read_lora(path)
    assert (file_rank, file_alpha) == (rank, alpha)
    with torch.device("meta"):  # every adapter the job trained (the family's LoRA targets), none other
        model = dit_class(get_preset(preset).dit)
        add_lora(model, rank, targets=targets)
    adapters = {n.replace(".default", "") for n, _ in model.named_parameters() if ".lora_" in n}
    assert set(native) == adapters
    assert all(torch.equal(native[k.removeprefix("diffusion_model.")], v) for k, v in raw.items() if ".lora_" in k)
    assert all(v.any() for k, v in native.items() if ".lora_B." in k)  # trained (lora_B starts at zero)
    return native


def probe_inputs(in_dim: int = 16, text_dim: int = 64):
    """A fixed (x, t, context) for preset:tiny-shaped DiTs: latents (1, in_dim, 3, 4, 4), 5 text tokens."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, in_dim, 3, 4, 4, generator=g)
    return x, torch.tensor([600.0]), [torch.randn(5, text_dim, generator=g)]


def probe_kwargs(config) -> dict:
    """The extra DiT input of `probe_inputs` for a config with the CLIP image branch (fixed random
    `clip_fea` (1, Li, image_dim)); {} otherwise."""
    if config.image_dim is None:
        return {}
    g = torch.Generator().manual_seed(4)
    return {"clip_fea": torch.randn(1, config.image_context_len, config.image_dim, generator=g)}


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest |a[k] - b[k]| over two state dicts with the same keys (asserted)."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# Two runs that differ only in how fp32 sums are ordered (SP=2 vs SP=1, ZeRO-3 vs ZeRO-0, offload, micro-
# batches) compute gradients equal to ~1e-7 relative, but Adam's normalised update m/sqrt(v) turns a
# gradient entry's RELATIVE error into an update error: an entry that nearly cancels (|g| near its own
# rounding error) moves by a different fraction of lr in each run. So trained weights are compared by
# what training changed, per tensor and in norm, not element by element against a fixed epsilon:
# a LoRA by its weight delta (alpha/r) B A, zero at the start; a full fine-tune by theta - theta_base.
# TRAINED_RTOL: measured <= 2.9e-5 over the suite's LoRA comparisons (SP=2 vs SP=1, ZeRO-3 vs ZeRO-2 experts,
# accumulation, offload, checkpointing: 0 .. 2.9e-5), tolerance 5e-4 (17x); a missing or doubled gradient term
# is O(1). Full fine-tunes whose small tensors Adam amplifies more pass their own (HunyuanVideo 1.5's: 3e-3).
TRAINED_RTOL = 5e-4
# What counts as trained: a LoRA delta B A starts at exactly 0 (B = 0) and weight decay keeps it there, so any
# change is training. A full fine-tune's tensor changes under AdamW's weight decay alone (theta *= 1 - lr wd, a
# change along theta itself), so its change is counted with the part along the base removed, and must exceed
# TRAINED_MIN_CHANGE of the base's norm: Adam moves every element with a gradient by about lr a step (a few
# steps at lr 1e-3 .. 3e-2 change a tiny model's tensor by 1e-2 .. 1e-1 of its norm, in other directions than
# theta's), while decay leaves only float rounding (~1e-7 of the norm a step) off theta's direction.
TRAINED_MIN_CHANGE = 1e-4


def _trained_part(change: torch.Tensor, base: torch.Tensor | None) -> float:
    """||change|| with its component along `base` (weight decay's direction) removed; all of it without a base
    (or for a one-element tensor, whose every change is along itself)."""
    if base is None or base.numel() == 1 or not base.any():
        return change.norm().item()
    theta = base.flatten()
    along = (change.flatten() @ theta) / (theta @ theta)
    return (change.flatten() - along * theta).norm().item()


def lora_deltas(state: dict) -> dict:
    """{module: B @ A} of a LoRA file's state (our ComfyUI keys), the weight change up to alpha/r."""
    return {k[: -len(".lora_B.weight")]: state[k].float() @ state[k.replace("lora_B", "lora_A")].float()
            for k in state if k.endswith(".lora_B.weight")}


def assert_trained_close(a: dict, b: dict, base: dict | None = None, rtol: float = TRAINED_RTOL,
                         untrained: frozenset | set = frozenset()) -> float:
    """Two trained results agree in what training changed, tensor by tensor: `a`, `b` LoRA states
    (compared by `lora_deltas`) or, with `base`, full state dicts (compared by the change from `base`).
    Every compared tensor must have trained in BOTH runs (a LoRA delta non-zero; a full tensor moved off its
    base's direction by more than TRAINED_MIN_CHANGE of its norm): runs that trained nothing are not "alike".
    `untrained`: names that get no gradient by design (e.g. a stream that feeds nothing), checked to have
    trained in neither run.
    Returns the worst ||change_a - change_b|| / ||change_b||; raises naming the tensor."""
    if base is None:
        a, b = lora_deltas(a), lora_deltas(b)
        assert a, "no lora_B tensors: not a LoRA file"
        base = {}
    else:
        base = {k: v.float() for k, v in base.items()}
        a = {k: a[k].float() - base[k] for k in base}
        b = {k: b[k].float() - base[k] for k in base}
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    assert set(untrained) <= set(a), sorted(set(untrained) - set(a))[:5]
    worst, name = 0.0, None
    for k in a:
        need = TRAINED_MIN_CHANGE * base[k].norm().item() if k in base else 0.0
        for run, change in (("a", a), ("b", b)):
            size = _trained_part(change[k], base.get(k))
            if k in untrained:
                assert size <= need, f"{k}: run {run} trained it (change {size:.2e} off the base), said untrained"
            else:
                assert size > need, (f"{k}: run {run} did not train it (change {size:.2e} off the base, "
                                     f"needs > {need:.2e})")
        scale = b[k].norm().item()
        err = (a[k] - b[k]).norm().item() / scale if scale > 0 else float(a[k].norm().item() > 0)
        if err > worst:
            worst, name = err, k
    assert worst <= rtol, f"{name}: trained change differs by {worst:.2e} (relative, > {rtol:.0e})"
    return worst
