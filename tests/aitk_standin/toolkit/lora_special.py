"""Stand-in `LoRASpecialNetwork`: which Linears ai-toolkit's LoRA adapts, the peft-format state dict it
saves and loads, and the model hooks it calls on the way.

Read from ostris/ai-toolkit 27a03a91: toolkit/lora_special.py (`LoRAModule.__init__` L46-130: lora_down
kaiming-uniform, lora_up zeros, scale alpha / rank with alpha = rank in peft format; `create_modules`
L453-600: every Linear inside a module whose class is in `target_lin_modules`, named
`transformer.<path>`, skipped when `transformer_only` and no `get_transformer_block_names()` entry is a
substring of that name, or when a word of `ignore_if_contains` is; kept only when a word of
`only_if_contains` is, when given), toolkit/network_mixins.py (`get_state_dict` L581-631: lora_down ->
lora_A, lora_up -> lora_B, `$$` -> `.`, alphas dropped, then the model's `convert_lora_weights_before_save`;
`save_weights` L633-656: the model's `save_lora` hook when it has one; `load_weights` L658-789: the model's
`load_lora` hook, then `convert_lora_weights_before_load`, then `load_state_dict(strict=False)` with the keys
the network lacks set aside). Left out: conv, DoRA / LoKr / full-rank modules, dropout, rank expansion,
text-encoder LoRA, merging.
"""

import math
import os

import torch

LINEAR_MODULES = ("Linear", "LoRACompatibleLinear", "QLinear")


class LoRAModule(torch.nn.Module):
    """W x + lora_up(lora_down(x)) * multiplier * alpha / rank, hooked onto the original Linear's forward."""

    def __init__(self, lora_name: str, org_module: torch.nn.Linear, lora_dim: int, alpha: float):
        super().__init__()
        self.lora_name, self.lora_dim = lora_name, lora_dim
        self.lora_down = torch.nn.Linear(org_module.in_features, lora_dim, bias=False)
        self.lora_up = torch.nn.Linear(lora_dim, org_module.out_features, bias=False)
        self.register_buffer("alpha", torch.tensor(float(alpha)))
        self.scale = float(alpha) / lora_dim
        torch.nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        torch.nn.init.zeros_(self.lora_up.weight)
        self.multiplier = 1.0
        self.org_module = [org_module]

    def apply_to(self):
        self.org_forward = self.org_module[0].forward
        self.org_module[0].forward = self.forward

    def forward(self, x):
        lx = self.lora_up(self.lora_down(x.to(self.lora_down.weight.dtype)))
        return self.org_forward(x) + (lx * self.multiplier * self.scale).to(x.dtype)


class LoRASpecialNetwork(torch.nn.Module):
    PEFT_PREFIX_UNET = "transformer"

    def __init__(self, unet, lora_dim: int = 4, alpha: float = 1.0, network_config=None, network_type="lora",
                 transformer_only: bool = True, is_transformer: bool = True, base_model=None,
                 target_lin_modules=("UNet2DConditionModel",), only_if_contains=None, ignore_if_contains=None,
                 **kwargs):
        super().__init__()
        if network_type.lower() != "lora" or not is_transformer:
            raise NotImplementedError("stand-in LoRASpecialNetwork: plain LoRA on a transformer (peft format)")
        self.network_type, self.network_config, self.lora_dim = network_type, network_config, lora_dim
        self.peft_format = True  # is_transformer: peft format, alpha = rank (lora_special.py ~L423)
        self.base_model_ref = (lambda: base_model) if base_model is not None else None
        blocks = base_model.get_transformer_block_names() if base_model is not None else None
        self.unet_loras = []
        for name, module in unet.named_modules():
            if type(module).__name__ not in target_lin_modules:
                continue
            for child_name, child in module.named_modules():
                clean = ".".join(x for x in (self.PEFT_PREFIX_UNET, name, child_name) if x)
                if type(child).__name__ not in LINEAR_MODULES:
                    continue
                if any(word in clean for word in (ignore_if_contains or [])):
                    continue
                if transformer_only and blocks is not None and not any(b in clean for b in blocks):
                    continue
                if only_if_contains is not None and not any(word in clean for word in only_if_contains):
                    continue
                self.unet_loras.append(LoRAModule(clean.replace(".", "$$"), child, lora_dim, lora_dim))

    def apply_to(self):
        for lora in self.unet_loras:
            lora.apply_to()
            self.add_module(lora.lora_name, lora)

    def prepare_optimizer_params(self):
        return [p for lora in self.unet_loras for p in lora.parameters()]

    def get_state_dict(self, dtype=torch.float32) -> dict:
        out = {}
        for key, value in self.state_dict().items():
            if key.endswith(".alpha"):
                continue
            key = key.replace("lora_down", "lora_A").replace("lora_up", "lora_B").replace("$$", ".")
            out[key] = value.detach().clone().to("cpu", dtype)
        if self.base_model_ref is not None:
            out = self.base_model_ref().convert_lora_weights_before_save(out)
        return out

    def save_weights(self, file, dtype=torch.float32, metadata=None):
        save_dict = self.get_state_dict(dtype)
        model = self.base_model_ref() if self.base_model_ref is not None else None
        if model is not None and hasattr(model, "save_lora"):
            model.save_lora(save_dict, file, metadata or {})
            return
        from safetensors.torch import save_file

        save_file(save_dict, file, metadata or None)

    def load_weights(self, file):
        """Returns the keys the network lacks (ai-toolkit's `extra_dict`: set aside, never loaded), or None."""
        model = self.base_model_ref() if self.base_model_ref is not None else None
        if isinstance(file, str) and model is not None and hasattr(model, "load_lora"):
            weights = model.load_lora(file)
        else:
            from safetensors.torch import load_file

            weights = load_file(file) if isinstance(file, str) and os.path.splitext(file)[1] == ".safetensors" \
                else file
        if model is not None:
            weights = model.convert_lora_weights_before_load(weights)
        load = {}
        for key, value in weights.items():
            if key.endswith(".alpha"):
                continue
            key = key.replace("lora_A", "lora_down").replace("lora_B", "lora_up").replace(".", "$$")
            key = key.replace("$$lora_down$$", ".lora_down.").replace("$$lora_up$$", ".lora_up.")
            load[key] = value
        current = self.state_dict()
        extra = {k: v for k, v in load.items() if k not in current}
        self.load_state_dict({k: v for k, v in load.items() if k in current}, strict=False)
        return extra or None
