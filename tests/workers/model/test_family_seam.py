"""The model families' seam (workers/model/families/): each family's declaration fits the tiny
built-in it names, the registry finds each by its model types, and no family's name is used
anywhere else in workers/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from procs import REPO

from queue_tinker.builtin_models import BUILTIN_MODELS
from queue_tinker.workers.model.adapters import expert_parameters, linear_names
from queue_tinker.workers.model.base_model import _model_of, builtin_config
from queue_tinker.workers.model.families import FAMILIES, GENERIC, Family, family_of

# What a family's name looks like in code: transformers' model_type values and class names.
FAMILY_NAME = re.compile(
    r"llama|qwen|mistral|mixtral|gemma|gpt_?oss|deepseek|kimi|phi3|gpt2|neox|glm", re.IGNORECASE
)
SEAM = REPO / "workers" / "model" / "families"


def named_in_code(path: Path, root: Path = REPO) -> list[str]:
    """Family names in a module's code: identifiers, attributes, imports and string
    constants, its docstrings and comments left out (they may say which models a rule is
    for)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = None if id(node) in docstrings else node.value
        elif isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.alias | ast.FunctionDef | ast.ClassDef):
            text = node.name
        else:
            continue
        if text and FAMILY_NAME.search(text):
            found.append(f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}: {text!r}")
    return found


def test_no_family_is_named_outside_the_seam() -> None:
    """The rest of the worker asks the registry: a model_type, a family's class or module
    named anywhere in workers/ but families/ is a rule that belongs to a family."""
    outside = [
        hit
        for path in sorted((REPO / "workers").rglob("*.py"))
        if SEAM not in path.parents
        for hit in named_in_code(path)
    ]
    assert not outside, "\n".join(outside)


def test_the_check_finds_a_family_name_in_code_but_not_in_prose(tmp_path: Path) -> None:
    module = tmp_path / "rule.py"
    module.write_text(
        '"""Llama-style layers."""\n# Qwen3 too\n'
        'SHARDABLE = {"qwen3"}\nfrom x import GptOssConfig\n'
    )
    hits = {hit.split(": ", 1)[1] for hit in named_in_code(module, tmp_path)}
    assert hits == {"'qwen3'", "'GptOssConfig'"}


def test_every_model_type_has_one_family_and_others_are_generic() -> None:
    types = [t for family in FAMILIES for t in family.model_types]
    assert len(types) == len(set(types))
    for family in FAMILIES:
        for model_type in family.model_types:
            assert family_of(model_type) is family
    assert family_of("some_new_architecture") is GENERIC


@pytest.mark.parametrize(
    "family", FAMILIES, ids=lambda family: family.name.lower().replace(" ", "-")
)
def test_a_family_s_declaration_fits_its_tiny_built_ins(family: Family) -> None:
    """Each built-in a family names is of its model types; what it declares LoRA adapts
    exists in the model (every attention name of its layers is declared, the MLP's too),
    experts are declared where the model stacks them, a vision tower where it has one."""
    assert family.builtins
    for name in family.builtins:
        spec = BUILTIN_MODELS[name]
        assert family_of(spec.model_type) is family, name
        with torch.device("meta"):
            model = _model_of(builtin_config(name))
        present = linear_names(model)
        declared = {*family.attention, *family.mlp, *family.unembed}
        assert present <= declared, (name, present - declared)
        assert bool(expert_parameters(model)) is family.experts, name
        assert (family.vision is not None) is (spec.vision is not None), name
        parts = {part for module, _ in model.named_modules() for part in module.split(".")}
        assert set(family.frozen) <= parts, name
