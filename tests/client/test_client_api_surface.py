"""The Python client mirrors the official SDK's public API (tinker 0.38): every public method of
ServiceClient, TrainingClient, SamplingClient and RestClient exists on ours with every argument
name the SDK's has, or README.md's table "Not in the Python client" names it with a reason (the
async twins the SDK itself deprecates may be left out; ours that exist are checked too)."""

from __future__ import annotations

import inspect
import re

import pytest
import tinker
from procs import REPO

import queue_tinker
from queue_tinker.client.rest import RestClient

README = REPO / "README.md"
CLASSES = ["ServiceClient", "TrainingClient", "SamplingClient", "RestClient"]


def ours(name: str) -> type:
    return RestClient if name == "RestClient" else getattr(queue_tinker, name)


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    found = {}
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or not callable(member):
            continue
        try:
            found[name] = inspect.signature(member)
        except (TypeError, ValueError):
            continue
    return found


def deprecated(cls: type, method: str) -> bool:
    """The SDK marks the async twins it is retiring: their docstring begins "Deprecated"."""
    return (inspect.getdoc(getattr(cls, method)) or "").startswith("Deprecated")


def excused() -> dict[str, str]:
    """`Class.method` -> reason, from README's table (rows `| `Class.method` | reason |`)."""
    section = README.read_text().split("### Not in the Python client", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([A-Za-z]+\.[a-z_]+)` \| (.+?) \|$", section, re.M)
    return dict(rows)


@pytest.mark.parametrize("name", CLASSES)
def test_every_sdk_method_is_ours_or_has_a_written_reason(name: str) -> None:
    """Each public SDK method exists on our class with all the SDK's argument names (in the
    SDK's order for positional ones), or the README gives a reason it is not there."""
    reasons = excused()
    mine = public_methods(ours(name))
    problems = []
    for method, sdk_sig in public_methods(getattr(tinker, name)).items():
        key = f"{name}.{method}"
        if key in reasons:
            assert len(reasons[key]) > 20, f"{key}: the reason is too short to be one"
            continue
        if method not in mine:
            if not deprecated(getattr(tinker, name), method):
                problems.append(f"{key}: missing")
            continue
        sdk_params = [p for p in sdk_sig.parameters.values() if p.name != "self"]
        our_params = {p.name: p for p in mine[method].parameters.values() if p.name != "self"}
        for p in sdk_params:
            if p.name not in our_params:
                problems.append(f"{key}: no argument {p.name!r}")
        positional = [
            p.name for p in sdk_params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        ]
        ours_positional = [p for p in our_params if p in positional]
        if ours_positional != positional[: len(ours_positional)]:
            problems.append(f"{key}: positional order {ours_positional} vs SDK {positional}")
    assert not problems, "\n".join(problems)


def test_every_written_reason_names_a_real_sdk_method() -> None:
    """No stale rows: every excused name is a public method of the SDK class it names."""
    for key in excused():
        cls, method = key.split(".")
        assert method in public_methods(getattr(tinker, cls)), key
