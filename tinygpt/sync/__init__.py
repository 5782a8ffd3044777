"""Mirroring a run folder to Google Drive (or any folder). Knows files, never models.

copy.py         copy-and-verify: folders whole or not at all (a finetune's adapter once), retries
                with backoff, permanent errors
identity.py     one run per mirror (identity.json)
mirror.py       the background `Mirror` (a trainer callback)
watch.py        whether the mirror folder is still this run's (Drive mounted, device, identity)
catchup.py      what the mirror lacks (`mirror_lag`), and copying it (`catch_up`)
mirrored.py     the wiring both trainings call: identity, restore, the `Mirror` from the first
                step, its close
restore.py      the newest valid checkpoint back onto a new VM
token_cache.py  the token cache's shards to and from the mirror
"""
