"""The mutants of one module for ``tools/mutation_sweep.py``: every comparison, arithmetic operator, boolean
connective, number, ``min``/``max``, ``sum``/``mean``, negation and side-effect call changed one at a time
(mutmut's and cosmic-ray's operators, over Python's own AST). ``sites`` lists them; ``mutant_source`` writes
one."""

from __future__ import annotations

import ast
from typing import NamedTuple

_BINOPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
           ast.FloorDiv: ast.Div, ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult}
_CMPOPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
           ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_NAME_SWAPS = {"min": "max", "max": "min", "any": "all", "all": "any", "amin": "amax", "amax": "amin",
               "sum": "mean", "mean": "sum", "minimum": "maximum", "maximum": "minimum",
               "clamp_min": "clamp_max", "clamp_max": "clamp_min", "argmax": "argmin", "argmin": "argmax",
               "cumsum": "cumprod", "float": "int", "ge": "gt", "gt": "ge", "le": "lt", "lt": "le",
               "logical_and": "logical_or", "logical_or": "logical_and", "exp": "log", "log": "exp"}
_SKIP_CALLS = {"print", "warn", "warning", "info", "debug", "error", "exception", "echo", "log_line"}


class Site(NamedTuple):
    index: int
    line: int
    col: int
    kind: str
    text: str  # what changes, e.g. "< -> <="
    statement: int  # the line of the statement holding it (what coverage records)


def _is_docstring(node: ast.AST, parent: ast.AST | None) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


def _is_main_guard(node: ast.AST) -> bool:
    """``if __name__ == "__main__":``, a script's entry point."""
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and len(test.comparators) == 1
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == "__main__")


def _options(node: ast.AST) -> list[tuple[str, str, callable]]:
    """The mutations of ``node`` itself: (kind, description, apply(node))."""
    out = []
    if isinstance(node, ast.BinOp | ast.AugAssign) and type(node.op) in _BINOPS:
        new = _BINOPS[type(node.op)]
        out.append(("binop", f"{type(node.op).__name__} -> {new.__name__}",
                    lambda n, new=new: setattr(n, "op", new())))
    elif isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _CMPOPS:
                new = _CMPOPS[type(op)]
                out.append(("compare", f"{type(op).__name__} -> {new.__name__}",
                            lambda n, i=i, new=new: n.ops.__setitem__(i, new())))
    elif isinstance(node, ast.BoolOp):
        new = ast.Or if isinstance(node.op, ast.And) else ast.And
        out.append(("boolop", f"{type(node.op).__name__} -> {new.__name__}",
                    lambda n, new=new: setattr(n, "op", new())))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.Not):
        out.append(("unary", f"drop {type(node.op).__name__}", "replace_with_operand"))
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float, bool):
        value = node.value
        if isinstance(value, bool):
            new = not value
        elif value == 0:
            new = type(value)(1)
        elif value == 1:
            new = type(value)(0)
        elif isinstance(value, int):
            new = value + 1
        else:
            new = value * 2
        out.append(("number", f"{value!r} -> {new!r}", lambda n, new=new: setattr(n, "value", new)))
    elif isinstance(node, ast.Name) and node.id in _NAME_SWAPS and isinstance(node.ctx, ast.Load):
        new = _NAME_SWAPS[node.id]
        if node.id not in ("float", "sum", "exp", "log"):  # builtins: only the pairs that exist as builtins
            out.append(("name", f"{node.id} -> {new}", lambda n, new=new: setattr(n, "id", new)))
    elif isinstance(node, ast.Attribute) and node.attr in _NAME_SWAPS and isinstance(node.ctx, ast.Load):
        new = _NAME_SWAPS[node.attr]
        out.append(("attr", f".{node.attr} -> .{new}", lambda n, new=new: setattr(n, "attr", new)))
    elif isinstance(node, ast.Break | ast.Continue):
        new = ast.Continue if isinstance(node, ast.Break) else ast.Break
        out.append(("flow", f"{type(node).__name__} -> {new.__name__}", "swap_flow"))
    return out


def _statement_options(stmt: ast.stmt) -> list[tuple[str, str, str]]:
    """Whole-statement mutations: a call made for its effect removed; an ``if``'s test negated."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        func = stmt.value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name not in _SKIP_CALLS:
            return [("statement", f"drop call {name}()", "drop_statement")]
    if isinstance(stmt, ast.If | ast.While) and not isinstance(stmt.test, ast.Compare | ast.BoolOp | ast.UnaryOp):
        return [("condition", "negate condition", "negate_test")]
    return []


class _Walker:
    """Visits the mutable nodes in a fixed order; applies mutation number ``target`` when given."""

    def __init__(self, target: int | None = None):
        self.target = target
        self.sites: list[Site] = []
        self.applied = False
        self.statement = 0

    def _offer(self, node, parent, field, index, options):
        for kind, text, action in options:
            number = len(self.sites)
            line = getattr(node, "lineno", 0)
            self.sites.append(Site(number, line, getattr(node, "col_offset", 0), kind, text, self.statement or line))
            if number == self.target:
                self._apply(node, parent, field, index, action)
                self.applied = True

    @staticmethod
    def _apply(node, parent, field, index, action):
        def put(new):
            if index is None:
                setattr(parent, field, new)
            else:
                getattr(parent, field)[index] = new
        if action == "replace_with_operand":
            put(node.operand)
        elif action == "swap_flow":
            put(ast.Continue() if isinstance(node, ast.Break) else ast.Break())
        elif action == "drop_statement":
            put(ast.Pass())
        elif action == "negate_test":
            node.test = ast.UnaryOp(op=ast.Not(), operand=node.test)
        else:
            action(node)

    def visit(self, node: ast.AST, parent=None, field=None, index=None):
        if isinstance(node, ast.Raise | ast.JoinedStr | ast.Assert | ast.Import | ast.ImportFrom):
            return  # error messages, asserts and imports: not the computation
        if isinstance(node, ast.Expr) and _is_docstring(node, parent):
            return
        if _is_main_guard(node):  # a mutant of it runs the script when its module is imported (a flow, for real)
            return
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in _SKIP_CALLS:
                return
        if isinstance(node, ast.stmt):
            self.statement = node.lineno
            self._offer(node, parent, field, index, _statement_options(node))
        self._offer(node, parent, field, index, _options(node))
        statement = self.statement
        for name, value in ast.iter_fields(node):
            if name in ("annotation", "returns", "decorator_list", "type_comment"):
                continue
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if isinstance(item, ast.AST):
                        self.visit(item, node, name, i)
            elif isinstance(value, ast.AST):
                self.visit(value, node, name, None)
            self.statement = statement


def sites(source: str) -> list[Site]:
    walker = _Walker()
    walker.visit(ast.parse(source))
    return walker.sites


def mutant_source(source: str, number: int) -> str:
    tree = ast.parse(source)
    walker = _Walker(number)
    walker.visit(tree)
    if not walker.applied:
        raise IndexError(f"no mutation number {number}")
    return ast.unparse(ast.fix_missing_locations(tree))
