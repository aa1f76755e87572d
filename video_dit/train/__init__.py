"""The DeepSpeed trainer: `launch/train.sh` -> `video_dit.train.launcher` (validation, the memory plan,
then the ranks) -> `launch/train.py` -> `trainer.run(load_job(CONFIG))`.

    config.py      the ai-toolkit job YAML as typed dataclasses (`load_job`, `parse_job`, `TrainJob`)
    validate.py    file-system checks and the `prepare:` stages (demo data, tiny VAE); exit 2 on errors
    launcher.py    the ranks under a parent that owns them (signals, ports)
    plan.py        the memory plan of a job per bucket, before anything loads
    trainer.py     `Trainer(job, resume)`: set-up in a fixed order, `train()`, `close()`; `run(job)`
    build.py       the DiT a job trains: built (partitioned under ZeRO-3), then made trainable
    precision.py   the dtype policy: training dtype, build dtype, storage, quantization of the frozen base
    engine.py      the optimizer, its LR schedule, and `initialize` (DeepSpeed through `parallel/zero.py`)
    caches.py      what a job's latent and text caches hold, named
    experts.py     which experts of a two-expert model a job trains, and when
    checkpoint.py  atomic checkpoints, `latest`, resume planning (world-size change -> universal format)
    ema.py         the weights' moving average, partitioned like them
    validation.py  the held-out validation loss
    export.py      LoRA file (ComfyUI keys) and native sharded full exports, gathered under ZeRO-3
    preview.py     MP4 previews + contact sheets (all ranks under ZeRO-3, rank 0 writes)
    metrics.py     metrics.jsonl (+ TensorBoard when installed), peak memory, analytic FLOPs
    faults.py      the fault suite's hooks (inert unless VIDEO_DIT_FAULT is set)
    vae_stage.py   the tiny VAE of the embedded default (`train_tiny_vae`)
The distributed layer (process group, ZeRO, the partitioned build, sequence parallelism) is
`video_dit/parallel/`; device decisions are `video_dit/devices.py`; which files make up the model
is `video_dit/spec.py`.
"""
