"""Differential judgement: the runner that loads one checkpoint in every engine, the comparisons, known issues, reports and heatmaps."""
