"""`tinygpt push`: `upload_folder`'s folder (export.py) to a Hugging Face Hub repository.

Invariant: `push` needs a token (`HF_TOKEN`, or Colab's secret of that name) and the Hub; without
either it stops with one line before exporting anything. What it uploads is exactly
`upload_folder`'s folder."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tinygpt.core.checkpoint import RunCheckpoint
from tinygpt.core.options import option
from tinygpt.model import gguf as gg
from tinygpt.publish.export import upload_folder
from tinygpt.publish.source import run_kind


class PushError(RuntimeError):
    """A push that cannot start or finish: the message says what to do."""


def hub_token() -> str | None:
    """HF_TOKEN from the environment, else from Colab's secrets (the key icon in its side bar)."""
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if token:
        return token
    try:
        from google.colab import userdata

        return userdata.get("HF_TOKEN")
    except Exception:  # not Colab, no such secret, or this notebook not granted access: no token
        return None


@dataclass(kw_only=True)
class PushOptions(RunCheckpoint):
    """`tinygpt push`: each field is one of its options (core/options.py)."""

    repo_id: str = option(
        flag="REPO_ID", help="USER/NAME or ORG/NAME (created if it does not exist)"
    )
    private: bool = option(False, help="create the repository private")
    gguf: str = option(
        "q8_0",
        choices=(*gg.QUANTS, "none"),
        help="also upload a GGUF of this type, for `ollama run hf.co/REPO_ID`",
    )

    def run(self) -> str:
        gguf = None if self.gguf == "none" else self.gguf
        return push(self.run_dir, self.repo_id, private=self.private, gguf=gguf, which=self.which)


def push(
    run_dir: str | Path,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = False,
    gguf: str | None = "q8_0",
    which: str = "latest",
) -> str:
    """Upload `upload_folder`'s folder to the Hub repository `repo_id` (created if needed); returns
    its URL. The token and the Hub are checked first, so a missing token or no network costs no
    export."""
    if repo_id.count("/") != 1:
        raise PushError(
            f"repository {repo_id!r} is not USER/NAME (or ORG/NAME), e.g. alice/tinygpt-124m"
        )
    run_kind(Path(run_dir))
    if gguf:
        gg.check_quant(gguf)
    token = token or hub_token()
    if not token:
        raise PushError(
            "no Hugging Face token: set HF_TOKEN to a write token from "
            "https://huggingface.co/settings/tokens (in Colab: add a secret named HF_TOKEN)"
        )
    try:
        from huggingface_hub import HfApi
    except ImportError as e:
        raise PushError("pushing needs huggingface_hub: pip install huggingface_hub") from e
    api = HfApi(token=token)
    try:
        user = api.whoami()["name"]
    except Exception as e:
        raise PushError(
            f"could not sign in to the Hugging Face Hub ({_short(e)}); check the "
            "network and that HF_TOKEN is a valid write token"
        ) from e
    with tempfile.TemporaryDirectory(prefix="tinygpt-push-") as tmp:
        folder = upload_folder(run_dir, Path(tmp) / "upload", repo_id, gguf=gguf, which=which)
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            message = f"tinygpt push of {Path(run_dir).resolve().name} by {user}"
            api.upload_folder(folder_path=str(folder), repo_id=repo_id, commit_message=message)
        except Exception as e:
            raise PushError(
                f"the upload to {repo_id} failed ({_short(e)}); run the same command again"
            ) from e
    return f"https://huggingface.co/{repo_id}"


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__
