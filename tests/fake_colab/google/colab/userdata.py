"""Colab's secrets (the key icon in the side bar): `get(name)` returns a secret's value, and raises when the
notebook has no secret of that name. Here the secrets are `SECRETS`, which a test fills."""

SECRETS: dict[str, str] = {}


class SecretNotFoundError(Exception):
    pass


def get(key: str) -> str:
    if key not in SECRETS:
        raise SecretNotFoundError(f"Secret {key} does not exist.")
    return SECRETS[key]
