"""The control channel's records (``plan``'s dataclasses and SamplingParams) to and from plain data.

:func:`to_wire` turns a record into dicts, lists and scalars for ``shard_engine.wire``;
:func:`from_wire` builds a record of an expected class back, and only the classes of
:data:`RECORDS`: each from a dict of its fields, checked field by field against the class's own
annotations. A field the class does not declare, a required one missing, or a value of the wrong
type raises :class:`WireError` naming the field; nothing else is ever constructed and nothing runs.
The schema is derived from the annotations, so a field added to a record travels without an edit
here; one of a type this module cannot check fails the first time its record is encoded.
"""

from __future__ import annotations

import dataclasses
import types
import typing

from server.engine.plan import (
    ImageInput,
    PeerShare,
    PromptLogprobs,
    SequenceAdd,
    StepPlan,
    StepResult,
    TokenResult,
    TrainerTransfer,
    UpdateReport,
    WeightUpdate,
    Work,
)
from server.engine.sampling import SamplingParams
from shard_engine.wire import WireError

RECORDS = (SamplingParams, ImageInput, SequenceAdd, Work, PeerShare, TrainerTransfer, WeightUpdate, UpdateReport, StepPlan,
           TokenResult, PromptLogprobs, StepResult)
"""The only classes that cross the control channel."""

_NONE = type(None)
_SCALARS = {int: (int,), float: (float, int), bool: (bool,), str: (str,), bytes: (bytes,), _NONE: (_NONE,),
            dict: (dict,)}
"""Each scalar annotation's types on the wire, exactly (a bool is no int here; an int-valued float
a peer set as an int stays one, as pickle kept it). A bare ``dict`` (a rank's memory report) is
free-form: plain data is all ``shard_engine.wire`` lets through."""


def _fail(where: str, expected: str, value) -> typing.NoReturn:
    raise WireError(f"{where}: expected {expected}, got {type(value).__name__}")


def _names(types_: frozenset) -> str:
    return " or ".join(sorted(t.__name__ for t in types_))


def _checker(tp, where: str):
    """How a decoded value is checked against annotation ``tp``: a frozenset of the types it may
    have (a check, the value kept as it is), or a function that checks it and returns it built."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _SCALARS:
        return frozenset(_SCALARS[tp])
    if tp in RECORDS:
        return lambda v: _schema(tp).build(v)
    if origin in (typing.Union, types.UnionType):
        others = [a for a in args if a is not _NONE]
        if len(others) != 1 or len(args) != 2:
            raise TypeError(f"{where}: only X | None unions cross the wire, not {tp}")
        inner = _checker(others[0], where)
        if isinstance(inner, frozenset):
            return inner | {_NONE}
        return lambda v: None if v is None else inner(v)
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return _sequence_checker(_checker(args[0], where), where, tuple if origin is tuple else None)
    if origin is tuple:
        return _FixedTuple([_checker(a, where) for a in args], where)
    if origin is dict:
        key, value = _checker(args[0], where), _checker(args[1], where)
        if not isinstance(key, frozenset):
            raise TypeError(f"{where}: dict keys must be scalars, not {args[0]}")

        def check_dict(v):
            if type(v) is not dict:
                _fail(where, "a dict", v)
            if not set(map(type, v)) <= key:
                _fail(f"{where} key", _names(key), next(k for k in v if type(k) not in key))
            if isinstance(value, frozenset):
                if not set(map(type, v.values())) <= value:
                    _fail(where, f"values of {_names(value)}", next(x for x in v.values() if type(x) not in value))
                return v
            return {k: value(x) for k, x in v.items()}
        return check_dict
    raise TypeError(f"{where}: a field of type {tp} cannot cross the wire")


class _FixedTuple:
    """A fixed tuple of scalars (a ``(token, logprob)`` pair) travels as a list of its items."""

    def __init__(self, parts: list, where: str):
        if not all(isinstance(part, frozenset) for part in parts):
            raise TypeError(f"{where}: only tuples of scalars cross the wire")
        self.parts, self.where = parts, where
        self.expected = f"a list of {len(parts)} ({', '.join(map(_names, parts))})"

    def __call__(self, v) -> tuple:
        if type(v) is not list or len(v) != len(self.parts) or not all(map(frozenset.__contains__, self.parts,
                                                                           map(type, v))):
            _fail(self.where, self.expected, v)
        return tuple(v)

    def check_all(self, v: list) -> list[tuple]:
        """Every item of ``v`` checked (the common pair unrolled: the top alternatives of each token)."""
        if len(self.parts) != 2:
            return [self(x) for x in v]
        first, second = self.parts
        for x in v:
            if type(x) is not list or len(x) != 2 or type(x[0]) not in first or type(x[1]) not in second:
                _fail(self.where, self.expected, x)
        return [(a, b) for a, b in v]


def _sequence_checker(inner, where: str, build):
    if isinstance(inner, _FixedTuple):
        def check_tuples(v):
            if type(v) is not list:
                _fail(where, "a list", v)
            items = inner.check_all(v)
            return items if build is None else build(items)
        return check_tuples
    if isinstance(inner, frozenset):
        def check_scalars(v):  # token and block ids, the common case: checked at C speed
            if type(v) is not list or not set(map(type, v)) <= inner:
                _fail(where, f"a list of {_names(inner)}", v)
            return v if build is None else build(v)
        return check_scalars

    def check_items(v):
        if type(v) is not list:
            _fail(where, "a list", v)
        items = [inner(x) for x in v]
        return items if build is None else build(items)
    return check_items


def _encoder(tp):
    """None where a value of ``tp`` is plain data already (a tuple goes as a list); else a
    function that turns the records inside it into dicts."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in RECORDS:
        return to_wire
    inners = [_encoder(a) for a in args if a is not _NONE and a is not Ellipsis]
    inner = next((e for e in inners if e is not None), None)
    if inner is None:
        return None
    if origin in (typing.Union, types.UnionType):
        return lambda v: None if v is None else inner(v)
    if origin in (list, tuple):
        return lambda v: [inner(x) for x in v]
    if origin is dict:
        return lambda v: {k: inner(x) for k, x in v.items()}
    raise TypeError(f"records inside {tp} cannot cross the wire")


class _Schema:
    """One record class's fields: how each is checked and encoded, and which are required."""

    def __init__(self, cls):
        hints = typing.get_type_hints(cls)
        fields = [f for f in dataclasses.fields(cls) if f.init]
        self.names = frozenset(f.name for f in fields)
        self.checks = {f.name: _checker(hints[f.name], f"{cls.__name__}.{f.name}") for f in fields}
        self.encoders = [(f.name, e) for f in fields if (e := _encoder(hints[f.name])) is not None]
        self.required = frozenset(f.name for f in fields
                                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        # a field that is its default object (None, False, 0) is left out, and rebuilt as it
        self.defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
        self.cls = cls

    def build(self, data):
        """A record built from ``data``, the decoder's own dict (its values are replaced in place)."""
        cls, names, checks = self.cls, self.names, self.checks
        if type(data) is not dict:
            _fail(cls.__name__, f"a {cls.__name__} (a dict of its fields)", data)
        if not names.issuperset(data):
            raise WireError(f"{cls.__name__} has no field {sorted(map(repr, data.keys() - names))[0]}")
        if not self.required <= data.keys():
            raise WireError(f"{cls.__name__}'s field {sorted(self.required - data.keys())[0]!r} is missing")
        for name, value in data.items():
            check = checks[name]
            if check.__class__ is frozenset:
                if value.__class__ not in check:
                    _fail(f"{cls.__name__}.{name}", _names(check), value)
            else:
                data[name] = check(value)
        return cls(**data)


_SCHEMAS: dict[type, _Schema] = {}


def _schema(cls) -> _Schema:
    schema = _SCHEMAS.get(cls)
    if schema is None:
        schema = _SCHEMAS[cls] = _Schema(cls)
    return schema


def to_wire(record) -> dict:
    """``record`` (an instance of one of :data:`RECORDS`) as plain data: a dict of its fields."""
    cls = type(record)
    if cls not in RECORDS:
        raise WireError(f"{cls.__name__} is not a control-channel record")
    schema = _schema(cls)
    names, defaults = schema.names, schema.defaults
    # (an attribute set on an instance besides its fields stays home)
    out = {k: v for k, v in vars(record).items() if k in names and defaults.get(k, _NO_DEFAULT) is not v}
    for name, encode in schema.encoders:
        if name in out:
            out[name] = encode(out[name])
    return out


_NO_DEFAULT = object()


def from_wire(cls, data):
    """A ``cls`` (one of :data:`RECORDS`) built from ``data`` as :func:`to_wire` made it, and
    ``shard_engine.wire`` decoded it; ``data``'s dicts are consumed (their values replaced)."""
    if cls not in RECORDS:
        raise TypeError(f"{cls.__name__} is not a control-channel record")
    return _schema(cls).build(data)
