"""The DeepSpeed trainer (issue 6): `launch/train.sh` -> `video_dit.train.validate` (before any rank)
-> `launch/train.py` -> `trainer.run(load_job(CONFIG))`.

    config.py      the ai-toolkit job YAML as typed dataclasses (`load_job`, `parse_job`, `TrainJob`)
    validate.py    file-system checks and the `prepare:` stages (demo data, tiny VAE); exit 2 on errors
    engine.py      process group, DeepSpeed JSON, optimizer/LR, initialize, quantize, ZeRO-3 gathering, MFU peak
    trainer.py     `Trainer(job, resume)`: set-up in a fixed order, `train()`, `close()`; `run(job)`
    checkpoint.py  atomic checkpoints, `latest`, resume planning (world-size change -> universal format)
    export.py      LoRA file (ComfyUI keys) and native sharded full exports, gathered under ZeRO-3
    preview.py     MP4 previews + contact sheets (all ranks under ZeRO-3, rank 0 writes)
    metrics.py     metrics.jsonl (+ TensorBoard when installed), peak memory, analytic FLOPs
    vae_stage.py   the tiny VAE of the embedded default (`train_tiny_vae`)
"""
