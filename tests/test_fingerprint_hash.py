"""grpo/provenance/fingerprint.py: the semantic hash of one module. Layout-only edits (comments, docstrings,
formatting, line numbers) keep it; a change of meaning (a constant, its type, an operator, a name, a field)
changes it."""

from __future__ import annotations

import ast

import pytest

from grpo.provenance import fingerprint
from grpo.provenance.fingerprint import FingerprintError, semantic_hash

ORIGINAL = '''
"""Module docstring."""
import math


class Scale:
    """Class docstring."""

    factor = 2

    def apply(self, x):
        """Method docstring."""
        return x * self.factor + math.pi
'''


SAME_MEANING = {
    "comment": ORIGINAL.replace("factor = 2", "factor = 2  # doubled on purpose"),
    "module docstring": ORIGINAL.replace("Module docstring.", "A longer module docstring."),
    "class docstring removed": ORIGINAL.replace('    """Class docstring."""\n', ""),
    "method docstring": ORIGINAL.replace("Method docstring.", "Scales x."),
    "formatting": ORIGINAL.replace(
        "x * self.factor + math.pi", "(x * self.factor\n                + math.pi)"
    ),
    "blank lines (line numbers move)": "\n\n\n" + ORIGINAL.replace("\n\n", "\n\n\n\n"),
}


NEW_MEANING = {
    "constant": ORIGINAL.replace("factor = 2", "factor = 3"),
    "operator": ORIGINAL.replace("x * self.factor", "x / self.factor"),
    "name": ORIGINAL.replace("math.pi", "math.e"),
    "int to float": ORIGINAL.replace("factor = 2", "factor = 2.0"),
}


@pytest.mark.parametrize("edit", sorted(SAME_MEANING))
def test_layout_only_edit_keeps_the_hash(edit):
    assert SAME_MEANING[edit] != ORIGINAL
    assert semantic_hash(SAME_MEANING[edit]) == semantic_hash(ORIGINAL)


@pytest.mark.parametrize("edit", sorted(NEW_MEANING))
def test_semantic_edit_changes_the_hash(edit):
    assert semantic_hash(NEW_MEANING[edit]) != semantic_hash(ORIGINAL)


@pytest.mark.parametrize("falsy", ["0", "0.0", "False", "''", "()"])
def test_a_falsy_constant_is_not_none(falsy):
    """``t[:, 0]`` is not ``t[:, None]``, nor ``beta = 0.0`` ``beta = None``: only None and empty lists are
    left out of the dump (the fields Python versions print differently)."""
    assert semantic_hash(f"x = t[:, {falsy}]\n") != semantic_hash("x = t[:, None]\n")
    assert semantic_hash(f"beta = {falsy}\n") != semantic_hash("beta = None\n")


def test_a_string_that_is_not_a_docstring_counts():
    assert semantic_hash("x = 1\n'a'\n") != semantic_hash("x = 1\n'b'\n")


def test_syntax_error_names_the_file():
    with pytest.raises(FingerprintError, match="broken.py"):
        semantic_hash("def f(:\n", "broken.py")


def test_a_constant_of_another_type_changes_the_hash():
    """``"2"`` is not ``2``: a value's type is part of its meaning, whatever its printed form."""
    assert semantic_hash("factor = '2'\n") != semantic_hash("factor = 2\n")
    assert semantic_hash("name = 'None'\n") != semantic_hash("name = None\n")


def test_which_slice_bound_a_value_fills_changes_the_hash():
    """``t[1:]`` and ``t[:1]`` hold the same one value in different fields: the field names count."""
    assert semantic_hash("y = t[:, 1:]\n") != semantic_hash("y = t[:, :1]\n")
    assert semantic_hash("y = t[::2]\n") != semantic_hash("y = t[:2]\n")


def test_a_string_a_function_returns_is_not_a_docstring():
    """Only an expression statement can be a docstring: ``return 'a'`` as a body's first line is code."""
    assert semantic_hash("def f():\n    return 'a'\n") != semantic_hash("def f():\n    return 'b'\n")
    assert semantic_hash("class C:\n    x = 'a'\n") != semantic_hash("class C:\n    x = 'b'\n")


def test_the_canonical_tree_leaves_out_empty_and_none_fields():
    """What keeps a fingerprint the same across Python versions that add empty fields to the tree."""


    dump = fingerprint._canonical(ast.parse("def f(x):\n    return x\n"))
    assert "=[]" not in dump and "=None" not in dump and "FunctionDef(" in dump
