"""One run per mirror: a run's identity (its id and configuration hash) in identity.json, in the run
folder and in its mirror. A mirror that holds another run's identity is refused before anything is
written there (MirrorTaken), so two runs never mix their checkpoints on one Drive folder."""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from pathlib import Path

from tinygpt.core.files import read_bytes_safe, write_bytes_atomic
from tinygpt.core.rundir import IDENTITY, RunDirError
from tinygpt.sync.copy import MirrorTaken, new_tag

IDENTITY_LIMIT = 4096  # an identity.json holds two short strings


def read_identity(folder: Path) -> dict | None:
    """The identity.json of a run folder or a mirror (None
    when it has none; RunDirError when it is not one)."""
    p = folder / IDENTITY
    if not os.path.lexists(p):
        return None
    try:
        d = json.loads(read_bytes_safe(p, IDENTITY_LIMIT))  # no link followed, a few bytes at most
    except ValueError:
        d = None
    if not (
        isinstance(d, dict)
        and isinstance(d.get("run_id"), str)
        and isinstance(d.get("config"), str)
        # what `run_identity` makes: shown in messages, so one short word
        and re.fullmatch(r"[0-9A-Za-z_-]{1,64}", d["run_id"]) is not None
    ):
        raise RunDirError(
            f"{p} is not a run identity (run_id, config); delete it only if {folder} holds one run"
        )
    return d


def run_identity(local: str | Path, mirror: str | Path | None, config: dict) -> dict:
    """This run's identity ({run_id, config hash}) from the run folder's
    identity.json, else the mirror's (a new VM resuming it), else a new one. Refuses,
    before anything is written (MirrorTaken), a mirror that another run owns: another
    configuration, or another run id than the run folder's. A mirror that cannot be
    read is left to the mirror's own retries: it never stops a run here."""
    config_json = json.dumps(config, sort_keys=True, default=str).encode()
    digest = hashlib.sha256(config_json).hexdigest()[:16]
    mine = read_identity(Path(local))
    theirs = None
    if mirror is not None:
        try:
            theirs = read_identity(Path(mirror))
        except OSError:
            theirs = None
    if theirs is not None:
        if theirs["config"] != digest:
            raise MirrorTaken(
                f"the mirror {mirror} belongs to another run (its {IDENTITY}: run "
                f"{theirs['run_id']}, with another configuration or data): this run would mix its "
                "files with that run's; nothing was written. Use another --mirror folder (one per "
                "run)"
            )
        if mine is not None and mine["run_id"] != theirs["run_id"]:
            raise MirrorTaken(
                f"the mirror {mirror} belongs to run {theirs['run_id']} (its {IDENTITY}) and run "
                f"folder {local} is run {mine['run_id']}: two runs would mix their checkpoints; "
                "nothing was written. Use another --mirror folder (one per run)"
            )
        return theirs
    return mine if mine is not None else {"run_id": uuid.uuid4().hex[:12], "config": digest}


def write_identity(folder: str | Path, identity: dict) -> None:
    """The run folder's identity.json (kept once written)."""
    if not (Path(folder) / IDENTITY).is_file():
        write_bytes_atomic(Path(folder) / IDENTITY, json.dumps(identity).encode())


def claim_mirror(mirror: Path, identity: dict, tag: str = "") -> None:
    """Write the identity into the mirror, or check the
    one there (a second VM may have claimed it since)."""
    theirs = read_identity(mirror)
    if theirs is None:
        write_bytes_atomic(mirror / IDENTITY, json.dumps(identity).encode(), tag=tag or new_tag())
    elif theirs["run_id"] != identity["run_id"]:
        raise MirrorTaken(
            f"the mirror {mirror} was claimed by run {theirs['run_id']} (another VM or tab) while "
            f"this run ({identity['run_id']}) started: this run does not write there; use another "
            "--mirror"
        )
