"""The campaign's live progress bar (tqdm): examples, cells covered, findings known and new.

Against the time budget when there is one, else against the example budget. On a terminal it
redraws in place; in a CI log it writes a line every 30 seconds."""

from __future__ import annotations

import sys

from harness.campaign.explore import Budget, Campaign


class ProgressBar:
    def __init__(self, budget: Budget, cells: int, stream=sys.stderr):
        from tqdm import tqdm

        self.budget, self.cells = budget, cells
        by_time = budget.seconds is not None
        self.bar = tqdm(
            total=int(budget.seconds) if by_time else budget.max_examples,
            unit="s" if by_time else "example",
            file=stream,
            mininterval=0.5 if stream.isatty() else 30.0,
            dynamic_ncols=True,
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}] {postfix}",
        )
        self.by_time = by_time

    def __call__(self, campaign: Campaign) -> None:
        known = sum(count for signature, count in campaign.counts.items() if signature not in campaign.minimal)
        self.bar.set_postfix_str(
            f"{campaign.examples} examples, cells {campaign.cells_reached()}/{self.cells}, "
            f"findings {known} known / {len(campaign.minimal)} new signature(s)",
            refresh=False,
        )
        position = min(int(self.budget.elapsed()), self.bar.total or 0) if self.by_time else campaign.examples
        self.bar.update(position - self.bar.n)

    def close(self) -> None:
        self.bar.close()
