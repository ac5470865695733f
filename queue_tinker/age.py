"""age (filippo.io/age) encryption of exported weights, as the Tinker SDK asks for it with
`save_weights_external(..., age_encryption_recipients=[...])`: every exported file is
encrypted to the recipients and stored with a `.age` suffix (`age -d -i <identity>` reads it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyrage

from queue_tinker.errors import UserInputError

AGE_SUFFIX = ".age"
MAX_RECIPIENTS = 10  # as the SDK documents
_pyrage: Any = pyrage  # the extension module ships no type information


def parse_recipient(text: object, field: str) -> Any:
    """A native `age1...` key or an SSH public key; UserInputError naming the field else."""
    if isinstance(text, str):
        for kind in (_pyrage.x25519.Recipient, _pyrage.ssh.Recipient):
            try:
                return kind.from_str(text.strip())
            except (_pyrage.RecipientError, ValueError):
                continue
    raise UserInputError(
        f"{field}: {text!r} is not an age recipient (an age1... key or an SSH public key)"
    )


def check_recipients(values: object, field: str = "age_encryption_recipients") -> list[str]:
    """The recipients as given, each checked; None or [] is no encryption."""
    if values is None:
        return []
    if not isinstance(values, list) or len(values) > MAX_RECIPIENTS:
        raise UserInputError(f"{field}: must be a list of at most {MAX_RECIPIENTS} recipients")
    for i, value in enumerate(values):
        parse_recipient(value, f"{field}[{i}]")
    return [str(v).strip() for v in values]


def encrypt_in_place(directory: Path, names: Sequence[str], recipients: Sequence[str]) -> None:
    """Replace each named file of `directory` by `<name>.age`, encrypted to `recipients`.
    Idempotent: a file already replaced (a replay after a crash) is left as it is."""
    parsed = [parse_recipient(r, "age_encryption_recipients") for r in recipients]
    for name in names:
        plain = directory / name
        if not plain.exists():
            continue
        partial = directory / f".{name}{AGE_SUFFIX}.partial"
        _pyrage.encrypt_file(str(plain), str(partial), parsed)
        os.replace(partial, directory / f"{name}{AGE_SUFFIX}")
        plain.unlink()
