"""The answer a policy gives: a verdict, the reason, the rule, and the command that changes it."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .rules import Rule


class Decision(NamedTuple):
    """The answer to one question put to a policy. (A NamedTuple: one is built per request,
    and a frozen dataclass costs several times more to construct.)"""

    allowed: bool
    reason: str
    """Why, in words a person reads in `corral monitor` and in a 403 body."""
    rule: Rule | None = None
    """The rule that decided it (allow or deny); None for the default deny."""
    hint: str = ""
    """The command that would change this decision, for denials."""

    @property
    def verdict(self) -> str:
        return "allow" if self.allowed else "deny"
