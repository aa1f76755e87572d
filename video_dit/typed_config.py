"""Typed configuration from plain dicts (YAML): dataclasses in, clear errors out.

`parse(cls, data, path)` builds dataclass `cls` from `data`, checking every key and type; an unknown
key is an error with the nearest valid name, a wrong type names the key path and what is accepted.
Nested dataclasses, `list[...]`, `tuple[...]`, `Literal[...]`, `Optional[...]` and `dict` are handled.
ai-toolkit's configs read keys with `kwargs.get` and silently accept typos; ours do not.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints


class ConfigError(ValueError):
    """A bad config value; `str(err)` starts with the key path (e.g. `config.process[0].train.lr`)."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}")


# Names other trainers (diffusers, kohya, OneTrainer, HF) give keys we spell otherwise: difflib's
# spelling distance cannot find them (`learning_rate` is far from `lr`).
OTHER_NAMES = {
    "learning_rate": "lr", "max_train_steps": "steps", "train_steps": "steps", "num_train_steps": "steps",
    "max_steps": "steps", "train_batch_size": "batch_size", "micro_batch_size": "batch_size",
    "gradient_accumulation_step": "gradient_accumulation", "grad_accum": "gradient_accumulation",
    "lr_warmup_steps": "warmup_steps", "warmup": "warmup_steps", "lr_schedule": "lr_scheduler",
    "mixed_precision": "dtype", "precision": "dtype", "clip_grad_norm": "max_grad_norm",
    "rank": "linear", "lora_rank": "linear", "network_dim": "linear", "alpha": "linear_alpha",
    "lora_alpha": "linear_alpha", "network_alpha": "linear_alpha", "frames": "num_frames",
    "caption_extension": "caption_ext", "data_dir": "folder_path", "path": "folder_path",
    "output_dir": "training_folder", "pretrained_model_name_or_path": "name_or_path", "model_path": "name_or_path",
}


def did_you_mean(name: str, valid) -> str:
    valid = list(valid)
    other = OTHER_NAMES.get(name.lower())
    if other in valid:
        return f" (did you mean {other!r}?)"
    close = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse(cls, data: Any, path: str):
    """Build dataclass `cls` from mapping `data`; `path` names where `data` sits in the file."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a mapping of {cls.__name__} keys, got {type(data).__name__}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"{path}.{key}", f"unknown key{did_you_mean(str(key), fields)}; "
                                               f"valid keys: {', '.join(fields)}")
        kwargs[key] = convert(hints[key], value, f"{path}.{key}")
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{path}.{missing[0]}", "required key is missing")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate(path)
    return obj


def _type_name(tp) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(_type_name(a) for a in get_args(tp))}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def convert(tp, value: Any, path: str):
    """`value` checked (and, for ints given to float fields, widened) against type `tp`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own error is the useful one
            return convert(options[0], value, path)
        errors = []
        for arg in options:
            try:
                return convert(arg, value, path)
            except ConfigError as exc:
                errors.append(exc)
        deepest = max(errors, key=lambda e: len(e.path))
        if deepest.path != path:  # the value matched a structured option but failed inside it
            raise deepest
        raise ConfigError(path, f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(path, f"{value!r} is not accepted; accepted: {_type_name(tp)}"
                                f"{did_you_mean(str(value), [str(a) for a in get_args(tp)])}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(path, f"expected null, got {value!r}")
    if dataclasses.is_dataclass(tp):
        return parse(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list ({_type_name(tp)}), got {value!r}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(path, f"expected {len(args)} items ({_type_name(tp)}), got {len(value)}")
            return tuple(convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        out = [convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected true or false, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-4` as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(path, f"expected a number, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected an integer, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(path, f"expected a string, got {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(path, f"expected {_type_name(tp)}, got {value!r}")


