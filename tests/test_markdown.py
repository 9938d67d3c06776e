"""tasks/markdown.py at its bounds: a line, a code line, a table row and a cell exactly as wide as allowed
fit and stay as written, one character more does not; a table fits only when every row and cell does; a
wrapped line keeps a hyphenated word whole; a row short of the header's cells still becomes an item."""

from __future__ import annotations

from tasks.artifacts import cell
from tasks.markdown import CELL, CODE, LINE, ROW, fit, width_problems


def _words(width: int) -> str:
    """Prose of exactly ``width`` characters."""
    text = ("word " * (width // 5 + 1))[:width]
    return text[:-1] + "x" if text.endswith(" ") else text


def test_a_line_as_wide_as_allowed_fits_and_one_more_character_does_not():
    for width, limit in ((LINE, LINE), (LINE + 1, LINE)):
        line = _words(width)
        assert len(line) == width
        assert bool(width_problems(line + "\n")) is (width > limit)
        assert (fit(line + "\n") == line + "\n") is (width <= limit)
    for width in (CODE, CODE + 1):
        block = "```\n" + "x " * (width // 2) + "x" * (width % 2) + "\n```\n"
        assert len(block.splitlines()[1]) == width
        assert bool(width_problems(block)) is (width > CODE)
        assert (fit(block) == block) is (width <= CODE)


def _table(first: int, second: int) -> str:
    row = f"| {'x' * first} | {'y' * second} |"
    return f"| name | value |\n| --- | --- |\n{row}\n"


def test_a_table_row_and_cell_as_wide_as_allowed_fit_and_one_more_character_does_not():
    exact = _table(CELL, ROW - CELL - 7)  # the cell at CELL, the row at ROW
    assert len(exact.splitlines()[2]) == ROW
    assert width_problems(exact) == [] and fit(exact) == exact
    for wider in (_table(CELL, ROW - CELL - 6), _table(CELL + 1, 1)):  # the row at ROW + 1; a cell at CELL + 1
        assert width_problems(wider), wider
        assert "| x" not in fit(wider) and width_problems(fit(wider)) == []


def test_one_wide_cell_in_a_short_row_makes_the_table_a_list():
    table = _table(CELL + 1, 1)
    assert len(table.splitlines()[2]) < ROW
    assert fit(table).splitlines()[0].startswith(f"- **{'x' * (CELL + 1)}** · value: y")


def test_a_wrapped_line_keeps_hyphenated_words_whole():
    term = "--max-steps-and-checkpoint-every"
    line = "word " * 16 + term + " and more words after it"
    assert len(line) > LINE
    out = fit(line + "\n").splitlines()
    assert len(out) == 2 and any(term in part for part in out), out
    code = "```\n" + "x " * 35 + term + "\n```\n"
    assert any(term in part for part in fit(code).splitlines())


def test_a_row_short_of_the_headers_cells_still_becomes_an_item():
    table = "| rule | column | detail |\n| --- | --- | --- |\n| " + "r" * (CELL + 2) + " | c |\n"
    assert fit(table).splitlines() == [f"- **{'r' * (CELL + 2)}** · column: c"]


def test_a_table_cell_as_wide_as_allowed_is_kept_whole():
    assert cell("h" * CELL) == "h" * CELL
    assert cell("h" * (CELL + 1)) == "h" * (CELL - 1) + "…"


def test_a_code_block_never_closed_runs_to_the_end():
    block = "```\n" + "x " * 50 + "\n"
    assert width_problems(block) and width_problems(fit(block)) == []
