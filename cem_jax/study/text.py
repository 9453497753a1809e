"""The small formatting helpers that the study report's modules share (`what_ran`, `sentences`,
`tables`): a p-value, a count of things, mean ± sd, and a Markdown table's rows and rule.
"""

from __future__ import annotations

import statistics


def p_text(value: float) -> str:
    """A p-value to 3 significant digits; "> 0.999" for one that would round to 1 without being
    1 (a Holm-adjusted p is capped at exactly 1)."""
    return "> 0.999" if 0.999 < value < 1 else f"{value:.3g}"


def count_text(n: int, thing: str) -> str:
    """"1 loss spike", "2 loss spikes"."""
    return f"{n} {thing}{'s' * (n != 1)}"


def mean_sd(values: list[float]) -> str:
    """"mean ± sd" to 4 decimals; the value alone for one, "–" for none."""
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def table_row(cells: list[str]) -> str:
    """A Markdown table's row of `cells`."""
    return "| " + " | ".join(cells) + " |"


def table_rule(head: list[str]) -> str:
    """The rule under a Markdown table's `head`."""
    return "|" + "---|" * len(head)
