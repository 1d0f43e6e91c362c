"""Exploration: Hypothesis strategies and profiles, the campaign, replay of recorded recipes, the oracle's sweep."""
