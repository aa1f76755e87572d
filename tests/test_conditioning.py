"""First-frame conditioning: both i2v layouts against diffusers' Wan pipelines' construction (the
per-token timestep order is the one diffusers feeds its WanTransformer3DModel, with which our DiT has
parity), the VAE conditioning latents and the masked loss."""

import pytest
import torch

from video_dit.diffusion.conditioning import FirstFrameConditioning, encode_conditioning, masked_mse, pack_frame_mask
from video_dit.families import get_preset
from video_dit.families.wan.vae import CausalVideoVAE

B, C, FL, H, W = 2, 16, 3, 4, 6  # latents (B, C, F', h, w)


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(0)
    return CausalVideoVAE(get_preset("tiny").vae).eval()


def _latents(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, C, FL, H, W, generator=g), torch.randn(B, C, 1, H, W, generator=g)


def test_replace_with_per_token_timesteps_matches_wan22_ti2v_layout():
    noisy, first = _latents()
    t = torch.tensor([800.0, 300.0])
    x, ts, mask = FirstFrameConditioning("replace").apply(noisy, t, {"first_frame_latents": first})
    assert torch.equal(x[:, :, :1], first) and torch.equal(x[:, :, 1:], noisy[:, :, 1:])
    # diffusers' WanPipeline (expand_timesteps, Wan 2.2 TI2V): mask[:, :, 0] = 0, then
    # (mask[0][0][:, ::2, ::2] * t).flatten() over the (F', h/2, w/2) token grid.
    ref_mask = torch.ones(1, 1, FL, H, W)
    ref_mask[:, :, 0] = 0
    ref = torch.stack([(ref_mask[0][0][:, ::2, ::2] * ti).flatten() for ti in t])
    assert ts.shape == (B, FL * (H // 2) * (W // 2)) and torch.equal(ts, ref)
    assert mask.shape == (B, 1, FL, H, W)
    assert torch.equal(mask, ref_mask.expand(B, 1, FL, H, W))


def test_restore_puts_the_clean_first_frame_back():
    noisy, first = _latents()
    cond = FirstFrameConditioning("replace")
    restored = cond.restore(noisy, {"first_frame_latents": first})
    assert torch.equal(restored[:, :, 0:1], first) and torch.equal(restored[:, :, 1:], noisy[:, :, 1:])
    assert FirstFrameConditioning("concat").restore(noisy, {}) is noisy


def test_replace_conditions_only_the_active_samples():
    """A t2v item in an i2v job (replace mode): exactly what an unconditioned t2v step feeds the DiT
    (x_t, the clip's t on every token) and no mask; the conditioned item as if alone."""
    noisy, first = _latents()
    t = torch.tensor([800.0, 300.0])
    cond = FirstFrameConditioning("replace")
    x, ts, mask = cond.apply(noisy, t, {"first_frame_latents": first}, active=torch.tensor([True, False]))
    x_all, ts_all, mask_all = cond.apply(noisy, t, {"first_frame_latents": first})
    assert torch.equal(x[0], x_all[0]) and torch.equal(ts[0], ts_all[0]) and torch.equal(mask[0], mask_all[0])
    assert torch.equal(x[1], noisy[1]) and bool((ts[1] == 300.0).all()) and bool((mask[1] == 1).all())
    assert cond.apply(noisy, t, {"first_frame_latents": first}, active=torch.ones(B, dtype=torch.bool))[0].equal(x_all)


def _diffusers_i2v_mask(batch, num_frames, h, w, temporal=4, given=(0,)):
    """The mask construction of diffusers' WanImageToVideoPipeline.prepare_latents, generalised to
    any given pixel frames (the pipeline gives frame 0, and the last frame for first-last-frame)."""
    mask = torch.ones(batch, 1, num_frames, h, w)
    keep = [i for i in range(num_frames) if i not in given]
    mask[:, :, keep] = 0
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=temporal)
    mask = torch.concat([first, mask[:, :, 1:, :]], dim=2)
    mask = mask.view(batch, -1, temporal, h, w)
    return mask.transpose(1, 2)


def test_concat_layout_matches_wan_i2v():
    noisy, _ = _latents()
    cond_latents = torch.randn(B, 16, FL, H, W)
    t = torch.tensor([800.0, 300.0])
    x, ts, mask = FirstFrameConditioning("concat").apply(noisy, t, {"cond_latents": cond_latents})
    assert x.shape == (B, 36, FL, H, W) and torch.equal(ts, t)
    num_frames = 4 * (FL - 1) + 1
    ref = torch.cat([noisy, _diffusers_i2v_mask(B, num_frames, H, W), cond_latents], dim=1)
    assert torch.equal(x, ref)
    # frame 0 is the video's first frame (nothing replaces it while sampling): in the loss by default
    assert mask.shape == (B, 1, FL, H, W) and bool((mask == 1).all())
    _, _, masked = FirstFrameConditioning("concat", mask_first_frame_loss=True).apply(
        noisy, t, {"cond_latents": cond_latents})
    assert torch.equal(masked[:, :, 0], torch.zeros(B, 1, H, W)) and bool((masked[:, :, 1:] == 1).all())
    # the packing itself, with a mask that is not constant per latent frame (first + last frame given)
    frame_mask = torch.zeros(B, num_frames, H, W)
    frame_mask[:, 0] = frame_mask[:, -1] = 1
    assert torch.equal(pack_frame_mask(frame_mask),
                       _diffusers_i2v_mask(B, num_frames, H, W, given=(0, num_frames - 1)))


def test_encode_conditioning_is_the_normalized_vae_latent(vae):
    g = torch.Generator().manual_seed(1)
    frame = torch.rand(1, 3, 16, 32, generator=g) * 2 - 1
    rep = encode_conditioning(vae, frame, "replace", num_frames=5)["first_frame_latents"]
    with torch.no_grad():
        ref = vae.normalize(vae.encode(frame[:, :, None]).mode())
    assert rep.shape == (1, 16, 1, 2, 4) and torch.equal(rep, ref)
    # a clip gives the same latents as its first frame
    clip = torch.cat([frame[:, :, None], torch.rand(1, 3, 4, 16, 32, generator=g) * 2 - 1], dim=2)
    assert torch.equal(encode_conditioning(vae, clip, "replace", 5)["first_frame_latents"], rep)
    cat = encode_conditioning(vae, frame, "concat", num_frames=5)["cond_latents"]
    with torch.no_grad():
        video = torch.cat([frame[:, :, None], torch.zeros(1, 3, 4, 16, 32)], dim=2)
        ref = vae.normalize(vae.encode(video).mode())
    assert cat.shape == (1, 16, 2, 2, 4) and torch.equal(cat, ref)
    torch.testing.assert_close(cat[:, :, :1], rep, atol=1e-5, rtol=1e-5)  # causal: frame 0 alone
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        encode_conditioning(vae, frame * 3, "replace", 5)
    with pytest.raises(ValueError, match="4k \\+ 1"):
        encode_conditioning(vae, frame, "concat", 8)


def test_masked_mse_ignores_conditioned_tokens():
    pred, target = _latents(1)[0], _latents(2)[0]
    _, _, mask = FirstFrameConditioning("replace").apply(pred, torch.ones(B), {"first_frame_latents": pred[:, :, :1]})
    loss = masked_mse(pred, target, mask)
    torch.testing.assert_close(loss, ((pred[:, :, 1:] - target[:, :, 1:]) ** 2).mean())
    changed = pred.clone()
    changed[:, :, 0] += 100.0
    assert torch.equal(masked_mse(changed, target, mask), loss)
    torch.testing.assert_close(masked_mse(pred, target), ((pred - target) ** 2).mean())
    with pytest.raises(ValueError, match="all zeros"):
        masked_mse(pred, target, torch.zeros_like(mask))


def test_validation():
    with pytest.raises(ValueError, match="accepted: replace, concat"):
        FirstFrameConditioning("inpaint")
    with pytest.raises(ValueError, match="mask_first_frame_loss=False needs i2v mode 'concat'"):
        FirstFrameConditioning("replace", mask_first_frame_loss=False)
    assert FirstFrameConditioning("replace").mask_first_frame_loss is True
    assert FirstFrameConditioning("concat").mask_first_frame_loss is False
    noisy, first = _latents()
    with pytest.raises(KeyError, match="first_frame_latents"):
        FirstFrameConditioning("replace").apply(noisy, torch.ones(B), {})
    with pytest.raises(ValueError, match="expected"):
        FirstFrameConditioning("replace").apply(noisy, torch.ones(B), {"first_frame_latents": noisy})
    with pytest.raises(ValueError, match="conditions every sample"):
        FirstFrameConditioning("concat").apply(noisy, torch.ones(B), {"cond_latents": torch.zeros(B, 16, FL, H, W)},
                                               active=torch.tensor([True, False]))


def test_first_last_frame_and_clip_features(vae):
    """Wan 2.1 FLF2V: the mask gives pixel frames 0 and F-1 (diffusers' construction), the VAE sees
    [first, zeros, last], the CLIP features are [first | last] along tokens and reach the DiT through
    dit_kwargs; replace mode refuses a last frame."""
    from video_dit.families.wan.loading import load_image_encoder

    g = torch.Generator().manual_seed(2)
    first, last = (torch.rand(1, 3, 16, 32, generator=g) * 2 - 1 for _ in range(2))
    clip = load_image_encoder("preset:tiny-clip-flf2v")
    cond = encode_conditioning(vae, first, "concat", 9, last_frame=last, image_encoder=clip)
    with torch.no_grad():
        video = torch.cat([first[:, :, None], torch.zeros(1, 3, 7, 16, 32), last[:, :, None]], dim=2)
        ref = vae.normalize(vae.encode(video).mode())
    assert torch.equal(cond["cond_latents"], ref)
    assert torch.equal(cond["clip_features"], torch.cat([clip.encode(first), clip.encode(last)], dim=1))
    assert cond["clip_features"].shape == (1, 34, 32)
    conditioning = FirstFrameConditioning("concat", last_frame=True)
    noisy = torch.randn(1, 16, 3, 2, 4, generator=g)
    x, _, mask = conditioning.apply(noisy, torch.tensor([500.0]), cond)
    assert torch.equal(x[:, 16:20], _diffusers_i2v_mask(1, 9, 2, 4, given=(0, 8)))
    assert bool((mask == 1).all())  # the last latent frame holds 3 generated pixel frames: in the loss
    assert conditioning.dit_kwargs(cond)["clip_fea"] is cond["clip_features"]
    assert FirstFrameConditioning("concat").dit_kwargs({"cond_latents": ref}) == {}
    with pytest.raises(ValueError, match="needs i2v mode 'concat'"):
        FirstFrameConditioning("replace", last_frame=True)
    with pytest.raises(ValueError, match="last frame needs i2v mode 'concat'"):
        encode_conditioning(vae, first, "replace", 9, last_frame=last)
