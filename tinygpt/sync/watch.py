"""Is the mirror folder still the one this run copies to? The `Mirror`'s checks (mirror.py): at
its first copy the folder is made, unless it lies under a Drive mount point where nothing is
mounted (its parents would be made on the VM's own disk), and its device noted; before each copy
the folder is on that device with this run's identity.json in it, else `MirrorGone`.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from tinygpt.sync.copy import MirrorGone
from tinygpt.sync.identity import read_identity

# where Colab mounts Google Drive (colab.mount_drive's default)
DRIVE_MOUNTPOINT = Path("/content/drive")


def unmounted_drive(mirror: Path) -> Path | None:
    """Colab's Drive mount point when `mirror` lies under it and nothing is mounted there (None
    otherwise)."""
    path = Path(os.path.abspath(mirror))
    if DRIVE_MOUNTPOINT in path.parents and not os.path.ismount(DRIVE_MOUNTPOINT):
        return DRIVE_MOUNTPOINT
    return None


def first_contact(mirror: Path, local: Path) -> int:
    """Make the mirror folder (once, at the first copy) and say which folder it is: its device. A
    Drive mount point that is not mounted is refused: its parents would be made on the VM's own
    disk."""
    if mirror.exists() and not mirror.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "the mirror is a file, not a folder", str(mirror))
    drive = unmounted_drive(mirror)
    if drive is not None:
        raise MirrorGone(mirror, local, f"nothing is mounted at {drive}")
    mirror.mkdir(parents=True, exist_ok=True)
    return os.stat(mirror).st_dev


def check_root(mirror: Path, local: Path, root: int | None, identity: dict | None) -> None:
    """Before each copy: the mirror folder is the one this run began copying to (on the device
    `root`, this run's identity.json still there once claimed: `identity`, else None), else
    MirrorGone: a Drive unmounted mid-run leaves an empty mount point on the VM's disk, where
    nothing must be made (the copies would look done and be lost with the VM). The inode is not
    compared: a FUSE mount (Drive's) may number a folder anew after the kernel forgets it."""
    try:
        st = os.stat(mirror)
    except FileNotFoundError:
        raise MirrorGone(
            mirror, local, "the folder no longer exists: Drive unmounted, or the folder deleted"
        ) from None
    if st.st_dev != root:
        raise MirrorGone(
            mirror, local, "it now lies on another file system: Drive unmounted or remounted"
        )
    if identity is not None:
        theirs = read_identity(mirror)
        if theirs is None or theirs["run_id"] != identity["run_id"]:
            why = "gone" if theirs is None else f"run {theirs['run_id']}'s"
            raise MirrorGone(mirror, local, f"its identity.json is {why}: the folder was replaced")
