"""`video-dit aitk-install`'s Python extension, registration through ai-toolkit's extension scan (stand-in),
import hygiene and the shared tiny i2v job file (the UI entries and the bases: tests/test_aitk_ui.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import aitk_standin
import pytest
import yaml

from video_dit.cli import main as cli
from video_dit.commands.aitk_install import MARKER, SHIM, InstallError, install

REPO = Path(__file__).resolve().parents[1]


def fake_checkout(root: Path) -> Path:
    (root / "toolkit").mkdir(parents=True)
    (root / "run.py").write_text("# ai-toolkit entry point\n")
    return root


def test_install_writes_a_two_line_shim_and_is_idempotent(tmp_path, capsys):
    aitk = fake_checkout(tmp_path / "ai-toolkit")
    shim = aitk / "extensions" / "video_dit" / "__init__.py"
    assert install(aitk) == (shim, "installed")
    assert shim.read_text() == SHIM and len(SHIM.splitlines()) == 2
    before = shim.stat().st_mtime_ns
    assert install(aitk) == (shim, "unchanged") and shim.stat().st_mtime_ns == before
    assert cli(["aitk-install", str(aitk)]) == 1  # a checkout without the web UI: said, with the way round it
    assert "pass --no-ui" in capsys.readouterr().err
    shim.write_text(MARKER + "\nfrom an_older_layout import AI_TOOLKIT_MODELS\n")  # ours, outdated
    assert install(aitk) == (shim, "updated") and shim.read_text() == SHIM


def test_install_refuses_foreign_folders_and_non_checkouts(tmp_path, capsys):
    aitk = fake_checkout(tmp_path / "ai-toolkit")
    foreign = aitk / "extensions" / "video_dit"
    foreign.mkdir(parents=True)
    (foreign / "__init__.py").write_text("AI_TOOLKIT_MODELS = []  # someone else's\n")
    assert cli(["aitk-install", "--no-ui", str(aitk)]) == 1
    err = capsys.readouterr().err
    assert str(foreign) in err and "foreign" in err
    assert (foreign / "__init__.py").read_text() == "AI_TOOLKIT_MODELS = []  # someone else's\n"
    (foreign / "__init__.py").unlink()
    with pytest.raises(InstallError, match="without an __init__.py"):
        install(aitk)
    with pytest.raises(InstallError, match="does not look like an ai-toolkit checkout"):
        install(tmp_path)
    with pytest.raises(InstallError, match="no such directory"):
        install(tmp_path / "missing")


def test_installed_shim_registers_the_arch_with_get_model_class(tmp_path):
    """ai-toolkit's registration: import `extensions.<name>` for every folder, collect
    AI_TOOLKIT_MODELS, first matching `arch` wins (stand-in of toolkit/util/get_model.py)."""
    aitk_dir = fake_checkout(tmp_path / "ai-toolkit")
    install(aitk_dir)
    aitk = aitk_standin.activate()
    sys.path.insert(0, str(aitk_dir))  # run.py's directory is on sys.path in ai-toolkit
    try:
        from toolkit.config_modules import ModelConfig
        from toolkit.util import get_model

        get_model.TOOLKIT_ROOT = str(aitk_dir)
        model_class = get_model.get_model_class(ModelConfig(arch="video_dit:tiny", name_or_path="preset:tiny"))
        assert model_class is aitk.VideoDiTModel
        assert sys.modules["extensions.video_dit"].__file__ == str(aitk_dir / "extensions" / "video_dit" / "__init__.py")
    finally:
        sys.path.remove(str(aitk_dir))
        aitk_standin.deactivate()


def test_video_dit_never_imports_ai_toolkit():
    code = ("import sys, video_dit, video_dit.cli, video_dit.commands.aitk_install, video_dit.integrations\n"
            "assert 'toolkit' not in sys.modules and 'video_dit.integrations.ai_toolkit' not in sys.modules\n"
            "try:\n    import video_dit.integrations.ai_toolkit\nexcept ImportError as e:\n    print(e)\n"
            "else:\n    raise SystemExit('imported without ai-toolkit')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "aitk-install" in out.stdout  # the ImportError ai-toolkit prints says what to do


def test_shared_job_file_reads_in_both_trainers(tmp_path, monkeypatch):
    from PIL import Image

    from video_dit.train.config import load_job

    # the job's paths are relative to where it is run; its `prepare:` stage would make data/demo
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "demo").mkdir(parents=True)
    Image.new("RGB", (64, 64)).save(tmp_path / "data" / "demo" / "0000.png")
    ours = load_job(REPO / "configs" / "aitk_tiny_i2v.yaml")  # our typed parser rejects unknown keys
    assert ours.process.model.preset == "tiny" and ours.process.i2v_mode == "replace"
    job = yaml.safe_load((REPO / "configs" / "aitk_tiny_i2v.yaml").read_text())
    assert job["job"] == "extension"
    process = job["config"]["process"][0]
    assert process["type"] == "sd_trainer"
    assert process["model"]["arch"] == "video_dit" and process["model"]["name_or_path"] == "preset:tiny"
    assert process["train"]["noise_scheduler"] == "flowmatch"  # ai-toolkit draws flowmatch timesteps only then
    dataset = process["datasets"][0]
    assert dataset["do_i2v"] is True and (dataset["num_frames"] - 1) % 4 == 0
    assert set(process) - {"prepare"} <= {"type", "training_folder", "device", "network", "save", "datasets",
                                          "train", "model", "sample"}  # keys ai-toolkit's process reads
    aitk = aitk_standin.activate()
    try:
        from toolkit.config_modules import ModelConfig

        model = aitk.VideoDiTModel(device="cpu", model_config=ModelConfig(**process["model"]), dtype="fp32")
        assert model.i2v_mode == "replace" and model.get_bucket_divisibility() == 16
        assert dataset["resolution"][0] % model.get_bucket_divisibility() == 0
    finally:
        aitk_standin.deactivate()
