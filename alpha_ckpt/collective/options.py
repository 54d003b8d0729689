"""The options of one :class:`~alpha_ckpt.Checkpointer`: every option of :mod:`alpha_ckpt.runtime.options`.

``Checkpointer(store, run=..., **options)`` builds a :class:`CheckpointerOptions` from its keyword
arguments; ``Checkpointer(options=...)`` takes one as it is; ``Checkpointer.from_launcher_env(**overrides)``
fills one from alpha-run's hand-off (:func:`alpha_ckpt.runtime.launch_env.launcher_settings`), the
arguments given overriding it. Each option is spelled once, in :data:`alpha_ckpt.runtime.options.OPTIONS`
(name, default, meaning, rule, alpha-run's flag); this class adds only what needs the layers above the
options' core (the placement rules, the schedule). A value that cannot be is a
:class:`~alpha_ckpt.UsageError` here (exit 2 under alpha-run), never a checkpoint's refusal later.
"""
from __future__ import annotations

from typing import Any

from alpha_ckpt.errors import Refusal, UsageError
from alpha_ckpt.runtime import options as options_core
from alpha_ckpt.state.rules import PlacementRules
from alpha_ckpt.collective.schedule import Schedule


class CheckpointerOptions:
    """The options of one Checkpointer (one run/step of one store), checked once, read-only: one attribute
    per option of :data:`alpha_ckpt.runtime.options.OPTIONS` (``help(alpha_ckpt.runtime.options)`` says what
    each means)."""

    __slots__ = ("_values",)

    def __init__(self, **given: Any):
        if given.get("store") is None or given.get("run") is None:
            raise UsageError("Checkpointer needs store= and run= (or Checkpointer.from_launcher_env() under "
                             "alpha-run)")
        try:
            values = options_core.check(given)
        except UsageError as exc:
            raise UsageError(f"Checkpointer: {exc}") from None
        object.__setattr__(self, "_values", values)
        try:
            self.rules()
            self.schedule()
        except (Refusal, ValueError, TypeError) as exc:
            raise UsageError(f"Checkpointer: {exc}") from None

    def __getattr__(self, name: str) -> Any:
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            raise AttributeError(f"CheckpointerOptions has no option {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("CheckpointerOptions are read-only: use replace(...)")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CheckpointerOptions) and self._values == other._values

    __hash__ = None  # type: ignore[assignment]  # values such as metadata are dicts

    def __repr__(self) -> str:
        given = {k: v for k, v in self._values.items() if v != options_core.by_name()[k].default}
        return f"CheckpointerOptions({', '.join(f'{k}={v!r}' for k, v in given.items())})"

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def replace(self, **changes: Any) -> "CheckpointerOptions":
        """These options with ``changes`` (checked again)."""
        return CheckpointerOptions(**{**self._values, **changes})

    def rules(self) -> PlacementRules:
        return PlacementRules.of(self.per_rank, self.from_rank0)

    def schedule(self) -> Schedule:
        return Schedule(self.every, self.mtbf, self.checkpoint_cost, memory=self.memory is not None,
                        durable_every=self.durable_every, mtbf_durable=self.mtbf_durable)
