"""Findings of the convention checker and how they are shown.

A finding names the check, a level, what differs and the setting that fixes it:

- ``error``: the dataset and the env disagree in a way that silently ruins training or evaluation
  (a flipped quaternion, an inverted gripper, upside-down images, another control rate);
- ``warn``: they differ in a way a setting handles (a [0, 1] gripper convention), or something looks
  suspicious; the fix names the setting;
- ``ok`` / ``info``: agreement, or facts worth seeing (replay success rate, inconclusive checks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

LEVELS = ("ok", "info", "warn", "error")


@dataclass(frozen=True)
class Finding:
    check: str  # fps, action, gripper, state, image, render, cameras, replay
    level: str
    message: str  # what agrees or differs, with the numbers
    fix: str = ""  # the setting or change that makes them agree

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"finding level {self.level!r} is not one of {LEVELS}")


@dataclass
class Report:
    dataset: str
    suite: str
    probed: str  # which env episodes the dataset was compared with
    findings: list[Finding] = field(default_factory=list)

    def add(self, check: str, level: str, message: str, fix: str = "") -> None:
        self.findings.append(Finding(check, level, message, fix))

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def clean(self) -> bool:
        """No error and no warning."""
        return not any(f.level in ("error", "warn") for f in self.findings)

    def of(self, check: str) -> list[Finding]:
        return [f for f in self.findings if f.check == check]

    def to_dict(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "suite": self.suite,
            "probed": self.probed,
            "clean": self.clean,
            "findings": [asdict(f) for f in self.findings],
        }

    def text(self) -> str:
        errors, warns = len(self.errors), sum(f.level == "warn" for f in self.findings)
        verdict = "agree" if self.clean else f"{errors} error(s), {warns} warning(s)"
        lines = [f"{self.dataset} against {self.suite} ({self.probed}): {verdict}"]
        for f in self.findings:
            lines.append(f"  {f.level.upper():5s} {f.check}: {f.message}")
            if f.fix:
                lines.append(f"        fix: {f.fix}")
        return "\n".join(lines) + "\n"
