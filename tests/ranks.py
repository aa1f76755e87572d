"""Start N gloo ranks (subprocesses with torch.distributed's env) and wait for them; and the worker that
runs a list of trainer jobs as one rank of such a launch.

- `start` / `wait`: any script as N ranks; each rank's output goes to `<log_prefix>_rank<r>.log`, and a
  failed launch raises with those logs.
- `run_jobs(root, jobs)`: N ranks of this file's worker (`python tests/ranks.py --jobs SPEC`), which
  runs `jobs` in order in ONE process group (a launch costs more than the steps: combine jobs).
  Each job is a dict: `config` (a job YAML), `resume`, and optional checks:
    run       the product's path (`trainer.run`: exit codes and messages); a non-zero code ends the launch
    predict   after training, the trained module's prediction on `helpers.probe_inputs` -> pred.safetensors
    nan       {"rank", "calls", "from_call"}: the k-th losses on that rank made non-finite
    record    every trained batch's dataset indices -> items_rank<r>.jsonl ([step, rank, indices])
    dump      the full trainable state after a resume and after each save -> state_<tag>_<step>.safetensors
              ("params": the parameters without Adam's moments, which a tensor without a gradient lacks)
    init      the trainable parameters as built, before any step (full tensors) -> init.safetensors
    stop_at   stop after this step (the LR schedule keeps the configured length)
    fault     a VIDEO_DIT_FAULT value for this job only (see video_dit/train/faults.py)
  and always writes result_rank<r>.json: VAE / text / CLIP image encode calls, the optimizer-step and micro-step
  counters, the LR scheduler's position, what the ZeRO optimizer offloads, a NonFiniteError's message,
  the class of a LoRA's base layer, the compute dtype, the parameters' dtypes (and the float32 ones' names),
  the dtypes the first block's Linears output while training (what the matmuls actually ran in), and the
  values of the integer tensors this rank's sequence-parallel seam kept (a DiT's per-row tags).
  `presets` (start_jobs / run_jobs): `helpers.register_preset` keyword dicts, registered in every rank
  before the first job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def rank_env(**extra) -> dict:
    """The environment of a rank: this checkout and tests/ importable, 1 thread, no GPU, no inherited
    rank variables or fault injection; a rank that aborts prints its threads' Python stacks."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIDEO_DIT_FAULT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]), CUDA_VISIBLE_DEVICES="",
               PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start(argv: list[str], cwd: Path, log_prefix: Path, world: int = 2, env: dict | None = None) -> list:
    """Start `python *argv` on `world` ranks (1 thread each, CPU only, `env` added); returns [(process, log)]."""
    from video_dit.devices import free_port

    port = free_port()
    procs = []
    for rank in range(world):
        rank_vars = rank_env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                             **(env or {}))
        log = open(f"{log_prefix}_rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, *argv], env=rank_vars, cwd=cwd, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    return procs


def finish(procs: list, log_prefix: Path, timeout: float = 300) -> tuple[list, str]:
    """Wait for every rank (one shared deadline; a rank still running then is killed: "timeout").
    Returns (exit codes, the ranks' logs)."""
    deadline = time.monotonic() + timeout
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            codes.append("timeout")
        log.close()
    logs = "\n".join(f"--- rank {r} (rc {c}):\n" + Path(f"{log_prefix}_rank{r}.log").read_text()
                     for r, c in enumerate(codes))
    return codes, logs


def wait(procs: list, log_prefix: Path, timeout: float = 300) -> None:
    """Wait for every rank; raise AssertionError with the failed ranks' log tails."""
    codes, _ = finish(procs, log_prefix, timeout)
    failed = [(r, c) for r, c in enumerate(codes) if c != 0]
    if failed:
        logs = "\n".join(f"--- rank {r} (rc {rc}):\n" + Path(f"{log_prefix}_rank{r}.log").read_text()[-4000:]
                         for r, rc in failed)
        raise AssertionError(f"launch {Path(log_prefix).name} failed: {failed}\n{logs}")


def start_jobs(root: Path, jobs: list[dict], world: int = 2, *, fault: str | None = None,
               presets: list[dict] | None = None, env: dict | None = None) -> tuple[list, Path]:
    """Start `jobs` (see the module docstring) on `world` ranks of one process group without waiting;
    `presets`: `helpers.register_preset` keyword dicts, registered in each rank first; `env`: added to
    the ranks' environment (e.g. CUDA_VISIBLE_DEVICES for GPU ranks). Returns (procs, log prefix) for
    `finish` / `wait`."""
    root = Path(root)
    spec = root / f"spec_{os.getpid()}_{len(list(root.glob('spec_*.json')))}.json"
    spec.write_text(json.dumps({"jobs": jobs, "presets": presets or []}))
    procs = start([__file__, "--jobs", str(spec)], cwd=root, log_prefix=root / spec.stem, world=world,
                  env={**({"VIDEO_DIT_FAULT": fault} if fault else {}), **(env or {})})
    return procs, root / spec.stem


def run_jobs(root: Path, jobs: list[dict], world: int = 2, *, fault: str | None = None, timeout: float = 900,
             check: bool = True, presets: list[dict] | None = None, env: dict | None = None) -> tuple[list, str, float]:
    """Run `jobs` (see the module docstring) in order on `world` ranks of one process group.
    Returns (exit codes, the ranks' logs, seconds until the last rank exited); with `check`, a failed
    launch raises with the logs."""
    t0 = time.monotonic()
    procs, prefix = start_jobs(root, jobs, world, fault=fault, presets=presets, env=env)
    codes, logs = finish(procs, prefix, timeout)
    elapsed = time.monotonic() - t0
    if check and any(c != 0 for c in codes):
        raise AssertionError(f"launch {prefix.name} failed: {codes}\n{logs[-8000:]}")
    return codes, logs, elapsed


def result(out_dir: Path, rank: int = 0) -> dict:
    """The worker's result_rank<r>.json of a job's output folder."""
    return json.loads((Path(out_dir) / f"result_rank{rank}.json").read_text())


# ---------------------------------------------------------------- the worker (one rank)

def full_state(trainer, moments: bool = True) -> dict:
    """The trainable state as full tensors, whatever the ZeRO partitioning: fp32 params and Adam moments
    (`moments`; collective under ZeRO; every rank calls), plus the step and the LR scheduler's position (each
    expert's, keys prefixed `<expert>/`, in a two-expert job)."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for expert, e in trainer.experts.items():  # one DiT (expert None), or each trained expert's, prefixed
        pre = f"{expert}/" if expert else ""
        for name, p in e.module.named_parameters():
            if not p.requires_grad:
                continue
            out[f"{pre}param/{name}"] = safe_get_full_fp32_param(p).detach().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq") if moments and e.scheduler.last_epoch > 0 else ():  # none before step 1
                out[f"{pre}{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
        out[f"{pre}lr_step"] = torch.tensor(e.scheduler.last_epoch)
    out["step"] = torch.tensor(trainer.step)
    return out


class _Calls:
    """Counts calls of a method of some classes (patched on each class: the trainer builds its own
    instances; one count for all of them, e.g. both families' VAEs)."""

    def __init__(self, classes, name: str):
        self.n = 0
        for cls in classes:
            self._patch(cls, name)

    def _patch(self, cls, name: str) -> None:
        original = getattr(cls, name)

        def counted(obj, *a, **kw):
            self.n += 1
            return original(obj, *a, **kw)
        setattr(cls, name, counted)


def _poison(trainer, nan: dict) -> None:
    loss_of, calls = trainer.loss_of, [0]

    def poisoned(batch, micro):
        loss = loss_of(batch, micro)
        calls[0] += 1
        if trainer.rank == nan["rank"] and (calls[0] in nan["calls"] or calls[0] >= nan["from_call"]):
            return loss * float("nan")
        return loss
    trainer.loss_of = poisoned


def _record(trainer, out: Path):
    loss_of, record = trainer.loss_of, open(out / f"items_rank{trainer.rank}.jsonl", "a")

    def recording(batch, micro):
        record.write(json.dumps([trainer.step + 1, trainer.rank, batch["index"].tolist()]) + "\n")
        record.flush()
        return loss_of(batch, micro)
    trainer.loss_of = recording
    return record


def _dump(trainer, out: Path, moments: bool = True) -> None:
    from safetensors.torch import save_file

    def dump(tag):
        state = full_state(trainer, moments)
        if trainer.rank == 0:
            save_file(state, str(out / f"state_{tag}_{trainer.step}.safetensors"))

    if trainer.step > 0:  # resumed: the state as loaded (a fresh start has no Adam moments yet)
        dump("start")
    save = trainer.save

    def save_and_dump():
        save()
        dump("saved")
    trainer.save = save_and_dump


def _watch_linears(block) -> set:
    """The dtypes the plain nn.Linear layers of `block` (LoRA adapters and base layers alike) output
    from now on, gathered in the returned set (a forward hook each)."""
    import torch

    seen = set()
    for m in block.modules():
        if type(m) is torch.nn.Linear:
            m.register_forward_hook(lambda mod, args, out: seen.add(str(out.dtype)))
    return seen


def _watch_integer_splits(seq_parallel) -> set:
    """The values of the integer tensors (a DiT's per-row tags, such as MiniMax H3's AdaLN entries) this rank's
    sequence-parallel seam keeps from now on, gathered in the returned set (empty without one)."""
    import torch

    seen = set()
    if seq_parallel is not None:
        split = seq_parallel.split

        def recording(t, dim, *args, **kwargs):
            part = split(t, dim, *args, **kwargs)
            if not part.is_floating_point() and part.dtype != torch.bool:
                seen.update(part.flatten().tolist())
            return part
        seq_parallel.split = recording
    return seen


def _save_init(trainer, out: Path) -> None:
    from safetensors.torch import save_file

    from video_dit.parallel.zero import gathered

    trainable = [(n, p) for n, p in trainer.module.named_parameters() if p.requires_grad]
    with gathered([p for _, p in trainable], trainer.zero_stage):  # whole under ZeRO-3 too
        state = {n: p.detach().float().clone().contiguous() for n, p in trainable}
    if trainer.rank == 0:
        save_file(state, str(out / "init.safetensors"))


def _predict(trainer, out: Path) -> None:
    import torch
    from helpers import probe_inputs, probe_kwargs
    from safetensors.torch import save_file

    from video_dit.parallel.zero import gathered

    module = trainer.module
    x, t, ctx = probe_inputs(module.config.in_dim, module.config.text_dim)
    extra = {k: v.to(trainer.dtype) for k, v in probe_kwargs(module.config).items()}  # CLIP features, if any
    module.eval()
    with torch.no_grad():  # under ZeRO-3 every rank runs the forward (hooks gather each block)
        pred = module(x.to(trainer.dtype), t, [c.to(trainer.dtype) for c in ctx], **extra)
    with gathered(list(module.parameters()), trainer.zero_stage):
        if trainer.rank == 0:
            save_file({"pred": pred.float().contiguous()}, str(out / "pred.safetensors"))


def worker(spec_path: str) -> int:
    import torch
    from helpers import register_preset

    from video_dit.families.hunyuan15.encoders import HY15ImageEncoder, HY15PromptEncoder
    from video_dit.families.hunyuan15.vae import HunyuanVideo15VAE
    from video_dit.families.wan.image_encoder import ImageEncoder
    from video_dit.families.wan.text_encoder import TextEncoder
    from video_dit.families.wan.vae import CausalVideoVAE
    from video_dit.train.config import load_job
    from video_dit.train.trainer import NonFiniteError, Trainer, run

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    for preset in spec.get("presets", []):
        register_preset(**preset)
    vae_calls, text_calls = _Calls([CausalVideoVAE, HunyuanVideo15VAE], "encode"), \
        _Calls([TextEncoder, HY15PromptEncoder], "encode")
    image_calls = _Calls([ImageEncoder, HY15ImageEncoder], "encode")
    for item in spec["jobs"]:
        job = load_job(item["config"])
        vae0, text0, image0 = vae_calls.n, text_calls.n, image_calls.n
        if item.get("fault"):  # this job's VIDEO_DIT_FAULT (faults.install reads it when the Trainer is built)
            os.environ["VIDEO_DIT_FAULT"] = item["fault"]
        if item.get("run"):
            code = run(job, resume=item.get("resume"))
            if code:
                return code
            continue
        trainer = Trainer(job, resume=item.get("resume"))
        if item.get("fault"):
            del os.environ["VIDEO_DIT_FAULT"]
        out = job.out_dir
        res = {"vae_encode_calls_at_start": vae_calls.n - vae0, "text_encode_calls_at_start": text_calls.n - text0,
               "image_encode_calls_at_start": image_calls.n - image0}
        first_linear = next(m for m in trainer.module.blocks[0].modules() if hasattr(m, "base_layer")
                            or type(m) is torch.nn.Linear)
        base = getattr(first_linear, "base_layer", None)
        res["quantized"] = type(base).__name__ if base is not None else None
        res["dtype"] = str(trainer.dtype)  # the compute dtype the trainer chose
        res["param_dtypes"] = sorted({str(p.dtype) for p in trainer.module.parameters()})
        res["float32_params"] = sorted(n for n, p in trainer.module.named_parameters() if p.dtype == torch.float32)
        linear_dtypes = _watch_linears(trainer.module.blocks[0])
        split_values = _watch_integer_splits(trainer.module.seq_parallel)
        if item.get("nan") is not None:
            _poison(trainer, item["nan"])
        record = _record(trainer, out) if item.get("record") else None
        if item.get("init"):
            _save_init(trainer, out)
        if item.get("dump"):
            _dump(trainer, out, moments=item["dump"] != "params")
        if item.get("stop_at"):
            trainer.p.train.steps = item["stop_at"]
        code = 0
        try:
            code = trainer.train()
        except NonFiniteError as exc:
            res["nonfinite"] = str(exc)
        opt = trainer.engine.optimizer  # DeepSpeed's ZeRO optimizer: what it actually offloads
        res.update(offload_optimizer=bool(getattr(opt, "cpu_offload", False) or getattr(opt, "offload_optimizer", False)),
                   offload_param=bool(getattr(opt, "offload_param", False)))
        res["linear_output_dtypes"] = sorted(linear_dtypes)
        res["sp_split_integer_values"] = sorted(split_values)
        res.update(vae_encode_calls=vae_calls.n - vae0, text_encode_calls=text_calls.n - text0,
                   image_encode_calls=image_calls.n - image0, step=trainer.step,
                   scheduler_steps=trainer.scheduler.last_epoch, engine_global_steps=trainer.engine.global_steps,
                   engine_micro_steps=trainer.engine.micro_steps)
        (out / f"result_rank{trainer.rank}.json").write_text(json.dumps(res))
        if record is not None:
            record.close()
        if item.get("predict"):
            _predict(trainer, out)
        trainer.close()
        if code:
            return code
    return 0


def _worker_main(spec: str):
    """Run the jobs; a finished rank ends as the product's does (`end_rank`), a failed one leaves the
    group and raises."""
    from video_dit.parallel.process import end_rank, leave_distributed

    try:
        code = worker(spec)
    except BaseException:
        leave_distributed()
        raise
    end_rank(code)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--jobs":
        _worker_main(sys.argv[2])
    sys.exit(f"usage: {sys.argv[0]} --jobs SPEC.json")
