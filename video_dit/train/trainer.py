"""The training loop: cached latents -> flow matching -> first-frame conditioning -> DiT -> masked MSE
-> DeepSpeed. The trainer holds no model math; the DiT holds no distributed code.

    Trainer(job)         set-up, in order: process group; VAE + text encoder; data scan and caches
                         (split across ranks); preview prompts encoded; text encoder freed; DiT (+ LoRA,
                         + checkpointing); resume plan; deepspeed.initialize; quantize; load checkpoint
    Trainer.train()      steps until train.steps, with metrics, validation, EMA, previews, checkpoints and
                         exports (validation: video_dit/train/validation.py; EMA: video_dit/train/ema.py)
    Trainer.close()      release the logger (the process group stays for the launcher's teardown)

Two-expert models (Wan 2.2 A14B, train/experts.py): one DeepSpeed engine per trained expert, in one
process (each with its own LoRA or full weights, optimizer, LR scheduler and checkpoint subfolder;
under ZeRO-3 each partitioned); optimizer step s trains the expert `ExpertSchedule.expert_of(s)` (all
ranks agree: a pure function of the job and s, checked every step) on timesteps of its own side of the
boundary. An expert that is loadable but not trained renders previews and validation only (frozen:
partitioned under ZeRO-3; under ZeRO 0-2 on the CPU, moved to the device while it is used).

Determinism: the noise and timestep of each sample come from its own generator, seeded by (seed, r,
s, j) for optimizer step s on data-parallel rank r, j the sample's position among the samples this
rank trains in step s (micro-batch m of batch size b: j = m*b + i). So a resumed run draws exactly
what the uninterrupted one drew, and `gradient_accumulation: k` at batch size b draws what one batch
of k*b draws (accumulation changes memory, not the training). The data order is the sampler's
(seed, epoch, position). Together with DeepSpeed's model/optimizer/LR state this makes "6 steps"
and "3 steps + relaunch + 3 steps" give the same losses.
"""

from __future__ import annotations

import gc
import hashlib
import json
import random
import re
import shutil
import sys
import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from video_dit.data import BucketBatchSampler, CachedDataset, DataError, ScanResult, build_cache, collate, scan_datasets
from video_dit.data.demo import preview_steps, report
from video_dit.data.demo_av import previews_have_sound, sound_report
from video_dit.data.cache import TEXT_NAMES
from video_dit.data.frames import load_item_audio
from video_dit.devices import device_peak_flops, local_device, pin_memory, to_device
from video_dit.diffusion.experts import EXPERTS, TwoExperts, expert_at, expert_range
from video_dit.diffusion.flow import TimestepSampler
from video_dit.diffusion.objective import AudioBatch, flow_matching_loss
from video_dit.media import tensor_to_pil
from video_dit.models.common import te_quantization
from video_dit.models.layouts import mixed_outputs, write_sources
from video_dit.models.saved import dit_folder
from video_dit.models.weights import WeightsError
from video_dit.parallel.memory import ActivationPeak, release_heap_per_block
from video_dit.parallel.process import init_distributed
from video_dit.parallel.sequence import attach, init_sequence_parallel
from video_dit.parallel.zero import Distribution
from video_dit.spec import spec_of_job
from video_dit.train import checkpoint as ckpt
from video_dit.train import export, faults, outcome, validation
from video_dit.train.build import build_dit, make_trainable
from video_dit.train.caches import cache_spaces, encoder_dtypes
from video_dit.train.ema import EMA
from video_dit.train.engine import LRSchedule, initialize, schedule_change, sync_lr
from video_dit.train.experts import ExpertSchedule, plan_experts
from video_dit.train.metrics import MetricsLog, WandbLog, peak_memory_gb, read_metrics, step_flops
from video_dit.train.plan import AutoCheckpointing, auto_checkpointing, machine_here, oom_message
from video_dit.train.precision import build_dtype, cpu_fp32_notice, quantize_frozen, train_dtype
from video_dit.train.preview import describe, encode_preview_images, encode_prompts, job_scheduler, render

EXIT_BAD_INPUT = 2    # weights / data / checkpoint that cannot be used (as a bad config)
EXIT_NONFINITE = 3
EXIT_SAVE_FAILED = 4  # a checkpoint could not be written (disk full, ...)
EXIT_OUT_OF_MEMORY = 5  # a step ran out of device memory (the message says what would lower it)


class NonFiniteError(RuntimeError):
    """Too many non-finite losses in a row; the last good checkpoint is kept."""


def _seed_of(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & (2 ** 63 - 1)


class Expert:
    """One trained DiT of the job: its DeepSpeed engine (module, optimizer, LR scheduler) and its
    timestep sampler. `name`: the expert ("high_noise" / "low_noise"), None for a one-model job."""

    def __init__(self, name, engine, optimizer, scheduler, timesteps):
        self.name, self.engine, self.optimizer, self.scheduler = name, engine, optimizer, scheduler
        self.module, self.timesteps = engine.module, timesteps


class Trainer:
    def __init__(self, job, resume: str | None = None, log=print):
        self.job, self.p = job, job.process
        self._log = log
        self._join()                       # the process group, this rank's device, dtype, ZeRO and sequence groups
        self.spec = spec_of_job(self.p)    # which files make up the model, resolved once
        self.preset = self.spec.preset
        self.family = self.spec.family     # its loaders and what the trainer asks of it (`Family.training`)
        self.i2v_mode = self.spec.i2v_mode
        self.any_i2v = any(d.do_i2v for d in self.p.datasets)
        sound, t = self.family.audio, self.p.train  # a DiT with sound: its audio stream's timesteps and loss weight
        self.audio_timesteps = t.audio_timesteps or (sound.timesteps if sound is not None else None)
        self.audio_loss_weight = t.audio_loss_weight if t.audio_loss_weight is not None else (
            sound.loss_weight if sound is not None else None)
        self._parts: dict = {}
        self._encode()                     # 1. caches and preview prompts; the encoders are freed after
        plan = self._build_models(resume)  # 2.-3. the DiTs trained (one, or experts) under DeepSpeed
        self._restore(plan)                # 4. a checkpoint's weights, optimizer, EMA and data position
        # metrics.jsonl is the run's history: rows of steps after the resumed one (done again now) are dropped
        lg = self.p.logging  # Weights & Biases as ai-toolkit sends it (`logging.use_wandb`), rank 0
        wandb = WandbLog(lg.project_name, lg.run_name, self.job.raw, lg.log_every, self.out_dir) \
            if lg.use_wandb else None
        self.metrics = MetricsLog(self.out_dir, enabled=self.rank0, resume_step=self.step, wandb=wandb)
        self.act_peak = ActivationPeak(self.device)  # activation peak per rank, for metrics
        self.peak_flops, self.peak_source = device_peak_flops(self.dtype)
        faults.install(self)  # the fault suite's hooks (tests/faults/); inert unless VIDEO_DIT_FAULT is set

    def _join(self) -> None:
        """The process group and what each rank needs to know of its place: device, training dtype,
        the ZeRO layout, the sequence groups, the output folders and the per-rank seeds."""
        self.rank, self.world = init_distributed(self.p.deepspeed.timeout_s)
        self.rank0 = self.rank == 0
        self.job = self.job.for_ranks(self.world)  # train.global_batch_size over the data-parallel ranks
        self.p = p = self.job.process
        self.device = local_device()
        self.dtype = train_dtype(p.train.dtype, p.train.cpu_bf16)
        self.dist = Distribution.of(self.job, self.world)
        self.zero_stage = self.dist.stage
        self.out_dir = self.job.out_dir
        self.ckpt_dir = self.out_dir / "checkpoints"
        mixed = mixed_outputs(self.out_dir, "video_dit")  # the launcher refused it already (validate.check_paths)
        if mixed is not None:
            raise ckpt.ResumeError(f"config.name: {mixed}")
        if self.rank0:
            (self.out_dir / "samples").mkdir(parents=True, exist_ok=True)
            ckpt.clean_incomplete(self.ckpt_dir)
        seed = p.train.seed
        random.seed(seed + self.rank)
        np.random.seed((seed + self.rank) % 2 ** 32)
        torch.manual_seed(seed + self.rank)
        self.sp = p.deepspeed.sequence_parallel_size
        # sequence parallel (video_dit/parallel/sequence.py): the N ranks of a sequence group share one
        # batch and its noise, so data and noise follow the data-parallel rank; ZeRO still spans all ranks
        self.sp_info = init_sequence_parallel(self.sp)
        self.dp_world, self.dp_rank = self.sp_info.dp_size, self.sp_info.dp_rank
        t = p.train
        if t.global_batch_size is not None:
            self.log(f"train.global_batch_size {t.global_batch_size} on {self.dp_world} data-parallel rank(s): "
                     f"micro-batches of {t.batch_size} x {t.gradient_accumulation} per step and rank")
        notice = cpu_fp32_notice(p.train.dtype, self.dtype)
        if notice:
            self.log(notice)

    def _encode(self) -> None:
        """1. The frozen encoders, the caches, the preview prompts (and images); then the text and image
        encoders are freed: training reads cached tensors only. The VAE runs in model.vae_dtype (float32
        by default, as Wan runs it), the text and image encoders in the training dtype (Wan's umT5 runs
        in bf16)."""
        p, spec, family = self.p, self.spec, self.family
        vae_dtype, _ = encoder_dtypes(p)
        self.vae = family.load_vae(spec.vae, dtype=vae_dtype, device=self.device).eval().requires_grad_(False)
        text_encoder = family.load_text_encoder(spec.text_encoder, dtype=self.dtype, device=self.device,
                                                quantize=te_quantization(p.model), tokenizer=spec.tokenizer)
        image_encoder = None
        if spec.image_encoder is not None:
            image_encoder = family.load_image_encoder(spec.image_encoder, dtype=self.dtype, device=self.device,
                                                      quantize="qfloat8" if p.model.quantize_image_encoder else None)
        # a DiT with sound: its audio codec encodes the clips' tracks (cached) and decodes the previews'
        self.audio_codec = (family.audio.load_codec(spec.audio, dtype=vae_dtype, device=self.device, seed=p.model.seed)
                            if family.audio is not None else None)
        self._build_data(text_encoder, image_encoder)
        self.previews = (encode_prompts(p.sample, text_encoder, self.preset, job_scheduler(p), family.prompt_images)
                         if self._sampling_enabled() else [])
        # the image encoder once per preview image (Wan's CLIP, HunyuanVideo 1.5's SigLIP)
        encode_preview_images(self.previews, image_encoder, family.image_embeds, log=self.log)
        for line in describe(self.previews):
            self.log(line)
        del text_encoder, image_encoder
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _build_models(self, resume: str | None):
        """2. Which DiTs: one model, or the experts a two-expert job trains (train/experts.py), and the
        rule of which expert trains which step. 3. The resume plan (it decides load_universal and the LR
        schedule), then per trained DiT: build (under ZeRO-3 partitioned: no rank holds a whole model),
        trainable parameters, checkpointing, DeepSpeed, quantization of the frozen base; the frozen
        experts of previews, the conditioning and the EMA. Returns the resume plan."""
        p = self.p
        self.expert_plan = plan_experts(p, self.preset)
        trained = self.expert_plan.trained if self.expert_plan else (None,)
        self.expert_schedule = None
        if self.expert_plan is not None:
            self.expert_schedule = ExpertSchedule(self.expert_plan, p.train.seed, timestep_sampler(p, self.preset),
                                                  _seed_of)
        plan = ckpt.plan_resume(resume or p.save.resume, self.ckpt_dir, self.world, self.zero_stage,
                                convert=ckpt.to_universal,  # another world size / ZeRO stage: universal format
                                experts=self.expert_plan.trained if self.expert_plan else None)
        self.schedule = self._schedule(plan)  # the job's global-step schedule; each expert's at its steps
        self.experts: dict[str | None, Expert] = {}
        for name in trained:
            dit = self._build_dit(name)
            steps = self.expert_schedule.steps_of(name, p.train.steps) if len(trained) > 1 else None
            engine, optimizer, scheduler = initialize(
                dit, self.job, self.world, load_universal=plan is not None and plan.universal, schedule=self.schedule,
                steps=steps, distribution=self.dist)
            if p.model.quantize:
                quantize_frozen(engine.module, p.model.qtype_name, self.family.arch)
            t_range = expert_range(name, self.expert_plan.boundary, p.train.min_t, p.train.max_t) if name else None
            self.experts[name] = Expert(name, engine, optimizer, scheduler, timestep_sampler(p, self.preset, t_range))
        self.activate(trained[0])
        self.dit_config = self.module.config
        self.frozen_experts = self._build_preview_experts()
        self.conditioning = job_conditioning(p, self.dit_config, self.family.training)
        self.ema = None
        if p.train.ema_config.use_ema:
            # a two-expert job: one average over both trained experts' weights, updated after every
            # optimizer step (the inactive expert's weights held still), as ai-toolkit's EMA of its one
            # network holding both experts' LoRAs; parameter names prefixed by the expert
            tracked = self.module if self.expert_plan is None else torch.nn.ModuleDict(
                {name: e.module for name, e in self.experts.items()})
            self.ema = EMA(tracked, p.train.ema_config.ema_decay, self.zero_stage)
        # train.gradient_checkpointing: auto: the plan's blocks per bucket (`_checkpoint_for`)
        self.auto_ckpt = AutoCheckpointing(self.job, machine_here(self.world, self.device)) \
            if auto_checkpointing(self.job) else None
        self._ckpt_blocks = None
        return plan

    def _restore(self, plan) -> None:
        """4. The step counters, and from a checkpoint (`plan`, None for a fresh run): the engines' state,
        the LR, the EMA and the sampler's position."""
        self.step = 0
        self._drawn_t: list[float] = []  # this optimizer step's timesteps on this rank (two-expert metrics)
        self.nonfinite_in_row = 0
        self.config_hash = self.job.config_hash()
        if plan is None:
            return
        state = ckpt.load(self.engines(), plan)
        for e in self.experts.values():  # the restored optimizers hold the checkpoint schedule's last LR
            sync_lr(e.scheduler)
        if self.ema is not None and not self.ema.load(plan.source):
            self.log(f"warning: {plan.source} holds no EMA; the average restarts from the resumed weights")
        self.step = int(state["step"])
        self.nonfinite_in_row = int(state.get("nonfinite_in_row", 0))
        self.sampler.load_state_dict(state["sampler"])
        if state.get("config_hash") not in (None, self.config_hash):
            self.log(f"warning: {plan.path} was saved with a different training config "
                     f"(hash {state.get('config_hash')} vs {self.config_hash}); resuming anyway")
        self.log(f"resumed from {plan.path} at step {self.step}")

    # ---------------------------------------------------------------- set-up helpers
    def log(self, msg: str) -> None:
        if self.rank0:
            self._log(f"[video_dit] {msg}")

    def _build_dit(self, expert: str | None, trainable: bool = True, device=None):
        """One DiT of the job (`build_dit`; an expert's from its source): trainable (`make_trainable`:
        LoRA or full weights, checkpointing, sequence parallelism), or frozen in eval mode."""
        p = self.p
        source, seed = (self.spec.dit, self.spec.seed) if expert is None else self.expert_plan.sources[expert]
        # a LoRA base (or a frozen expert) is built in the training dtype, a full fine-tune in float32
        # (its master weights); bf16 keeps the float32 islands either way
        dtype = build_dtype(self.dtype, lora=p.network is not None) if trainable else self.dtype
        dit = build_dit(source, self.preset, zero_stage=self.zero_stage, dtype=dtype, device=device or self.device,
                        seed=seed, ds_config=self.dist.config, family=self.family)
        if self.dist.partitioned and self.device.type == "cpu":  # host-memory gathers, block by block
            release_heap_per_block(dit)
        if trainable:
            # attention backend, LoRA or full, float32 trainable / bf16 frozen bulk, checkpointing, Ulysses SP
            return make_trainable(dit, p, self.dtype, self.sp_info, family=self.family, expert=expert).train()
        dit.set_attention_backend(p.model.attention_backend)
        attach(dit, self.sp_info)  # dit.seq_parallel: Ulysses attention when sequence_parallel_size > 1
        return dit.requires_grad_(False).eval()

    def _build_preview_experts(self) -> dict:
        """The experts that are loadable but not trained, frozen, for previews and validation only (a
        one-expert job on a two-expert model): under ZeRO-3 partitioned behind an optimizer-less engine;
        under ZeRO 0-2 on the CPU, moved to the device for its preview steps (`TwoExperts` offload) and
        for a validation; a validation sigma of an expert the job cannot load is refused at the start."""
        plan = self.expert_plan
        if plan is None or not (self._sampling_enabled() or self.validator is not None):
            return {}
        if not self.dist.collective_forward and not self.rank0 and self.validator is None:
            return {}  # under ZeRO 0-2 (no sequence parallelism) rank 0 renders alone: only it holds the expert
        frozen = {}
        for name in (e for e in plan.sources if e not in plan.trained):
            on = "cpu" if self.dist.frozen_on_host else None  # moved to the device when used
            frozen[name] = self.dist.frozen(self._build_dit(name, trainable=False, device=on))
        return frozen

    def activate(self, name: str | None) -> None:
        """Make `name`'s engine, optimizer, LR scheduler, module and timestep sampler the ones the loop and
        the outputs use (`self.engine`, ...): the expert of the step being built (None: the one model)."""
        e = self.experts[name]
        self.active = name
        self.engine, self.optimizer, self.scheduler, self.module, self.timesteps = (
            e.engine, e.optimizer, e.scheduler, e.module, e.timesteps)

    def engines(self):
        """The DeepSpeed engine, or {expert: engine} of a two-expert job (checkpoints hold each)."""
        if self.expert_plan is None:
            return self.engine
        return {name: e.engine for name, e in self.experts.items()}

    def _schedule(self, plan) -> LRSchedule:
        """The LR schedule of this run: the job's; on resume the checkpoint's, extended when train.steps
        changed (`LRSchedule.extended`, logged). Other schedule changes are refused (`ResumeError`)."""
        fresh = LRSchedule.of(self.p.train)
        if plan is None:
            return fresh
        saved = plan.meta.get("lr_schedule")
        if saved is None:
            self.log(f"warning: {plan.path} records no LR schedule (an older checkpoint); this job's schedule "
                     "applies as if it had been configured from the start")
            return fresh
        change = schedule_change(plan.meta, self.p.train)
        if change is not None:
            raise ckpt.ResumeError(f"config.process[0].train.{change[0]}: {change[1]}")
        old, step = LRSchedule(**saved), int(plan.meta["step"])
        if old.total == fresh.total or step >= fresh.total:
            return old
        new = old.extended(step, fresh.total)
        self.log(new.describe(step, old))
        return new

    def _sampling_enabled(self) -> bool:
        s = self.p.sample
        return s is not None and bool(s.samples) and not self.p.train.disable_sampling

    def _build_data(self, text_encoder, image_encoder=None) -> None:
        """The datasets scanned, every item's latents and text embeddings cached (split across ranks),
        the held-out items' validator, and the loader of this rank's batches."""
        p, spec, sound = self.p, self.spec, self.family.audio
        scan = scan_datasets(p.datasets, self.preset.divisibility, verbose=self.rank0,
                             i2v_mode=self.i2v_mode if self.any_i2v else None, audio=sound is not None)
        scan, val_scan = validation.collect(p, scan, self.preset.divisibility, verbose=self.rank0,
                                            audio=sound is not None)
        space, text_space = cache_spaces(p, self.preset, spec.vae, spec.text_encoder, next(self.vae.parameters()).dtype,
                                         text_encoder.dtype, spec.image_encoder, image_encoder,
                                         spec.audio if sound is not None else None)
        vae, training = self.vae, self.family.training

        def encode_fn(video):  # (1, 3, F, H, W) in [-1, 1] on CPU
            video = video.to(self.device, vae.dtype if hasattr(vae, "dtype") else torch.float32)
            out = {"latents": vae.normalize(vae.encode(video).mode()).float()}
            if self.any_i2v:  # the first frame's latents, the image encoder's embeds (`Training.cache_item`)
                out.update(training.cache_item(vae, video, p.i2v_mode, p.flf2v, image_encoder))
            return out

        def text_fn(captions):  # {key: (L, D)} per caption (`Training.text_entry`)
            return [training.text_entry(e) for e in text_encoder.encode(captions)]

        # a conditioner that presents a clip's first frame with its caption (`Family.prompt_images`: MiniMax H3): the
        # captions of do_i2v clips encoded with it, keyed on the clip (`data.cache.item_text_path`)
        keyframe_text = self.any_i2v and self.family.prompt_images is not None

        def keyframe_text_fn(captions, first):  # first (3, H, W) in [-1, 1] -> {key: (L, D)} per caption
            image = tensor_to_pil(first)[0]  # uint8-rounded, as ai-toolkit hands the frame to its conditioner
            shown = self.family.prompt_images(image, None, image.height, image.width)
            return [training.text_entry(e) for e in text_encoder.encode(captions, images=[shown] * len(captions))]

        def audio_fn(item):  # a DiT with sound: the clip's track over its frames' span, encoded (zeros without)
            return audio_entry(item, self.audio_codec, sound, p.datasets[item.dataset].fps, self.device, vae.dtype)

        t0 = time.perf_counter()
        everything = scan if val_scan is None else ScanResult.merge([scan, val_scan])
        build_cache(everything, encode_fn, text_fn, rank=self.rank, world_size=self.world, space_version=space,
                    text_space_version=text_space, barrier=dist.barrier, verbose=self.rank0,
                    audio_fn=audio_fn if sound is not None else None,
                    keyframe_text_fn=keyframe_text_fn if keyframe_text else None)
        self.log(f"caches ready in {time.perf_counter() - t0:.1f}s")
        self.dataset = CachedDataset(scan, space_version=space, text_space_version=text_space, seed=p.train.seed,
                                     keyframe_text=keyframe_text)
        self.validator = None
        if val_scan is not None:
            val_set = CachedDataset(val_scan, space_version=space, text_space_version=text_space, seed=p.train.seed,
                                    keyframe_text=keyframe_text)
            self.validator = validation.Validator(
                p.train.validation_config, val_set, dp_rank=self.dp_rank, dp_size=self.dp_world,
                sp_rank=self.sp_info.sp_rank, device=self.device,
                collective=self.dist.collective_forward)
            self.log(f"validation: {len(val_set)} held-out items at sigmas {p.train.validation_config.validation_sigmas}")
        self.sampler = BucketBatchSampler(self.dataset, p.train.batch_size, world_size=self.dp_world,
                                          rank=self.dp_rank, seed=p.train.seed)
        workers = max(d.num_workers for d in p.datasets)
        # pinned host batches on GPU ranks: their copies to the device are asynchronous (`loss_at`)
        self.loader = torch.utils.data.DataLoader(self.dataset, batch_sampler=self.sampler, collate_fn=collate,
                                                  num_workers=workers, pin_memory=pin_memory())
        self._consumed = 0

    def _batches(self):
        while True:
            self.dataset.set_epoch(self.sampler.epoch)
            self._consumed = 0
            for batch in self.loader:
                self._consumed += 1
                yield batch

    # ---------------------------------------------------------------- one micro-batch
    def loss_of(self, batch: dict, micro: int) -> torch.Tensor:
        """Flow-matching loss of one micro-batch (forward only). `micro` numbers micro-batches within the
        optimizer step being built: each sample's t and noise come from its own generator, seeded by
        (seed, rank, step, the sample's position in the step) (module docstring)."""
        B, shape = batch["latents"].shape[0], (1, *batch["latents"].shape[1:])
        first = micro * self.p.train.batch_size  # this micro-batch's first position in the step
        gens = [torch.Generator("cpu").manual_seed(_seed_of(self.p.train.seed, self.dp_rank, self.step, first + i))
                for i in range(B)]
        t = torch.cat([self.timesteps.sample(1, g) for g in gens])  # (B,) on [min_t, max_t]
        noise = torch.cat([torch.randn(shape, generator=g) for g in gens])  # (B, C, F', h, w)
        # the conditioning's own noise of this step (MiniMax H3's keyframe rows), after the video's from each generator
        cond_noise = None if self.conditioning is None else torch.cat(
            [torch.randn((*shape[:2], 1, *shape[3:]), generator=g) for g in gens])  # (B, C, 1, h, w)
        self._drawn_t.extend(t.tolist())
        audio_t = audio_noise = None
        if "audio_latents" in batch:  # a DiT with sound: the audio stream's own generators (tied: the video's t)
            agens = [torch.Generator("cpu").manual_seed(_seed_of(self.p.train.seed, self.dp_rank, self.step, first + i,
                                                                 "audio")) for i in range(B)]
            audio_t = None if self.audio_timesteps == "tied" else torch.cat([self.timesteps.sample(1, g)
                                                                              for g in agens])
            a_shape = (1, *batch["audio_latents"].shape[1:])
            audio_noise = torch.cat([torch.randn(a_shape, generator=g) for g in agens])
        return self.loss_at(batch, t, noise, audio_t=audio_t, audio_noise=audio_noise, parts=self._parts,
                            cond_noise=cond_noise)

    def loss_at(self, batch: dict, t: torch.Tensor, noise: torch.Tensor, model=None, audio_t=None, audio_noise=None,
                parts: dict | None = None, cond_noise: torch.Tensor | None = None) -> torch.Tensor:
        """The training loss of `batch` at given timesteps t (B,) and noise (B, C, F', h, w): what
        `loss_of` computes after drawing them (a validation loss calls this with fixed ones). `model`:
        the DiT to run (default: the engine being trained; a two-expert validation picks by t). A batch with
        sound (`audio_latents`): `audio_t` (B,) (None: tied, t or `AudioPath.tied_map(t)`) and `audio_noise`
        like its latents; `parts` receives each stream's loss (`flow_matching_loss`); `cond_noise` (B, C, 1, h, w): the
        conditioning's own noise (MiniMax H3's keyframe rows; None for the others)."""
        dev = self.device
        x0 = to_device(batch["latents"], dev, torch.float32)  # (B, C, F', h, w)
        t, noise = to_device(t, dev, torch.float32), to_device(noise, dev, torch.float32)
        cond = active = None
        if self.conditioning is not None:
            cond = {k: to_device(batch[k], dev) for k in self.family.training.cond_keys if k in batch}
            # per sample (DataItem.conditioned): clips of do_i2v datasets; stills and t2v datasets train
            # unconditioned, as t2v (concat mode refuses unconditioned items at the scan); a validation
            # batch says it itself: its indices are the validation set's
            active = to_device(batch["do_i2v"], dev) if "do_i2v" in batch else torch.tensor(
                [self.dataset.item(int(i)).conditioned for i in batch["index"]], device=dev)
        context, text_kwargs = self.family.training.text_inputs(batch, dev, self.dit_config)
        audio = None
        if "audio_latents" in batch:
            # the batch's frame rate, which a DiT with sound positions its tokens by (seconds); one per batch, as
            # ltx-trainer takes the first of its batch's (its buckets share one dataset fps)
            text_kwargs = {**text_kwargs, "fps": float(batch["fps"][0])}
            if audio_noise is None:
                raise ValueError("a batch with sound needs its audio noise (audio_noise=)")
            tied = self.family.audio.tied_map  # tied: the video's t, through the family's coupling when it has one
            audio_t = (t if tied is None else tied(t)) if audio_t is None else to_device(audio_t, dev, torch.float32)
            audio = AudioBatch(to_device(batch["audio_latents"], dev, torch.float32),
                               to_device(audio_noise, dev, torch.float32), audio_t, to_device(batch["has_audio"], dev),
                               self.audio_loss_weight, self.timesteps.loss_weight(audio_t))
        return flow_matching_loss(self.engine if model is None else model, x0, context, t, noise,
                                  conditioning=self.conditioning, cond=cond, active=active,
                                  weight=self.timesteps.loss_weight(t), text_kwargs=text_kwargs, audio=audio,
                                  parts=parts,
                                  cond_noise=None if cond_noise is None else to_device(cond_noise, dev, torch.float32))

    def _checkpoint_for(self, batch: dict) -> None:
        """`gradient_checkpointing: auto`: the plan's blocks for this batch's bucket, the most any rank needs
        (ZeRO-3 gathers a checkpointed block's parameters again in its re-run: every rank checkpoints alike)."""
        if self.auto_ckpt is None:
            return
        choice = self.auto_ckpt.choose(batch["latents"].shape[2:])
        n = torch.tensor([choice.blocks], device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        if int(n) != self._ckpt_blocks:
            self._ckpt_blocks = int(n)
            for e in self.experts.values():
                e.module.set_checkpointed_blocks(self._ckpt_blocks)
            self.log(f"step {self.step + 1}: {choice.describe()}; {self._ckpt_blocks} checkpointed on every rank")

    def _text_len(self, batch: dict) -> int:
        """The text tokens the DiT attends to in this batch: its config's fixed length (Wan pads to
        text_len), else the batch's longest caption (HunyuanVideo 1.5 pads to the batch)."""
        fixed = getattr(self.dit_config, "text_len", None)
        key = "text_embeds" if "text_embeds" in batch else batch[TEXT_NAMES][0]  # the main stream's, else the first
        return fixed if fixed is not None else max(e.shape[0] for e in batch[key])

    # ---------------------------------------------------------------- the loop
    def train(self) -> int:
        p = self.p
        total = p.train.steps
        if self.step >= total:
            self.log(f"nothing to do: step {self.step} >= train.steps {total}")
            return 0
        if self.step == 0 and self.validator is not None:
            self.metrics.write({"step": 0, **self.validate()})
        if self.step == 0 and self.previews and not p.train.skip_first_sample:
            self.preview()
        bar = self._open_progress(total) if self.rank0 else None
        batches = self._batches()
        micro, losses, flops, tokens_seen, samples_seen = 0, [], 0.0, 0, 0
        stream_losses: dict[str, list[float]] = {}
        t_step = time.perf_counter()
        while self.step < total:
            if micro == 0:  # a new optimizer step: its expert (two-expert jobs; None for one model)
                self.activate(self.expert_schedule.expert_of(self.step) if self.expert_schedule else None)
                self._drawn_t = []
            batch = next(batches)
            self._batch_shape = tuple(batch["latents"].shape)  # (B, C, F', h, w): named if the step runs out of memory
            self._parts = {}  # each stream's loss of this micro-batch (a DiT with sound)
            self._checkpoint_for(batch)
            self.act_peak.start()  # the forward's peak: what autograd keeps for backward, plus transients
            loss = self.loss_of(batch, micro)
            self.act_peak.stop()
            # every rank must agree to skip, or the collectives of backward/step would desynchronize
            flag = torch.tensor([loss.detach().float().item() if torch.isfinite(loss) else 0.0,
                                 0.0 if torch.isfinite(loss) else 1.0], device=self.device)
            dist.all_reduce(flag)
            if flag[1] > 0:
                self.nonfinite_in_row += 1
                self.log(f"warning: non-finite loss at step {self.step + 1} on {int(flag[1])} rank(s); batch "
                         f"skipped ({self.nonfinite_in_row}/{p.train.max_nonfinite_steps} in a row)")
                if self.nonfinite_in_row >= p.train.max_nonfinite_steps:
                    last = ckpt.find_latest(self.ckpt_dir)
                    raise NonFiniteError(f"{self.nonfinite_in_row} non-finite losses in a row; stopping. The last "
                                         f"good checkpoint is {last or '(none yet)'}")
                continue
            self.nonfinite_in_row = 0
            lr = self.scheduler.get_last_lr()[0]
            self.engine.backward(loss)
            boundary = self.engine.is_gradient_accumulation_boundary()
            self.engine.step()
            f, L = step_flops(self.dit_config, tuple(batch["latents"].shape), self._text_len(batch), self.family.flops)
            flops += f
            tokens_seen += L * batch["latents"].shape[0]
            samples_seen += batch["latents"].shape[0]
            losses.append(float(flag[0]) / self.world)
            for name, value in self._parts.items():  # this rank's; averaged over ranks with the step's row
                stream_losses.setdefault(name, []).append(value)
            micro += 1
            if not boundary:
                continue
            self.step += 1
            if self.ema is not None:
                self.ema.update()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t_step
            if getattr(self.module, "blocks_compiled", False) and not getattr(self, "_compile_reported", False):
                self._compile_reported = True  # torch.compile ran inside this first step
                self.log(f"step {self.step}: {dt:.1f}s, torch.compile of the DiT's blocks included (train.compile)")
            grad_norm = self.engine.get_global_grad_norm()
            mem = torch.tensor([peak_memory_gb(), self.act_peak.read_gb()], device=self.device)
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            row = {
                "step": self.step, "loss": sum(losses) / len(losses), "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "samples_per_s": samples_seen * self.dp_world / dt, "tokens_per_s": tokens_seen * self.dp_world / dt,
                # a sequence group of N ranks computes one batch together: N x fewer FLOPs per rank
                "tflops": flops * self.dp_world / dt / 1e12, "mfu": flops / self.sp / dt / self.peak_flops,
                "peak_mem_gb": float(mem[0]), "step_time_s": dt, "sp_degree": self.sp, "act_peak_gb": float(mem[1]),
            }
            if "audio" in stream_losses:  # a DiT with sound: each stream's loss, averaged over the ranks
                means = torch.tensor([sum(v) / len(v) for v in stream_losses.values()], device=self.device)
                dist.all_reduce(means)
                row.update({f"loss_{k}": float(m) / self.world for k, m in zip(stream_losses, means)})
            if self.validator is not None and self.validator.due(self.step, total):
                row.update(self.validate())
            if self.expert_plan is not None:
                row.update(self._expert_row())
            self.metrics.write(row)
            if bar is not None:
                bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{lr:.2e}")
                bar.update(1)
            micro, losses, flops, tokens_seen, samples_seen = 0, [], 0.0, 0, 0
            stream_losses = {}
            if self.step % p.save.save_every == 0 or self.step == total:
                self.save()
            if self.previews and self.step % p.sample.sample_every == 0 and self.step >= p.sample.sample_start_step:
                self.preview()
            t_step = time.perf_counter()
        if bar is not None:
            self._close_progress(bar)
        self._demo_report()
        return 0

    def _open_progress(self, total: int, file=None):
        """The rank-0 progress bar (stderr). While it is open, log lines go through `tqdm.write`, which
        clears the bar, prints the line and redraws the bar below it: a plain print would be glued to the
        end of the bar's line. `file` (tests): one stream for both."""
        bar = tqdm(total=total, initial=self.step, desc=self.job.name, dynamic_ncols=True, file=file or sys.stderr)
        self._plain_log = self._log
        if self._log is print:  # a caller's own log function is left alone
            self._log = lambda msg: tqdm.write(msg, file=file or sys.stdout)
        return bar

    def _close_progress(self, bar) -> None:
        bar.close()
        self._log = self._plain_log

    def _demo_report(self) -> None:
        """The embedded demo (a `prepare.demo_data` job): the preview checker on step 0 and the last
        step (`video-dit check-demo` prints the same), previews with sound heard too."""
        p = self.p
        if not (self.rank0 and self.previews and p.prepare is not None and p.prepare.demo_data is not None):
            return
        samples = self.out_dir / "samples"
        steps = sorted({0, self.step} & set(preview_steps(samples)))
        prompts = [j.prompt for j in self.previews]
        try:
            text, _ = report(samples, prompts, steps)
            if previews_have_sound(samples, steps):
                text += "\n" + sound_report(samples, prompts, steps)[0]
        except ValueError as exc:  # prompts that are not demo captions
            text = f"demo check skipped: {exc}"
        self.log(text)
        if self.validator is not None:
            val = [(r["step"], r["val_loss"]) for r in read_metrics(self.metrics.path) if "val_loss" in r]
            if val:
                self.log(f"held-out validation loss: {val[0][1]:.4f} at step {val[0][0]} -> {val[-1][1]:.4f} at step "
                         f"{val[-1][0]} (`video-dit plot {self.out_dir}` draws it beside the training loss)")

    def _expert_row(self) -> dict:
        """metrics.jsonl fields of a two-expert step: the expert trained and every rank's timesteps
        (gathered); raises when the ranks disagree on the expert (they never should: one rule)."""
        mine = [self.expert_plan.trained.index(self.active), *self._drawn_t]
        rows = [None] * self.world
        dist.all_gather_object(rows, mine)
        if len({r[0] for r in rows}) != 1:
            raise RuntimeError(f"step {self.step}: the ranks trained different experts {[r[0] for r in rows]}")
        return {"expert": self.active, "timesteps": [r[1:] for r in rows]}

    # ---------------------------------------------------------------- outputs
    def _ema_for(self, use: bool):
        """The EMA weights swapped into the model when the job asks for them here (every rank)."""
        return self.ema.swapped_in() if self.ema is not None and use else nullcontext()

    def validate(self) -> dict:
        """The validation figures of the current weights (every rank; see validation.py), and of the
        EMA weights with `ema_config.validate_with_ema`."""
        t0 = time.perf_counter()
        with self._experts_for_validation() as loss_at:
            out = self.validator.run(self.module, loss_at)
            if self.ema is not None and self.p.train.ema_config.validate_with_ema:
                with self.ema.swapped_in():
                    out.update(self.validator.run(self.module, loss_at, suffix="_ema"))
        self.log(f"step {self.step}: val_loss {out['val_loss']:.4f}"
                 + (f", EMA {out['val_loss_ema']:.4f}" if "val_loss_ema" in out else "")
                 + f" ({time.perf_counter() - t0:.1f}s)")
        return out

    def preview(self) -> None:
        t0 = time.perf_counter()
        with self._ema_for(self.p.train.ema_config.sample_with_ema):
            # a frozen expert held on the host by rank 0 alone (ZeRO 0-2): rank 0 renders alone (the
            # same answer on every rank: from the job's expert plan, not from what this rank built)
            plan = self.expert_plan
            frozen = plan is not None and bool(set(plan.sources) - set(plan.trained))
            share = not (frozen and self.dist.frozen_on_host)
            paths = render(self._preview_model(), self.vae, self.previews, self.out_dir, self.step,
                           every_rank=self.dist.collective_forward, i2v_mode=self.i2v_mode, log=self.log,
                           share=share, pipeline=self.family.pipeline, audio_codec=self.audio_codec)
        self.log(f"step {self.step}: {len(paths)} preview(s) in {time.perf_counter() - t0:.1f}s")

    @contextmanager
    def _experts_for_validation(self):
        """The loss function validation calls: `loss_at`; for a two-expert model each validation sigma's
        loss is its expert's (`expert_at`: the trained engine, or the frozen expert, moved to the device
        for the validation under ZeRO 0-2 and back after)."""
        if self.expert_plan is None:
            yield self.loss_at
            return
        models = {**self.frozen_experts, **{n: e.engine for n, e in self.experts.items()}}
        moved = [m for m in self.frozen_experts.values() if self.dist.frozen_on_host]
        for m in moved:
            m.to(self.device)
        try:
            yield lambda batch, t, noise, **kw: self.loss_at(
                batch, t, noise, model=models[expert_at(float(t.flatten()[0]), self.expert_plan.boundary)], **kw)
        finally:
            for m in moved:
                m.to("cpu")

    def _preview_model(self):
        """What previews sample: the DiT, or both experts (`TwoExperts`: the trained ones and a frozen
        preview-only one); an expert the job cannot load (one expert's weights only) is left out, with
        a warning: the previews then show that expert alone, not what Wan 2.2 samples."""
        if self.expert_plan is None:
            return self.module
        modules = {**{n: e.module for n, e in self.experts.items()}, **self.frozen_experts}
        if len(modules) == 1:
            if not getattr(self, "_warned_one_expert", False):
                self.log(f"warning: previews use the {self.active.replace('_', '-')} expert alone: "
                         f"{self.p.model.name_or_path} holds one expert (a two-expert folder samples both)")
                self._warned_one_expert = True
            return next(iter(modules.values()))
        offload = tuple(n for n in self.frozen_experts if self.dist.frozen_on_host)
        return TwoExperts(*(modules[e] for e in EXPERTS), self.expert_plan.boundary, offload=offload,
                          device=self.device if offload else None)

    def save(self) -> None:
        """Checkpoint (DeepSpeed state + sampler + counters + RNG, + the EMA) and the exports of this step."""
        p = self.p
        client = {"step": self.step, "sampler": self.sampler.state_dict(consumed_batches=self._consumed),
                  "nonfinite_in_row": self.nonfinite_in_row, "config_hash": self.config_hash}
        meta = {"step": self.step, "world_size": self.world, "zero_stage": self.zero_stage,
                "config_hash": self.config_hash, "name": self.job.name, "time": time.time(),
                "lr": p.train.lr, "lr_schedule": self.schedule.to_dict()}
        ckpt.save(self.engines(), self.ckpt_dir, self.step, client, meta, keep=p.save.max_step_saves_to_keep,
                  frozen_base=p.network is not None, extra=self.ema.save if self.ema is not None else None)
        self._export(self.job.name)
        if self.ema is not None:  # the average beside the raw weights: <name>_ema_<step>..., <name>_ema...
            with self.ema.swapped_in():
                self._export(f"{self.job.name}_ema", ema=True)
        dist.barrier()
        self.log(f"step {self.step}: saved checkpoint and {'LoRA' if p.network is not None else 'weights'}"
                 + (" (raw and EMA)" if self.ema is not None else ""))

    def _export(self, name: str, ema: bool = False) -> None:
        """The LoRA file or full weights folder of this step as `<name>_<step>...`, `<name>...` the latest;
        one per trained expert of a two-expert job: `<name>_<step>_<expert>.safetensors` (ai-toolkit's split
        LoRA names, ComfyUI keys, `expert` + `boundary_ratio` in the metadata) or, for a full fine-tune,
        `<name>_<step>/<Wan's expert folder>/` (high_noise_model/, low_noise_model/)."""
        p = self.p
        metadata = {"base_preset": self.preset.name, "base_model": p.model.name_or_path, "step": self.step,
                    "name": self.job.name, "i2v_mode": self.i2v_mode if self.any_i2v else "none",
                    "meta": json.dumps(self.job.meta, default=str)}
        if ema:
            metadata["ema_decay"] = str(p.train.ema_config.ema_decay)
        dtype = p.save.torch_dtype
        folder = self.out_dir / f"{name}_{self.step:09d}"
        for expert, e in self.experts.items():
            suffix = f"_{expert}" if expert else ""
            meta_e = dict(metadata, **({"expert": expert, "boundary_ratio": self.expert_plan.boundary} if expert else {}))
            if p.network is not None:
                meta_e.update(rank=p.network.linear)
                path = self.out_dir / f"{name}_{self.step:09d}{suffix}.safetensors"
                out = export.export_lora(e.module, self.zero_stage, path, p.network.alpha, dtype, meta_e,
                                         comfy=self.family.lora_to_comfy)
                if out is not None:
                    export.point_latest(self.out_dir / f"{name}{suffix}.safetensors", out)
            else:  # one model: its sources beside its weights; two experts: beside both expert folders
                out = export.export_full(e.module, self.zero_stage, dit_folder(folder, expert), dtype, meta_e,
                                         sources=None if expert else self._sources(),
                                         storage=self.family.arch.param_dtypes, config_json=self.family.config_json)
        if self.rank0:
            if p.network is None:
                if self.expert_plan is not None:
                    write_sources(folder, self._sources())
                export.point_latest(self.out_dir / name, folder)
            self._prune_exports(name)

    def _sources(self) -> dict:
        """What a full fine-tune export records beside its weights (`video_dit_sources.json`): the preset,
        where the VAE, text encoder (and CLIP image encoder) came from (absolute paths), the i2v mode and
        the first preview's sampling settings and dtypes, which `video-dit sample --model EXPORT` then
        uses by default."""
        out = {**self.spec.sources(), "i2v_mode": self.i2v_mode if self.any_i2v else "none"}
        if self.previews:
            vae_dtype, _ = encoder_dtypes(self.p)
            out["sampling"] = {**preview_sampling(self.previews[0]),  # previews: the DiT in the training dtype
                               "dtype": dtype_name(self.dtype), "vae_dtype": dtype_name(vae_dtype)}
        return out

    def _prune_exports(self, name: str) -> None:
        """Keep the exports of the last `max_step_saves_to_keep` saves: `<name>_<9-digit step>` files or
        folders, with every expert's `_high_noise` / `_low_noise` file of a step."""
        step_re = re.compile(re.escape(name) + r"_(\d{9})(_high_noise|_low_noise)?(\.safetensors)?")
        found = [(int(m.group(1)), q) for q in self.out_dir.iterdir() if (m := step_re.fullmatch(q.name))]
        keep = sorted({step for step, _ in found})[-self.p.save.max_step_saves_to_keep:]
        for step, old in found:
            if step in keep:
                continue
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)

    def out_of_memory_line(self) -> str:
        """One line for a step that ran out of device memory (`plan.oom_message`: the step, the bucket, the
        planned and the measured peak, what would lower it with the plan's figures) and the last complete
        checkpoint, which stays intact (a checkpoint is written to a temporary name and renamed)."""
        shape = getattr(self, "_batch_shape", None)
        last = ckpt.find_latest(self.ckpt_dir)
        resume = f"the last complete checkpoint is {last or '(none yet)'}; `./launch/train.sh` resumes from it"
        if shape is None:
            return f"rank {self.rank}: out of memory before the first step's batch; {resume}"
        measured = (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                    else int(peak_memory_gb() * 2 ** 30))
        line = oom_message(self.job, shape[2:], measured, machine_here(self.world, self.device), step=self.step + 1,
                           checkpointed=self._ckpt_blocks)
        return f"rank {self.rank}: {line}; {resume}"

    def close(self) -> None:
        self.metrics.close()


def audio_entry(item, codec, sound, dataset_fps: float, device, dtype) -> dict:
    """What a clip caches for a DiT with sound (`Family.audio`: `sound`, its loaded `codec`): its track over its
    frames' span at the codec's rate and channels, encoded (`audio_latents` (1, ...)); `has_audio` (1,) bool,
    False for a clip without an audio stream, whose latents are zeros of the shape a track of its span encodes
    to (so it batches with the clips with sound of its bucket; trained as the picture alone: its audio loss is
    masked); `fps` (1,): its frames over its span (the DiT's positions are seconds), else `dataset_fps`."""
    wave = load_item_audio(item, sound.rate, sound.channels)  # (C, S) or None
    fps = len(item.frames) / item.audio_span.duration if item.audio_span is not None else dataset_fps
    rate = torch.tensor([float(fps)])
    if wave is None:
        if item.audio_span is None:  # no span to encode (a still): the length a clip of its frames is sampled at
            shape = codec.latent_shape(len(item.frames), fps)
        else:  # the encoder's own length for the span (it can differ by one from the sampled length's rounding)
            silence = torch.zeros(1, sound.channels, item.audio_span.samples(sound.rate), device=device, dtype=dtype)
            shape = codec.encode(silence).shape[1:]
        return {"audio_latents": torch.zeros(1, *shape), "has_audio": torch.zeros(1, dtype=torch.bool), "fps": rate}
    latents = codec.encode(wave[None].to(device, dtype)).float().cpu()
    return {"audio_latents": latents, "has_audio": torch.ones(1, dtype=torch.bool), "fps": rate}


def timestep_sampler(process, preset, t_range: tuple[float, float] | None = None):
    """The job's `TimestepSampler`: `train.timestep_type` at `train.timestep_shift` (default: the
    preset's training shift), conditioned on [train.min_t, train.max_t], or on `t_range` (an expert's
    side of the boundary within them, `diffusion.experts.expert_range`)."""
    t = process.train
    shift = t.timestep_shift if t.timestep_shift is not None else preset.train_shift
    lo, hi = t_range if t_range is not None else (t.min_t, t.max_t)
    return TimestepSampler(t.timestep_type, shift=shift, min_t=lo, max_t=hi)


def job_conditioning(process, dit_config, training):
    """The job's conditioning object (`Training.conditioning`: its i2v mode, the DiT's patch,
    `model.mask_first_frame_loss`, the datasets' `do_flf2v`), or None: a Wan job without a `do_i2v`
    dataset (HunyuanVideo 1.5's DiT reads its condition channels in every job: `conditions_t2v`)."""
    if not (training.conditions_t2v or any(d.do_i2v for d in process.datasets)):
        return None
    return training.conditioning(process.i2v_mode, dit_config.patch_size, process.model.mask_first_frame_loss,
                                 process.flf2v)


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (`video-dit sample --dtype`'s spelling)."""
    return str(dtype).removeprefix("torch.")


def preview_sampling(job) -> dict:
    """The settings a preview rendered with (`PreviewJob`), for an export's `video_dit_sources.json`:
    `video-dit sample --model EXPORT` uses them for every flag it is not given."""
    st = job.settings
    return {"solver": st.solver, "steps": st.steps, "shift": st.shift, "guidance": st.guidance,
            "guidance_2": st.guidance_2, "negative": st.negative, "grid": st.grid, "frames": job.num_frames,
            "height": job.height, "width": job.width, "fps": job.fps, "seed": job.seed}


def run(job, resume: str | None = None) -> int:
    """Build, train, close; the exit code (0, EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_SAVE_FAILED or
    EXIT_OUT_OF_MEMORY)."""
    try:
        trainer = Trainer(job, resume=resume)
    except (WeightsError, DataError, ckpt.ResumeError) as exc:  # bad weights/data/checkpoint: one message
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"[video_dit] error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    try:
        return trainer.train()
    except KeyboardInterrupt:  # Ctrl-C of a run started without our launcher (the launcher prints its own line)
        if trainer.rank0:
            print(f"\n[video_dit] interrupted after step {trainer.step}; {ckpt.resume_hint(trainer.ckpt_dir)}",
                  file=sys.stderr, flush=True)
        return 130
    except NonFiniteError as exc:
        trainer.log(f"error: {exc}")
        return EXIT_NONFINITE
    except ckpt.CheckpointWriteError as exc:  # printed by the rank that failed (maybe not rank 0)
        print(f"[video_dit] error: {exc}", file=sys.stderr, flush=True)
        outcome.record(job.out_dir, EXIT_SAVE_FAILED)  # what the launcher reports (train/outcome.py)
        return EXIT_SAVE_FAILED
    except torch.OutOfMemoryError:  # printed by the rank that ran out; the launcher then stops every rank
        # on a line of its own: rank 0's progress bar may be drawn on the same terminal
        print(f"\n[video_dit] error: {trainer.out_of_memory_line()}", file=sys.stderr, flush=True)
        outcome.record(job.out_dir, EXIT_OUT_OF_MEMORY)
        return EXIT_OUT_OF_MEMORY
    finally:
        trainer.close()


__all__ = ["EXIT_BAD_INPUT", "EXIT_NONFINITE", "EXIT_SAVE_FAILED", "NonFiniteError", "Trainer", "audio_entry",
           "job_conditioning", "cache_spaces", "run", "timestep_sampler"]
