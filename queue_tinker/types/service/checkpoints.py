"""Checkpoint addresses: tinker://<run id>/weights/<name>, .../sampler_weights/<name> and
.../external_weights/<name>; the file names inside a checkpoint directory."""

from __future__ import annotations

import re
from dataclasses import dataclass

from queue_tinker.errors import UserInputError
from queue_tinker.types.enums import CheckpointKind

SCHEME = "tinker://"
META_FILE = "qt_meta.json"  # our metadata beside the PEFT files of every checkpoint directory
PEFT_CONFIG = "adapter_config.json"  # with PEFT_WEIGHTS: what PeftModel.from_pretrained reads
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_FILES = (PEFT_CONFIG, PEFT_WEIGHTS)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Run ids are ours (m-<hex>) or the Tinker protocol's (<session id>:train:<n>).
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,255}")
_SEGMENTS = {kind.path_segment: kind for kind in CheckpointKind}


def loadable(path: CheckpointPath, field: str = "path") -> CheckpointPath:
    """A checkpoint a run or a sampler can start from: not external weights (exported for
    download, perhaps encrypted)."""
    if path.kind is CheckpointKind.EXTERNAL:
        raise UserInputError(
            f"{field}: {path} holds external weights, which are for download; "
            "load a weights/ or sampler_weights/ checkpoint"
        )
    return path


def check_name(name: object, field: str = "name") -> str:
    """Names become directory names, so they are kept to a safe alphabet."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise UserInputError(
            f"{field}: {name!r} is not a valid checkpoint name; use 1 to 128 letters, digits, "
            "'.', '_' or '-', starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class CheckpointPath:
    run_id: str  # the model id of the training run that saved it
    kind: CheckpointKind
    name: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.run_id}/{self.kind.path_segment}/{self.name}"

    @property
    def storage_key(self) -> str:
        """Where it lives in checkpoint storage (queue_tinker/storage): <run>/<kind>/<name>."""
        return f"{self.run_id}/{self.kind.path_segment}/{self.name}"

    @classmethod
    def parse(cls, path: object, field: str = "path") -> CheckpointPath:
        text = path if isinstance(path, str) else ""
        parts = text.removeprefix(SCHEME).split("/") if text.startswith(SCHEME) else []
        if len(parts) != 3 or parts[1] not in _SEGMENTS or not parts[0]:
            raise UserInputError(
                f"{field}: {path!r} is not a checkpoint path; expected "
                f"{SCHEME}<run id>/weights/<name>, {SCHEME}<run id>/sampler_weights/<name> or "
                f"{SCHEME}<run id>/external_weights/<name>"
            )
        run_id, segment, name = parts
        if not _RUN_ID.fullmatch(run_id) or ".." in run_id:
            raise UserInputError(f"{field}: {path!r} names no valid run id ({run_id!r})")
        return cls(run_id=run_id, kind=_SEGMENTS[segment], name=check_name(name, field))
