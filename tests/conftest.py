"""tests/ on the import path, so every test file (also those under tests/faults/) imports the shared
builders (`helpers`) and launchers (`ranks`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
