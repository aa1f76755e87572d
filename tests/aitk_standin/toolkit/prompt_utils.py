"""Stand-in `PromptEmbeds` and `concat_prompt_embeds` (dispatching to the class's own concat)."""

import torch


class PromptEmbeds:
    def __init__(self, args, attention_mask=None):
        if isinstance(args, (list, tuple)):
            self.text_embeds, self.pooled_embeds = args[0], args[1]
        else:
            self.text_embeds, self.pooled_embeds = args, None
        self.attention_mask = attention_mask

    def to(self, *args, **kwargs):
        if isinstance(self.text_embeds, (list, tuple)):
            self.text_embeds = [t.to(*args, **kwargs) for t in self.text_embeds]
        else:
            self.text_embeds = self.text_embeds.to(*args, **kwargs)
        return self


def concat_prompt_embeds(prompt_embeds, padding_side="right"):
    if hasattr(prompt_embeds[0].__class__, "concat_prompt_embeds"):
        return prompt_embeds[0].__class__.concat_prompt_embeds(prompt_embeds, padding_side=padding_side)
    return PromptEmbeds(torch.cat([p.text_embeds for p in prompt_embeds], dim=0))
