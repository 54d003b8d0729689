"""Which optimizer class saved an optimizer's state, told from what its ``state_dict()`` recorded.

A fresh optimizer has no per-parameter state until its first step, so a restore cannot compare
the destination's state with the saved one; torch's ``load_state_dict`` accepts another class's
state and fails later (SGD's momentum buffers into AdamW: ``KeyError: 'step'`` inside the load,
after the tensors were copied; AdamW's into SGD: at the first ``step()``). What tells the classes
apart is every param group's hyperparameters: each class puts all of its ``defaults`` in every
group (SGD ``momentum``, ``dampening``, ``nesterov``; AdamW ``betas``, ``eps``, ``amsgrad``), and a
class may fix one that its constructor does not take (AdamW's ``decoupled_weight_decay=True``,
which is all that tells its state from Adam's).

The class is not written into the generation: the root manifest of the same state must keep its
digest (docs/FORMAT.md, Compatibility), and the saved groups already say it. A generation is
named as saved by one of torch.optim's classes when its hyperparameters are exactly that class's;
a restore is refused when the saved groups hold a hyperparameter the destination's class does not
have, hold another value for one the destination's class fixes, or were saved by a torch.optim
class that the destination's class is not (nor derives from).
"""
from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch


@dataclass(frozen=True)
class Hyperparameters:
    """An optimizer class's hyperparameter names, and those its class fixes (not constructor arguments)."""

    cls: type
    keys: frozenset
    fixed: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, optimizer_class: type, defaults: Mapping[str, Any]) -> "Hyperparameters":
        try:
            taken = inspect.signature(optimizer_class.__init__).parameters
        except (TypeError, ValueError):
            taken = {}
        open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values())
        fixed = () if open_ended else tuple((k, v) for k, v in defaults.items() if k not in taken)
        return cls(optimizer_class, frozenset(defaults), fixed)

    def fixed_differ(self, groups: Sequence[Mapping]) -> list[str]:
        """The fixed hyperparameters a saved group holds with another value."""
        return sorted({f"{k}={g[k]!r}" for k, v in self.fixed for g in groups if k in g and not _same(g[k], v)})


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a tensor-valued hyperparameter: not a fixed flag
        return False


@functools.lru_cache(maxsize=1)
def torch_optimizers() -> tuple[Hyperparameters, ...]:
    """torch.optim's own classes, each with its hyperparameters (found by building one on a dummy parameter)."""
    out = []
    for name in getattr(torch.optim, "__all__", ()):
        cls = getattr(torch.optim, name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                probe = cls([torch.nn.Parameter(torch.zeros(2, 2))])
        except Exception:  # noqa: BLE001 - a class that needs arguments cannot be told apart; it is left out
            continue
        out.append(Hyperparameters.of(cls, probe.defaults))
    return tuple(out)


def _known_keys() -> frozenset:
    return frozenset().union(*(h.keys for h in torch_optimizers()))


def saved_by(groups: Sequence[Mapping]) -> type | None:
    """The torch.optim class whose hyperparameters are exactly the saved groups' (fixed ones included),
    or None (another class's, or a torch version's with other hyperparameters)."""
    known = _saved_keys(groups) & _known_keys()
    fits = [h for h in torch_optimizers() if h.keys == known and not h.fixed_differ(groups)]
    if not fits:
        return None
    return max(fits, key=lambda h: len(h.fixed)).cls  # AdamW over Adam: its fixed flag is what tells them apart


def _saved_keys(groups: Sequence[Mapping]) -> frozenset:
    keys = [frozenset(g) - {"params"} for g in groups]
    return frozenset.intersection(*keys) if keys else frozenset()


def class_change(optimizer: torch.optim.Optimizer, groups: Any, allowed: Sequence[tuple[str, str]] = ()) -> str | None:
    """Why the saved param ``groups`` are not ``optimizer``'s class's (naming both classes), or None.

    ``allowed``: (saved class, destination class) names a restore may change between when the
    hyperparameters are the same (Adam's state into AdamW: torch's AdamW makes it decoupled again).
    """
    if not isinstance(groups, list) or not groups or not all(isinstance(g, Mapping) for g in groups):
        return None  # torch's own shape check (check_param_groups) names what is wrong
    destination = type(optimizer)
    mine = Hyperparameters.of(destination, optimizer.defaults)
    other = saved_by(groups)
    if other is destination:
        return None
    foreign = sorted((_saved_keys(groups) & _known_keys()) - mine.keys)
    fixed = mine.fixed_differ(groups)
    changed = other is not None and not issubclass(destination, other)
    if not (foreign or fixed or changed):
        return None
    pair = (other.__name__ if other is not None else None, destination.__name__)
    if pair in set(allowed) and not foreign:
        return None
    why = (f"its param_groups hold {', '.join(foreign)}, which {destination.__name__} has not" if foreign else
           f"its param_groups hold {', '.join(fixed)}" if fixed else "its state is another class's")
    if pair in set(allowed):  # the hyperparameters differ: torch's load would take the state and fail later
        why += "; allow_optimizer_change allows only a change between classes of the same hyperparameters"
    return f"saved by {pair[0] or 'another optimizer class'}, destination {destination.__name__}: {why}"


