"""Where :func:`loss_scaling.autocast` departs from its table: :class:`AutocastPolicy`.

A policy names equations by where they are in the user's code (the module path or
``jax.named_scope``, the source line, the primitive), never by their position in one trace,
so it holds for other batches, under ``jit`` and after the params change.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from loss_scaling.autocast.rewrite import Place
from loss_scaling.autocast.rules import RULES, Rule


class Site(NamedTuple):
    """Where equations are in the user's code; an empty field matches anything.

    Attributes:
      path: a module path or named scope (``"Transformer/block_3/mlp"``): the equations
        under it (the path itself or anything below it).
      source: ``"file.py:123"``: the equations written on that line (the file's path
        matched from its end, so a relative or shorter path is enough).
      primitive: a primitive's name (``"dot_general"``).
    """

    path: str = ""
    source: str = ""
    primitive: str = ""

    @classmethod
    def parse(cls, where: str | Site) -> Site:
        """A :class:`Site` from its string form: ``"file.py:123"`` is a source line,
        anything else a module path."""
        if isinstance(where, Site):
            return where
        if not isinstance(where, str) or not where:
            raise TypeError(BAD_SITE.format(value=repr(where)))
        file, _, line = where.rpartition(":")
        if file and line.isdigit():
            return cls(source=where)
        return cls(path=where.strip("/"))

    def matches(self, path: str, source: str | None, primitive: str) -> bool:
        """Whether an equation at ``path``, written at ``source``, is one of these."""
        if self.primitive and primitive != self.primitive:
            return False
        if self.path and not (path == self.path or path.startswith(self.path + "/")):
            return False
        if self.source:
            if source is None:
                return False
            return source == self.source or source.endswith(("/" + self.source,
                                                              "\\" + self.source))
        return True


BAD_SITE = ("a policy site must be a module path ('Model/block_0/mlp', as the report's "
            "'module path' column shows it), a source line ('model.py:42') or a "
            "loss_scaling.autocast.Site, got {value}")
BAD_RULE = ("AutocastPolicy(rules=...) maps primitive names to ls.AutocastRule values, got "
            "{key!r}: {value!r}")


@dataclasses.dataclass(frozen=True)
class AutocastPolicy:
    """Where autocast departs from its table of rules (docs/autocast.md).

    Attributes:
      float32: sites whose equations run as written, in float32: the matmuls too (what
        transformers' ``_keep_in_fp32_modules`` does by hand).
      float32_out: sites whose matmuls keep half operands but accumulate and return
        float32 (``preferred_element_type``), and whose other equations run in float32:
        the fix for a result that overflows the half dtype, at half the matmul cost of
        ``float32``.
      rules: primitive name -> :class:`~loss_scaling.autocast.rules.Rule`, replacing the
        table's rule for that primitive everywhere.

    Examples:
      >>> import loss_scaling as ls
      >>> policy = ls.AutocastPolicy(float32=("Model/head",), float32_out=("model.py:42",))
      >>> policy.float32
      (Site(path='Model/head', source='', primitive=''),)
    """

    float32: tuple[Site, ...] = ()
    float32_out: tuple[Site, ...] = ()
    rules: Mapping[str, Rule] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("float32", "float32_out"):
            value = getattr(self, name)
            if isinstance(value, str | Site):
                value = (value,)
            object.__setattr__(self, name, tuple(Site.parse(w) for w in value))
        for key, value in dict(self.rules).items():
            if not isinstance(key, str) or not isinstance(value, Rule):
                raise TypeError(BAD_RULE.format(key=key, value=value))
        object.__setattr__(self, "rules", dict(self.rules))

    def __hash__(self) -> int:
        return hash((self.float32, self.float32_out, tuple(sorted(
            (k, v.value) for k, v in self.rules.items()))))

    def decide(self, eqn: Any, place: Place, rule: Rule, matched: set[Site] | None = None
               ) -> Rule:
        """The rule for one float32 equation: the table's, unless this policy names it
        (the sites that name it are added to ``matched``)."""
        name = eqn.primitive.name
        rule = self.rules.get(name, rule)
        if rule in (Rule.CALL, Rule.LOOP, Rule.CUSTOM) or not (self.float32 or self.float32_out):
            return rule
        hits = [s for s in self.float32 if s.matches(place.path, place.source, name)]
        outs = [s for s in self.float32_out if s.matches(place.path, place.source, name)]
        if matched is not None:
            matched.update(hits, outs)
        if hits:
            return Rule.AS_WRITTEN
        if outs:
            return Rule.HALF_FLOAT32_OUT if RULES.get(name) is Rule.HALF else Rule.FLOAT32
        return rule

    def sites(self) -> tuple[Site, ...]:
        """Every site this policy names."""
        return (*self.float32, *self.float32_out)

    @property
    def is_default(self) -> bool:
        """Whether this policy changes nothing (the default program)."""
        return not (self.float32 or self.float32_out or self.rules)

    def extended(self, float32: Iterable[Site] = (), float32_out: Iterable[Site] = ()
                 ) -> AutocastPolicy:
        """This policy with more sites (each once, in order)."""
        return dataclasses.replace(
            self, float32=tuple(dict.fromkeys((*self.float32, *float32))),
            float32_out=tuple(dict.fromkeys((*self.float32_out, *float32_out))))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict (:meth:`from_dict` reads it back)."""
        return {"format": FORMAT, "version": VERSION,
                "float32": [_site_json(s) for s in self.float32],
                "float32_out": [_site_json(s) for s in self.float32_out],
                "rules": {k: v.value for k, v in sorted(self.rules.items())}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AutocastPolicy:
        """The policy :meth:`to_dict` wrote, or one written by hand: ``{"float32":
        ["Model/head", "model.py:42"], "float32_out": [{"path": ..., "source": ...,
        "primitive": ...}], "rules": {"custom_jvp_call": "as written"}}``; every key is
        optional."""
        if not isinstance(data, Mapping):
            raise TypeError(BAD_JSON.format(what=f"a {type(data).__name__}"))
        unknown = set(data) - {"format", "version", "float32", "float32_out", "rules"}
        if unknown:
            raise ValueError(BAD_JSON.format(what=f"unknown keys {sorted(unknown)}"))
        if data.get("format", FORMAT) != FORMAT or data.get("version", VERSION) != VERSION:
            raise ValueError(BAD_JSON.format(
                what=f"format {data.get('format')!r} version {data.get('version')!r}"))
        by_value = {rule.value: rule for rule in Rule}
        rules = {}
        for name, value in dict(data.get("rules", {})).items():
            if value not in by_value:
                raise ValueError(BAD_JSON.format(
                    what=f"rule {value!r} for {name!r} (one of {sorted(by_value)})"))
            rules[name] = by_value[value]
        return cls(float32=tuple(_site_from_json(x) for x in data.get("float32", ())),
                   float32_out=tuple(_site_from_json(x) for x in data.get("float32_out", ())),
                   rules=rules)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the policy to a JSON file."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AutocastPolicy:
        """Reads a policy from a JSON file (:meth:`save`'s, or written by hand)."""
        with open(path) as f:
            return cls.from_dict(json.load(f))


FORMAT, VERSION = "loss_scaling.AutocastPolicy", 1
BAD_JSON = ("an autocast policy file holds {{'float32': [...], 'float32_out': [...], "
            "'rules': {{...}}}} (format " + repr(FORMAT) + ", version " + str(VERSION)
            + "); this one has {what}")


def _site_json(site: Site) -> Any:
    fields = {k: v for k, v in site._asdict().items() if v}
    if list(fields) == ["path"] or list(fields) == ["source"]:
        return next(iter(fields.values()))  # the string form Site.parse reads
    return fields


def _site_from_json(value: Any) -> Site:
    if isinstance(value, Mapping):
        unknown = set(value) - set(Site._fields)
        if unknown:
            raise ValueError(BAD_JSON.format(what=f"a site with unknown keys {sorted(unknown)}"))
        return Site(**{k: str(v) for k, v in value.items()})
    return Site.parse(value)


def site_of(path: str, source: str | None, primitive: str) -> Site:
    """The site of one equation, its file relative to the working directory when inside
    it (a policy file then holds on another machine's checkout)."""
    if source is not None:
        file, _, line = source.rpartition(":")
        relative = os.path.relpath(file)
        if not relative.startswith(".."):
            source = f"{relative}:{line}"
    return Site(path=path, source=source or "", primitive=primitive)


DEFAULT = AutocastPolicy()
