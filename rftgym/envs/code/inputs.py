"""Type-driven random and edge-case inputs for function-style tasks.

A :class:`ValueModel` is learned per argument position from the example arguments (their types,
numeric ranges and signs, string alphabets and lengths, list lengths, tuple shapes; strings that are
all operators such as ``'+'`` and ``'//'`` are drawn from those seen), or, when a
task has no examples, from the entry point's annotations. Sampling stays near what was observed
(same sign, ranges widened a little, lengths up to a bit longer) so that inputs stay in the
spec's domain; whatever the reference still rejects is dropped by the TCG.
"""

from __future__ import annotations

import ast
import random
import string
from dataclasses import dataclass, field
from typing import Any

from .tasks import UNPARSABLE, args_source, parse_args_source


MAX_TOKEN_CHARS = 3  # a string of at most this many symbols, and only such strings seen: an operator


@dataclass
class ValueModel:
    kinds: set[str] = field(default_factory=set)
    lo: float | None = None
    hi: float | None = None
    chars: set[str] = field(default_factory=set)
    min_len: int | None = None
    max_len: int | None = None
    items: "ValueModel | None" = None      # list/set elements, dict keys
    values: "ValueModel | None" = None     # dict values
    fields: list["ValueModel"] | None = None  # fixed-shape tuples
    decimals: int = 0
    texts: set[str] = field(default_factory=set)  # the strings seen (while they look like operator tokens)

    def observe(self, value: Any) -> None:
        kind = _kind(value)
        self.kinds.add(kind)
        if kind in ("int", "float"):
            self.lo = value if self.lo is None else min(self.lo, value)
            self.hi = value if self.hi is None else max(self.hi, value)
            if kind == "float":
                text = repr(value)
                self.decimals = max(self.decimals, len(text.split(".")[1]) if "." in text and "e" not in text else 3)
        elif kind in ("str", "list", "set", "dict", "tuple"):
            self.min_len = len(value) if self.min_len is None else min(self.min_len, len(value))
            self.max_len = len(value) if self.max_len is None else max(self.max_len, len(value))
            if kind == "str":
                self.chars.update(value)
                self.texts.add(value)
            elif kind == "tuple":
                if self.fields is None:
                    self.fields = [ValueModel() for _ in value]
                if len(self.fields) == len(value):
                    for model, item in zip(self.fields, value):
                        model.observe(item)
            elif kind == "dict":
                self.items = self.items or ValueModel()
                self.values = self.values or ValueModel()
                for k, v in value.items():
                    self.items.observe(k)
                    self.values.observe(v)
            else:
                self.items = self.items or ValueModel()
                for item in value:
                    self.items.observe(item)

    # ------------------------------------------------------------ sampling

    def sample(self, rng: random.Random, depth: int = 0) -> Any:
        kind = rng.choice(sorted(self.kinds)) if self.kinds else "int"
        if kind == "none":
            return None
        if kind == "bool":
            return rng.random() < 0.5
        if kind == "int":
            lo, hi = _widen(self.lo, self.hi, 0, 10, positive_ints=True)
            return rng.randint(int(lo), int(hi))
        if kind == "float":
            lo, hi = _widen(self.lo, self.hi, 0.0, 10.0)
            return round(rng.uniform(lo, hi), max(1, min(self.decimals, 3)))
        if kind == "str":
            if self.tokens:  # '+', '**', '//': another string of their characters is no operator
                return rng.choice(self.tokens)
            alphabet = "".join(sorted(self.chars)) or string.ascii_lowercase
            return "".join(rng.choice(alphabet) for _ in range(self._length(rng, 8)))
        if kind == "tuple" and self.fields is not None:
            return tuple(f.sample(rng, depth + 1) for f in self.fields)
        if depth > 4:
            return [] if kind == "list" else None
        if kind == "dict":
            keys = self.items or ValueModel({"str"})
            values = self.values or ValueModel({"int"})
            return {_hashable(keys.sample(rng, depth + 1)): values.sample(rng, depth + 1) for _ in range(self._length(rng, 4))}
        items = self.items if self.items is not None and self.items.kinds else ValueModel({"int"})
        made = [items.sample(rng, depth + 1) for _ in range(self._length(rng, 6))]
        if kind == "set":
            return {_hashable(v) for v in made}
        return made

    @property
    def tokens(self) -> list[str]:
        """The strings seen, where every one is a short run of symbols (an operator: ``'+'``,
        ``'**'``, ``'//'``), in order; else none."""
        if not self.texts or not all(0 < len(t) <= MAX_TOKEN_CHARS and not any(c.isalnum() or c.isspace() for c in t)
                                     for t in self.texts):
            return []
        return sorted(self.texts)

    def _length(self, rng: random.Random, default_max: int) -> int:
        lo = self.min_len if self.min_len is not None else 0
        hi = self.max_len if self.max_len is not None else default_max
        return rng.randint(lo, max(lo, hi + max(1, hi // 2)))

    def edges(self) -> list[Any]:
        """Boundary values of this kind inside the domain the examples show (a reference's output
        outside it is arbitrary, and a correct solution may differ there): the observed extremes,
        0 and -1 where the observed range holds them, 1 for positive ints, and the empty value
        (a one-item value) only where an example was empty (had at most one item)."""
        out: list[Any] = []
        may_be_empty = self.min_len is None or self.min_len == 0
        may_be_one = self.min_len is None or self.min_len <= 1
        for kind in sorted(self.kinds):
            if kind == "int":
                lo, hi = (self.lo, self.hi) if self.lo is not None else (0, 10)
                out += [v for v in (0, 1, -1, lo, hi) if lo <= v <= hi or v in (lo, hi) or (v == 1 and lo >= 1)]
            elif kind == "float":
                out += [0.0, 1.0] + ([self.lo, self.hi] if self.lo is not None else [])
            elif kind == "str" and self.tokens:
                out += self.tokens[:1]
            elif kind == "str":
                out += [""] * may_be_empty + [(sorted(self.chars) or ["a"])[0]] * may_be_one
            elif kind == "list":
                first = self.items.sample(random.Random(0)) if self.items and self.items.kinds else 0
                out += [[]] * may_be_empty + [[first]] * may_be_one
            elif kind == "bool":
                out += [True, False]
        return out


def _kind(value: Any) -> str:
    if value is None:
        return "none"
    for kind, types in (("bool", bool), ("int", int), ("float", float), ("str", str), ("list", list),
                        ("tuple", tuple), ("dict", dict), ("set", (set, frozenset))):
        if isinstance(value, types):
            return kind
    return "other"


def _hashable(value: Any) -> Any:
    """A set member or dict key made from ``value`` (lists become tuples; others fall back to repr)."""
    if isinstance(value, list):
        value = tuple(value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _widen(lo, hi, default_lo, default_hi, positive_ints: bool = False):
    """The observed range widened by half its width, never crossing zero the other way (nor, with
    ``positive_ints``, down to 0 from ints that were all positive: "a positive integer n")."""
    if lo is None:
        return default_lo, default_hi
    span = max(hi - lo, (abs(lo) + abs(hi)) / 2, 2)
    new_lo, new_hi = lo - span / 2, hi + span / 2
    if lo >= 0:
        new_lo = max(new_lo, 1 if positive_ints and lo >= 1 else 0)
    if hi <= 0:
        new_hi = min(new_hi, 0)
    return new_lo, new_hi


_ANNOTATION_KINDS = {"int": "int", "float": "float", "str": "str", "bool": "bool", "list": "list", "List": "list",
                     "tuple": "tuple", "Tuple": "tuple", "dict": "dict", "Dict": "dict", "set": "set", "Set": "set"}


def model_from_annotation(node: ast.expr | None) -> ValueModel:
    """A value model from a type annotation (``int``, ``List[int]``, ``list[str]``...)."""
    model = ValueModel()
    if node is None:
        model.kinds.add("int")
        return model
    base = node.value if isinstance(node, ast.Subscript) else node
    name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
    kind = _ANNOTATION_KINDS.get(name or "", "int")
    model.kinds.add(kind)
    if kind in ("int", "float"):
        model.lo, model.hi = 0, 20
    if kind in ("list", "set") and isinstance(node, ast.Subscript):
        model.items = model_from_annotation(node.slice)
    if kind == "dict" and isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and len(node.slice.elts) == 2:
        model.items = model_from_annotation(node.slice.elts[0])
        model.values = model_from_annotation(node.slice.elts[1])
    if kind == "tuple" and isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple):
        model.fields = [model_from_annotation(e) for e in node.slice.elts if not isinstance(e, ast.Constant)]
    return model


def parsed_examples(sources: list[str]) -> list[tuple]:
    """The argument tuples of ``sources`` that parse as literals (the others left out)."""
    examples = []
    for source in sources:
        try:
            examples.append(parse_args_source(source))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return examples


def argument_models(reference: str, entry_point: str, example_inputs: list[str]) -> list[ValueModel] | None:
    """One model per argument: from the examples if any parse, else from the annotations."""
    examples = parsed_examples(example_inputs)
    if examples:
        arity = max(len(e) for e in examples)
        models = [ValueModel() for _ in range(arity)]
        for args in examples:
            if len(args) == arity:
                for model, value in zip(models, args):
                    model.observe(value)
        return models
    try:
        tree = ast.parse(reference)
    except UNPARSABLE:
        return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == entry_point:
            params = node.args.posonlyargs + node.args.args
            if not params or any(a.annotation is None for a in params):
                return None  # guessing types without examples or annotations leaves the spec's domain
            return [model_from_annotation(a.annotation) for a in params]
    return None


def random_args(models: list[ValueModel], rng: random.Random, n: int) -> list[tuple]:
    return [tuple(m.sample(rng) for m in models) for _ in range(n)]


def random_inputs(models: list[ValueModel], rng: random.Random, n: int) -> list[str]:
    return [args_source(args) for args in random_args(models, rng, n)]


def _mutate_value(value: Any, rng: random.Random) -> Any:
    """A small change of one value that keeps its type: a list or string reordered, an element
    repeated or dropped; a number moved a little; anything else as it is."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):  # a positive one stays positive, a zero non-negative ("n >= 1", "n >= 0")
        moved = value + rng.choice((-2, -1, 1, 2))
        return max(moved, 1) if value >= 1 else max(moved, 0) if value == 0 else moved
    if isinstance(value, float):
        return value * rng.choice((0.9, 1.1)) if value else rng.choice((-0.5, 0.5))
    if isinstance(value, (list, str)) and len(value) > 0:
        items = list(value)
        move = rng.randrange(3)
        if move == 0:
            rng.shuffle(items)
        elif move == 1:
            items.insert(rng.randrange(len(items) + 1), rng.choice(items))
        elif len(items) > 1:
            del items[rng.randrange(len(items))]
        return "".join(items) if isinstance(value, str) else items
    return value


def neighbour_inputs(bases: list[tuple], rng: random.Random, n: int) -> list[str]:
    """``n`` inputs near ``bases``: each one base with one argument changed by
    :func:`_mutate_value`, or two changes in a row (deduplicated; may return fewer)."""
    out: list[str] = []
    for _ in range(n * 2):
        if len(out) >= n or not bases:
            break
        args = list(rng.choice(bases))
        if not args:
            break
        for _ in range(rng.choice((1, 1, 2))):
            position = rng.randrange(len(args))
            args[position] = _mutate_value(args[position], rng)
        source = args_source(tuple(args))
        if source not in out:
            out.append(source)
    return out


def edge_args(models: list[ValueModel], base: tuple | None, rng: random.Random) -> list[tuple]:
    """Each argument in turn set to each of its edge values, the others from ``base`` (the first
    example) or sampled; then all arguments at their first edge value."""
    base = base if base is not None and len(base) == len(models) else tuple(m.sample(rng) for m in models)
    out = []
    for i, model in enumerate(models):
        for value in model.edges():
            out.append(base[:i] + (value,) + base[i + 1:])
    firsts = [m.edges()[:1] for m in models]
    if all(firsts):
        out.append(tuple(f[0] for f in firsts))
    return out


def edge_inputs(models: list[ValueModel], base: tuple | None, rng: random.Random) -> list[str]:
    """:func:`edge_args` as argument lists, deduplicated."""
    return list(dict.fromkeys(args_source(args) for args in edge_args(models, base, rng)))
