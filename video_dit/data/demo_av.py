"""The audio-video demo's sound: each shape's colour its own steady note, and the checker that hears it.

    caption ("a red square moving up ...") --parse_caption--> colour
            --render_sound--> (1, round(frames / fps * rate)) float32 sine: the colour's note, steady over the
                              clip whatever the shape's direction
    a preview's waveform --estimate_pitch--> dominant pitch --check_sound--> PASS / FAIL

Design (for a tiny model to learn and a checker to verify): one pure tone per clip, its note
`NOTES[colour]` taken from the A major pentatonic scale a fifth apart (A3 E4 B4 F#5 C#6, 220 to 1109 Hz:
7 semitones between neighbours, so a pitch within a semitone names one colour), steady over the clip;
amplitude `AMPLITUDE` with `FADE_S` raised-cosine fades, a random start phase (the only randomness, from its
own generator, so the picture of a seed is the same with or without sound). `video_dit.data.demo.make_demo_data(
..., audio_rate=16000)` writes the clips with this sound as AAC (`video-dit make-demo-data --audio`).

Why the sound does not follow the motion: a mel vocoder at 25 frames a second sounds a steady frame's pitch on
a multiple of the frame rate, and the tiny one the demo trains renders the five tones it is trained on, not a
map from the mel to a pitch or a level (measured: 4-semitone glides came back as their clip's steady note, and
a 12 dB loudness ramp up or down came back as +2.1 and +0.8 dB). The checker asks what issue 47 asks of the
sound: the caption colour's pitch.

The checker (`estimate_pitch`, `check_sound`): per 64 ms Hann window (16 ms hop) of the mono mix, the
strongest spectral peak between `F_LOW` and `F_HIGH` (zero-padded FFT, parabolic interpolation on the
log magnitude), over the windows whose energy is within 20 dB of the loudest; the dominant pitch is the
median of those in semitones. Passes when the track is audible (peak above `audio.SILENT_PEAK`) and the
dominant pitch is within `PITCH_TOL_ST` (1 semitone) of the caption colour's note.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from video_dit.data import audio as audio_mod
from video_dit.data.demo import COLORS, make_demo_data, parse_caption

AUDIO_RATE = 16000        # the demo's sample rate (LTX-2's audio VAE reads 16 kHz)
MIN_RATE = 8000           # the lowest rate the demo writes: its highest note (1109 Hz) far below the Nyquist frequency
NOTES = {"red": 57, "green": 64, "blue": 71, "yellow": 78, "white": 85}  # MIDI: A3 E4 B4 F#5 C#6, a fifth apart
AMPLITUDE = 0.5
FADE_S = 0.01
F_LOW, F_HIGH = 60.0, 4000.0   # where the checker looks for the dominant peak (the notes are 220-1109 Hz)
WINDOW_S, HOP_S = 0.064, 0.016
PITCH_TOL_ST = 1.0
assert set(NOTES) == set(COLORS)


def midi_to_hz(note: float) -> float:
    return 440.0 * 2.0 ** ((note - 69.0) / 12.0)


def hz_to_midi(hz):
    return 69.0 + 12.0 * np.log2(np.asarray(hz, float) / 440.0)


def render_sound(colour: str, frames: int, fps: float, rate: int, rng: np.random.Generator) -> np.ndarray:
    """`(1, round(frames / fps * rate))` float32: the clip's steady tone of `colour` (module docstring),
    starting with its first frame and ending with its last frame's span."""
    n = int(round(frames / fps * rate))
    t = np.arange(n) / rate
    phase = 2 * np.pi * midi_to_hz(NOTES[colour]) * t + rng.uniform(0, 2 * np.pi)
    fade = np.clip(np.minimum(t, t[::-1]) / FADE_S, 0, 1)
    envelope = AMPLITUDE * 0.5 * (1 - np.cos(np.pi * fade))            # raised-cosine fades at both ends
    return (envelope * np.sin(phase)).astype(np.float32)[None]


def make_demo_av_data(out_dir, count: int = 64, frames: int = 17, size: int = 64, seed: int = 0,
                      holdout: int = 4, fps: float = 16, audio_rate: int = AUDIO_RATE) -> list[Path]:
    """The demo dataset (`demo.make_demo_data`: the same pictures for the same seed) with sound: every
    clip, held-out ones included, an MP4 with an AAC track at `audio_rate` (mono) from `render_sound`."""
    def sound(colour, direction, n, rate_fps, rng):  # `make_demo_data`'s callback; the direction is not heard
        return render_sound(colour, n, rate_fps, audio_rate, rng)

    return make_demo_data(out_dir, count=count, frames=frames, size=size, seed=seed, holdout=holdout, fps=fps,
                          sound=sound, audio_rate=audio_rate)


def estimate_pitch(wave: np.ndarray, rate: int) -> dict:
    """The dominant pitch of `wave` (`(C, S)` or `(S,)`, channels averaged; module docstring):
    `{"pitch_hz", "pitch_midi", "windows"}` (the windows used); NaN figures when no window has energy."""
    mono = np.asarray(wave, np.float64)
    mono = mono.mean(0) if mono.ndim == 2 else mono
    win, hop = int(round(WINDOW_S * rate)), int(round(HOP_S * rate))
    n_fft = 4 * (1 << int(np.ceil(np.log2(win))))                     # zero-padded 4x: 3.9 Hz bins at 16 kHz
    starts = range(0, max(len(mono) - win, 0) + 1, hop)
    frames = np.stack([mono[s:s + win] for s in starts]) if len(mono) >= win else np.zeros((0, win))
    energy = np.sqrt((frames ** 2).mean(1)) if len(frames) else np.zeros(0)   # (windows,) RMS
    if not len(frames) or energy.max() <= 0:
        return {"pitch_hz": float("nan"), "pitch_midi": float("nan"), "windows": 0}
    voiced = frames[energy >= energy.max() * 0.1]                      # within 20 dB of the loudest window
    spec = np.log(np.abs(np.fft.rfft(voiced * np.hanning(win), n_fft, axis=1)) + 1e-12)  # (windows, bins)
    lo, hi = int(np.ceil(F_LOW * n_fft / rate)), min(int(F_HIGH * n_fft / rate), n_fft // 2 - 1)
    k = lo + spec[:, lo:hi].argmax(1)
    a, b, c = (spec[np.arange(len(k)), k + d] for d in (-1, 0, 1))
    offset = 0.5 * (a - c) / np.where(a - 2 * b + c == 0, -1e-12, a - 2 * b + c)  # the parabola's vertex
    midi = hz_to_midi((k + offset) * rate / n_fft)                     # (windows,)
    pitch = float(np.median(midi))
    return {"pitch_hz": midi_to_hz(pitch), "pitch_midi": pitch, "windows": len(midi)}


def check_sound(wave: np.ndarray, rate: int, caption: str) -> dict:
    """Does `wave` (`(C, S)` at `rate`) sound as the demo caption says: audible, its dominant pitch within
    `PITCH_TOL_ST` of the caption colour's note (module docstring)? Returns the figures, `ok` and `failed`
    (the criteria that failed: "audible", "pitch")."""
    _, colour, direction = parse_caption(caption)
    est = estimate_pitch(wave, rate)
    error = est["pitch_midi"] - NOTES[colour]
    checks = {
        "audible": not audio_mod.is_silent(np.asarray(wave)),
        "pitch": bool(np.isfinite(error) and abs(error) <= PITCH_TOL_ST),
    }
    result = {"caption": caption, "colour": colour, "direction": direction,
              "expected_hz": round(midi_to_hz(NOTES[colour]), 1), "pitch_hz": round(est["pitch_hz"], 1),
              "pitch_error_st": round(float(error), 2),
              "peak_dbfs": round(audio_mod.dbfs(audio_mod.peak(np.asarray(wave))), 1)}
    result["failed"] = [k for k, ok in checks.items() if not ok]
    result["ok"] = not result["failed"]
    return result


def format_sound_check(result: dict) -> str:
    """One line per clip: the note asked, the pitch heard, its error, the peak, PASS / FAIL (criteria)."""
    if "error" in result:
        return f"FAIL  {result['caption']}: {result['error']}"
    return (f"{'PASS' if result['ok'] else 'FAIL'}  {result['colour']} {result['direction']}: want "
            f"{result['expected_hz']:g} Hz, heard {result['pitch_hz']:g} Hz ({result['pitch_error_st']:+.2f} st), "
            f"peak {result['peak_dbfs']:g} dBFS"
            + (f"  [failed: {', '.join(result['failed'])}]" if result["failed"] else ""))


def check_clip_sound(path, caption: str) -> dict:
    """`check_sound` of the audio of every frame of the MP4 `path` (`audio.clip_audio`); a file
    without an audio stream, or one that cannot be read, fails with "unreadable" and the reason."""
    try:
        got = audio_mod.clip_audio(path)
    except audio_mod.MediaError as exc:
        return {"caption": caption, "ok": False, "failed": ["unreadable"], "error": str(exc)}
    if got is None:
        return {"caption": caption, "ok": False, "failed": ["unreadable"], "error": f"{path}: no audio stream"}
    return check_sound(got[0], got[1], caption)


# ---------------------------------------------------------------- the previews of a demo run


def previews_have_sound(samples: Path, steps: list[int]) -> bool:
    """Whether preview 0 of any of `steps` carries an audio stream (a job whose model generates sound)."""
    for step in steps:
        path = samples / f"{step:09d}_0.mp4"
        try:
            if path.is_file() and audio_mod.audio_info(path) is not None:
                return True
        except audio_mod.MediaError:
            continue  # an unreadable preview: the picture half reports it
    return False


def sound_report(samples: Path, prompts: list[str], steps: list[int]) -> tuple[str, dict[int, list[dict]]]:
    """The audio half of the check: (printable report, {step: results}) of `check_clip_sound` on every
    preview `<samples>/<step>_<i>.mp4` (its audio track over its frames' span)."""
    lines = ["sound check: each preview audible, its dominant pitch within a semitone of its caption colour's "
             "note (video_dit/data/demo_av.py check_sound)"]
    out = {}
    for step in steps:
        results = [check_clip_sound(samples / f"{step:09d}_{i}.mp4", prompt) for i, prompt in enumerate(prompts)]
        out[step] = results
        lines.append(f"step {step}: {sum(r['ok'] for r in results)}/{len(results)} previews sound right")
        lines += [f"  {format_sound_check(r)}" for r in results]
    return "\n".join(lines), out
