"""A run's decisions signed with this user's key, the one that signs the compile cache
(`compile_cache.signing_key`: $TINYGPT_COMPILE_KEY, Colab's secret of that name, or the local key
file; never on a mirror): run.json's recipe, plan and probe, probe.json, finetune.json. A run this
user wrote resumes with its decisions (on a new VM too, where the same key is given there); any
other (a shared mirror's, a file edited by hand) is state only: its size, micro-batch, context and
precision, a finetuning run's hardware class and plan, are decided here again (`pretrain.plan_run`,
`probe.fit_to_device`, `probe_cache.read_kept`, `finetune.run_finetune._settle`).
Field bounds (`plan.kept_plan`, `ProbeResult.from_dict`, `Budget.load`) stay as the second wall."""

from __future__ import annotations

import hashlib
import hmac
import json

from tinygpt.train.compile_cache import signing_key

SIGNATURE = "signature"  # the field that holds it
RUN_DOMAIN = "run"  # run.json: its DECIDED fields
FINETUNE_DOMAIN = "finetune"  # finetune.json: all of it
DECIDED = ("recipe", "plan", "probe")


def _digest(key: bytes, d: dict, domain: str) -> str:
    covered = (
        {k: d.get(k) for k in DECIDED}
        if domain == RUN_DOMAIN
        else {k: v for k, v in d.items() if k not in (SIGNATURE, "from_cache")}
    )
    payload = json.dumps(covered, sort_keys=True, default=str)
    return hmac.new(key, f"tinygpt-{domain}\0{payload}".encode(), hashlib.sha256).hexdigest()


def sign(d: dict, domain: str = RUN_DOMAIN) -> dict:
    """`d` (as JSON will read it back) with this user's signature; unsigned when no key can be had."""
    key, _ = signing_key()
    plain = json.loads(json.dumps({k: v for k, v in d.items() if k != SIGNATURE}, default=str))
    return {**plain, SIGNATURE: _digest(key, plain, domain)} if key else plain


def own_signature(d: object, domain: str = RUN_DOMAIN) -> bool:
    """Whether this user signed `d` (False for another's, a forged one, or none)."""
    sig = d.get(SIGNATURE) if isinstance(d, dict) else None
    if not isinstance(sig, str):
        return False
    key, _ = signing_key()
    return key is not None and hmac.compare_digest(sig, _digest(key, d, domain))
