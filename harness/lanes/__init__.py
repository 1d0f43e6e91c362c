"""Regression lanes: check (git bisect run exit codes) and bisect over package releases."""
