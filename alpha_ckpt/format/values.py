"""Typed canonical JSON: every non-tensor value of a state, exactly, without pickle.

JSON alone loses types (a tuple comes back a list, an int key a str key,
``1.0`` may come back ``1``, NaN is not JSON at all). Each Python value has
exactly one encoding here, so equal values encode to equal bytes:

================================  =============================================
value                             encoding
================================  =============================================
``None``, ``True``/``False``      ``null``, ``true``/``false``
``str``                           a JSON string
``int`` in [-2**63, 2**63)        a JSON integer
any other ``int``                 ``{"bigint": "-1f..."}`` (hexadecimal)
``float``                         ``{"float": "3ff0000000000000"}``: the
                                  IEEE-754 binary64 bits, so NaN payloads, inf
                                  and -0.0 come back bit for bit
``bytes``                         ``{"bytes": "<base64>"}``
``list``                          a JSON array
``tuple``                         ``{"tuple": [...]}``
``dict`` / ``OrderedDict`` /      ``{"dict": [[key, value], ...]}`` /
``collections.Counter``           ``{"odict": ...}`` / ``{"counter": ...}``, in
                                  insertion order; keys are ``str`` or ``int``
a tensor / NumPy array            ``{"tensor": "dotted.name"}`` /
                                  ``{"ndarray": "dotted.name"}``: a region
a PerRank entry of N ranks        ``{"per_rank": [rank 0's, ..., rank N-1's]}``
================================  =============================================

Every JSON object has exactly one key, the type tag. The decoder takes
hostile bytes: it bounds nesting depth, big-int and bytes lengths, and raises
only :class:`~alpha_ckpt.errors.Refusal` (code ``format``).

Part of the format (docs/FORMAT.md): a root manifest's ``state`` is written in it, so the
format layer decodes it; it imports nothing of the package but the errors.
"""
from __future__ import annotations

import base64
import binascii
import collections
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from alpha_ckpt.errors import Refusal, RefusalCode

MAX_DEPTH = 64            # nesting of containers; real state dicts are a handful deep
MAX_BIGINT_HEX = 1 << 16  # 262,144-bit integers: far past any counter, bounded work to parse
_SMALL_INT = 1 << 63
_DICT_TAGS = {"dict": dict, "odict": collections.OrderedDict, "counter": collections.Counter}
_REF_TAGS = ("tensor", "ndarray")


@dataclass(frozen=True)
class PerRankSaved:
    """A decoded ``{"per_rank": [...]}``: what each rank saved of a PerRank entry (None: not this capture's)."""

    parts: tuple


@dataclass(frozen=True)
class RegionRef:
    """Where a decoded state holds a tensor (``kind`` "tensor") or a NumPy array ("ndarray"): region ``name``."""

    kind: str
    name: str


def encode_value(value: Any, where: str = "value", leaf: Callable[[Any, str], Any] | None = None,
                 _depth: int = 0) -> Any:
    """The typed JSON of ``value``. ``leaf(obj, dotted_name)`` encodes what is not a plain value
    (tensors, Stateful objects) or returns NotImplemented; ``where`` names the entry in errors."""
    if _depth > MAX_DEPTH:
        raise ValueError(f"state entry {where!r} is nested more than {MAX_DEPTH} containers deep")
    if leaf is not None:
        out = leaf(value, where)
        if out is not NotImplemented:
            return out
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value if -_SMALL_INT <= value < _SMALL_INT else {"bigint": format(value, "x")}
    if kind is float:
        return {"float": struct.pack(">d", value).hex()}
    if kind is bytes:
        return {"bytes": base64.b64encode(value).decode("ascii")}
    if kind is list or kind is tuple:
        items = [encode_value(v, f"{where}.{i}", leaf, _depth + 1) for i, v in enumerate(value)]
        return items if kind is list else {"tuple": items}
    for tag, dict_type in _DICT_TAGS.items():
        if kind is dict_type:
            pairs = []
            for key, v in value.items():
                if type(key) not in (str, int):
                    raise ValueError(f"state entry {where!r} has key {key!r} of type {type(key).__name__}; "
                                     "keys are str or int")
                pairs.append([encode_value(key, where), encode_value(v, f"{where}.{key}", leaf, _depth + 1)])
            return {tag: pairs}
    raise ValueError(f"state entry {where!r} is a {kind.__module__}.{kind.__qualname__}; a state holds tensors, "
                     "NumPy arrays, objects with state_dict()/load_state_dict(), None, bool, int, float, str, bytes, "
                     "and lists, tuples and dicts (OrderedDict, Counter) of them")


def decode_value(obj: Any, what: str = "value", _depth: int = 0) -> Any:
    """The Python value of typed JSON ``obj`` (from :func:`parse_canonical_json`); tensors as :class:`RegionRef`."""
    if _depth > MAX_DEPTH:
        raise _bad(what, f"nested more than {MAX_DEPTH} containers deep")
    kind = type(obj)
    if obj is None or kind is bool or kind is str:
        return obj
    if kind is int:
        if not -_SMALL_INT <= obj < _SMALL_INT:
            raise _bad(what, f"integer {_short(obj)} is outside [-2**63, 2**63) (those are tagged bigint)")
        return obj
    if kind is list:
        return [decode_value(v, what, _depth + 1) for v in obj]
    if kind is not dict:
        raise _bad(what, f"a bare JSON {kind.__name__} is not a typed value (floats are tagged)")
    if len(obj) != 1:
        raise _bad(what, f"a typed value is an object with one tag, not keys {sorted(obj)[:4]}")
    (tag, body), = obj.items()
    if tag == "bigint":
        return _bigint(body, what)
    if tag == "float":
        if type(body) is not str or len(body) != 16 or body != body.lower():
            raise _bad(what, "a float is the 16 lowercase hex digits of its binary64 bits")
        try:
            return struct.unpack(">d", bytes.fromhex(body))[0]
        except ValueError:
            raise _bad(what, f"float bits {body!r} are not hexadecimal") from None
    if tag == "bytes":
        if type(body) is not str:
            raise _bad(what, "bytes are a base64 string")
        try:
            data = base64.b64decode(body.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise _bad(what, "bytes are not canonical base64") from None
        if base64.b64encode(data).decode("ascii") != body:
            raise _bad(what, "bytes are not canonical base64")
        return data
    if tag == "tuple":
        if type(body) is not list:
            raise _bad(what, "a tuple holds a list")
        return tuple(decode_value(v, what, _depth + 1) for v in body)
    if tag in _DICT_TAGS:
        if type(body) is not list:
            raise _bad(what, f"a {tag} holds a list of [key, value] pairs")
        out = _DICT_TAGS[tag]()
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise _bad(what, f"a {tag} holds [key, value] pairs")
            key = decode_value(pair[0], what, _depth + 1)
            if type(key) not in (str, int):
                raise _bad(what, f"a {tag} key is a str or int, not {type(key).__name__}")
            if key in out:
                raise _bad(what, f"a {tag} names key {_short(key)} twice")
            out[key] = decode_value(pair[1], what, _depth + 1)
        return out
    if tag == "per_rank":
        if type(body) is not list or not body:
            raise _bad(what, "a per_rank entry holds one value per rank")
        return PerRankSaved(tuple(decode_value(v, what, _depth + 1) for v in body))
    if tag in _REF_TAGS:
        if type(body) is not str or not body:
            raise _bad(what, f"a {tag} reference names its region")
        return RegionRef(tag, body)
    raise _bad(what, f"unknown type tag {_short(tag)}")


def _bigint(body: Any, what: str) -> int:
    if type(body) is not str or not body or len(body) > MAX_BIGINT_HEX + 1:
        raise _bad(what, f"a bigint is at most {MAX_BIGINT_HEX} hex digits")
    digits = body[1:] if body.startswith("-") else body
    if not digits or any(c not in "0123456789abcdef" for c in digits) or (len(digits) > 1 and digits[0] == "0"):
        raise _bad(what, f"bigint {_short(body)} is not canonical lowercase hexadecimal")
    value = int(body, 16)
    if -_SMALL_INT <= value < _SMALL_INT:
        raise _bad(what, "a bigint inside [-2**63, 2**63) is written as a plain integer")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bad(what: str, message: str) -> Refusal:
    return Refusal(RefusalCode.FORMAT, f"{what}: {message}")


def dotted_leaves(node: Any, prefix: str = "") -> Iterable[tuple[str, RegionRef]]:
    """The (dotted name, reference) of every region a decoded skeleton names, in order."""
    if isinstance(node, RegionRef):
        yield prefix, node
    elif isinstance(node, PerRankSaved):
        for i, value in enumerate(node.parts):
            if value is not None:
                yield from dotted_leaves(value, f"{prefix}.{i}" if prefix else str(i))
    elif isinstance(node, Mapping):
        for key, value in node.items():
            yield from dotted_leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from dotted_leaves(value, f"{prefix}.{i}" if prefix else str(i))
