"""Fake `google.colab.drive`: `mount` makes a folder with MyDrive/ appear at the mountpoint.

The backing folder is $TINYGPT_FAKE_DRIVE_ROOT (a temp folder of the test); the mountpoint becomes
a symlink to it, as Colab's FUSE mount makes Drive appear at /content/drive.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

mounts: list[str] = []  # every mountpoint mounted, for tests to look at


def _backing() -> Path:
    root = os.environ.get("TINYGPT_FAKE_DRIVE_ROOT") or os.path.join(
        tempfile.gettempdir(), "tinygpt-fake-drive"
    )
    return Path(root)


def mount(
    mountpoint: str, force_remount: bool = False, timeout_ms: int = 120000, readonly: bool = False
) -> None:
    backing = _backing()
    (backing / "MyDrive").mkdir(parents=True, exist_ok=True)
    mp = Path(mountpoint)
    if mp.is_symlink():
        if not force_remount and mp.resolve() == backing.resolve():
            print(
                f"Drive already mounted at {mountpoint}; to attempt to forcibly remount, "
                f'call drive.mount("{mountpoint}", force_remount=True).'
            )
            return
        mp.unlink()
    elif mp.exists():
        if not mp.is_dir() or any(mp.iterdir()):
            raise ValueError("Mountpoint must not already contain files")
        mp.rmdir()
    mp.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(backing, mp, target_is_directory=True)
    mounts.append(str(mountpoint))
    print(f"Mounted at {mountpoint}")


def flush_and_unmount(timeout_ms: int = 86400000) -> None:
    for mountpoint in mounts:
        if Path(mountpoint).is_symlink():
            Path(mountpoint).unlink()
    mounts.clear()
