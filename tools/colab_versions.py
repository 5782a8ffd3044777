"""Has Colab moved? constraints/colab.txt against Colab's own package list, one line per difference.

    python tools/colab_versions.py FREEZE [OS_INFO]

FREEZE is a copy of pip-freeze.gpu.txt from googlecolab/backend-info (or `pip list --format=freeze`
run in a Colab runtime), OS_INFO the same commit's os-info-gpu.txt (its `Python 3.13.15` line is
checked against colab.txt's `# python` line). Exit status 0 when every pinned package has Colab's
version, 1 otherwise, each package that differs printed with both versions. With no arguments it
reads the copies kept in tests/fixtures (which tests/test_colab_versions.py checks the same way).
The README ("When Colab moves") says how to refresh both files from the repository's newest commit.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
COLAB = ROOT / "constraints" / "colab.txt"
FIXTURES = ROOT / "tests" / "fixtures"
FREEZE = FIXTURES / "colab-pip-freeze.gpu.txt"
OS_INFO = FIXTURES / "colab-os-info-gpu.txt"


def _version(text: str) -> Version | str:
    """A version without its local label (2.11.0+cu128
    -> 2.11.0); the text itself if it is no version."""
    try:
        return Version(Version(text).public)
    except InvalidVersion:
        return text


def pins(text: str) -> dict[str, Version | str]:
    """{canonical name: version} of a constraints file
    (`name==version`, comments and blank lines skipped)."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==", 1)
            out[canonicalize_name(name)] = _version(version.strip())
    return out


def freeze(text: str) -> dict[str, Version | str]:
    """{canonical name: version} of `pip freeze` output;
    `name @ URL` lines keep their URL as the version."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-")):
            continue
        parts = re.split(r"\s*(===|==| @ )\s*", line, maxsplit=1)
        if len(parts) != 3:  # a bare name (an editable install, say): no version to compare
            continue
        name, sep, version = parts
        out[canonicalize_name(name)] = _version(version) if sep != " @ " else version
    return out


def pinned_python(text: str) -> str | None:
    """colab.txt's Python, from its `# python X.Y.Z` line."""
    m = re.search(r"^# python (\S+)", text, re.M)
    return m.group(1) if m else None


def os_info_python(text: str) -> str | None:
    """The Python of an os-info file (`Python 3.13.15`)."""
    m = re.search(r"^Python (\S+)", text, re.M)
    return m.group(1) if m else None


def differences(colab_txt: str, freeze_txt: str, os_info_txt: str | None = None) -> list[str]:
    """One line per pinned package whose version differs from Colab's list
    or that the list lacks, and one for Python when an os-info file is given
    and disagrees. Empty: constraints/colab.txt is Colab as listed."""
    have, colab = pins(colab_txt), freeze(freeze_txt)
    out = []
    for name, version in have.items():
        if name not in colab:
            out.append(
                f"{name}: constraints/colab.txt {version}, not in Colab's list (removed or renamed)"
            )
        elif colab[name] != version:
            out.append(f"{name}: constraints/colab.txt {version}, Colab {colab[name]}")
    if os_info_txt is not None:
        mine, theirs = pinned_python(colab_txt), os_info_python(os_info_txt)
        if mine != theirs:
            out.append(f"python: constraints/colab.txt {mine}, Colab {theirs}")
    return out


def main(argv: list[str]) -> int:
    if len(argv) > 2 or any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 2
    freeze_file = Path(argv[0]) if argv else FREEZE
    os_info = Path(argv[1]) if len(argv) > 1 else (OS_INFO if not argv else None)
    found = differences(
        COLAB.read_text(), freeze_file.read_text(), os_info.read_text() if os_info else None
    )
    for line in found:
        print(line)
    what = f"{freeze_file}" + (f" and {os_info}" if os_info else "")
    print(
        f"{len(found)} pinned package(s) differ from {what}"
        if found
        else f"constraints/colab.txt matches {what} ({len(pins(COLAB.read_text()))} packages)"
    )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
