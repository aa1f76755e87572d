"""Sound in and out (video_dit/data/audio.py, media.py): the cut lands on the clip's frames, the
resampler against a sine computed here, a dataset with a clip without sound, a silent one and a
corrupt one, the AAC track read back, the contact sheet's strip.

Every expected figure is computed in the test from the clip it wrote (a click's container time, a
sine's formula); tolerances are derived (rounding) or measured (AAC, libswresample) and stated."""

from __future__ import annotations

import re
import warnings
from fractions import Fraction

import av
import numpy as np
import pytest

from video_dit import media
from video_dit.cli import main as cli_main
from video_dit.data import audio as A
from video_dit.data.dataset import DatasetConfig, DataWarning, scan_dataset
from video_dit.data.frames import load_item_audio
from video_dit.typed_config import ConfigError, parse

NTSC = Fraction(24000, 1001)
OUT = 16000  # the rate every cut is read at


def write_clip(path, frames: int, fps, wave=None, rate: int = 48000, audio_start: float = 0.0,
               size: int = 16, video_start: int = 0) -> None:
    """A clip of `frames` grey frames at `fps` (libx264), the first shown at frame time `video_start`
    (in frames), and, when `wave` `(C, S)` is given, an audio track whose first sample plays at
    container time `audio_start`: FLAC in .mkv (lossless, so a click stays one sample), AAC in .mp4."""
    path = str(path)
    codec = "flac" if path.endswith(".mkv") else "aac"
    with av.open(path, "w") as c:
        v = c.add_stream("libx264", rate=Fraction(fps))
        v.width = v.height = size
        v.pix_fmt = "yuv420p"
        a = None
        if wave is not None:
            a = c.add_stream(codec, rate=rate)
            a.layout = "mono" if wave.shape[0] == 1 else "stereo"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), 8 * i % 256, np.uint8), format="rgb24")
            frame.pts = video_start + i
            for p in v.encode(frame):
                c.mux(p)
        for p in v.encode():
            c.mux(p)
        if a is not None:
            if codec == "flac":  # 16-bit PCM in, packed
                pcm = np.round(np.clip(wave, -1, 1) * 32767).astype(np.int16)
                frame = av.AudioFrame.from_ndarray(pcm.T.reshape(1, -1).copy(), format="s16", layout=a.layout.name)
            else:
                frame = av.AudioFrame.from_ndarray(wave.astype(np.float32), format="fltp", layout=a.layout.name)
            frame.sample_rate, frame.pts, frame.time_base = rate, int(round(audio_start * rate)), Fraction(1, rate)
            for p in a.encode(frame):
                c.mux(p)
            for p in a.encode():
                c.mux(p)


def clicks(seconds: float, rate: int, times, audio_start: float = 0.0) -> np.ndarray:
    """`(1, S)` silence with a 0.9 click at each container time in `times`."""
    wave = np.zeros((1, int(seconds * rate)))
    for t in times:
        wave[0, int(round((t - audio_start) * rate))] = 0.9
    return wave


# Sync. Tolerance: the click sits at the nearest source sample (<= 0.5 / 48000 s = 0.17 output
# samples off) and libswresample's band-limited image of it peaks on the nearest output sample: |d| <= 1
# for FLAC. AAC smears a click over its block; measured 0 samples off here (asserted <= 8, 0.5 ms). An
# MP4 holds a track's start offset in an edit list in the movie's timescale, 1/1000 s as FFmpeg's muxer
# writes it: the offset reads back floored to the millisecond (here 0.2287 -> 0.228 s, measured 11
# samples early at 16 kHz), so that case allows 16 + 1 samples. One frame of error would be 667 samples
# at 24000/1001 fps.
SYNC_CASES = [
    # (file, source fps, dataset fps, shrink, frames in the clip, num_frames, audio start s, video start
    #  in frames, click frame, tol)
    ("stride2_ntsc.mkv", NTSC, 12, False, 40, 17, 0.0, 0, 20, 1),   # consecutive frames, stride 1.998
    ("offset_ntsc.mkv", NTSC, 24, False, 30, 17, 0.25, 0, 12, 1),   # the audio starts 0.25 s after the video
    ("offset_ntsc.mp4", NTSC, 24, False, 30, 17, 0.25, 0, 12, 17),  # the same in MP4 + AAC (an edit list, in ms)
    ("video_late.mkv", Fraction(25), 25, False, 30, 17, 0.0, 5, 10, 1),  # the video starts 0.2 s after the audio
    ("spread.mp4", Fraction(25), 24, True, 33, 17, 0.0, 0, 16, 8),  # spread over the clip: stride 2
]


@pytest.mark.parametrize("name,fps,ds_fps,shrink,total,n,audio_start,video_start,k,tol", SYNC_CASES)
def test_a_click_at_frame_k_lands_on_its_sample_of_the_cut(tmp_path, name, fps, ds_fps, shrink, total, n,
                                                           audio_start, video_start, k, tol):
    folder = tmp_path / "d"
    folder.mkdir()
    t0 = video_start / float(fps)  # frame 0's container time
    seconds = t0 + total / float(fps) + 0.5
    write_clip(folder / name, total, fps, clicks(seconds - audio_start, 48000, [t0 + k / float(fps)], audio_start),
               audio_start=audio_start, video_start=video_start)
    cfg = parse(DatasetConfig, {"folder_path": str(folder), "num_frames": n, "fps": ds_fps, "resolution": [16],
                                "shrink_video_to_frames": shrink}, "ds")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)  # the shrink note
        (item,) = scan_dataset(cfg, 16, verbose=False, audio=True).items
    assert k in item.frames  # the click's frame is one of the selected frames
    info = A.audio_info(folder / name)
    assert info.start > 0.1 if audio_start else info.start == 0.0  # the offsets are in the container
    assert media.probe_video(folder / name).start == pytest.approx(t0)
    stride = float(fps) / ds_fps if not shrink else (total - 1) / (n - 1)
    wave = load_item_audio(item, OUT, 1)
    assert wave.shape == (1, round(n * stride / float(fps) * OUT))  # n frames at their own rate, at 16 kHz
    got = int(np.abs(wave[0].numpy()).argmax())
    want = round(k / float(fps) * OUT)  # the cut starts at the first selected frame, frame 0, at time t0
    assert abs(got - want) <= tol, (got, want)
    # the click itself: its band-limited image at a third of the rate peaks at 0.9 / 3 = 0.3 on a sample,
    # measured 0.243 between samples; the resampler's ringing around it stays far below
    assert wave[0, got] > 0.15


def test_a_cut_from_a_later_frame_seeks_and_still_lands(tmp_path):
    """A span starting 2.5 s into a 3.5 s clip (`read_audio` seeks there): the click at frame 70 lands
    (70 - 60) frames into the cut of frames 60..76; AAC, tolerance as above."""
    path = tmp_path / "long.mp4"
    write_clip(path, 84, NTSC, clicks(3.6, 44100, [70 / float(NTSC), 30 / float(NTSC)]), rate=44100)
    span = A.frames_span(media.probe_video(path).start, 60, 17, 1.0, float(NTSC))
    assert span.start > A.SEEK_AFTER_S + A.MARGIN_S  # the seek path
    wave = A.read_audio(path, span, rate=OUT, channels=2)
    assert wave.shape == (2, round(17 / float(NTSC) * OUT)) and np.array_equal(wave[0], wave[1])  # mono duplicated
    assert abs(int(np.abs(wave[0]).argmax()) - round(10 / float(NTSC) * OUT)) <= 8
    assert np.abs(wave[0]).max() > 0.15  # (as above) and the click at frame 30 is not in the cut:
    assert np.abs(wave[0, :round(9 / float(NTSC) * OUT)]).max() < 0.02


def test_resampling_and_mixing_against_sines_computed_here(tmp_path):
    """FLAC at 44.1 kHz read at 16 kHz by libswresample. Reference: the formula of each sine at the 16 kHz
    sample times. Measured max error 2.5e-5 (16-bit input: 1.5e-5 per LSB / 2) beyond 20 ms of the edges
    (where the stream starts abruptly); tolerance 2.5e-4 (10x). A 12 kHz tone (above the 8 kHz Nyquist
    frequency; naive decimation would alias it to 4 kHz) comes out at 1.9e-5 of its RMS; tolerance 1e-3."""
    src, f, phi = 44100, 1234.5, 0.3
    t = np.arange(2 * src) / src
    stereo = np.stack([0.5 * np.sin(2 * np.pi * f * t + phi), 0.3 * np.sin(2 * np.pi * 660 * t)])
    write_clip(tmp_path / "s.mkv", 48, 24, stereo, rate=src)
    write_clip(tmp_path / "hi.mkv", 48, 24, 0.5 * np.sin(2 * np.pi * 12000 * t)[None], rate=src)
    span = A.AudioSpan(0.0, 2.0)
    tt = np.arange(2 * OUT) / OUT
    left, right = 0.5 * np.sin(2 * np.pi * f * tt + phi), 0.3 * np.sin(2 * np.pi * 660 * tt)
    inner = slice(int(0.02 * OUT), -int(0.02 * OUT))
    both = A.read_audio(tmp_path / "s.mkv", span, rate=OUT)
    mono = A.read_audio(tmp_path / "s.mkv", span, rate=OUT, channels=1)
    assert both.shape == (2, 32000) and mono.shape == (1, 32000) and both.dtype == np.float32
    assert np.abs(both[0] - left)[inner].max() < 2.5e-4
    assert np.abs(both[1] - right)[inner].max() < 2.5e-4
    assert np.abs(mono[0] - (left + right) / 2)[inner].max() < 2.5e-4  # unit-gain downmix, not +3 dB
    hi = A.read_audio(tmp_path / "hi.mkv", span, rate=OUT)
    assert np.sqrt((hi[0, inner] ** 2).mean()) < 1e-3 * 0.5 / np.sqrt(2)
    # at the source rate nothing is resampled: the samples are the file's own (16-bit)
    native = A.read_audio(tmp_path / "s.mkv", span)
    assert native.shape == (2, 2 * src) and np.abs(native - stereo).max() < 1 / 32767


def _dataset(folder, size: int = 16):
    """sound.mp4 (a tone), nosound.mp4 (no audio stream), silent.mp4 (an AAC track of zeros),
    corrupt.mp4 (its AAC packets overwritten with random bytes; the video intact); frames size x size."""
    folder.mkdir()
    t = np.arange(int(1.5 * 16000)) / 16000
    write_clip(folder / "sound.mp4", 24, 16, 0.5 * np.sin(2 * np.pi * 440 * t)[None], rate=16000, size=size)
    write_clip(folder / "nosound.mp4", 24, 16, size=size)
    write_clip(folder / "silent.mp4", 24, 16, np.zeros((1, t.size)), rate=16000, size=size)
    write_clip(folder / "corrupt.mp4", 24, 16, 0.5 * np.sin(2 * np.pi * 440 * t)[None], rate=16000, size=size)
    with av.open(str(folder / "corrupt.mp4")) as c:
        spans = [(p.pos, p.size) for p in c.demux(c.streams.audio[0]) if p.size]
    data, rng = bytearray((folder / "corrupt.mp4").read_bytes()), np.random.default_rng(0)
    for pos, size in spans:
        data[pos:pos + size] = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    (folder / "corrupt.mp4").write_bytes(bytes(data))
    for name in ("sound", "nosound", "silent", "corrupt"):
        (folder / f"{name}.txt").write_text(f"a clip, {name}")


def _scan(folder, audio_key="auto", audio=True):
    cfg = parse(DatasetConfig, {"folder_path": str(folder), "num_frames": 17, "fps": 16, "resolution": [16],
                                "shrink_video_to_frames": False, "audio": audio_key}, "ds")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scan = scan_dataset(cfg, 16, verbose=True, audio=audio)
    return scan, [str(w.message) for w in caught if issubclass(w.category, DataWarning)]


def test_a_dataset_with_sound_none_silence_and_a_corrupt_track(tmp_path, capsys):
    folder = tmp_path / "d"
    _dataset(folder)
    assert A.read_audio(folder / "nosound.mp4", A.AudioSpan(0, 1)) is None  # no stream: "no audio", no error
    with pytest.raises(media.MediaError, match=r"corrupt\.mp4: corrupt audio stream \(aac\): cannot be decoded"):
        A.read_audio(folder / "corrupt.mp4", A.AudioSpan(0, 1))
    assert len(media.read_video_frames(folder / "corrupt.mp4")) == 24  # its picture is intact

    scan, warned = _scan(folder)
    by_name = {it.path.rsplit("/", 1)[1]: it for it in scan.items}
    assert sorted(by_name) == ["nosound.mp4", "silent.mp4", "sound.mp4"]  # nothing but the corrupt clip lost
    assert [w for w in warned if "skipped" in w] == [w for w in warned if "corrupt.mp4: skipped: corrupt audio" in w]
    assert len([w for w in warned if "skipped" in w]) == 1  # one warning, naming the file
    assert {n: it.has_audio for n, it in by_name.items()} == {"nosound.mp4": False, "silent.mp4": True,
                                                               "sound.mp4": True}  # silence is sound
    assert scan.audio_counts() == {"sound": 2, "silent": 1, "none": 1, "corrupt": 1}
    out = capsys.readouterr().out
    assert "1 files skipped (1 corrupt audio)" in out
    assert ("audio: 2 clip(s) with sound (1 of them silent: peak below -60 dBFS, trained as sound), 1 without an "
            "audio stream train the picture alone (audio loss masked), 1 skipped for a corrupt audio stream") in out
    # the items' sound: 17 frames at 16 fps = 17000 samples at 16 kHz; the tone's peak, the silence's zeros
    sound, silent = (load_item_audio(by_name[n], 16000, 1) for n in ("sound.mp4", "silent.mp4"))
    assert sound.shape == silent.shape == (1, 17000)
    assert abs(float(sound.abs().max()) - 0.5) < 0.1 and float(silent.abs().max()) < A.SILENT_PEAK
    assert load_item_audio(by_name["nosound.mp4"], 16000, 1) is None
    assert by_name["nosound.mp4"].audio_span == A.AudioSpan(0.0, 17 / 16)  # its length, for the masked latents

    scan, warned = _scan(folder, "required")
    assert sorted(it.path.rsplit("/", 1)[1] for it in scan.items) == ["silent.mp4", "sound.mp4"]
    assert any("nosound.mp4: skipped: no audio stream (audio: required)" in w for w in warned)
    scan, warned = _scan(folder, "off")  # no track read: the corrupt one stays, every item the picture alone
    assert len(scan.items) == 4 and not any(it.has_audio for it in scan.items) and not scan.audio
    scan, warned = _scan(folder, audio=False)  # a job without sound: the same, the key ignored
    assert len(scan.items) == 4 and not any(it.has_audio for it in scan.items) and warned == []
    with pytest.raises(ConfigError, match=r"ds\.audio: 'yes' is not accepted; accepted: 'auto' \| 'required' \| 'off'"):
        parse(DatasetConfig, {"folder_path": str(folder), "audio": "yes"}, "ds")


def test_inspect_data_counts_sound_silence_and_none(tmp_path, capsys):
    """A model with sound (`Family.audio`: LTX-2) has its clips' tracks counted; one without reads none."""
    folder = tmp_path / "d"
    _dataset(folder, size=32)
    for preset, counted in (("tiny-ltx2-t2v", True), ("tiny", False)):
        job = tmp_path / f"{preset}.yaml"
        job.write_text(f"""job: extension
config:
  name: t
  process:
    - type: sd_trainer
      model: {{name_or_path: "preset:{preset}"}}
      datasets:
        - folder_path: {folder}
          num_frames: 17
          fps: 16
          shrink_video_to_frames: false
          resolution: [32]
""")
        assert cli_main(["inspect-data", str(job)]) == 0
        out = capsys.readouterr().out
        line = ("sound: 2 clips with sound (1 silent: peak below -60 dBFS), 1 without an audio stream, 1 with a "
                "corrupt audio stream (skipped)")
        assert (line in out) is counted and ("sound:" in out) is counted, out
        assert bool(re.search(r"skipped .*corrupt\.mp4: corrupt audio stream", out)) is counted


# The AAC track written and read back. Measured (FFmpeg 8.1's native encoder, its defaults): SNR 30.6 dB
# (mono 16 kHz, a faded 440 Hz tone), 39.9 dB (stereo 440 / 660 Hz), the error mostly in the first two
# 1024-sample frames. Asserted: >= 20 dB (error RMS <= 10% of the signal's, ~3x the worst measured error).
# The same audio one video frame late (1000 samples) reads back at -5.8 / -5.2 dB: the check can fail.
# The stream header's duration: 17008 samples for the 17000 written (asserted within one AAC frame).
def _snr_db(ref, got):
    return 10 * np.log10((ref ** 2).mean() / ((got - ref) ** 2).mean())


@pytest.mark.parametrize("channels", [1, 2])
def test_mp4_with_aac_reads_back_at_its_rate_length_and_waveform(tmp_path, channels):
    rate, F, fps = 16000, 17, 16
    n = round(F / fps * rate)
    t = np.arange(n) / rate
    fade = np.clip(np.minimum(t, t[::-1]) / 0.01, 0, 1)
    wave = np.stack([0.5 * fade * np.sin(2 * np.pi * 440 * t), 0.3 * fade * np.sin(2 * np.pi * 660 * t)])[:channels]
    frames = np.zeros((F, 32, 32, 3), np.uint8)
    path = media.write_video(frames, tmp_path / "a.mp4", fps=fps, audio=wave, audio_rate=rate)
    assert path.read_bytes() == media.write_video(frames, tmp_path / "b.mp4", fps=fps, audio=wave,
                                                  audio_rate=rate).read_bytes()  # deterministic
    with av.open(str(path)) as c:
        (stream,) = c.streams.audio
        assert (stream.codec_context.name, stream.codec_context.sample_rate, stream.codec_context.channels) == \
            ("aac", rate, channels)
        assert abs(stream.duration * stream.time_base * rate - n) <= 1024  # the header: within one AAC frame
        assert len(c.streams.video) == 1 and c.streams.video[0].frames == F
    got, got_rate = A.clip_audio(path)  # the span of the clip's 17 frames
    assert got_rate == rate and got.shape == (channels, n)
    assert _snr_db(wave, got) >= 20.0
    late = np.pad(wave, ((0, 0), (1000, 0)))[:, :n]
    media.write_video(frames, tmp_path / "late.mp4", fps=fps, audio=late, audio_rate=rate)
    assert _snr_db(wave, A.clip_audio(tmp_path / "late.mp4")[0]) < 3.0
    with pytest.raises(ValueError, match=r"a\.gif: a \.gif has no audio track"):
        media.write_video(frames, tmp_path / "a.gif", fps=fps, audio=wave, audio_rate=rate)
    with pytest.raises(ValueError, match="not an AAC sample rate; accepted: 8000, 11025"):
        media.write_video(frames, tmp_path / "c.mp4", fps=fps, audio=wave, audio_rate=15999)
    with pytest.raises(ValueError, match=r"\(channels, samples\) with 1 or 2 channels, got shape \(3,"):
        media.write_video(frames, tmp_path / "c.mp4", fps=fps, audio=np.zeros((3, n)), audio_rate=rate)


def test_contact_sheet_audio_strip(tmp_path):
    """Without audio, the sheet is the grid alone (each frame pasted where the grid puts it); with a
    2 kHz tone at 16 kHz, a strip under it whose spectrogram's brightest row is the tone's:
    row (1 - 2000 / 8000) * (rows - 1) from the top, +-1 row for the FFT bin's width; its waveform
    reaches the tone's amplitude and silence draws one flat line."""
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (5, 12, 20, 3), dtype=np.uint8)
    plain = np.asarray(media.contact_sheet(frames, cols=5))
    assert plain.shape == (2 + 12 + 2, 5 * 22 + 2, 3)
    assert np.array_equal(plain[2:14, 2 + 22 * 3:2 + 22 * 3 + 20], frames[3])
    t = np.arange(16000) / 16000
    tone = (0.5 * np.sin(2 * np.pi * 2000 * t))[None]
    sheet = np.asarray(media.contact_sheet(frames, cols=5, audio=tone, audio_rate=16000))
    rows = media.WAVE_ROWS + media.SPECTRUM_ROWS
    assert sheet.shape == (plain.shape[0] + rows + 2, plain.shape[1], 3)
    assert np.array_equal(sheet[:plain.shape[0]], plain)  # the frames as before
    strip = sheet[plain.shape[0]:plain.shape[0] + rows, 2:-2].astype(int)
    spec = strip[media.WAVE_ROWS:].sum(-1)                            # (rows, width) brightness
    want = (1 - 2000 / 8000) * (media.SPECTRUM_ROWS - 1)
    assert np.all(np.abs(spec.argmax(0) - want) <= 1)
    wave_rows = np.nonzero((strip[:media.WAVE_ROWS] != 16).any(-1).any(1))[0]
    half = (media.WAVE_ROWS - 1) / 2
    assert wave_rows.min() <= round(half - 0.5 * half) and wave_rows.max() >= round(half + 0.5 * half)
    quiet = np.asarray(media.contact_sheet(frames, cols=5, audio=np.zeros((1, 16000)), audio_rate=16000))
    lit = (quiet[plain.shape[0]:plain.shape[0] + media.WAVE_ROWS, 2:-2] != 16).any(-1).any(1)
    assert lit.sum() == 1 and (quiet[plain.shape[0] + media.WAVE_ROWS:plain.shape[0] + rows, 2:-2] == 0).all()


# ---------------------------------------------------------------- the audio-video demo's sound and its checker
# Tolerances: the checker's own (demo_av.py): audible, and the dominant pitch within PITCH_TOL_ST = 1 semitone of
# the caption colour's note (the notes are 7 apart). On the exact tones the estimator is off by <= 0.01 st
# (measured), so they must read within 0.05 st, a tone 0.5 st off must pass and 1.5 st off fail.


def test_pitch_estimator_on_synthetic_tones():
    from video_dit.data import demo_av as D

    rate, n = 16000, 17000
    t = np.arange(n) / rate
    rng = np.random.default_rng(3)
    for note in rng.uniform(45, 90, 8):  # random pitches, 110 Hz .. 1.5 kHz: within 0.05 st
        est = D.estimate_pitch(0.4 * np.sin(2 * np.pi * D.midi_to_hz(note) * t + rng.uniform(0, 6)), rate)
        assert abs(est["pitch_midi"] - note) < 0.05, (note, est)
    caption = "a blue circle moving up on a black background"  # B4 (71)
    for offset, ok in ((0.0, True), (0.5, True), (-0.5, True), (1.5, False), (-1.5, False), (7.0, False),
                       (-7.0, False)):  # +-7: the neighbouring colours' notes (F#5, E4)
        r = D.check_sound(0.5 * np.sin(2 * np.pi * D.midi_to_hz(71 + offset) * t)[None], rate, caption)
        assert r["ok"] is ok and (ok or r["failed"] == ["pitch"]), (offset, r)
        assert abs(r["pitch_error_st"] - offset) < 0.05, (offset, r)
    assert D.check_sound(np.zeros((1, n)), rate, caption)["failed"] == ["audible", "pitch"]
    # the data's sound: each colour's steady note (440 * 2^((note - 69) / 12) Hz, derived here) whatever the
    # direction, its RMS between the fades that of a sine of AMPLITUDE (within 0.01 dB; measured <= 0.002 dB)
    for colour, note in D.NOTES.items():
        wave = D.render_sound(colour, 17, 16, rate, rng)
        assert wave.shape == (1, n) and wave.dtype == np.float32
        assert abs(12 * np.log2(D.estimate_pitch(wave, rate)["pitch_hz"] / (440 * 2 ** ((note - 69) / 12)))) < 0.05
        for direction in ("up", "down", "left", "right"):
            assert D.check_sound(wave, rate, caption.replace("blue", colour).replace(" up ", f" {direction} "))["ok"]
        middle = wave[0, 160:-160].astype(float)                          # past the 10 ms fades
        assert abs(20 * np.log10(np.sqrt((middle ** 2).mean()) * np.sqrt(2) / D.AMPLITUDE)) < 0.01, colour


def test_av_demo_data_sounds_as_its_captions_say(tmp_path, capsys):
    from video_dit.data import demo_av as D
    from video_dit.data.demo import check_clip, holdout_dir

    args = ["--count", "5", "--frames", "17", "--size", "32", "--holdout", "5", "--audio"]
    assert cli_main(["make-demo-data", str(tmp_path / "a"), *args]) == 0
    assert "with 16000 Hz mono AAC sound" in capsys.readouterr().out
    assert cli_main(["make-demo-data", str(tmp_path / "b"), *args[:-1]]) == 0  # the same seed without sound
    clips = sorted((tmp_path / "a").glob("*.mp4")) + sorted(holdout_dir(tmp_path / "a").glob("*.mp4"))
    assert len(clips) == 10
    captions = [p.with_suffix(".txt").read_text().strip() for p in clips]
    for path, caption in zip(clips, captions):
        r = D.check_clip_sound(path, caption)  # its colour's note through AAC: measured 0.00 st off (rounded)
        assert r["ok"] and abs(r["pitch_error_st"]) < 0.05, D.format_sound_check(r)
        wave, rate = A.clip_audio(path)
        assert rate == 16000 and wave.shape == (1, 17000)  # 17 frames at 16 fps
        assert check_clip(media.read_video_frames(path), caption)["ok"]  # and the picture still as before
    assert np.array_equal(media.read_video_frames(clips[0]), media.read_video_frames(tmp_path / "b" / clips[0].name))
    # a caption of another colour fails on pitch (5 held-out clips hold every colour)
    shifted = captions[5:][1:] + captions[5:][:1]
    assert not any(D.check_clip_sound(p, c)["ok"] for p, c in zip(clips[5:], shifted))
    assert D.check_clip_sound(tmp_path / "b" / "0000.mp4", captions[0])["failed"] == ["unreadable"]
    assert cli_main(["make-demo-data", str(tmp_path / "c"), "--audio", "--audio-rate", "15000"]) == 2


def test_check_demo_hears_previews_with_sound(tmp_path, capsys):
    """`video-dit check-demo` on previews with sound: step 40 = the held-out clips (picture and sound
    right), step 0 = their pictures with the other clip's sound (pitch wrong): exit 0 on the last step
    passing both halves; 1 when the last step asked has the picture right and the sound wrong."""
    import shutil

    import yaml

    data = tmp_path / "data"
    assert cli_main(["make-demo-data", str(data), "--count", "1", "--frames", "17", "--size", "32",
                     "--holdout", "2", "--audio"]) == 0
    held = tmp_path / "data_holdout"
    captions = [(held / f"{j:03d}.txt").read_text().strip() for j in range(2)]
    job = {"job": "extension", "config": {"name": "d", "process": [{
        "training_folder": str(tmp_path / "out"), "model": {"name_or_path": "preset:tiny"},
        "datasets": [{"folder_path": str(data), "num_frames": 17, "resolution": [32]}],
        "sample": {"samples": [{"prompt": c, "ctrl_img": str(held / f"{j:03d}.png")}
                               for j, c in enumerate(captions)]}}]}}
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    samples = tmp_path / "out" / "d" / "samples"
    samples.mkdir(parents=True)
    for j in range(2):
        shutil.copy(held / f"{j:03d}.mp4", samples / f"{40:09d}_{j}.mp4")
        other, rate = A.clip_audio(held / f"{1 - j:03d}.mp4")
        media.write_video(media.read_video_frames(held / f"{j:03d}.mp4"), samples / f"{0:09d}_{j}.mp4", fps=16,
                          audio=other, audio_rate=rate)
    capsys.readouterr()
    assert cli_main(["check-demo", str(config)]) == 0
    out = capsys.readouterr().out
    assert "step 0: 2/2 previews pass" in out and "step 40: 2/2 previews pass" in out  # the pictures
    assert "step 0: 0/2 previews sound right" in out and "step 40: 2/2 previews sound right" in out
    assert out.count("[failed: pitch]") == 2
    assert cli_main(["check-demo", str(config), "--steps", "40,0"]) == 1
