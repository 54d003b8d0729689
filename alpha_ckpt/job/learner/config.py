"""Job configuration: a TOML file plus `--set KEY=VALUE` overrides."""
from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass

from alpha_ckpt.errors import Refusal
from alpha_ckpt.format.records import check_name


# replicated: every owner holds and updates everything (one copy is checkpointed);
# partitioned: each owner owns a contiguous word range of every parameter and
#   optimizer-state region, ZeRO style (parameters all-gathered after each update);
# optimizer: only the optimizer state is partitioned (ZeRO stage 1); the
#   parameters are updated by range, all-gathered and checkpointed replicated.
PARAMETER_MODES = ("replicated", "partitioned", "optimizer")


@dataclass(frozen=True)
class JobConfig:
    run: str = "nightly"
    step: str = "fit"
    seed: int = 20261129
    stores: int = 12
    items: int = 40
    history_days: int = 90
    horizon_days: int = 7
    hidden: int = 32
    batch: int = 96
    optimizer: str = "adam"
    parameters: str = "replicated"  # see PARAMETER_MODES
    lr: float = 0.01
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    bind_placement: bool = False  # refuse a resume on other devices (UUIDs), not only another product
    # A frozen table [embedding_rows, history_days] (say, pretrained per-series profiles)
    # added to each sample's history: row = sample index % rows. Never trained, always
    # checkpointed, so later generations carry its shard instead of writing it. 0: none.
    embedding_rows: int = 0

    def __post_init__(self) -> None:
        if self.optimizer not in ("sgd", "momentum", "adam"):
            raise ValueError(f"optimizer must be sgd, momentum or adam, not {self.optimizer!r}")
        if self.parameters not in PARAMETER_MODES:
            raise ValueError(f"parameters must be one of {', '.join(PARAMETER_MODES)}, not {self.parameters!r}")
        for name in ("run", "step"):  # they name store directories: refused at the first publish otherwise
            try:
                check_name(getattr(self, name), name)
            except Refusal as refusal:
                raise ValueError(refusal.message) from None
        for name in ("stores", "items", "history_days", "horizon_days", "hidden", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.embedding_rows < 0:
            raise ValueError(f"embedding_rows must not be negative, not {self.embedding_rows}")
        if not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"seed must be in [0, 2**63), not {self.seed}")
        # A non-finite rate never reaches a checkpoint: its manifest (canonical JSON) cannot hold it.
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, not {self.lr}")
        for name in ("momentum", "beta1", "beta2"):  # decay rates, as torch's SGD and Adam require
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), not {getattr(self, name)}")
        # Adam divides by sqrt(v) + eps, and v is 0 where a gradient was always 0 (a dead unit): 0/0.
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"eps must be a positive finite number, not {self.eps}")

    @property
    def samples(self) -> int:
        return self.stores * self.items

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


_FIELDS = frozenset(f.name for f in dataclasses.fields(JobConfig))


def _coerce(name: str, text: str, default):
    kind = type(default)
    try:
        if kind is bool:
            return {"true": True, "false": False}[text.lower()]
        return kind(text)
    except (KeyError, ValueError):
        raise ValueError(f"--set {name}={text}: expected a {kind.__name__}") from None


def load_config(path: str | None, overrides: list[str] = ()) -> JobConfig:
    """Read ``path`` (TOML), then apply ``KEY=VALUE`` overrides; unknown keys are errors."""
    defaults = JobConfig()
    values = {}
    if path:
        with open(path, "rb") as f:
            values.update(tomllib.load(f))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        if key not in _FIELDS:  # not hasattr: methods and properties are no config keys
            raise ValueError(f"--set {key}: unknown key")
        values[key] = _coerce(key, text, getattr(defaults, key))
    unknown = sorted(set(values) - _FIELDS)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}")
    for key, value in values.items():
        default = getattr(defaults, key)
        if isinstance(default, float) and isinstance(value, int):
            values[key] = float(value)
        elif type(value) is not type(default):
            raise ValueError(f"{key}: expected a {type(default).__name__}, got {value!r}")
    return JobConfig(**values)
