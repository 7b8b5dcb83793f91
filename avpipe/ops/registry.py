"""The operator registry: one table of named operators that augmentation chains
(:meth:`avpipe.ops.audio_augment.Chain.from_config`), extraction presets (their ``ops`` lists,
from Python or TOML) and ``avpipe extract --help`` all read.

An operator is one function (or one :class:`~avpipe.ops._augment_base.Augment` class) plus one
registration::

    from avpipe.ops import registry

    @registry.register("clip", kind="audio", stage="features")
    def clip(data, *, low: float = -10.0, high: float = 10.0):
        feats, frame_lengths = data
        return feats.clip(low, high), frame_lengths

Each entry (:class:`Op`) knows:

* ``kind``: what it applies to — ``"audio"`` or ``"image"`` (images, video frames and clips);
* ``stage``: the data it takes, ``gives``: the data it returns (see :data:`STAGES`): audio ops
  take and give ``(signals [B, n], lengths)`` (``"signal"``) or ``(features [B, C, T],
  frame_lengths)`` (``"features"``); image ops take uint8 or float ``[..., H, W, C]`` arrays
  (``"pixels"``);
* its parameters (:class:`Param`: name, default, accepted types), read from the function's
  keyword arguments (or the class's ``__init__``); :meth:`Op.check` refuses an unknown or
  missing argument, or a value of the wrong type, naming the parameter and the value;
* ``random``: whether it draws parameters per item (an augmentation class with its own
  ``sample``: its ``random`` attribute); a preset, which must give the same bytes on every run, takes only the others;
* ``context``: parameters a preset fills from its own settings (``sample_rate``).

A function ``fn(data, **args) -> data`` is deterministic; in a chain it runs as an
:class:`~avpipe.ops._augment_base.Augment` with no parameters to draw. An ``Augment`` class is
built with its arguments; in a preset a deterministic one is applied with empty params.

Each entry records the module that registered it (``module``): a process that needs the
operators registered outside avpipe (extraction's workers) imports :func:`modules` first. An
operator registered in a script's ``__main__`` is not importable by another interpreter.

Names are unique within a kind; one name may be registered for two kinds (``normalize``: the
features' per-channel normalization, and the images' mean/std normalization), and then
:func:`get` needs ``kind``.
"""

from __future__ import annotations

import inspect
import numbers
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Op", "Param", "REQUIRED", "INHERITED", "STAGES", "register", "unregister", "get", "names", "entries",
           "kinds_of", "modules", "OperatorNotImportableError"]

#: what each stage's data is (for messages and docs)
STAGES = {
    "signal": "a signal (signals [B, n] with lengths)",
    "features": "features ([B, C, T] with frame lengths)",
    "pixels": "pixels (uint8 or float [..., H, W, C])",
    "tensor": "a normalized tensor (float [..., C, H, W])",
}
KINDS = ("audio", "image")


class _Required:
    def __repr__(self):
        return "REQUIRED"


#: the default of a parameter that must be given
REQUIRED = _Required()


class _Inherited:
    def __repr__(self):
        return "..."


#: the default of a parameter whose value otherwise comes from elsewhere (log_mel's
#: overrides of its preset's fields)
INHERITED = _Inherited()


@dataclass(frozen=True)
class Param:
    """One parameter of an operator: ``types`` the accepted Python types (None: any; an int is
    accepted for a float, a bool never for a number)."""

    name: str
    default: Any = REQUIRED
    types: tuple | None = None

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def describe(self) -> str:
        return self.name if self.required else f"{self.name}={self.default!r}"

    def check(self, value) -> None:
        if self.types is None:
            return
        ok = False
        for t in self.types:
            if t is type(None):
                ok = value is None
            elif t is float:  # numpy scalars too
                ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
            elif t is int:
                ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            else:
                ok = isinstance(value, t)
            if ok:
                return
        words = {type(None): "None", int: "an int", float: "a number", bool: "true or false",
                 str: "a string"}
        want = " or ".join(words.get(t, t.__name__) for t in self.types)
        raise ValueError(f"{self.name} must be {want}, got {value!r}")


@dataclass
class Op:
    """A registered operator (see the module docstring)."""

    name: str
    kind: str
    stage: str
    gives: str
    target: Callable  # the function, or the Augment class
    params: dict[str, Param]
    random: bool = False
    context: tuple = ()
    validate: Callable | None = None  # validate(args): raises ValueError naming the value
    doc: str = ""
    is_class: bool = field(default=False)
    module: str = ""  # the module that registered it (its target's __module__)

    def check(self, args: dict, *, allow_context: bool = True) -> None:
        """Refuse unknown or missing arguments and values of the wrong type (ValueError naming
        the parameter and the value), then run the operator's own value checks."""
        allowed = {n for n in self.params if allow_context or n not in self.context}
        extra = set(args) - allowed
        if extra:
            if not allow_context and extra & set(self.context):
                given = sorted(extra & set(self.context))
                raise ValueError(f"{', '.join(given)}: set by the caller, not an argument here")
            raise ValueError(f"unknown argument(s) {sorted(extra)}; it takes {sorted(allowed)}")
        missing = [n for n, p in self.params.items() if p.required and n not in args]
        if missing:
            raise ValueError(f"missing argument(s) {missing}")
        for k, v in args.items():
            self.params[k].check(v)
        if self.validate is not None:
            self.validate(args)

    def apply(self, data, args: dict, **context):
        """Apply the operator to a batch (deterministic ops only): ``context`` values the
        operator declares (``sample_rate``) are passed to it, the rest ignored."""
        if self.random:
            raise ValueError(f"{self.name} draws random parameters; apply it through a Chain")
        kw = {**args, **{k: v for k, v in context.items() if k in self.context}}
        if self.is_class:
            return self.target(**kw).apply(data, {})
        return self.target(data, **kw)

    def signature(self, *, allow_context: bool = True) -> str:
        """``name(a, b=1, ...)`` for docs and help."""
        ps = [p.describe() for n, p in self.params.items()
              if allow_context or n not in self.context]  # fmt: skip
        return f"{self.name}({', '.join(ps)})"


_ENTRIES: dict[tuple[str, str], Op] = {}


class OperatorNotImportableError(RuntimeError):
    """An operator another process needs was registered where that process cannot import it
    (the caller's ``__main__``): register it in an importable module."""


def _types_of(hint) -> tuple | None:
    """Accepted types of an annotation: plain types and unions of them; None for the rest."""
    if hint in (int, float, bool, str):
        return (hint,)
    if hint is type(None):
        return (type(None),)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        parts = [_types_of(a) for a in typing.get_args(hint)]
        if all(p is not None for p in parts):
            return tuple(t for p in parts for t in p)
    return None


def _params_of(fn, skip: int) -> dict[str, Param]:
    """The keyword parameters of ``fn`` after its first ``skip`` ones (and ``stream``)."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - no usable annotations: no type checks
        hints = {}
    out = {}
    for p in list(inspect.signature(fn).parameters.values())[skip:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name == "stream":
            continue
        default = REQUIRED if p.default is p.empty else p.default
        out[p.name] = Param(p.name, default, _types_of(hints.get(p.name)))
    return out


def register(name=None, *, kind: str | None = None, stage: str | None = None,
             gives: str | None = None, params=(), context=(), validate=None):  # fmt: skip
    """Register an operator; a decorator of a function ``fn(data, **args) -> data`` or of an
    ``Augment`` class (``name`` defaults to the class's ``name``). ``params``: extra
    :class:`Param` entries (arguments taken through ``**kwargs``); ``context``: parameters a
    preset fills itself; ``validate(args)``: value checks beyond the types. A name already
    registered for ``kind`` by another definition is refused."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if stage not in STAGES or (gives is not None and gives not in STAGES):
        raise ValueError(f"stage and gives must be among {', '.join(STAGES)}, got "
                         f"{stage!r}, {gives!r}")

    def deco(target):
        is_class = inspect.isclass(target)
        op_name = name or getattr(target, "name", None) or target.__name__
        ps = _params_of(target.__init__ if is_class else target, 1)
        for p in params:
            ps[p.name] = p
        random = is_class and bool(getattr(target, "random", False))
        doc = inspect.getdoc(target) or ""
        entry = Op(op_name, kind, stage, gives or stage, target, ps, random, tuple(context),
                   validate, doc.split("\n\n")[0].replace("\n", " "), is_class,
                   getattr(target, "__module__", None) or "")
        old = _ENTRIES.get((kind, op_name))
        same = old is not None and all(  # the same definition again (a module reloaded)
            getattr(old.target, a, None) == getattr(target, a, None)
            for a in ("__module__", "__qualname__"))
        if old is not None and not same:
            raise ValueError(f"operator {op_name!r} ({kind}) is already registered "
                             f"({getattr(old.target, '__qualname__', old.target)!r})")
        _ENTRIES[(kind, op_name)] = entry
        return target

    return deco


def unregister(name: str, kind: str) -> None:
    """Remove an entry (a test's operator); a name not registered is ignored."""
    _ENTRIES.pop((kind, name), None)


def modules() -> list[str]:
    """The modules outside avpipe that registered operators, importable by another process
    (not ``__main__``), sorted: importing them registers the same operators there."""
    return sorted({e.module for e in _ENTRIES.values()
                   if e.module and e.module != "__main__" and e.module != "avpipe"
                   and not e.module.startswith("avpipe.")})


def kinds_of(name: str) -> list[str]:
    """The kinds ``name`` is registered for."""
    return [k for k in KINDS if (k, name) in _ENTRIES]


def get(name: str, kind: str | None = None) -> Op:
    """The entry of ``name`` (of ``kind``; needed where the name has several kinds).
    KeyError naming the known operators when there is none."""
    if kind is None:
        ks = kinds_of(name)
        if len(ks) > 1:
            raise KeyError(f"operator {name!r} is registered for {' and '.join(ks)}: give kind=")
        kind = ks[0] if ks else None
    entry = _ENTRIES.get((kind, name))
    if entry is None:
        raise KeyError(f"unknown operator {name!r}; one of {', '.join(names(kind=kind))}")
    return entry


def names(*, kind: str | None = None, stage: str | None = None,
          random: bool | None = None) -> list[str]:  # fmt: skip
    """Sorted names of the registered operators (of ``kind``, taking ``stage``, random or
    not)."""
    return sorted({e.name for e in entries(kind=kind, stage=stage, random=random)})


def entries(*, kind: str | None = None, stage: str | None = None,
            random: bool | None = None) -> list[Op]:  # fmt: skip
    """The registered :class:`Op` entries, by kind then name."""
    out = [e for (k, _), e in _ENTRIES.items()
           if (kind is None or k == kind) and (stage is None or e.stage == stage)
           and (random is None or e.random == random)]  # fmt: skip
    return sorted(out, key=lambda e: (KINDS.index(e.kind), e.name))
