"""Just enough of CEL to evaluate the ValidatingAdmissionPolicy rules this repository writes (infra/k8s): literals,
lists, field selection and indexing, `has()`, `size()`, `in`, `==`/`!=`, `!`, `&&`, `||`, `?:`, `.all(x, …)`,
`.startsWith()`/`.endsWith()`. A selection of a field that is not there is an error, as in CEL (the API server's
`failurePolicy: Fail` then denies). Anything outside that subset raises `CelUnsupported`, so a rule written with
more of CEL fails its test loudly instead of being skipped."""

from __future__ import annotations

import re

_TOKEN = re.compile(r"\s*(?:(?P<string>'[^']*')|(?P<number>\d+)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
                    r"|(?P<op>&&|\|\||==|!=|[!?:.\[\](),]))")


class CelUnsupported(Exception):
    pass


class CelError(Exception):
    """An evaluation error (no such key): the API server denies the request."""


def _tokens(text: str) -> list[tuple[str, str]]:
    position, found = 0, []
    text = text.strip()
    while position < len(text):
        match = _TOKEN.match(text, position)
        if not match:
            raise CelUnsupported(f"cannot read {text[position:position + 20]!r}")
        kind = match.lastgroup
        found.append((kind, match.group(kind)))
        position = match.end()
    return found + [("end", "")]


class _Parser:
    def __init__(self, text: str):
        self.tokens, self.at = _tokens(text), 0

    def peek(self) -> str:
        return self.tokens[self.at][1]

    def take(self, expected: str | None = None) -> tuple[str, str]:
        token = self.tokens[self.at]
        if expected is not None and token[1] != expected:
            raise CelUnsupported(f"expected {expected!r}, found {token[1]!r}")
        self.at += 1
        return token

    def parse(self):
        node = self.ternary()
        self.take("")
        return node

    def ternary(self):
        node = self.binary("||")
        if self.peek() == "?":
            self.take("?")
            yes = self.ternary()
            self.take(":")
            return ("?", node, yes, self.ternary())
        return node

    def binary(self, op: str):
        lower = {"||": lambda: self.binary("&&"), "&&": self.relation}[op]
        node = lower()
        while self.peek() == op:
            self.take(op)
            node = (op, node, lower())
        return node

    def relation(self):
        node = self.unary()
        if self.peek() in ("==", "!=", "in"):
            op = self.take()[1]
            return (op, node, self.unary())
        return node

    def unary(self):
        if self.peek() == "!":
            self.take("!")
            return ("!", self.unary())
        return self.postfix(self.primary())

    def postfix(self, node):
        while self.peek() in (".", "["):
            if self.take()[1] == ".":
                name = self.take()[1]
                if self.peek() == "(":
                    node = ("call", name, node, self.arguments())
                else:
                    node = ("field", node, name)
            else:
                node = ("index", node, self.ternary())
                self.take("]")
        return node

    def arguments(self) -> list:
        self.take("(")
        found = []
        while self.peek() != ")":
            found.append(self.ternary())
            if self.peek() == ",":
                self.take(",")
        self.take(")")
        return found

    def primary(self):
        kind, value = self.take()
        if kind == "string":
            return ("literal", value[1:-1])
        if kind == "number":
            return ("literal", int(value))
        if value in ("true", "false"):
            return ("literal", value == "true")
        if value == "(":
            node = self.ternary()
            self.take(")")
            return node
        if value == "[":
            items = []
            while self.peek() != "]":
                items.append(self.ternary())
                if self.peek() == ",":
                    self.take(",")
            self.take("]")
            return ("list", items)
        if kind == "name" and self.peek() == "(":
            return ("call", value, None, self.arguments())
        if kind == "name":
            return ("name", value)
        raise CelUnsupported(f"unexpected {value!r}")


def _evaluate(node, env: dict):
    kind = node[0]
    if kind == "literal":
        return node[1]
    if kind == "name":
        if node[1] not in env:
            raise CelError(f"undeclared reference to {node[1]!r}")
        return env[node[1]]
    if kind == "list":
        return [_evaluate(item, env) for item in node[1]]
    if kind == "field":
        base = _evaluate(node[1], env)
        if not isinstance(base, dict) or node[2] not in base:
            raise CelError(f"no such key: {node[2]}")
        return base[node[2]]
    if kind == "index":
        base, key = _evaluate(node[1], env), _evaluate(node[2], env)
        try:
            return base[key]
        except (KeyError, IndexError, TypeError):
            raise CelError(f"no such key: {key}") from None
    if kind == "!":
        return not _boolean(_evaluate(node[1], env))
    if kind == "&&":
        return _boolean(_evaluate(node[1], env)) and _boolean(_evaluate(node[2], env))
    if kind == "||":
        return _boolean(_evaluate(node[1], env)) or _boolean(_evaluate(node[2], env))
    if kind == "?":
        return _evaluate(node[2] if _boolean(_evaluate(node[1], env)) else node[3], env)
    if kind in ("==", "!="):
        left, right = _evaluate(node[1], env), _evaluate(node[2], env)
        if type(left) is not type(right) and not (left is None or right is None):
            raise CelError(f"no such overload: {type(left).__name__} {kind} {type(right).__name__}")
        return (left == right) == (kind == "==")
    if kind == "in":
        return _evaluate(node[1], env) in _evaluate(node[2], env)
    if kind == "call":
        return _call(node[1], node[2], node[3], env)
    raise CelUnsupported(kind)


def _boolean(value) -> bool:
    if not isinstance(value, bool):
        raise CelError(f"not a bool: {value!r}")
    return value


def _call(name: str, target, arguments: list, env: dict):
    if name == "has" and target is None:
        [selection] = arguments
        if selection[0] != "field":
            raise CelUnsupported("has() of anything but a field selection")
        base = _evaluate(selection[1], env)
        return isinstance(base, dict) and selection[2] in base
    if name == "size" and target is None:
        [argument] = arguments
        return len(_evaluate(argument, env))
    if name == "all" and target is not None:
        variable, body = arguments
        if variable[0] != "name":
            raise CelUnsupported("all() needs a variable")
        return all(_boolean(_evaluate(body, env | {variable[1]: item})) for item in _evaluate(target, env))
    if name in ("startsWith", "endsWith") and target is not None:
        [argument] = arguments
        text, affix = _evaluate(target, env), _evaluate(argument, env)
        return text.startswith(affix) if name == "startsWith" else text.endswith(affix)
    raise CelUnsupported(f"function {name}")


def evaluate(expression: str, env: dict):
    """The value of `expression` with the variables `env`; `CelError` where CEL's evaluation errs."""
    return _evaluate(_Parser(expression).parse(), env)
