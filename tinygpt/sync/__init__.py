"""Mirroring a run folder to Google Drive (or any folder): verified copies, restore on a new VM.
Knows files, never models."""
