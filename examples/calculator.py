"""The `calculator` tool of examples/tool-calculator.yaml: a plain function with type hints and
a docstring, as any tool is written. Evaluates + - * / on integers and decimals without
`eval` (the model's text never reaches Python's evaluator)."""

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers with + - * and parentheses.

    Args:
        expression: the expression, e.g. "123*456"
    """
    return str(_evaluate(ast.parse(expression.strip(), mode="eval").body))


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise ValueError(f"not an arithmetic expression: {ast.unparse(node)!r}")
