"""What every family's activation model shares (each family's `MemoryModel`: `families/wan/memory.py`,
`families/hunyuan15/memory.py`): the knobs of one prediction (`Setting`), its result (`Activations`) and the byte widths the
derivations use (s: the compute dtype's; a: the float32 islands'; w: a trainable weight's autocast copy)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Setting:
    """The knobs of one prediction."""

    zero_stage: int
    sp: int = 1
    checkpointing: bool = False
    micro_batch: int = 1
    offload_optimizer: bool = False
    offload_param: bool = False
    recompute: bool = True  # RecomputeSaved without checkpointing (`train.recompute_saved`)
    checkpoint_blocks: int | None = None  # with `checkpointing`, only the first this many blocks (None: all)

    def describe(self) -> str:
        ckpt = "no ckpt" if not self.checkpointing else "ckpt" if self.checkpoint_blocks is None else \
            f"ckpt {self.checkpoint_blocks} blocks"
        parts = [f"ZeRO-{self.zero_stage}", f"SP {self.sp}", ckpt, f"batch {self.micro_batch}"]
        if not self.recompute and not self.checkpointing:
            parts.append("no recompute")
        if self.offload_optimizer:
            parts.append("offload optimizer")
        if self.offload_param:
            parts.append("offload params")
        return ", ".join(parts)


@dataclass(frozen=True)
class Activations:
    saved: int      # what the forward leaves for backward
    peak: int       # the highest activation memory of the step (the last block's FFN backward)
    parts: dict = field(default_factory=dict)


def float32_bytes(s: int) -> int:
    """Bytes per element of the float32 islands (the residual stream, the LayerNorms' float32 inputs and
    outputs, the head): float32, or the compute dtype when it is wider (a float64 model)."""
    return max(s, 4)


def weight_copy_bytes(s: int) -> int:
    """Bytes per element of the compute-dtype copy that autocast makes of a float32 trainable weight at
    every call (`VideoDiT.precision`: `cache_enabled=False`) and that its matmul keeps for the input's
    gradient: s in a bf16 / fp16 job (trainable parameters are float32 masters), 0 in float32 (no copy)."""
    return s if s < 4 else 0


def checkpointed_count(setting: Setting, num_layers: int) -> int:
    """How many of the `num_layers` blocks `setting` checkpoints (the first ones:
    `VideoDiT.set_checkpointed_blocks`)."""
    if not setting.checkpointing:
        return 0
    n = num_layers if setting.checkpoint_blocks is None else setting.checkpoint_blocks
    return max(0, min(num_layers, n))
