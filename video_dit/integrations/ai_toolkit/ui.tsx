// ai-toolkit UI entries for the `video_dit` arch, one per preset.
//
// ai-toolkit's UI has no plug-in point, so this file is copied next to its model list:
//   cp video_dit/integrations/ai_toolkit/ui.tsx AITK_DIR/ui/src/app/jobs/new/video_dit.tsx
// and two lines are added to AITK_DIR/ui/src/app/jobs/new/options.tsx:
//   import { videoDitModelArchs } from './video_dit';
//   ...videoDitModelArchs,            // inside `export const modelArchs: ModelArch[] = [`
// `name` is `video_dit:<preset>`: ModelConfig strips the `:tag`, so every entry runs `arch: video_dit`.
// A `preset:NAME` path builds that preset (random weights; only the `tiny*` presets need no files).
// For a real model, give the local folder of the weights (Wan or HunyuanVideo 1.5) (diffusers layout: transformer/, vae/,
// text_encoder/, tokenizer/; Wan 2.1 I2V / FLF2V also image_encoder/ + image_processor/; LTX-2 a diffusers folder or
// Lightricks' single file, its Gemma 3 as model.te_name_or_path GEMMA_FOLDER::SINGLE_FILE) and keep
// `model_kwargs.preset`: nothing is downloaded from a hub. LTX-2 makes sound: its datasets read each clip's track
// (`do_audio`, ai-toolkit's key) and its loss adds the audio's (`train.audio_loss_multiplier`), as ai-toolkit's ltx2.
import type { ModelArch } from './options';

const flowmatch = {
  'config.process[0].sample.sampler': ['flowmatch', 'flowmatch'],
  'config.process[0].train.noise_scheduler': ['flowmatch', 'flowmatch'],
  'config.process[0].train.timestep_type': ['shift', 'sigmoid'],
};

// [selected, unselected] values, as in options.tsx
// Two-expert presets (Wan 2.2 A14B) also carry ai-toolkit's multistage keys, as its wan22_14b entries.
function presetDefaults(preset: string, o: { frames: number; fps: number; size: number; quantize: boolean; i2v: boolean;
                                             experts?: boolean; sound?: boolean }) {
  const kwargs = { ...(preset.startsWith('tiny') ? {} : { preset }),
                   ...(o.experts ? { train_high_noise: true, train_low_noise: true } : {}) };
  return {
    ...flowmatch,
    'config.process[0].model.name_or_path': [preset.startsWith('tiny') ? `preset:${preset}` : '', ''],
    'config.process[0].model.model_kwargs': [kwargs, {}],
    'config.process[0].model.quantize': [o.quantize, false],
    'config.process[0].model.quantize_te': [o.quantize, false],
    'config.process[0].sample.num_frames': [o.frames, 1],
    'config.process[0].sample.fps': [o.fps, 1],
    'config.process[0].sample.width': [o.size, 1024],
    'config.process[0].sample.height': [o.size, 1024],
    'config.process[0].datasets[x].num_frames': [o.frames, 1],
    'config.process[0].datasets[x].fps': [o.fps, undefined],
    'config.process[0].datasets[x].do_i2v': [o.i2v ? true : undefined, undefined],
    ...(o.sound ? { 'config.process[0].datasets[x].do_audio': [true, undefined],
                    'config.process[0].train.audio_loss_multiplier': [1.0, undefined] } : {}),
  };
}

const video = {
  group: 'video' as const,
  isVideoModel: true,
  disableSections: ['network.conv' as const], // Conv3d is never LoRA-targeted
  additionalSections: [
    'sample.ctrl_img' as const,
    'datasets.num_frames' as const,
    'datasets.do_i2v' as const,
    'model.low_vram' as const,
    'datasets.auto_frame_count' as const,
  ],
};

// a model with sound (LTX-2): ai-toolkit's dataset audio keys too, as its ltx2 entries
const withSound = {
  ...video,
  additionalSections: [...video.additionalSections, 'datasets.do_audio' as const, 'datasets.audio_normalize' as const],
};

export const videoDitModelArchs: ModelArch[] = [
  {
    name: 'video_dit:tiny',
    label: 'video_dit tiny (CPU smoke test, i2v)',
    ...video,
    defaults: presetDefaults('tiny', { frames: 17, fps: 16, size: 64, quantize: false, i2v: true }),
  },
  {
    name: 'video_dit:wan2.1-t2v-1.3b',
    label: 'video_dit Wan 2.1 T2V 1.3B',
    ...video,
    defaults: presetDefaults('wan2.1-t2v-1.3b', { frames: 41, fps: 16, size: 480, quantize: false, i2v: false }),
  },
  {
    name: 'video_dit:wan2.1-t2v-14b',
    label: 'video_dit Wan 2.1 T2V 14B',
    ...video,
    defaults: presetDefaults('wan2.1-t2v-14b', { frames: 41, fps: 16, size: 480, quantize: true, i2v: false }),
  },
  {
    name: 'video_dit:wan2.2-ti2v-5b',
    label: 'video_dit Wan 2.2 TI2V 5B (latent-replace i2v)',
    ...video,
    defaults: presetDefaults('wan2.2-ti2v-5b', { frames: 121, fps: 24, size: 704, quantize: true, i2v: true }),
  },
  {
    name: 'video_dit:wan2.2-t2v-a14b',
    label: 'video_dit Wan 2.2 T2V A14B (two experts)',
    ...video,
    additionalSections: [...video.additionalSections, 'model.multistage' as const],
    defaults: presetDefaults('wan2.2-t2v-a14b', { frames: 81, fps: 16, size: 480, quantize: true, i2v: false,
                                                  experts: true }),
  },
  {
    name: 'video_dit:wan2.2-i2v-a14b',
    label: 'video_dit Wan 2.2 I2V A14B (two experts, channel-concat i2v)',
    ...video,
    additionalSections: [...video.additionalSections, 'model.multistage' as const],
    defaults: presetDefaults('wan2.2-i2v-a14b', { frames: 81, fps: 16, size: 480, quantize: true, i2v: true,
                                                  experts: true }),
  },
  {
    name: 'video_dit:tiny-a14b',
    label: 'video_dit tiny two-expert (CPU smoke test, Wan 2.2 A14B layout)',
    ...video,
    additionalSections: [...video.additionalSections, 'model.multistage' as const],
    defaults: presetDefaults('tiny-a14b', { frames: 17, fps: 16, size: 64, quantize: false, i2v: true, experts: true }),
  },
  {
    name: 'video_dit:wan2.1-i2v-14b-480p',
    label: 'video_dit Wan 2.1 I2V 14B 480P (concat + CLIP image)',
    ...video,
    defaults: presetDefaults('wan2.1-i2v-14b-480p', { frames: 81, fps: 16, size: 480, quantize: true, i2v: true }),
  },
  {
    name: 'video_dit:wan2.1-i2v-14b-720p',
    label: 'video_dit Wan 2.1 I2V 14B 720P (concat + CLIP image)',
    ...video,
    defaults: presetDefaults('wan2.1-i2v-14b-720p', { frames: 81, fps: 16, size: 720, quantize: true, i2v: true }),
  },
  {
    name: 'video_dit:wan2.1-flf2v-14b-720p',
    label: 'video_dit Wan 2.1 FLF2V 14B 720P (first + last frame; ctrl_img_2 = last frame)',
    ...video,
    defaults: presetDefaults('wan2.1-flf2v-14b-720p', { frames: 81, fps: 16, size: 720, quantize: true, i2v: true }),
  },
  {
    name: 'video_dit:tiny-clip-i2v',
    label: 'video_dit tiny CLIP i2v (CPU smoke test, Wan 2.1 I2V layout)',
    ...video,
    defaults: presetDefaults('tiny-clip-i2v', { frames: 17, fps: 16, size: 64, quantize: false, i2v: true }),
  },
  {
    name: 'video_dit:tiny-clip-flf2v',
    label: 'video_dit tiny CLIP flf2v (CPU smoke test, Wan 2.1 FLF2V layout)',
    ...video,
    defaults: presetDefaults('tiny-clip-flf2v', { frames: 17, fps: 16, size: 64, quantize: false, i2v: true }),
  },
  {
    name: 'video_dit:hunyuan15-480p-t2v',
    label: 'video_dit HunyuanVideo 1.5 480p T2V',
    ...video,
    defaults: presetDefaults('hunyuan15-480p-t2v', { frames: 61, fps: 24, size: 480, quantize: true, i2v: false }),
  },
  {
    name: 'video_dit:hunyuan15-480p-i2v',
    label: 'video_dit HunyuanVideo 1.5 480p I2V (first frame + SigLIP)',
    ...video,
    defaults: presetDefaults('hunyuan15-480p-i2v', { frames: 61, fps: 24, size: 480, quantize: true, i2v: true }),
  },
  {
    name: 'video_dit:hunyuan15-720p-t2v',
    label: 'video_dit HunyuanVideo 1.5 720p T2V',
    ...video,
    defaults: presetDefaults('hunyuan15-720p-t2v', { frames: 61, fps: 24, size: 720, quantize: true, i2v: false }),
  },
  {
    name: 'video_dit:hunyuan15-720p-i2v',
    label: 'video_dit HunyuanVideo 1.5 720p I2V (first frame + SigLIP)',
    ...video,
    defaults: presetDefaults('hunyuan15-720p-i2v', { frames: 61, fps: 24, size: 720, quantize: true, i2v: true }),
  },
  {
    name: 'video_dit:hunyuan15-480p-t2v-cfg-distilled',
    label: 'video_dit HunyuanVideo 1.5 480p T2V CFG-distilled',
    ...video,
    defaults: presetDefaults('hunyuan15-480p-t2v-cfg-distilled', { frames: 61, fps: 24, size: 480, quantize: true, i2v: false }),
  },
  {
    name: 'video_dit:hunyuan15-480p-i2v-cfg-distilled',
    label: 'video_dit HunyuanVideo 1.5 480p I2V CFG-distilled',
    ...video,
    defaults: presetDefaults('hunyuan15-480p-i2v-cfg-distilled', { frames: 61, fps: 24, size: 480, quantize: true, i2v: true }),
  },
  {
    name: 'video_dit:hunyuan15-720p-i2v-cfg-distilled',
    label: 'video_dit HunyuanVideo 1.5 720p I2V CFG-distilled',
    ...video,
    defaults: presetDefaults('hunyuan15-720p-i2v-cfg-distilled', { frames: 61, fps: 24, size: 720, quantize: true, i2v: true }),
  },
  {
    name: 'video_dit:tiny-hy15-t2v',
    label: 'video_dit tiny HunyuanVideo 1.5 t2v (CPU smoke test)',
    ...video,
    defaults: presetDefaults('tiny-hy15-t2v', { frames: 17, fps: 24, size: 64, quantize: false, i2v: false }),
  },
  {
    name: 'video_dit:tiny-hy15-i2v',
    label: 'video_dit tiny HunyuanVideo 1.5 i2v (CPU smoke test)',
    ...video,
    defaults: presetDefaults('tiny-hy15-i2v', { frames: 17, fps: 24, size: 64, quantize: false, i2v: true }),
  },
  {
    name: 'video_dit:ltx2-19b-dev',
    label: 'video_dit LTX-2 19B dev (video with sound)',
    ...withSound,
    defaults: presetDefaults('ltx2-19b-dev', { frames: 121, fps: 24, size: 768, quantize: true, i2v: false, sound: true }),
  },
  {
    name: 'video_dit:ltx2.3-22b-dev',
    label: 'video_dit LTX-2.3 22B dev (video with sound)',
    ...withSound,
    defaults: presetDefaults('ltx2.3-22b-dev', { frames: 121, fps: 24, size: 768, quantize: true, i2v: false, sound: true }),
  },
  {
    name: 'video_dit:ltx2.5-dev',
    label: 'video_dit LTX-2.5 dev (video with sound; its Gemma 4 text encoder is not built yet)',
    ...withSound,
    defaults: presetDefaults('ltx2.5-dev', { frames: 121, fps: 24, size: 768, quantize: true, i2v: false, sound: true }),
  },
  {
    name: 'video_dit:tiny-ltx2-t2v',
    label: 'video_dit tiny LTX-2 with sound (CPU smoke test)',
    ...withSound,
    defaults: presetDefaults('tiny-ltx2-t2v', { frames: 17, fps: 24, size: 64, quantize: false, i2v: false, sound: true }),
  },
];
