"""`helpers.assert_trained_close`, the comparison every "these runs train alike" test ends with (SP=2 vs
SP=1, ZeRO-3 vs ZeRO-0 or ZeRO-2, micro-batches, offload, checkpointing): it passes runs that trained
alike, and fails runs that trained differently, runs where a tensor trained in one only, and runs that
trained nothing at all (LoRA B still 0; a full tensor moved by AdamW's weight decay alone)."""

import helpers
import pytest
import torch


def _lora(seed: int, scale_b: float = 1.0) -> dict:
    """A LoRA file's state for two modules (our ComfyUI keys): random A, B = scale_b x a fixed random B."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in ("diffusion_model.blocks.0.self_attn.q", "diffusion_model.blocks.0.ffn.0"):
        out[f"{m}.lora_A.weight"] = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
        out[f"{m}.lora_B.weight"] = scale_b * torch.randn(32, 4, generator=g) * 1e-2
    return out


def test_lora_runs_trained_alike_pass_and_differing_or_untrained_ones_fail():
    trained = _lora(1)
    assert helpers.assert_trained_close(trained, _lora(1)) == 0.0
    assert helpers.assert_trained_close(trained, _lora(1, 1 + 1e-4)) == pytest.approx(1e-4, rel=1e-2)
    with pytest.raises(AssertionError, match="trained change differs by 2.00e-03"):
        helpers.assert_trained_close(trained, _lora(1, 1 + 2e-3))
    untrained = _lora(1, 0.0)  # B as initialised: nothing trained
    with pytest.raises(AssertionError, match="self_attn.q: run a did not train it"):
        helpers.assert_trained_close(untrained, _lora(1, 0.0))  # equal, and both untrained: not "alike"
    with pytest.raises(AssertionError, match="run b did not train it"):
        helpers.assert_trained_close(trained, untrained)


def _adamw_run(steps: int = 3, lr: float = 1e-2, train_bias: bool = True) -> tuple[dict, dict]:
    """(base, trained) state dicts of a Linear after `steps` AdamW steps (the trainer's weight decay 0.01);
    with train_bias False the bias gets no gradient, so only weight decay moves it."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    base = {k: v.detach().clone() for k, v in layer.state_dict().items()}
    opt = torch.optim.AdamW(layer.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 16, generator=g)
        y = layer(x) if train_bias else x @ layer.weight.T + layer.bias.detach()
        opt.zero_grad()
        y.square().mean().backward()
        if not train_bias:
            layer.bias.grad = torch.zeros_like(layer.bias)
        opt.step()
    return base, {k: v.detach().clone() for k, v in layer.state_dict().items()}


def test_full_fine_tunes_count_weight_decay_alone_as_untrained():
    base, trained = _adamw_run()
    assert helpers.assert_trained_close(trained, {k: v.clone() for k, v in trained.items()}, base=base) == 0.0
    with pytest.raises(AssertionError, match="weight: run a did not train it"):
        helpers.assert_trained_close(base, base, base=base)  # nothing changed in either run
    # the bias moved by weight decay alone (theta *= 1 - lr wd, 3 steps): not training, though it changed
    base, decayed = _adamw_run(train_bias=False)
    assert not torch.equal(decayed["bias"], base["bias"])
    with pytest.raises(AssertionError, match="bias: run a did not train it"):
        helpers.assert_trained_close(decayed, decayed, base=base)
    assert helpers.assert_trained_close(decayed, decayed, base=base, untrained={"bias"}) == 0.0
    with pytest.raises(AssertionError, match="weight: run a trained it .* said untrained"):
        helpers.assert_trained_close(decayed, decayed, base=base, untrained={"weight"})
    # a run that trained differently (another learning rate) fails on the comparison itself
    with pytest.raises(AssertionError, match="trained change differs"):
        helpers.assert_trained_close(_adamw_run(lr=1.1e-2)[1], trained, base=base)
