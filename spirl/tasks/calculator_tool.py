"""The calculator tool: parse a Qwen3-style tool call, evaluate arithmetic safely.

A tool call is the text between `<tool_call>` and `</tool_call>`: a JSON object
`{"name": "calculator", "arguments": {"expression": "347*29+18"}}` (Qwen3's tool-call format).
Expressions are parsed with `ast` and only numbers, + - * / // % ** and parentheses are
evaluated (no names, calls or attributes), with bounds on size so that a policy cannot hang the
trainer with `9**9**9`. Every problem raises ToolError with a one-line message that is sent back
to the model as the tool's answer.
"""

from __future__ import annotations

import ast
import json
import operator
import re

TOOL_SPEC = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string",
                                                                   "description": "e.g. 347*29+18"}},
                   "required": ["expression"]}}}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**18

_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class ToolError(ValueError):
    """A malformed tool call or an expression the calculator refuses; one line for the model."""


def find_tool_call(text: str) -> dict | None:
    """The first tool call in `text` as {"name", "arguments"}; None if there is none.
    Raises ToolError if a call is present but malformed."""
    m = _CALL.search(text)
    if m is None:
        return None
    if not m.group(2):
        raise ToolError("<tool_call> is never closed: end the call with </tool_call>")
    body = m.group(1).strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolError(f"the tool call is not valid JSON ({e.msg} at char {e.pos}): "
                        'write {"name": "calculator", "arguments": {"expression": "..."}}') from None
    if not isinstance(call, dict) or not isinstance(call.get("arguments"), dict) or "name" not in call:
        raise ToolError('the tool call needs "name" and an "arguments" object')
    return call


def run_tool_call(call: dict) -> str:
    """Run a parsed call; the result text (a JSON object) or ToolError."""
    if call["name"] != "calculator":
        raise ToolError(f"unknown tool {str(call['name'])[:40]!r}: the only tool is 'calculator'")
    expr = call["arguments"].get("expression")
    if not isinstance(expr, str):
        raise ToolError('calculator needs a string argument "expression"')
    return json.dumps({"result": format_number(evaluate(expr))})


def evaluate(expression: str) -> int | float:
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse expression {expression[:40]!r}: use numbers, + - * / // % ** and ( )") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except (OverflowError, ValueError) as e:
            raise ToolError(f"arithmetic error: {e}") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ToolError("result out of range")
        return value
    raise ToolError(f"unsupported syntax ({type(node).__name__}): use numbers, + - * / // % ** and ( )")


def format_number(x: int | float) -> int | float:
    """Integers stay integers; a float that is a whole number becomes one; others keep 10 digits."""
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return x if isinstance(x, int) else float(f"{x:.10g}")
