"""One error hierarchy: every exception class of the package lives in errors.py, under
QueueTinkerError, with a user or server category."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import queue_tinker
from queue_tinker import errors
from queue_tinker.errors import ErrorCategory, QueueTinkerError

# Not imported: __main__ modules run the CLI, alembic's env.py and versions run migrations.
SKIPPED = ("__main__", "queue_tinker.migrations")


def package_modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(queue_tinker.__path__, "queue_tinker."):
        if not any(part in info.name for part in SKIPPED):
            names.append(info.name)
    return names


def test_every_exception_class_lives_in_errors_under_the_base_with_a_category() -> None:
    """Imports every module of the package (workers included) and looks at the exception
    classes each defines: all of them are errors.py's, and each has a category."""
    modules = package_modules()
    assert (
        "queue_tinker.workers.runtime.worker" in modules and "queue_tinker.gateway.app" in modules
    )
    defined: dict[str, type[BaseException]] = {}
    for name in modules:
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == name:
                defined[f"{name}.{cls.__qualname__}"] = cls
    elsewhere = sorted(n for n, cls in defined.items() if cls.__module__ != errors.__name__)
    assert elsewhere == []
    in_errors = {n: cls for n, cls in defined.items() if cls.__module__ == errors.__name__}
    assert len(in_errors) >= 15  # the base and its 14 subclasses, as of now
    for name, cls in in_errors.items():
        assert issubclass(cls, QueueTinkerError), name
        assert isinstance(cls.category, ErrorCategory), name


def test_user_errors_and_server_errors() -> None:
    """Bad input is the user's (retrying fails the same way); an outage or a bug the server's."""
    assert errors.SeqIdUsedError("x").category is ErrorCategory.USER
    assert errors.MalformedProtobufError("x").category is ErrorCategory.USER
    assert errors.NotFoundError("x").category is ErrorCategory.USER
    assert errors.StorageUnavailableError("x").category is ErrorCategory.SERVER
    assert errors.CheckpointPathError("x").category is ErrorCategory.SERVER
    assert errors.RedisUnavailableError("x").category is ErrorCategory.SERVER
    assert errors.EmbeddedServerError("x").category is ErrorCategory.SERVER
