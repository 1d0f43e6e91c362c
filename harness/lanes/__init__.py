"""Lanes: check (git bisect run exit codes), bisect over package releases, and upstream reproducers."""
