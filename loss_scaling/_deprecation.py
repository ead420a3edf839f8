"""Renamed public names: each old name still answers, with a ``DeprecationWarning`` that
names the new one. Every rename is one :class:`Renamed` entry in :data:`RENAMES`."""

from __future__ import annotations

import warnings
from typing import NamedTuple

RENAMED = (
    "{owner}.{old} is deprecated (renamed in {since}): use {new_path}, which it returns. "
    "The old name will be removed in a later release."
)


class Renamed(NamedTuple):
    """One renamed public name.

    Attributes:
      owner: where the name lives: a class name (``"LossScalingState"``: the class keeps
        a property under the old name), or ``"loss_scaling"`` for a name of the package
        (the package's ``__getattr__`` answers it).
      old: the name before.
      new: the name now: in ``owner``, or a name of optax outside the package
        (``"optax.GradientTransformationExtraArgs"``: the package answers it from optax,
        which it imports by name).
      since: the change that renamed it.
    """

    owner: str
    old: str
    new: str
    since: str

    @property
    def new_path(self) -> str:
        """Where the new name lives: ``owner.new``, or ``new`` itself when dotted."""
        return self.new if "." in self.new else f"{self.owner}.{self.new}"

    def warn(self, stacklevel: int = 3) -> None:
        """The ``DeprecationWarning``, pointed at the caller of the old name's accessor."""
        warnings.warn(RENAMED.format(**self._asdict(), new_path=self.new_path),
                      DeprecationWarning, stacklevel=stacklevel)


LAST_STEP_FINITE = Renamed("LossScalingState", "last_step_finite", "last_step_applied",
                           since="issue 34")
"""A field of the state until 250089d, whose checkpoints restore today."""

LOSS_SCALING_TRANSFORMATION = Renamed(
    "loss_scaling", "LossScalingTransformation", "optax.GradientTransformationExtraArgs",
    since="issue 41")
"""The class ``with_loss_scaling`` returned, an optax transformation that also carried its
options (``tx.options``): it returns the optax class itself now, its options on
``tx.update`` only."""

RENAMES: tuple[Renamed, ...] = (LAST_STEP_FINITE, LOSS_SCALING_TRANSFORMATION)
"""Every public name renamed since checkpoints were first treated as released (250089d)."""


def package_alias(name: str) -> Renamed | None:
    """The entry for an old name of the package itself (``loss_scaling.<name>``), if any."""
    return next((r for r in RENAMES if r.owner == "loss_scaling" and r.old == name), None)
