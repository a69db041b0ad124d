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
    # (safetensors files are written and read by hdreplay.checkpoint.tensorfile, without the package)
    assert "torch" in loaded


def test_importing_the_core_changes_no_environment_variable():
    code = "import os; before = dict(os.environ); import hdreplay; print(before == dict(os.environ))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


def test_the_core_is_what_import_hdreplay_loads_and_it_needs_only_torch_numpy_safetensors():
    """``import hdreplay`` loads the method alone: no peer, diagnostic, asynchronous or integration module, and no
    third-party package beyond torch, numpy and safetensors (and what they load themselves)."""
    code = ("import sys; import torch, numpy, safetensors, safetensors.torch; base = set(sys.modules); "
            "import hdreplay; new = set(sys.modules) - base; print(sorted(new))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    new = set(eval(out))
    ours = {m for m in new if m.split(".")[0] == "hdreplay"}
    assert not {m for m in ours if m.split(".")[1:2] and m.split(".")[1] in (
        "baselines", "diagnostics", "staleness", "integrations")}, ours
    foreign = {m.split(".")[0] for m in new - ours} - set(sys.stdlib_module_names)
    assert not foreign, foreign
