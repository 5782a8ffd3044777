"""Mirroring a run folder to Google Drive (or any folder). Knows files, never models.

    copy.py      copy-and-verify: folders whole or not at all, retries with backoff, permanent errors
    identity.py  one run per mirror (identity.json)
    mirror.py    the background `Mirror` (a trainer callback), what the mirror lacks, catching it up
    mirrored.py  the wiring both trainings call: identity, restore, the `Mirror` from the first step, its close
    restore.py   the newest valid checkpoint back onto a new VM
    shards.py    the token cache's shards to and from the mirror
"""
