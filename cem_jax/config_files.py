"""Reading configs: YAML files with `base:` chains, `section.key=value` overrides, dataclasses
built from dicts with every field checked, and a config's `imports`.

The YAML file of an experiment has sections (`model:`, `data:`, `optimizer:`, ...); `load_yaml`
reads it (with the chain of files it names as `base:`, whose values it overrides section by
section), `apply_overrides` applies `section.key=value` strings (a value is read as its field's
type: `steps=2`, `tie_mlp=false`, `dtype=bfloat16`, `dir=runs/exp #2` as written), and
`from_dict` builds a dataclass, rejecting unknown keys. Every check raises `ValueError` naming
the field, the value and what is allowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def check_field_types(obj: Any) -> None:
    """Check every field of dataclass `obj` against its annotation (`int`, `float`, `bool`,
    `str`, optionally `| None`); bools are not accepted as numbers, nor are inf and nan.
    Raises `ConfigFieldError`."""
    for f in dataclasses.fields(obj):
        value, kinds = getattr(obj, f.name), str(f.type).replace(" ", "").split("|")
        if value is None and "None" in kinds:
            continue
        allowed = tuple(t for k in kinds if k != "None" for t in _TYPES.get(k, (object,)))
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        require(ok, f.name, value, f"of type {f.type}")
        require(not isinstance(value, float) or math.isfinite(value), f.name, value,
                "a finite number")


class ConfigFieldError(ValueError):
    """A config field out of range; `field` names it (`from_dict` prefixes its section)."""

    def __init__(self, field: str, value: Any, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"config field {field!r} = {value!r} is invalid: it must be {allowed}")


class UnknownFieldError(ValueError):
    """A key that is not a field of its section; `field` names it (`section.key`)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


def require(ok: bool, field: str, value: Any, allowed: str) -> None:
    """Raise `ConfigFieldError` unless `ok`."""
    if not ok:
        raise ConfigFieldError(field, value, allowed)


def did_you_mean(name: Any, known: Sequence[str]) -> str:
    """"; did you mean 'x'?" naming the one of `known` closest to `name` (a misspelling,
    `difflib.get_close_matches`), or "" when none is close."""
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def from_dict(cls: type[T], values: dict[str, Any], *, section: str = "") -> T:
    """Build dataclass `cls` from a mapping; unknown keys raise `ValueError` with a suggestion
    (a close field name, or for a value `cls` computes, its `SET_THROUGH` entry: the fields
    that set it)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    where = f" in section {section!r}" if section else ""
    if not isinstance(values, dict):
        raise ValueError(f"config section {section or cls.__name__!r} must be a mapping of "
                         f"field: value, not {values!r}")
    for key in values:
        if key not in fields:
            derived = getattr(cls, "SET_THROUGH", {}).get(key)
            hint = (f": it is computed; set {derived} instead" if derived
                    else did_you_mean(key, sorted(fields)))
            raise UnknownFieldError(f"{section}.{key}" if section else key,
                                    f"unknown config field {key!r}{where}{hint} "
                                    f"(known: {', '.join(sorted(fields))})")
    floats = {f.name for f in dataclasses.fields(cls) if str(f.type).startswith("float")}
    values = {k: _as_float(v) if k in floats else v for k, v in values.items()}
    try:
        return cls(**values)
    except ConfigFieldError as err:  # name the field as an override would: section.field
        if not section:
            raise
        raise ConfigFieldError(f"{section}.{err.field}", err.value, err.allowed) from None


def _as_float(value: Any) -> Any:
    """YAML 1.1 reads `3e-4` as a string; accept it (and ints) for float fields."""
    try:
        return float(value) if isinstance(value, str | int) and not isinstance(value, bool) \
            else value
    except ValueError:
        return value


BASE_KEY = "base"  # top-level key of a config file naming the file it inherits from


def check_module_names(names: Any) -> Sequence[str]:
    """`names` if it is a list (or tuple) of module names, as a config's `imports` takes them;
    ValueError otherwise."""
    ok = isinstance(names, (list, tuple)) and all(
        isinstance(n, str) and n and all(part.isidentifier() for part in n.split("."))
        for n in names)
    require(ok, "imports", names, "a list of module names, e.g. [my_energies]")
    return names


def import_modules(names: Sequence[str]) -> None:
    """Import each module of `names` (a config's `imports`: user code that registers what the
    config names, e.g. `cem_jax.energies.register_activation`); a module already imported is
    not imported again. Raises ValueError naming a module that cannot be found, or whose code
    raised while it was imported, and why (one line: `python -c "import NAME"` shows the
    module's own traceback)."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ValueError(f"imports: module {name!r} cannot be imported ({err}); install it "
                             f"or put its folder on PYTHONPATH") from None
        except Exception as err:  # the user's code: one line, and how to see the rest
            raise ValueError(f"imports: module {name!r} raised {type(err).__name__} when "
                             f"imported: {err} (python -c 'import {name}' shows where)") from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a nested dict, its chain of `base:` files resolved.

    A file may name `base: OTHER.yaml` (a path relative to the file itself); its values then
    override the base's section by section: a mapping merges key by key into the base's
    mapping (an empty section changes nothing), any other value replaces the base's. A base may
    name its own base. Raises `FileNotFoundError` (no such file; a missing base names both
    files) or `ValueError` (not UTF-8 YAML holding a mapping, a `base:` that is not a path, a
    cycle of bases).
    """
    return _resolve_bases(Path(path), ())


def _resolve_bases(path: Path, named_by: tuple[Path, ...]) -> dict[str, Any]:
    """`path`'s values over those of its bases; `named_by`: the files that led to it."""
    values = _read_yaml(path)
    if BASE_KEY not in values:
        return values
    base = values.pop(BASE_KEY)
    if not isinstance(base, str) or not base.strip():
        raise ValueError(f"config file {str(path)!r}: base must be the path of a YAML file "
                         f"(relative to this file), not {base!r}")
    base_path, chain = path.parent / base, (*named_by, path)
    if base_path.resolve() in {p.resolve() for p in chain}:
        cycle = " -> ".join(str(p) for p in (*chain, base_path))
        raise ValueError(f"config file {str(path)!r} names base {base!r}, which leads back to "
                         f"itself ({cycle}); remove one of these base: lines")
    if not base_path.is_file():
        what = "is a directory" if base_path.is_dir() else "does not exist"
        raise FileNotFoundError(f"config file {str(path)!r} names base {base!r}, but "
                                f"{str(base_path)!r} {what} (a base is a path relative to "
                                f"the file that names it)")
    return _merge(_resolve_bases(base_path, chain), values)


@contextlib.contextmanager
def naming_the_file(path: str | Path | None, overrides: Sequence[str] = ()) -> Iterator[None]:
    """Within it, an unknown or invalid field (or section) read from YAML file `path` raises
    `ValueError` naming the file of `path`'s `base:` chain that sets it, and the chain that
    leads there (`config file 'b.yaml' (the base of 'a.yaml'): unknown config field ...`); a
    field an override sets, or none of the files, is left as it is."""
    try:
        yield
    except (ConfigFieldError, UnknownFieldError) as err:
        chain = None if path is None else _files_to_setting(Path(path), err.field, overrides)
        if chain is None:
            raise
        via = "".join(f", the base of {str(f)!r}" for f in reversed(chain[:-1]))
        raise ValueError(f"config file {str(chain[-1])!r}{f' ({via[2:]})' if via else ''}: "
                         f"{err}") from None


def _files_to_setting(path: Path, field: str, overrides: Sequence[str]) -> list[Path] | None:
    """The files of `path`'s (valid) base chain from `path` to the one whose value of `field`
    (`section.key`, or a top-level `section`) `load_yaml` keeps, or None when an override or
    no file sets it."""
    section, _, key = field.partition(".")
    if any(o.partition("=")[0] == field for o in overrides):
        return None
    chain: list[Path] = []
    while path is not None:
        chain.append(path)
        values = _read_yaml(path)
        if (section in values) if not key else (
                isinstance(values.get(section), dict) and key in values[section]):
            return chain
        path = path.parent / values[BASE_KEY] if BASE_KEY in values else None
    return None


def _merge(base: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """`values` over `base`: mappings merge key by key, any other value replaces."""
    out = dict(base)
    for key, value in values.items():
        if isinstance(out.get(key), dict) and (value is None or isinstance(value, dict)):
            value = _merge(out[key], value or {})
        out[key] = value
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    """One YAML file as a dict; raises `FileNotFoundError`/`ValueError` naming the file."""
    if path.is_dir():
        raise ValueError(f"config file {str(path)!r} is a directory; give a YAML file in it")
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ValueError(f"config file {str(path)!r} is not UTF-8 text: {err}") from err
    except yaml.YAMLError as err:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {err}") from err
    if not isinstance(values, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping at the top level")
    return values


def apply_overrides(values: dict[str, Any], overrides: list[str],
                    sections: Mapping[str, type] | None = None) -> dict[str, Any]:
    """Return a copy of nested `values` with `section.key=value` overrides applied.

    A value is read as the type of the field it sets, when `sections` ({section name:
    dataclass}) names that field: a `str` field gets the text after the first `=` exactly as
    written (`run.dir=runs/exp #2`, `sample_prompt=Thou art #1`), and a nullable one (`str |
    None`) also takes `null` or `~` (or nothing) for None. Any other value is parsed as a YAML
    scalar (`2` → int, `false` → bool, `null` → None) or a flow list of them (`[a, b]`, for
    the top-level `imports`); a value that YAML reads as anything else
    (`KING:` a mapping, `2024-01-01` a date, `*.txt` an alias, `[x` an error) is kept as the
    string given. Raises `ValueError` for a string without `=` or a path through a non-mapping.
    """
    out = yaml.safe_load(yaml.safe_dump(values))  # deep copy of plain data
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like section.key=value")
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part!r} is not a section")
        cls = (sections or {}).get(parents[0]) if len(parents) == 1 else None
        node[leaf] = _typed_value(raw, _field_type(cls, leaf))
    return out


def _field_type(cls: type | None, name: str) -> str | None:
    """The annotation of field `name` of dataclass `cls` as written ("str | None"), or None."""
    types = {f.name: str(f.type).replace(" ", "") for f in dataclasses.fields(cls)} if cls \
        else {}
    return types.get(name)


def _typed_value(raw: str, annotation: str | None) -> Any:
    """`raw` as a value of a field annotated `annotation` (see `apply_overrides`)."""
    if annotation == "str":
        return raw
    if annotation == "str|None":
        return None if raw.strip() in ("", "null", "Null", "NULL", "~") else raw
    return _scalar(raw)


def _scalar(raw: str) -> Any:
    """`raw` as a YAML scalar (str, int, float, bool or None) or a flow list of them
    (`imports=[my_energies]`), else the string itself."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    scalar = str | int | float | bool
    if isinstance(value, list) and all(isinstance(v, scalar) for v in value):
        return value
    return value if value is None or isinstance(value, scalar) else raw


def load_section(cls: type[T], section: str, path: str | Path | None = None,
                 overrides: Sequence[str] = ()) -> T:
    """Section `section` of YAML file `path` (its bases resolved; None: all defaults) as
    dataclass `cls`, with overrides given as `section.key=value` (as `cem-train` takes them)
    or plain `key=value`. Raises `ValueError` for an override of another section (only this
    one is read), and as `load_yaml`, `apply_overrides` and `from_dict` do."""
    overrides = [o if "." in o.partition("=")[0] else f"{section}.{o}" for o in overrides]
    for item in overrides:
        if item.partition("=")[0].split(".")[0] != section:
            raise ValueError(f"override {item!r} is not in section {section!r}, the only "
                             f"one read here")
    values = apply_overrides(load_yaml(path) if path is not None else {}, overrides,
                             {section: cls})
    with naming_the_file(path, overrides):
        return from_dict(cls, values.get(section) or {}, section=section)
