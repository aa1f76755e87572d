"""tests/ on the import path, so every test file (also those under tests/faults/) imports the shared
builders (`helpers`) and launchers (`ranks`). Tests marked `gpu` are skipped without CUDA."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
