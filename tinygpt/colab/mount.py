"""Google Drive inside Colab: is this Colab, mount Drive, where runs live on it.

Only the notebooks and `tinygpt.colab.runs` use this; the mirror itself (`tinygpt.sync`) works with
any folder, so nothing below the Colab layer needs to know about Drive."""

from __future__ import annotations

from pathlib import Path

DRIVE_RUNS = Path("tinygpt", "runs")  # runs live in MyDrive/tinygpt/runs/<name>


def in_colab() -> bool:
    try:
        import google.colab  # noqa: F401
    except ImportError:
        return False
    return True


def mount_drive(
    mountpoint: str | Path = "/content/drive", force_remount: bool = False, **kwargs
) -> Path:
    """Mount Google Drive (Colab only) and return its MyDrive folder."""
    try:
        from google.colab import drive
    except ImportError:
        raise RuntimeError(
            "mount_drive needs Google Colab; elsewhere any folder can be the mirror "
            "(`tinygpt pretrain --mirror DIR`)"
        ) from None
    drive.mount(str(mountpoint), force_remount=force_remount, **kwargs)
    mydrive = Path(mountpoint) / "MyDrive"
    if not mydrive.is_dir():
        raise OSError(f"Drive did not appear at {mydrive}; try mount_drive(force_remount=True)")
    return mydrive


def drive_run_dir(name: str, mydrive: str | Path) -> Path:
    """MyDrive/tinygpt/runs/<name>: where run `name` is mirrored on Drive (`mydrive`: MyDrive)."""
    return Path(mydrive) / DRIVE_RUNS / name
