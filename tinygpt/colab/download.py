"""The download: a run packed as a zip that Colab hands
to the browser (what a user keeps off the VM)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from tinygpt.core.checkpoint import MANIFEST, STATE_FILE, latest_valid, read_manifest
from tinygpt.core.files import atomic_output, link_problem
from tinygpt.core.rundir import PLOTS, RUN_FILES, RunDir

# already dense: deflating them costs time and saves ~nothing
_STORED = {".safetensors", ".pt", ".png"}


def zip_run(run_dir: str | Path, dest: str | Path | None = None, resumable: bool = False) -> Path:
    """<run>.zip beside the run folder with what a user keeps: run files (config,
    tokenizer, metrics, samples), plots and the newest valid checkpoint's weights
    and manifest, enough to generate and export (`unzip` it, then `tinygpt
    generate <run>`). The optimizer state (state.pt, twice the model: 1.5 GB for
    124M) stays on Drive unless `resumable`, which packs the whole checkpoint."""
    run_dir = Path(run_dir)
    ckpt = latest_valid(RunDir(run_dir).checkpoints)
    if ckpt is None:
        raise FileNotFoundError(f"{run_dir} holds no valid checkpoint to download; train first")

    def present(p: Path) -> bool:  # a link too: it is left out below, and said
        return p.is_file() or p.is_symlink()

    files = [run_dir / n for n in RUN_FILES if present(run_dir / n)]
    plots = run_dir / PLOTS
    files += sorted(filter(present, plots.iterdir())) if plots.is_dir() else []
    skip = set() if resumable else {STATE_FILE, MANIFEST}
    files += sorted(p for p in ckpt.iterdir() if present(p) and p.name not in skip)
    # a link is never followed into the download (it could
    # point at any file of this VM): left out, said once
    links = [why for p in [plots, *files] if (why := link_problem(p, writes=True)) is not None]
    files = [
        f
        for f in files
        if link_problem(f, writes=True) is None
        and (f.parent == run_dir or link_problem(f.parent) is None)
    ]
    if links:
        print(f"left out of the zip, never followed: {'; '.join(links)}")
    dest = Path(dest) if dest is not None else run_dir.parent / f"{run_dir.name}.zip"
    # never half a zip under the real name
    with atomic_output(dest) as tmp, zipfile.ZipFile(tmp, "w") as z:
        for f in files:
            kind = zipfile.ZIP_STORED if f.suffix in _STORED else zipfile.ZIP_DEFLATED
            z.write(f, Path(run_dir.name) / f.relative_to(run_dir), compress_type=kind)
        # the manifest of what is in the zip, so the weights verify (and load) there too
        if not resumable:
            manifest = read_manifest(ckpt)
            manifest["files"] = {k: v for k, v in manifest["files"].items() if k != STATE_FILE}
            z.writestr(
                str(Path(run_dir.name) / ckpt.relative_to(run_dir) / MANIFEST),
                json.dumps(manifest, indent=1),
            )
    return dest
