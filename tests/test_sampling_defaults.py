"""Sampling defaults: each preset's `sample_*` values are the numbers of Wan's configs and generate.py
(typed here from Wan's source, file and line named); a diffusers folder's scheduler_config.json gives the
solver and shift; the command or job wins over both; the line that says which were used."""

import json
import math

import pytest
from helpers import ROOT

from video_dit.diffusion.sampling_settings import read_scheduler_config, resolve_sampling
from video_dit.families import PRESETS, get_preset
from video_dit.families.wan import FAMILY as WAN

# wan/configs/shared_config.py line 19 (Wan2.1 and Wan2.2): `sample_neg_prompt`
WAN_NEG = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，"
           "JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，"
           "手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")
WAN21_I2V_NEG = "镜头晃动，" + WAN_NEG  # Wan2.1 wan/configs/wan_i2v_14B.py line 11
WAN21_FLF2V_NEG = "镜头切换，" + WAN21_I2V_NEG  # Wan2.1 wan/configs/__init__.py line 18 (on the i2v config)

# preset: (solver, steps, shift, guidance, negative), from Wan's source:
#   Wan2.1 generate.py: --sample_solver default 'unipc' (line 231), --sample_guide_scale default 5.0
#   (line 244); steps 50, 40 for "i2v" tasks (lines 71-74); shift 5.0, 3.0 for i2v at 480*832 / 832*480,
#   16 for flf2v (lines 76-81).
#   Wan2.2 generate.py: unipc (line 204); steps, shift, guidance from the task's config (lines 84-91):
#   wan/configs/wan_ti2v_5B.py lines 33-35 (shift 5.0, 50 steps, guidance 5.0);
#   wan/configs/wan_i2v_A14B.py lines 34-37 (shift 5.0, 40 steps, guidance (3.5, 3.5) low/high noise);
#   wan/configs/wan_t2v_A14B.py lines 34-37 (shift 12.0, 40 steps, guidance (3.0, 4.0) low/high noise:
#   sample_guidance is the high-noise expert's, tests/test_experts_config.py checks the pair).
EXPECTED = {
    "wan2.1-t2v-1.3b": ("unipc", 50, 5.0, 5.0, WAN_NEG),
    "wan2.1-t2v-14b": ("unipc", 50, 5.0, 5.0, WAN_NEG),
    "wan2.1-i2v-14b-480p": ("unipc", 40, 3.0, 5.0, WAN21_I2V_NEG),
    "wan2.1-i2v-14b-720p": ("unipc", 40, 5.0, 5.0, WAN21_I2V_NEG),
    "wan2.1-flf2v-14b-720p": ("unipc", 50, 16.0, 5.0, WAN21_FLF2V_NEG),
    "wan2.2-ti2v-5b": ("unipc", 50, 5.0, 5.0, WAN_NEG),
    "wan2.2-i2v-a14b": ("unipc", 40, 5.0, 3.5, WAN_NEG),
    "wan2.2-t2v-a14b": ("unipc", 40, 12.0, 4.0, WAN_NEG),
    # HunyuanVideo 1.5, Tencent-Hunyuan/HunyuanVideo-1.5: shift and guidance from hyvideo/commons/__init__.py
    # lines 48-105 (PIPELINE_CONFIGS), 50 steps (hyvideo/pipelines/hunyuan_video_pipeline.py line 101), 12 for
    # the step-distilled model (commons line 104), Euler (its scheduler's only solver), negative "" (generate.py
    # line 282)
    "hunyuan15-480p-t2v": ("euler", 50, 5.0, 6.0, ""),
    "hunyuan15-480p-i2v": ("euler", 50, 5.0, 6.0, ""),
    "hunyuan15-720p-t2v": ("euler", 50, 9.0, 6.0, ""),
    "hunyuan15-720p-i2v": ("euler", 50, 7.0, 6.0, ""),
    "hunyuan15-480p-t2v-cfg-distilled": ("euler", 50, 5.0, 1.0, ""),
    "hunyuan15-480p-i2v-cfg-distilled": ("euler", 50, 5.0, 1.0, ""),
    "hunyuan15-720p-i2v-cfg-distilled": ("euler", 50, 7.0, 1.0, ""),
    "hunyuan15-480p-i2v-step-distilled": ("euler", 12, 7.0, 1.0, ""),
}
# Lightricks/LTX-2 packages/ltx-pipelines/src/ltx_pipelines/utils/constants.py (commit 400fd31):
# DEFAULT_NEGATIVE_PROMPT; steps 40 (LTX_2_PARAMS), 30 from 2.3 on (LTX_2_3_PARAMS, LTX_2_4_PARAMS: 2.5); video
# cfg_scale 3.0; the shift exp(2.05): ltx-core components/schedulers.py LTX2Scheduler (max_shift 2.05 at its
# default 4096 tokens); Euler (ltx-core EulerDiffusionStep, diffusers' FlowMatchEulerDiscreteScheduler)
LTX2_NEG = ("has_subtitles, has_blurbox, transition from black, transition to black, speech_ending_short, blurry, out "
            "of focus, overexposed, underexposed, low contrast, washed out colors, excessive noise, grainy texture, "
            "poor lighting, flickering, motion blur, distorted proportions, unnatural skin tones, deformed facial "
            "features, asymmetrical face, missing facial features, extra limbs, disfigured hands, wrong hand count, "
            "artifacts around text, inconsistent perspective, camera shake, incorrect depth of field, background too "
            "sharp, background clutter, distracting reflections, harsh shadows, inconsistent lighting direction, "
            "color banding, cartoonish rendering, 3D CGI look, unrealistic materials, uncanny valley effect, "
            "incorrect ethnicity, wrong gender, exaggerated expressions, wrong gaze direction, mismatched lip sync, "
            "silent or muted audio, distorted voice, robotic voice, echo, background noise, off-sync audio, "
            "incorrect dialogue, added dialogue, repetitive speech, jittery movement, awkward pauses, incorrect "
            "timing, unnatural transitions, inconsistent framing, tilted camera, flat lighting, inconsistent tone, "
            "cinematic oversaturation, stylized filters, or AI artifacts.")
EXPECTED.update({
    "ltx2-19b-dev": ("euler", 40, math.exp(2.05), 3.0, LTX2_NEG),
    "ltx2.3-22b-dev": ("euler", 30, math.exp(2.05), 3.0, LTX2_NEG),
    "ltx2.5-dev": ("euler", 30, math.exp(2.05), 3.0, LTX2_NEG),
    # ours (no reference): 8 steps, the release's shift and guidance, no negative prompt (random text encoder)
    "tiny-ltx2-t2v": ("euler", 8, math.exp(2.05), 3.0, ""),
    # the audio-video demo's (no reference): the video demo's recipe, configs/demo_i2v_tiny.yaml's sample block
    "tiny-ltx2-demo": ("euler", 20, 3.0, 1.0, ""),
})
# MiniMax-AI/MiniMax-H3 (commit 8d8824e) FL2VA/model_index.json `sigma_shift_scales.video` 12.0 and README ("The
# released checkpoints are CFG-distilled": guidance 1, no negative prompt); diffusers 0.42.1 modular_pipelines
# `num_inference_steps` 50 grid points with the terminal 0 (49 model evaluations), MiniMaxH3Scheduler (Euler)
EXPECTED.update({
    "minimax-h3-fl2va": ("euler", 49, 12.0, 1.0, ""),
    "minimax-h3-ref2va": ("euler", 49, 12.0, 1.0, ""),
    # ours (no reference): the release's at 8 steps
    "tiny-h3": ("euler", 8, 12.0, 1.0, ""),
})
# ours (no reference): Euler at 20 steps, shift 3, guidance 5, no negative prompt (random text encoder)
TINY = ("euler", 20, 3.0, 5.0, "")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_sampling_defaults_are_wan_s(name):
    p = get_preset(name)
    expected = EXPECTED.get(name, TINY if name.startswith("tiny") else None)
    assert expected is not None, f"preset {name} has no reference sampling defaults in this test: add them"
    assert (p.sample_solver, p.sample_steps, p.sample_shift, p.sample_guidance, p.sample_negative) == expected


def _scheduler_folder(tmp_path, scheduler):
    scheduler.save_config(tmp_path / "scheduler")  # what save_pretrained writes
    return tmp_path


def test_scheduler_config_of_a_diffusers_folder(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    unipc = _scheduler_folder(tmp_path / "a", diffusers.UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0))
    cfg = read_scheduler_config(unipc)
    assert (cfg.solver, cfg.shift, cfg.grid) == ("unipc", 3.0, "diffusers")
    euler = _scheduler_folder(tmp_path / "b", diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))
    assert (read_scheduler_config(euler).solver, read_scheduler_config(euler).shift) == ("euler", 7.0)
    assert read_scheduler_config(tmp_path / "nothing_here") is None
    assert read_scheduler_config("preset:tiny") is None
    # what we cannot sample exactly is refused, naming the file, the key and what is accepted
    for name, scheduler, message in [
        ("c", diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                use_karras_sigmas=True), "use_karras_sigmas = True"),
        ("d", diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                solver_order=3), "solver_order = 3 .* accepted: 2"),
        ("e", diffusers.UniPCMultistepScheduler(), "prediction_type = 'epsilon'"),
        ("f", diffusers.DPMSolverMultistepScheduler(), "class 'DPMSolverMultistepScheduler'.*accepted: UniPC"),
    ]:
        folder = _scheduler_folder(tmp_path / name, scheduler)
        with pytest.raises(ValueError, match=message) as err:
            read_scheduler_config(folder)
        assert str(folder / "scheduler" / "scheduler_config.json") in str(err.value)


def test_precedence_and_the_line_that_says_it(tmp_path):
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "UniPCMultistepScheduler", "prediction_type": "flow_prediction", "use_flow_sigmas": True,
         "flow_shift": 3.0}))
    config = read_scheduler_config(tmp_path)
    preset = get_preset("wan2.1-t2v-1.3b")
    s = resolve_sampling(preset, family=WAN)
    assert (s.solver, s.steps, s.shift, s.guidance, s.negative, s.grid) == ("unipc", 50, 5.0, 5.0, WAN_NEG, "reference")
    assert s.describe() == ("sampling: unipc on Wan 2.1 / 2.2's grid, 50 steps, shift 5, guidance 5, negative prompt "
                            "Wan's default [solver, steps, shift, guidance, negative: preset wan2.1-t2v-1.3b]")
    s = resolve_sampling(preset, config, {"steps": (8, "--steps")}, family=WAN)
    assert (s.solver, s.steps, s.shift, s.grid) == ("unipc", 8, 3.0, "diffusers")
    assert s.sources["shift"] == str(tmp_path / "scheduler" / "scheduler_config.json")
    s = resolve_sampling(preset, config, {"solver": ("euler", "--solver"), "guidance": (1.0, "--cfg")}, family=WAN)
    assert (s.solver, s.shift, s.grid) == ("euler", 3.0, "reference")  # the folder's grid belongs to its UniPC
    assert "(off: no negative pass)" in s.describe() and "negative" not in s.describe().split("[")[1]
    s = resolve_sampling(None, family=WAN)  # no preset known: Wan's generate.py defaults
    assert (s.solver, s.steps, s.shift, s.guidance, s.negative) == ("unipc", 50, 5.0, 5.0, WAN_NEG)
    assert "Wan's generate.py defaults" in s.describe()
    with pytest.raises(ValueError, match="unknown solver 'dpm'"):
        resolve_sampling(preset, None, {"solver": ("dpm", "--solver")}, family=WAN)


def _job(sample: dict, name_or_path="preset:wan2.1-t2v-1.3b"):
    from video_dit.train.config import parse_job

    return parse_job({"job": "extension", "config": {"name": "j", "process": [{
        "datasets": [{"folder_path": str(ROOT / "docs")}],
        "model": {"name_or_path": name_or_path, "preset": "wan2.1-t2v-1.3b"},
        "sample": {"samples": [{"prompt": "a"}, {"prompt": "b", "sample_steps": 7, "neg": ""}], **sample}}]}})


def test_previews_take_the_preset_unless_the_job_says(tmp_path):
    from video_dit.train.preview import describe, job_scheduler, sample_settings

    job = _job({})  # no sampling keys: the preset's
    p = job.process
    a, b = (sample_settings(p.sample, i, get_preset("wan2.1-t2v-1.3b")) for i in (0, 1))
    assert (a.solver, a.steps, a.shift, a.guidance, a.negative) == ("unipc", 50, 5.0, 5.0, WAN_NEG)
    assert (b.steps, b.negative) == (7, "") and b.sources["steps"] == "sample.samples[1].sample_steps"

    class Job:  # what describe() reads
        def __init__(self, index, settings):
            self.index, self.settings = index, settings

    lines = describe([Job(0, a), Job(1, b)])
    assert len(lines) == 2 and lines[0].startswith("previews 0: sampling: unipc on Wan 2.1 / 2.2's grid, 50 steps")
    # the job's keys win; ai-toolkit's names: sampler flowmatch = Euler; ddpm (its default) = the default
    job = _job({"sampler": "flowmatch", "guidance_scale": 1.0, "sample_steps": 12, "shift": 8.0, "neg": "x"})
    s = sample_settings(job.process.sample, 0, get_preset("wan2.1-t2v-1.3b"))
    assert (s.solver, s.steps, s.shift, s.guidance, s.negative) == ("euler", 12, 8.0, 1.0, "x")
    assert s.sources["solver"] == "sample.sampler (flowmatch)" and s.sources["guidance"] == "sample.guidance_scale"
    s = sample_settings(_job({"sampler": "ddpm"}).process.sample, 0, get_preset("wan2.1-t2v-1.3b"))
    assert s.solver == "unipc" and s.sources["solver"] == "preset wan2.1-t2v-1.3b"
    # a diffusers model folder: its scheduler's shift unless the job sets one
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0}))
    job = _job({}, name_or_path=str(tmp_path))
    s = sample_settings(job.process.sample, 0, get_preset("wan2.1-t2v-1.3b"), job_scheduler(job.process))
    assert (s.solver, s.shift, s.steps) == ("euler", 3.0, 50)
    assert job_scheduler(_job({"sampler": "unipc", "shift": 5.0}, name_or_path=str(tmp_path)).process) is None
    from video_dit.typed_config import ConfigError

    with pytest.raises(ConfigError, match="sample_steps.*>= 1"):
        _job({"sample_steps": 0})
    # ai-toolkit's other sampler names (for its image models) name no flow solver: the default, said so
    s = sample_settings(_job({"sampler": "lms", "neg": False}).process.sample, 0, get_preset("wan2.1-t2v-1.3b"))
    assert (s.solver, s.negative, s.sources["negative"]) == ("unipc", "", "sample.neg")  # neg false: none
