"""The core library imports alone: no framework, plotting, dataframe or lab module is pulled in."""

import subprocess
import sys

FORBIDDEN = ("trl", "transformers", "verl", "matplotlib", "pandas", "hdreplay_lab", "omegaconf", "hydra", "ray",
             "accelerate", "datasets")


def test_import_hdreplay_pulls_in_no_framework_or_lab_module():
    code = ("import hdreplay, hdreplay.integrations, hdreplay.integrations.common, sys; "
            "print(sorted({m.split('.')[0] for m in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(eval(out))
    assert not loaded & set(FORBIDDEN), loaded & set(FORBIDDEN)
    assert "torch" in loaded  # (safetensors files are written and read by hdreplay.tensorfile, without the package)


def test_importing_the_core_changes_no_environment_variable():
    code = "import os; before = dict(os.environ); import hdreplay; print(before == dict(os.environ))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
