"""What a new user meets on a fresh clone: the README's install advice, and the words the main commands print."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_readmes_cpu_install_names_pytorchs_cpu_index():
    """From the public index, `pip install torch==X` fetches the CUDA build (527 MB and nvidia-* packages): the
    README's CPU advice must name PyTorch's CPU index."""
    readme = (ROOT / "README.md").read_text()
    installs = re.findall(r"pip install torch[^`\n]*", readme)
    assert installs, "the README no longer says how to install torch on a CPU machine"
    for line in installs:
        assert "--index-url https://download.pytorch.org/whl/cpu" in line, line
