"""tools/mutation_sites.py and tools/mutation_sweep.py: the mechanical mutants of a module, one operator
change each, and the sweep's verdict on them."""

from __future__ import annotations

import ast

import pytest

from tools.mutation_sites import mutant_source, sites
from tools.mutation_sweep import _ServeSource, main

SOURCE = '''
"""A docstring is never mutated."""


def clip(x, low=0, high=1.5):
    if x < low or x >= high:
        raise ValueError(f"{x} is out of [{low}, {high})")
    total = min(x, high) - -low
    values.append(total)
    for item in range(3):
        if not item:
            continue
    return total / 2
'''


def test_each_site_is_one_operator_changed_and_the_rest_left_alone():
    found = sites(SOURCE)
    kinds = {(s.kind, s.text) for s in found}
    assert {("compare", "Lt -> LtE"), ("compare", "GtE -> Gt"), ("boolop", "Or -> And"), ("name", "min -> max"),
            ("binop", "Sub -> Add"), ("unary", "drop USub"), ("binop", "Div -> Mult"), ("number", "0 -> 1"),
            ("number", "1.5 -> 3.0"), ("number", "2 -> 3"), ("statement", "drop call append()"),
            ("flow", "Continue -> Break"), ("unary", "drop Not")} <= kinds
    original = ast.dump(ast.parse(SOURCE))
    for site in found:
        mutated = mutant_source(SOURCE, site.index)
        assert ast.dump(ast.parse(mutated)) != original, site
        assert "A docstring is never mutated." in mutated and "is out of" in mutated, site
    lines = {s.text: s.statement for s in found}
    assert lines["Lt -> LtE"] == 6 and lines["Div -> Mult"] == 13 and lines["drop Not"] == 11


def test_error_messages_and_raises_are_not_sites():
    raising = 'def f(x):\n    raise ValueError(f"{x + 1} < 2")\n'
    assert sites(raising) == []


def test_a_number_past_the_last_site_is_refused():
    with pytest.raises(IndexError):
        mutant_source(SOURCE, len(sites(SOURCE)))


def test_the_finder_serves_the_mutant_for_its_module_only(tmp_path):
    import importlib
    import sys

    path = tmp_path / "sweep_probe.py"
    path.write_text("VALUE = 1 + 1\n")
    finder = _ServeSource("sweep_probe", path, mutant_source(path.read_text(), 0))
    sys.meta_path.insert(0, finder)
    try:
        module = importlib.import_module("sweep_probe")
        assert module.VALUE == 0 and module.__file__ == str(path)
        assert finder.find_spec("json", None) is None
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop("sweep_probe", None)


def test_what_reads_the_source_by_line_reads_the_mutant(tmp_path):
    """The mutant is ``ast.unparse``'s text, whose lines are not the file's (comments and blank lines
    gone): pydantic's field docstrings and ``inspect`` must read the mutant, or every served config module
    loses its field docs and each of its mutants fails the docs test (a kill that is none)."""
    import importlib
    import inspect
    import linecache
    import sys

    path = tmp_path / "sweep_fields.py"
    path.write_text(
        "# a comment the unparsed mutant drops\n\n"
        "from pydantic import BaseModel, ConfigDict\n\n\n"
        "class Section(BaseModel):\n"
        "    model_config = ConfigDict(use_attribute_docstrings=True)\n\n"
        "    size: int = 8  # a trailing comment\n"
        '    """How many."""\n\n\n'
        "def double(x):\n"
        "    return x * 2\n"
    )
    number = next(s.index for s in sites(path.read_text()) if s.text == "8 -> 9")
    finder = _ServeSource("sweep_fields", path, mutant_source(path.read_text(), number))
    sys.meta_path.insert(0, finder)
    try:
        module = importlib.import_module("sweep_fields")
        field = module.Section.model_fields["size"]
        assert field.default == 9 and field.description == "How many."
        assert inspect.getsource(module.double).strip() == "def double(x):\n    return x * 2"
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop("sweep_fields", None)
        linecache.cache.pop(str(path), None)


def test_a_module_that_is_not_there_is_named_with_the_fix(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["grpo/core/no_such_module.py", "tests/test_losses.py", "--list"])
    assert exit_.value.code == 2
    assert "no module grpo/core/no_such_module.py: name a .py file" in capsys.readouterr().err


def test_a_scripts_entry_point_is_never_mutated():
    """A mutant of ``if __name__ == "__main__": run()`` would run the script (a real flow, in the checkout)
    when the child imports its module: neither the guard nor its body is a site."""
    source = 'def run():\n    return 1 + 2\n\n\nif __name__ == "__main__":\n    run()\n'
    assert {s.line for s in sites(source)} == {2}
    assert {s.line for s in sites(source.replace("__main__", "other"))} == {2, 5, 6}
